#!/usr/bin/env python3
"""Where the w8a8 TMA GEMM's tiles spend their time (issue 40): each block of
grouped_gemm_sm90_fp8_tma stamps %globaltimer at its entry, its first full stage, its main loop's
end and its epilogue's end, with its SM, into a probe array of a patched copy of the tree (the
kernel as main has it otherwise); one eager forward of a preset's fp8_block layer after warm-up.
Prints, per GEMM: tiles, the kernel's span, the medians of fill / main loop / epilogue and of the
gap an SM sits between its blocks, and the SMs' busy share; then the JSON.

    python3 scripts/fp8_tile_probe.py --preset qwen3-30b-a3b --tokens 4096 [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from statistics import median_high
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = 16384  # probe rows a GEMM; blocks past it share the last row (the counts say so)

# a block's stamps (ns), then its SM and rows: PROBE_SLOTS a block
STAMPS = ("entry", "first_full", "loop_end", "epilogue_end", "tile_found", "barriers_ready", "epilogue_mid")
SM, ROWS = len(STAMPS), len(STAMPS) + 1
PROBE_SLOTS = len(STAMPS) + 2

HELPERS = f"""
#define F8T_PROBE_BLOCKS {BLOCKS}
__device__ unsigned long long f8t_probe[2][F8T_PROBE_BLOCKS][{PROBE_SLOTS}];  // [gate/up, down][block][stamps, SM, rows]
__device__ __forceinline__ unsigned long long f8t_now() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}}
"""

# (anchor, text inserted after it): each anchor occurs once in the kernel's source
PATCHES = (
    ("    GemmTile t;\n",
     "    const unsigned long long probe_t0 = f8t_now();\n"),
    ("    if (!gemm_tile<MODE, BM, BN, FMT_FP8>(t, GEMM_ARG_NAMES)) return;\n",
     "    unsigned long long* probe = f8t_probe[MODE == MODE_GATE_UP ? 0 : 1]"
     "[min((int)(blockIdx.y * gridDim.x + blockIdx.x), F8T_PROBE_BLOCKS - 1)];\n"
     "    if (threadIdx.x == 0) {\n"
     "        unsigned sm;\n"
     "        asm volatile(\"mov.u32 %0, %smid;\" : \"=r\"(sm));\n"
     "        probe[0] = probe_t0; probe[4] = f8t_now(); probe[7] = sm; probe[8] = t.rows;\n"
     "    }\n"),
    ("    __syncthreads();\n",
     "    if (threadIdx.x == 0) probe[5] = f8t_now();\n"),
    ("            const float amax[2] = {fmaxf(m[0][0], m[1][0]), fmaxf(m[0][1], m[1][1])};  // the row's 128 columns\n",
     "            if (threadIdx.x == 0) probe[6] = f8t_now();\n"),
    ("        mbar_wait(&full[s], (kt / S) & 1);\n",
     "        if (kt == 0 && threadIdx.x == 0) probe[1] = f8t_now();\n"),
    ("    if (!has_rows) return;\n",
     ""),
)


def patched_tree(dest: Path) -> Path:
    """cupymoe/ and cuda/ copied into dest, the TMA GEMM stamping its blocks."""
    for d in ("cupymoe", "cuda"):
        shutil.copytree(ROOT / d, dest / d, ignore=shutil.ignore_patterns("__pycache__"))
    cu = dest / "cuda" / "grouped_sm90_fp8_tma.cu"
    src = cu.read_text()
    kernel = src.index("template <int MODE, bool STORE_ACT = false, int WGS = 2>\n__global__")
    src = src[:kernel] + HELPERS + src[kernel:]
    for anchor, text in PATCHES:
        if src.count(anchor) != 1:
            raise SystemExit(f"probe anchor not found once in {cu.name}: {anchor!r}")
        src = src.replace(anchor, anchor + text)
    loop_end = "    if (!has_rows) return;\n"
    src = src.replace(loop_end, "    if (threadIdx.x == 0) probe[2] = f8t_now();\n" + loop_end)
    assert src.endswith("}\n")
    src = src[:-2] + "    if (threadIdx.x == 0) probe[3] = f8t_now();\n}\n"
    cu.write_text(src)
    return dest


def summarize(rows) -> dict:
    """One GEMM's blocks (STAMPS in ns, SM, rows) as figures, µs: the medians of each block's parts, from
    entry to its tile found (the tile lists' loads), its barriers ready, its first stage full, its main
    loop's end, gate/up's activation made (the row maxima known) and its epilogue's end."""
    at = {name: i for i, name in enumerate(STAMPS)}
    rows = [r for r in rows if r[at["entry"]] and r[at["epilogue_end"]]]
    if not rows:
        return {"tiles": 0}

    def part(start: str, end: str, of=None) -> float:
        """The median of end - start over the blocks (`of`: those blocks alone), µs."""
        return median_high([r[at[end]] - r[at[start]] for r in (of or rows)]) * 1e-3

    t0, t1 = min(r[at["entry"]] for r in rows), max(r[at["epilogue_end"]] for r in rows)
    by_sm: dict[int, list] = {}
    for r in rows:
        by_sm.setdefault(int(r[SM]), []).append(r)
    gaps, busy = [], 0
    for blocks in by_sm.values():
        blocks.sort(key=lambda r: r[at["entry"]])
        gaps += [b[at["entry"]] - a[at["epilogue_end"]] for a, b in zip(blocks, blocks[1:])]
        busy += sum(r[at["epilogue_end"]] - r[at["entry"]] for r in blocks)
    with_act = [r for r in rows if r[at["epilogue_mid"]]]  # gate/up's blocks stamp it
    return {"tiles": len(rows), "span_us": (t1 - t0) * 1e-3, "sms": len(by_sm),
            "blocks_an_sm_max": max(len(b) for b in by_sm.values()),
            "fill_us": part("entry", "first_full"),
            "find_tile_us": part("entry", "tile_found"),
            "barriers_us": part("tile_found", "barriers_ready"),
            "first_stage_us": part("barriers_ready", "first_full"),
            "loop_us": part("first_full", "loop_end"),
            "epilogue_us": part("loop_end", "epilogue_end"),
            "epilogue_act_us": part("loop_end", "epilogue_mid", with_act) if with_act else None,
            "block_us": part("entry", "epilogue_end"),
            "gap_between_blocks_us": median_high(gaps) * 1e-3 if gaps else 0.0,
            "busy_share": busy / ((t1 - t0) * len(by_sm)),
            "last_start_us": (max(r[at["entry"]] for r in rows) - t0) * 1e-3,
            "rows_median": median_high([int(r[ROWS]) for r in rows])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tree = patched_tree(Path(tempfile.mkdtemp()))
    sys.path.insert(0, str(tree))
    import cupy
    import numpy as np

    from cupymoe import MoeLayer, jit
    from cupymoe.bench import preset_config, random_device_weights

    out = {"what": "w8a8 TMA GEMM blocks by %globaltimer (scripts/fp8_tile_probe.py)", "cells": []}
    for preset in args.preset:
        cfg = preset_config(preset)
        hw = random_device_weights(cfg, 0, "fp8_block")
        layer = MoeLayer(cfg, hw, max_tokens=max(args.tokens))
        layer.warmup()
        del hw
        mods = [m for m in jit.library(0)._modules if _has_probe(m)]
        assert len(mods) == 1, f"{len(mods)} modules hold the probe"
        nbytes = 2 * BLOCKS * PROBE_SLOTS * 8
        mem = cupy.cuda.UnownedMemory(mods[0].get_global_var("f8t_probe"), nbytes, mods[0])
        probe = cupy.ndarray((2, BLOCKS, PROBE_SLOTS), cupy.uint64, cupy.cuda.MemoryPointer(mem, 0))
        g = cupy.random.default_rng(1)
        for n in args.tokens:
            xb = _bf16(cupy, g, n, cfg.hidden_size)
            y = cupy.zeros((n, cfg.hidden_size), cupy.uint16)
            s = cupy.cuda.Stream(non_blocking=True)
            for _ in range(20):
                layer.forward(int(xb.data.ptr), n, int(y.data.ptr), s.ptr)
            s.synchronize()
            probe[...] = 0
            layer.forward(int(xb.data.ptr), n, int(y.data.ptr), s.ptr)
            s.synchronize()
            host = probe.get().astype(np.int64)
            cell = {"preset": preset, "N": n, "path": layer.select_path(n),
                    "gate_up": summarize(host[0].tolist()), "down": summarize(host[1].tolist())}
            out["cells"].append(cell)
            for stage in ("gate_up", "down"):
                f = cell[stage]
                print(f"{preset} N={n} {stage}: " + "  ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in f.items()), flush=True)
        del layer
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def _has_probe(mod) -> bool:
    try:
        mod.get_global_var("f8t_probe")
        return True
    except Exception:
        return False


def _bf16(cupy, g, n, h):
    """bf16 bits of N(0, 1) rows (the top half of each float32)."""
    return (g.standard_normal((n, h), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)


if __name__ == "__main__":
    main()
