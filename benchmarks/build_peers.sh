#!/usr/bin/env bash
# Build the kernel benchmarks' peers (mamba-ssm, causal-conv1d) from their sdists for one GPU
# architecture into /tmp/peers; then put /tmp/peers on PYTHONPATH.
#
#   bash benchmarks/build_peers.sh [SDIST_DIR]      # PEER_ARCH=90 (default: sm_90, H100/H200)
#
# SDIST_DIR holds mamba_ssm-*.tar.gz and causal_conv1d-*.tar.gz (default .sdist/); when it has
# none they are downloaded there with pip. Needs torch with CUDA and nvcc.
set -euo pipefail
sdists=${1:-.sdist}
arch=${PEER_ARCH:-90}
mkdir -p "$sdists"
if ! ls "$sdists"/mamba_ssm-*.tar.gz "$sdists"/causal_conv1d-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip download --no-deps --no-binary :all: -d "$sdists" mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
fi
work=/tmp/peer_build; rm -rf "$work"; mkdir -p "$work" /tmp/peers
for tarball in "$sdists"/*.tar.gz; do tar xzf "$tarball" -C "$work"; done
for setup in "$work"/*/setup.py; do
  python3 - "$setup" "$arch" <<'PY'
import re, sys
path, arch = sys.argv[1], sys.argv[2]
src = open(path).read()
# Their setup.py appends -gencode flags for sm_75..sm_121: keep the one architecture asked for
# (minutes instead of an hour).
out = []
for line in src.splitlines(keepends=True):
    if re.search(r'cc_flag\.append\("arch=compute_\d+,code=sm_\d+"\)', line) and f'sm_{arch}"' not in line:
        indent = line[:len(line) - len(line.lstrip())]
        if out and '"-gencode"' in out[-1]:
            out[-1] = indent + "pass\n"
        line = indent + "pass\n"
    out.append(line)
open(path, "w").write("".join(out))
PY
done
# The two packages build side by side, each with all the jobs (mamba-ssm has 10 nvcc units,
# causal-conv1d 4): the wall time is then their longest unit, not the sum. mamba-ssm's
# selective_scan_fn does not need causal-conv1d.
export TORCH_CUDA_ARCH_LIST="${arch:0:1}.${arch:1}" MAX_JOBS=${MAX_JOBS:-$(nproc)} MAMBA_FORCE_BUILD=TRUE \
  CAUSAL_CONV1D_FORCE_BUILD=TRUE
for pkg in "$work"/mamba_ssm-* "$work"/causal_conv1d-*; do
  ( cd "$pkg" && python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target /tmp/peers . ) &
done
wait
# torch first: the extensions link against its libraries.
PYTHONPATH=/tmp/peers python3 -c "import torch, selective_scan_cuda; print('mamba-ssm built')"
PYTHONPATH=/tmp/peers python3 -c "import torch, causal_conv1d_cuda; print('causal-conv1d built')"
