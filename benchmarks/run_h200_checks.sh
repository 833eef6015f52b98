#!/usr/bin/env bash
# One call on one H200 (device tool, kind nvidia-h200, about 8 minutes): GPU tests of the
# Mamba-1 scan, conv, packing and kernel-swap paths; the kernels on a training step's tensors
# (bench_train_layouts.py); Mamba-1 and Mamba-2 packed training with a profile of one Mamba-1
# step. Logs and JSON under $OUT (at most 8 files come back: keep it to these).
#
#   device run: bash benchmarks/run_h200_checks.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
quiet() { grep -v -i "warn\|falling back"; }
timeout 330 python3 -m pytest tests/test_kernel_selective_scan.py tests/test_kernel_causal_conv1d.py \
  tests/test_packing.py tests/test_swap_kernels.py -q -p no:logging -p no:cacheprovider 2>&1 | tail -15 > "$OUT/tests.log"
timeout 60 python3 benchmarks/bench_train_layouts.py --out "$OUT" 2>&1 | quiet > "$OUT/layouts.log"
timeout 200 python3 benchmarks/train_packed.py --models mamba mamba2 --out "$OUT" 2>&1 | quiet > "$OUT/train.log"
timeout 80 python3 benchmarks/profile_train_step.py --models mamba --modes packed --top 15 --out "$OUT" 2>&1 \
  | quiet > "$OUT/profile.log"
tail -4 "$OUT/tests.log"; cat "$OUT/layouts.log"; tail -9 "$OUT/train.log"; cat "$OUT/profile.log"
