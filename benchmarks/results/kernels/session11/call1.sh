set -x
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
export PYTHONPATH=$PWD:/tmp/peers
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
python3 scratch/ab_states.py 2>&1 | tee $OUT/r/ab_states.log
for s in "1 2048" "1 16384" "8 2048"; do set -- $s
  python3 benchmarks/ncu_ssd_forward.py --batch $1 --length $2 --out $OUT/r/fwd_b$1_l$2.json 2>&1 | grep -v Warning | tee $OUT/r/fwd_b$1_l$2.log
done
cp $OUT/ab_states.json $OUT/r/ 2>/dev/null
tar cf $OUT/results.tar -C $OUT r
