"""MoeLayer: one MoE layer on one GPU, launched by raw pointer on the caller's stream.

Construction uploads the weights, makes the layer's choices (cupymoe/plan.py) and binds it to
a workspace; `forward` validates the call, looks up the prebuilt plan of its row count and
launches it (cupymoe/launch.py): no host sync, no allocation, no copy of per-step data, so a
whole forward can be captured into a CUDA graph. Every refusal comes before the first launch.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from . import arrays, guard, jit, lora_slots, profiling, tma
from . import catalog as C
from .config import MoeConfig
from .errors import LaunchError, LoraError, MoeCallError, OptionError, WorkspaceError
from .forward_plan import LoraShape, build_forward_plan, lora_router_t_rows, lora_stack_parts, prefill_shape
from .graph_launch import PlanGraph
from .host_weights import HostWeights
from .knobs import Knobs
from .launch import CaptureStatus, Driver, PackedPlan
from .layer_checks import (check_options, check_path, check_smem_fits, check_stream, check_token_limit, checked_call,
                           check_device_pointers, note_device_pointers,
                           cupy_module, device_of, optional_pointer, seed_checked_call)
from .parallel import Communicator, check_communicator, owned_experts
from .plan import (Buf, CallValue, DeviceFacts, ForwardPlan, LayerOptions, Path, Space, error_text,
                   choose_path, lora_options, plan_layer)
from .warmup import WarmupReport, warm_up
from .weights import DeviceWeights, MemoryReport
from .workspace import GUARD_BYTES, ScratchView, Workspace, WorkspaceNeed, layer_need, layer_tickets_offset

log = logging.getLogger(__name__)

DEFAULT_STREAMS = (0, 1, 2)  # the legacy and per-thread default streams: the current context's

_UNTRIED = object()  # a plan whose forward graph was not captured yet
# the tensor-map tables a plan's kernels may read, by buffer name: (plan, weight tables' pointers,
# scratch, LoRA slots) -> the table's bytes
MAP_TABLES = {"tma_maps": tma.layer_table,  # with the LoRA stacked form's maps where the slots have them
              "swapab_maps": lambda plan, ptrs, scratch, lora: tma.swapab_table(plan, ptrs, lora),
              "fp8_maps": lambda plan, ptrs, scratch, lora: tma.fp8_table(plan, ptrs, scratch)}


class MoeLayer:
    """One MoE layer on one GPU (calling convention: docs/DESIGN.md section 5)."""

    def __init__(self, cfg: MoeConfig, host_weights: HostWeights, *, max_tokens: int,
                 device: Optional[int] = None, path: str = "auto", row_invariant: bool = False,
                 atomic_max_tokens: Optional[int] = None, decode_max_tokens: Optional[int] = None,
                 comm: Optional[Communicator] = None, expert_owner: Optional[Sequence[int]] = None,
                 fp8_compute: str = "auto", workspace: Optional[Workspace] = None, max_loras: int = 0,
                 max_lora_rank: int = 0, keep_w8a8_activation: bool = False, lora_experts: Optional[bool] = None):
        """Options: `path` ("auto", "decode", "atomic", "prefill"), `row_invariant` (the grouped path at
        every N: a row's bits never depend on N or the batch), `decode_max_tokens` / `atomic_max_tokens`
        (default: the measured crossover for the routed experts' format, raised to the tuning table's
        decode-path buckets for the layer's shape on the arch it was measured on, this GPU's by_device
        rows over its by_shape rows), `comm` (sums the
        expert-parallel partials), `expert_owner[e]` (the rank computing expert e), `fp8_compute`
        ("auto", "w8a8", "w8a16"), `workspace` (scratch shared with other layers run in turn on one
        stream; default: the layer's own), `max_loras` / `max_lora_rank` (adapter slots reserved once:
        set_lora, clear_lora, forward's lora_ids_ptr), `lora_experts` (whether the slots hold the routed
        and shared experts' adapters too, not the router's alone; None: yes but on a w8a8 layer, whose
        LoRA forwards then run the experts as w8a16, its gate/up quantizing the activation before a
        delta could be added), `keep_w8a8_activation` (inspection: a w8a8 layer's prefill gate/up also
        stores its bf16 activation, which down never reads (it reads the e4m3 codes), so that
        cupymoe.verify can check it; the output bits are the same either way)."""
        check_options(cfg, max_tokens, path, row_invariant)
        options = LayerOptions(row_invariant, fp8_compute, decode_max_tokens, atomic_max_tokens, comm is not None,
                               keep_w8a8_activation)
        owned = owned_experts(cfg, expert_owner)
        check_token_limit(cfg, max_tokens, len(owned))
        lora_k, lora_r = lora_slots.check_options(max_loras, max_lora_rank)
        lora_slots.serves_experts(lora_experts, False)  # its value refused before anything is read
        if lora_experts is not None and not lora_k:  # it says what the slots take: no slots, nothing to say
            raise OptionError(f"lora_experts={lora_experts!r} without adapter slots: give max_loras=K, "
                              "max_lora_rank=R too")
        cupy = cupy_module()
        self.cfg, self.max_tokens, self.default_path = cfg, int(max_tokens), path
        self.layer_idx: Optional[int] = None  # the decoder layer it was loaded as (from_pretrained, from_hf)
        self._owned = owned  # the routed experts this layer computes (expert parallelism)
        self.device_id = device_of(cupy, device)
        self.comm = comm
        if comm is not None:
            check_communicator(cfg, comm)
        knobs = Knobs.from_env()
        self._profile, self._dump_dir, self._graph_launch = knobs.profile, knobs.dump_dir, knobs.graph_launch
        self._lora_stack_shrink, self._lora_fold = knobs.lora_stack_shrink, knobs.lora_fold
        self._lora_down_split, self._lora_overlap = knobs.lora_down_split, knobs.lora_overlap
        self._lora_shrink_runs, self._lora_swapab = knobs.lora_shrink_runs, knobs.lora_swapab
        self._guard = GUARD_BYTES if knobs.guard else 0  # red zones in the scratch (guard mode)
        # forwards something watches take _observed_forward; the plain one tests this flag alone
        self._watched = self._profile or self._dump_dir is not None or bool(self._guard)
        with cupy.cuda.Device(self.device_id):
            self.lib = jit.library(self.device_id)
            self.device = DeviceFacts(self.lib.arch, self.lib.sm_count, self.lib.max_smem, self.lib.name)
            check_smem_fits(cfg, len(owned), self.device)
            if lora_k:  # before any weight is uploaded
                lora_slots.check_rank_fits(cfg, lora_r, self.device.max_smem)
            self.weights = DeviceWeights(cfg, host_weights, self.device_id, owned)
            self.plan = self._plan_layer(options, knobs)
            assert self.plan.i_max == self.weights.i_max, (self.plan.i_max, self.weights.i_max)
            self._err = cupy.zeros(1, cupy.int32)  # sticky error bits the kernels set (check_errors)
            self._lora, self._lora_plan = None, self.plan  # _lora_plan: the LoRA forwards' plans' LayerPlan
            if lora_k:
                self._reserve_lora(options, knobs, lora_k, lora_r, lora_experts)
            self._ctx = cupy.cuda.driver.ctxGetCurrent()
            self._bind(workspace or Workspace(self.workspace_need(), device=self.device_id))
            # the uploads and repacks went through the legacy default stream, which a caller's
            # non-blocking stream never waits for: finish them before a first forward
            cupy.cuda.runtime.deviceSynchronize()
        log.info("MoeLayer ready on device %d (%s): %d local experts, weights %.1f MB, scratch %.1f MB",
                 self.device_id, self.lib.arch, self.plan.n_local, self.weights.nbytes / 1e6,
                 self.scratch.plan.total_bytes / 1e6)

    def _plan_layer(self, options: LayerOptions, knobs: Knobs):
        return plan_layer(self.cfg, self.weights.format, self.weights.shared_format, self.lib.arch,
                          n_local=len(self._owned), options=options, knobs=knobs,
                          mxfp4_scale_bytes=self.weights.mxfp4_scale_bytes, device_name=self.device.name)

    def _reserve_lora(self, options: LayerOptions, knobs: Knobs, lora_k: int, lora_r: int,
                      lora_experts: Optional[bool]) -> None:
        """The adapter slots and the LayerPlan of the LoRA forwards (a w8a8 layer's experts as w8a16 where
        its slots take expert adapters: their deltas go before the activation)."""
        with_experts = lora_slots.serves_experts(lora_experts, self.plan.w8a8)
        if with_experts and self.plan.w8a8:
            self._lora_plan = self._plan_layer(lora_options(options), knobs)
            if self._lora_plan.tma or self._lora_plan.swapab_chosen:  # the maps are encoded for self.plan
                raise OptionError("lora_experts=True on this w8a8 layer: its w8a16 LoRA plans would read "
                                  "tensor maps of their own, which the layer does not encode; build it "
                                  "with fp8_compute='w8a16'")
        experts = lora_slots.expert_slot_shape(self._owned, self.plan.i_max, with_experts)
        # the stacked form's Bext only where a GEMM may run it (forward_plan.lora_stack_parts)
        stack = lora_stack_parts(self._lora_plan, knobs.lora_in_gemm, lora_k, lora_r)
        t_rows = lora_router_t_rows(self._lora_plan, knobs.lora_router_t_rows, lora_k, lora_r)
        self.plan = replace(self.plan, lora_router_t_rows=t_rows)
        self._lora_plan = replace(self._lora_plan, lora_router_t_rows=t_rows)
        # A's bf16 parts only where a plan's router GEMM reads them (forward_plan.lora_router_t)
        self._lora = lora_slots.LoraSlots(self.cfg, lora_k, lora_r, self.device_id, experts, stack,
                                          router_parts=t_rows > 0)

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config_dict: Mapping[str, Any], tensors: Mapping[str, Any], prefix: str, *,
                max_tokens: int, **options) -> "MoeLayer":
        """Build from a config.json dict and a mapping of hub tensor names (numpy, torch, CuPy)."""
        from .checkpoint import layer_index_of, load_layer_from_tensors

        cfg, hw = load_layer_from_tensors(config_dict, tensors, prefix)
        layer = cls(cfg, hw, max_tokens=max_tokens, **options)
        layer.layer_idx = layer_index_of(prefix)
        return layer

    @classmethod
    def from_pretrained(cls, checkpoint_dir, layer_idx: int, *, max_tokens: int, **options) -> "MoeLayer":
        """Build from a checkpoint directory in hub naming (config.json + safetensors)."""
        from .checkpoint import load_layer

        cfg, hw = load_layer(checkpoint_dir, layer_idx)
        layer = cls(cfg, hw, max_tokens=max_tokens, **options)
        layer.layer_idx = int(layer_idx)
        return layer

    # --- scratch -------------------------------------------------------------------------
    def workspace_need(self, max_tokens: Optional[int] = None) -> WorkspaceNeed:
        """What this layer needs of a workspace at `max_tokens` (default its own; refused as the
        constructor refuses it: OptionError, ConfigError past the kernels' limit)."""
        if max_tokens is not None:
            check_options(self.cfg, max_tokens, self.default_path, False)
            check_token_limit(self.cfg, max_tokens, len(self._owned))
            max_tokens = int(max_tokens)  # a numpy integer passes the checks; the buffers' sizes take ints
        return layer_need(self.plan, max_tokens or self.max_tokens, self._guard, self._lora_experts,
                          self._lora_rank, self._lora_stack_ks, self._lora_router_t_cols, self._lora_plan)[1]

    def _bind(self, ws: Workspace) -> None:
        if ws.device_id != self.device_id:
            raise WorkspaceError(f"workspace is on device {ws.device_id}, the layer on device {self.device_id}")
        plan, need = layer_need(self.plan, self.max_tokens, self._guard, self._lora_experts, self._lora_rank,
                                self._lora_stack_ks, self._lora_router_t_cols, self._lora_plan)
        ws.check_fits(need, f"a {self.cfg.model_type or 'MoE'} layer at max_tokens={self.max_tokens}")
        self.workspace, self.scratch = ws, ScratchView.on(plan, ws, layer_tickets_offset(self.plan))
        if self._lora is not None:  # the slots wait for this workspace's forwards too before a fill
            self._lora.add_reader(ws)
        # the tensor-map tables of the kernels the plan picks, encoded now; others on first use
        self._maps = {name: self._encode_maps(name) for name, chosen in
                      (("tma_maps", self.plan.tma), ("swapab_maps", self.plan.swapab_chosen),
                       ("fp8_maps", self.plan.fp8_tma_chosen)) if chosen}
        self._packed: dict[tuple, PackedPlan] = {}  # (path, row count or prefill shape, separated)
        self._by_n: dict[tuple, PackedPlan] = {}  # (path asked, N) -> its plan, for the fast lookup
        self._experts_packed: dict[tuple, PackedPlan] = {}  # the experts-only entry's plans (cupymoe/experts.py)
        self._streams: dict[int, int] = {}
        self._graphs: dict[PackedPlan, Optional[PlanGraph]] = {}  # None: the plan launches step by step
        self._capture_status = CaptureStatus()
        self._checked: tuple = (None, None)  # (arguments, what _check_call made of them) of the last forward
        self._device_ptrs: OrderedDict[int, None] = OrderedDict()  # raw pointers checked as device memory
        self._lora_plans: dict[tuple, PackedPlan] = {}  # (path asked, N, separated) -> its LoRA plan

    def with_workspace(self, workspace: Workspace) -> "MoeLayer":
        """This layer on another workspace (e.g. a second stream's): the same weights, its own scratch."""
        other = copy.copy(self)
        other._bind(workspace)
        return other

    def _resolve(self, buf: Buf) -> int:
        if buf.space == Space.WEIGHTS:
            return self.weights.ptr(buf.name)
        if buf.space == Space.SCRATCH:
            return self.scratch.ptr(buf.name)
        if buf.name == "err":
            return int(self._err.data.ptr)
        if buf.name in MAP_TABLES:
            maps = self._maps.get(buf.name)
            if maps is None:  # a plan forced onto these kernels after construction (tune)
                maps = self._maps[buf.name] = self._encode_maps(buf.name)
            return int(maps.data.ptr)
        if buf.name.startswith("lora_") and self._lora is not None:
            return self._lora.ptr(buf.name)
        raise KeyError(f"no buffer {buf}")

    def _encode_maps(self, name: str):
        """One of the kernels' tensor-map tables (cupymoe/tma.py, MAP_TABLES) in device memory."""
        import cupy

        ptrs = {p: self.weights.tables[p].get() for p in ("gate", "up", "down")}
        return cupy.asarray(np.frombuffer(MAP_TABLES[name](self.plan, ptrs, self.scratch, self._lora), np.uint8))

    # --- paths and plans -------------------------------------------------------------------
    @property
    def decode_max_tokens(self) -> int:
        return self.plan.decode_max_tokens

    @property
    def atomic_max_tokens(self) -> int:
        return self.plan.atomic_max_tokens

    @property
    def row_invariant(self) -> bool:
        return self.plan.row_invariant

    @property
    def fp8_compute(self) -> Optional[str]:
        return None if self.plan.fp8_compute is None else self.plan.fp8_compute.value

    @property
    def keep_w8a8_activation(self) -> bool:
        """Whether the w8a8 prefill gate/up stores the bf16 activation (False on every other layer)."""
        return self.plan.keep_w8a8_activation

    def select_path(self, num_tokens: int, path: Optional[str] = None, *, lora: bool = False) -> str:
        """The path a forward of `num_tokens` rows takes (a forced one is validated); `lora`: with ids
        (a w8a8 layer with expert slots chooses as its w8a16 LoRA plans)."""
        check_path(path)  # `path or ...` on an array would raise ValueError
        return choose_path(self._lora_plan if lora else self.plan, path or self.default_path, num_tokens)

    def plan_for(self, num_tokens: int, path: Optional[str] = None, *, separated: bool = False) -> PackedPlan:
        """The packed plan a forward of `num_tokens` rows runs (built on first use, then kept)."""
        p = Path(self.select_path(num_tokens, path))
        key = (p, num_tokens if p != Path.PREFILL else prefill_shape(self.plan, self.device, num_tokens), separated)
        packed = self._packed.get(key)
        if packed is None:
            plan = build_forward_plan(self.plan, self.device, num_tokens, p, separated=separated)
            packed = self._packed[key] = PackedPlan(plan, self._resolve, self.lib.pointer, self._reduce())
        return packed

    def forward_plan(self, num_tokens: int, path: Optional[str] = None) -> ForwardPlan:
        """The launches a forward of `num_tokens` rows makes, every value evaluated (to read them)."""
        return self.plan_for(num_tokens, path).plan.at(num_tokens)

    def warmup(self) -> WarmupReport:
        """Build every plan `forward` can run (each decode row count, each prefill shape up to
        max_tokens), capture each as a graph, and launch every available path once on one scratch
        row, so that no first-use cost falls into a capture or a timed region (cupymoe/warmup.py).
        The LoRA and experts-only plans are built on their first call."""
        return warm_up(self)

    # --- the forward ---------------------------------------------------------------------
    def forward(self, input_ptr: int, num_tokens: int, output_ptr: int, stream: int, *,
                token_ids_ptr: int = 0, path: Optional[str] = None, lora_ids_ptr: int = 0) -> None:
        """Enqueue the layer on `stream`: output[N, H] bf16 = MoE(input[N, H] bf16); `token_ids_ptr`:
        [N] int32, read by a hash-routing layer (required there) and by no other, so a model's caller may
        pass it to every layer; `path`: force a path for this call; `lora_ids_ptr`: [N] int32 adapter
        slots a row (-1 = base), 0 = no LoRA (the base plans, bit for bit). Outside a caller's
        capture an unwatched forward without LoRA is one CUDA-graph launch (cupymoe/graph_launch.py)."""
        n, x, out, token_ids = checked_call(self, input_ptr, num_tokens, output_ptr, token_ids_ptr)
        stream = self._stream(stream)
        if path is not None:  # before it keys a dict (an unhashable one would raise TypeError there)
            check_path(path)
        if type(lora_ids_ptr) is not int or lora_ids_ptr:
            lora_ids = optional_pointer("lora_ids_ptr", lora_ids_ptr, 4)
            if lora_ids:
                check_device_pointers(self, (("lora_ids_ptr", lora_ids),))
                return self._lora_forward(x, n, out, stream, token_ids, lora_ids, path)
        if self._watched or profiling.observed():
            return self._observed_forward(x, n, out, stream, token_ids, path)
        packed = self._by_n.get((path, n))
        if packed is None:
            packed = self._by_n[(path, n)] = self.plan_for(n, path)
        ws = self.workspace
        ws.use(stream)
        graph = self._graphs.get(packed, _UNTRIED) if self._graph_launch else None
        if graph is not None and not Driver.is_capturing(stream, self._capture_status):  # a capture takes the launches
            if graph is _UNTRIED:
                graph = self._capture(packed, x, out, token_ids, n)
            if graph is not None and self._launch_graph(graph, x, out, token_ids, n, stream):
                return
        packed.run(x, out, token_ids, n, stream)
        ws.done(stream)

    def _capture(self, packed: PackedPlan, x: int, out: int, token_ids: int, n: int) -> Optional[PlanGraph]:
        """`packed` as a one-launch graph (None, and step-by-step launches, where it cannot be)."""
        packed.set_call(x, out, token_ids, n)
        try:
            graph = PlanGraph.capture(packed, self.workspace.capture_stream(), self.workspace.done_event, self._ctx)
        except LaunchError as e:
            log.warning("%s: launched step by step (%s)", packed.plan.path, e)
            graph = None
        self._graphs[packed] = graph
        return graph

    def _launch_graph(self, graph: PlanGraph, x: int, out: int, token_ids: int, n: int, stream: int) -> bool:
        try:
            graph.launch(x, out, token_ids, n, stream)
            return True
        except LaunchError as e:  # raised before anything was enqueued: the launches take over
            log.warning("forward graph dropped (%s)", e)
            self._graphs[graph.packed] = None
            return False

    # --- LoRA ------------------------------------------------------------------------------
    def set_lora(self, slot: int, adapter, stream: Optional[int] = None) -> None:
        """Copy `adapter` (cupymoe.lora.LoraWeights) into `slot` on `stream` (None: synchronously);
        outside capture. The copy waits for the last forward enqueued on every workspace this layer or
        a copy of it (with_workspace, which shares the slots) is bound to (they may read the slot).
        LoraError names what the layer cannot serve before anything is copied, and an adapter read for
        another decoder layer than the one this layer was loaded as."""
        self._check_adapter_layer(adapter)
        slots = self._lora_slots("set_lora")
        slots.fill(slot, adapter, stream, after=slots.reader_events())

    def _check_adapter_layer(self, adapter) -> None:
        theirs = getattr(adapter, "layer_idx", None)
        if theirs is not None and self.layer_idx is not None and theirs != self.layer_idx:
            raise LoraError(f"adapter {getattr(adapter, 'source', '')!r}: read for decoder layer {theirs}, this "
                            f"layer was loaded as layer {self.layer_idx} (load_peft(dir, {self.layer_idx}, cfg))")

    def check_lora(self, slot: int, adapter) -> None:
        """LoraError naming what set_lora(slot, adapter) would refuse; nothing is copied (to check an
        adapter against many layers before any takes it)."""
        self._check_adapter_layer(adapter)
        self._lora_slots("check_lora").check(slot, adapter)

    @property
    def max_lora_rank(self) -> int:
        """The reserved adapter slots' rank (0: none reserved)."""
        return self._lora_rank

    def clear_lora(self, slot: int, stream: Optional[int] = None) -> None:
        """Empty `slot`: rows with its id get the base layer again (after the workspaces' forwards, as set_lora)."""
        slots = self._lora_slots("clear_lora")
        slots.clear(slot, stream, after=slots.reader_events())

    @property
    def _lora_experts(self) -> bool:
        """Whether the LoRA plans add the experts' deltas (their slots and scratch exist)."""
        return self._lora is not None and self._lora.experts is not None

    @property
    def lora_experts(self) -> bool:
        """Whether the adapter slots take the experts' modules too (MoeLayer(lora_experts=...))."""
        return self._lora_experts

    @property
    def _lora_rank(self) -> int:
        """The reserved adapter slots' rank (0: none): the per-pair LoRA kernels' scratch."""
        return self._lora.max_rank if self._lora is not None else 0

    @property
    def _lora_stack_ks(self) -> int:
        """The LoRA stacked form's KS (0: the layer has none; cupymoe/lora_stack.py)."""
        return self._lora.stack_width if self._lora is not None else 0

    @property
    def _lora_router_t_cols(self) -> int:
        """The router GEMM's LoRA t columns (0: no plan makes t there; forward_plan.lora_router_t)."""
        if self._lora is None or not self._lora_plan.lora_router_t_rows:
            return 0
        return C.lora_router_t_cols(self._lora.max_loras, self._lora.max_rank)

    def lora_shape(self, what: str) -> LoraShape:
        """What the LoRA plans take of the slots and the knobs (LoraError naming `what` where the layer
        reserved none)."""
        slots = self._lora_slots(what)
        return LoraShape(slots.max_loras, slots.max_rank, self._lora_experts, slots.stack_parts,
                         stack_shrink=self._lora_stack_shrink, fold=self._lora_fold,
                         down_split=self._lora_down_split, overlap=self._lora_overlap,
                         shrink_runs=self._lora_shrink_runs, swapab=self._lora_swapab)

    def _lora_slots(self, what: str) -> "lora_slots.LoraSlots":
        if self._lora is None:
            raise LoraError(f"{what}: this layer reserved no adapter slots; build it with max_loras=K, max_lora_rank=R")
        return self._lora

    def _lora_forward(self, x: int, n: int, out: int, stream: int, token_ids: int, lora_ids: int, path) -> None:
        """A forward with per-row adapters: the LoRA plan variant (built once per (path, N)); watched
        (NVTX, stage events, profile, dumps) as a base forward is."""
        lora = self.lora_shape("forward(lora_ids_ptr=...)")
        observed = self._watched or profiling.observed()
        separated = observed and (self._profile or profiling.recording_events())
        key = (path, n, separated)
        packed = self._lora_plans.get(key)
        if packed is None:
            p = Path(self.select_path(n, path, lora=True))
            plan = build_forward_plan(self._lora_plan, self.device, n, p, separated=separated, lora=lora)
            packed = self._lora_plans[key] = PackedPlan(plan, self._resolve, self.lib.pointer, self._reduce())
        packed.set_call_value(CallValue.LORA_IDS, lora_ids)
        if observed:
            return self._run_observed(packed, x, n, out, stream, token_ids)
        self.workspace.use(stream)
        packed.run(x, out, token_ids, n, stream)
        self.workspace.done(stream)

    def _reduce(self):
        comm = self.comm
        return (lambda ptr, nbytes, stream: comm.all_reduce(ptr, nbytes, "bf16", stream)) if comm else None

    def _stream(self, stream) -> int:
        """The raw stream, checked once to belong to this layer's device; a default stream (0, 1, 2: the
        current context's) every call, since the thread's current device may have changed."""
        s = self._streams.get(stream) if type(stream) is int else None  # a list is unhashable, 16.0 == 16
        if s is None:
            s = check_stream(stream)
            if s not in DEFAULT_STREAMS and Driver.stream_context(s) != self._ctx:
                raise MoeCallError(f"stream 0x{s:x} belongs to another device's context than this "
                                   f"layer's device {self.device_id}")
            self._streams[s] = s
        current = Driver.current_context() if s in DEFAULT_STREAMS else self._ctx
        if current != self._ctx:
            where = "a device other than" if current else "no device (no CUDA context) for"
            raise MoeCallError(f"stream={s} is the default stream of the thread's current device, here {where} "
                               f"this layer's device {self.device_id}: make it current (cupy.cuda.Device"
                               f"({self.device_id}), torch.cuda.device({self.device_id})) or pass a stream of it")
        return s

    def _observed_forward(self, x: int, n: int, out: int, stream: int, token_ids: int, path) -> None:
        """A forward whose stages something watches: NVTX ranges, stage events, profile syncs, dumps,
        the red zones (filled before the launches)."""
        separated = self._profile or profiling.recording_events()
        self._run_observed(self.plan_for(n, path, separated=separated), x, n, out, stream, token_ids)

    def _run_observed(self, packed: PackedPlan, x: int, n: int, out: int, stream: int, token_ids: int) -> None:
        """`packed` stage by stage, each stage in its NVTX range (and events / profile syncs)."""
        from .debug import cupy_stream, dump_forward

        debug = self._profile or self._dump_dir is not None
        s = cupy_stream(stream, self.device_id)
        if debug and s.is_capturing():
            raise MoeCallError("CUPYMOE_PROFILE / CUPYMOE_DUMP_DIR synchronise the stream; unset them while "
                               "capturing a graph")
        self.workspace.use(stream)
        guard.arm_zones(self.scratch.zones, stream)
        packed.prepare(x, out, token_ids, n, stream)
        timer = profiling.StageTimer(s, n, packed.plan.path.value, self._profile)
        profiling.run_by_stage(timer, packed, n, stream)
        self.workspace.done(stream)
        if self._dump_dir is not None:
            dump_forward(self, x, n, out, s, packed.plan.path)

    # --- conveniences ----------------------------------------------------------------------
    def __call__(self, x, *, out=None, stream=None, token_ids=None, path: Optional[str] = None, lora_ids=None):
        """Run on a torch tensor (bf16, CUDA) or a CuPy array (uint16 bits of bf16), [N, H]; `out`
        is allocated when not given (so pass it under graph capture); `token_ids`, `lora_ids`: [N]
        int32 on the layer's GPU (lora_ids: each row's adapter slot, -1 = base)."""
        xa = arrays.view(x, "x")
        n = arrays.rows_of(xa, self.cfg.hidden_size, self.device_id)
        if out is None:
            out = arrays.empty_like(x)
        op = arrays.checked_ptr(out, "out", device=self.device_id, dtypes=arrays.BF16_BITS, shape=xa.shape)
        tp, lp = (0 if a is None else arrays.checked_ptr(a, name, device=self.device_id, dtypes=("int32",),
                                                         shape=(n,))
                  for name, a in (("token_ids", token_ids), ("lora_ids", lora_ids)))
        seed_checked_call(self, int(xa.ptr), int(n), int(op), int(tp))  # the arrays' devices are checked
        note_device_pointers(self, int(lp))
        self.forward(int(xa.ptr), int(n), int(op), arrays.current_stream(x) if stream is None else stream,
                     token_ids_ptr=int(tp), path=path, lora_ids_ptr=lp)
        return out

    def check_guard(self) -> None:
        """Guard mode (CUPYMOE_GUARD=1): synchronise and raise GuardError naming the buffer whose red
        zone a kernel of the last forward wrote into. Call it before another layer uses the workspace."""
        if not self._guard:
            raise OptionError("check_guard: this layer was built without CUPYMOE_GUARD=1 (no red zones)")
        guard.check_zones(self.scratch.zones, self.device_id)

    def memory_report(self) -> MemoryReport:
        """The device memory this layer uses: its own weight copies, the caller's tensors it borrows,
        its tables and state, and its workspace (cupymoe/weights.py says what is borrowed)."""
        w = self.weights.memory
        state = int(self._err.nbytes) + sum(int(m.nbytes) for m in self._maps.values())
        state += 0 if self._lora is None else self._lora.nbytes  # the adapters' slots
        return MemoryReport(w.owned, w.borrowed, w.tables, state, self.workspace_need().total_bytes,
                            self.workspace.nbytes)

    # --- the experts-only entry (cupymoe/experts.py) ------------------------------------
    def forward_experts(self, input_ptr: int, num_tokens: int, topk_ids_ptr: int, topk_weights_ptr: int,
                        output_ptr: int, stream: int, *, shared_expert: Optional[bool] = None,
                        path: Optional[str] = None, lora_ids_ptr: int = 0) -> None:
        """Enqueue the layer's experts on `stream` for a caller that routed the rows itself:
        output[N, H] bf16 = sum_j topk_weights[r, j] * expert_{topk_ids[r, j]}(input[r]) (+ the
        shared expert unless shared_expert=False; default: as the layer has one). ids [N, k] int32,
        weights [N, k] float32, used as given (no renormalisation or scaling); an id outside
        0..router_width-1 is flagged (check_errors) and adds nothing. `lora_ids_ptr`: [N] int32 adapter
        slots a row (-1 = base), the experts' deltas added (the router's are the caller's, as its routing
        is); 0 = none."""
        from .experts import forward_experts

        forward_experts(self, input_ptr, num_tokens, topk_ids_ptr, topk_weights_ptr, output_ptr, stream,
                        shared_expert=shared_expert, path=path, lora_ids_ptr=lora_ids_ptr)

    def run_experts(self, x, topk_ids, topk_weights, *, out=None, stream=None, shared_expert: Optional[bool] = None,
                    path: Optional[str] = None, lora_ids=None):
        """forward_experts on torch tensors or CuPy arrays: x [N, H] bf16, topk_ids [N, k] int32,
        topk_weights [N, k] float32, lora_ids [N] int32 or None, on the layer's GPU; returns `out`
        (allocated when not given)."""
        from .experts import run_experts

        return run_experts(self, x, topk_ids, topk_weights, out=out, stream=stream, shared_expert=shared_expert,
                           path=path, lora_ids=lora_ids)

    def check_errors(self) -> None:
        """Synchronise and raise if a kernel flagged bad input (e.g. a token id outside tid2eid)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.deviceSynchronize()
            flags = int(self._err.get()[0])
            if flags:
                self._err.fill(0)
                # the reset runs on the null stream, which a non-blocking caller stream does not wait
                # for: finish it now, or it may land after the next forward's flags and erase them
                cupy.cuda.runtime.deviceSynchronize()
                raise MoeCallError(f"a kernel flagged bad input (error bits 0x{flags:x}: {error_text(flags)})")
