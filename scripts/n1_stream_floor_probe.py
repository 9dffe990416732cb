"""How fast can the routed experts' bytes of one decode row be read? Streams the byte counts
of the N = 1 cells (qwen3-30b-a3b fp8: down 12.6 MB, gate/up 25.2, both 37.7; deepseek-v3 fp8:
down 117, gate/up 235) with bulk copies (cp.async.bulk into a shared-memory ring on
mbarriers, several chunk sizes and depths) and with plain 16-byte register loads, each
kernel ten times in a CUDA graph over buffers L2 does not hold, and prints the median time a
launch next to the copy floor (4.28 TB/s). It computes nothing: a launch's time is the
least any kernel reading those bytes takes. Needs an sm_90 GPU and CuPy; what it gave on
the lent H200 is in benchmarks/DECISIONS.md (decode).

    python scripts/n1_stream_floor_probe.py [--mb 12.6 25.2 37.7 117 235] [--reps 20]
"""

import argparse
from pathlib import Path

import cupy as cp
import numpy as np

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--mb", type=float, nargs="+", default=[12.6, 25.2, 37.7, 117.0, 235.0])
ap.add_argument("--reps", type=int, default=20, help="graph replays timed (the median is printed)")
ap.add_argument("--copy-tbs", type=float, default=4.28, help="the copy rate the floor column divides by")
args = ap.parse_args()
WINDOW = 1 << 28  # ten launches read eight windows of a 2 GiB buffer in turn: none stays in L2
too_big = [mb for mb in args.mb if mb * 1e6 > WINDOW]
if too_big:
    raise SystemExit(f"n1_stream_floor_probe: --mb {too_big} exceeds a read window ({WINDOW / 1e6:.1f} MB)")
try:
    cp.cuda.runtime.getDeviceCount()
except cp.cuda.runtime.CUDARuntimeError as e:
    raise SystemExit(f"n1_stream_floor_probe: needs an NVIDIA GPU ({e})")

# (chunk bytes, ring slots, blocks an SM) of the bulk copies
BULK = ((16384, 4, 1), (16384, 6, 1), (32768, 4, 1), (8192, 8, 2), (16384, 3, 2), (4096, 8, 3))
REG_BLOCKS_PER_SM = (2, 4, 8)  # 256-thread blocks of register loads

module = cp.RawModule(code=Path(__file__).with_suffix(".cu").read_text(), options=("-arch=sm_90a", "-std=c++17"))
bulk, reg = module.get_function("bulk_stream"), module.get_function("reg_stream")
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
buf = cp.empty(8 * WINDOW, dtype=cp.uint8)
sink = cp.zeros(1, dtype=cp.uint32)
stream = cp.cuda.Stream(non_blocking=True)


def time_launch(launch) -> float:
    """Median µs a launch, timed as a graph of ten launches on rotating windows."""
    offsets = [((j * 97) % 8) * WINDOW for j in range(10)]
    with stream:
        stream.begin_capture()
        for o in offsets:
            launch(o)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(args.reps):
            e0.record(stream)
            graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / len(offsets))
    return float(np.median(times))


for mb in args.mb:
    total = int(mb * 1e6) // 65536 * 65536
    line = [f"{mb:6.1f} MB floor {total / (args.copy_tbs * 1e6):6.2f} us |"]
    for chunk, stages, per_sm in BULK:
        smem = chunk * stages
        bulk.max_dynamic_shared_size_bytes = smem
        t = time_launch(lambda o: bulk((sms * per_sm,), (128,), (buf.data.ptr + o, np.int64(total), np.int32(chunk),
                                                                np.int32(stages), sink.data.ptr), shared_mem=smem))
        line.append(f"bulk {chunk // 1024}Kx{stages}x{per_sm} {t:6.2f}")
    for per_sm in REG_BLOCKS_PER_SM:
        t = time_launch(lambda o: reg((sms * per_sm,), (256,), (buf.data.ptr + o, np.int64(total // 16), sink.data.ptr)))
        line.append(f"reg x{per_sm} {t:6.2f}")
    print(" ".join(line), flush=True)
