"""The LoRA plans' cost model (benchmarks/DECISIONS.md, "LoRA: what the plans cost"): per issue
cell, the extra launches (counted from the CPU plans), the second gate/up pass's weight bytes,
the adapters' bytes, the per-pair kernels' scalar loads, and the predicted overhead with two
gate/up passes (ACT_SELECT, before ACT_PAIR), with one (ACT_PAIR) and after each further
proposed change; the plans say how many passes this tree makes. The last column models this
tree's own LoRA plan (branch_us: which delta kernels, grouped or per pair, PDL or plain). No
GPU; base times and gate/up shares are the measured ones quoted.

    PYTHONPATH=$PWD python scripts/lora_cost.py
"""

from __future__ import annotations

import math

from cupymoe.bench import expected_touched, expert_bytes, preset_config
from cupymoe.ceilings import COPY_TBPS
from cupymoe.forward_plan import LoraShape, build_forward_plan
from cupymoe.knobs import Knobs
from cupymoe.plan import DeviceFacts, LayerOptions, Path, Stage, choose_path, plan_layer

K, R = 4, 16
COPY = COPY_TBPS * 1e12  # B/s, the H200's steady copy ceiling (its base times below)
LOADS = 132 * 32 * 1.5e9  # scalar loads/s: one warp load instruction a clock an SM at the capped clock
GAP_US = 2.5  # a plain (non-PDL) launch's gap in a graph, measured order (DECISIONS.md, Host)
L2_RATE = 8e12  # B/s, L2 hits (a guess within 2x)
PDL_GAP_US, FLOOR_US = 1.0, 3.0  # a PDL launch's gap; a delta kernel's latency floor (guesses)
# measured base µs (results/20261202-h200-lora.json: qwen3 bf16 and fp8_block w8a16, deepseek bf16;
# deepseek fp8_block: the w8a8 rows, stand-ins for w8a16) and gate/up's share of the layer (the
# stages runs: 20261202-h200-stages, 20261130-h200-stages-n1, prefill-stages)
BASE = {("qwen3-30b-a3b", "bf16"): {1: 33.2, 64: 345.4, 1024: 417.5, 4096: 825.0},
        ("qwen3-30b-a3b", "fp8_block"): {1: 24.2, 64: 179.0, 1024: 653.0, 4096: 1623.0},
        ("deepseek-v3", "bf16"): {1: 179.0, 64: 4557.0, 1024: 5830.0, 4096: 6888.0},
        ("deepseek-v3", "fp8_block"): {1: 101.6, 64: 2156.9, 1024: 4000.0, 4096: 6932.2}}
GATE_UP_SHARE = {1: 0.40, 64: 0.54, 1024: 0.58, 4096: 0.61}


def pair_loads(cfg, pairs: int) -> float:
    """Scalar loads of lora_gate_up_act and lora_down_delta (every row has an adapter)."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = 2 * R * 2 * H + 2 * I * R + 3 * I  # A and x a rank row, B a column, g u act
    down = 2 * R * I + H * R + 2 * H
    return pairs * (gate_up + down)


def gate_up_gemms(plan) -> int:
    """The plan's gate/up GEMM launches (those with an activation code; not lora_gate_up_act)."""
    return sum(1 for s in plan.steps if getattr(s, "stage", None) == Stage.GATE_UP
               and s.kernel != "lora_gate_up_act" and any(a.name == "act_code" for a in s.args))


