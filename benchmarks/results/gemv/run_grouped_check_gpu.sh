# One H200 (nvidia-h200): the grouped launch's swept tiling at 64 rows in the graphed step, and
# Llama's decode rows with it.
set -x
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
timeout 60 python -m pytest tests/test_group_decode_linears.py -o addopts="" -q 2>&1 | tail -2 | tee $OUT/logs/gpu_tests_grouped.log
timeout 110 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models llama-3-8b --env SSMSHARD_GROUP_ROWS=1 --batches 64 --rounds 7 2>&1 | grep "ms/step"
timeout 80 python benchmarks/decode_gpu.py --out $OUT/decode --models llama-3-8b --variants ssmshard --batches 64 --new-tokens 64 --repeats 5 --budget-s 160 2>&1 | grep '"tpot"\|skipped' | cut -c1-600
