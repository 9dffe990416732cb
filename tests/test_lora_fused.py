"""CPU tests of PEFT `target_parameters` adapters on stacked experts (cupymoe/lora_fused.py).

Evidence: adapters written here the way PEFT's lora.ParamWrapper saves them, for each PEFT version's
orientation (0.17-0.18, 0.19.0, 0.19.1+), and the truth taken from PEFT's own delta rule
(`ParamWrapper.get_delta_weight`, restated in `peft_delta`): the stacked parameter's delta dP laid
along its axes, split into each expert's gate / up / down deltas as transformers 5's forward reads
them (hf_layouts.py). The loader's per-expert modules must give those deltas (s B A in float64,
against dP; float32 factors, so the two sides differ by rounding only, rtol 1e-12), and the
reference run with the adapter must equal the reference run on the merged weights (rtol 1e-10,
test_reference_lora.py's tolerance and reason). A square parameter without the saving version,
and every malformed layout, is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from _lora import STACKED_LAYER as LAYER
from _lora import _bf16_exact as _bf16
from _lora import peft_release as _release
from _lora import stacked_adapter as make_adapter
from _lora import write_stacked_peft as write
from cupymoe import reference, testing
from cupymoe.errors import LoraError
from cupymoe.lora import PEFT_PREFIX, LoraKey, LoraTarget, load_peft
from cupymoe.lora_fused import peft_version, stacked_params

VERSIONS = ("0.17.1", "0.18.0", "0.19.0", "0.19.1", "0.20.0")


def expert_deltas(cfg, deltas) -> dict[LoraKey, np.ndarray]:
    """Each routed expert's gate / up / down delta [out, in] from dP, as transformers 5's forward reads P."""
    specs, I, out = stacked_params(cfg), cfg.moe_intermediate_size, {}
    for name, d in deltas.items():
        p = specs[name]
        for e in range(cfg.num_experts):
            w = d[e].T if p.transposed else d[e]  # [output, input]
            if name == "down_proj":
                out[LoraKey(LoraTarget.DOWN, e)] = w
            elif p.transposed:  # gpt-oss: gate = even output columns of x @ P, up = odd
                out[LoraKey(LoraTarget.GATE, e)], out[LoraKey(LoraTarget.UP, e)] = w[0::2], w[1::2]
            else:
                out[LoraKey(LoraTarget.GATE, e)], out[LoraKey(LoraTarget.UP, e)] = w[:I], w[I:]
    return out


def _check_modules(got, want):
    assert set(got.modules) == set(want)
    for key, d in want.items():
        m = got.modules[key]
        np.testing.assert_allclose(m.scale * (m.b.astype(np.float64) @ m.a.astype(np.float64)), d, rtol=1e-12,
                                   atol=1e-12 * float(np.max(np.abs(d))))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_every_version_every_family(tmp_path, family, version):
    cfg = testing.tiny_config(family)
    tensors, deltas = make_adapter(cfg, np.random.default_rng(7), version)
    got = load_peft(write(tmp_path / "a", tensors, version), LAYER, cfg)
    _check_modules(got, expert_deltas(cfg, deltas))
    assert got.max_rank == 3 and all(m.scale == 2.0 for m in got.modules.values())


@pytest.mark.parametrize("version", ["0.17.1", "0.19.1"])
def test_non_square_needs_no_version(tmp_path, version):
    """Where a parameter's input and output widths differ, the shapes say which factor shrinks."""
    cfg = testing.tiny_config("qwen3_moe")
    tensors, deltas = make_adapter(cfg, np.random.default_rng(8), version)
    _check_modules(load_peft(write(tmp_path / "a", tensors, None), LAYER, cfg), expert_deltas(cfg, deltas))


SQUARE = [("gpt_oss", {"hidden_size": 64}),  # down_proj square (H = I)
          ("qwen3_moe", {"hidden_size": 128}),  # gate_up square (H = 2I)
          ("qwen3_moe", {"hidden_size": 64})]  # down_proj square


