"""Would fp4 decode go faster on e4m3 tensor cores? Times fp4_e4m3_decode_probe.cu's kernel,
one copy skeleton (decode_wgmma_fp4.cu's ring) with five compute sides, over mxfp4 codes of
deepseek-v3's gate/up rows (K = 7168) for the experts a decode step touches (220 at N = 64, 96
at N = 16; 4096 weight rows each): MODE 0 W4A16 (the bit placement on stored nibbles, bf16
wgmma), MODE 4 the same on repacked words (quant.cuh's layout), MODE 1
W4A8 (a byte-permute lookup to e4m3, e4m3 wgmma, fp32 promotion a 32-code group), MODE 2 the
same with each activation as two e4m3 terms, MODE 3 the copies alone; each on several shapes of
the skeleton (--shapes: k steps a stage, stages, blocks an SM, weight rows a block;
decode_wgmma_fp4.cu's is 2,3,3,128). The data are random and the sums are nobody's: only the
instruction streams and the reads are compared. Modes
alternate, twice, each after 0.3 s of the same launches (the GPU's power-capped state, as the
bench). Needs an sm_90 GPU and CuPy; the results are in benchmarks/DECISIONS.md (fp4).

    python scripts/fp4_e4m3_decode_probe.py [--experts 220 96] [--shapes 2,3,3,128 4,3,3,64] [--reps 9]
"""

import argparse
import statistics
import time
from pathlib import Path

import cupy as cp

from cupymoe import jit

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--experts", type=int, nargs="+", default=[220, 96], help="experts touched (4096 rows of K each)")
ap.add_argument("--shapes", nargs="+", default=["2,3,3,128", "4,2,2,128", "2,4,2,128", "4,3,1,128"],
                help="skeleton shapes KSUB,STAGES,MINB,ROWS: k steps a stage, stages, blocks an SM, weight rows a block")
ap.add_argument("--modes", type=int, nargs="+", default=[0, 4, 1, 2, 3])
ap.add_argument("--reps", type=int, default=9, help="timed repetitions of 10 launches (the median is printed)")
ap.add_argument("--copy-tbs", type=float, default=4.28, help="the copy rate the floor column divides by")
args = ap.parse_args()
try:
    cp.cuda.runtime.getDeviceCount()
except cp.cuda.runtime.CUDARuntimeError as e:
    raise SystemExit(f"fp4_e4m3_decode_probe: needs an NVIDIA GPU ({e})")

K, ROWS_PER_EXPERT, NTOK, THREADS = 7168, 4096, 8, 128
MODES = {0: "W4A16 bf16 (stored nibbles)", 1: "W4A8 e4m3", 2: "e4m3, activations hi + lo", 3: "copies alone",
         4: "W4A16 (repacked words)"}
SHAPES = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes]
NAMES = {(m, sh): f"fp4_probe<{m}, {sh[0]}, {sh[1]}, {sh[2]}, {sh[3]}>" for m in args.modes for sh in SHAPES}
module = cp.RawModule(code=Path(__file__).with_suffix(".cu").read_text(),
                      options=("-arch=sm_90a", *(o for o in jit.compile_options("sm_90a")
                                                 if not o.startswith(("--gpu-architecture", "-Xptxas")))),
                      name_expressions=list(NAMES.values()))


def stage_bytes(mode: int, ksub: int, rows: int) -> int:  # the .cu's pr_stage_bytes
    x = NTOK * 128 if mode == 1 else 2 * NTOK * 128
    return ksub * (x + rows * 64) + rows * 4 * ksub


rows_max = max(args.experts) * ROWS_PER_EXPERT
codes = cp.random.randint(0, 256, rows_max * K // 2, dtype=cp.uint8)
scales = cp.random.randint(118, 127, rows_max * K // 32, dtype=cp.uint8)  # e8m0 2^-9 .. 2^-1
xs = cp.random.randint(0, 256, NTOK * 2 * K, dtype=cp.uint8)
out = cp.empty(rows_max * NTOK, dtype=cp.float32)
stream = cp.cuda.Stream(non_blocking=True)


def timed(mode: int, shape: tuple, rows: int) -> list[float]:
    fn = module.get_function(NAMES[mode, shape])
    smem = shape[1] * stage_bytes(mode, shape[0], shape[3]) + 1024
    fn.max_dynamic_shared_size_bytes = smem
    launch = lambda: fn((rows // shape[3],), (THREADS,), (codes, scales, xs, out, cp.int32(K)), shared_mem=smem,
                        stream=stream)
    with stream:
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:  # the steady (power-capped) state first
            launch()
            stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(args.reps):
            e0.record(stream)
            for _ in range(10):
                launch()
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / 10)
    return times


for n_exp in args.experts:
    rows = n_exp * ROWS_PER_EXPERT
    nbytes = rows * (K // 2 + K // 32)
    floor = nbytes / (args.copy_tbs * 1e12) * 1e6
    print(f"{n_exp} experts x {ROWS_PER_EXPERT} rows, K = {K}: {nbytes / 1e9:.2f} GB, floor {floor:.1f} us", flush=True)
    for rnd in (1, 2):
        for shape in SHAPES:
            for mode in args.modes:
                t = timed(mode, shape, rows)
                med = statistics.median(t)
                print(f"  round {rnd} shape {shape} MODE {mode} {MODES[mode]:<26} {med:8.1f} us  "
                      f"{med / floor:5.2f}x floor  {nbytes / med / 1e6:5.2f} TB/s  reps {min(t):.1f}-{max(t):.1f}",
                      flush=True)
