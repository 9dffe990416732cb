"""LoRA adapters on the MoE layer: one layer's share of a PEFT adapter, as named records.

    lw = load_peft(adapter_dir, layer_idx, cfg)     # host side, no GPU
    y = reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=ids)

An adapter adds `scale * B @ (A @ x)` to a linear map `y = W x` of the block (A [r, in],
B [out, r]; scale = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`), as PEFT
defines it. The modules it may name are the hub names of docs/FORMATS.md: the router, each
routed expert's gate / up / down (mixtral's w1 / w3 / w2) and the shared expert's; adapters of
transformers 5's stacked expert parameters (PEFT's `target_parameters`) are split per expert by
cupymoe/lora_fused.py. What this module cannot serve (DoRA, vLLM's stacks, fan_in_fan_out,
biases, other tensor names under the layer's MLP prefix, a rank over the caller's maximum, bad
shapes or values) is a LoraError naming the key and the value; nothing is half loaded.
"""

from __future__ import annotations

import enum
import math
import numbers
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import ml_dtypes
import numpy as np

from .bounded_match import MatchError, first_matches
from .config import MoeConfig, is_finite_number, is_integer
from .errors import CheckpointError, LoraError
from .formats import BF16
from .lora_fused import (NEST, in_axis_by_version, in_axis_of, nested_pairs, peft_version, per_expert, stacked_params,
                         which_param)

__all__ = ["LoraTarget", "LoraKey", "LoraModule", "LoraWeights", "load_peft", "lora_scale", "random_lora",
           "round_robin_ids", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's saved names: this, then the base model's module name
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")
_MLP_PREFIXES = ("mlp.", "block_sparse_moe.")  # every family's MLP prefix, transformers 4 and 5
# the tensor dtypes read (safetensors' names): every one converts to float32 exactly
_FILE_FLOATS = ("BF16", "F16", "F32")


class LoraTarget(str, enum.Enum):
    """A linear map of the block an adapter may change."""

    ROUTER = "router"
    GATE = "gate"
    UP = "up"
    DOWN = "down"
    SHARED_GATE = "shared_gate"
    SHARED_UP = "shared_up"
    SHARED_DOWN = "shared_down"

    @property
    def per_expert(self) -> bool:
        return self in (LoraTarget.GATE, LoraTarget.UP, LoraTarget.DOWN)


@dataclass(frozen=True)
class LoraKey:
    """Which module: a target, and the routed expert's id for GATE / UP / DOWN (else None)."""

    target: LoraTarget
    expert: Optional[int] = None


@dataclass(frozen=True)
class LoraModule:
    """One module's delta: `scale * b @ (a @ x)`; a [rank, in] and b [out, rank] float32."""

    name: str  # the hub module name, e.g. model.layers.3.mlp.experts.7.gate_proj
    a: np.ndarray
    b: np.ndarray
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self, x: np.ndarray) -> np.ndarray:
        """The delta for rows `x` [n, in], in x's dtype (float64 in the reference)."""
        return (x @ self.a.astype(x.dtype).T) @ (self.b.astype(x.dtype).T * x.dtype.type(self.scale))


@dataclass(frozen=True)
class LoraWeights:
    """One MoE layer's share of an adapter: the modules it changes, by LoraKey."""

    modules: Mapping[LoraKey, LoraModule] = field(default_factory=dict)
    source: str = ""  # where it came from, for messages
    layer_idx: Optional[int] = None  # the decoder layer it was read for (load_peft), None: unsaid

    def get(self, target: LoraTarget, expert: Optional[int] = None) -> Optional[LoraModule]:
        return self.modules.get(LoraKey(LoraTarget(target), expert))

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def targets(self) -> frozenset:
        return frozenset(k.target for k in self.modules)

    def check(self, cfg: MoeConfig, max_rank: Optional[int] = None) -> "LoraWeights":
        """LoraError naming the first module whose key, shape, rank or values `cfg` cannot take."""
        if max_rank is not None and not is_integer(max_rank):
            raise LoraError(f"max_rank={max_rank!r}: must be a whole number or None")
        shapes = _in_out(cfg)
        for key, m in self.modules.items():
            if not isinstance(key, LoraKey) or not isinstance(key.target, LoraTarget) or not isinstance(m, LoraModule):
                raise LoraError(f"LoraWeights.modules[{key!r}]: expected LoraKey(LoraTarget, expert) -> LoraModule, "
                                f"found {type(key).__name__} -> {type(m).__name__}")
            _check_key(cfg, key, m.name)
            _check_module(m, *shapes[key.target], max_rank)
        return self


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    if not is_integer(rank) or rank < 1:
        raise LoraError(f"rank={rank!r}: must be a whole number >= 1")
    return float(alpha) / (math.sqrt(rank) if use_rslora else rank)


