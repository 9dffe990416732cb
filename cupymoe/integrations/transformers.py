"""A loaded transformers model's MoE blocks -> what `cupymoe.MoeLayer.from_hf` takes.

    for ref in moe_blocks(model):                       # every MoE block, in module order
        config_dict, tensors, prefix = block_tensors(model, ref)
        layer = cupymoe.MoeLayer.from_hf(config_dict, tensors, prefix, max_tokens=...)

`tensors` are the block's own parameters and buffers (`state_dict()`: torch tensors sharing the
model's memory, no copies), named as the model names them (`model.layers.3.mlp.gate.weight`):
transformers 5's stacked experts (`experts.gate_up_proj`) are read by `cupymoe.hf_layouts`, and
the prefix carries the layer index, so `MoeConfig.from_hf` checks the layer is an MoE one.
Needs torch and transformers only at call time (this module imports neither).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from ..config import SUPPORTED_MODEL_TYPES
from ..errors import CheckpointError, MoeCallError, OptionError, UnsupportedModelError

__all__ = ["MoeBlockRef", "BlockOutput", "BLOCK_OUTPUT", "moe_blocks", "block_tensors", "replace_moe_blocks",
           "replaced_blocks", "load_lora", "clear_lora", "set_lora_ids", "check_errors"]


@dataclass(frozen=True)
class MoeBlockRef:
    """One MoE block of a loaded model."""

    path: str  # module path, e.g. "model.layers.3.mlp" (model.get_submodule(path) is `module`)
    layer_idx: int  # the decoder layer it sits in (LongCat: the block index, as its num_layers counts)
    family: str  # the text config's model_type, one of config.SUPPORTED_MODEL_TYPES
    module: Any  # the torch.nn.Module


@dataclass(frozen=True)
class BlockOutput:
    """How a family's MoE block is called and what its `forward` returns (transformers 5.24)."""

    block_class: str  # the block's class in modeling_<family>.py
    returns_tuple: bool  # forward returns (hidden_states, extra) instead of hidden_states
    extra: Optional[str]  # what the tuple's second element is (the decoder layer discards it)
    router: str  # submodule whose forward's output[0] transformers records as `router_logits`


# Every block takes hidden_states [batch, seq, H] (after the post-attention norm) and returns the
# same shape and dtype; qwen / mixtral / gpt-oss unpack exactly three dims, deepseek / longcat any.
INPUT_SHAPE = "[batch, seq, hidden]"
BLOCK_OUTPUT: dict[str, BlockOutput] = {
    "qwen3_moe": BlockOutput("Qwen3MoeSparseMoeBlock", False, None, "gate"),
    "qwen2_moe": BlockOutput("Qwen2MoeSparseMoeBlock", False, None, "gate"),
    "qwen3_next": BlockOutput("Qwen3NextSparseMoeBlock", False, None, "gate"),
    "deepseek_v3": BlockOutput("DeepseekV3MoE", False, None, "gate"),
    "mixtral": BlockOutput("MixtralSparseMoeBlock", False, None, "gate"),
    # GptOssMLP.forward: (hidden [batch, seq, H], router_scores [batch * seq, k]: the softmax over
    # the top-k logits); GptOssDecoderLayer does `hidden_states, _ = self.mlp(hidden_states)`
    "gpt_oss": BlockOutput("GptOssMLP", True, "router_scores [batch * seq, k]", "router"),
    "longcat_flash": BlockOutput("LongcatFlashMoE", False, None, "router"),
}

# `<anything>.layers.<i>.<mlp>`: where a decoder layer keeps its MLP (mixtral before transformers 5:
# block_sparse_moe); a dense MLP (DeepSeek's first layers, Qwen's mlp_only_layers) has no experts.
_BLOCK_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)$")
# PEFT's LoRA wrappers in a module's state_dict: the wrapped layer under base_layer, the factors beside it
_PEFT_WRAPPED = re.compile(r"(?:^|\.)(?:base_layer|lora_A|lora_B|lora_magnitude_vector)\.")


