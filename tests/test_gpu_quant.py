"""GPU: quantized experts and routers (fp8_block, nvfp4, mxfp4) on every path.

Each case's layer is fed random weights quantized on the host (cupymoe.formats); the two
references get the very same quantized weights (dequantized exactly in float64; the
faithful one also rounds what the kernels round: reference.kernel_weights). Tolerances are
the bf16 ones; cupymoe/verify.py derives what each format adds (nothing, except fp8 experts
on the grouped path: three more bf16 roundings, which scale the envelope's rms term by
sqrt(7/4)). Outputs are poisoned with NaN first; inputs are fresh random draws.
"""

from __future__ import annotations


import numpy as np
import pytest

from cupymoe import reference, testing
from cupymoe.verify import (EXACT_NORMWISE, bf16_bits, bits_to_f32, check, compare, path_roundings, run_layer,
                            well_separated_input)

pytestmark = pytest.mark.gpu

# (family, routed experts' format, router format, shared expert format or None = same)
CASES = {
    "qwen3_moe-fp8": ("qwen3_moe", "fp8_block", "bf16", None),
    # fp8 router, fp8 routed experts, bf16 shared expert: DeepSeek-V3 as shipped
    "deepseek_v3-fp8-fp8router-bf16shared": ("deepseek_v3", "fp8_block", "fp8_block", "bf16"),
    "longcat_flash-fp8": ("longcat_flash", "fp8_block", "bf16", None),
    # nvfp4 router and experts, bf16 shared expert and its sigmoid gate
    "qwen2_moe-nvfp4-nvfp4router-bf16shared": ("qwen2_moe", "nvfp4", "nvfp4", "bf16"),
    "qwen3_next-nvfp4": ("qwen3_next", "nvfp4", "bf16", None),
    # two quantized formats in one layer: each kernel runs once per format
    "deepseek_v3-nvfp4-fp8shared": ("deepseek_v3", "nvfp4", "bf16", "fp8_block"),
    # gpt-oss as shipped: mxfp4 experts with biases and swiglu_oai, bf16 router with bias
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", "bf16", None),
    "mixtral-mxfp4": ("mixtral", "mxfp4", "bf16", None),
    # an fp8 router in front of bf16 experts
    "qwen3_moe-bf16-fp8router": ("qwen3_moe", "bf16", "fp8_block", None),
}
SMALL = (1, 3, 17, 64)
LARGE = (100, 1000)  # 1000: the "math" GEMM configuration (layer.MATH_ROWS_PER_EXPERT)


def _case(name, rng, **layer_kw):
    from cupymoe import MoeLayer

    family, fmt, router_fmt, shared_fmt = CASES[name]
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt, router_fmt=router_fmt, shared_fmt=shared_fmt)
    layer_kw.setdefault("max_tokens", max(LARGE))
    layer_kw.setdefault("decode_max_tokens", max(SMALL))
    layer_kw.setdefault("atomic_max_tokens", max(SMALL))
    layer_kw.setdefault("keep_w8a8_activation", True)  # the w8a8 prefill checks read the bf16 activation
    return cfg, hw, MoeLayer(cfg, hw, **layer_kw)


def _sized_case(name, H, I, Is, rng, **layer_kw):
    """CASES[name]'s family at hidden size H, expert width I and, where not None, shared expert width Is."""
    from cupymoe import MoeLayer

    family, fmt, router_fmt, shared_fmt = CASES[name]
    over = dict(hidden_size=H, moe_intermediate_size=I)
    if Is is not None:
        over["shared_expert_intermediate_size"] = Is
    cfg = testing.tiny_config(family, **over)
    hw = testing.random_host_weights(cfg, rng, fmt, router_fmt=router_fmt, shared_fmt=shared_fmt)
    return cfg, hw, MoeLayer(cfg, hw, **layer_kw)


def _check_decode_paths(layer, cfg, hw, rng, tokens, label: str) -> None:
    """The layer on the decode and atomic paths at each N of `tokens`, against the reference."""
    for path in ("decode", "atomic"):
        for n in tokens:
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
            assert c.ok, f"{label} N={n} {path}: {c}"


def _decode_grid(layer, cfg, n):
    """(max_active, rows a busy expert is expected to get, wgmma gate/up blocks) of the
    layer's decode launch at n rows, as forward_plan works them out."""
    from cupymoe.catalog import WGMMA_DECODE_GATE_UP_COLUMNS

    has_shared = 1 if cfg.has_shared_expert else 0
    max_active = max(1, min(layer.weights.n_local, n * cfg.num_experts_per_tok) + has_shared)
    rows = max(1.0, 2.0 * n * cfg.num_experts_per_tok / layer.weights.n_local)
    return max_active, rows, -(-layer.weights.i_max // WGMMA_DECODE_GATE_UP_COLUMNS) * max_active


def _on_sms(layer, sm_count: int):
    """The layer as if its GPU had `sm_count` SMs (its plans are built from the device facts)."""
    import dataclasses

    assert not layer._packed, "plans were built for the real GPU already"
    layer.device = dataclasses.replace(layer.device, sm_count=sm_count)
    return layer


_hopper = testing.on_sm90a


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_layers_against_reference_on_every_path(name, rng):
    cfg, hw, layer = _case(name, rng)
    for path, tokens in (("decode", SMALL), ("atomic", SMALL), ("prefill", SMALL + LARGE)):
        for n in tokens:
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
            assert c.ok, f"{name} N={n} {path} ({layer.fp8_compute}): {c}"


@pytest.mark.parametrize("fp8_compute", ["auto", "w8a16"])
@pytest.mark.parametrize("k_splits", [1, 2, 4, 8])
def test_tensor_core_decode_with_every_k_split(k_splits, fp8_compute, rng, monkeypatch):
    """decode_mma.cu's kernels with each K split (the layer picks the fewest that fill the
    GPU, so the tiny configs alone would only ever run 8) and both token passes (8 rows up
    to N = 3 here, 16 from N = 17): a bias-carrying gpt-oss mxfp4 layer, a layer whose
    shared expert is fp8 next to nvfp4 routed experts (two formats, one launch each), and
    fp8 experts (H = 96 and 160: k128 steps past K read zeros) with a bf16 shared expert.
    fp8 both as w8a8 ("auto" on sm_90a: with KS blocks writing each 128-column group of the
    activation, the last one quantizes it) and as w8a16. (w8a8 on decode_mma.cu at every N:
    where their grid fills two waves "auto" takes decode_wgmma_a8.cu's kernels, which
    test_w8a8_decode_kernels_by_knob covers.)"""
    from cupymoe import catalog, jit  # noqa: F401  (jit's module lists are made on import: every K split, before the patch)

    monkeypatch.setattr(catalog, "MMA_DECODE_K_SPLITS", (k_splits,))
    monkeypatch.setenv("CUPYMOE_W8A8_DECODE", "mma")
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", "mma")
    for name in ("gpt_oss-mxfp4", "deepseek_v3-nvfp4-fp8shared", "qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared"):
        cfg, hw, layer = _case(name, rng, fp8_compute=fp8_compute)
        _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} KS={k_splits} ({layer.fp8_compute})")


