"""What the routing chain's kernels cost because their code is cold. The bench's layer copies of one
cell are built as `graph_timeline.py` builds them; three graphs are captured and replayed in the
steady state, and each routing-chain kernel (stages router, topk, norm, sort) is read under
torch.profiler (CUPTI records of a graph's kernels):
  full   the whole forwards, as the bench replays them (the routing code comes after the GEMMs,
         which stream the weights through L2);
  warm   the routing steps alone, copy after copy (every launch's code was run just before);
  l2cold the routing steps alone, each copy's behind a 256 MB read (L2 holds no code; the SMs'
         instruction caches keep what the read's tiny kernel did not take).
For each kernel: its median duration and its median step, the time from the previous kernel's end
to its own end (what it adds to the chain; under PDL a kernel starts early and waits).

    python3 scripts/code_fetch_probe.py --preset qwen3-30b-a3b --format fp8_block --tokens 16

Needs a GPU, CuPy and torch (the profiler).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time

ROUTING = {"router", "topk", "norm", "sort"}


def kernel_records(run, replays: int = 20) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every kernel that `replays` calls of run() enqueue."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return sorted((e["ts"], e["dur"], re.sub(r"\(.*", "", e["name"])) for e in events
                  if e.get("cat") == "kernel" and e.get("ph") == "X")


def per_kernel(records: list[tuple[float, float, str]], names: list[str]) -> dict[str, dict]:
    """Each name's median duration and median step (its end minus the previous kernel's end)."""
    out: dict[str, dict] = {}
    prev_end = None
    durs: dict[str, list] = {}
    steps: dict[str, list] = {}
    for t, d, name in records:
        short = name[:60]
        if any(n in name for n in names):
            durs.setdefault(short, []).append(d)
            if prev_end is not None:
                steps.setdefault(short, []).append(t + d - prev_end)
        prev_end = t + d if prev_end is None else max(prev_end, t + d)
    for short in durs:
        out[short] = dict(dur=statistics.median(durs[short]),
                          step=statistics.median(steps[short]) if steps.get(short) else None, count=len(durs[short]))
    return out


def main() -> None:
    import types

    import cupy

    from cupymoe.bench import PRESETS, build_layers, cell_input, layer_options, preset_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--format", default="bf16", choices=["bf16", "fp8_block", "nvfp4", "mxfp4"])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--fp8-compute", default="auto", choices=["auto", "w8a8", "w8a16"])
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    cfg, n = preset_config(args.preset), args.tokens
    layers = build_layers(cfg, args.format, types.SimpleNamespace(tokens=[n], seed=0), args.preset,
                          **layer_options(args.format, args))  # the bench's copies, as bench builds them
    nl = len(layers)
    x, out = cell_input(cfg, n, 0)
    s = cupy.cuda.Stream(non_blocking=True)
    for layer in layers:
        layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr)
    s.synchronize()
    packs = [next(p for p in layer._packed.values() if p.bound_n == n) for layer in layers]
    routing = [[(kind, payload) for stage, kind, payload in p.steps if getattr(stage, "value", stage) in ROUTING]
               for p in packs]
    names = sorted({payload[3] for steps in routing for kind, payload in steps if kind == "launch"})
    flush_a = cupy.zeros(64 << 20, dtype=cupy.float32)  # 256 MB read, 256 MB written: L2 holds none of the code
    flush_b = cupy.empty_like(flush_a)

    def capture(body) -> cupy.cuda.Graph:
        with s:
            s.begin_capture()
            body()
            g = s.end_capture()
        g.upload(s)
        return g

    def full():
        for layer in layers:
            layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr)

    def routing_only(flush: bool):
        def body():
            for p, steps in zip(packs, routing):
                if flush:
                    cupy.add(flush_a, 1.0, out=flush_b)
                p.prepare(int(x.data.ptr), int(out.data.ptr), 0, n, s.ptr)
                for kind, payload in steps:
                    p.run_step(kind, payload, n, s.ptr)
        return body

    graphs = {"full": capture(full), "warm": capture(routing_only(False)), "l2cold": capture(routing_only(True))}
    result = dict(preset=args.preset, format=args.format, tokens=n, copies=nl, kernels=names, forms={})
    for form, g in graphs.items():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            g.launch(s)
            s.synchronize()

        def run(g=g):
            g.launch(s)
        recs = kernel_records(run)
        s.synchronize()
        result["forms"][form] = per_kernel(recs, names)
    print(f"{args.preset} {args.format} N={n}: {nl} copies; routing kernels' median duration / step (µs)")
    for short in result["forms"]["full"]:
        row = "  ".join(f"{form} {f[short]['dur']:6.2f} / {f[short]['step'] or 0:6.2f}"
                        for form, f in result["forms"].items() if short in f)
        print(f"  {short:60s} {row}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
