#!/usr/bin/env bash
# What a device call carries, made on this machine (PyPI reachable), each step skipped where its
# output is there already:
#   .whl/           the nvtx wheel for the device image's Python (cp312, not this machine's)
#   .peer/          vLLM's Triton kernel and H200 configs (the shared peers' get_vllm_kernel.sh) and
#                   the two peer_bench scripts beside them (scripts/serving_check.sh reads them there)
#   .kcache.tar.xz  the kernel cache of this tree, packed with the device's NVRTC 13.0 from a scratch
#                   venv (scripts/kernel_cache_pack.py; ~2.5 min on 2 cores), rebuilt every run: the
#                   cache keys follow the sources
# then carry [".whl", ".peer", ".kcache.tar.xz"] (all three are ignored by git).
#
#   bash scripts/device_setup.sh            (SHARED: the shared folder, default ../shared;
#                                            KCACHE_VENV: the NVRTC 13.0 venv, default /tmp/cupymoe-nvrtc13)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
DEVICE_PY=${DEVICE_PY:-3.12}
mkdir -p .whl
if ! ls .whl/nvtx-*-cp${DEVICE_PY/./}-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PY" \
    --platform manylinux_2_28_x86_64 nvtx -d .whl
fi
[ -f .peer/vllm_kernel.py ] || bash "$SHARED/peers/get_vllm_kernel.sh"
cp -f "$SHARED/peers/peer_bench.py" "$SHARED/peers/peer_bench_fp8.py" .peer/
VENV=${KCACHE_VENV:-/tmp/cupymoe-nvrtc13}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q cupy-cuda13x "cuda-toolkit[nvrtc]==13.0.*" numpy ml_dtypes
fi
"$VENV/bin/python" scripts/kernel_cache_pack.py --out .kcache.tar.xz .
ls -la .whl .peer/*.py .kcache.tar.xz
