"""GPU: an eager forward launched as one captured graph computes the bits of the step-by-step
launches, with its pointers and row counts patched between calls, and a caller's capture
still takes the launches themselves."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import testing
from cupymoe.verify import bf16_bits, bits_to_f32, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

FAMILIES = (("qwen3_moe", "bf16"), ("deepseek_v3", "fp8_block"), ("gpt_oss", "mxfp4"), ("qwen2_moe", "nvfp4"))
# bit-reproducible paths; 257 and 300 share a prefill bucket (its row count patched in place)
TOKENS = (("decode", (1, 5, 17, 5)), ("prefill", (64, 300, 257, 1, 300)))


def _pair(monkeypatch, fam, fmt, rng):
    from cupymoe import MoeLayer

    cfg = testing.tiny_config(fam)
    hw = testing.random_host_weights(cfg, rng, fmt)
    layers = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("CUPYMOE_GRAPH_LAUNCH", mode)
        layers[mode] = MoeLayer(cfg, hw, max_tokens=300, decode_max_tokens=64, atomic_max_tokens=64)
    return cfg, hw, layers["0"], layers["1"]


@pytest.mark.parametrize("fam, fmt", FAMILIES)
def test_graph_launched_forwards_equal_the_step_by_step_launches_bit_for_bit(monkeypatch, rng, fam, fmt):
    cfg, hw, direct, graphed = _pair(monkeypatch, fam, fmt, rng)
    for path, ns in TOKENS:
        for n in ns:  # each run_layer call uses new buffers and a new stream: every pointer patched
            x = well_separated_input(cfg, hw, rng, n)
            np.testing.assert_array_equal(run_layer(graphed, x, path), run_layer(direct, x, path),
                                          err_msg=f"{fam} {fmt} {path} N={n}")
    assert graphed._graphs and all(g is not None for g in graphed._graphs.values())
    assert not direct._graphs


def test_the_same_buffers_again_launch_the_graph_unpatched_and_a_capture_takes_the_launches(monkeypatch, rng):
    import cupy

    cfg, hw, direct, graphed = _pair(monkeypatch, "qwen3_moe", "bf16", rng)
    x = well_separated_input(cfg, hw, rng, 5)
    want = run_layer(direct, x, "decode")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd = cupy.asarray(bf16_bits(x))
        out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)
    for _ in range(3):
        graphed.forward(int(xd.data.ptr), 5, int(out.data.ptr), s.ptr, path="decode")
    s.synchronize()
    np.testing.assert_array_equal(bits_to_f32(out.get()), want)
    out.fill(0x7FC0)
    s.synchronize()
    s.begin_capture()
    graphed.forward(int(xd.data.ptr), 5, int(out.data.ptr), s.ptr, path="decode")
    g = s.end_capture()
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(bits_to_f32(out.get()), want)


def test_warmup_captures_every_plan(monkeypatch, rng):
    _, _, _, graphed = _pair(monkeypatch, "deepseek_v3", "fp8_block", rng)
    report = graphed.warmup()
    assert report.graphs == report.plans > 0
