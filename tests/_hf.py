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
