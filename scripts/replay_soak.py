"""Long runs: captured forwards replayed many times, every output checked bitwise against the
first; and device memory before and after building and dropping many layers.

    python scripts/replay_soak.py --replays 100000 --layers 100

For each path (decode, prefill) and weight format, one forward and a comparison kernel are captured
into one graph: the comparison counts, on the device, every element of the replay's output unlike
the first output, so 10^5 replays need one read at the end. Exit 1 on any difference or leak.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

COUNT = r'''extern "C" __global__ void count_unlike(const unsigned short* a, const unsigned short* b, long long n,
                                           unsigned long long* unlike) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        if (a[i] != b[i]) atomicAdd(unlike, 1ull);
}'''


def soak(layer, cfg, n: int, path: str, replays: int, rng) -> tuple[int, float]:
    """(elements unlike the first output over every replay, seconds)."""
    import cupy

    from cupymoe.verify import bf16_bits

    count = cupy.RawKernel(COUNT, "count_unlike")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.asarray(bf16_bits(rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)))
        first = cupy.full(x.shape, 0x7FC0, cupy.uint16)
        out = cupy.full(x.shape, 0x7FC0, cupy.uint16)
        unlike = cupy.zeros(1, cupy.uint64)
    layer.forward(int(x.data.ptr), n, int(first.data.ptr), s.ptr, path=path)
    s.begin_capture()
    layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr, path=path)
    count((64,), (256,), (out, first, np.int64(out.size), unlike), stream=s)
    g = s.end_capture()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.launch(s)
    s.synchronize()
    return int(unlike.get()[0]), time.perf_counter() - t0


def build_and_drop(make, count: int) -> tuple[int, int]:
    """Device bytes in use (driver's view) before and after building and dropping `count` layers."""
    import cupy

    def used() -> int:
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        cupy.cuda.runtime.deviceSynchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    make()  # the kernel library and the first allocations of the process
    before = used()
    for _ in range(count):
        layer = make()
        del layer
    return before, used()


def main() -> int:
    from cupymoe import MoeLayer, testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=100000)
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_block", "nvfp4", "mxfp4"])
    args = ap.parse_args()
    rng = np.random.default_rng(3)
    cfg = testing.tiny_config("deepseek_v3")
    bad = 0
    for fmt in args.formats:
        hw = testing.random_host_weights(cfg, rng, fmt)
        layer = MoeLayer(cfg, hw, max_tokens=256, decode_max_tokens=16)
        for n, path in ((4, "decode"), (256, "prefill")):
            unlike, seconds = soak(layer, cfg, n, path, args.replays, rng)
            bad += unlike != 0
            print(f"replay_soak: {fmt} {path} N={n}: {args.replays} replays in {seconds:.1f} s, "
                  f"{unlike} elements unlike the first output", flush=True)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    before, after = build_and_drop(lambda: MoeLayer(cfg, hw, max_tokens=256), args.layers)
    bad += before != after
    print(f"replay_soak: device memory in use {before} bytes before {args.layers} layers were built and dropped, "
          f"{after} after")
    print(f"replay_soak: {'all equal' if not bad else f'{bad} FAILED'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
