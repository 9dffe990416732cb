"""CPU tests of MoeLayer's path rules that need no device: which paths a one-row forward may
take (warmup runs each of them once). The layer is built without __init__ (no GPU here), with
only the attributes select_path reads."""

from __future__ import annotations

import pytest

from cupymoe.layer import MoeLayer, PathUnavailableError


def _layer(**attrs) -> MoeLayer:
    layer = object.__new__(MoeLayer)
    defaults = dict(default_path="auto", row_invariant=False, decode_max_tokens=8, atomic_max_tokens=8, cfg=None)
    for name, value in {**defaults, **attrs}.items():
        setattr(layer, name, value)
    return layer


def test_warmup_takes_every_path_the_layer_serves():
    """warmup() once forced "decode" on row-invariant layers, which select_path refuses, so it
    raised on every such layer; and "atomic" at atomic_max_tokens 0. It never ran prefill."""
    assert _layer()._warmup_paths() == ["decode", "atomic", "prefill"]
    assert _layer(row_invariant=True)._warmup_paths() == ["prefill"]
    assert _layer(atomic_max_tokens=0)._warmup_paths() == ["decode", "prefill"]
    with pytest.raises(PathUnavailableError, match="row_invariant=True"):
        _layer(row_invariant=True).select_path(1, "decode")


def test_fp4_down_blocks_take_two_tiles_where_a_wave_of_them_is_expected(monkeypatch):
    """decode_wgmma_down_fp4's tiles a block (layer._fp4_down_tiles): two on qwen3-30b-a3b's
    shape (I = 768: three ring stages) from the rows whose expected experts give 8 two-tile
    blocks each to a wave of 3 blocks on 132 SMs (N = 8: 51.6 experts, 413 blocks), one below
    (N = 4: 29.1, 233) and on deepseek-v3's (I = 2048: eight stages); CUPYMOE_FP4_DOWN_TILES
    forces a count where it divides H / 128."""
    from types import SimpleNamespace

    from cupymoe import bench, kernels

    monkeypatch.delenv("CUPYMOE_FP4_DOWN_TILES", raising=False)

    def tiles(preset, n, n_local=None):  # a layer built now: it reads the knob as MoeLayer.__init__ does
        cfg = bench.preset_config(preset)
        layer = _layer(cfg=cfg, weights=SimpleNamespace(n_local=n_local or cfg.num_experts), _sm_count=132,
                       _fp4_down_tiles_forced=kernels.fp4_down_tiles())
        return layer._fp4_down_tiles(n)

    assert [tiles("qwen3-30b-a3b", n) for n in (1, 4, 8, 16, 64)] == [1, 1, 2, 2, 2]
    assert [tiles("deepseek-v3", n) for n in (1, 8, 64)] == [1, 1, 1]
    assert tiles("qwen3-30b-a3b", 8, n_local=64) == 1  # half the experts on this rank: 206 blocks
    monkeypatch.setenv("CUPYMOE_FP4_DOWN_TILES", "4")
    assert tiles("qwen3-30b-a3b", 1) == 4 and tiles("deepseek-v3", 64) == 4  # 16 and 56 tiles of H
    monkeypatch.setenv("CUPYMOE_FP4_DOWN_TILES", "3")
    assert tiles("qwen3-30b-a3b", 64) == 1  # 3 does not divide 16
    monkeypatch.setenv("CUPYMOE_FP4_DOWN_TILES", "0")
    with pytest.raises(ValueError, match="CUPYMOE_FP4_DOWN_TILES='0'"):
        tiles("qwen3-30b-a3b", 64)


def test_w8a8_decode_takes_wgmma_from_the_measured_waves():
    """layer._w8a8_decode_kernel in "auto": decode_wgmma_a8.cu's kernels where the gate/up grid
    holds WGMMA_DECODE_MIN_WAVES waves of two blocks an SM (132 SMs), decode_mma.cu's below.
    deepseek-v3 at N = 2 (16 experts x 32 blocks = 512, 1.94 waves) measured 3.5 % faster on
    wgmma (NOTES.md v43), qwen3-30b-a3b at N = 4 (32 x 12 = 384, 1.45 waves) 8 % slower."""
    from types import SimpleNamespace

    from cupymoe import bench

    def kernel(preset, n):
        cfg = bench.preset_config(preset)
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        layer = _layer(cfg=cfg, weights=SimpleNamespace(n_local=E, i_max=cfg.moe_intermediate_size), _sm_count=132,
                       fp8_compute="w8a8", _w8a8_decode_mode="auto")
        found = layer._w8a8_decode_kernel("gate_up", max(1.0, 2.0 * n * k / E), min(E, n * k))
        return found[0].split("<")[0] if found else "mma"

    assert [kernel("deepseek-v3", n) for n in (1, 2, 4)] == ["mma", "decode_wgmma_gate_up_a8", "decode_wgmma_gate_up_a8"]
    assert [kernel("qwen3-30b-a3b", n) for n in (1, 4, 8)] == ["mma", "mma", "decode_wgmma_gate_up_a8"]
