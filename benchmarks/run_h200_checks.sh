#!/usr/bin/env bash
# One call on one H200 (device tool, kind nvidia-h200): GPU tests of the chunked prefill, packing
# and selective-scan kernels, the packed-training benchmark, then the selective-scan sweep beside
# mamba-ssm (built from its sdist in the background meanwhile). Writes logs and JSON under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
(bash benchmarks/build_peers.sh > "$OUT/peers.log" 2>&1) &
peers=$!
CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 -m pytest tests/test_chunked_prefill.py -k kernels -q -p no:logging -rA 2>&1 \
  | grep -v "^\[transformers\]" | tail -25 > "$OUT/tests.log"
timeout 150 python3 -m pytest tests/test_packing.py tests/test_kernel_selective_scan.py tests/test_swap_kernels.py \
  -k "kernels or selective or swap" -q -p no:logging 2>&1 | tail -15 >> "$OUT/tests.log"
timeout 220 python3 benchmarks/train_packed.py --models mamba mamba2 --out "$OUT/train" > "$OUT/train.log" 2>&1
wait $peers
PYTHONPATH=$PWD:/tmp/peers timeout 120 python3 benchmarks/bench_selective_scan.py --sweep --out "$OUT/scan.json" \
  > "$OUT/scan.log" 2>&1
tail -5 "$OUT/tests.log" "$OUT/train.log" "$OUT/scan.log"
