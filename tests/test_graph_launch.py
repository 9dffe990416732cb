"""The eager forward's graph launch on the CPU: a fake driver records what is captured and
patched, so that a forward is seen to patch exactly the nodes whose values changed."""

from __future__ import annotations

import ctypes

import pytest

from cupymoe import bench, graph_launch
from cupymoe.errors import LaunchError
from cupymoe.forward_plan import build_forward_plan
from cupymoe.graph_launch import NODE_EVENT_RECORD, NODE_KERNEL, NODE_MEMSET, PlanGraph
from cupymoe.knobs import Knobs
from cupymoe.launch import Driver, LaunchConfig, PackedPlan
from cupymoe.plan import AllReduce, CallValue, DeviceFacts, LayerOptions, Path, Stage, plan_layer

H200 = DeviceFacts.h200()


class FakeDriver:
    """Stream capture, graph nodes and exec updates, as far as PlanGraph uses them."""

    def __init__(self, shuffle: bool = False):
        self.nodes: list[tuple[int, tuple]] = []  # (type, what)
        self.patched: list[tuple] = []
        self.launched = 0
        self.shuffle = shuffle

    # -- the direct-launch entry points, which record nodes during a capture
    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        c = LaunchConfig.from_address(cfg)
        self.nodes.append((NODE_KERNEL, (fn, tuple(c.grid), params)))
        return 0

    def cuMemsetD32Async(self, ptr, value, count, stream):
        self.nodes.append((NODE_MEMSET, (ptr, count)))
        return 0

    def cuGetErrorString(self, rc, out):
        return 0

    # -- graph entry points
    def fns(self) -> dict:
        return {name: getattr(self, name, self._ok) for name in graph_launch._SIGNATURES}

    def _ok(self, *args):
        return 0

    def cuEventRecordWithFlags(self, event, stream, flags):
        assert flags == graph_launch.CU_EVENT_RECORD_EXTERNAL
        self.nodes.append((NODE_EVENT_RECORD, (event,)))
        return 0

    def cuStreamEndCapture(self, stream, graph):
        graph._obj.value = 0xC0DE
        return 0

    def cuGraphGetNodes(self, graph, handles, count):
        count._obj.value = len(self.nodes)
        order = list(range(len(self.nodes)))
        if self.shuffle:
            order = order[1:] + order[:1]
        if handles is not None:
            for i, j in enumerate(order):
                handles[i] = 0x100 + j
        return 0

    def cuGraphNodeGetType(self, h, out):
        out._obj.value = self.nodes[h - 0x100][0]
        return 0

    def cuGraphKernelNodeGetParams_v2(self, h, out):
        fn, grid, _ = self.nodes[h - 0x100][1]
        out._obj.func, out._obj.grid[:] = fn, list(grid)
        return 0

    def cuGraphInstantiateWithFlags(self, exec_, graph, flags):
        exec_._obj.value = 0xE0E
        return 0

    def cuGraphExecKernelNodeSetParams_v2(self, exec_, h, params):
        self.patched.append(("kernel", h - 0x100, tuple(params._obj.grid)))
        return 0

    def cuGraphExecMemsetNodeSetParams(self, exec_, h, params, ctx):
        self.patched.append(("memset", h - 0x100, params._obj.width))
        return 0

    def cuGraphLaunch(self, exec_, stream):
        self.launched += 1
        return 0


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(Driver, "_lib", drv)
    monkeypatch.setattr(graph_launch.GraphApi, "_fns", drv.fns())
    return drv


def _packed(n: int, path: Path) -> PackedPlan:
    cfg = bench.preset_config("qwen3-30b-a3b")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(), knobs=Knobs())
    plan = build_forward_plan(lp, H200, n, path)
    addresses: dict = {}
    fns: dict = {}
    return PackedPlan(plan, lambda b: addresses.setdefault(str(b), 0x10_0000 * (len(addresses) + 1)),
                      lambda name: fns.setdefault(name, 0x2000 + len(fns)))


