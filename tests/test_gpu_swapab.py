"""GPU: the swap-AB bf16 decode (cuda/decode_swapab_sm90.cu, CUPYMOE_DECODE_KERNEL=swapab) against
cupymoe.reference on the decode and atomic paths, at row counts that take every token tile (1-8 rows too) and
runs longer than a tile (passes > 1): awkward N, K and I past whole 64-wide steps (H = 96, 160;
I = 40, a shared expert of 96), down's 128-row blocks reaching past H, one expert holding most
rows, experts nobody chose, outputs poisoned with NaN first; a captured graph's replay equals
the eager forward bit for bit. sm_90a only (elsewhere the knob leaves the register decode)."""

from __future__ import annotations

import pytest

from _gpu_checks import check_replay_matches_eager, check_skewed_routing
from cupymoe import testing
from cupymoe.verify import check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

# name -> (family, MoeConfig overrides)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),  # H = 96: a step and a half of K, down's block past H
    "mixtral": ("mixtral", {}),  # 8 experts, top-2: 64 rows an expert at 255 rows, tiles of 128
    "qwen3_moe-I40": ("qwen3_moe", {"moe_intermediate_size": 40}),  # I not a multiple of 64
    "qwen2_moe": ("qwen2_moe", {}),  # a gated shared expert of I = 96: N rows in passes
    "gpt_oss": ("gpt_oss", {}),  # expert biases, swiglu_oai
    "qwen3_moe-H512": ("qwen3_moe", {"hidden_size": 512}),  # gate/up's K of 8 steps: the ring wraps
}
TOKENS = (1, 3, 8, 9, 17, 64, 255)  # 1-8: the tuning table takes it below 9 rows on some shapes
MAX_TOKENS = 256


@pytest.fixture(autouse=True)
def _swapab(monkeypatch):
    if not testing.on_sm90a():
        pytest.skip("the swap-AB decode needs sm_90a")
    monkeypatch.setenv("CUPYMOE_DECODE_KERNEL", "swapab")


def _case(name, rng, max_tokens=MAX_TOKENS):
    from cupymoe import MoeLayer

    family, overrides = CASES[name]
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    layer = MoeLayer(cfg, hw, max_tokens=max_tokens, decode_max_tokens=max_tokens, atomic_max_tokens=32)
    return cfg, hw, layer


@pytest.mark.parametrize("name", sorted(CASES))
def test_swapab_decode_matches_the_reference(name, rng):
    cfg, hw, layer = _case(name, rng)
    assert layer.plan.swapab_chosen
    for path, tokens in (("decode", TOKENS), ("atomic", (2, 9, 17))):
        for n in tokens:
            kernels = testing.expert_kernels(layer, n, path)
            assert all(k.startswith("decode_swapab_") for k in kernels), (n, kernels)
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
            assert c.ok, f"{name} N={n} {path} ({kernels[0]}): {c}"
    layer.check_errors()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_one_expert_holding_most_rows_and_experts_nobody_chose(name, rng):
    """A given routing: every row's first pick expert 0 (its run of N rows takes several passes
    of the token tile the plan sized for an even spread), the rest over every expert but 1."""
    cfg, hw, layer = _case(name, rng)
    check_skewed_routing(layer, cfg, hw, rng, (17, 255), "decode", name)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "qwen3_moe-H512"])
def test_gate_up_by_slot_matches_by_active_expert(name, monkeypatch):
    """decode_swapab_gate_up's grid by table slot (CUPYMOE_GATE_UP_AHEAD=on: each block's first
    weight stages copied before it waits for the lists, a slot nobody chose waiting for them to
    land and leaving; K of 1.5 and 2.5 steps, fewer than the ring's stages, and of 8, where the ring
    wraps onto the stages copied ahead) gives
    the very bits of its grid by active expert (off) on the decode path, and both match the
    reference on the decode and atomic paths, with a shared expert's slot (qwen2_moe); N = 9
    leaves experts nobody chose (skewed routing: always one); N = 300 (1200 pairs) has its lists
    from the one-block sort's second round."""
    import numpy as np

    from cupymoe.forward_plan import build_forward_plan
    from cupymoe.plan import Path

    outs = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("CUPYMOE_GATE_UP_AHEAD", mode)
        cfg, hw, layer = _case(name, np.random.default_rng(11), max_tokens=300)
        for path, tokens in (("decode", (9, 17, 64, 300)), ("atomic", (9, 17))):
            for n in tokens:
                plan = build_forward_plan(layer.plan, layer.device, n, Path(path)).at(n)
                gate_up = next(s for s in plan.launches if s.kernel.startswith("decode_swapab_gate_up<"))
                assert (gate_up.arg("slot_active") != 0) == (mode == "on"), (name, mode, path, n)
                x = well_separated_input(cfg, hw, np.random.default_rng(n), n)
                outs[mode, path, n] = run_layer(layer, x, path)
                c = check(outs[mode, path, n], cfg, hw, x, path, layer=layer)
                assert c.ok, f"{name} N={n} {path} CUPYMOE_GATE_UP_AHEAD={mode}: {c}"
        check_skewed_routing(layer, cfg, hw, np.random.default_rng(5), (9, 17), "decode", f"{name} {mode}")
        layer.check_errors()
    for (mode, path, n), out in outs.items():
        if mode == "on" and path == "decode":  # the atomic path's float atomics may sum in any order
            assert np.array_equal(out, outs["off", path, n]), f"{name} N={n}: by slot, bits differ"


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_swapab_past_256_rows(name, rng):
    """The rows the tune sweep offers the swap-AB decode at (tune.SWAPAB_CAP): every expert's run and
    the shared expert's N rows in many passes, the lists by the one-block sort's three rounds (513
    rows) and by the three-pass sort (2047: past DECODE_SORT_PAIRS pairs)."""
    from cupymoe import MoeLayer

    family, overrides = CASES[name]
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    layer = MoeLayer(cfg, hw, max_tokens=2048, decode_max_tokens=2048)
    for n in (513, 2047):
        kernels = testing.expert_kernels(layer, n, "decode")
        assert all(k.startswith("decode_swapab_") for k in kernels), (n, kernels)
        x = well_separated_input(cfg, hw, rng, n)
        c = check(run_layer(layer, x, "decode"), cfg, hw, x, "decode", layer=layer)
        assert c.ok, f"{name} N={n} ({kernels[0]}): {c}"
    layer.check_errors()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_captured_graph_replays_the_eager_forward(name, rng):
    cfg, hw, layer = _case(name, rng)
    check_replay_matches_eager(layer, cfg, hw, rng, (2, 17, 255), "decode", name)
