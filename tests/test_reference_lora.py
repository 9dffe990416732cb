"""CPU tests of cupymoe.reference's LoRA: moe_forward(..., lora=, lora_ids=) in float64.

Evidence, independent of how the reference folds the deltas in:
1. No adapter rows (ids None, all -1) and a zero-B adapter give the base layer bit for bit.
2. A rank-r adapter equals the base reference run on merged weights W + s B A (router,
   routed experts, shared expert): that is what a LoRA delta is, computed through the base
   code path. Rows of a mixed batch (-1, slot 0, slot 1) each equal their own merged layer.
   Tolerance rtol 1e-10 plus atol 1e-12 * max|expected| (tests/test_reference.py's): the two
   sides sum the same float64 products in different orders (W x + s B (A x) against
   (W + s B A) x), a few ulps apart; a missing, doubled or misplaced delta is ~1e-1.
"""

from __future__ import annotations


import numpy as np
import pytest

from _lora import merged, random_lora
from cupymoe import reference, testing
from cupymoe.errors import LoraError
from cupymoe.lora import LoraTarget

FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")
N = 11


def _close(got, want):
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * scale)


def _setup(family, fmt="bf16", seed=0, **kw):
    cfg = testing.tiny_config(family, **kw)
    rng = np.random.default_rng(seed)
    hw = testing.random_host_weights(cfg, rng, fmt)
    x = testing.random_input(rng, N, cfg.hidden_size)
    tids = testing.random_token_ids(rng, N, cfg.hash_vocab_size) if cfg.hash_routing else None
    return cfg, hw, x, tids, rng


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_no_adapter_rows_is_base_bitwise(family):
    cfg, hw, x, tids, rng = _setup(family)
    base = reference.moe_forward(cfg, hw, x, tids)
    lw = random_lora(cfg, rng, rank=3)
    for lora, ids in (({0: lw}, None), ({0: lw}, np.full(N, -1, np.int32)), (None, np.full(N, -1))):
        np.testing.assert_array_equal(reference.moe_forward(cfg, hw, x, tids, lora=lora, lora_ids=ids), base)
    zero = random_lora(cfg, rng, rank=3, zero_b=True)
    np.testing.assert_array_equal(reference.moe_forward(cfg, hw, x, tids, lora={0: zero}, lora_ids=np.zeros(N, int)),
                                  base)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_adapter_equals_merged_weights(family, fmt):
    if fmt == "mxfp4" and family != "gpt_oss" or fmt != "bf16" and family == "gpt_oss" and fmt != "mxfp4":
        pytest.skip("formats as they exist in the wild (test_reference's grid)")
    cfg, hw, x, tids, rng = _setup(family, fmt)
    lw = random_lora(cfg, rng, rank=4, size=0.3)
    got = reference.moe_forward(cfg, hw, x, tids, lora={5: lw}, lora_ids=np.full(N, 5))
    _close(got, reference.moe_forward(cfg, merged(cfg, hw, lw), x, tids))


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_mixed_batch_rows_each_their_own(family):
    cfg, hw, x, tids, rng = _setup(family, seed=1)
    adapters = {0: random_lora(cfg, rng, rank=2, size=0.5), 1: random_lora(cfg, rng, rank=5, size=0.5)}
    ids = np.array([-1, 0, 1, 1, -1, 0, 0, 1, -1, 1, 0], np.int32)
    got = reference.moe_forward(cfg, hw, x, tids, lora=adapters, lora_ids=ids)
    for slot in (-1, 0, 1):
        rows = ids == slot
        w = hw if slot < 0 else merged(cfg, hw, adapters[slot])
        _close(got[rows], reference.moe_forward(cfg, w, x, tids)[rows])


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_experts_alone_with_a_whole_layer_adapter(family):
    """The experts-only entry without the shared expert takes the adapter the whole layer was tuned with
    (shared-expert modules included, checked against the layer) and leaves the shared deltas out with the
    shared expert: the merged layer's routed experts alone."""
    cfg, hw, x, tids, rng = _setup(family, seed=5)
    lw = random_lora(cfg, rng, rank=3, size=0.5)
    assert any(k.target.value.startswith("shared") for k in lw.modules)
    ids, w = reference.route(cfg, hw, x).ids, reference.route(cfg, hw, x).weights
    got = reference.experts_forward(cfg, hw, x, ids, w, lora={0: lw}, lora_ids=np.zeros(N, int), shared_expert=False)
    _close(got, reference.experts_forward(cfg, merged(cfg, hw, lw), x, ids, w, shared_expert=False))


