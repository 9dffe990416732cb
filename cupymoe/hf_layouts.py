"""Stacked expert layouts (transformers 5, vLLM) read as the expert stacks HostWeights holds.

transformers 5 loads a MoE block's routed experts into two stacked parameters, and vLLM's
FusedMoE into `w13_weight` / `w2_weight`; the hub keeps one module per expert. The loader
(`checkpoint._plan`) asks `plan_stacked_experts` first and reads the hub's per-expert names
when it finds neither layout. A stacked tensor is read once and its gate and up halves are
numpy views of it: no per-expert slicing and no copy (a CPU torch tensor's memory is shared
through `.numpy()`; only float16/float64 are converted to float32, as for per-expert tensors).

The layouts (W in the [out, in] nn.Linear orientation; E routed experts, Z zero experts,
hidden H, intermediate I), read from transformers 5.24's `modeling_<family>.py` and from
vLLM's FusedMoE and gpt_oss.py:

  transformers 5, qwen3_moe / qwen2_moe / qwen3_next / deepseek_v3 / mixtral:
      experts.gate_up_proj [E, 2I, H] = [gate; up] along axis 1 (the forward's chunk(2, -1)),
      experts.down_proj [E, H, I]; no transposes, no biases.
  transformers 5, longcat_flash: the same, but gate_up_proj has E + Z rows up to 5.24 (rows >= E are
      never read; down_proj has E).
  transformers 5, gpt_oss: the hub layout itself (gate_up_proj [E, H, 2I], x @ W, gate / up
      interleaved on the last axis; biases), read by checkpoint._plan_fused_experts.
  vLLM, every family but gpt_oss: experts.w13_weight [E, 2I, H] = [w1 (gate); w3 (up)],
      experts.w2_weight [E, H, I].
  vLLM, gpt_oss: experts.w13_weight [E, 2I, H] with gate = even rows, up = odd rows (the
      hub's interleave, transposed), w13_bias [E, 2I] likewise; w2_weight [E, H, I], w2_bias [E, H].

Block fp8 stacks carry `<name>_scale_inv`, split like the weight where each half has its own row
blocks ([E, 2 * ceil(I/128), ceil(H/128)]: vLLM's block fp8; transformers' FP8Experts where I is a
multiple of 128). FP8Experts quantizes [gate; up] whole (ceil(2I/128) row blocks, one straddling the
halves where I is no multiple of 128): refused by name, as no split serves it. transformers 5.25's
save_pretrained of FP8Experts in the hub format writes each expert's codes under its hub name and the
scales stacked beside them (`experts.gate_up_proj_scale_inv`, `experts.down_proj_scale_inv`): read as
per-expert weights whose scales are slices of those (`_ScalesBesideExperts`).
Routers, correction biases and shared experts keep their hub names in both (the loader reads
them as usual). transformers 5 also moves Mixtral's block from `block_sparse_moe.` to `mlp.`
(`save_pretrained(save_original_format=False)` writes it so): `layer_prefix_in` finds either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .checkpoint import (FLOAT_DTYPES, U8, CheckpointError, MissingTensorError, Reader, _assemble, _ceil_div,
                         _Linear, _once, _Planner, _Source, contiguous, layer_prefix, naming_for)
from .config import MoeConfig
from .formats import E4M3, FP8_BLOCK

EXPERTS = "experts."  # the routed experts' module, under the MLP prefix, in every family and both layouts
SCALE = "_scale_inv"  # block fp8 scales beside a stacked weight (transformers FP8Experts, vLLM)
TRANSFORMERS_MLP = "mlp."  # where transformers 5 keeps every family's MoE block (Mixtral's hub name differs)


@dataclass(frozen=True)
class StackedLayout:
    """One stacked layout's tensor names under `experts.` and how gate and up share a tensor."""

    source: str  # for messages
    gate_up: str  # [E, 2I, H]
    down: str  # [E, H, I]
    interleaved: bool = False  # gate = even rows, up = odd rows; else gate = first I rows, up = the rest
    gate_up_bias: Optional[str] = None  # [E, 2I], split like the weight
    down_bias: Optional[str] = None  # [E, H]


