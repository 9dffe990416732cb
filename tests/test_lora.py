"""CPU tests of cupymoe.lora: PEFT adapter directories (written here) -> LoraWeights, and every refusal.

Evidence: tensors written under literal PEFT names (`base_model.model.` + the hub module name of
docs/FORMATS.md) come back bit for bit (bf16 -> float32 is exact) under the right LoraKey, with
PEFT's scale; each thing the layer cannot serve is refused by LoraError naming the key and value.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

from _lora import random_lora, write_peft
from cupymoe import testing
from cupymoe.errors import Error, LoraError
from cupymoe.lora import LoraKey, LoraModule, LoraTarget, LoraWeights, load_peft, lora_scale

BF16 = ml_dtypes.bfloat16
LAYER = 3


def _cfg(family="qwen2_moe", **kw):
    return testing.tiny_config(family, **kw)


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_round_trip_every_family(tmp_path, family):
    cfg = _cfg(family)
    rng = np.random.default_rng(1)
    lw = random_lora(cfg, rng, rank=3, layer_idx=LAYER)
    got = load_peft(write_peft(tmp_path / "a", lw, {"r": 3, "lora_alpha": 6}), LAYER, cfg)
    assert set(got.modules) == set(lw.modules)
    for key, m in lw.modules.items():
        g = got.modules[key]
        assert g.name == m.name and g.scale == 2.0
        np.testing.assert_array_equal(g.a, m.a)
        np.testing.assert_array_equal(g.b, m.b)
    # what each family offers: its router always, per-expert modules unless fused (gpt-oss)
    assert LoraKey(LoraTarget.ROUTER) in got.modules
    assert any(k.target.per_expert for k in got.modules) == (family != "gpt_oss")
    assert (LoraKey(LoraTarget.SHARED_DOWN) in got.modules) == cfg.has_shared_expert


def test_literal_hub_names(tmp_path):
    """Names written by hand as FORMATS.md spells them, including mixtral's w1/w3/w2."""
    from safetensors.numpy import save_file

    cfg = _cfg("mixtral")
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    a = np.arange(2 * H, dtype=np.float32).reshape(2, H) / 64
    b = np.ones((I, 2), np.float32)
    d = tmp_path / "m"
    d.mkdir()
    save_file({f"base_model.model.model.layers.{LAYER}.block_sparse_moe.experts.1.w3.lora_A.weight": a,
               f"base_model.model.model.layers.{LAYER}.block_sparse_moe.experts.1.w3.lora_B.weight": b,
               "base_model.model.model.layers.0.block_sparse_moe.gate.lora_A.weight": np.zeros((9, 9), np.float32),
               f"base_model.model.model.layers.{LAYER}.self_attn.q_proj.lora_A.weight": np.zeros((2, 5), np.float32)},
              str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "use_rslora": True}))
    got = load_peft(d, LAYER, cfg)
    assert list(got.modules) == [LoraKey(LoraTarget.UP, 1)]  # other layers and attention ignored
    m = got.get("up", 1)
    assert m.scale == 4 / math.sqrt(2) and m.rank == 2
    np.testing.assert_array_equal(m.a, a)


def test_rank_and_alpha_patterns(tmp_path):
    cfg = _cfg("qwen3_moe")
    rng = np.random.default_rng(2)
    lw4 = random_lora(cfg, rng, rank=4, layer_idx=LAYER, targets=["gate", "down"], experts=[0])
    lw2 = random_lora(cfg, rng, rank=2, layer_idx=LAYER, targets=["router"])
    lw = LoraWeights({**lw4.modules, **lw2.modules})
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"mlp.gate": 2},
              "alpha_pattern": {"experts.0.down_proj": 2, "mlp.gate": 1}}
    got = load_peft(write_peft(tmp_path / "p", lw, config), LAYER, cfg)
    assert got.get("router").scale == 1 / 2  # rank 2 and alpha 1 from the patterns
    assert got.get("gate", 0).scale == 8 / 4  # "mlp.gate" does not match a dotted suffix of experts.0.gate_proj
    assert got.get("down", 0).scale == 2 / 4
    assert got.max_rank == 4
    with pytest.raises(LoraError, match=r"rank 4 exceeds the maximum rank 3"):
        load_peft(tmp_path / "p", LAYER, cfg, max_rank=3)