@pytest.mark.parametrize("version", VERSIONS + (None,))
@pytest.mark.parametrize("family, overrides", SQUARE)
def test_square_follows_its_sibling(tmp_path, family, overrides, version):
    """A square parameter takes the orientation its non-square sibling's shapes show, with or without
    peft_version (one PEFT rule for the experts module)."""
    cfg = testing.tiny_config(family, **overrides)
    tensors, deltas = make_adapter(cfg, np.random.default_rng(9), version or "0.20.0")
    _check_modules(load_peft(write(tmp_path / "a", tensors, version), LAYER, cfg), expert_deltas(cfg, deltas))


def test_square_follows_a_patched_sibling(tmp_path):
    """transformers 5's loading patches PEFT 0.19.0 (patch_moe_parameter_targeting) to swap in / out for
    qwen3_moe: peft_version's rule says axis 1, the sibling's shapes say 2, and the sibling wins."""
    cfg = testing.tiny_config("qwen3_moe", hidden_size=64)
    tensors, deltas = make_adapter(cfg, np.random.default_rng(15), "0.19.0", in_axis=2)
    _check_modules(load_peft(write(tmp_path / "a", tensors, "0.19.0"), LAYER, cfg), expert_deltas(cfg, deltas))


@pytest.mark.parametrize("version", VERSIONS + (None, "0.19.1.dev0", "0.18.2.dev0"))
@pytest.mark.parametrize("family, overrides", SQUARE)
def test_square_alone_by_version(tmp_path, family, overrides, version):
    """Without a sibling the saving version decides where its rule is certain, and else the adapter
    is refused: no version, a development build around the changes (0.18.2.dev0 already had 0.19.0's
    rule), 0.19.0 (transformers 5's loading patches its rule), a transposed stack from 0.19.0 on (its
    is_transposed depends on the transformers version)."""
    cfg = testing.tiny_config(family, **overrides)
    square = "down_proj" if overrides["hidden_size"] == 64 else "gate_up_proj"
    made = version.split(".dev")[0] if version else "0.20.0"
    tensors, deltas = make_adapter(cfg, np.random.default_rng(10), made, params=(square,))
    d = write(tmp_path / "a", tensors, version)
    if version is None:
        match = "no readable peft_version"
    elif version.endswith("dev0"):
        match = "is a development build around the ParamWrapper orientation changes"
    elif _release(version) == (0, 19, 0) or family == "gpt_oss" and _release(version) >= (0, 19, 0):
        match = "depends on the transformers it was trained with"
    else:
        _check_modules(load_peft(d, LAYER, cfg), expert_deltas(cfg, deltas))
        return
    with pytest.raises(LoraError, match=match):
        load_peft(d, LAYER, cfg)


def test_peft_version_parse():
    assert peft_version("0.19.1+gabc") == (0, 19, 1, True) and peft_version("0.20.0rc1") == (0, 20, 0, False)
    assert peft_version("x") is None and peft_version(None) is None
    assert peft_version("1" * 5000 + ".0.0") is None  # no version; int() of 4300+ digits would raise


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "longcat_flash", "mixtral"])
def test_reference_equals_merged_weights(tmp_path, family):
    """The reference with the loaded adapter on every row equals the base reference on P + dP."""
    from dataclasses import replace

    from cupymoe import formats

    cfg = testing.tiny_config(family)
    rng = np.random.default_rng(11)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    x = testing.random_input(rng, 9, cfg.hidden_size)
    tensors, deltas = make_adapter(cfg, rng, "0.20.0")
    lw = load_peft(write(tmp_path / "a", tensors, "0.20.0"), LAYER, cfg)
    changes = {}
    for key, d in expert_deltas(cfg, deltas).items():
        w = changes.setdefault(key.target.value, formats.dequantize(getattr(hw, key.target.value), np.float64))
        w[key.expert] += d
    got = reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=np.zeros(9, np.int32))
    want = reference.moe_forward(cfg, replace(hw, **changes), x)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * float(np.max(np.abs(want))))


def test_one_parameter_and_patterns(tmp_path):
    """down_proj alone (no nesting); rank_pattern / alpha_pattern matched on `experts.<parameter>`."""
    cfg = testing.tiny_config("qwen2_moe")
    tensors, deltas = make_adapter(cfg, np.random.default_rng(12), "0.19.1", rank=2, params=("down_proj",))
    d = write(tmp_path / "a", tensors, "0.19.1", rank=5, rank_pattern={"experts.down_proj": 2},
              alpha_pattern={"experts.down_proj": 4})
    got = load_peft(d, LAYER, cfg)
    _check_modules(got, expert_deltas(cfg, deltas))  # dP at scale 2 = alpha 4 / r 2
    assert {k.target for k in got.modules} == {LoraTarget.DOWN}


