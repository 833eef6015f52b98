# Two H200s (nvidia-h200-x2): the graphed-decode GPU tests of the attention families at tp 1 and 2
# with the decode passes, the graphed step with and without hoist_attention_mask (one GPU), and the
# Llama decode table rows (one GPU).
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 200 python -m pytest tests/test_cuda_graph.py -o addopts="" -q --durations=0 \
  -k "(nccl_all_reduces and (zamba or llama)) or (dm_generate_graphs_decode_at_tp1 and llama)" 2>&1 | tail -14 | tee $OUT/logs/gpu_tests_cuda_graph.log
export CUDA_VISIBLE_DEVICES=0
timeout 150 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models llama-3-8b --skip hoist_attention_mask --batches 1 64 --rounds 7 2>&1 | grep "ms/step"
timeout 170 python benchmarks/decode_gpu.py --out $OUT/decode --models llama-3-8b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 160 2>&1 | grep -v Warning | tail -12