# ----------------------------------------------------------------------------------
# shapes and checks
# ----------------------------------------------------------------------------------

def _in_out(cfg: MoeConfig) -> dict[LoraTarget, tuple[int, int]]:
    """(in, out) of each target's map under cfg."""
    H, I, Is, R = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.router_width
    return {LoraTarget.ROUTER: (H, R), LoraTarget.GATE: (H, I), LoraTarget.UP: (H, I), LoraTarget.DOWN: (I, H),
            LoraTarget.SHARED_GATE: (H, Is), LoraTarget.SHARED_UP: (H, Is), LoraTarget.SHARED_DOWN: (Is, H)}


def _check_key(cfg: MoeConfig, key: LoraKey, name: str) -> None:
    if key.target.per_expert != (key.expert is not None):
        raise LoraError(f"{name}: LoraKey {key} must carry an expert id exactly when its target is per expert")
    if key.expert is not None and not is_integer(key.expert):  # 0.5 matched no expert's slot, True read as 1
        raise LoraError(f"{name}: expert {key.expert!r} is no expert id (an int)")
    if key.expert is not None and not 0 <= key.expert < cfg.num_experts:
        raise LoraError(f"{name}: expert {key.expert} outside 0..{cfg.num_experts - 1}")
    if key.target.value.startswith("shared") and not cfg.has_shared_expert:
        raise LoraError(f"{name}: the layer ({cfg.model_type or 'this config'}) has no shared expert")


def _check_module(m: LoraModule, inn: int, out: int, max_rank: Optional[int]) -> None:
    """Shapes [r, in] / [out, r], the rank against `max_rank`, finite values and scale."""
    a, b = m.a, m.b
    for part, t in (("lora_A", a), ("lora_B", b)):
        real = isinstance(t, np.ndarray) and (t.dtype.kind == "f" or t.dtype.name == "bfloat16")
        if not real:  # complex or integer weights are no adapter's
            raise LoraError(f"{m.name}.{part}.weight: dtype {getattr(t, 'dtype', type(t).__name__)}: "
                            "must be a real floating-point array")
    if a.ndim != 2 or a.shape[1] != inn or a.shape[0] < 1:
        raise LoraError(f"{m.name}.lora_A.weight: expected shape [r, {inn}], found {list(a.shape)}")
    if b.ndim != 2 or b.shape != (out, a.shape[0]):
        raise LoraError(f"{m.name}.lora_B.weight: expected shape [{out}, {a.shape[0]}] (lora_A's rank), "
                        f"found {list(b.shape)}")
    if max_rank is not None and m.rank > max_rank:
        raise LoraError(f"{m.name}: rank {m.rank} exceeds the maximum rank {max_rank}")
    for part, t in (("lora_A", a), ("lora_B", b)):
        bad = np.flatnonzero(~np.isfinite(t))
        if bad.size:
            idx = np.unravel_index(int(bad[0]), t.shape)
            raise LoraError(f"{m.name}.{part}.weight: non-finite value {t[idx]} at {list(map(int, idx))}")
    if not isinstance(m.scale, numbers.Real) or isinstance(m.scale, (bool, np.bool_)):
        raise LoraError(f"{m.name}: scale {m.scale!r} is no real number")
    if not is_finite_number(m.scale) or abs(m.scale) > float(np.finfo(np.float32).max):
        raise LoraError(f"{m.name}: scale {m.scale} is not a finite float32 (the kernels' scale)")
    for part, t in (("lora_A", a), ("lora_B", b)):  # the slots hold bf16 (experts) or fp32 (router) copies
        big = np.float32(np.max(np.abs(t))) if t.size else np.float32(0)
        if np.isinf(big.astype(BF16)):
            raise LoraError(f"{m.name}.{part}.weight: |value| {float(big):g} rounds to inf in bfloat16 (largest "
                            f"{float(ml_dtypes.finfo(BF16).max):g}; the slots keep bf16 copies)")
    bs = float(np.max(np.abs(b))) * abs(float(m.scale)) if b.size else 0.0
    if bs > float(np.finfo(np.float32).max):  # the router's slot holds s B in float32
        raise LoraError(f"{m.name}: scale x |lora_B| reaches {bs:g}, past float32 (the router's slot holds s B)")


