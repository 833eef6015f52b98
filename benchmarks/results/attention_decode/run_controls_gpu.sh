# One H200 (nvidia-h200): the attention with the hoisted (additive) mask against the boolean one
# on the GPU's kernels, and a control for the batch-64 tokens: two builds of the same plan (the
# second with an environment variable nothing reads) compared as pass_ab_gpu.py compares variants.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 100 python -m pytest tests/test_hoist_attention_mask.py -o addopts="" -q 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_hoist_attention_mask.log
timeout 200 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models llama-3-8b --env SSMSHARD_UNREAD_CONTROL=1 --batches 1 64 --rounds 3 2>&1 | grep "ms/step"
