"""The floors' ceilings: a GPU's device-to-device copy rate (bytes read + written) and its bf16 and fp8
e4m3 8192^3 matrix rates (torch._scaled_mm), from its row of data/ceilings.json by the device's exact
name, or measured in the run (--measure-ceilings; a GPU without a row). Each is a steady-state figure
(after STEADY_WARM_S of load, the median of CEILING_REPEATS repetitions of CEILING_CALLS calls), with the
burst figure kept beside it where measured (docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

REFERENCE_GPU = "NVIDIA H200"  # the lent H200 (PERFORMANCE.md), whose row the targets and baselines are
CEILING_KEYS = ("copy_TBps", "bf16_TFLOPs", "fp8_TFLOPs")
CEILINGS_TABLE = Path(__file__).resolve().parent / "data" / "ceilings.json"
STEADY_WARM_S = 0.3  # seconds of load before timing, a cell's or a ceiling's (the power cap settles in ~0.1 s)
CEILING_REPEATS, CEILING_CALLS = 7, 20  # a ceiling's timed repetitions (median) and calls per repetition


def torch_seconds_a_call(fn) -> tuple[float, float]:
    """Seconds a call of `fn` (work on torch's current stream), timed by CUDA events: (steady,
    burst). Steady: after STEADY_WARM_S of calls, the median of CEILING_REPEATS repetitions of
    CEILING_CALLS calls; burst: three warm-ups, the mean of ten. Needs torch with CUDA."""
    import torch

    def repetition(calls):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 1e3 / calls

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    burst = repetition(10)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < STEADY_WARM_S:
        repetition(5)
    return statistics.median(repetition(CEILING_CALLS) for _ in range(CEILING_REPEATS)), burst


def measure_ceilings() -> dict[str, Optional[float]]:
    """copy TB/s (bytes read + written), bf16 8192^3 TFLOP/s and fp8 e4m3 8192^3 TFLOP/s
    (torch._scaled_mm, per-tensor float32 scales, bf16 out; None where this GPU or torch
    build has no fp8 matrix product), each in the steady state (the key itself: after
    STEADY_WARM_S of load, the median of CEILING_REPEATS repetitions) and as a burst
    (`<key>_burst`: three warm-ups, the mean of ten). Needs torch with CUDA."""
    import torch

    timed = torch_seconds_a_call
    n = 8192

    def copy_tbps():
        a = torch.empty(2**31 // 2, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        return [2 * a.numel() * a.element_size() / t / 1e12 for t in timed(lambda: b.copy_(a))]

    def bf16_tflops():
        m = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        return [2 * n**3 / t / 1e12 for t in timed(lambda: m @ m)]

    def fp8_tflops():
        a8 = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)  # row-major
        b8 = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), dtype=torch.float32, device="cuda")
        return [2 * n**3 / t / 1e12 for t in timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                                            out_dtype=torch.bfloat16))]

    res: dict[str, Optional[float]] = {}
    res["copy_TBps"], res["copy_TBps_burst"] = copy_tbps()
    res["bf16_TFLOPs"], res["bf16_TFLOPs_burst"] = bf16_tflops()
    res["fp8_TFLOPs"] = res["fp8_TFLOPs_burst"] = None
    try:
        res["fp8_TFLOPs"], res["fp8_TFLOPs_burst"] = fp8_tflops()
    except (RuntimeError, AttributeError, TypeError) as e:  # no fp8 on this GPU / torch build
        print(f"ceilings: fp8 matrix rate not measured ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # give the GBs back before CuPy draws the weights
    return res


class Ceilings(NamedTuple):
    """The floors' ceilings a run uses (CEILING_KEYS, plus `<key>_burst` where measured), which
    keys were measured in the run, and where the others come from."""
    values: dict
    measured: dict
    source: str


def table_ceilings(gpu: str) -> Optional[dict]:
    """The ceilings measured on a GPU of this exact name (data/ceilings.json), or None."""
    row = json.loads(CEILINGS_TABLE.read_text())["gpus"].get(gpu)
    return None if row is None else {k: float(row[k]) for k in CEILING_KEYS}


# The reference row: the fallback where a GPU has no row and torch is missing, and cell_figures'
# defaults (dense fp8 is ~2x bf16).
COPY_TBPS, BF16_TFLOPS, FP8_TFLOPS = (table_ceilings(REFERENCE_GPU)[k] for k in CEILING_KEYS)


def ceilings_note(gpu: str) -> str:
    """What `bench` will take as `gpu`'s ceilings, in a line (`python -m cupymoe info`)."""
    row = table_ceilings(gpu)
    if row is None:
        return "floors' ceilings: no row in data/ceilings.json, so bench measures them (needs torch)"
    return ("floors' ceilings (data/ceilings.json): copy {copy_TBps:.2f} TB/s, bf16 {bf16_TFLOPs:.0f} TFLOP/s, "
            "fp8 {fp8_TFLOPs:.0f} TFLOP/s").format(**row)


def resolve_ceilings(measure: bool, gpu: str = REFERENCE_GPU) -> Ceilings:
    """The ceilings of this run: the table's row of `gpu`, replaced by figures measured here with
    --measure-ceilings or where the table has no row for `gpu` (without torch: the reference GPU's
    row, said so)."""
    row = table_ceilings(gpu)
    own_row = row is not None
    source = f"data/ceilings.json ({gpu})"
    if not own_row:
        row, measure = table_ceilings(REFERENCE_GPU), True
        source = f"data/ceilings.json has no row for {gpu}: measured here ({REFERENCE_GPU}'s row where not measured)"
    ceilings = dict(row)
    measured = dict.fromkeys(ceilings, False)
    if measure:
        try:
            got = measure_ceilings()
        except ImportError as e:
            got = {}
            if not own_row:
                source = (f"data/ceilings.json has no row for {gpu} and torch is not importable ({e}): "
                          f"{REFERENCE_GPU}'s row, so the floors are not this GPU's")
            print(f"ceilings: torch is not importable ({e}); using {source}", file=sys.stderr)
        for key, val in got.items():
            if val is not None and key in ceilings:
                ceilings[key], measured[key] = float(val), True
        # the burst figures travel beside the steady ones, only where both were measured
        ceilings.update({f"{key}_burst": float(got[f"{key}_burst"]) for key in measured
                         if measured[key] and got.get(f"{key}_burst") is not None})
    print("ceilings: copy {:.2f} TB/s, bf16 mm {:.0f} TFLOP/s, fp8 mm {:.0f} TFLOP/s ({}; {})".format(
        ceilings["copy_TBps"], ceilings["bf16_TFLOPs"], ceilings["fp8_TFLOPs"],
        ", ".join(f"{k} {'measured, steady state' if v else 'table'}" for k, v in measured.items()), source),
        flush=True)
    if any(k.endswith("_burst") for k in ceilings):
        print("ceilings as a burst (3 warm-ups, the mean of 10): " + ", ".join(
            f"{k[:-6]} {v:.2f}" for k, v in ceilings.items() if k.endswith("_burst")), flush=True)
    return Ceilings(ceilings, measured, source)
