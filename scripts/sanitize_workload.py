"""The forwards compute-sanitizer watches (scripts/sanitize.sh): every kernel family on every path
and format, on layers shaped like qwen3_moe and deepseek_v3 (H = 2048, 32 and 64 experts), fresh
random inputs, every output element written (--check: against cupymoe.reference too).

    python scripts/sanitize_workload.py [--formats bf16 fp8_block nvfp4 mxfp4] [--tokens 1 5 12 64 640]
                                        [--families qwen3_moe deepseek_v3] [--paths decode atomic prefill]

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
    from cupymoe.verify import check, run_layer, well_separated_input

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_block", "nvfp4", "mxfp4"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 5, 12, 64, 640])
    ap.add_argument("--families", nargs="+", default=list(SHAPES))
    ap.add_argument("--paths", nargs="+", default=["decode", "atomic", "prefill"])
    ap.add_argument("--check", action="store_true",
                    help="also check every output against the float64 reference (slow on the CPU at 640 rows)")
    args = ap.parse_args()
    rng = np.random.default_rng(5)
    bad = runs = 0
    for fam in args.families:
        cfg = testing.tiny_config(fam, **SHAPES[fam])
        for fmt in args.formats:
            hw = testing.random_host_weights(cfg, rng, fmt)
            # --check reads the w8a8 prefill's bf16 activation, which only then is stored
            layer = MoeLayer(cfg, hw, max_tokens=max(args.tokens), decode_max_tokens=64, atomic_max_tokens=8,
                             keep_w8a8_activation=bool(args.check))
            for n in args.tokens:
                paths = ["decode", "atomic", "prefill"] if n <= 8 else ["decode", "prefill"] if n <= 64 else ["prefill"]
                for path in (p for p in paths if p in args.paths):
                    x = well_separated_input(cfg, hw, rng, n)
                    out = run_layer(layer, x, path)
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
