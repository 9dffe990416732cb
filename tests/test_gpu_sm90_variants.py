"""GPU: the bf16 TMA GEMM's variants a tuning-table bucket names for gate/up and down
(Choice.sm90_gate_up / sm90_down) against cupymoe.reference on the prefill path, outputs poisoned
first: a layer that keeps the gathered inputs (I = 1040: tma_192 gate/up reading xg) running a
gathering gate/up beside it, each down variant with 128- and 192-row tiles beside the gate/up's,
the one-block and the three-pass sort; and a layer without xg (I = 64) swapping its down. sm_90a only."""

from __future__ import annotations

import pytest

from cupymoe import testing
from cupymoe.verify import check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

PAIRS = [("gather_wide", "tma_192"), ("tma_wide", "tma_wide"), ("tma_192", "tma_wide"), ("gather_wide", "tma_wide")]


@pytest.fixture(autouse=True)
def _hopper():
    if not testing.on_sm90a():
        pytest.skip("the bf16 TMA GEMMs need sm_90a")


@pytest.mark.parametrize("intermediate", [1040, 64])
def test_tuned_variants_match_the_reference(intermediate, rng):
    from cupymoe import MoeLayer, tune
    from cupymoe.catalog import GemmMode
    from cupymoe.heuristics import gate_up_reads_xg, sm90_variant_fits
    from cupymoe.tuning import TUNING, Choice

    cfg = testing.tiny_config("qwen3_moe", moe_intermediate_size=intermediate)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    layer = MoeLayer(cfg, hw, max_tokens=1100)
    base = layer.plan
    assert base.gathers_rows == (intermediate >= 1024)
    for gate_up, down in PAIRS:
        if not (sm90_variant_fits(base, GemmMode.GATE_UP, gate_up) and sm90_variant_fits(base, GemmMode.DOWN, down)):
            continue
        for n in (200, 1100):  # 800 pairs: the one-block sort; 4400: three passes
            layer.plan = tune.forced(base, n, Choice("prefill", "math", sm90_gate_up=gate_up, sm90_down=down))
            layer._packed.clear()
            layer._by_n.clear()
            kernels = testing.expert_kernels(layer, n, "prefill")
            v = TUNING.sm90_variants
            assert v[gate_up].kernel(GemmMode.GATE_UP) in kernels and v[down].kernel(GemmMode.DOWN) in kernels, kernels
            assert ("gather_rows" in kernels) == gate_up_reads_xg(base, gate_up), kernels
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, "prefill"), cfg, hw, x, "prefill", layer=layer)
            assert c.ok, f"I={intermediate} N={n} gate/up {gate_up} down {down} ({kernels}): {c}"
    layer.check_errors()
