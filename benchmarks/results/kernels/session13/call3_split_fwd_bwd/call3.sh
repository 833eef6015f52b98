#!/usr/bin/env bash
# Session 13, call 3: forward+backward at the old (256-token) and new (128-token) minimum
# segment, the batch-1 split sweep at 2K/4K once more, then the scan benchmark at the new default.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
export PYTHONPATH=$PWD:/tmp/peers
q() { grep -v -i "warn\|falling back"; }
timeout 200 python3 benchmarks/sweep_scan_split.py --lengths 2048 4096 --fwd-bwd-segments 8 16 \
  --out "$OUT/sweep_scan_split.json" 2>&1 | q > "$OUT/sweep_scan_split.log"
grep -v "^    bd" "$OUT/sweep_scan_split.log"
timeout 200 python3 benchmarks/bench_selective_scan.py --graphs --profile --out "$OUT/bench_selective_scan.json" 2>&1 | q > "$OUT/bench_selective_scan.log"
grep "CUDA graph\|forward kernels" "$OUT/bench_selective_scan.log"; tail -12 "$OUT/bench_selective_scan.log"
timeout 100 python3 -m pytest tests/test_kernel_selective_scan.py -k "default_config or segments" -rA -p no:logging -p no:cacheprovider > "$OUT/tests_default_config.log" 2>&1
tail -3 "$OUT/tests_default_config.log"
