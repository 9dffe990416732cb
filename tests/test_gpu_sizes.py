"""GPU: the largest sizes a layer admits run right. The most rows a call (catalog.MAX_TOKENS) on
every path, and a router wider than the 48 KB of shared memory top-k gets without opting in
(R = 2048 experts: 4 warps x (2R + 64) floats = 132 KB), against cupymoe.reference."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import catalog as C
from cupymoe import testing
from cupymoe.errors import MoeCallError
from cupymoe.verify import check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu


def _layer(cfg, hw, max_tokens: int, **kw):
    from cupymoe import MoeLayer

    return MoeLayer(cfg, hw, max_tokens=max_tokens, decode_max_tokens=kw.pop("decode_max_tokens", max_tokens),
                    atomic_max_tokens=kw.pop("atomic_max_tokens", max_tokens), **kw)


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "bf16"), ("deepseek_v3", "bf16"), ("qwen3_moe", "fp8_block")])
def test_the_most_rows_a_call_on_every_path(family, fmt, rng):
    """N = MAX_TOKENS (65536) on the grouped path (every row checked), and on the decode and atomic
    paths forced to that many rows (a sample of 4096 rows checked); one row more is refused."""
    n = C.MAX_TOKENS
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    layer = _layer(cfg, hw, n, keep_w8a8_activation=True)  # the w8a8 check reads the bf16 activation
    x = well_separated_input(cfg, hw, rng, n)
    out = run_layer(layer, x, "prefill")
    c = check(out, cfg, hw, x, "prefill", layer=layer)
    assert c.ok, f"{family} {fmt} N={n} prefill: {c}"
    sample = np.sort(rng.choice(n, 4096, replace=False))
    for path in ("decode", "atomic"):
        out = run_layer(layer, x, path)
        assert np.isfinite(out).all(), f"{path}: unwritten rows"
        if layer.fp8_compute == "w8a8":  # its check reads the layer's intermediates of every row
            c = check(out, cfg, hw, x, path, layer=layer)
        else:
            c = check(out[sample], cfg, hw, x[sample], path)
        assert c.ok, f"{family} {fmt} N={n} {path}: {c}"
    with pytest.raises(MoeCallError, match=rf"num_tokens={n + 1}: must be in 1..max_tokens={n}"):
        layer.forward(1 << 20, n + 1, 2 << 20, 0)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_top_k_over_2048_experts_uses_its_opted_in_shared_memory(family, rng):
    """R = 2048 (past the 1504 experts whose top-k scratch fits 48 KB): topk_route asks for more
    than 48 KB and launches (the opt-in made at load); its routing and the output match the
    reference on the grouped and decode paths (deepseek: group-limited, 8 groups)."""
    overrides = dict(num_experts=2048, num_experts_per_tok=8)
    if family == "deepseek_v3":
        overrides.update(n_group=8, topk_group=4)
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw, 300, decode_max_tokens=64, atomic_max_tokens=8)
    for n, path in ((300, "prefill"), (64, "decode"), (17, "decode"), (5, "atomic")):
        topk = [launch for launch in layer.forward_plan(n, path).launches if launch.kernel.startswith("topk_route")]
        assert topk and topk[0].smem == C.topk_route_smem_bytes(2048) > C.STATIC_SMEM_LIMIT, (n, path)
        x = well_separated_input(cfg, hw, rng, n)
        c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
        assert c.ok, f"{family} R=2048 N={n} {path}: {c}"
