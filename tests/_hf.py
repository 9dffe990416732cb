"""Test helpers for transformers' own MoE blocks: tiny float64 models of each family, a block's forward
on numpy rows, the normwise distance (CPU; the callers importorskip torch and transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import testing

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # small: only the MoE blocks run


def tiny_model(family: str, dtype=None, **overrides):
    """AutoModelForCausalLM.from_config of the family's tiny config (eager experts), every parameter
    bf16-valued (exact in the float32 HostWeights the loader keeps), float64 unless `dtype`."""
    import torch
    import transformers

    dtype = torch.float64 if dtype is None else dtype
    config = {k: v for k, v in testing.hf_config_dict(family, **overrides).items() if k != "architectures"}
    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.for_model(**config, **ATTENTION)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * 0.1).to(torch.bfloat16).to(dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((torch.randn_like(b) * 0.05).to(torch.bfloat16).to(dtype))
    return model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny float64 ops: a second intra-op thread only waits (32 ms a linear instead of 60 us on 2 cores).
    Autouse in a test module that imports it."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_block(block, x: np.ndarray):
    """The block's forward on rows `x` [n, H] as one float64 sequence (its raw output)."""
    import torch

    with torch.no_grad():
        return block(torch.from_numpy(np.asarray(x).astype(np.float64))[None])


def block_rows(out, returns_tuple: bool) -> np.ndarray:
    """A block output's hidden states as rows [n, H]."""
    return (out[0] if returns_tuple else out)[0].numpy()


def normwise(theirs: np.ndarray, ours: np.ndarray) -> float:
    return float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours))


# PEFT adapters (tests/test_lora_peft.py, test_gpu_torch.py): the stacked experts' parameters, and per family
# the router's and shared expert's weights as parameters: a router that is no nn.Linear must be adapted so
# (PEFT refuses it as a module); a shared expert named as modules is rewritten by PEFT for the families
# transformers 5 converts from v4 naming (test_lora_peft.py::test_v4_style_shared_expert_targets)
PEFT_STACKED = ["experts.gate_up_proj", "experts.down_proj"]
_SHARED = {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert", "deepseek_v3": "shared_experts"}
PEFT_ROUTER_AND_SHARED = {
    family: ([] if family == "longcat_flash" else ["router.weight" if family == "gpt_oss" else "gate.weight"])
    + [f"{_SHARED[family]}.{p}_proj.weight" for p in ("gate", "up", "down") if family in _SHARED]
    # longcat's router reads classifier.weight directly, past PEFT's wrappers (test_linear_router_...)
    for family in testing.FAMILIES
}


def peft_or_skip():
    """peft, or a skip naming why: absent, not importable beside this transformers (0.17 imports names
    transformers 5 dropped; 0.21 raises on 5.10), or older than `target_parameters` (0.17)."""
    import dataclasses

    import transformers

    try:
        import peft
    except Exception as e:
        pytest.skip(f"needs peft, importable beside transformers {transformers.__version__} ({e})",
                    allow_module_level=True)
    if "target_parameters" not in {f.name for f in dataclasses.fields(peft.LoraConfig)}:
        pytest.skip(f"peft {peft.__version__} has no target_parameters", allow_module_level=True)
    return peft


def random_peft_adapter(model, path, params, modules=(), seed=1, size=0.1, **lora_options):
    """`model` wrapped by PEFT (r 4, lora_alpha 8) on target `params` and `modules`, random bf16-valued
    factors (exact in float32), saved to `path` as float32 (load_peft refuses float64); the PEFT model."""
    import peft
    import torch
    from safetensors.torch import load_file, save_file

    from cupymoe.lora import ADAPTER_WEIGHTS

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(modules),
                             target_parameters=list(params) or None, init_lora_weights=False, **lora_options)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen, dtype=p.dtype) * size).to(torch.bfloat16).to(p.dtype))
    wrapped.save_pretrained(path)
    weights = path / ADAPTER_WEIGHTS
    save_file({k: v.float().contiguous() for k, v in load_file(weights).items()}, weights)
    return wrapped
