# Session 11, call 4 (repo root): dt-kernel sweep, then the five GPU test files.
export PYTHONPATH=$PWD
python3 benchmarks/results/kernels/session11/dt_sweep.py $OUT/dt_sweep.json 2>&1 | grep -v -i warn > $OUT/dt_sweep.log
cat $OUT/dt_sweep.log
bash benchmarks/run_h200_checks.sh tests
