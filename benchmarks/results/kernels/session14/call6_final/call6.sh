#!/usr/bin/env bash
# Session 14, call 6: the carry kernel back (unrolled loads, the backward's walk reversed in-kernel), with the
# prefetch, constexpr checkpoint chunk and skipped segment passes kept. GPU tests, then A/B against HEAD's
# tree with mamba-ssm (carried in .peers) in the same processes.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
timeout 330 python3 -m pytest tests/test_kernel_selective_scan.py -q -p no:logging -p no:cacheprovider -rf > "$OUT/tests_selective_scan.log" 2>&1
echo "scan tests rc $?"; tail -2 "$OUT/tests_selective_scan.log"
timeout 100 python3 -m pytest tests/test_packing.py tests/test_swap_kernels.py -k "kernels or swap" -q -p no:logging -p no:cacheprovider -rf > "$OUT/tests_packing_swap.log" 2>&1
echo "packing/swap tests rc $?"; tail -2 "$OUT/tests_packing_swap.log"
for tag in old new; do
  if [ $tag = old ]; then pp=scratch/old/benchmarks; else pp=benchmarks; fi
  PYTHONPATH=$pp:/tmp/peers timeout 90 python3 scratch/ab_scan.py $tag --peer 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
done
PYTHONPATH=benchmarks timeout 60 python3 scratch/prof.py new 2>>"$OUT/prof.err" > "$OUT/prof.jsonl"; grep -c . "$OUT/prof.jsonl"
