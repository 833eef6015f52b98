#!/usr/bin/env bash
# Session 14, call 3: the in-kernel chain unrolled by 8. GPU tests of the Mamba-1 kernels while mamba-ssm builds,
# then an interleaved A/B against HEAD's tree (scratch/old), the peer in the new tree's processes.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
(bash benchmarks/build_peers.sh > "$OUT/build_peers.log" 2>&1; cd /tmp && tar cf - peers | xz -1 | split -b 15M - "$OUT/peers.tar.xz.part") &
timeout 270 python3 -m pytest tests/test_kernel_selective_scan.py -q -p no:logging -p no:cacheprovider -rf > "$OUT/tests_selective_scan.log" 2>&1
echo "tests rc $?"; tail -2 "$OUT/tests_selective_scan.log"
wait
for r in 1 2; do
  PYTHONPATH=scratch/old/benchmarks:/tmp/peers timeout 80 python3 scratch/ab_scan.py old 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
  PYTHONPATH=benchmarks:/tmp/peers timeout 100 python3 scratch/ab_scan.py new --peer 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
done