def _reading(packed: PackedPlan, kind) -> set[int]:
    return {i for i, step in enumerate(packed.plan.steps)
            if any(isinstance(a.value, kind) for a in getattr(step, "args", ()))}


def test_a_decode_forward_is_one_graph_launch_patching_only_the_nodes_that_read_changed_pointers(fake):
    packed = _packed(1, Path.DECODE)
    packed.set_call(0xA000, 0xB000, 0, 1)
    graph = PlanGraph.capture(packed, 0x5, 0xEE, 0)
    assert [t for t, _ in fake.nodes] == [NODE_KERNEL] * len(packed.plan.launches) + [NODE_EVENT_RECORD]
    graph.launch(0xA000, 0xB000, 0, 1, 0x77)  # the captured values: nothing to patch
    assert fake.patched == [] and fake.launched == 1
    graph.launch(0xA100, 0xB000, 0, 1, 0x77)
    assert {i for _, i, _ in fake.patched} == _reading(packed, CallValue)
    fake.patched.clear()
    graph.launch(0xA100, 0xB000, 0, 1, 0x78)  # another stream, the same values
    assert fake.patched == [] and fake.launched == 3


def test_a_bucket_forward_patches_its_row_count_nodes_with_their_new_grids(fake):
    from cupymoe.plan import PerN

    packed = _packed(3000, Path.PREFILL)
    packed.set_call(0xA000, 0xB000, 0, 3000)
    graph = PlanGraph.capture(packed, 0x5, 0xEE, 0)
    graph.launch(0xA000, 0xB000, 0, 2500, 0x77)
    steps = packed.plan.steps
    per_n = {i for i, s in enumerate(steps) if isinstance(s, graph_launch.Memset) and isinstance(s.words, PerN)}
    per_n |= {i for i, s in enumerate(steps) if isinstance(s, graph_launch.Launch) and (
        any(isinstance(a.value, PerN) for a in s.args) or any(isinstance(g, PerN) for g in s.grid)
        or isinstance(s.smem, PerN))}
    assert per_n and {i for _, i, _ in fake.patched} == per_n
    expected = packed.plan.at(2500).steps
    for kind, i, value in fake.patched:
        if kind == "kernel":
            assert value == tuple((tuple(expected[i].grid) + (1, 1))[:3])
        else:
            assert value == expected[i].words


def test_a_capture_whose_nodes_do_not_match_the_plan_is_refused(fake):
    fake.shuffle = True
    packed = _packed(1, Path.DECODE)
    packed.set_call(0xA000, 0xB000, 0, 1)
    with pytest.raises(LaunchError, match="does not match|nodes"):
        PlanGraph.capture(packed, 0x5, 0xEE, 0)


def test_a_plan_with_an_all_reduce_is_not_captured(fake):
    packed = _packed(1, Path.DECODE)
    packed.steps.append((Stage.REDUCE, "all_reduce", AllReduce(Stage.REDUCE, 128)))
    assert PlanGraph.capture(packed, 0x5, 0xEE, 0) is None
    assert fake.nodes == []


def test_the_node_parameter_blocks_have_the_drivers_layout():
    assert ctypes.sizeof(graph_launch.KernelNodeParams) == 72
    assert graph_launch.KernelNodeParams.kernel_params.offset == 40
    assert ctypes.sizeof(graph_launch.MemsetNodeParams) == 40


def test_a_plan_reading_other_call_values_is_refused(fake):
    """The experts-only entry's ids and weights are call values launch() does not track."""
    cfg = bench.preset_config("qwen3-30b-a3b")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(), knobs=Knobs())
    plan = build_forward_plan(lp, H200, 4, Path.DECODE, given_routing=True)
    packed = PackedPlan(plan, lambda b: 0x10_0000, lambda name: 0x2000)
    packed.set_call(0xA000, 0xB000, 0, 4)
    with pytest.raises(LaunchError, match="topk_ids"):
        PlanGraph.capture(packed, 0x5, 0xEE, 0)
