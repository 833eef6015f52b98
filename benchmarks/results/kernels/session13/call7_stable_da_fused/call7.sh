#!/usr/bin/env bash
# Session 13, call 7: the stable da form fused into the dx/dB kernel: precision and speed
# beside the identity form, then the GPU SSD and packing tests (and the seed-917710232 replay).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p "$OUT"
timeout 200 python3 benchmarks/results/kernels/session13/ab_ssd_da.py scratch/ssd_scan_bwd_old.py 2>&1 \
  | grep -v -i "warn\|falling back" > "$OUT/ab_ssd_da.log"
tail -14 "$OUT/ab_ssd_da.log"
timeout 330 python3 -m pytest tests/test_kernel_ssd_scan.py -rA -p no:logging -p no:cacheprovider > "$OUT/tests_kernel_ssd_scan.log" 2>&1 &
timeout 330 python3 -m pytest tests/test_packing.py -rA -p no:logging -p no:cacheprovider > "$OUT/tests_packing.log" 2>&1 &
wait
SSMSHARD_TEST_SEED=917710232 timeout 60 python3 -m pytest tests/test_packing.py -k "kernels and mamba2" -rA -p no:logging -p no:cacheprovider > "$OUT/tests_packing_seed917710232.log" 2>&1
for f in kernel_ssd_scan packing packing_seed917710232; do echo "$f: $(grep -c "^PASSED" "$OUT/tests_$f.log") passed, $(grep -c "^FAILED" "$OUT/tests_$f.log") failed"; done
