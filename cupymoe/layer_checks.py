"""The checks a MoeLayer makes before anything reaches the GPU: its options at construction
(sizes the kernels' counts and grids can serve, shared memory the GPU opts in to) and each
forward's arguments (pointers, row counts, overlap), every refusal a named error with the value."""

from __future__ import annotations

from typing import Optional

from .config import MoeConfig, is_integer, kernel_limits_violations
from .errors import (ConfigError, CudaUnavailableError, MoeCallError, OptionError, PathUnavailableError,
                     UnsupportedModelError)
from .plan import PATH_NAMES, DeviceFacts

_MAX_PTR = 1 << 64


def cupy_module():
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailableError(f"CuPy is not installed ({e}): pip install 'cupymoe[cu12]' (or [cu13])") from None
    return cupy


def device_of(cupy, device: Optional[int]) -> int:
    """The CUDA device the layer lives on (the current one by default), or a named error without one."""
    if device is not None and not is_integer(device):  # int(1.9) and int(True) would pick device 1
        raise OptionError(f"device={device!r}: a device index (int) is required")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        current = cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise CudaUnavailableError(f"no usable CUDA device: {e}") from None
    dev = current if device is None else int(device)
    if not 0 <= dev < count:
        raise CudaUnavailableError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return dev


def check_max_tokens(max_tokens) -> None:
    if not is_integer(max_tokens) or max_tokens <= 0:
        raise OptionError(f"max_tokens={max_tokens!r}: must be a positive integer")


def check_options(cfg: MoeConfig, max_tokens, path: str, row_invariant: bool) -> None:
    """Refuse what no layer could run, before anything is uploaded."""
    check_max_tokens(max_tokens)
    if not isinstance(path, str) or path not in PATH_NAMES:  # an array's `in` would raise ValueError
        raise OptionError(f"path={path!r}: must be one of {PATH_NAMES}")
    if not isinstance(row_invariant, bool):
        raise OptionError(f"row_invariant={row_invariant!r}: must be True or False")
    if path in ("decode", "atomic") and row_invariant:
        raise PathUnavailableError(f"path={path!r} with row_invariant=True: row-invariant layers run the grouped "
                                   "path at every N; use path='auto' or 'prefill'")
    problems = kernel_limits_violations(cfg)
    if problems:
        raise UnsupportedModelError(f"the GPU kernels cannot serve this layer: {'; '.join(problems)}")


def check_token_limit(cfg: MoeConfig, max_tokens: int, n_local: int) -> None:
    """Refuse a max_tokens the kernels' int32 counts and grid extents cannot serve (catalog.token_limit)."""
    from .catalog import MAX_GRID_Y, MAX_TOKENS, token_limit

    limit = token_limit(cfg.num_experts_per_tok, n_local, cfg.has_shared_expert)
    if max_tokens > limit:
        why = (f"the kernels serve at most {MAX_TOKENS} rows a call" if limit == MAX_TOKENS else
               f"with k={cfg.num_experts_per_tok} over {n_local} local experts the grouped GEMMs' tiles would pass "
               f"the grid's y limit of {MAX_GRID_Y}")
        raise ConfigError(f"max_tokens={max_tokens}: {why}; this layer accepts max_tokens <= {limit} "
                          "(split larger batches into calls of at most that many rows)")


def check_smem_fits(cfg: MoeConfig, n_local: int, dev: DeviceFacts) -> None:
    """Refuse a layer whose top-k or sort block would ask more shared memory than the GPU opts in to
    (the launch would fail mid-forward, after the router was enqueued)."""
    from .catalog import sort_place_smem_bytes, topk_route_smem_bytes

    need = topk_route_smem_bytes(cfg.router_width)
    if need > dev.max_smem:
        raise UnsupportedModelError(f"router width R = {cfg.router_width}: the top-k kernel needs {need} bytes of "
                                    f"shared memory a block, this GPU allows {dev.max_smem}")
    need = sort_place_smem_bytes(n_local)
    if need > dev.max_smem:
        raise UnsupportedModelError(f"{n_local} routed experts on one GPU: the grouped path's sort needs {need} bytes "
                                    f"of shared memory a block, this GPU allows {dev.max_smem}; spread the experts "
                                    "over more ranks (ep_world_size)")


def row_count(num_tokens, max_tokens: int) -> int:
    if not is_integer(num_tokens):
        raise MoeCallError(f"num_tokens={num_tokens!r}: must be an int")
    n = int(num_tokens)
    if not 1 <= n <= max_tokens:
        raise MoeCallError(f"num_tokens={n}: must be in 1..max_tokens={max_tokens}")
    return n


def pointer(name: str, p, align: int) -> int:
    if not is_integer(p):
        raise MoeCallError(f"{name}={p!r}: a device pointer (int) is required")
    if not 0 < p < _MAX_PTR:
        raise MoeCallError(f"{name}={p!r}: not a device address (must be in 1..2^64-1)")
    if p % align:
        raise MoeCallError(f"{name}=0x{int(p):x}: must be {align}-byte aligned")
    return int(p)


def optional_pointer(name: str, p, align: int) -> int:
    """0 where the pointer is absent (None or an integer 0), else `pointer`'s checks."""
    if p is None or (is_integer(p) and p == 0):
        return 0
    return pointer(name, p, align)