def test_tensor_core_decode_down_with_two_fragments_a_warp(rng, monkeypatch):
    """decode_mma_down<..., CF = 2> (each warp streams two 16-row fragments, 32 columns),
    which the layer takes only where half the blocks still fill every SM unsplit, so never
    on the tiny configs by itself: here the layer is told its GPU has one SM. Every format,
    both token passes, H = 96 and 160 (a fragment whose rows lie past H reads row H - 1
    again and stores nothing). CUPYMOE_MMA_DECODE_DOWN_PAIRS=0 keeps one fragment. (w8a8
    on decode_mma.cu at every N, as above.)"""
    monkeypatch.setenv("CUPYMOE_W8A8_DECODE", "mma")
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", "mma")
    for pairs, fp8_compute in (("1", "auto"), ("0", "auto"), ("1", "w8a16")):
        monkeypatch.setenv("CUPYMOE_MMA_DECODE_DOWN_PAIRS", pairs)
        for name in ("gpt_oss-mxfp4", "deepseek_v3-nvfp4-fp8shared", "qwen3_moe-fp8",
                     "deepseek_v3-fp8-fp8router-bf16shared"):
            from cupymoe.heuristics import register_decode_kernel

            cfg, hw, layer = _case(name, rng, fp8_compute=fp8_compute)
            _on_sms(layer, 1)  # one block fills this "GPU": down takes two fragments a warp
            fmt = layer.plan.formats[0]
            kernel, blocks = register_decode_kernel(layer.plan, layer.device, "down", fmt, 1.0, cfg.hidden_size, 1)
            assert kernel.endswith(", 2>") == (pairs == "1"), kernel
            assert blocks == -(-cfg.hidden_size // (32 * 8 if pairs == "1" else 16 * 8))
            _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} down pairs={pairs} ({layer.fp8_compute})")


def test_fp8_decode_on_cuda_cores_by_knob(rng, monkeypatch):
    """CUPYMOE_FP8_DECODE=cores sends w8a16 fp8 experts back to decode.cu's CUDA-core readers
    (the measurement baseline for the tensor-core ones), which match the reference too."""
    from cupymoe.catalog import WeightFormat

    fp8 = WeightFormat.FP8_BLOCK
    for mode in ("mma", "cores"):
        monkeypatch.setenv("CUPYMOE_FP8_DECODE", mode)
        cfg, hw, layer = _case("qwen3_moe-fp8", rng, fp8_compute="w8a16")
        assert (fp8 in layer.plan.mma_decode_formats) == (mode == "mma")
        _check_decode_paths(layer, cfg, hw, rng, (1, 17), mode)


def test_fp4_tensor_core_decode_takes_mxfp4_scales_in_its_range_only(rng):
    """The tensor-core decode scales fp4 weights by 2^-64 on the way (decode_mma.cu), which
    keeps mxfp4 weights exact for scale bytes 66 .. 192 (2^-61 .. 2^65). Weights at both ends
    of that range run there and match the reference; one scale byte past it sends the
    layer's mxfp4 weights to the CUDA-core readers, which match it too."""
    from cupymoe import MoeLayer
    from cupymoe.catalog import FP4_MMA_MXFP4_SCALE_BYTES, WeightFormat

    lo, hi = FP4_MMA_MXFP4_SCALE_BYTES
    mx = WeightFormat.MXFP4
    cfg = testing.tiny_config("gpt_oss")
    for edge, expect_mma in ((hi, True), (hi + 1, False)):
        hw = testing.random_host_weights(cfg, rng, "mxfp4")
        hw.gate.scales[...] = rng.integers(lo, lo + 8, hw.gate.scales.shape)  # tiny gate rows ...
        hw.down.scales[...] = rng.integers(edge - 8, edge + 1, hw.down.scales.shape)  # ... huge down rows
        layer = MoeLayer(cfg, hw, max_tokens=64, decode_max_tokens=64, atomic_max_tokens=64)
        assert (mx in layer.plan.mma_decode_formats) == expect_mma, (edge, layer.weights.mxfp4_scale_bytes)
        _check_decode_paths(layer, cfg, hw, rng, (1, 17), f"scale bytes up to {edge}")


