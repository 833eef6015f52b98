# One H200 (nvidia-h200): the batch-64 decode step of Mamba-2.8B (64 layers), Mamba2-2.7B (64)
# and Zamba2-2.7B (54), every layer, with the current plan, kernel by kernel, with programmatic
# dependent launch off (SSMSHARD_PDL=0) so that each kernel's measured time is its own and the
# times add up; then batch64_budget.py sets each category's time beside the bytes it must move.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for model in ${MODELS:-mamba-2.8b mamba2-2.7b zamba2-2.7b}; do
    layers=64; [ "$model" = zamba2-2.7b ] && layers=54
    SSMSHARD_PDL=0 timeout 200 python benchmarks/decode_profile.py --out $OUT/profile_$model --model $model \
        --variants tp1 --layers $layers --batches 64 2>&1 | grep -v Warning | tail -3
    python benchmarks/results/decode_profile/batch64_budget.py $OUT/profile_$model/decode_profile.json
done
