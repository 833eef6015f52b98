#!/usr/bin/env bash
# Session 15's prepared GPU call (not run: the session had no device time): B and C read a tile ahead in the
# Mamba-1 parallel forward (ScanConfig.par_prefetch_bc), swept at batch 1 over tiles and segment counts beside
# mamba-ssm (carried in .peers); forward+backward with the backward's own split (ScanConfig.bwd_segments);
# the new GPU tests. Run with: carry [".peers"], about 8 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
patch=benchmarks/results/kernels/session15/fwd_prefetch_bc.patch
if git apply --check "$patch" 2>/dev/null; then git apply "$patch"; echo "applied $patch"; fi
grep -q PREFETCH_BC ssmshard/kernels/selective_scan_fwd_parallel.py || { echo "the patch is not in this tree"; exit 1; }
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
timeout 150 python3 -m pytest tests/test_kernel_selective_scan.py -k "prefetch or own_way or short_tile" -q \
  -p no:logging -p no:cacheprovider -rf > "$OUT/tests_prefetch.log" 2>&1
echo "tests rc $?"; tail -2 "$OUT/tests_prefetch.log"
PYTHONPATH=/tmp/peers timeout 240 python3 benchmarks/sweep_scan_split.py --out "$OUT/sweep_scan_split.json" \
  --lengths 2048 4096 8192 16384 --tiles 8:none:0 8:none:1 16:none:0 16:none:1 32:none:1 \
  --segments 1 2 3 4 6 8 11 16 22 > "$OUT/sweep.log" 2>&1
echo "sweep rc $?"; tail -3 "$OUT/sweep.log"
PYTHONPATH=benchmarks:benchmarks/results/kernels/session15 timeout 120 \
  python3 benchmarks/results/kernels/session15/fwd_bwd_split.py > "$OUT/fwd_bwd_split.jsonl" 2> "$OUT/fwd_bwd_split.err"
echo "fwd_bwd rc $?"; cat "$OUT/fwd_bwd_split.jsonl"
