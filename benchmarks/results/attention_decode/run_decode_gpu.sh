# One H200 (nvidia-h200): the Zamba2 decode table rows with every decode pass, and a batch-64
# profile of 8 Llama layers. (The Llama rows: run_cache_write_gpu.sh's call, README.)
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 260 python benchmarks/decode_gpu.py --out $OUT/decode_zamba2 --models zamba2-2.7b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 250 2>&1 | grep -v Warning | tail -8
timeout 100 python benchmarks/decode_profile.py --out $OUT/profile --model llama-3-8b --variants tp1 --layers 8 --batches 64 2>&1 | tail -4
