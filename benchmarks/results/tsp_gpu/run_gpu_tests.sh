# One H200 (nvidia-h200): TSP on the Triton kernels and CUDA tensors (tests/test_tsp_gpu.py: the
# D ranks as threads of one process on the one GPU; logits and generated tokens; two runs, two
# fresh seeds), then the GPU test of bfloat16 SSM states with its near-tie bound relative to the
# largest logit. Logs under $OUT/logs.
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/logs/device.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/logs/device.txt
date -u +%F | tee -a $OUT/logs/device.txt
for run in 1 2; do  # two runs: two fresh seeds
  timeout ${TSP_LIMIT:-200} python -m pytest tests/test_tsp_gpu.py -o addopts="" -q -p no:cacheprovider -p no:logging \
    -rfE --durations=5 2>&1 | tail -20 | tee -a $OUT/logs/gpu_tests_tsp.log
done
left=$((${TOTAL_LIMIT:-575} - SECONDS))
timeout $left python -m pytest tests/test_ssm_state_dtype.py -k on_the_gpu -o addopts="" -q -p no:cacheprovider \
  -p no:logging -rfE 2>&1 | tail -6 | tee $OUT/logs/gpu_tests_bf16_states.log