def test_with_module_adapters(tmp_path):
    """Router and shared-expert modules beside the stacked experts, mixtral's router under transformers
    5's `mlp.` prefix too."""
    cfg = testing.tiny_config("mixtral")
    rng = np.random.default_rng(13)
    tensors, deltas = make_adapter(cfg, rng, "0.19.1")
    H, R = cfg.hidden_size, cfg.router_width
    router = f"{PEFT_PREFIX}model.layers.{LAYER}.mlp.gate"
    a, b = _bf16(rng.standard_normal((3, H))), _bf16(rng.standard_normal((R, 3)))
    tensors.update({f"{router}.lora_A.weight": a, f"{router}.lora_B.weight": b})
    got = load_peft(write(tmp_path / "a", tensors, "0.19.1"), LAYER, cfg)
    np.testing.assert_array_equal(got.get("router").a, a)
    assert len(got.modules) == 1 + 3 * cfg.num_experts


def _refused(tmp_path, cfg, tensors, match, version="0.19.1", **config):
    with pytest.raises(LoraError, match=match):
        load_peft(write(tmp_path / "r", tensors, version, **config), LAYER, cfg)


def test_longcat_gate_up_of_the_routed_experts_alone(tmp_path):
    """transformers 5.25 sizes LongCat's gate_up_proj for the E routed experts (earlier 5.x: E + Z with
    the zero experts): an adapter trained on either loads to the same routed experts' factors."""
    cfg = testing.tiny_config("longcat_flash")
    E, Ep, r = cfg.num_experts, stacked_params(cfg)["gate_up_proj"].experts, 3
    assert Ep > E
    full, _ = make_adapter(cfg, np.random.default_rng(21), "0.19.1", rank=r)
    inner = f"{PEFT_PREFIX}model.layers.{LAYER}.mlp.experts.base_layer"
    routed = dict(full)
    routed[f"{inner}.lora_A.weight"] = full[f"{inner}.lora_A.weight"][:r * E]  # expert-major rows
    b = full[f"{inner}.lora_B.weight"]
    routed[f"{inner}.lora_B.weight"] = b.reshape(b.shape[0], r, Ep)[:, :, :E].reshape(b.shape[0], r * E)
    want = load_peft(write(tmp_path / "full", full, "0.19.1"), LAYER, cfg).modules
    got = load_peft(write(tmp_path / "routed", routed, "0.19.1"), LAYER, cfg).modules
    assert want.keys() == got.keys()
    for k in want:
        assert np.array_equal(want[k].a, got[k].a) and np.array_equal(want[k].b, got[k].b), k
    odd = dict(full)
    odd[f"{inner}.lora_A.weight"] = full[f"{inner}.lora_A.weight"][:r * (E + 1)]
    odd[f"{inner}.lora_B.weight"] = b[:, :r * (E + 1)]
    _refused(tmp_path, cfg, odd, rf"do not hold rank {r} for {E} or {Ep} experts")
    # rank 4 on the E + Z = 15 experts is also rank 5 on E = 12: a config giving 5 cannot tell them apart
    four, _ = make_adapter(cfg, np.random.default_rng(22), "0.19.1", rank=4, params=("gate_up_proj",))
    _refused(tmp_path, cfg, four, r"lora_A's 60 rows read as rank 5 on 12 experts or as rank 4 on 15", rank=5)


