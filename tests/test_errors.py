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
