"""Run a preset layer eagerly a few times at given token counts: a target for ncu.

    ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
        python3 scripts/stage_times.py --preset qwen3-30b-a3b --tokens 1 [--format fp8_block]
        [--lora 4 --lora-rank 16]   (the bench's adapters, rows round-robin over the slots)
        [--path decode --decode-max-tokens 256]   (with CUPYMOE_DECODE_KERNEL=swapab: that kernel at 256 rows)

Per-kernel durations come from ncu; this script only builds the layer and launches.
"""

import argparse
import types

import cupy
import numpy as np

from cupymoe.bench import PRESETS, install_adapters, lora_ids_on_device, preset_config, random_device_weights
from cupymoe.layer import MoeLayer
from cupymoe.verify import bf16_bits

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
ap.add_argument("--tokens", type=int, nargs="+", default=[1])
ap.add_argument("--path", default="auto")
ap.add_argument("--format", default="bf16", choices=["bf16", "fp8_block", "nvfp4", "mxfp4"])
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--lora", type=int, default=0, help="adapters in the layer's slots (0: none)")
ap.add_argument("--lora-rank", type=int, default=16)
ap.add_argument("--fp8-compute", default="auto")
ap.add_argument("--decode-max-tokens", type=int, default=None, help="the layer's decode_max_tokens (with --path decode)")
args = ap.parse_args()

cfg = preset_config(args.preset)
opts = dict(max_loras=args.lora, max_lora_rank=args.lora_rank) if args.lora else {}
if args.decode_max_tokens:
    opts["decode_max_tokens"] = args.decode_max_tokens
layer = MoeLayer(cfg, random_device_weights(cfg, 0, args.format), max_tokens=max(args.tokens),
                 fp8_compute=args.fp8_compute, **opts)
if args.lora:
    install_adapters([layer], types.SimpleNamespace(seed=0, lora=args.lora, lora_rank=args.lora_rank))
rng = np.random.default_rng(0)
for n in args.tokens:
    x = cupy.asarray(bf16_bits(rng.standard_normal((n, cfg.hidden_size), dtype=np.float32)))
    out = cupy.empty_like(x)
    ids = int(lora_ids_on_device(n, args.lora).data.ptr) if args.lora else 0
    for _ in range(args.reps):
        layer.forward(int(x.data.ptr), n, int(out.data.ptr), cupy.cuda.get_current_stream().ptr, path=args.path,
                      lora_ids_ptr=ids)
cupy.cuda.runtime.deviceSynchronize()
