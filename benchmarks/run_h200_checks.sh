#!/usr/bin/env bash
# One call on one H200 (device tool, kind nvidia-h200, about 8 minutes): GPU tests of the
# Mamba-1 scan, packing and kernel-swap paths; the kernels on a training step's tensors and the
# scan at aligned / unaligned row lengths (bench_train_layouts.py); Mamba-1 packed, padded and
# one-at-a-time training. Logs and JSON under $OUT (at most 8 files come back: keep it to these).
#
#   device run: bash benchmarks/run_h200_checks.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
quiet() { grep -v -i "warn\|falling back"; }
timeout 280 python3 -m pytest tests/test_kernel_selective_scan.py tests/test_packing.py tests/test_swap_kernels.py \
  -q -p no:logging -p no:cacheprovider > "$OUT/tests.log" 2>&1
timeout 80 python3 benchmarks/bench_train_layouts.py --out "$OUT" 2>&1 | quiet > "$OUT/layouts.log"
timeout 150 python3 benchmarks/train_packed.py --models mamba --out "$OUT" 2>&1 | quiet > "$OUT/train.log"
tail -4 "$OUT/tests.log"; cat "$OUT/layouts.log"; tail -9 "$OUT/train.log"
