# One H200 (nvidia-h200): the gated-activation kernel's GPU tests, then the 16/64-row TMA GEMM and
# read-probe sweep against cuBLAS (tma_rows_gpu.py).
export PYTHONPATH=$PWD
python -m pytest tests/test_fuse_gated_activation.py -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_test_gated_activation.log
timeout 450 python benchmarks/results/gemv/tma_rows_gpu.py --out $OUT 2>&1 | grep -v Warning
