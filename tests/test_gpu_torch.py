"""GPU: cupymoe in torch: the op under torch.compile(fullgraph=True) and torch.cuda.graph, the module,
and loaded transformers models with their MoE blocks replaced (needs torch and transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import testing
from cupymoe.verify import PATH_ROUNDING, bf16_bits, check, well_separated_input

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _module(rng, family="qwen2_moe", max_tokens=64):
    import cupymoe.torch as ct
    from cupymoe import MoeLayer

    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng)
    return cfg, hw, ct.MoeModule(MoeLayer(cfg, hw, max_tokens=max_tokens))


def _bf16(x: np.ndarray):
    return torch.from_numpy(bf16_bits(x).view(np.int16)).view(torch.bfloat16).cuda()


def _f32(t) -> np.ndarray:
    return (t.view(torch.int16).cpu().numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_the_op_and_module_match_the_reference_and_compile_whole(rng):
    cfg, hw, module = _module(rng)
    for n in (1, 5, 40):
        xh = well_separated_input(cfg, hw, rng, n)
        x = _bf16(xh)
        y = module(x)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert check(_f32(y), cfg, hw, xh, module.layer.select_path(n), layer=module.layer).ok
        assert torch.equal(torch.ops.cupymoe.moe_forward(x, module.layer_id, None).view(torch.int16),
                           y.view(torch.int16))
        y3 = module(x.reshape(1, n, -1))  # [batch, seq, H]
        assert y3.shape == (1, n, cfg.hidden_size) and torch.equal(y3.reshape(n, -1).view(torch.int16),
                                                                    y.view(torch.int16))
    compiled = torch.compile(lambda t: module(t) * 2, fullgraph=True)
    x = _bf16(well_separated_input(cfg, hw, rng, 7))
    assert torch.equal(compiled(x).view(torch.int16), (module(x) * 2).view(torch.int16))


def test_the_module_inside_torch_cuda_graph_capture(rng):
    cfg, hw, module = _module(rng)
    n = 6
    static = _bf16(well_separated_input(cfg, hw, rng, n))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        module(static)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = module(static)
    xh = well_separated_input(cfg, hw, rng, n)
    static.copy_(_bf16(xh))
    g.replay()
    torch.cuda.synchronize()
    assert check(_f32(out), cfg, hw, xh, module.layer.select_path(n), layer=module.layer).ok
    assert torch.equal(out.view(torch.int16), module(static).view(torch.int16))


class _RoundedIO:
    """The original block with its input and output rounded to bf16: what any bf16 layer in its place
    must add at the least, through the rest of the model."""

    def __init__(self, block):
        self.block = block

    def __call__(self, hidden_states, *args, **kwargs):
        out = self.block(hidden_states.to(torch.bfloat16).to(hidden_states.dtype), *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0].to(torch.bfloat16).to(hidden_states.dtype),) + tuple(out[1:])
        return out.to(torch.bfloat16).to(hidden_states.dtype)


class _FaithfulReference:
    """The block replaced by cupymoe.reference in float64 with the kernels' own bf16 rounding points
    (input, activation, per-path terms, output): what a faithful bf16 layer computes, so that its
    logits error is the model's amplification of those roundings alone."""

    def __init__(self, model, ref, path: str):
        from cupymoe.checkpoint import load_layer_from_tensors
        from cupymoe.integrations.transformers import block_tensors

        config, tensors, prefix = block_tensors(model, ref)
        self.cfg, self.hw = load_layer_from_tensors(config, {k: v.cpu() for k, v in tensors.items()}, prefix)
        self.block, self.rounding = ref.module.forward, PATH_ROUNDING[path]

    def __call__(self, hidden_states, *args, **kwargs):
        from cupymoe import reference

        original = self.block(hidden_states, *args, **kwargs)  # for the return structure only
        x = hidden_states.reshape(-1, self.cfg.hidden_size).to(torch.bfloat16).float().cpu().numpy()
        y = reference.moe_forward(self.cfg, self.hw, x, rounding=self.rounding)
        out = torch.from_numpy(y).to(torch.bfloat16).to(hidden_states.dtype).to(hidden_states.device)
        out = out.reshape(hidden_states.shape)
        return (out,) + tuple(original[1:]) if isinstance(original, tuple) else out