def test_fp4_words_repacked_on_the_device_as_the_host_map_says(rng):
    """cuda/repack.cu (quant.cuh fp4_word_repack), which the layer runs over every fp4
    matrix it uploads, moves each 32-bit word's bits as formats.fp4_word_bit_map says (the
    map the CPU replay of the kernels' bit placement checks): random words, every nibble
    value in every position, an odd word count; the layer's own copies of an nvfp4 and an
    mxfp4 stack are the host codes repacked, and the caller's arrays are left as they were."""
    import cupy

    from cupymoe import MoeLayer, formats, jit, weights

    lib = jit.library(cupy.cuda.runtime.getDevice())
    assert lib["fp4_repack_words"] is not None
    host = rng.integers(0, 256, (1001, 4), dtype=np.uint8)
    host[:128] = (np.arange(16, dtype=np.uint8)[:, None, None] * 0x11).repeat(8, 1).reshape(128, 1)
    d = weights._repack_fp4(cupy.asarray(host))
    assert np.array_equal(cupy.asnumpy(d), formats.repack_fp4_words(host))
    assert np.array_equal(formats.unrepack_fp4_words(cupy.asnumpy(d)), host)
    for fmt, field in (("nvfp4", "packed"), ("mxfp4", "blocks")):
        cfg = testing.tiny_config("qwen3_moe")
        hw = testing.random_host_weights(cfg, rng, fmt)
        before = getattr(hw.gate, field).copy()
        layer = MoeLayer(cfg, hw, max_tokens=8)
        got = cupy.asnumpy(layer.weights.experts["gate"]).reshape(before.shape)
        assert np.array_equal(got, formats.repack_fp4_words(before.reshape(*before.shape[:-2], -1)).reshape(before.shape))
        assert np.array_equal(getattr(hw.gate, field), before)


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_fp4_prefill_takes_mxfp4_scale_bytes_on_both_sides_of_the_bit_placement(family, rng):
    """The grouped GEMM turns an mxfp4 chunk into bf16 by bit placement times 2^(e - 1) while
    that is a bf16 (scale byte e <= 128, quant.cuh FP4_PAIRS_MXFP4_MAX_SCALE_BYTE), else by
    fp4x8_to_bf16 (the codes' values, then the scale); both are exact. Even weight rows take
    bytes 121 .. 128, odd ones 129 .. 136, in every matrix, so each branch makes whole output
    columns; the prefill path matches the reference, and an nvfp4 layer (its weights times
    2^-64 into the tensor cores, the epilogue multiplying back) does too. (These scales spread
    the rows' outputs over ~2^15, where down's products can cancel: verify's envelope counts
    the activation's bf16 rounding there since module seed 1141835320 failed it with the
    faithful reference matched bit for bit.)"""
    from cupymoe import MoeLayer

    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, "mxfp4")
    for m in (hw.gate, hw.up, hw.down):
        m.scales[..., 0::2, :] = rng.integers(121, 129, m.scales[..., 0::2, :].shape)
        m.scales[..., 1::2, :] = rng.integers(129, 137, m.scales[..., 1::2, :].shape)
    assert hw.gate.scales.max() == 136 and (hw.gate.scales == 128).any()
    nv = testing.random_host_weights(cfg, rng, "nvfp4")
    for what, weights in (("mxfp4 bytes 121 .. 136", hw), ("nvfp4", nv)):
        layer = MoeLayer(cfg, weights, max_tokens=300)
        for n in (3, 64, 300):
            x = well_separated_input(cfg, weights, rng, n)
            c = check(run_layer(layer, x, "prefill"), cfg, weights, x, "prefill", layer=layer)
            assert c.ok, f"{family} {what} N={n} prefill: {c}"


def test_quantized_layers_decode_up_to_their_measured_crossover(rng):
    """Without decode_max_tokens, an fp4 layer takes the decode path up to 256 rows and an
    fp8 one up to 64 (their tensor-core decode beats the grouped GEMMs that far on the
    H200) and prefill above; bf16 keeps 8. The auto path is checked at a size only fp4
    decodes."""
    from cupymoe import MoeLayer
    from cupymoe.tuning import TUNING

    DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT = TUNING.decode_max_tokens
    DEFAULT_DECODE_MAX_TOKENS = TUNING.decode_max_tokens["bf16"]

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng, "nvfp4")
    layer = MoeLayer(cfg, hw, max_tokens=300)
    assert layer.decode_max_tokens == DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT["nvfp4"] == 256
    assert layer.select_path(256) == "decode" and layer.select_path(257) == "prefill"
    x = well_separated_input(cfg, hw, rng, 150)
    c = check(run_layer(layer, x), cfg, hw, x, "decode", layer=layer)
    assert c.ok, f"N=150 auto (decode): {c}"
    fp8 = MoeLayer(cfg, testing.random_host_weights(cfg, rng, "fp8_block"), max_tokens=100)
    assert fp8.decode_max_tokens == DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT["fp8_block"] == 64
    assert fp8.select_path(64) == "decode" and fp8.select_path(65) == "prefill"
    bf16 = MoeLayer(cfg, testing.random_host_weights(cfg, rng, "bf16"), max_tokens=16)
    assert bf16.decode_max_tokens == DEFAULT_DECODE_MAX_TOKENS == 8


def test_fp8_prefill_rounds_weights_once_and_decode_keeps_them_exact(rng):
    """The faithful references differ exactly where the kernels do: the grouped GEMM's
    bf16(q * s) tiles vs the decode reader's exact scaling. Each path matches its own
    model tightly (the outlier rule of verify.compare), proving which one it computes."""
    cfg, hw, layer = _case("qwen3_moe-fp8", rng, fp8_compute="w8a16")
    x = well_separated_input(cfg, hw, rng, 64)
    pre = run_layer(layer, x, "prefill")
    dec = run_layer(layer, x, "decode")
    grouped_ref = reference.moe_forward(cfg, hw, x, rounding="grouped")
    decode_ref = reference.moe_forward(cfg, hw, x, rounding="decode")
    assert not np.array_equal(grouped_ref, reference.moe_forward(cfg, hw, x)), "rounding changed nothing"
    assert compare(pre, reference.moe_forward(cfg, hw, x), grouped_ref, roundings=path_roundings(hw, "prefill")).ok
    assert compare(dec, reference.moe_forward(cfg, hw, x), decode_ref).ok
    # and each path misses the other's model: the fp8 rounding is visible at N = 64
    assert compare(pre, reference.moe_forward(cfg, hw, x), decode_ref).faithful_normwise > \
        compare(pre, reference.moe_forward(cfg, hw, x), grouped_ref).faithful_normwise


@pytest.mark.parametrize("name", ["deepseek_v3-fp8-fp8router-bf16shared", "gpt_oss-mxfp4",
                                  "qwen2_moe-nvfp4-nvfp4router-bf16shared"])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_quantized_graph_replay_is_bitwise_eager(name, path, rng):
    import cupy

    cfg, hw, layer = _case(name, rng)
    n = 17 if path == "decode" else 300
    xh = well_separated_input(cfg, hw, rng, n)
    x = cupy.asarray(bf16_bits(xh))
    eager, replay, _ = testing.eager_and_graph(layer, x, n, path, cupy.cuda.Stream(non_blocking=True))
    assert np.array_equal(eager.get(), replay.get())
    c = check(bits_to_f32(replay.get()), cfg, hw, xh, path, layer=layer)
    assert c.ok, f"{name} {path}: {c}"


