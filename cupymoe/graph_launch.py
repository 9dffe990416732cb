"""An eager forward as one graph launch: a PackedPlan captured once into a CUDA graph.

A forward of k launches costs k driver calls of about 4 us each on the host; the same launches
captured into a graph cost one cuGraphLaunch. The graph is captured on a private stream the
first time a plan runs outside a capture (nothing executes during a capture), then each
forward patches only the nodes whose values changed since the last (its input, output and
token-id pointers; the row-count values of a bucket plan) and launches it. The workspace's
end-of-forward event is a node of the graph, so stream order across workspaces costs nothing
more. Same kernels, same arguments: the same bits as the direct launches.

A caller's capture gets the direct launches (a graph launched into a capture would freeze the
patched values of that moment); so does a plan with an all-reduce (a host call between launches).
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Optional

from .errors import LaunchError
from .launch import Driver, LaunchConfig, PackedPlan
from .plan import Arg, CallValue, Launch, Memset, PerN

CU_STREAM_CAPTURE_MODE_RELAXED = 2  # other threads' calls stay legal while we capture
CU_EVENT_RECORD_EXTERNAL = 1  # inside a capture: an event-record node, not a capture dependency
NODE_KERNEL, NODE_MEMSET, NODE_EVENT_RECORD = 0, 2, 7  # CUgraphNodeType
_PATCHED = {CallValue.INPUT, CallValue.OUTPUT, CallValue.TOKEN_IDS}  # the call values launch() tracks


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class MemsetNodeParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


_P = ctypes.c_void_p
_SIGNATURES = {
    "cuStreamBeginCapture_v2": [_P, ctypes.c_int],
    "cuStreamEndCapture": [_P, _P],
    "cuEventRecordWithFlags": [_P, _P, ctypes.c_uint],
    "cuGraphInstantiateWithFlags": [_P, _P, ctypes.c_ulonglong],
    "cuGraphGetNodes": [_P, _P, _P],
    "cuGraphNodeGetType": [_P, _P],
    "cuGraphKernelNodeGetParams_v2": [_P, _P],
    "cuGraphExecKernelNodeSetParams_v2": [_P, _P, _P],
    "cuGraphExecMemsetNodeSetParams": [_P, _P, _P, _P],
    "cuGraphLaunch": [_P, _P],
    "cuGraphExecDestroy": [_P],
    "cuGraphDestroy": [_P],
}


class GraphApi:
    """The driver's graph entry points, with their argument types (loaded on first use)."""

    _fns: Optional[dict] = None

    @classmethod
    def fns(cls) -> dict:
        if cls._fns is None:
            lib, fns = Driver.lib(), {}
            for name, argtypes in _SIGNATURES.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError as e:
                    raise LaunchError(f"the CUDA driver has no {name}: {e}") from e
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                fns[name] = fn
            cls._fns = fns
        return cls._fns


@dataclass
class _Node:
    """A graph node a forward may patch: which call values it reads and its parameter block."""

    handle: int
    params: ctypes.Structure
    reads_call: bool  # input, output or token ids
    reads_n: bool  # a row-count value of a bucket plan
    config: Optional[LaunchConfig] = None  # a kernel node's launch configuration (grid, smem)
    words: Optional[PerN] = None  # a memset node's row-dependent length


def _reads(args: tuple[Arg, ...], kind) -> bool:
    return any(isinstance(a.value, kind) for a in args)


class PlanGraph:
    """A PackedPlan as one instantiated graph; `launch` patches what changed and launches it."""

    def __init__(self, packed: PackedPlan, graph: int, exec_: int, nodes: list[_Node], ctx: int):
        self.packed, self._graph, self._exec, self._ctx = packed, graph, exec_, ctx
        self._call_nodes = [nd for nd in nodes if nd.reads_call and not nd.reads_n]
        self._n_nodes = [nd for nd in nodes if nd.reads_n]
        self._last = packed.call_values()
        self._n = packed.bound_n
        fns = GraphApi.fns()
        self._set_kernel, self._set_memset = fns["cuGraphExecKernelNodeSetParams_v2"], fns["cuGraphExecMemsetNodeSetParams"]
        self._launch = fns["cuGraphLaunch"]
        weakref.finalize(self, _destroy, exec_, graph)

    @classmethod
    def capture(cls, packed: PackedPlan, capture_stream: int, done_event: int, ctx: int) -> Optional["PlanGraph"]:
        """Capture `packed` (already prepared for a call) with `done_event` recorded at its end;
        None when the plan cannot run as a graph (an all-reduce step)."""
        if any(kind == "all_reduce" for _, kind, _ in packed.steps):
            return None
        extra = {a.value for s in packed.plan.launches for a in s.args if isinstance(a.value, CallValue)} - _PATCHED
        if extra:  # launch() patches on the three call pointers alone
            raise LaunchError(f"the plan reads call values a graph launch does not patch: {sorted(v.value for v in extra)}")
        fns = GraphApi.fns()
        graph = _capture(packed, capture_stream, done_event, fns)
        try:
            nodes = _match_nodes(packed, graph, fns)
            exec_ = ctypes.c_void_p()
            Driver.check(fns["cuGraphInstantiateWithFlags"](ctypes.byref(exec_), graph, 0), "cuGraphInstantiate")
        except BaseException:
            fns["cuGraphDestroy"](graph)
            raise
        return cls(packed, graph, exec_.value, nodes, ctx)

    def launch(self, x: int, out: int, token_ids: int, n: int, stream: int) -> None:
        """Enqueue the forward on `stream` (not capturing) as one graph launch."""
        self.packed.set_call(x, out, token_ids, n)
        call = (x, out, token_ids)
        if call != self._last:
            for nd in self._call_nodes:
                self._patch(nd)
            self._last = call
            if n == self._n:
                for nd in self._n_nodes:
                    if nd.reads_call:
                        self._patch(nd)
        if n != self._n:
            for nd in self._n_nodes:
                self._patch(nd)
            self._n = n
        rc = self._launch(self._exec, stream)
        if rc:
            Driver.check(rc, "cuGraphLaunch")

    def _patch(self, nd: _Node) -> None:
        if nd.config is not None:
            cfg, p = nd.config, nd.params
            p.grid[0], p.grid[1], p.grid[2] = cfg.grid[0], cfg.grid[1], cfg.grid[2]
            p.shared_mem = cfg.shared_mem
            rc = self._set_kernel(self._exec, nd.handle, ctypes.byref(p))
        else:
            nd.params.width = nd.words.fn(self.packed.bound_n)
            rc = self._set_memset(self._exec, nd.handle, ctypes.byref(nd.params), self._ctx)
        if rc:
            Driver.check(rc, "patching a forward graph's node")


