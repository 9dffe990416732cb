"""Observability: NVTX ranges per stage, a per-stage timing mode and debug dumps.

- NVTX: one range `moe` a forward in the `cupymoe` domain with a range a stage nested in it
  (`router`, `topk`, `norm`, `sort`, `gate_up`, `down`, `reduce`, `all_reduce`), so Nsight
  Compute's filter `--nvtx --nvtx-include "cupymoe@moe/gate_up/"` profiles a stage's kernels.
  Emitted when a tool is attached (Nsight sets one up at process start); without one a
  forward skips them.
- CUPYMOE_PROFILE=1: synchronise around each stage and log its microseconds (logger
  `cupymoe.profile`). Host syncs: refused while the stream is captured.
- CUPYMOE_DUMP_DIR=path: after each forward, the debug dumps (gate input, gate logits,
  expert ids and weights, routed-only output, shared output, final output) as .npy, bf16
  converted to float32. Also a host sync; also refused under capture.
"""

from __future__ import annotations

import ctypes
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import LaunchError

DOMAIN = "cupymoe"
FORWARD_RANGE = "moe"
STAGE_NAMES = ("router", "topk", "norm", "sort", "gate_up", "down", "reduce", "all_reduce")
log = logging.getLogger("cupymoe.profile")


class _Nvtx:
    """The cupymoe domain's ranges, their attributes made once; inert without a tool."""

    def __init__(self):
        self.domain = None
        self.attrs: dict[str, object] = {}
        try:
            import nvtx
            from nvtx._lib import DummyDomain
        except ImportError:  # nvtx is a dependency; degrade to no ranges rather than fail a forward
            return
        domain = nvtx.get_domain(DOMAIN)
        if isinstance(domain, DummyDomain):  # no tool attached to this process
            return
        self.domain = domain
        self.attrs = {name: domain.get_event_attributes(message=name) for name in (FORWARD_RANGE,) + STAGE_NAMES}

    @property
    def active(self) -> bool:
        return self.domain is not None

    def push(self, name: str) -> None:
        if self.domain is not None:
            self.domain.push_range(self.attrs[name])

    def pop(self) -> None:
        if self.domain is not None:
            self.domain.pop_range()


NVTX = _Nvtx()
_stage_events: Optional[list] = None


def observed() -> bool:
    """Whether anything watches a forward's stages (an NVTX tool, or stage events being recorded)."""
    return NVTX.active or _stage_events is not None


def recording_events() -> bool:
    return _stage_events is not None


@contextmanager
def record_stage_events(into: list):
    """Within this block every stage also records CUDA events (graph-capturable) into `into`
    as (stage, start_event, end_event): per-stage device time inside a replayed graph."""
    global _stage_events
    prev, _stage_events = _stage_events, into
    try:
        yield into
    finally:
        _stage_events = prev


_libcuda = None


def _record_external(event, stream) -> None:
    """cuEventRecordWithFlags(..., CU_EVENT_RECORD_EXTERNAL) under capture: there a plain event
    record only orders streams; the external flag makes it a real record node, so the event's
    time can be read after each replay of the graph. Outside capture the flag is invalid (the
    driver refuses it), so an eager forward records plainly."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuEventRecordWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    rc = _libcuda.cuEventRecordWithFlags(event.ptr, stream.ptr, 1 if stream.is_capturing() else 0)
    if rc != 0:
        raise LaunchError(f"cuEventRecordWithFlags failed with CUresult {rc}")


class StageTimer:
    """Wraps each stage of one forward in an NVTX range (and, in profile mode, a timed sync)."""

    def __init__(self, stream, num_tokens: int, path: str, profile: bool = False):
        self.stream = stream  # a CuPy stream (syncs and events)
        self.num_tokens = num_tokens
        self.path = path
        self.profile = profile

    @contextmanager
    def forward(self):
        NVTX.push(FORWARD_RANGE)
        try:
            yield
        finally:
            NVTX.pop()

    @contextmanager
    def stage(self, name: str):
        NVTX.push(name)
        events = None
        if _stage_events is not None:
            import cupy

            events = (cupy.cuda.Event(), cupy.cuda.Event())
            _record_external(events[0], self.stream)
        t0 = None
        if self.profile:
            self.stream.synchronize()
            t0 = time.perf_counter()
        try:
            yield
        finally:
            if events is not None:
                _record_external(events[1], self.stream)
                _stage_events.append((name, *events))
            if t0 is not None:
                self.stream.synchronize()
                us = (time.perf_counter() - t0) * 1e6
                log.info("MoE %s [%s] N=%d: %.1f us", self.path, name, self.num_tokens, us)
            NVTX.pop()


_dump_seq = 0


def write_dumps(directory: Path, stream, arrays: dict[str, tuple[int, tuple[int, ...], str]]) -> Path:
    """Copy device buffers to .npy files: arrays maps name -> (ptr, shape, dtype name)."""
    import cupy

    global _dump_seq
    directory.mkdir(parents=True, exist_ok=True)
    stream.synchronize()
    _dump_seq += 1
    for name, (ptr, shape, dtype) in arrays.items():
        np_dtype = np.uint16 if dtype == "bf16" else np.dtype(dtype)
        n = int(np.prod(shape))
        mem = cupy.cuda.UnownedMemory(ptr, n * np.dtype(np_dtype).itemsize, owner=None)
        arr = cupy.ndarray(shape, dtype=np_dtype, memptr=cupy.cuda.MemoryPointer(mem, 0)).get(stream=stream)
        if dtype == "bf16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        np.save(directory / f"{_dump_seq:05d}_{name}.npy", arr)
    return directory


def run_by_stage(timer: "StageTimer", packed, n: int, stream: int) -> None:
    """Enqueue a prepared PackedPlan's steps, each stage's run inside the timer's range for it."""
    steps = packed.steps
    with timer.forward():
        i = 0
        while i < len(steps):
            stage = steps[i][0]
            with timer.stage(stage.value):
                while i < len(steps) and steps[i][0] == stage:
                    packed.run_step(steps[i][1], steps[i][2], n, stream)
                    i += 1
