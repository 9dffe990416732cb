"""PEFT adapters on stacked experts (`target_parameters`) read as per-expert LoRA modules.

transformers 5 keeps a MoE block's routed experts in two 3-D parameters (cupymoe/hf_layouts.py;
gpt-oss on the hub too), which PEFT adapts with `target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"]` (lora.ParamWrapper). What PEFT saves, and what it means (read from
PEFT 0.17-0.20's `ParamWrapper.update_layer` / `get_delta_weight`):

- A parameter P [E_p, d1, d2] gets lora_A [r E_p, in] and lora_B [out, r E_p], {in, out} = {d1, d2}
  (E_p: P's expert count; longcat_flash's gate_up_proj also holds its zero experts up to transformers
  5.24, the routed ones alone from 5.25, so either count is read). Expert e's
  factors: A_e = lora_A rows e r .. e r + r - 1 (expert-major), B_e = lora_B columns j E_p + e,
  j < r (rank-major). ΔP_e = scale B_e A_e, laid along P's axes so that A's columns run along the
  `in` axis. The forward uses P + ΔP.
- Which axis is `in` changed between versions: PEFT < 0.19.0 takes d1; 0.19.0 takes d2 when the
  experts module says `is_transposed` (gpt-oss: P is [E, in, out], x @ P) and d1 otherwise;
  0.19.1 and later d2 unless transposed (huggingface/peft#3165; transformers 5 also patches older
  PEFT for its converted families, and its transposed stacks say `is_transposed` only from 5.x).
  So a factor is the shrink (its columns along the forward's input) in some adapters and the
  expand in others. Where a parameter's input and output widths differ its shapes say which axis
  was `in`; the rule is one per adapter (one PEFT, one experts module), so a square parameter
  (gpt-oss's down_proj at H = I) follows its non-square sibling, and only without one the saving
  version (`peft_version` in adapter_config.json), where that version's rule is certain (before
  0.19.0; from 0.19.1 on a stack that is not transposed); else the adapter is refused by name.
- Two parameters of one module nest: the first one PEFT wraps (the module's own parameter order,
  gate_up_proj before down_proj) is innermost, saved under `experts.base_layer.lora_*`, the other
  under `experts.lora_*`. The shapes tell the two apart in every family (gate_up's {2I, H} against
  down's {I, H}), so the loader goes by the shapes, not by the nesting.

The per-expert modules: gate_up's output rows split into gate and up (the transformers layout
[gate; up]; gpt-oss interleaved: gate = even, up = odd), each with the shared shrink; the scale
from r and lora_alpha (rank_pattern / alpha_pattern matched on `<module>.<parameter>`, as PEFT
matches them). The kernels then run them as any per-expert adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from .config import MoeConfig
from .errors import LoraError

GATE_UP, DOWN = "gate_up_proj", "down_proj"
NEST = "base_layer"  # PEFT's wrapper nesting: the inner ParamWrapper's factors sit under it
# a longer number is no version (int() refuses 4300+ digits)
_VERSION = re.compile(r"^(\d{1,9})\.(\d{1,9})\.(\d{1,9})(.*)$")


@dataclass(frozen=True)
class StackedParam:
    """One stacked expert parameter as the family lays it out (hf_layouts.py)."""

    name: str  # GATE_UP or DOWN
    experts: int  # E_p, its leading axis
    routed: int  # E, the routed experts (longcat_flash's gate_up_proj: E_p = E + Z before transformers 5.25)
    input: int  # the forward's input width (H for gate_up, I for down)
    output: int  # its output width (2I for gate_up, H for down)
    transposed: bool  # P is [E, input, output] (x @ P: gpt-oss); else [E, output, input]

    @property
    def counts(self) -> tuple[int, ...]:
        """The leading axes an adapter of P may have been trained on: E_p, or E where the version sized it so."""
        return tuple(sorted({self.routed, self.experts}))


def stacked_params(cfg: MoeConfig) -> dict[str, StackedParam]:
    """gate_up_proj and down_proj of `cfg`'s family in transformers 5's layout."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    t = cfg.model_type == "gpt_oss"
    gate_up_rows = E + (cfg.zero_expert_num if cfg.model_type == "longcat_flash" else 0)
    return {GATE_UP: StackedParam(GATE_UP, gate_up_rows, E, H, 2 * I, t), DOWN: StackedParam(DOWN, E, E, I, H, t)}


def peft_version(raw: Optional[str]) -> Optional[tuple[int, int, int, bool]]:
    """(major, minor, patch, final) of adapter_config.json's `peft_version`; None when absent or unreadable."""
    if not isinstance(raw, str):
        return None
    m = _VERSION.match(raw.strip())
    if m is None:
        return None
    major, minor, patch, rest = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
    return major, minor, patch, not rest or rest.startswith("+")  # a local tag (+g...) keeps a release final


