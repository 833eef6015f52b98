#!/usr/bin/env bash
# Session 14, call 8: the parallel backward's per-token inputs loaded one tile ahead. A/B against 70c976c's
# tree (scratch/old) with mamba-ssm beside, then the GPU tests of the parallel backward and packing on kernels.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cat .peers/peers.tar.xz.part* | xz -d | tar xf - -C /tmp
for r in 1 2; do
  PYTHONPATH=scratch/old/benchmarks:/tmp/peers timeout 70 python3 scratch/ab_scan.py old 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
  peer=""; [ $r = 1 ] && peer=--peer
  PYTHONPATH=benchmarks:/tmp/peers timeout 90 python3 scratch/ab_scan.py new $peer 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
done
run() { timeout 170 python3 -m pytest $2 -k "$3" -p no:logging -p no:cacheprovider -rf > "$OUT/tests_$1.log" 2>&1; echo "$1 rc $?"; tail -1 "$OUT/tests_$1.log"; }
run scan_bwd tests/test_kernel_selective_scan.py "parallel_bwd or default_config or packed_equals or no_grad or matches_reference" &
run packing tests/test_packing.py "kernels" &
wait
