"""Torch tensors and CuPy arrays as what a forward takes: a device address, a shape, a dtype.

The convenience entry points (`MoeLayer.__call__`, the torch module) accept either; every
property a kernel relies on is checked here before anything is launched: the device, the
dtype, contiguity, the shape. bf16 travels as torch.bfloat16 or as CuPy uint16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import MoeCallError

BF16_BITS = ("bfloat16", "uint16")  # torch's bf16, CuPy's uint16 bf16 bits


@dataclass(frozen=True)
class DeviceArray:
    ptr: int
    shape: tuple[int, ...]
    dtype: str  # torch's or numpy's dtype name, e.g. "bfloat16", "uint16", "int32"
    device: Optional[int]  # the CUDA device index; None on the host
    contiguous: bool
    framework: str  # "torch" or "cupy"

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        where = "the host" if self.device is None else f"cuda:{self.device}"
        return f"{self.framework} {self.dtype} {list(self.shape)} on {where}{'' if self.contiguous else ' (strided)'}"


def is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


def view(obj: Any, what: str) -> DeviceArray:
    """The DeviceArray of a torch tensor or CuPy array (anything else is refused by name)."""
    try:
        if is_torch(obj):
            dev = obj.device
            return DeviceArray(int(obj.data_ptr()), tuple(obj.shape), str(obj.dtype).replace("torch.", ""),
                               dev.index if dev.type == "cuda" else None, bool(obj.is_contiguous()), "torch")
        if type(obj).__module__.startswith("cupy"):
            return DeviceArray(int(obj.data.ptr), tuple(obj.shape), str(obj.dtype), int(obj.device.id),
                               bool(obj.flags.c_contiguous), "cupy")
    except (AttributeError, RuntimeError) as e:  # torch.nn.Module, a CuPy stream, a sparse tensor: no dense array
        raise MoeCallError(f"{what}: expected a dense torch tensor or CuPy array, got {type(obj).__name__} "
                           f"({type(e).__name__}: {e})") from None
    raise MoeCallError(f"{what}: expected a torch tensor or a CuPy array, got {type(obj).__name__}")


def accepted_dtypes(framework: str, dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """`dtypes` as an array of `framework` may carry them: uint16 stands for bf16 bits in CuPy alone
    (torch has bfloat16, and a torch uint16 tensor holds integers)."""
    if framework == "torch" and "bfloat16" in dtypes:
        return tuple(d for d in dtypes if d != "uint16")
    return dtypes


def check(a: DeviceArray, what: str, *, device: int, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> None:
    """Refuse `a` unless it is contiguous, on `device`, of one of `dtypes` (accepted_dtypes) and of `shape`."""
    dtypes = accepted_dtypes(a.framework, dtypes)
    want = f"a contiguous {' or '.join(dtypes)} array {list(shape)} on cuda:{device}"
    if a.device != device or a.dtype not in dtypes or a.shape != shape or not a.contiguous:
        raise MoeCallError(f"{what}: expected {want}, got {a.describe()}")


def checked_ptr(obj: Any, what: str, *, device: int, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """The device address of `obj` after `view` and `check` accept it."""
    a = view(obj, what)
    check(a, what, device=device, dtypes=dtypes, shape=shape)
    return a.ptr


def rows_of(x: DeviceArray, hidden_size: int, device: int) -> int:
    """The row count of a bf16 input [N, H], after checking it is one."""
    n = x.shape[0] if len(x.shape) == 2 else -1
    check(x, "x", device=device, dtypes=BF16_BITS, shape=(max(n, 0), hidden_size))
    if n == 0:
        raise MoeCallError(f"x: has no rows ({x.describe()})")
    return n


def empty_like(x: Any) -> Any:
    if is_torch(x):
        import torch

        return torch.empty_like(x)
    import cupy

    return cupy.empty_like(x)


def current_stream(x: Any) -> int:
    """The stream the framework of `x` would run on now, as a raw cudaStream_t."""
    if is_torch(x):
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)
