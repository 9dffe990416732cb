"""A layer's deploy-time warm-up (MoeLayer.warmup): every plan it can run built, packed and
captured as a graph, every path launched once, so that no first-use cost (plan building,
graph capture, the driver's lazy loading) falls into a caller's capture or a timed region."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .errors import PathUnavailableError
from .forward_plan import prefill_buckets


@dataclass(frozen=True)
class WarmupReport:
    plans: int  # forward plans built (decode row counts, prefill shapes)
    seconds: float
    graphs: int = 0  # of them captured as one-launch graphs for eager forwards


def warm_up(layer) -> WarmupReport:
    t0 = time.perf_counter()
    for p in warmup_paths(layer):
        for n in _row_counts(layer, p):
            packed = layer.plan_for(n, p)
            if layer._graph_launch and packed not in layer._graphs:
                layer._capture(packed, 0, 0, 0, n)  # patched with the real pointers at its first launch
    seconds = time.perf_counter() - t0
    _run_each_path(layer)
    return WarmupReport(len(layer._packed), seconds, sum(g is not None for g in layer._graphs.values()))


def _row_counts(layer, path: str):
    """Each row count of the decode paths; the first of each prefill shape up to max_tokens."""
    top = layer.max_tokens if path == "prefill" else min(layer.max_tokens, layer.decode_max_tokens)
    if path == "atomic":
        top = min(top, layer.atomic_max_tokens)
    if path == "prefill":
        return [lo for lo, _, _ in prefill_buckets(layer.plan, layer.device, prefill_from(layer), top)]
    return range(1, top + 1)


def _run_each_path(layer) -> None:
    import cupy

    with cupy.cuda.Device(layer.device_id):
        rng = np.random.default_rng(0)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:  # the input made on the stream that reads it
            x = cupy.asarray((rng.standard_normal((1, layer.cfg.hidden_size), dtype=np.float32)
                              .view(np.uint32) >> 16).astype(np.uint16))
            tids, out = cupy.zeros(1, cupy.int32), cupy.empty_like(x)
        for p in warmup_paths(layer):
            layer.forward(int(x.data.ptr), 1, int(out.data.ptr), s.ptr, token_ids_ptr=int(tids.data.ptr), path=p)
        s.synchronize()


def prefill_from(layer) -> int:
    # the tuning table may send row counts below the decode cap to prefill
    return 1 if layer.row_invariant or layer.plan.tuned else layer.decode_max_tokens + 1


def warmup_paths(layer) -> list[str]:
    """The paths a one-row forward may take on this layer (select_path accepts them)."""
    paths = []
    for p in ("decode", "atomic", "prefill"):
        try:
            layer.select_path(1, p)
        except PathUnavailableError:
            continue
        paths.append(p)
    return paths
