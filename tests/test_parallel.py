"""Expert parallelism: ownership, communicators, partial outputs, NCCL (one and two GPUs)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cupymoe import reference, testing
from cupymoe.errors import OptionError
from cupymoe.parallel import check_communicator, owned_experts
from cupymoe.verify import PATH_ROUNDING, bf16_bits, bits_to_f32, check, compare, run_layer, well_separated_input


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
    for bad in ({e: e % 2 for e in range(10)}, 1, "0101010101"):  # a dict's keys were read as the ranks
        with pytest.raises(OptionError, match="expected a sequence of ranks, one per expert"):
            owned_experts(cfg, bad)


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


def test_communicator_misuse_is_refused_by_name():
    """A rank outside the world (before NCCL is touched), an all-reduce of no whole elements or of a dtype it
    does not take, and one on a closed communicator: cupymoe errors, not bare ValueError / RuntimeError."""
    from cupymoe.errors import OptionError, ParallelError
    from cupymoe.parallel import NcclCommunicator, _count

    with pytest.raises(OptionError, match=r"rank=2 outside 0\.\.1"):
        NcclCommunicator(2, 2, None)
    with pytest.raises(OptionError, match=r"dtype='fp16': all_reduce takes one of"):
        _count(64, "fp16")
    with pytest.raises(OptionError, match="nbytes=6 is not a whole number of fp32 elements"):
        _count(6, "fp32")
    closed = object.__new__(NcclCommunicator)
    closed._comm = None
    with pytest.raises(ParallelError, match="all_reduce on a closed NcclCommunicator"):
        closed.all_reduce(0, 64, "fp32", 0)


def test_spawn_ranks_collects_results_and_reports_failed_or_dead_ranks():
    from cupymoe.errors import ParallelError
    from cupymoe.parallel import spawn_ranks

    kw = dict(make_unique_id=lambda: b"uid", use_gpus=False)
    assert spawn_ranks(_rank_ok, 3, 10, **kw) == [0, 10, 20]
    with pytest.raises(ParallelError, match="(?s)rank 1:.*ValueError: rank one refuses"):
        spawn_ranks(_rank_raises, 2, **kw)
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank\(s\) \[1\] exited with code\(s\) \[3\]"):
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
        # verify.check's budget for the path: the grouped path rounds each term before the sum, which a
        # bare compare() left out of the envelope (a seed's rank-1 prefill partial read 1.05 of it)
        c = check(out, rcfg, hw, x, path, layer=layer, owned_experts=mine)
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


# (family, format, experts dealt every other one, fp8_compute): bf16 with contiguous blocks, the
# quantized formats with the interleaved map (the selection an index array, not a slice)
TWO_RANK_CASES = [("qwen2_moe", "bf16", False, "auto"), ("longcat_flash", "bf16", False, "auto"),
                  ("deepseek_v3", "fp8_block", True, "w8a16"), ("deepseek_v3", "fp8_block", True, "auto"),
                  ("qwen3_next", "nvfp4", True, "auto"), ("mixtral", "mxfp4", True, "auto")]  # E even: E / 2 a rank


@pytest.mark.gpu
@pytest.mark.parametrize("family, fmt, interleaved, fp8_compute", TWO_RANK_CASES)
def test_two_ranks_over_nccl_equal_the_single_gpu_layer(family, fmt, interleaved, fp8_compute):
    """Two processes, one GPU each, decode and prefill at N = 1, 7, 64, 1000, for each case: the
    ranks' outputs agree bit for bit, eager and replayed, and equal the full layer within the
    envelope of two bf16 partials (bf16: against the faithful sum of the rounded partials too;
    quantized: each partial's rounding, w8a8's activation codes, as the one-GPU partials test)."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    from cupymoe.parallel import spawn_ranks
    from cupymoe.verify import path_roundings

    seed = time.time_ns() % 2**31
    what = f"{family} {fmt} {'interleaved' if interleaved else 'contiguous'} {fp8_compute} (seed {seed})"
    outs = spawn_ranks(testing.ep_rank_check, 2, family, seed, (1, 7, 64, 1000), ("decode", "prefill"), fmt,
                       interleaved, fp8_compute)
    w8a8 = outs[0].pop("fp8_compute") == "w8a8"
    outs[1].pop("fp8_compute")
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, np.random.default_rng(seed), fmt,
                                     shared_fmt="bf16" if fmt != "bf16" else None)
    owner = [e % 2 for e in range(cfg.num_experts)] if interleaved else None
    ep = [cfg.replace(ep_world_size=2, ep_rank=r) for r in (0, 1)]
    for key, (x, eager0, graph0) in outs[0].items():
        _, eager1, graph1 = outs[1][key]
        assert np.array_equal(eager0, eager1), f"{what} {key}: ranks disagree"
        assert np.array_equal(eager0, graph0) and np.array_equal(eager1, graph1), f"{what} {key}: graph != eager"
        path = key[1]
        mine = [owned_experts(c, owner) for c in ep]
        partials = [reference.moe_forward(c, hw, x, owned_experts=m) for c, m in zip(ep, mine)]
        exact = reference.moe_forward(cfg, hw, x)
        if fmt == "bf16":  # each rank's partial is rounded to bf16 before the sum (cupymoe.verify)
            faithful = sum(bits_to_f32(bf16_bits(reference.moe_forward(c, hw, x, owned_experts=m,
                                                                      rounding=PATH_ROUNDING[path])))
                           for c, m in zip(ep, mine))
            c = compare(eager0, exact, faithful, partials=partials)
        else:
            if PATH_ROUNDING[path] == "grouped":
                partials.append(reference.moe_forward(cfg, hw, x, rounding="grouped", absolute=True))
            c = compare(eager0, exact, roundings=path_roundings(hw, path), partials=partials, w8a8=w8a8)
        assert c.ok, f"{what} {key}: {c}"
