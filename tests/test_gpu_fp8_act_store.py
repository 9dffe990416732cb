"""GPU: the w8a8 grouped gate/up without its bf16 activation store (the production kernels,
grouped_gemm_sm90_fp8<0> / _tma<0>) against the one that keeps it for inspection
(MoeLayer(keep_w8a8_activation=True): <0, true>, what verify reads), on both w8a8 grouped GEMMs
(cp.async and TMA), each activation's epilogue (silu, gelu_tanh, swiglu_oai with biases), a
shared fp8 expert of another I, a bf16 shared expert beside fp8 routed ones, H under one 128-code
step and the 4-stage ring wrapping, at N = 1, 67, 300, 1100: the outputs are equal bit for bit
and so are the activation's e4m3 codes and scales (the activation is rounded to bf16 before its
amax either way). verify refuses by name to read the activation a production forward did not
store; the decode path, whose kernels store it either way, is checked on that layer as before.
sm_90a only."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import formats, testing
from cupymoe.errors import ActivationNotKeptError
from cupymoe.verify import _read_scratch, _stored_rows, bf16_bits, check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

# name -> (family, shared expert's format or None = the routed experts', MoeConfig overrides)
CASES = {
    "qwen3_moe": ("qwen3_moe", None, {}),  # silu, H = 96: one partial K step
    "qwen3_moe-H528-I656": ("qwen3_moe", None, {"hidden_size": 528, "moe_intermediate_size": 656}),  # the ring wraps
    "qwen2_moe": ("qwen2_moe", None, {}),  # a gated fp8 shared expert of I = 96 (I_max 96, I 64)
    "deepseek_v3-bf16shared": ("deepseek_v3", "bf16", {}),  # fp8 routed, bf16 shared: two kernels
    "mixtral-gelu_tanh": ("mixtral", None, {"hidden_act": "gelu_tanh"}),
    "gpt_oss": ("gpt_oss", None, {}),  # expert biases, swiglu_oai
}
TOKENS = (1, 67, 300, 1100)
MAX_TOKENS = 1100


@pytest.fixture(autouse=True)
def _hopper():
    if not testing.on_sm90a():
        pytest.skip("w8a8 needs sm_90a")


def _pair(name, rng, variant, monkeypatch):
    """(cfg, hw, production layer, layer keeping the activation): the same weights, one GEMM variant."""
    from cupymoe import MoeLayer

    monkeypatch.setenv("CUPYMOE_SM90_FP8_VARIANT", variant)
    family, shared_fmt, overrides = CASES[name]
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng, "fp8_block", shared_fmt=shared_fmt)
    off, on = (MoeLayer(cfg, hw, max_tokens=MAX_TOKENS, fp8_compute="w8a8", keep_w8a8_activation=keep)
               for keep in (False, True))
    assert (off.keep_w8a8_activation, on.keep_w8a8_activation) == (False, True)
    return cfg, hw, off, on


def _act_codes(layer, cfg, hw, n) -> dict:
    """(expert or "shared", token) -> the bytes of its activation's e4m3 codes and scales, for the
    fp8 experts of the layer's last forward of n rows (what down reads; verify.W8a8Stages' rows)."""
    P = n * cfg.num_experts_per_tok + (n if cfg.has_shared_expert else 0)
    i_max = layer.weights.i_max
    kb = -(-i_max // formats.FP8_BLOCK)
    q = _read_scratch(layer, "qact", np.uint8, (P, i_max))
    s = _read_scratch(layer, "sact", np.float32, (P, kb)).view(np.uint32)
    fp8 = {"routed": formats.weight_format(hw.down) == "fp8_block",
           "shared": formats.weight_format(hw.shared_down) == "fp8_block"}
    out = {}
    for key, token, pos, width in _stored_rows(layer, cfg, n):
        if fp8["shared" if key == "shared" else "routed"]:
            out[key, token] = (q[pos, :width].tobytes(), s[pos, :-(-width // formats.FP8_BLOCK)].tobytes())
    return out


@pytest.mark.parametrize("variant", ["cp_async", "tma", "tma64"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_store_changes_no_output_bit_and_no_code(name, variant, rng, monkeypatch):
    cfg, hw, off, on = _pair(name, rng, variant, monkeypatch)
    tma = "_tma" if variant != "cp_async" and off.plan.fp8_tma_ok else ""
    form = ", 1" if tma and variant == "tma64" else ""
    for n in TOKENS:
        gate_up = [[k for k in testing.expert_kernels(layer, n, "prefill") if k.startswith("grouped_gemm_sm90_fp8")][0]
                   for layer in (off, on)]
        names = ([f"grouped_gemm_sm90_fp8_tma<0, false{form}>", f"grouped_gemm_sm90_fp8_tma<0, true{form}>"] if form
                 else [f"grouped_gemm_sm90_fp8{tma}<0>", f"grouped_gemm_sm90_fp8{tma}<0, true>"])
        assert gate_up == names, (n, gate_up)
        x = well_separated_input(cfg, hw, rng, n)
        a = run_layer(off, x, "prefill")
        codes_off = _act_codes(off, cfg, hw, n)
        b = run_layer(on, x, "prefill")
        codes_on = _act_codes(on, cfg, hw, n)
        assert not np.isnan(a).any(), f"{name} {variant} N={n}: unwritten outputs"
        assert np.array_equal(bf16_bits(a), bf16_bits(b)), f"{name} {variant} N={n}: the outputs' bits differ"
        assert codes_off and codes_off.keys() == codes_on.keys(), f"{name} {variant} N={n}: other rows"
        differ = [k for k in codes_off if codes_off[k] != codes_on[k]]
        assert not differ, f"{name} {variant} N={n}: the activation's codes or scales differ at {differ[:4]}"
    c = check(b, cfg, hw, x, "prefill", layer=on)  # the kept activation is what verify judges
    assert c.ok, f"{name} {variant} N={n} kept: {c}"
    off.check_errors()
    on.check_errors()


def test_verify_refuses_the_activation_a_production_forward_did_not_store(rng, monkeypatch):
    cfg, hw, off, _ = _pair("qwen2_moe", rng, "cp_async", monkeypatch)
    x = well_separated_input(cfg, hw, rng, 300)
    out = run_layer(off, x, "prefill")
    with pytest.raises(ActivationNotKeptError, match="keep_w8a8_activation=True"):
        check(out, cfg, hw, x, "prefill", layer=off)
    for path, n in (("decode", 17), ("atomic", 5)):  # their kernels store the activation (their quantizer reads it)
        x = well_separated_input(cfg, hw, rng, n)
        c = check(run_layer(off, x, path), cfg, hw, x, path, layer=off)
        assert c.ok, f"N={n} {path} on the production layer: {c}"
