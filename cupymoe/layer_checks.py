"""The checks a MoeLayer makes before anything reaches the GPU: its options at construction
(sizes the kernels' counts and grids can serve, shared memory the GPU opts in to) and each
forward's arguments (pointers, row counts, overlap), every refusal a named error with the value."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .config import MoeConfig, kernel_limits_violations
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
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        current = cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise CudaUnavailableError(f"no usable CUDA device: {e}") from None
    dev = current if device is None else int(device)
    if not 0 <= dev < count:
        raise CudaUnavailableError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return dev


def check_options(cfg: MoeConfig, max_tokens, path: str, row_invariant: bool) -> None:
    """Refuse what no layer could run, before anything is uploaded."""
    if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise OptionError(f"max_tokens={max_tokens!r}: must be a positive integer")
    if path not in PATH_NAMES:
        raise OptionError(f"path={path!r}: must be one of {PATH_NAMES}")
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


def pointer(name: str, p, align: int) -> int:
    if type(p) is not int and (not isinstance(p, np.integer) or isinstance(p, bool)):
        raise MoeCallError(f"{name}={p!r}: a device pointer (int) is required")
    if not 0 < p < _MAX_PTR:
        raise MoeCallError(f"{name}={p!r}: not a device address (must be in 1..2^64-1)")
    if p % align:
        raise MoeCallError(f"{name}=0x{int(p):x}: must be {align}-byte aligned")
    return int(p)


def check_rows_and_buffers(layer, input_ptr, num_tokens, output_ptr) -> tuple[int, int, int]:
    """The row count, input and output of a call (every entry's), refused by name: (N, input, output)."""
    if type(num_tokens) is not int and (not isinstance(num_tokens, np.integer) or isinstance(num_tokens, bool)):
        raise MoeCallError(f"num_tokens={num_tokens!r}: must be an int")
    n = int(num_tokens)
    if not 1 <= n <= layer.max_tokens:
        raise MoeCallError(f"num_tokens={n}: must be in 1..max_tokens={layer.max_tokens}")
    x = pointer("input_ptr", input_ptr, 16)  # the kernels read 16-byte vectors
    out = pointer("output_ptr", output_ptr, 16)
    nbytes = n * layer.cfg.hidden_size * 2
    if x < out + nbytes and out < x + nbytes:
        raise MoeCallError(f"output_ptr=0x{out:x} overlaps input_ptr=0x{x:x} ({nbytes} bytes each): blocks read "
                           "whole input rows while others write the output; give the output its own memory")
    return n, x, out


def check_call(layer, input_ptr, num_tokens, output_ptr, token_ids_ptr) -> tuple[int, int, int, int]:
    """Refuse a bad call before anything is launched; returns (N, input, output, token ids) as ints."""
    n, x, out = check_rows_and_buffers(layer, input_ptr, num_tokens, output_ptr)
    if token_ids_ptr:
        return n, x, out, pointer("token_ids_ptr", token_ids_ptr, 4)
    if layer.cfg.hash_routing:
        raise MoeCallError("hash routing (tid2eid) needs token_ids_ptr: a device pointer to num_tokens int32 ids")
    return n, x, out, 0
