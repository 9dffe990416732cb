"""The arena planner's alias proof (CPU) and one real allocation (GPU)."""

import pytest

from cupymoe.arena import ALIGN, ArenaError, BufferSpec, plan_arena
from cupymoe.config import MoeConfig
from cupymoe.layer import STAGES, plan_layer_arena

STAGES3 = ("a", "b", "c")


def test_buffers_without_aliases_never_overlap():
    plan = plan_arena(STAGES3, [BufferSpec("x", 100, "a", "c"), BufferSpec("y", 300, "a", "b"),
                                BufferSpec("z", 1, "c", "c")])
    assert plan.overlapping_pairs() == []
    offs = sorted((p.offset, p.nbytes) for p in plan.placements.values())
    for (o1, n1), (o2, _) in zip(offs, offs[1:]):
        assert o1 + n1 <= o2 and o2 % ALIGN == 0
    assert plan.total_bytes >= sum(n for _, n in offs)


def test_declared_alias_with_disjoint_lifetimes_shares_bytes():
    plan = plan_arena(STAGES3, [BufferSpec("logits", 1000, "a", "a"), BufferSpec("act", 4000, "b", "c")],
                      aliases=[("logits", "act")])
    assert plan.placements["logits"].offset == plan.placements["act"].offset
    assert plan.overlapping_pairs() == [("logits", "act")]
    assert plan.total_bytes == 4096  # one region, sized for the larger member


def test_bad_alias_table_is_refused_naming_both_buffers_and_stages():
    # the seed's corruption bug: shared-expert scratch aliased onto a buffer still in use
    with pytest.raises(ArenaError, match=r"'scratch'.*'logits'|'logits'.*'scratch'") as e:
        plan_arena(STAGES3, [BufferSpec("logits", 64, "a", "b"), BufferSpec("scratch", 64, "b", "c")],
                   aliases=[("logits", "scratch")])
    assert "['b']" in str(e.value)


@pytest.mark.parametrize("bad, msg", [
    ([BufferSpec("x", 4, "a", "zz")], "unknown stage"),
    ([BufferSpec("x", 4, "c", "a")], "comes after"),
    ([BufferSpec("x", 4, "a", "a"), BufferSpec("x", 4, "a", "a")], "declared twice"),
    # sizes: whole bytes only (a float size had given a float total_bytes for the allocation)
    ([BufferSpec("x", -1, "a", "a")], r"'x': size -1 must be a whole number"),
    ([BufferSpec("x", 10.5, "a", "a")], r"'x': size 10.5 must be a whole number"),
    ([BufferSpec("x", None, "a", "a")], r"'x': size None must be a whole number"),
])
def test_malformed_specs_are_refused(bad, msg):
    with pytest.raises(ArenaError, match=msg):
        plan_arena(STAGES3, bad)


def test_alias_table_naming_unknown_buffer_is_refused():
    with pytest.raises(ArenaError, match="unknown buffer 'nope'"):
        plan_arena(STAGES3, [BufferSpec("x", 4, "a", "a")], aliases=[("x", "nope")])


@pytest.mark.parametrize("shared, prenorm", [(0, False), (64, True)])
def test_layer_plan_is_proven_and_sized_for_max_tokens(shared, prenorm):
    cfg = MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                    shared_expert_intermediate_size=shared, pre_expert_norm=prenorm)
    plan = plan_layer_arena(cfg, max_tokens=33, n_local=16, i_max=64, decode_max_tokens=8)
    assert plan.stages == STAGES
    assert plan.overlapping_pairs() == [("logits", "act")]
    P = 33 * 4 + (33 if shared else 0)
    Pd = 8 * 4 + (8 if shared else 0)  # fp32 decode outputs only for the decode path's rows
    assert plan.placements["y"].nbytes == Pd * 128 * 4
    assert plan.placements["yw"].nbytes == P * 128 * 2
    assert plan.placements["xe"].nbytes == (33 * 128 * 2 if prenorm else 0)


@pytest.mark.gpu
def test_arena_on_gpu_has_fixed_aligned_addresses():
    import cupy

    from cupymoe.arena import Arena, BufferTooSmallError

    plan = plan_arena(STAGES3, [BufferSpec("x", 1000, "a", "b"), BufferSpec("y", 10, "c", "c")],
                      aliases=[("x", "y")])
    arena = Arena(plan, 0)
    assert arena.ptr("x") == arena.ptr("y") == arena.base and arena.base % ALIGN == 0
    cupy.cuda.runtime.memset(arena.ptr("x"), 7, 1000)
    with pytest.raises(BufferTooSmallError, match="x too small: need 2000 bytes, have 1000"):
        arena.require("x", 2000)
    assert arena.require("x", 1000) == arena.base


def test_arena_names_an_unknown_buffer_whatever_asks():
    """ptr, nbytes and require all name the missing buffer and list the planned ones
    (require had raised a bare KeyError through nbytes). No GPU: the arena's bookkeeping
    without its allocation."""
    from cupymoe.arena import Arena

    arena = Arena.__new__(Arena)  # the plan and a base address; __init__ would allocate
    arena.plan, arena.base = plan_arena(STAGES3, [BufferSpec("x", 4, "a", "b")]), 1 << 20
    for ask in (lambda: arena.ptr("nope"), lambda: arena.nbytes("nope"), lambda: arena.require("nope", 1)):
        with pytest.raises(KeyError, match=r"arena has no buffer 'nope'; buffers: \['x'\]"):
            ask()
    assert arena.require("x", 4) == 1 << 20
