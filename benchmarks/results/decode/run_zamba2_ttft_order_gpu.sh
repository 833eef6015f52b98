# One H200: Zamba2-2.7B's 4K TTFT call by call, before and after a batch-1 TPOT run, with layers
# copied and traced whole (zamba2_ttft_order.py).
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
for flag in "" --trace-all-layers; do
  timeout 250 python benchmarks/results/decode/zamba2_ttft_order.py $flag 2>&1 | grep '^{' | tee -a $OUT/logs/zamba2_ttft_order.log
done
