#!/usr/bin/env bash
# Host time before (HEAD 4afc8b4, copied to scratch/old) and after this session's host-path
# changes, two rounds each, beside mamba-ssm; then per-launch device times of the new tree.
# Run with: carry [".peers", "scratch/old"], nvidia-h200.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
for round in 1 2; do
  for tree in old new; do
    bench=benchmarks; [ "$tree" = old ] && bench=scratch/old/benchmarks
    PYTHONPATH=$bench:/tmp/peers timeout 150 python3 benchmarks/results/kernels/session16/host_overhead.py \
      2>> "$OUT/host_overhead.err" | sed "s/^{/{\"tree_tag\": \"$tree\", \"round\": $round, /" >> "$OUT/host_overhead.jsonl"
    echo "$tree round $round rc $?"
  done
done
PYTHONPATH=benchmarks timeout 120 python3 benchmarks/results/kernels/session14/prof.py new > "$OUT/prof.jsonl" 2> "$OUT/prof.err"
echo "prof rc $?"; cat "$OUT/prof.jsonl"
grep -v profile "$OUT/host_overhead.jsonl" | cut -c1-400
