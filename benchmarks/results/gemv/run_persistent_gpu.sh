# One H200 (nvidia-h200): the batch-1 persistent GEMV sweep, PDL off then on.
export PYTHONPATH=$PWD
SSMSHARD_PDL=0 timeout 280 python benchmarks/results/gemv/persistent_gemv_gpu.py --out $OUT 2>&1 | grep -v Warning
SSMSHARD_PDL=1 timeout 250 python benchmarks/results/gemv/persistent_gemv_gpu.py --out $OUT 2>&1 | grep -v Warning
