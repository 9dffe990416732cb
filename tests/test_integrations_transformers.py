"""cupymoe.integrations.transformers and hf_layouts against transformers 5's own MoE blocks (CPU).

For each family a tiny random model is built with AutoModelForCausalLM.from_config (float64,
the eager per-expert loop), its weights rounded to bf16 values (the loader keeps float32, so
float64 weights would be rounded there). Every MoE block is found (moe_blocks), converted
(block_tensors -> checkpoint.load_layer_from_tensors, which is what MoeLayer.from_hf runs)
and compared with the block's own forward:

* with the routing cupymoe.reference computes fed to the block in place of its router's, the
  rest of the block (the stacked experts' halves, shared experts, gates, identity experts)
  agrees to float64 rounding (1e-12 normwise);
* unpatched, to 1e-6: transformers computes the routing weights in float32 in every family
  but gpt-oss (softmax(dtype=torch.float), DeepSeek's and LongCat's routers in float32).

Needs torch and transformers (not among the test dependencies: skipped without them).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from cupymoe import checkpoint, formats, hf_layouts, reference, testing
from cupymoe.errors import CheckpointError, UnsupportedModelError
from cupymoe.integrations import transformers as hf
from cupymoe.verify import well_separated_input

from _hf import ATTENTION
from _hf import normwise as _normwise
from _hf import one_torch_thread  # noqa: F401 (autouse: one intra-op thread)
from _hf import run_block as _run
from _hf import tiny_model as _model

torch = pytest.importorskip("torch", reason="needs torch (the cross-check runs transformers' modules)")
transformers = pytest.importorskip("transformers", reason="needs transformers")

FLOAT64_BOUND = 1e-12  # normwise, both sides in float64
FLOAT32_ROUTING_BOUND = 1e-6  # normwise: float32 routing weights (~6e-8 each) and nothing else


MOE_LAYERS = {"deepseek_v3": [1, 2], "qwen3_next": [0, 1, 2, 3]}  # DeepSeek's layer 0 is dense


@pytest.fixture(scope="module", params=testing.FAMILIES)
def family_model(request):
    return request.param, _model(request.param)


def _convert(model, ref):
    return checkpoint.load_layer_from_tensors(*hf.block_tensors(model, ref))


def _route_as(monkeypatch, router, routing, x):
    """The router's forward replaced by one returning `routing` in the form the version's returns:
    (logits, weights, ids), or (weights, ids) where the router gives two (LongCat before 5.24)."""
    with torch.no_grad():
        arity = len(router(torch.from_numpy(np.asarray(x).astype(np.float64))))
    parts = [routing.logits, routing.weights, routing.ids][3 - arity:]
    monkeypatch.setattr(router, "forward", lambda h: tuple(torch.from_numpy(p) for p in parts))


def test_finds_every_moe_block(family_model):
    family, model = family_model
    refs = hf.moe_blocks(model)
    assert [r.layer_idx for r in refs] == MOE_LAYERS.get(family, [0, 1])
    for r in refs:
        assert r.family == family and r.path == f"model.layers.{r.layer_idx}.mlp"
        assert model.get_submodule(r.path) is r.module
        assert type(r.module).__name__ == hf.BLOCK_OUTPUT[family].block_class


def test_block_matches_reference(family_model, monkeypatch):
    family, model = family_model
    for ref in hf.moe_blocks(model):
        cfg, hw = _convert(model, ref)
        x = well_separated_input(cfg, hw, np.random.default_rng(ref.layer_idx), 37)
        ours = reference.moe_forward(cfg, hw, x)
        out = _run(ref.module, x)
        io = hf.BLOCK_OUTPUT[family]
        assert isinstance(out, tuple) == io.returns_tuple
        theirs = (out[0] if io.returns_tuple else out)
        assert theirs.shape == (1, 37, cfg.hidden_size)
        bound = FLOAT64_BOUND if family == "gpt_oss" else FLOAT32_ROUTING_BOUND
        assert _normwise(theirs[0].numpy(), ours) < bound, f"{family} {ref.path}"

        # the same block with the reference's float64 routing in place of its router's
        routing = reference.route(cfg, hw, x)
        _route_as(monkeypatch, getattr(ref.module, io.router), routing, x)
        out = _run(ref.module, x)
        err = _normwise((out[0] if io.returns_tuple else out)[0].numpy(), ours)
        assert err < FLOAT64_BOUND, f"{family} {ref.path}: normwise {err:.3e} with the reference's routing"
        monkeypatch.undo()


@pytest.mark.parametrize("original", [True, False], ids=["hub", "stacked"])
def test_checkpoint_transformers_writes(family_model, tmp_path, original):
    """What save_pretrained writes (the hub's per-expert format by default; transformers 5's stacked
    one with save_original_format=False), in shards with their index, loads with checkpoint.load_layer
    to the block's own output."""
    family, model = family_model
    ref = hf.moe_blocks(model)[0]
    shards = dict(max_shard_size="64KB")
    try:
        model.save_pretrained(tmp_path, save_original_format=original, **shards)
    except TypeError:  # a version without the option writes its one format
        if not original:
            pytest.skip(f"transformers {transformers.__version__} has no save_original_format")
        model.save_pretrained(tmp_path, **shards)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / checkpoint.INDEX_FILE).is_file()
    cfg, hw = checkpoint.load_layer(tmp_path, ref.layer_idx)
    if family == "gpt_oss":  # transformers < 5.18 computes with 1.702 / 7.0 whatever config.json says
        cfg = cfg.replace(swiglu_alpha=float(ref.module.experts.alpha), swiglu_limit=float(ref.module.experts.limit))
    x = well_separated_input(cfg, hw, np.random.default_rng(5), 23)
    out = _run(ref.module, x)
    theirs = (out[0] if hf.BLOCK_OUTPUT[family].returns_tuple else out)[0].numpy()
    bound = FLOAT64_BOUND if family == "gpt_oss" else FLOAT32_ROUTING_BOUND
    assert _normwise(theirs, reference.moe_forward(cfg, hw, x)) < bound, family


