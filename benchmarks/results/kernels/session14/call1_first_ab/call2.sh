#!/usr/bin/env bash
# Session 14, call 2: GPU tests of the changed Mamba-1 kernels (scan, packing on the kernels, kernel swap),
# then an interleaved A/B against HEAD's tree (scratch/old: its own ssmshard and bench module).
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ ! -f /tmp/peers_built_mamba_ssm ]; then bash benchmarks/build_peers.sh > "$OUT/build_peers.log" 2>&1; fi
ls /tmp/peers | head -3
timeout 200 python3 -m pytest tests/test_kernel_selective_scan.py -q -p no:logging -p no:cacheprovider > "$OUT/tests_selective_scan.log" 2>&1
tail -2 "$OUT/tests_selective_scan.log"
timeout 150 python3 -m pytest tests/test_packing.py tests/test_swap_kernels.py -q -p no:logging -p no:cacheprovider > "$OUT/tests_packing_swap.log" 2>&1
tail -2 "$OUT/tests_packing_swap.log"
for r in 1 2; do
  PYTHONPATH=scratch/old/benchmarks:/tmp/peers timeout 100 python3 scratch/ab_scan.py old 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
  PYTHONPATH=benchmarks:/tmp/peers timeout 100 python3 scratch/ab_scan.py new --peer 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
done
grep -v -i warn "$OUT/ab.err" | tail -5
