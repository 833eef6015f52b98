# One H200 (nvidia-h200): the test suite minus the slow set on the GPU machine, in parts that fit
# one call. PART=gpu: the files with GPU-only tests (a CUDA skip condition); PART=rest: the other
# files; anything else: the test paths given in PART. A per-test log (-v) so that a run cut off by
# its time limit still names every test it ran. Logs under $OUT/logs/gpu_suite_<name>.log.
export PYTHONPATH=$PWD
mkdir -p $OUT/logs
case "${PART:?set PART=gpu, rest or test paths}" in
  gpu)  files=$(grep -l "cuda.is_available" tests/test_*.py); name=gpu ;;
  rest) files=$(grep -L "cuda.is_available" tests/test_*.py); name=rest ;;
  *)    files=$PART; name=${NAME:-subset} ;;
esac
timeout -s INT ${LIMIT:-540} python -m pytest $files -m "not slow" -k "${K:-not nothing}" -o addopts="" \
  -p no:cacheprovider -p no:benchmark -n ${WORKERS:-12} -v -rfE --durations=10 2>&1 \
  | grep -v "^bringing up nodes" > $OUT/logs/gpu_suite_${name}_full.log
grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/logs/gpu_suite_${name}_full.log | tail -60 | tee $OUT/logs/gpu_suite_${name}.log
