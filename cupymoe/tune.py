"""python -m cupymoe tune: time every admissible choice per (preset, format, N) and keep the fastest.

For each preset and format the layer copies are drawn and built once (with decode and atomic
caps that admit every candidate); for each N each distinct candidate plan is forced through
the tuning table's own lookup (LayerPlan.tuned) and timed as bench times a cell (CUDA-graph
replays over the copies, the steady state, the median of repetitions). The choices:

    path            decode (up to DECODE_CAP rows), atomic (up to ATOMIC_CAP), prefill
    grouped         math (from MATH_MIN_ROWS rows an expert) or stream (up to STREAM_MAX_ROWS); not w8a8
    w8a8_decode     mma or wgmma (fp8_block as w8a8, on the decode paths)
    decode_kernel   swapab (bf16 and fp8 as w8a8 on sm_90a, decode and atomic paths up to SWAPAB_CAP rows,
                    where the largest token tile holds a busy expert) or the format's other decode kernels
    token_tile      the swap-AB decodes' token tile: the rule's (heuristics.swapab_busy_rows) and each
                    smaller one that holds an expert one Poisson deviation above its mean rows; the w8a8
                    wgmma decode's: the rule's (heuristics.a8_token_tile) and each wider one
    sm90_fp8        tma (the w8a8 grouped GEMM by TMA, 128 x 256 tiles, on the prefill path) or cp_async
    sm90_gate_up,   the bf16 TMA GEMM's variant of gate/up and of down on the prefill path's math tiles
    sm90_down       (sm_90a): each pair of the TUNED_SM90 variants that fit the layer
                    (heuristics.sm90_variant_fits: its tensor maps and gathered inputs)

Candidates whose launches equal another's are timed once; where the default (what the
heuristics pick today) already runs at FLOOR_PRUNE_PCT of the floor, nothing else is timed. A
candidate replaces the default only when faster by more than MARGIN and its output is within
MAX_REL_ERR of the default's (the paths sum in other orders; a larger gap is a fault, not a choice). The run writes a result
file (benchmarks/results style) whose `table` rows, each with the command that measured it,
`--apply` merges into the tuning table (cupymoe/data/tuning.json, entry by_shape; a sweep timed on
another GPU than the table's into that GPU's by_device section).
"""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from . import heuristics as HX
from .forward_plan import build_forward_plan
from .plan import DeviceFacts, LayerPlan, choose_path
from .catalog import WGMMA_DECODE_TOKEN_TILES, GemmMode
from .errors import ConfigError
from .tuning import TUNED_SM90, Choice, Tuning, fine_bucket, format_key, parse_by_shape, shape_key

if TYPE_CHECKING:
    from .ceilings import Ceilings

# decode candidates only up to the rows the GPU tests check that path at (`python -m cupymoe verify`:
# 64; w8a8 and w8a16 to 511: tests/test_gpu_quant.py test_w8a8_decode_kernels_past_64_rows,
# test_w8a16_decode_kernels_past_64_rows; fp4 to 2047: test_fp4_decode_kernels_past_256_rows)
DECODE_CAP = {"bf16": 64, "fp8_block:w8a8": 512, "fp8_block:w8a16": 512, "nvfp4": 2048, "mxfp4": 2048}
# bf16 and w8a8 decode candidates on the swap-AB kernels up to this many rows (tests/test_gpu_swapab*.py
# test_swapab_past_256_rows: 2047), where heuristics.swapab_holds_busy_expert
SWAPAB_CAP = 2048
ATOMIC_CAP = 16  # the atomic path's fp32 accumulator pays off, if anywhere, at few rows
MATH_MIN_ROWS = 16  # rows an expert below which 128-row tiles are mostly empty
STREAM_MAX_ROWS = 1024  # rows an expert above which 64-row tiles only double the weight reads
# the default past this % of the floor leaves nothing worth timing: the floor streams at the nominal
# copy rate (4.26 TB/s) and vLLM beats it by up to 6 % where the weights bound a cell (read ceiling 4.54)
FLOOR_PRUNE_PCT = 107.0
MARGIN = 0.01  # a candidate must beat the default by this fraction (the repetitions' noise)
MAX_REL_ERR = 0.05  # a candidate whose output differs from the default's by more is never picked
TUNE_WARM_S = 0.1  # seconds of replays before each cell after the first (the GPU stays loaded)
TABLE_ENTRY = "by_shape"
DEVICE_ENTRY = "by_device"  # rows timed on other GPUs of the table's arch, a section each by the GPU's name
DEVICE_ENTRY_ABOUT = {
    "decides": "per GPU model (the name the driver reports) of the table's arch, by_shape rows timed on it: on that "
               "GPU each replaces the by_shape row of its shape, format and bucket (the copy rate moves the "
               "crossovers; the kernels are the same). CUPYMOE_DEVICE_ROWS=0 leaves them out",
    "result": [], "command": "python -m cupymoe tune ... on that GPU, then tune --apply RESULT (each row records its own)",
    "value": {}}


