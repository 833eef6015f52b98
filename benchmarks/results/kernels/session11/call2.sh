export PYTHONPATH=$PWD
mkdir -p $OUT/r
python3 scratch/ab_states.py 2>&1 | grep -v -i warn | tee $OUT/r/ab_states.log | tail -25
cp $OUT/ab_states.json $OUT/r/ 2>/dev/null
python3 -m pytest tests/test_kernel_ssd_scan.py -rA -q -p no:logging 2>&1 | tail -30 > $OUT/r/tests_ssd.log; tail -3 $OUT/r/tests_ssd.log
tar cf $OUT/results.tar -C $OUT r
