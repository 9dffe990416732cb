"""The debug dumps of a forward (CUPYMOE_DUMP_DIR): a debug aid with host syncs and copies."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .forward_plan import dump_launches
from .launch import launch_once
from .plan import CallValue
from .plan import Path as FwdPath
from .profiling import write_dumps

log = logging.getLogger(__name__)
_STREAMS: dict = {}


class _StreamHandle:
    """A raw cudaStream_t seen through the CUDA stream protocol (`__cuda_stream__`)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def cupy_stream(ptr: int, device_id: int):
    """A CuPy stream object over a raw stream (for syncs and events), made once a stream and device
    (a freed stream's handle may come back on another device)."""
    import cupy

    s = _STREAMS.get((ptr, device_id))
    if s is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            s = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            s = cupy.cuda.ExternalStream(ptr, device_id)
        _STREAMS[ptr, device_id] = s
    return s


def dump_forward(layer, x: int, n: int, out: int, s, path: FwdPath) -> Path:
    """The seed's dumps of the forward just enqueued: gate input, logits (recomputed: the forward's
    share bytes with act), expert ids and weights, routed-only output (the reduce again without the
    shared expert), the shared expert's rows (decode paths), the output."""
    import cupy

    cfg, scratch = layer.cfg, layer.scratch
    H, k, R = cfg.hidden_size, cfg.num_experts_per_tok, cfg.router_width
    with cupy.cuda.Device(layer.device_id):
        logits = cupy.empty((n, R), dtype=cupy.float32)
        routed = cupy.empty((n, H), dtype=cupy.uint16)
        for launch in dump_launches(layer.plan, layer.device, n, path, int(logits.data.ptr), int(routed.data.ptr)):
            launch_once(launch, layer._resolve, layer.lib.pointer, n, s.ptr, {CallValue.INPUT: x})
        arrays = {
            "gate_input": (x, (n, H), "bf16"),
            "gate_logits": (int(logits.data.ptr), (n, R), "float32"),
            "expert_ids": (scratch.ptr("topk_ids"), (n, k), "int32"),
            "expert_weights": (scratch.ptr("topk_w"), (n, k), "float32"),
            "routed_only": (int(routed.data.ptr), (n, H), "bf16"),
            "moe_out": (out, (n, H), "bf16"),
        }
        if cfg.has_shared_expert and path == FwdPath.PREFILL:
            log.info("CUPYMOE_DUMP_DIR: shared_out is dumped on the decode and atomic paths only")
        elif cfg.has_shared_expert:  # the shared expert's rows sit contiguously in y
            s.synchronize()
            pos = np.empty(1, np.int32)
            cupy.cuda.runtime.memcpy(pos.ctypes.data, scratch.ptr("pair_pos") + n * k * 4, 4,
                                     cupy.cuda.runtime.memcpyDeviceToHost)
            arrays["shared_out"] = (scratch.ptr("y") + int(pos[0]) * H * 4, (n, H), "float32")
        return write_dumps(Path(layer._dump_dir), s, arrays)
