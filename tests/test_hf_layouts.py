"""CPU tests of cupymoe.hf_layouts: transformers 5's and vLLM's stacked experts (numpy only).

Each case starts from random HostWeights, writes the layer in hub naming (save_layer), then
replaces the per-expert tensors by a stacked layout built here by hand (np.concatenate for
[gate; up], element-wise interleaving for gpt-oss under vLLM), loads it, and checks the result
bit for bit against the HostWeights it came from. The comparison with transformers' own
modules lives in test_integrations_transformers.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from cupymoe import checkpoint, hf_layouts
from cupymoe.errors import CheckpointError, MissingTensorError
from cupymoe.formats import Fp8BlockWeight
from cupymoe.testing import FAMILIES, hf_config_dict, random_host_weights, tiny_config

LAYER = 1  # an MoE layer in every tiny config (deepseek's layer 0 is dense)
STACKED_FAMILIES = [f for f in FAMILIES if f != "gpt_oss"]  # gpt-oss's hub layout is transformers' own
FP8_QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _hub(tmp_path, family, fmt="bf16", seed=0, **overrides):
    """(config dict, hub tensors of layer LAYER, its MLP prefix, the HostWeights they hold)."""
    cfg = tiny_config(family, **overrides)
    hw = random_host_weights(cfg, np.random.default_rng(seed), fmt)
    config = hf_config_dict(family, **overrides)
    if fmt == "fp8_block":
        config["quantization_config"] = FP8_QCONFIG
    prefix = checkpoint.layer_prefix(family, LAYER)
    checkpoint.save_layer(tmp_path / "hub", config, LAYER, hw)
    return config, checkpoint._hub_tensors(cfg, hw, prefix)[0], prefix, hw  # save_layer's own tensors


def _parts(w):
    """A weight's arrays: (q, scale_inv) for block fp8, (w,) for a plain array."""
    return (w.q, w.scale_inv) if isinstance(w, Fp8BlockWeight) else (w,)


def _interleave(even, odd):
    out = np.empty((even.shape[0], 2 * even.shape[1]) + even.shape[2:], dtype=even.dtype)
    out[:, 0::2], out[:, 1::2] = even, odd
    return out


def _stacked(tensors, prefix, hw, layout, *, extra_rows=0):
    """`tensors` with the routed experts replaced by `layout`'s stacked tensors built from `hw`."""
    base = prefix + hf_layouts.EXPERTS
    out = {k: v for k, v in tensors.items() if not k.startswith(base)}
    gate, up, down = _parts(hw.gate), _parts(hw.up), _parts(hw.down)
    suffixes = ("", hf_layouts.SCALE)
    for suffix, g, u in zip(suffixes, gate, up):
        gu = _interleave(g, u) if layout.interleaved else np.concatenate([g, u], axis=1)
        if extra_rows:  # LongCat under transformers: rows for the zero experts, never read
            gu = np.concatenate([gu, np.full((extra_rows,) + gu.shape[1:], np.nan, gu.dtype)])
        out[base + layout.gate_up + suffix] = gu
    for suffix, d in zip(suffixes, down):
        out[base + layout.down + suffix] = np.ascontiguousarray(d)
    if layout.gate_up_bias:
        out[base + layout.gate_up_bias] = _interleave(hw.gate_bias, hw.up_bias)
        out[base + layout.down_bias] = hw.down_bias
    return out


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _re_shape(shape):
    return r"\(" + r", ".join(str(d) for d in shape) + r"\)"


def _assert_same(got, want):
    """Bit for bit, every tensor of the layer."""
    for field in ("router", "gate", "up", "down", "router_bias", "correction_bias", "gate_bias", "up_bias",
                  "down_bias", "shared_gate", "shared_up", "shared_down", "shared_expert_gate"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            for pa, pb in zip(_parts(a), _parts(b)):
                assert pa.dtype == pb.dtype and np.array_equal(_bits(pa), _bits(pb)), field


@pytest.mark.parametrize("family", STACKED_FAMILIES)
def test_transformers_stacked_experts_load_as_views(tmp_path, family):
    config, tensors, prefix, hw = _hub(tmp_path, family)
    stacked = _stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS,
                       extra_rows=tiny_config(family).zero_expert_num)
    _, got = checkpoint.load_layer_from_tensors(config, stacked, prefix)
    _assert_same(got, hw)
    gate_up = stacked[prefix + "experts.gate_up_proj"]
    assert np.shares_memory(got.gate, gate_up) and np.shares_memory(got.up, gate_up)  # views, no copy
    assert np.shares_memory(got.down, stacked[prefix + "experts.down_proj"])


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_w13_w2(tmp_path, family):
    config, tensors, prefix, hw = _hub(tmp_path, family)
    layout = hf_layouts.VLLM_GPT_OSS if family == "gpt_oss" else hf_layouts.VLLM
    _, got = checkpoint.load_layer_from_tensors(config, _stacked(tensors, prefix, hw, layout), prefix)
    _assert_same(got, hw)