def test_regular_expression_patterns_match_as_peft_matches_them(tmp_path):
    """Keys with groups, classes and repeats (matched in a child interpreter, bounded_match) give the
    same ranks and alphas as PEFT's regular expressions: the first key in the file's order that matches
    the name or a dotted suffix of it."""
    cfg = _cfg("qwen3_moe")
    rng = np.random.default_rng(3)
    gate_down = random_lora(cfg, rng, rank=2, layer_idx=LAYER, targets=["gate", "down"], experts=[0, 1])
    lw = LoraWeights({**gate_down.modules,
                      **random_lora(cfg, rng, rank=4, layer_idx=LAYER, targets=["up"], experts=[1]).modules})
    config = {"r": 2, "lora_alpha": 8, "rank_pattern": {r"experts\.[1-9]\d*\.up_proj": 4},
              "alpha_pattern": {r"experts\.(0|1)\.(gate|down)_proj": 2, r".*down_proj": 6}}
    got = load_peft(write_peft(tmp_path / "p", lw, config), LAYER, cfg)
    assert got.get("up", 1).rank == 4 and got.get("up", 1).scale == 8 / 4
    assert [got.get(t, e).scale for t in ("gate", "down") for e in (0, 1)] == [1.0] * 4  # the first key wins


@pytest.mark.parametrize("key", ["(.+)+Q", "(.?){30}.{30}Q"])
def test_a_pattern_that_backtracks_without_bound_is_refused_in_bounded_time(tmp_path, monkeypatch, key):
    """`(.+)+Q` against a module name backtracks for hours in Python's re (holding the GIL), thirty
    optional characters 2^30 ways; the match runs in a child killed past PATTERN_MATCH_S, and the key is named."""
    import re
    import time

    from cupymoe import lora

    monkeypatch.setattr(lora, "PATTERN_MATCH_S", 1.0)
    cfg = _cfg("qwen3_moe")
    lw = random_lora(cfg, np.random.default_rng(4), rank=2, layer_idx=LAYER, targets=["gate"], experts=[0])
    t0 = time.monotonic()
    _refused(tmp_path, cfg, lw, {"r": 2, "lora_alpha": 2, "rank_pattern": {"gate_proj": 2, key: 2}},
             match=rf"rank_pattern key\(s\) \[{re.escape(repr(key))}\]: matching \d+ names took over 1 s .*: refused")
    assert time.monotonic() - t0 < 10


def _refused(tmp_path, cfg, lw, config=None, extra=None, match=""):
    d = write_peft(tmp_path / "r", lw, config, extra=extra)
    with pytest.raises(LoraError, match=match) as e:
        load_peft(d, LAYER, cfg)
    assert isinstance(e.value, Error)
    return str(e.value)


