"""The data behind verify.py's faithful rule: many fresh draws of the tiny families on the
GPU, saved, then judged on the CPU by any candidate rule.

    python scripts/faithful_draws.py collect --out draws.npz [--draws 16] [--format bf16 fp8_block]   (GPU)
    python scripts/faithful_draws.py analyze draws.npz                                                 (CPU)

`collect` runs each family (and the wide-k variant of tests/test_gpu_layer.py) in each
weight format on the prefill and decode paths at N = 1, 3, 17, 64. It judges every output
right away by verify.check with the layer (the rule the GPU tests apply: it reads the
layer's stored intermediates, so only there) into draws.json, and stores every input and
output with the seed of the weights, so `analyze` rebuilds the weights and the references
exactly and reports, per configuration, how many draws the rule without the layer's
intermediates fails and how far the worst element lies beyond the tight bound (a kernel bug
lands far beyond it; a rounding flip the faithful model cannot place, within one ulp of a
rounded term).
"""

from __future__ import annotations

import argparse
import json
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


def _weights(name: str, seed: int, fmt: str = "bf16"):
    cfg = _config(name)
    return cfg, testing.random_host_weights(cfg, np.random.default_rng(seed), fmt)


def collect(out: str, draws: int, seed: int, fmts) -> None:
    from cupymoe import MoeLayer

    saved, judged = {}, []
    for fi, fmt in enumerate(fmts):
        for ci, name in enumerate(CONFIGS):
            wseed = seed + 100 * fi + ci
            cfg, hw = _weights(name, wseed, fmt)
            layer = MoeLayer(cfg, hw, max_tokens=max(TOKENS), decode_max_tokens=max(TOKENS),
                             keep_w8a8_activation=True)  # verify.check reads the w8a8 bf16 activation
            rng = np.random.default_rng(seed + 1000 + 100 * fi + ci)
            for d in range(draws):
                for n in TOKENS:
                    x = verify.well_separated_input(cfg, hw, rng, n)
                    for path in PATHS:
                        o = verify.run_layer(layer, x, path)
                        c = verify.check(o, cfg, hw, x, path, layer=layer)
                        judged.append(dict(config=name, format=fmt, path=path, n=n, draw=d, ok=c.ok,
                                           outliers=c.outliers, faithful=c.faithful_normwise,
                                           stage_outliers=None if c.stages is None else c.stages.outliers))
                        key = f"{name}|{wseed}|{fmt}|{path}|{n}|{d}"
                        saved[key + "|x"] = verify.bf16_bits(x)
                        saved[key + "|out"] = o
            failed = sum(not j["ok"] for j in judged if j["config"] == name and j["format"] == fmt)
            print(f"{name} {fmt}: {draws} draws x {len(TOKENS)} sizes x {len(PATHS)} paths, "
                  f"{failed} failed verify.check", flush=True)
    np.savez_compressed(out, **saved)
    with open(out.rsplit(".", 1)[0] + ".json", "w") as f:
        json.dump(judged, f)


def analyze(path: str) -> int:
    data = np.load(path)
    cases = sorted({k.rsplit("|", 1)[0] for k in data.files})
    weights = {}
    summary = {}
    for case in cases:
        name, wseed, fmt, p, n, d = case.split("|")
        if fmt == "fp8_block" and p == "prefill":  # w8a8: only the device's stage checks apply
            continue
        if (name, wseed, fmt) not in weights:
            weights[name, wseed, fmt] = _weights(name, int(wseed), fmt)
        cfg, hw = weights[name, wseed, fmt]
        x = verify.bits_to_f32(data[case + "|x"])
        out = data[case + "|out"]
        c = verify.check(out, cfg, hw, x, p)
        exact, faithful = verify.references(cfg, hw, x, p)
        f = np.asarray(faithful, np.float64)
        tight = verify.FAITHFUL_TIGHT[0] * np.abs(f) + verify.FAITHFUL_TIGHT[1] * np.sqrt(np.mean(f ** 2))
        err = np.abs(out - f)
        ratio = float((err / tight).max())
        # beyond the tight bound: how far, in ulps of the output's own bf16 value
        ulp = verify.bf16_ulp(f)
        beyond = err > tight
        ulps = float(((err - verify.FAITHFUL_TIGHT[1] * np.sqrt(np.mean(f ** 2))) / ulp)[beyond].max()) if beyond.any() else 0.0
        s = summary.setdefault((f"{name} {fmt}", p, int(n)), dict(draws=0, failed=0, worst=0.0, outliers=[], ulps=0.0))
        s["draws"] += 1
        s["failed"] += 0 if c.ok else 1
        s["worst"] = max(s["worst"], ratio)
        s["ulps"] = max(s["ulps"], ulps)
        s["outliers"].append(c.outliers)
    fails = 0
    print(f"{'config':30s} {'path':8s} {'N':>4s} {'failed':>9s} {'mean outliers':>14s} {'max':>8s} "
          f"{'worst |o-f|/tight':>18s} {'outliers: ulps of out':>22s}")
    for (name, p, n), s in sorted(summary.items()):
        fails += s["failed"]
        print(f"{name:30s} {p:8s} {n:4d} {s['failed']:4d}/{s['draws']:<4d} {np.mean(s['outliers']):14.2e} "
              f"{np.max(s['outliers']):8.2e} {s['worst']:18.2f} {s['ulps']:22.2f}")
    print(f"{fails} failed checks of {sum(s['draws'] for s in summary.values())} (without the layer's intermediates)")
    judged = path.rsplit(".", 1)[0] + ".json"
    try:
        with open(judged) as f:
            rows = json.load(f)
    except OSError:
        return 0
    bad = [r for r in rows if not r["ok"]]
    print(f"on the device, verify.check with the layer: {len(bad)} failed of {len(rows)}")
    for r in bad:
        print(f"  {r}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--draws", type=int, default=16)
    c.add_argument("--seed", type=int, default=20261130)
    c.add_argument("--format", nargs="+", default=["bf16"], help="expert weight formats (fp8_block: w8a8 on sm_90a)")
    a = sub.add_parser("analyze")
    a.add_argument("path")
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        collect(args.out, args.draws, args.seed, args.format)
        return 0
    return analyze(args.path)


if __name__ == "__main__":
    sys.exit(main())
