"""Where an eager forward's host time goes: the driver's own cost of a launch and of the calls a
forward makes, against a forward split into its parts.

    python scripts/host_probe.py --preset qwen3-30b-a3b --format bf16 fp8_block --path decode prefill \\
        --tokens 1 64 4096 --json host.json

Prints µs a call (over --calls calls in batches of 20, the median of the batch means; the stream
drained between batches, outside the timing).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from cupymoe.bench import host_us_per_call as timed  # µs a call: the median of batch means


def driver_costs(calls: int) -> dict:
    import cupy

    from cupymoe.launch import Driver, LaunchConfig, _PDL_ATTRIBUTE, _dims

    lib = Driver.lib()
    s = cupy.cuda.Stream(non_blocking=True)
    k = cupy.RawKernel('extern "C" __global__ void noop(int a) {}', "noop")
    k((1,), (32,), (np.int32(0),))
    arg = ctypes.c_int32(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    plain = LaunchConfig(_dims((1,)), _dims((32,)), 0, s.ptr, None, 0)
    pdl = LaunchConfig(_dims((1,)), _dims((32,)), 0, s.ptr, ctypes.pointer(_PDL_ATTRIBUTE), 1)
    fn = int(k.kernel.ptr)
    ev = cupy.cuda.Event(disable_timing=True)
    out = {
        "cuLaunchKernelEx": timed(lambda: lib.cuLaunchKernelEx(ctypes.addressof(plain), fn, ctypes.addressof(params),
                                                               None), calls, s.synchronize),
        "cuLaunchKernelEx_pdl": timed(lambda: lib.cuLaunchKernelEx(ctypes.addressof(pdl), fn,
                                                                   ctypes.addressof(params), None), calls, s.synchronize),
        "cupy_launch": timed(lambda: k((1,), (32,), (np.int32(0),), stream=s), calls, s.synchronize),
        "cuEventRecord": timed(lambda: Driver.record(ev.ptr, s.ptr), calls, s.synchronize),
        "cuStreamIsCapturing": timed(lambda: Driver.is_capturing(s.ptr), calls, s.synchronize),
    }
    return out


def forward_parts(layer, x, out, n: int, calls: int, path=None) -> dict:
    import cupy

    from cupymoe.layer_checks import check_call

    s = cupy.cuda.Stream(non_blocking=True)
    xp, op = int(x.data.ptr), int(out.data.ptr)
    layer.forward(xp, n, op, s.ptr, path=path)
    packed = layer.plan_for(n, path)
    ws = layer.workspace
    parts = {
        "forward": timed(lambda: layer.forward(xp, n, op, s.ptr, path=path), calls, s.synchronize),
        "check_call": timed(lambda: check_call(layer, xp, n, op, 0), calls, s.synchronize),
        "plan.run": timed(lambda: packed.run(xp, op, 0, n, s.ptr), calls, s.synchronize),
        "workspace.done": timed(lambda: ws.done(s.ptr), calls, s.synchronize),
        "launches": len(packed.plan.launches),
    }
    graph = layer._graphs.get(packed)
    if graph is not None:  # one graph launch as it was last patched; then with x alternating between two buffers
        x2 = x.copy()
        pointers = (xp, int(x2.data.ptr))
        parts["graph.launch"] = timed(lambda: graph.launch(xp, op, 0, n, s.ptr), calls, s.synchronize)
        flips = iter(range(10 ** 9))
        parts["graph.launch_new_x"] = timed(lambda: graph.launch(pointers[next(flips) & 1], op, 0, n, s.ptr), calls,
                                            s.synchronize)
        parts["nodes_reading_x"] = len(graph._call_nodes) + sum(nd.reads_call for nd in graph._n_nodes)
    return parts


def main() -> None:
    import json

    import cupy

    from cupymoe import MoeLayer, bench
    from cupymoe.errors import PathUnavailableError

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--format", nargs="+", default=["bf16"])
    ap.add_argument("--path", nargs="+", default=["auto"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    driver = {k: round(v, 2) for k, v in driver_costs(args.calls).items()}
    print("driver:", driver)
    cfg = bench.preset_config(args.preset)
    rows = []
    for fmt in args.format:
        layer = MoeLayer(cfg, bench.random_device_weights(cfg, 0, fmt), max_tokens=max(args.tokens),
                         decode_max_tokens=64, atomic_max_tokens=64)
        for path in args.path:
            for n in args.tokens:
                try:
                    taken = layer.select_path(n, None if path == "auto" else path)
                except PathUnavailableError:
                    continue
                x = cupy.asarray((np.random.default_rng(n).standard_normal((n, cfg.hidden_size), dtype=np.float32)
                                  .view(np.uint32) >> 16).astype(np.uint16))
                out = cupy.empty_like(x)
                cupy.cuda.runtime.deviceSynchronize()
                parts = forward_parts(layer, x, out, n, args.calls, None if path == "auto" else path)
                parts = {k: round(v, 2) if isinstance(v, float) else v for k, v in parts.items()}
                rows.append(dict(format=fmt, path=path, taken=taken, N=n, **parts))
                print(f"{fmt} {path}->{taken} N={n}:", parts)
        del layer
    if args.json:
        meta = dict(gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), date=time.strftime("%Y-%m-%d"),
                    preset=args.preset, calls=args.calls, command="PYTHONPATH=. python3 scripts/host_probe.py "
                    + " ".join(__import__("sys").argv[1:]).replace(args.json, "<json>"))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, driver_us=driver, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