@pytest.mark.parametrize("key,value,match", [
    ("use_dora", True, "use_dora=True: DoRA"),
    ("fan_in_fan_out", True, "fan_in_fan_out=True"),
    ("lora_bias", True, "lora_bias=True"),
    ("bias", "all", "bias='all'"),
    ("peft_type", "IA3", "peft_type='IA3'"),
    ("r", 0, "r=0 must be a positive integer"),
    ("lora_alpha", "x", "lora_alpha='x' must be a number"),
    # a string passes an equality test with True: served as plain LoRA it would be wrong
    ("use_dora", "true", "use_dora='true' must be true or false"),
    ("fan_in_fan_out", "yes", "fan_in_fan_out='yes' must be true or false"),
    ("alora_invocation_tokens", [1, 2, 3], r"alora_invocation_tokens=\[1, 2, 3\]: activated LoRA"),
    ("layer_replication", [[0, 4]], r"layer_replication=\[\[0, 4\]\]: replicated layers"),
    ("use_rslora", "yes", "use_rslora='yes'"),
    ("lora_alpha", 10 ** 400, "lora_alpha=10{400} must be a number"),  # past float: not an OverflowError
    ("rank_pattern", {"mlp.gate": 2.5}, r"rank_pattern\['mlp.gate'\]=2.5"),
    ("target_parameters", "experts.gate_up_proj", r"target_parameters='experts.gate_up_proj' must be a list"),
    # falsy values that are no mapping / list were read as empty ones
    ("rank_pattern", "", r"rank_pattern='' must map module patterns to numbers"),
    ("alpha_pattern", [], r"alpha_pattern=\[\] must map module patterns to numbers"),
    ("target_parameters", 0, r"target_parameters=0 must be a list"),
    # compiles alone, but not as PEFT (and pattern_key) match it: an inline flag not at the start
    ("alpha_pattern", {"(?i)gate_proj": 16}, r"alpha_pattern\['\(\?i\)gate_proj'\]: not a regular expression"),
])
def test_config_refusals(tmp_path, key, value, match):
    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(3), rank=2, layer_idx=LAYER, targets=["router"])
    _refused(tmp_path, cfg, lw, {"r": 2, "lora_alpha": 4, key: value}, match=match)


def test_weights_made_by_hand_with_keys_or_scales_no_adapter_has_are_refused():
    """An expert id of 0.5 matched no slot (the module silently dropped), True was read as expert 1; a key
    that is no LoraKey, a string scale or a rank of 0 raised AttributeError / TypeError / ZeroDivisionError."""
    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(5), rank=2, targets=[LoraTarget.GATE], experts=[1])
    (key, m), = lw.modules.items()
    cases = [({LoraKey(LoraTarget.GATE, 0.5): m}, "expert 0.5 is no expert id"),
             ({LoraKey(LoraTarget.GATE, True): m}, "expert True is no expert id"),
             ({("gate", 1): m}, r"modules\[\('gate', 1\)\]: expected LoraKey\(LoraTarget, expert\) -> LoraModule"),
             ({LoraKey("gate", 1): m}, "expected LoraKey"),
             ({key: type(m)(m.name, m.a, m.b, "2")}, "scale '2' is no real number"),
             ({key: type(m)(m.name, m.a, m.b, 1j)}, "scale 1j is no real number")]
    for modules, match in cases:
        with pytest.raises(LoraError, match=match):
            LoraWeights(modules).check(cfg)
    for rank in (0, 2.5):
        with pytest.raises(LoraError, match=f"rank={rank!r}: must be a whole number >= 1"):
            lora_scale(8, rank, False)
    from cupymoe.lora import round_robin_ids
    for n, k in ((5, 2.5), (5, -1), (-1, 2)):  # float slots [0, 1, 2, 0.5, 1.5], or all -1 for k = -1
        with pytest.raises(LoraError, match="whole numbers >= 0 are required"):
            round_robin_ids(n, k)
    assert round_robin_ids(5, 2).tolist() == [0, 1, 0, 1, 0] and round_robin_ids(3, 0).tolist() == [-1] * 3


def _t(shape):
    return np.zeros(shape, np.float32)


