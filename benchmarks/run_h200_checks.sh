#!/usr/bin/env bash
# Two calls on one H200 (device tool, kind nvidia-h200, up to 9 minutes each). On a cold machine
# the tests spend most of their time compiling kernels (at 2eef27a, 124 tests in 401 s with one
# process per file), so they get a call of their own:
#
#   device run: bash benchmarks/run_h200_checks.sh tests   # GPU tests: the three kernels, packing, kernel swap
#   device run: bash benchmarks/run_h200_checks.sh bench   # the scan's defaults, Mamba-1 training, bench_train_layouts.py
#   device run (carry .sdist, or .peers): bash benchmarks/run_h200_checks.sh peers
#       # every kernel beside its peer (see below); a call without .peers builds them (6 minutes)
#       # and returns them packed in $OUT: copy the parts into .peers/ to carry next time.
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
  # Every kernel beside its peer: the Mamba-1 scan (with CUDA-graph forwards), SSD and the conv.
  # The peers come unpacked from .peers/ when an earlier call left them there (carry .peers),
  # else they build here (build_peers.sh, about 6 minutes) and come back packed in $OUT for the
  # next call. Meanwhile a first pass without them compiles our kernels and times the forward
  # with 32-channel tiles everywhere (the default before the eighth session) for an A/B in one
  # run. Results are tarred into $OUT/results.tar (at most 8 files come back).
  r="$OUT/r"; mkdir -p "$r"
  if ls .peers/peers.tar.xz.part* > /dev/null 2>&1; then
    cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp && touch /tmp/peers_built_mamba_ssm /tmp/peers_built_causal_conv1d
  else
    ( timeout 500 bash benchmarks/build_peers.sh > "$r/build_peers.log" 2>&1 \
        && find /tmp/peers -name "*.so" -exec strip --strip-debug {} + \
        && tar cf - -C /tmp peers | xz -T16 -3 | split -b 15m -d - "$OUT/peers.tar.xz.part" ) &
  fi
  nice -n 5 timeout 150 python3 benchmarks/bench_selective_scan.py --no-mamba --graphs --fwd-block-d 32 \
    --out "$r/bench_selective_scan_bd32.json" 2>&1 | quiet > "$r/bench_selective_scan_bd32.log"
  timeout 60 python3 -m pytest tests/test_kernel_selective_scan.py -k default_config -rA -p no:logging -p no:cacheprovider > "$r/tests_default_config.log" 2>&1
  for i in $(seq 300); do [ -e /tmp/peers_built_mamba_ssm ] && break; sleep 1; done
  export PYTHONPATH=$PWD:/tmp/peers
  timeout 160 python3 benchmarks/bench_selective_scan.py --graphs --profile --out "$r/bench_selective_scan.json" 2>&1 | quiet > "$r/bench_selective_scan.log"
  timeout 180 python3 benchmarks/bench_ssd_scan.py --profile --out "$r/bench_ssd_scan.json" 2>&1 | quiet > "$r/bench_ssd_scan.log"
  for i in $(seq 200); do [ -e /tmp/peers_built_causal_conv1d ] && break; sleep 1; done
  timeout 50 python3 benchmarks/bench_causal_conv1d.py --no-sweep --out "$r/bench_causal_conv1d.json" 2>&1 | quiet > "$r/bench_causal_conv1d.log"
  wait
  tar cf "$OUT/results.tar" -C "$OUT" r && rm -rf "$r"
  ls -l "$OUT"; tar xOf "$OUT/results.tar" r/bench_selective_scan.log | tail -14
else
  timeout 150 python3 benchmarks/bench_selective_scan.py --no-mamba --out "$OUT/bench_selective_scan.json" 2>&1 | quiet > "$OUT/scan.log"
  timeout 240 python3 benchmarks/train_packed.py --models mamba --padded-order both --out "$OUT" 2>&1 | quiet > "$OUT/train.log"
  timeout 80 python3 benchmarks/bench_train_layouts.py --out "$OUT" 2>&1 | quiet > "$OUT/layouts.log"
  tail -12 "$OUT/scan.log"; tail -10 "$OUT/train.log"; cat "$OUT/layouts.log"
fi