def _logits_error_with(model, ids, want, refs, wrap) -> float:
    for ref in refs:
        ref.module.forward = wrap(ref)
    try:
        return float((model(ids).logits.float() - want).norm() / want.norm())
    finally:
        for ref in refs:
            ref.module.forward = ref.module.forward.block


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_a_loaded_transformers_model_with_its_moe_blocks_replaced(family, rng):
    """A tiny random model of each family (float32 on the GPU, weights rounded to bf16 values):
    every MoE block replaced, the logits against the original's within max(3e-2, 2 x what rounding
    the blocks' input and output to bf16 alone does, 2 x what the float64 reference with the
    kernels' bf16 rounding points does in the blocks' place), a greedy generate runs, and the
    layers share one workspace. (The layer rounds its input, activation and output to bf16, ~2^-8 each; qwen3-next's
    random linear-attention layers amplify any such rounding tenfold and more: 9.7e-2 from the
    rounded input and output alone on one CPU draw, the float64 reference in the blocks' place the same.)"""
    transformers = pytest.importorskip("transformers")
    from cupymoe.integrations.transformers import moe_blocks, replace_moe_blocks

    config = {k: v for k, v in testing.hf_config_dict(family).items() if k != "architectures"}
    transformers.logging.set_verbosity_error()
    attention = {}  # multi-head latent attention (deepseek_v3, longcat_flash) keeps the config's own heads
    if family not in ("deepseek_v3", "longcat_flash"):
        attention = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = transformers.AutoConfig.for_model(**config, **attention)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * 0.1).to(torch.bfloat16).float())
    ids = torch.randint(0, cfg.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        want = model(ids).logits.float()
        refs = moe_blocks(model)
        rounded = _logits_error_with(model, ids, want, refs, lambda ref: _RoundedIO(ref.module.forward))
        assert replace_moe_blocks(model, max_tokens=64) == len(refs) > 0
        layer = next(m.layer for m in model.modules() if hasattr(m, "layer_id"))
        got = model(ids).logits.float()
        err = float((got - want).norm() / want.norm())
        for ref in refs:  # the original blocks back, for the faithful baseline
            parent, _, name = ref.path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, ref.module)
        path = layer.select_path(ids.numel())
        faithful = _logits_error_with(model, ids, want, refs, lambda ref: _FaithfulReference(model, ref, path))
        bound = max(3e-2, 2 * rounded, 2 * faithful)
        assert err < bound, (f"{family}: logits normwise {err:.3e} (rounded I/O alone {rounded:.3e}, the float64 "
                             f"reference with the kernels' rounding {faithful:.3e})")
        replace_moe_blocks(model, max_tokens=64)
        spaces = {id(m.layer.workspace) for m in model.modules() if hasattr(m, "layer_id")}
        assert len(spaces) == 1
        gen = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 8)
    print(f"{family}: {len(refs)} blocks, logits normwise {err:.2e} (bf16 block I/O alone {rounded:.2e})")


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_a_replaced_model_with_peft_s_own_adapter_gives_peft_s_logits(family, tmp_path):
    """An adapter PEFT itself makes (router, shared expert and stacked experts, tests/_hf.py) on a tiny
    float32 model: the replaced model with it loaded (load_lora) and two sequences in one batch, one on
    the adapter and one on -1, gives PEFT's merged model's logits for the first and the base model's for
    the second, within the bound of the base test above (3e-2, or twice what rounding the blocks' input
    and output to bf16 alone does in either model)."""
    pytest.importorskip("transformers")
    from _hf import PEFT_ROUTER_AND_SHARED, PEFT_STACKED, peft_or_skip, random_peft_adapter, tiny_model

    peft_or_skip()
    from cupymoe.integrations.transformers import load_lora, moe_blocks, replace_moe_blocks, set_lora_ids

    base = tiny_model(family, torch.float32).cuda().eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        want_base = base(ids).logits.float()
        rounded_base = _logits_error_with(base, ids, want_base, moe_blocks(base),
                                          lambda ref: _RoundedIO(ref.module.forward))
    # factors of 0.2: the logits move by 0.25 (qwen2_moe) / 0.5 (gpt_oss) normwise on the CPU, past the bound
    adapted = random_peft_adapter(tiny_model(family, torch.float32), tmp_path / "a",
                                  PEFT_ROUTER_AND_SHARED[family] + PEFT_STACKED, size=0.2)
    adapted = adapted.merge_and_unload().cuda().eval()
    with torch.no_grad():
        want_adapted = adapted(ids).logits.float()
        rounded_adapted = _logits_error_with(adapted, ids, want_adapted, moe_blocks(adapted),
                                             lambda ref: _RoundedIO(ref.module.forward))
    assert replace_moe_blocks(base, max_tokens=64, max_loras=2, max_lora_rank=4) > 0
    assert load_lora(base, 1, tmp_path / "a") == len(moe_blocks(adapted))
    set_lora_ids(base, torch.tensor([1, -1], dtype=torch.int32, device="cuda"))
    with torch.no_grad():
        got = base(ids).logits.float()
    set_lora_ids(base, None)
    want = torch.cat([want_adapted[:1], want_base[1:]])
    bound = max(3e-2, 2 * rounded_base, 2 * rounded_adapted)
    moved = float((want_adapted[0] - want_base[0]).norm() / want_base[0].norm())
    assert moved > 3 * bound, f"the adapter moves sequence 0's logits by {moved:.3e} only (bound {bound:.3e})"
    for b, name in ((0, "PEFT's merged model"), (1, "the base model")):
        err = float((got[b] - want[b]).norm() / want[b].norm())
        assert err < bound, f"{family}: sequence {b} normwise {err:.3e} against {name} (bound {bound:.3e})"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_replaced_model_serves_peft_adapters(family, tmp_path, rng):
    """replace_moe_blocks(max_loras, max_lora_rank), load_lora of a PEFT target_parameters adapter (every
    MoE block's share) and set_lora_ids: each replaced block's output equals its layer's own forward with
    the same rows' slots bit for bit ([batch] ids spread over each sequence), moves off the base output
    where a row has an adapter, and a generate runs with the adapter on; after clear_lora the same ids
    run the emptied slot, still the layer's own bits."""
    transformers = pytest.importorskip("transformers")
    from _lora import stacked_adapter, write_stacked_peft
    from cupymoe.integrations.transformers import (clear_lora, load_lora, moe_blocks, replace_moe_blocks,
                                                   replaced_blocks, set_lora_ids)

    config = {k: v for k, v in testing.hf_config_dict(family).items() if k != "architectures"}
    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.for_model(**config, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * 0.1).to(torch.bfloat16).float())
    refs = moe_blocks(model)
    assert replace_moe_blocks(model, max_tokens=64, max_loras=2, max_lora_rank=8) == len(refs) > 0
    blocks = replaced_blocks(model)
    tensors = {}
    for _, block in blocks:
        tensors.update(stacked_adapter(block.layer.cfg, rng, "0.20.0", layer_idx=block.layer_idx)[0])
    assert load_lora(model, 1, write_stacked_peft(tmp_path / "a", tensors, "0.20.0")) == len(blocks)
    lora = torch.tensor([1, -1], dtype=torch.int32, device="cuda")  # a slot a sequence
    set_lora_ids(model, lora)
    h = torch.randn(2, 5, model.config.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for _, block in blocks:
            out = block(h)
            out = out[0] if isinstance(out, tuple) else out
            rows = lora[:, None].expand(2, 5).reshape(-1).contiguous()
            want = block.layer(h.reshape(10, -1), lora_ids=rows)
            assert torch.equal(out.reshape(10, -1).view(torch.int16), want.view(torch.int16))
            base = block.layer(h.reshape(10, -1))
            assert not torch.equal(want[:5].view(torch.int16), base[:5].view(torch.int16))  # slot 1's rows
        gen = model.generate(torch.randint(0, model.config.vocab_size, (2, 4), device="cuda"), max_new_tokens=3,
                             do_sample=False)
        assert gen.shape == (2, 7)
        clear_lora(model, 1)
        for _, block in blocks:
            out = block(h)
            out = out[0] if isinstance(out, tuple) else out
            want = block.layer(h.reshape(10, -1), lora_ids=lora[:, None].expand(2, 5).reshape(-1).contiguous())
            assert torch.equal(out.reshape(10, -1).view(torch.int16), want.view(torch.int16))
    set_lora_ids(model, None)
