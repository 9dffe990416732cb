"""Where one bench cell's time goes inside its replayed CUDA graph, with programmatic dependent
launch on. `--stages` separates the kernels by events, which turns PDL off and
adds a launch gap a stage; Nsight Systems is not on the lent machines. This builds the bench's
layer copies, captures their forwards into one graph as the bench does, runs 0.3 s of replays
(the steady state), then 20 replays under torch.profiler, whose CUPTI kernel records include a
graph's kernels. Each layer forward (from the kernel matching --first) is one row of kernels;
for each kernel it prints the median start, end and duration, in µs from the forward's first
kernel's start. Under PDL a kernel starts early and waits: its end is what the chain sees.

    python3 scripts/graph_timeline.py --preset qwen3-30b-a3b --format fp8_block --tokens 1
    python3 scripts/graph_timeline.py --preset qwen3-30b-a3b --tokens 64 --lora 4   (bench --lora's adapters)

Needs a GPU, CuPy and torch (the profiler).
"""

from __future__ import annotations

import argparse
import re
import statistics


# a forward's first kernel: the router (decode's router_*; prefill's ROUTER-mode GEMM, mode 2),
# never the router's LoRA delta (lora_router_*)
FIRST = r"^(void )?(router|grouped_gemm(_sm90|_lora)?<2,)"


def forward_timeline(kernels: list[tuple[float, float, str]], first: str = FIRST) -> dict:
    """Kernel records (start µs, duration µs, name) of many forwards -> each position's median
    start, end and duration from its forward's first start, plus the median span (first start
    to last end) and period (first start to the next forward's). A forward starts at a kernel
    whose name matches `first`; forwards of the commonest length count (the first one, maybe
    cut by the profiler's window, is dropped)."""
    forwards: list[list[tuple[float, float, str]]] = []
    for t, d, name in sorted(kernels):
        if re.search(first, name):
            forwards.append([])
        if forwards:
            forwards[-1].append((t, d, name))
    if len(forwards) < 2:
        raise ValueError(f"fewer than two forwards start with a kernel matching {first!r}")
    length = statistics.mode(len(f) for f in forwards)
    forwards = [f for f in forwards if len(f) == length][1:]
    if not forwards:
        raise ValueError("no whole forward after the first")
    rows = []
    for i in range(length):
        rows.append(dict(
            name=forwards[0][i][2],
            start=statistics.median(f[i][0] - f[0][0] for f in forwards),
            end=statistics.median(f[i][0] + f[i][1] - f[0][0] for f in forwards),
            dur=statistics.median(f[i][1] for f in forwards)))
    starts = [f[0][0] for f in forwards]
    return dict(kernels=rows, forwards=len(forwards),
                span=statistics.median(max(t + d for t, d, _ in f) - f[0][0] for f in forwards),
                period=statistics.median(b - a for a, b in zip(starts, starts[1:])) if len(starts) > 1 else None)


def main() -> None:
    import json
    import tempfile
    import time

    import cupy
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cupymoe.bench import (PRESETS, add_lora_args, expected_touched, expert_bytes, install_adapters,
                               layer_options, layer_weight_bytes, layers_needed, lora_ids_on_device, preset_config,
                               random_device_weights)
    from cupymoe.layer import MoeLayer
    from cupymoe.verify import bf16_bits

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--format", default="bf16", choices=["bf16", "fp8_block", "nvfp4", "mxfp4"])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--first", default=FIRST, help="regex of a forward's first kernel's name")
    add_lora_args(ap)
    ap.add_argument("--seed", type=int, default=0, help="the adapters' draw (--lora)")
    ap.add_argument("--fp8-compute", default="auto", choices=["auto", "w8a8", "w8a16"],
                    help="fp8_block layers' compute (bench's; with --lora, auto is w8a16)")
    args = ap.parse_args()

    cfg, n = preset_config(args.preset), args.tokens
    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    lb = layer_weight_bytes(cfg, args.format)
    free = 0.6 * cupy.cuda.runtime.memGetInfo()[1] - lb
    nl = layers_needed(lb, expected_touched(E, k, n) * expert_bytes(args.format, H, I), free)
    hw = random_device_weights(cfg, 0, args.format)
    opts = layer_options(args.format, args)
    layers = [MoeLayer(cfg, hw, max_tokens=n, **opts) for _ in range(nl)]  # copies that L2 cannot hold together
    del hw
    for layer in layers:
        layer.warmup()
    lora_ids = 0  # the rows' adapter slots (bench --lora's), 0: the base plans
    if args.lora:
        install_adapters(layers, args)
        ids = lora_ids_on_device(n, args.lora)  # held for the graph's replays
        lora_ids = int(ids.data.ptr)
    x = cupy.asarray(bf16_bits(np.random.default_rng([0, n]).standard_normal((n, H), dtype=np.float32)))
    out = cupy.empty_like(x)
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    for layer in layers:
        layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr, lora_ids_ptr=lora_ids)
    s.synchronize()
    s.begin_capture()
    for layer in layers:
        layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr, lora_ids_ptr=lora_ids)
    g = s.end_capture()
    g.upload(s)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        g.launch(s)
        s.synchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(s)
    for _ in range(10):
        g.launch(s)
    e1.record(s)
    e1.synchronize()
    per_layer = cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / 10 / nl
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.launch(s)
        s.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    records = [(e["ts"], e["dur"], re.sub(r"\(.*", "", e["name"])) for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X"]
    tl = forward_timeline(records, args.first)
    lora = f" LoRA {args.lora}x r{args.lora_rank}" if args.lora else ""
    print(f"{args.preset} {args.format}{lora} N={n}: {nl} layer copies, {per_layer:.2f} µs a layer by events "
          f"(torch {torch.__version__}); {tl['forwards']} forwards, µs from the first kernel's start (medians)")
    for r in tl["kernels"]:
        print(f"  {r['name'][:58]:58s} start {r['start']:7.2f}  end {r['end']:7.2f}  dur {r['dur']:7.2f}")
    print(f"  span {tl['span']:.2f}  period {tl['period']:.2f}")


if __name__ == "__main__":
    main()
