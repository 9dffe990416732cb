"""Guard mode (CUPYMOE_GUARD=1): red zones between a layer's scratch buffers, filled before each
forward and checked after it, for what compute-sanitizer cannot watch (e.g. TMA stores)."""

from __future__ import annotations

import numpy as np

from .errors import GuardError
from .workspace import GUARD_PATTERN


def arm_zones(zones, stream: int) -> None:
    """Fill the red zones on `stream` before the forward (other layers sharing the workspace may
    have written there since)."""
    import cupy

    for zone, ptr in zones:
        cupy.cuda.runtime.memsetAsync(ptr, GUARD_PATTERN, zone.nbytes, stream)


def check_zones(zones, device_id: int) -> None:
    """Synchronise and raise GuardError naming the first buffer whose red zone changed."""
    import cupy

    with cupy.cuda.Device(device_id):
        cupy.cuda.runtime.deviceSynchronize()
        views = [cupy.ndarray((z.nbytes,), cupy.uint8,
                              cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, z.nbytes, zones), 0))
                 for z, ptr in zones]
        data = cupy.concatenate(views).get()
    start = 0
    for zone, _ in zones:
        bad = np.flatnonzero(data[start:start + zone.nbytes] != GUARD_PATTERN)
        start += zone.nbytes
        if bad.size:
            raise GuardError(f"red zone after scratch buffer {zone.after!r} (before {zone.before!r}) changed: "
                             f"{bad.size} of its {zone.nbytes} bytes, the first at +{int(bad[0])} = "
                             f"0x{int(data[start - zone.nbytes + bad[0]]):02x} (pattern 0x{GUARD_PATTERN:02x}): "
                             f"a kernel wrote past {zone.after!r} or before {zone.before!r}")
