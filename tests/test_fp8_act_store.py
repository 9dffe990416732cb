"""CPU tests of the w8a8 gate/up's optional bf16 activation store (MoeLayer(keep_w8a8_activation=...)):
production plans name the grouped gate/up without it (grouped_gemm_sm90_fp8<0>, _tma<0>), a layer
built to keep it names <0, true> and nothing else changes; the kernel file guards its one store by
the template flag; verify refuses by name to read the activation of a forward that did not store it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import cupymoe
from cupymoe import bench, catalog as C, jit, testing
from cupymoe.catalog import GemmMode
from cupymoe.errors import ActivationNotKeptError, OptionError
from cupymoe.forward_plan import build_forward_plan
from cupymoe.knobs import Knobs
from cupymoe.plan import DeviceFacts, LayerOptions, Path, plan_layer

H200 = DeviceFacts.h200()
VARIANTS = {"cp_async": Knobs(), "tma": Knobs.from_env({"CUPYMOE_SM90_FP8_VARIANT": "tma"})}


def _lp(cfg, knobs=Knobs(), fmt="fp8_block", arch="sm_90a", **options):
    shared = fmt if cfg.has_shared_expert else None
    return plan_layer(cfg, fmt, shared, arch, options=LayerOptions(**options), knobs=knobs, table={})


def _gemms(lp, n, path=Path.PREFILL):
    plan = build_forward_plan(lp, H200, n, path).at(n)
    return [s for s in plan.launches if s.stage.value in ("gate_up", "down") and s.kernel.startswith("grouped_gemm")]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3", "qwen3-next-80b"])
def test_production_skips_the_store_and_keeping_it_changes_only_gate_ups_name(preset, variant):
    cfg = bench.preset_config(preset)
    tma = "_tma" if variant == "tma" else ""
    off, on = _lp(cfg, VARIANTS[variant]), _lp(cfg, VARIANTS[variant], keep_w8a8_activation=True)
    assert not off.keep_w8a8_activation and on.keep_w8a8_activation
    names = set(jit.MODULES["grouped_sm90_fp8" + tma].names)
    for n in (256, 4096):
        a, b = _gemms(off, n), _gemms(on, n)
        assert [s.kernel for s in a] == [f"grouped_gemm_sm90_fp8{tma}<0>", f"grouped_gemm_sm90_fp8{tma}<1>"]
        assert [s.kernel for s in b] == [f"grouped_gemm_sm90_fp8{tma}<0, true>", f"grouped_gemm_sm90_fp8{tma}<1>"]
        assert {s.kernel for s in a + b} <= names
        for x, y in zip(a, b):  # the same grid, block, shared memory and arguments (`out` too)
            assert (x.grid, x.block, x.smem, x.args) == (y.grid, y.block, y.smem, y.args)
    for n in (1, 17, 64):  # the decode path's kernels store the activation either way (their quantizer reads it)
        for path in (Path.DECODE, Path.ATOMIC):
            assert build_forward_plan(off, H200, n, path).at(n) == build_forward_plan(on, H200, n, path).at(n)


def test_every_w8a8_instance_is_listed_for_nvrtc_with_its_shared_memory():
    names = C.sm90_fp8_kernels(False)
    assert jit.MODULES["grouped_sm90_fp8"].names == names and len(set(names)) == 3
    assert C.sm90_fp8_kernel(GemmMode.GATE_UP, False, True) in names
    assert all(jit.opt_in_smem(name, H200.max_smem) == C.sm90_fp8_smem_bytes() for name in names)
    names = C.sm90_fp8_kernels(True)  # three a form of the TMA kernel
    assert jit.MODULES["grouped_sm90_fp8_tma"].names == names and len(set(names)) == 3 * len(C.FP8_TMA_SHAPES)
    for shape in C.FP8_TMA_SHAPES.values():
        form = [C.sm90_fp8_kernel(m, True, keep, shape.wgs) for m, keep in ((0, False), (1, False), (0, True))]
        assert set(form) <= set(names)
        assert all(jit.opt_in_smem(name, H200.max_smem) == shape.smem_bytes() for name in form)
    with pytest.raises(AssertionError):  # down has no activation to store
        C.sm90_fp8_kernel(GemmMode.DOWN, False, True)


@pytest.mark.parametrize("kw", [dict(fp8_compute="w8a16"), dict(fmt="bf16"), dict(fmt="nvfp4"), dict(arch="sm_80")])
def test_layers_without_the_w8a8_gemm_ignore_the_option(kw):
    cfg = bench.preset_config("qwen3-30b-a3b")
    fmt, arch = kw.pop("fmt", "fp8_block"), kw.pop("arch", "sm_90a")
    off = _lp(cfg, fmt=fmt, arch=arch, **kw)
    on = _lp(cfg, fmt=fmt, arch=arch, keep_w8a8_activation=True, **kw)
    assert not on.keep_w8a8_activation and not on.w8a8
    for n in (300, 4096):
        plans = [build_forward_plan(lp, H200, n, Path.PREFILL).at(n) for lp in (off, on)]
        assert plans[0] == plans[1]


@pytest.mark.parametrize("bad", [1, "yes", None, np.bool_(True)])
def test_a_value_that_is_not_a_bool_is_refused_by_name(bad):
    with pytest.raises(OptionError, match=r"keep_w8a8_activation=.*: must be True or False"):
        LayerOptions(keep_w8a8_activation=bad)
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, np.random.default_rng(0), "fp8_block")
    with pytest.raises(OptionError, match="keep_w8a8_activation="):  # before any device is looked for
        cupymoe.MoeLayer(cfg, hw, max_tokens=4, keep_w8a8_activation=bad)


def test_the_kernels_store_the_activation_only_under_the_flag():
    src = (jit.kernel_dir() / "fp8_gemm.cuh").read_text()
    body = src[src.index("template <int ACT, bool STORE_ACT>"):src.index("float div_rn_nearest(")]
    stores = re.findall(r"^.*\*reinterpret_cast<[^>]+\*>\([^)]*\) = .*$", body, re.M)
    assert len(stores) == 1 and "if (STORE_ACT && " in stores[0], stores
    for f in ("grouped_sm90_fp8.cu", "grouped_sm90_fp8_tma.cu"):
        kernel = (jit.kernel_dir() / f).read_text()
        assert re.search(r"template <int MODE, bool STORE_ACT = false(, int WGS = 2)?>", kernel), f
        assert re.search(r"fp8_gate_up_act<[^<>]*, STORE_ACT>|emit_gate_up_fp8<[^<>]*, STORE_ACT>", kernel), f


def _entries(module: str) -> dict:
    """Each kernel's PTX of `module` (NVRTC on the CPU, through the kernel cache), by name expression."""
    cm = jit.compile_module(module, "sm_90a")
    out = {}
    for expr, mangled in cm.lowered.items():
        start = cm.ptx.index(f".entry {mangled}(")
        end = cm.ptx.find(".entry ", start + 1)
        out[expr] = cm.ptx[start:end if end >= 0 else len(cm.ptx)]
    return out


