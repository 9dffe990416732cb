"""MoeLayer: one MoE layer on one GPU, launched by raw pointer on the caller's stream.

Construction uploads the weights, makes the layer's choices (cupymoe/plan.py) and binds it to
a workspace; `forward` validates the call, looks up the prebuilt plan of its row count and
launches it (cupymoe/launch.py): no host sync, no allocation, no copy of per-step data, so a
whole forward can be captured into a CUDA graph. Every refusal comes before the first launch.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from . import arrays, jit, profiling, tma
from .config import MoeConfig, kernel_limits_violations
from .errors import (CudaUnavailableError, MoeCallError, OptionError, PathUnavailableError, UnsupportedModelError,
                     WorkspaceError)
from .forward_plan import build_forward_plan, prefill_buckets, prefill_shape
from .host_weights import HostWeights
from .knobs import Knobs
from .launch import Driver, PackedPlan
from .parallel import Communicator, check_communicator, owned_experts
from .plan import PATH_NAMES, Buf, DeviceFacts, ForwardPlan, LayerOptions, Path, Space, choose_path, plan_layer
from .weights import DeviceWeights
from .workspace import ScratchView, Workspace, WorkspaceNeed, layer_need

log = logging.getLogger(__name__)

PATHS = PATH_NAMES
_MAX_PTR = 1 << 64


@dataclass(frozen=True)
class WarmupReport:
    plans: int  # forward plans built (decode row counts, prefill shapes)
    seconds: float


class MoeLayer:
    """One MoE layer on one GPU (calling convention: docs/DESIGN.md section 5)."""

    def __init__(self, cfg: MoeConfig, host_weights: HostWeights, *, max_tokens: int,
                 device: Optional[int] = None, path: str = "auto", row_invariant: bool = False,
                 atomic_max_tokens: Optional[int] = None, decode_max_tokens: Optional[int] = None,
                 comm: Optional[Communicator] = None, expert_owner: Optional[Sequence[int]] = None,
                 fp8_compute: str = "auto", workspace: Optional[Workspace] = None):
        """Options: `path` ("auto", "decode", "atomic", "prefill"), `row_invariant` (the grouped path at
        every N: a row's bits never depend on N or the batch), `decode_max_tokens` / `atomic_max_tokens`
        (default: the measured crossover for the routed experts' format), `comm` (sums the
        expert-parallel partials), `expert_owner[e]` (the rank computing expert e), `fp8_compute`
        ("auto", "w8a8", "w8a16"), `workspace` (scratch shared with other layers run in turn on one
        stream; default: the layer's own)."""
        _check_options(cfg, max_tokens, path, row_invariant)
        cupy = _cupy()
        self.cfg, self.max_tokens, self.default_path = cfg, int(max_tokens), path
        self.device_id = _device(cupy, device)
        self.comm = comm
        if comm is not None:
            check_communicator(cfg, comm)
        owned = owned_experts(cfg, expert_owner)
        knobs = Knobs.from_env()
        self._profile, self._dump_dir = knobs.profile, knobs.dump_dir
        with cupy.cuda.Device(self.device_id):
            self.lib = jit.library(self.device_id)
            self.device = DeviceFacts(self.lib.arch, self.lib.sm_count, self.lib.max_smem)
            _check_sort_fits(len(owned), self.device)
            self.weights = DeviceWeights(cfg, host_weights, self.device_id, owned)
            options = LayerOptions(row_invariant, fp8_compute, decode_max_tokens, atomic_max_tokens, comm is not None)
            self.plan = plan_layer(cfg, self.weights.format, self.weights.shared_format, self.lib.arch,
                                   n_local=len(owned), options=options, knobs=knobs,
                                   mxfp4_scale_bytes=self.weights.mxfp4_scale_bytes)
            assert self.plan.i_max == self.weights.i_max, (self.plan.i_max, self.weights.i_max)
            self._err = cupy.zeros(1, cupy.int32)  # sticky error bits the kernels set (check_errors)
            self._ctx = cupy.cuda.driver.ctxGetCurrent()
            self._bind(workspace or Workspace(self.workspace_need(), device=self.device_id))
            # the uploads and repacks went through the legacy default stream, which a caller's
            # non-blocking stream never waits for: finish them before a first forward
            cupy.cuda.runtime.deviceSynchronize()
        log.info("MoeLayer ready on device %d (%s): %d local experts, weights %.1f MB, scratch %.1f MB",
                 self.device_id, self.lib.arch, self.plan.n_local, self.weights.nbytes / 1e6,
                 self.scratch.plan.total_bytes / 1e6)

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config_dict: Mapping[str, Any], tensors: Mapping[str, Any], prefix: str, *,
                max_tokens: int, **options) -> "MoeLayer":
        """Build from a config.json dict and a mapping of hub tensor names (numpy, torch, CuPy)."""
        from .checkpoint import load_layer_from_tensors

        cfg, hw = load_layer_from_tensors(config_dict, tensors, prefix)
        return cls(cfg, hw, max_tokens=max_tokens, **options)

    @classmethod
    def from_pretrained(cls, checkpoint_dir, layer_idx: int, *, max_tokens: int, **options) -> "MoeLayer":
        """Build from a checkpoint directory in hub naming (config.json + safetensors)."""
        from .checkpoint import load_layer

        cfg, hw = load_layer(checkpoint_dir, layer_idx)
        return cls(cfg, hw, max_tokens=max_tokens, **options)

    # --- scratch -------------------------------------------------------------------------
    def workspace_need(self, max_tokens: Optional[int] = None) -> WorkspaceNeed:
        """What this layer needs of a workspace at `max_tokens` (default its own)."""
        return layer_need(self.plan, max_tokens or self.max_tokens)[1]

    def _bind(self, ws: Workspace) -> None:
        if ws.device_id != self.device_id:
            raise WorkspaceError(f"workspace is on device {ws.device_id}, the layer on device {self.device_id}")
        plan, need = layer_need(self.plan, self.max_tokens)
        ws.check_fits(need, f"a {self.cfg.model_type or 'MoE'} layer at max_tokens={self.max_tokens}")
        self.workspace, self.scratch = ws, ScratchView.on(plan, ws)
        self._tma_maps = None
        if self.plan.tma:
            import cupy

            ptrs = {p: self.weights.tables[p].get() for p in ("gate", "up", "down")}
            self._tma_maps = cupy.asarray(np.frombuffer(tma.layer_table(self.plan, ptrs, self.scratch), np.uint8))
        self._packed: dict[tuple, PackedPlan] = {}  # (path, row count or prefill shape, separated)
        self._by_n: dict[tuple, PackedPlan] = {}  # (path asked, N) -> its plan, for the fast lookup
        self._streams: dict[int, int] = {}

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
        if buf.name == "tma_maps":
            return int(self._tma_maps.data.ptr)
        raise KeyError(f"no buffer {buf}")

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

    def select_path(self, num_tokens: int, path: Optional[str] = None) -> str:
        """The path a forward of `num_tokens` rows takes (a forced one is validated)."""
        return choose_path(self.plan, path or self.default_path, num_tokens)

    def plan_for(self, num_tokens: int, path: Optional[str] = None, *, separated: bool = False) -> PackedPlan:
        """The packed plan a forward of `num_tokens` rows runs (built on first use, then kept)."""
        p = Path(self.select_path(num_tokens, path))
        key = (p, num_tokens if p != Path.PREFILL else prefill_shape(self.plan, self.device, num_tokens), separated)
        packed = self._packed.get(key)
        if packed is None:
            plan = build_forward_plan(self.plan, self.device, num_tokens, p, separated=separated)
            comm = self.comm
            reduce = (lambda ptr, nbytes, stream: comm.all_reduce(ptr, nbytes, "bf16", stream)) if comm else None
            packed = self._packed[key] = PackedPlan(plan, self._resolve, self.lib.pointer, reduce)
        return packed

    def forward_plan(self, num_tokens: int, path: Optional[str] = None) -> ForwardPlan:
        """The launches a forward of `num_tokens` rows makes, every value evaluated (to read them)."""
        return self.plan_for(num_tokens, path).plan.at(num_tokens)

    def warmup(self) -> WarmupReport:
        """Build every plan this layer can run (each decode row count, each prefill shape up to
        max_tokens) and launch every path once on a scratch input, so that no first-use cost
        falls into a capture or a timed region."""
        import cupy

        t0 = time.perf_counter()
        for p in self._warmup_paths():
            top = self.max_tokens if p == "prefill" else min(self.max_tokens, self.decode_max_tokens)
            if p == "atomic":
                top = min(top, self.atomic_max_tokens)
            if p == "prefill":
                ns = [lo for lo, _, _ in prefill_buckets(self.plan, self.device, self._prefill_from(), top)]
            else:
                ns = range(1, top + 1)
            for n in ns:
                self.plan_for(n, p)
        seconds = time.perf_counter() - t0
        with cupy.cuda.Device(self.device_id):
            rng = np.random.default_rng(0)
            s = cupy.cuda.Stream(non_blocking=True)
            with s:  # the input made on the stream that reads it
                x = cupy.asarray((rng.standard_normal((1, self.cfg.hidden_size), dtype=np.float32)
                                  .view(np.uint32) >> 16).astype(np.uint16))
                tids, out = cupy.zeros(1, cupy.int32), cupy.empty_like(x)
            for p in self._warmup_paths():
                self.forward(int(x.data.ptr), 1, int(out.data.ptr), s.ptr, token_ids_ptr=int(tids.data.ptr), path=p)
            s.synchronize()
        return WarmupReport(len(self._packed), seconds)

    def _prefill_from(self) -> int:
        # the tuning table may send row counts below the decode cap to prefill
        return 1 if self.row_invariant or self.plan.tuned else self.decode_max_tokens + 1

    def _warmup_paths(self) -> list[str]:
        """The paths a one-row forward may take on this layer (select_path accepts them)."""
        paths = []
        for p in ("decode", "atomic", "prefill"):
            try:
                self.select_path(1, p)
            except PathUnavailableError:
                continue
            paths.append(p)
        return paths

    # --- the forward ---------------------------------------------------------------------
    def forward(self, input_ptr: int, num_tokens: int, output_ptr: int, stream: int, *,
                token_ids_ptr: int = 0, path: Optional[str] = None) -> None:
        """Enqueue the layer on `stream`: output[N, H] bf16 = MoE(input[N, H] bf16)."""
        n, x, out, token_ids = _check_call(self, input_ptr, num_tokens, output_ptr, token_ids_ptr)
        stream = self._stream(stream)
        debug = self._profile or self._dump_dir is not None
        if debug or profiling.observed():
            return self._observed_forward(x, n, out, stream, token_ids, path, debug)
        packed = self._by_n.get((path, n))
        if packed is None:
            packed = self._by_n[(path, n)] = self.plan_for(n, path)
        ws = self.workspace
        ws.use(stream)
        packed.run(x, out, token_ids, n, stream)
        ws.done(stream)

    def _stream(self, stream) -> int:
        """The raw stream, checked once to belong to this layer's device."""
        s = self._streams.get(stream)
        if s is None:
            if not isinstance(stream, (int, np.integer)) or isinstance(stream, bool) or not 0 <= stream < _MAX_PTR:
                raise MoeCallError(f"stream={stream!r}: a cudaStream_t as an int is required")
            if stream not in (0, 1, 2) and Driver.stream_context(int(stream)) != self._ctx:
                raise MoeCallError(f"stream 0x{int(stream):x} belongs to another device's context than this "
                                   f"layer's device {self.device_id}")
            s = self._streams[stream] = int(stream)
        return s

    def _observed_forward(self, x: int, n: int, out: int, stream: int, token_ids: int, path, debug: bool) -> None:
        """A forward whose stages something watches: NVTX ranges, stage events, profile syncs, dumps."""
        from .debug import cupy_stream, dump_forward

        s = cupy_stream(stream, self.device_id)
        if debug and s.is_capturing():
            raise MoeCallError("CUPYMOE_PROFILE / CUPYMOE_DUMP_DIR synchronise the stream; unset them while "
                               "capturing a graph")
        separated = self._profile or profiling.recording_events()
        packed = self.plan_for(n, path, separated=separated)
        self.workspace.use(stream)
        packed.prepare(x, out, token_ids, n, stream)
        timer = profiling.StageTimer(s, n, packed.plan.path.value, self._profile)
        with timer.forward():
            i = 0
            while i < len(packed.steps):
                stage = packed.steps[i][0]
                with timer.stage(stage.value):
                    while i < len(packed.steps) and packed.steps[i][0] == stage:
                        packed.run_step(packed.steps[i][1], packed.steps[i][2], n, stream)
                        i += 1
        self.workspace.done(stream)
        if self._dump_dir is not None:
            dump_forward(self, x, n, out, s, packed.plan.path)

    # --- conveniences ----------------------------------------------------------------------
    def __call__(self, x, *, out=None, stream=None, token_ids=None, path: Optional[str] = None):
        """Run on a torch tensor (bf16, CUDA) or a CuPy array (uint16 bits of bf16), [N, H]; `out`
        is allocated when not given (so pass it under graph capture)."""
        xa = arrays.view(x, "x")
        n = arrays.rows_of(xa, self.cfg.hidden_size, self.device_id)
        if out is None:
            out = arrays.empty_like(x)
        oa = arrays.view(out, "out")
        arrays.check(oa, "out", device=self.device_id, dtypes=arrays.BF16_BITS, shape=xa.shape)
        tp = 0
        if token_ids is not None:
            ta = arrays.view(token_ids, "token_ids")
            arrays.check(ta, "token_ids", device=self.device_id, dtypes=("int32",), shape=(n,))
            tp = ta.ptr
        self.forward(xa.ptr, n, oa.ptr, arrays.current_stream(x) if stream is None else stream,
                     token_ids_ptr=tp, path=path)
        return out

    def check_errors(self) -> None:
        """Synchronise and raise if a kernel flagged bad input (e.g. a token id outside tid2eid)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.deviceSynchronize()
            flags = int(self._err.get()[0])
            if flags:
                self._err.fill(0)
                raise MoeCallError(f"a kernel flagged bad input (error bits 0x{flags:x}: bit 0 = a token id outside "
                                   "0..hash_vocab_size-1; those rows got no routed experts)")


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailableError(f"CuPy is not installed ({e}): pip install 'cupymoe[cu12]' (or [cu13])") from None
    return cupy


def _device(cupy, device: Optional[int]) -> int:
    """The CUDA device the layer lives on (the current one by default), or a named error without one."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        current = cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise CudaUnavailableError(f"no usable CUDA device: {e}") from None
    dev = current if device is None else int(device)
    if not 0 <= dev < count:
        raise CudaUnavailableError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return dev


def _check_options(cfg: MoeConfig, max_tokens, path: str, row_invariant: bool) -> None:
    """Refuse what no layer could run, before anything is uploaded."""
    if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise OptionError(f"max_tokens={max_tokens!r}: must be a positive integer")
    if path not in PATHS:
        raise OptionError(f"path={path!r}: must be one of {PATHS}")
    if path in ("decode", "atomic") and row_invariant:
        raise PathUnavailableError(f"path={path!r} with row_invariant=True: row-invariant layers run the grouped "
                                   "path at every N; use path='auto' or 'prefill'")
    problems = kernel_limits_violations(cfg)
    if problems:
        raise UnsupportedModelError(f"the GPU kernels cannot serve this layer: {'; '.join(problems)}")


def _check_sort_fits(n_local: int, dev: DeviceFacts) -> None:
    from .catalog import sort_place_smem_bytes

    need = sort_place_smem_bytes(n_local)
    if need > dev.max_smem:
        raise UnsupportedModelError(f"{n_local} routed experts on one GPU: the grouped path's sort needs {need} bytes "
                                    f"of shared memory a block, this GPU allows {dev.max_smem}; spread the experts "
                                    "over more ranks (ep_world_size)")


def _pointer(name: str, p, align: int) -> int:
    if type(p) is not int and (not isinstance(p, np.integer) or isinstance(p, bool)):
        raise MoeCallError(f"{name}={p!r}: a device pointer (int) is required")
    if not 0 < p < _MAX_PTR:
        raise MoeCallError(f"{name}={p!r}: not a device address (must be in 1..2^64-1)")
    if p % align:
        raise MoeCallError(f"{name}=0x{int(p):x}: must be {align}-byte aligned")
    return int(p)


def _check_call(layer: MoeLayer, input_ptr, num_tokens, output_ptr, token_ids_ptr) -> tuple[int, int, int, int]:
    """Refuse a bad call before anything is launched; returns (N, input, output, token ids) as ints."""
    if type(num_tokens) is not int and (not isinstance(num_tokens, np.integer) or isinstance(num_tokens, bool)):
        raise MoeCallError(f"num_tokens={num_tokens!r}: must be an int")
    n = int(num_tokens)
    if not 1 <= n <= layer.max_tokens:
        raise MoeCallError(f"num_tokens={n}: must be in 1..max_tokens={layer.max_tokens}")
    x = _pointer("input_ptr", input_ptr, 16)  # the kernels read 16-byte vectors
    out = _pointer("output_ptr", output_ptr, 16)
    nbytes = n * layer.cfg.hidden_size * 2
    if x < out + nbytes and out < x + nbytes:
        raise MoeCallError(f"output_ptr=0x{out:x} overlaps input_ptr=0x{x:x} ({nbytes} bytes each): blocks read "
                           "whole input rows while others write the output; give the output its own memory")
    if token_ids_ptr:
        return n, x, out, _pointer("token_ids_ptr", token_ids_ptr, 4)
    if layer.cfg.hash_routing:
        raise MoeCallError("hash routing (tid2eid) needs token_ids_ptr: a device pointer to num_tokens int32 ids")
    return n, x, out, 0