TRANSFORMERS = StackedLayout("transformers 5", "gate_up_proj", "down_proj")
VLLM = StackedLayout("vLLM", "w13_weight", "w2_weight")
VLLM_GPT_OSS = StackedLayout("vLLM", "w13_weight", "w2_weight", interleaved=True,
                             gate_up_bias="w13_bias", down_bias="w2_bias")

# Each stacked layout is told apart by the first part of a tensor's name under `experts.`.
_HEADS = {TRANSFORMERS.source: ("gate_up_proj", "down_proj"), VLLM.source: ("w13_", "w2_")}
_HUB = "hub (per-expert modules)"


def _layout_of(head: str, model_type: str) -> Optional[str]:
    """Which layout a name whose first part under `experts.` is `head` belongs to (None: neither)."""
    if head.isdigit():
        return _HUB
    for source, starts in _HEADS.items():
        if head.startswith(starts):
            # gpt-oss's hub tensors are already transformers' stacked ones (checkpoint reads them)
            return _HUB if (source == TRANSFORMERS.source and model_type == "gpt_oss") else source
    return None


def _summary(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def found_layouts(src: _Source, base: str, model_type: str) -> dict[str, list[str]]:
    """{layout: the tensor names under `base` (the experts' prefix) that belong to it}."""
    found: dict[str, list[str]] = {}
    for name in sorted(src.names(base)):
        kind = _layout_of(name[len(base):].split(".")[0], model_type)
        if kind is not None:
            found.setdefault(kind, []).append(name)
    return found


def layer_prefix_in(src: _Source, model_type: str, layer_idx: int) -> str:
    """Layer `layer_idx`'s MLP prefix in `src`: the hub's, else transformers 5's `mlp.` when only it holds tensors."""
    hub = layer_prefix(model_type, layer_idx)
    moved = f"model.layers.{int(layer_idx)}.{TRANSFORMERS_MLP}"
    return moved if hub != moved and not src.names(hub) and src.names(moved) else hub


def _layout_for(source: str, model_type: str) -> StackedLayout:
    if source == VLLM.source:
        return VLLM_GPT_OSS if model_type == "gpt_oss" else VLLM
    return TRANSFORMERS


def plan_stacked_experts(P: _Planner, cfg: MoeConfig, prefix: str) -> Optional[dict[str, Reader]]:
    """Readers for gate / up / down (and gpt-oss's biases) from a stacked layout; None when the
    experts are under the hub's names (or absent: the per-expert plan reports what is missing).

    Refuses experts spread over two layouts (half converted) and a stacked layout missing one
    of its tensors, naming what was found.
    """
    base = prefix + EXPERTS
    found = found_layouts(P.src, base, cfg.model_type)
    if _scales_beside_per_expert_codes(found):
        P.src = _ScalesBesideExperts(P, cfg, prefix)
        return None
    if len(found) > 1:
        listing = "; ".join(f"{kind}: {_summary(names)}" for kind, names in found.items())
        raise CheckpointError(f"{base}*: the experts are stored in {len(found)} layouts at once ({listing}); "
                              "a layer's experts must be in one")
    stacked = [kind for kind in found if kind != _HUB]
    if not stacked:
        return None
    layout = _layout_for(stacked[0], cfg.model_type)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    tensors = [layout.gate_up, layout.down] + ([layout.gate_up_bias, layout.down_bias] if cfg.has_expert_bias else [])
    for t in tensors:
        if t is None or not P.src.has(base + t):
            raise MissingTensorError(
                f"{base}{t or '<bias>'}: the {layout.source} stacked layout needs it, but {P.src.searched()} "
                f"holds only {_summary(found[stacked[0]])} under {base!r}")
    # transformers sizes LongCat's gate_up_proj for the zero experts too (it never reads those rows)
    rows = (E, E + cfg.zero_expert_num)
    if layout is TRANSFORMERS:
        _refuse_straddling_scales(P.src, base + layout.gate_up, I)
    # each half keeps its own 128-row scale blocks (vLLM: 2 * ceil(I / 128)), else no split exists
    gate_up = _StackedLinear(P, base + layout.gate_up, rows, 2 * I, H, scale_rows=2 * _ceil_div(I, FP8_BLOCK))
    down = _StackedLinear(P, base + layout.down, (E,), H, I)
    if gate_up.lin.fmt == "fp8_block" and layout.interleaved:
        raise CheckpointError(f"{gate_up.name}: gate and up rows alternate, so they share fp8 scale blocks "
                              "and cannot be split; load the hub checkpoint instead")
    split_at = {"w": I, "q": I, "scale_inv": _ceil_div(I, FP8_BLOCK)}  # where the up half starts, per part

    def read_halves() -> tuple[Any, Any]:
        pairs = {p: _split(a, split_at[p], layout.interleaved) for p, a in gate_up.read(E).items()}
        return tuple(_assemble(gate_up.lin.fmt, {p: pair[k] for p, pair in pairs.items()}) for k in (0, 1))

    halves = _once(read_halves)
    readers: dict[str, Reader] = {
        "gate": lambda: halves()[0],
        "up": lambda: halves()[1],
        "down": lambda: _assemble(down.lin.fmt, down.read(E)),
    }
    if cfg.has_expert_bias:
        read_bias = P.vector(base + layout.gate_up_bias, (E, 2 * I))
        # copies: [E, I] each, and contiguous vectors are what callers index
        bias_halves = _once(lambda: tuple(contiguous(h) for h in _split(read_bias(), I, layout.interleaved)))
        readers["gate_bias"] = lambda: bias_halves()[0]
        readers["up_bias"] = lambda: bias_halves()[1]
        readers["down_bias"] = P.vector(base + layout.down_bias, (E, H))
    return readers


def _refuse_straddling_scales(src: _Source, name: str, I: int, hint: str = "load the hub checkpoint instead") -> None:
    """transformers' FP8Experts quantizes [gate; up] whole: ceil(2I / 128) row blocks, one straddling the
    halves where I is no multiple of 128, which no split serves (the halves need 2 ceil(I / 128) of their
    own). With I mod 128 in (64, 128) the two counts are equal, so any such stack is refused; with I mod
    128 in (0, 64] the stored count tells."""
    if I % FP8_BLOCK == 0 or not src.has(name + SCALE):
        return
    whole, stored = _ceil_div(2 * I, FP8_BLOCK), src.shape(name + SCALE)
    if I % FP8_BLOCK > FP8_BLOCK // 2 or (len(stored) == 3 and stored[1] == whole):
        raise CheckpointError(f"{name}: intermediate size {I} (mod {FP8_BLOCK} = {I % FP8_BLOCK}): its {whole} "
                              "fp8 scale row blocks may straddle gate and up (transformers' FP8Experts), which "
                              f"cannot be split; {hint}")


def _scales_beside_per_expert_codes(found: dict[str, list[str]]) -> bool:
    """Per-expert weights whose block fp8 scales lie stacked beside them (transformers 5.25's
    save_pretrained of FP8Experts in the hub format): every transformers-5 name a `_scale_inv`, no
    per-expert scale of its own."""
    if set(found) != {TRANSFORMERS.source, _HUB}:
        return False
    return all(n.endswith(SCALE) for n in found[TRANSFORMERS.source]) and \
        not any(n.endswith(".weight_scale_inv") for n in found[_HUB])


class _ScalesBesideExperts(_Source):
    """The planner's source, with each expert's `<proj>.weight_scale_inv` a slice of the stacked
    `experts.gate_up_proj_scale_inv` ([gate; up] row blocks: each half's own, as the split needs) and
    `experts.down_proj_scale_inv`; those two count as used."""

    def __init__(self, P: _Planner, cfg: MoeConfig, prefix: str):
        naming, base = naming_for(cfg.model_type), prefix + EXPERTS
        self.src, I = P.src, cfg.moe_intermediate_size
        gate_up, down = base + TRANSFORMERS.gate_up + SCALE, base + TRANSFORMERS.down + SCALE
        for name in (gate_up, down):
            P.need(name)
            P.check_dtype(name, FLOAT_DTYPES, "a float scale")
        _refuse_straddling_scales(self.src, base + TRANSFORMERS.gate_up, I,
                                  "re-save it with save_original_format=False, or from the model as quantized")
        E, half, cols = cfg.num_experts, _ceil_div(I, FP8_BLOCK), _ceil_div(cfg.hidden_size, FP8_BLOCK)
        P.check_shape(gate_up, (E, 2 * half, cols), (E + cfg.zero_expert_num, 2 * half, cols))  # LongCat: E + Z
        P.check_shape(down, (E, cols, half))
        # gate, up, down: (stacked tensor, its rows lo .. hi - 1)
        row_spans = ((gate_up, 0, half), (gate_up, half, 2 * half), (down, 0, cols))
        self.slices: dict[str, tuple[str, int, int, int]] = {
            prefix + naming.experts.format(e=e) + proj + ".weight_scale_inv": (name, e, lo, hi)
            for e in range(E) for proj, (name, lo, hi) in zip(naming.projections, row_spans)}
        self.stacked = {n: _once(lambda n=n: self.src.read(n)) for n in (gate_up, down)}

    def has(self, name: str) -> bool:
        return name in self.slices or self.src.has(name)

    def dtype(self, name: str) -> np.dtype:
        return self.src.dtype(self.slices[name][0] if name in self.slices else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.slices:
            return self.src.shape(name)
        stacked, _, lo, hi = self.slices[name]
        return (hi - lo,) + tuple(self.src.shape(stacked)[2:])

    def read(self, name: str) -> np.ndarray:
        if name not in self.slices:
            return self.src.read(name)
        stacked, e, lo, hi = self.slices[name]
        return self.stacked[stacked]()[e, lo:hi]

    def where(self, name: str) -> str:
        return self.src.where(self.slices[name][0] if name in self.slices else name)

    def searched(self) -> str:
        return self.src.searched()

    def names(self, prefix: str) -> list[str]:
        return self.src.names(prefix)


def _split(a: np.ndarray, n: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two halves of `a` along axis 1 as views: even/odd rows, or the first `n` rows and the rest."""
    if interleaved:
        return a[:, 0::2], a[:, 1::2]
    return a[:, :n], a[:, n:]


class _StackedLinear:
    """One stacked weight [rows, out, in], float or block fp8: header checks now, views on read."""

    def __init__(self, P: _Planner, name: str, rows: tuple[int, ...], out: int, inn: int,
                 scale_rows: Optional[int] = None):
        self.P, self.name = P, name
        src = P.src
        P.need(name)
        dt, shape = src.dtype(name), src.shape(name)
        if len(shape) != 3 or shape[0] not in rows or shape[1:] != (out, inn):
            want = " or ".join(str((r, out, inn)) for r in dict.fromkeys(rows))
            raise CheckpointError(f"{name}: expected shape {want}, found {shape} in {src.where(name)}")
        if src.has(name + SCALE):
            P.check_dtype(name, (E4M3, U8), f"float8_e4m3fn (it has a {SCALE}: block fp8)")
            scale = P.need(name + SCALE)
            scale_rows = _ceil_div(out, FP8_BLOCK) if scale_rows is None else scale_rows
            P.check_shape(scale, (shape[0], scale_rows, _ceil_div(inn, FP8_BLOCK)))
            P.check_dtype(scale, FLOAT_DTYPES, "a float scale")
            self.lin = _Linear(name, "fp8_block", {"q": name, "scale_inv": scale}, dt)
        elif dt in FLOAT_DTYPES:
            # served without it, the map would be off by that scale (as a per-expert weight's, checkpoint.py)
            scales = [n for n in src.names(name + "_") if "scale" in n[len(name):]]
            if scales:
                raise CheckpointError(f"{name} is {dt} but {', '.join(scales)} lies beside it in {src.where(name)}: "
                                      "a float stack takes no scale; quantized stacks are block fp8 with "
                                      f"{name}{SCALE}")
            self.lin = _Linear(name, "bf16", {"w": name}, dt)
        elif dt == E4M3:
            raise MissingTensorError(f"{name} is float8_e4m3fn but {name}{SCALE} is not found in "
                                     f"{src.searched()}: only block fp8 is supported")
        else:
            raise CheckpointError(f"{name}: stacked experts of dtype {dt} are not supported (float, or block fp8 "
                                  f"with {SCALE}); load the hub checkpoint instead")

    def read(self, E: int) -> dict[str, np.ndarray]:
        """The parts in canonical dtypes, the first E rows: views of the source where its dtype allows."""
        return self.P.read_parts(self.lin, rows=E)  # rows past E (LongCat's zero experts) are never read