def branch_us(cfg, lora, base, n: int) -> float:
    """This tree's LoRA plan `lora` (against `base`) at n rows: its launches' gaps (PDL or plain),
    the g/u round trip, the router delta and the expert deltas. Per-pair kernels: each pair's
    adapter bytes from L2, over a latency floor. Grouped kernels: the grouped path's stored
    terms yw read and written, down's act read (HBM), each 32-row chunk's A and B (a partial
    chunk an adapter a tile) and each pair's x row (L2), over a floor; the mma work is < 1 % of
    the GEMMs'."""
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    new = [s for s in lora.steps if getattr(s, "kernel", "").startswith("lora_")]
    kinds = {s.kernel for s in new}
    gaps = sum(PDL_GAP_US if s.pdl else GAP_US for s in new)
    pairs = n * k
    stores = 2 * pairs * I * 2 * 2 / COPY * 1e6
    if "lora_grouped_router_delta" in kinds:
        router = -(-n // 32) * min(K, 32) * R * H * 4 / L2_RATE * 1e6
    else:
        router = n * R * H * 4 / L2_RATE * 1e6
    if "lora_grouped_down_delta" in kinds:
        touched = expected_touched(E, k, n)
        tiles = touched * math.ceil(pairs / touched / 128)  # 128-row GEMM tiles
        chunks = tiles * K * math.ceil(pairs / tiles / K / 32)  # the adapters round-robin in a tile
        hbm = pairs * (4 * H + 2 * I)
        l2 = chunks * R * (3 * H + 3 * I) * 2 + pairs * 2 * H
        experts = hbm / COPY * 1e6 + l2 / L2_RATE * 1e6
    else:
        experts = pairs * (R * (3 * H + 3 * I) * 2 + 2 * H + 4 * I + 8 * H) / L2_RATE * 1e6
    return gaps + stores + max(FLOOR_US, router) + max(2 * FLOOR_US, experts)


def cell(shape: str, fmt: str, n: int) -> dict:
    cfg = preset_config(shape, routed_only=True)
    dev = DeviceFacts.h200()
    lp = plan_layer(cfg, fmt, None, dev.arch, options=LayerOptions(fp8_compute="w8a16"), knobs=Knobs())
    path = Path(choose_path(lp, "auto", n))
    base = build_forward_plan(lp, dev, n, path).at(n)
    lora = build_forward_plan(lp, dev, n, path, lora=LoraShape(K, R, True)).at(n)
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    T = expected_touched(E, k, n)
    gu_bytes = T * expert_bytes(fmt, H, I) * 2 / 3
    segs = min(K * E, E * (1 - (1 - 1 / E) ** (n * k / K)) * min(K, n))  # (adapter, expert) segments touched
    adapter_bytes = segs * R * (3 * H + 3 * I) * 2 + K * R * (H + cfg.router_width) * 4
    b = BASE[(shape, fmt)][n]
    second = GATE_UP_SHARE[n] * b
    stores = 2 * n * k * I * 2 * 2 / COPY * 1e6  # g and u written and read back (bf16)
    pairs_us = max(pair_loads(cfg, n * k) / LOADS * 1e6, adapter_bytes / COPY * 1e6)
    passes = gate_up_gemms(lora) // gate_up_gemms(base)  # 1 with ACT_PAIR, 2 with ACT_SELECT
    gaps = (len(lora.steps) - len(base.steps)) * GAP_US
    gaps_one = gaps - (passes - 1) * GAP_US  # the one-pass plan's extra launches
    now = (passes - 1) * second + stores + pairs_us + gaps
    two_pass = now + (2 - passes) * (second + GAP_US)  # the second pass: its weights and its launch
    one_pass = now - (passes - 1) * (second + GAP_US)
    sgmv = stores + adapter_bytes / COPY * 1e6 + 2 * n * k * R * (4 * H + 2 * I) / 600e12 * 1e6 + gaps_one
    # a shrink launch before gate/up and one before down, under PDL (~1 µs each), nothing else
    fused = adapter_bytes / COPY * 1e6 + 2 * n * k * R * (4 * H + 2 * I) / 600e12 * 1e6 + 2 * 1.0
    return dict(shape=shape, fmt=fmt, n=n, path=path.value, launches=len(lora.steps) - len(base.steps),
                passes=passes, gu_GB=gu_bytes / 1e9, adapter_MB=adapter_bytes / 1e6,
                loads_G=pair_loads(cfg, n * k) / 1e9, base=b, two_pass=100 * two_pass / b,
                one_pass=100 * one_pass / b, sgmv=100 * sgmv / b, fused=100 * fused / b,
                branch=100 * branch_us(cfg, lora, base, n) / b)


def main() -> None:
    print("| preset | fmt | N | path | +launches (this tree) | 2nd gate/up GB | adapter MB | pair loads G | base µs "
          "| two passes % | one pass % | + grouped shrink/expand % | + expand in the GEMM, router delta fused, PDL % "
          "| this tree's plan % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in ("qwen3-30b-a3b", "deepseek-v3"):
        for fmt in ("bf16", "fp8_block"):
            for n in (1, 64, 1024, 4096):
                c = cell(shape, fmt, n)
                print(f"| {shape} | {fmt} | {n} | {c['path']} | {c['launches']} | {c['gu_GB']:.2f} | "
                      f"{c['adapter_MB']:.0f} | {c['loads_G']:.2f} | {c['base']:.0f} | {c['two_pass']:.0f} | "
                      f"{c['one_pass']:.0f} | {c['sgmv']:.0f} | {c['fused']:.0f} | {c['branch']:.0f} |")


if __name__ == "__main__":
    main()
