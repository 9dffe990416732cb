"""GPU: the w8a8 TMA grouped GEMM (cuda/grouped_sm90_fp8_tma.cu, CUPYMOE_SM90_FP8_VARIANT=tma and
its 64-row form tma64) on the prefill path: checked stage by stage against cupymoe.reference (verify.check_w8a8) at
awkward N (1, 67, 300, 1100) and K (H = 96, 160 and 528: under one 128-code step, a step and a
quarter, five steps wrapping the 4-stage ring with a 16-code tail; I = 64, 80 and 656, down's six
steps wrapping it too), gate/up
tiles whose second half lies past I, a shared fp8 expert of another I, one expert holding most
rows, experts nobody chose, outputs poisoned with NaN first; the same bits as the cp.async
kernel (grouped_sm90_fp8.cu: both run fp8_gemm.cuh's instructions per element); a captured
graph's replay equals the eager forward bit for bit. sm_90a only."""

from __future__ import annotations

import numpy as np
import pytest

from _gpu_checks import check_replay_matches_eager, check_skewed_routing
from cupymoe import testing
from cupymoe.verify import bf16_bits, check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

# name -> (family, shared expert's format or None = the routed experts', MoeConfig overrides)
CASES = {
    "qwen3_moe": ("qwen3_moe", None, {}),  # H = 96: one partial K step
    "qwen3_moe-H528-I656": ("qwen3_moe", None, {"hidden_size": 528, "moe_intermediate_size": 656}),  # the ring wraps
    "qwen3_moe-I80": ("qwen3_moe", None, {"moe_intermediate_size": 80}),  # half a gate/up tile past I
    "qwen2_moe": ("qwen2_moe", None, {}),  # a gated fp8 shared expert of I = 96 (I_max 96, I 64)
    "deepseek_v3-bf16shared": ("deepseek_v3", "bf16", {}),  # fp8 routed, bf16 shared: two kernels, two tile heights
    "longcat_flash": ("longcat_flash", None, {}),  # zero experts
    "gpt_oss": ("gpt_oss", None, {}),  # expert biases, swiglu_oai
}
TOKENS = (1, 67, 300, 1100)
MAX_TOKENS = 1100


@pytest.fixture(autouse=True, params=["tma", "tma64"])
def form(request, monkeypatch):
    """Each test on both forms of the kernel: 128-row tiles (4 stages, one block an SM) and 64-row
    tiles (2 stages, two blocks an SM)."""
    if not testing.on_sm90a():
        pytest.skip("w8a8 needs sm_90a")
    monkeypatch.setenv("CUPYMOE_SM90_FP8_VARIANT", request.param)
    return request.param


def _case(name, rng, hw=None, keep=True):
    """`keep`: the gate/up also stores the bf16 activation, which verify.check reads (False: the
    production kernels, for the bitwise checks)."""
    from cupymoe import MoeLayer

    family, shared_fmt, overrides = CASES[name]
    cfg = testing.tiny_config(family, **overrides)
    if hw is None:
        hw = testing.random_host_weights(cfg, rng, "fp8_block", shared_fmt=shared_fmt)
    layer = MoeLayer(cfg, hw, max_tokens=MAX_TOKENS, fp8_compute="w8a8", keep_w8a8_activation=keep)
    assert layer.fp8_compute == "w8a8"
    return cfg, hw, layer


def _expert_kernels(layer, n):
    return [k for k in testing.expert_kernels(layer, n, "prefill") if k.startswith("grouped")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_tma_w8a8_matches_the_reference_stage_by_stage(name, rng, form):
    cfg, hw, layer = _case(name, rng)
    assert layer.plan.fp8_tma_chosen
    for n in TOKENS:
        kernels = _expert_kernels(layer, n)
        assert sum(k.startswith("grouped_gemm_sm90_fp8_tma<") for k in kernels) == 2, (n, kernels)
        assert all(k.endswith(", 1>") == (form == "tma64") for k in kernels if "_tma<" in k), kernels
        x = well_separated_input(cfg, hw, rng, n)
        c = check(run_layer(layer, x, "prefill"), cfg, hw, x, "prefill", layer=layer)
        assert c.ok, f"{name} N={n} prefill on the TMA w8a8 GEMM: {c}"
    layer.check_errors()


@pytest.mark.parametrize("name", ["qwen3_moe-H528-I656", "qwen2_moe", "deepseek_v3-bf16shared", "gpt_oss"])
def test_the_same_bits_as_the_cp_async_kernel(name, rng, monkeypatch):
    """Both kernels run the same products, promotions and epilogue per element: one layer each,
    the same weights and inputs, outputs equal bit for bit."""
    cfg, hw, tma_layer = _case(name, rng, keep=False)
    monkeypatch.setenv("CUPYMOE_SM90_FP8_VARIANT", "cp_async")
    _, _, ref_layer = _case(name, rng, hw, keep=False)
    assert not ref_layer.plan.fp8_tma_chosen
    for n in TOKENS:
        assert any(k.startswith("grouped_gemm_sm90_fp8<") for k in _expert_kernels(ref_layer, n))
        x = well_separated_input(cfg, hw, rng, n)
        a, b = run_layer(tma_layer, x, "prefill"), run_layer(ref_layer, x, "prefill")
        assert not np.isnan(a).any(), f"{name} N={n}: unwritten outputs"
        assert np.array_equal(bf16_bits(a), bf16_bits(b)), f"{name} N={n}: the TMA kernel's bits differ"


@pytest.mark.parametrize("name", ["qwen3_moe-H528-I656", "qwen2_moe", "gpt_oss"])
def test_one_expert_holding_most_rows_and_experts_nobody_chose(name, rng):
    """A given routing: every row's first pick expert 0 (a run of N rows: many 128-row tiles,
    the last one short), the rest over every expert but 1."""
    cfg, hw, layer = _case(name, rng)
    check_skewed_routing(layer, cfg, hw, rng, (67, 1100), "prefill", name, assert_written=True)


@pytest.mark.parametrize("name", ["qwen3_moe-H528-I656", "qwen2_moe"])
def test_a_captured_graph_replays_the_eager_forward(name, rng):
    cfg, hw, layer = _case(name, rng, keep=False)
    check_replay_matches_eager(layer, cfg, hw, rng, (67, 1100), "prefill", name)


def test_a_plan_forced_after_construction_encodes_the_maps(rng, monkeypatch, form):
    """python -m cupymoe tune forces a built layer's plan onto the TMA kernel: the maps are
    encoded on first use."""
    from cupymoe import tune
    from cupymoe.tuning import Choice

    monkeypatch.setenv("CUPYMOE_SM90_FP8_VARIANT", "auto")
    cfg, hw, layer = _case("qwen3_moe-H528-I656", rng)
    assert not layer.plan.fp8_tma_chosen and layer._maps.get("fp8_maps") is None
    n = 1100
    layer.plan = tune.forced(layer.plan, n, Choice("prefill", sm90_fp8=form))
    layer._packed.clear()
    layer._by_n.clear()
    assert all(k.startswith("grouped_gemm_sm90_fp8_tma<") and k.endswith(", 1>") == (form == "tma64")
               for k in _expert_kernels(layer, n))
    x = well_separated_input(cfg, hw, rng, n)
    c = check(run_layer(layer, x, "prefill"), cfg, hw, x, "prefill", layer=layer)
    assert c.ok and layer._maps.get("fp8_maps") is not None, f"N={n}: {c}"
