"""CPU tests of the sizes a layer admits: rows a call (int32 counts, CUDA's grid limits) and the
widest router (top-k's shared memory against the opt-in maximum). What is admitted must launch;
what cannot launch is refused by name when the layer is built."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import catalog as C
from cupymoe import jit, testing
from cupymoe.errors import ConfigError, UnsupportedModelError
from cupymoe.forward_plan import build_forward_plan
from cupymoe.knobs import Knobs
from cupymoe.layer import MoeLayer
from cupymoe.layer_checks import check_smem_fits, check_token_limit
from cupymoe.plan import ArgType, DeviceFacts, LayerOptions, Path, plan_layer

H200 = DeviceFacts.h200()
A100 = DeviceFacts("sm_80", 108, 166912)
INT32_MAX = 2**31 - 1


def _plan(cfg, fmt="bf16", dev=H200, **options):
    shared = fmt if cfg.has_shared_expert else None
    return plan_layer(cfg, fmt, shared, dev.arch, options=LayerOptions(**options), knobs=Knobs())


def _assert_launchable(plan, dev, what: str) -> None:
    """Every grid within CUDA's extents, every int32 argument within int32, shared memory opted in."""
    for launch in plan.launches:
        x, y, z = (tuple(launch.grid) + (1, 1))[:3]
        assert 1 <= x <= INT32_MAX and 1 <= y <= C.MAX_GRID_Y and 1 <= z <= C.MAX_GRID_Y, (what, launch)
        assert launch.smem <= dev.max_smem, (what, launch)
        for a in launch.args:
            if a.type == ArgType.I32:
                assert -2**31 <= a.value <= INT32_MAX, (what, launch.kernel, a)


def test_max_tokens_past_the_limit_is_refused_by_name_before_the_gpu():
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=rf"max_tokens={C.MAX_TOKENS + 1}: .*max_tokens <= {C.MAX_TOKENS}"):
        MoeLayer(cfg, hw, max_tokens=C.MAX_TOKENS + 1)
    check_token_limit(cfg, C.MAX_TOKENS, cfg.num_experts)  # the limit itself is accepted


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family", testing.FAMILIES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4"])
def test_every_plan_at_the_most_rows_a_call_stays_in_cuda_limits(family, fmt, dev):
    cfg = testing.tiny_config(family)
    n = C.token_limit(cfg.num_experts_per_tok, cfg.num_experts, cfg.has_shared_expert)
    assert n == C.MAX_TOKENS
    lp = _plan(cfg, fmt, dev, decode_max_tokens=n, atomic_max_tokens=n)
    for path in (Path.DECODE, Path.ATOMIC, Path.PREFILL):
        _assert_launchable(build_forward_plan(lp, dev, n, path).at(n), dev, f"{family} {fmt} {path.value}")


def test_a_wide_k_over_many_experts_gets_a_lower_limit_that_is_tight():
    """k = 64 over 2048 experts: the grouped GEMMs' M tiles pass gridDim.y before 65536 rows; the
    limit is the last row count whose plan fits, and the layer names it."""
    cfg = testing.tiny_config("qwen3_moe", num_experts=2048, num_experts_per_tok=64)
    limit = C.token_limit(64, 2048, False)
    assert 0 < limit < C.MAX_TOKENS
    assert C.max_tiles(limit, 64, 2048, False) <= C.MAX_GRID_Y < C.max_tiles(limit + 1, 64, 2048, False)
    lp = _plan(cfg)
    _assert_launchable(build_forward_plan(lp, H200, limit, Path.PREFILL).at(limit), H200, "at the limit")
    with pytest.raises(ConfigError, match=rf"max_tokens={limit + 1}: with k=64 over 2048 .*<= {limit}"):
        check_token_limit(cfg, limit + 1, 2048)


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
def test_the_widest_admitted_router_fits_top_k_opt_in(dev):
    """topk_route's scratch at R = MAX_ROUTER_WIDTH is past the 48 KB a launch gets without opting
    in; the opt-in made at load (jit.opt_in_smem) covers it and so does the device."""
    need = C.topk_route_smem_bytes(C.MAX_ROUTER_WIDTH)
    assert C.STATIC_SMEM_LIMIT < need <= dev.max_smem
    for expr in (name for name in jit.MODULES["topk"].names if name.startswith("topk_route")):
        assert jit.opt_in_smem(expr, dev.max_smem) >= need, expr
    cfg = testing.tiny_config("qwen3_moe", num_experts=C.MAX_ROUTER_WIDTH)
    check_smem_fits(cfg, 64, dev)  # 64 local experts: an expert-parallel rank's share
    lp = _plan(cfg, dev=dev, decode_max_tokens=64)
    for path, n in ((Path.PREFILL, 300), (Path.DECODE, 64)):
        topk = [launch for launch in build_forward_plan(lp, dev, n, path).at(n).launches
                if launch.kernel.startswith("topk_route")]
        assert topk and all(launch.smem == need for launch in topk), (path, topk)


def test_a_router_wider_than_the_gpu_opts_in_is_refused_when_built():
    small = DeviceFacts("sm_86", 84, 101376)  # 99 KB a block
    wide = testing.tiny_config("qwen3_moe", num_experts=C.MAX_ROUTER_WIDTH)
    with pytest.raises(UnsupportedModelError, match=r"R = 4096: the top-k kernel needs 132096 bytes.*allows 101376"):
        check_smem_fits(wide, 64, small)
    check_smem_fits(testing.tiny_config("qwen3_moe", num_experts=1504), 64, small)


def test_more_local_experts_than_the_sort_block_holds_are_refused_when_built():
    small = DeviceFacts("sm_86", 84, 101376)
    fits = small.max_smem // C.sort_place_smem_bytes(1)  # bytes grow linearly with the local experts
    cfg = testing.tiny_config("qwen3_moe", num_experts=fits + 1)
    with pytest.raises(UnsupportedModelError, match=rf"{fits + 1} routed experts on one GPU: the grouped path's sort "
                                                    rf"needs \d+ bytes of shared memory a block, this GPU allows 101376"):
        check_smem_fits(cfg, fits + 1, small)
    check_smem_fits(cfg, fits, small)
