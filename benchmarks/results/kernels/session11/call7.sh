# Session 11, call 7 (repo root; carry scratch/old_tree = `git archive cf948bb ssmshard`): the
# packed Mamba-2 kernel test at call 4's failing seed on cf948bb's kernels, run from inside the
# old tree so that its ssmshard is the one imported (call 6's "old" runs imported this tree's).
cp -r tests scratch/old_tree/ && cd scratch/old_tree
python3 -c "import ssmshard; print(ssmshard.__file__)"
for seed in 917710232 5 6; do
  echo "cf948bb seed $seed: $(SSMSHARD_TEST_SEED=$seed python3 -m pytest tests/test_packing.py -k 'kernels_equals_each_sequence_alone and mamba2' -p no:logging -p no:cacheprovider -rA 2>&1 | grep -E 'AssertionError:|passed|failed' | head -2 | tr '\n' ' ')"
done
