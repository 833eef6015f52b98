# One H200 (nvidia-h200): GPU tests of the rotary kernel and the folded cache positions, the
# graphed step with and without each pass, the Llama decode table rows, a batch-64 profile.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 120 python -m pytest tests/test_fuse_rotary.py tests/test_fold_cache_positions.py -o addopts="" -q 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_rotary.log
timeout 150 python -m pytest tests/test_cuda_graph.py -o addopts="" -q -k "dm_generate_graphs_decode_at_tp1 and (llama or zamba2)" 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_cuda_graph.log
timeout 150 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models llama-3-8b --skip fuse_rotary fold_cache_positions --batches 1 64 --rounds 7 2>&1 | grep "ms/step"
timeout 170 python benchmarks/decode_gpu.py --out $OUT/decode --models llama-3-8b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 160 2>&1 | grep -v Warning | tail -12
timeout 90 python benchmarks/decode_profile.py --out $OUT/profile --model llama-3-8b --variants tp1 --layers 8 --batches 64 2>&1 | tail -4
