# One H200 (nvidia-h200): the static-K/V decode program now traces the shortest prefix (its first
# attention layer an example like any other). The GPU tests of graphed decode over copied layers,
# then time to start of Zamba2-2.7B and the Llama-3-8B-sized config with lazy_forward=True: a first
# process (filling Triton's caches), then one with warm caches.
export PYTHONPATH=$PWD
timeout 240 python -m pytest tests/test_layer_repeat.py -k gpu -o addopts="" -q -p no:cacheprovider 2>&1 | tail -3
MODELS="zamba2-2.7b llama-3-8b" ROUND_S=120 ROUNDS="cold_lazy warm_lazy" T=$((585 - SECONDS)) \
    bash benchmarks/results/decode/run_lazy_forward_start_gpu.sh 2>&1 | grep -v "^+"