def test_quantized_row_invariance(rng):
    """row_invariant=True holds for quantized experts too: every row's bits equal the row
    run alone, whatever N."""
    cfg, hw, layer = _case("gpt_oss-mxfp4", rng, row_invariant=True)
    x = well_separated_input(cfg, hw, rng, 300)
    full = run_layer(layer, x)
    for i in rng.choice(300, size=6, replace=False):
        assert np.array_equal(run_layer(layer, x[i:i + 1])[0], full[i]), f"row {i}"


def test_quantized_refusals_name_the_values(rng):
    from cupymoe import MoeLayer, formats
    from cupymoe.weights import UnsupportedFormatError

    # nvfp4 needs the input width to be a multiple of 32 (16-byte chunks of codes): H = 80
    cfg = testing.tiny_config("qwen3_moe", hidden_size=80)
    hw = testing.random_host_weights(cfg, rng, "nvfp4")
    with pytest.raises(UnsupportedFormatError, match=r"multiple of 32.*\(15, 64, 80\)"):
        MoeLayer(cfg, hw, max_tokens=4)
    # routed experts must share one format
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng, "fp8_block")
    hw.down = formats.quantize(formats.dequantize(hw.down, np.float32), "mxfp4")
    with pytest.raises(UnsupportedFormatError, match="share one weight format"):
        MoeLayer(cfg, hw, max_tokens=4)


def test_the_main_job_verify_command_passes():
    """`python -m cupymoe verify`'s body on two families, every format and path."""
    from cupymoe.verify import verify_families

    assert verify_families(["qwen2_moe", "gpt_oss"], [1, 17, 100], ["decode", "atomic", "prefill"],
                           formats_=("bf16", "fp8_block", "nvfp4", "mxfp4")) == 0


@pytest.mark.parametrize("family,fmt", [("deepseek_v3", "fp8_block"), ("qwen3_moe", "nvfp4"), ("gpt_oss", "mxfp4")])
def test_from_pretrained_quantized_checkpoint(tmp_path, rng, inspect_scratch, family, fmt):
    """A checkpoint in the format's hub layout (DeepSeek-V3 weight_scale_inv, ModelOpt
    weight_scale / weight_scale_2, gpt-oss _blocks / _scales; written by save_layer, whose
    round trips are bit-exact on the CPU) runs through MoeLayer.from_pretrained; `inspect`
    reports the scratch that layer allocates."""
    from cupymoe import MoeLayer, checkpoint

    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    checkpoint.save_layer(tmp_path, testing.hf_config_dict(family), 1, hw)
    want_cfg, loaded = checkpoint.load_layer(tmp_path, 1)
    layer = MoeLayer.from_pretrained(tmp_path, 1, max_tokens=300, keep_w8a8_activation=True)
    assert layer.cfg == want_cfg and layer.weights.format == fmt
    assert inspect_scratch(tmp_path, "--layer", 1, "--max-tokens", 300, "--arch", layer.lib.arch,
                           "--gpu", layer.device.name) == \
        {300: layer.workspace.nbytes}
    for n in (3, 300):
        x = well_separated_input(want_cfg, loaded, rng, n)
        path = layer.select_path(n)
        c = check(run_layer(layer, x), want_cfg, loaded, x, path, layer=layer)
        assert c.ok, f"{family} {fmt} N={n} {path}: {c}"


@pytest.mark.parametrize("fmt,fp8_compute", [("fp8_block", "w8a16"), ("fp8_block", "auto"), ("nvfp4", "auto"),
                                             ("mxfp4", "auto")])
def test_quantized_expert_parallel_partials_sum_to_full_layer(rng, fmt, fp8_compute):
    """Expert parallelism with quantized experts, on every path (fp8 also as w8a8 where the
    GPU runs it): each rank keeps its experts' codes and scales (an interleaved expert ->
    rank map, so the selection is an index array, not a slice), its partial matches the
    reference's partial (verify.check with the rank's experts), and the partials sum to the
    full layer (each partial's bf16 rounding in the envelope, cupymoe/verify.py)."""
    from cupymoe import MoeLayer
    from cupymoe.parallel import owned_experts
    from cupymoe.verify import PATH_ROUNDING

    cfg = testing.tiny_config("deepseek_v3")
    hw = testing.random_host_weights(cfg, rng, fmt, shared_fmt="bf16")
    owner = [e % 2 for e in range(cfg.num_experts)]
    layers = [MoeLayer(cfg.replace(ep_world_size=2, ep_rank=r), hw, max_tokens=300, decode_max_tokens=64,
                       atomic_max_tokens=64, expert_owner=owner, fp8_compute=fp8_compute, keep_w8a8_activation=True)
              for r in range(2)]
    for path, n in (("decode", 17), ("atomic", 17), ("prefill", 300)):
        x = well_separated_input(cfg, hw, rng, n)
        parts = []
        for rank, layer in enumerate(layers):
            owned = owned_experts(layer.cfg, owner)
            out = run_layer(layer, x, path)
            c = check(out, layer.cfg, hw, x, path, layer=layer, owned_experts=owned)
            assert c.ok, f"{fmt} ({layer.fp8_compute}) {path} rank {rank}: {c}"
            parts.append((out, reference.moe_forward(layer.cfg, hw, x, owned_experts=owned)))
        grouped = PATH_ROUNDING[path] == "grouped"
        rounded = [p[1] for p in parts]  # each partial rounded to bf16, and on the grouped path each term
        if grouped:
            rounded.append(reference.moe_forward(cfg, hw, x, rounding="grouped", absolute=True))
        c = compare(parts[0][0] + parts[1][0], reference.moe_forward(cfg, hw, x), roundings=path_roundings(hw, path),
                    partials=rounded, w8a8=layers[0].fp8_compute == "w8a8")
        assert c.ok, f"{fmt} ({layers[0].fp8_compute}) {path} sum of partials: {c}"


