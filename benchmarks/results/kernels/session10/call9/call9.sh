#!/usr/bin/env bash
# Session 10, call 9: slot-major cs/dt rows (every chunk's row aligned, packed rows too): the
# SSD bench beside the peer, then the SSD, packing and kernel-swap GPU tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
export PYTHONPATH=$PWD:/tmp/peers
timeout 300 python3 benchmarks/bench_ssd_scan.py --profile --out $R/bench_ssd_scan.json 2>&1 | grep -v -i "warn\|falling back" > $R/bench_ssd_scan.log
tail -9 $R/bench_ssd_scan.log | cut -c1-200
export PYTHONPATH=$PWD
for f in kernel_ssd_scan packing swap_kernels; do
  timeout 240 python3 -m pytest tests/test_$f.py -rA -p no:logging -p no:cacheprovider > $R/tests_$f.log 2>&1 &
done
wait
for f in kernel_ssd_scan packing swap_kernels; do echo "$f: $(grep -c PASSED $R/tests_$f.log) passed, $(grep -c FAILED $R/tests_$f.log) failed"; done
tar cf $OUT/results.tar -C $OUT r && rm -rf $R