PATTERN_MATCH_S = 10.0  # the bound on matching one of an adapter's pattern maps against a layer's names
PEFT_PATTERN = r"(.*\.)?({})$"  # PEFT's get_pattern_key: re.match of this, the key formatted in


# ----------------------------------------------------------------------------------
# the adapter's config
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PeftConfig:
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    version: Optional[tuple] = None  # peft_version (lora_fused.peft_version): the stacked experts' orientation
    target_parameters: tuple[str, ...] = ()  # PEFT's `<module>.<parameter>` targets (ParamWrapper)

    def pattern_name(self, module: str) -> str:
        """The name PEFT matched rank_pattern / alpha_pattern on: `<module>.weight` where a target_parameters
        entry took the module's weight (a router that is no Linear), else the module's."""
        param = module + ".weight"
        return param if any(param == t or param.endswith("." + t) for t in self.target_parameters) else module

    # name -> (rank_pattern key, alpha_pattern key) PEFT takes for it (resolve); None: no key matched
    matched: Mapping[str, tuple[Optional[str], Optional[str]]] = field(default_factory=dict)

    def resolve(self, names: Iterable[str]) -> "_PeftConfig":
        """This config with each name's pattern keys found, by PEFT's rule (get_pattern_key): the first
        pattern, in the file's order, matching the name or a dotted suffix of it (a key equal to the name
        is one such). Keys are the file's regular expressions, matched in bounded time (bounded_match)."""
        names = sorted(set(names) - set(self.matched))
        found = {}
        for attr in ("rank_pattern", "alpha_pattern"):
            keys = list(getattr(self, attr))
            try:
                hits = first_matches(keys, names, PEFT_PATTERN, PATTERN_MATCH_S)
            except MatchError as e:
                raise LoraError(f"{ADAPTER_CONFIG}: {attr} {e.args[0]}: refused") from None
            found[attr] = [None if i is None else keys[i] for i in hits]
        return replace(self, matched={**self.matched, **{n: (found["rank_pattern"][j], found["alpha_pattern"][j])
                                                         for j, n in enumerate(names)}})

    def rank_alpha(self, module: str) -> tuple[int, float]:
        rk, ak = self.matched[module] if module in self.matched else self.resolve([module]).matched[module]
        r = self.rank_pattern[rk] if rk is not None else self.r
        return r, (self.alpha_pattern[ak] if ak is not None else self.alpha)


# (key, value that cannot be served, why): DoRA, transposed weights, biases
_REFUSED = (("use_dora", True, "DoRA (magnitude vectors) is not served"),
            ("fan_in_fan_out", True, "fan_in_fan_out (Conv1D-transposed weights) is not served"),
            ("lora_bias", True, "a bias on lora_B is not served"))
# (key, why): keys whose any non-empty value changes where or how the delta applies
_REFUSED_PRESENT = (
    ("alora_invocation_tokens", "activated LoRA (a delta only after the invocation tokens) is not served"),
    ("layer_replication", "replicated layers (a layer's adapter reused elsewhere) are not served"))


def _number(v: Any, key: str, what: type) -> Any:
    ok = is_finite_number(v)
    if not ok or (what is int and (v != int(v) or v < 1)):
        raise LoraError(f"{ADAPTER_CONFIG}: {key}={v!r} must be a {'positive integer' if what is int else 'number'}")
    return int(v) if what is int else float(v)