@pytest.mark.parametrize("family,name,shape,match", [
    ("qwen2_moe", "mlp.experts.0.gate_proj.lora_magnitude_vector", (8,), "DoRA magnitude vector"),
    ("qwen2_moe", "mlp.gate.lora_B.bias", (8,), "LoRA bias"),
    ("qwen2_moe", "mlp.gate.lora_A.default.weight", (2, 64), "adapter-named key"),
    ("qwen2_moe", "mlp.shared_expert_gate.lora_A.weight", (2, 64), "no module of this layer"),
    ("qwen2_moe", "mlp.experts.99.gate_proj.lora_A.weight", (2, 64), "no module of this layer"),
    ("gpt_oss", "mlp.experts.gate_up_proj.lora_A.weight", (2, 64), "named after a stacked expert parameter"),
    ("qwen3_moe", "mlp.experts.w13_weight.lora_A.weight", (2, 64), "vLLM's stacked expert layout"),
    ("mixtral", "mlp.experts.0.w1.lora_A.weight", (2, 64), "no module of this layer"),  # another layout's prefix
    ("qwen2_moe", "mlp.modules_to_save.gate.weight", (8, 64), "PEFT's modules_to_save: a full replacement"),
    ("qwen2_moe", "mlp.gate.modules_to_save.default.weight", (8, 64), "a whole weight of the module"),
    ("qwen2_moe", "mlp.gate.weight", (8, 64), "a whole weight of the module"),
])
def test_unknown_keys_refused(tmp_path, family, name, shape, match):
    cfg = _cfg(family)
    lw = random_lora(cfg, np.random.default_rng(4), rank=2, layer_idx=LAYER, targets=["router"])
    key = f"base_model.model.model.layers.{LAYER}.{name}"
    msg = _refused(tmp_path, cfg, lw, {"r": 2, "lora_alpha": 4}, extra={key: _t(shape)}, match=match)
    assert key in msg


def test_shape_value_and_pair_refusals(tmp_path):
    cfg = _cfg()
    H, R = cfg.hidden_size, cfg.router_width
    p = f"base_model.model.model.layers.{LAYER}.mlp.gate"
    base = random_lora(cfg, np.random.default_rng(5), rank=2, layer_idx=LAYER, targets=["down"], experts=[0])
    cases = [
        ({f"{p}.lora_A.weight": _t((2, H + 1)), f"{p}.lora_B.weight": _t((R, 2))},
         r"lora_A.weight: expected shape \[r, "),
        ({f"{p}.lora_A.weight": _t((2, H)), f"{p}.lora_B.weight": _t((R + 1, 2))}, r"lora_B.weight: expected shape"),
        ({f"{p}.lora_A.weight": _t((3, H)), f"{p}.lora_B.weight": _t((R, 3))}, "gives this module rank 2"),
        ({f"{p}.lora_A.weight": _t((2, H))}, r"mlp.gate.lora_B.weight is missing"),
        ({f"{p}.lora_A.weight": np.full((2, H), np.inf, np.float32), f"{p}.lora_B.weight": _t((R, 2))},
         r"lora_A.weight: non-finite value inf at \[0, 0\]"),
        ({f"{p}.lora_A.weight": np.zeros((2, H), np.int32), f"{p}.lora_B.weight": _t((R, 2))},
         r"mlp.gate.lora_A.weight: dtype I32 is not served"),
        # numpy holds no fp8: refused by its name in the file, not as an unreadable file
        ({f"{p}.lora_A.weight": np.zeros((2, H), ml_dtypes.float8_e4m3fn), f"{p}.lora_B.weight": _t((R, 2))},
         r"mlp.gate.lora_A.weight: dtype F8_E4M3 is not served \(expected one of \('BF16', 'F16', 'F32'\)\)"),
    ]
    for i, (extra, match) in enumerate(cases):
        d = write_peft(tmp_path / f"c{i}", base, {"r": 2, "lora_alpha": 2}, extra=extra)
        with pytest.raises(LoraError, match=match):
            load_peft(d, LAYER, cfg)


def test_files_refused(tmp_path):
    cfg = _cfg()
    with pytest.raises(LoraError, match="adapter_config.json not found"):
        load_peft(tmp_path, LAYER, cfg)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(LoraError, match="not adapter_model.bin"):
        load_peft(tmp_path, LAYER, cfg)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(LoraError, match="not a readable safetensors file"):
        load_peft(tmp_path, LAYER, cfg)
    (tmp_path / "adapter_config.json").write_text("[1]")
    with pytest.raises(LoraError, match="expected a JSON object"):
        load_peft(tmp_path, LAYER, cfg)


