"""The tail of the w8a8 model's normwise error against the exact reference at few elements, which
verify.w8a8_normwise_bound must cover: the reference's own w8a8 rounding (rounding="grouped",
activations="fp8_block") against float64, on fresh well-separated rows of tiny configs (weights redrawn
every 20 rows), per (family, N): the median, the 99th and 99.9th percentiles, the largest, and the
size factor c in 2^-4 (1 + c / sqrt(elements)) that the largest needs. No GPU.

    python scripts/w8a8_bound_tail.py [--families qwen3_moe deepseek_v3 gpt_oss] [--tokens 1 3]
                                      [--draws 20000] [--seed 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def tail(fam: str, n: int, draws: int, seed: int) -> dict:
    from cupymoe import reference, testing
    from cupymoe.verify import W8A8_NORMWISE, w8a8_normwise_bound, well_separated_input

    rng = np.random.default_rng(seed)
    cfg = testing.tiny_config(fam)
    errs = np.empty(draws)
    for d in range(draws):
        if d % 20 == 0:
            hw = testing.random_host_weights(cfg, rng, "fp8_block")
        x = well_separated_input(cfg, hw, rng, n)
        exact = reference.moe_forward(cfg, hw, x)
        w8a8 = reference.moe_forward(cfg, hw, x, rounding="grouped", activations="fp8_block")
        errs[d] = np.linalg.norm(w8a8 - exact) / np.linalg.norm(exact)
    elements = n * cfg.hidden_size
    bound = w8a8_normwise_bound(elements)
    return {"family": fam, "N": n, "elements": elements, "draws": draws, "median": float(np.median(errs)),
            "p99": float(np.quantile(errs, 0.99)), "p999": float(np.quantile(errs, 0.999)), "max": float(errs.max()),
            "bound": bound, "over_bound": int(np.count_nonzero(errs > bound)),
            "factor_needed": (float(errs.max()) / W8A8_NORMWISE - 1) * math.sqrt(elements)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "deepseek_v3", "gpt_oss"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for fam in args.families:
        for n in args.tokens:
            r = tail(fam, n, args.draws, args.seed)
            rows.append(r)
            print(f"{fam} N={n} ({r['elements']} elements): median {r['median']:.4f} p99 {r['p99']:.4f} "
                  f"p99.9 {r['p999']:.4f} max {r['max']:.4f}; bound {r['bound']:.4f}, {r['over_bound']} over; "
                  f"factor needed {r['factor_needed']:.2f}", flush=True)
    if args.json:
        meta = {"command": "python scripts/w8a8_bound_tail.py " + " ".join(sys.argv[1:]).replace(args.json, "FILE"),
                "what": "the reference's w8a8 model against float64 at few elements (verify.w8a8_normwise_bound)"}
        json.dump({"meta": meta, "rows": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
