"""CPU model of the per-pair LoRA kernels' sliced shrinks (cuda/lora_common.cuh lora_slice,
lora_slice_shrink, lora_slices_meet; forward_plan.lora_slices): the slices cover every input
vector once and in order, the scratch and ticket counts bound every plan's use, and the fixed
summation order (a lane's vectors, the LORA_TPR-lane butterfly, the slices in order) gives the
float64 dot product to fp32 accuracy whatever block comes last."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cupymoe.catalog import LORA_RED
from cupymoe.forward_plan import LORA_BLOCKS, LORA_SLICE_MIN, LORA_SLICE_TARGET, lora_slices
from cupymoe.workspace import LORA_TICKETS

KERNELS = Path(__file__).parents[1] / "cuda"
SRC = (KERNELS / "lora_common.cuh").read_text() + (KERNELS / "lora.cu").read_text()  # the shrink, its constants, the kernels
TPR, VPT = (int(re.search(rf"#define {n} (\d+)", SRC).group(1)) for n in ("LORA_TPR", "LORA_VPT"))


def test_constants_match_the_kernels():
    assert int(re.search(r"#define LORA_RED (\d+)", SRC).group(1)) == LORA_RED
    assert LORA_BLOCKS == LORA_TICKETS and 32 % TPR == 0
    assert LORA_SLICE_TARGET <= LORA_TICKETS  # the splits stay inside the tickets and lora_part


def lora_slice(length, s, S):
    vecs = (length + 7) >> 3
    per = (vecs + S - 1) // S
    return min(length, 8 * per * s), min(length, 8 * per * (s + 1))


@pytest.mark.parametrize("length", [8, 64, 96, 392, 768, 776, 2048, 7168])
def test_slices_cover_each_vector_once_in_order(length):
    for items in (1, 3, 8, 9, 64, 512, 1055, 1056, 5000):
        S = lora_slices(items, length)
        assert 1 <= S <= max(1, -(-length // LORA_SLICE_MIN))
        cols = []
        for s in range(S):
            lo, hi = lora_slice(length, s, S)
            assert lo % 8 == 0 and lo <= hi
            cols.extend(range(lo, hi))
        assert cols == list(range(length))


def test_scratch_bounds():
    """lora_part holds 2 LORA_TICKETS items' slices (workspace.layer_scratch) and lora_tickets
    LORA_TICKETS counters: every split (slices > 1) stays inside both."""
    for cols in (96, 776, 2048, 7168):
        for items in range(1, 3000):
            S = lora_slices(items, cols)
            if S > 1:
                assert items < LORA_TICKETS and items * S < 2 * LORA_TICKETS, (items, cols, S)


def block_rank_sum(a, v, lo, hi):
    """lora_slice_shrink's sum for one rank row: lane l adds its vectors c0 = lo + 8 l, + 8 TPR
    VPT ... (VPT at a step, each 8 products in column order) in fp32, then the butterfly."""
    f32 = np.float32
    lanes = []
    for lane in range(TPR):
        acc = f32(0)
        for c0 in range(lo + 8 * lane, hi, 8 * TPR * VPT):
            for i in range(VPT):
                c = c0 + 8 * TPR * i
                if c >= hi:
                    continue
                for e in range(8):
                    acc = f32(acc + f32(a[c + e]) * f32(v[c + e]))
        lanes.append(acc)
    m = TPR // 2
    while m:
        lanes = [f32(lanes[i] + lanes[i ^ m]) for i in range(TPR)]
        m //= 2
    assert len({float(x) for x in lanes}) == 1  # every lane of the row holds the same sum
    return lanes[0]


@pytest.mark.parametrize("length, items", [(776, 1), (392, 3), (2048, 8), (96, 1)])
def test_sliced_sum_is_the_dot_product(length, items, rng):
    a = rng.standard_normal(length).astype(np.float32)
    v = rng.standard_normal(length).astype(np.float32)
    S = lora_slices(items, length)
    parts = [block_rank_sum(a, v, *lora_slice(length, s, S)) for s in range(S)]
    t = np.float32(0)
    for p in parts:  # lora_slices_meet: the slices in slice order
        t = np.float32(t + p)
    exact = float(np.dot(a.astype(np.float64), v.astype(np.float64)))
    bound = 2 * length * np.finfo(np.float32).eps * float(np.abs(a.astype(np.float64)) @ np.abs(v))
    assert abs(float(t) - exact) <= bound


HOLDS = {n: int(re.search(rf"#define {n} (\d+)", SRC).group(1)) for n in ("LORA_HOLD", "LORA_HOLD_DOWN")}


def held_rounds(width, hold, threads=256):
    """The columns of lora_gate_up_act's / lora_down_delta's rounds as their loops take them: round
    c0 = 0, hold threads, ...; thread x's held slot i < hold is column c0 + x + i threads (< width);
    [(round, thread, slot, column)]; round 0 is the one computed before the PDL wait."""
    out, c0 = [], 0
    while True:
        out += [(c0 // (hold * threads), x, i, c0 + x + i * threads)
                for x in range(threads) for i in range(hold) if c0 + x + i * threads < width]
        if c0 + hold * threads >= width:
            return out
        c0 += hold * threads


@pytest.mark.parametrize("hold", sorted(HOLDS.values()))
@pytest.mark.parametrize("width", [1, 255, 256, 768, 2047, 2048, 2049, 2056, 4096, 4104, 7168, 12345])
def test_held_rounds_cover_each_column_once(width, hold):
    """Every output column in exactly one (round, thread, slot); a slot's index below HOLD (the
    register arrays' size); round 0 alone where width <= HOLD x 256 (qwen3's 768 and 2048,
    deepseek's gate/up 2048: all before the wait), deepseek's H = 7168 at HOLD_DOWN in two."""
    cols = held_rounds(width, hold)
    assert sorted(c for *_, c in cols) == list(range(width))
    assert all(i < hold for _, _, i, _ in cols)
    assert max(r for r, *_ in cols) == (width - 1) // (hold * 256)
    assert HOLDS == {"LORA_HOLD": 8, "LORA_HOLD_DOWN": 16}  # DECISIONS' figures (2048 and 4096 columns)
