# Session 11, call 5 (repo root, .peers carried): the SSD, packing and kernel-swap test files
# side by side (one process each), then the SSD bench with both sides' kernels profiled.
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
export PYTHONPATH=$PWD
for f in kernel_ssd_scan packing swap_kernels; do
  timeout 400 python3 -m pytest "tests/test_$f.py" -rA -p no:logging -p no:cacheprovider > "$OUT/tests_$f.log" 2>&1 &
done
wait
for f in kernel_ssd_scan packing swap_kernels; do echo "$f: $(grep -c "^PASSED" "$OUT/tests_$f.log") passed, $(grep -c "^FAILED" "$OUT/tests_$f.log") failed"; tail -1 "$OUT/tests_$f.log"; done
export PYTHONPATH=$PWD:/tmp/peers
timeout 190 python3 benchmarks/bench_ssd_scan.py --profile --out $OUT/bench_ssd_scan.json 2>&1 | grep -v -i warn > $OUT/bench_ssd_scan.log
tail -8 $OUT/bench_ssd_scan.log
# Replays of call 4's failures at their seeds (the row-end cs_last read, fixed in 7c063f3).
export PYTHONPATH=$PWD
SSMSHARD_TEST_SEED=917710232 python3 -m pytest tests/test_packing.py -k "kernels_equals_each_sequence_alone and mamba2" -p no:logging -q 2>&1 | tail -1
SSMSHARD_TEST_SEED=543125953 python3 -m pytest "tests/test_kernel_ssd_scan.py::test_strong_decay_overflows_above_diagonal[cb_stored]" -p no:logging -q 2>&1 | tail -1
SSMSHARD_TEST_SEED=4240593045 python3 -m pytest "tests/test_kernel_ssd_scan.py::test_strong_decay_overflows_above_diagonal[cb_inline]" -p no:logging -q 2>&1 | tail -1