def _peft_config(raw: Mapping[str, Any]) -> _PeftConfig:
    """The keys that change the math, checked; the ones that would change it unservably refused."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{ADAPTER_CONFIG}: peft_type={raw['peft_type']!r}: only LORA adapters are served")
    for key, bad, why in _REFUSED:
        v = raw.get(key, False)
        if not isinstance(v, bool) and v is not None:  # "true" would pass an equality test and be served wrong
            raise LoraError(f"{ADAPTER_CONFIG}: {key}={v!r} must be true or false")
        if v == bad:
            raise LoraError(f"{ADAPTER_CONFIG}: {key}={bad!r}: {why}")
    for key, why in _REFUSED_PRESENT:
        if raw.get(key):
            raise LoraError(f"{ADAPTER_CONFIG}: {key}={raw[key]!r}: {why}")
    if raw.get("bias", "none") != "none":
        raise LoraError(f"{ADAPTER_CONFIG}: bias={raw['bias']!r}: only 'none' is served (no trained biases)")
    if not isinstance(raw.get("use_rslora", False), bool):
        raise LoraError(f"{ADAPTER_CONFIG}: use_rslora={raw['use_rslora']!r} must be true or false")
    patterns = {}
    for key, what in (("rank_pattern", int), ("alpha_pattern", float)):
        p = raw.get(key)
        p = {} if p is None else p  # "" or [] is no mapping, not an empty one
        if not isinstance(p, dict):
            raise LoraError(f"{ADAPTER_CONFIG}: {key}={p!r} must map module patterns to numbers")
        patterns[key] = {str(k): _number(v, f"{key}[{k!r}]", what) for k, v in p.items()}
        for k in patterns[key]:
            try:
                re.compile(PEFT_PATTERN.format(k))  # as resolve matches it (an inline flag fails only there)
            except (re.error, OverflowError, RecursionError) as e:  # PEFT matches each key as a regular expression
                raise LoraError(f"{ADAPTER_CONFIG}: {key}[{k!r}]: not a regular expression "
                                f"({type(e).__name__}: {str(e)[:120]})") from None
    targets = raw.get("target_parameters")
    targets = [] if targets is None else targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{ADAPTER_CONFIG}: target_parameters={targets!r} must be a list of parameter names")
    return _PeftConfig(r=_number(raw.get("r", 8), "r", int),
                       alpha=_number(raw.get("lora_alpha", 8), "lora_alpha", float),
                       use_rslora=raw.get("use_rslora", False), rank_pattern=patterns["rank_pattern"],
                       alpha_pattern=patterns["alpha_pattern"], version=peft_version(raw.get("peft_version")),
                       target_parameters=tuple(targets))


# ----------------------------------------------------------------------------------
# names
# ----------------------------------------------------------------------------------

_ROUTED = (LoraTarget.GATE, LoraTarget.UP, LoraTarget.DOWN)
_SHARED = (LoraTarget.SHARED_GATE, LoraTarget.SHARED_UP, LoraTarget.SHARED_DOWN)


def layer_keys(cfg: MoeConfig, *, experts: bool = True, shared: bool = True) -> list[LoraKey]:
    """The keys of the maps an adapter may change: the router, each routed expert's gate, up and
    down (`experts`), the shared expert's (`shared`, where the layer has one)."""
    keys = [LoraKey(LoraTarget.ROUTER)]
    if experts:
        keys += [LoraKey(t, e) for e in range(cfg.num_experts) for t in _ROUTED]
    if shared and cfg.has_shared_expert:
        keys += [LoraKey(t) for t in _SHARED]
    return keys