def check_disjoint(x: int, out: int, nbytes: int) -> None:
    if x < out + nbytes and out < x + nbytes:
        raise MoeCallError(f"output_ptr=0x{out:x} overlaps input_ptr=0x{x:x} ({nbytes} bytes each): blocks read "
                           "whole input rows while others write the output; give the output its own memory")


def check_call(layer, input_ptr, num_tokens, output_ptr, token_ids_ptr,
               device_memory: bool = True) -> tuple[int, int, int, int]:
    """Refuse a bad call before anything is launched; returns (N, input, output, token ids) as ints.
    `device_memory`: also ask the runtime what each pointer points at (raw pointers; arrays whose
    device was checked already skip it)."""
    n = row_count(num_tokens, layer.max_tokens)
    x = pointer("input_ptr", input_ptr, 16)  # the kernels read 16-byte vectors
    out = pointer("output_ptr", output_ptr, 16)
    check_disjoint(x, out, n * layer.cfg.hidden_size * 2)
    token_ids = optional_pointer("token_ids_ptr", token_ids_ptr, 4)
    if not token_ids and layer.cfg.hash_routing:
        raise MoeCallError("hash routing (tid2eid) needs token_ids_ptr: a device pointer to num_tokens int32 ids")
    if device_memory:
        check_device_pointers(layer, (("input_ptr", x), ("output_ptr", out), ("token_ids_ptr", token_ids)))
    return n, x, out, token_ids


# cudaMemoryType: what cudaPointerGetAttributes says of an address
_UNREGISTERED, _DEVICE = 0, 2


def check_device_memory(name: str, p: int, device_id: int) -> None:
    """A MoeCallError where the runtime knows `p` as no CUDA memory (pageable host memory, a stray
    address: the kernels would fault and leave the context unusable) or as device memory of another
    GPU; pinned host and managed memory pass (the GPU reads them). Asked once per new pointer
    (check_device_pointers keeps them); an answer the runtime cannot give lets the pointer pass."""
    cupy = cupy_module()
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(p)
        kind, device = int(attrs.type), int(attrs.device)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if "InvalidValue" not in str(e):  # older runtimes answer an unregistered address so
            return
        kind, device = _UNREGISTERED, -1
    except Exception:  # noqa: BLE001 (a best-effort guard: never in a correct call's way)
        return
    if kind == _UNREGISTERED:
        raise MoeCallError(f"{name}=0x{p:x}: not CUDA memory (host memory or a stray address); the layer "
                           f"reads device memory of cuda:{device_id}")
    if kind == _DEVICE and device != device_id:
        raise MoeCallError(f"{name}=0x{p:x}: device memory of cuda:{device}, the layer on cuda:{device_id}")


DEVICE_POINTERS_KEPT = 64  # pointers a layer remembers as checked device memory (a server reuses a few buffers)


def check_device_pointers(layer, named) -> None:
    """check_device_memory of each nonzero (name, pointer) the layer has not seen checked, then kept
    (layer._device_ptrs, the least recently used dropped past DEVICE_POINTERS_KEPT): every raw pointer
    of forward and forward_experts, so buffers a server cycles through are asked once."""
    seen = layer._device_ptrs
    for name, p in named:
        if not p:
            continue
        if p in seen:
            seen.move_to_end(p)  # least recently used goes first
        else:
            check_device_memory(name, p, layer.device_id)
            note_device_pointers(layer, p)


def note_device_pointers(layer, *ptrs: int) -> None:
    """Keep pointers whose device was checked already (arrays.checked_ptr) so check_device_pointers skips them."""
    seen = layer._device_ptrs
    for p in ptrs:
        if p:
            seen[p] = None
            seen.move_to_end(p)
    while len(seen) > DEVICE_POINTERS_KEPT:
        seen.popitem(last=False)


def seed_checked_call(layer, input_ptr: int, num_tokens: int, output_ptr: int, token_ids_ptr: int) -> None:
    """check_call without the runtime's pointer query, kept as the last call's (so the forward that follows
    takes it from checked_call's cache): for arrays whose device arrays.checked_ptr has checked."""
    call = (input_ptr, num_tokens, output_ptr, token_ids_ptr)
    if call != layer._checked[0]:
        layer._checked = (call, check_call(layer, *call, device_memory=False))


def checked_call(layer, input_ptr, num_tokens, output_ptr, token_ids_ptr) -> tuple[int, int, int, int]:
    """check_call, skipped when the arguments are the last call's plain ints (kept in layer._checked)."""
    call = (input_ptr, num_tokens, output_ptr, token_ids_ptr)
    # compared only as plain ints: an array's == is no bool, and 16.0 == 16 must not pass as a pointer
    if (type(input_ptr) is int and type(num_tokens) is int and type(output_ptr) is int
            and type(token_ids_ptr) is int and call == layer._checked[0]):
        return layer._checked[1]
    checked = check_call(layer, input_ptr, num_tokens, output_ptr, token_ids_ptr)
    layer._checked = (call, checked)
    return checked


def check_stream(stream) -> int:
    """A cudaStream_t as an int (0, 1 and 2 are the legacy, per-thread default streams)."""
    if not is_integer(stream) or not 0 <= stream < _MAX_PTR:
        raise MoeCallError(f"stream={stream!r}: a cudaStream_t as an int is required")
    return int(stream)


def check_path(path) -> None:
    """Refuse a path that is not one of PATH_NAMES (or None: the layer's default)."""
    if path is not None and (not isinstance(path, str) or path not in PATH_NAMES):
        raise PathUnavailableError(f"path={path!r}: must be one of {PATH_NAMES} or None")