@dataclass(frozen=True)
class Timed:
    choice: Choice
    us: float
    pct_of_floor: float
    rel_err: float = 0.0  # normwise distance of its output from the default's


def layer_keys(lp: LayerPlan) -> tuple[str, str]:
    """(shape key, format key) of the tuning table a layer plan reads."""
    cfg = lp.cfg
    return (shape_key(cfg.hidden_size, cfg.moe_intermediate_size, lp.n_local, cfg.num_experts,
                      cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size),
            format_key(lp.routed_format.label, lp.w8a8))


def default_choice(lp: LayerPlan, dev: DeviceFacts, n: int) -> Choice:
    """What the layer plan `lp` runs at `n` rows, as a Choice (every field set that applies)."""
    path = choose_path(lp, "auto", n)
    if path == "prefill":
        fp8 = HX.sm90_fp8_variant(lp, n)
        return Choice(path, None if lp.w8a8 else HX.grouped_config(lp, n), sm90_fp8=None if fp8 == "cp_async" else fp8,
                      sm90_gate_up=HX.sm90_variant(lp, GemmMode.GATE_UP, n),
                      sm90_down=HX.sm90_variant(lp, GemmMode.DOWN, n))
    if HX.swapab_decode(lp, n):
        return Choice(path, decode_kernel="swapab", token_tile=lp.choice(n).token_tile)
    if not lp.w8a8:
        return Choice(path)
    k = lp.cfg.num_experts_per_tok
    max_active = max(1, min(lp.n_local, n * k) + lp.has_shared)
    if not HX.w8a8_decode_wgmma(lp, dev, max_active, n):
        return Choice(path, w8a8_decode="mma")
    row = lp.choice(n)  # the table's token tile where its row names one (heuristics.a8_token_tile)
    tile = row.token_tile if row.w8a8_decode == "wgmma" and row.token_tile in WGMMA_DECODE_TOKEN_TILES else None
    return Choice(path, w8a8_decode="wgmma", token_tile=tile)


