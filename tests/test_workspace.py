"""The scratch planner's alias proof and the workspace's sizing (CPU), one real allocation (GPU)."""

import numpy as np
import pytest

from cupymoe.config import MoeConfig
from cupymoe.errors import ArenaError, BufferTooSmallError, WorkspaceError
from cupymoe.workspace import (ALIGN, GUARD_BYTES, STAGES, BufferSpec, ScratchView, WorkspaceNeed, layer_scratch,
                               plan_scratch, zeroed_bytes)

STAGES3 = ("a", "b", "c")


def test_buffers_without_aliases_never_overlap():
    plan = plan_scratch(STAGES3, [BufferSpec("x", 100, "a", "c"), BufferSpec("y", 300, "a", "b"),
                                  BufferSpec("z", 1, "c", "c")])
    assert plan.overlapping_pairs() == []
    offs = sorted((p.offset, p.nbytes) for p in plan.placements.values())
    for (o1, n1), (o2, _) in zip(offs, offs[1:]):
        assert o1 + n1 <= o2 and o2 % ALIGN == 0
    assert plan.total_bytes >= sum(n for _, n in offs)


def test_declared_alias_with_disjoint_lifetimes_shares_bytes():
    plan = plan_scratch(STAGES3, [BufferSpec("logits", 1000, "a", "a"), BufferSpec("act", 4000, "b", "c")],
                        aliases=[("logits", "act")])
    assert plan.placements["logits"].offset == plan.placements["act"].offset
    assert plan.overlapping_pairs() == [("logits", "act")]
    assert plan.total_bytes == 4096  # one region, sized for the larger member


def test_bad_alias_table_is_refused_naming_both_buffers_and_stages():
    # the seed's corruption bug: shared-expert scratch aliased onto a buffer still in use
    with pytest.raises(ArenaError, match=r"'scratch'.*'logits'|'logits'.*'scratch'") as e:
        plan_scratch(STAGES3, [BufferSpec("logits", 64, "a", "b"), BufferSpec("scratch", 64, "b", "c")],
                     aliases=[("logits", "scratch")])
    assert "['b']" in str(e.value)


@pytest.mark.parametrize("bad, msg", [
    ([BufferSpec("x", 4, "a", "zz")], "unknown stage"),
    ([BufferSpec("x", 4, "c", "a")], "comes after"),
    ([BufferSpec("x", 4, "a", "a"), BufferSpec("x", 4, "a", "a")], "declared twice"),
    ([BufferSpec("x", -1, "a", "a")], r"'x': size -1 must be a whole number"),
    ([BufferSpec("x", 10.5, "a", "a")], r"'x': size 10.5 must be a whole number"),
    ([BufferSpec("x", None, "a", "a")], r"'x': size None must be a whole number"),
])
def test_malformed_specs_are_refused(bad, msg):
    with pytest.raises(ArenaError, match=msg):
        plan_scratch(STAGES3, bad)


def test_alias_table_naming_unknown_buffer_is_refused():
    with pytest.raises(ArenaError, match="unknown buffer 'nope'"):
        plan_scratch(STAGES3, [BufferSpec("x", 4, "a", "a")], aliases=[("x", "nope")])


@pytest.mark.parametrize("shared, prenorm", [(0, False), (64, True)])
def test_layer_scratch_is_proven_and_sized_for_max_tokens(shared, prenorm):
    cfg = MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                    shared_expert_intermediate_size=shared, pre_expert_norm=prenorm)
    plan = layer_scratch(cfg, max_tokens=33, n_local=16, i_max=64, decode_max_tokens=8)
    assert plan.stages == STAGES
    assert plan.overlapping_pairs() == [("logits", "act")]
    P = 33 * 4 + (33 if shared else 0)
    Pd = 8 * 4 + (8 if shared else 0)  # fp32 decode outputs only for the decode path's rows
    assert plan.placements["y"].nbytes == Pd * 128 * 4
    assert plan.placements["yw"].nbytes == P * 128 * 2
    assert plan.placements["xe"].nbytes == (33 * 128 * 2 if prenorm else 0)


