"""How fast can the decode kernels' weight reads go? Streams qwen3-30b-a3b's gate and up fp8
weights at N = 64 (402 MB: 128 experts x 2 x 768 rows x 2048 bytes) with the grid of
decode_mma_gate_up_a8 there (768 blocks of 8 warps, two blocks an SM) in the access patterns
of scripts/stream_pattern_probe.cu, loads only, and prints each one's time and TB/s. Needs a
GPU and CuPy; the result it gave on the lent H200 is in NOTES.md v30.

    python scripts/stream_pattern_probe.py [--rounds 2] [--copies 4]
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
args = ap.parse_args()

src = (Path(__file__).with_name("stream_pattern_probe.cu")).read_text()
module = cupy.RawModule(code=src, options=("-std=c++17",))
K, rows = 2048, 768 * 8 * 16  # bytes a row; rows of each matrix (8 warps x 16 rows a block)
nbytes = 2 * rows * K
bufs = [cupy.random.randint(0, 255, nbytes, dtype=cupy.uint8) for _ in range(args.copies)]
sink = cupy.zeros(1, cupy.uint32)
for _ in range(args.rounds):
    for mode, name in enumerate(PATTERNS):
        for unroll in args.unrolls:
            fn = module.get_function(f"probe{unroll}")
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            for _rep in range(3):  # the last of three is the one timed
                start.record()
                for i in range(args.launches):
                    fn((768,), (256,), (bufs[i % args.copies], sink, np.int32(K), np.int32(rows), np.int32(mode)))
                end.record()
                end.synchronize()
            us = cupy.cuda.get_elapsed_time(start, end) * 1000 / args.launches
            print(f"mode {name} unroll {unroll}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)
