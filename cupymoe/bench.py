"""python -m cupymoe bench: per-layer time with CUDA-graph replays, next to the floor.

Method (PERFORMANCE.md): several copies of the layer's weights (so the experts do not sit
in the 50 MB L2) captured into one CUDA graph, replays timed with CUDA events, the median of
repeats; random inputs, never zeros; the floor computed from the routing the layer
actually produced (its own top-k ids, read back from its scratch).

The routed experts are drawn in one of FORMATS (--format; router and shared expert stay
bf16), and each row's floor counts the bytes of that format:

    bytes = touched experts x expert_bytes(format) (+ their fp32 biases) + router R H x 2
            + shared 3 H Is x 2 + in/out N H x 2 x 2
    FLOPs = 2 N k 3 H I + 2 N H R + 2 N 3 H Is
    floor = max(bytes / copy bandwidth, FLOPs / bf16 matrix rate)

Every format runs its expert GEMMs on bf16 tensor cores here (quantized weights are
dequantized in registers: W8A16 / W4A16), so `floor_us` uses the bf16 rate; fp8_block rows
also carry `floor_fp8_us`, the routed experts' FLOPs at the fp8 matrix rate (what a W8A8
kernel such as vLLM's could reach).

The ceilings are the GPU's row of cupymoe/data/ceilings.json (the lent H200's: 4.26 TB/s,
777 TFLOP/s bf16, 1462 TFLOP/s fp8 through torch._scaled_mm); a GPU without a row is measured
in the run, as --measure-ceilings does on any GPU. The peers' stored figures are the H200's, so
on another GPU the rows leave them out.

Steady state. Under sustained load the H200 reaches its 700 W power cap within about 0.1 s
and lowers its clocks (nvidia-smi: 1980 MHz boost, 1350-1600 MHz capped, reason "software
power cap"; benchmarks/DECISIONS.md): an 8192^3 bf16 product that runs 795-811 TFLOP/s in a burst (three
warm-ups, the mean of ten: PERFORMANCE.md's method) runs 685-697 TFLOP/s sustained, and a
cell's repetitions, 140 graph replays, run in that capped state. So both are timed the same
way: after STEADY_WARM_S seconds of the same work, the median of repetitions (the cells:
--repeats of --replays replays; the ceilings: CEILING_REPEATS of CEILING_CALLS calls). The
floors use the steady ceilings; the burst ones are kept beside them (`*_burst`, and each
row's `pct_of_burst_floor`) to compare with figures measured the burst way.

The peers' figures come from benchmarks/baselines/h200-bf16-peers.json
(every row: vLLM's bf16 compute-only time; bf16 rows: also torch._grouped_mm) and
h200-fp8-peers.json (fp8_block rows: vLLM's fp8 GEMMs only), measured on the same kind of
GPU. The torch peers timed in the same run read bf16 weights, so they run on bf16 rows only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import numpy as np

from . import knobs
from .ceilings import (BF16_TFLOPS, CEILING_CALLS, CEILING_REPEATS, COPY_TBPS, FP8_TFLOPS, REFERENCE_GPU,
                       STEADY_WARM_S, resolve_ceilings)
from .config import MoeConfig
from .errors import OptionError
from .profiling import record_stage_events

# PERFORMANCE.md's grid. The peers ran routed experts only; "shared" is reported apart.
PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True),
    "qwen3-235b-a22b": dict(hidden_size=4096, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True),
    "deepseek-v3": dict(hidden_size=7168, moe_intermediate_size=2048, num_experts=256, num_experts_per_tok=8,
                        scoring_func="sigmoid", has_correction_bias=True, n_group=8, topk_group=4,
                        norm_topk_prob=True, routed_scaling_factor=2.5, shared_expert_intermediate_size=2048),
    "mixtral-8x7b": dict(hidden_size=4096, moe_intermediate_size=14336, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True),
    "qwen3-next-80b": dict(hidden_size=2048, moe_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
                           norm_topk_prob=True, shared_expert_intermediate_size=512, has_shared_expert_gate=True),
    "gpt-oss-120b": dict(hidden_size=2880, moe_intermediate_size=2880, num_experts=128, num_experts_per_tok=4,
                         topk_then_softmax=True, has_router_bias=True, has_expert_bias=True, hidden_act="swiglu_oai"),
}
FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")  # of the routed experts
L2_BYTES = 50e6
MAX_LAYERS = 32  # copies of the weights rotated through one graph, at most
HOST_CALLS, HOST_BATCH = 400, 20  # --host: eager forwards timed; the stream is drained between batches

_REPO = Path(__file__).resolve().parent.parent
# Where the peers' figures are looked for, first hit wins: $CUPYMOE_BASELINES, the repo's
# benchmarks/baselines, the shared/baselines beside the checkout.
BASELINE_DIRS = (_REPO / "benchmarks" / "baselines", Path(__file__).resolve().parent / "baselines",
                 _REPO.parent / "shared" / "baselines")  # the source tree's, an installed package's, shared/
BASELINE_FILES = {"bf16": "h200-bf16-peers.json", "fp8_block": "h200-fp8-peers.json"}


def preset_config(name: str, *, routed_only: bool = True) -> MoeConfig:
    kw = dict(PRESETS[name])
    if routed_only:  # the peers' figures cover the routed experts only
        kw.pop("shared_expert_intermediate_size", None)
        kw.pop("has_shared_expert_gate", None)
    return MoeConfig(model_type=name, **kw)


def _int_at_least(lo: int):
    """An argparse type: an integer >= lo (refused at parsing, before any weights are drawn)."""
    import argparse

    def parse(v: str) -> int:
        try:
            i = int(v)
        except ValueError:
            i = lo - 1
        if i < lo:
            raise argparse.ArgumentTypeError(f"{v!r}: must be an integer >= {lo}")
        return i
    return parse


def add_lora_args(ap) -> None:
    """--lora K and --lora-rank R: the adapters install_adapters draws (bench's, scripts/graph_timeline.py's)."""
    ap.add_argument("--lora", type=_int_at_least(0), default=0, metavar="K",
                    help="also time each cell with K random adapters in the layer's slots, one a row round-robin "
                         "(lora_ids_ptr inside the captured graph): lora_us, base_us, overhead_pct of the same layer")
    ap.add_argument("--lora-rank", type=_int_at_least(1), default=16, metavar="R", help="the adapters' rank (--lora)")


def add_bench_args(ap) -> None:
    ap.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(PRESETS))
    ap.add_argument("--format", dest="formats", nargs="+", default=["bf16"], choices=FORMATS,
                    help="routed experts' weight format(s), each timed next to its own floor "
                         "(router and shared expert stay bf16; default bf16)")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--fp8-compute", default="auto", choices=["auto", "w8a8", "w8a16"],
                    help="fp8_block experts (every path): w8a8 (sm_90a e4m3 tensor cores), w8a16, or auto")
    ap.add_argument("--path", default="auto", choices=["auto", "decode", "atomic", "prefill"])
    ap.add_argument("--decode-max-tokens", type=int, default=None,
                    help="the layer's decode_max_tokens (default: the layer's own)")
    ap.add_argument("--full-layer", action="store_true", help="include the shared expert (peers exclude it)")
    ap.add_argument("--repeats", type=int, default=7, help="timed repetitions (median reported)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per repetition")
    ap.add_argument("--measure-ceilings", action="store_true",
                    help="measure copy TB/s, bf16 and fp8 (torch._scaled_mm) TFLOP/s in this run (needs torch)")
    ap.add_argument("--json", default=None, help="write results here (default benchmarks/results/<date>-<gpu>.json)")
    ap.add_argument("--no-peers", action="store_true",
                    help="skip the torch peers (timed in the same run when torch is importable; bf16 only)")
    ap.add_argument("--eager-max-tokens", type=int, default=256,
                    help="time the per-expert eager loop only up to this many tokens (it is slow)")
    ap.add_argument("--plots", default=None,
                    help="folder for one PNG per preset and format (time against N, log-log); needs matplotlib")
    ap.add_argument("--stages", action="store_true",
                    help="also time each stage inside the replayed graph (CUDA events between stages); "
                         "the events separate the kernels, so the decode chain runs without programmatic "
                         "dependent launch and the layer's time reads higher (20-30 us at N = 1 on the H200)")
    ap.add_argument("--host", action="store_true",
                    help="also time each cell's eager forward on the host (enqueue only; over --host-calls calls "
                         "in batches of 20, the median of the batch means) and the plan's build")
    ap.add_argument("--host-calls", type=int, default=HOST_CALLS, help="eager forwards timed for --host")
    add_lora_args(ap)
    ap.add_argument("--lora-timing", choices=LORA_TIMINGS, default="interleaved",
                    help="--lora: the base and LoRA repetitions interleaved, or all base repetitions then all LoRA "
                         "ones (each after its own warm-up)")
    ap.add_argument("--seed", type=int, default=0)


# ----------------------------------------------------------------------------------
# baselines (the peers' figures measured earlier on the same kind of GPU)
# ----------------------------------------------------------------------------------

def baseline_path(fmt: str) -> Optional[Path]:
    """The baseline file for `fmt` (None when that format has none or none is found)."""
    fname = BASELINE_FILES.get(fmt)
    if fname is None:
        return None
    env = os.environ.get("CUPYMOE_BASELINES")
    for d in ((Path(env),) if env else ()) + BASELINE_DIRS:
        if (d / fname).is_file():
            return d / fname
    return None


def baseline_gpu(doc: dict) -> str:
    """The device name a baseline file was measured on ("NVIDIA H200 (one GPU)" -> "NVIDIA H200")."""
    return str(doc.get("gpu", REFERENCE_GPU)).split(" (")[0]


def load_baselines(gpu: str = REFERENCE_GPU) -> dict[tuple[str, str, int], dict]:
    """{(format, shape, N): that cell's row} from every baseline file found that was measured on a
    GPU of this name; another GPU's files are left out, said so (their vLLM times against ours
    would be a ratio of two machines)."""
    out: dict[tuple[str, str, int], dict] = {}
    for fmt in BASELINE_FILES:
        p = baseline_path(fmt)
        if p is None:
            continue
        try:
            doc = json.loads(p.read_text())
            rows = doc["rows"]
        except (OSError, ValueError, KeyError) as e:
            print(f"baselines: cannot read {p} ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        if baseline_gpu(doc) != gpu:
            print(f"baselines: {p.name} was measured on {baseline_gpu(doc)} and this GPU is {gpu}: its peers' "
                  f"columns are left out (time them in the same call: shared peers/README.md)", file=sys.stderr)
            continue
        for r in rows:
            out[(fmt, r["shape"], int(r["N"]))] = r
    return out


def baseline_columns(baselines: dict, shape: str, fmt: str, n: int) -> dict:
    """The peers' figures a row carries: vLLM's bf16 compute-only time on every row (the
    reference a quantized layer must also beat), torch._grouped_mm's on bf16 rows, vLLM's fp8
    GEMMs-only time on fp8_block rows. Absent cells are None."""
    b16 = baselines.get(("bf16", shape, n), {})
    cols = {"vllm_compute_only": b16.get("vllm_compute_only")}
    if fmt == "bf16":
        cols["grouped_mm"] = b16.get("grouped_mm")
    if fmt == "fp8_block":
        cols["vllm_fp8_gemms_only"] = baselines.get(("fp8_block", shape, n), {}).get("vllm_fp8_gemms_only")
    return cols


# ----------------------------------------------------------------------------------
# bytes, FLOPs and floors (pure: tested without a GPU)
# ----------------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def matrix_bytes(fmt: str, out: int, inn: int) -> int:
    """Bytes of one [out, in] weight matrix stored in `fmt` (weights + scales)."""
    if fmt == "bf16":
        return out * inn * 2
    if fmt == "fp8_block":  # e4m3 bytes + fp32 scale_inv per 128x128 block
        return out * inn + _ceil_div(out, 128) * _ceil_div(inn, 128) * 4
    if fmt == "nvfp4":  # e2m1 nibbles + e4m3 scale per 16 + one fp32 scale_2
        if inn % 16:
            raise OptionError(f"nvfp4: in={inn} is not a multiple of 16")
        return out * inn // 2 + out * inn // 16 + 4
    if fmt == "mxfp4":  # e2m1 nibbles + e8m0 scale per 32
        if inn % 32:
            raise OptionError(f"mxfp4: in={inn} is not a multiple of 32")
        return out * inn // 2 + out * inn // 32
    raise OptionError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def expert_bytes(fmt: str, H: int, I: int) -> int:
    """Bytes of one routed expert's gate [I, H], up [I, H] and down [H, I] in `fmt`."""
    return 2 * matrix_bytes(fmt, I, H) + matrix_bytes(fmt, H, I)


