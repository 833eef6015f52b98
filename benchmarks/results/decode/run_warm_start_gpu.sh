# One H200: time to start of Mamba2-2.7B, Mamba-2.8B and Zamba2-2.7B in a fresh process on a fresh
# machine (cold: Triton compiles every kernel and tunes the SSD kernels), then again in a second
# process on the same machine (warm: Triton's on-disk caches of compiled kernels and, where
# Triton has cache_results, of the SSD kernels' tunings). TRITON_PRINT_AUTOTUNING=1 prints one
# line per tuning that benchmarked its configs (none where the tuning came from the cache).
#   bash benchmarks/results/decode/run_warm_start_gpu.sh         # $OUT: start_{cold,warm}{,.log}
#   MODELS="llama-3-8b zamba2-2.7b" ROUND_S=140 bash benchmarks/results/decode/run_warm_start_gpu.sh
#   [T=SECONDS_LEFT] bash benchmarks/results/decode/run_warm_start_gpu.sh tests [ssd]   # GPU tests: the SSD kernels
#                                                                # and of graphed decode over copied layers
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
if [ "$1" = tests ]; then
  timeout $((${T:-590} - SECONDS)) python -m pytest tests/test_kernel_ssd_scan.py -o addopts="" -q -p no:logging 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_ssd.log
  [ "$2" = ssd ] && exit
  timeout $((${T:-590} - SECONDS)) python -m pytest tests/test_layer_repeat.py -k gpu -o addopts="" -q -p no:logging 2>&1 | tail -3 | tee $OUT/logs/gpu_tests_layer_repeat.log
  exit
fi
python -c "import inspect, triton; print('triton', triton.__version__, 'cache_results:', 'cache_results' in inspect.signature(triton.autotune).parameters)"
export TRITON_PRINT_AUTOTUNING=1
for round in cold warm; do
  timeout $((${ROUND_S:-270} + 10)) python benchmarks/decode_gpu.py --out $OUT/start_$round \
      --models ${MODELS:-mamba2-2.7b mamba-2.8b zamba2-2.7b} --variants ssmshard --batches --repeats 3 --budget-s ${ROUND_S:-270} > $OUT/start_$round.log 2>&1
  echo "$round: tunings benchmarked: $(grep -c 'Triton autotuning for function' $OUT/start_$round.log)"
  grep '"start"\|"ttft"' $OUT/start_$round.log | cut -c1-700
done