def _regions_and_zones(plan):
    """The plan's byte ranges in address order: ("buf", names, lo, hi) a region, ("zone", zone, lo, hi)."""
    regions: dict[int, list] = {}
    for p in plan.placements.values():
        r = regions.setdefault(p.offset, [[], p.offset, p.offset])
        r[0].append(p.name)
        r[2] = max(r[2], p.offset + p.nbytes)
    items = [("buf", tuple(names), lo, hi) for names, lo, hi in regions.values()]
    items += [("zone", z, z.offset, z.offset + z.nbytes) for z in plan.zones]
    return sorted(items, key=lambda t: (t[2], t[3]))  # a zero-byte buffer before the zone at its address


@pytest.mark.parametrize("w8a8, gathered", [(False, False), (True, True)])
def test_guard_mode_puts_a_red_zone_between_every_buffer_and_keeps_alignment(w8a8, gathered):
    cfg = MoeConfig(hidden_size=160, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                    shared_expert_intermediate_size=64, pre_expert_norm=True)
    args = dict(max_tokens=37, n_local=16, i_max=64, decode_max_tokens=8, w8a8=w8a8, gathered_inputs=gathered)
    plain, plan = layer_scratch(cfg, **args), layer_scratch(cfg, **args, guard=GUARD_BYTES)
    assert plain.zones == () and plan.overlapping_pairs() == plain.overlapping_pairs()
    assert {n: p.nbytes for n, p in plan.placements.items()} == {n: p.nbytes for n, p in plain.placements.items()}
    items = _regions_and_zones(plan)
    kinds = [k for k, *_ in items]
    assert kinds == ["zone", "buf"] * (len(kinds) // 2) + ["zone"], kinds  # zone, buffer, zone, ..., zone
    for prev, nxt in zip(items, items[1:]):
        assert prev[3] == nxt[2], (prev, nxt)  # contiguous: every byte outside the buffers is in a zone
    for kind, what, lo, hi in items:
        if kind == "buf":
            assert lo % ALIGN == 0, what
        else:
            assert hi - lo >= GUARD_BYTES and hi % ALIGN == 0, what
    for (_, z, _, _), (_, names, _, _), (_, z2, _, _) in zip(items[0::2], items[1::2], items[2::2]):
        assert z.before == names[0] and z2.after == "/".join(names)  # each zone names its neighbours
    assert items[-1][3] == plan.total_bytes
    assert plan.total_bytes - plain.total_bytes == GUARD_BYTES * len(plan.zones)


def test_guard_zones_must_keep_alignment():
    with pytest.raises(ArenaError, match="guard=100: red zones must be a multiple of 256"):
        plan_scratch(STAGES3, [BufferSpec("x", 4, "a", "a")], guard=100)


def test_a_workspace_need_covers_every_layer_it_is_made_for():
    a, b = WorkspaceNeed(1000, 0), WorkspaceNeed(700, 300)
    both = a | b
    assert (both.scratch_bytes, both.zeroed_bytes) == (1000, 300)
    assert both.total_bytes == 1024 + 512
    assert zeroed_bytes(128, 768, w8a8=True) == 129 * 6 * 4 and zeroed_bytes(128, 768, w8a8=False) == 0


def test_a_scratch_view_names_its_buffers_and_refuses_unknown_ones():
    plan = plan_scratch(STAGES3, [BufferSpec("x", 4, "a", "b"), BufferSpec("y", 300, "c", "c")])
    view = ScratchView(plan, 1 << 20, 1 << 16, 512)
    assert view.ptr("x") == 1 << 20 and view.ptr("y") == (1 << 20) + 256 and view.ptr("act_tickets") == 1 << 16
    assert view.nbytes("act_tickets") == 512 and view.require("y", 300) == view.ptr("y")
    for ask in (lambda: view.ptr("nope"), lambda: view.require("nope", 1)):
        with pytest.raises((ArenaError, KeyError), match=r"'nope'"):
            ask()
    with pytest.raises(BufferTooSmallError, match="y too small: need 301 bytes, have 300"):
        view.require("y", 301)


@pytest.mark.gpu
def test_a_workspace_on_gpu_has_fixed_aligned_addresses_and_checks_fit():
    import cupy

    from cupymoe.workspace import Workspace

    ws = Workspace(WorkspaceNeed(5000, 700))
    assert ws.base % ALIGN == 0 and ws.scratch_base == ws.base + 768 and ws.nbytes >= 5000 + 700
    zeros = cupy.ndarray((700,), cupy.uint8, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ws.base, 700, ws), 0))
    assert int(zeros.sum()) == 0  # the zeroed region starts zeroed
    ws.check_fits(WorkspaceNeed(5000, 700), "a layer")
    with pytest.raises(WorkspaceError, match="needs 6000 bytes of scratch"):
        ws.check_fits(WorkspaceNeed(6000, 0), "a layer")
    with pytest.raises(WorkspaceError, match="a WorkspaceNeed or a number of bytes"):
        Workspace("lots")


