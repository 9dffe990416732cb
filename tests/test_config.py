"""CPU tests of cupymoe.config: MoeConfig validation and MoeConfig.from_hf per family.

The config.json dicts below are written out here with the published sizes of real
checkpoints (Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, Qwen3-Next-80B-A3B, DeepSeek-V3,
Mixtral-8x7B, gpt-oss-120b, LongCat-Flash), trimmed to the keys that matter plus a few
that must be ignored (attention sizes, vocab), so a mapping that reads the wrong key
shows up as a wrong value. Every error test checks that the message names the field
(or key) and the offending value, as DESIGN.md section 5 asks of every refusal.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest

from cupymoe.config import (ACTIVATIONS, SCORING_FUNCS, SUPPORTED_MODEL_TYPES, WEIGHT_FORMATS,
                            DenseLayerError, MoeConfig, UnsupportedModelError)
from cupymoe.errors import ConfigError
from cupymoe.testing import FAMILIES, hf_config_dict, tiny_config

BASE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def cfg(**kw) -> MoeConfig:
    return MoeConfig(**{**BASE, **kw})


def refused(field: str, value, **kw):
    """MoeConfig(**BASE, **kw) must raise ValueError naming `field` and `value`."""
    with pytest.raises(ValueError) as ei:
        cfg(**kw)
    msg = str(ei.value)
    assert f"{field}={value!r}" in msg, msg
    return msg


# ==================================================================================
# MoeConfig validation
# ==================================================================================

@pytest.mark.parametrize("field", ["hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_sizes_must_be_positive_integers(field, value):
    refused(field, value, **{field: value})


def test_k_larger_than_router_width():
    # R = E + Z: k = 9 > 8 + 0 is refused; with Z = 1, k = 9 = R is allowed
    msg = refused("num_experts_per_tok", 9, num_experts_per_tok=9)
    assert "8 + 0" in msg
    assert cfg(num_experts_per_tok=9, zero_expert_num=1).router_width == 9
    refused("num_experts_per_tok", 10, num_experts_per_tok=10, zero_expert_num=1)
    refused("zero_expert_num", -1, zero_expert_num=-1)


@pytest.mark.parametrize("field,value", [
    ("scoring_func", "tanh"), ("scoring_func", "Softmax"),
    ("hidden_act", "relu"), ("hidden_act", "swish"),  # aliases are from_hf's job, not MoeConfig's
    ("weight_format", "int4"), ("weight_format", "fp8"),
])
def test_unknown_names_refused(field, value):
    msg = refused(field, value, **{field: value})
    allowed = {"scoring_func": SCORING_FUNCS, "hidden_act": ACTIVATIONS, "weight_format": WEIGHT_FORMATS}[field]
    assert all(a in msg for a in allowed), msg  # and the message lists what is allowed


@pytest.mark.parametrize("value", [0.0, -2.5, float("inf"), float("nan")])
def test_routed_scaling_factor_positive_finite(value):
    with pytest.raises(ValueError, match=r"routed_scaling_factor=" + re.escape(repr(value))):
        cfg(routed_scaling_factor=value)


@pytest.mark.parametrize("value", [0.0, -1e-6, float("nan")])
def test_rms_norm_eps_positive(value):
    with pytest.raises(ValueError, match=r"rms_norm_eps=" + re.escape(repr(value))):
        cfg(rms_norm_eps=value)


def test_group_limited_routing_rules():
    G = dict(num_experts=16, num_experts_per_tok=4)
    refused("n_group", 0, n_group=0, **G)
    refused("n_group", 3, n_group=3, topk_group=1, **G)  # 3 does not divide 16
    refused("topk_group", 5, n_group=4, topk_group=5, **G)  # > n_group
    refused("topk_group", 0, n_group=4, topk_group=0, **G)  # < 1
    # 16 groups of 1 expert: the group score (sum of the top 2) is undefined
    refused("n_group", 16, n_group=16, topk_group=4, **G)
    # 4 groups of 4, keep 1: only 4 candidate experts, so k = 5 is impossible
    msg = refused("num_experts_per_tok", 5, n_group=4, topk_group=1, num_experts=16, num_experts_per_tok=5)
    assert "topk_group=1" in msg
    # zero (identity) experts have no group: refused with groups
    refused("n_group", 4, n_group=4, topk_group=2, zero_expert_num=2, **G)
    ok = cfg(n_group=4, topk_group=1, **G)  # k = 4 = 1 group x 4 experts: the limit itself
    assert (ok.n_group, ok.topk_group) == (4, 1)


def test_topk_then_softmax_rules():
    refused("topk_then_softmax", True, topk_then_softmax=True, has_correction_bias=True)
    refused("topk_then_softmax", True, topk_then_softmax=True, num_experts=16, n_group=4, topk_group=2)
    refused("scoring_func", "sigmoid", topk_then_softmax=True, scoring_func="sigmoid")
    assert cfg(topk_then_softmax=True, has_router_bias=True).topk_then_softmax


def test_hash_routing_rules():
    refused("hash_vocab_size", 0, hash_routing=True)
    refused("hash_vocab_size", -5, hash_routing=True, hash_vocab_size=-5)
    refused("hash_routing", True, hash_routing=True, hash_vocab_size=100, num_experts=16, n_group=4, topk_group=2)
    refused("topk_then_softmax", True, hash_routing=True, hash_vocab_size=100, topk_then_softmax=True)
    assert cfg(hash_routing=True, hash_vocab_size=100).hash_vocab_size == 100


def test_shared_expert_rules():
    refused("has_shared_expert_gate", True, has_shared_expert_gate=True)
    refused("shared_expert_intermediate_size", -1, shared_expert_intermediate_size=-1)
    c = cfg(shared_expert_intermediate_size=48, has_shared_expert_gate=True)
    assert c.has_shared_expert and c.has_shared_expert_gate


def test_swiglu_parameters_positive():
    """Each parameter refused under its own name (a bad alpha was once reported as the limit)."""
    refused("swiglu_limit", 0.0, swiglu_limit=0.0)
    refused("swiglu_alpha", -1.0, swiglu_alpha=-1.0)
    refused("swiglu_limit", float("nan"), swiglu_limit=float("nan"))  # NaN <= 0 is False
    refused("swiglu_limit", float("inf"), swiglu_limit=float("inf"))


def test_field_types_are_checked_naming_the_field():
    """A float where a count belongs, a string where a flag does, a NaN or an infinity, would
    slip past the range checks (1.5 zero experts give a router width of 9.5) or fail later
    with errors naming nothing: each is refused naming the field and value."""
    refused("zero_expert_num", 1.5, zero_expert_num=1.5)
    refused("n_group", 2.0, n_group=2.0)
    refused("ep_world_size", 2.0, ep_world_size=2.0)
    refused("num_experts_per_tok", True, num_experts_per_tok=True)
    refused("norm_topk_prob", "no", norm_topk_prob="no")
    refused("routed_scaling_factor", "2", routed_scaling_factor="2")
    refused("routed_scaling_factor", True, routed_scaling_factor=True)
    refused("rms_norm_eps", None, rms_norm_eps=None)
    refused("rms_norm_eps", float("inf"), rms_norm_eps=float("inf"))
    refused("scoring_func", 3, scoring_func=3)
    refused("quant_exclude", "lm_head", quant_exclude="lm_head")
    assert cfg(routed_scaling_factor=2).routed_scaling_factor == 2  # an int is a number
    assert cfg(quant_exclude=["lm_head"]).quant_exclude == ("lm_head",)


def test_expert_parallel_rules():
    refused("ep_world_size", 0, ep_world_size=0)
    msg = refused("ep_world_size", 3, ep_world_size=3)
    assert "num_experts=8" in msg
    refused("ep_rank", 2, ep_world_size=2, ep_rank=2)
    refused("ep_rank", -1, ep_world_size=2, ep_rank=-1)
    msg = refused("ep_rank", 4, ep_world_size=4, ep_rank=4)
    assert "0..3" in msg


# ----------------------------------------------------------------------------------
# valid configs: derived properties
# ----------------------------------------------------------------------------------

def test_defaults_and_derived_properties():
    c = cfg()
    assert c.router_width == 8 and not c.has_shared_expert
    assert (c.scoring_func, c.hidden_act, c.weight_format) == ("softmax", "silu", "bf16")
    assert (c.ep_world_size, c.ep_rank, c.experts_per_rank) == (1, 0, 8)
    assert c.owned_experts() == range(0, 8)
    assert cfg(zero_expert_num=3).router_width == 11
    assert cfg(shared_expert_intermediate_size=16).has_shared_expert


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_owned_experts_are_contiguous_blocks_covering_all(world):
    E = 8
    ranks = [cfg(ep_world_size=world, ep_rank=r) for r in range(world)]
    blocks = [c.owned_experts() for c in ranks]
    for r, (c, b) in enumerate(zip(ranks, blocks)):
        assert c.experts_per_rank == E // world
        assert b == range(r * (E // world), (r + 1) * (E // world))  # contiguous, in rank order
    assert [e for b in blocks for e in b] == list(range(E))  # disjoint, covers every expert


def test_replace_returns_a_validated_copy():
    c = cfg()
    d = c.replace(ep_world_size=2, ep_rank=1)
    assert d.owned_experts() == range(4, 8)
    assert c.ep_world_size == 1  # the original is untouched
    assert d == dataclasses.replace(c, ep_world_size=2, ep_rank=1)
    with pytest.raises(ValueError, match="ep_rank=2"):
        c.replace(ep_world_size=2, ep_rank=2)


def test_frozen_and_hashable():
    c = cfg(quant_exclude=["lm_head", "*.router"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_experts = 16
    assert c.quant_exclude == ("lm_head", "*.router")  # a list is stored as a tuple
    assert hash(c) == hash(cfg(quant_exclude=("lm_head", "*.router")))


# ==================================================================================
# MoeConfig.from_hf: real config.json contents
# ==================================================================================

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "vocab_size": 151936, "torch_dtype": "bfloat16",
}

QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
    "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "num_hidden_layers": 24, "rms_norm_eps": 1e-06, "vocab_size": 151936,
}

QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "num_hidden_layers": 48, "full_attention_interval": 4,
    "rms_norm_eps": 1e-06, "vocab_size": 151936,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "hidden_act": "silu", "num_hidden_layers": 61, "rms_norm_eps": 1e-06,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "vocab_size": 129280, "ep_size": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
    "num_experts_per_tok": 2, "hidden_act": "silu", "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "router_aux_loss_coef": 0.02, "vocab_size": 32000,
}

GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 128,
    "experts_per_token": 4, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
    "hidden_act": "silu", "num_hidden_layers": 36, "rms_norm_eps": 1e-05,
    "head_dim": 64, "sliding_window": 128, "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
}

LONGCAT_FLASH = {
    "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash",
    "hidden_size": 6144, "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048,
    "n_routed_experts": 512, "zero_expert_num": 256, "zero_expert_type": "identity",
    "moe_topk": 12, "routed_scaling_factor": 6.0, "norm_topk_prob": False, "router_bias": False,
    "hidden_act": "silu", "num_layers": 28, "num_hidden_layers": 56, "rms_norm_eps": 1e-05,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "vocab_size": 131072,
}


def _fields(c: MoeConfig) -> dict:
    return dataclasses.asdict(c)


def _expect(**kw) -> dict:
    """Every MoeConfig field: the defaults overridden by `kw` (so an unexpected
    non-default anywhere fails the comparison too)."""
    return _fields(MoeConfig(**kw))


def test_from_hf_qwen3_moe_30b_a3b():
    got = MoeConfig.from_hf(QWEN3_30B_A3B, 10)
    assert _fields(got) == _expect(
        model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, scoring_func="softmax", norm_topk_prob=True, hidden_act="silu",
        rms_norm_eps=1e-6)
    assert not got.has_shared_expert and got.router_width == 128


def test_from_hf_qwen2_moe_a27b():
    got = MoeConfig.from_hf(QWEN15_MOE_A27B, 0)
    assert _fields(got) == _expect(
        model_type="qwen2_moe", hidden_size=2048, moe_intermediate_size=1408, num_experts=60,
        num_experts_per_tok=4, scoring_func="softmax", norm_topk_prob=False, hidden_act="silu",
        rms_norm_eps=1e-6, shared_expert_intermediate_size=5632, has_shared_expert_gate=True)


def test_from_hf_qwen3_next_80b():
    got = MoeConfig.from_hf(QWEN3_NEXT_80B, 47)
    assert _fields(got) == _expect(
        model_type="qwen3_next", hidden_size=2048, moe_intermediate_size=512, num_experts=512,
        num_experts_per_tok=10, scoring_func="softmax", norm_topk_prob=True, hidden_act="silu",
        rms_norm_eps=1e-6, shared_expert_intermediate_size=512, has_shared_expert_gate=True)


def test_from_hf_norm_topk_prob_defaults_per_family():
    # transformers' defaults when the key is absent: Qwen3-Next True, Qwen2/Qwen3-MoE False
    for base, want in [(QWEN3_NEXT_80B, True), (QWEN3_30B_A3B, False), (QWEN15_MOE_A27B, False)]:
        d = {k: v for k, v in base.items() if k != "norm_topk_prob"}
        assert MoeConfig.from_hf(d).norm_topk_prob is want, base["model_type"]


def test_from_hf_deepseek_v3():
    got = MoeConfig.from_hf(DEEPSEEK_V3, 3)  # the first MoE layer (0..2 are dense)
    assert _fields(got) == _expect(
        model_type="deepseek_v3", hidden_size=7168, moe_intermediate_size=2048, num_experts=256,
        num_experts_per_tok=8, scoring_func="sigmoid", has_correction_bias=True, n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
        shared_expert_intermediate_size=2048,  # I * n_shared_experts = 2048 * 1, ungated
        hidden_act="silu", rms_norm_eps=1e-6, weight_format="fp8_block")
    assert not got.has_shared_expert_gate


def test_from_hf_deepseek_shared_experts_and_topk_method():
    two = MoeConfig.from_hf({**DEEPSEEK_V3, "n_shared_experts": 2})
    assert two.shared_expert_intermediate_size == 4096  # 2048 * 2
    none = MoeConfig.from_hf({**DEEPSEEK_V3, "n_shared_experts": 0})
    assert not none.has_shared_expert
    # only noaux_tc has the e_score_correction_bias; greedy takes the top k over all experts,
    # whatever n_group the config also carries (DeepSeek's MoEGate ignores it there)
    greedy = MoeConfig.from_hf({**DEEPSEEK_V3, "topk_method": "greedy", "n_group": 1, "topk_group": 1})
    assert not greedy.has_correction_bias and greedy.n_group == 1
    greedy = MoeConfig.from_hf({**DEEPSEEK_V3, "topk_method": "greedy"})  # n_group 8 in the dict
    assert not greedy.has_correction_bias and (greedy.n_group, greedy.topk_group) == (1, 1)
    # group_limited_greedy (max-per-group scores) or a misspelling would be routed as neither
    for method in ("group_limited_greedy", "noaux-tc"):
        with pytest.raises(ValueError, match=f"topk_method='{method}': supported are 'noaux_tc' and 'greedy'"):
            MoeConfig.from_hf({**DEEPSEEK_V3, "topk_method": method})


def test_from_hf_refuses_mistyped_values_naming_the_key():
    """config.json values of the wrong kind are refused naming the key, not truncated (128.9
    experts), read as truthy ("false" -> True) or failed on in int() with no key named."""
    cases = [
        ({**QWEN3_30B_A3B, "norm_topk_prob": "false"}, "norm_topk_prob='false': expected true or false"),
        ({**DEEPSEEK_V3, "norm_topk_prob": "false"}, "norm_topk_prob='false': expected true or false"),
        ({**LONGCAT_FLASH, "router_bias": "false"}, "router_bias='false': expected true or false"),
        ({**QWEN3_30B_A3B, "num_experts": 128.9}, "num_experts=128.9: expected a whole number"),
        ({**QWEN3_30B_A3B, "num_experts": "eight"}, "num_experts='eight': expected a whole number"),
        ({**QWEN3_30B_A3B, "moe_intermediate_size": 767.5}, "moe_intermediate_size=767.5: expected a whole number"),
        ({**QWEN3_30B_A3B, "hidden_size": [2048]}, r"hidden_size=\[2048\]: expected a whole number"),
        ({**QWEN3_30B_A3B, "decoder_sparse_step": 2.5}, "decoder_sparse_step=2.5: expected a whole number"),
        ({**DEEPSEEK_V3, "n_shared_experts": 1.5}, "n_shared_experts=1.5: expected a whole number"),
        ({**DEEPSEEK_V3, "routed_scaling_factor": "x"}, "routed_scaling_factor='x': expected a finite number"),
        ({**LONGCAT_FLASH, "zero_expert_num": 255.7}, "zero_expert_num=255.7: expected a whole number"),
        ({**GPT_OSS_120B, "swiglu_limit": float("nan")}, "swiglu_limit=nan: expected a finite number"),
        ({**QWEN3_30B_A3B, "quantization_config": "fp8"}, "quantization_config='fp8': expected an object"),
        # a JSON integer past float's range: refused by name, not an OverflowError from math.isfinite
        ({**QWEN3_30B_A3B, "rms_norm_eps": 10 ** 400}, r"rms_norm_eps=10{400}: expected a finite number"),
        ({**DEEPSEEK_V3, "routed_scaling_factor": -10 ** 400}, r"routed_scaling_factor=-10{400}: expected a finite"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            MoeConfig.from_hf(config, 3)  # an MoE layer of each (deepseek-v3's first)
    # a whole number written as a float is that number
    assert MoeConfig.from_hf({**QWEN3_30B_A3B, "num_experts": 128.0}, 3).num_experts == 128


def test_from_hf_refuses_zero_false_or_empty_counts_instead_of_reading_a_default():
    """0, false or "" for a group count, a layer step or a shared / zero expert count is refused by
    name: read as `value or default` they became 1 (deepseek-v3 routed in one group, a qwen3
    decoder_sparse_step of 0 serving every layer as MoE) where transformers' own code divides by them
    or masks every group. An explicit null keeps its documented meaning."""
    at_least = [
        (DEEPSEEK_V3, "n_group", 1), (DEEPSEEK_V3, "topk_group", 1), (DEEPSEEK_V3, "moe_layer_freq", 1),
        (QWEN3_30B_A3B, "decoder_sparse_step", 1), (DEEPSEEK_V3, "first_k_dense_replace", 0),
        (DEEPSEEK_V3, "n_shared_experts", 0), (LONGCAT_FLASH, "zero_expert_num", 0),
    ]
    for base, key, least in at_least:
        for bad in ([0] if least else []) + [-1, False, ""]:
            expect = rf"config.json {key}={bad!r}: " + ("must be at least" if isinstance(bad, int) and bad is not False
                                                          else "expected a whole number")
            with pytest.raises(ConfigError, match=expect):
                MoeConfig.from_hf({**base, key: bad}, 3)
    # null: no shared expert, no zero experts, no dense layers first, steps of 1
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "n_shared_experts": None}, 3).shared_expert_intermediate_size == 0
    assert MoeConfig.from_hf({**LONGCAT_FLASH, "zero_expert_num": None}, 0).zero_expert_num == 0
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "first_k_dense_replace": None}, 0).num_experts == 256
    assert MoeConfig.from_hf({**QWEN3_30B_A3B, "decoder_sparse_step": None}, 0).num_experts == 128
    cfg = MoeConfig.from_hf({**DEEPSEEK_V3, "n_group": 8, "topk_group": 4}, 3)
    assert (cfg.n_group, cfg.topk_group) == (8, 4)
    for bad in (0, "", False):  # no list of layers, not an empty one
        with pytest.raises(ConfigError, match=rf"mlp_only_layers={bad!r}: expected a list of layer indices"):
            MoeConfig.from_hf({**QWEN3_30B_A3B, "mlp_only_layers": bad}, 0)
    no_count = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match=r"layer_idx=-1: a decoder layer's index is >= 0"):
        MoeConfig.from_hf(no_count, -1)


def test_from_hf_refuses_a_config_that_is_no_mapping_and_overrides_no_field_has():
    with pytest.raises(ConfigError, match="config: expected a config.json object .a mapping., found list"):
        MoeConfig.from_hf([], 0)
    with pytest.raises(ConfigError, match=r"overrides \['num_expert'\]: no such MoeConfig field"):
        MoeConfig.from_hf(QWEN3_30B_A3B, 0, num_expert=4)
    assert MoeConfig.from_hf(QWEN3_30B_A3B, 0, ep_world_size=2, ep_rank=1).ep_rank == 1


def test_from_hf_quant_method_as_a_string_enum():
    """A loaded model's config.to_dict() keeps transformers' QuantizationMethod enum (a str subclass whose
    str() is 'QuantizationMethod.FP8'): its value is what counts."""
    import enum

    class QuantizationMethod(str, enum.Enum):
        FP8 = "fp8"

    q = {"quant_method": QuantizationMethod.FP8, "weight_block_size": (128, 128)}
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "quantization_config": q}, 3).weight_format == "fp8_block"


def test_from_hf_exclude_list_given_as_one_string_is_one_pattern():
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": "lm_head"}
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "quantization_config": q}, 3).quant_exclude == ("lm_head",)
    q = {**q, "modules_to_not_convert": ["lm_head", 7]}
    with pytest.raises(ValueError, match=r"modules_to_not_convert=\['lm_head', 7\]: expected a list"):
        MoeConfig.from_hf({**DEEPSEEK_V3, "quantization_config": q}, 3)


def test_from_hf_mixtral_8x7b():
    got = MoeConfig.from_hf(MIXTRAL_8X7B, 31)
    assert _fields(got) == _expect(
        model_type="mixtral", hidden_size=4096, moe_intermediate_size=14336, num_experts=8,
        num_experts_per_tok=2, scoring_func="softmax", norm_topk_prob=True, hidden_act="silu",
        rms_norm_eps=1e-5)


def test_from_hf_gpt_oss_120b():
    got = MoeConfig.from_hf(GPT_OSS_120B, 35)
    assert _fields(got) == _expect(
        model_type="gpt_oss", hidden_size=2880, moe_intermediate_size=2880, num_experts=128,
        num_experts_per_tok=4, topk_then_softmax=True, has_router_bias=True, has_expert_bias=True,
        hidden_act="swiglu_oai",  # config.json's "silu" is not what gpt-oss computes
        swiglu_alpha=1.702, swiglu_limit=7.0, rms_norm_eps=1e-5, weight_format="mxfp4",
        quant_exclude=("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"))
    assert MoeConfig.from_hf({**GPT_OSS_120B, "swiglu_limit": 3.5}).swiglu_limit == 3.5
    assert MoeConfig.from_hf({**GPT_OSS_120B, "swiglu_alpha": 1.5}).swiglu_alpha == 1.5  # transformers >= 5.18 reads it


def test_from_hf_longcat_flash():
    got = MoeConfig.from_hf(LONGCAT_FLASH, 27)
    assert _fields(got) == _expect(
        model_type="longcat_flash", hidden_size=6144, moe_intermediate_size=2048, num_experts=512,
        num_experts_per_tok=12, zero_expert_num=256, scoring_func="softmax", has_correction_bias=True,
        norm_topk_prob=False, routed_scaling_factor=6.0, hidden_act="silu", rms_norm_eps=1e-5)
    assert got.router_width == 768  # 512 routed + 256 identity experts


def test_from_hf_longcat_non_identity_zero_experts_refused():
    with pytest.raises(ValueError, match="zero_expert_type='const'"):
        MoeConfig.from_hf({**LONGCAT_FLASH, "zero_expert_type": "const"})


def test_from_hf_longcat_router_bias_not_silently_dropped():
    # LongCat's config (transformers' LongcatFlashConfig, SGLang's LongCat router) has
    # `router_bias`; True puts a bias on `mlp.router.classifier`, added to the logits.
    # Published checkpoints say false (handled above); for true, mapping it to
    # has_router_bias=True or refusing it by name are both correct. Keeping
    # has_router_bias=False is not: the logits would lack the bias with no error.
    try:
        got = MoeConfig.from_hf({**LONGCAT_FLASH, "router_bias": True})
    except ValueError as e:
        assert "router_bias" in str(e)
    else:
        assert got.has_router_bias


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_tiny_testing_configs(family):
    # cupymoe.testing promises from_hf(hf_config_dict(f)) == tiny_config(f)
    assert MoeConfig.from_hf(hf_config_dict(family)) == tiny_config(family)


def test_from_hf_does_not_mutate_its_input():
    d = copy.deepcopy(DEEPSEEK_V3)
    MoeConfig.from_hf(d, 5, ep_world_size=2, ep_rank=1)
    assert d == DEEPSEEK_V3


# ----------------------------------------------------------------------------------
# both spellings of aliased keys (transformers' attribute_map)
# ----------------------------------------------------------------------------------

def _respell(d: dict, old: str, new: str) -> dict:
    out = {k: v for k, v in d.items() if k != old}
    out[new] = d[old]
    return out


@pytest.mark.parametrize("base,old,new", [
    (QWEN3_30B_A3B, "num_experts", "num_local_experts"),
    (QWEN15_MOE_A27B, "num_experts", "num_local_experts"),
    (QWEN3_NEXT_80B, "num_experts", "num_local_experts"),
    (DEEPSEEK_V3, "n_routed_experts", "num_local_experts"),
    (MIXTRAL_8X7B, "num_local_experts", "num_experts"),
    (GPT_OSS_120B, "num_local_experts", "num_experts"),
    (LONGCAT_FLASH, "n_routed_experts", "num_experts"),
    (LONGCAT_FLASH, "n_routed_experts", "num_local_experts"),
    (LONGCAT_FLASH, "moe_topk", "num_experts_per_tok"),
    (LONGCAT_FLASH, "expert_ffn_hidden_size", "moe_intermediate_size"),
])
def test_aliased_keys_give_equal_configs(base, old, new):
    respelled = _respell(base, old, new)
    assert old not in respelled
    assert MoeConfig.from_hf(respelled) == MoeConfig.from_hf(base)


@pytest.mark.parametrize("present", [("experts_per_token",), ("num_experts_per_tok",),
                                     ("experts_per_token", "num_experts_per_tok")])
def test_gpt_oss_experts_per_token_spellings(present):
    d = {k: v for k, v in GPT_OSS_120B.items() if k not in ("experts_per_token", "num_experts_per_tok")}
    d.update({k: 4 for k in present})
    assert MoeConfig.from_hf(d) == MoeConfig.from_hf(GPT_OSS_120B)
    assert MoeConfig.from_hf(d).num_experts_per_tok == 4


def test_missing_key_names_all_spellings():
    d = {k: v for k, v in DEEPSEEK_V3.items() if k != "n_routed_experts"}
    with pytest.raises(KeyError, match="n_routed_experts / num_local_experts"):
        MoeConfig.from_hf(d)


def test_from_hf_refusals_are_cupymoe_errors():
    """Every config.json refusal is a cupymoe.ConfigError (before, bare ValueError / KeyError
    escaped from the key readers), and keeps its built-in base for older callers."""
    from cupymoe import ConfigError, Error
    from cupymoe.config import MissingConfigKeyError

    d = {k: v for k, v in DEEPSEEK_V3.items() if k != "n_routed_experts"}
    with pytest.raises(MissingConfigKeyError) as ei:
        MoeConfig.from_hf(d)
    assert isinstance(ei.value, KeyError) and str(ei.value).startswith("config.json of model_type")
    bad = [{**DEEPSEEK_V3, "hidden_size": 7.5}, {**DEEPSEEK_V3, "norm_topk_prob": "false"},
           {**DEEPSEEK_V3, "routed_scaling_factor": "x"}, {**DEEPSEEK_V3, "topk_method": "sinkhorn"},
           {**DEEPSEEK_V3, "hidden_act": "relu9"}, {**DEEPSEEK_V3, "quantization_config": [1]},
           {**DEEPSEEK_V3, "quantization_config": {"quant_method": "awq"}}]
    for d in bad:
        with pytest.raises(ConfigError) as ei:
            MoeConfig.from_hf(d)
        assert isinstance(ei.value, (Error, ValueError))
    with pytest.raises(ConfigError, match="layer_idx=99 is outside"):
        MoeConfig.from_hf(DEEPSEEK_V3, 99)
    for idx in ("0", 0.5, True):  # a layer index is a whole number, never truncated or parsed
        with pytest.raises(ConfigError, match=f"layer_idx={idx!r}: must be a whole number"):
            MoeConfig.from_hf(DEEPSEEK_V3, idx)


def test_from_hf_absent_keys_take_transformers_class_defaults():
    """A hand-written config.json that leaves out keys transformers' config classes default
    (transformers 5.24: DeepseekV3Config first_k_dense_replace 3; LongcatFlashConfig
    zero_expert_num 256, routed_scaling_factor 6.0) reads as transformers would read it.
    Before, they defaulted to 0 dense layers, 0 zero experts and a scaling of 1.0."""
    d = {k: v for k, v in DEEPSEEK_V3.items() if k != "first_k_dense_replace"}
    for layer in (0, 1, 2):
        with pytest.raises(DenseLayerError, match=f"layer {layer} "):
            MoeConfig.from_hf(d, layer)
    assert MoeConfig.from_hf(d, 3).num_experts == 256
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "first_k_dense_replace": None}, 0).num_experts == 256  # null: none
    lc = {k: v for k, v in LONGCAT_FLASH.items() if k not in ("zero_expert_num", "routed_scaling_factor")}
    got = MoeConfig.from_hf(lc)
    assert got.zero_expert_num == 256 and got.routed_scaling_factor == 6.0
    assert MoeConfig.from_hf({**LONGCAT_FLASH, "zero_expert_num": None}).zero_expert_num == 0  # null: none


# ----------------------------------------------------------------------------------
# layer indices: dense layers, range, unknown families
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [0, 1, 2])
def test_deepseek_first_k_dense_replace(layer):
    with pytest.raises(DenseLayerError, match=f"layer {layer} .*deepseek_v3.*dense"):
        MoeConfig.from_hf(DEEPSEEK_V3, layer)


def test_deepseek_moe_layer_freq():
    # MoE where layer >= first_k_dense_replace (3) and layer % moe_layer_freq (2) == 0
    d = {**DEEPSEEK_V3, "moe_layer_freq": 2}
    for layer in (3, 5, 7):
        with pytest.raises(DenseLayerError, match=f"layer {layer} "):
            MoeConfig.from_hf(d, layer)
    for layer in (4, 6, 60):
        assert MoeConfig.from_hf(d, layer).num_experts == 256
    assert MoeConfig.from_hf(DEEPSEEK_V3, 60).num_experts == 256  # freq 1: every layer >= 3


def test_qwen_mlp_only_layers():
    for base in (QWEN3_30B_A3B, QWEN15_MOE_A27B, QWEN3_NEXT_80B):
        d = {**base, "mlp_only_layers": [0, 5]}
        for layer in (0, 5):
            with pytest.raises(DenseLayerError, match=f"layer {layer} .*{base['model_type']}"):
                MoeConfig.from_hf(d, layer)
        assert MoeConfig.from_hf(d, 4).num_experts == base["num_experts"]


def test_qwen_decoder_sparse_step():
    # transformers: sparse iff (layer + 1) % decoder_sparse_step == 0 -> with step 2 the
    # odd layers 1, 3, ... are MoE and the even ones dense
    d = {**QWEN3_30B_A3B, "decoder_sparse_step": 2}
    for layer in (0, 2, 46):
        with pytest.raises(DenseLayerError):
            MoeConfig.from_hf(d, layer)
    for layer in (1, 3, 47):
        assert MoeConfig.from_hf(d, layer).num_experts == 128


@pytest.mark.parametrize("base,layer", [
    (QWEN3_30B_A3B, 48), (QWEN3_30B_A3B, -1), (DEEPSEEK_V3, 61), (MIXTRAL_8X7B, 32),
    (GPT_OSS_120B, 36), (QWEN3_NEXT_80B, 100),
])
def test_layer_index_out_of_range(base, layer):
    with pytest.raises(ValueError, match=f"layer_idx={layer}") as ei:
        MoeConfig.from_hf(base, layer)
    assert not isinstance(ei.value, DenseLayerError)


def test_longcat_counts_blocks_in_num_layers():
    # 28 blocks (num_layers) of which num_hidden_layers = 56 counts the attention
    # sub-layers: layer 30 exists in the 56-count but not as an MoE block.
    with pytest.raises(ValueError, match=r"layer_idx=30 .*0\.\.27"):
        MoeConfig.from_hf(LONGCAT_FLASH, 30)
    assert MoeConfig.from_hf(LONGCAT_FLASH, 27).num_experts == 512


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v2", None])
def test_unknown_model_type(model_type):
    d = {**MIXTRAL_8X7B, "model_type": model_type}
    if model_type is None:
        del d["model_type"]
    with pytest.raises(UnsupportedModelError) as ei:
        MoeConfig.from_hf(d)
    msg = str(ei.value)
    assert repr(model_type) in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES), msg
    assert isinstance(ei.value, ValueError)


# ----------------------------------------------------------------------------------
# quantization_config, hidden_act, overrides
# ----------------------------------------------------------------------------------

def test_fp8_block_quantization():
    assert MoeConfig.from_hf(DEEPSEEK_V3).weight_format == "fp8_block"
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    got = MoeConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": q})
    assert got.weight_format == "fp8_block" and got.quant_exclude == ("lm_head",)


@pytest.mark.parametrize("block", [[64, 64], [128, 64], None, 128, "128"])
def test_fp8_other_block_sizes_refused(block):
    """Named as config.json gives it (a bare 128 had raised a TypeError from list())."""
    q = {"quant_method": "fp8", "weight_block_size": block}
    with pytest.raises(ValueError, match=re.escape(f"weight_block_size={block!r}")):
        MoeConfig.from_hf({**DEEPSEEK_V3, "quantization_config": q})


@pytest.mark.parametrize("scheme", ["static", None, "Dynamic"])
def test_fp8_activation_schemes_other_than_dynamic_refused(scheme):
    """A static scheme's per-tensor input scale would be left out, the rows scaled dynamically instead."""
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": scheme}
    with pytest.raises(ConfigError, match=re.escape(f"activation_scheme={scheme!r}")):
        MoeConfig.from_hf({**DEEPSEEK_V3, "quantization_config": q})
    q["activation_scheme"] = "dynamic"
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "quantization_config": q}).weight_format == "fp8_block"