def module_names(cfg: MoeConfig, layer_idx: int) -> dict[str, LoraKey]:
    """Every hub module name of layer `layer_idx` an adapter may change -> its LoraKey."""
    from .checkpoint import layer_prefix, naming_for

    naming, prefix = naming_for(cfg.model_type), layer_prefix(cfg.model_type, layer_idx)

    def name(key: LoraKey) -> str:
        if key.target == LoraTarget.ROUTER:
            return prefix + naming.router
        if key.expert is not None:
            return prefix + naming.experts.format(e=key.expert) + naming.projections[_ROUTED.index(key.target)]
        return prefix + naming.shared + naming.projections[_SHARED.index(key.target)]

    # gpt-oss's fused expert parameters are no Linear modules
    keys = layer_keys(cfg, experts=not naming.fused_experts, shared=bool(naming.shared))
    return {name(k): k for k in keys}


def _why_unknown(module_key: str) -> str:
    """A hint for a tensor name under the MLP prefix this module cannot place."""
    if "lora_magnitude_vector" in module_key:
        return "a DoRA magnitude vector (DoRA is not served)"
    if module_key.endswith(".bias"):
        return "a LoRA bias (not served)"
    if re.search(r"\.lora_[AB]\.[^.]+\.weight$", module_key):
        return "an adapter-named key (save the adapter with PEFT's save_pretrained, which drops the name)"
    if re.search(r"\.experts\.(gate_up_proj|down_proj)\.", module_key):
        return ("an adapter named after a stacked expert parameter (PEFT saves target_parameters adapters as "
                "experts.lora_A.weight / lora_B.weight)")
    if ".w13" in module_key or ".w2_weight" in module_key:
        return ("vLLM's stacked expert layout (PEFT adapters of transformers' experts or of per-expert "
                "modules are served)")
    if "modules_to_save" in module_key or not re.search(r"\.lora_[AB]\.", module_key):
        return ("a whole weight of the module (PEFT's modules_to_save: a full replacement, not a low-rank "
                "delta; not served)")
    return "no module of this layer by that name (router, experts.{e}.<proj>, shared expert)"


# ----------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------

def load_peft(adapter_dir: Union[str, Path], layer_idx: int, cfg: MoeConfig, *,
              max_rank: Optional[int] = None) -> LoraWeights:
    """Layer `layer_idx`'s modules of a PEFT LoRA adapter directory (adapter_config.json and
    adapter_model.safetensors); tensors of other layers and of non-MoE modules are ignored,
    unknown names under this layer's MLP prefix refused. `max_rank` refuses larger ranks."""
    if not is_integer(layer_idx) or layer_idx < 0:
        raise LoraError(f"load_peft: layer_idx={layer_idx!r} must be a non-negative whole number (the decoder layer)")
    root = Path(adapter_dir)
    pc = _peft_config(raw_peft_config(root))
    weights = _weights_file(root)
    tensors, lora_keys = _read_layer_tensors(weights, PEFT_PREFIX + f"model.layers.{int(layer_idx)}.")
    if not tensors:  # none for this layer: fine where the adapter leaves it out, not where it nests elsewhere
        _check_layout(weights, lora_keys)
    modules = _assemble(cfg, layer_idx, tensors, pc)
    return LoraWeights(modules, source=f"{root} layer {layer_idx}", layer_idx=int(layer_idx)).check(cfg, max_rank)


def adapter_lora_keys(adapter_dir: Union[str, Path]) -> list[str]:
    """Every LoRA tensor name (`...lora_A.weight` / `lora_B.weight`) of the adapter's safetensors file."""
    from safetensors import safe_open

    weights = _weights_file(Path(adapter_dir))
    try:
        with safe_open(str(weights), framework="numpy") as f:
            return [k for k in f.keys() if _KEY.match(k)]
    except Exception as e:  # a corrupt file: safetensors' own errors name no file
        raise LoraError(f"{weights}: not a readable safetensors file ({e})") from None


def raw_peft_config(adapter_dir: Union[str, Path]) -> dict[str, Any]:
    """adapter_config.json as written (the checkpoint's JSON rules; LoraError when missing or unreadable)."""
    from .checkpoint import _read_json

    root = Path(adapter_dir)
    if not (root / ADAPTER_CONFIG).is_file():
        raise LoraError(f"{root / ADAPTER_CONFIG} not found: a PEFT adapter directory holds it")
    try:
        return _read_json(root, ADAPTER_CONFIG)
    except CheckpointError as e:  # the checkpoint's path-containment and JSON rules, named as a LoRA error
        raise LoraError(str(e)) from None


