#!/usr/bin/env bash
# Build the optional benchmark peers (mamba-ssm, causal-conv1d) from their sdists for sm_90 only,
# into /tmp/peers (add it to PYTHONPATH). Sdists are carried in .sdist/ (no network on the GPU
# machines); fetch them with: python - < benchmarks/fetch_peer_sdists.py
set -euo pipefail
work=/tmp/peer_build; rm -rf "$work"; mkdir -p "$work" /tmp/peers
for tarball in .sdist/*.tar.gz; do tar xzf "$tarball" -C "$work"; done
for setup in "$work"/*/setup.py; do
  python3 - "$setup" <<'PY'
import re, sys
path = sys.argv[1]
src = open(path).read()
# Their setup.py appends -gencode flags for sm_75..sm_121: keep sm_90 alone (a few minutes
# instead of an hour on the H200 machines).
out = []
for line in src.splitlines(keepends=True):
    if re.search(r'cc_flag\.append\("arch=compute_\d+,code=sm_\d+"\)', line) and "sm_90\"" not in line:
        indent = line[:len(line) - len(line.lstrip())]
        if out and '"-gencode"' in out[-1]:
            out[-1] = indent + "pass\n"
        line = indent + "pass\n"
    out.append(line)
open(path, "w").write("".join(out))
PY
done
# The two packages build side by side, each with all the jobs: mamba-ssm has 10 nvcc units and
# causal-conv1d 4, so together they fit 16 cores, and the wall time is their longest unit. On one
# H200 machine causal-conv1d alone took over 5 minutes, so one after the other did not fit a
# 10-minute call. mamba-ssm's selective_scan_fn does not need causal-conv1d.
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE
for pkg in "$work"/mamba_ssm-* "$work"/causal_conv1d-*; do
  # /tmp/peers_built_<package> marks each package done, so that a caller can start using
  # mamba-ssm (2.5 minutes) before causal-conv1d (6 minutes) is ready.
  ( cd "$pkg" && time python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target /tmp/peers . \
      && touch "/tmp/peers_built_$(basename "$pkg" | cut -d- -f1)" ) &
done
wait
# torch first: the extensions link against its libraries.
PYTHONPATH=/tmp/peers python3 -c "import torch, selective_scan_cuda; print('mamba-ssm built')"
PYTHONPATH=/tmp/peers python3 -c "import torch, causal_conv1d_cuda; print('causal-conv1d built')"