def _fp8_model(family, monkeypatch, tmp_path, hidden, inter):
    """The family's tiny model quantized by transformers' own FineGrainedFP8 quantizer on load (its GPU
    check patched away: the quantization is torch code that runs on the CPU)."""
    from transformers.quantizers import quantizer_finegrained_fp8 as fp8q

    monkeypatch.setattr(fp8q.FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    sizes = dict(hidden_size=hidden, **{"intermediate_size" if family == "mixtral" else "moe_intermediate_size": inter})
    _model(family, torch.bfloat16, **sizes).save_pretrained(tmp_path / "bf16")
    return transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=transformers.FineGrainedFP8Config(), dtype=torch.bfloat16,
        device_map="cpu")


def _dequantized(codes, scale_inv):
    """[E, rows, cols] e4m3 codes times their 128 x 128 block scales, float32."""
    q, s = codes.detach().float(), scale_inv.detach().float()
    rows, cols = q.shape[1], q.shape[2]
    return (q * s.repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[:, :, :cols]).numpy()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_fp8_checkpoints_transformers_quantizes_and_writes(family, monkeypatch, tmp_path):
    """transformers' FineGrainedFP8 model (FP8Experts: [gate; up] quantized whole): its parameters in memory
    (block_tensors) and what save_pretrained writes in both formats load as fp8_block whose dequantized
    gate, up and down are the module's, bit for bit; at I = 320 (a scale block straddling gate and up) the
    stack is refused by name."""
    model = _fp8_model(family, monkeypatch, tmp_path, 384, 256)
    ref = hf.moe_blocks(model)[0]
    experts = ref.module.experts
    gate_up = _dequantized(experts.gate_up_proj, experts.gate_up_proj_scale_inv)
    down = _dequantized(experts.down_proj, experts.down_proj_scale_inv)
    loads = {"memory": lambda: checkpoint.load_layer_from_tensors(*hf.block_tensors(model, ref))}
    for original in (True, False):
        path = tmp_path / ("hub" if original else "stacked")
        model.save_pretrained(path, save_original_format=original)
        loads[path.name] = lambda path=path: checkpoint.load_layer(path, ref.layer_idx)
    for where, load in loads.items():
        cfg, hw = load()
        assert cfg.weight_format == "fp8_block", where
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        for name, got, want in (("gate", hw.gate, gate_up[:E, :I]), ("up", hw.up, gate_up[:E, I:]),
                                ("down", hw.down, down[:E])):
            assert np.array_equal(formats.dequantize(got, np.float32), want), f"{where} {name}"
    straddling = _fp8_model(family, monkeypatch, tmp_path / "320", 384, 320)
    ref = hf.moe_blocks(straddling)[0]
    with pytest.raises(CheckpointError, match=r"intermediate size 320 \(mod 128 = 64\): its 5 fp8 scale row blocks "
                                              r"may straddle gate and up"):
        checkpoint.load_layer_from_tensors(*hf.block_tensors(straddling, ref))


def test_router_is_what_transformers_records(family_model):
    family, model = family_model
    recorded = model.model._can_record_outputs.get("router_logits")
    if recorded is None:
        pytest.skip(f"transformers {transformers.__version__} records no router_logits for {family}")
    target = getattr(recorded, "target_class", recorded)
    for ref in hf.moe_blocks(model):
        assert type(getattr(ref.module, hf.BLOCK_OUTPUT[family].router)) is target


