# One H200: the decode-attention kernel's tests on the GPU, its benchmark against PyTorch's SDPA
# backends, the graphed decode tests with the pass (tokens equal eager's and HF's), and the
# Zamba2 and Llama steps with and without the opt-in pass.
# (pass_ab_decode_attention.jsonl was recorded while the pass ran by default, as
# "all passes" against "without decode_attention"; --add is the same comparison now.)
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 150 python -m pytest tests/test_decode_attention.py -o addopts="" -q -p no:logging 2>&1 | tail -4 | tee $OUT/logs/gpu_tests_decode_attention.log
timeout 170 python -W ignore benchmarks/bench_decode_attention.py --out $OUT/bench_decode_attention.json \
  --batches 1 64 256 2>&1 | tee $OUT/logs/bench_decode_attention.log
timeout 270 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models zamba2-2.7b llama-3-8b \
  --add decode_attention --batches 1 64 --rounds 5 2>&1 | grep "ms/step"