def _weights_file(root: Path) -> Path:
    """adapter_model.safetensors under `root` (the checkpoint's path-containment rule); LoraError when absent."""
    from .checkpoint import _inside

    try:
        weights = _inside(root, ADAPTER_WEIGHTS, str(root / ADAPTER_WEIGHTS))
    except CheckpointError as e:
        raise LoraError(str(e)) from None
    if not weights.is_file():
        raise LoraError(f"{root / ADAPTER_WEIGHTS} not found (only safetensors adapters are read, "
                        "not adapter_model.bin)")
    return weights


_LAYERS_LAYOUT = re.compile(re.escape(PEFT_PREFIX) + r"model\.layers\.\d+\.")
_ANY_LAYERS = re.compile(r"\.layers\.\d+\.")


def _check_layout(path: Path, lora_keys: list[str]) -> None:
    """A LoraError unless some decoder layer's LoRA tensor of the file (`lora_keys`) lies under PEFT's
    base_model.model.model.layers.<i>.: an adapter whose base model nests its layers elsewhere would give
    every layer an empty adapter."""
    nested = [k for k in lora_keys if _ANY_LAYERS.search(k)]  # adapters of lm_head or embeddings alone are fine
    if nested and not any(_LAYERS_LAYOUT.match(k) for k in nested):
        raise LoraError(f"{path}: no LoRA tensor lies under {PEFT_PREFIX}model.layers.<i>. (e.g. {nested[0]}): "
                        "the adapter's base model nests its decoder layers elsewhere, which is not read")


