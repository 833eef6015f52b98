#!/usr/bin/env bash
# Session 13, call 2: the batch-1 split sweep beside the peer (CUDA-graph medians).
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
PYTHONPATH=$PWD:/tmp/peers timeout 500 python3 benchmarks/sweep_scan_split.py --out "$OUT/sweep_scan_split.json" 2>&1 \
  | grep -v -i "warn\|falling back" > "$OUT/sweep_scan_split.log"
cat "$OUT/sweep_scan_split.log"