def test_refusals(tmp_path):
    cfg = testing.tiny_config("qwen3_moe")
    rng = np.random.default_rng(14)
    tensors, _ = make_adapter(cfg, rng, "0.19.1")
    base = f"{PEFT_PREFIX}model.layers.{LAYER}.mlp.experts"
    bad = dict(tensors)
    bad[f"{base}.lora_A.weight"] = bad[f"{base}.lora_A.weight"][:, :5]
    _refused(tmp_path, cfg, bad, r"fit no stacked expert parameter's in / out widths")
    _refused(tmp_path, cfg, tensors, r"do not hold rank 4 for 15 experts", rank=4)
    twice = {**tensors, f"{base}.lora_A.weight": tensors[f"{base}.base_layer.lora_A.weight"],
             f"{base}.lora_B.weight": tensors[f"{base}.base_layer.lora_B.weight"]}
    _refused(tmp_path, cfg, twice, r"a second adapter of gate_up_proj")
    gap = {k.replace(".experts.base_layer.", ".experts.base_layer.base_layer."): v for k, v in tensors.items()
           if ".base_layer." in k}
    _refused(tmp_path, cfg, gap, r"PEFT wrappers nested below it \(base_layer\) but no lora_A")
    half = {k: v for k, v in tensors.items() if not k.endswith("base_layer.lora_B.weight")}
    _refused(tmp_path, cfg, half, r"experts.base_layer.lora_B.weight is missing")
    per_expert = f"{PEFT_PREFIX}model.layers.{LAYER}.mlp.experts.0.down_proj"
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    both = {**tensors, f"{per_expert}.lora_A.weight": np.zeros((3, I), np.float32),
            f"{per_expert}.lora_B.weight": np.zeros((H, 3), np.float32)}
    _refused(tmp_path, cfg, both, r"down of expert 0 is also adapted under .*experts.down_proj\[0\]")


def test_inspect_shows_the_adapters_share(tmp_path, capsys):
    """`python -m cupymoe inspect DIR --lora ADAPTER`: the layer's modules per target with ranks, scales
    and their stacked source; on a w8a8 plan the option its expert modules need; a refused adapter: one
    line, 2."""
    from cupymoe.__main__ import main
    from cupymoe.checkpoint import save_layer

    cfg = testing.tiny_config("qwen3_moe")
    rng = np.random.default_rng(16)
    save_layer(tmp_path / "ckpt", testing.hf_config_dict("qwen3_moe", num_hidden_layers=LAYER + 1), LAYER,
               testing.random_host_weights(cfg, rng, "fp8_block"))
    tensors, _ = make_adapter(cfg, rng, "0.19.1")
    adapter = write(tmp_path / "a", tensors, "0.19.1")
    assert main(["inspect", str(tmp_path / "ckpt"), "--layer", str(LAYER), "--lora", str(adapter),
                 "--fp8-compute", "w8a16"]) == 0
    out = capsys.readouterr().out
    assert f"peft_version 0.19.1, r 3, lora_alpha 6; layer {LAYER}: {3 * cfg.num_experts} modules, max rank 3" in out
    assert "gate         (15 experts)   rank 3      scale 2        from model.layers.2.mlp.experts.gate_up_proj\n" in out
    assert "w8a8" not in out.split("adapter ")[-1]
    assert main(["inspect", str(tmp_path / "ckpt"), "--layer", str(LAYER), "--lora", str(adapter),
                 "--fp8-compute", "w8a8"]) == 0
    assert "expert modules on a w8a8 layer: served with MoeLayer(lora_experts=True)" in capsys.readouterr().out
    for bad in (tmp_path, tmp_path / "missing"):  # a refused adapter is its one line, no listing before it
        assert main(["inspect", str(tmp_path / "ckpt"), "--layer", str(LAYER), "--lora", str(bad)]) == 2
        got = capsys.readouterr()
        assert got.err.startswith("cupymoe inspect: LoraError:") and got.err.count("\n") == 1 and got.out == ""


def test_both_mlp_spellings_refused(tmp_path):
    """mixtral's stacked experts adapted under both block_sparse_moe.experts and mlp.experts: refused,
    not one silently dropped."""
    cfg = testing.tiny_config("mixtral")
    tensors, _ = make_adapter(cfg, np.random.default_rng(17), "0.19.1", params=("down_proj",))
    both = {**tensors, **{k.replace(".mlp.experts", ".block_sparse_moe.experts"): v for k, v in tensors.items()}}
    with pytest.raises(LoraError, match=r"down_proj is also adapted under .*experts\.down_proj"):
        load_peft(write(tmp_path / "a", both, "0.19.1"), LAYER, cfg)