def test_w8a8_on_hopper_against_the_reference(rng):
    """fp8-block experts as w8a8 (sm_90a: e4m3 tensor cores, activations quantized per row
    and 128 columns, promoted to fp32 every 128 products) on every path: tight against the
    reference that quantizes the activations the same way, stage by stage, and within the
    derived w8a8 bound of the exact one (cupymoe/verify.py check_w8a8). DeepSeek-V3's
    layout: fp8 router, fp8 routed experts, bf16 shared expert (which stays on the bf16
    kernels)."""
    if not _hopper():
        pytest.skip("w8a8 needs sm_90a")
    for name in ("deepseek_v3-fp8-fp8router-bf16shared", "qwen3_moe-fp8", "longcat_flash-fp8"):
        cfg, hw, layer = _case(name, rng, fp8_compute="w8a8")
        assert layer.fp8_compute == "w8a8"
        for path, tokens in (("decode", SMALL), ("atomic", SMALL), ("prefill", (17, 65, 300, 1000))):
            for n in tokens:
                x = well_separated_input(cfg, hw, rng, n)
                c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
                assert c.ok, f"{name} N={n} {path} w8a8: {c}"


@pytest.mark.parametrize("mode", ["wgmma", "mma", "auto"])
def test_w8a8_decode_kernels_by_knob(mode, rng, monkeypatch):
    """CUPYMOE_W8A8_DECODE picks the w8a8 decode kernels at every N: decode_wgmma_a8.cu's
    (weights through a shared-memory ring, wgmma e4m3) or decode_mma.cu's _a8 ones; "auto"
    takes the wgmma ones where their gate/up grid holds WGMMA_DECODE_MIN_WAVES waves of two
    blocks an SM (here on a "GPU" of two SMs: from 8 blocks). The wgmma kernels' pass
    heights all run: 8 rows at N = 1 and 3, 16 at 17, 32 at 64, and runs longer than a pass
    (the shared experts' N rows). fp8 experts with H = 96 and 160 (k128 steps past K read
    zeros, down's 128-row tiles reach past H), a bf16 shared expert beside them, an fp8 one
    beside nvfp4 routed experts; decode and atomic paths."""
    from cupymoe.catalog import WGMMA_DECODE_TOKEN_TILES, WeightFormat
    from cupymoe.heuristics import decode_kernel
    from cupymoe.tuning import TUNING

    if not _hopper():
        pytest.skip("w8a8 needs sm_90a")
    monkeypatch.setenv("CUPYMOE_W8A8_DECODE", mode)
    fp8 = WeightFormat.FP8_BLOCK
    heights, chosen = set(), set()
    for name in ("qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared", "longcat_flash-fp8",
                 "deepseek_v3-nvfp4-fp8shared"):
        cfg, hw, layer = _case(name, rng, fp8_compute="w8a8")
        assert layer.fp8_compute == "w8a8"
        _on_sms(layer, 2)
        for n in SMALL:
            max_active, rows, blocks = _decode_grid(layer, cfg, n)
            wg = mode == "wgmma" or (mode == "auto" and blocks >= TUNING.wgmma_decode_min_waves * 2 * 2)
            for stage in ("gate_up", "down"):
                kernel = decode_kernel(layer.plan, layer.device, stage, fp8, rows, max_active).name
                assert kernel.startswith("decode_wgmma_" if wg else "decode_mma_"), (name, n, kernel)
                chosen.add(kernel.split("_")[1])
                if wg:
                    heights.add(int(kernel.split("<")[1].rstrip(">")))
        _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} w8a8 decode on {mode}")
    if mode == "wgmma":
        assert heights == set(WGMMA_DECODE_TOKEN_TILES), heights
    assert chosen == {"wgmma", "mma"} if mode == "auto" else {mode}, chosen


@pytest.mark.parametrize("mode", ["wgmma", "mma"])
def test_w8a8_decode_kernels_past_64_rows(mode, rng, monkeypatch):
    """The w8a8 decode kernels at the rows the tuning table sends them (deepseek-v3 and
    qwen3-next-80b fp8 take decode/wgmma at 256 rows) and `python -m cupymoe tune` offers them
    (tune.DECODE_CAP, up to 512): N = 65, 129, 255 and 511 on the decode path (the atomic one is
    tuned up to 16 rows), a layer whose decode cap is 512, against the reference."""
    if not _hopper():
        pytest.skip("w8a8 needs sm_90a")
    monkeypatch.setenv("CUPYMOE_W8A8_DECODE", mode)
    for name in ("qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared"):
        cfg, hw, layer = _case(name, rng, fp8_compute="w8a8", decode_max_tokens=512, max_tokens=512)
        assert layer.fp8_compute == "w8a8"
        for n in (65, 129, 255, 511):
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, "decode"), cfg, hw, x, "decode", layer=layer)
            assert c.ok, f"{name} N={n} decode w8a8 on {mode}: {c}"
        layer.check_errors()


@pytest.mark.parametrize("mode", ["mma", "cores"])
def test_w8a16_decode_kernels_past_64_rows(mode, rng, monkeypatch):
    """The w8a16 fp8 decode kernels (CUPYMOE_FP8_DECODE) at the rows `python -m cupymoe tune` offers
    them (tune.DECODE_CAP, up to 512): N = 65, 129, 255 and 511 on the decode path of a layer whose
    decode cap is 512, against the reference."""
    monkeypatch.setenv("CUPYMOE_FP8_DECODE", mode)
    for name in ("qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared"):
        cfg, hw, layer = _case(name, rng, fp8_compute="w8a16", decode_max_tokens=512, max_tokens=512)
        assert layer.fp8_compute == "w8a16" and layer.select_path(511) == "decode"
        for n in (65, 129, 255, 511):
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, "decode"), cfg, hw, x, "decode", layer=layer)
            assert c.ok, f"{name} N={n} decode w8a16 on {mode}: {c}"
        layer.check_errors()


