"""python -m cupymoe: kernels (build check, no GPU), info, knobs, inspect, verify (GPU), bench (GPU), tune (GPU;
--apply: none).

    python -m cupymoe kernels --arch sm_90a   compile cuda/ through NVRTC, print resources
    python -m cupymoe info                    versions, each GPU's arch, its floors' ceilings and tuning rows
    python -m cupymoe knobs                   every CUPYMOE_* variable and its default
    python -m cupymoe inspect DIR             a checkpoint's MoE layers as cupymoe reads them
    python -m cupymoe inspect DIR --lora A    ... and a PEFT adapter's share of the layer
    python -m cupymoe verify                  every family and format on the GPU against the reference
    python -m cupymoe bench --help            per-cell timings (graph replays) against the floor
    python -m cupymoe tune --help             the dispatch choices timed per shape and N (GPU; --apply: none)
"""

from __future__ import annotations

import argparse
import logging
import sys


def _no_gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'cupymoe[cu12]' or 'cupymoe[cu13]')"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no CUDA driver or device ({type(e).__name__}: {e})"
    return None if n else "no CUDA device found"


def require_gpu(what: str) -> None:
    reason = _no_gpu_reason()
    if reason:
        print(f"cupymoe {what}: needs an NVIDIA GPU (sm_80 or newer), but {reason}; "
              f"without one, `python -m cupymoe kernels --arch sm_90a` builds the kernels", file=sys.stderr)
        sys.exit(2)


