"""One MoE layer of a Hugging Face checkpoint <-> HostWeights (safetensors, hub naming).

    cfg, hw = load_layer(checkpoint_dir, layer_idx)                    # files on disk
    cfg, hw = load_layer_from_tensors(config_dict, tensors, prefix)    # tensors already in memory
    save_layer(checkpoint_dir, config_dict, layer_idx, hw)             # the inverse (tests, tools)

How it is put together, and why:

* `NAMING` is the one table of where each family keeps a layer's tensors (FORMATS.md).
  Loading and saving both read it, so the two directions cannot drift apart.
* Tensors come from a *source*: safetensors files (`_FileSource`, opened lazily, reading only
  the tensors of the requested layer, since a real checkpoint is hundreds of GB) or a caller's
  mapping (`_MappingSource`: numpy / ml_dtypes arrays, torch tensors, CuPy arrays).
  `load_layer` is `load_layer_from_tensors` over a file source: one code path.
* Loading is *plan, then read*. The plan checks every name, shape and dtype against the
  config from the file headers alone; only then is any data read. A missing tensor of
  expert 255 fails in milliseconds rather than after gigabytes of reads, and the error
  names the tensor and the file(s) searched.
* The storage format is decided per tensor by what the source holds, not by the config:
  `X.weight_scale_inv` next to `X.weight` means DeepSeek block fp8, a uint8 `X.weight` means
  ModelOpt NVFP4, a float `X.weight` means unquantized. A bf16 shared expert next to fp8
  routed experts, or an fp8 router, load as what they are. The config's exclude list is
  used as a cross-check: `save_layer` refuses to write a quantized tensor for a module the
  config excludes, and loading one logs a warning.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path, PureWindowsPath
from typing import Any, Callable, Mapping, Optional, Union

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import MoeConfig, UnsupportedModelError, is_integer
from .formats import (
    BF16,
    E4M3,
    FP8_BLOCK,
    MXFP4_GROUP,
    NVFP4_GROUP,
    Fp8BlockWeight,
    Mxfp4Weight,
    Nvfp4Weight,
    check_e4m3_codes,
    check_e4m3_scales,
    check_e8m0_scales,
    check_finite,
    check_positive_scales,
    dequantize,
    weight_format,
)
from .host_weights import HostWeights

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MODELOPT_FILE = "hf_quant_config.json"  # older ModelOpt checkpoints keep their quantization here

# Stacks of at least this many experts log their progress (INFO, every ~25%).
PROGRESS_MIN_EXPERTS = 64

PathLike = Union[str, Path]
Reader = Callable[[], Any]


# ----------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------

from .errors import CheckpointError, CheckpointFileError, MissingTensorError  # noqa: F401 (re-exported)
from .errors import OptionError, WeightError


class CheckpointExistsError(CheckpointError, FileExistsError):
    """save_layer's directory already holds a checkpoint. Also a FileExistsError, for callers catching that."""


# ----------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------

U8 = np.dtype(np.uint8)
F32 = np.dtype(np.float32)
FLOAT_DTYPES = (BF16, np.dtype(np.float16), F32, np.dtype(np.float64))

# safetensors dtype string -> the numpy / ml_dtypes dtype it means.
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": F32, "F16": np.dtype(np.float16), "BF16": BF16,
    "F8_E4M3": E4M3, "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": U8,
    "BOOL": np.dtype(bool),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):  # ml_dtypes >= 0.5
    _ST_DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)

# safetensors' numpy framework (checked on 0.8.0) returns BF16 as ml_dtypes.bfloat16, but for
# the F8 dtypes it looks up `numpy.float8_e4m3fn`, which does not exist, and raises. Those
# tensors are read straight from the file's bytes (`_FileSource._read_raw`) instead.
_RAW_READ = frozenset(k for k in _ST_DTYPES if k.startswith("F8_"))

# torch dtypes numpy cannot hold: (same-width integer torch dtype to view through, numpy dtype).
_TORCH_VIEWS = {
    "bfloat16": ("int16", BF16),
    "float8_e4m3fn": ("uint8", E4M3),
    "float8_e5m2": ("uint8", np.dtype(ml_dtypes.float8_e5m2)),
}
if "F8_E8M0" in _ST_DTYPES:
    _TORCH_VIEWS["float8_e8m0fnu"] = ("uint8", _ST_DTYPES["F8_E8M0"])
# what an mxfp4 `_scales` tensor may be stored as
E8M0_DTYPES = (U8,) + ((_ST_DTYPES["F8_E8M0"],) if "F8_E8M0" in _ST_DTYPES else ())


# ----------------------------------------------------------------------------------
# the naming table
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HubNaming:
    """Where one family keeps one MoE layer's tensors, relative to the layer's MLP prefix.

    Module names (no `.weight`) for the linear layers, full tensor names for vectors. The
    MLP prefix is `model.layers.{i}.` + `mlp`.
    """

    mlp: str = "mlp."
    router: str = "gate"  # module: <router>.weight [R, H]
    router_bias: Optional[str] = None  # tensor [R], added to the logits
    correction_bias: Optional[str] = None  # tensor [R], e_score_correction_bias
    experts: str = "experts.{e}."  # per-expert module prefix; fused (gpt-oss): the fused prefix
    fused_experts: bool = False  # gpt-oss: gate_up_proj / down_proj hold all experts at once
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared: Optional[str] = None  # shared-expert module prefix (same projection names)
    shared_gate: Optional[str] = None  # module: <shared_gate>.weight [1, H]


_QWEN_SHARED = HubNaming(shared="shared_expert.", shared_gate="shared_expert_gate")

NAMING: dict[str, HubNaming] = {
    "qwen3_moe": HubNaming(),
    "qwen2_moe": _QWEN_SHARED,
    "qwen3_next": _QWEN_SHARED,
    "deepseek_v3": HubNaming(correction_bias="gate.e_score_correction_bias", shared="shared_experts."),
    "mixtral": HubNaming(mlp="block_sparse_moe.", projections=("w1", "w3", "w2")),
    "gpt_oss": HubNaming(router="router", router_bias="router.bias", experts="experts.", fused_experts=True),
    "longcat_flash": HubNaming(router="router.classifier", router_bias="router.classifier.bias",
                               correction_bias="router.e_score_correction_bias"),
}

# gpt-oss fused expert tensors, under HubNaming.experts (FORMATS.md).
_GATE_UP, _DOWN = "gate_up_proj", "down_proj"
_FIELDS = ("gate", "up", "down")
_SHARED_FIELDS = ("shared_gate", "shared_up", "shared_down")


def naming_for(model_type: str) -> HubNaming:
    if model_type not in NAMING:
        raise UnsupportedModelError(
            f"model_type={model_type!r} has no hub naming in cupymoe.checkpoint; known: {', '.join(NAMING)}")
    return NAMING[model_type]


def layer_prefix(model_type: str, layer_idx: int) -> str:
    """The MLP prefix of layer `layer_idx`, e.g. `model.layers.3.mlp.` (mixtral: `block_sparse_moe.`)."""
    return f"model.layers.{int(layer_idx)}.{naming_for(model_type).mlp}"


