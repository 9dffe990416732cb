"""How fast can TMA boxes stream a weight matrix, by the shape of what a stage asks for? The
swap-AB decodes (cuda/decode_swapab_sm90.cu) bring each stage as 64-row boxes of one 128-byte
row of K: each box touches 64 rows 128 bytes apiece, and a row's next 128 bytes come a stage
later. This streams qwen3-30b-a3b's gate and up weights (bf16, 128 experts: 805 MB) through the
swap-AB decode's ring (one consumer warpgroup that only waits and frees, a producer warp, 2 blocks
an SM, 128 weight rows a block) and varies:

  bks     boxes along K a stage (1: the kernels' 128 bytes of a row; 2, 4: 256 / 512 contiguous bytes
          of each row asked for at once)
  stages  the ring's depth (bytes in flight a block: stages x bks x 16 KB)
  tiled   the matrix laid out in 64 x 64 tiles, each box 8 KB contiguous (the upper bound of a
          repacked layout)
  promo   the tensor map's L2 promotion (none, 128, 256 bytes; the layer's weight maps took 256 before
          this probe, 128 since: benchmarks/DECISIONS.md "The weight maps' L2 promotion")

and prints each form's TB/s beside the read ceiling (16-byte loads, four in flight; DECISIONS "The
read ceiling"). Needs a GPU and CuPy.

    python3 scripts/tma_stream_probe.py [OUT.json]
"""

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SRC = r'''
typedef unsigned long long u64;
__device__ __forceinline__ unsigned su32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_wait(u64* b, int parity) {
    asm volatile("{\n.reg .pred d;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n@!d bra W;\n}\n"
                 ::"r"(su32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void box(void* dst, const void* map, int c0, int c1, u64* b) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(su32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(su32(b)) : "memory");
}
// grid (slabs of 128 rows), 160 threads: warps 0-3 consume (wait, free), warp 4's lane 0 copies.
// K in 64-element steps; a stage holds BKS steps of both 64-row tiles. tiled: box (kt, tile) at
// row (tile * KT + kt) * 64 of a [R / 64 * KT * 64, 64] view.
template <int BKS, int S, bool TILED>
__global__ void __launch_bounds__(160, 2) stream(const unsigned char* maps, int KT, unsigned* sink) {
    extern __shared__ __align__(1024) unsigned char sm[];
    const unsigned pad = (1024u - (su32(sm) & 1023u)) & 1023u;
    unsigned char* ring = sm + pad;
    constexpr int STAGE = BKS * 2 * 8192;
    u64* full = reinterpret_cast<u64*>(ring + S * STAGE);
    u64* empty = full + S;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(su32(&full[s])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;\n" ::"r"(su32(&empty[s])));
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int steps = KT / BKS, tile0 = blockIdx.x * 2;
    if (threadIdx.x >= 128) {
        if (threadIdx.x != 128) return;
        for (int g = 0; g < steps; ++g) {
            const int s = g % S;
            if (g >= S) bar_wait(&empty[s], ((g / S) - 1) & 1);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(su32(&full[s])), "r"(STAGE) : "memory");
            for (int b = 0; b < BKS; ++b)
                for (int t = 0; t < 2; ++t) {
                    const int kt = g * BKS + b, tile = tile0 + t;
                    unsigned char* dst = ring + s * STAGE + (t * BKS + b) * 8192;
                    if (TILED) box(dst, maps, 0, (tile * KT + kt) * 64, &full[s]);
                    else box(dst, maps, kt * 64, tile * 64, &full[s]);
                }
        }
        return;
    }
    unsigned x = 0;
    for (int g = 0; g < steps; ++g) {
        const int s = g % S;
        bar_wait(&full[s], (g / S) & 1);
        x ^= reinterpret_cast<const unsigned*>(ring + s * STAGE)[threadIdx.x];
        __syncwarp();
        if ((threadIdx.x & 31) == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(su32(&empty[s])) : "memory");
    }
    if (x == 0x12345678u) sink[0] = x;
}
'''

FORMS = [  # (bks, stages, tiled, promo)
    (1, 5, False, "256"), (1, 5, False, "none"), (1, 5, False, "128"), (1, 3, False, "256"),
    (2, 3, False, "256"), (2, 2, False, "256"), (2, 3, False, "none"),
    (1, 5, True, "256"), (1, 3, True, "256"), (2, 3, True, "256"),
]


def encode(ptr, rows, cols, promo):
    """The layer's map of a [rows, cols] bf16 matrix in 64-row boxes, at L2 promotion `promo`."""
    from cupymoe import tma

    return tma.encode(tma.Matrix2D(ptr, rows, cols, l2_promotion=promo), 64, "probe weights")


def main():
    import cupy
    import numpy as np

    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise SystemExit(f"tma_stream_probe: needs an NVIDIA GPU ({e})")
    from cupymoe import jit

    K, R, copies = 2048, 128 * 2 * 768, 3  # qwen3-30b-a3b gate + up, every expert; copies cycled past the L2
    KT = K // 64
    bufs = [cupy.random.standard_normal((R, K), dtype=cupy.float32).astype(cupy.float16) for _ in range(copies)]
    nbytes = R * K * 2
    names = [f"stream<{b}, {s}, {'true' if t else 'false'}>" for b, s, t, _ in FORMS]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90a"), name_expressions=sorted(set(names)))
    sink = cupy.zeros(1, cupy.uint32)
    out = {"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "sources": jit.tree_digest(),
                    "command": "python3 scripts/tma_stream_probe.py", "bytes": nbytes,
                    "what": "qwen3-30b-a3b gate+up bf16 weights streamed by 64-row TMA boxes through a "
                            "swap-AB-shaped ring"},
           "forms": []}
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for (bks, stages, tiled, promo), name in zip(FORMS, names):
        k = mod.get_function(name)
        smem = 1024 + stages * bks * 2 * 8192 + 16 * stages
        k.max_dynamic_shared_size_bytes = smem
        rows = R * KT if tiled else R
        cols = 64 if tiled else K
        maps = [cupy.asarray(np.frombuffer(encode(b.data.ptr, rows, cols, promo), np.uint8)) for b in bufs]
        grid = (R // 128,)

        def launch(i):
            k(grid, (160,), (maps[i % copies], np.int32(KT), sink), shared_mem=smem)

        for i in range(300 if not out["forms"] else 40):  # toward the steady state
            launch(i)
        times = []
        for rep in range(7):
            start.record()
            for i in range(20):
                launch(i)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 20 * 1e-3)
        t = float(np.median(times))
        row = {"bks": bks, "stages": stages, "tiled": tiled, "l2_promotion": promo,
               "bytes_in_flight_a_block": stages * bks * 16384, "us": round(t * 1e6, 1),
               "TBps": round(nbytes / t / 1e12, 3)}
        out["forms"].append(row)
        print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
