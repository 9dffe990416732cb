"""cupymoe.reference against transformers' own MoE blocks, every family (CPU, float64).

The GPU tests compare the kernels with cupymoe.reference; this checks the reference itself
against the modelling code users run. Each family's tiny layer is written as a hub checkpoint
(checkpoint.save_layer), loaded back by cupymoe (load_layer) and by transformers
(AutoModelForCausalLM.from_pretrained in float64, eager experts), and the layer's MLP module
runs on the same input as reference.moe_forward; quantized checkpoints (block fp8, gpt-oss's mxfp4)
the same way through transformers' own dequantizing loaders. LongCat's module is filled by hand:
transformers 5.24 sizes its fused gate_up_proj for the routed and the zero experts (E + Z)
while the hub layout holds the E routed ones, so from_pretrained refuses the checkpoint.

The bound: transformers computes the routing weights in float32 in every family but gpt-oss
(softmax / sigmoid `dtype=torch.float`, LongCat's and DeepSeek's routers in float32), which
moves the output by ~1e-7 normwise; a wrong scaling, normalisation, expert choice or
activation moves it by 1e-2 or more. Needs torch and transformers (not among the test
dependencies: skipped without them; the lent GPU's image has both).
"""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import checkpoint, reference, testing
from cupymoe.verify import well_separated_input

torch = pytest.importorskip("torch", reason="needs torch (the cross-check runs transformers' modules)")
transformers = pytest.importorskip("transformers", reason="needs transformers")

FLOAT32_ROUTING_BOUND = 1e-6  # normwise: float32 routing weights (~6e-8 each) and nothing else


def _load_float64(path):
    """The checkpoint as transformers loads it, in float64 with the per-expert (eager) loop
    where the version has a choice (the grouped_mm kernels take no float64)."""
    transformers.logging.set_verbosity_error()
    kw = dict(dtype=torch.float64)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw)
    except TypeError:  # a version without the option
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kw)


def _longcat_module(path, hw):
    """LongcatFlashMoE of the checkpoint's config, its tensors set from `hw` (hub layout ->
    transformers' fused experts: gate_up_proj[e] = [gate_e; up_e] for the routed experts)."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    config = transformers.AutoConfig.from_pretrained(path)
    moe = LongcatFlashMoE(config).double()
    t = lambda a: torch.from_numpy(np.asarray(a).astype(np.float64))  # noqa: E731
    gate, up, down = (np.asarray(getattr(hw, p)).astype(np.float64) for p in ("gate", "up", "down"))
    E = gate.shape[0]
    with torch.no_grad():
        moe.router.classifier.weight.copy_(t(hw.router))
        moe.router.e_score_correction_bias.copy_(t(hw.correction_bias))
        moe.experts.gate_up_proj.zero_()
        moe.experts.gate_up_proj[:E].copy_(t(np.concatenate([gate, up], axis=1)))
        moe.experts.down_proj.copy_(t(down))
    return moe


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_reference_matches_transformers_moe_block(tmp_path, family):
    rng = np.random.default_rng(11)
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng)
    layer = 1 if family == "deepseek_v3" else 0  # DeepSeek's layer 0 is dense (first_k_dense_replace)
    checkpoint.save_layer(tmp_path, testing.hf_config_dict(family), layer, hw)
    got_cfg, got_hw = checkpoint.load_layer(tmp_path, layer)
    if family == "longcat_flash":
        block = _longcat_module(tmp_path, got_hw)
    else:
        block = _load_float64(tmp_path).model.layers[layer].mlp
    # gpt-oss: transformers before 5.18 fixes swiglu's alpha and limit at 1.702 and 7.0 and ignores
    # config.json's swiglu_limit (1.25 in the tiny config, so the clamp bites); 5.24 reads it, as
    # OpenAI's reference does. Compared with the constants the module holds.
    _assert_block_is_the_reference(block, got_cfg, got_hw, rng, family)


def _assert_block_is_the_reference(block, cfg, hw, rng, what):
    """The module against reference.moe_forward on well-separated rows (gpt-oss: with the constants the
    module holds, as above)."""
    if cfg.model_type == "gpt_oss":
        cfg = cfg.replace(swiglu_alpha=float(block.experts.alpha), swiglu_limit=float(block.experts.limit))
    x = well_separated_input(cfg, hw, rng, 37)
    with torch.no_grad():
        out = block(torch.from_numpy(np.asarray(x).astype(np.float64))[None])
    theirs = (out[0] if isinstance(out, tuple) else out)[0].numpy()
    ours = reference.moe_forward(cfg, hw, x)
    err = np.linalg.norm(theirs - ours) / np.linalg.norm(ours)
    assert err < FLOAT32_ROUTING_BOUND, f"{what} ({type(block).__name__}): normwise {err:.3e}"


# fp8_block hub checkpoints of every family that has them in the wild or could, and gpt-oss's mxfp4
QUANTIZED = [(f, "fp8_block") for f in testing.FAMILIES if f != "gpt_oss"] + [("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("family, fmt", QUANTIZED)
def test_quantized_checkpoint_read_as_transformers_reads_it(tmp_path, family, fmt):
    """A quantized hub checkpoint (checkpoint.save_layer: block fp8 with weight_scale_inv, gpt-oss's
    mxfp4 blocks and scales) loaded by transformers with its quantizer's dequantize=True on the CPU
    (in float64; mxfp4 dequantizes its experts into bf16, where its values are exact, cast back) computes
    what the reference does on the weights cupymoe reads: codes, scales and layouts mean the same to both."""
    from test_checkpoint import QCONFIGS

    rng = np.random.default_rng(12)
    sizes = {"hidden_size": 256} if fmt == "fp8_block" else {}  # two 128-column scale blocks
    cfg = testing.tiny_config(family, **sizes)
    hw = testing.random_host_weights(cfg, rng, fmt)
    layer = 1 if family == "deepseek_v3" else 0
    config = testing.hf_config_dict(family, **sizes)
    config["quantization_config"] = dict(QCONFIGS[fmt])
    checkpoint.save_layer(tmp_path, config, layer, hw)
    got_cfg, got_hw = checkpoint.load_layer(tmp_path, layer)
    quantizer = transformers.Mxfp4Config if fmt == "mxfp4" else transformers.FineGrainedFP8Config
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quantizer(dequantize=True), device_map="cpu", experts_implementation="eager",
        dtype=torch.float64).double()
    _assert_block_is_the_reference(model.model.layers[layer].mlp, got_cfg, got_hw, rng, f"{family} {fmt}")
