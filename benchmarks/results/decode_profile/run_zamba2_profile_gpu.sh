# One H200 (nvidia-h200): Zamba2-2.7B's decode step at batch 64, kernel by kernel (all 54 layers).
export PYTHONPATH=$PWD
timeout 200 python benchmarks/decode_profile.py --out $OUT/profile --model zamba2-2.7b --variants tp1 --layers 54 --batches 64 2>&1 | grep -v Warning | tail -3
