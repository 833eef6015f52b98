# One H200: kernel-by-kernel profiles of the graphed decode step with the opt-in decode_attention
# pass at batch 64: all 54 layers of Zamba2-2.7B, the first 8 of Llama-3-8B.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 150 python benchmarks/decode_profile.py --out $OUT/zamba2 --model zamba2-2.7b --variants tp1_opt_in --layers 54 --batches 64 2>&1 | tail -30 | tee $OUT/logs/profile_zamba2.log
timeout 100 python benchmarks/decode_profile.py --out $OUT/llama --model llama-3-8b --variants tp1_opt_in --layers 8 --batches 64 2>&1 | tail -30 | tee $OUT/logs/profile_llama.log