@pytest.mark.parametrize("tile", [16, 32])
def test_w8a8_decode_tuned_token_tile(tile, rng, monkeypatch):
    """A tuning-table row of decode/wgmma naming a token tile: passes of that many rows at every N
    of its bucket, far more rows than the experts hold (N = 1, 3) as well as runs longer than a pass
    (N = 64: the shared expert's), on the decode and atomic paths, against the reference."""
    from dataclasses import replace

    from cupymoe import plan as plan_mod, tune
    from cupymoe.forward_plan import build_forward_plan
    from cupymoe.plan import Path
    from cupymoe.tuning import TUNING, Choice, n_bucket

    if not _hopper():
        pytest.skip("w8a8 needs sm_90a")
    for name in ("qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared"):
        _, _, probe = _case(name, rng, fp8_compute="w8a8", max_tokens=64)
        row = Choice("decode", w8a8_decode="wgmma", token_tile=tile)
        table = {**TUNING.by_shape, tune.layer_keys(probe.plan): tuple((n_bucket(n), row) for n in SMALL)}
        monkeypatch.setattr(plan_mod, "TUNING", replace(TUNING, by_shape=table))
        cfg, hw, layer = _case(name, rng, fp8_compute="w8a8", max_tokens=64)
        for n in SMALL:
            launches = build_forward_plan(layer.plan, layer.device, n, Path.DECODE).at(n).launches
            kernels = [s.kernel for s in launches if s.stage.value in ("gate_up", "down") and "_a8" in s.kernel]
            assert kernels == [f"decode_wgmma_gate_up_a8<{tile}>", f"decode_wgmma_down_a8<{tile}>"], (name, n, kernels)
        _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} w8a8 decode, token tile {tile}")
        layer.check_errors()


# w8a8 layers whose H is a multiple of 128, so decode_wgmma_down_a8's blocks may take several
# 128-row tiles: (case, hidden_size, moe_intermediate_size, shared_expert_intermediate_size or None)
WGMMA_A8_TILE_CASES = (
    ("qwen3_moe-fp8", 512, 384, None),  # K = 384: 8-16-row passes a stage half past K, 2 stages a tile
    ("deepseek_v3-fp8-fp8router-bf16shared", 384, 256, 128),  # K of one stage (8-16 rows): the ring spans three tiles
    ("longcat_flash-fp8", 512, 128, None),  # K = 128: one stage a tile at every pass height (32 rows: N = 255)
)


@pytest.mark.parametrize("tiles", [2, 3, 4])
def test_w8a8_decode_down_tiles(tiles, rng, monkeypatch):
    """CUPYMOE_A8_DOWN_TILES: decode_wgmma_down_a8's blocks take T 128-row tiles of H in one run of
    their ring where T divides H / 128 (H = 512: two and four; H = 384: three; else one tile a
    block), every tile's epilogue between stages of the next, at passes of 8, 16 and 32 rows and
    runs longer than a pass (N = 255), on the decode and atomic paths, against the reference."""
    from cupymoe.catalog import WeightFormat
    from cupymoe.heuristics import decode_kernel

    if not _hopper():
        pytest.skip("w8a8 needs sm_90a")
    monkeypatch.setenv("CUPYMOE_W8A8_DECODE", "wgmma")
    monkeypatch.setenv("CUPYMOE_A8_DOWN_TILES", str(tiles))
    tiled = set()
    for name, H, I, Is in WGMMA_A8_TILE_CASES:
        cfg, hw, layer = _sized_case(name, H, I, Is, rng, max_tokens=256, decode_max_tokens=256,
                                     atomic_max_tokens=max(SMALL), fp8_compute="w8a8")
        for n in SMALL:
            max_active, rows, _ = _decode_grid(layer, cfg, n)
            dk = decode_kernel(layer.plan, layer.device, "down", WeightFormat.FP8_BLOCK, rows, max_active, n)
            t = tiles if (H // 128) % tiles == 0 else 1
            assert dk.name.startswith("decode_wgmma_down_a8<") and dk.blocks == H // (128 * t), (name, n, dk)
            tiled.add(t)
        _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} w8a8 down tiles {tiles}")
        x = well_separated_input(cfg, hw, rng, 255)
        c = check(run_layer(layer, x, "decode"), cfg, hw, x, "decode", layer=layer)
        assert c.ok, f"{name} N=255 decode w8a8 down tiles {tiles}: {c}"
        layer.check_errors()
    assert tiles in tiled


# fp4 layers whose every K is a multiple of 128, as decode_wgmma_fp4.cu reads them:
# (case, hidden_size, moe_intermediate_size, shared_expert_intermediate_size or None)
WGMMA_FP4_CASES = (
    ("qwen3_next-nvfp4", 384, 128, 256),                   # nvfp4 shared expert: the fp4 launch reads x for it
    ("gpt_oss-mxfp4", 256, 384, None),                     # biases, swiglu_oai; I = 384: a stage half past K
    ("deepseek_v3-nvfp4-fp8shared", 128, 256, 128),        # an fp8 shared expert in its own launch
    ("qwen2_moe-nvfp4-nvfp4router-bf16shared", 256, 128, 128),
)


