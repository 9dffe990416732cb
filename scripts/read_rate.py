"""Read-only stream rates on this GPU beside the copy rate: the ceiling a weight stream can reach,
which the floors (bytes at the copy rate, read + written) understate by a few percent.

    PYTHONPATH=. python3 scripts/read_rate.py OUT.json        (a GPU, torch and CuPy; ~20 s)

readv: one 16-byte load a thread a trip; readv4: four in flight (grids of 2-16 blocks an SM on 132
SMs); torch's sum and amax; torch's copy. Each in the steady state (0.3 s of load, then the median of
7 repetitions of 20 calls: cupymoe.bench.torch_seconds_a_call, the ceilings' method), over 4 GiB
(far past the L2). Run from the repository root (PYTHONPATH=.)."""
import json
import sys

import cupy
import torch

from cupymoe.bench import torch_seconds_a_call


def steady(fn):
    return torch_seconds_a_call(fn)[0]


a = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()  # 4 GiB
b = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
nb = a.numel() * 2
src = r'''
extern "C" __global__ void readv(const uint4* __restrict__ p, size_t n, unsigned* out) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i); x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) out[0] = x;
}
extern "C" __global__ void readv4(const uint4* __restrict__ p, size_t n, unsigned* out) {
    unsigned x = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v0 = __ldg(p + i), v1 = __ldg(p + i + stride), v2 = __ldg(p + i + 2 * stride), v3 = __ldg(p + i + 3 * stride);
        x ^= v0.x ^ v1.y ^ v2.z ^ v3.w ^ v0.w ^ v1.x ^ v2.y ^ v3.z;
    }
    for (; i < n; i += stride) { uint4 v = __ldg(p + i); x ^= v.x ^ v.w; }
    if (x == 0x12345678u) out[0] = x;
}
'''
mod = cupy.RawModule(code=src, options=("-std=c++17",))
out = cupy.zeros(1, cupy.uint32)
ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(a.data_ptr(), nb, a), 0)
n16 = nb // 16
res = {}
s = torch.cuda.current_stream().cuda_stream
cs = cupy.cuda.ExternalStream(s)
for name in ("readv", "readv4"):
    k = mod.get_function(name)
    for blocks_per_sm, threads in ((4, 512), (8, 256), (16, 256), (2, 1024)):
        g = 132 * blocks_per_sm
        fn = lambda: k((g,), (threads,), (ptr, cupy.uint64(n16), out), stream=cs)
        res[f"{name} {g}x{threads}"] = nb / steady(fn) / 1e12
res["torch sum fp32"] = nb / steady(lambda: a.sum(dtype=torch.float32)) / 1e12
res["torch amax"] = nb / steady(lambda: a.amax()) / 1e12
half = a[: 2**30]
res["copy (read+write)"] = 2 * 2**31 / steady(lambda: b.copy_(half)) / 1e12
for key, val in res.items():
    print(f"{key:<28} {val:.3f} TB/s")
json.dump({k: round(v, 3) for k, v in res.items()}, open(sys.argv[1], "w"), indent=1)
