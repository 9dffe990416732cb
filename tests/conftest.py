"""Shared pytest setup: GPU tests are marked `gpu` and skip cleanly where no GPU is found."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable through CuPy, else why not."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        return f"no CUDA driver/device ({type(e).__name__}: {e})"
    return None if n > 0 else "no CUDA device found"


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def rng():
    """A fresh random generator per test module, its seed printed (rerun a failure with it)."""
    seed = time.time_ns() % 2**31
    print(f"seed {seed}")
    return np.random.default_rng(seed)