def candidates(lp: LayerPlan, n: int) -> list[Choice]:
    """Every choice admissible at `n` rows on a layer plan whose caps admit them, pruned by rows an expert."""
    fkey = layer_keys(lp)[1]
    rows = HX.expert_mean_rows(lp, n)
    out: list[Choice] = []
    caps = {"decode": lp.decode_max_tokens, "atomic": min(lp.atomic_max_tokens, ATOMIC_CAP)}
    for path, cap in caps.items():
        if n <= min(cap, DECODE_CAP.get(fkey, 0)):
            # atomic differs from decode only in down's accumulation: its kernels are left to the rule
            kernels = ("mma", "wgmma") if lp.w8a8 and path == "decode" else (None,)
            out += [Choice(path, w8a8_decode=w) for w in kernels]
            if lp.w8a8 and path == "decode":  # and the wgmma decode's wider token tiles
                out += [Choice(path, w8a8_decode="wgmma", token_tile=t)
                        for t in HX.a8_token_tiles_to_time(lp, HX.decode_rows_per_expert(lp, n))]
        if lp.swapab_ok and n <= min(cap, SWAPAB_CAP) and HX.swapab_holds_busy_expert(lp, n, lp.w8a8):
            # the rule's token tile, then each smaller one worth timing
            out += [Choice(path, decode_kernel="swapab")]
            out += [Choice(path, decode_kernel="swapab", token_tile=t) for t in HX.swapab_smaller_tiles(lp, n, lp.w8a8)]
    grouped = [g for g, ok in (("stream", rows <= STREAM_MAX_ROWS), ("math", rows >= MATH_MIN_ROWS)) if ok]
    if lp.w8a8:
        tma = lp.fp8_tma_ok and rows >= MATH_MIN_ROWS  # its 128-row tiles, like math's
        out += [Choice("prefill")] + ([Choice("prefill", sm90_fp8="tma64")] if lp.fp8_tma_ok else [])
        out += [Choice("prefill", sm90_fp8="tma")] if tma else []
    else:
        out += [Choice("prefill", g) for g in grouped or ["stream"]]
        if "math" in grouped and not lp.row_invariant:
            out += [Choice("prefill", "math", sm90_gate_up=gu, sm90_down=dn) for gu, dn in sm90_pairs(lp)]
    return out


def sm90_pairs(lp: LayerPlan) -> list[tuple[str, str]]:
    """(gate/up, down) bf16 TMA GEMM variants of TUNED_SM90 that fit the layer, every pair (distinct()
    drops those that launch what another does: gather_wide's down is tma_wide's)."""
    fits = {m: [v for v in TUNED_SM90 if HX.sm90_variant_fits(lp, m, v)] for m in (GemmMode.GATE_UP, GemmMode.DOWN)}
    return [(gu, dn) for gu in fits[GemmMode.GATE_UP] for dn in fits[GemmMode.DOWN]]


def forced(lp: LayerPlan, n: int, choice: Choice) -> LayerPlan:
    """`lp` with the table's entry for n's finest bucket set to `choice` (and no other)."""
    return replace(lp, tuned=((fine_bucket(n), choice),))


def distinct(lp: LayerPlan, dev: DeviceFacts, n: int, choices: list[Choice]) -> list[Choice]:
    """The choices whose forward plans differ (the first of equal ones kept)."""
    seen, out = set(), []
    for c in choices:
        f = forced(lp, n, c)
        path = choose_path(f, "auto", n)
        key = (path, build_forward_plan(f, dev, n, path).at(n).steps)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def pick(default: Timed, timed: list[Timed], margin: float = MARGIN) -> Timed:
    """The fastest, unless it beats the default by no more than `margin`."""
    best = min((t for t in timed if t.rel_err <= MAX_REL_ERR), key=lambda t: t.us, default=default)
    return best if best.us < default.us * (1.0 - margin) else default


def sweep_command(args) -> str:
    """The command that reproduces a sweep (its outputs left out: they name this machine's paths)."""
    parts = ["--preset", *args.preset, "--format", *args.formats, "--tokens", *map(str, args.tokens)]
    if getattr(args, "fp8_compute", "auto") != "auto":
        parts += ["--fp8-compute", args.fp8_compute]
    return "python -m cupymoe tune " + " ".join(map(shlex.quote, parts))


def table_rows(cells: list[dict], command: str, result: str) -> list[dict]:
    """The by_shape rows of a sweep's cells: the chosen choice, its time, the default's, where measured."""
    rows = []
    for c in cells:
        ch = c["chosen"]
        rows.append(dict(shape=c["shape_key"], format=c["format_key"], n=fine_bucket(c["N"]), path=ch["path"],
                         grouped=ch["grouped"], w8a8_decode=ch["w8a8_decode"],
                         decode_kernel=ch.get("decode_kernel"), sm90_fp8=ch.get("sm90_fp8"),
                         token_tile=ch.get("token_tile"), sm90_gate_up=ch.get("sm90_gate_up"),
                         sm90_down=ch.get("sm90_down"), us=ch["us"],
                         default=c["default"]["label"], default_us=c["default"]["us"], preset=c["shape"],
                         measured_at=c["N"], result=result, command=command))
    return rows