def test_vllm_gpt_oss_rows_alternate(tmp_path):
    """w13_weight row 2i is gate row i, row 2i + 1 up row i (vLLM keeps the checkpoint's interleave)."""
    config, tensors, prefix, hw = _hub(tmp_path, "gpt_oss")
    stacked = _stacked(tensors, prefix, hw, hf_layouts.VLLM_GPT_OSS)
    w13 = stacked[prefix + "experts.w13_weight"]
    assert np.array_equal(w13[3, 10], np.asarray(hw.gate)[3, 5]) and np.array_equal(w13[3, 11], np.asarray(hw.up)[3, 5])
    _, got = checkpoint.load_layer_from_tensors(config, stacked, prefix)
    assert np.array_equal(got.up_bias[2, 7], stacked[prefix + "experts.w13_bias"][2, 15])


@pytest.mark.parametrize("layout", [hf_layouts.TRANSFORMERS, hf_layouts.VLLM], ids=["transformers", "vllm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_block_fp8_stacks(tmp_path, family, layout):
    config, tensors, prefix, hw = _hub(tmp_path, family, "fp8_block")
    stacked = _stacked(tensors, prefix, hw, layout)
    cfg, got = checkpoint.load_layer_from_tensors(config, stacked, prefix)
    assert cfg.weight_format == "fp8_block" and isinstance(got.gate, Fp8BlockWeight)
    _assert_same(got, hw)


def test_stacked_layout_from_disk_mixtral_at_mlp(tmp_path):
    """A checkpoint in transformers 5's own layout (save_pretrained(save_original_format=False)):
    Mixtral's block at `mlp.`, its experts stacked."""
    config, tensors, prefix, hw = _hub(tmp_path, "mixtral")
    assert prefix == f"model.layers.{LAYER}.block_sparse_moe."
    moved = f"model.layers.{LAYER}.mlp."
    stacked = {k.replace(prefix, moved): v for k, v in _stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS).items()}
    (tmp_path / "t5").mkdir()
    save_file(stacked, str(tmp_path / "t5" / checkpoint.SINGLE_FILE))
    (tmp_path / "t5" / checkpoint.CONFIG_FILE).write_text(json.dumps(config))
    _, got = checkpoint.load_layer(tmp_path / "t5", LAYER)
    _assert_same(got, hw)
    _, hub = checkpoint.load_layer(tmp_path / "hub", LAYER)  # the hub's block_sparse_moe still loads
    _assert_same(hub, hw)


# --- refusals -------------------------------------------------------------------------------

def test_refuses_half_stacked(tmp_path):
    config, tensors, prefix, hw = _hub(tmp_path, "qwen3_moe")
    stacked = _stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS)
    del stacked[prefix + "experts.down_proj"]
    with pytest.raises(MissingTensorError, match=r"experts\.down_proj: the transformers 5 stacked layout needs it"
                                                 r".*holds only .*experts\.gate_up_proj"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


@pytest.mark.parametrize("layout,suffix", [(hf_layouts.TRANSFORMERS, "_scale"), (hf_layouts.TRANSFORMERS, "_weight_scale_2"),
                                           (hf_layouts.VLLM, "_scale"), (hf_layouts.VLLM, "_scale_2")])
def test_refuses_a_scale_beside_a_float_stack(tmp_path, layout, suffix):
    """A float stack with a scale beside it loaded with the scale ignored (one log line); served so, the map
    is off by that scale. Refused as the per-expert weight's twin is."""
    config, tensors, prefix, hw = _hub(tmp_path, "qwen3_moe")
    stacked = _stacked(tensors, prefix, hw, layout)
    name = prefix + "experts." + layout.down
    stacked[name + suffix] = np.full((hw.down.shape[0],), 0.5, np.float32)
    with pytest.raises(CheckpointError, match=rf"{name} is .* but {name}{suffix} lies beside it .*a float stack takes "
                                              "no scale"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


def test_refuses_stacked_beside_per_expert(tmp_path):
    config, tensors, prefix, hw = _hub(tmp_path, "qwen2_moe")
    mixed = {**tensors, prefix + "experts.gate_up_proj": np.concatenate([hw.gate, hw.up], axis=1)}
    with pytest.raises(CheckpointError, match=r"stored in 2 layouts at once \(hub \(per-expert modules\): "
                                              r".*experts\.0\..*; transformers 5: .*experts\.gate_up_proj\)"):
        checkpoint.load_layer_from_tensors(config, mixed, prefix)


def test_refuses_transformers_beside_vllm(tmp_path):
    config, tensors, prefix, hw = _hub(tmp_path, "deepseek_v3")
    both = {**_stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS), **_stacked(tensors, prefix, hw, hf_layouts.VLLM)}
    with pytest.raises(CheckpointError, match=r"transformers 5: .*gate_up_proj.*; vLLM: .*w13_weight"):
        checkpoint.load_layer_from_tensors(config, both, prefix)


@pytest.mark.parametrize("name, shape", [("gate_up_proj", (15, 64, 96)), ("gate_up_proj", (16, 128, 96)),
                                         ("gate_up_proj", (15, 96, 128)), ("down_proj", (15, 64, 96))])
def test_refuses_misshaped_stack(tmp_path, name, shape):
    config, tensors, prefix, hw = _hub(tmp_path, "qwen3_moe")
    stacked = _stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS)
    stacked[prefix + "experts." + name] = np.zeros(shape, np.float32)
    with pytest.raises(CheckpointError, match=rf"experts\.{name}: expected shape \(15, \d+, \d+\), "
                                              rf"found {_re_shape(shape)}"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


def test_longcat_takes_zero_expert_rows_but_no_more(tmp_path):
    config, tensors, prefix, hw = _hub(tmp_path, "longcat_flash")
    stacked = _stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS, extra_rows=4)  # E + Z + 1
    with pytest.raises(CheckpointError,
                       match=r"expected shape \(12, 128, 96\) or \(15, 128, 96\), found \(16, 128, 96\)"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


def test_refuses_fp8_scales_shared_by_gate_and_up(tmp_path):
    """transformers allocates ceil(2I / 128) scale rows; with I % 128 != 0 a block spans both halves: at
    I mod 128 in (0, 64] (here 192) the stored count tells it from the halves' own 2 ceil(I / 128)
    (what transformers 5.17 writes for such a model is refused by name)."""
    cfg = tiny_config("qwen3_moe", moe_intermediate_size=192, hidden_size=256)
    config = hf_config_dict("qwen3_moe", moe_intermediate_size=192, hidden_size=256)
    config["quantization_config"] = FP8_QCONFIG
    E, prefix = cfg.num_experts, checkpoint.layer_prefix("qwen3_moe", LAYER)
    hw = random_host_weights(cfg, np.random.default_rng(0), "fp8_block")
    stacked = _stacked(checkpoint._hub_tensors(cfg, hw, prefix)[0], prefix, hw, hf_layouts.TRANSFORMERS)
    _, ok = checkpoint.load_layer_from_tensors(config, stacked, prefix)  # 2 * ceil(192 / 128) = 4 rows: splits
    _assert_same(ok, hw)
    stacked[prefix + "experts.gate_up_proj_scale_inv"] = np.ones((E, 3, 2), np.float32)
    with pytest.raises(CheckpointError, match=r"gate_up_proj: intermediate size 192 \(mod 128 = 64\): its 3 fp8 "
                                              r"scale row blocks may straddle gate and up"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


def test_refuses_fp8_interleaved_and_unscaled(tmp_path):
    config, tensors, prefix, hw = _hub(tmp_path, "qwen3_moe", "fp8_block")
    stacked = _stacked(tensors, prefix, hw, hf_layouts.VLLM)
    del stacked[prefix + "experts.w2_weight_scale_inv"]
    with pytest.raises(MissingTensorError, match=r"w2_weight is float8_e4m3fn but .*w2_weight_scale_inv is not found"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)
    stacked[prefix + "experts.w2_weight"] = np.zeros((15, 96, 32), np.uint8)  # packed fp4, say
    with pytest.raises(CheckpointError, match=r"w2_weight: expected shape \(15, 96, 64\), found \(15, 96, 32\)"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)
    stacked[prefix + "experts.w2_weight"] = np.zeros((15, 96, 64), np.int8)
    with pytest.raises(CheckpointError, match=r"w2_weight: stacked experts of dtype int8 are not supported"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


def test_refuses_fp8_gpt_oss_w13(tmp_path):
    config, tensors, prefix, hw = _hub(tmp_path, "gpt_oss")
    stacked = _stacked(tensors, prefix, hw, hf_layouts.VLLM_GPT_OSS)
    w13 = prefix + "experts.w13_weight"
    stacked[w13] = np.zeros(stacked[w13].shape, np.uint8)
    stacked[w13 + "_scale_inv"] = np.ones((9, 2, 1), np.float32)
    with pytest.raises(CheckpointError, match=r"w13_weight: gate and up rows alternate"):
        checkpoint.load_layer_from_tensors(config, stacked, prefix)


@pytest.mark.parametrize("inter, refused", [(96, True), (64, False), (256, False)])
def test_transformers_fp8_stack_whose_scale_blocks_may_straddle_gate_and_up(tmp_path, inter, refused):
    """transformers' FP8Experts quantizes [gate; up] whole: with I mod 128 in (64, 128) its ceil(2I / 128)
    row blocks number 2 ceil(I / 128), as split halves' do, and one straddles the halves, so such a stack
    is refused by name (a split would scale part of up by gate's block); elsewhere the counts differ or the
    blocks coincide. vLLM's w13 always keeps each half's own."""
    config, tensors, prefix, hw = _hub(tmp_path, "qwen3_moe", "fp8_block", moe_intermediate_size=inter)
    stacked = _stacked(tensors, prefix, hw, hf_layouts.TRANSFORMERS)
    if refused:
        with pytest.raises(CheckpointError, match=rf"intermediate size {inter} \(mod 128 = 96\).*may straddle"):
            checkpoint.load_layer_from_tensors(config, stacked, prefix)
    else:
        _assert_same(checkpoint.load_layer_from_tensors(config, stacked, prefix)[1], hw)
    _assert_same(checkpoint.load_layer_from_tensors(config, _stacked(tensors, prefix, hw, hf_layouts.VLLM),
                                                    prefix)[1], hw)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_per_expert_fp8_codes_with_their_scales_stacked(tmp_path, family, caplog):
    """What transformers 5.25's save_pretrained writes for FP8Experts in the hub format: each expert's
    codes under its hub name, the scales stacked beside them (experts.gate_up_proj_scale_inv, each half's
    own row blocks, and experts.down_proj_scale_inv): read bit for bit, the stacked scales used; a
    whole-quantized gate_up (a block straddling gate and up) refused by name."""
    config, tensors, prefix, hw = _hub(tmp_path, family, "fp8_block")
    inter = hw.gate.q.shape[1]  # 64: a whole [gate; up] has one 128-row block, the halves one each
    base = prefix + hf_layouts.EXPERTS
    mixed = {k: v for k, v in tensors.items() if not (k.startswith(base) and k.endswith(".weight_scale_inv"))}
    mixed[base + "gate_up_proj" + hf_layouts.SCALE] = np.concatenate([hw.gate.scale_inv, hw.up.scale_inv], axis=1)
    mixed[base + "down_proj" + hf_layouts.SCALE] = hw.down.scale_inv
    _assert_same(checkpoint.load_layer_from_tensors(config, mixed, prefix)[1], hw)
    (tmp_path / "mixed").mkdir()
    save_file(mixed, str(tmp_path / "mixed" / checkpoint.SINGLE_FILE))
    (tmp_path / "mixed" / checkpoint.CONFIG_FILE).write_text(json.dumps(config))
    _assert_same(checkpoint.load_layer(tmp_path / "mixed", LAYER)[1], hw)
    assert "were ignored" not in caplog.text  # the stacked scales count as used
    fewer = dict(mixed)
    fewer[base + "down_proj" + hf_layouts.SCALE] = hw.down.scale_inv[:-1]
    with pytest.raises(CheckpointError, match=r"experts\.down_proj_scale_inv: expected shape"):
        checkpoint.load_layer_from_tensors(config, fewer, prefix)
    stray = {**mixed, base + "w13_weight": np.zeros((1, 1, 1), np.float32)}
    with pytest.raises(CheckpointError, match=r"stored in 3 layouts at once"):
        checkpoint.load_layer_from_tensors(config, stray, prefix)
    whole = dict(mixed)
    whole[base + "gate_up_proj" + hf_layouts.SCALE] = mixed[base + "gate_up_proj" + hf_layouts.SCALE][:, :1]
    with pytest.raises(CheckpointError, match=rf"intermediate size {inter} \(mod 128 = {inter}\): its 1 fp8 scale "
                                              r"row blocks may straddle gate and up .*save_original_format=False"):
        checkpoint.load_layer_from_tensors(config, whole, prefix)
