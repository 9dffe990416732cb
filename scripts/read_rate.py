"""Read-only stream rates on this GPU beside the copy rate: the ceiling a weight stream can reach,
which the floors (bytes at the copy rate, read + written) understate by a few percent.

    python3 scripts/read_rate.py OUT.json        (a GPU, torch and CuPy; ~20 s)

readv: one 16-byte load a thread a trip; readv4: four in flight (grids of 2-16 blocks an SM);
torch's sum and amax; torch's copy. Each in the steady state (cupymoe.ceilings.torch_seconds_a_call,
the ceilings' method: 0.3 s of load, then the median of 7 repetitions of 20 calls), over 4 GiB
(far past the L2). OUT.json: {"meta": {gpu, date, commit, command, what}, "rates_TBps": {...}}."""
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SRC = r'''
extern "C" __global__ void readv(const uint4* __restrict__ p, size_t n, unsigned* out) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) out[0] = x;  // keeps the loads; never true in practice
}
extern "C" __global__ void readv4(const uint4* __restrict__ p, size_t n, unsigned* out) {
    unsigned x = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v0 = __ldg(p + i), v1 = __ldg(p + i + stride), v2 = __ldg(p + i + 2 * stride), v3 = __ldg(p + i + 3 * stride);
        x ^= v0.x ^ v1.y ^ v2.z ^ v3.w ^ v0.w ^ v1.x ^ v2.y ^ v3.z;
    }
    for (; i < n; i += stride) {
        uint4 v = __ldg(p + i);
        x ^= v.x ^ v.w;
    }
    if (x == 0x12345678u) out[0] = x;
}
'''


def rates() -> dict[str, float]:
    import cupy
    import torch

    from cupymoe.ceilings import torch_seconds_a_call
    from cupymoe.debug import cupy_stream

    def steady(fn):
        return torch_seconds_a_call(fn)[0]

    a = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()  # 4 GiB
    b = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    nb = a.numel() * a.element_size()
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",))
    out = cupy.zeros(1, cupy.uint32)
    ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(a.data_ptr(), nb, a), 0)
    stream = cupy_stream(torch.cuda.current_stream().cuda_stream, 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}
    for name in ("readv", "readv4"):
        kernel = mod.get_function(name)
        for blocks_per_sm, threads in ((4, 512), (8, 256), (16, 256), (2, 1024)):
            grid = sms * blocks_per_sm
            res[f"{name} {grid}x{threads}"] = nb / steady(
                lambda: kernel((grid,), (threads,), (ptr, cupy.uint64(nb // 16), out), stream=stream)) / 1e12
    res["torch sum fp32"] = nb / steady(lambda: a.sum(dtype=torch.float32)) / 1e12
    res["torch amax"] = nb / steady(lambda: a.amax()) / 1e12
    half = a[: b.numel()]
    res["copy (read+write)"] = 2 * b.numel() * b.element_size() / steady(lambda: b.copy_(half)) / 1e12
    return res


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    from cupymoe.bench import _git_commit

    res = rates()
    for key, val in res.items():
        print(f"{key:<28} {val:.3f} TB/s")
    meta = dict(gpu=torch.cuda.get_device_name(0), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                commit=_git_commit(), command="python3 scripts/read_rate.py OUT.json",
                what="TB/s over 4 GiB in the steady state; readv / readv4: 16-byte loads, one or four in flight a "
                     "thread, grid blocks x threads; copy counts bytes read + written")
    with open(sys.argv[1], "w") as f:
        json.dump({"meta": meta, "rates_TBps": {k: round(v, 3) for k, v in res.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
