# Session 11, call 3 (run from the repo root with .peers carried): the SSD bench with both
# sides' kernels profiled, then the SSD test file on the GPU.
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
export PYTHONPATH=$PWD:/tmp/peers
mkdir -p $OUT/r
python3 benchmarks/bench_ssd_scan.py --profile --out $OUT/r/bench_ssd_scan.json 2>&1 | grep -v -i warn > $OUT/r/bench_ssd_scan.log
tail -20 $OUT/r/bench_ssd_scan.log
python3 -m pytest tests/test_kernel_ssd_scan.py -rA -p no:logging 2>&1 | tail -40 > $OUT/r/tests_kernel_ssd_scan.log
tail -2 $OUT/r/tests_kernel_ssd_scan.log
tar cf $OUT/results.tar -C $OUT r
