# One H200: the batch-64 graphed step with and without the opt-in decode_attention pass, and with
# it but its kernel launched without programmatic dependent launch (pdl=0), and with PDL off for
# every kernel of the step (SSMSHARD_PDL=0).
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 330 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/zamba2 --models zamba2-2.7b \
  --add decode_attention --env SSMSHARD_DECODE_ATTENTION=pdl=0 SSMSHARD_PDL=0 --batches 64 --rounds 5 2>&1 | grep -v Warning | tail -12 | tee $OUT/logs/ab_zamba2.log
timeout 200 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/llama --models llama-3-8b \
  --add decode_attention --env SSMSHARD_DECODE_ATTENTION=pdl=0 SSMSHARD_PDL=0 --batches 64 --rounds 5 2>&1 | grep -v Warning | tail -12 | tee $OUT/logs/ab_llama.log