def _text_config(model: Any) -> Any:
    """The config of the model's decoder (a multimodal wrapper keeps it as its text config)."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type={family!r} ({type(model).__name__}) is not supported; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def moe_blocks(model: Any) -> list[MoeBlockRef]:
    """Every MoE block of a loaded transformers model of a supported family, in module order.

    A block is a decoder layer's MLP module that holds routed experts (an `experts` child).
    Raises UnsupportedModelError for another family.
    """
    family = _text_config(model).model_type
    refs = []
    for path, module in model.named_modules():
        m = _BLOCK_PATH.search(path)
        if m and hasattr(module, "experts") and not getattr(module, "is_cupymoe_block", False):
            refs.append(MoeBlockRef(path, int(m.group(1)), family, module))
    return refs


def block_tensors(model: Any, ref: MoeBlockRef) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(config_dict, tensors, prefix) for `MoeLayer.from_hf` / `checkpoint.load_layer_from_tensors`.

    tensors: the block's state_dict (parameters and persistent buffers, e.g. the correction
    bias) under `prefix` = `ref.path + "."`: torch tensors sharing the model's memory. config_dict:
    the text config, with the constants the module holds in place of the config's (gpt-oss's
    swiglu alpha and limit, fixed by transformers before 5.18). Refuses
    a block whose weights are not materialised (offloaded to the meta device) or that carries PEFT
    LoRA wrappers (its base weights would load without the adapter), naming the tensor.
    """
    config_dict = _text_config(model).to_dict()
    prefix = ref.path + "."
    tensors: dict[str, Any] = {}
    for name, t in ref.module.state_dict().items():
        if _PEFT_WRAPPED.search(name):
            raise CheckpointError(f"{prefix}{name}: the block carries PEFT LoRA wrappers; merge them first "
                                  "(merge_and_unload()), or serve the adapter with cupymoe.lora.load_peft and "
                                  "MoeLayer.set_lora on the base model")
        if getattr(t, "is_meta", False):
            raise CheckpointError(f"{prefix}{name} is on the meta device (offloaded or not loaded): "
                                  "load the model's weights onto the CPU or a GPU first")
        tensors[prefix + name] = t
    config_dict.update(_module_constants(ref))
    return config_dict, tensors, prefix


# Constants a family's experts module holds as attributes, by the config key MoeConfig.from_hf reads:
# transformers before 5.18 fixes gpt-oss's at 1.702 and 7.0 whatever the config says
_MODULE_CONSTANTS = {"gpt_oss": {"swiglu_alpha": "alpha", "swiglu_limit": "limit"}}


def _module_constants(ref: MoeBlockRef) -> dict[str, float]:
    """The config keys the block's module overrides: what it computes, not what its config says."""
    experts = getattr(ref.module, "experts", None)
    return {key: float(getattr(experts, attr)) for key, attr in _MODULE_CONSTANTS.get(ref.family, {}).items()
            if isinstance(getattr(experts, attr, None), (int, float))}


def replace_moe_blocks(model: Any, *, max_tokens: int, **options: Any) -> int:
    """Replace every MoE block of `model` (its weights on a GPU) by a cupymoe layer; returns how many.

    Each block becomes a MoeBlock module: hidden_states [batch, seq, H] in (any float dtype; the
    layer computes in bf16), the same shape and dtype out, at most `max_tokens` rows a layer call;
    gpt-oss blocks return (hidden_states, None), whose second element its decoder layer discards.
    Every layer runs on one workspace (they run in turn on one stream). The replaced blocks'
    routers are not called, so `output_router_logits` records nothing for them. `options` go to
    MoeLayer (path, fp8_compute, ...)."""
    from ..errors import WorkspaceError
    from ..layer import MoeLayer
    from ..workspace import Workspace

    _check_replace_options(max_tokens, options, MoeLayer)
    done = replaced_blocks(model)
    if done:
        raise OptionError(f"replace_moe_blocks: {done[0][0]} (and {len(done) - 1} more) is already a cupymoe block; "
                          "load the model again to build its layers with other options")
    refs = moe_blocks(model)
    blocks = [block_tensors(model, ref) for ref in refs]  # (config dict, tensors, prefix) of each
    devices = [_cuda_index(ref, tensors) for ref, (_, tensors, _) in zip(refs, blocks)]
    given = options.pop("workspace", None)
    if given is not None and given.device_id not in devices:  # before any layer's weights are uploaded
        raise WorkspaceError(f"the workspace passed to replace_moe_blocks is on device {given.device_id}, the "
                             f"model's MoE blocks on {sorted(set(devices))}: it would serve none")
    shared: dict[int, Any] = {given.device_id: given} if given is not None else {}  # device -> its layers' workspace
    layers = []
    for ref, (config_dict, tensors, prefix), device in zip(refs, blocks, devices):

        def build(ws):
            return MoeLayer.from_hf(config_dict, tensors, prefix, max_tokens=max_tokens, device=device,
                                    workspace=ws, **options)

        try:
            layer = build(shared.get(device))
        except WorkspaceError as e:  # larger than the layers before it: its own for now, one for all below
            if given is not None and shared.get(device) is given:  # the caller's: never swapped for another
                raise WorkspaceError(f"the workspace passed to replace_moe_blocks (device {given.device_id}) "
                                     f"cannot serve {ref.path}: {e}") from e
            layer = build(None)
        shared.setdefault(device, layer.workspace)
        layers.append(layer)
    layers = _one_workspace(layers, Workspace)
    for ref, layer in zip(refs, layers):
        parent, _, name = ref.path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name,
                _block_module(layer, ref.family, ref.layer_idx))
    return len(refs)


