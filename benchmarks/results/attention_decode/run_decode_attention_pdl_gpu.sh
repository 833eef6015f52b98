# One H200: the graphed decode test with the opt-in decode_attention pass (tokens equal eager's
# and HF's), then Zamba2-2.7B's batch-64 step with and without the pass with programmatic
# dependent launch off, kernel by kernel (per-kernel times without overlap) and A/B.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 170 python -m pytest tests/test_decode_attention.py -k graphed -o addopts="" -q -p no:logging 2>&1 | tail -6 | tee $OUT/logs/gpu_tests_graphed_decode_attention.log
SSMSHARD_PDL=0 timeout 250 python benchmarks/decode_profile.py --out $OUT/zamba2_pdl0 --model zamba2-2.7b \
  --variants tp1 tp1_opt_in --layers 54 --batches 64 2>&1 | tail -40 | tee $OUT/logs/profile_zamba2_pdl0.log
SSMSHARD_PDL=0 timeout 110 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models zamba2-2.7b \
  --add decode_attention --batches 64 --rounds 3 2>&1 | grep "ms/step" | tee $OUT/logs/ab_pdl0.log
