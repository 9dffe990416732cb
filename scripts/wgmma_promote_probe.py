"""How much of the e4m3 tensor rate the w8a8 main loop's promotion schedules leave, one or two
consumer warpgroups an SM, operands resident in shared memory. Decides the ping-pong w8a8 GEMM
(DECISIONS "Next for #40: a ping-pong w8a8 gate/up"): a ping-pong runs one warpgroup's main loop
beside the other's epilogue, so it gains only if one warpgroup alone keeps the tensor cores near
their rate. Prints, per schedule and warpgroup count, the cycles a 64 x 256 x 128 step of warpgroup
0 and the share of the SM's peak (4096 e4m3 MACs a cycle on sm_90), and writes them as JSON.

    python scripts/wgmma_promote_probe.py [--steps 4096] [--json OUT.json]
    python scripts/wgmma_promote_probe.py --compile-only     (no GPU: registers and spills)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cupymoe import jit  # noqa: E402

SCHEDS = {"halves": 0, "quarters": 1, "bare": 2}
# (schedule, warpgroups, partner): one warpgroup alone, two in step, one beside an epilogue
CONFIGS = [(s, w, p) for s in SCHEDS for (w, p) in ((1, False), (2, False), (2, True))]
PEAK_MACS_PER_CYCLE = 4096  # dense e4m3 on an sm_90 SM
STEP_MACS = 64 * 256 * 128  # one warpgroup's step
SOURCE = Path(__file__).with_suffix(".cu")


def name(sched: str, wgs: int, partner: bool) -> str:
    return f"wgmma_promote_probe<{SCHEDS[sched]}, {wgs}, {'true' if partner else 'false'}>"


def smem_bytes(wgs: int) -> int:
    return 4 * (256 + 64 * wgs) * 128 + 1024


def compile_probe(arch: str) -> tuple[bytes, dict[str, str], list]:
    """NVRTC with the package's options: the cubin, each instance's lowered name, its resources."""
    nvrtc = jit._nvrtc()
    names = [name(*c) for c in CONFIGS]
    prog = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, (), ())
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, jit.compile_options(arch))
        except nvrtc.NVRTCError as e:
            raise SystemExit(f"wgmma_promote_probe: NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}")
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx
        res = jit._parse_resources(nvrtc.getProgramLog(prog), ptx, lowered)
        return nvrtc.getCUBIN(prog), lowered, res
    finally:
        nvrtc.destroyProgram(prog)


def report_resources(res: list) -> int:
    bad = 0
    for r in res:
        print(f"{r.name}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads} bytes, wgmma {r.uses_wgmma}")
        bad += r.spill_stores > 0 or not r.uses_wgmma
    return 1 if bad else 0


def run(steps: int, out: str | None) -> int:
    import cupy as cp
    import numpy as np

    try:
        dev = cp.cuda.Device()
        sms = dev.attributes["MultiProcessorCount"]
        gpu = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise SystemExit(f"wgmma_promote_probe: needs an sm_90 GPU ({e})")
    cubin, lowered, res = compile_probe("sm_90a")
    report_resources(res)
    module = cp.cuda.function.Module()
    module.load(cubin)
    rng = np.random.default_rng(0)
    scales = cp.asarray(rng.uniform(0.5, 2.0, 64).astype(np.float32))
    cycles = cp.zeros(sms, dtype=cp.int64)
    nanos = cp.zeros(sms, dtype=cp.int64)
    sink = cp.zeros(256, dtype=cp.float32)
    rows = []
    for sched, wgs, partner in CONFIGS:
        fn = module.get_function(lowered[name(sched, wgs, partner)])
        drv = cp.cuda.driver
        drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(wgs))
        args = (np.int32(steps), scales, cycles, nanos, sink)
        for _ in range(2):  # the second launch is the one read (clocks up, code loaded)
            fn((sms,), (128 * wgs,), args, shared_mem=smem_bytes(wgs))
            cp.cuda.runtime.deviceSynchronize()
        per_step = float(np.median(cp.asnumpy(cycles)))
        ns_step = float(np.median(cp.asnumpy(nanos))) / steps
        working = 1 if partner else wgs  # warpgroups running the main loop
        busy = working * STEP_MACS / PEAK_MACS_PER_CYCLE / per_step
        tflops = working * STEP_MACS * 2 * sms / ns_step / 1e3  # the whole GPU's rate at this schedule
        rows.append({"schedule": sched, "warpgroups": wgs, "partner_epilogue": partner,
                     "cycles_a_step": round(per_step, 1), "ns_a_step": round(ns_step, 1),
                     "gpu_TFLOPs": round(tflops, 1), "tensor_share": round(busy, 3)})
        print(f"{sched:9s} wgs {wgs} partner {partner!s:5s}: {per_step:8.1f} cycles / {ns_step:7.1f} ns a step of "
              f"warpgroup 0, {tflops:7.1f} TFLOP/s over the GPU, tensor cores {100 * busy:5.1f} % busy", flush=True)
    if out:
        meta = {"gpu": gpu, "command": "python scripts/wgmma_promote_probe.py " + " ".join(sys.argv[1:]),
                "steps": steps, "peak_macs_per_cycle": PEAK_MACS_PER_CYCLE,
                "resources": [{"name": r.name, "registers": r.registers, "spill_stores": r.spill_stores} for r in res]}
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4096, help="128-code steps a warpgroup runs")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--compile-only", action="store_true", help="compile for --arch and print resources (no GPU)")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    if args.compile_only:
        return report_resources(compile_probe(args.arch)[2])
    return run(args.steps, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