@pytest.mark.parametrize("mode", ["wgmma", "mma", "auto", "wgmma-tiles2", "wgmma-tiles3"])
def test_fp4_decode_kernels_by_knob(mode, rng, monkeypatch):
    """CUPYMOE_FP4_DECODE picks the fp4 decode kernels at every N: decode_wgmma_fp4.cu's
    (codes through a shared-memory ring, dequantized into wgmma's A operand) or
    decode_mma.cu's; "auto" takes the wgmma ones where their gate/up grid holds
    WGMMA_FP4_DECODE_MIN_WAVES waves of WGMMA_FP4_DECODE_BLOCKS_PER_SM blocks an SM (here on
    a "GPU" of 8 SMs, so both kernels run); all match the reference on the decode and
    atomic paths. Layers whose
    every K is a multiple of 128 (the tiny configs' are not: there the layer keeps
    decode_mma.cu's kernels), both fp4 formats, 8-row passes (N = 1, 3) and 16-row ones
    (N = 17, 64; the shared experts' N rows take several passes), K of one to three k128
    steps (a ring stage's second step past K: the scale bytes as four-byte chunks, zeros
    past K; K = 256: whole stages, a row's scale bytes of a stage one 16- or 8-byte copy),
    down's 128-row tiles over H = 128 .. 384, and (CUPYMOE_FP4_DOWN_TILES, "-tilesT") down's
    blocks taking T tiles in one run of their ring where T divides H / 128 (H = 256 two, 384
    three: every tile's epilogue, and K of 1-2 stages, so the ring runs from one tile into the
    next within its first copies), shared experts of an fp4, fp8 and bf16 format beside fp4
    routed ones."""
    from cupymoe.catalog import WGMMA_FP4_DECODE_BLOCKS_PER_SM, WGMMA_FP4_DECODE_TOKEN_TILES, WeightFormat
    from cupymoe.heuristics import decode_kernel
    from cupymoe.tuning import TUNING

    if not _hopper():
        pytest.skip("decode_wgmma_fp4.cu needs sm_90a")
    WGMMA_FP4_DECODE_MIN_WAVES = TUNING.wgmma_fp4_decode_min_waves

    mode, _, tiles = mode.partition("-tiles")
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", mode)
    if tiles:
        monkeypatch.setenv("CUPYMOE_FP4_DOWN_TILES", tiles)
    heights, chosen, tiled = set(), set(), set()
    for name, H, I, Is in WGMMA_FP4_CASES:
        fmt = CASES[name][1]
        cfg, hw, layer = _sized_case(name, H, I, Is, rng, max_tokens=max(SMALL), decode_max_tokens=max(SMALL),
                                     atomic_max_tokens=max(SMALL))
        code = WeightFormat.named(fmt)
        assert layer.plan.fp4_wgmma_ok and code in layer.plan.mma_decode_formats, name
        _on_sms(layer, 8)
        for n in SMALL:
            max_active, rows, blocks = _decode_grid(layer, cfg, n)
            wg = mode == "wgmma" or (mode == "auto" and blocks >= WGMMA_FP4_DECODE_MIN_WAVES
                                     * WGMMA_FP4_DECODE_BLOCKS_PER_SM * 8)
            for stage in ("gate_up", "down"):
                dk = decode_kernel(layer.plan, layer.device, stage, code, rows, max_active, n)
                kernel, blocks = dk.name, dk.blocks
                assert kernel.startswith(f"decode_wgmma_{stage}_fp4<{int(code)}," if wg
                                         else f"decode_mma_{stage}<{int(code)},"), (name, n, kernel)
                if wg and stage == "down":
                    t = int(tiles) if tiles and (H // 128) % int(tiles) == 0 else 1
                    assert blocks == H // (128 * t), (name, n, blocks)
                    tiled.add(t)
                chosen.add(kernel.split("_")[1])
                if wg:
                    heights.add(int(kernel.split(", ")[1].rstrip(">")))
        _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} H={H} I={I} fp4 decode on {mode}")
    if mode == "wgmma":
        assert heights == set(WGMMA_FP4_DECODE_TOKEN_TILES), heights
        assert tiled == ({1, int(tiles)} if tiles else {1}), tiled
    assert chosen == ({"wgmma", "mma"} if mode == "auto" else {mode}), chosen


@pytest.mark.parametrize("mode", ["wgmma", "mma"])
def test_fp4_decode_kernels_past_256_rows(mode, rng, monkeypatch):
    """The fp4 decode kernels at the rows `python -m cupymoe tune` offers them (tune.DECODE_CAP, up
    to 2048; the tuning table's H100 rows send gpt-oss-120b mxfp4 and deepseek-v3 nvfp4 there):
    N = 257, 700 and 2047 on the decode path of a layer whose decode cap is 2048, its experts'
    rows in many passes of 16 (and the shared expert's N in more), against the reference."""
    if not _hopper():
        pytest.skip("decode_wgmma_fp4.cu needs sm_90a")
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", mode)
    for name, H, I, Is in WGMMA_FP4_CASES:
        cfg, hw, layer = _sized_case(name, H, I, Is, rng, max_tokens=2048, decode_max_tokens=2048)
        assert layer.select_path(2047) == "decode"
        for n in (257, 700, 2047):
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, "decode"), cfg, hw, x, "decode", layer=layer)
            assert c.ok, f"{name} N={n} fp4 decode on {mode}: {c}"
        layer.check_errors()


