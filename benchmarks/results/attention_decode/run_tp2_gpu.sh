# Two H200s (nvidia-h200-x2): the graphed-decode GPU tests of the attention families at tp 2 (NCCL
# all-reduces in the graph) with every decode pass, fuse_cache_write included; then Zamba2's decode
# rows in a process of its own (one GPU).
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 200 python -m pytest tests/test_cuda_graph.py -o addopts="" -q --durations=0 \
  -k "nccl_all_reduces and (zamba or llama)" 2>&1 | tail -12 | tee $OUT/logs/gpu_tests_tp2_static_kv.log
export CUDA_VISIBLE_DEVICES=0
timeout 200 python benchmarks/decode_gpu.py --out $OUT/decode_zamba2 --models zamba2-2.7b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 190 2>&1 | grep -v Warning | grep '"tpot"\|environment' | cut -c1-300
