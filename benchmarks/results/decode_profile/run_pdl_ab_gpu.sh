# One H200 (nvidia-h200): the graphed decode step with programmatic dependent launch on (the
# default) and off (SSMSHARD_PDL=0 while the graph is captured), timed alternately in one process
# (pass_ab_gpu.py), at batch 1 and 64, for each of MODELS.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for model in ${MODELS:-zamba2-2.7b mamba2-2.7b mamba-2.8b}; do
    timeout 170 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/pdl_$model --models $model \
        --env SSMSHARD_PDL=0 --batches 1 64 --rounds 7 2>&1 | grep -v Warning | tail -5
done
