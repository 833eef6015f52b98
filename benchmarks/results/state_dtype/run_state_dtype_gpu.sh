# One H200 (nvidia-h200): Plan(ssm_state_dtype=torch.bfloat16) against HF's float32 SSM states.
# TESTS=1: the state-dtype tests, GPU ones included (graphed decode with bfloat16 states), and the
#       state update kernel's.
# AB=1: the graphed decode step with float32 and with bfloat16 states, timed alternately in one
#       process (pass_ab_gpu.py --state-dtypes bfloat16), at BATCHES, for each of MODELS.
# TPOT=1: decode_gpu.py's TPOT and weight-read floor with bfloat16 states (the floor counts them
#       in bfloat16), ssmshard only, at BATCHES.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MODELS=${MODELS:-mamba2-2.7b mamba-2.8b zamba2-2.7b}
BATCHES=${BATCHES:-1 64 256}
if [ "${TESTS:-1}" = 1 ]; then
    timeout 240 python -m pytest tests/test_ssm_state_dtype.py tests/test_kernel_selective_scan.py -q -p no:cacheprovider \
        -o addopts="" -k "gpu or errors or state_update" \
        > $OUT/gpu_tests_full.log 2>&1; tail -3 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
fi
if [ "${AB:-1}" = 1 ]; then
    for model in $MODELS; do
        timeout 200 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab_$model --models $model \
            --state-dtypes bfloat16 --batches $BATCHES --rounds 7 2>&1 | grep -v Warning | tail -4
    done
fi
if [ "${TPOT:-0}" = 1 ]; then
    timeout ${TPOT_S:-400} python benchmarks/decode_gpu.py --out $OUT/tpot --models $MODELS --variants ssmshard \
        --batches $BATCHES --ssm-state-dtype bfloat16 --budget-s $(( ${TPOT_S:-400} - 40 )) 2>&1 | grep -v Warning | tail -8
fi
