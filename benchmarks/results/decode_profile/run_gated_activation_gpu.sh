# One H200 (nvidia-h200): a gated MLP's activation and product as one launch (fuse_gated_activation,
# kernels/gated_activation.py). GPU tests (the kernel against torch bit for bit; graphed decode of
# Llama, Zamba and Zamba2 against eager and HF), then the graphed step of the Llama-3-8B-sized config
# and of Zamba2-2.7B with and without the pass, timed alternately in one process.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_fuse_gated_activation.py "tests/test_cuda_graph.py::test_dm_generate_graphs_decode_at_tp1" \
    -k "not mamba" -o addopts="" -q -p no:cacheprovider -rf 2>&1 | tail -12
for model in ${MODELS:-llama-3-8b zamba2-2.7b}; do
    timeout 190 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab_$model --models $model \
        --skip fuse_gated_activation --batches 1 64 --rounds 7 2>&1 | grep -v Warning | tail -4
done
