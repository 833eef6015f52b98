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
