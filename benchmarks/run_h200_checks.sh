#!/usr/bin/env bash
# Two calls on one H200 (device tool, kind nvidia-h200, up to 9 minutes each). On a cold machine
# the tests spend most of their time compiling kernels (at 2eef27a, 124 tests in 401 s with one
# process per file), so they get a call of their own:
#
#   device run: bash benchmarks/run_h200_checks.sh tests   # GPU tests: the three kernels, packing, kernel swap
#   device run: bash benchmarks/run_h200_checks.sh bench   # the scan's defaults, Mamba-1 training, bench_train_layouts.py
#   device run (carry .sdist): bash benchmarks/run_h200_checks.sh peers
#       # the Mamba-1 scan and its segment sweep beside mamba-ssm's selective_scan_fn. The peers
#       # build (build_peers.sh, side by side since the seventh session; untested that way) while a
#       # first pass without them compiles every config.
#
# Logs and JSON under $OUT (at most 8 files come back: keep it to these).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
quiet() { grep -v -i "warn\|falling back"; }
if [ "${1:-tests}" = tests ]; then
  # One pytest process per file: compiling is single-threaded per process and dominates a cold
  # run, so five processes on the 16 host cores finish far sooner than one.
  for f in kernel_selective_scan kernel_ssd_scan kernel_causal_conv1d packing swap_kernels; do
    timeout 540 python3 -m pytest "tests/test_$f.py" -rA -p no:logging -p no:cacheprovider > "$OUT/tests_$f.log" 2>&1 &
  done
  wait
  for f in kernel_selective_scan kernel_ssd_scan kernel_causal_conv1d packing swap_kernels; do echo "$f: $(grep -c "PASSED" "$OUT/tests_$f.log") passed, $(grep -c "FAILED" "$OUT/tests_$f.log") failed"; done
elif [ "$1" = peers ]; then
  # The first pass only compiles (niced, so that the build keeps the cores); the second times.
  ( MAX_JOBS=16 timeout 420 bash benchmarks/build_peers.sh > "$OUT/build_peers.log" 2>&1 ) &
  nice -n 19 timeout 400 python3 benchmarks/bench_selective_scan.py --sweep-segments --only-sweeps --no-mamba \
    --out "$OUT/bench_selective_scan_warm.json" 2>&1 | quiet > "$OUT/bench_selective_scan_warm.log"
  wait
  tail -3 "$OUT/build_peers.log"
  PYTHONPATH=$PWD:/tmp/peers timeout 170 python3 benchmarks/bench_selective_scan.py --sweep-segments \
    --out "$OUT/bench_selective_scan_segments.json" 2>&1 | quiet > "$OUT/bench_selective_scan_segments.log"
  tail -80 "$OUT/bench_selective_scan_segments.log"
else
  timeout 150 python3 benchmarks/bench_selective_scan.py --no-mamba --out "$OUT/bench_selective_scan.json" 2>&1 | quiet > "$OUT/scan.log"
  timeout 240 python3 benchmarks/train_packed.py --models mamba --padded-order both --out "$OUT" 2>&1 | quiet > "$OUT/train.log"
  timeout 80 python3 benchmarks/bench_train_layouts.py --out "$OUT" 2>&1 | quiet > "$OUT/layouts.log"
  tail -12 "$OUT/scan.log"; tail -10 "$OUT/train.log"; cat "$OUT/layouts.log"
fi
