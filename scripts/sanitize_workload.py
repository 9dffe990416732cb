"""The forwards compute-sanitizer watches (scripts/sanitize.sh): every kernel family on every path
and format, on layers shaped like qwen3_moe and deepseek_v3 (H = 2048, 32 and 64 experts), fresh
random inputs, every output element written (--check: against cupymoe.reference too).

    python scripts/sanitize_workload.py [--formats bf16 fp8_block nvfp4 mxfp4] [--tokens 1 5 12 64 640]
                                        [--families qwen3_moe deepseek_v3] [--paths decode atomic prefill]
                                        [--lora] [--fp8-compute w8a16]

--lora: two adapters on every module the layer has (ranks 8 and 3), the rows' slots cycling -1, 0, 1: the
LoRA plans (on the prefill path the shrinks and the stacked GEMMs, those by PDL). Families other than
the two shaped here take testing.tiny_config's sizes.

Rows: 1 and 5 take the decode path's fused routing + lists (decode_route_lists), 12 the top-k +
lists kernel (decode_topk_lists), 64 topk_route with the one-block list builder and the grouped
"stream" GEMMs, 640 the three-pass sort and the math-bound grouped GEMMs (wgmma on Hopper).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

SHAPES = {
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=32, num_experts_per_tok=8),
    "deepseek_v3": dict(hidden_size=2048, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                        n_group=8, topk_group=4, shared_expert_intermediate_size=512),
}


def main() -> int:
    from cupymoe import MoeLayer, testing
    from cupymoe.lora import random_lora
    from cupymoe.verify import check, run_layer, well_separated_input

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_block", "nvfp4", "mxfp4"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 5, 12, 64, 640])
    ap.add_argument("--families", nargs="+", default=list(SHAPES))
    ap.add_argument("--paths", nargs="+", default=["decode", "atomic", "prefill"])
    ap.add_argument("--check", action="store_true",
                    help="also check every output against the float64 reference (slow on the CPU at 640 rows)")
    ap.add_argument("--lora", action="store_true", help="two adapters on every module, the rows' slots mixed")
    ap.add_argument("--fp8-compute", choices=["w8a8", "w8a16"], help="fp8_block's compute (default the layer's)")
    args = ap.parse_args()
    if args.lora and args.check:
        ap.error("--check compares against the reference without adapters: give --lora or --check, not both")
    rng = np.random.default_rng(5)
    bad = runs = 0
    for fam in args.families:
        cfg = testing.tiny_config(fam, **SHAPES.get(fam, {}))
        for fmt in args.formats:
            hw = testing.random_host_weights(cfg, rng, fmt)
            # --check reads the w8a8 prefill's bf16 activation, which only then is stored
            extra = dict(max_loras=2, max_lora_rank=8) if args.lora else {}
            if args.fp8_compute and fmt == "fp8_block":
                extra["fp8_compute"] = args.fp8_compute
            layer = MoeLayer(cfg, hw, max_tokens=max(args.tokens), decode_max_tokens=64, atomic_max_tokens=8,
                             keep_w8a8_activation=bool(args.check), **extra)
            if args.lora:
                for slot, (rank, size) in enumerate(((8, 0.3), (3, 0.5))):
                    layer.set_lora(slot, random_lora(cfg, rng, rank=rank, size=size))
            for n in args.tokens:
                paths = ["decode", "atomic", "prefill"] if n <= 8 else ["decode", "prefill"] if n <= 64 else ["prefill"]
                for path in (p for p in paths if p in args.paths):
                    x = well_separated_input(cfg, hw, rng, n)
                    ids = (np.arange(n) % 3 - 1) if args.lora else None  # slots -1, 0, 1, -1, ...
                    out = run_layer(layer, x, path, lora_ids=ids)
                    ok = bool(np.isfinite(out).all())  # poisoned with NaN: every element written
                    why = "" if ok else "unwritten or non-finite output"
                    if ok and args.check:
                        c = check(out, cfg, hw, x, path, layer=layer)
                        ok, why = c.ok, str(c)
                    runs += 1
                    bad += not ok
                    print(f"{fam} {fmt} N={n} {path}: {'ok' if ok else 'FAIL ' + why}", flush=True)
            del layer
    print(f"sanitize_workload: {runs} forwards, {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
