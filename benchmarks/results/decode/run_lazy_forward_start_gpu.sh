# One H200: time to start with and without parallelize(..., lazy_forward=True). A first process
# fills Triton's on-disk caches (compiled kernels, the SSD kernels' tunings); then processes on the
# same machine alternate the two ways, so each is measured with warm caches, twice where time allows.
#   MODELS="llama-3-8b zamba2-2.7b" bash benchmarks/results/decode/run_lazy_forward_start_gpu.sh
#   # $OUT: start_<round>/rows_rank0.jsonl and start_<round>.log
#   ROUNDS="cold_lazy warm_lazy" ...    # only these rounds (a round named *lazy* runs with the flag)
#   ROUNDS="cold_lazy_cached warm_lazy_cached warm_lazy" ...   # *cached*: parallelize(program_cache=
#        $PROGRAM_CACHE, default /tmp/ssmshard_programs): the first such round stores, later ones load
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
ROUND_S=${ROUND_S:-100}
for round in ${ROUNDS:-cold_eager warm_lazy warm_eager warm_lazy2 warm_eager2}; do
  [ $((${T:-585} - SECONDS)) -lt $((ROUND_S + 20)) ] && { echo "no time for $round"; break; }
  flag=; case $round in *lazy*) flag=--lazy-forward;; esac
  case $round in *cached*) flag="$flag --program-cache ${PROGRAM_CACHE:-/tmp/ssmshard_programs}";; esac
  timeout $((ROUND_S + 15)) python benchmarks/decode_gpu.py --out $OUT/start_$round $flag \
      --models ${MODELS:-llama-3-8b zamba2-2.7b} --variants ssmshard --batches --repeats 1 --budget-s $ROUND_S > $OUT/start_$round.log 2>&1
  echo "$round ($SECONDS s)"
  grep '"start"' $OUT/start_$round.log | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line.split('] ', 1)[1])
    parts = [r.get(k) for k in ('parallelize_s', 'prefill_program_s', 'generation_programs_s', 'static_decode_s', 'first_generate_s')]
    total = sum(p for p in parts if p)
    print(r['model'], 'lazy' if r.get('lazy_forward') else 'eager', 'cached' if 'cached' in '$round' else '', ' / '.join(f'{p:.2f}' for p in parts if p is not None), 'total', f'{total:.2f}')
"
done
