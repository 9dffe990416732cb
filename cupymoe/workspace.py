"""Scratch: a layer's per-call buffers, planned with declared aliases, in a Workspace layers share.

Each layer plans its scratch (`layer_scratch`): named buffers, each with the stages in which
it is live (first write .. last read); byte sharing is declared in ONE alias table, and
`plan_scratch` proves before anything is allocated that no two buffers whose bytes overlap
are live in the same stage. An undeclared alias cannot be written here.

A Workspace is one device allocation with fixed addresses (what makes a captured graph safe
to replay): a zeroed region (the w8a8 decode's tickets, zeros between forwards) and a scratch
region every layer built on it lays its own plan over. Layers sharing a workspace must run
in turn on one stream; the same layers run on a second stream at once through a second
workspace (`MoeLayer.with_workspace`). A workspace used from a new stream orders itself after
the work already enqueued on the old one (an event wait); a capture begun on a new stream cannot
wait for eager work (nor query it without invalidating the capture), so its caller orders it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from .config import MoeConfig, is_integer
from .errors import ArenaError, BufferTooSmallError, WorkspaceError
from . import catalog as C

ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (16-byte vectors, TMA)
GUARD_BYTES = 256  # CUPYMOE_GUARD=1: a red zone this long (a multiple of ALIGN) after every buffer
GUARD_PATTERN = 0xA5  # the red zones' byte
STAGES = ("route", "norm", "sort", "gate_up", "down", "reduce")  # the lifetimes' stages


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
class Zone:
    """A red zone (guard mode): bytes no kernel may write, from the end of `after`'s bytes (its
    alignment padding included) to the start of `before`."""

    after: str
    before: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ScratchPlan:
    stages: tuple[str, ...]
    placements: dict[str, Placement]
    total_bytes: int
    zones: tuple[Zone, ...] = ()

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


def _check_specs(stages: Sequence[str], buffers: Iterable[BufferSpec]) -> tuple[dict, dict]:
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
    return specs, live


def _alias_groups(specs: dict, aliases: Sequence[Sequence[str]]) -> dict[str, int]:
    group_of: dict[str, int] = {}
    for gi, group in enumerate(aliases):
        for name in group:
            if name not in specs:
                raise ArenaError(f"alias table names unknown buffer {name!r}")
            if name in group_of:
                raise ArenaError(f"buffer {name!r} appears in two alias groups")
            group_of[name] = gi
    return group_of


def _regions(specs: dict, aliases: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """The buffers in declaration order, an alias group as one region (at its first member)."""
    group_of = _alias_groups(specs, aliases)
    regions, done = [], set()
    for name in specs:
        gi = group_of.get(name)
        if gi is None:
            regions.append((name,))
        elif gi not in done:
            done.add(gi)
            regions.append(tuple(aliases[gi]))
    return regions


def _lay_out(specs: dict, live: dict, aliases, guard: int) -> tuple[dict, tuple[Zone, ...], int]:
    """Each region at the next aligned offset; with `guard`, a zone before the first and after each."""
    placements: dict[str, Placement] = {}
    zones: list[list] = []
    offset = guard
    if guard:
        zones.append(["(scratch start)", None, 0, guard])
    for region in _regions(specs, aliases):
        size = max(specs[m].nbytes for m in region)
        for m in region:
            placements[m] = Placement(m, offset, specs[m].nbytes, live[m])
        if zones:
            zones[-1][1] = region[0]
        offset += _align(size)
        if guard:
            zones.append(["/".join(region), "(scratch end)", offset - _align(size) + size, _align(size) - size + guard])
            offset += guard
    return placements, tuple(Zone(*z) for z in zones), offset


def plan_scratch(stages: Sequence[str], buffers: Iterable[BufferSpec],
                 aliases: Sequence[Sequence[str]] = (), guard: int = 0) -> ScratchPlan:
    """Lay the buffers out, aliasing only inside declared groups, and prove it safe: each alias
    group shares one region sized for its largest member, every other buffer has bytes of its
    own, and every overlapping pair must have disjoint live ranges. `guard` (a multiple of
    ALIGN): red zones that long around every region (guard mode; 0: none)."""
    if guard % ALIGN:
        raise ArenaError(f"guard={guard}: red zones must be a multiple of {ALIGN} bytes (alignment)")
    specs, live = _check_specs(stages, buffers)
    placements, zones, offset = _lay_out(specs, live, aliases, guard)
    plan = ScratchPlan(tuple(stages), placements, max(offset, ALIGN), zones)
    for a, b in plan.overlapping_pairs():
        (alo, ahi), (blo, bhi) = live[a], live[b]
        if alo <= bhi and blo <= ahi:
            both = [stages[i] for i in range(max(alo, blo), min(ahi, bhi) + 1)]
            raise ArenaError(f"alias table lets {a!r} (live {stages[alo]}..{stages[ahi]}) and {b!r} "
                             f"(live {stages[blo]}..{stages[bhi]}) share bytes while both are live in {both}")
    return plan


# forward_plan.LORA_BLOCKS: room for the per-pair LoRA kernels' splits (they split fewer than
# forward_plan.LORA_SLICE_TARGET items, so fewer than that many tickets and 2x slices' sums are used)
LORA_TICKETS = 1056


def layer_scratch(cfg: MoeConfig, max_tokens: int, n_local: int, i_max: int, decode_max_tokens: int,
                  w8a8: bool = False, w8a8_shared_x: bool = False, gathered_inputs: bool = False,
                  guard: int = 0, lora_experts: bool = False, lora_rank: int = 0,
                  lora_stack_ks: int = 0, lora_router_t: tuple[int, int] = (0, 0)) -> ScratchPlan:
    """A layer's buffers, their live stages and the ONE alias table. `w8a8`: the e4m3 copies of
    the expert input and of the activation with their scales a 128 columns; `w8a8_shared_x`: x's
    too (an fp8 shared expert behind a pre-expert norm); `gathered_inputs`: xg, the expert
    inputs in sorted order (the TMA GEMM's gate/up A); `guard`: red zones (plan_scratch);
    `lora_experts`: lora_gu, the LoRA plans' pre-activation g and u, a row 2 i_max wide;
    `lora_rank` (> 0: the layer reserved adapter slots of that rank): lora_part, the per-pair
    LoRA kernels' slice sums (forward_plan.lora_slices: fewer than 2 LORA_TICKETS items' slices,
    2 rank rows an item at most), and with `lora_experts` lora_pair_t, the swap-AB LoRA gate/up's s t
    of the decode's positions [Pd, 2 lora_rank] fp32; `lora_stack_ks` (> 0: the LoRA stacked form's KS,
    cupymoe/lora_stack.py):
    its shrinks' T of gate/up [P, 2 KS] and of down [P, KS], bf16 (the TMA GEMMs' extra A);
    `lora_router_t` (rows, columns): the router GEMM's LoRA t, a copy a K split, fp32 (topk_route_lora)."""
    T, k, H, R = max_tokens, cfg.num_experts_per_tok, cfg.hidden_size, cfg.router_width
    sh = 1 if cfg.has_shared_expert else 0
    P = T * k + sh * T  # expert positions: every routed pair, plus one shared row a token
    Td = min(T, decode_max_tokens)
    Pd = Td * k + sh * Td
    tiles = C.max_tiles(T, k, n_local, bool(sh)) * 16
    kb_h, kb_i = -(-H // 128), -(-i_max // 128)
    buffers = [
        BufferSpec("logits", T * R * 4 * C.ROUTER_MAX_SPLITS, "route", "route"),  # a split router's copies
        BufferSpec("topk_ids", T * k * 4, "route", "reduce"),
        BufferSpec("topk_w", T * k * 4, "route", "reduce"),
        BufferSpec("xe", T * H * 2 if cfg.pre_expert_norm else 0, "norm", "reduce"),
        BufferSpec("block_counts", -(-T * k // C.SORT_BLOCK) * n_local * 4, "sort", "sort"),
        BufferSpec("num_active", 4, "sort", "down"),
        BufferSpec("active_slot", (n_local + 1) * 4, "sort", "down"),
        BufferSpec("active_start", (n_local + 1) * 4, "sort", "down"),
        BufferSpec("active_len", (n_local + 1) * 4, "sort", "down"),
        BufferSpec("num_tiles", 4, "sort", "down"),  # the grouped GEMMs' M tiles
        BufferSpec("tile_info", tiles, "sort", "down"),
        BufferSpec("num_tiles_down", 4, "sort", "down"),  # down's where their height differs
        BufferSpec("tile_info_down", tiles, "sort", "down"),
        BufferSpec("sorted_row", P * 4, "sort", "down"),  # lora_grouped_down_delta reads it in down
        BufferSpec("sorted_pair", P * 4, "sort", "down"),
        BufferSpec("pair_pos", (T * k + T) * 4, "sort", "reduce"),
        BufferSpec("slot_active", (n_local + 1) * 4, "sort", "gate_up"),  # decode lists: slot -> active index
        BufferSpec("xg", P * H * 2 if gathered_inputs else 0, "gate_up", "gate_up"),
        BufferSpec("act", P * i_max * 2, "gate_up", "down"),
        BufferSpec("y", Pd * H * 4, "down", "reduce"),  # decode: fp32 expert outputs
        BufferSpec("yw", P * H * 2, "down", "reduce"),  # grouped: weighted bf16 expert outputs
        BufferSpec("acc", Td * H * 4, "sort", "reduce"),  # atomic path: zeroed in 'sort'
        # w8a8: e4m3 codes and a scale a 128 columns of x (made while routing), of the norm's
        # output (by the norm) and of the activation (by gate/up)
        BufferSpec("qx", T * H if w8a8 else 0, "route", "gate_up"),
        BufferSpec("sx", T * kb_h * 4 if w8a8 else 0, "route", "gate_up"),
        BufferSpec("qx_shared", T * H if w8a8_shared_x else 0, "route", "gate_up"),
        BufferSpec("sx_shared", T * kb_h * 4 if w8a8_shared_x else 0, "route", "gate_up"),
        BufferSpec("qact", P * i_max if w8a8 else 0, "gate_up", "down"),
        BufferSpec("sact", P * kb_i * 4 if w8a8 else 0, "gate_up", "down"),
    ]
    if lora_experts:  # last, so a layer's other buffers sit where they would without it
        buffers.append(BufferSpec("lora_gu", P * 2 * i_max * 2, "gate_up", "gate_up"))
    if lora_rank:  # written and read inside one LoRA launch: route (the router's delta) to down
        buffers.append(BufferSpec("lora_part", lora_part_floats(lora_rank) * 4, "route", "down"))
    if lora_experts and lora_rank:  # the swap-AB LoRA gate/up's s t of decode positions (forward_plan.lora_swapab)
        buffers.append(BufferSpec("lora_pair_t", Pd * 2 * lora_rank * 4, "gate_up", "gate_up"))
    if lora_stack_ks:  # written just before the GEMM that reads it; last, as lora_gu
        buffers.append(BufferSpec("lora_t_gu", P * 2 * lora_stack_ks * 2, "gate_up", "gate_up"))
        buffers.append(BufferSpec("lora_t_down", P * lora_stack_ks * 2, "down", "down"))
    if lora_router_t[0]:  # beside the logits, read by top-k
        buffers.append(BufferSpec("lora_router_t", lora_router_t[0] * lora_router_t[1] * 4 * C.ROUTER_MAX_SPLITS,
                                  "route", "route"))
    # logits die once top-k has read them, act is born at gate_up; xg dies in gate_up, yw is born in down
    return plan_scratch(STAGES, buffers, [("logits", "act"), ("xg", "yw")], guard)


def lora_part_floats(lora_rank: int) -> int:
    """lora_part's floats: fewer than 2 LORA_TICKETS items' slices of 2 rank rows each (and the
    folded router delta's shares, forward_plan.lora_fold)."""
    return 2 * LORA_TICKETS * 2 * lora_rank


def zeroed_bytes(n_local: int, i_max: int, w8a8: bool, lora: bool = False) -> int:
    """The zeroed region a layer needs: the w8a8 decode gate/up's tickets (a counter a slot and
    128 activation columns; its last blocks reset them, so they are zeros between forwards),
    then (`lora`) the per-pair LoRA kernels' tickets (a counter an item, reset likewise) at
    lora_tickets_offset."""
    act = (n_local + 1) * -(-i_max // 128) * 4 if w8a8 else 0
    return lora_tickets_offset(act) + LORA_TICKETS * 4 if lora else act


def lora_tickets_offset(act_ticket_bytes: int) -> int:
    """Where lora_tickets start in the zeroed region (past the w8a8 tickets)."""
    return _align(act_ticket_bytes)


@dataclass(frozen=True)
class WorkspaceNeed:
    """The bytes a layer needs of a workspace; `a | b` needs what either does."""

    scratch_bytes: int
    zeroed_bytes: int = 0

    def __post_init__(self):
        for name in ("scratch_bytes", "zeroed_bytes"):
            v = getattr(self, name)
            if not is_integer(v) or v < 0:
                raise WorkspaceError(f"WorkspaceNeed.{name}={v!r}: must be a whole number of bytes >= 0")

    def __or__(self, other: "WorkspaceNeed") -> "WorkspaceNeed":
        return WorkspaceNeed(max(self.scratch_bytes, other.scratch_bytes), max(self.zeroed_bytes, other.zeroed_bytes))

    @property
    def total_bytes(self) -> int:
        return _align(self.zeroed_bytes) + _align(self.scratch_bytes)


class Workspace:
    """Scratch for a set of layers that run in turn on one stream: one fixed allocation.

    `Workspace(need)`: a WorkspaceNeed (e.g. `WorkspaceNeed | ...` over the layers, or
    `MoeLayer.workspace_need(...)`) or a number of scratch bytes."""

    def __init__(self, need: Union[WorkspaceNeed, int], *, device: Optional[int] = None):
        from .layer_checks import cupy_module, device_of

        if is_integer(need) and need >= 0:
            need = WorkspaceNeed(int(need))
        if not isinstance(need, WorkspaceNeed):
            raise WorkspaceError(f"Workspace({need!r}): give a WorkspaceNeed or a number of bytes >= 0")
        self.need = need
        if device is not None and not is_integer(device):
            raise WorkspaceError(f"Workspace(device={device!r}): a device index (int) is required")
        cupy = cupy_module()  # no CuPy, no device, or an index past them: CudaUnavailableError
        self.device_id = device_of(cupy, device)
        self.zeroed_bytes = _align(need.zeroed_bytes)
        with cupy.cuda.Device(self.device_id):
            self._mem = cupy.cuda.memory.Memory(max(ALIGN, need.total_bytes))  # never moves: graphs stay valid
            self.base = int(self._mem.ptr)
            if self.zeroed_bytes:
                cupy.cuda.runtime.memset(self.base, 0, self.zeroed_bytes)
            # the memset ran on the legacy stream; layers launch on others (so a Workspace cannot be made
            # while another stream captures in global mode: make it before capturing, as its address must be)
            cupy.cuda.runtime.deviceSynchronize()
            self._done = cupy.cuda.Event(disable_timing=True)  # recorded after each forward
        self.scratch_base = self.base + self.zeroed_bytes
        self.scratch_bytes = _align(need.scratch_bytes)
        self._stream: Optional[int] = None
        self._capture_stream = None  # where the layers' forward graphs are captured (nothing runs there)

    @classmethod
    def for_layers(cls, needs: Iterable[WorkspaceNeed], *, device: Optional[int] = None) -> "Workspace":
        total = WorkspaceNeed(0)
        for n in needs:
            if not isinstance(n, WorkspaceNeed):  # a bare count: its zeroed share would be lost
                raise WorkspaceError(f"Workspace.for_layers: {n!r} is no WorkspaceNeed (MoeLayer.workspace_need(...))")
            total = total | n
        return cls(total, device=device)

    @property
    def nbytes(self) -> int:
        return self.zeroed_bytes + self.scratch_bytes

    def check_fits(self, need: WorkspaceNeed, what: str) -> None:
        if need.scratch_bytes > self.scratch_bytes or need.zeroed_bytes > self.zeroed_bytes:
            raise WorkspaceError(f"workspace too small for {what}: needs {need.scratch_bytes} bytes of scratch and "
                                 f"{need.zeroed_bytes} zeroed, has {self.scratch_bytes} and {self.zeroed_bytes}; "
                                 "size it with Workspace.for_layers over every layer that shares it")

    def use(self, stream: int) -> None:
        """A forward is about to be enqueued on `stream`: from a stream other than the last one, it
        first waits for the forwards already enqueued (outside a capture: _order_after)."""
        if stream != self._stream:
            if self._stream is not None:
                _order_after(self._done.ptr, stream, self)
            self._stream = stream

    def done(self, stream: int) -> None:
        """A forward was enqueued on `stream`: an event marks its end (one recorded under capture
        marks nothing a later wait outside it can use: _order_after skips it)."""
        from .launch import Driver

        Driver.record(self._done.ptr, stream)

    @property
    def done_event(self) -> int:
        """The event that marks the end of the last forward (a forward graph records it itself)."""
        return int(self._done.ptr)

    def capture_stream(self) -> int:
        """A private stream of this workspace's device to capture forward graphs on."""
        if self._capture_stream is None:
            import cupy

            with cupy.cuda.Device(self.device_id):
                self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        return int(self._capture_stream.ptr)

    def __repr__(self) -> str:
        return (f"Workspace(device {self.device_id}, {self.scratch_bytes} bytes scratch + {self.zeroed_bytes} "
                f"zeroed at 0x{self.base:x})")


def _order_after(event: int, new: int, ws: Workspace) -> None:
    """`new` waits for the last forward's end. Not a capture: a captured stream may not wait for
    eager work, nor may an event be queried during a capture (it would invalidate it); a capture
    begun on another stream must be ordered by its caller (torch.cuda.graph synchronizes first)."""
    from .launch import Driver

    if not Driver.is_capturing(new):
        Driver.wait(new, event)


def layer_need(lp, max_tokens: int, guard: int = 0, lora_experts: bool = False,
               lora_rank: int = 0, lora_stack_ks: int = 0, lora_router_t_cols: int = 0,
               lora_lp=None) -> tuple[ScratchPlan, WorkspaceNeed]:
    """A layer's scratch plan (`lp` a plan.LayerPlan) and what it needs of a workspace at `max_tokens`
    (`guard`: with red zones; `lora_experts`: the LoRA plans' expert deltas' scratch too;
    `lora_rank`: the reserved adapter slots' rank, 0 for none: the per-pair kernels' scratch;
    `lora_stack_ks`: the LoRA stacked form's T, 0 for none; `lora_router_t_cols`: the router GEMM's
    LoRA t columns, up to lora_lp.lora_router_t_rows rows, 0 for none; `lora_lp`: the LayerPlan of the
    LoRA plans where it is not `lp` (a w8a8 layer's experts as w8a16): one scratch serving both)."""
    lora_lp = lora_lp or lp
    t_rows = min(max_tokens, lora_lp.lora_router_t_rows) if lora_router_t_cols else 0
    decode_rows = max(lp.decode_max_tokens, lora_lp.decode_max_tokens)
    plan = layer_scratch(lp.cfg, max_tokens, lp.n_local, lp.i_max, decode_rows, lp.w8a8,
                         lp.w8a8_shared_x, lp.gathers_rows or lora_lp.gathers_rows, guard, lora_experts, lora_rank,
                         lora_stack_ks, (t_rows, lora_router_t_cols))
    return plan, WorkspaceNeed(plan.total_bytes, zeroed_bytes(lp.n_local, lp.i_max, lp.w8a8, lora_rank > 0))


def layer_tickets_offset(lp) -> int:
    """lora_tickets' offset in the zeroed region for layer `lp`."""
    return lora_tickets_offset(zeroed_bytes(lp.n_local, lp.i_max, lp.w8a8))


class ScratchView:
    """A layer's scratch plan laid over a workspace: its buffers by name, as addresses (the
    scratch from `scratch_base`, the w8a8 tickets at the zeroed region's `zeroed_base`)."""

    def __init__(self, plan: ScratchPlan, scratch_base: int, zeroed_base: int, zeroed_bytes: int,
                 lora_tickets_at: int = 0):
        self.plan = plan
        self.zeroed_bytes = zeroed_bytes
        self._ptrs = {name: scratch_base + p.offset for name, p in plan.placements.items()}
        self._ptrs["act_tickets"] = zeroed_base
        self._ptrs["lora_tickets"] = zeroed_base + lora_tickets_at
        self.zones = tuple((z, scratch_base + z.offset) for z in plan.zones)  # guard mode: (zone, address)

    @classmethod
    def on(cls, plan: ScratchPlan, ws: "Workspace", lora_tickets_at: int = 0) -> "ScratchView":
        return cls(plan, ws.scratch_base, ws.base, ws.zeroed_bytes, lora_tickets_at)

    def ptr(self, name: str) -> int:
        try:
            return self._ptrs[name]
        except KeyError:
            raise ArenaError(f"scratch has no buffer {name!r}; buffers: {sorted(self._ptrs)}") from None

    def nbytes(self, name: str) -> int:
        if name == "act_tickets":
            return self.zeroed_bytes
        if name == "lora_tickets":
            return max(0, self.zeroed_bytes - (self._ptrs["lora_tickets"] - self._ptrs["act_tickets"]))
        return self.plan.placements[name].nbytes

    def require(self, name: str, nbytes: int) -> int:
        """The buffer's address, after checking it holds `nbytes` (a named error if not)."""
        have = self.nbytes(name)
        if nbytes > have:
            raise BufferTooSmallError(f"{name} too small: need {nbytes} bytes, have {have}")
        return self.ptr(name)
