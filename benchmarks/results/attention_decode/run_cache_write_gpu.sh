# Two H200s (nvidia-h200-x2): the rotary/cache-write kernel and the graphed-decode GPU tests of
# the attention families at tp 1 and 2 with every decode pass, the graphed step with and without
# fuse_cache_write and hoist_attention_mask (one GPU). The decode table rows: run_decode_gpu.sh.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 100 python -m pytest tests/test_fuse_cache_write.py tests/test_fuse_rotary.py -o addopts="" -q 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_kernel.log
timeout 230 python -m pytest tests/test_cuda_graph.py -o addopts="" -q --durations=0 \
  -k "(nccl_all_reduces and (zamba or llama)) or (dm_generate_graphs_decode_at_tp1 and (llama or zamba2))" 2>&1 | tail -14 | tee $OUT/logs/gpu_tests_cuda_graph.log
export CUDA_VISIBLE_DEVICES=0
timeout 200 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models llama-3-8b --skip fuse_cache_write hoist_attention_mask fuse_cache_write+hoist_attention_mask --batches 1 64 --rounds 7 2>&1 | grep "ms/step"
