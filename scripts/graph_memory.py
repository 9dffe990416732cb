"""Device memory and time that warmup's graph captures cost, over many layers on one workspace.

    python scripts/graph_memory.py --preset qwen3-30b-a3b --format bf16 fp8_block --layers 8 --json F

Each layer is built on the first layer's workspace, then warmed up (every decode row count and
prefill shape planned and captured as one-launch graphs). Reported per layer: plans, graphs,
warmup seconds, and the device memory warmup added (cudaMemGetInfo, after a synchronize), so a
server can budget a model of L layers as L times that figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def used_bytes() -> int:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def measure(preset: str, fmt: str, layers: int, max_tokens: int) -> dict:
    from cupymoe.bench import preset_config, random_device_weights
    from cupymoe.layer import MoeLayer

    cfg = preset_config(preset)
    hw = random_device_weights(cfg, 0, fmt)
    built, rows = [], []
    for i in range(layers):
        ws = {"workspace": built[0].workspace} if built else {}
        layer = MoeLayer(cfg, hw, max_tokens=max_tokens, **ws)
        before = used_bytes()
        t0 = time.perf_counter()
        report = layer.warmup()
        rows.append({"layer": i, "plans": report.plans, "graphs": report.graphs,
                     "warmup_s": round(time.perf_counter() - t0, 3), "warmup_bytes": used_bytes() - before})
        built.append(layer)
        print(f"{preset} {fmt} layer {i}: {rows[-1]}", flush=True)
    per_layer = [r["warmup_bytes"] for r in rows[1:]] or [rows[0]["warmup_bytes"]]
    return {"preset": preset, "format": fmt, "max_tokens": max_tokens, "layers": rows,
            "workspace_bytes": built[0].workspace.scratch_bytes + built[0].workspace.zeroed_bytes,
            "warmup_bytes_per_layer_median": sorted(per_layer)[len(per_layer) // 2]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--format", nargs="+", default=["bf16", "fp8_block"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results = [measure(args.preset, f, args.layers, args.max_tokens) for f in args.format]
    for r in results:
        print(f"{r['preset']} {r['format']}: warmup adds {r['warmup_bytes_per_layer_median'] / 2**20:.1f} MiB a layer "
              f"(median of layers 1..), workspace {r['workspace_bytes'] / 2**20:.1f} MiB shared")
    if args.json:
        command = (f"python scripts/graph_memory.py --preset {args.preset} --format {' '.join(args.format)} "
                   f"--layers {args.layers} --max-tokens {args.max_tokens}")
        args.json.write_text(json.dumps({"command": command, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