def merge_rows(tuning: dict, rows: list[dict], device: str = "") -> dict:
    """The tuning table's JSON with `rows` in its by_shape entry, or with `device` in that GPU's by_device
    section (a row of the same shape, format and bucket replaced), sorted; the entry's result list names
    every file its rows came from."""
    if not device:
        entry = dict(tuning[TABLE_ENTRY])
        entry["value"] = _merged(entry.get("value", []), rows)
        entry["result"] = sorted({r["result"] for r in entry["value"]})
        return {**tuning, TABLE_ENTRY: entry}
    entry = dict(tuning.get(DEVICE_ENTRY) or DEVICE_ENTRY_ABOUT)
    sections = {**entry.get("value", {}), device: _merged(entry.get("value", {}).get(device, []), rows)}
    entry["value"] = dict(sorted(sections.items()))
    entry["result"] = sorted({r["result"] for rs in sections.values() for r in rs})
    return {**tuning, DEVICE_ENTRY: entry}


def _merged(old: list[dict], rows: list[dict]) -> list[dict]:
    keep = {(r["shape"], r["format"], r["n"]): r for r in old}
    keep.update({(r["shape"], r["format"], r["n"]): r for r in rows})
    return [keep[k] for k in sorted(keep)]


def foreign_gpu(tuning: dict, gpu: Optional[str]) -> bool:
    """Whether rows timed on `gpu` belong to its by_device section of `tuning` (another GPU than the table's)."""
    table_gpu = tuning.get("device")
    return bool(gpu and table_gpu and gpu != table_gpu)


@dataclass(frozen=True)
class Applied:
    """What `tune --apply` merged: its rows' count and the entry they went to."""

    rows: int
    into: str  # "by_shape" or "by_device['<GPU>']"


def apply_result(result_path: Path, tuning_path: Path, other_gpu: bool = False) -> Applied:
    """Merge a sweep's result file's table rows into the tuning table file. Rows
    timed on another GPU than the table's (an H100's into the H200's table: the same arch, other
    rates) go to that GPU's by_device section, or with `other_gpu` into the table's own rows, each
    marked `timed_on` that GPU."""
    result = _json_object(result_path, "a tune result")
    rows, meta = result.get("table"), result.get("meta", {})
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows) or not isinstance(meta, dict):
        raise ConfigError(f"{result_path}: not a tune result (expected an object with a 'table' list of rows "
                          "and a 'meta' object, as `python -m cupymoe tune --json` writes)")
    tuning = _json_object(tuning_path, "a tuning table")
    _check_table(tuning, tuning_path)
    measured, table_arch = meta.get("arch"), tuning.get("arch", "sm_90a")
    if measured is not None and measured != table_arch:  # the rows name that arch's kernels and its timings
        raise ConfigError(f"{result_path}: measured on {measured}, but the tuning table's rows are {table_arch}'s")
    gpu = meta.get("gpu")
    if "gpu" in meta and (not isinstance(gpu, str) or not gpu):
        raise ConfigError(f"{result_path}: meta.gpu must be the GPU's name, found {gpu!r}")
    foreign = foreign_gpu(tuning, gpu)
    name = f"benchmarks/results/{Path(result_path).name}"  # where the result is committed
    mark = {"timed_on": gpu} if foreign and other_gpu else {}  # the rows a sweep on the table's GPU should re-time
    rows = [{**r, "result": name, **mark} for r in rows]
    parse_by_shape(rows)  # each row as the table would read it, before they are sorted in
    device = gpu if foreign and not other_gpu else ""
    merged = merge_rows(tuning, rows, device)
    _check_table(merged, tuning_path)  # the whole table loads, or nothing is written
    Path(tuning_path).write_text(json.dumps(merged, indent=2) + "\n")
    return Applied(len(rows), f"{DEVICE_ENTRY}[{device!r}]" if device else TABLE_ENTRY)