def test_router_adapter_changes_routing_and_routes_like_merged():
    cfg, hw, x, tids, rng = _setup("deepseek_v3", seed=2)
    lw = random_lora(cfg, rng, rank=4, targets=[LoraTarget.ROUTER], size=3.0)
    ids = np.zeros(N, np.int32)
    got = reference.route(cfg, hw, x, lora={0: lw}, lora_ids=ids)
    want = reference.route(cfg, merged(cfg, hw, lw), x)
    np.testing.assert_array_equal(got.ids, want.ids)
    assert (got.ids != reference.route(cfg, hw, x).ids).any()  # the delta is large enough to re-route


@pytest.mark.parametrize("variant", [dict(pre_expert_norm=True), dict(ep_world_size=2, ep_rank=1),
                                     dict(ep_world_size=2, ep_rank=0)])
def test_norm_and_expert_parallel(variant):
    cfg, hw, x, tids, rng = _setup("qwen2_moe", seed=3, **variant)
    if cfg.pre_expert_norm:
        hw.norm_weight = (1 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)
    lw = random_lora(cfg, rng, rank=3, size=0.5)
    got = reference.moe_forward(cfg, hw, x, lora={2: lw}, lora_ids=np.full(N, 2))
    _close(got, reference.moe_forward(cfg, merged(cfg, hw, lw), x))


def test_float32_rounding_and_w8a8_modes_run():
    cfg, hw, x, tids, rng = _setup("deepseek_v3", "fp8_block", seed=4)
    lw = random_lora(cfg, rng, rank=2, size=0.3)
    ids = np.arange(N) % 2 - 1
    exact = reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=ids)
    for kw in (dict(dtype=np.float32), dict(rounding="grouped"), dict(rounding="decode", activations="fp8_block")):
        got = reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=ids, **kw)
        assert np.linalg.norm(got - exact) <= 0.05 * np.linalg.norm(exact), kw


def test_refusals():
    cfg, hw, x, tids, rng = _setup("qwen3_moe")
    lw = random_lora(cfg, rng, rank=2)
    with pytest.raises(LoraError, match=r"lora_ids holds \[3\]: neither -1"):
        reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=np.full(N, 3))
    with pytest.raises(LoraError, match=r"expected \[11\] integers"):
        reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=np.zeros(N, np.float32))
    with pytest.raises(LoraError, match="absolute=True"):
        reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=np.zeros(N, int), absolute=True)
    other = random_lora(testing.tiny_config("qwen3_moe", hidden_size=32), rng, rank=2, targets=["router"])
    with pytest.raises(LoraError, match=rf"lora_A.weight: expected shape \[r, {cfg.hidden_size}\]"):
        reference.moe_forward(cfg, hw, x, lora={0: other}, lora_ids=np.zeros(N, int))


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "longcat_flash"])
def test_lora_plan_rounding(family):
    """lora_plan models the GPU LoRA plans' extra stores (bf16 g, u; the grouped term re-rounded
    after down's delta): nothing without `rounding`, within the exact check's budget with it."""
    cfg, hw, x, tids, rng = _setup(family, seed=3)
    adapters = {0: random_lora(cfg, rng, rank=2, size=0.5), 1: random_lora(cfg, rng, rank=5, size=0.5)}
    ids = np.array([-1, 0, 1, 1, -1, 0, 0, 1, -1, 1, 0], np.int32)
    exact = reference.moe_forward(cfg, hw, x, tids, lora=adapters, lora_ids=ids)
    np.testing.assert_array_equal(reference.moe_forward(cfg, hw, x, tids, lora=adapters, lora_ids=ids,
                                                        lora_plan=True), exact)
    for rounding in ("decode", "grouped"):
        plain = reference.moe_forward(cfg, hw, x, tids, lora=adapters, lora_ids=ids, rounding=rounding)
        plan = reference.moe_forward(cfg, hw, x, tids, lora=adapters, lora_ids=ids, rounding=rounding,
                                     lora_plan=True)
        assert (plan != plain).any()  # two roundings more: ~2e-3 rms more off the exact layer, inside 2^-7
        assert np.linalg.norm(plan - exact) <= 2.0 ** -7 * np.linalg.norm(exact)
