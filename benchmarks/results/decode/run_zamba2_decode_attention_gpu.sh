# One H200 (nvidia-h200): Zamba2-2.7B's decode at batch 1 and 64 in a process of its own with the
# default plan, which since decode_attention's head-dim rule runs its 160-wide heads' one-position
# attention on ssmshard's kernel.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
timeout 400 python benchmarks/decode_gpu.py --out $OUT/decode --models zamba2-2.7b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 390 2>&1 | grep -v Warning | grep '"tpot"\|"start"\|"ttft"\|environment' | cut -c1-400
