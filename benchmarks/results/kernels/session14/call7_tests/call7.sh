#!/usr/bin/env bash
# Session 14, call 7: the whole Mamba-1 kernel test file on the GPU, in three pytest processes side by side
# (call 6's single process compiled for 330 s and reached 38 of 52).
set -uo pipefail
mkdir -p "$OUT"
run() { timeout 450 python3 -m pytest tests/test_kernel_selective_scan.py -k "$2" -p no:logging -p no:cacheprovider -rf > "$OUT/tests_selective_scan_$1.log" 2>&1; echo "$1 rc $?"; tail -1 "$OUT/tests_selective_scan_$1.log"; }
run a "test_scan_fp32" &
run b "(segment or packed) and not test_scan_fp32" &
run c "not (test_scan_fp32 or segment or packed)" &
wait
