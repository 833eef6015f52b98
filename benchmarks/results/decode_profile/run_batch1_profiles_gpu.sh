# One H200 (nvidia-h200): the batch-1 decode step of Zamba2-2.7B (54 layers) and Mamba-2.8B
# (64 layers), kernel by kernel, with programmatic dependent launch off (SSMSHARD_PDL=0) so
# that each kernel's measured time is its own and the times add up.
export PYTHONPATH=$PWD
for model in zamba2-2.7b mamba-2.8b; do
    layers=54; [ "$model" = mamba-2.8b ] && layers=64
    SSMSHARD_PDL=0 timeout 250 python benchmarks/decode_profile.py --out $OUT/profile_$model --model $model \
        --variants tp1 --layers $layers --batches 1 2>&1 | grep -v Warning | tail -3
done