def _check_table(doc: dict, path: Path) -> None:
    """`doc` loads as the tuning table, else a ConfigError naming `path`."""
    try:
        Tuning.from_json(doc)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: not a loadable tuning table ({type(e).__name__}: {e})") from None


def _json_object(path: Path, what: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as {what}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not {what} (expected a JSON object, found {type(doc).__name__})")
    return doc


# ----------------------------------------------------------------------------------
# the sweep (GPU)
# ----------------------------------------------------------------------------------

def _time_choice(layers, lp0: LayerPlan, n: int, choice: Choice, x, out, args, ceilings, warm_s: float) -> Timed:
    """One candidate: every copy's plan forced to `choice`, its plans rebuilt, timed as bench's cell."""
    from .bench import _time_cell, cell_figures

    for L in layers:
        L.plan = forced(lp0, n, choice)
        L._packed.clear()
        L._by_n.clear()
    times, _, touched = _time_cell(layers, x, out, n, args, warm_s)
    us = statistics.median(times)
    floor = cell_figures(lp0.cfg, lp0.routed_format.label, n, touched, copy_tbps=ceilings["copy_TBps"],
                         bf16_tflops=ceilings["bf16_TFLOPs"], fp8_tflops=ceilings["fp8_TFLOPs"])
    best_floor = floor.get("floor_fp8_us", floor["floor_us"]) if lp0.w8a8 else floor["floor_us"]
    return Timed(choice, round(us, 2), round(100 * best_floor / us, 1))


def _bf16_values(bits):
    """uint16 bits of bf16 (CuPy) -> float32 values."""
    import cupy

    return (bits.astype(cupy.uint32) << 16).view(cupy.float32)


def _rel_err(out, ref) -> float:
    import cupy

    a, b = _bf16_values(out), _bf16_values(ref)
    return round(float(cupy.linalg.norm(a - b) / max(float(cupy.linalg.norm(b)), 1e-30)), 5)


def _timed_dict(t: Timed) -> dict:
    return dict(label=t.choice.label(), path=t.choice.path, grouped=t.choice.grouped,
                w8a8_decode=t.choice.w8a8_decode, decode_kernel=t.choice.decode_kernel, sm90_fp8=t.choice.sm90_fp8,
                token_tile=t.choice.token_tile, sm90_gate_up=t.choice.sm90_gate_up, sm90_down=t.choice.sm90_down,
                us=t.us,
                pct_of_floor=t.pct_of_floor, rel_err=t.rel_err)


def _tune_cell(layers, lp0: LayerPlan, lp_default: LayerPlan, dev, shape: str, n: int, args, ceilings,
               first: bool) -> dict:
    """Every distinct candidate of one N timed; the cell's record with the chosen one."""
    from .bench import cell_input
    from .ceilings import STEADY_WARM_S

    x, out = cell_input(lp0.cfg, n, args.seed)
    base = default_choice(lp_default, dev, n)
    default = _time_choice(layers, lp0, n, base, x, out, args, ceilings, STEADY_WARM_S if first else args.warm_s)
    others = [c for c in distinct(lp0, dev, n, [base] + candidates(lp0, n)) if c != base]
    timed, ref = [default], out.copy()
    if default.pct_of_floor < FLOOR_PRUNE_PCT:
        for c in others:
            t = _time_choice(layers, lp0, n, c, x, out, args, ceilings, args.warm_s)
            timed.append(replace(t, rel_err=_rel_err(out, ref)))
    chosen = pick(default, timed)
    skey, fkey = layer_keys(lp0)
    print(f"  N={n:<5} " + "  ".join(f"{t.choice.label()} {t.us:.1f}" for t in timed)
          + f"  -> {chosen.choice.label()} ({default.us / chosen.us:.3f}x the default)", flush=True)
    return dict(shape=shape, shape_key=skey, format_key=fkey, N=n, default=_timed_dict(default),
                candidates=[_timed_dict(t) for t in timed], chosen=_timed_dict(chosen),
                pruned_by_floor=len(timed) == 1 and bool(others), speedup=round(default.us / chosen.us, 4))


def _out_of_time(deadline: Optional[float], shape: str, fmt: str, tokens, skipped: list) -> bool:
    """Past --time-limit: `tokens`' cells of (shape, fmt) listed as skipped, so the result says what was not timed."""
    if deadline is None or time.perf_counter() < deadline:
        return False
    skipped.append(dict(shape=shape, format=fmt, N=list(tokens), reason="--time-limit reached"))
    print(f"[tune {shape} {fmt}] --time-limit reached: N = {' '.join(map(str, tokens))} not timed", flush=True)
    return True


def _tune_format(shape: str, cfg, fmt: str, args, ceilings: dict, skipped: list,
                 deadline: Optional[float] = None) -> list[dict]:
    """Every N of one preset and format: the layers built once with caps admitting every candidate;
    no cell starts past `deadline` (perf_counter seconds)."""
    from .bench import build_layers, free_layers, layer_options
    from .plan import LayerOptions, plan_layer

    tag = f"[tune {shape} {fmt}]"
    layers: list = []
    if _out_of_time(deadline, shape, fmt, args.tokens, skipped):
        return []
    try:
        w8a8 = fmt == "fp8_block" and args.fp8_compute != "w8a16"
        cap = DECODE_CAP.get(format_key(fmt, w8a8), 0)
        cap = max(cap, SWAPAB_CAP) if fmt == "bf16" or w8a8 else cap  # the swap-AB candidates' rows (sm_90a only)
        try:
            layers = build_layers(cfg, fmt, args, tag, **layer_options(fmt, args, decode_max_tokens=cap,
                                                                        atomic_max_tokens=min(ATOMIC_CAP, cap)))
        except (NotImplementedError, TypeError, ValueError) as e:
            skipped.append(dict(shape=shape, format=fmt, reason=f"{type(e).__name__}: {e}"))
            print(f"{tag} skipped: {skipped[-1]['reason']}", flush=True)
            return []
        lp0, dev = layers[0].plan, layers[0].device
        opts = LayerOptions(fp8_compute=layer_options(fmt, args).get("fp8_compute", "auto"))
        lp_default = plan_layer(cfg, fmt, None, dev.arch, n_local=lp0.n_local, options=opts,
                                mxfp4_scale_bytes=layers[0].weights.mxfp4_scale_bytes,
                                device_name=dev.name)  # what a layer runs on this GPU today
        print(f"{tag} {len(layers)} layer copies; timing", flush=True)
        cells = []
        for i, n in enumerate(args.tokens):
            if _out_of_time(deadline, shape, fmt, args.tokens[i:], skipped):
                break
            cells.append(_tune_cell(layers, lp0, lp_default, dev, shape, n, args, ceilings, i == 0))
        return cells
    finally:
        del layers
        free_layers()


def run_tune(args) -> int:
    """The sweep; the result file is rewritten after each preset and format (a run cut short keeps its cells).
    --time-limit counts from here, the kernels' build and the ceilings included."""
    import cupy

    from . import jit
    from .bench import preset_config
    from .ceilings import resolve_ceilings

    deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit  # 0: time nothing
    props = cupy.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode()
    ceil = resolve_ceilings(args.measure_ceilings, gpu)
    ceilings = ceil.values
    args.arch_measured = jit.arch_for_capability(props["major"], props["minor"])  # the result's rows are its
    print(jit.tree_line(), flush=True)
    jit.library(cupy.cuda.runtime.getDevice(), progress=lambda line: print("  " + line, flush=True))
    path = Path(args.json) if args.json else Path("benchmarks/results") / f"{datetime.now():%Y%m%d-%H%M}-tune.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0, cells, skipped = time.perf_counter(), [], []
    for shape in args.preset:
        for fmt in dict.fromkeys(args.formats):
            cells += _tune_format(shape, preset_config(shape), fmt, args, ceilings, skipped, deadline)
            rows = _write_result(path, args, gpu, cells, skipped, ceil, time.perf_counter() - t0)
    print(f"results written to {path}", flush=True)
    if args.table_out:
        tuning = json.loads((Path(__file__).parent / "data" / "tuning.json").read_text())
        merged = merge_rows(tuning, rows, gpu if foreign_gpu(tuning, gpu) else "")  # as --apply files them
        Path(args.table_out).write_text(json.dumps(merged, indent=2) + "\n")
        print(f"tuning table with these rows written to {args.table_out}", flush=True)
    return 0 if cells else 1


def _write_result(path: Path, args, gpu: str, cells: list, skipped: list, ceil: "Ceilings",
                  seconds: float) -> list[dict]:
    """The result file of the cells so far (meta, cells, table rows); returns the rows."""
    import cupy

    from . import jit
    from .bench import _git_commit

    command = sweep_command(args)
    meta = dict(gpu=gpu, arch=args.arch_measured, commit=_git_commit(), sources=jit.tree_digest(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), cupy=cupy.__version__, command=command, **ceil.values,
                ceilings_measured=ceil.measured, ceilings_source=ceil.source, seconds=round(seconds, 1),
                skipped=skipped or None,
                method=f"bench's cells (CUDA-graph replays over the layer copies, the median of {args.repeats} "
                       f"repetitions of {args.replays} replays; {args.warm_s} s of replays before each cell after "
                       f"the first), each distinct candidate plan forced through the table's lookup; the default "
                       f"alone where it reaches {FLOOR_PRUNE_PCT} % of the floor; a candidate kept only when "
                       f"{100 * MARGIN:.0f} % faster than the default")
    rows = table_rows(cells, command, f"benchmarks/results/{path.name}")
    path.write_text(json.dumps(dict(meta=meta, cells=cells, table=rows), indent=1))
    return rows


def add_tune_args(ap) -> None:
    from .bench import FORMATS, PRESETS

    ap.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"], choices=sorted(PRESETS))
    ap.add_argument("--format", dest="formats", nargs="+", default=["bf16", "fp8_block"], choices=FORMATS)
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 32, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--fp8-compute", default="auto", choices=["auto", "w8a8", "w8a16"])
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions a candidate (median)")
    ap.add_argument("--replays", type=int, default=10, help="graph replays a repetition")
    ap.add_argument("--warm-s", type=float, default=TUNE_WARM_S, help="seconds of replays before each cell "
                    "after the first")
    ap.add_argument("--measure-ceilings", action="store_true", help="measure the floors' ceilings in this run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="start no cell this many seconds after the command starts (the kernels' build included); "
                         "the cells left are listed as skipped in the result (a device call's budget; the preset "
                         "order is the timing order)")
    ap.set_defaults(stages=False)  # bench's cell timer reads it: a tuning cell times no stages
    ap.add_argument("--json", default=None, help="the result file (default benchmarks/results/<date>-tune.json)")
    ap.add_argument("--table-out", default=None, help="also write the tuning table with this sweep's rows here")
    ap.add_argument("--apply", default=None, metavar="RESULT",
                    help="no GPU: merge RESULT's table rows into --table and exit")
    ap.add_argument("--table", default=str(Path(__file__).parent / "data" / "tuning.json"),
                    help="the tuning table --apply writes (default: the package's)")
    ap.add_argument("--other-gpu", action="store_true",
                    help="--apply: rows timed on another GPU than the table's (same arch) into the table's own rows, "
                         "marked timed_on, not into that GPU's by_device section")
