"""Expert parallelism: ownership, communicators, partial outputs, NCCL (one and two GPUs)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cupymoe import reference, testing
from cupymoe.errors import OptionError
from cupymoe.parallel import check_communicator, owned_experts
from cupymoe.verify import PATH_ROUNDING, bf16_bits, bits_to_f32, compare, run_layer, well_separated_input


def test_owned_experts_contiguous_by_default_or_from_a_map():
    cfg = testing.tiny_config("qwen2_moe", ep_world_size=2, ep_rank=1)  # E = 10
    assert owned_experts(cfg) == [5, 6, 7, 8, 9]
    assert owned_experts(cfg, [e % 2 for e in range(10)]) == [1, 3, 5, 7, 9]
    with pytest.raises(OptionError, match="has 3 entries; the layer has num_experts=10"):
        owned_experts(cfg, [0, 1, 0])
    with pytest.raises(OptionError, match=r"ranks outside 0..1: \(expert, rank\) \[\(2, 5\)\]"):
        owned_experts(cfg, [0, 1, 5] + [0] * 7)
    with pytest.raises(OptionError, match=r"not whole rank numbers: \(expert, entry\) \[\(1, 1.7\)\]"):
        owned_experts(cfg, [0, 1.7] + [0] * 8)  # int() would have made it rank 1
    assert owned_experts(cfg, np.arange(10) % 2) == [1, 3, 5, 7, 9]  # numpy (and torch) integers are ranks


def test_communicator_must_match_the_ep_world():
    class Fake:
        world_size, rank = 2, 0

        def all_reduce(self, ptr, nbytes, dtype, stream):
            raise AssertionError("not called")

    check_communicator(testing.tiny_config("qwen2_moe", ep_world_size=2, ep_rank=0), Fake())
    with pytest.raises(OptionError, match="rank 0 of 2, but the layer is ep_rank=1 of ep_world_size=2"):
        check_communicator(testing.tiny_config("qwen2_moe", ep_world_size=2, ep_rank=1), Fake())


def _rank_ok(rank, world, uid, scale):
    return rank * scale


def _rank_raises(rank, world, uid):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def _rank_dies(rank, world, uid):
    import os

    if rank == 1:
        os._exit(3)  # a crash in native code leaves no Python exception behind
    time.sleep(60)  # rank 0 would wait in a collective for the dead rank


def test_spawn_ranks_collects_results_and_reports_failed_or_dead_ranks():
    from cupymoe.parallel import spawn_ranks

    kw = dict(make_unique_id=lambda: b"uid", use_gpus=False)
    assert spawn_ranks(_rank_ok, 3, 10, **kw) == [0, 10, 20]
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*ValueError: rank one refuses"):
        spawn_ranks(_rank_raises, 2, **kw)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited with code\(s\) \[3\]"):
        spawn_ranks(_rank_dies, 2, **kw)
    assert time.monotonic() - t0 < 30, "a dead rank must fail the launch at once"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_explicit_owner_map_partials_sum_to_the_full_layer(rng, path):
    """Each rank's partial, run in turn on one GPU, with experts dealt round-robin."""
    from cupymoe import MoeLayer

    cfg = testing.tiny_config("qwen2_moe")  # gated shared expert: counted once, on rank 0
    hw = testing.random_host_weights(cfg, rng)
    owner = [e % 2 for e in range(cfg.num_experts)]
    n = 33
    x = well_separated_input(cfg, hw, rng, n)
    exact = reference.moe_forward(cfg, hw, x)
    total = np.zeros_like(exact)
    for rank in range(2):
        rcfg = cfg.replace(ep_world_size=2, ep_rank=rank)
        layer = MoeLayer(rcfg, hw, max_tokens=64, decode_max_tokens=64, expert_owner=owner)
        out = run_layer(layer, x, path)
        mine = owned_experts(rcfg, owner)
        ex = reference.moe_forward(rcfg, hw, x, owned_experts=mine)
        fa = reference.moe_forward(rcfg, hw, x, owned_experts=mine, rounding="decode" if path == "decode" else "grouped")
        c = compare(out, ex, fa)
        assert c.ok, f"rank {rank}: {c}"
        total += out
    assert compare(total, exact).ok  # two bf16 partials: normwise and envelope only


@pytest.mark.gpu
def test_one_rank_nccl_communicator_eager_and_captured(rng):
    """The NCCL all-reduce on the forward's stream, captured in a graph (one rank: identity)."""
    import cupy

    from cupymoe import MoeLayer
    from cupymoe.parallel import NcclCommunicator

    cfg = testing.tiny_config("deepseek_v3")
    hw = testing.random_host_weights(cfg, rng)
    plain = MoeLayer(cfg, hw, max_tokens=64)
    comm = NcclCommunicator(1, 0, NcclCommunicator.new_unique_id())
    layer = MoeLayer(cfg, hw, max_tokens=64, comm=comm)
    s = cupy.cuda.Stream(non_blocking=True)
    for n in (1, 64):
        x = well_separated_input(cfg, hw, rng, n)
        want = run_layer(plain, x)
        assert np.array_equal(run_layer(layer, x), want)
        eager, out, g = testing.eager_and_graph(layer, cupy.asarray(bf16_bits(x)), n, None, s)
        del g  # a graph that captured NCCL calls goes before its communicator
        assert np.array_equal(bits_to_f32(eager.get()), want)
        assert np.array_equal(bits_to_f32(out.get()), want)


@pytest.mark.gpu
def test_two_ranks_over_nccl_equal_the_single_gpu_layer():
    """Two processes, one GPU each: every rank's output is the full layer's, eager and replayed."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    from cupymoe.parallel import spawn_ranks

    seed = time.time_ns() % 2**31
    for family in ("qwen2_moe", "longcat_flash"):
        outs = spawn_ranks(testing.ep_rank_check, 2, family, seed, (1, 7, 64, 1000), ("decode", "prefill"))
        cfg = testing.tiny_config(family)
        hw = testing.random_host_weights(cfg, np.random.default_rng(seed))
        for key, (x, eager0, graph0) in outs[0].items():
            _, eager1, graph1 = outs[1][key]
            assert np.array_equal(eager0, eager1), f"{family} {key}: ranks disagree"
            assert np.array_equal(eager0, graph0) and np.array_equal(eager1, graph1), f"{family} {key}: graph != eager"
            # each rank's partial is rounded to bf16 before the sum (cupymoe.verify)
            path = key[1]
            ep = cfg.replace(ep_world_size=2)
            partials = [reference.moe_forward(ep, hw, x, ep_rank=r) for r in (0, 1)]
            faithful = sum(bits_to_f32(bf16_bits(reference.moe_forward(ep, hw, x, ep_rank=r,
                                                                      rounding=PATH_ROUNDING[path])))
                           for r in (0, 1))
            c = compare(eager0, reference.moe_forward(cfg, hw, x), faithful, partials=partials)
            assert c.ok, f"{family} {key} (seed {seed}): {c}"
