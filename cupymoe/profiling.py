"""Observability: NVTX ranges per stage, a per-stage timing mode and debug dumps.

- NVTX: one range per stage (`moe/router`, `moe/topk`, ...) in the `cupymoe` domain through
  the `nvtx` package; it costs next to nothing when no profiler is attached.
- `CUPYMOE_PROFILE=1`: synchronise the stream around each stage and log its microseconds
  through `logging` (logger `cupymoe.profile`), like the seed's `prof_step!`. Never on by
  default: it adds host syncs, so it refuses to run while the stream is being captured.
- `CUPYMOE_DUMP_DIR=path`: after each forward, the seed's debug dumps (gate input, gate
  logits, expert ids and weights, routed-only output, shared output, final output) as .npy,
  bf16 converted to float32. Also a host sync; also refused under capture.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a dependency; degrade to no ranges rather than fail a forward
    _nvtx = None

DOMAIN = "cupymoe"
log = logging.getLogger("cupymoe.profile")


def profile_enabled() -> bool:
    return os.environ.get("CUPYMOE_PROFILE", "") not in ("", "0")


def dump_dir() -> Optional[Path]:
    d = os.environ.get("CUPYMOE_DUMP_DIR")
    return Path(d) if d else None


_stage_events: Optional[list] = None


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
    """cuEventRecordWithFlags(..., CU_EVENT_RECORD_EXTERNAL): inside stream capture a plain
    event record only orders streams; the external flag makes it a real record node, so
    the event's time can be read after each replay of the graph."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuEventRecordWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    rc = _libcuda.cuEventRecordWithFlags(event.ptr, stream.ptr, 1)
    if rc != 0:
        raise RuntimeError(f"cuEventRecordWithFlags failed with CUresult {rc}")


class StageTimer:
    """Wraps each stage of one forward in an NVTX range (and, in profile mode, a timed sync)."""

    def __init__(self, stream, num_tokens: int, path: str):
        self.stream = stream
        self.num_tokens = num_tokens
        self.path = path
        self.profile = profile_enabled()
        # stage events (bench --stages) or profile syncs stand between the kernels: the
        # layer then launches them without programmatic dependent launch
        self.separates_kernels = self.profile or _stage_events is not None

    @contextmanager
    def stage(self, name: str):
        label = f"moe/{name}"
        if _nvtx is not None:
            _nvtx.push_range(label, domain=DOMAIN)
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
            if _nvtx is not None:
                _nvtx.pop_range(domain=DOMAIN)


_dump_seq = 0


def write_dumps(stream, arrays: dict[str, tuple[int, tuple[int, ...], str]]) -> Path:
    """Copy device buffers to .npy files: arrays maps name -> (ptr, shape, dtype name)."""
    import cupy

    global _dump_seq
    d = dump_dir()
    assert d is not None
    d.mkdir(parents=True, exist_ok=True)
    stream.synchronize()
    _dump_seq += 1
    for name, (ptr, shape, dtype) in arrays.items():
        np_dtype = np.uint16 if dtype == "bf16" else np.dtype(dtype)
        n = int(np.prod(shape))
        mem = cupy.cuda.UnownedMemory(ptr, n * np.dtype(np_dtype).itemsize, owner=None)
        arr = cupy.ndarray(shape, dtype=np_dtype, memptr=cupy.cuda.MemoryPointer(mem, 0)).get(stream=stream)
        if dtype == "bf16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        np.save(d / f"{_dump_seq:05d}_{name}.npy", arr)
    return d
