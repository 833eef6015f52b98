# One H200 (nvidia-h200): the key/value cache writes of attention without a rotary embedding as one
# launch (fuse_cache_write's writes-only case, kernels/cache_write.py). The GPU tests of the kernel
# and of Zamba's graphed decode, then Zamba2-2.7B's graphed step with and without the pass timed
# alternately in one process, then its TPOT in a process of its own.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_fuse_cache_write.py "tests/test_cuda_graph.py::test_dm_generate_graphs_decode_at_tp1[zamba]" \
    "tests/test_cuda_graph.py::test_dm_generate_graphs_decode_at_tp1[zamba2]" -o addopts="" -q -p no:cacheprovider 2>&1 | tail -3
timeout 200 python benchmarks/results/decode_profile/pass_ab_gpu.py --out $OUT/ab --models zamba2-2.7b \
    --skip fuse_cache_write --batches 1 64 --rounds 7 2>&1 | grep -v Warning | tail -8
timeout $((590 - SECONDS)) python benchmarks/decode_gpu.py --out $OUT/decode --models zamba2-2.7b --variants ssmshard \
    --batches 1 64 --new-tokens 64 --repeats 5 --budget-s $((570 - SECONDS)) 2>&1 | grep -v Warning | grep '"tpot"' | cut -c1-300
