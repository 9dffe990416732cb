"""Output bits of a fixed set of layers and calls, to compare two versions of the package.

    python scripts/plan_equivalence.py --out new.json                 # with the package on the path
    PYTHONPATH=old_tree python scripts/plan_equivalence.py --out old.json
    python scripts/plan_equivalence.py --compare old.json new.json

Every case draws its weights and inputs from fixed seeds with the public API only (MoeLayer,
testing.random_host_weights, bench.random_device_weights), runs one forward on a forced
bit-reproducible path (decode, prefill) and records the sha256 of the output's bits. The
atomic path is left out: its float atomics may sum in any order. The LoRA cases (tiny layers with
four adapters of mixed ranks, ids -1 mixed in) cover the per-pair, grouped and stacked forms;
`--lora-only` runs them alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

TINY_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")
TINY_TOKENS = ((1, "decode"), (3, "decode"), (8, "decode"), (17, "decode"), (64, "decode"), (65, "prefill"),
               (300, "prefill"), (1000, "prefill"))
PRESETS = (("qwen3-30b-a3b", ("bf16", "fp8_block", "nvfp4", "mxfp4")), ("deepseek-v3", ("fp8_block", "nvfp4")),
           ("qwen3-next-80b", ("bf16",)), ("gpt-oss-120b", ("mxfp4",)), ("mixtral-8x7b", ("bf16",)))
PRESET_TOKENS = (1, 2, 5, 16, 64, 200, 1024, 4096)
LORA_FAMILIES = ("qwen3_moe", "qwen2_moe")  # without and with the shared expert
LORA_FORMATS = (("bf16", {}), ("fp8_block", {"fp8_compute": "w8a16"}))
LORA_RANKS = (16, 3, 1, 8)  # the slots' adapters
# 1100: the stacked form on a tiny layer (shrinks by expert pieces or chunks); 2100: by segments
# (heuristics.LORA_SEGMENTS_FROM_ROWS)
LORA_TOKENS = ((9, "decode"), (300, "prefill"), (1100, "prefill"), (2100, "prefill"))


def _bits(a) -> np.ndarray:
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _run(layer, x_bits: np.ndarray, path: str, lora_ids=None) -> str:
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    with s:  # upload and poison ordered before the forward
        x = cupy.asarray(x_bits)
        out = cupy.full(x.shape, 0x7FC0, cupy.uint16)
        ids = None if lora_ids is None else cupy.asarray(lora_ids)
    layer(x, out=out, path=path, stream=s.ptr, lora_ids=ids)
    s.synchronize()
    return hashlib.sha256(cupy.asnumpy(out).tobytes()).hexdigest()[:32]


def tiny_cases(results: dict) -> None:
    from cupymoe import MoeLayer, testing

    for fam in testing.FAMILIES:
        cfg = testing.tiny_config(fam)
        for fmt in TINY_FORMATS:
            for options in ({}, {"row_invariant": True}) + (({"fp8_compute": "w8a16"},) if fmt == "fp8_block" else ()):
                rng = np.random.default_rng(11)
                hw = testing.random_host_weights(cfg, rng, fmt)
                layer = MoeLayer(cfg, hw, max_tokens=1000, decode_max_tokens=64, atomic_max_tokens=64, **options)
                tag = ",".join(f"{k}={v}" for k, v in options.items())
                for n, path in TINY_TOKENS:
                    path = "prefill" if options.get("row_invariant") else path
                    x = _bits(np.random.default_rng([n, 5]).standard_normal((n, cfg.hidden_size)) * 0.5)
                    results[f"tiny {fam} {fmt} {tag} N={n} {path}"] = _run(layer, x, path)
                del layer


def lora_cases(results: dict) -> None:
    from cupymoe import MoeLayer, testing
    from cupymoe.lora import random_lora

    for fam in LORA_FAMILIES:
        cfg = testing.tiny_config(fam)
        for fmt, options in LORA_FORMATS:
            rng = np.random.default_rng(13)
            hw = testing.random_host_weights(cfg, rng, fmt)
            layer = MoeLayer(cfg, hw, max_tokens=max(n for n, _ in LORA_TOKENS), decode_max_tokens=64,
                             atomic_max_tokens=64, max_loras=len(LORA_RANKS), max_lora_rank=max(LORA_RANKS), **options)
            for slot, rank in enumerate(LORA_RANKS):
                layer.set_lora(slot, random_lora(cfg, rng, rank))
            for n, path in LORA_TOKENS:
                x = _bits(np.random.default_rng([n, 7]).standard_normal((n, cfg.hidden_size)) * 0.5)
                ids = np.random.default_rng([n, 8]).integers(-1, len(LORA_RANKS), n).astype(np.int32)
                results[f"lora {fam} {fmt} N={n} {path}"] = _run(layer, x, path, ids)
            del layer


def preset_cases(results: dict) -> None:
    import cupy

    from cupymoe import MoeLayer, bench

    for preset, fmts in PRESETS:
        cfg = bench.preset_config(preset, routed_only=False)
        for fmt in fmts:
            hw = bench.random_device_weights(cfg, 0, fmt)
            cupy.cuda.runtime.deviceSynchronize()
            layer = MoeLayer(cfg, hw, max_tokens=max(PRESET_TOKENS))
            for n in PRESET_TOKENS:
                x = _bits(np.random.default_rng([n, 9]).standard_normal((n, cfg.hidden_size)))
                results[f"{preset} {fmt} N={n} auto"] = _run(layer, x, None)
            del layer, hw
            cupy.get_default_memory_pool().free_all_blocks()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--tiny-only", action="store_true")
    ap.add_argument("--lora-only", action="store_true", help="the LoRA cases alone")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(f))["outputs"] for f in args.compare)
        common = sorted(set(a) & set(b))
        differ = [k for k in common if a[k] != b[k]]
        for k in differ:
            print("DIFFERS", k)
        print(f"plan_equivalence: {len(common)} cases in both, {len(differ)} differ, "
              f"{len(set(a) ^ set(b))} in one only")
        return 1 if differ or not common else 0
    t0 = time.time()
    results: dict = {}
    if not args.lora_only:
        tiny_cases(results)
    lora_cases(results)
    if not (args.tiny_only or args.lora_only):
        preset_cases(results)
    import cupymoe

    meta = dict(package=cupymoe.__file__.split("/")[-2], cases=len(results), seconds=round(time.time() - t0, 1))
    json.dump(dict(meta=meta, outputs=results), open(args.out, "w"), indent=0)
    print(f"plan_equivalence: {len(results)} cases in {meta['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
