"""CPU tests of cupymoe.checkpoint: hub naming and formats <-> HostWeights.

Two independent kinds of evidence:
1. Round trips: random HostWeights -> save_layer -> load_layer, bit-exact, for every family x
   format that exists in the wild. These catch asymmetries but not a naming error made the
   same way in both directions.
2. Hand-written checkpoints: tensors written under literal hub names (as FORMATS.md spells
   them) with safetensors.numpy.save_file, then loaded and checked element by element,
   including gpt-oss's even/odd interleave and the fp4 nibble order, computed here from the
   raw bytes rather than with cupymoe.formats.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from cupymoe import checkpoint
from cupymoe.checkpoint import (CheckpointError, CheckpointFileError, MissingTensorError, load_layer,
                                load_layer_from_tensors, read_config, save_layer)
from cupymoe.config import DenseLayerError, MoeConfig, UnsupportedModelError
from cupymoe.errors import ConfigError, OptionError
from cupymoe.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from cupymoe.host_weights import HostWeights
from cupymoe.testing import FAMILIES, hf_config_dict, random_host_weights, tiny_config

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
LAYER = 1  # an MoE layer in every tiny config (deepseek's layer 0 is dense)

# FORMATS.md: e2m1 code -> value; 8..15 are the negatives of 0..7.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

FP8_QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
NVFP4_QCONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                 "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_expert_gate"]}
MXFP4_QCONFIG = {"quant_method": "mxfp4",
                 "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]}
QCONFIGS = {"fp8_block": FP8_QCONFIG, "nvfp4": NVFP4_QCONFIG, "mxfp4": MXFP4_QCONFIG}

# Every family x format combination that exists in released checkpoints.
COMBOS = [(f, "bf16") for f in FAMILIES] + [
    ("deepseek_v3", "fp8_block"), ("qwen3_moe", "fp8_block"),
    ("qwen3_moe", "nvfp4"), ("deepseek_v3", "nvfp4"), ("qwen2_moe", "nvfp4"),
    ("gpt_oss", "mxfp4"),
]


# ----------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------

def config_for(family: str, fmt: str) -> dict:
    cfg = hf_config_dict(family)
    if fmt != "bf16":
        cfg["quantization_config"] = json.loads(json.dumps(QCONFIGS[fmt]))
    return cfg


def with_input_scales(hw: HostWeights, rng: np.random.Generator) -> HostWeights:
    """ModelOpt NVFP4 checkpoints carry an input_scale per linear; give every nvfp4 weight one."""
    for f in fields(hw):
        w = getattr(hw, f.name)
        if isinstance(w, Nvfp4Weight):
            w.input_scale = (rng.random(w.scale_2.shape) + 0.5).astype(np.float32)
    return hw


def assert_bits_equal(got, want, label: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{label}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{label}: bits differ"


def assert_same_weight(got, want, label: str) -> None:
    assert type(got) is type(want), f"{label}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, (Fp8BlockWeight, Nvfp4Weight, Mxfp4Weight)):
        for part in fields(want):
            g, w = getattr(got, part.name), getattr(want, part.name)
            assert (g is None) == (w is None), f"{label}.{part.name}: {g!r} vs {w!r}"
            if w is not None:
                assert_bits_equal(g, w, f"{label}.{part.name}")
    else:
        assert_bits_equal(got, want, label)


def assert_same_weights(got: HostWeights, want: HostWeights) -> None:
    assert got.names() == want.names()
    for name in want.names():
        assert_same_weight(getattr(got, name), getattr(want, name), name)


def rand_bf16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(BF16)


def rand_f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def rand_e4m3(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 50).astype(np.float32).astype(E4M3)


def write_checkpoint(root, config: dict, tensors: dict, shards: list[list[str]] | None = None,
                     extra_files: dict | None = None):
    """A checkpoint written by hand: config.json and one file, or the given shards + index."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    for name, content in (extra_files or {}).items():
        (root / name).write_text(json.dumps(content))
    if shards is None:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(root / fname))
        weight_map.update({n: fname for n in names})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def per_expert_bf16(rng, prefix: str, E: int, H: int, I: int, projs=("gate_proj", "up_proj", "down_proj")):
    """{hub name: bf16 array} of E experts' gate/up/down, in the per-expert naming."""
    g, u, d = projs
    t = {}
    for e in range(E):
        t[f"{prefix}experts.{e}.{g}.weight"] = rand_bf16(rng, I, H)
        t[f"{prefix}experts.{e}.{u}.weight"] = rand_bf16(rng, I, H)
        t[f"{prefix}experts.{e}.{d}.weight"] = rand_bf16(rng, H, I)
    return t


def check_per_expert(hw: HostWeights, tensors: dict, prefix: str, E: int, projs=("gate_proj", "up_proj", "down_proj")):
    for e in range(E):
        for field, proj in zip(("gate", "up", "down"), projs):
            assert_bits_equal(getattr(hw, field)[e], tensors[f"{prefix}experts.{e}.{proj}.weight"], f"{field}[{e}]")


# ----------------------------------------------------------------------------------
# 1. round trips through save_layer
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family,fmt", COMBOS, ids=[f"{f}-{m}" for f, m in COMBOS])
def test_round_trip_bit_exact(tmp_path, family, fmt):
    rng = np.random.default_rng(COMBOS.index((family, fmt)))
    config = config_for(family, fmt)
    cfg = MoeConfig.from_hf(config, LAYER)
    assert cfg.weight_format == fmt
    hw = with_input_scales(random_host_weights(cfg, rng, fmt), rng)

    save_layer(tmp_path, config, LAYER, hw)
    got_cfg, got = load_layer(tmp_path, LAYER)

    assert got_cfg == cfg
    assert_same_weights(got, hw)


def test_a_shard_size_that_is_no_count_is_refused_before_anything_is_written(tmp_path):
    """shard_max_tensors 0, 2.5, "4" or True is refused by name with the directory left empty (a refusal
    after config.json was written made the retry fail on the half-written directory)."""
    rng = np.random.default_rng(1)
    config = config_for("qwen3_moe", "bf16")
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng)
    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(OptionError, match=rf"shard_max_tensors={bad!r}: must be a whole number >= 1"):
            save_layer(tmp_path, config, LAYER, hw, shard_max_tensors=bad)
        assert not any(tmp_path.iterdir())
    save_layer(tmp_path, config, LAYER, hw, shard_max_tensors=np.int64(20))
    assert load_layer(tmp_path, LAYER)[0] == MoeConfig.from_hf(config, LAYER)


def test_round_trip_sharded_mixed_formats(tmp_path):
    """fp8 routed experts next to a bf16 shared expert and an fp8 router, across 5 shards."""
    rng = np.random.default_rng(1)
    config = config_for("deepseek_v3", "fp8_block")
    cfg = MoeConfig.from_hf(config, LAYER)
    hw = random_host_weights(cfg, rng, "fp8_block", router_fmt="fp8_block", shared_fmt="bf16")

    save_layer(tmp_path, config, LAYER, hw, shard_max_tensors=23)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    n_tensors = 2 + 1 + 16 * 3 * 2 + 3  # router q+s, correction bias, 48 fp8 expert linears, bf16 shared
    assert len(index["weight_map"]) == n_tensors
    assert shards == sorted(set(index["weight_map"].values())) and len(shards) == 5
    assert not (tmp_path / "model.safetensors").exists()

    got_cfg, got = load_layer(tmp_path, LAYER)
    assert got_cfg == cfg
    assert isinstance(got.router, Fp8BlockWeight) and got.shared_gate.dtype == BF16
    assert_same_weights(got, hw)


def test_save_adds_quantization_config(tmp_path):
    """No quantization_config given + nvfp4 experts -> save_layer writes ModelOpt's, excluding bf16 modules."""
    rng = np.random.default_rng(2)
    config = hf_config_dict("qwen2_moe")
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng, "nvfp4")
    save_layer(tmp_path, config, LAYER, hw)

    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "modelopt" and written["quant_algo"] == "NVFP4"
    assert sorted(written["exclude_modules"]) == ["model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"]
    got_cfg, got = load_layer(tmp_path, LAYER)
    assert got_cfg.weight_format == "nvfp4"
    assert got_cfg.quant_exclude == tuple(written["exclude_modules"])
    assert_same_weights(got, hw)


def test_save_refuses_quantized_excluded_module(tmp_path):
    rng = np.random.default_rng(3)
    config = config_for("qwen3_moe", "nvfp4")  # excludes model.layers.*.mlp.gate
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng, "nvfp4", router_fmt="nvfp4")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate is nvfp4 but the quantization config excludes"):
        save_layer(tmp_path, config, LAYER, hw)


