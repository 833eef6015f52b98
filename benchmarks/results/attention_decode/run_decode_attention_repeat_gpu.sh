# One H200: Zamba2-2.7B's graphed step with and without the opt-in decode_attention pass at batch
# 1 and 64, in two separate processes (does the saving repeat within one host?).
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
for run in 1 2; do
  timeout 250 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/zamba2_$run --models zamba2-2.7b \
    --add decode_attention --batches 1 64 --rounds 5 2>&1 | grep "ms/step" | tee $OUT/logs/ab_zamba2_$run.log
done
