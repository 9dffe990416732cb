"""The tail of a model's normwise error against the exact reference at few elements, which verify's
normwise bounds must cover. A rule names the model and the bound:

  w8a8      the reference's w8a8 rounding (rounding="grouped", activations="fp8_block"), fp8_block
            weights; bound verify.w8a8_normwise_bound
  faithful  the kernel-faithful bf16 model of a path (--rounding decode | grouped) in --format, with
            --lora R an adapter of rank R on every module of every row (the LoRA plans' stores,
            lora_plan=True); bound verify.exact_normwise_bound

Fresh well-separated rows of the tiny configs (weights redrawn every 20 rows), per (family, N): the
median, the 99th and 99.9th percentiles, the largest, and the size factor c in B (1 + c / sqrt(elements))
that the largest needs (B: the rule's bound at many elements). No GPU.

    python scripts/normwise_tail.py [--rule w8a8] [--families qwen3_moe deepseek_v3 gpt_oss] [--tokens 1 3]
                                    [--draws 20000] [--seed 7] [--json FILE]
    python scripts/normwise_tail.py --rule faithful --rounding grouped --format fp8_block [--lora 8] ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def _model(args, cfg, hw, x, adapters, ids):
    from cupymoe import reference

    if args.rule == "w8a8":
        return reference.moe_forward(cfg, hw, x, rounding="grouped", activations="fp8_block")
    return reference.moe_forward(cfg, hw, x, rounding=args.rounding, lora=adapters, lora_ids=ids,
                                 lora_plan=adapters is not None)


def tail(args, fam: str, n: int) -> dict:
    from cupymoe import reference, testing, verify
    from cupymoe.lora import random_lora

    rng = np.random.default_rng(args.seed)
    cfg = testing.tiny_config(fam)
    fmt = "fp8_block" if args.rule == "w8a8" else args.format
    ids = np.zeros(n, np.int32) if args.lora else None
    errs = np.empty(args.draws)
    for d in range(args.draws):
        if d % 20 == 0:
            hw = testing.random_host_weights(cfg, rng, fmt)
            adapters = {0: random_lora(cfg, rng, args.lora, size=0.3)} if args.lora else None
        x = verify.well_separated_input(cfg, hw, rng, n, lora=adapters, lora_ids=ids)
        exact = reference.moe_forward(cfg, hw, x, lora=adapters, lora_ids=ids)
        errs[d] = np.linalg.norm(_model(args, cfg, hw, x, adapters, ids) - exact) / np.linalg.norm(exact)
    elements = n * cfg.hidden_size
    many, bound = ((verify.W8A8_NORMWISE, verify.w8a8_normwise_bound(elements)) if args.rule == "w8a8" else
                   (verify.EXACT_NORMWISE, verify.exact_normwise_bound(elements)))
    return {"family": fam, "N": n, "elements": elements, "draws": args.draws, "median": float(np.median(errs)),
            "p99": float(np.quantile(errs, 0.99)), "p999": float(np.quantile(errs, 0.999)), "max": float(errs.max()),
            "bound": bound, "over_bound": int(np.count_nonzero(errs > bound)),
            "factor_needed": (float(errs.max()) / many - 1) * math.sqrt(elements)}


def _what(args) -> str:
    if args.rule == "w8a8":
        return "the reference's w8a8 model against float64 at few elements (verify.w8a8_normwise_bound)"
    lora = f", an adapter of rank {args.lora} on every module of every row (lora_plan)" if args.lora else ""
    return (f"the reference's kernel-faithful model ({args.rounding} rounding, {args.format} weights{lora}) against "
            f"float64 at few elements (verify.exact_normwise_bound)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rule", choices=("w8a8", "faithful"), default="w8a8")
    ap.add_argument("--rounding", choices=("decode", "grouped"), default="grouped", help="faithful: the path's")
    ap.add_argument("--format", default="bf16", help="faithful: the expert weights' format")
    ap.add_argument("--lora", type=int, default=0, help="faithful: every row with an adapter of this rank")
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "deepseek_v3", "gpt_oss"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for fam in args.families:
        for n in args.tokens:
            r = tail(args, fam, n)
            rows.append(r)
            print(f"{fam} N={n} ({r['elements']} elements): median {r['median']:.4f} p99 {r['p99']:.4f} "
                  f"p99.9 {r['p999']:.4f} max {r['max']:.4f}; bound {r['bound']:.4f}, {r['over_bound']} over; "
                  f"factor needed {r['factor_needed']:.2f}", flush=True)
    if args.json:
        meta = {"command": "python scripts/normwise_tail.py " + " ".join(sys.argv[1:]).replace(args.json, "FILE"),
                "what": _what(args)}
        json.dump({"meta": meta, "rows": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
