# One H200 (nvidia-h200): TPOT at batch 1 and 64 of the four decode configs with every decode pass
# of the current plan, two models a process (a third model in one process decoded slower at
# batch 1 in an earlier run, README "The four configs in one process"), Zamba2 first.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 265 python benchmarks/decode_gpu.py --out $OUT/decode_a --models zamba2-2.7b mamba-2.8b --variants ssmshard \
  --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 255 2>&1 | grep -v Warning | grep '"tpot"\|environment' | cut -c1-400
timeout $((570 - SECONDS)) python benchmarks/decode_gpu.py --out $OUT/decode_b --models mamba2-2.7b llama-3-8b --variants ssmshard \
  --batches 1 64 --new-tokens 64 --repeats 5 --budget-s $((555 - SECONDS)) 2>&1 | grep -v Warning | grep '"tpot"\|environment' | cut -c1-400
