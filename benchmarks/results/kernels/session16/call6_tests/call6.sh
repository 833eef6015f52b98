#!/usr/bin/env bash
# GPU tests of the kernels at this tree (sixteenth session): four pytest processes side by side,
# logs under $OUT. Run with: no carry, nvidia-h200.
set -uo pipefail
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/device.txt"
run() {  # name, pytest arguments...
  local name=$1; shift
  timeout 540 python3 -m pytest "$@" -p no:cacheprovider -p no:logging -rfE > "$OUT/$name.log" 2>&1
  echo "$name rc $?" >> "$OUT/rc.txt"
}
run scan_parallel tests/test_kernel_selective_scan.py -k "parallel or segment or prefetch or split" &
run scan_rest tests/test_kernel_selective_scan.py -k "not (parallel or segment or prefetch or split)" &
run ssd_conv tests/test_kernel_ssd_scan.py tests/test_kernel_causal_conv1d.py &
run packing_swap tests/test_packing.py tests/test_swap_kernels.py &
wait
cat "$OUT/rc.txt"; for f in "$OUT"/*.log; do echo "== $f"; tail -3 "$f"; done
