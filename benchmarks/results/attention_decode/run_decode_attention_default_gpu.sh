# One H200: with decode_attention in the default plan (head dims that are not a power of two),
# the kernel's and the pass's tests, and the default plan's graphed decode of the attention
# families at tp 1 (tokens equal eager's and HF's).
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 200 python -m pytest tests/test_decode_attention.py -o addopts="" -q -p no:logging 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_decode_attention_default.log
timeout 200 python -m pytest tests/test_cuda_graph.py -k "dm_generate_graphs_decode_at_tp1 and (llama or zamba)" -o addopts="" -q -p no:logging 2>&1 | tail -3 | tee -a $OUT/logs/gpu_tests_decode_attention_default.log
