#!/usr/bin/env bash
# GPU check of the parallel selective-scan forward (ScanConfig.fwd_variant="parallel"), for one
# H200: the kernel tests on the GPU (no interpreter; both forward variants, the backward fed
# by each), then the parallel forward's sweep (forward median and max relative error against
# the fp32 torch reference per config, B=8 d=5120 L=2048 and B=1 d=5120 L=16384).
#
#     bash benchmarks/gpu_check_scanfast.sh        # writes $OUT/pytest.log, $OUT/sweep.{json,log}
#
# The peer comparison (mamba-ssm) is run separately (bench_selective_scan.py without --no-mamba).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"

start=$(date +%s)
python3 -m pytest tests/test_kernel_selective_scan.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
echo "tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest.log"

start=$(date +%s)
python3 benchmarks/bench_selective_scan.py --sweep --no-mamba --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
echo "benchmark with sweep: $(( $(date +%s) - start )) s" | tee -a "$OUT/sweep.log"
