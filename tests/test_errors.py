"""cupymoe.Error is the root of what the package raises; without a GPU the layer says so by name."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import cupymoe
from cupymoe import errors, testing

from conftest import gpu_unavailable_reason


def test_every_named_error_derives_from_the_root_and_keeps_its_builtin_base():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, Exception)]
    assert len(classes) >= 18
    for c in classes:
        assert issubclass(c, cupymoe.Error), c
        assert c is cupymoe.Error or any(b in c.__mro__ for b in (ValueError, RuntimeError, NotImplementedError,
                                                                  KeyError, FileNotFoundError)), c
    assert issubclass(cupymoe.MissingTensorError, KeyError) and issubclass(cupymoe.ConfigError, ValueError)
    assert set(cupymoe.__all__) >= {c.__name__ for c in classes}


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="this machine has a GPU")
def test_a_layer_without_a_gpu_is_refused_by_name():
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, np.random.default_rng(0))
    with pytest.raises(cupymoe.CudaUnavailableError):
        cupymoe.MoeLayer(cfg, hw, max_tokens=4)


def test_the_reference_refuses_ranks_experts_and_options_it_would_otherwise_coerce():
    """ep_rank 1.9 / "1" / True read as rank 1, owned_experts [0.5, 7.9] as [0, 7] and [99] as an all-zero
    partial, shared_expert="no" as true, complex weights lost their imaginary part: each is refused by
    name; a bad dtype, owned_experts that is no collection and a lora slot that is no LoraWeights raise
    the package's errors, not TypeError / AttributeError."""
    cfg = testing.tiny_config("qwen3_moe", num_experts=16, ep_world_size=2)
    hw = testing.random_host_weights(cfg, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((3, cfg.hidden_size)).astype(np.float32)
    ref = cupymoe.reference
    for rank in (1.9, "1", True, "one"):
        with pytest.raises(cupymoe.OptionError, match=rf"ep_rank={rank!r}: a rank index \(int\) is required"):
            ref.moe_forward(cfg, hw, x, ep_rank=rank)
    E = cfg.num_experts
    for owned in ([0.5, 7.9], [99], [-1], ["3"]):
        with pytest.raises(cupymoe.OptionError, match=rf"owned_experts holds .*: expert ids are integers in 0..{E - 1}"):
            ref.moe_forward(cfg, hw, x, ep_rank=1, owned_experts=owned)
    with pytest.raises(cupymoe.OptionError, match="owned_experts=5: expected a collection of expert ids"):
        ref.moe_forward(cfg, hw, x, ep_rank=1, owned_experts=5)
    with pytest.raises(cupymoe.OptionError, match="dtype='bogus': the reference computes in float32 or float64"):
        ref.moe_forward(cfg, hw, x, dtype="bogus")
    with pytest.raises(cupymoe.OptionError, match="shared_expert='no': must be True or False"):
        ref.moe_forward(cfg, hw, x, shared_expert="no")
    with pytest.raises(cupymoe.LoraError, match=r"lora\[0\]: expected a cupymoe.lora.LoraWeights, found str"):
        ref.moe_forward(cfg, hw, x, lora={0: "x"}, lora_ids=np.zeros(3, np.int32))
    ids = np.zeros((3, cfg.num_experts_per_tok), np.int32)
    for w in (ids.astype(np.complex64), ids.astype(str), ids.astype(bool)):
        with pytest.raises(cupymoe.MoeCallError, match="given routing: expected integer ids"):
            ref.experts_forward(cfg, hw, x, ids, w)
    # an explicit map's share: the same as the contiguous block it names
    block = sorted(cfg.replace(ep_rank=1).owned_experts())
    assert np.array_equal(ref.moe_forward(cfg, hw, x, ep_rank=1, owned_experts=np.array(block)),
                          ref.moe_forward(cfg, hw, x, ep_rank=np.int64(1)))


def test_the_reference_refuses_by_name_and_the_submodules_follow_a_plain_import():
    """docs/DESIGN.md section 5 calls cupymoe.reference.moe_forward after `import cupymoe`; its refusals
    are the package's own (MoeCallError for the input, OptionError for an option), still ValueErrors."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, np.random.default_rng(0))
    x = np.zeros((2, cfg.hidden_size + 1), np.float32)
    with pytest.raises(cupymoe.MoeCallError, match=rf"x: expected shape \[N, {cfg.hidden_size}\]"):
        cupymoe.reference.moe_forward(cfg, hw, x)
    assert issubclass(cupymoe.MoeCallError, ValueError)
    for name in ("checkpoint", "lora", "reference", "formats", "verify", "testing", "integrations"):
        assert getattr(cupymoe, name).__name__ == f"cupymoe.{name}"
    assert cupymoe.integrations.transformers.replace_moe_blocks