def layer_weight_bytes(cfg: MoeConfig, fmt: str) -> int:
    """Bytes of one layer's weights: routed experts in `fmt`, router and shared expert bf16."""
    E, H, I, R = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.router_width
    bias = (2 * I + H) * 4 if cfg.has_expert_bias else 0
    return E * (expert_bytes(fmt, H, I) + bias) + R * H * 2 + 3 * H * cfg.shared_expert_intermediate_size * 2


def expected_touched(E: int, k: int, n: int) -> float:
    """Distinct experts N tokens touch under uniform routing (used only to size the rotation)."""
    return E * (1.0 - (1.0 - k / E) ** n)


def layers_needed(layer_bytes: float, touched_bytes: float, max_bytes: float, l2_bytes: float = L2_BYTES) -> int:
    """Copies of the layer to rotate through one graph so that what the forwards touch
    (the experts of the smallest N) is 4x the L2: at least 2, at most MAX_LAYERS and what
    `max_bytes` of device memory holds (but 2 regardless)."""
    want = max(2, math.ceil(4 * l2_bytes / max(touched_bytes, 1.0)), math.ceil(4 * l2_bytes / layer_bytes))
    cap = max(2, min(MAX_LAYERS, int(max_bytes // layer_bytes)))
    return min(want, cap)


def cell_figures(cfg: MoeConfig, fmt: str, n: int, touched: int, *, copy_tbps: float = COPY_TBPS,
                 bf16_tflops: float = BF16_TFLOPS, fp8_tflops: float = FP8_TFLOPS) -> dict:
    """bytes, FLOPs and floors (µs) of one cell: `touched` = distinct routed experts the
    routing chose. `floor_us` uses the bf16 rate (every format's GEMMs run on bf16 tensor
    cores here); fp8_block also gets `floor_fp8_us`: the routed experts' FLOPs at the fp8
    rate, the router's and shared expert's at the bf16 rate."""
    H, I, k, R = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.router_width
    Is = cfg.shared_expert_intermediate_size
    bias = (2 * I + H) * 4 if cfg.has_expert_bias else 0
    nbytes = touched * (expert_bytes(fmt, H, I) + bias) + (R * H + 3 * H * Is + 2 * n * H) * 2
    routed_flops = 2 * n * k * 3 * H * I
    other_flops = 2 * n * (H * R + 3 * H * Is)
    flops = routed_flops + other_flops
    mem_us = nbytes / copy_tbps / 1e6
    fig = dict(bytes=nbytes, flops=flops, floor_us=max(mem_us, flops / bf16_tflops / 1e6))
    if fmt == "fp8_block":
        fig["floor_fp8_us"] = max(mem_us, routed_flops / fp8_tflops / 1e6 + other_flops / bf16_tflops / 1e6)
    return fig


# (bytes, FLOPs) of each stage a forward of N rows moves and computes (stage_figures); FLOPs 0:
# the stage is timed against the copy rate only
STAGES_METHOD = ("CUDA events between the stages inside the timed graph replays (the separated plan: no "
                 "programmatic dependent launch, so the total reads higher than the row's us at small N); each "
                 "stage's time is the last replay's, averaged over the layers; share_pct of the stages' sum; bytes "
                 "and FLOPs per stage from the layer's shape and the touched experts (bench.stage_figures)")


def stage_figures(cfg: MoeConfig, fmt: str, n: int, touched: int, path: str, w8a8: bool = False) -> dict:
    """{stage: (bytes, FLOPs)} of a forward of `n` rows whose routing touched `touched` routed
    experts: each stage's weights once, its inputs and outputs once (what the copy rate bounds)."""
    H, I, k, R = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.router_width
    Is = cfg.shared_expert_intermediate_size
    pairs = n * k
    act = 1 if w8a8 else 2  # the activation's bytes a value between gate/up and down
    y = 2 if path == "prefill" else 4  # down's per-pair rows: weighted bf16 (prefill) or fp32
    b_gate_up, b_down = (touched * 2 * I * 4, touched * H * 4) if cfg.has_expert_bias else (0, 0)
    fig = {
        "router": (R * H * 2 + n * H * 2 + n * R * 4, 2 * n * H * R),
        "topk": (n * R * 4 + pairs * 8, 0),
        "sort": (pairs * 4 * 4, 0),  # ids in; sorted rows, pairs and positions out
        "gate_up": (touched * 2 * matrix_bytes(fmt, I, H) + 2 * Is * H * 2 + b_gate_up + n * H * 2
                    + (pairs * I + n * Is) * act, 2 * (pairs * I + n * Is) * 2 * H),
        "down": (touched * matrix_bytes(fmt, H, I) + H * Is * 2 + b_down + (pairs * I + n * Is) * act
                 + (pairs + (n if Is else 0)) * H * y, 2 * (pairs * I + n * Is) * H),
        "reduce": ((pairs + (n if Is else 0)) * H * y + n * H * 2, 0),
    }
    if cfg.pre_expert_norm:
        fig["norm"] = (2 * n * H * 2, 0)
    return fig


def stage_rows(stage_us: dict, figures: dict) -> dict:
    """Each timed stage: µs, share of the stages' sum, and its bytes / FLOPs as achieved rates."""
    total = sum(stage_us.values()) or 1.0
    out = {}
    for st, us in stage_us.items():
        nbytes, flops = figures.get(st, (0, 0))
        out[st] = dict(us=round(us, 2), share_pct=round(100 * us / total, 1), bytes=nbytes, flops=flops,
                       TBps=round(nbytes / us / 1e6, 3) if us > 0 else None,
                       TFLOPs=round(flops / us / 1e6, 2) if us > 0 and flops else None)
    return out


def format_stages(stages: dict) -> str:
    """The terminal line of a row's stages: µs, share, and the rate that bounds it."""
    def rate(d):
        return f"{d['TFLOPs']:.0f} TFLOP/s" if d["TFLOPs"] else f"{d['TBps'] or 0:.2f} TB/s"
    return "  ".join(f"{st} {d['us']:.1f} ({d['share_pct']:.0f}%, {rate(d)})" for st, d in stages.items())


def bench_row(cfg: MoeConfig, shape: str, fmt: str, n: int, touched: int, times_us: list[float],
              ceilings: dict, baselines: dict, *, path: str, layers: int,
              stage_us: Optional[dict] = None, path_taken: Optional[str] = None, w8a8: bool = False) -> dict:
    """One result row: the median of `times_us` next to this format's floor and the peers'
    figures from the baseline files; with `stage_us`, each stage's share and rates
    (`path_taken`: the path the forward ran, for its stages' bytes)."""
    us = statistics.median(times_us)
    fig = cell_figures(cfg, fmt, n, touched, copy_tbps=ceilings["copy_TBps"], bf16_tflops=ceilings["bf16_TFLOPs"],
                       fp8_tflops=ceilings["fp8_TFLOPs"])
    row = dict(shape=shape, format=fmt, N=n, path=path, routed_only=not cfg.has_shared_expert, layers=layers,
               us=round(us, 2), floor_us=round(fig["floor_us"], 2), pct_of_floor=round(100 * fig["floor_us"] / us, 1))
    if "floor_fp8_us" in fig:
        row.update(floor_fp8_us=round(fig["floor_fp8_us"], 2), pct_of_fp8_floor=round(100 * fig["floor_fp8_us"] / us, 1))
    if "bf16_TFLOPs_burst" in ceilings:  # the same floor from the burst ceilings, for comparison
        burst = cell_figures(cfg, fmt, n, touched, copy_tbps=ceilings.get("copy_TBps_burst", ceilings["copy_TBps"]),
                             bf16_tflops=ceilings["bf16_TFLOPs_burst"],
                             fp8_tflops=ceilings.get("fp8_TFLOPs_burst", ceilings["fp8_TFLOPs"]))
        row.update(floor_burst_us=round(burst["floor_us"], 2), pct_of_burst_floor=round(100 * burst["floor_us"] / us, 1))
    row.update(touched=touched, bytes=fig["bytes"], TBps=round(fig["bytes"] / us / 1e6, 3),
               TFLOPs=round(fig["flops"] / us / 1e6, 2), spread_us=round(max(times_us) - min(times_us), 2),
               reps_us=[round(t, 2) for t in times_us])  # each repetition, in the order timed
    row.update(baseline_columns(baselines, shape, fmt, n))
    row["stages_us"] = {st: round(t, 2) for st, t in (stage_us or {}).items()} or None
    if stage_us:
        taken = path_taken or (path if path != "auto" else "prefill")
        row["stages"] = stage_rows(stage_us, stage_figures(cfg, fmt, n, touched, taken, w8a8))
    return row


def format_row(row: dict) -> str:
    """The terminal line of one row: format, N, time, floor(s), rates, peers' ratios (> 1: we are faster)."""
    us = row["us"]
    line = (f"  {row['format']:<9} N={row['N']:<6} {us:9.1f} us  floor {row['floor_us']:8.1f} us "
            f"({row['pct_of_floor']:5.1f}% of floor)")
    if row.get("pct_of_burst_floor") is not None:
        line += f" ({row['pct_of_burst_floor']:.1f}% of the burst floor)"
    if row.get("floor_fp8_us") is not None:
        line += f"  fp8 floor {row['floor_fp8_us']:.1f} us ({row['pct_of_fp8_floor']:.1f}%)"
    line += f"  {row['TBps']:.2f} TB/s  {row['TFLOPs']:.1f} TFLOP/s  touched {row['touched']}"
    peers = [("vllm_compute_only", "vLLM" if row["format"] == "bf16" else "vLLM-bf16"),
             ("vllm_fp8_gemms_only", "vLLM-fp8-GEMMs"), ("grouped_mm_us", "grouped_mm"), ("eager_us", "eager")]
    vs = [f"{row[key] / us:.2f}x {label}" for key, label in peers if row.get(key)]
    if row.get("lora_us") is not None:
        vs.append(f"LoRA {row['lora_us']:.1f} us ({row['overhead_pct']:+.1f}% over {row['base_us']:.1f})")
    if row.get("host_us") is not None:
        vs.append(f"host {row['host_us']:.1f} us (step by step {row.get('host_steps_us', 0):.1f}; plan built in "
                  f"{row['plan_build_us']:.0f} us, captured in {row.get('graph_capture_us') or 0:.0f})")
    return line + ("  " + "  ".join(vs) if vs else "")


# ----------------------------------------------------------------------------------
# random weights, drawn on the device (pure array code: `xp` is cupy, or numpy in tests)
# ----------------------------------------------------------------------------------

_E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # uniform random codes
FP8_SIGMA = 448.0 / 8  # std of the values encoded to e4m3: 8 sigma to the e4m3 max, no clipping in practice
NVFP4_SCALE_CODES = (0x30, 0x40)  # e4m3 codes 0.5 .. 1.875: finite, positive


def _e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 0xF, code & 7
    v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if code & 0x80 else v


def e4m3_bits(xp, v):
    """float -> e4m3fn bit patterns (uint8), round to nearest even, saturating at +-448:
    never the NaN codes 0x7F / 0xFF. Pure array arithmetic, for numpy and CuPy alike."""
    v = xp.asarray(v, dtype=xp.float32)
    a = xp.minimum(xp.abs(v), xp.float32(448.0))
    _, ex = xp.frexp(xp.maximum(a, xp.float32(2.0 ** -10)))  # a = m 2^ex, m in [0.5, 1)
    e = xp.maximum(ex.astype(xp.int32) - 1, -6)  # floor(log2 a); -6 = the subnormals' exponent
    n = xp.rint(xp.ldexp(a, (3 - e).astype(xp.int32))).astype(xp.int32)  # a / 2^(e-3): 8..16 (0..8 subnormal)
    bits = ((e + 6) * 8 + n).astype(xp.uint8)  # n = 16 carries into the exponent field exactly
    return (bits | (xp.signbit(v).astype(xp.uint8) << 7)).astype(xp.uint8, copy=False)


def _random_bytes(xp, rng, shape) -> Any:
    """Uniform random uint8 of `shape`, drawn as 16-bit words (CuPy's integers() takes a
    32-bit signed range, and draws 32-bit words under any dtype: 2 bytes of temporary per byte)."""
    size = math.prod(shape)
    words = rng.integers(0, 1 << 16, size=_ceil_div(size, 2), dtype=xp.uint16)
    return words.view(xp.uint8)[:size].reshape(shape)


def _quantized_random(xp, rng, fmt: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """Random weights of logical shape [..., out, in] in `fmt`, as the raw arrays of that
    format (names as in cupymoe.formats), dequantized std about 1/sqrt(in) so activations
    stay O(1). `xp`: cupy (the benchmark) or numpy (tests); `rng`: its Generator.

        bf16       bits  u16 [..., out, in]
        fp8_block  q     u8 (e4m3 bits) [..., out, in]; scale_inv f32 [..., ceil(out/128), ceil(in/128)]
        nvfp4      packed u8 [..., out, in/2]; scale u8 (e4m3 bits) [..., out, in/16]; scale_2 f32 [...]
        mxfp4      blocks u8 [..., out, in/32, 16]; scales u8 (e8m0) [..., out, in/32]
    """
    shape = tuple(int(d) for d in shape)
    lead, (out, inn) = shape[:-2], shape[-2:]
    std = 1.0 / math.sqrt(inn)
    if fmt == "bf16":
        w = rng.standard_normal(shape, dtype=xp.float32) * xp.float32(std)
        return {"bits": (w.view(xp.uint32) >> 16).astype(xp.uint16)}
    if fmt == "fp8_block":
        q = e4m3_bits(xp, rng.standard_normal(shape, dtype=xp.float32) * xp.float32(FP8_SIGMA))
        sshape = lead + (_ceil_div(out, 128), _ceil_div(inn, 128))
        jitter = xp.exp2(rng.random(sshape, dtype=xp.float32) - xp.float32(0.5))  # a factor in [0.71, 1.41)
        return {"q": q, "scale_inv": (jitter * xp.float32(std / FP8_SIGMA)).astype(xp.float32)}
    if fmt == "nvfp4":
        if inn % 16:
            raise OptionError(f"nvfp4: in={inn} is not a multiple of 16")
        lo, hi = NVFP4_SCALE_CODES
        scale_rms = math.sqrt(sum(_e4m3_value(c) ** 2 for c in range(lo, hi)) / (hi - lo))
        scale = rng.integers(lo, hi, size=lead + (out, inn // 16), dtype=xp.int32).astype(xp.uint8)
        s2 = xp.full(lead, std / (_E2M1_RMS * scale_rms), dtype=xp.float32)
        return {"packed": _random_bytes(xp, rng, lead + (out, inn // 2)), "scale": scale, "scale_2": s2}
    if fmt == "mxfp4":
        if inn % 32:
            raise OptionError(f"mxfp4: in={inn} is not a multiple of 32")
        # each group's exponent is e_lo or e_lo + 1, the upper with the probability that
        # makes the mean square exactly std^2: p 4 + (1 - p) = (std / (rms 2^e_lo))^2
        x = math.log2(std / _E2M1_RMS)
        e_lo = math.floor(x)
        p = (4.0 ** (x - e_lo) - 1.0) / 3.0
        up = rng.random(lead + (out, inn // 32), dtype=xp.float32) < xp.float32(p)
        scales = (up.astype(xp.int32) + (127 + e_lo)).astype(xp.uint8)  # far from the NaN exponent 255
        return {"blocks": _random_bytes(xp, rng, lead + (out, inn // 32, 16)), "scales": scales}
    raise OptionError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def _random_stack(xp, rng, fmt: str, shape: tuple[int, ...], chunk_elems: int = 1 << 28) -> dict[str, Any]:
    """`_quantized_random` of an [E, out, in] stack, drawn a few experts at a time so the
    float32 temporaries stay near `chunk_elems` elements (a layer's experts are GBs)."""
    E, out, inn = shape
    step = max(1, chunk_elems // (out * inn))
    res: dict[str, Any] = {}
    for e0 in range(0, E, step):
        part = _quantized_random(xp, rng, fmt, (min(step, E - e0), out, inn))
        for key, a in part.items():
            if key not in res:
                res[key] = xp.empty((E,) + a.shape[1:], dtype=a.dtype)
            res[key][e0:e0 + a.shape[0]] = a
        del part
    return res


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _container(fmt: str, raw: dict[str, Any]):
    """The raw arrays of one projection as cupymoe.formats' container (CuPy arrays kept on
    the device; nvfp4's per-matrix scale_2 on the host)."""
    from . import formats

    if fmt == "bf16":
        return raw["bits"]
    if fmt == "fp8_block":
        return formats.Fp8BlockWeight(q=raw["q"], scale_inv=raw["scale_inv"])
    if fmt == "nvfp4":
        return formats.Nvfp4Weight(packed=raw["packed"], scale=raw["scale"],
                                   scale_2=_host(raw["scale_2"]).astype(np.float32))
    if fmt == "mxfp4":
        return formats.Mxfp4Weight(blocks=raw["blocks"], scales=raw["scales"])
    raise OptionError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


# The random e_score_correction_bias's spread. A trained one balances the experts' loads; a
# random one of std 0.1 (the sigmoid scores' spread is ~0.2 here) steered every token to the
# same high-bias experts instead: deepseek-v3's uniform-random input touched ~128 experts at
# N = 64 and ~210 at 4096 (uniform routing: 222 and 256, as the peers' runs touched). At 0.01
# the reference routing touches 214-225 and 256 (benchmarks/DECISIONS.md).
CORRECTION_BIAS_STD = 0.01


def random_device_weights(cfg: MoeConfig, seed: int, fmt: str = "bf16"):
    """Random weights drawn on the GPU (a layer is GBs: numpy would take minutes).

    Routed experts (gate, up, down) in `fmt`, as cupymoe.formats containers holding CuPy
    arrays (bf16: CuPy uint16 bits); router and shared expert bf16 bits; biases float32 on
    the host. Dequantized std about 1/sqrt(fan_in) keeps activations O(1). The router and
    its biases are drawn first, so one seed routes alike in every format.
    """
    import cupy

    from .host_weights import HostWeights

    if fmt not in FORMATS:
        raise OptionError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    g = cupy.random.default_rng(seed)
    E, H, I, R = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.router_width
    Is = cfg.shared_expert_intermediate_size

    def bf16(*shape):
        return _quantized_random(cupy, g, "bf16", shape)["bits"]

    def v(n, scale=0.1):
        return (g.standard_normal(n, dtype=cupy.float32) * scale).get()

    router = bf16(R, H)
    router_bias = v(R) if cfg.has_router_bias else None
    correction_bias = v(R, CORRECTION_BIAS_STD) if cfg.has_correction_bias else None
    experts = {name: _container(fmt, _random_stack(cupy, g, fmt, shape))
               for name, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))}
    return HostWeights(
        router=router, **experts,
        router_bias=router_bias, correction_bias=correction_bias,
        gate_bias=v((E, I)) if cfg.has_expert_bias else None,
        up_bias=v((E, I)) if cfg.has_expert_bias else None,
        down_bias=v((E, H)) if cfg.has_expert_bias else None,
        shared_gate=bf16(Is, H) if Is else None, shared_up=bf16(Is, H) if Is else None,
        shared_down=bf16(H, Is) if Is else None,
        shared_expert_gate=v(H) if cfg.has_shared_expert_gate else None,
    )


def _git(root: Path, *args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=root, stderr=subprocess.DEVNULL, text=True).strip()


def _git_commit(root: Optional[Path] = None) -> str:
    """The commit the package's tree (`root`: the folder holding cupymoe/ and cuda/) is at, with
    "+changes" where its cupymoe/ or cuda/ differ from it; "unknown" where the tree is not its
    repository's top (a copy inside another checkout, whose HEAD says nothing about it) or git
    cannot tell. CUPYMOE_COMMIT names it where the copy has no .git (a lent GPU machine)."""
    if os.environ.get("CUPYMOE_COMMIT"):
        return os.environ["CUPYMOE_COMMIT"]
    root = (root or Path(__file__).parent.parent).resolve()
    try:
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return "unknown"
        changed = _git(root, "status", "--porcelain", "--", "cupymoe", "cuda")
        return _git(root, "rev-parse", "--short", "HEAD") + ("+changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ----------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------

def _time_cell(layers, x, out, n: int, args, warm_s: float = STEADY_WARM_S,
               lora_ids: int = 0) -> tuple[list[float], dict[str, float], int]:
    """Eager once (warm, and the routing for the floor), then the graph of every layer's
    forward: per-layer µs of each repetition, per-stage µs (--stages), touched experts. `warm_s`:
    seconds of replays before timing (shorter where the GPU is already under the same load).
    `lora_ids`: the rows' adapter slots ([n] int32 on the device; 0: the base plans)."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    run = _CapturedRun(layers, x, out, n, args, s, lora_ids)
    _steady(s, [run], warm_s)
    times = [run.time_once(args) for _ in range(args.repeats)]
    return times, run.stage_us(), run.touched


class _CapturedRun:
    """One timed configuration: the layers' forwards captured as one graph (after one eager
    pass, whose routing gives the touched experts), with its stage events under --stages."""

    def __init__(self, layers, x, out, n: int, args, s, lora_ids: int = 0):
        import cupy

        cfg = layers[0].cfg
        k, E = cfg.num_experts_per_tok, cfg.num_experts
        self.s, self.layers = s, len(layers)
        for L in layers:
            L.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr, lora_ids_ptr=lora_ids)
        s.synchronize()
        # every copy holds the same weights, so the last layer's routing is every layer's
        ids = cupy.ndarray((n, k), cupy.int32, cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(layers[-1].scratch.ptr("topk_ids"), n * k * 4, None), 0)).get()
        self.touched = len(np.unique(ids[ids < E]))
        self.stage_events: list = []
        s.begin_capture()
        with record_stage_events(self.stage_events) if args.stages else contextlib.nullcontext():
            for L in layers:
                L.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr, lora_ids_ptr=lora_ids)
        self.graph = s.end_capture()
        self.graph.upload(s)
        for _ in range(3):
            self.graph.launch(s)
        s.synchronize()

    def time_once(self, args) -> float:
        """One repetition: per-layer µs over args.replays replays."""
        import cupy

        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(self.s)
        for _ in range(args.replays):
            self.graph.launch(self.s)
        e1.record(self.s)
        e1.synchronize()
        return cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / args.replays / self.layers

    def stage_us(self) -> dict[str, float]:
        """Each stage's µs in the last replay of this graph, averaged over the layers."""
        import cupy

        out: dict[str, float] = {}
        for st, a, z in self.stage_events:
            out[st] = out.get(st, 0.0) + cupy.cuda.get_elapsed_time(a, z) * 1e3 / self.layers
        return out


def _steady(s, runs: list, warm_s: float) -> None:
    """The steady state (module docstring): the runs' graphs replayed in turn until warm_s has passed."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        for r in runs:
            r.graph.launch(s)
        s.synchronize()


def time_host(layer, x, out, n: int, calls: int = HOST_CALLS) -> dict:
    """The host's side of an eager forward of `n` rows: the mean µs `forward` takes to validate,
    look up its plan and enqueue (the device drained between batches, outside the timing), as
    one graph launch (host_us) and step by step (host_steps_us), and the µs its plan takes to
    build and pack from nothing, and to capture as a graph."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    t0 = time.perf_counter()
    layer._packed.clear()
    layer._by_n.clear()
    layer._graphs.clear()
    packed = layer.plan_for(n)
    build_us = (time.perf_counter() - t0) * 1e6
    args = (int(x.data.ptr), n, int(out.data.ptr), s.ptr)
    t0 = time.perf_counter()
    if layer._graph_launch:
        layer._capture(packed, args[0], args[2], 0, n)
    capture_us = (time.perf_counter() - t0) * 1e6
    row = dict(host_us=_host_mean(layer, args, s, calls), host_calls=calls, plan_build_us=round(build_us, 1),
               graph_capture_us=round(capture_us, 1) if layer._graph_launch else None)
    graph_launch, layer._graph_launch = layer._graph_launch, False
    try:
        row["host_steps_us"] = _host_mean(layer, args, s, calls)
    finally:
        layer._graph_launch = graph_launch
    return row


def _host_mean(layer, args: tuple, s, calls: int) -> float:
    layer.forward(*args)  # the per-N lookup made once, as a server's first call of this N
    s.synchronize()
    return round(host_us_per_call(lambda: layer.forward(*args), calls, s.synchronize), 2)


def host_us_per_call(fn, calls: int, drain) -> float:
    """µs a call of `fn` on the host: over `calls` calls in batches of HOST_BATCH (`drain()` between
    batches, outside the timing), the median of the batch means (a batch another tenant of the
    host slowed is discounted)."""
    means = []
    for done in range(0, calls, HOST_BATCH):
        batch = min(HOST_BATCH, calls - done)
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        means.append((time.perf_counter() - t) / batch)
        drain()
    return float(np.median(means)) * 1e6


def _layer_count(cfg: MoeConfig, fmt: str, tokens) -> int:
    """Copies of the layer a cell rotates through (module docstring), as device memory allows."""
    import cupy

    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    layer_bytes = layer_weight_bytes(cfg, fmt)
    touched_bytes = expected_touched(E, k, min(tokens)) * expert_bytes(fmt, H, I)
    total_mem = cupy.cuda.runtime.memGetInfo()[1]
    return layers_needed(layer_bytes, touched_bytes, 0.6 * total_mem - layer_bytes)


def layer_options(fmt: str, args, **extra) -> dict:
    """MoeLayer's keyword options of a bench or tune run (`extra` over the arguments')."""
    opts = {} if getattr(args, "decode_max_tokens", None) is None else {"decode_max_tokens": args.decode_max_tokens}
    if fmt == "fp8_block":
        opts["fp8_compute"] = getattr(args, "fp8_compute", "auto")
    if getattr(args, "lora", 0):  # the slots reserved once; a w8a8 layer serves router adapters only
        opts.update(max_loras=args.lora, max_lora_rank=args.lora_rank)
        if opts.get("fp8_compute") == "auto":
            opts["fp8_compute"] = "w8a16"
    return {**opts, **extra}


def build_layers(cfg: MoeConfig, fmt: str, args, tag: str, *, path: str = "auto", **opts) -> list:
    """Random weights of `fmt` drawn once on the GPU, then the layer copies built from them and
    warmed up. A format the layer does not serve raises NotImplementedError, TypeError or ValueError."""
    import cupy

    from .layer import MoeLayer

    n_layers = _layer_count(cfg, fmt, args.tokens)
    t0 = time.perf_counter()
    print(f"{tag} drawing random {fmt} expert weights on the GPU ({layer_weight_bytes(cfg, fmt) / 1e9:.2f} GB/layer) "
          f"...", flush=True)
    hw = random_device_weights(cfg, args.seed, fmt)
    cupy.cuda.runtime.deviceSynchronize()
    print(f"{tag} {fmt} weights drawn in {time.perf_counter() - t0:.1f} s; building {n_layers} layers from them ...",
          flush=True)
    layers = [MoeLayer(cfg, hw, max_tokens=max(args.tokens), path=path, **opts) for _ in range(n_layers)]
    del hw  # each layer holds its own copy
    for L in layers:
        L.warmup()
    return layers


def cell_input(cfg: MoeConfig, n: int, seed: int):
    """(x, out) of one cell: one input per N, the same in every format (so the same routing)."""
    import cupy

    from .verify import bf16_bits

    x_host = np.random.default_rng([seed, n]).standard_normal((n, cfg.hidden_size), dtype=np.float32)
    x = cupy.asarray(bf16_bits(x_host))
    out = cupy.empty_like(x)
    cupy.cuda.runtime.deviceSynchronize()  # the copy ran on the null stream; the layer reads x on its own
    return x, out


# ----------------------------------------------------------------------------------
# LoRA (--lora K --lora-rank R): the same layers timed with and without adapters
# ----------------------------------------------------------------------------------

LORA_TIMINGS = ("interleaved", "sequential")  # --lora-timing
LORA_ALPHA = 32.0  # the adapters' lora_alpha (scale alpha / r; it changes values, not the time)
LORA_METHOD = ("each cell timed twice in one run on the same layer copies (built with max_loras=K, "
               "max_lora_rank=R), both graphs captured first and their repetitions interleaved (base, "
               "LoRA, base, ...) after STEADY_WARM_S of both in turn: base_us with lora_ids_ptr=0 (the "
               "base plans), lora_us with the rows' "
               "adapter ids (row i -> slot i mod K, int32 on the device) passed to every forward inside "
               "the captured graph; the K slots hold cupymoe.lora.random_lora adapters of rank R on "
               "lora_targets (every module the layer has: router, routed experts, shared expert; a w8a8 "
               "layer's default slots take the router's alone); overhead_pct = 100 (lora_us / base_us - 1); the row's "
               "us, floor and touched are the base run's, lora_touched the LoRA run's (the router's "
               "delta changes the routing); overhead_paired_pct = 100 (median of lora_i / base_i - 1); "
               "timing 'sequential' (--lora-timing): each graph warmed and timed alone, base first")


def lora_targets(layer) -> tuple:
    """The modules the bench's adapters name: all of them, but the router's alone where the layer's
    slots take nothing else (a w8a8 layer by default: MoeLayer(lora_experts=...))."""
    from .lora import LoraTarget

    return tuple(LoraTarget) if layer.lora_experts else (LoraTarget.ROUTER,)


def install_adapters(layers, args) -> list[str]:
    """K random adapters of rank R drawn once (seeded) and copied into every layer copy's slots
    0..K-1; returns the targets' names."""
    from .lora import random_lora

    targets = lora_targets(layers[0])
    rng = np.random.default_rng([args.seed, 42])
    for slot in range(args.lora):
        adapter = random_lora(layers[0].cfg, rng, args.lora_rank, targets=targets, alpha=LORA_ALPHA)
        for L in layers:
            L.set_lora(slot, adapter)
    return [t.value for t in targets]


def lora_ids_on_device(n: int, k: int):
    import cupy

    from .lora import round_robin_ids

    ids = cupy.asarray(round_robin_ids(n, k))
    cupy.cuda.runtime.deviceSynchronize()  # copied on the null stream; the layer reads it on its own
    return ids


def lora_columns(base_us: list[float], lora_us: list[float], touched: int) -> dict:
    """A row's LoRA columns from the two runs' interleaved repetitions: the medians' ratio, and
    the median of each pair's ratio (repetition i of both, timed back to back)."""
    b, l_ = statistics.median(base_us), statistics.median(lora_us)
    paired = statistics.median(lt / bt for bt, lt in zip(base_us, lora_us))
    return dict(base_us=round(b, 2), lora_us=round(l_, 2), overhead_pct=round(100.0 * (l_ / b - 1.0), 1),
                overhead_paired_pct=round(100.0 * (paired - 1.0), 1),
                lora_touched=touched, lora_reps_us=[round(t, 2) for t in lora_us])


def lora_meta(args, rows: list[dict]) -> Optional[dict]:
    """The JSON meta's account of the LoRA runs (None without --lora)."""
    if not getattr(args, "lora", 0):
        return None
    computes = sorted({r["fp8_compute"] for r in rows if r.get("fp8_compute")})
    return dict(max_loras=args.lora, max_lora_rank=args.lora_rank, adapters=args.lora, rank=args.lora_rank,
                timing=getattr(args, "lora_timing", "interleaved"),
                lora_alpha=LORA_ALPHA, ids="row i -> slot i mod K", fp8_compute=computes or None,
                fp8_note="fp8_block layers are built with fp8_compute='w8a16' unless --fp8-compute names one: "
                         "w8a8 layers serve router adapters alone (lora_targets says so per row)",
                method=LORA_METHOD)


def _time_base_and_lora(layers, x, out, n: int, args) -> dict:
    """A --lora cell: the base graph and the LoRA graph captured side by side and their
    repetitions interleaved (base, LoRA, base, ...), so both see the same clocks under the power
    cap (LORA_METHOD); --lora-timing sequential: each graph timed alone in turn."""
    import cupy

    ids = lora_ids_on_device(n, args.lora)
    if getattr(args, "lora_timing", "interleaved") == "sequential":
        times, stage_us, touched = _time_cell(layers, x, out, n, args)
        lora_times, lora_stage_us, lora_touched = _time_cell(layers, x, out, n, args, lora_ids=int(ids.data.ptr))
        return dict(times=times, stage_us=stage_us, touched=touched, lora_times=lora_times,
                    lora_touched=lora_touched, lora_stage_us=lora_stage_us)
    s = cupy.cuda.Stream(non_blocking=True)
    base = _CapturedRun(layers, x, out, n, args, s)
    lora = _CapturedRun(layers, x, out, n, args, s, lora_ids=int(ids.data.ptr))
    _steady(s, [base, lora], STEADY_WARM_S)
    times, lora_times = [], []
    for _ in range(args.repeats):
        times.append(base.time_once(args))
        lora_times.append(lora.time_once(args))
    return dict(times=times, stage_us=base.stage_us(), touched=base.touched, lora_times=lora_times,
                lora_touched=lora.touched, lora_stage_us=lora.stage_us())


def _bench_cell(layers, shape: str, fmt: str, n: int, args, ceilings: dict, baselines: dict, torch_peers) -> dict:
    """One N of one preset and format: the layer timed, the row with its floor, stages and peers
    (--lora: timed again with the adapters, lora_columns)."""
    cfg = layers[0].cfg
    x, out = cell_input(cfg, n, args.seed)
    lora = _time_base_and_lora(layers, x, out, n, args) if getattr(args, "lora", 0) else None
    if lora:
        times, stage_us, touched = lora["times"], lora["stage_us"], lora["touched"]
    else:
        times, stage_us, touched = _time_cell(layers, x, out, n, args)
    row = bench_row(cfg, shape, fmt, n, touched, times, ceilings, baselines, path=args.path,
                    layers=len(layers), stage_us=stage_us, path_taken=layers[0].select_path(n),
                    w8a8=layers[0].plan.w8a8)
    if fmt == "fp8_block":
        row["fp8_compute"] = layers[0].fp8_compute
    if lora:
        row.update(lora_columns(times, lora["lora_times"], lora["lora_touched"]),
                   lora_targets=[t.value for t in lora_targets(layers[0])])
        if lora["lora_stage_us"]:  # --stages: where the adapters' time goes, stage by stage
            row["lora_stages_us"] = {st: round(t, 2) for st, t in lora["lora_stage_us"].items()}
    if getattr(args, "host", False):
        row.update(time_host(layers[0], x, out, n, args.host_calls))
    if torch_peers:
        row.update(time_peers(torch_peers, cfg, x, out, n, args))
    print(format_row(row), flush=True)
    if row.get("stages"):
        print("           stages: " + format_stages(row["stages"]), flush=True)
    if row.get("lora_stages_us"):
        print("      LoRA stages: " + "  ".join(f"{st} {t:.1f}" for st, t in row["lora_stages_us"].items()), flush=True)
    return row


def free_layers() -> None:
    """Give the memory of dropped layers (and the torch peers' views) back before the next GBs."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


def _bench_format(shape: str, cfg: MoeConfig, fmt: str, args, ceilings: dict, baselines: dict,
                  skipped: list) -> list[dict]:
    """Every N of one preset in one format: draw, build the layer copies, time, free."""
    tag = f"[{shape} {fmt}]"
    t0 = time.perf_counter()
    layers: list = []
    torch_peers = None
    try:
        try:
            layers = build_layers(cfg, fmt, args, tag, path=args.path, **layer_options(fmt, args))
        except (NotImplementedError, TypeError, ValueError) as e:  # a format the layer does not serve (yet)
            reason = f"{type(e).__name__}: {e}"
            print(f"{tag} skipped: {reason}", flush=True)
            skipped.append(dict(shape=shape, format=fmt, reason=reason))
            return []
        if fmt == "bf16" and not args.no_peers:
            torch_peers = _torch_peers(layers)
        note = "" if torch_peers else (" (torch peers: bf16 only)" if fmt != "bf16" else " (no torch peers)")
        if getattr(args, "lora", 0):
            targets = install_adapters(layers, args)
            note += f" (LoRA: {args.lora} adapters of rank {args.lora_rank} on {', '.join(targets)})"
        print(f"{tag} ready in {time.perf_counter() - t0:.1f} s{note}", flush=True)
        return [_bench_cell(layers, shape, fmt, n, args, ceilings, baselines, torch_peers) for n in args.tokens]
    finally:
        del torch_peers, layers  # the torch peers hold views of the layers' weights: drop both
        free_layers()


def run_bench(args) -> int:
    import cupy

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    ceilings, measured, ceilings_source = resolve_ceilings(args.measure_ceilings, gpu)
    baselines = load_baselines(gpu)
    fmts = list(dict.fromkeys(getattr(args, "formats", None) or ["bf16"]))
    results: list[dict] = []
    skipped: list[dict] = []
    from . import jit

    print(jit.tree_line(), flush=True)
    print(f"compiling or loading the kernels for {gpu} (cache: {jit.cache_dir()}) ...", flush=True)
    jit.library(cupy.cuda.runtime.getDevice(), progress=lambda line: print("  " + line, flush=True))
    for shape in args.preset:
        cfg = preset_config(shape, routed_only=not args.full_layer)
        for fmt in fmts:
            results += _bench_format(shape, cfg, fmt, args, ceilings, baselines, skipped)
    meta = dict(gpu=gpu, commit=_git_commit(), sources=jit.tree_digest(), knobs=knobs.chosen() or None,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), cupy=cupy.__version__, formats=fmts,
                full_layer=bool(args.full_layer), **ceilings, ceilings_measured=measured,
                ceilings_source=ceilings_source,
                floors="floor_us: bytes of the format actually touched / copy_TBps vs FLOPs / bf16_TFLOPs "
                       "(every format's GEMMs on bf16 tensor cores); floor_fp8_us (fp8_block): the routed "
                       "experts' FLOPs / fp8_TFLOPs; floor_burst_us: floor_us from the burst ceilings",
                baselines={f: baseline_path(f).name for f in sorted({k[0] for k in baselines})},  # no machine paths
                method=f"CUDA-graph replays over several layers, after {STEADY_WARM_S} s of replays the median of "
                       f"repeats; measured ceilings: after {STEADY_WARM_S} s of load, the median of {CEILING_REPEATS} "
                       f"repetitions of {CEILING_CALLS} calls (the steady state; *_burst: 3 warm-ups, the mean of 10)",
                stages_method=STAGES_METHOD if getattr(args, "stages", False) else None, skipped=skipped or None,
                lora=lora_meta(args, results))
    path = Path(args.json) if args.json else (
        Path("benchmarks/results") / f"{datetime.now():%Y%m%d-%H%M}-{gpu.replace(' ', '_')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    print(f"results written to {path}", file=sys.stderr)
    if args.plots:
        for png in plot_results(results, Path(args.plots), stem=path.stem):
            print(f"plot written to {png}", file=sys.stderr)
    return 0 if results else 1


def _torch_peers(layers):
    """One TorchPeers per layer, or None when torch (with CUDA) is not importable."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    from .peers import TorchPeers

    return [TorchPeers(L) for L in layers]


def time_peers(peers, cfg, x, out, n: int, args) -> dict:
    """The peers on the same input, same layers: grouped_mm captured in a graph, eager
    (host-synchronising) timed as is; and, where they compute cupymoe's function, how
    far their output is from cupymoe's (normwise)."""
    import torch

    from .peers import same_function

    xt = torch.from_dlpack(x).view(torch.bfloat16)
    ours = torch.from_dlpack(out).view(torch.bfloat16).float()
    res: dict = {}
    o = torch.empty_like(xt)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        peers[-1].grouped_mm(xt, o)  # warm-up, and the output check: `out` holds the last layer's
    torch.cuda.synchronize()
    if same_function(cfg):
        res["grouped_mm_vs_cupymoe"] = round(float((o.float() - ours).norm() / ours.norm()), 5)

    def timed(fn, reps, stream):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = []
        with torch.cuda.stream(stream):
            for _ in range(reps):
                e0.record(stream)
                fn()
                e1.record(stream)
                e1.synchronize()
                t.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(t)

    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for p in peers:
                p.grouped_mm(xt, o)
        g.replay()

        def replays():
            for _ in range(args.replays):
                g.replay()

        res["grouped_mm_us"] = round(timed(replays, args.repeats, s) / args.replays / len(peers), 2)
    except RuntimeError as e:  # a torch build whose grouped_mm cannot be captured: time it eagerly
        res["grouped_mm_note"] = f"not capturable ({e.__class__.__name__}); timed eagerly"
        s = torch.cuda.Stream()  # a failed capture can leave its stream unusable
        torch.cuda.synchronize()
        res["grouped_mm_us"] = round(timed(lambda: [p.grouped_mm(xt, o) for p in peers], args.repeats, s)
                                     / len(peers), 2)
    if n <= args.eager_max_tokens:
        res["eager_us"] = round(timed(lambda: [p.eager(xt, o) for p in peers], 3, s) / len(peers), 2)
    return res


def plot_results(rows: list[dict], folder: Path, stem: str = "bench") -> list[Path]:
    """One PNG per preset and format: time against N (log-log), the floor(s), every
    implementation. bf16: <stem>-<preset>.png; other formats: <stem>-<preset>-<format>.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    series = [("us", "cupymoe", "-o"), ("grouped_mm_us", "torch._grouped_mm (same run)", "--s"),
              ("eager_us", "per-expert eager loop (same run)", ":^"),
              ("vllm_compute_only", "vLLM bf16 compute-only (baseline file)", "-.d"),
              ("vllm_fp8_gemms_only", "vLLM fp8 GEMMs only (baseline file)", "-.v"),
              ("floor_us", "floor (bf16 rate)", "k-"), ("floor_fp8_us", "floor (fp8 rate)", "k--")]
    for shape, fmt in dict.fromkeys((r["shape"], r.get("format", "bf16")) for r in rows):
        mine = sorted((r for r in rows if r["shape"] == shape and r.get("format", "bf16") == fmt),
                      key=lambda r: r["N"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, label, style in series:
            pts = [(r["N"], r[key]) for r in mine if r.get(key)]
            if pts:
                if key == "floor_us" and fmt != "fp8_block":
                    label = "floor"
                ax.plot(*zip(*pts), style, label=label, linewidth=1.0 if key.startswith("floor") else 1.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("µs per layer")
        what = "routed experts" if mine[0].get("routed_only", True) else "full layer"
        ax.set_title(f"{shape}: {fmt} experts, MoE layer ({what})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        png = folder / (f"{stem}-{shape}.png" if fmt == "bf16" else f"{stem}-{shape}-{fmt}.png")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    return written
