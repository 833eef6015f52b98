#!/usr/bin/env bash
# Session 13, call 1: GPU tests of the split-row paths (fixup join included), then the scan
# benchmark beside the peer with both segment joins on every split row.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
(cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp) &
PYTHONPATH=$PWD timeout 200 python3 -m pytest tests/test_kernel_selective_scan.py -k "segments or fixup or default_config or skip_dead or packed" \
  -q -p no:logging -p no:cacheprovider > "$OUT/tests_split.log" 2>&1
tail -3 "$OUT/tests_split.log"
wait
PYTHONPATH=$PWD:/tmp/peers timeout 330 python3 benchmarks/bench_selective_scan.py --graphs --sweep-join \
  --out "$OUT/bench_selective_scan.json" 2>&1 | grep -v -i "warn\|falling back" > "$OUT/bench_selective_scan.log"
tail -40 "$OUT/bench_selective_scan.log"
