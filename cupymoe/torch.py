"""cupymoe in torch: `torch.ops.cupymoe.moe_forward` / `moe_experts` and an nn.Module around a MoeLayer.

    import cupymoe.torch
    module = cupymoe.torch.MoeModule(layer)            # or MoeModule.from_pretrained(dir, i, max_tokens=...)
    y = module(x)                                      # bf16 [..., H] on the layer's GPU, torch's current stream
    y = torch.ops.cupymoe.moe_forward(x2d, module.layer_id, None, None)   # token_ids, lora_ids
    y = module.experts(x2d, topk_ids, topk_weights)   # a server's own routing (MoeLayer.forward_experts)
    y = torch.ops.cupymoe.moe_experts(x2d, module.layer_id, topk_ids, topk_weights, None)

Importing this module registers the ops (each with a fake implementation, so torch.compile(fullgraph=True)
traces through it as one opaque node) and needs torch; the rest of cupymoe does not. The op runs on
torch's current stream and allocates its output through torch's allocator, so it works inside
torch.cuda.graph capture too.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any, Optional

import torch

from .errors import MoeCallError
from .experts import shared_flag
from .layer import MoeLayer

# the op's layer_id -> layer (ops take plain values); weak, so a dropped module frees its layer's memory
_LAYERS: "weakref.WeakValueDictionary[int, MoeLayer]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(layer: MoeLayer) -> int:
    """An id under which torch.ops.cupymoe.moe_forward finds `layer` while the caller holds the layer
    (MoeModule does): the registry keeps no layer alive."""
    layer_id = next(_IDS)
    _LAYERS[layer_id] = layer
    return layer_id


def _layer(layer_id: int) -> MoeLayer:
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise MoeCallError(f"layer_id={layer_id}: no cupymoe layer is registered under it (never registered, "
                           "or its layer was freed: hold the MoeModule or the layer)")
    return layer


def _inference_only(ctx: Any, grad: torch.Tensor) -> None:
    raise MoeCallError("cupymoe's ops are inference-only: no gradient flows through the MoE layer (run the "
                       "forward under torch.no_grad() or torch.inference_mode())")


@torch.library.custom_op("cupymoe::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, layer_id: int, token_ids: Optional[torch.Tensor] = None,
                lora_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 [N, H] -> bf16 [N, H]: the MoE layer registered under `layer_id`, on torch's current stream;
    `lora_ids` [N] int32: each row's adapter slot (-1 = base; the layer's set_lora fills the slots)."""
    layer = _layer(layer_id)
    _on_gpu("x", x)
    out = torch.empty_like(x)
    layer(x, out=out, token_ids=token_ids, lora_ids=lora_ids, stream=torch.cuda.current_stream(x.device).cuda_stream)
    return out


