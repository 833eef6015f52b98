# One H200 (nvidia-h200): the test suite minus the slow set on the GPU machine, in parts that fit
# one call. PART=gpu: the files with GPU-only tests (a CUDA skip condition); PART=rest: the other
# files; anything else: the test paths given in PART. A per-test log (-v) so that a run cut off by
# its time limit still names every test it ran. Logs under $OUT/logs/gpu_suite_<name>.log.
# A part does not fit one call (each was cut by its limit at 76-90%): SHARDS=N SHARD=i (0 <= i < N)
# runs every N-th of its files, starting at the i-th, as part <name>_<i>of<N>.
export PYTHONPATH=$PWD
# Two threads per process: the multi-process tests start several ranks per worker, and with
# torch's default (a thread per core) 12 workers oversubscribed the 16 cores. With 2, a set of
# 40 of them took 90 s; with the default, single tests of that set took 300-480 s.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p $OUT/logs
case "${PART:?set PART=gpu, rest or test paths}" in
  gpu)  files=$(grep -l "cuda.is_available" tests/test_*.py); name=gpu ;;
  rest) files=$(grep -L "cuda.is_available" tests/test_*.py); name=rest ;;
  *)    files=$PART; name=${NAME:-subset} ;;
esac
if [ -n "${SHARDS:-}" ]; then
  files=$(echo $files | tr ' ' '\n' | awk -v n="$SHARDS" -v i="${SHARD:?set SHARD with SHARDS}" '(NR - 1) % n == i')
  name=${name}_${SHARD}of${SHARDS}
fi
timeout -s INT ${LIMIT:-540} python -m pytest $files -m "not slow" -k "${K:-not nothing}" -o addopts="" \
  -p no:cacheprovider -p no:benchmark -n ${WORKERS:-12} -v -rfE --durations=10 2>&1 \
  | grep -v "^bringing up nodes" > $OUT/logs/gpu_suite_${name}_full.log
grep -E "^(FAILED|ERROR)|passed|failed|error" $OUT/logs/gpu_suite_${name}_full.log | tail -60 | tee $OUT/logs/gpu_suite_${name}.log
