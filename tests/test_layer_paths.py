"""CPU tests of MoeLayer's path rules that need no device: which paths a one-row forward may
take (warmup runs each of them once). The layer is built without __init__ (no GPU here), with
only the attributes select_path reads."""

from __future__ import annotations

import pytest

from cupymoe.layer import MoeLayer, PathUnavailableError


def _layer(**attrs) -> MoeLayer:
    layer = object.__new__(MoeLayer)
    defaults = dict(default_path="auto", row_invariant=False, decode_max_tokens=8, atomic_max_tokens=8, cfg=None)
    for name, value in {**defaults, **attrs}.items():
        setattr(layer, name, value)
    return layer


def test_warmup_takes_every_path_the_layer_serves():
    """warmup() once forced "decode" on row-invariant layers, which select_path refuses, so it
    raised on every such layer; and "atomic" at atomic_max_tokens 0. It never ran prefill."""
    assert _layer()._warmup_paths() == ["decode", "atomic", "prefill"]
    assert _layer(row_invariant=True)._warmup_paths() == ["prefill"]
    assert _layer(atomic_max_tokens=0)._warmup_paths() == ["decode", "prefill"]
    with pytest.raises(PathUnavailableError, match="row_invariant=True"):
        _layer(row_invariant=True).select_path(1, "decode")
