"""MoeConfig: every knob of the layer's math (DESIGN.md section 1), validated and frozen.

`MoeConfig.from_hf(config_dict, layer_idx)` owns the mapping from each model family's
Hugging Face `config.json` to these fields, in one place: key names differ per family
(`num_experts` / `n_routed_experts` / `num_local_experts`, `moe_intermediate_size` /
`intermediate_size` / `expert_ffn_hidden_size`, ...) and transformers 5 may write a
family's canonical key under an alias from its `attribute_map`, so every lookup below
accepts all the spellings a family's config class accepts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_oai")
WEIGHT_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")
SUPPORTED_MODEL_TYPES = (
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_next",
    "deepseek_v3",
    "mixtral",
    "gpt_oss",
    "longcat_flash",
)


# re-exported: callers catch them from here too
from .errors import ConfigError, DenseLayerError, MissingConfigKeyError, UnsupportedModelError  # noqa: F401


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"MoeConfig.{field}={value!r}: {why}")


@dataclass(frozen=True)
class MoeConfig:
    """One MoE layer. Field names follow the Hugging Face spellings where one exists."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int

    # --- routing -------------------------------------------------------------------
    scoring_func: str = "softmax"  # softmax | sigmoid | sqrtsoftplus
    norm_topk_prob: bool = False  # w /= sum(w) + 1e-20 over the k selected
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False  # e_score_correction_bias, selection only
    n_group: int = 1  # group-limited selection when > 1
    topk_group: int = 1
    topk_then_softmax: bool = False  # gpt-oss: top-k of logits, softmax over the k
    has_router_bias: bool = False  # added to the logits (gpt-oss router.bias)
    zero_expert_num: int = 0  # LongCat identity experts, ids E .. E+Z-1
    hash_routing: bool = False  # DeepSeek-V4 style static tid2eid table
    hash_vocab_size: int = 0  # rows of tid2eid

    # --- experts -------------------------------------------------------------------
    hidden_act: str = "silu"  # silu | gelu | gelu_tanh | swiglu_oai
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    has_expert_bias: bool = False  # gate/up/down biases (gpt-oss)

    # --- shared expert -------------------------------------------------------------
    shared_expert_intermediate_size: int = 0
    has_shared_expert_gate: bool = False  # scale = sigmoid(x . w_shared_gate)

    # --- pre-expert norm -----------------------------------------------------------
    pre_expert_norm: bool = False  # routed experts read rmsnorm(x) * w_norm
    rms_norm_eps: float = 1e-6

    # --- expert parallelism --------------------------------------------------------
    ep_world_size: int = 1
    ep_rank: int = 0

    # --- weights -------------------------------------------------------------------
    weight_format: str = "bf16"  # the routed experts' format in the checkpoint
    quant_exclude: tuple[str, ...] = ()  # module-name patterns kept unquantized
    model_type: str = ""

    def __post_init__(self) -> None:
        self._check_types()
        self._check_sizes_and_names()
        self._check_routing()
        self._check_experts()
        self._check_parallelism()
        object.__setattr__(self, "quant_exclude", tuple(self.quant_exclude))

    def _check_types(self) -> None:
        # types first: a float where a count belongs, a string where a flag does, or a NaN,
        # would pass the range checks below (or fail them with an error naming nothing)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise _bad(f.name, v, "must be an integer")
            if f.type in ("int", int) and abs(v) >= 2 ** 31:  # sizes and counts index with 32-bit integers
                raise _bad(f.name, v, "must be below 2**31 in magnitude")
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise _bad(f.name, v, "must be True or False")
            if f.type in ("float", float) and not is_finite_number(v):
                raise _bad(f.name, v, "must be a finite number")
            if f.type in ("str", str) and not isinstance(v, str):
                raise _bad(f.name, v, "must be a string")
        if isinstance(self.quant_exclude, str):
            raise _bad("quant_exclude", self.quant_exclude, "must be a sequence of module-name patterns, not one string")
        if not isinstance(self.quant_exclude, (list, tuple)) or not all(isinstance(p, str) for p in self.quant_exclude):
            raise _bad("quant_exclude", self.quant_exclude, "must be a list or tuple of module-name patterns (strings)")

    def _check_sizes_and_names(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            v = getattr(self, name)
            if v <= 0:  # an integer: _check_types
                raise _bad(name, v, "must be a positive integer")
        E, k = self.num_experts, self.num_experts_per_tok
        if self.zero_expert_num < 0:
            raise _bad("zero_expert_num", self.zero_expert_num, "must be >= 0")
        if k > E + self.zero_expert_num:
            raise _bad("num_experts_per_tok", k, f"k exceeds the router width E + Z = {E} + {self.zero_expert_num}")
        if self.scoring_func not in SCORING_FUNCS:
            raise _bad("scoring_func", self.scoring_func, f"must be one of {SCORING_FUNCS}")
        if self.hidden_act not in ACTIVATIONS:
            raise _bad("hidden_act", self.hidden_act, f"unknown activation; must be one of {ACTIVATIONS}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise _bad("weight_format", self.weight_format, f"must be one of {WEIGHT_FORMATS}")
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise _bad("routed_scaling_factor", self.routed_scaling_factor, "must be positive and finite")

    def _check_routing(self) -> None:
        E, k = self.num_experts, self.num_experts_per_tok
        if self.n_group < 1:
            raise _bad("n_group", self.n_group, "must be >= 1")
        if self.n_group > 1:
            if E % self.n_group:
                raise _bad("n_group", self.n_group, f"does not divide num_experts={E}")
            if not 1 <= self.topk_group <= self.n_group:
                raise _bad("topk_group", self.topk_group, f"must be in 1..n_group={self.n_group}")
            if E // self.n_group < 2:
                raise _bad("n_group", self.n_group, "groups need >= 2 experts (group score = sum of top-2)")
            if k > self.topk_group * (E // self.n_group):
                raise _bad("num_experts_per_tok", k, f"exceeds the experts in topk_group={self.topk_group} groups")
            if self.zero_expert_num:
                raise _bad("n_group", self.n_group, "group-limited routing with zero experts is not defined")
        if self.topk_then_softmax and (self.has_correction_bias or self.n_group > 1 or self.hash_routing):
            raise _bad("topk_then_softmax", True, "cannot combine with a correction bias, groups or hash routing")
        if self.topk_then_softmax and self.scoring_func != "softmax":
            raise _bad("scoring_func", self.scoring_func, "topk_then_softmax applies softmax over the k logits")
        if self.hash_routing:
            if self.hash_vocab_size <= 0:
                raise _bad("hash_vocab_size", self.hash_vocab_size, "hash routing needs the tid2eid table's row count")
            if self.n_group > 1:
                raise _bad("hash_routing", True, "the static table replaces group-limited selection")

    def _check_experts(self) -> None:
        for name in ("swiglu_alpha", "swiglu_limit"):
            if getattr(self, name) <= 0:
                raise _bad(name, getattr(self, name), "must be positive")
        if self.shared_expert_intermediate_size < 0:
            raise _bad("shared_expert_intermediate_size", self.shared_expert_intermediate_size, "must be >= 0")
        if self.has_shared_expert_gate and not self.shared_expert_intermediate_size:
            raise _bad("has_shared_expert_gate", True, "a shared-expert gate needs a shared expert")
        if not self.rms_norm_eps > 0:
            raise _bad("rms_norm_eps", self.rms_norm_eps, "must be > 0")

    def _check_parallelism(self) -> None:
        if self.ep_world_size < 1:
            raise _bad("ep_world_size", self.ep_world_size, "must be >= 1")
        if self.num_experts % self.ep_world_size:
            raise _bad("ep_world_size", self.ep_world_size, f"does not divide num_experts={self.num_experts}")
        if not 0 <= self.ep_rank < self.ep_world_size:
            raise _bad("ep_rank", self.ep_rank, f"must be in 0..{self.ep_world_size - 1}")

    # --- derived ---------------------------------------------------------------------
    @property
    def router_width(self) -> int:
        """R = E + Z: the router scores the zero (identity) experts too."""
        return self.num_experts + self.zero_expert_num

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_world_size

    def owned_experts(self) -> range:
        """The contiguous block of routed experts this EP rank computes."""
        n = self.experts_per_rank
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def replace(self, **changes: Any) -> "MoeConfig":
        return dataclasses.replace(self, **changes)

    # --- Hugging Face ---------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any], layer_idx: int | None = None, **overrides: Any) -> "MoeConfig":
        """Map a `config.json` dict of a supported family to a MoeConfig.

        `layer_idx`, when given, is checked against the family's dense-layer rules
        (DeepSeek's `first_k_dense_replace`, Qwen's `mlp_only_layers` and
        `decoder_sparse_step`): asking for a dense layer raises DenseLayerError.
        `overrides` set fields directly (e.g. `ep_world_size=2, ep_rank=1`).
        """
        return _from_hf(cls, config, layer_idx, overrides)


# ----------------------------------------------------------------------------------
# what the GPU kernels serve
# ----------------------------------------------------------------------------------

KERNEL_VECTOR_MULTIPLE = 8  # widths: the kernels read 16-byte vectors of bf16


def kernel_limits_violations(cfg: MoeConfig) -> list[str]:
    """Every reason MoeLayer refuses to build `cfg`, one sentence each naming the field, its
    value and the limit; empty when the GPU kernels serve it. Pure: for `inspect` and the layer."""
    from .catalog import MAX_GROUPS, MAX_ROUTER_WIDTH, MAX_TOPK

    out = []
    for name in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        v = getattr(cfg, name)
        if v % KERNEL_VECTOR_MULTIPLE:
            out.append(f"MoeConfig.{name}={v}: the kernels read 16-byte vectors, so it must be a multiple of "
                       f"{KERNEL_VECTOR_MULTIPLE}")
    if cfg.n_group > MAX_GROUPS:
        out.append(f"MoeConfig.n_group={cfg.n_group}: the top-k kernel handles at most {MAX_GROUPS} groups")
    if cfg.num_experts_per_tok > MAX_TOPK:
        out.append(f"MoeConfig.num_experts_per_tok={cfg.num_experts_per_tok}: the top-k kernel serves k <= "
                   f"{MAX_TOPK}")
    if cfg.router_width > MAX_ROUTER_WIDTH:
        out.append(f"router width R = num_experts + zero_expert_num = {cfg.router_width}: the top-k kernel serves "
                   f"R <= {MAX_ROUTER_WIDTH}")
    return out


# ----------------------------------------------------------------------------------
# Hugging Face mapping
# ----------------------------------------------------------------------------------

_MISSING = object()


def _key(cfg: Mapping[str, Any], *names: str) -> str:
    """The first spelling of a key that cfg sets (else the first name): what _get reads."""
    return next((n for n in names if cfg.get(n) is not None), names[0])


def _get(cfg: Mapping[str, Any], *names: str, default: Any = _MISSING) -> Any:
    """First present spelling of a key; the names are every alias transformers allows."""
    value = cfg.get(_key(cfg, *names))
    if value is not None:
        return value
    if default is _MISSING:
        mt = cfg.get("model_type", "?")
        raise MissingConfigKeyError(f"config.json of model_type={mt!r} lacks {' / '.join(names)}")
    return default


def _whole(value: Any, key: str, least: int | None = None) -> int:
    """A config.json count: an integer (or a float with no fraction), at least `least` where given,
    else an error naming the key."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    else:
        raise ConfigError(f"config.json {key}={value!r}: expected a whole number")
    if least is not None and n < least:
        raise ConfigError(f"config.json {key}={value!r}: must be at least {least}")
    return n


def _whole_or(cfg: Mapping[str, Any], key: str, absent: int, null: int, least: int) -> int:
    """A count whose absent key and explicit null each mean a value of their own (transformers'
    default; the modelling code's reading of None); any other value must be a whole number >= `least`
    (0, false or "" are not read as the default)."""
    if key not in cfg:
        return absent
    value = cfg[key]
    return null if value is None else _whole(value, key, least)


def _flag(value: Any, key: str) -> bool:
    """A config.json flag: JSON true / false only (a string "false" is not False)."""
    if isinstance(value, bool):
        return value
    raise ConfigError(f"config.json {key}={value!r}: expected true or false")


def _number(value: Any, key: str) -> float:
    if is_finite_number(value):
        return float(value)
    raise ConfigError(f"config.json {key}={value!r}: expected a finite number")


def _patterns(value: Any, key: str) -> tuple[str, ...]:
    """An exclude list: a list of module-name patterns (one string is one pattern)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise ConfigError(f"quantization_config.{key}={value!r}: expected a list of module-name patterns")


def _enum_value(v: Any) -> Any:
    """A string enum's value (a loaded model's config.to_dict() keeps transformers' QuantizationMethod.FP8)."""
    return v.value if isinstance(v, enum.Enum) else v


def _weight_format(cfg: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    q = cfg.get("quantization_config")
    if not q:
        return "bf16", ()
    if not isinstance(q, Mapping):
        raise ConfigError(f"quantization_config={q!r}: expected an object")
    method = str(_enum_value(q.get("quant_method", ""))).lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
            raise ConfigError(f"quantization_config.weight_block_size={block!r}: only [128, 128] fp8 blocks are supported")
        scheme = _enum_value(q.get("activation_scheme", "dynamic"))
        if scheme != "dynamic":  # a static scheme's input_scale would be left out: the activations are scaled per row
            raise ConfigError(f"quantization_config.activation_scheme={scheme!r}: block fp8 activations are quantized "
                              "dynamically (per row and 128 columns); a static input scale is not served")
        return "fp8_block", _patterns(q.get("modules_to_not_convert"), "modules_to_not_convert")
    if method == "modelopt":
        if q.get("quant_algo") is None:  # an export that quantizes only the KV cache: weights as stored
            return "bf16", ()
        algo = str(_enum_value(q.get("quant_algo"))).upper()
        if algo != "NVFP4":
            raise ConfigError(f"quantization_config.quant_algo={algo!r}: only NVFP4 ModelOpt checkpoints are supported")
        gs = q.get("group_size", 16)
        if gs != 16:
            raise ConfigError(f"quantization_config.group_size={gs!r}: NVFP4 uses groups of 16")
        key = "exclude_modules" if q.get("exclude_modules") else "ignore"
        return "nvfp4", _patterns(q.get(key), key)
    if method == "mxfp4":
        return "mxfp4", _patterns(q.get("modules_to_not_convert"), "modules_to_not_convert")
    raise ConfigError(f"quantization_config.quant_method={method!r}: supported are fp8, modelopt (NVFP4), mxfp4")


def layer_count(config: Mapping[str, Any]) -> int | None:
    """The layers a `config.json` dict numbers its MoE layers by (layer_idx runs below it),
    None where it gives none. LongCat counts blocks in num_layers (each holds two attention
    sub-layers and one MoE); its num_hidden_layers counts the sub-layers, twice as many."""
    keys = (("num_layers", "num_hidden_layers") if config.get("model_type") == "longcat_flash"
            else ("num_hidden_layers", "num_layers"))
    n_layers = _get(config, *keys, default=None)
    return None if n_layers is None else _whole(n_layers, _key(config, *keys))


def is_finite_number(v: Any) -> bool:
    """A real number (not a bool) that is finite as a float: an integer past float's range (a JSON
    literal of 400 digits) is not, where math.isfinite would raise OverflowError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def is_integer(v: Any) -> bool:
    """A Python or numpy integer, never a bool (True is no index, count or address). The exact-int
    test first: the per-call checks (row counts, addresses) take it on every forward."""
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _check_layer(model_type: str, cfg: Mapping[str, Any], layer_idx: int | None) -> None:
    if layer_idx is None:
        return
    if not is_integer(layer_idx):
        raise ConfigError(f"layer_idx={layer_idx!r}: must be a whole number (the decoder layer's index)")
    n_layers = layer_count(cfg)
    if layer_idx < 0:
        raise ConfigError(f"layer_idx={layer_idx}: a decoder layer's index is >= 0")
    if n_layers is not None and not 0 <= layer_idx < n_layers:
        raise ConfigError(f"layer_idx={layer_idx} is outside 0..{int(n_layers) - 1} for {model_type}")
    dense = False
    if model_type == "deepseek_v3":
        # absent: transformers' DeepseekV3Config default (3 dense layers first); null: none
        first = _whole_or(cfg, "first_k_dense_replace", absent=3, null=0, least=0)
        freq = _whole_or(cfg, "moe_layer_freq", absent=1, null=1, least=1)
        dense = layer_idx < first or layer_idx % freq != 0
    elif model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        mlp_only = cfg.get("mlp_only_layers")
        mlp_only = [] if mlp_only is None else mlp_only  # 0 or "" is no list of layers
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise ConfigError(f"config.json mlp_only_layers={mlp_only!r}: expected a list of layer indices")
        step = _whole_or(cfg, "decoder_sparse_step", absent=1, null=1, least=1)
        dense = layer_idx in mlp_only or (layer_idx + 1) % step != 0
    if dense:
        raise DenseLayerError(f"layer {layer_idx} of this {model_type} model is a dense MLP layer, not MoE")


class _HfReader:
    """Typed reads of one config.json dict, each key under every spelling its family accepts."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = config

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        return _get(self.config, *names, default=default)

    def count(self, *names: str, default: Any = _MISSING) -> int:
        """A count, under its first present spelling."""
        return _whole(self.get(*names, default=default), _key(self.config, *names))

    def flag(self, name: str, default: bool) -> bool:
        return _flag(self.get(name, default=default), name)

    def num(self, name: str, default: float) -> float:
        return _number(self.get(name, default=default), name)

    def act(self) -> str:
        return _act(self.get("hidden_act", default="silu"))


def _from_hf(cls, config: Mapping[str, Any], layer_idx: int | None, overrides: dict) -> MoeConfig:
    if not isinstance(config, Mapping):
        raise ConfigError(f"config: expected a config.json object (a mapping), found {type(config).__name__}")
    if unknown := sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)}):
        raise ConfigError(f"MoeConfig.from_hf overrides {unknown}: no such MoeConfig field")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_layer(model_type, config, layer_idx)
    fmt, exclude = _weight_format(config)
    r = _HfReader(config)
    kw: dict[str, Any] = dict(model_type=model_type, hidden_size=r.count("hidden_size"),
                              rms_norm_eps=r.num("rms_norm_eps", 1e-6), weight_format=fmt, quant_exclude=exclude)
    kw.update(_FAMILY_FIELDS[model_type](r))
    kw.update(overrides)
    return cls(**kw)


def _qwen_fields(r: _HfReader) -> dict[str, Any]:
    model_type = r.config.get("model_type")
    kw: dict[str, Any] = dict(
        num_experts=r.count("num_experts", "num_local_experts"),
        num_experts_per_tok=r.count("num_experts_per_tok"),
        moe_intermediate_size=r.count("moe_intermediate_size"),
        norm_topk_prob=r.flag("norm_topk_prob", model_type == "qwen3_next"),
        hidden_act=r.act(),
        scoring_func="softmax",
    )
    if model_type != "qwen3_moe":  # required: transformers' default for an absent key is not 0
        sh = r.count("shared_expert_intermediate_size")
        kw.update(shared_expert_intermediate_size=sh, has_shared_expert_gate=sh > 0)
    return kw


def _deepseek_fields(r: _HfReader) -> dict[str, Any]:
    E = r.count("n_routed_experts", "num_local_experts")
    I = r.count("moe_intermediate_size")
    # DeepSeek's MoEGate: noaux_tc selects by score + e_score_correction_bias within the
    # best groups; greedy takes the top k scores over all experts, no bias, no groups.
    # Anything else (group_limited_greedy's max-per-group scores, a misspelling) would be
    # routed as neither, so it is refused
    topk_method = r.get("topk_method", default="noaux_tc")
    if topk_method not in ("noaux_tc", "greedy"):
        raise ConfigError(f"config.json topk_method={topk_method!r}: supported are 'noaux_tc' and 'greedy'")
    greedy = topk_method == "greedy"
    return dict(
        num_experts=E,
        num_experts_per_tok=r.count("num_experts_per_tok"),
        moe_intermediate_size=I,
        scoring_func=str(r.get("scoring_func", default="sigmoid")),
        has_correction_bias=not greedy,
        # defaults are transformers' DeepseekV3Config's
        n_group=1 if greedy else _whole(r.get("n_group", default=8), "n_group", least=1),
        topk_group=1 if greedy else _whole(r.get("topk_group", default=4), "topk_group", least=1),
        norm_topk_prob=r.flag("norm_topk_prob", True),
        routed_scaling_factor=r.num("routed_scaling_factor", 2.5),
        # an explicit null means no shared expert (DeepSeek's modelling code)
        shared_expert_intermediate_size=I * _whole_or(r.config, "n_shared_experts", absent=1, null=0, least=0),
        hidden_act=r.act(),
    )


def _mixtral_fields(r: _HfReader) -> dict[str, Any]:
    return dict(
        num_experts=r.count("num_local_experts", "num_experts"),
        num_experts_per_tok=r.count("num_experts_per_tok"),
        moe_intermediate_size=r.count("intermediate_size"),
        norm_topk_prob=True,  # softmax over all, top-k, renormalise over the k
        hidden_act=r.act(),
    )


def _gpt_oss_fields(r: _HfReader) -> dict[str, Any]:
    return dict(
        num_experts=r.count("num_local_experts", "num_experts"),
        num_experts_per_tok=r.count("num_experts_per_tok", "experts_per_token"),
        moe_intermediate_size=r.count("intermediate_size"),
        topk_then_softmax=True,
        has_router_bias=True,
        has_expert_bias=True,
        hidden_act="swiglu_oai",
        # transformers from 5.18 reads both from the config (earlier ones fix 1.702 and 7.0)
        swiglu_alpha=r.num("swiglu_alpha", 1.702),
        swiglu_limit=r.num("swiglu_limit", 7.0),
    )


def _longcat_fields(r: _HfReader) -> dict[str, Any]:
    kw = dict(
        num_experts=r.count("n_routed_experts", "num_experts", "num_local_experts"),
        num_experts_per_tok=r.count("moe_topk", "num_experts_per_tok"),
        moe_intermediate_size=r.count("expert_ffn_hidden_size", "moe_intermediate_size"),
        # absent keys take transformers' LongcatFlashConfig defaults (256 zero experts, a
        # routed scaling of 6.0); an explicit null zero_expert_num means none, as its
        # modelling code reads it (`config.zero_expert_num or 0`)
        zero_expert_num=_whole_or(r.config, "zero_expert_num", absent=256, null=0, least=0),
        has_correction_bias=True,
        has_router_bias=r.flag("router_bias", False),  # router.classifier.bias
        norm_topk_prob=r.flag("norm_topk_prob", False),
        routed_scaling_factor=r.num("routed_scaling_factor", 6.0),
        hidden_act=r.act(),
    )
    ztype = r.config.get("zero_expert_type", "identity")
    if kw["zero_expert_num"] and ztype != "identity":
        raise ConfigError(f"zero_expert_type={ztype!r}: only identity zero experts are defined")
    return kw


# one per SUPPORTED_MODEL_TYPES entry: the fields beyond those every family shares
_FAMILY_FIELDS = {
    "qwen3_moe": _qwen_fields,
    "qwen2_moe": _qwen_fields,
    "qwen3_next": _qwen_fields,
    "deepseek_v3": _deepseek_fields,
    "mixtral": _mixtral_fields,
    "gpt_oss": _gpt_oss_fields,
    "longcat_flash": _longcat_fields,
}


def _act(name: str) -> str:
    name = str(name)
    aliases = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "swiglu_oai": "swiglu_oai"}
    if name not in aliases:
        raise ConfigError(f"hidden_act={name!r}: unknown activation; supported: {sorted(aliases)}")
    return aliases[name]
