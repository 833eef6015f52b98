# One H200 (nvidia-h200): a Mamba layer's in_proj and conv update as one launch at batch 1
# (fuse_gemv_conv, kernels/gemv_conv.py). GPU tests (the kernel against the GEMV and conv-update
# kernels bit for bit; graphed batch-1 decode against eager, the plan without the pass and HF; the
# tp-1 graphed decode of the Mamba families at batch 3, where the call falls back to the two
# kernels), then the graphed batch-1 step of each of MODELS with and without the pass, timed
# alternately in one process. TESTS=0 leaves the tests out.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${TESTS:-1}" != 0 ]; then
    timeout 220 python -m pytest tests/test_fuse_gemv_conv.py "tests/test_cuda_graph.py::test_dm_generate_graphs_decode_at_tp1" \
        -k "mamba or kernel or graphed_batch or plan_runs" -o addopts="" -q -p no:cacheprovider -rf 2>&1 | tail -12
fi
for model in ${MODELS:-mamba-2.8b mamba2-2.7b}; do
    timeout 150 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab_$model --models $model \
        --skip fuse_gemv_conv --batches 1 --rounds 7 2>&1 | grep -v Warning | tail -4
done
