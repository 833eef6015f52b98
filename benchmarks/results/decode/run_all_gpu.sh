# One H200 (nvidia-h200): the four decode configs at batch 1 and 64 in one process (one copy
# bandwidth, one host) with every decode pass, after the GPU tests of the fused rotary/cache write.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 60 python -m pytest tests/test_fuse_cache_write.py -o addopts="" -q 2>&1 | tail -2 | tee $OUT/logs/gpu_tests_fuse_cache_write.log
timeout 480 python benchmarks/decode_gpu.py --out $OUT/decode --models mamba-2.8b mamba2-2.7b zamba2-2.7b llama-3-8b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 470 2>&1 | grep -v Warning | grep '"tpot"\|"start"\|"ttft"\|environment' | cut -c1-400