def test_a_workspace_need_at_tokens_no_layer_could_take_is_refused():
    """workspace_need(0) gave the layer's own size, -5 an arena error, 10**9 a 1.4 TB need: refused as the
    constructor refuses max_tokens (a stand-in layer: the checks come before anything is sized)."""
    from types import SimpleNamespace

    from cupymoe import testing
    from cupymoe.errors import ConfigError, OptionError
    from cupymoe.layer import MoeLayer

    cfg = testing.tiny_config("qwen3_moe")
    layer = SimpleNamespace(cfg=cfg, default_path="auto", _owned=tuple(range(cfg.num_experts)))
    for bad in (0, -5, 2.5, True):
        with pytest.raises(OptionError, match=rf"max_tokens={bad!r}: must be a positive integer"):
            MoeLayer.workspace_need(layer, bad)
    with pytest.raises(ConfigError, match=r"max_tokens=1000000000: the kernels serve at most"):
        MoeLayer.workspace_need(layer, 10**9)


def test_a_workspace_need_at_a_numpy_integer_is_the_ints():
    """np.int64(256) passes the checks as 256 does; the buffers were sized with it (an ArenaError)."""
    from types import SimpleNamespace

    import numpy as np

    from cupymoe import testing
    from cupymoe.knobs import Knobs
    from cupymoe.layer import MoeLayer
    from cupymoe.plan import LayerOptions, plan_layer

    cfg = testing.tiny_config("qwen3_moe")
    lp = plan_layer(cfg, "bf16", None, "sm_90a", options=LayerOptions(), knobs=Knobs(), table={})
    layer = SimpleNamespace(cfg=cfg, default_path="auto", _owned=tuple(range(cfg.num_experts)), plan=lp,
                            _lora_plan=lp, _guard=0, _lora_experts=False, _lora_rank=0, _lora_stack_ks=0,
                            _lora_router_t_cols=0, max_tokens=512)
    want = MoeLayer.workspace_need(layer, 256)
    assert want != MoeLayer.workspace_need(layer, None)
    for v in (np.int64(256), np.int32(256), np.uint16(256)):
        assert MoeLayer.workspace_need(layer, v) == want


@pytest.mark.parametrize("bad", [1.5, True, "0"])
def test_a_workspace_device_that_is_no_index_is_refused(bad):
    from cupymoe.workspace import Workspace

    with pytest.raises(WorkspaceError, match=rf"Workspace\(device={bad!r}\): a device index \(int\) is required"):
        Workspace(1024, device=bad)


def test_workspace_needs_that_are_no_byte_counts_are_refused_and_no_gpu_is_named():
    """WorkspaceNeed(2.5) and WorkspaceNeed(10, True) passed; Workspace(WorkspaceNeed("a")) raised
    TypeError, for_layers([4096]) AttributeError; without a GPU, Workspace raised CuPy's own error."""
    from cupymoe.errors import CudaUnavailableError
    from conftest import gpu_unavailable_reason
    from cupymoe.workspace import Workspace, WorkspaceNeed

    for args in ((2.5,), (10, True), ("a",), (-1,), (0, -8)):
        with pytest.raises(WorkspaceError, match=r"WorkspaceNeed\.\w+=.*: must be a whole number of bytes >= 0"):
            WorkspaceNeed(*args)
    for bad in (-1, True, 2.5, "1024"):
        with pytest.raises(WorkspaceError, match="give a WorkspaceNeed or a number of bytes >= 0"):
            Workspace(bad)
    with pytest.raises(WorkspaceError, match=r"for_layers: 4096 is no WorkspaceNeed"):
        Workspace.for_layers([WorkspaceNeed(8), 4096])
    assert (WorkspaceNeed(np.int64(8)) | WorkspaceNeed(4, 2)) == WorkspaceNeed(8, 2)
    if gpu_unavailable_reason() is not None:
        with pytest.raises(CudaUnavailableError):
            Workspace(1 << 20)