def test_block_config_holds_what_the_module_computes():
    """gpt-oss's swiglu alpha and limit come from the experts module (transformers before 5.18 fixes
    them whatever config.json says; later ones read the config), so the layer computes what the block does."""
    model = _model("gpt_oss")
    ref = hf.moe_blocks(model)[0]
    with torch.no_grad():
        ref.module.experts.alpha, ref.module.experts.limit = 1.5, 3.25
    cfg, _ = _convert(model, ref)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.5, 3.25)
    qwen = _model("qwen3_moe")
    config_dict, _, _ = hf.block_tensors(qwen, hf.moe_blocks(qwen)[0])
    assert "swiglu_limit" not in config_dict


def test_block_tensors_share_the_models_memory(family_model):
    family, model = family_model
    ref = hf.moe_blocks(model)[0]
    config_dict, tensors, prefix = hf.block_tensors(model, ref)
    assert prefix == ref.path + "." and config_dict["model_type"] == family
    params = dict(ref.module.named_parameters())
    assert params and all(tensors[prefix + n].data_ptr() == p.data_ptr() for n, p in params.items())


@pytest.mark.parametrize("family", ["qwen3_moe", "longcat_flash"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_halves_are_views_of_the_parameter(family, dtype):
    model = _model(family, getattr(torch, dtype))
    ref = hf.moe_blocks(model)[0]
    _, hw = checkpoint.load_layer_from_tensors(*hf.block_tensors(model, ref))
    gate_up = ref.module.experts.gate_up_proj
    bits = gate_up.detach().view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy()
    assert np.shares_memory(hw.gate, bits) and np.shares_memory(hw.up, bits)
    I = hw.gate.shape[1]
    assert np.array_equal(np.asarray(hw.up, np.float32), gate_up.detach()[:hw.up.shape[0], I:].float().numpy())


def test_vllm_layout_of_the_same_block(family_model):
    """vLLM's w13_weight / w2_weight built from the module's parameters load to the same HostWeights."""
    family, model = family_model
    ref = hf.moe_blocks(model)[0]
    config_dict, tensors, prefix = hf.block_tensors(model, ref)
    _, want = checkpoint.load_layer_from_tensors(config_dict, tensors, prefix)
    base, E = prefix + "experts.", want.gate.shape[0]
    vllm = {k: v for k, v in tensors.items() if not k.startswith(base)}
    gate_up, down = tensors[base + "gate_up_proj"], tensors[base + "down_proj"]
    if family == "gpt_oss":  # vLLM transposes to [out, in] and keeps the interleave
        vllm[base + "w13_weight"], vllm[base + "w2_weight"] = gate_up.transpose(1, 2), down.transpose(1, 2)
        vllm[base + "w13_bias"] = tensors[base + "gate_up_proj_bias"]
        vllm[base + "w2_bias"] = tensors[base + "down_proj_bias"]
    else:
        vllm[base + "w13_weight"], vllm[base + "w2_weight"] = gate_up[:E], down
    _, got = checkpoint.load_layer_from_tensors(config_dict, vllm, prefix)
    for field in ("router", "gate", "up", "down", "gate_bias", "up_bias", "down_bias", "shared_gate", "shared_up",
                  "shared_down", "shared_expert_gate", "correction_bias"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None and b is None) or np.array_equal(a, b), field


def test_dense_layers_are_not_blocks():
    model = _model("qwen3_moe", mlp_only_layers=[1])
    assert [r.layer_idx for r in hf.moe_blocks(model)] == [0]


def test_state_dict_of_a_block_loads_with_an_empty_prefix():
    """The issue's call: load_layer_from_tensors(config, block.state_dict(), "") on a transformers 5 block."""
    model = _model("mixtral")
    block = model.model.layers[0].mlp
    cfg, hw = checkpoint.load_layer_from_tensors(model.config.to_dict(), block.state_dict(), "")
    assert np.array_equal(hw.gate, block.experts.gate_up_proj.detach()[:, :cfg.moe_intermediate_size].float().numpy())


def test_refuses_weights_on_the_meta_device():
    config = {k: v for k, v in testing.hf_config_dict("qwen2_moe").items() if k != "architectures"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config, **ATTENTION))
    ref = hf.moe_blocks(model)[0]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.\S+ is on the meta device"):
        hf.block_tensors(model, ref)


def test_replace_refuses_options_no_layer_takes_before_reading_a_block():
    """A misspelt option, `device` (each layer goes on its block's GPU) and a bad max_tokens: named
    refusals, also where the model has no MoE block to build (they were checked by the first layer only)."""
    from cupymoe.errors import OptionError

    model = _model("mixtral")  # on the host: a block read would be refused for that instead
    with pytest.raises(OptionError, match=r"unknown option max_lora; MoeLayer takes .*max_loras"):
        hf.replace_moe_blocks(model, max_tokens=8, max_lora=2)
    with pytest.raises(OptionError, match=r"device=0: each layer is built on the GPU its block's weights are on"):
        hf.replace_moe_blocks(model, max_tokens=8, device=0)
    dense = _model("qwen3_moe", mlp_only_layers=[0, 1])
    assert hf.moe_blocks(dense) == []
    for bad in (-1, 0, 2.5, "8", None):
        with pytest.raises(OptionError, match=rf"max_tokens={re.escape(repr(bad))}: must be a positive integer"):
            hf.replace_moe_blocks(dense, max_tokens=bad)
    assert hf.replace_moe_blocks(dense, max_tokens=8) == 0


def test_refuses_other_families_and_a_model_on_the_host():
    class Config:
        model_type = "llama"

    class Model:
        config = Config()

    with pytest.raises(UnsupportedModelError, match=r"model_type='llama' \(Model\) is not supported"):
        hf.moe_blocks(Model())
    with pytest.raises(CheckpointError, match=r"weights lie on \['cpu'\]; move the model to one CUDA device"):
        hf.replace_moe_blocks(_model("mixtral"), max_tokens=8)


def test_hf_layouts_names_match_transformers(family_model):
    """The stacked names hf_layouts reads are the parameters transformers' experts modules hold."""
    family, model = family_model
    experts = hf.moe_blocks(model)[0].module.experts
    assert {hf_layouts.TRANSFORMERS.gate_up, hf_layouts.TRANSFORMERS.down} <= {n for n, _ in experts.named_parameters()}


def test_stacked_adapter_matches_the_merged_block(family_model, tmp_path, monkeypatch):
    """A PEFT target_parameters adapter (tests/_lora.py's, PEFT 0.20's orientation) loaded by load_peft
    and run by the reference equals transformers' own block with PEFT's merge P + dP, under the
    reference's routing (FLOAT64_BOUND); and the experts module is what cupymoe/lora_fused.py assumes:
    gate_up_proj registered before down_proj (PEFT wraps it first: innermost), is_transposed and the
    stacked shapes as stacked_params says."""
    from _lora import stacked_adapter, write_stacked_peft
    from cupymoe.lora import load_peft
    from cupymoe.lora_fused import stacked_params

    family, model = family_model
    ref = hf.moe_blocks(model)[0]
    cfg, hw = _convert(model, ref)
    experts = ref.module.experts
    names = [n for n, _ in experts.named_parameters(recurse=False)]
    assert names.index("gate_up_proj") < names.index("down_proj")
    for name, p in stacked_params(cfg).items():
        assert bool(getattr(experts, "is_transposed", False)) == p.transposed, name
        want = (p.input, p.output) if p.transposed else (p.output, p.input)
        shape = tuple(getattr(experts, name).shape)
        assert shape[0] in p.counts and shape[1:] == want, name
    counts = {name: getattr(experts, name).shape[0] for name in stacked_params(cfg)}
    tensors, deltas = stacked_adapter(cfg, np.random.default_rng(3), "0.20.0", layer_idx=ref.layer_idx, counts=counts)
    lw = load_peft(write_stacked_peft(tmp_path / "a", tensors, "0.20.0"), ref.layer_idx, cfg)
    x = well_separated_input(cfg, hw, np.random.default_rng(4), 37)
    ours = reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=np.zeros(37, np.int32))
    routing = reference.route(cfg, hw, x)
    io = hf.BLOCK_OUTPUT[family]
    _route_as(monkeypatch, getattr(ref.module, io.router), routing, x)
    saved = {name: getattr(experts, name).detach().clone() for name in deltas}
    try:
        with torch.no_grad():
            for name, d in deltas.items():
                getattr(experts, name).add_(torch.from_numpy(d))
        out = _run(ref.module, x)
    finally:
        with torch.no_grad():
            for name, p in saved.items():
                getattr(experts, name).copy_(p)
    err = _normwise((out[0] if io.returns_tuple else out)[0].numpy(), ours)
    assert err < FLOAT64_BOUND, f"{family} {ref.path}: normwise {err:.3e} against PEFT's merged block"


def test_refuses_a_block_with_peft_wrappers():
    """A PEFT model's block (its experts under base_layer, lora_A / lora_B beside) is refused by name, not
    loaded without its adapter; a state_dict in PEFT's naming stands in for PEFT (not installed here)."""
    model = _model("qwen3_moe")
    ref = hf.moe_blocks(model)[0]
    wrapped = {("experts.base_layer." + k[len("experts."):] if k.startswith("experts.") else k): v
               for k, v in ref.module.state_dict().items()}
    wrapped["experts.lora_A.default.weight"] = torch.zeros(2, 8)

    class Wrapped:
        def state_dict(self):
            return wrapped

    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.\S+: the block carries PEFT LoRA"):
        hf.block_tensors(model, hf.MoeBlockRef(ref.path, ref.layer_idx, ref.family, Wrapped()))