def in_axis_by_version(p: StackedParam, version: Optional[tuple[int, int, int, bool]], where: str) -> int:
    """The axis of P (1 or 2) PEFT took as `in_features`, by the version that saved the adapter: the rule
    for a square parameter whose adapter has no non-square sibling (in_axis_of)."""
    if version is None:
        raise LoraError(f"{where}: {p.name} is square ({p.input} x {p.output}), so which factor is the shrink "
                        "depends on the PEFT version that saved the adapter (huggingface/peft#3165), and "
                        "adapter_config.json has no readable peft_version")
    major, minor, patch, final = version
    v = (major, minor, patch)
    if not final and (0, 18, 1) < v <= (0, 19, 1):  # a development build around the two changes
        raise LoraError(f"{where}: {p.name} is square and peft_version {major}.{minor}.{patch} is a development "
                        "build around the ParamWrapper orientation changes (0.19.0 / 0.19.1): its layout is not known")
    if v < (0, 19, 0):
        return 1
    if p.transposed or v == (0, 19, 0):
        # from 0.19.0 the rule reads the experts module's is_transposed, which older transformers
        # versions do not set on transposed stacks; and 0.19.0's rule is what transformers 5's own
        # loading patches (patch_moe_parameter_targeting) for its converted families: either axis
        raise LoraError(f"{where}: {p.name} is square and the adapter holds no adapter of the other stacked "
                        f"parameter: with peft_version {major}.{minor}.{patch} its orientation depends on the "
                        "transformers it was trained with; adapt gate_up_proj too, or merge the adapter")
    return 2


def in_axis_of(p: StackedParam, a: np.ndarray) -> Optional[int]:
    """The axis of P PEFT took as `in_features` (lora_A's width), None where P is square."""
    if p.input == p.output:
        return None
    d1 = p.input if p.transposed else p.output
    return 1 if a.shape[1] == d1 else 2


def _factors(p: StackedParam, a: np.ndarray, b: np.ndarray, rank: int, in_axis: int, where: str):
    """(shrink [E_p, r, input], expand [E_p, output, r]) of one parameter's lora_A / lora_B, A's columns
    along P's axis `in_axis`."""
    count = a.shape[0] // rank if a.ndim == 2 and a.shape[0] % rank == 0 else 0
    rows = rank * count
    if count not in p.counts or b.ndim != 2 or b.shape[1] != rows:
        want = " or ".join(f"[{rank * c}, in], lora_B [out, {rank * c}]" for c in p.counts)
        raise LoraError(f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not hold rank {rank} for "
                        f"{' or '.join(map(str, p.counts))} experts (expected lora_A {want})")
    if count != p.experts and rows % p.experts == 0:
        # the rows also hold another rank on the stack with the zero experts: the config's rank alone picks
        raise LoraError(f"{where}: lora_A's {rows} rows read as rank {rank} on {count} experts or as rank "
                        f"{rows // p.experts} on {p.experts} (with the zero experts, transformers up to 5.24): "
                        "which one the adapter was trained on is not certain")
    d1, d2 = (p.input, p.output) if p.transposed else (p.output, p.input)
    fin, fout = (d1, d2) if in_axis == 1 else (d2, d1)
    if (a.shape[1], b.shape[0]) != (fin, fout):
        raise LoraError(f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)}: expected in / out widths "
                        f"{fin} / {fout} for {p.name}")
    A = a.reshape(count, rank, a.shape[1])  # expert-major rows
    B = b.reshape(b.shape[0], rank, count).transpose(2, 0, 1)  # rank-major columns -> [E_p, out, r]
    if in_axis == (1 if p.transposed else 2):  # A's columns along the forward's input: A shrinks
        return A, B
    return B.transpose(0, 2, 1), A.transpose(0, 2, 1)  # ΔW = B A along P: the factors swap roles


def which_param(cfg: MoeConfig, a: np.ndarray, b: np.ndarray) -> Optional[str]:
    """The stacked parameter whose in / out widths a factor pair has (None: neither)."""
    for p in stacked_params(cfg).values():
        if a.ndim == 2 and b.ndim == 2 and (a.shape[1], b.shape[0]) in ((p.input, p.output), (p.output, p.input)):
            return p.name
    return None


def per_expert(cfg: MoeConfig, p: StackedParam, a: np.ndarray, b: np.ndarray, rank: int, in_axis: int,
               where: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"gate" / "up" / "down": (shrink [E, r, in], expand [E, out, r])} of one stacked parameter,
    routed experts only (longcat's zero experts are never computed)."""
    shrink, expand = _factors(p, a, b, rank, in_axis, where)
    E = cfg.num_experts
    shrink, expand = shrink[:E], expand[:E]
    if p.name == DOWN:
        return {"down": (shrink, expand)}
    I = cfg.moe_intermediate_size
    if p.transposed:  # gpt-oss: gate and up interleaved along the output
        return {"gate": (shrink, expand[:, 0::2]), "up": (shrink, expand[:, 1::2])}
    return {"gate": (shrink, expand[:, :I]), "up": (shrink, expand[:, I:])}


def nested_pairs(module_parts: Mapping[str, Mapping[str, np.ndarray]], experts_module: str, prefix: str = "",
                 ) -> list[tuple[str, Mapping[str, np.ndarray]]]:
    """The (module name, {lora_A, lora_B}) pairs at `experts_module` and its base_layer nesting,
    outermost first; LoraError (naming `prefix` + the module) for a nesting with a gap."""
    out = []
    name = experts_module
    while True:
        below = any(k.startswith(f"{name}.{NEST}") for k in module_parts)
        if name in module_parts:
            out.append((name, module_parts[name]))
        elif below:
            raise LoraError(f"{prefix}{name}: PEFT wrappers nested below it (base_layer) but no lora_A / "
                            "lora_B of its own")
        if not below:
            return out
        name = f"{name}.{NEST}"