@moe_forward.register_fake
def _moe_forward_fake(x: torch.Tensor, layer_id: int, token_ids: Optional[torch.Tensor] = None,
                      lora_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty_like(x)


moe_forward.register_autograd(_inference_only)


@torch.library.custom_op("cupymoe::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared_expert: Optional[bool] = None, lora_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 [N, H] -> bf16 [N, H]: the registered layer's experts on the caller's routing (topk_ids [N, k]
    int32, topk_weights [N, k] float32, used as given), on torch's current stream; `shared_expert`: None
    adds the shared expert where the layer has one; `lora_ids` [N] int32: each row's adapter slot, the
    experts' deltas added (MoeLayer.forward_experts)."""
    layer = _layer(layer_id)
    _on_gpu("x", x)
    out = torch.empty_like(x)
    layer.run_experts(x, topk_ids, topk_weights, out=out, stream=torch.cuda.current_stream(x.device).cuda_stream,
                      shared_expert=shared_expert, lora_ids=lora_ids)
    return out


@moe_experts.register_fake
def _moe_experts_fake(x: torch.Tensor, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      shared_expert: Optional[bool] = None, lora_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty_like(x)


moe_experts.register_autograd(_inference_only)


_INT32_MAX = 2**31 - 1
# integer dtypes whose every value an int32 holds (int64 is narrowed by _as_int32)
_NARROW_EXACT = (torch.int8, torch.uint8, torch.int16, torch.int32)
ID_DTYPES = _NARROW_EXACT + (torch.int64,)  # what the module and set_lora_ids take as ids
ID_DTYPE_NAMES = tuple(str(d).removeprefix("torch.") for d in ID_DTYPES)


def _tensor(name: str, t: Any) -> torch.Tensor:
    """`t` itself; a MoeCallError naming `name` and what it is unless a torch tensor."""
    if not isinstance(t, torch.Tensor):
        raise MoeCallError(f"{name}: a torch tensor is required, got {type(t).__module__}.{type(t).__qualname__}")
    return t


def _as_int32(name: str, t: torch.Tensor) -> torch.Tensor:
    """Integer ids as int32 (int32 ones as they are), an int64 value outside int32 as INT32_MAX: every
    kernel that reads ids flags that one as out of range, where a plain cast would wrap it into a valid
    id. On the device, no host sync (capturable). A MoeCallError naming `name` unless integer."""
    t = _tensor(name, t)
    if t.dtype == torch.int32:
        return t
    if t.dtype == torch.int64:
        return torch.where((t < -_INT32_MAX - 1) | (t > _INT32_MAX), _INT32_MAX, t).to(torch.int32)
    if t.dtype in _NARROW_EXACT:
        return t.to(torch.int32)
    raise MoeCallError(f"{name}: an integer tensor of dtype {', '.join(ID_DTYPE_NAMES)} is required, got {t.dtype}")


def row_count(lead: tuple) -> int:
    """The rows of x [*lead, H]."""
    return math.prod(int(d) for d in lead)


def one_a_row(ids: torch.Tensor, lead: tuple) -> bool:
    """Whether `ids` hold one id a row of x [*lead, H] in the rows' order: flat, or shaped as `lead`
    (a [seq, batch] tensor of as many ids would cross the rows)."""
    return ids.numel() == row_count(lead) and (ids.dim() == 1 or tuple(ids.shape) == tuple(lead))


def _int32_rows(name: str, t: Optional[torch.Tensor], lead: tuple) -> Optional[torch.Tensor]:
    """Ids one a row of x [*lead, H] (one_a_row) as contiguous int32 (_as_int32); a MoeCallError
    naming both shapes otherwise."""
    if t is None:
        return None
    t = _as_int32(name, t)
    if not one_a_row(t, lead):
        raise MoeCallError(f"{name} of shape {tuple(t.shape)}: one id a row of x is required, [{row_count(lead)}] "
                           f"or {tuple(lead)} (x's shape without its hidden size)")
    return t.reshape(-1).contiguous()


def _on_gpu(name: str, t: torch.Tensor) -> None:
    """A MoeCallError naming `name` for a tensor in host memory (the layer reads device pointers)."""
    if not t.is_cuda:
        raise MoeCallError(f"{name}: a CUDA tensor is required, got one on {t.device}")


class MoeModule(torch.nn.Module):
    """A MoeLayer as a torch module: forward(x [..., H] bf16, token_ids=None, lora_ids=None)."""

    def __init__(self, layer: MoeLayer):
        super().__init__()
        self.layer = layer

    @property
    def layer(self) -> MoeLayer:
        return self._layer

    @layer.setter
    def layer(self, layer: MoeLayer) -> None:
        """A new layer (e.g. `layer.with_workspace(ws)`) is registered anew: forward and check_errors
        use the same one."""
        self._layer = layer
        self.layer_id = register(layer)
        self.hidden_size = layer.cfg.hidden_size

    @classmethod
    def from_pretrained(cls, checkpoint_dir, layer_idx: int, *, max_tokens: int, **options) -> "MoeModule":
        return cls(MoeLayer.from_pretrained(checkpoint_dir, layer_idx, max_tokens=max_tokens, **options))

    def rows_of(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [..., H] as rows [N, H]; a MoeCallError naming `name` where its last dimension is not H
        (a reshape alone would turn [N, 2H] into 2N rows)."""
        _tensor(name, x)
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise MoeCallError(f"{name} has shape {tuple(x.shape)}: its last dimension must be the layer's "
                               f"hidden size {self.hidden_size}")
        return x.reshape(-1, self.hidden_size)

    def forward(self, x: torch.Tensor, token_ids: Optional[torch.Tensor] = None,
                lora_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., H] bf16; token_ids and lora_ids (each row's adapter slot, -1 = base) one a row,
        any integer dtype (int32 passed as it is)."""
        rows = self.rows_of(x, "x")
        if not rows.is_contiguous():
            rows = rows.contiguous()
        lead = tuple(x.shape[:-1])
        tokens, ids = _int32_rows("token_ids", token_ids, lead), _int32_rows("lora_ids", lora_ids, lead)
        return torch.ops.cupymoe.moe_forward(rows, self.layer_id, tokens, ids).reshape(x.shape)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared_expert: Optional[bool] = None, lora_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The experts alone on the caller's routing (vLLM's fused_experts): x [N, H] bf16, topk_ids
        [N, k] (any integer dtype: int32 is passed as it is), topk_weights [N, k] (float32 as it is),
        lora_ids [N] (each row's adapter slot, any integer dtype) or None."""
        _tensor("x", x)
        topk_ids = _as_int32("topk_ids", topk_ids)
        # (x, weights, ids) swapped would pass every shape check
        if not _tensor("topk_weights", topk_weights).is_floating_point():
            raise MoeCallError(f"topk_weights: a floating-point tensor is required, got {topk_weights.dtype}")
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        shared_flag(self.layer, shared_expert)  # the op's bool schema would take 2 or -1 as True
        ids = _int32_rows("lora_ids", lora_ids, tuple(x.shape[:-1]))
        return torch.ops.cupymoe.moe_experts(x.contiguous(), self.layer_id, topk_ids.contiguous(),
                                             topk_weights.contiguous(), shared_expert, ids)

    def check_errors(self) -> None:
        """Raise what the layer's kernels flagged (a LoRA slot, token or expert id out of range: those rows
        got the base layer or no expert; NaN router logits or weights: plan.ErrorBit); synchronises the device,
        so call it outside capture."""
        self.layer.check_errors()

    def extra_repr(self) -> str:
        cfg = self.layer.cfg
        return (f"{cfg.model_type or 'moe'}: H={cfg.hidden_size}, E={cfg.num_experts}, k={cfg.num_experts_per_tok}, "
                f"max_tokens={self.layer.max_tokens}, experts {self.layer.weights.format}")