@pytest.mark.parametrize("module", ["grouped_sm90_fp8", "grouped_sm90_fp8_tma"])
def test_the_production_gate_up_has_no_bf16_stores(module):
    """The bf16x2 stores (st.global.u32) are the kept instance's alone: production's gate/up stores
    only the e4m3 codes (u16) and their scales (f32)."""
    e = _entries(module)
    tma = "_tma" if module.endswith("_tma") else ""
    off, on = e[f"grouped_gemm_sm90_fp8{tma}<0>"], e[f"grouped_gemm_sm90_fp8{tma}<0, true>"]
    bf16x2 = re.compile(r"st\.global(\.\w+)*\.(u32|b32)\s")
    assert not bf16x2.search(off) and bf16x2.search(on)
    if tma:  # the one-warpgroup form alike
        assert not bf16x2.search(e["grouped_gemm_sm90_fp8_tma<0, false, 1>"])
        assert bf16x2.search(e["grouped_gemm_sm90_fp8_tma<0, true, 1>"])
    for op in ("st.global.u16", "st.global.f32"):
        assert off.count(op) == on.count(op) > 0, op


def _layer(cfg, keep: bool, fmt="fp8_block", fp8_compute="auto"):
    """What verify reads of a layer before its scratch: its plan (and fp8_compute, as check() asks)."""
    lp = _lp(cfg, fmt=fmt, fp8_compute=fp8_compute, keep_w8a8_activation=keep)
    return SimpleNamespace(plan=lp, fp8_compute=None if lp.fp8_compute is None else lp.fp8_compute.value)


def test_verify_refuses_the_activation_of_a_forward_that_did_not_store_it():
    from cupymoe import verify

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, np.random.default_rng(1), "fp8_block")
    x = testing.random_input(np.random.default_rng(2), 3, cfg.hidden_size)
    off = _layer(cfg, keep=False)
    assert issubclass(ActivationNotKeptError, OptionError) and "ActivationNotKeptError" in cupymoe.__all__
    for call in (lambda: verify.require_kept_activation(off, "prefill"),
                 lambda: verify.W8a8Stages(off, cfg, hw, x, "prefill"),  # before it reads any scratch
                 lambda: verify.check(np.zeros_like(x), cfg, hw, x, "prefill", layer=off)):
        with pytest.raises(ActivationNotKeptError, match=r"keep_w8a8_activation=True"):
            call()
    for path in ("decode", "atomic"):  # their kernels store the activation either way
        verify.require_kept_activation(off, path)
    verify.require_kept_activation(_layer(cfg, keep=True), "prefill")
    verify.require_kept_activation(_layer(cfg, keep=False, fp8_compute="w8a16"), "prefill")
    verify.require_kept_activation(_layer(cfg, keep=False, fmt="bf16"), "prefill")
