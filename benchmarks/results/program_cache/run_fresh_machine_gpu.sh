# Time to start on a fresh machine whose caches were filled on another machine of the same kind:
# what a deployment gets when it ships the program cache and Triton's cache (a persistent volume,
# or baked into the image) with the model. Two calls, each on a freshly started nvidia-h200:
#
#   STAGE=store bash benchmarks/results/program_cache/run_fresh_machine_gpu.sh
#       the first process of each model pair fills both caches under /tmp/ssmshard_start;
#       they come back as $OUT/caches.tgz.part-* (15 MB pieces)
#   mkdir -p .startcache && cp <files_at>/caches.tgz.part-* .startcache/      # here, between the calls
#   STAGE=load bash benchmarks/results/program_cache/run_fresh_machine_gpu.sh  # with carry [".startcache"]
#       unpacks them, then per pair: a process that loads (the fresh machine's first), and another
#
# $OUT/start_logs_<stage>.tgz: per pair, the benchmark's log and rows of each round
# (run_lazy_forward_start_gpu.sh's start_<round>.log and start_<round>/rows_rank0.jsonl).
set -x
W=/tmp/ssmshard_start
mkdir -p $W/logs
export TRITON_CACHE_DIR=$W/triton PROGRAM_CACHE=$W/programs
case "${STAGE:?set STAGE=store or STAGE=load}" in
  store) rounds="first_lazy_cached" ;;
  load)  rounds="fresh_lazy_cached again_lazy_cached"
         cat .startcache/caches.tgz.part-* | tar xzf - -C $W || exit 1
         du -sh $W/triton $W/programs ;;
esac
for pair in "zamba2-2.7b llama-3-8b" "mamba-2.8b mamba2-2.7b"; do
  mkdir -p $W/logs/${pair// /_}
  OUT=$W/logs/${pair// /_} MODELS="$pair" ROUNDS="$rounds" ROUND_S=${ROUND_S:-150} T=${T:-330} \
      bash benchmarks/results/decode/run_lazy_forward_start_gpu.sh
done
tar czf $OUT/start_logs_$STAGE.tgz -C $W/logs .
if [ "$STAGE" = store ]; then
  du -sh $W/triton $W/programs
  tar czf - -C $W triton programs | split -b 15M - $OUT/caches.tgz.part-
  ls -l $OUT
fi
