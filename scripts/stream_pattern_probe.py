"""How fast can the decode kernels' weight reads go? Streams qwen3-30b-a3b's gate and up fp8
weights at N = 64 (402 MB: 128 experts x 2 x 768 rows x 2048 bytes) with the grid of
decode_mma_gate_up_a8 there (768 blocks of 8 warps, two blocks an SM) in the access patterns
of scripts/stream_pattern_probe.cu, loads only, and prints each one's time and TB/s. Needs a
GPU and CuPy; the result it gave on the lent H200 is in benchmarks/DECISIONS.md (decode).

    python scripts/stream_pattern_probe.py [--rounds 2] [--copies 4]
    python scripts/stream_pattern_probe.py --patterns strided --unrolls 1 --hops 0 2 3 --epilogue 0 1

--hops / --epilogue add what a decode block does besides streaming (stream_pattern_probe.cu):
dependent loads before its first weight load, a fence, barrier and ticket after its last.
"""

import argparse
from pathlib import Path

import cupy
import numpy as np

PATTERNS = ("strided", "tiled", "8x256", "4x512")
UNROLLS = (1, 2, 4)

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--copies", type=int, default=4, help="weight buffers cycled, so L2 holds none between launches")
ap.add_argument("--launches", type=int, default=20)
ap.add_argument("--unrolls", type=int, nargs="+", default=list(UNROLLS), choices=UNROLLS)
ap.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
ap.add_argument("--hops", type=int, nargs="+", default=[0], help="dependent loads before a block's first weight load")
ap.add_argument("--epilogue", type=int, nargs="+", default=[0], choices=(0, 1), help="1: a fence, barrier and ticket at the end")
args = ap.parse_args()
try:
    cupy.cuda.runtime.getDeviceCount()
except cupy.cuda.runtime.CUDARuntimeError as e:
    raise SystemExit(f"stream_pattern_probe: needs an NVIDIA GPU ({e})")

src = (Path(__file__).with_name("stream_pattern_probe.cu")).read_text()
module = cupy.RawModule(code=src, options=("-std=c++17",))
K, rows = 2048, 768 * 8 * 16  # bytes a row; rows of each matrix (8 warps x 16 rows a block)
nbytes = 2 * rows * K
bufs = [cupy.random.randint(0, 255, nbytes, dtype=cupy.uint8) for _ in range(args.copies)]
sink = cupy.zeros(2, cupy.uint32)
blocks = 768
chain = cupy.arange(blocks, dtype=cupy.int32)  # identity: the hops change no address, only add latency
tickets = cupy.zeros(blocks, cupy.int32)
variants = [(m, u, h, e) for m in args.patterns for u in args.unrolls for h in args.hops for e in args.epilogue]
for _ in range(args.rounds):
    for name, unroll, hops, epilogue in variants:
        fn = module.get_function(f"probe{unroll}")
        fargs = (sink, np.int32(K), np.int32(rows), np.int32(PATTERNS.index(name)), chain, np.int32(hops),
                 np.int32(epilogue), tickets)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for _rep in range(3):  # the last of three is the one timed
            start.record()
            for i in range(args.launches):
                fn((blocks,), (256,), (bufs[i % args.copies],) + fargs)
            end.record()
            end.synchronize()
        us = cupy.cuda.get_elapsed_time(start, end) * 1000 / args.launches
        extra = (f" hops {hops}" if hops else "") + (" epilogue" if epilogue else "")
        print(f"mode {name} unroll {unroll}{extra}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)