def test_modelopt_nvfp4():
    q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"], "kv_cache_quant_algo": None}
    got = MoeConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": q})
    assert got.weight_format == "nvfp4"
    assert got.quant_exclude == ("lm_head", "model.layers.*.mlp.gate")


@pytest.mark.parametrize("q,needle", [
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo='FP8'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size=32"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "awq"}, "quant_method='awq'"),
])
def test_unsupported_quantization_refused(q, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        MoeConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": q})


def test_mxfp4_and_unquantized():
    assert MoeConfig.from_hf(GPT_OSS_120B).weight_format == "mxfp4"
    plain = {k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"}
    got = MoeConfig.from_hf(plain)
    assert got.weight_format == "bf16" and got.quant_exclude == ()


@pytest.mark.parametrize("act,want", [("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"),
                                      ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh")])
def test_hidden_act_aliases(act, want):
    assert MoeConfig.from_hf({**QWEN3_30B_A3B, "hidden_act": act}).hidden_act == want
    assert MoeConfig.from_hf({**DEEPSEEK_V3, "hidden_act": act}).hidden_act == want


def test_hidden_act_unknown_refused():
    with pytest.raises(ValueError, match="hidden_act='relu2'"):
        MoeConfig.from_hf({**MIXTRAL_8X7B, "hidden_act": "relu2"})


def test_overrides_applied_and_validated():
    got = MoeConfig.from_hf(QWEN3_30B_A3B, 0, ep_world_size=2, ep_rank=1)
    assert (got.ep_world_size, got.ep_rank, got.experts_per_rank) == (2, 1, 64)
    assert got.owned_experts() == range(64, 128)
    assert got == MoeConfig.from_hf(QWEN3_30B_A3B).replace(ep_world_size=2, ep_rank=1)
    with pytest.raises(ValueError, match="ep_world_size=3"):  # 3 does not divide 128
        MoeConfig.from_hf(QWEN3_30B_A3B, ep_world_size=3)
    with pytest.raises(ValueError, match="ep_rank=2"):
        MoeConfig.from_hf(QWEN3_30B_A3B, ep_world_size=2, ep_rank=2)
    # an override beats the mapped value
    assert MoeConfig.from_hf(DEEPSEEK_V3, routed_scaling_factor=1.0).routed_scaling_factor == 1.0


def test_kernel_limits_violations_name_each_width_the_layer_refuses():
    """config.kernel_limits_violations lists, in words, every reason MoeLayer refuses a config
    (widths not a multiple of 8, more than 32 groups, k > 64, R > 4096); empty when served."""
    from cupymoe.config import kernel_limits_violations

    for family in FAMILIES:
        assert kernel_limits_violations(tiny_config(family)) == [], family
    got = kernel_limits_violations(cfg(hidden_size=100, moe_intermediate_size=36, shared_expert_intermediate_size=20))
    assert got == [
        "MoeConfig.hidden_size=100: the kernels read 16-byte vectors, so it must be a multiple of 8",
        "MoeConfig.moe_intermediate_size=36: the kernels read 16-byte vectors, so it must be a multiple of 8",
        "MoeConfig.shared_expert_intermediate_size=20: the kernels read 16-byte vectors, so it must be a multiple of 8",
    ]
    assert kernel_limits_violations(cfg(num_experts=128, n_group=64, topk_group=2, num_experts_per_tok=4)) == [
        "MoeConfig.n_group=64: the top-k kernel handles at most 32 groups"]
    assert kernel_limits_violations(cfg(num_experts=128, n_group=32, topk_group=2, num_experts_per_tok=4)) == []
    assert kernel_limits_violations(cfg(num_experts=100, num_experts_per_tok=65)) == [
        "MoeConfig.num_experts_per_tok=65: the top-k kernel serves k <= 64"]
    assert kernel_limits_violations(cfg(num_experts=4096, zero_expert_num=1, num_experts_per_tok=64)) == [
        "router width R = num_experts + zero_expert_num = 4097: the top-k kernel serves R <= 4096"]
    assert kernel_limits_violations(cfg(num_experts=4096, num_experts_per_tok=64)) == []


def test_malformed_values_found_by_the_property_suite_are_config_errors():
    """Each of these escaped as a TypeError or OverflowError (tests/test_properties.py drew them)."""
    from cupymoe import ConfigError

    with pytest.raises(ConfigError, match=r"MoeConfig\.quant_exclude=0: must be a list or tuple"):
        cfg(quant_exclude=0)
    with pytest.raises(ConfigError, match=r"MoeConfig\.num_experts=9223372036854775808: must be below 2\*\*31"):
        cfg(num_experts=2 ** 63)
    with pytest.raises(ConfigError, match=r"config\.json mlp_only_layers=1: expected a list of layer indices"):
        MoeConfig.from_hf(hf_config_dict("qwen3_moe", mlp_only_layers=1), 0)
