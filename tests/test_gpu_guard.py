"""GPU: guard mode (CUPYMOE_GUARD=1). Red zones between the workspace's buffers are filled before
each forward; a clean forward on every path, format and Hopper GEMM variant leaves them intact,
and a write past a buffer is caught by check_guard, naming the buffer."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import testing
from cupymoe.errors import GuardError, OptionError
from cupymoe.verify import bf16_bits, check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

RUNS = ((1, "decode"), (5, "decode"), (5, "atomic"), (17, "decode"), (64, "atomic"), (64, "prefill"),
        (1000, "prefill"))
CASES = {  # every format, a shared expert, a pre-expert norm (xe), zero experts, w8a8 (qx, qact)
    "qwen2_moe-bf16": ("qwen2_moe", "bf16", {}),
    "qwen2_moe-prenorm": ("qwen2_moe", "bf16", dict(pre_expert_norm=True)),
    "deepseek_v3-fp8_block": ("deepseek_v3", "fp8_block", {}),
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", {}),
    "qwen3_moe-nvfp4": ("qwen3_moe", "nvfp4", {}),
    "longcat_flash-bf16": ("longcat_flash", "bf16", dict(pre_expert_norm=True)),
}


def _guarded(monkeypatch, rng, family="qwen2_moe", fmt="bf16", **overrides):
    from cupymoe import MoeLayer

    monkeypatch.setenv("CUPYMOE_GUARD", "1")  # read when the layer is built
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng, fmt)
    # the w8a8 check reads the stored activation (its store a superset of the production kernel's writes)
    layer = MoeLayer(cfg, hw, max_tokens=1000, decode_max_tokens=64, atomic_max_tokens=64, keep_w8a8_activation=True)
    assert len(layer.scratch.zones) == len(layer.scratch.plan.zones) > 10
    return cfg, hw, layer


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_clean_forward_leaves_every_red_zone_intact(case, rng, monkeypatch):
    family, fmt, overrides = CASES[case]
    cfg, hw, layer = _guarded(monkeypatch, rng, family, fmt, **overrides)
    for n, path in RUNS:
        x = well_separated_input(cfg, hw, rng, n)
        out = run_layer(layer, x, path)
        layer.check_guard()
        c = check(out, cfg, hw, x, path, layer=layer)
        assert c.ok, f"{case} N={n} {path}: {c}"


@pytest.mark.parametrize("sm90", ["twin", "tma", "gather_wide", "tma_192"])
def test_hopper_gemm_variants_stay_inside_their_buffers(sm90, rng, monkeypatch):
    """The TMA GEMMs' boxes (loads of xg / act, stores of yw) clip at their tensor maps' rows."""
    monkeypatch.setenv("CUPYMOE_SM90_VARIANT", sm90)
    cfg, hw, layer = _guarded(monkeypatch, rng)
    for n in (64, 333, 1000):
        x = well_separated_input(cfg, hw, rng, n)
        out = run_layer(layer, x, "prefill")
        layer.check_guard()
        assert check(out, cfg, hw, x, "prefill", layer=layer).ok, (sm90, n)


def test_a_write_past_a_buffer_is_caught_naming_it(rng, monkeypatch):
    import cupy

    cfg, hw, layer = _guarded(monkeypatch, rng, "deepseek_v3")
    x = well_separated_input(cfg, hw, rng, 17)
    run_layer(layer, x, "decode")
    layer.check_guard()
    end = layer.scratch.ptr("topk_w") + layer.scratch.nbytes("topk_w")  # one byte past its end
    cupy.cuda.runtime.memset(end, 0, 1)
    with pytest.raises(GuardError, match=r"red zone after scratch buffer 'topk_w' \(before 'xe'\) changed: 1 of"):
        layer.check_guard()
    run_layer(layer, x, "prefill")  # the next forward fills the zones again
    layer.check_guard()
    cupy.cuda.runtime.memset(layer.scratch.ptr("sorted_row") - 1, 0x11, 1)  # one byte before a buffer
    with pytest.raises(GuardError, match=r"before 'sorted_row'\).*= 0x11"):
        layer.check_guard()


def test_guard_mode_off_costs_nothing(rng, monkeypatch):
    """Without the knob: no zones, no fill (the plain forward path), a smaller workspace."""
    from cupymoe import MoeLayer

    monkeypatch.delenv("CUPYMOE_GUARD", raising=False)
    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    plain = MoeLayer(cfg, hw, max_tokens=1000)
    assert plain.scratch.zones == () and not plain._watched
    with pytest.raises(OptionError, match="CUPYMOE_GUARD=1"):
        plain.check_guard()
    _, _, guarded = _guarded(monkeypatch, rng)
    assert guarded.workspace.nbytes > plain.workspace.nbytes


@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
def test_the_experts_only_entry_arms_and_keeps_the_red_zones(path, rng, monkeypatch):
    import cupy

    cfg, hw, layer = _guarded(monkeypatch, rng)
    n, k = 37, cfg.num_experts_per_tok
    x = cupy.asarray(bf16_bits(testing.random_input(rng, n, cfg.hidden_size)))
    ids = cupy.asarray(rng.integers(0, cfg.router_width, size=(n, k)).astype(np.int32))
    w = cupy.asarray(rng.uniform(0.05, 1.0, size=(n, k)).astype(np.float32))
    layer.run_experts(x, ids, w, path=path)
    layer.check_guard()
