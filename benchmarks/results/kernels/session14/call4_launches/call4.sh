#!/usr/bin/env bash
# Session 14, call 4: per-launch device times of one forward+backward, HEAD's tree against the working tree.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for r in 1 2; do
  PYTHONPATH=scratch/old/benchmarks timeout 100 python3 scratch/prof.py old 2>>"$OUT/prof.err" | tee -a "$OUT/prof.jsonl"
  PYTHONPATH=benchmarks timeout 100 python3 scratch/prof.py new 2>>"$OUT/prof.err" | tee -a "$OUT/prof.jsonl"
done
grep -v -i warn "$OUT/prof.err" | tail -3
