"""python -m cupymoe bench: per-layer time with CUDA-graph replays, next to the floor.

Method (PERFORMANCE.md): several layers' worth of weights (so the experts do not sit in
the 50 MB L2) captured into one CUDA graph, replays timed with CUDA events, the median of
repeats; random inputs, never zeros; the floor computed from the routing the layer
actually produced (its own top-k ids, read back from the arena):

    bytes = touched experts x 3 H I x 2 + router R H x 2 + shared 3 H Is x 2 + in/out N H x 2 x 2
    FLOPs = 2 N k 3 H I + 2 N H R + 2 N 3 H Is
    floor = max(bytes / copy bandwidth, FLOPs / bf16 matrix rate)

The ceilings default to the ones measured on the lent H200 (4.26 TB/s, 777 TFLOP/s) and can
be measured in the same run with --measure-ceilings. The peers' figures come from
benchmarks/baselines/h200-bf16-peers.json (measured on the same kind of GPU).
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

import numpy as np

from .config import MoeConfig
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
COPY_TBPS = 4.26
BF16_TFLOPS = 777.0
L2_BYTES = 50e6
BASELINES = Path(__file__).resolve().parent.parent / "benchmarks" / "baselines" / "h200-bf16-peers.json"


def preset_config(name: str, *, routed_only: bool = True) -> MoeConfig:
    kw = dict(PRESETS[name])
    if routed_only:  # the peers' figures cover the routed experts only
        kw.pop("shared_expert_intermediate_size", None)
        kw.pop("has_shared_expert_gate", None)
    return MoeConfig(model_type=name, **kw)


def add_bench_args(ap) -> None:
    ap.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(PRESETS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--path", default="auto", choices=["auto", "decode", "atomic", "prefill"])
    ap.add_argument("--decode-max-tokens", type=int, default=None,
                    help="the layer's decode_max_tokens (default: the layer's own)")
    ap.add_argument("--full-layer", action="store_true", help="include the shared expert (peers exclude it)")
    ap.add_argument("--repeats", type=int, default=7, help="timed repetitions (median reported)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per repetition")
    ap.add_argument("--measure-ceilings", action="store_true", help="measure copy TB/s and bf16 TFLOP/s (needs torch)")
    ap.add_argument("--json", default=None, help="write results here (default benchmarks/results/<date>-<gpu>.json)")
    ap.add_argument("--no-peers", action="store_true",
                    help="skip the torch peers (timed in the same run when torch is importable)")
    ap.add_argument("--eager-max-tokens", type=int, default=256,
                    help="time the per-expert eager loop only up to this many tokens (it is slow)")
    ap.add_argument("--plots", default=None,
                    help="folder for one PNG per preset (time against N, log-log); needs matplotlib")
    ap.add_argument("--stages", action="store_true",
                    help="also time each stage inside the replayed graph (CUDA events between stages)")
    ap.add_argument("--seed", type=int, default=0)


def _peers() -> dict:
    try:
        rows = json.loads(BASELINES.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["shape"], r["N"]): r for r in rows}


def measure_ceilings() -> tuple[float, float]:
    import torch

    a = torch.empty(2**31 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 1e3 / reps

    t_copy = timed(lambda: b.copy_(a))
    t_mm = timed(lambda: m @ m)
    return 2 * a.numel() * 2 / t_copy / 1e12, 2 * 8192**3 / t_mm / 1e12


def random_device_weights(cfg: MoeConfig, seed: int):
    """Random bf16 weights drawn on the GPU (a layer is GBs: numpy would take minutes).

    std 1/sqrt(fan_in) keeps activations O(1); bf16 bits are the top half of float32.
    """
    import cupy

    from .host_weights import HostWeights

    g = cupy.random.default_rng(seed)
    E, H, I, R = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.router_width
    Is = cfg.shared_expert_intermediate_size

    def w(*shape):
        a = g.standard_normal(shape, dtype=cupy.float32) * (1.0 / math.sqrt(shape[-1]))
        return (a.view(cupy.uint32) >> 16).astype(cupy.uint16)

    def v(n, scale=0.1):
        return (g.standard_normal(n, dtype=cupy.float32) * scale).get()

    return HostWeights(
        router=w(R, H), gate=w(E, I, H), up=w(E, I, H), down=w(E, H, I),
        router_bias=v(R) if cfg.has_router_bias else None,
        correction_bias=v(R) if cfg.has_correction_bias else None,
        gate_bias=v((E, I)) if cfg.has_expert_bias else None,
        up_bias=v((E, I)) if cfg.has_expert_bias else None,
        down_bias=v((E, H)) if cfg.has_expert_bias else None,
        shared_gate=w(Is, H) if Is else None, shared_up=w(Is, H) if Is else None,
        shared_down=w(H, Is) if Is else None,
        shared_expert_gate=v(H) if cfg.has_shared_expert_gate else None,
    )


def _git_commit() -> str:
    if os.environ.get("CUPYMOE_COMMIT"):  # a copy of the tree without .git (a lent GPU machine)
        return os.environ["CUPYMOE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_bench(args) -> int:
    import cupy

    from .layer import MoeLayer
    from .verify import bf16_bits

    rng = np.random.default_rng(args.seed)
    copy_tbps, mm_tflops = COPY_TBPS, BF16_TFLOPS
    if args.measure_ceilings:
        copy_tbps, mm_tflops = measure_ceilings()
        print(f"ceilings measured: copy {copy_tbps:.2f} TB/s, bf16 mm {mm_tflops:.0f} TFLOP/s", flush=True)
    peers = _peers()
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    results = []
    max_n = max(args.tokens)
    for name in args.preset:
        cfg = preset_config(name, routed_only=not args.full_layer)
        H, I, E, k, R = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.router_width
        Is = cfg.shared_expert_intermediate_size
        layer_bytes = (E * 3 * H * I + 3 * H * Is + R * H) * 2
        n_layers = max(2, math.ceil(4 * L2_BYTES / layer_bytes))
        print(f"[{name}] drawing weights ({layer_bytes / 1e9:.2f} GB/layer), building {n_layers} layers ...",
              flush=True)
        t0 = time.perf_counter()
        hw = random_device_weights(cfg, args.seed)
        opts = {} if args.decode_max_tokens is None else {"decode_max_tokens": args.decode_max_tokens}
        layers = [MoeLayer(cfg, hw, max_tokens=max_n, path=args.path, **opts) for _ in range(n_layers)]
        del hw
        for L in layers:
            L.warmup()
        peers = None if args.no_peers else _torch_peers(layers)
        print(f"[{name}] ready in {time.perf_counter() - t0:.1f} s"
              f"{'' if peers else ' (no torch peers)'}", flush=True)
        for n in args.tokens:
            x = cupy.asarray(bf16_bits(rng.standard_normal((n, H), dtype=np.float32)))
            out = cupy.empty_like(x)
            s = cupy.cuda.Stream(non_blocking=True)
            for L in layers:  # eager once: warm, and the routing for the floor
                L.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr)
            s.synchronize()
            ids = cupy.ndarray((n, k), cupy.int32, cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(layers[-1].arena.ptr("topk_ids"), n * k * 4, None), 0)).get()
            touched = len(np.unique(ids[ids < E]))
            stage_events: list = []
            s.begin_capture()
            with record_stage_events(stage_events) if args.stages else contextlib.nullcontext():
                for L in layers:
                    L.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr)
            g = s.end_capture()
            g.upload(s)
            for _ in range(3):
                g.launch(s)
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            times = []
            for _ in range(args.repeats):
                e0.record(s)
                for _ in range(args.replays):
                    g.launch(s)
                e1.record(s)
                e1.synchronize()
                times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / args.replays / n_layers)
            us = statistics.median(times)
            stage_us: dict[str, float] = {}
            if stage_events:  # after the last replay: each stage's time, averaged over the layers
                for st, a, z in stage_events:
                    stage_us[st] = stage_us.get(st, 0.0) + cupy.cuda.get_elapsed_time(a, z) * 1e3 / n_layers
            nbytes = (touched * 3 * H * I + 3 * H * Is + R * H + 2 * n * H) * 2
            flops = 2 * n * (k * 3 * H * I + H * R + 3 * H * Is)
            floor = max(nbytes / copy_tbps / 1e6, flops / mm_tflops / 1e6)
            peer = peers.get((name, n), {})
            row = dict(shape=name, N=n, path=args.path, us=round(us, 2), floor_us=round(floor, 2),
                       pct_of_floor=round(100 * floor / us, 1), touched=touched,
                       TBps=round(nbytes / us / 1e6, 3), TFLOPs=round(flops / us / 1e6, 2),
                       spread_us=round(max(times) - min(times), 2),
                       vllm_compute_only=peer.get("vllm_compute_only"), grouped_mm=peer.get("grouped_mm"),
                       stages_us={k: round(v, 2) for k, v in stage_us.items()} or None)
            if peers:
                row.update(time_peers(peers, cfg, x, out, n, args))
            results.append(row)
            vs = f"{peer['vllm_compute_only'] / us:.2f}x vLLM" if peer.get("vllm_compute_only") else ""
            for name in ("grouped_mm", "eager"):
                if row.get(f"{name}_us"):
                    vs += f"  {row[f'{name}_us'] / us:.2f}x {name}"
            print(f"  N={n:<6} {us:9.1f} us  floor {floor:8.1f} us ({row['pct_of_floor']:5.1f}% of floor)  "
                  f"{row['TBps']:.2f} TB/s  {row['TFLOPs']:.1f} TFLOP/s  touched {touched}  {vs}", flush=True)
            if stage_us:
                print("           stages: " + "  ".join(f"{k} {v:.1f}" for k, v in stage_us.items()), flush=True)
        del layers
        cupy.get_default_memory_pool().free_all_blocks()
    meta = dict(gpu=gpu, commit=_git_commit(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), cupy=cupy.__version__, copy_TBps=copy_tbps,
                bf16_TFLOPs=mm_tflops, method="CUDA-graph replays over several layers, median of repeats")
    path = Path(args.json) if args.json else (
        Path("benchmarks/results") / f"{datetime.now():%Y%m%d-%H%M}-{gpu.replace(' ', '_')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    print(f"results written to {path}", file=sys.stderr)
    if args.plots:
        for png in plot_results(results, Path(args.plots), stem=path.stem):
            print(f"plot written to {png}", file=sys.stderr)
    return 0


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

    def timed(fn, reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = []
        for _ in range(reps):
            e0.record(s)
            fn()
            e1.record(s)
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

        with torch.cuda.stream(s):
            res["grouped_mm_us"] = round(timed(replays, args.repeats) / args.replays / len(peers), 2)
    except RuntimeError as e:  # a torch build whose grouped_mm cannot be captured: time it eagerly
        res["grouped_mm_note"] = f"not capturable ({e.__class__.__name__}); timed eagerly"
        with torch.cuda.stream(s):
            res["grouped_mm_us"] = round(timed(lambda: [p.grouped_mm(xt, o) for p in peers], args.repeats)
                                         / len(peers), 2)
    if n <= args.eager_max_tokens:
        with torch.cuda.stream(s):
            res["eager_us"] = round(timed(lambda: [p.eager(xt, o) for p in peers], 3) / len(peers), 2)
    return res


def plot_results(rows: list[dict], folder: Path, stem: str = "bench") -> list[Path]:
    """One PNG per preset: time against N (log-log), the floor, every implementation."""
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
              ("vllm_compute_only", "vLLM compute-only (baseline file)", "-.d"), ("floor_us", "floor", "k-")]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["N"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, label, style in series:
            pts = [(r["N"], r[key]) for r in mine if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, label=label, linewidth=1.5 if key != "floor_us" else 1.0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("µs per layer")
        ax.set_title(f"{shape}: bf16 MoE layer (routed experts)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        png = folder / f"{stem}-{shape}.png"
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    return written