def test_save_refuses_format_contradicting_config(tmp_path):
    rng = np.random.default_rng(4)
    config = config_for("deepseek_v3", "fp8_block")
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng, "nvfp4")
    with pytest.raises(ValueError, match="means fp8_block routed experts, but host_weights holds nvfp4"):
        save_layer(tmp_path, config, LAYER, hw)


def test_save_refuses_existing_checkpoint(tmp_path):
    rng = np.random.default_rng(5)
    config = hf_config_dict("mixtral")
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng)
    save_layer(tmp_path, config, LAYER, hw)
    with pytest.raises(FileExistsError, match="already holds"):
        save_layer(tmp_path, config, LAYER, hw)


# ----------------------------------------------------------------------------------
# 2. hand-written checkpoints, one per family
# ----------------------------------------------------------------------------------

def test_qwen3_moe_bf16_hand_written(tmp_path):
    rng = np.random.default_rng(10)
    config = hf_config_dict("qwen3_moe")  # E=15, H=96, I=64
    p = "model.layers.1.mlp."
    t = {"model.layers.1.mlp.gate.weight": rand_bf16(rng, 15, 96)}
    t.update(per_expert_bf16(rng, p, 15, 96, 64))
    t["model.layers.0.mlp.gate.weight"] = rand_bf16(rng, 15, 96)  # another layer: must be left alone
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg == MoeConfig.from_hf(config, LAYER)
    assert_bits_equal(hw.router, t["model.layers.1.mlp.gate.weight"], "router")
    check_per_expert(hw, t, p, 15)
    assert hw.gate.shape == (15, 64, 96) and hw.down.shape == (15, 96, 64)


def test_qwen2_moe_shared_expert_hand_written(tmp_path):
    rng = np.random.default_rng(11)
    config = hf_config_dict("qwen2_moe")  # E=10, H=160, I=64, Is=96
    p = "model.layers.1.mlp."
    t = {"model.layers.1.mlp.gate.weight": rand_bf16(rng, 10, 160),
         "model.layers.1.mlp.shared_expert.gate_proj.weight": rand_bf16(rng, 96, 160),
         "model.layers.1.mlp.shared_expert.up_proj.weight": rand_bf16(rng, 96, 160),
         "model.layers.1.mlp.shared_expert.down_proj.weight": rand_bf16(rng, 160, 96),
         "model.layers.1.mlp.shared_expert_gate.weight": rand_bf16(rng, 1, 160)}
    t.update(per_expert_bf16(rng, p, 10, 160, 64))
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg.has_shared_expert_gate and cfg.shared_expert_intermediate_size == 96
    check_per_expert(hw, t, p, 10)
    for field, proj in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"), ("shared_down", "down_proj")):
        assert_bits_equal(getattr(hw, field), t[f"{p}shared_expert.{proj}.weight"], field)
    # [1, H] bf16 -> [H] float32, values unchanged
    assert hw.shared_expert_gate.dtype == np.float32 and hw.shared_expert_gate.shape == (160,)
    assert np.array_equal(hw.shared_expert_gate, t[f"{p}shared_expert_gate.weight"][0].astype(np.float32))


def test_qwen3_next_sharded_hand_written(tmp_path):
    """Sharded through index.json, with one expert's projections split across two shards."""
    rng = np.random.default_rng(12)
    config = hf_config_dict("qwen3_next")  # E=20, H=96, I=64, Is=64
    p = "model.layers.1.mlp."
    t = {"model.layers.1.mlp.gate.weight": rand_bf16(rng, 20, 96),
         "model.layers.1.mlp.shared_expert.gate_proj.weight": rand_bf16(rng, 64, 96),
         "model.layers.1.mlp.shared_expert.up_proj.weight": rand_bf16(rng, 64, 96),
         "model.layers.1.mlp.shared_expert.down_proj.weight": rand_bf16(rng, 96, 64),
         "model.layers.1.mlp.shared_expert_gate.weight": rand_bf16(rng, 1, 96)}
    t.update(per_expert_bf16(rng, p, 20, 96, 64))
    first = [n for n in t if ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) < 10]
    first.append("model.layers.1.mlp.experts.10.gate_proj.weight")
    second = [n for n in t if n not in first]
    root = write_checkpoint(tmp_path, config, t, shards=[first, second])
    assert "model.layers.1.mlp.experts.10.up_proj.weight" in second

    cfg, hw = load_layer(root, LAYER)
    assert cfg == MoeConfig.from_hf(config, LAYER)
    assert_bits_equal(hw.router, t[f"{p}gate.weight"], "router")
    check_per_expert(hw, t, p, 20)
    assert np.array_equal(hw.shared_expert_gate, t[f"{p}shared_expert_gate.weight"][0].astype(np.float32))