@pytest.mark.parametrize("fp4_decode", ["wgmma", "mma"])
def test_format_launch_with_no_chosen_expert_keeps_the_decode_chain_ordered(fp4_decode, rng, monkeypatch):
    """EP rank 0 of two, nvfp4 routed experts beside an fp8 shared expert (two launches a
    stage, the routed format's first), and a hash table that sends tokens 0-9 to rank 1's
    experts only: at such rows the nvfp4 down launch (decode_wgmma_down_fp4, or with
    CUPYMOE_FP4_DECODE=mma decode_mma_down) has no expert to serve, and its blocks leave
    before their wait for gate/up, all but block 0 (pdl_leave_early), so that the fp8 down
    launch after it, which waits only for it, still runs after the fp8 gate/up that makes the
    shared expert's activation. Outputs against the reference on the decode and atomic
    paths, rows of such tokens only and mixed."""
    from cupymoe import MoeLayer

    if not _hopper():
        pytest.skip("the decode chain's PDL and decode_wgmma_fp4.cu need sm_90a")
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", fp4_decode)
    family, fmt, router_fmt, shared_fmt = CASES["deepseek_v3-nvfp4-fp8shared"]
    cfg = testing.tiny_config(family, hidden_size=128, moe_intermediate_size=256, shared_expert_intermediate_size=128,
                              hash_routing=True, hash_vocab_size=20, n_group=1, topk_group=1)
    hw = testing.random_host_weights(cfg, rng, fmt, router_fmt=router_fmt, shared_fmt=shared_fmt)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    other = np.arange(E // 2, E)  # rank 1's experts
    hw.tid2eid = np.stack([rng.permutation(other)[:k] if t < 10 else rng.permutation(E)[:k]
                           for t in range(20)]).astype(np.int32)
    cfg = cfg.replace(ep_world_size=2, ep_rank=0)
    layer = MoeLayer(cfg, hw, max_tokens=8, decode_max_tokens=8, atomic_max_tokens=8)
    assert set(np.flatnonzero(layer.weights.slot_of.get()[:E] >= 0)) == set(range(E // 2)), "rank 0's experts"
    for token_ids in ([3], [0, 9], [1, 5, 7], [2, 15, 4]):
        token_ids = np.array(token_ids, np.int32)
        n = len(token_ids)
        for path in ("decode", "atomic"):
            x = well_separated_input(cfg, hw, rng, n, token_ids)
            c = check(run_layer(layer, x, path, token_ids), cfg, hw, x, path, token_ids, layer)
            assert c.ok, f"tokens {list(token_ids)} {path}: {c}"


@pytest.mark.parametrize("name", ["qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared", "longcat_flash-fp8",
                                  "deepseek_v3-nvfp4-fp8shared"])
def test_wgmma_gate_up_by_slot_matches_by_active_expert(name, monkeypatch):
    """decode_wgmma_gate_up_a8's grid by table slot (each block's first weight stages copied
    before it waits for the lists, its active index looked up in slot_active after) gives
    the very bits of its grid by active expert, on the decode path, and matches the
    reference on the decode and atomic paths; forced at every N where the grid covers every
    slot (CUPYMOE_GATE_UP_AHEAD=on against off), so N = 4 and 5 leave experts nobody
    chose (their blocks copy and leave), with a bf16 shared expert beside (its slot's block
    leaves the fp8 launch), zero experts, and an fp8 shared expert beside nvfp4 routed ones
    (the fp8 launch's only slot)."""
    if not _hopper():
        pytest.skip("w8a8 needs sm_90a")
    monkeypatch.setenv("CUPYMOE_W8A8_DECODE", "wgmma")
    outs = {}
    for cap in ("on", "off"):  # every slot's block where the grid covers them all; never
        monkeypatch.setenv("CUPYMOE_GATE_UP_AHEAD", cap)
        cfg, hw, layer = _case(name, np.random.default_rng(3), fp8_compute="w8a8")
        for path in ("decode", "atomic"):
            for n in (1, 4, 5, 17, 64):
                x = well_separated_input(cfg, hw, np.random.default_rng(n), n)
                outs[cap, path, n] = run_layer(layer, x, path)
                c = check(outs[cap, path, n], cfg, hw, x, path, layer=layer)
                assert c.ok, f"{name} N={n} {path} CUPYMOE_GATE_UP_AHEAD={cap}: {c}"
    for (cap, path, n), out in outs.items():
        if path == "decode":  # the atomic path's float atomics may sum in any order
            assert np.array_equal(out, outs["off", path, n]), f"{name} N={n}: by slot, bits differ"


@pytest.mark.parametrize("name", ["qwen3_moe-fp8", "deepseek_v3-fp8-fp8router-bf16shared", "longcat_flash-fp8",
                                  "gpt_oss-mxfp4", "qwen3_next-nvfp4"])
def test_topk_and_lists_in_one_launch_match_the_two(name, rng, monkeypatch):
    """decode_topk_lists (top-k and the expert lists in one launch, past decode_route_lists'
    8 rows up to 16) gives the very bits of topk_route + decode_build_lists on the decode path,
    and on the atomic path (whose fp32 atomics add a row's experts in arrival order: not
    bit-reproducible, DESIGN.md section 1) the same output to fp32 summation order: the register
    and the shared-memory routing (deepseek-v3's groups), zero experts (longcat), a shared expert
    and its gate, softmax after top-k (gpt-oss)."""
    outs = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("CUPYMOE_TOPK_LISTS", knob)
        cfg, hw, layer = _case(name, np.random.default_rng(7))
        assert layer.plan.topk_lists == (knob == "1")
        for path in ("decode", "atomic"):
            for n in (9, 12, 16):
                x = well_separated_input(cfg, hw, np.random.default_rng(n), n)
                outs[knob, path, n] = run_layer(layer, x, path)
                if knob == "1":
                    c = check(outs[knob, path, n], cfg, hw, x, path, layer=layer)
                    assert c.ok, f"{name} N={n} {path}: {c}"
    for (knob, path, n), out in outs.items():
        if knob == "1" and path == "decode":
            assert np.array_equal(out, outs["0", path, n]), f"{name} N={n} {path}: bits differ"
        elif knob == "1":
            gap = compare(out, outs["0", path, n]).normwise
            assert gap <= EXACT_NORMWISE, f"{name} N={n} {path}: {gap:.2e} apart"


@pytest.mark.parametrize("name", ["deepseek_v3-fp8-fp8router-bf16shared", "gpt_oss-mxfp4", "qwen3_moe-bf16-fp8router"])
def test_decode_router_on_tensor_cores_and_on_cuda_cores(name, rng, monkeypatch):
    """The decode path with each router (CUPYMOE_DECODE_ROUTER): router_mma.cu's tensor-core
    kernels (sm_90a; K over a cluster, or at 64 rows over the grid into copies top-k sums; with
    w8a8 they also make x's e4m3 codes past decode_route_lists' rows) and router.cu's CUDA-core one, each against the reference on the decode and atomic paths: a
    quantized (fp8) router, a router bias (gpt-oss), groups and a shared expert (deepseek-v3)."""
    from cupymoe import catalog

    monkeypatch.setattr(catalog, "ROUTER_SPLIT_STEPS", 1)  # the tiny H's 3-5 k32 steps over 3-4 copies, one empty
    for knob in ("mma", "split", "cores"):
        monkeypatch.setenv("CUPYMOE_DECODE_ROUTER", knob)
        cfg, hw, layer = _case(name, rng)
        router = layer.forward_plan(min(64, layer.decode_max_tokens), "decode").launches[0].kernel
        sm90 = layer.lib.arch == "sm_90a"
        assert router.startswith("router_logits_mma") == (knob == "mma" and sm90)
        assert router.startswith("router_logits_split") == (knob == "split" and sm90)
        _check_decode_paths(layer, cfg, hw, rng, SMALL, f"{name} router {knob}")


def test_fp8_compute_refusals(rng):
    from cupymoe import MoeLayer
    from cupymoe.weights import UnsupportedFormatError

    cfg = testing.tiny_config("qwen3_moe")
    with pytest.raises(UnsupportedFormatError, match="needs fp8_block experts"):
        MoeLayer(cfg, testing.random_host_weights(cfg, rng, "nvfp4"), max_tokens=4, fp8_compute="w8a8")
    with pytest.raises(ValueError, match="fp8_compute="):
        MoeLayer(cfg, testing.random_host_weights(cfg, rng, "fp8_block"), max_tokens=4, fp8_compute="fp8")