def is_excluded(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether `module` matches a quantization exclude pattern (fnmatch wildcards).

    A pattern naming a parent module (`model.layers.*.self_attn`) excludes its children too.
    """
    return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in patterns)


# ----------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------

class _Source:
    """Tensors by hub name: header facts (has, dtype, shape) without reading data, then read."""

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def dtype(self, name: str) -> np.dtype:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def where(self, name: str) -> str:
        """Where `name` lives, for error messages."""
        raise NotImplementedError

    def searched(self) -> str:
        """What a lookup searches, for missing-tensor messages."""
        raise NotImplementedError

    def names(self, prefix: str) -> list[str]:
        raise NotImplementedError


def _framework(t: Any) -> str:
    return type(t).__module__.split(".")[0]


def _foreign_dtype(t: Any) -> np.dtype:
    """The numpy dtype `t` converts to, without converting (a GPU tensor stays put)."""
    fw = _framework(t)
    if fw == "torch":
        name = str(t.dtype).replace("torch.", "")
        return _TORCH_VIEWS[name][1] if name in _TORCH_VIEWS else np.dtype(name)
    dt = np.dtype(t.dtype) if hasattr(t, "dtype") else np.asarray(t).dtype
    if fw == "cupy" and dt == np.uint16:
        return BF16  # CuPy has no bfloat16: bf16 travels as uint16 views (DESIGN.md section 5)
    return dt


def _on_cuda(t: Any) -> bool:
    """A torch CUDA tensor or a CuPy array: read on its device, never through the host."""
    fw = _framework(t)
    return fw == "cupy" or (fw == "torch" and t.device.type == "cuda")


def _to_device(t: Any) -> Any:
    """A CuPy view of a CUDA tensor (no copy): bf16 as uint16 bits, fp8 as uint8 bytes, as the
    containers of cupymoe.formats hold device arrays; a CuPy array as it is."""
    if _framework(t) == "cupy":
        return t
    import cupy
    import torch

    t = t.detach()
    name = str(t.dtype).replace("torch.", "")
    if name in _TORCH_VIEWS:  # DLPack has no such dtype: a same-width integer view
        t = t.view(getattr(torch, _TORCH_VIEWS[name][0]))
    a = cupy.from_dlpack(t)
    return a.view(cupy.uint16) if name == "bfloat16" else a


def contiguous(a: Any) -> Any:
    """A C-contiguous array, on the device for a CuPy one."""
    if _framework(a) == "cupy":
        import cupy

        return cupy.ascontiguousarray(a)
    return np.ascontiguousarray(a)


def _to_numpy(t: Any) -> np.ndarray:
    """numpy / ml_dtypes array from a numpy array, torch tensor or CuPy array."""
    fw = _framework(t)
    if fw == "torch":
        t = t.detach().cpu().contiguous()
        name = str(t.dtype).replace("torch.", "")
        if name in _TORCH_VIEWS:  # numpy has no such dtype: go through a same-width integer view
            int_name, np_dtype = _TORCH_VIEWS[name]
            return t.view(getattr(sys.modules["torch"], int_name)).numpy().view(np_dtype)
        return t.numpy()
    if fw == "cupy":
        a = t.get()
        return a.view(BF16) if a.dtype == np.uint16 else a
    return np.asarray(t)


class _MappingSource(_Source):
    def __init__(self, tensors: Mapping[str, Any]):
        self._t = tensors

    def has(self, name: str) -> bool:
        return name in self._t

    def _tensor(self, name: str) -> Any:
        """The mapping's tensor, refused by name where nothing here can read it: a torch tensor on the
        meta device (not loaded), of another layout than dense (sparse), or of a dtype numpy has no
        name for (quantized qint8, packed float4)."""
        t = self._t[name]
        if _framework(t) == "torch":
            if getattr(t, "is_meta", False):
                raise CheckpointError(f"{name} is on the meta device (offloaded or not loaded): load the "
                                      "weights onto the CPU or a GPU first")
            if str(getattr(t, "layout", "torch.strided")) != "torch.strided":
                raise CheckpointError(f"{name}: a {t.layout} tensor; give it dense (t.to_dense())")
            try:
                _foreign_dtype(t)
            except TypeError:
                raise CheckpointError(f"{name}: dtype {t.dtype} is not served (bf16, fp16, fp32, e4m3 or the "
                                      "formats' integer storage)") from None
        return t

    def dtype(self, name: str) -> np.dtype:
        return _foreign_dtype(self._tensor(name))

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._tensor(name)
        return tuple(int(d) for d in (t.shape if hasattr(t, "shape") else np.shape(t)))

    def read(self, name: str) -> Any:
        t = self._tensor(name)
        return _to_device(t) if _on_cuda(t) else _to_numpy(t)

    def where(self, name: str) -> str:
        return "the tensors mapping"

    def searched(self) -> str:
        return f"the tensors mapping ({len(self._t)} tensors)"

    def names(self, prefix: str) -> list[str]:
        return [k for k in self._t if isinstance(k, str) and k.startswith(prefix)]


class _FileSource(_Source):
    """`model.safetensors`, or the shards `model.safetensors.index.json` names; files open on first use.

    When both exist, model.safetensors wins (as in transformers).

    Handles are registered on `stack`, so they close when the caller's `with` block ends.
    """

    def __init__(self, root: Path, stack: ExitStack):
        self._root, self._stack = root, stack
        self._single: Optional[Path] = None
        self._index: Optional[Path] = None
        self._map: dict[str, str] = {}
        self._handles: dict[Path, Any] = {}
        self._keys: dict[Path, set[str]] = {}
        self._raw: dict[Path, tuple[Any, dict, int]] = {}  # file object, header, data offset
        self._real: dict[Path, Path] = {}  # each opened file's resolved path, checked to lie inside root
        if (root / SINGLE_FILE).is_file():
            self._single = root / SINGLE_FILE
        elif (root / INDEX_FILE).is_file():
            self._index = root / INDEX_FILE
            index = _read_json(root, INDEX_FILE)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self._index}: weight_map must map tensor names to file names, "
                                      f"found {'no weight_map' if weight_map is None else 'a ' + type(weight_map).__name__}")
            for name, file in weight_map.items():
                if not isinstance(file, str) or not file:
                    raise CheckpointError(f"{self._index}: weight_map maps {name!r} to {file!r}, not a file name")
            for file in set(weight_map.values()):
                _check_name(root, file, f"{self._index}: weight_map names shard {file!r}")
            self._map = weight_map
        else:
            raise CheckpointFileError(f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")

    def _file(self, name: str) -> Path:
        return self._single if self._single is not None else self._root / self._map[name]

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            rel = str(path.relative_to(self._root))
            real = _inside(self._root, rel, f"{self._index}: weight_map names shard {rel!r}" if self._index else str(path))
            try:
                is_file = real.is_file()
            except OSError as e:  # a name too long, a path through a file: no file by that name
                raise CheckpointFileError(f"{self._index} maps tensors to {rel!r}, which cannot be opened "
                                          f"({e.strerror})") from None
            if not is_file:
                why = "is no regular file" if real.exists() else "does not exist"  # a directory: '.', 'sub/'
                raise CheckpointFileError(f"{self._index} maps tensors to {rel!r}, but {path} {why}")
            logger.debug("opening %s", path)
            try:
                h = self._stack.enter_context(safe_open(str(real), framework="numpy"))
            except Exception as e:  # safetensors' own error (a truncated or corrupt file) names no file
                raise CheckpointFileError(f"{path}: not a readable safetensors file ({e})") from e
            self._handles[path] = h
            self._real[path] = real
            self._keys[path] = set(h.keys())
        return self._handles[path]

    def _slice(self, name: str) -> Any:
        path = self._file(name)
        h = self._handle(path)
        if name not in self._keys[path]:
            raise MissingTensorError(f"{self._index} maps tensor {name!r} to {path}, but that file does not hold it")
        return h.get_slice(name)

    def has(self, name: str) -> bool:
        if self._single is not None:
            self._handle(self._single)
            return name in self._keys[self._single]
        return name in self._map

    def dtype(self, name: str) -> np.dtype:
        st = self._slice(name).get_dtype()
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{name} in {self._file(name)}: dtype {st} is not supported")
        return _ST_DTYPES[st]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        path = self._file(name)
        st = self._slice(name).get_dtype()
        want = _ST_DTYPES[st]
        try:
            if st in _RAW_READ:
                return self._read_raw(path, name, want)
            a = self._handle(path).get_tensor(name)
        except MemoryError:  # a size the header claims and this machine cannot hold
            n = int(np.prod(self.shape(name), dtype=np.int64)) * want.itemsize
            raise CheckpointError(f"{name} in {path}: its {n} bytes do not fit in memory") from None
        if a.dtype != want:  # an older safetensors may hand out BF16 as raw 16-bit integers
            if a.dtype.itemsize != want.itemsize:
                raise CheckpointError(f"{name} in {path}: safetensors returned {a.dtype} for {st}")
            a = a.view(want)
        return a

    def _read_raw(self, path: Path, name: str, dtype: np.dtype) -> np.ndarray:
        """Read one tensor's bytes at its header offsets (safetensors: u64 header length, JSON header, data)."""
        if path not in self._raw:
            f = self._stack.enter_context(open(self._real[path], "rb"))
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:  # safe_open checked this file; it may have changed since
                raise CheckpointError(f"{path}: header length {n} exceeds the file's {size} bytes")
            self._raw[path] = (f, json.loads(f.read(n)), 8 + n)
        f, header, data_start = self._raw[path]
        entry = header[name]
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= os.fstat(f.fileno()).st_size - data_start:
            raise CheckpointError(f"{name} in {path}: data offsets {[begin, end]} lie outside the file")
        buf = bytearray(end - begin)
        f.seek(data_start + begin)
        got = f.readinto(buf)
        if got != len(buf):
            raise CheckpointError(f"{name} in {path}: file truncated ({got} of {len(buf)} bytes)")
        return np.frombuffer(buf, dtype=dtype).reshape(entry["shape"])

    def where(self, name: str) -> str:
        return str(self._file(name))

    def searched(self) -> str:
        if self._single is not None:
            return str(self._single)
        return f"{self._index} (weight_map of {len(self._map)} tensors)"

    def names(self, prefix: str) -> list[str]:
        if self._single is not None:
            self._handle(self._single)
            keys = self._keys[self._single]
        else:
            keys = self._map
        return [k for k in keys if k.startswith(prefix)]


# ----------------------------------------------------------------------------------
# planning: check names, shapes and dtypes from the headers, return readers
# ----------------------------------------------------------------------------------

@dataclass
class _Linear:
    """One nn.Linear weight as stored: its format and which tensor holds each part."""

    module: str
    fmt: str  # bf16 | fp8_block | nvfp4
    parts: dict[str, str]  # part -> tensor name
    dtype: np.dtype  # stored dtype of the main tensor


# Parts read as float32 (scales), and those that are scalars stored as [] or [1].
_F32_PARTS = ("scale_inv", "scale_2", "input_scale")
_SCALAR_PARTS = ("scale_2", "input_scale")
# What each part must hold (input_scale is only kept for W4A4 users: unchecked).
_VALUE_CHECKS = {"w": check_finite, "q": check_e4m3_codes, "scale_inv": check_positive_scales,
                 "scale": check_e4m3_scales, "scale_2": check_positive_scales}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _once(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Memoise a reader whose result feeds two fields (gpt-oss gate/up share one tensor)."""
    box: list = []

    def get() -> Any:
        if not box:
            box.append(fn())
        return box[0]

    return get


class _Planner:
    def __init__(self, src: _Source, exclude: tuple[str, ...]):
        self.src = src
        self.exclude = exclude
        self.used: set[str] = set()

    # --- header checks -----------------------------------------------------------
    def need(self, name: str) -> str:
        if not self.src.has(name):
            raise MissingTensorError(f"tensor {name!r} not found in {self.src.searched()}")
        self.used.add(name)
        return name

    def check_shape(self, name: str, want: tuple[int, ...], *alternatives: tuple[int, ...]) -> None:
        got = self.src.shape(name)
        if got != want and got not in alternatives:
            shown = " or ".join(str(s) for s in (want,) + alternatives)
            raise CheckpointError(f"{name}: expected shape {shown}, found {got} in {self.src.where(name)}")

    def check_dtype(self, name: str, allowed: tuple, what: str) -> np.dtype:
        dt = self.src.dtype(name)
        if dt not in allowed:
            raise CheckpointError(f"{name}: expected {what}, found dtype {dt} in {self.src.where(name)}")
        return dt

    # --- linear layers ------------------------------------------------------------
    def linear(self, module: str, out: int, inn: int) -> _Linear:
        """Inspect `module`'s tensors; the format is what the source holds (module docstring)."""
        w = self.need(module + ".weight")
        dt = self.src.dtype(w)
        if self.src.has(module + ".weight_scale_inv"):
            self.check_dtype(w, (E4M3, U8), "float8_e4m3fn (it has a weight_scale_inv: block fp8)")
            s = self.need(module + ".weight_scale_inv")
            self.check_shape(w, (out, inn))
            self.check_shape(s, (_ceil_div(out, FP8_BLOCK), _ceil_div(inn, FP8_BLOCK)))
            self.check_dtype(s, FLOAT_DTYPES, "a float scale")
            lin = _Linear(module, "fp8_block", {"q": w, "scale_inv": s}, dt)
        elif dt == U8:
            if inn % NVFP4_GROUP:
                raise CheckpointError(f"{w}: NVFP4 needs in % {NVFP4_GROUP} == 0, the config gives in={inn}")
            parts = {"packed": w, "scale": self.need(module + ".weight_scale"),
                     "scale_2": self.need(module + ".weight_scale_2")}
            if self.src.has(module + ".input_scale"):
                parts["input_scale"] = self.need(module + ".input_scale")
            self.check_shape(w, (out, inn // 2))
            self.check_shape(parts["scale"], (out, inn // NVFP4_GROUP))
            self.check_dtype(parts["scale"], (E4M3, U8), "float8_e4m3fn block scales")
            for p in _SCALAR_PARTS:
                if p in parts:
                    self.check_shape(parts[p], (), (1,))
                    self.check_dtype(parts[p], FLOAT_DTYPES, "a float scalar")
            lin = _Linear(module, "nvfp4", parts, dt)
        elif dt == E4M3:
            raise MissingTensorError(
                f"{w} is float8_e4m3fn but {module}.weight_scale_inv is not found in {self.src.searched()}: "
                "only block fp8 (DeepSeek-V3 style) is supported")
        else:
            self.check_dtype(w, FLOAT_DTYPES, "a float weight (bf16/f16/f32) or a quantized one")
            self.check_shape(w, (out, inn))
            scales = [module + p for p in (".weight_scale", ".weight_scale_2") if self.src.has(module + p)]
            if scales:  # served without it, the map would be off by that scale
                raise CheckpointError(f"{w} is {dt} but {', '.join(scales)} lies beside it in {self.src.where(w)}: "
                                      "a float weight with a scale is not a format cupymoe reads")
            lin = _Linear(module, "bf16", {"w": w}, dt)
        if lin.fmt != "bf16" and is_excluded(module, self.exclude):
            logger.warning("%s is stored %s although the quantization config excludes it; loading it as stored",
                           module, lin.fmt)
        return lin

    def read_parts(self, lin: _Linear, rows: Optional[int] = None) -> dict[str, np.ndarray]:
        """Read a linear's tensors into canonical dtypes (e4m3 views, float32 scales, scalar shapes);
        `rows`: only the first rows of each (a stack's), the ones checked and returned."""
        parts = {}
        for p, name in lin.parts.items():
            a = self.src.read(name)
            device = _framework(a) == "cupy"  # a CUDA tensor's view: bf16 as uint16, e4m3 as uint8 (formats)
            if rows is not None:
                a = a[:rows]
            if p in ("q", "scale") and a.dtype == U8 and not device:  # canonical dtypes: stacks never cast
                a = a.view(E4M3)
            if p in _F32_PARTS:
                a = a.astype(np.float32)
            if p in _SCALAR_PARTS:
                a = a.reshape(())
            if p == "w" and a.dtype not in ((np.dtype(np.uint16), F32) if device else (BF16, F32)):
                a = a.astype(np.float32)  # f16/f64 -> f32: exact for f16, HostWeights holds bf16 or f32
            if p in _VALUE_CHECKS:  # the values as they will be served, named by their hub tensor
                _VALUE_CHECKS[p](a, name)
            parts[p] = a
        return parts

    def single(self, module: str, out: int, inn: int) -> Reader:
        lin = self.linear(module, out, inn)
        return lambda: _assemble(lin.fmt, self.read_parts(lin))

    def stacked(self, modules: list[str], out: int, inn: int, label: str) -> Reader:
        """Experts' linears stacked [E, out, in]; all experts must share one storage format."""
        lins = [self.linear(m, out, inn) for m in modules]
        first = lins[0]
        for lin in lins[1:]:
            if (lin.fmt, lin.dtype, lin.parts.keys()) != (first.fmt, first.dtype, first.parts.keys()):
                raise CheckpointError(
                    f"{lin.module} is stored as {lin.fmt} ({lin.dtype}, parts {sorted(lin.parts)}) but "
                    f"{first.module} as {first.fmt} ({first.dtype}, parts {sorted(first.parts)}): "
                    "a layer's experts must share one format")

        def read() -> Any:
            n = len(lins)
            bufs: dict[str, np.ndarray] = {}
            for e, lin in enumerate(lins):
                for p, a in self.read_parts(lin).items():
                    if p not in bufs:  # allocate once (on the tensors' device): a real layer's stack is gigabytes
                        bufs[p] = _empty((n,) + a.shape, a.dtype, label, device=_framework(a) == "cupy")
                    bufs[p][e] = a
                if n >= PROGRESS_MIN_EXPERTS and ((e + 1) % max(1, n // 4) == 0 or e + 1 == n):
                    logger.info("%s: read %d/%d experts", label, e + 1, n)
            return _assemble(first.fmt, bufs)

        read.copies = True  # its device stacks are new arrays, not views of the caller's tensors
        return read

    # --- vectors ------------------------------------------------------------------
    def vector(self, name: str, shape: tuple[int, ...]) -> Reader:
        """A bias-like tensor, returned as float32 (bf16 -> f32 is exact)."""
        self.need(name)
        self.check_shape(name, shape)
        self.check_dtype(name, FLOAT_DTYPES, "a float tensor")
        return lambda: _finite(self.src.read(name).astype(np.float32), name)

    def gate_vector(self, module: str, hidden: int) -> Reader:
        """The shared-expert gate, a [1, H] linear, as a float32 [H] vector (dequantized if stored so)."""
        lin = self.linear(module, 1, hidden)
        return lambda: _finite(dequantize(_assemble(lin.fmt, _on_host(self.read_parts(lin))), np.float32)
                               .reshape(hidden), module + ".weight")


def _empty(shape: tuple[int, ...], dtype: np.dtype, what: str, device: bool = False) -> Any:
    if device:
        import cupy

        return cupy.empty(shape, dtype=dtype)
    try:
        return np.empty(shape, dtype=dtype)
    except MemoryError:  # sizes the headers claim and this machine cannot hold
        raise CheckpointError(f"{what}: a stack of shape {shape} {dtype} does not fit in memory") from None


def _holds_device(v: Any) -> bool:
    """A CuPy array, or a quantized container holding one."""
    return _framework(v) == "cupy" or any(_framework(a) == "cupy" for a in getattr(v, "__dict__", {}).values())


def _on_host(parts: dict[str, Any]) -> dict[str, np.ndarray]:
    """A small linear's parts as host arrays of the canonical dtypes (a CUDA tensor's view holds
    bf16 as uint16 and e4m3 as uint8): [1, H] gates are dequantized on the host."""
    out = {}
    for p, a in parts.items():
        if _framework(a) == "cupy":
            a = _to_numpy(a)  # bf16 bits come back as bfloat16
            if p in ("q", "scale") and a.dtype == U8:
                a = a.view(E4M3)
        out[p] = a
    return out


def _finite(a: np.ndarray, name: str) -> np.ndarray:
    check_finite(a, name)
    return a


def _assemble(fmt: str, p: dict[str, np.ndarray]) -> Any:
    if fmt == "bf16":
        return p["w"]
    if fmt == "fp8_block":
        return Fp8BlockWeight(p["q"], p["scale_inv"])
    if fmt == "nvfp4":
        return Nvfp4Weight(p["packed"], p["scale"], p["scale_2"], p.get("input_scale"))
    raise AssertionError(f"unknown stored format {fmt!r}")


def _plan_fused_experts(P: _Planner, cfg: MoeConfig, base: str) -> dict[str, Reader]:
    """gpt-oss: all experts in one tensor per projection; gate and up interleaved (FORMATS.md).

    bf16:  gate_up_proj [E, H, 2I] (x @ W layout: gate = even columns, up = odd), down_proj [E, I, H];
           transposed here into the [out, in] orientation of HostWeights.
    mxfp4: gate_up_proj_blocks [E, 2I, H/32, 16] / _scales [E, 2I, H/32], already [out, in]:
           gate = even rows, up = odd rows; down_proj_blocks [E, H, I/32, 16] / _scales.
    Biases (both formats): gate_up_proj_bias [E, 2I] (even/odd as above), down_proj_bias [E, H].
    """
    gate_up, down = base + _GATE_UP, base + _DOWN
    pair = _once(_plan_fused_gate_up(P, cfg, gate_up))
    readers: dict[str, Reader] = {"gate": lambda: pair()[0], "up": lambda: pair()[1],
                                  "down": _plan_fused_down(P, cfg, down)}
    if cfg.has_expert_bias:
        read_gu_bias = P.vector(gate_up + "_bias", (cfg.num_experts, 2 * cfg.moe_intermediate_size))
        bias_pair = _once(lambda: tuple(contiguous(read_gu_bias()[:, k::2]) for k in (0, 1)))
        readers["gate_bias"] = lambda: bias_pair()[0]
        readers["up_bias"] = lambda: bias_pair()[1]
        readers["down_bias"] = P.vector(down + "_bias", (cfg.num_experts, cfg.hidden_size))
    return readers


def _plan_fused_gate_up(P: _Planner, cfg: MoeConfig, gate_up: str) -> Callable[[], tuple[Any, Any]]:
    """The reader of the fused gate_up tensor, giving (gate, up) stacks in [E, out, in]."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    src = P.src
    if _fused_is_mxfp4(P, gate_up):
        blocks, scales = _check_fused_mxfp4(P, gate_up, E, 2 * I, H)

        def read_gate_up() -> tuple[Any, Any]:
            b, s = src.read(blocks), _read_e8m0(src, scales)
            return tuple(Mxfp4Weight(contiguous(b[:, k::2]), contiguous(s[:, k::2]))
                         for k in (0, 1))
    else:
        name = _check_fused_float(P, gate_up, (E, H, 2 * I))

        def read_gate_up() -> tuple[Any, Any]:
            a = _fused_float(src.read(name), name)
            return tuple(contiguous(a[:, :, k::2].transpose(0, 2, 1)) for k in (0, 1))

    return read_gate_up


def _plan_fused_down(P: _Planner, cfg: MoeConfig, down: str) -> Reader:
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    src = P.src
    if _fused_is_mxfp4(P, down):
        blocks, scales = _check_fused_mxfp4(P, down, E, H, I)
        return lambda: Mxfp4Weight(src.read(blocks), _read_e8m0(src, scales))
    name = _check_fused_float(P, down, (E, I, H))
    return lambda: contiguous(_fused_float(src.read(name), name).transpose(0, 2, 1))


def _fused_is_mxfp4(P: _Planner, name: str) -> bool:
    # mxfp4 when its _blocks are there; a lone _scales is half an mxfp4 tensor (a partial
    # download, a renamed file), not a reason to look for the bf16 tensor instead
    if not P.src.has(name + "_blocks") and P.src.has(name + "_scales"):
        P.need(name + "_blocks")
    return P.src.has(name + "_blocks")


def _check_fused_mxfp4(P: _Planner, name: str, E: int, out: int, inn: int) -> tuple[str, str]:
    """Check a fused MXFP4 stack's _blocks and _scales headers; their names."""
    if inn % MXFP4_GROUP:
        raise CheckpointError(f"{name}_blocks: MXFP4 needs in % {MXFP4_GROUP} == 0, the config gives in={inn}")
    blocks, scales = P.need(name + "_blocks"), P.need(name + "_scales")
    P.check_shape(blocks, (E, out, inn // MXFP4_GROUP, MXFP4_GROUP // 2))
    P.check_shape(scales, (E, out, inn // MXFP4_GROUP))
    P.check_dtype(blocks, (U8,), "uint8 packed e2m1 codes")
    # uint8 or F8_E8M0: other 1-byte dtypes (I8, BOOL, the e4m3 / e5m2 floats) would be
    # read as biased exponents all the same, silently giving other weights
    P.check_dtype(scales, E8M0_DTYPES, "uint8 (or F8_E8M0) e8m0 exponents")
    return blocks, scales


def _check_fused_float(P: _Planner, name: str, shape: tuple[int, ...]) -> str:
    P.need(name)
    P.check_shape(name, shape)
    P.check_dtype(name, FLOAT_DTYPES, "a float weight")
    return name


def _fused_float(a: Any, name: str) -> Any:
    """A float stack as HostWeights holds it: bf16 (on the device: uint16 bits) or f32, finite."""
    keep = (np.dtype(np.uint16), F32) if _framework(a) == "cupy" else (BF16, F32)
    return _finite(a if a.dtype in keep else a.astype(np.float32), name)


def _read_e8m0(src: _Source, name: str) -> np.ndarray:
    s = src.read(name)
    check_e8m0_scales(s, name)
    return s


def _required(naming: HubNaming, attr: str, cfg: MoeConfig, why: str) -> str:
    value = getattr(naming, attr)
    if value is None:
        raise CheckpointError(f"the config asks for {why}, but {cfg.model_type} checkpoints have none "
                              f"(HubNaming.{attr} is unset)")
    return value


def _plan(cfg: MoeConfig, src: _Source, prefix: str) -> tuple[dict[str, Reader], set[str]]:
    naming = naming_for(cfg.model_type)
    E, H, I, R = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.router_width
    Is = cfg.shared_expert_intermediate_size
    if cfg.pre_expert_norm or cfg.hash_routing:
        raise CheckpointError(f"pre-expert norm / hash routing have no hub naming for {cfg.model_type}")
    P = _Planner(src, cfg.quant_exclude)
    readers: dict[str, Reader] = {"router": P.single(prefix + naming.router, R, H)}
    if cfg.has_router_bias:
        readers["router_bias"] = P.vector(prefix + _required(naming, "router_bias", cfg, "a router bias"), (R,))
    if cfg.has_correction_bias:
        name = prefix + _required(naming, "correction_bias", cfg, "a correction bias")
        readers["correction_bias"] = P.vector(name, (R,))

    from .hf_layouts import plan_stacked_experts  # imported here: it builds on this module

    stacked = plan_stacked_experts(P, cfg, prefix)  # transformers 5 / vLLM stacks; None: hub names
    if stacked is not None:
        readers.update(stacked)
    elif naming.fused_experts:
        readers.update(_plan_fused_experts(P, cfg, prefix + naming.experts))
    else:
        if cfg.has_expert_bias:
            raise CheckpointError(f"the config asks for expert biases, but {cfg.model_type} experts have none")
        # each expert has tensors of its own here: a larger count is refused before E names are made
        if E > (present := len(src.names(prefix))):
            raise CheckpointError(f"MoeConfig.num_experts={E} (from the config) exceeds the {present} tensors under "
                                  f"{prefix!r} in {src.searched()}: each expert needs its own; the config does not "
                                  "describe this checkpoint")
        for field, proj, (out, inn) in zip(_FIELDS, naming.projections, ((I, H), (I, H), (H, I))):
            modules = [prefix + naming.experts.format(e=e) + proj for e in range(E)]
            readers[field] = P.stacked(modules, out, inn, label=f"{prefix}{naming.experts.format(e='*')}{proj}")

    if cfg.has_shared_expert:
        shared = prefix + _required(naming, "shared", cfg, "a shared expert")
        for field, proj, (out, inn) in zip(_SHARED_FIELDS, naming.projections, ((Is, H), (Is, H), (H, Is))):
            readers[field] = P.single(shared + proj, out, inn)
    if cfg.has_shared_expert_gate:
        module = prefix + _required(naming, "shared_gate", cfg, "a shared-expert gate")
        readers["shared_expert_gate"] = P.gate_vector(module, H)
    return readers, P.used


def _routed_format(hw: HostWeights) -> Optional[str]:
    """The routed experts' single storage format, or None when gate/up/down differ."""
    fmts = {weight_format(hw.gate), weight_format(hw.up), weight_format(hw.down)}
    return fmts.pop() if len(fmts) == 1 else None


# names of tensors that are parts of an MoE layer (a shared expert and its gate, DeepSeek's routing bias)
_LAYER_PART_MARKERS = ("shared_expert", "e_score_correction_bias")


def _is_bias(name: str) -> bool:
    """A bias vector of a linear map (the router's, an expert's), by its hub name."""
    return name.endswith((".bias", "_bias"))


def _holds_values(src: "_Source", name: str) -> bool:
    """Whether a tensor the config leaves out would change the layer: transformers saves zero-width shared
    experts (n_shared_experts 0) and an all-zero correction bias under greedy routing, which change nothing;
    a bias of zeros adds nothing either."""
    if int(np.prod(src.shape(name))) == 0:
        return False
    if "e_score_correction_bias" not in name and not _is_bias(name):
        return True
    try:  # a GPU tensor of a mapping reads as a CuPy array: its values to the host first
        return bool(np.any(np.asarray(_to_numpy(src.read(name)), dtype=np.float32)))
    except (KeyError, TypeError, ValueError) as e:  # a dtype nothing here reads: it cannot be served either
        raise CheckpointError(f"{name}: a tensor of this layer that cannot be read ({e})") from None


def _load(cfg: MoeConfig, src: _Source, prefix: str) -> tuple[MoeConfig, HostWeights]:
    if not cfg.model_type:
        raise CheckpointError("MoeConfig.model_type is empty: it picks the hub naming; build the config "
                              "with MoeConfig.from_hf or set model_type")
    readers, used = _plan(cfg, src, prefix)
    unused = sorted(set(src.names(prefix)) - used)
    # a part of the layer the config leaves out (a bias too) would be served without it: refused, not ignored
    described = [n for n in unused if (any(m in n for m in _LAYER_PART_MARKERS) or _is_bias(n))
                 and _holds_values(src, n)]
    if described:
        raise CheckpointError(f"{len(described)} tensor(s) under {prefix!r} belong to a part of the {cfg.model_type} "
                              f"layer its config leaves out (a shared expert, the routing bias, a bias): "
                              f"{', '.join(described[:4])}{' ...' if len(described) > 4 else ''}; the config has "
                              f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}, "
                              f"has_correction_bias={cfg.has_correction_bias}")
    if unused:
        logger.warning("%d tensor(s) under %r are not part of the %s layer and were ignored: %s",
                       len(unused), prefix, cfg.model_type, ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else ""))
    logger.info("loading %s (%s, %d experts) from %s", prefix, cfg.model_type, cfg.num_experts, src.searched())
    # each tensor's values were checked as it was read, under its hub name (_VALUE_CHECKS)
    values = {field: read() for field, read in readers.items()}
    made = frozenset(f for f, read in readers.items() if getattr(read, "copies", False) and _holds_device(values[f]))
    hw = HostWeights(**values, made_on_device=made).validate(cfg, values=False)
    fmt = _routed_format(hw)
    if fmt is not None and fmt != cfg.weight_format:
        logger.warning("%s: the config says the routed experts are %s but the checkpoint holds %s; "
                       "the returned config says %s", prefix, cfg.weight_format, fmt, fmt)
        cfg = replace(cfg, weight_format=fmt)
    return cfg, hw


# ----------------------------------------------------------------------------------
# public loading API
# ----------------------------------------------------------------------------------

def _check_name(root: Path, name: str, what: str) -> None:
    """Refuse a file name read from the checkpoint (an index's shard) that is absolute or has
    a '..' component: a directory from the internet must not name files outside itself."""
    parts = re.split(r"[/\\]", name)
    if "\0" in name or name.startswith(("/", "\\")) or PureWindowsPath(name).drive or ".." in parts:
        raise CheckpointError(f"{what}: an absolute path or one with a '..' component is refused; "
                              f"the checkpoint's files must lie inside {root}")


def _allowed_dirs(real_root: str) -> tuple[str, ...]:
    """Where a checkpoint's files may resolve: its own directory, and for a Hugging Face hub
    cache snapshot (models--*/snapshots/<rev>, whose files link to ../../blobs) that repo's blobs."""
    snapshots = os.path.dirname(real_root)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return real_root, os.path.join(repo, "blobs")
    return (real_root,)


def _inside(root: Path, rel: Union[str, Path], what: str) -> Path:
    """`root / rel` resolved (symlinks followed); CheckpointError naming `what` when that lies
    outside the checkpoint directory (the hub cache's blobs aside, _allowed_dirs)."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, rel))
    if not any(real == d or os.path.commonpath([real, d]) == d for d in _allowed_dirs(real_root)):
        raise CheckpointError(f"{what} resolves to {real}, outside the checkpoint directory {real_root}: refused "
                              "(a checkpoint's files, symlinks followed, must lie inside it)")
    return Path(real)


def read_config(checkpoint_dir: PathLike) -> dict[str, Any]:
    """`config.json`, with an older ModelOpt `hf_quant_config.json` folded in as `quantization_config`.

    Older ModelOpt exports keep `{"quantization": {"quant_algo": "NVFP4", "exclude_modules": [...]}}`
    beside a config.json that has no quantization_config; MoeConfig.from_hf reads only the latter.
    """
    root = Path(checkpoint_dir)
    path = root / CONFIG_FILE
    if not path.is_file():
        raise CheckpointFileError(f"config.json not found: {path}")
    config = _read_json(root, CONFIG_FILE)
    modelopt = root / MODELOPT_FILE
    if not config.get("quantization_config") and modelopt.is_file():
        quant = _read_json(root, MODELOPT_FILE).get("quantization")
        if not isinstance(quant, dict):
            raise CheckpointError(f"{modelopt} has no 'quantization' section")
        config = {**config, "quantization_config": {"quant_method": "modelopt", **quant}}
    return config


def _read_json(root: Path, name: str) -> dict[str, Any]:
    """A JSON object from the checkpoint's file `name`; every way the file can be unreadable
    (not UTF-8, not JSON, nested past the parser's depth, too large) is a CheckpointError naming it."""
    path = root / name
    real = _inside(root, name, str(path))
    try:
        data = json.loads(real.read_bytes().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02X} at offset {e.start}); "
                              "expected a JSON file") from None
    except (ValueError, RecursionError, MemoryError) as e:  # JSONDecodeError, int digit limits: ValueErrors
        raise CheckpointError(f"{path}: invalid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_layer(checkpoint_dir: PathLike, layer_idx: int) -> tuple[MoeConfig, HostWeights]:
    """Read layer `layer_idx`'s MoE tensors from a Hugging Face checkpoint directory.

    Only that layer's tensors are read (the files open lazily and are closed on return).
    Raises DenseLayerError for a dense layer, UnsupportedModelError for an unknown family,
    CheckpointError (MissingTensorError / CheckpointFileError) naming the tensor or file.
    """
    root = Path(checkpoint_dir)
    cfg = MoeConfig.from_hf(read_config(root), layer_idx)
    from .hf_layouts import layer_prefix_in  # Mixtral's block may sit at transformers 5's `mlp.`

    with ExitStack() as stack:
        src = _FileSource(root, stack)
        return _load(cfg, src, layer_prefix_in(src, cfg.model_type, layer_idx))


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HUB_LAYER = re.compile(r"^model\.layers\.(0|[1-9][0-9]{0,8})\.")  # at most 9 digits: int() stays cheap


def layer_index_of(prefix: str) -> Optional[int]:
    """The decoder layer a hub prefix names (`model.layers.3.mlp.` -> 3), None where it names none."""
    m = _LAYER_RE.search(prefix)
    return int(m.group(1)) if m else None


def layer_indices(checkpoint_dir: PathLike) -> list[int]:
    """The layer indices the checkpoint's tensor names carry (`model.layers.<i>.`), sorted: the
    layers there are to inspect, bounded by the files rather than by config.json's count."""
    with ExitStack() as stack:
        names = _FileSource(Path(checkpoint_dir), stack).names("")
    return sorted({int(m.group(1)) for n in names if (m := _HUB_LAYER.match(n))})


def load_layer_from_tensors(cfg_or_config_dict: Union[MoeConfig, Mapping[str, Any]], tensors: Mapping[str, Any],
                            prefix: str) -> tuple[MoeConfig, HostWeights]:
    """The mapping form of load_layer, for callers that already hold the tensors.

    `tensors` maps hub names to numpy / ml_dtypes arrays, torch tensors (bf16 and fp8 are
    converted through same-width integer views) or CuPy arrays (uint16 means bf16 bits). CUDA
    tensors and CuPy arrays stay on their device (DLPack views, rearranged there where the layout
    asks): the layer then uses them where they lie or copies them on the device (cupymoe/weights.py).
    `prefix` is the layer's MLP prefix, e.g. `model.layers.3.mlp.`, or "" for names relative to
    the MLP module (its `state_dict()`'s). A config dict is mapped
    with MoeConfig.from_hf, checked against the layer index read from the prefix when it has one.
    """
    if prefix and not prefix.endswith("."):  # "" : names relative to the MLP module (its state_dict())
        prefix += "."
    if isinstance(cfg_or_config_dict, MoeConfig):
        cfg = cfg_or_config_dict
    else:
        cfg = MoeConfig.from_hf(cfg_or_config_dict, layer_index_of(prefix))
    return _load(cfg, _MappingSource(tensors), prefix)


# ----------------------------------------------------------------------------------
# saving (the inverse, same naming table)
# ----------------------------------------------------------------------------------

def _linear_tensors(module: str, w: Any) -> dict[str, np.ndarray]:
    """One linear's hub tensors (`module.weight` and its scales) for a single matrix."""
    fmt = weight_format(w)
    if fmt == "bf16":
        a = np.asarray(w)
        if a.dtype not in FLOAT_DTYPES:
            raise WeightError(f"{module}: a plain weight must be bf16 or float, found {a.dtype}")
        return {module + ".weight": np.ascontiguousarray(a)}
    if fmt == "fp8_block":
        return {module + ".weight": np.ascontiguousarray(w.q),
                module + ".weight_scale_inv": np.ascontiguousarray(w.scale_inv, dtype=np.float32)}
    if fmt == "nvfp4":
        out = {module + ".weight": np.ascontiguousarray(w.packed),
               module + ".weight_scale": np.ascontiguousarray(w.scale),
               module + ".weight_scale_2": np.asarray(w.scale_2, dtype=np.float32).reshape(())}
        if w.input_scale is not None:
            out[module + ".input_scale"] = np.asarray(w.input_scale, dtype=np.float32).reshape(())
        return out
    raise WeightError(f"{module}: {fmt} weights exist only in gpt-oss's fused expert tensors; "
                     "per-module checkpoints hold bf16, fp8_block or nvfp4")


def _vector_tensor(name: str, v: np.ndarray, shape: Optional[tuple[int, ...]] = None) -> dict[str, np.ndarray]:
    a = np.asarray(v)
    return {name: np.ascontiguousarray(a if shape is None else a.reshape(shape))}


def _interleave(even: np.ndarray, odd: np.ndarray, axis: int, what: str) -> np.ndarray:
    """Merge two arrays element-wise along `axis`: even -> 0, 2, 4 ...; odd -> 1, 3, 5 ..."""
    if even.dtype != odd.dtype or even.shape != odd.shape:
        raise WeightError(f"{what}: gate and up must share dtype and shape to interleave, found "
                         f"{even.dtype}{even.shape} and {odd.dtype}{odd.shape}")
    shape = list(even.shape)
    shape[axis] *= 2
    out = np.empty(shape, dtype=even.dtype)
    idx = [slice(None)] * even.ndim
    idx[axis] = slice(0, None, 2)
    out[tuple(idx)] = even
    idx[axis] = slice(1, None, 2)
    out[tuple(idx)] = odd
    return out


def _fused_expert_tensors(hw: HostWeights, base: str) -> dict[str, np.ndarray]:
    """gpt-oss's fused expert tensors; the inverse of `_plan_fused_experts` (layouts there)."""
    out: dict[str, np.ndarray] = {}
    gate_up, down = base + _GATE_UP, base + _DOWN
    fg, fu, fd = weight_format(hw.gate), weight_format(hw.up), weight_format(hw.down)
    if fg != fu:
        raise WeightError(f"{gate_up}: gpt-oss stores gate and up in one tensor, so they must share a format; "
                         f"found gate {fg}, up {fu}")
    if fg == "mxfp4":
        out[gate_up + "_blocks"] = _interleave(hw.gate.blocks, hw.up.blocks, 1, gate_up + "_blocks")
        out[gate_up + "_scales"] = _interleave(hw.gate.scales, hw.up.scales, 1, gate_up + "_scales")
    elif fg == "bf16":
        g, u = np.asarray(hw.gate).transpose(0, 2, 1), np.asarray(hw.up).transpose(0, 2, 1)
        out[gate_up] = _interleave(g, u, 2, gate_up)
    else:
        raise WeightError(f"{gate_up}: gpt-oss experts are stored bf16 or mxfp4, not {fg}")
    if fd == "mxfp4":
        out[down + "_blocks"] = np.ascontiguousarray(hw.down.blocks)
        out[down + "_scales"] = np.ascontiguousarray(hw.down.scales)
    elif fd == "bf16":
        out[down] = np.ascontiguousarray(np.asarray(hw.down).transpose(0, 2, 1))
    else:
        raise WeightError(f"{down}: gpt-oss experts are stored bf16 or mxfp4, not {fd}")
    if hw.gate_bias is not None:
        out[gate_up + "_bias"] = _interleave(np.asarray(hw.gate_bias), np.asarray(hw.up_bias), 1,
                                             gate_up + "_bias")
        out[down + "_bias"] = np.ascontiguousarray(hw.down_bias)
    return out


def _hub_tensors(cfg: MoeConfig, hw: HostWeights, prefix: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All of the layer's tensors under their hub names, and {module: format} of its linears."""
    naming = naming_for(cfg.model_type)
    tensors: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}

    def linear(module: str, w: Any) -> None:
        tensors.update(_linear_tensors(module, w))
        formats[module] = weight_format(w)

    linear(prefix + naming.router, hw.router)
    if hw.router_bias is not None:
        tensors.update(_vector_tensor(prefix + naming.router_bias, hw.router_bias))
    if hw.correction_bias is not None:
        tensors.update(_vector_tensor(prefix + naming.correction_bias, hw.correction_bias))
    if naming.fused_experts:
        tensors.update(_fused_expert_tensors(hw, prefix + naming.experts))
        formats[prefix + naming.experts.rstrip(".")] = _routed_format(hw) or "mixed"
    else:
        for e in range(cfg.num_experts):
            for field, proj in zip(_FIELDS, naming.projections):
                linear(prefix + naming.experts.format(e=e) + proj, getattr(hw, field)[e])
    if cfg.has_shared_expert:
        for field, proj in zip(_SHARED_FIELDS, naming.projections):
            linear(prefix + naming.shared + proj, getattr(hw, field))
    if hw.shared_expert_gate is not None:
        tensors.update(_vector_tensor(prefix + naming.shared_gate + ".weight", hw.shared_expert_gate,
                                      (1, cfg.hidden_size)))
        formats[prefix + naming.shared_gate] = "bf16"
    return tensors, formats


def _quantization_config(fmt: str, unquantized: list[str]) -> dict[str, Any]:
    """The quantization_config a real checkpoint of `fmt` carries (FORMATS.md)."""
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": unquantized}
    if fmt == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP,
                "exclude_modules": unquantized}
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": unquantized}
    raise OptionError(f"no quantization_config for format {fmt!r}")


def save_layer(checkpoint_dir: PathLike, config_dict: Mapping[str, Any], layer_idx: int, host_weights: HostWeights,
               *, shard_max_tensors: Optional[int] = None) -> Path:
    """Write one layer as a small Hugging Face checkpoint in the family's hub naming and formats.

    Writes config.json and model.safetensors, or, with `shard_max_tensors`, shards of at most
    that many tensors plus model.safetensors.index.json. Each tensor is written in the format
    and dtype HostWeights holds it (so load_layer gives it back bit-exact). When `config_dict`
    has no quantization_config and the routed experts are quantized, the one a real checkpoint
    of that format carries is added, listing the layer's unquantized linears as excluded.
    Refuses a directory that already holds a checkpoint, and a quantized tensor for a module
    the config excludes. Returns the directory.
    """
    root = Path(checkpoint_dir)
    if shard_max_tensors is not None and not (is_integer(shard_max_tensors) and shard_max_tensors >= 1):
        raise OptionError(f"shard_max_tensors={shard_max_tensors!r}: must be a whole number >= 1 (or None)")
    config = dict(config_dict)
    cfg = MoeConfig.from_hf(config, layer_idx)  # also refuses dense layers and unknown families
    host_weights.validate(cfg)
    prefix = layer_prefix(cfg.model_type, layer_idx)
    tensors, formats = _hub_tensors(cfg, host_weights, prefix)
    config = _config_to_save(config, layer_idx, cfg, host_weights, formats)
    _fresh_dir(root)
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    _save_tensors(root, tensors, shard_max_tensors)
    return root


def _config_to_save(config: dict[str, Any], layer_idx: int, cfg: MoeConfig, hw: HostWeights,
                    formats: dict[str, str]) -> dict[str, Any]:
    """`config` with the quantization_config the routed experts' format needs, checked against
    the linears' formats: no quantized module its exclude list names."""
    routed = _routed_format(hw)
    if routed is None:
        raise WeightError("the routed experts mix formats (gate/up/down: "
                         f"{[weight_format(getattr(hw, f)) for f in _FIELDS]}); "
                         "a checkpoint's quantization_config names one")
    if config.get("quantization_config"):
        if cfg.weight_format != routed:
            raise CheckpointError(f"config_dict's quantization_config means {cfg.weight_format} routed experts, "
                             f"but host_weights holds {routed}")
    elif routed != "bf16":
        config = {**config, "quantization_config": _quantization_config(
            routed, [m for m, f in formats.items() if f == "bf16"])}
        cfg = MoeConfig.from_hf(config, layer_idx)
    for module, fmt in formats.items():
        if fmt != "bf16" and is_excluded(module, cfg.quant_exclude):
            raise CheckpointError(f"{module} is {fmt} but the quantization config excludes it "
                             f"(patterns {list(cfg.quant_exclude)}): excluded modules stay bf16")
    return config


def _fresh_dir(root: Path) -> None:
    """Create `root`, refusing one that already holds a checkpoint."""
    root.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in root.iterdir() if p.name == CONFIG_FILE or p.suffix == ".safetensors"
                      or p.name == INDEX_FILE)
    if existing:
        raise CheckpointExistsError(f"save_layer writes a fresh checkpoint, but {root} already holds {existing}")


def _save_tensors(root: Path, tensors: dict[str, np.ndarray], shard_max_tensors: Optional[int]) -> None:
    """model.safetensors, or shards of at most `shard_max_tensors` tensors and their index."""
    metadata = {"format": "pt"}  # what transformers writes; some readers insist on it
    if shard_max_tensors is None:
        save_file(tensors, str(root / SINGLE_FILE), metadata=metadata)
        logger.debug("wrote %d tensors to %s", len(tensors), root / SINGLE_FILE)
        return
    names = list(tensors)
    step = int(shard_max_tensors)
    chunks = [names[i:i + step] for i in range(0, len(names), step)]
    weight_map: dict[str, str] = {}
    for i, chunk in enumerate(chunks):
        fname = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(root / fname), metadata=metadata)
        weight_map.update({n: fname for n in chunk})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    logger.debug("wrote %d tensors in %d shards to %s", len(tensors), len(chunks), root)
