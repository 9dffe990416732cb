"""Run a preset layer eagerly a few times at given token counts: a target for ncu.

    ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
        python3 scripts/stage_times.py --preset qwen3-30b-a3b --tokens 1 [--format fp8_block]

Per-kernel durations come from ncu; this script only builds the layer and launches.
"""

import argparse

import cupy
import numpy as np

from cupymoe.bench import PRESETS, preset_config, random_device_weights
from cupymoe.layer import MoeLayer
from cupymoe.verify import bf16_bits

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
ap.add_argument("--tokens", type=int, nargs="+", default=[1])
ap.add_argument("--path", default="auto")
ap.add_argument("--format", default="bf16", choices=["bf16", "fp8_block", "nvfp4", "mxfp4"])
ap.add_argument("--reps", type=int, default=3)
args = ap.parse_args()

cfg = preset_config(args.preset)
layer = MoeLayer(cfg, random_device_weights(cfg, 0, args.format), max_tokens=max(args.tokens))
rng = np.random.default_rng(0)
for n in args.tokens:
    x = cupy.asarray(bf16_bits(rng.standard_normal((n, cfg.hidden_size), dtype=np.float32)))
    out = cupy.empty_like(x)
    for _ in range(args.reps):
        layer.forward(int(x.data.ptr), n, int(out.data.ptr), cupy.cuda.get_current_stream().ptr, path=args.path)
cupy.cuda.runtime.deviceSynchronize()
