#!/usr/bin/env bash
# Session 13, call 9: the packed Mamba-2 kernel test at the old per-tensor bound (1e-4) over
# seeds, the stable da form in place (seed 917710232 first: the one that needed 5e-4).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p "$OUT"
for seed in 917710232 1 2 3 4 5 6 7 8 9 10 11; do
  r=$(SSMSHARD_TEST_SEED=$seed timeout 120 python3 -m pytest tests/test_packing.py -k "kernels and (mamba2 or zamba2)" -q -p no:logging -p no:cacheprovider 2>&1 | tail -1)
  echo "seed $seed: $r" | tee -a "$OUT/seeds.log"
done
