# One H200: the decode-attention kernel's launch shapes swept at the Zamba2 and Llama shapes
# (batch 1 and 64, 80 and 1024 cached positions) beside PyTorch's SDPA backends, then the graphed
# Zamba2 and Llama steps without the pass and with it under other launch shapes (the Zamba2 one
# ran past its timeout). Recorded while the pass ran by default ("--skip decode_attention"); with
# the pass opt-in the same variants are "--add decode_attention --env ...".
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 170 python -W ignore benchmarks/bench_decode_attention.py --out $OUT/bench_decode_attention_sweep.json --sweep \
  --batches 1 64 --positions 80 1024 2>&1 > $OUT/logs/bench_decode_attention_sweep.log
timeout 260 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab_zamba2 --models zamba2-2.7b --add decode_attention \
  --env SSMSHARD_DECODE_ATTENTION=block_s=32,num_stages=1 SSMSHARD_DECODE_ATTENTION=block_s=16,num_warps=2,num_stages=1 \
  --batches 1 64 --rounds 5 2>&1 | grep "ms/step"
timeout 150 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab_llama --models llama-3-8b --add decode_attention \
  --env SSMSHARD_DECODE_ATTENTION=block_s=32,num_stages=1 --batches 1 64 --rounds 5 2>&1 | grep "ms/step"
