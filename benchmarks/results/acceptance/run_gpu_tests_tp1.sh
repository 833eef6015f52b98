# One H200 (nvidia-h200): the GPU tests of graphed decode at tp 1 on the current plan (every
# decode pass): graphed = eager = HF greedy tokens for the six families, left-padded prompts of
# different lengths, rows finishing at different steps; then the decode kernels' own GPU tests.
# Logs under $OUT/logs. (tp 2 needs two GPUs: tests/test_cuda_graph.py -k nccl_all_reduces.)
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/logs/device.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/logs/device.txt
timeout 330 python -m pytest tests/test_cuda_graph.py tests/test_finishing_rows.py -o addopts="" -q -p no:cacheprovider \
  -p no:logging -rs 2>&1 | tail -8 | tee $OUT/logs/gpu_tests_graphed_decode_tp1.log
left=$((575 - SECONDS))
timeout $left python -m pytest tests/test_fuse_gated_activation.py tests/test_fuse_cache_write.py tests/test_fuse_gemv_conv.py \
  tests/test_decode_attention.py tests/test_decode_gemv.py tests/test_layer_repeat.py -k "gpu or kernel or graphed" \
  -o addopts="" -q -p no:cacheprovider -p no:logging 2>&1 | tail -4 | tee $OUT/logs/gpu_tests_decode_kernels.log
