# Session 11, call 6 (repo root; carry .peers and scratch/old_tree = `git archive cf948bb ssmshard`):
# the packed Mamba-2 kernel test at call 4's failing seed and four more, on cf948bb's kernels
# and on this tree's; then the SSD bench (chunk-states autotune keyed on chunks per sequence too).
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
for tree in old new; do
  if [ $tree = old ]; then P=$PWD/scratch/old_tree:$PWD; else P=$PWD; fi
  PYTHONPATH=$P python3 -c "import ssmshard, sys; print('$tree', ssmshard.__file__)"
  for seed in 917710232 1 2 3 4; do
    echo "$tree seed $seed: $(PYTHONPATH=$P SSMSHARD_TEST_SEED=$seed python3 -m pytest tests/test_packing.py -k 'kernels_equals_each_sequence_alone and mamba2' -p no:logging -p no:cacheprovider -q 2>&1 | grep -E 'AssertionError:|passed|failed' | head -2 | tr '\n' ' ')"
  done
done 2>&1 | tee $OUT/packing_seeds.log
PYTHONPATH=$PWD:/tmp/peers timeout 300 python3 benchmarks/bench_ssd_scan.py --profile --out $OUT/bench_ssd_scan.json 2>&1 | grep -v -i warn > $OUT/bench_ssd_scan.log
tail -8 $OUT/bench_ssd_scan.log
