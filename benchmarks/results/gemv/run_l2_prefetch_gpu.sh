# One H200 (nvidia-h200): out_proj weights prefetched into L2 during a layer's latency-bound kernels.
export PYTHONPATH=$PWD
timeout 400 python benchmarks/results/gemv/l2_prefetch_gpu.py --out $OUT 2>&1 | grep -v Warning
