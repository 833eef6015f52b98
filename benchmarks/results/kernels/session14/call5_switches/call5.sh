#!/usr/bin/env bash
# Session 14, call 5: per-launch device times (forward+backward and no-grad forward) of the working tree
# with the u/delta prefetch off (SS_PREFETCH=0) and with the in-kernel segment chain skipped (SS_NOCHAIN=1,
# timing only: the results are then wrong), from a copy of the tree with those switches (scratch/exp).
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for r in 1 2; do
  PYTHONPATH=scratch/exp/benchmarks timeout 100 python3 scratch/prof.py default 2>>"$OUT/prof.err" | tee -a "$OUT/prof.jsonl"
  SS_PREFETCH=0 PYTHONPATH=scratch/exp/benchmarks timeout 100 python3 scratch/prof.py no_prefetch 2>>"$OUT/prof.err" | tee -a "$OUT/prof.jsonl"
  SS_NOCHAIN=1 PYTHONPATH=scratch/exp/benchmarks timeout 100 python3 scratch/prof.py no_chain 2>>"$OUT/prof.err" | tee -a "$OUT/prof.jsonl"
done
grep -v -i warn "$OUT/prof.err" | tail -3