def test_symlink_outside_refused(tmp_path):
    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(6), rank=2, layer_idx=LAYER, targets=["router"])
    outside = write_peft(tmp_path / "outside", lw, {"r": 2, "lora_alpha": 2})
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    os.symlink(outside / "adapter_model.safetensors", d / "adapter_model.safetensors")
    with pytest.raises(LoraError, match="outside the checkpoint directory"):
        load_peft(d, LAYER, cfg)


def test_check_by_hand_records():
    cfg = _cfg("qwen3_moe")  # no shared expert
    lw = random_lora(cfg, np.random.default_rng(7), rank=2, targets=["router"])
    m = lw.get("router")
    with pytest.raises(LoraError, match="has no shared expert"):
        LoraWeights({LoraKey(LoraTarget.SHARED_UP): m}).check(cfg)
    with pytest.raises(LoraError, match="expert 99 outside"):
        LoraWeights({LoraKey(LoraTarget.GATE, 99): m}).check(cfg)
    with pytest.raises(LoraError, match="exactly when its target is per expert"):
        LoraWeights({LoraKey(LoraTarget.GATE): m}).check(cfg)
    assert lora_scale(16, 4, True) == 8.0 and lora_scale(16, 4, False) == 4.0


def test_an_adapter_nesting_its_layers_elsewhere_is_refused(tmp_path):
    """An adapter whose keys lie under another path (a multimodal model's
    base_model.model.model.language_model.layers...) would give every layer an empty adapter: refused,
    naming a key; an adapter that simply leaves this layer out loads as empty."""
    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(5), 2, layer_idx=LAYER)
    good = write_peft(tmp_path / "good", lw, {"r": 2, "lora_alpha": 2})
    assert load_peft(good, LAYER, cfg).modules and not load_peft(good, LAYER + 1, cfg).modules
    from safetensors.numpy import load_file, save_file

    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    t = load_file(str(good / "adapter_model.safetensors"))
    save_file({k.replace("model.model.layers.", "model.model.language_model.layers."): v for k, v in t.items()},
              str(nested / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match=r"no LoRA tensor lies under base_model.model.model.layers.<i>. \(e.g. "
                                        r"base_model.model.model.language_model.layers"):
        load_peft(nested, LAYER, cfg)


def test_an_adapter_of_other_modules_alone_loads_empty(tmp_path):
    """An adapter of lm_head alone (no decoder layer's module) gives the MoE layer nothing to add and
    is not mistaken for one nesting its layers elsewhere."""
    from safetensors.numpy import save_file

    cfg = _cfg()
    d = tmp_path / "lm_head"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    save_file({"base_model.model.lm_head.lora_A.weight": np.ones((2, cfg.hidden_size), np.float32),
               "base_model.model.lm_head.lora_B.weight": np.ones((8, 2), np.float32)},
              str(d / "adapter_model.safetensors"))
    assert not load_peft(d, LAYER, cfg).modules


def test_patterns_scales_factors_and_options_refused_by_name(tmp_path):
    """A rank / alpha pattern that is no regular expression (PEFT matches keys as ones), a 0-d lora_A, a
    scale past float32 (the kernels' scale would be inf), a max_rank that is no whole number."""
    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(7), rank=2, layer_idx=LAYER, targets=["router"])
    _refused(tmp_path, cfg, lw, {"r": 2, "lora_alpha": 2, "rank_pattern": {"gate(": 2}},
             match=r"rank_pattern\['gate\('\]: not a regular expression")
    p = f"base_model.model.model.layers.{LAYER}.mlp.gate"
    msg = _refused(tmp_path, cfg, lw, {"r": 2, "lora_alpha": 2}, extra={f"{p}.lora_A.weight": np.array(1.0, np.float32)},
                   match=r"lora_A.weight: expected 2 dimensions \[r, in\], found \[\]")
    assert p in msg
    _refused(tmp_path, cfg, lw, {"r": 2, "lora_alpha": 4e39}, match=r"scale 2e\+39 is not a finite float32")
    # finite float32 factors the slots could not hold: bf16 copies past its range, s B past float32
    (key, m), = lw.modules.items()
    big_a = LoraWeights({key: LoraModule(m.name, np.full(m.a.shape, 3.4e38, np.float32), m.b, m.scale)})
    with pytest.raises(LoraError, match=r"lora_A.weight: \|value\| 3.4e\+38 rounds to inf in bfloat16"):
        big_a.check(cfg)  # (a bf16 file cannot hold it: weights made by hand)
    big_sb = LoraWeights({key: LoraModule(m.name, m.a, np.full_like(m.b, 1e30), m.scale)})
    _refused(tmp_path, cfg, big_sb, {"r": 2, "lora_alpha": 2e10},
             match=r"scale x \|lora_B\| reaches 1[.0-9]*e\+40, past float32")
    with pytest.raises(LoraError, match="max_rank='3': must be a whole number"):
        load_peft(write_peft(tmp_path / "ok", lw, {"r": 2, "lora_alpha": 2}), LAYER, cfg, max_rank="3")