def _check_replace_options(max_tokens: Any, options: dict, layer_type: Any) -> None:
    """Refuse, before any block is read, what no layer would take: a max_tokens that is no positive
    integer, an option MoeLayer does not know, and `device` (each layer goes on its block's GPU)."""
    import inspect

    from ..layer_checks import check_max_tokens

    check_max_tokens(max_tokens)
    if "device" in options:
        raise OptionError(f"replace_moe_blocks: device={options['device']!r}: each layer is built on the GPU its "
                          "block's weights are on; move the model there (model.to(...)) instead")
    accepted = set(inspect.signature(layer_type.__init__).parameters) - {"self", "cfg", "host_weights", "max_tokens"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise OptionError(f"replace_moe_blocks: unknown option {', '.join(unknown)}; MoeLayer takes "
                          f"{', '.join(sorted(accepted - {'device'}))}")


# --- LoRA on the replaced blocks ------------------------------------------------------------------

def replaced_blocks(model: Any) -> list[tuple[str, Any]]:
    """(module path, block) of every MoE block replace_moe_blocks put into `model`, in module order."""
    return [(path, m) for path, m in model.named_modules() if getattr(m, "is_cupymoe_block", False)]


def _blocks_or_refuse(model: Any, what: str) -> list[tuple[str, Any]]:
    from ..errors import LoraError

    blocks = replaced_blocks(model)
    if not blocks:
        raise LoraError(f"{what}: the model has no cupymoe block; call replace_moe_blocks(model, max_tokens=..., "
                        "max_loras=K, max_lora_rank=R) first")
    return blocks


def load_lora(model: Any, slot: int, adapter_dir: Any, *, stream: Optional[int] = None,
              moe_only: bool = False) -> int:
    """A PEFT adapter directory into `slot` of every replaced block (replace_moe_blocks(..., max_loras=K,
    max_lora_rank=R)): each block's share read by cupymoe.lora.load_peft and checked by every block
    before any block takes it, so a refusal (LoraError, naming the block) leaves every slot as it was.
    An adapter with LoRA tensors outside the replaced blocks (attention, a dense MLP) is refused, the
    model would run without them, unless `moe_only=True` (the caller serves the rest). Outside
    capture; `stream` as MoeLayer.set_lora's. Returns how many blocks took it."""
    from ..errors import LoraError
    from ..lora import PEFT_PREFIX, adapter_lora_keys, load_peft

    if not isinstance(moe_only, bool):  # "False" would skip the refusal below
        raise OptionError(f"load_lora: moe_only={moe_only!r}: must be True or False")
    blocks = _blocks_or_refuse(model, "load_lora")
    if not moe_only:
        inside = tuple(f"{PEFT_PREFIX}{path}." for path, _ in blocks)
        outside = [k for k in adapter_lora_keys(adapter_dir) if not k.startswith(inside)]
        if outside:
            raise LoraError(f"{adapter_dir}: {len(outside)} LoRA tensors lie outside the replaced MoE blocks "
                            f"(e.g. {outside[0]}), which the model would run without; serve those with PEFT and "
                            "pass moe_only=True")
    loaded = []
    for path, block in blocks:
        layer = block.layer
        try:
            lw = load_peft(adapter_dir, block.layer_idx, layer.cfg, max_rank=layer.max_lora_rank or None)
            layer.check_lora(slot, lw)
        except LoraError as e:
            raise LoraError(f"{path}: {e}") from None
        loaded.append((layer, lw))
    for layer, lw in loaded:
        layer.set_lora(slot, lw, stream)
    return len(loaded)


def clear_lora(model: Any, slot: int, *, stream: Optional[int] = None) -> int:
    """Empty `slot` in every replaced block; returns how many."""
    blocks = _blocks_or_refuse(model, "clear_lora")
    for _, block in blocks:
        block.layer.clear_lora(slot, stream)
    return len(blocks)


def set_lora_ids(model: Any, ids: Any) -> int:
    """The adapter slot of each row for the replaced blocks' forwards from now on (-1 = base model):
    an integer tensor on the model's GPU, [batch] (each sequence's rows share its slot) or one a row
    ([batch, seq] or [batch * seq]); None: no LoRA (the base plans' bits). Kept by reference, so a
    captured graph replays whatever it holds then (update it in place). Returns how many blocks."""
    import torch

    from ..torch import ID_DTYPE_NAMES, ID_DTYPES

    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES:
            raise MoeCallError(f"set_lora_ids: a torch integer tensor of dtype {', '.join(ID_DTYPE_NAMES)} or None "
                               f"is required, found {getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() == 0:
            raise MoeCallError("set_lora_ids: a 0-d tensor; give one slot a sequence ([batch]) or a row")
    blocks = _blocks_or_refuse(model, "set_lora_ids")
    for _, block in blocks:
        block.lora_ids = ids
    return len(blocks)


def check_errors(model: Any) -> int:
    """Raise what a replaced block's kernels flagged (a LoRA slot, token or expert id out of range: its
    rows got the base layer or no expert; NaN router logits or weights), one MoeCallError naming the
    block; synchronises the blocks' devices, so call it outside capture (after a batch, in tests, at a
    debugging point). Returns how many blocks were checked."""
    blocks = _blocks_or_refuse(model, "check_errors")
    for path, block in blocks:
        try:
            block.layer.check_errors()
        except MoeCallError as e:
            raise MoeCallError(f"{path}: {e}") from None
    return len(blocks)


def _row_ids(ids: Any, shape: tuple) -> Any:
    """`ids` as one a row of hidden_states `shape` ([batch, seq, H] or [rows, H]): [batch] ids expanded
    over each sequence's rows; a MoeCallError naming both shapes where they do not fit."""
    from ..torch import one_a_row, row_count

    if one_a_row(ids, tuple(shape[:-1])):
        return ids.reshape(-1)
    if len(shape) == 3 and ids.dim() == 1 and ids.shape[0] == shape[0]:
        return ids[:, None].expand(int(shape[0]), int(shape[1])).reshape(-1)
    raise MoeCallError(f"lora_ids of shape {tuple(ids.shape)} fit neither the {row_count(tuple(shape[:-1]))} rows "
                       f"of hidden_states {tuple(shape)} nor its {shape[0]} sequences (set_lora_ids)")


def _cuda_index(ref: MoeBlockRef, tensors: dict) -> int:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise CheckpointError(f"{ref.path}: its weights lie on {sorted(str(d) for d in devices)}; move the model to "
                              "one CUDA device first (model.to('cuda'))")
    return next(iter(devices)).index or 0


def _one_workspace(layers: list, workspace_type) -> list:
    """The layers on one workspace a device (a layer that needed more than the first got its own)."""
    by_device: dict[int, list] = {}
    for layer in layers:
        by_device.setdefault(layer.device_id, []).append(layer)
    out = {}
    for device, group in by_device.items():
        if len({id(layer.workspace) for layer in group}) > 1:
            ws = workspace_type.for_layers((layer.workspace_need() for layer in group), device=device)
            group = [layer.with_workspace(ws) for layer in group]
        out.update({id(orig): new for orig, new in zip(by_device[device], group)})
    return [out[id(layer)] for layer in layers]


def _block_module(layer, family: str, layer_idx: int):
    import torch

    from ..torch import MoeModule

    class MoeBlock(MoeModule):
        """A replaced MoE block: the block's call signature, the layer underneath (bf16 inside); the
        rows' adapter slots from set_lora_ids."""

        is_cupymoe_block = True

        def __init__(self, layer):
            super().__init__(layer)
            self.layer_idx = layer_idx  # the decoder layer's index, as the adapters' names count it
            self.lora_ids = None

        def forward(self, hidden_states, *args, **kwargs):
            extra = [f"argument {i + 2}" for i, a in enumerate(args) if a is not None]
            extra += [k for k, v in kwargs.items() if v is not None]
            if extra:  # the layer would go on without them: nothing the caller asked of them would happen
                raise MoeCallError(f"the replaced {family} MoE block takes hidden_states alone; it was also "
                                   f"given {', '.join(extra)}")
            shape, dtype = hidden_states.shape, hidden_states.dtype
            rows = self.rows_of(hidden_states, "hidden_states").to(torch.bfloat16)
            if rows.shape[0] == 0:  # no rows: nothing routed, the empty output
                out = torch.empty_like(hidden_states)
                return (out, None) if BLOCK_OUTPUT[family].returns_tuple else out
            ids = None if self.lora_ids is None else _row_ids(self.lora_ids, tuple(shape))
            limit = self.layer.max_tokens
            parts = [MoeModule.forward(self, rows[i:i + limit], lora_ids=None if ids is None else ids[i:i + limit])
                     for i in range(0, rows.shape[0], limit)]
            out = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(shape).to(dtype)
            return (out, None) if BLOCK_OUTPUT[family].returns_tuple else out

    return MoeBlock(layer)