def test_deepseek_v3_fp8_hand_written(tmp_path):
    """DeepSeek fp8: e4m3 weights + fp32 weight_scale_inv per 128x128 block; bf16 router; fp32 bias."""
    rng = np.random.default_rng(13)
    config = config_for("deepseek_v3", "fp8_block")  # E=16, H=160, I=64, Is=128
    p = "model.layers.1.mlp."
    t = {"model.layers.1.mlp.gate.weight": rand_bf16(rng, 16, 160),
         "model.layers.1.mlp.gate.e_score_correction_bias": rand_f32(rng, 16)}
    for mod, (out, inn) in ([(f"experts.{e}.{proj}", shape) for e in range(16) for proj, shape in
                             (("gate_proj", (64, 160)), ("up_proj", (64, 160)), ("down_proj", (160, 64)))]
                            + [("shared_experts.gate_proj", (128, 160)), ("shared_experts.up_proj", (128, 160)),
                               ("shared_experts.down_proj", (160, 128))]):
        t[f"{p}{mod}.weight"] = rand_e4m3(rng, out, inn)
        t[f"{p}{mod}.weight_scale_inv"] = rng.random((-(-out // 128), -(-inn // 128))).astype(np.float32)
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg.weight_format == "fp8_block" and cfg.has_correction_bias and cfg.n_group == 4
    assert hw.router.dtype == BF16
    assert_bits_equal(hw.correction_bias, t[f"{p}gate.e_score_correction_bias"], "correction_bias")
    assert isinstance(hw.gate, Fp8BlockWeight) and hw.gate.scale_inv.shape == (16, 1, 2)
    assert hw.down.scale_inv.shape == (16, 2, 1)
    for e in range(16):
        for field, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            assert_bits_equal(getattr(hw, field).q[e], t[f"{p}experts.{e}.{proj}.weight"], f"{field}[{e}].q")
            assert_bits_equal(getattr(hw, field).scale_inv[e], t[f"{p}experts.{e}.{proj}.weight_scale_inv"], field)
    assert isinstance(hw.shared_up, Fp8BlockWeight)
    assert_bits_equal(hw.shared_up.q, t[f"{p}shared_experts.up_proj.weight"], "shared_up.q")
    # W[i, j] = q[i, j] * s[i // 128, j // 128]: element (5, 150) of expert 3's gate is in block (0, 1)
    q, s = t[f"{p}experts.3.gate_proj.weight"], t[f"{p}experts.3.gate_proj.weight_scale_inv"]
    assert hw.gate.dequantize()[3, 5, 150] == np.float32(float(q[5, 150]) * float(s[0, 1]))


def test_mixtral_w1_w3_w2_hand_written(tmp_path):
    """Mixtral: block_sparse_moe.*, w1 = gate, w3 = up, w2 = down."""
    rng = np.random.default_rng(14)
    config = hf_config_dict("mixtral")  # E=8, H=96, I=64
    p = "model.layers.1.block_sparse_moe."
    t = {"model.layers.1.block_sparse_moe.gate.weight": rand_bf16(rng, 8, 96)}
    t.update(per_expert_bf16(rng, p, 8, 96, 64, projs=("w1", "w3", "w2")))
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg.norm_topk_prob
    assert_bits_equal(hw.router, t["model.layers.1.block_sparse_moe.gate.weight"], "router")
    check_per_expert(hw, t, p, 8, projs=("w1", "w3", "w2"))
    assert_bits_equal(hw.up[6], t["model.layers.1.block_sparse_moe.experts.6.w3.weight"], "w3 is up")


def test_gpt_oss_bf16_interleave_hand_written(tmp_path):
    """gate_up_proj [E, H, 2I]: gate = even columns, up = odd; transposed to [E, I, H]."""
    rng = np.random.default_rng(15)
    config = hf_config_dict("gpt_oss")  # E=9, H=96, I=64
    p = "model.layers.1.mlp."
    gu, gub = rand_bf16(rng, 9, 96, 128), rand_f32(rng, 9, 128).astype(BF16)
    dp, dpb = rand_bf16(rng, 9, 64, 96), rand_f32(rng, 9, 96).astype(BF16)
    t = {"model.layers.1.mlp.router.weight": rand_bf16(rng, 9, 96),
         "model.layers.1.mlp.router.bias": rand_bf16(rng, 9),
         "model.layers.1.mlp.experts.gate_up_proj": gu, "model.layers.1.mlp.experts.gate_up_proj_bias": gub,
         "model.layers.1.mlp.experts.down_proj": dp, "model.layers.1.mlp.experts.down_proj_bias": dpb}
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg.topk_then_softmax and cfg.hidden_act == "swiglu_oai" and cfg.swiglu_limit == 1.25
    assert hw.gate.shape == (9, 64, 96) and hw.up.shape == (9, 64, 96) and hw.down.shape == (9, 96, 64)
    for e, i, h in ((0, 0, 0), (2, 5, 7), (8, 63, 95), (4, 31, 50)):
        assert hw.gate[e, i, h] == gu[e, h, 2 * i]
        assert hw.up[e, i, h] == gu[e, h, 2 * i + 1]
        assert hw.down[e, h, i] == dp[e, i, h]
        assert hw.gate_bias[e, i] == np.float32(gub[e, 2 * i])
        assert hw.up_bias[e, i] == np.float32(gub[e, 2 * i + 1])
        assert hw.down_bias[e, h] == np.float32(dpb[e, h])
    assert hw.gate.dtype == BF16 and hw.gate_bias.dtype == np.float32
    assert np.array_equal(hw.router_bias, t[f"{p}router.bias"].astype(np.float32))


def test_gpt_oss_mxfp4_interleave_and_nibbles_hand_written(tmp_path):
    """mxfp4 rows interleaved (gate = even rows, up = odd); element 2j in the low nibble."""
    rng = np.random.default_rng(16)
    config = config_for("gpt_oss", "mxfp4")  # E=9, H=96, I=64
    gu_b = rng.integers(0, 256, (9, 128, 3, 16), dtype=np.uint8)
    gu_s = rng.integers(120, 134, (9, 128, 3), dtype=np.uint8)
    d_b = rng.integers(0, 256, (9, 96, 2, 16), dtype=np.uint8)
    d_s = rng.integers(120, 134, (9, 96, 2), dtype=np.uint8)
    t = {"model.layers.1.mlp.router.weight": rand_bf16(rng, 9, 96),
         "model.layers.1.mlp.router.bias": rand_bf16(rng, 9),
         "model.layers.1.mlp.experts.gate_up_proj_blocks": gu_b,
         "model.layers.1.mlp.experts.gate_up_proj_scales": gu_s,
         "model.layers.1.mlp.experts.gate_up_proj_bias": rand_bf16(rng, 9, 128),
         "model.layers.1.mlp.experts.down_proj_blocks": d_b,
         "model.layers.1.mlp.experts.down_proj_scales": d_s,
         "model.layers.1.mlp.experts.down_proj_bias": rand_bf16(rng, 9, 96)}
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg.weight_format == "mxfp4"
    assert isinstance(hw.gate, Mxfp4Weight) and hw.gate.shape == (9, 64, 96) and hw.down.shape == (9, 96, 64)
    assert_bits_equal(hw.gate.blocks[4, 7], gu_b[4, 14], "gate row 7 = row 14")
    assert_bits_equal(hw.up.blocks[4, 7], gu_b[4, 15], "up row 7 = row 15")
    assert_bits_equal(hw.up.scales[4, 7], gu_s[4, 15], "up scales row 7 = row 15")
    assert_bits_equal(hw.down.blocks, d_b, "down blocks")

    def by_hand(blocks, scales, e, row, j):
        byte = int(blocks[e, row, j // 32, (j % 32) // 2])
        code = byte & 0xF if j % 2 == 0 else byte >> 4
        return E2M1[code] * 2.0 ** (int(scales[e, row, j // 32]) - 127)

    up, gate, down = hw.up.dequantize(), hw.gate.dequantize(), hw.down.dequantize()
    for e, i, j in ((4, 7, 45), (0, 0, 0), (8, 63, 95), (2, 10, 32)):
        assert up[e, i, j] == by_hand(gu_b, gu_s, e, 2 * i + 1, j)
        assert gate[e, i, j] == by_hand(gu_b, gu_s, e, 2 * i, j)
    assert down[3, 90, 33] == by_hand(d_b, d_s, 3, 90, 33)


def test_longcat_flash_router_width_hand_written(tmp_path):
    """LongCat: router.classifier [E+Z, H] and router.e_score_correction_bias [E+Z]; E experts only."""
    rng = np.random.default_rng(17)
    config = hf_config_dict("longcat_flash")  # E=12, Z=3, H=96, I=64
    p = "model.layers.1.mlp."
    t = {"model.layers.1.mlp.router.classifier.weight": rand_bf16(rng, 15, 96),
         "model.layers.1.mlp.router.e_score_correction_bias": rand_f32(rng, 15)}
    t.update(per_expert_bf16(rng, p, 12, 96, 64))
    cfg, hw = load_layer(write_checkpoint(tmp_path, config, t), LAYER)

    assert cfg.router_width == 15 and cfg.zero_expert_num == 3
    assert_bits_equal(hw.router, t[f"{p}router.classifier.weight"], "router")
    assert_bits_equal(hw.correction_bias, t[f"{p}router.e_score_correction_bias"], "correction_bias")
    check_per_expert(hw, t, p, 12)


def test_nvfp4_modelopt_hf_quant_config_hand_written(tmp_path):
    """Older ModelOpt: quantization in hf_quant_config.json; u8 weights, e4m3 scales, fp32 scale_2 scalars."""
    rng = np.random.default_rng(18)
    config = hf_config_dict("qwen3_moe")  # E=15, H=96, I=64; no quantization_config
    hf_quant = {"producer": {"name": "modelopt", "version": "0.19.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}
    p = "model.layers.1.mlp."
    t = {"model.layers.1.mlp.gate.weight": rand_bf16(rng, 15, 96)}
    for e in range(15):
        for proj, (out, inn) in (("gate_proj", (64, 96)), ("up_proj", (64, 96)), ("down_proj", (96, 64))):
            m = f"{p}experts.{e}.{proj}"
            t[m + ".weight"] = rng.integers(0, 256, (out, inn // 2), dtype=np.uint8)
            t[m + ".weight_scale"] = (rng.random((out, inn // 16)) * 4 + 0.25).astype(np.float32).astype(E4M3)
            t[m + ".weight_scale_2"] = np.array(0.01 * (e + 1), dtype=np.float32)
            t[m + ".input_scale"] = np.array(0.5 + e, dtype=np.float32)
    root = write_checkpoint(tmp_path, config, t, extra_files={"hf_quant_config.json": hf_quant})
    cfg, hw = load_layer(root, LAYER)

    assert cfg.weight_format == "nvfp4" and cfg.quant_exclude == ("lm_head", "model.layers.*.mlp.gate")
    assert read_config(root)["quantization_config"]["quant_method"] == "modelopt"
    assert hw.router.dtype == BF16
    assert isinstance(hw.down, Nvfp4Weight) and hw.down.shape == (15, 96, 64)
    assert_bits_equal(hw.up.packed[6], t[f"{p}experts.6.up_proj.weight"], "up[6].packed")
    assert_bits_equal(hw.up.scale[6], t[f"{p}experts.6.up_proj.weight_scale"], "up[6].scale")
    assert_bits_equal(hw.up.scale_2, np.array([0.01 * (e + 1) for e in range(15)], np.float32), "scale_2")
    assert_bits_equal(hw.gate.input_scale, np.arange(15, dtype=np.float32) + np.float32(0.5), "input_scale")
    # W[i, j] = e2m1(nibble of byte j // 2: low for even j) * scale[i, j // 16] * scale_2
    m = f"{p}experts.9.down_proj"
    for i, j in ((0, 0), (17, 33), (95, 63)):
        byte = int(t[m + ".weight"][i, j // 2])
        code = byte & 0xF if j % 2 == 0 else byte >> 4
        want = np.float32(E2M1[code]) * np.float32(t[m + ".weight_scale"][i, j // 16]) * np.float32(0.1)
        assert hw.down.dequantize()[9, i, j] == want


# ----------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------

def small_qwen3(rng):
    config = hf_config_dict("qwen3_moe")
    t = {"model.layers.1.mlp.gate.weight": rand_bf16(rng, 15, 96)}
    t.update(per_expert_bf16(rng, "model.layers.1.mlp.", 15, 96, 64))
    return config, t


def test_missing_tensor_names_tensor_and_file(tmp_path):
    config, t = small_qwen3(np.random.default_rng(20))
    del t["model.layers.1.mlp.experts.13.up_proj.weight"]
    root = write_checkpoint(tmp_path, config, t)
    with pytest.raises(MissingTensorError) as info:
        load_layer(root, LAYER)
    msg = str(info.value)
    assert "model.layers.1.mlp.experts.13.up_proj.weight" in msg and str(root / "model.safetensors") in msg
    assert isinstance(info.value, KeyError) and isinstance(info.value, CheckpointError)


def test_missing_tensor_in_sharded_checkpoint_names_index(tmp_path):
    config, t = small_qwen3(np.random.default_rng(21))
    del t["model.layers.1.mlp.experts.2.down_proj.weight"]
    names = list(t)
    root = write_checkpoint(tmp_path, config, t, shards=[names[:20], names[20:]])
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight' not found "
                                                 r"in .*model\.safetensors\.index\.json"):
        load_layer(root, LAYER)


def test_wrong_shape_names_tensor_expected_found_file(tmp_path):
    config, t = small_qwen3(np.random.default_rng(22))
    t["model.layers.1.mlp.experts.4.down_proj.weight"] = rand_bf16(np.random.default_rng(0), 96, 65)
    root = write_checkpoint(tmp_path, config, t)
    with pytest.raises(CheckpointError) as info:
        load_layer(root, LAYER)
    msg = str(info.value)
    for part in ("model.layers.1.mlp.experts.4.down_proj.weight", "expected shape (96, 64)", "found (96, 65)",
                 str(root / "model.safetensors")):
        assert part in msg


def test_missing_config_json(tmp_path):
    with pytest.raises(CheckpointFileError, match="config.json not found: .*config.json"):
        load_layer(tmp_path, LAYER)


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict("mixtral")))
    with pytest.raises(CheckpointFileError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        load_layer(tmp_path, LAYER)


def test_index_naming_missing_shard(tmp_path):
    config, t = small_qwen3(np.random.default_rng(23))
    root = write_checkpoint(tmp_path, config, t, shards=[list(t)[:10], list(t)[10:]])
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointFileError, match=r"model-00002-of-00002\.safetensors', but .*model-00002-of-00002"
                                                  r"\.safetensors does not exist"):
        load_layer(root, LAYER)


@pytest.mark.parametrize("shard", [".", "sub"])
def test_index_naming_a_directory_as_a_shard(tmp_path, shard):
    config, t = small_qwen3(np.random.default_rng(23))
    root = write_checkpoint(tmp_path, config, t, shards=[list(t)[:10], list(t)[10:]])
    (root / "sub").mkdir()
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {n: shard if f.endswith("00002.safetensors") else f for n, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFileError, match=rf"maps tensors to '{re.escape(shard)}', but .* is no regular file"):
        load_layer(root, LAYER)


def test_index_pointing_at_wrong_shard(tmp_path):
    config, t = small_qwen3(np.random.default_rng(24))
    names = list(t)
    root = write_checkpoint(tmp_path, config, t, shards=[names[:10], names[10:]])
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.1.mlp.experts.14.gate_proj.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match=r"maps tensor 'model\.layers\.1\.mlp\.experts\.14\.gate_proj\.weight'"
                                                 r" to .*model-00001-of-00002\.safetensors, but that file does not"):
        load_layer(root, LAYER)


def test_dense_deepseek_layer_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict("deepseek_v3")))  # first_k_dense_replace=1
    with pytest.raises(DenseLayerError, match="layer 0"):
        load_layer(tmp_path, 0)


def test_unknown_model_type_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        load_layer(tmp_path, 0)


def test_fp8_weight_without_block_scale(tmp_path):
    rng = np.random.default_rng(25)
    config, t = small_qwen3(rng)
    t["model.layers.1.mlp.experts.0.gate_proj.weight"] = rand_e4m3(rng, 64, 96)
    with pytest.raises(MissingTensorError, match=r"experts\.0\.gate_proj\.weight is float8_e4m3fn but "
                                                 r".*weight_scale_inv is not found"):
        load_layer(write_checkpoint(tmp_path, config, t), LAYER)


def test_experts_must_share_a_format(tmp_path):
    rng = np.random.default_rng(26)
    config, t = small_qwen3(rng)
    t["model.layers.1.mlp.experts.7.up_proj.weight"] = rand_e4m3(rng, 64, 96)
    t["model.layers.1.mlp.experts.7.up_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    with pytest.raises(CheckpointError, match=r"experts\.7\.up_proj is stored as fp8_block .* but "
                                              r".*experts\.0\.up_proj as bf16"):
        load_layer(write_checkpoint(tmp_path, config, t), LAYER)


@pytest.mark.parametrize("part", ["weight_scale", "weight_scale_2"])
def test_a_scale_beside_a_float_weight_is_refused(tmp_path, part):
    """Served without its scale the expert would be off by it: refused, not logged as an extra tensor."""
    rng = np.random.default_rng(29)
    config, t = small_qwen3(rng)
    t[f"model.layers.1.mlp.experts.3.down_proj.{part}"] = np.full((), 0.5, np.float32)
    with pytest.raises(CheckpointError, match=rf"experts\.3\.down_proj\.weight is bfloat16 but "
                                              rf".*experts\.3\.down_proj\.{part} lies beside it"):
        load_layer(write_checkpoint(tmp_path, config, t), LAYER)


def test_unused_tensors_under_prefix_are_reported(tmp_path, caplog):
    """A tensor the layer has no place for is logged; a bias that would add something (the router's, an
    expert's) is refused by name, as the layer would be served without it; a bias of zeros is logged."""
    rng = np.random.default_rng(27)
    config, t = small_qwen3(rng)
    t["model.layers.1.mlp.gate.bias"] = np.zeros(15, BF16)
    t["model.layers.1.mlp.gate.note"] = rand_bf16(rng, 3)
    with caplog.at_level(logging.WARNING, logger="cupymoe.checkpoint"):
        load_layer(write_checkpoint(tmp_path / "zeros", config, t), LAYER)
    assert "model.layers.1.mlp.gate.bias" in caplog.text and "model.layers.1.mlp.gate.note" in caplog.text
    for name, shape in (("model.layers.1.mlp.gate.bias", 15), ("model.layers.1.mlp.experts.0.down_proj.bias", 64)):
        bad = {**t, name: rand_bf16(rng, shape)}
        with pytest.raises(CheckpointError, match=rf"belong to a part of the qwen3_moe layer its config leaves out "
                                                  rf"\(a shared expert, the routing bias, a bias\): {re.escape(name)}"):
            load_layer(write_checkpoint(tmp_path / name, config, bad), LAYER)


def test_big_layer_logs_progress(tmp_path, caplog):
    rng = np.random.default_rng(28)
    config = hf_config_dict("qwen3_moe", num_experts=checkpoint.PROGRESS_MIN_EXPERTS)
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng)
    save_layer(tmp_path, config, LAYER, hw)
    with caplog.at_level(logging.INFO, logger="cupymoe.checkpoint"):
        _, got = load_layer(tmp_path, LAYER)
    n = checkpoint.PROGRESS_MIN_EXPERTS
    assert f"model.layers.1.mlp.experts.*.down_proj: read {n}/{n} experts" in caplog.text
    assert_same_weights(got, hw)


# ----------------------------------------------------------------------------------
# mapping form
# ----------------------------------------------------------------------------------

def test_mapping_form_matches_files(tmp_path):
    rng = np.random.default_rng(30)
    config = hf_config_dict("qwen2_moe")
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng)
    save_layer(tmp_path, config, LAYER, hw)
    from safetensors.numpy import load_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.gate.weight"] = rand_bf16(rng, 10, 160)  # whole-model mapping: other layers too

    cfg, got = load_layer_from_tensors(config, tensors, "model.layers.1.mlp.")
    assert cfg == MoeConfig.from_hf(config, LAYER)
    assert_same_weights(got, hw)
    # a MoeConfig instead of the dict, and a prefix without the trailing dot
    cfg2, got2 = load_layer_from_tensors(cfg, tensors, "model.layers.1.mlp")
    assert cfg2 == cfg
    assert_same_weights(got2, hw)


def test_mapping_form_fp8_as_uint8_views():
    """CuPy has no fp8 dtype: e4m3 weights may arrive as uint8; weight_scale_inv marks them fp8."""
    rng = np.random.default_rng(31)
    config = config_for("deepseek_v3", "fp8_block")
    cfg = MoeConfig.from_hf(config, LAYER)
    hw = random_host_weights(cfg, rng, "fp8_block")
    tensors, _ = checkpoint._hub_tensors(cfg, hw, "model.layers.1.mlp.")
    as_u8 = {n: (a.view(np.uint8) if a.dtype == E4M3 else a) for n, a in tensors.items()}
    assert any(a.dtype == np.uint8 for a in as_u8.values())
    _, got = load_layer_from_tensors(config, as_u8, "model.layers.1.mlp.")
    assert_same_weights(got, hw)


def test_mapping_form_errors():
    rng = np.random.default_rng(32)
    config, t = small_qwen3(rng)
    del t["model.layers.1.mlp.experts.3.gate_proj.weight"]
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.1\.mlp\.experts\.3\.gate_proj\.weight' not found "
                                                 r"in the tensors mapping"):
        load_layer_from_tensors(config, t, "model.layers.1.mlp.")
    with pytest.raises(DenseLayerError):
        load_layer_from_tensors(hf_config_dict("deepseek_v3"), {}, "model.layers.0.mlp.")
    with pytest.raises(CheckpointError, match="model_type is empty"):
        load_layer_from_tensors(MoeConfig(hidden_size=96, moe_intermediate_size=64, num_experts=15,
                                          num_experts_per_tok=4), t, "model.layers.1.mlp.")


def test_raw_reader_agrees_with_safetensors(tmp_path):
    """F8 tensors bypass safetensors' numpy framework (it cannot build them); check that byte
    reader against safetensors on the dtypes both can read."""
    import contextlib
    rng = np.random.default_rng(33)
    t = {"a": rand_bf16(rng, 3, 5), "b": rand_f32(rng, 7), "c": rng.integers(0, 256, (2, 2, 4), dtype=np.uint8)}
    save_file(t, str(tmp_path / "model.safetensors"))
    with contextlib.ExitStack() as stack:
        src = checkpoint._FileSource(tmp_path, stack)
        for name, want in t.items():
            assert_bits_equal(src.read(name), want, name)
            assert_bits_equal(src._read_raw(tmp_path / "model.safetensors", name, want.dtype), want, name)


def test_longcat_router_bias_round_trip(tmp_path):
    """config.json `router_bias: true` puts a bias on mlp.router.classifier (LongCat)."""
    cfg = tiny_config("longcat_flash", has_router_bias=True)
    hw = random_host_weights(cfg, np.random.default_rng(5))
    save_layer(tmp_path, hf_config_dict("longcat_flash", router_bias=True), LAYER, hw)
    got_cfg, got = load_layer(tmp_path, LAYER)
    assert got_cfg == cfg
    np.testing.assert_array_equal(got.router_bias, hw.router_bias)


def test_inspect_command_reports_the_layers_formats_and_refusals(tmp_path, capsys):
    """`python -m cupymoe inspect DIR`: which layers are MoE, each tensor's format, shape and
    bytes, and a tensor the GPU kernels cannot read named with the reason (no GPU needed)."""
    from cupymoe import testing
    from cupymoe.__main__ import main

    rng = np.random.default_rng(3)
    cfg = testing.tiny_config("deepseek_v3")
    hw = random_host_weights(cfg, rng, "fp8_block", router_fmt="fp8_block", shared_fmt="bf16")
    save_layer(tmp_path / "ds", testing.hf_config_dict("deepseek_v3"), 1, hw)
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    # first_k_dense_replace = 1; the checkpoint holds layer 1's tensors only
    assert "3 layers (tensors here for 1), MoE layers: 1\n" in out
    assert "router               fp8_block  (16, 160)" in out and "dequantized once to bf16" in out
    assert "shared_gate          bfloat16   (128, 160)" in out and "NOT served" not in out
    assert "scratch at max_tokens=64 on sm_90a:" in out and "at max_tokens=4096 on sm_90a:" in out
    # nvfp4 with an input width the kernels cannot read in whole chunks (80 % 32 != 0)
    cfg = testing.tiny_config("qwen3_moe", hidden_size=80)
    hw = random_host_weights(cfg, rng, "nvfp4")
    save_layer(tmp_path / "q", testing.hf_config_dict("qwen3_moe", hidden_size=80), 0, hw)
    assert main(["inspect", str(tmp_path / "q"), "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert "gate                 nvfp4      (15, 64, 80)" in out
    assert "NOT served by the GPU kernels: input width 80 is not a multiple of 32" in out


def test_inspect_scratch_is_the_layers_plan(tmp_path, capsys, inspect_scratch):
    """inspect reports the scratch MoeLayer would allocate: its plan for the formats and the
    arch (fp8 experts' w8a8 buffers on sm_90a, the decode rows of each format), not the bf16
    layer's. Before, it sized every layer as bf16 (8 decode rows, no w8a8 buffers): the bench's
    deepseek-v3 shape with fp8 experts at max_tokens 64 read 11.5 MB against the layer's 27.5."""
    from cupymoe import testing
    from cupymoe.knobs import Knobs
    from cupymoe.plan import plan_layer
    from cupymoe.workspace import layer_need

    rng = np.random.default_rng(7)
    cfg = testing.tiny_config("deepseek_v3")
    hw = random_host_weights(cfg, rng, "fp8_block", shared_fmt="bf16")
    save_layer(tmp_path / "ds", testing.hf_config_dict("deepseek_v3"), 1, hw)
    got_cfg, _ = load_layer(tmp_path / "ds", 1)
    hopper = inspect_scratch(str(tmp_path / "ds"), "--max-tokens", "64", "300")
    for T, got in hopper.items():
        want = layer_need(plan_layer(got_cfg, "fp8_block", "bf16", "sm_90a", n_local=cfg.num_experts,
                                     knobs=Knobs()), T)[1]
        assert got == want.total_bytes
        bf16_sized = layer_need(plan_layer(got_cfg, "bf16", "bf16", "sm_90a", n_local=cfg.num_experts,
                                           knobs=Knobs()), T)[1]
        assert got > bf16_sized.total_bytes  # the e4m3 copies and 64 decode rows
    w8a16 = inspect_scratch(str(tmp_path / "ds"), "--max-tokens", "64", "300", "--fp8-compute", "w8a16")
    ampere = inspect_scratch(str(tmp_path / "ds"), "--max-tokens", "64", "300", "--arch", "sm_80")
    assert ampere == w8a16 and all(w8a16[T] < hopper[T] for T in hopper)
    # Hopper is compiled for as sm_90a whichever way it is named
    assert inspect_scratch(tmp_path / "ds", "--max-tokens", "64", "300", "--arch", "sm_90") == hopper
    # a GPU the tuning table has rows of (none for this shape: the same scratch) or not (said so)
    assert inspect_scratch(tmp_path / "ds", "--max-tokens", "64", "--gpu", "NVIDIA H100 80GB HBM3") == {64: hopper[64]}
    from cupymoe.__main__ import main
    assert main(["inspect", str(tmp_path / "ds"), "--max-tokens", "64", "--gpu", "NVIDIA H100 PCI"]) == 0
    out = capsys.readouterr().out
    assert "--gpu 'NVIDIA H100 PCI': the tuning table has no rows timed on it" in out
    assert "scratch at max_tokens=64 on sm_90a (NVIDIA H100 PCI):" in out
    # fp8 experts on sm_80 cannot run w8a8: refused as the layer would refuse it
    from cupymoe.__main__ import main

    assert main(["inspect", str(tmp_path / "ds"), "--arch", "sm_80", "--fp8-compute", "w8a8"]) == 2
    refused = capsys.readouterr()
    assert "fp8_compute='w8a8' needs sm_90a" in refused.err
    # a max_tokens the layer would refuse gets no scratch figure: the refusal, named
    assert main(["inspect", str(tmp_path / "ds"), "--max-tokens", "64", "65537"]) == 0
    out = capsys.readouterr().out
    assert "scratch at max_tokens=64 " in out and "scratch at max_tokens=65537" not in out
    assert "max_tokens=65537: refused (max_tokens=65537: the kernels serve at most 65536 rows a call" in out
    assert refused.out == ""  # the refusal alone: nothing of the listing before it
    assert main(["inspect", str(tmp_path / "ds"), "--arch", "sm_70"]) == 2
    assert "sm_80 or newer" in capsys.readouterr().err
    # nvfp4 experts decode up to 256 rows
    cfg = testing.tiny_config("qwen3_moe")
    save_layer(tmp_path / "q", testing.hf_config_dict("qwen3_moe"), 0, random_host_weights(cfg, rng, "nvfp4"))
    assert main(["inspect", str(tmp_path / "q"), "--layer", "0"]) == 0
    assert "decode path up to 256 rows" in capsys.readouterr().out


def test_corrupt_or_truncated_shard_names_the_file(tmp_path):
    """A shard cut short (a partial download) or not safetensors at all: safetensors' own error
    names no file, the loader's does."""
    config, t = small_qwen3(np.random.default_rng(40))
    root = write_checkpoint(tmp_path, config, t, shards=[list(t)[:10], list(t)[10:]])
    shard = root / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointFileError, match=r"model-00002-of-00002\.safetensors: not a readable safetensors file"):
        load_layer(root, LAYER)
    shard.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointFileError, match=r"model-00002-of-00002\.safetensors: not a readable safetensors file"):
        load_layer(root, LAYER)


def test_malformed_index_weight_map_is_refused_naming_the_entry(tmp_path):
    config, t = small_qwen3(np.random.default_rng(41))
    root = write_checkpoint(tmp_path, config, t, shards=[list(t)[:10], list(t)[10:]])
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"] = None
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map maps "
                                              r"'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight' to None"):
        load_layer(root, LAYER)
    index_path.write_text(json.dumps({"weight_map": ["model.layers.1.mlp.gate.weight"]}))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map must map tensor names to file names, found a list"):
        load_layer(root, LAYER)


def test_mxfp4_scales_of_another_one_byte_dtype_are_refused(tmp_path):
    """mxfp4 `_scales` are uint8 (or F8_E8M0) exponents; an int8, bool or fp8 tensor of the same
    shape would be read as exponents all the same (an e4m3 1.0 is byte 56: 2^-71), so it is
    refused, naming the tensor, its dtype and the file. Mxfp4Weight refuses them too."""
    rng = np.random.default_rng(42)
    config = config_for("gpt_oss", "mxfp4")
    hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng, "mxfp4")
    save_layer(tmp_path / "ok", config, LAYER, hw)
    from safetensors.numpy import load_file
    t = load_file(str(tmp_path / "ok" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    assert t[name].dtype == np.uint8
    for bad in (np.int8, np.dtype(ml_dtypes.float8_e4m3fn)):
        t2 = dict(t)
        t2[name] = t[name].view(bad)
        root = write_checkpoint(tmp_path / np.dtype(bad).name, config, t2)
        with pytest.raises(CheckpointError, match=rf"{name}: expected uint8 \(or F8_E8M0\) e8m0 exponents, found dtype "
                                                  rf"{np.dtype(bad).name} in .*model\.safetensors"):
            load_layer(root, LAYER)
        with pytest.raises(ValueError, match=f"Mxfp4Weight.scales: expected uint8 or float8_e8m0fnu e8m0 exponents, "
                                             f"found {np.dtype(bad).name}"):
            Mxfp4Weight(hw.down.blocks, hw.down.scales.view(bad))
    # e8m0 as its own ml_dtypes type is the same bytes
    e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)
    assert_bits_equal(Mxfp4Weight(hw.down.blocks, hw.down.scales.view(e8m0)).scales, hw.down.scales, "e8m0 view")


def test_mxfp4_scales_without_their_blocks_name_the_blocks(tmp_path):
    """gpt-oss: a `_scales` whose `_blocks` is missing is refused naming the `_blocks` tensor,
    not read as a request for the bf16 `gate_up_proj` / `down_proj`."""
    rng = np.random.default_rng(46)
    config = config_for("gpt_oss", "mxfp4")
    save_layer(tmp_path / "ok", config, LAYER, random_host_weights(MoeConfig.from_hf(config, LAYER), rng, "mxfp4"))
    from safetensors.numpy import load_file
    t = load_file(str(tmp_path / "ok" / "model.safetensors"))
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}_blocks"
        root = write_checkpoint(tmp_path / proj, config, {n: a for n, a in t.items() if n != name})
        with pytest.raises(MissingTensorError, match=rf"tensor '{name}' not found in .*model\.safetensors"):
            load_layer(root, LAYER)


def test_mapping_form_names_relative_to_the_mlp_module():
    """prefix "": the tensors keyed as an MLP module's state_dict() gives them (gate.weight,
    experts.0.gate_proj.weight, ...)."""
    rng = np.random.default_rng(43)
    config, t = small_qwen3(rng)
    relative = {n[len("model.layers.1.mlp."):]: a for n, a in t.items()}
    cfg, want = load_layer_from_tensors(config, t, "model.layers.1.mlp.")
    cfg2, got = load_layer_from_tensors(cfg, relative, "")
    assert cfg2 == cfg
    assert_same_weights(got, want)


def test_modelopt_export_quantizing_only_the_kv_cache_loads_its_bf16_weights(tmp_path):
    """An hf_quant_config.json (or quantization_config) with quant_algo null and only
    kv_cache_quant_algo set leaves the weights as stored: bf16 here, not a refusal."""
    config, t = small_qwen3(np.random.default_rng(44))
    root = write_checkpoint(tmp_path, config, t,
                            extra_files={"hf_quant_config.json": {"quantization": {"quant_algo": None,
                                                                                   "kv_cache_quant_algo": "FP8"}}})
    cfg, hw = load_layer(root, LAYER)
    assert cfg == MoeConfig.from_hf(config, LAYER)
    np.testing.assert_array_equal(hw.router.view(np.uint16), t["model.layers.1.mlp.gate.weight"].view(np.uint16))


def test_inspect_counts_longcat_layers_in_blocks(tmp_path, capsys):
    """LongCat's config carries num_layers (blocks, each with one MoE) and num_hidden_layers
    (twice as many sub-layers, as transformers writes it): inspect counts the blocks, as
    MoeConfig.from_hf checks layer_idx against."""
    from cupymoe.__main__ import main

    config = hf_config_dict("longcat_flash")
    config["num_hidden_layers"] = 2 * config["num_layers"]
    save_layer(tmp_path, config, LAYER, random_host_weights(MoeConfig.from_hf(config, LAYER),
                                                            np.random.default_rng(45)))
    assert main(["inspect", str(tmp_path), "--layer", str(LAYER)]) == 0
    n = config["num_layers"]
    assert f"{n} layers (tensors here for {LAYER}), MoE layers: {LAYER}\n" in capsys.readouterr().out


def test_inspect_refusals_are_one_line_naming_the_problem(tmp_path, capsys):
    """inspect on a dense layer, a layer out of range or a bad --max-tokens: exit status 2 and
    one line naming it (an ArenaError about 'logits' for --max-tokens -5 named neither the
    option nor the value), not a traceback."""
    from cupymoe.__main__ import main

    config = hf_config_dict("deepseek_v3")
    save_layer(tmp_path, config, LAYER, random_host_weights(MoeConfig.from_hf(config, LAYER),
                                                            np.random.default_rng(47)))
    assert main(["inspect", str(tmp_path), "--layer", "0"]) == 2
    assert "cupymoe inspect: DenseLayerError: layer 0 of this deepseek_v3 model is a dense MLP layer" in \
        capsys.readouterr().err
    assert main(["inspect", str(tmp_path), "--layer", "7"]) == 2
    assert "layer_idx=7 is outside 0..2 for deepseek_v3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--max-tokens", "-5"])
    assert "argument --max-tokens: -5 is not >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------
# a checkpoint directory never reaches outside itself
# ----------------------------------------------------------------------------------

def _sharded_with(tmp_path, rng, shard2: str):
    """small_qwen3 in two shards, the index naming the second one `shard2`; returns (root, shard-2 tensors)."""
    config, t = small_qwen3(rng)
    names = list(t)
    root = write_checkpoint(tmp_path / "ckpt", config, t, shards=[names[:10], names[10:]])
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({n: shard2 for n in names[10:]})
    index_path.write_text(json.dumps(index))
    return root, {n: t[n] for n in names[10:]}


@pytest.mark.parametrize("hostile", ["../outside.safetensors", "sub/../../outside.safetensors", "{abs}",
                                     "../../etc/passwd", "..\\outside.safetensors", "C:\\outside.safetensors",
                                     "sub/\x00.safetensors"])
def test_index_shard_names_outside_the_directory_are_refused(tmp_path, hostile):
    """An index naming a shard by an absolute path or through '..' is refused before anything is
    opened, naming the index, the shard and the directory; before, ../x and /tmp/x loaded silently
    and ../../etc/passwd was opened."""
    outside = tmp_path / "outside.safetensors"
    hostile = hostile.replace("{abs}", str(outside))
    root, t2 = _sharded_with(tmp_path, np.random.default_rng(60), hostile)
    save_file(t2, str(outside))  # a readable shard, so only the check stands between it and the loader
    with pytest.raises(CheckpointError) as info:
        load_layer(root, LAYER)
    msg = str(info.value)
    assert "model.safetensors.index.json: weight_map names shard" in msg and repr(hostile) in msg
    assert "an absolute path or one with a '..' component is refused" in msg and str(root) in msg


def test_symlinks_leaving_the_directory_are_refused_and_inside_ones_load(tmp_path):
    """A shard, the single file or config.json that is a symlink resolving outside the checkpoint
    directory is refused (naming it and where it resolves); a symlink that stays inside loads."""
    rng = np.random.default_rng(61)
    root, t2 = _sharded_with(tmp_path, rng, "link.safetensors")
    outside = tmp_path / "outside.safetensors"
    save_file(t2, str(outside))
    (root / "link.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"weight_map names shard 'link\.safetensors' resolves to "
                                              rf".*outside\.safetensors, outside the checkpoint directory {root}"):
        load_layer(root, LAYER)
    # the same link through a directory link
    (root / "link.safetensors").unlink()
    (root / "d").symlink_to(tmp_path)
    index_path = root / "model.safetensors.index.json"
    index_path.write_text(index_path.read_text().replace("link.safetensors", "d/outside.safetensors"))
    with pytest.raises(CheckpointError, match=r"'d/outside\.safetensors' resolves to .*, outside the checkpoint"):
        load_layer(root, LAYER)
    # inside: a link to a file in a subdirectory of the checkpoint loads, and gives the same weights
    (root / "sub").mkdir()
    save_file(t2, str(root / "sub" / "real.safetensors"))
    (root / "inside.safetensors").symlink_to(root / "sub" / "real.safetensors")
    index_path.write_text(index_path.read_text().replace("d/outside.safetensors", "inside.safetensors"))
    _, hw = load_layer(root, LAYER)
    np.testing.assert_array_equal(hw.up[14].view(np.uint16),
                                  t2["model.layers.1.mlp.experts.14.up_proj.weight"].view(np.uint16))

    # the single-file case and config.json
    config, t = small_qwen3(rng)
    single = write_checkpoint(tmp_path / "single", config, t)
    (single / "model.safetensors").rename(tmp_path / "w.safetensors")
    (single / "model.safetensors").symlink_to(tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors resolves to .*w\.safetensors, outside the "
                                              r"checkpoint directory"):
        load_layer(single, LAYER)
    (single / "model.safetensors").unlink()
    (tmp_path / "w.safetensors").rename(single / "w.safetensors")
    (single / "model.safetensors").symlink_to("w.safetensors")  # relative, inside
    load_layer(single, LAYER)
    (single / "config.json").rename(tmp_path / "config.json")
    (single / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json resolves to .*, outside the checkpoint directory"):
        load_layer(single, LAYER)


def test_hub_cache_snapshot_links_into_its_blobs_load(tmp_path):
    """A Hugging Face hub cache snapshot (models--*/snapshots/<rev>/*, links to ../../blobs/<hash>) is
    the usual checkpoint directory; its links into the same repo's blobs are followed, others not."""
    config, t = small_qwen3(np.random.default_rng(62))
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs" / "c0ffee").write_text(json.dumps(config))
    save_file(t, str(repo / "blobs" / "beef"))
    (snap / "config.json").symlink_to("../../blobs/c0ffee")
    (snap / "model.safetensors").symlink_to("../../blobs/beef")
    cfg, hw = load_layer(snap, LAYER)
    assert cfg == MoeConfig.from_hf(config, LAYER)
    (snap / "model.safetensors").unlink()
    save_file(t, str(tmp_path / "hub" / "elsewhere"))
    (snap / "model.safetensors").symlink_to("../../../elsewhere")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_layer(snap, LAYER)


def test_unreadable_json_files_are_checkpoint_errors(tmp_path):
    """config.json or the index that is not UTF-8, not JSON, or nested past the parser's depth:
    a CheckpointError naming the file (before: a raw UnicodeDecodeError or RecursionError)."""
    config, t = small_qwen3(np.random.default_rng(63))
    root = write_checkpoint(tmp_path, config, t, shards=[list(t)[:10], list(t)[10:]])
    for name in ("config.json", "model.safetensors.index.json"):
        good = (root / name).read_bytes()
        for bad, why in ((b"\xff\xfe{}", r"not UTF-8 text \(byte 0xFF at offset 0\)"),
                         (b"[" * 100_000, "invalid JSON"), (b'{"a": ' + b"1" * 5000 + b"}", "invalid JSON"),
                         (b"[1, 2]", "expected a JSON object, found list")):
            (root / name).write_bytes(bad)
            with pytest.raises(CheckpointError, match=rf"{name}: {why}"):
                load_layer(root, LAYER)
        (root / name).write_bytes(good)
    load_layer(root, LAYER)


# ----------------------------------------------------------------------------------
# sizes a config or a header claims: bounded by what the files hold
# ----------------------------------------------------------------------------------

def _sparse_safetensors(path, tensors: dict) -> None:
    """A safetensors file whose header claims `tensors` ({name: (dtype, shape)}), data left a hole
    (a sparse file: claims of gigabytes cost nothing on disk)."""
    header, off = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * {"BF16": 2, "F32": 4}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        f.truncate(8 + len(h) + off)


def test_a_billion_experts_is_refused_before_a_billion_names(tmp_path):
    """num_experts 1e9 with a router header to match (a 16 GB sparse file): refused at once naming
    the key and the count of tensors there are, without building 1e9 names (before: 6 GB, 39 s)."""
    import time
    import tracemalloc

    E = 10 ** 9
    config = hf_config_dict("qwen3_moe", num_experts=E, hidden_size=8, moe_intermediate_size=8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _sparse_safetensors(tmp_path / "model.safetensors", {"model.layers.1.mlp.gate.weight": ("BF16", (E, 8)),
                                                         "model.layers.1.mlp.experts.0.up_proj.weight": ("BF16", (8, 8))})
    tracemalloc.start()
    t = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=rf"MoeConfig\.num_experts={E} \(from the config\) exceeds the 2 "
                                                  r"tensors under 'model\.layers\.1\.mlp\.' in .*model\.safetensors"):
            load_layer(tmp_path, LAYER)
        with pytest.raises(CheckpointError, match=rf"num_experts={E} .* exceeds the 1 tensors"):
            # a zero-stride view: a router of 1e9 rows in 16 bytes
            load_layer_from_tensors(config, {"model.layers.1.mlp.gate.weight": np.broadcast_to(np.zeros((1, 8), BF16),
                                                                                               (E, 8))},
                                    "model.layers.1.mlp.")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t < 2 and peak < 10 << 20


def _inspect(argv, capsys) -> tuple[int, str, str]:
    from cupymoe.__main__ import main

    rc = main(["inspect", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_lists_the_layers_the_tensors_name_not_the_configs_count(tmp_path, capsys):
    """num_hidden_layers 1e9 had made inspect call MoeConfig.from_hf 1e9 times (until killed): it
    looks only at the layers whose tensors the checkpoint holds."""
    import time

    config = hf_config_dict("qwen3_moe", num_hidden_layers=10 ** 9)
    save_layer(tmp_path, config, LAYER, random_host_weights(MoeConfig.from_hf(config, LAYER),
                                                            np.random.default_rng(70)))
    t = time.perf_counter()
    rc, out, err = _inspect([tmp_path], capsys)
    assert rc == 0 and time.perf_counter() - t < 10, err
    assert "1000000000 layers (tensors here for 1), MoE layers: 1\n" in out and "layer 1: MoeConfig(" in out


def test_inspect_names_what_the_kernels_refuse(tmp_path, capsys):
    """A width the layer refuses (hidden_size 100: not a multiple of 8) is named by inspect, from
    config.kernel_limits_violations, the layer's own list."""
    config = hf_config_dict("qwen3_moe", hidden_size=100)
    save_layer(tmp_path, config, LAYER, random_host_weights(MoeConfig.from_hf(config, LAYER),
                                                            np.random.default_rng(71)))
    rc, out, err = _inspect([tmp_path], capsys)
    assert rc == 0, err
    assert ("  NOT served by the GPU kernels: MoeConfig.hidden_size=100: the kernels read 16-byte vectors, so it "
            "must be a multiple of 8\n") in out


@pytest.mark.parametrize("case", ["config_not_utf8", "index_not_utf8", "index_not_json", "config_nested",
                                  "shard_outside", "shard_absolute", "huge_header", "truncated_shard",
                                  "billion_experts", "nan_weight", "zero_scale"])
def test_inspect_ends_every_refusal_in_one_line(tmp_path, capsys, case):
    """Corrupt or hostile checkpoints: exit status 2 and one line `cupymoe inspect: <Error>: <message>`
    naming the file or tensor; before, raw UnicodeDecodeError / RecursionError / MemoryError
    tracebacks, or a silent load."""
    rng = np.random.default_rng(72)
    config, t = small_qwen3(rng)
    root = write_checkpoint(tmp_path / "c", config, t, shards=[list(t)[:10], list(t)[10:]])
    index = root / "model.safetensors.index.json"
    shard2 = root / "model-00002-of-00002.safetensors"
    want = "CheckpointError"
    if case == "config_not_utf8":
        (root / "config.json").write_bytes(b'{"model_type": "qwen3_moe\xff"}')
    elif case == "index_not_utf8":
        index.write_bytes(b"\xc3\x28")
    elif case == "index_not_json":
        index.write_text('{"weight_map": {')
    elif case == "config_nested":
        (root / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif case in ("shard_outside", "shard_absolute"):
        shard2.rename(tmp_path / "x.safetensors")
        name = "../x.safetensors" if case == "shard_outside" else str(tmp_path / "x.safetensors")
        index.write_text(index.read_text().replace("model-00002-of-00002.safetensors", name))
    elif case == "huge_header":
        shard2.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")
        want = "CheckpointFileError"
    elif case == "truncated_shard":
        shard2.write_bytes(shard2.read_bytes()[:100])
        want = "CheckpointFileError"
    elif case == "billion_experts":
        (root / "config.json").write_text(json.dumps({**config, "num_experts": 10 ** 9}))
    elif case == "nan_weight":
        bad = dict(t)
        bad["model.layers.1.mlp.experts.3.down_proj.weight"] = t["model.layers.1.mlp.experts.3.down_proj.weight"].copy()
        bad["model.layers.1.mlp.experts.3.down_proj.weight"][2, 2] = np.nan
        root = write_checkpoint(tmp_path / "n", config, bad)
        want = "WeightError"
    elif case == "zero_scale":
        config = config_for("deepseek_v3", "fp8_block")
        hw = random_host_weights(MoeConfig.from_hf(config, LAYER), rng, "fp8_block")
        hw.down.scale_inv[5, 1, 0] = 0.0
        tensors, _ = checkpoint._hub_tensors(MoeConfig.from_hf(config, LAYER), hw, "model.layers.1.mlp.")
        root = tmp_path / "z"
        root.mkdir()
        (root / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(root / "model.safetensors"))
        want = "WeightError"
    rc, out, err = _inspect([root], capsys)
    assert rc == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith(f"cupymoe inspect: {want}: "), err
    assert "Traceback" not in err


def test_memory_a_checkpoint_claims_is_a_checkpoint_error(tmp_path, capsys, monkeypatch):
    """A tensor or an expert stack the machine cannot hold is a CheckpointError naming it, and inspect
    ends a MemoryError from anywhere else in one line too (before: a MemoryError traceback)."""
    config, t = small_qwen3(np.random.default_rng(73))
    root = write_checkpoint(tmp_path, config, t)
    real_empty = np.empty

    def empty(shape, dtype=float, *a, **k):
        if isinstance(shape, tuple) and len(shape) == 3 and shape[0] == 15:  # the expert stacks
            raise MemoryError
        return real_empty(shape, dtype, *a, **k)

    monkeypatch.setattr(np, "empty", empty)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.\*\.gate_proj: a stack of shape "
                                              r"\(15, 64, 96\) bfloat16 does not fit in memory"):
        load_layer(root, LAYER)
    monkeypatch.setattr(np, "empty", real_empty)

    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(checkpoint, "load_layer", no_memory)
    rc, out, err = _inspect([root], capsys)
    assert rc == 2 and out == "" and err.startswith("cupymoe inspect: MemoryError: ") and err.count("\n") == 1


def test_malformed_inputs_found_by_the_property_suite_are_checkpoint_errors(tmp_path):
    """A mapping value that is no array (it had raised AttributeError on .shape) and an index naming a
    shard too long for the file system (OSError from the stat): CheckpointErrors naming them."""
    config, t = small_qwen3(np.random.default_rng(74))
    bad = {**t, "model.layers.1.mlp.experts.2.up_proj.weight": [1.0, 2.0]}
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj\.weight: expected shape \(64, 96\), found \(2,\) "
                                              "in the tensors mapping"):
        load_layer_from_tensors(config, bad, "model.layers.1.mlp.")
    root = write_checkpoint(tmp_path, config, t, shards=[list(t)[:10], list(t)[10:]])
    index_path = root / "model.safetensors.index.json"
    index_path.write_text(index_path.read_text().replace("model-00002-of-00002.safetensors", "x" * 300))
    with pytest.raises(CheckpointFileError, match=r"maps tensors to 'xxxx.*', which cannot be opened \(File name too long\)"):
        load_layer(root, LAYER)


def test_a_shared_expert_the_config_leaves_out_is_refused(tmp_path):
    """The checkpoint holds a shared expert and its gate but config.json says there is none
    (shared_expert_intermediate_size 0): serving without it would be wrong, so the loader refuses,
    naming the tensors; a config without the key at all is refused too (transformers' default for it
    is not 0)."""
    rng = np.random.default_rng(13)
    config = hf_config_dict("qwen2_moe")  # E=10, H=160, I=64, Is=96
    p = "model.layers.1.mlp."
    t = {f"{p}gate.weight": rand_bf16(rng, 10, 160),
         f"{p}shared_expert.gate_proj.weight": rand_bf16(rng, 96, 160),
         f"{p}shared_expert.up_proj.weight": rand_bf16(rng, 96, 160),
         f"{p}shared_expert.down_proj.weight": rand_bf16(rng, 160, 96),
         f"{p}shared_expert_gate.weight": rand_bf16(rng, 1, 160)}
    t.update(per_expert_bf16(rng, p, 10, 160, 64))
    with pytest.raises(CheckpointError, match=r"4 tensor\(s\) under 'model.layers.1.mlp.' belong to a part of the "
                                              r"qwen2_moe layer its config leaves out .*shared_expert_intermediate_size=0"):
        load_layer(write_checkpoint(tmp_path / "zero", {**config, "shared_expert_intermediate_size": 0}, t), LAYER)
    absent = {k: v for k, v in config.items() if k != "shared_expert_intermediate_size"}
    with pytest.raises(ConfigError, match="lacks shared_expert_intermediate_size"):
        load_layer(write_checkpoint(tmp_path / "absent", absent, t), LAYER)


def test_parts_that_change_nothing_load_with_a_warning(tmp_path, caplog):
    """What transformers saves for parts a config leaves out but that change nothing loads: a greedy
    DeepSeek router's all-zero e_score_correction_bias buffer and zero-width shared experts
    (n_shared_experts 0); a correction bias holding values under greedy routing is refused."""
    rng = np.random.default_rng(14)
    config = {**hf_config_dict("deepseek_v3"), "topk_method": "greedy", "n_shared_experts": 0}  # E=16, H=160, I=64
    p = "model.layers.1.mlp."
    t = {f"{p}gate.weight": rand_bf16(rng, 16, 160),
         f"{p}gate.e_score_correction_bias": np.zeros(16, np.float32),
         f"{p}shared_experts.gate_proj.weight": np.zeros((0, 160), BF16),
         f"{p}shared_experts.up_proj.weight": np.zeros((0, 160), BF16),
         f"{p}shared_experts.down_proj.weight": np.zeros((160, 0), BF16)}
    t.update(per_expert_bf16(rng, p, 16, 160, 64))
    with caplog.at_level("WARNING"):
        cfg, _ = load_layer(write_checkpoint(tmp_path / "zeros", config, t), LAYER)
    assert not cfg.has_shared_expert and not cfg.has_correction_bias
    assert any("were ignored" in r.getMessage() for r in caplog.records)
    t[f"{p}gate.e_score_correction_bias"] = np.full(16, 0.5, np.float32)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) under .*: model.layers.1.mlp.gate.e_score_correction_bias"):
        load_layer(write_checkpoint(tmp_path / "bias", config, t), LAYER)


def _qint8(torch, t):
    import warnings

    with warnings.catch_warnings():  # torch deprecates its quantized tensors; a checkpoint may still hold one
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(t, 0.1, 0, torch.qint8)


def test_torch_tensors_nothing_can_read_are_refused_by_name():
    """load_layer_from_tensors given a torch tensor on the meta device, a sparse one, or one of a dtype numpy
    has no name for (qint8): a CheckpointError naming the tensor, not torch's or numpy's own error."""
    torch = pytest.importorskip("torch")
    cfg = tiny_config("qwen3_moe")
    hw = random_host_weights(cfg, np.random.default_rng(0))
    config, prefix = hf_config_dict("qwen3_moe"), checkpoint.layer_prefix("qwen3_moe", LAYER)
    t = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in checkpoint._hub_tensors(cfg, hw, prefix)[0].items()}
    name = prefix + "gate.weight"
    cases = ((torch.empty(t[name].shape, device="meta"), "is on the meta device"),
             (t[name].to_sparse(), "a torch.sparse_coo tensor"),
             (_qint8(torch, t[name]), "dtype torch.qint8 is not served"))
    for bad, match in cases:
        with pytest.raises(CheckpointError, match=re.escape(name) + ".*" + match):
            load_layer_from_tensors(config, {**t, name: bad}, prefix)
