"""How a ForwardPlan runs: its arguments packed once, launched by the driver on the caller's stream.

A PackedPlan turns the plan's launches into cuLaunchKernelEx calls whose configurations and
parameter arrays are built once. Every argument lives in its own ctypes cell; the per-call
values (input, output, token ids) and the row-count values of a bucket plan are cells shared
by every launch that reads them, so a forward writes each once and launches. Nothing here
decides what runs (cupymoe/plan.py) or allocates device memory.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Optional

from .errors import LaunchError
from .plan import AllReduce, Arg, ArgType, Buf, CallValue, ForwardPlan, Launch, Memset, PerN

# cuLaunchKernelEx's configuration (cuda.h): CUlaunchAttribute is an id padded to 8 bytes
# and a 64-byte value union; CUlaunchConfig the grid, block, dynamic shared memory, stream
# and the attribute array.
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CUDA_ERROR_INVALID_VALUE = 1  # what cuStreamWaitEvent answers for an event last recorded in a capture
CUDA_ERROR_CAPTURED_EVENT = 907


class _LaunchAttributeValue(ctypes.Union):  # 64 bytes; the int member this layer sets
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


# the one attribute a programmatic dependent launch passes (the driver reads it during the call)
_PDL_ATTRIBUTE = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
_PDL_ATTRIBUTE.value.programmatic_stream_serialization_allowed = 1

_CTYPES = {ArgType.U64: ctypes.c_uint64, ArgType.I32: ctypes.c_int32, ArgType.F32: ctypes.c_float}


class Driver:
    """The few driver entry points a forward calls, through ctypes (loaded on first use)."""

    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise LaunchError(f"libcuda.so.1 could not be loaded: {e}") from e
            lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
            lib.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            cls._lib = lib
        return cls._lib

    @classmethod
    def is_capturing(cls, stream: int, status: Optional["CaptureStatus"] = None) -> bool:
        """Whether `stream` is capturing (`status`: a cell of the caller's to answer in, saving an allocation)."""
        status = status or CaptureStatus()
        rc = cls.lib().cuStreamIsCapturing(stream, status.ref)
        if rc:
            cls.check(rc, "cuStreamIsCapturing")
        return status.cell.value != 0

    @classmethod
    def record(cls, event: int, stream: int) -> None:
        cls.check(cls.lib().cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cuEventRecord")

    @classmethod
    def wait(cls, stream: int, event: int) -> None:
        """`stream` waits for `event` (no host sync); an event last recorded inside a stream capture
        stands for no work, so there is nothing to wait for."""
        rc = cls.lib().cuStreamWaitEvent(ctypes.c_void_p(stream), ctypes.c_void_p(event), 0)
        if rc not in (0, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_CAPTURED_EVENT):
            cls.check(rc, "cuStreamWaitEvent")

    @classmethod
    def stream_context(cls, stream: int) -> int:
        ctx = ctypes.c_void_p()
        cls.check(cls.lib().cuStreamGetCtx(ctypes.c_void_p(stream), ctypes.byref(ctx)), "cuStreamGetCtx")
        return ctx.value or 0

    _ctx_get = None

    @classmethod
    def current_context(cls) -> int:
        """The calling thread's current CUDA context (0: none), whose default streams 0, 1 and 2 are
        (a forward on a default stream asks every call: the entry point is looked up once)."""
        if cls._ctx_get is None:
            import cupy

            cls._ctx_get = cupy.cuda.driver.ctxGetCurrent
        return cls._ctx_get()

    @classmethod
    def check(cls, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            cls.lib().cuGetErrorString(rc, ctypes.byref(msg))
            raise LaunchError(f"{what} failed: CUresult {rc} ({(msg.value or b'?').decode()})")


class CaptureStatus:
    """An answer cell for cuStreamIsCapturing that one thread's forwards reuse."""

    def __init__(self):
        self.cell = ctypes.c_int(0)
        self.ref = ctypes.byref(self.cell)


def _dims(d: tuple) -> ctypes.Array:
    return (ctypes.c_uint * 3)(*(tuple(int(v) for v in d) + (1, 1))[:3])


class PackedPlan:
    """One ForwardPlan bound to device addresses: `run(x, out, token_ids, n, stream)` patches the
    per-call cells and enqueues every step. `resolve(buf)` gives a Buf's address, `function(name)`
    a kernel's CUfunction handle, `all_reduce(ptr, nbytes, stream)` the communicator's sum."""

    def __init__(self, plan: ForwardPlan, resolve: Callable[[Buf], int], function: Callable[[str], int],
                 all_reduce: Optional[Callable[[int, int, int], None]] = None):
        self.plan = plan
        self._resolve = resolve
        self._call = {v: ctypes.c_uint64(0) for v in CallValue}  # cells every launch shares
        self._per_n: dict[str, tuple[ctypes._SimpleCData, Callable[[int], float]]] = {}
        self._configs: list[LaunchConfig] = []
        self._launch_parts: list[tuple[LaunchConfig, int, int]] = []  # (config, parameter array, function)
        self._grid_patches: list[tuple[LaunchConfig, int, PerN]] = []  # (config, axis or -1 for smem, value)
        self._keep: list = []
        self.steps: list[tuple] = []  # (stage, kind, payload)
        self._all_reduce = all_reduce
        for step in plan.steps:
            if isinstance(step, Launch):
                self.steps.append((step.stage, "launch", self._pack_launch(step, function(step.kernel))))
            elif isinstance(step, Memset):
                self.steps.append((step.stage, "memset", (resolve(step.buffer), step.words)))
            elif isinstance(step, AllReduce):
                self.steps.append((step.stage, "all_reduce", step.nbytes))
        self._n = -1
        self._stream = -1

    # --- packing ---------------------------------------------------------------------------
    def _cell(self, arg: Arg):
        v = arg.value
        if isinstance(v, CallValue):
            return self._call[v]
        if isinstance(v, PerN):
            cell = self._per_n.get(v.name)
            if cell is None:
                cell = self._per_n[v.name] = (_CTYPES[arg.type](0), v.fn)
            return cell[0]
        if isinstance(v, Buf):
            v = self._resolve(v)
        c = _CTYPES[arg.type](v)
        self._keep.append(c)
        return c

    def _pack_launch(self, launch: Launch, fn: int) -> tuple:
        cells = [self._cell(a) for a in launch.args]
        params = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
        grid = tuple(0 if isinstance(g, PerN) else g for g in launch.grid)
        smem = 0 if isinstance(launch.smem, PerN) else launch.smem
        cfg = LaunchConfig(_dims(grid), _dims(launch.block), smem, None,
                           ctypes.pointer(_PDL_ATTRIBUTE) if launch.pdl else None, 1 if launch.pdl else 0)
        for axis, g in enumerate(launch.grid):
            if isinstance(g, PerN):
                self._grid_patches.append((cfg, axis, g))
        if isinstance(launch.smem, PerN):
            self._grid_patches.append((cfg, -1, launch.smem))
        self._configs.append(cfg)
        self._launch_parts.append((cfg, ctypes.addressof(params), fn))
        self._keep += [params, cfg]
        return (ctypes.addressof(cfg), fn, ctypes.addressof(params), launch.kernel)

    # --- a forward ---------------------------------------------------------------------------
    def bind(self, n: int) -> None:
        """Write the row-count values of `n` rows (grids, shared memory, scalars)."""
        for cell, fn in self._per_n.values():
            cell.value = fn(n)
        for cfg, axis, v in self._grid_patches:
            if axis < 0:
                cfg.shared_mem = v.fn(n)
            else:
                cfg.grid[axis] = v.fn(n)
        self._n = n

    def set_call(self, x: int, out: int, token_ids: int, n: int) -> None:
        """Write the per-call cells (and the row-count values when `n` changed)."""
        call = self._call
        call[CallValue.INPUT].value = x
        call[CallValue.OUTPUT].value = out
        call[CallValue.TOKEN_IDS].value = token_ids
        if n != self._n:
            self.bind(n)

    def retarget(self, stream: int) -> None:
        """Every launch configuration names `stream`."""
        if stream != self._stream:
            for cfg in self._configs:
                cfg.stream = stream
            self._stream = stream

    def prepare(self, x: int, out: int, token_ids: int, n: int, stream: int) -> None:
        """Patch the per-call cells; after it, run_step (or run) enqueues."""
        self.set_call(x, out, token_ids, n)
        self.retarget(stream)

    # --- what a captured graph of the plan reads ---------------------------------------------
    @property
    def bound_n(self) -> int:
        return self._n

    def call_values(self) -> tuple[int, int, int]:
        c = self._call
        return (c[CallValue.INPUT].value, c[CallValue.OUTPUT].value, c[CallValue.TOKEN_IDS].value)

    def launch_parts(self) -> list[tuple[LaunchConfig, int, int]]:
        """(configuration, parameter array address, function) of each launch, in order."""
        return list(self._launch_parts)

    def memset_target(self, step: Memset) -> int:
        return self._resolve(step.buffer)

    def set_call_value(self, value: CallValue, ptr: int) -> None:
        """Patch one per-call cell that `prepare` does not take (a LoRA plan's lora_ids)."""
        self._call[value].value = ptr

    def run(self, x: int, out: int, token_ids: int, n: int, stream: int) -> None:
        """Enqueue the whole plan on `stream`."""
        self.prepare(x, out, token_ids, n, stream)
        launch = Driver.lib().cuLaunchKernelEx
        for _, kind, payload in self.steps:
            if kind == "launch":
                rc = launch(payload[0], payload[1], payload[2], None)
                if rc:
                    Driver.check(rc, f"cuLaunchKernelEx({payload[3]})")
            else:
                self.run_step(kind, payload, n, stream)

    def run_step(self, kind: str, payload, n: int, stream: int) -> None:
        """One step (after prepare): a launch, a memset of 32-bit zeros, or the all-reduce."""
        if kind == "launch":
            Driver.check(Driver.lib().cuLaunchKernelEx(payload[0], payload[1], payload[2], None),
                         f"cuLaunchKernelEx({payload[3]})")
        elif kind == "memset":
            ptr, words = payload
            count = words.fn(n) if isinstance(words, PerN) else words
            Driver.check(Driver.lib().cuMemsetD32Async(ptr, 0, count, stream), "cuMemsetD32Async")
        else:
            nbytes = payload.fn(n) if isinstance(payload, PerN) else payload
            self._all_reduce(self._call[CallValue.OUTPUT].value, nbytes, stream)


def launch_once(launch: Launch, resolve: Callable[[Buf], int], function: Callable[[str], int], n: int,
                stream: int, call: Optional[dict] = None) -> None:
    """Pack and enqueue one launch (debug dumps; never on a forward's path)."""
    plan = ForwardPlan(path=None, steps=(launch,), built_for=n)
    packed = PackedPlan(plan, resolve, function)
    call = call or {}
    packed.run(call.get(CallValue.INPUT, 0), call.get(CallValue.OUTPUT, 0), call.get(CallValue.TOKEN_IDS, 0), n,
               stream)
