"""Shared pytest setup: GPU tests are marked `gpu` and skip cleanly where no GPU is found."""

from __future__ import annotations

import functools
import os
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


pytest_plugins = ["pytester"]  # tests/test_conftest.py runs this file's hooks on a test of its own

_SEEDS: dict[str, int] = {}  # module name -> the seed of its rng


@pytest.fixture(scope="module")
def rng(request):
    """A fresh random generator per test module: seeded from CUPYMOE_TEST_SEED where set, else
    from the clock. A failing test's report names the seed (its module's tests draw from one
    generator in order, so rerunning the module with CUPYMOE_TEST_SEED replays the draws)."""
    env = os.environ.get("CUPYMOE_TEST_SEED")
    seed = int(env) if env else time.time_ns() % 2**31
    _SEEDS[request.module.__name__] = seed
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = _SEEDS.get(getattr(item.module, "__name__", ""))
    if report.failed and seed is not None and "rng" in item.fixturenames:
        report.sections.append(("rng seed", f"this module's rng seed {seed}: rerun the module with "
                                            f"CUPYMOE_TEST_SEED={seed} to replay its draws"))


@pytest.fixture
def inspect_scratch(capsys):
    """`python -m cupymoe inspect ARGV...` run in-process: max_tokens -> the scratch bytes its
    "scratch at" lines report (what a MoeLayer of that checkpoint would allocate)."""
    import re

    from cupymoe.__main__ import main

    def run(*argv) -> dict[int, int]:
        assert main(["inspect", *map(str, argv)]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "scratch at max_tokens" in ln]
        return {int(re.search(r"max_tokens=(\d+)", ln).group(1)): int(re.search(r"\((\d+) bytes", ln).group(1))
                for ln in lines}

    return run
