# One H200 (nvidia-h200): grouped launches above one row (from 17 rows). Tests, the graphed step
# with and without them (SSMSHARD_GROUP_ROWS=1: batch 1 only, as before), decode rows of Llama
# (rotary and cache positions fused too) and of the pure SSMs (start time), the kernel sweep.
set -x
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
timeout 120 python -m pytest tests/test_group_decode_linears.py tests/test_fuse_rotary.py -o addopts="" -q 2>&1 | tail -2 | tee $OUT/logs/gpu_tests_grouped_rotary.log
timeout 110 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models llama-3-8b --env SSMSHARD_GROUP_ROWS=1 --batches 64 --rounds 7 2>&1 | grep "ms/step"
timeout 100 python benchmarks/decode_gpu.py --out $OUT/decode --models llama-3-8b --variants ssmshard --batches 1 64 --new-tokens 64 --repeats 5 --budget-s 160 2>&1 | grep '"tpot"\|"start"\|"ttft"\|skipped' | cut -c1-600
timeout 170 python benchmarks/decode_gpu.py --out $OUT/decode_ssm --models mamba-2.8b mamba2-2.7b --variants ssmshard --batches 1 --new-tokens 64 --repeats 5 --budget-s 160 2>&1 | grep '"tpot"\|"start"\|"ttft"\|skipped' | cut -c1-600
timeout 170 python benchmarks/results/gemv/grouped_rows_gpu.py --out $OUT/gemv/grouped_rows.json 2>&1 | grep -v Warn | tail -8