def _read_layer_tensors(path: Path, prefix: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """The MLP tensors under the layer's `prefix` (PEFT names, stripped of PEFT_PREFIX), as float32;
    both MLP spellings (`mlp.`, mixtral's `block_sparse_moe.`), so another layout is refused, not skipped;
    and the names of every LoRA tensor in the file."""
    from safetensors import safe_open

    out, lora_keys = {}, []
    try:
        with safe_open(str(path), framework="numpy") as f:
            lora_keys = [k for k in f.keys() if _KEY.match(k)]
            for key in f.keys():
                if not key.startswith(prefix) or not key[len(prefix):].startswith(_MLP_PREFIXES):
                    continue
                dtype = f.get_slice(key).get_dtype()  # before reading: numpy cannot hold some (fp8)
                if dtype not in _FILE_FLOATS:
                    raise LoraError(f"{key}: dtype {dtype} is not served (expected one of {_FILE_FLOATS})")
                out[key[len(PEFT_PREFIX):]] = f.get_tensor(key).astype(np.float32)
    except LoraError:
        raise
    except Exception as e:  # safetensors' own errors (a truncated or corrupt file) name no file
        raise LoraError(f"{path}: not a readable safetensors file ({e})") from None
    return out, lora_keys


def _layer_names(cfg: MoeConfig, layer_idx: int) -> dict[str, LoraKey]:
    """module_names, and the router and shared expert under transformers 5's `mlp.` where the hub's MLP
    prefix differs (mixtral's block_sparse_moe.): transformers 5 keeps no per-expert modules there."""
    from .checkpoint import layer_prefix
    from .hf_layouts import TRANSFORMERS_MLP

    names = module_names(cfg, layer_idx)
    hub, moved = layer_prefix(cfg.model_type, layer_idx), f"model.layers.{int(layer_idx)}.{TRANSFORMERS_MLP}"
    if hub != moved:
        names.update({moved + n[len(hub):]: k for n, k in list(names.items()) if k.expert is None})
    return names


def _experts_modules(cfg: MoeConfig, layer_idx: int) -> list[str]:
    """The module names PEFT's ParamWrapper on the stacked experts is saved under (both MLP spellings)."""
    from .checkpoint import layer_prefix
    from .hf_layouts import EXPERTS, TRANSFORMERS_MLP

    prefixes = {layer_prefix(cfg.model_type, layer_idx), f"model.layers.{int(layer_idx)}.{TRANSFORMERS_MLP}"}
    return sorted(p + EXPERTS.rstrip(".") for p in prefixes)


def _in_nesting(module: str, base: str) -> bool:
    """Whether `module` is `base` or one of PEFT's wrappers nested under it (base.base_layer...)."""
    return module.startswith(base) and re.fullmatch(rf"(\.{NEST})*", module[len(base):]) is not None


def _pair(module: str, p: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    missing = {"lora_A", "lora_B"} - set(p)
    if missing:
        raise LoraError(f"{PEFT_PREFIX}{module}.{missing.pop()}.weight is missing (its pair is present)")
    return p["lora_A"], p["lora_B"]


def _stacked(cfg: MoeConfig, layer_idx: int, parts: dict[str, dict[str, np.ndarray]],
             pc: _PeftConfig) -> dict[LoraKey, LoraModule]:
    """The per-expert modules of `target_parameters` adapters on the stacked experts (cupymoe/lora_fused.py);
    their entries leave `parts`."""
    modules: dict[LoraKey, LoraModule] = {}
    params = stacked_params(cfg)
    for base in _experts_modules(cfg, layer_idx):
        found: dict[str, tuple[str, np.ndarray, np.ndarray]] = {}  # parameter -> (module, lora_A, lora_B)
        for module, p in nested_pairs(parts, base, PEFT_PREFIX):
            a, b = _pair(module, p)
            name, where = which_param(cfg, a, b), f"{PEFT_PREFIX}{module}"
            if name is None:
                want = "; ".join(f"{q.name}: {q.input} and {q.output}" for q in params.values())
                raise LoraError(f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} fit no stacked expert "
                                f"parameter's in / out widths ({want})")
            if name in found:
                raise LoraError(f"{where}: a second adapter of {name} (the first under {PEFT_PREFIX}{found[name][0]})")
            found[name] = (module, a, b)
            del parts[module]
        # one PEFT rule for the module: a non-square parameter's axis decides a square one's
        axes = {in_axis_of(params[n], a) for n, (_, a, _) in found.items()} - {None}
        if len(axes) > 1:
            raise LoraError(f"{PEFT_PREFIX}{base}: its stacked parameters' adapters disagree on PEFT's in / out "
                            "orientation")
        for name, (module, a, b) in found.items():
            where, key = f"{PEFT_PREFIX}{module}", f"{base}.{name}"  # PEFT matches patterns on the unwrapped name
            axis = in_axis_of(params[name], a) or (next(iter(axes)) if axes else
                                                   in_axis_by_version(params[name], pc.version, where))
            r, alpha = pc.rank_alpha(key)
            scale = lora_scale(alpha, r, pc.use_rslora)
            for target, (shrink, expand) in per_expert(cfg, params[name], a, b, r, axis, where).items():
                if LoraKey(LoraTarget(target), 0) in modules:  # both MLP spellings (mixtral's) adapt it
                    raise LoraError(f"{where}: {name} is also adapted under "
                                    f"{modules[LoraKey(LoraTarget(target), 0)].name.rsplit('[', 1)[0]}")
                for e in range(cfg.num_experts):
                    modules[LoraKey(LoraTarget(target), e)] = LoraModule(
                        f"{key}[{e}].{target}", np.ascontiguousarray(shrink[e]), np.ascontiguousarray(expand[e]),
                        scale)
    return modules


def _assemble(cfg: MoeConfig, layer_idx: int, tensors: Mapping[str, np.ndarray],
              pc: _PeftConfig) -> dict[LoraKey, LoraModule]:
    """Pair each module's lora_A and lora_B, with its rank and alpha from the patterns; the stacked
    experts' (target_parameters) split per expert."""
    names = _layer_names(cfg, layer_idx)
    stacked = tuple(_experts_modules(cfg, layer_idx))
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, a in tensors.items():
        m = _KEY.match(key)
        module = m.group("module") if m else None
        if module is None or (module not in names and not any(_in_nesting(module, b) for b in stacked)):
            raise LoraError(f"{PEFT_PREFIX}{key}: {_why_unknown(key)}")
        parts.setdefault(module, {})[m.group("part")] = a
    pc = pc.resolve([pc.pattern_name(m) for m in parts] +
                    [f"{base}.{name}" for base in stacked for name in stacked_params(cfg)])
    from_stacked = _stacked(cfg, layer_idx, parts, pc)
    modules = {}
    for module, p in sorted(parts.items()):
        if module not in names:  # under the experts module's nesting, below a gap
            raise LoraError(f"{PEFT_PREFIX}{module}: {_why_unknown(module)}")
        a, _ = _pair(module, p)
        if a.ndim != 2:
            raise LoraError(f"{PEFT_PREFIX}{module}.lora_A.weight: expected 2 dimensions [r, in], "
                            f"found {list(a.shape)}")
        r, alpha = pc.rank_alpha(pc.pattern_name(module))
        if p["lora_A"].shape[0] != r:
            raise LoraError(f"{PEFT_PREFIX}{module}.lora_A.weight: {p['lora_A'].shape[0]} rows, but "
                            f"{ADAPTER_CONFIG} gives this module rank {r} (r / rank_pattern)")
        key = names[module]
        if key in from_stacked or key in modules:
            raise LoraError(f"{PEFT_PREFIX}{module}: {key.target.value} of expert {key.expert} is also adapted "
                            f"under {from_stacked[key].name if key in from_stacked else modules[key].name}")
        modules[key] = LoraModule(module, p["lora_A"], p["lora_B"], lora_scale(alpha, r, pc.use_rslora))
    return {**modules, **from_stacked}


# ----------------------------------------------------------------------------------
# random adapters (tests and `python -m cupymoe bench --lora`)
# ----------------------------------------------------------------------------------

def random_lora(cfg: MoeConfig, rng: np.random.Generator, rank: int = 4, *, layer_idx: int = 0,
                targets: Optional[Iterable[LoraTarget]] = None, experts: Optional[Iterable[int]] = None,
                alpha: float = 8.0, size: float = 1.0, zero_b: bool = False) -> LoraWeights:
    """An adapter of rank `rank` on `targets` (default every module the layer has; routed ones
    for `experts`, default all) whose deltas are ~`size` times the base map's output scale (std
    1/sqrt(in) for A, 1/sqrt(r) for B before the scale alpha / r), A and B bf16-representable
    so every storage keeps them exactly."""
    from .formats import BF16

    want = set(LoraTarget) if targets is None else {LoraTarget(t) for t in targets}
    chosen = None if experts is None else set(experts)
    shapes, s = _in_out(cfg), lora_scale(alpha, rank, False)
    bf16_exact = lambda a: a.astype(np.float32).astype(BF16).astype(np.float32)  # noqa: E731
    modules = {}
    for name, key in _names_or_keys(cfg, layer_idx).items():
        if key.target not in want or (key.expert is not None and chosen is not None and key.expert not in chosen):
            continue
        inn, out = shapes[key.target]
        a = bf16_exact(rng.standard_normal((rank, inn)) * inn ** -0.5)
        b = rng.standard_normal((out, rank)) * size / (s * rank ** 0.5)
        b = np.zeros((out, rank), np.float32) if zero_b else bf16_exact(b)
        modules[key] = LoraModule(name, a, b, s)
    return LoraWeights(modules, source="random_lora")


def _names_or_keys(cfg: MoeConfig, layer_idx: int) -> dict[str, LoraKey]:
    """module_names, or for a config of no hub family (a bench preset) each module's key as its name."""
    from .checkpoint import NAMING

    if cfg.model_type in NAMING:
        return module_names(cfg, layer_idx)
    return {k.target.value + ("" if k.expert is None else f".{k.expert}"): k for k in layer_keys(cfg)}


def round_robin_ids(n: int, k: int) -> np.ndarray:
    """[n] int32 adapter slots spread over the rows: row i takes slot i mod k (k = 0: all -1)."""
    if not (is_integer(n) and n >= 0 and is_integer(k) and k >= 0):
        raise LoraError(f"round_robin_ids(n={n!r}, k={k!r}): whole numbers >= 0 are required")
    return (np.arange(n, dtype=np.int32) % k) if k > 0 else np.full(n, -1, np.int32)