@pytest.mark.parametrize("layer_idx", [-1, True, 0.9, "3"])
def test_a_layer_index_that_is_no_layer_is_refused(tmp_path, layer_idx):
    """-1 and True would read another layer's modules or none at all, 0.9 layer 0's under another name."""
    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(5), rank=2, layer_idx=LAYER, targets=["router"])
    d = write_peft(tmp_path / "a", lw, {"r": 2, "lora_alpha": 2})
    with pytest.raises(LoraError, match=rf"load_peft: layer_idx={layer_idx!r} must be a non-negative whole number"):
        load_peft(d, layer_idx, cfg)


def test_adapter_weights_that_are_not_real_floats_are_refused():
    """A complex lora_A would lose its imaginary part in the slot's copy; integers are no trained adapter."""
    from cupymoe.lora import LoraKey, LoraModule, LoraTarget, LoraWeights

    cfg = _cfg()
    a, b = np.zeros((2, cfg.hidden_size), np.complex64), np.zeros((cfg.num_experts, 2), np.float32)
    for bad, other in ((a, b), (a.real.astype(np.int32), b)):
        lw = LoraWeights({LoraKey(LoraTarget.ROUTER): LoraModule("mlp.gate", bad, other, 1.0)})
        with pytest.raises(LoraError, match=rf"mlp.gate.lora_A.weight: dtype {bad.dtype}: must be a real floating"):
            lw.check(cfg)


def test_an_adapter_read_for_another_layer_is_refused_by_a_layer_that_knows_its_own(tmp_path):
    """load_peft(dir, 3, cfg) into the layer loaded as layer 5 would serve layer 3's deltas there; layers
    built from a config and weights (no index known) and hand-made adapters (no index) are not checked."""
    from types import SimpleNamespace

    from cupymoe.layer import MoeLayer
    from cupymoe.lora import LoraWeights

    cfg = _cfg()
    lw = random_lora(cfg, np.random.default_rng(9), rank=2, layer_idx=LAYER, targets=["router"])
    read = load_peft(write_peft(tmp_path / "a", lw, {"r": 2, "lora_alpha": 2}), LAYER, cfg)
    assert read.layer_idx == LAYER
    with pytest.raises(LoraError, match=rf"read for decoder layer {LAYER}, this layer was loaded as layer "
                                        rf"{LAYER + 2} \(load_peft\(dir, {LAYER + 2}, cfg\)\)"):
        MoeLayer._check_adapter_layer(SimpleNamespace(layer_idx=LAYER + 2), read)
    MoeLayer._check_adapter_layer(SimpleNamespace(layer_idx=LAYER), read)
    MoeLayer._check_adapter_layer(SimpleNamespace(layer_idx=None), read)
    MoeLayer._check_adapter_layer(SimpleNamespace(layer_idx=LAYER + 2), LoraWeights(read.modules))
