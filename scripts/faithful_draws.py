"""The data behind verify.py's faithful rule: many fresh draws of the tiny families on the
GPU, saved, then judged on the CPU by any candidate rule.

    python scripts/faithful_draws.py collect --out draws.npz [--draws 16]     (GPU)
    python scripts/faithful_draws.py analyze draws.npz                         (CPU)

`collect` runs each family (and the wide-k variant of tests/test_gpu_layer.py) on the
prefill and decode paths at N = 1, 3, 17, 64 and stores every input and output with the
seed of the weights, so `analyze` rebuilds the weights and the references exactly and
reports, per configuration, how many draws verify.compare fails and how far the worst
element lies beyond the tight bound (a kernel bug lands far beyond it; a rounding flip
that the faithful model cannot place lands within one ulp of a rounded term).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from cupymoe import testing, verify

CONFIGS = {f: dict(family=f) for f in testing.FAMILIES}
CONFIGS["qwen3_next_wide_k"] = dict(family="qwen3_next", num_experts_per_tok=12)
TOKENS = (1, 3, 17, 64)
PATHS = ("prefill", "decode")


def _config(name: str):
    kw = dict(CONFIGS[name])
    return testing.tiny_config(kw.pop("family"), **kw)


def _weights(name: str, seed: int):
    cfg = _config(name)
    return cfg, testing.random_host_weights(cfg, np.random.default_rng(seed))


def collect(out: str, draws: int, seed: int) -> None:
    from cupymoe import MoeLayer

    saved = {}
    for ci, name in enumerate(CONFIGS):
        wseed = seed + ci
        cfg, hw = _weights(name, wseed)
        layer = MoeLayer(cfg, hw, max_tokens=max(TOKENS), decode_max_tokens=max(TOKENS))
        rng = np.random.default_rng(seed + 1000 + ci)
        for d in range(draws):
            for n in TOKENS:
                x = verify.well_separated_input(cfg, hw, rng, n)
                for path in PATHS:
                    o = verify.run_layer(layer, x, path)
                    key = f"{name}|{wseed}|{path}|{n}|{d}"
                    saved[key + "|x"] = verify.bf16_bits(x)
                    saved[key + "|out"] = o
        print(f"{name}: {draws} draws x {len(TOKENS)} sizes x {len(PATHS)} paths", flush=True)
    np.savez_compressed(out, **saved)


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """One unit in the last place of bf16 at each |v| (8 significant bits)."""
    a = np.maximum(np.abs(np.asarray(v, np.float64)), 2.0 ** -126)
    return 2.0 ** (np.floor(np.log2(a)) - 7)


def analyze(path: str) -> int:
    data = np.load(path)
    cases = sorted({k.rsplit("|", 1)[0] for k in data.files})
    weights = {}
    summary = {}
    for case in cases:
        name, wseed, p, n, d = case.split("|")
        if (name, wseed) not in weights:
            weights[name, wseed] = _weights(name, int(wseed))
        cfg, hw = weights[name, wseed]
        x = verify.bits_to_f32(data[case + "|x"])
        out = data[case + "|out"]
        c = verify.check(out, cfg, hw, x, p)
        exact, faithful = verify.references(cfg, hw, x, p)
        f = np.asarray(faithful, np.float64)
        tight = verify.FAITHFUL_TIGHT[0] * np.abs(f) + verify.FAITHFUL_TIGHT[1] * np.sqrt(np.mean(f ** 2))
        err = np.abs(out - f)
        ratio = float((err / tight).max())
        # beyond the tight bound: how far, in ulps of the output's own bf16 value
        ulp = bf16_ulp(f)
        beyond = err > tight
        ulps = float(((err - verify.FAITHFUL_TIGHT[1] * np.sqrt(np.mean(f ** 2))) / ulp)[beyond].max()) if beyond.any() else 0.0
        s = summary.setdefault((name, p, int(n)), dict(draws=0, failed=0, worst=0.0, outliers=[], ulps=0.0))
        s["draws"] += 1
        s["failed"] += 0 if c.ok else 1
        s["worst"] = max(s["worst"], ratio)
        s["ulps"] = max(s["ulps"], ulps)
        s["outliers"].append(c.outliers)
    fails = 0
    print(f"{'config':22s} {'path':8s} {'N':>4s} {'failed':>9s} {'mean outliers':>14s} {'max':>8s} "
          f"{'worst |o-f|/tight':>18s} {'outliers: ulps of out':>22s}")
    for (name, p, n), s in sorted(summary.items()):
        fails += s["failed"]
        print(f"{name:22s} {p:8s} {n:4d} {s['failed']:4d}/{s['draws']:<4d} {np.mean(s['outliers']):14.2e} "
              f"{np.max(s['outliers']):8.2e} {s['worst']:18.2f} {s['ulps']:22.2f}")
    print(f"{fails} failed checks of {len(cases)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--draws", type=int, default=16)
    c.add_argument("--seed", type=int, default=20261130)
    a = sub.add_parser("analyze")
    a.add_argument("path")
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        collect(args.out, args.draws, args.seed)
        return 0
    return analyze(args.path)


if __name__ == "__main__":
    sys.exit(main())
