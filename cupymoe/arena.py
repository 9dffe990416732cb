"""The arena: all of a layer's scratch in ONE device allocation with fixed addresses.

Fixed addresses are what make a captured CUDA graph safe to replay. Buffers are named,
each with the stages in which it is live (first write .. last read); byte sharing is
declared in ONE alias table (groups of buffers that may share bytes because their
lifetimes never meet), and `plan_arena` proves, before anything is allocated, that no two
buffers whose bytes overlap are live in the same stage. An undeclared alias, the bug the
seed's forward_batched records, cannot be written here: every overlap comes from the
table, and the table is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (16-byte vectors, TMA)


from .errors import ArenaError, BufferTooSmallError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class BufferSpec:
    name: str
    nbytes: int
    first: str  # stage of the first write
    last: str  # stage of the last read


@dataclass(frozen=True)
class Placement:
    name: str
    offset: int
    nbytes: int
    live: tuple[int, int]  # stage indices, inclusive


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ArenaPlan:
    stages: tuple[str, ...]
    placements: dict[str, Placement]
    total_bytes: int

    def overlapping_pairs(self) -> list[tuple[str, str]]:
        """Every pair of buffers whose byte ranges overlap (declared aliases)."""
        items = sorted(self.placements.values(), key=lambda p: p.offset)
        out = []
        for i, a in enumerate(items):
            for b in items[i + 1:]:
                if b.offset >= a.offset + a.nbytes:
                    break
                if a.nbytes and b.nbytes:
                    out.append((a.name, b.name))
        return out


def plan_arena(stages: Sequence[str], buffers: Iterable[BufferSpec],
               aliases: Sequence[Sequence[str]] = ()) -> ArenaPlan:
    """Lay the buffers out, aliasing only inside declared groups, and prove it safe.

    Each alias group shares one region sized for its largest member; every other buffer
    gets bytes of its own. Then every overlapping pair must have disjoint live ranges.
    """
    stage_idx = {s: i for i, s in enumerate(stages)}
    if len(stage_idx) != len(stages):
        raise ArenaError(f"duplicate stage names in {list(stages)}")
    specs: dict[str, BufferSpec] = {}
    live: dict[str, tuple[int, int]] = {}
    for b in buffers:
        if b.name in specs:
            raise ArenaError(f"buffer {b.name!r} declared twice")
        for s in (b.first, b.last):
            if s not in stage_idx:
                raise ArenaError(f"buffer {b.name!r}: unknown stage {s!r}; stages are {list(stages)}")
        lo, hi = stage_idx[b.first], stage_idx[b.last]
        if lo > hi:
            raise ArenaError(f"buffer {b.name!r}: first stage {b.first!r} comes after last stage {b.last!r}")
        if isinstance(b.nbytes, bool) or not isinstance(b.nbytes, int) or b.nbytes < 0:
            raise ArenaError(f"buffer {b.name!r}: size {b.nbytes!r} must be a whole number of bytes >= 0")
        specs[b.name] = b
        live[b.name] = (lo, hi)

    group_of: dict[str, int] = {}
    for gi, group in enumerate(aliases):
        for name in group:
            if name not in specs:
                raise ArenaError(f"alias table names unknown buffer {name!r}")
            if name in group_of:
                raise ArenaError(f"buffer {name!r} appears in two alias groups")
            group_of[name] = gi

    placements: dict[str, Placement] = {}
    offset = 0
    done_groups: set[int] = set()
    for name, spec in specs.items():
        gi = group_of.get(name)
        if gi is None:
            placements[name] = Placement(name, offset, spec.nbytes, live[name])
            offset += _align(spec.nbytes)
        elif gi not in done_groups:
            done_groups.add(gi)
            members = [m for m in aliases[gi]]
            size = max(specs[m].nbytes for m in members)
            for m in members:
                placements[m] = Placement(m, offset, specs[m].nbytes, live[m])
            offset += _align(size)

    plan = ArenaPlan(tuple(stages), placements, max(offset, ALIGN))
    for a, b in plan.overlapping_pairs():
        (alo, ahi), (blo, bhi) = live[a], live[b]
        if alo <= bhi and blo <= ahi:
            both = [stages[i] for i in range(max(alo, blo), min(ahi, bhi) + 1)]
            raise ArenaError(
                f"alias table lets {a!r} (live {stages[alo]}..{stages[ahi]}) and {b!r} "
                f"(live {stages[blo]}..{stages[bhi]}) share bytes while both are live in {both}"
            )
    return plan


class Arena:
    """One device allocation laid out by an ArenaPlan; buffers by name, as raw pointers."""

    def __init__(self, plan: ArenaPlan, device_id: Optional[int] = None):
        import cupy

        self.plan = plan
        with cupy.cuda.Device(device_id):
            # A plain cudaMalloc (not the pool): the arena's address never moves.
            self._mem = cupy.cuda.memory.Memory(plan.total_bytes)
        self.base = int(self._mem.ptr)

    def _placement(self, name: str) -> Placement:
        try:
            return self.plan.placements[name]
        except KeyError:
            raise KeyError(f"arena has no buffer {name!r}; buffers: {sorted(self.plan.placements)}") from None

    def ptr(self, name: str) -> int:
        return self.base + self._placement(name).offset

    def nbytes(self, name: str) -> int:
        return self._placement(name).nbytes

    def require(self, name: str, nbytes: int) -> int:
        """The buffer's pointer, after checking it holds `nbytes` (a named error if not)."""
        have = self.nbytes(name)
        if nbytes > have:
            raise BufferTooSmallError(f"{name} too small: need {nbytes} bytes, have {have}")
        return self.ptr(name)

    @property
    def total_bytes(self) -> int:
        return self.plan.total_bytes