def _destroy(exec_: int, graph: int) -> None:
    fns = GraphApi._fns
    if fns is not None:
        fns["cuGraphExecDestroy"](exec_)
        fns["cuGraphDestroy"](graph)


def _capture(packed: PackedPlan, stream: int, done_event: int, fns: dict) -> int:
    """The plan's steps and the event record, captured on the private `stream` (nothing runs)."""
    Driver.check(fns["cuStreamBeginCapture_v2"](stream, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")
    graph = ctypes.c_void_p()
    try:
        packed.retarget(stream)
        for _, kind, payload in packed.steps:
            packed.run_step(kind, payload, packed.bound_n, stream)
        Driver.check(fns["cuEventRecordWithFlags"](done_event, stream, CU_EVENT_RECORD_EXTERNAL),
                     "cuEventRecordWithFlags")
    finally:
        rc = fns["cuStreamEndCapture"](stream, ctypes.byref(graph))
    Driver.check(rc, "cuStreamEndCapture")
    return graph.value


def _graph_nodes(graph: int, fns: dict) -> list[tuple[int, int]]:
    """(handle, CUgraphNodeType) of every node, in the order the driver lists them."""
    count = ctypes.c_size_t(0)
    Driver.check(fns["cuGraphGetNodes"](graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    handles = (ctypes.c_void_p * count.value)()
    Driver.check(fns["cuGraphGetNodes"](graph, handles, ctypes.byref(count)), "cuGraphGetNodes")
    out = []
    for h in handles:
        t = ctypes.c_int(-1)
        Driver.check(fns["cuGraphNodeGetType"](h, ctypes.byref(t)), "cuGraphNodeGetType")
        out.append((h, t.value))
    return out


def _match_nodes(packed: PackedPlan, graph: int, fns: dict) -> list[_Node]:
    """The plan's steps paired with the captured nodes, each checked (type, kernel, grid) so that a
    patch can never reach the wrong node; a mismatch is a LaunchError (the caller falls back)."""
    listed = [(h, t) for h, t in _graph_nodes(graph, fns) if t != NODE_EVENT_RECORD]
    steps = packed.plan.steps
    if len(listed) != len(steps):
        raise LaunchError(f"captured {len(listed)} nodes for {len(steps)} steps")
    nodes, kernels = [], iter(packed.launch_parts())
    for (handle, kind), step in zip(listed, steps):
        if isinstance(step, Launch):
            config, params_ptr, fn = next(kernels)
            nodes.append(_kernel_node(handle, kind, step, config, params_ptr, fn, fns))
        elif isinstance(step, Memset):
            nodes.append(_memset_node(handle, kind, step, packed))
    return [nd for nd in nodes if nd.reads_call or nd.reads_n]


def _kernel_node(handle: int, kind: int, step: Launch, config: LaunchConfig, params_ptr: int, fn: int,
                 fns: dict) -> _Node:
    got = KernelNodeParams()
    if kind == NODE_KERNEL:
        Driver.check(fns["cuGraphKernelNodeGetParams_v2"](handle, ctypes.byref(got)), "cuGraphKernelNodeGetParams")
    if kind != NODE_KERNEL or got.func != fn or tuple(got.grid) != tuple(config.grid):
        raise LaunchError(f"captured node does not match the launch of {step.kernel}")
    params = KernelNodeParams(fn, config.grid, config.block, config.shared_mem, params_ptr, None, None, None)
    reads_n = _reads(step.args, PerN) or any(isinstance(g, PerN) for g in step.grid) or isinstance(step.smem, PerN)
    return _Node(handle, params, _reads(step.args, CallValue), reads_n, config=config)


def _memset_node(handle: int, kind: int, step: Memset, packed: PackedPlan) -> _Node:
    if kind != NODE_MEMSET:
        raise LaunchError(f"captured node of type {kind} where the memset of {step.buffer} was")
    words = step.words if isinstance(step.words, PerN) else None
    count = words.fn(packed.bound_n) if words else step.words
    params = MemsetNodeParams(packed.memset_target(step), 0, 0, 4, count, 1)
    return _Node(handle, params, False, words is not None, words=words)