def cmd_kernels(args) -> int:
    from . import Error, jit

    try:
        for arch in args.arch:
            jit.compile_options(arch)  # an arch NVRTC is not asked for: one line, before any compile
    except Error as e:
        print(f"cupymoe kernels: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    bad = 0
    for arch in args.arch:
        print(f"== {arch}: NVRTC {'.'.join(map(str, jit.nvrtc_version()))}, options "
              f"{' '.join(o for o in jit.compile_options(arch) if not o.startswith('-I'))}", flush=True)
        names = jit.modules_for(arch)
        print(f"   compiling {len(names)} modules side by side (CUPYMOE_BUILD_JOBS threads at most; default: "
              f"the CPUs) ...", file=sys.stderr, flush=True)

        def heard(cm, seconds):
            print(f"   {cm.module}: " + ("cached" if cm.from_cache else f"compiled in {seconds:.1f} s"),
                  file=sys.stderr, flush=True)

        try:
            mods = jit.compile_modules(names, arch, use_cache=not args.no_cache, progress=heard)
        except Error as e:  # NVRTC refusing the arch (one newer than it knows) or a module: its log, no traceback
            print(f"cupymoe kernels: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(jit.format_report(mods))
        spills = [(cm.module, r.name) for cm in mods for r in cm.resources() if r.spill_stores or r.spill_loads]
        if spills:
            print(f"SPILLS on {arch}: {spills}")
            bad += 1
    return 1 if bad else 0


def cmd_knobs(args) -> int:
    """The knob table, then this environment's CUPYMOE_* settings as a layer would read them (exit 2 and the
    refusal's line where one is unknown or its value bad)."""
    import os

    from . import knobs
    from .errors import OptionError

    print(knobs.describe())
    set_here = sorted(k for k in os.environ if k.startswith("CUPYMOE_"))
    try:
        knobs.Knobs.from_env()
    except OptionError as e:
        print(f"\nthis environment: {e}")
        return 2
    print("\nthis environment: " + (", ".join(f"{k}={os.environ[k]}" for k in set_here) or "no CUPYMOE_* variable set"))
    return 0


def cmd_info(args) -> int:
    import numpy

    from . import __version__
    from . import jit
    from .ceilings import ceilings_note
    from .errors import OptionError
    from .knobs import Knobs
    from .tuning import TUNING

    print(f"cupymoe {__version__}, numpy {numpy.__version__}")
    try:
        print(f"NVRTC {'.'.join(map(str, jit.nvrtc_version()))}, headers {jit.cuda_include_dirs()[0]}")
    except Exception as e:
        print(f"NVRTC unavailable: {e}")
    try:  # with or without a GPU: the environment a layer would refuse
        device_rows = Knobs.from_env().device_rows
    except OptionError as e:  # a misspelt knob: one line, as every command refuses it
        print(f"cupymoe info: OptionError: {e}", file=sys.stderr)
        return 2
    reason = _no_gpu_reason()
    if reason:
        print(f"GPU: none ({reason})")
        return 0
    import cupy

    for d in range(cupy.cuda.runtime.getDeviceCount()):
        p = cupy.cuda.runtime.getDeviceProperties(d)
        cc = cupy.cuda.Device(d).compute_capability
        print(f"GPU {d}: {p['name'].decode()}, sm_{cc}, {p['totalGlobalMem'] / 2**30:.0f} GiB, "
              f"{p['multiProcessorCount']} SMs -> kernels compiled for "
              f"{jit.arch_for_capability(int(cc[:-1]), int(cc[-1]))}")
        print(f"  {ceilings_note(p['name'].decode())}")
        print(f"  {TUNING.note(p['name'].decode(), jit.arch_for_capability(int(cc[:-1]), int(cc[-1])), device_rows)}")
    return 0


def cmd_inspect(args) -> int:
    """What cupymoe reads from a checkpoint (no GPU): the config mapping, which of the layers
    whose tensors it holds are MoE, and for one layer every tensor's format and shape, the
    bytes, and whether the GPU kernels serve it. A refusal (cupymoe.Error, or memory the
    checkpoint's sizes ask for) prints one line and returns 2."""
    from . import Error, checkpoint, formats
    from . import jit
    from .config import kernel_limits_violations, layer_count

    try:
        # refused before anything is read; named as the layer would compile for it (sm_90 -> sm_90a)
        cc, _ = jit.parse_arch(args.arch)
        arch = jit.arch_for_capability(cc // 10, cc % 10)
        config = checkpoint.read_config(args.dir)
        n_layers = layer_count(config)
        # the layers the tensors name, not range(n_layers): a config.json count is no bound on work
        present = [i for i in checkpoint.layer_indices(args.dir) if n_layers is None or i < n_layers]
        moe = _moe_layers(config, present)
        layer = args.layer if args.layer is not None else (moe[0] if moe else 0)
        cfg, hw = checkpoint.load_layer(args.dir, layer)
        from .plan import LayerOptions, plan_layer
        from .tuning import TUNING

        # the scratch MoeLayer would allocate on a GPU of that arch with every expert local: the
        # same plan (decode rows by format, w8a8 buffers, gathered inputs) as its constructor.
        # Made before anything is printed: a refused option or layer prints its one line only
        routed = formats.weight_format(hw.down)
        shared = formats.weight_format(hw.shared_down) if cfg.has_shared_expert else None

        def plan_of(c):
            return plan_layer(c, routed, shared, arch, n_local=c.num_experts,
                              options=LayerOptions(fp8_compute=args.fp8_compute), device_name=args.gpu)

        plan = plan_of(cfg)
        adapter = None
        if args.lora is not None:  # as load_peft reads it, before the listing: a refused adapter is its line only
            from .lora import load_peft, raw_peft_config

            adapter = load_peft(args.lora, layer, cfg), raw_peft_config(args.lora)
    except MemoryError as e:  # sizes no loader check bounded: one line, as for every refusal
        print(f"cupymoe inspect: MemoryError: {e or 'the checkpoint asks for more memory than there is'}",
              file=sys.stderr)
        return 2
    except Error as e:
        print(f"cupymoe inspect: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    held = "" if n_layers is not None and len(present) == n_layers else \
        f" (tensors here for {_ranges(present) if present else 'none'})"
    print(f"{args.dir}: model_type {config.get('model_type')}, {n_layers if n_layers is not None else '?'} layers"
          f"{held}, MoE layers: {_ranges(moe) if moe else 'none'}")
    print(f"layer {layer}: {cfg}")
    for why in kernel_limits_violations(cfg):
        print(f"  NOT served by the GPU kernels: {why}")
    _print_tensors(hw)
    if args.gpu and args.gpu not in TUNING.by_device:  # a misspelt name would size another GPU's scratch unseen
        print(f"  --gpu {args.gpu!r}: the tuning table has no rows timed on it (it has them for "
              f"{', '.join(map(repr, TUNING.by_device)) or 'no GPU'}): its by_shape rows size this scratch")
    _print_workspace(config, moe, cfg, plan, plan_of, f"{arch} ({args.gpu})" if args.gpu else arch, args.max_tokens)
    if adapter is not None:
        _print_lora(args.lora, layer, *adapter, plan)
    return 0


def _print_lora(adapter_dir, layer: int, lw, raw: dict, plan) -> None:
    """The adapter's share of the inspected layer (`lw`, load_peft's; `raw`, its adapter_config.json): per
    target, the modules, ranks, scales and where they come from; what this layer's plan would not serve."""
    import re

    print(f"adapter {adapter_dir}: peft_version {raw.get('peft_version', '?')}, r {raw.get('r', '?')}, "
          f"lora_alpha {raw.get('lora_alpha', '?')}; layer {layer}: {len(lw.modules)} modules, max rank {lw.max_rank} "
          f"(MoeLayer(..., max_lora_rank >= {lw.max_rank}))")
    by_target: dict = {}
    for key, m in lw.modules.items():
        by_target.setdefault(key.target, []).append(m)
    for target, ms in sorted(by_target.items(), key=lambda kv: kv[0].value):
        ranks = sorted({m.rank for m in ms})
        scales = sorted({m.scale for m in ms})
        # a stacked parameter's modules are named <parameter>[e].<target>, per-expert ones experts.<e>.<proj>
        sources = sorted({re.sub(r"\.experts\.\d+\.", ".experts.{e}.", re.sub(r"\[\d+\]\.\w+$", "", m.name))
                          for m in ms})
        experts = f" ({len(ms)} experts)" if target.per_expert else ""
        print(f"  {target.value:<12}{experts:<15} rank {'/'.join(map(str, ranks)):<6} "
              f"scale {'/'.join(f'{x:g}' for x in scales):<8} from {', '.join(sources)}")
    if plan.w8a8 and any(k.target.value != "router" for k in lw.modules):
        print("  expert modules on a w8a8 layer: served with MoeLayer(lora_experts=True), whose LoRA forwards run "
              "the experts as w8a16 (the default slots take the router's alone)")


def _moe_layers(config, present: list[int]) -> list[int]:
    """The layers of `present` that config.json makes MoE layers."""
    from .config import DenseLayerError, MoeConfig

    moe = []
    for i in present:
        try:
            MoeConfig.from_hf(config, i)
            moe.append(i)
        except DenseLayerError:
            pass
    return moe


def _print_tensors(hw) -> None:
    """One line per tensor of the layer: format, shape, size, and whether the kernels serve it."""
    from . import formats
    from .catalog import WeightFormat

    total = 0
    for name in hw.names():
        t = getattr(hw, name)
        fmt = formats.weight_format(t)
        label = fmt if fmt != "bf16" else str(getattr(t, "dtype", "bf16"))
        nbytes = int(t.nbytes)
        total += nbytes
        note = ""
        if fmt != "bf16" and name in ("gate", "up", "down", "shared_gate", "shared_up", "shared_down"):
            need = WeightFormat.named(fmt).k_multiple
            if t.shape[-1] % need:
                note = f"  NOT served by the GPU kernels: input width {t.shape[-1]} is not a multiple of {need}"
        elif fmt != "bf16" and name == "router":
            note = "  (dequantized once to bf16 at load)"
        print(f"  {name:<20} {label:<10} {str(tuple(t.shape)):<22} {nbytes / 1e6:10.2f} MB{note}")
    print(f"  total {total / 1e9:.3f} GB for this layer")


def _print_workspace(config, moe: list[int], cfg, plan, plan_of, arch: str, max_tokens: list[int]) -> None:
    """The scratch of the inspected layer, and the workspace every MoE layer of the model would share
    (each layer's config as from_hf maps it, with the inspected layer's weight formats)."""
    from .config import MoeConfig
    from .errors import ConfigError
    from .layer_checks import check_token_limit
    from .workspace import WorkspaceNeed, layer_need

    notes = [f"decode path up to {plan.decode_max_tokens} rows"]
    if plan.fp8_compute:
        notes.append(f"fp8 experts as {plan.fp8_compute.value}")
    plans = {}
    for i in moe:
        c = MoeConfig.from_hf(config, i)
        if c not in plans:
            plans[c] = plan_of(c)
    for T in max_tokens:
        try:  # a count the layer would refuse is no scratch size to report
            check_token_limit(cfg, T, cfg.num_experts)
        except ConfigError as e:
            print(f"  max_tokens={T}: refused ({e})")
            continue
        need = layer_need(plan, T)[1]
        print(f"  scratch at max_tokens={T} on {arch}: {need.total_bytes / 1e6:.1f} MB "
              f"({need.total_bytes} bytes; {', '.join(notes)})")
        if len(moe) > 1:
            shared = WorkspaceNeed(0)
            for p in plans.values():
                shared = shared | layer_need(p, T)[1]
            print(f"  workspace shared by the {len(moe)} MoE layers at max_tokens={T}: {shared.total_bytes / 1e6:.1f} MB "
                  f"({shared.total_bytes} bytes; a scratch of its own for each layer would take "
                  f"{len(moe) * need.total_bytes / 1e6:.1f} MB)")


def _ranges(idx: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)


def _cannot_write(command: str, paths: dict) -> bool:
    """Whether one of `paths` (flag -> path or None) cannot be written, said in one line before a sweep's
    minutes are lost: each opened for append (nothing truncated), removed again where the check made it."""
    from pathlib import Path

    for flag, path in paths.items():
        if path is None:
            continue
        p = Path(path)
        made = not p.exists()
        try:
            with open(p, "a"):
                pass
        except OSError as e:
            print(f"cupymoe {command}: {flag} {path}: cannot be written ({e.strerror or e})", file=sys.stderr)
            return True
        if made:
            p.unlink(missing_ok=True)
    return False


def cmd_verify(args) -> int:
    require_gpu("verify")
    from .verify import verify_families

    return verify_families(args.family, args.tokens, args.path, formats_=args.format, seed=args.seed)


def cmd_bench(args) -> int:
    require_gpu("bench")
    if _cannot_write("bench", {"--json": args.json}):
        return 2
    from .bench import run_bench

    return run_bench(args)


def cmd_tune(args) -> int:
    from . import Error
    from .tune import apply_result

    if args.apply:  # no GPU: the result file's rows into the table
        if _cannot_write("tune --apply", {"--table": args.table}):  # a read-only site-packages
            return 2
        try:
            applied = apply_result(args.apply, args.table, other_gpu=args.other_gpu)
        except Error as e:  # the table is left as it was: one line naming why
            print(f"cupymoe tune --apply: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(f"{applied.rows} rows of {args.apply} merged into {args.table}, entry {applied.into}")
        return 0
    require_gpu("tune")
    if _cannot_write("tune", {"--json": args.json, "--table-out": args.table_out}):
        return 2
    from .tune import run_tune

    return run_tune(args)


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a layer's max_tokens)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not >= 1")
    return v


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "inspect":
        # what a checkpoint or an option is refused for, as one line naming it, not a traceback
        # (CheckpointError, DenseLayerError, UnsupportedModelError are ValueErrors; a missing
        # tensor is also a KeyError; UnsupportedFormatError, an option the layer could not run,
        # a NotImplementedError)
        try:
            return args.fn(args)
        except (ValueError, KeyError, NotImplementedError) as e:
            print(f"cupymoe inspect: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    return args.fn(args)


class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments as one line on stderr and exit 2 (argparse prints its whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def _parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(prog="python -m cupymoe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = ap.add_subparsers(dest="cmd", required=True)

    k = sub.add_parser("kernels", help="compile every cuda/ kernel through NVRTC (no GPU needed)")
    k.add_argument("--arch", nargs="+", default=["sm_90a"], help="real architectures, e.g. sm_80 sm_90a")
    k.add_argument("--no-cache", action="store_true", help="recompile even when the cache has the cubin")
    k.set_defaults(fn=cmd_kernels)

    i = sub.add_parser("info", help="versions, GPUs, the arch the kernels are compiled for, each GPU's ceilings "
                                    "and tuning rows")
    i.set_defaults(fn=cmd_info)
    sub.add_parser("knobs", help="every CUPYMOE_* environment variable, what it does, its default").set_defaults(
        fn=cmd_knobs)

    _add_inspect_parser(sub)
    _add_verify_parser(sub)
    _add_bench_parser(sub)
    _add_tune_parser(sub)
    return ap


def _add_inspect_parser(sub) -> None:
    from .plan import FP8_COMPUTE_NAMES as FP8_COMPUTE

    c = sub.add_parser("inspect", help="a checkpoint's MoE layers as cupymoe reads them (no GPU needed)")
    c.add_argument("dir", help="a Hugging Face checkpoint directory (config.json + safetensors)")
    c.add_argument("--layer", type=int, default=None, help="the layer to load (default: the first MoE layer)")
    c.add_argument("--max-tokens", type=_positive_int, nargs="+", default=[64, 4096],
                   help="report the layer's scratch memory at these max_tokens")
    c.add_argument("--arch", default="sm_90a",
                   help="the GPU architecture the scratch is planned for, as the layer would compile for it "
                        "(sm_90a: Hopper; sm_80, sm_89, ...)")
    c.add_argument("--gpu", default="", metavar="NAME",
                   help="the GPU model as the driver names it (python -m cupymoe info), for the tuning table's rows "
                        "timed on it, e.g. 'NVIDIA H100 80GB HBM3' (default: the table's own GPU)")
    c.add_argument("--fp8-compute", choices=FP8_COMPUTE, default="auto",
                   help="fp8-block experts' compute, as MoeLayer's fp8_compute (w8a8 adds scratch)")
    c.add_argument("--lora", metavar="ADAPTER_DIR", default=None,
                   help="also a PEFT adapter directory's share of the layer, as cupymoe.lora.load_peft reads it")
    c.set_defaults(fn=cmd_inspect)


def _add_verify_parser(sub) -> None:
    from .testing import FAMILIES
    from .verify import VERIFY_FORMATS, VERIFY_PATHS, VERIFY_TOKENS

    v = sub.add_parser("verify", help="run every family's layer on the GPU against cupymoe.reference")
    v.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    v.add_argument("--tokens", nargs="+", type=int, default=list(VERIFY_TOKENS))
    v.add_argument("--path", nargs="+", default=list(VERIFY_PATHS), choices=VERIFY_PATHS,
                   help="paths to force (decode and atomic only up to 64 rows)")
    v.add_argument("--format", nargs="+", default=list(VERIFY_FORMATS), choices=VERIFY_FORMATS,
                   help="expert weight formats")
    v.add_argument("--seed", type=int, default=None, help="random seed (default: fresh each run)")
    v.set_defaults(fn=cmd_verify)


def _add_bench_parser(sub) -> None:
    from .bench import add_bench_args

    b = sub.add_parser("bench", help="time the layer with CUDA-graph replays against the floor (GPU)",
                       description="Time cupymoe's layer on the six PERFORMANCE.md presets with CUDA-graph "
                                   "replays, next to the floor and, in the same run, torch peers. --format "
                                   "picks the routed experts' weight format(s) (bf16, fp8_block, nvfp4, "
                                   "mxfp4), each timed next to its own floor. Needs an NVIDIA GPU (sm_80+) "
                                   "and CuPy; torch with CUDA (optional) for the peers and --measure-ceilings; "
                                   "matplotlib (optional) for --plots.")
    add_bench_args(b)
    b.set_defaults(fn=cmd_bench)


def _add_tune_parser(sub) -> None:
    from .tune import add_tune_args

    t = sub.add_parser("tune", help="time every admissible dispatch choice per (preset, format, N); write the "
                       "fastest as tuning-table rows (GPU; --apply merges a result file without one)",
                       description="For each preset, format and N, time every distinct admissible choice of path, "
                                   "grouped GEMM configuration and w8a8 decode kernels as bench times a cell, and "
                                   "write the fastest per (shape, format, N bucket) with the command that measured "
                                   "it. --apply RESULT merges a result file's rows into the tuning table (no GPU).")
    add_tune_args(t)
    t.set_defaults(fn=cmd_tune)


if __name__ == "__main__":
    sys.exit(main())
