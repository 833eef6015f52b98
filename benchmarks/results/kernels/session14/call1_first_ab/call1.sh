#!/usr/bin/env bash
# Session 14, call 1: build mamba-ssm (sm_90) while the GPU tests of the changed Mamba-1 kernels run,
# then an interleaved A/B against HEAD's tree (scratch/old) with mamba-ssm in the new tree's processes.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/device.txt"
(bash benchmarks/build_peers.sh > "$OUT/build_peers.log" 2>&1) &
timeout 300 python3 -m pytest tests/test_kernel_selective_scan.py -q -p no:logging -p no:cacheprovider > "$OUT/tests_selective_scan.log" 2>&1
tail -3 "$OUT/tests_selective_scan.log"
wait
tail -3 "$OUT/build_peers.log"
(cd /tmp && tar cf - peers | xz -1 > "$OUT/peers.tar.xz"); ls -la "$OUT/peers.tar.xz"
for r in 1 2 3; do
  PYTHONPATH=scratch/old:benchmarks:/tmp/peers timeout 150 python3 scratch/ab_scan.py old 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
  PYTHONPATH=$PWD:benchmarks:/tmp/peers timeout 150 python3 scratch/ab_scan.py new --peer 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
done
grep -v -i warn "$OUT/ab.err" | tail -5
