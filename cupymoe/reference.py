"""The numpy oracle of the MoE layer (DESIGN.md section 1): every GPU kernel is checked against it.

It computes in float64 by default (`dtype=np.float32` computes every step in float32
instead) and depends on nothing but numpy, ml_dtypes (through `formats`) and the config,
so any CPU test can use it. It is written for legibility: one function per step of
section 1, vectorised over rows where that stays readable, no fusion, no cleverness.

Conventions that section 1 leaves open, fixed here (kernels must follow them):

- **Top-k tie-break**: among equal selection scores the LOWER expert id wins (a stable
  sort of the negated scores). The same rule picks groups in group-limited routing.
  The ids of a row are listed in descending score order.
- **Zero (identity) experts** contribute `w * x_e[row]`, where `x_e` is the expert input
  (`rmsnorm(x) * w_norm` under `pre_expert_norm`, else `x`): an identity expert stands in
  for a routed expert, so it sees what the routed experts see. LongCat, the one family with
  zero experts, has no pre-expert norm, so there both readings agree.
- **Group-limited routing** excludes the experts of the dropped groups from the top-k
  outright (score -inf), as vLLM does. (transformers' DeepseekV3 fills them with 0.0
  instead, which differs only when every kept candidate's `c` is negative.)
- **norm_topk_prob** and **routed_scaling_factor** apply after the weights are known,
  whatever produced them (top-k of `c`, `topk_then_softmax`, hash routing); for
  `topk_then_softmax` the renormalisation is a no-op and the scaling factor is applied
  even though gpt-oss leaves it at 1.
- **Expert parallelism**: a rank's output is its PARTIAL sum: the routed experts it owns,
  plus, on rank 0 only, the shared expert and the zero-expert identity terms, so that the
  partials of all ranks sum (all-reduce) to the full output with those counted once.
- **LoRA** (`lora={slot: LoraWeights}`, `lora_ids` [N], -1 = base only): a row's adapter adds
  `scale * B (A v)` to each map it names, on that map's own input `v`: the router's to the
  logits before scoring, bias and top-k (so it can change the routing); a routed expert's
  gate / up before the activation, its down to `y` before the routing weight multiplies; the
  shared expert's likewise, before its gate. The expert maps read `x_e`, the down maps the
  activation as the path stores it (bf16 under `rounding`), never w8a8's quantized copies.
- **Precision**: the router logits and everything after are computed in `dtype` from the
  exact bf16 input and the dequantized weights; nothing is rounded to bf16 in between
  (the GPU path rounds some intermediates; the tests' tolerances absorb that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from . import formats
from .config import MoeConfig, is_integer
from .errors import ConfigError, LoraError, MoeCallError, OptionError
from .host_weights import HostWeights
from .lora import LoraWeights

__all__ = ["Routing", "moe_forward", "experts_forward", "given_routing", "route", "expert_input", "activation",
           "router_logits", "scores"]

# norm_topk_prob divides by sum(w) + NORM_EPS, as the reference implementations do, so that
# a row whose selected weights underflow to 0 yields 0 rather than NaN.
NORM_EPS = 1e-20


@dataclass
class Routing:
    """One batch's routing decision (float64 unless computed inside a float32 forward).

    logits  [N, R]  router logits (after the router bias)
    ids     [N, k]  selected expert ids, best first; ids >= E are zero (identity) experts
    weights [N, k]  the weight of each selected id, after renormalisation and scaling
    margin  [N]     how far the row is from a different selection: the gap, in the
                    selection score (logits for topk_then_softmax), between the k-th
                    selected candidate and the best unselected one; +inf when nothing
                    could change the choice (hash routing, or every candidate selected).
                    GPU tests redraw rows with a small margin, where fp32 rounding
                    could legitimately pick different experts than float64.
    """

    logits: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    margin: np.ndarray


# ----------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------

def _as_input(cfg: MoeConfig, x: Any, dtype) -> np.ndarray:
    """[N, H] input (bf16 or any float array) -> `dtype`; bf16 converts exactly."""
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[1] != cfg.hidden_size:
        raise MoeCallError(f"x: expected shape [N, {cfg.hidden_size}], found {a.shape}")
    if a.dtype.kind != "f" and a.dtype != formats.BF16:  # integers would be values here, not bf16 bits (uint16 views)
        raise MoeCallError(f"x: dtype {a.dtype} is not a float (bf16 bits travel as uint16 on the device only: "
                           "give the bf16 values)")
    return a.astype(dtype)


def _vector(t: Optional[np.ndarray], dtype) -> Optional[np.ndarray]:
    return None if t is None else np.asarray(t).astype(dtype)


# ----------------------------------------------------------------------------------
# step 1: pre-expert norm
# ----------------------------------------------------------------------------------

def expert_input(cfg: MoeConfig, host_weights: HostWeights, x: Any, *, dtype=np.float64) -> np.ndarray:
    """What the routed (and zero) experts read: `rmsnorm(x) * w_norm` under pre_expert_norm, else `x`.

    The router and the shared expert always read the un-normed `x` (section 1, step 1).
    """
    xf = _as_input(cfg, x, dtype)
    if not cfg.pre_expert_norm:
        return xf
    w = _vector(host_weights.norm_weight, dtype)
    rms = np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return xf / rms * w


# ----------------------------------------------------------------------------------
# steps 2 and 3: router logits, scores, selection
# ----------------------------------------------------------------------------------

def router_logits(cfg: MoeConfig, host_weights: HostWeights, x: np.ndarray) -> np.ndarray:
    """`l = x @ Wg^T (+ router bias)`, [N, R], in x's dtype."""
    wg = formats.dequantize(host_weights.router, x.dtype)
    logits = x @ wg.T
    if cfg.has_router_bias:
        logits = logits + _vector(host_weights.router_bias, x.dtype)
    return logits


def _sigmoid(v: np.ndarray) -> np.ndarray:
    # exp(-v) overflows to inf for very negative v; 1 / (1 + inf) = 0 is the right limit.
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(axis=-1, keepdims=True))  # shift by the max: no overflow
    return e / e.sum(axis=-1, keepdims=True)


def scores(cfg: MoeConfig, logits: np.ndarray) -> np.ndarray:
    """`s` by scoring_func: softmax over all R, sigmoid, or sqrt(softplus)."""
    if cfg.scoring_func == "softmax":
        return _softmax(logits)
    if cfg.scoring_func == "sigmoid":
        return _sigmoid(logits)
    if cfg.scoring_func == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, logits))  # logaddexp(0, l) = softplus(l), overflow-free
    raise ConfigError(f"scoring_func={cfg.scoring_func!r} is not defined")


def _topk(c: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries per row, best first; ties go to the lower index.

    A stable sort of -c keeps equal values in index order, which is the tie-break rule.
    """
    return np.argsort(-c, axis=-1, kind="stable")[:, :k]


def _gap_kth_vs_rest(c: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per row: min over selected of c minus max over unselected candidates (-inf = not a candidate)."""
    n = c.shape[0]
    rows = np.arange(n)[:, None]
    kth = c[rows, ids].min(axis=-1)
    rest = c.copy()
    rest[rows, ids] = -np.inf
    best_rest = rest.max(axis=-1)
    # No unselected candidate left: no perturbation can change the choice.
    return np.where(np.isneginf(best_rest), np.inf, kth - best_rest)


def _select_grouped(cfg: MoeConfig, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group-limited top-k (DeepSeek-V3): keep the topk_group best groups, top-k inside them.

    A group's score is the sum of its two best `c`. Returns (ids, margin); the margin is
    the smaller of the group-choice gap (last kept vs best dropped group score) and the
    in-group gap (k-th selected vs best unselected expert of the kept groups).
    """
    n, E = c.shape
    G, gsize = cfg.n_group, E // cfg.n_group
    grouped = c.reshape(n, G, gsize)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [n, G]
    kept = _topk(group_score, cfg.topk_group)  # [n, topk_group]
    group_margin = _gap_kth_vs_rest(group_score, kept)

    keep_mask = np.zeros((n, G), dtype=bool)
    keep_mask[np.arange(n)[:, None], kept] = True
    candidate = np.repeat(keep_mask, gsize, axis=1)  # [n, E]: expert j lies in group j // gsize
    masked = np.where(candidate, c, -np.inf)
    ids = _topk(masked, cfg.num_experts_per_tok)
    return ids, np.minimum(group_margin, _gap_kth_vs_rest(masked, ids))


def _hash_ids(cfg: MoeConfig, host_weights: HostWeights, token_ids: Any, n: int) -> np.ndarray:
    """Static routing (DeepSeek-V4 hash layers): ids = tid2eid[token_id]."""
    if token_ids is None:
        raise MoeCallError("hash routing (cfg.hash_routing=True) needs token_ids: pass the [N] token ids "
                           "of the rows, the static tid2eid table is indexed by them")
    t = np.asarray(token_ids)
    if t.shape != (n,) or not np.issubdtype(t.dtype, np.integer):
        raise MoeCallError(f"token_ids: expected [{n}] integers (one per row of x), found shape {t.shape} "
                           f"dtype {t.dtype}")
    V = cfg.hash_vocab_size
    if n and (t.min() < 0 or t.max() >= V):
        raise MoeCallError(f"token_ids must lie in 0..{V - 1} (tid2eid rows, cfg.hash_vocab_size), "
                           f"found {int(t.min())}..{int(t.max())}")
    return np.asarray(host_weights.tid2eid)[t].astype(np.int64)


def _route(cfg: MoeConfig, host_weights: HostWeights, x: np.ndarray, token_ids: Any,
           lora: Optional["_LoraRows"] = None) -> Routing:
    """Steps 2-3 on the router input `x` (already in the working dtype); `lora` adds the rows' router deltas."""
    n, k = x.shape[0], cfg.num_experts_per_tok
    rows = np.arange(n)[:, None]
    logits = router_logits(cfg, host_weights, x)
    if lora is not None:  # before scoring, bias and top-k: an adapter may change the routing
        logits = _plus(logits, lora.delta("router", None, np.arange(n), x))

    if cfg.topk_then_softmax:
        # gpt-oss: select on the logits themselves, then softmax over the k chosen logits.
        ids = _topk(logits, k)
        weights = _softmax(logits[rows, ids])
        margin = _gap_kth_vs_rest(logits, ids)
    else:
        s = scores(cfg, logits)
        if cfg.hash_routing:
            ids = _hash_ids(cfg, host_weights, token_ids, n)
            margin = np.full(n, np.inf, dtype=x.dtype)  # a table lookup has no near-ties
        else:
            # The correction bias steers the selection only; the weights stay s.
            c = s + _vector(host_weights.correction_bias, x.dtype) if cfg.has_correction_bias else s
            if cfg.n_group > 1:
                ids, margin = _select_grouped(cfg, c)
            else:
                ids = _topk(c, k)
                margin = _gap_kth_vs_rest(c, ids)
        weights = s[rows, ids]

    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + NORM_EPS)
    weights = weights * cfg.routed_scaling_factor
    return Routing(logits=logits, ids=ids.astype(np.int64), weights=weights, margin=margin)


def route(cfg: MoeConfig, host_weights: HostWeights, x: Any, token_ids: Any = None, *,
          lora: Optional[Mapping[int, Any]] = None, lora_ids: Any = None) -> Routing:
    """Router logits, scores, selection and weights for the rows of `x` [N, H], in float64.

    The router reads the un-normed `x` (pre_expert_norm affects the experts only).
    Hash routing needs `token_ids` [N] and raises ValueError without them.
    `lora` / `lora_ids`: the rows' router deltas, as moe_forward takes them.
    """
    host_weights.validate(cfg, values=False)  # shapes only: a NaN in an expert nobody routes to is no error here
    xf = _as_input(cfg, x, np.float64)
    return _route(cfg, host_weights, xf, token_ids, _lora_rows(cfg, lora, lora_ids, xf.shape[0]))


def given_routing(cfg: MoeConfig, topk_ids: Any, topk_weights: Any) -> Routing:
    """A caller's routing as the experts-only entry takes it (MoeLayer.forward_experts): ids [N, k]
    in 0..R-1 (E..R-1 the zero experts; -1 a pair that adds nothing, as the kernels treat an id
    they flag), the weights used as given: float32 values, no renormalisation, no
    routed_scaling_factor. Raises ValueError for anything else."""
    ids, w = np.asarray(topk_ids), np.asarray(topk_weights)
    k, R = cfg.num_experts_per_tok, cfg.router_width
    real = np.issubdtype(w.dtype, np.floating) or (np.issubdtype(w.dtype, np.integer) and w.dtype != np.bool_)
    if (ids.ndim != 2 or ids.shape[1] != k or not np.issubdtype(ids.dtype, np.integer) or w.shape != ids.shape
            or not real):  # strings, complex (its imaginary part dropped) or bools are no weights
        raise MoeCallError(f"given routing: expected integer ids [N, {k}] and weights of their shape, found ids "
                           f"{ids.shape} {ids.dtype}, weights {w.shape} {w.dtype}")
    if ids.size and (ids.min() < -1 or ids.max() >= R):  # -1: a pair that adds nothing (a flagged id's fate)
        raise MoeCallError(f"given routing: ids must lie in 0..{R - 1} (or -1: no expert), found "
                           f"{int(ids.min())}..{int(ids.max())}")
    n = ids.shape[0]
    return Routing(logits=np.zeros((n, 0)), ids=ids.astype(np.int64), weights=w.astype(np.float32).astype(np.float64),
                   margin=np.full(n, np.inf))


def experts_forward(cfg: MoeConfig, host_weights: HostWeights, x: Any, topk_ids: Any, topk_weights: Any, *,
                    shared_expert: bool = True, **options: Any) -> np.ndarray:
    """The experts-only entry's output: moe_forward with the caller's routing (given_routing) in place of
    the router's, the shared expert (if the layer has one) added unless `shared_expert=False`.
    `options`: moe_forward's (dtype, rounding, ep_rank, ...)."""
    routing = given_routing(cfg, topk_ids, topk_weights)
    return moe_forward(cfg, host_weights, x, routing=routing, shared_expert=shared_expert, **options)


# ----------------------------------------------------------------------------------
# step 4: experts
# ----------------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; libm's is exact to ~1 ulp


def activation(cfg: MoeConfig, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """`act(g, u)` of the GLU expert: the gate projection `g` activated, times the up projection `u`."""
    act = cfg.hidden_act
    if act == "silu":
        return g * _sigmoid(g) * u
    if act == "gelu":  # exact (erf) form
        return 0.5 * g * (1.0 + _erf(g / math.sqrt(2.0)).astype(g.dtype)) * u
    if act == "gelu_tanh":  # the tanh approximation (gelu_pytorch_tanh, gelu_new)
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    if act == "swiglu_oai":
        # gpt-oss: gate clamped from above only, up clamped both ways, and the "+1" on up.
        lim = cfg.swiglu_limit
        g = np.minimum(g, lim)
        u = np.clip(u, -lim, lim)
        return g * _sigmoid(cfg.swiglu_alpha * g) * (u + 1.0)
    raise ConfigError(f"hidden_act={act!r} is not defined")


# Kernel-faithful rounding (moe_forward's `rounding`): which intermediates the GPU paths
# store as bf16. "decode": the pre-normed input and the activation; "grouped": those and
# each (row, slot)'s weighted expert output (the shared expert's unweighted output).
ROUNDINGS = (None, "decode", "grouped")


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even) and back to a's dtype."""
    return a.astype(np.float32).astype(formats.BF16).astype(a.dtype)


def _fp8_as_gemm_reads(t: Any) -> Any:
    """An fp8-block matrix as the grouped GEMM's tile builder makes it: bf16(fp32(q) * s),
    each weight rounded once (cuda/quant.cuh). Other formats are returned as they are: the
    fp4 formats' code * scale is exact in bf16, and the decode reader keeps fp8 exact."""
    if formats.weight_format(t) != "fp8_block":
        return t
    out, inn = t.q.shape[-2:]
    s = np.repeat(np.repeat(t.scale_inv, formats.FP8_BLOCK, axis=-2), formats.FP8_BLOCK, axis=-1)[..., :out, :inn]
    return (t.q.astype(np.float32) * s.astype(np.float32)).astype(formats.BF16)


def kernel_weights(host_weights: HostWeights, rounding: Optional[str], w8a8: bool = False) -> HostWeights:
    """The weights as the GPU path `rounding` computes with: a quantized router rounded once
    to bf16 (both paths; cupymoe.weights.router_bf16), and for "grouped" the fp8 experts as
    the tile builder rounds them, unless `w8a8` (e4m3 tensor cores read the codes as they
    are). Exact (None): the weights themselves."""
    if rounding is None:
        return host_weights
    from dataclasses import replace

    from .weights import router_bf16

    changes: dict[str, Any] = {"router": router_bf16(host_weights.router)}
    if rounding == "grouped" and not w8a8:
        for name in ("gate", "up", "down", "shared_gate", "shared_up", "shared_down"):
            t = getattr(host_weights, name)
            if t is not None:
                changes[name] = _fp8_as_gemm_reads(t)
    return replace(host_weights, **changes)


# Activation formats (moe_forward's `activations`): "bf16" leaves the expert inputs as they
# are; "fp8_block" is DeepSeek-V3's w8a8: the input of every fp8-block projection quantized
# per row and 128-column group (quantize_activations_fp8).
ACTIVATIONS = ("bf16", "fp8_block")


def quantize_activations_fp8(a: np.ndarray) -> np.ndarray:
    """w8a8's activation quantization, dequantized again: per row and 128-column group,
    s = amax / 448 in fp32, q = e4m3(a / s) (nearest even, within +-448), returns q * s in
    a's dtype. A group of zeros stays zero."""
    a = np.asarray(a)
    n, k = a.shape
    out = np.empty_like(a)
    for c0 in range(0, k, formats.FP8_BLOCK):
        g = a[:, c0:c0 + formats.FP8_BLOCK].astype(np.float32)
        s = (np.abs(g).max(axis=1, keepdims=True) / np.float32(formats.E4M3_MAX)).astype(np.float32)
        safe = np.where(s > 0, s, np.float32(1))
        q = np.clip(g / safe, -formats.E4M3_MAX, formats.E4M3_MAX).astype(formats.E4M3)
        out[:, c0:c0 + formats.FP8_BLOCK] = q.astype(np.float32).astype(a.dtype) * s.astype(a.dtype)
    return out


def _ffn(cfg: MoeConfig, x: np.ndarray, gate: Any, up: Any, down: Any,
         biases: tuple[Optional[np.ndarray], ...] = (None, None, None), rounding: Optional[str] = None,
         activations: str = "bf16", quantized: Optional[Callable[[str, np.ndarray], np.ndarray]] = None,
         kernel_act: Optional[Callable[[np.ndarray], np.ndarray]] = None,
         down_magnitudes: bool = False, lora: Optional[Callable] = None, lora_plan: bool = False) -> Any:
    """One GLU feed-forward on rows `x`: down(act(gate(x), up(x))), weights dequantized here;
    with activations="fp8_block", an fp8-block projection's input is quantized first (w8a8):
    by quantize_activations_fp8, or by `quantized(stage, a)` ("gate_up" / "down") when given.
    `kernel_act(a)`: the activation the down projection multiplies instead of `a` (unless
    that input is quantized: then `quantized` decides). `down_magnitudes`: the root sum of
    squares of the down projection's products, sqrt(sum_i (a_i W_hi)^2), instead of the
    projection (no bias): the scale of what independent relative errors of the a_i move y_h by.
    `lora(proj, v)`: the rows' LoRA delta of "gate" / "up" / "down" on that map's input v, or None.
    `lora_plan` (moe_forward's): under `rounding`, g and u are rounded to bf16 before the deltas,
    and on the grouped path (y, down's delta) come back apart for the caller to round as stored."""
    dt = x.dtype
    x_in = x  # LoRA reads the map's input as stored, not w8a8's quantized copy

    def w8a8(t):
        return activations == "fp8_block" and formats.weight_format(t) == "fp8_block"

    def quantize(stage, a):
        return quantize_activations_fp8(a) if quantized is None else quantized(stage, a)

    if w8a8(gate):
        x = quantize("gate_up", x)
    g = x @ formats.dequantize(gate, dt).T
    u = x @ formats.dequantize(up, dt).T
    bg, bu, bd = biases
    if bg is not None:
        g, u = g + bg, u + bu
    if lora_plan and rounding:  # the LoRA plans' gate/up stores g and u in bf16 (ACT_PAIR)
        g, u = _bf16(g), _bf16(u)
    if lora is not None:
        g, u = _plus(g, lora("gate", x_in)), _plus(u, lora("up", x_in))
    a = activation(cfg, g, u)
    if rounding:
        a = _bf16(a)
    a_in = a
    if w8a8(down):
        a = quantize("down", a)
    elif kernel_act is not None:
        a = a_in = kernel_act(a)  # LoRA's down reads the activation the kernels stored too
    if down_magnitudes:
        return np.sqrt((a * a) @ np.square(formats.dequantize(down, dt)).T)
    y = a @ formats.dequantize(down, dt).T
    y = y if bd is None else y + bd
    d = None if lora is None else lora("down", a_in)
    if lora_plan and rounding == "grouped":
        return y, d
    return _plus(y, d)


def _stored_term(term: np.ndarray, delta: Optional[np.ndarray]) -> np.ndarray:
    """A grouped path's bf16 term (bf16(w y), or the shared expert's bf16(y)); the LoRA plans add
    down's (weighted) delta to the stored term and round again."""
    term = _bf16(term)
    return term if delta is None else _bf16(term + delta)


def _routed_experts(cfg: MoeConfig, hw: HostWeights, xe: np.ndarray, routing: Routing,
                    owned: range, include_zero: bool, rounding: Optional[str] = None,
                    activations: str = "bf16", w8a8_inputs: Optional[Callable] = None,
                    absolute: bool = False, kernel_acts: Optional[Callable] = None,
                    kernel_terms: Optional[Callable] = None, lora: Optional["_LoraRows"] = None,
                    lora_plan: bool = False) -> np.ndarray:
    """Sum over (row, slot) of w * expert(x_e[row]) for the owned experts (+ identity experts);
    `absolute`: of |w * expert(x_e[row])|; absolute="down": of |w| * sqrt(sum_i (a_i W_down,hi)^2)
    (moe_forward; identity experts have no down projection and add nothing).

    Loops over experts, not rows: each chosen expert's weights are dequantized once and
    applied to all the rows that chose it. Experts nobody chose are never touched.
    """
    E = cfg.num_experts
    dt = xe.dtype
    out = np.zeros_like(xe)
    ids, weights = routing.ids, routing.weights.astype(dt)
    for e in np.unique(ids):
        e = int(e)
        rows, slots = np.nonzero(ids == e)
        w = weights[rows, slots][:, None]
        if e >= E:
            if include_zero and absolute != "down":  # zero (identity) expert: w * its input
                np.add.at(out, rows, np.abs(w * xe[rows]) if absolute else w * xe[rows])
            continue
        if e not in owned:
            continue
        biases = (None, None, None)
        if cfg.has_expert_bias:
            biases = tuple(_vector(b[e], dt) for b in (hw.gate_bias, hw.up_bias, hw.down_bias))
        fed = None if w8a8_inputs is None else (lambda stage, a, e=e, rows=rows: w8a8_inputs(stage, e, rows, a))
        acts = None if kernel_acts is None else (lambda a, e=e, rows=rows: kernel_acts(e, rows, a))
        deltas = None if lora is None else (lambda proj, v, e=e, rows=rows: lora.delta(proj, e, rows, v))
        y = _ffn(cfg, xe[rows], hw.gate[e], hw.up[e], hw.down[e], biases, rounding, activations, fed, acts,
                 down_magnitudes=absolute == "down", lora=deltas, lora_plan=lora_plan)
        y, d = y if isinstance(y, tuple) else (y, None)
        if absolute == "down":
            np.add.at(out, rows, np.abs(w) * y)
            continue
        if rounding == "decode" and kernel_terms is not None:  # the decode path's fp32 outputs
            y = kernel_terms(e, rows, y)
        term = w * y
        if rounding == "grouped":  # the grouped GEMM stores bf16(w * y), weighted in fp32 first
            term = _stored_term(term, None if d is None else w * d)
            if kernel_terms is not None:
                term = kernel_terms(e, rows, term)
        # A row picks an expert at most once (top-k of distinct ids; tid2eid rows are
        # distinct by contract), but add.at stays right even if a table repeats one.
        np.add.at(out, rows, np.abs(term) if absolute else term)
    return out


# ----------------------------------------------------------------------------------
# step 5: shared expert
# ----------------------------------------------------------------------------------

def _shared_expert(cfg: MoeConfig, hw: HostWeights, x: np.ndarray, rounding: Optional[str] = None,
                   activations: str = "bf16", w8a8_inputs: Optional[Callable] = None,
                   kernel_acts: Optional[Callable] = None, kernel_terms: Optional[Callable] = None,
                   down_magnitudes: bool = False, lora: Optional["_LoraRows"] = None,
                   lora_plan: bool = False) -> np.ndarray:
    """`scale * down(act(gate(x), up(x)))` on the un-normed x; scale = sigmoid(x . w_gate) or 1.
    `down_magnitudes`: scale * sqrt(sum_i (a_i W_down,hi)^2) (moe_forward's absolute="down")."""
    rows = np.arange(x.shape[0])
    fed = None if w8a8_inputs is None else (lambda stage, a: w8a8_inputs(stage, "shared", rows, a))
    acts = None if kernel_acts is None else (lambda a: kernel_acts("shared", rows, a))
    deltas = None if lora is None else (lambda proj, v: lora.delta("shared_" + proj, None, rows, v))
    sh = _ffn(cfg, x, hw.shared_gate, hw.shared_up, hw.shared_down, rounding=rounding, activations=activations,
              quantized=fed, kernel_act=acts, down_magnitudes=down_magnitudes, lora=deltas, lora_plan=lora_plan)
    sh, d = sh if isinstance(sh, tuple) else (sh, None)
    if rounding == "grouped" and not down_magnitudes:
        sh = _stored_term(sh, d)
    if kernel_terms is not None and not down_magnitudes:
        sh = kernel_terms("shared", rows, sh)
    if cfg.has_shared_expert_gate:
        sh = sh * _sigmoid(x @ _vector(hw.shared_expert_gate, x.dtype))[:, None]
    return sh


# ----------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------

def moe_forward(cfg: MoeConfig, host_weights: HostWeights, x: Any, token_ids: Any = None, *,
                dtype=np.float64, ep_rank: Optional[int] = None, rounding: Optional[str] = None,
                owned_experts: Optional[Any] = None, activations: str = "bf16",
                w8a8_inputs: Optional[Callable] = None, absolute: Union[bool, str] = False,
                kernel_acts: Optional[Callable] = None, kernel_terms: Optional[Callable] = None,
                lora: Optional[Mapping[int, Any]] = None, lora_ids: Any = None, routing: Optional[Routing] = None,
                shared_expert: bool = True, lora_plan: bool = False) -> np.ndarray:
    """The MoE layer's output [N, H] in `dtype` for input `x` [N, H] (bf16 or float).

    Every step runs in `dtype` (float64 by default: the oracle; float32 to estimate what
    an fp32 kernel can achieve). Weights of any format are dequantized on the fly.

    Expert parallelism: with `cfg.ep_world_size > 1`, or when `ep_rank` is given (it
    overrides `cfg.ep_rank`), the result is that rank's PARTIAL output: the routed experts
    in its `owned_experts()` block, plus, on rank 0 only, the shared expert and the
    zero-expert identity terms. Summing the partials of ranks 0..ep_world_size-1 gives
    the full output, with the shared expert and identity terms counted exactly once.

    Hash routing needs `token_ids` [N] (ValueError without them).

    `owned_experts` replaces the contiguous block with an explicit set (cupymoe.parallel).

    `rounding` ("decode" or "grouped", see ROUNDINGS) also rounds to bf16 the intermediates
    that GPU path stores as bf16, and the weights it rounds (`kernel_weights`: a quantized
    router, fp8 experts in the grouped GEMM), everything else staying in `dtype`: the
    kernel-faithful reference that GPU tests compare against with a tight tolerance.
    None: exact.

    `activations="fp8_block"` is w8a8 (DeepSeek-V3's fp8 inference): the input of every
    fp8-block expert projection is quantized per row and 128-column group first
    (quantize_activations_fp8). It moves the output by ~4 % normwise (test_reference).
    `w8a8_inputs(stage, expert, rows, a)` replaces that quantization: `stage` "gate_up" or
    "down", `expert` an expert id or "shared", `rows` the token rows of `a`; it returns the
    dequantized values to multiply instead (verify.py feeds the kernels' own codes, so a
    comparison is not thrown off by one re-quantization flip, see there).

    `kernel_acts(expert, rows, a)` returns the activation rows the down projection of
    `expert` (an id or "shared") multiplies instead of the reference's own `a` (its bf16
    rounding included), where that input is not quantized: verify.check feeds the grouped
    path's stored activation, so a flip of that rounding upstream is not counted again in
    every output element the term reaches (see there). `kernel_terms(expert, rows, t)`
    likewise replaces the grouped path's bf16 terms (bf16(w * y) of a routed expert, the
    shared expert's bf16 output) with the ones the kernels stored; under rounding "decode",
    each expert's output y (before its routing weight, as the decode path stores it in fp32).

    `absolute=True` sums the magnitudes of the output's terms instead (each (row, slot)'s
    weighted expert output, identity term and shared expert output): what the grouped path
    rounds term by term, for verify.py's envelope. `absolute="down"` sums, over the same
    terms, |w| * sqrt(sum_i (a_i W_down,hi)^2) (the shared expert's gate in place of w,
    identity terms nothing): the scale of what the activation's bf16 rounding moves each
    output element by, which the products' cancellation does not shrink, for the same envelope.

    `lora` ({slot: cupymoe.lora.LoraWeights}) and `lora_ids` ([N] ints, -1 = base only, else a
    slot of `lora`): each row's adapter deltas (module docstring, "LoRA"). Without ids, or with
    every id -1, the result is the base layer's, bit for bit. LoraError names a bad id or module.
    `routing` (given_routing): the rows' expert ids and weights instead of the router's (the
    experts-only entry); `shared_expert=False` leaves the shared expert out.
    `lora_plan=True` (with `rounding`): the GPU's LoRA plans' stores too, on every row: g and u
    rounded to bf16 before the gate / up deltas, and on the grouped path down's delta (times w)
    added to the stored bf16 term and rounded again (docs/DESIGN.md section 9).
    """
    dtype = _checked_options(absolute, rounding, activations, dtype)
    if not isinstance(shared_expert, (bool, np.bool_)):  # "no" would read as true
        raise OptionError(f"shared_expert={shared_expert!r}: must be True or False")
    host_weights.validate(cfg, values=False)  # shapes only: a NaN in an expert nobody routes to is no error here
    host_weights = kernel_weights(host_weights, rounding, w8a8=activations == "fp8_block")
    owned, on_rank0 = _rank_share(cfg, ep_rank, owned_experts)
    xf = _as_input(cfg, x, dtype)
    rows = _lora_rows(cfg, lora, lora_ids, xf.shape[0])  # adapters are checked against the whole layer
    if not shared_expert:
        cfg, host_weights = without_shared_expert(cfg, host_weights)
    if rows is not None and absolute:
        raise LoraError(f"absolute={absolute!r} sums base terms only; it is not defined with LoRA rows")
    out = _layer_output(cfg, host_weights, xf, token_ids, owned, on_rank0, dtype=dtype,
                        rounding=rounding, activations=activations, w8a8_inputs=w8a8_inputs, absolute=absolute,
                        kernel_acts=kernel_acts, kernel_terms=kernel_terms, lora=rows, routing=routing,
                        lora_plan=lora_plan)
    return out.astype(dtype, copy=False)


def without_shared_expert(cfg: MoeConfig, hw: HostWeights) -> tuple[MoeConfig, HostWeights]:
    """The layer with its shared expert (and its gate) left out."""
    from dataclasses import replace

    return (cfg.replace(shared_expert_intermediate_size=0, has_shared_expert_gate=False),
            replace(hw, shared_gate=None, shared_up=None, shared_down=None, shared_expert_gate=None))


def _checked_options(absolute: Union[bool, str], rounding: Optional[str], activations: str, dtype) -> np.dtype:
    """Refuse moe_forward's options it has no meaning for; the computing dtype."""
    if absolute not in (False, True, "down"):
        raise OptionError(f"absolute={absolute!r}: must be False, True or 'down'")
    if rounding not in ROUNDINGS:
        raise OptionError(f"rounding={rounding!r}: must be one of {ROUNDINGS}")
    if activations not in ACTIVATIONS:
        raise OptionError(f"activations={activations!r}: must be one of {ACTIVATIONS}")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise OptionError(f"dtype={dtype!r}: the reference computes in float32 or float64") from None
    if dtype not in (np.float32, np.float64):
        raise OptionError(f"dtype={dtype}: the reference computes in float32 or float64")
    return dtype


def _rank_share(cfg: MoeConfig, ep_rank: Optional[int], owned_experts: Optional[Any]) -> tuple[Any, bool]:
    """The routed experts this rank computes, and whether it is rank 0 (the one adding the shared
    expert and the identity terms)."""
    if ep_rank is not None and not is_integer(ep_rank):  # int(1.9) and int(True) would pick rank 1
        raise OptionError(f"ep_rank={ep_rank!r}: a rank index (int) is required")
    rank = cfg.ep_rank if ep_rank is None else int(ep_rank)
    owned = cfg.replace(ep_rank=rank).owned_experts()  # validates the rank
    if owned_experts is not None:  # an explicit expert -> rank map's share for this rank
        owned = frozenset(_expert_ids(cfg, owned_experts))
    return owned, rank == 0


def _expert_ids(cfg: MoeConfig, ids: Any) -> list[int]:
    """`owned_experts` as routed expert ids, each an integer in 0..num_experts-1, else an OptionError."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise OptionError(f"owned_experts={ids!r}: expected a collection of expert ids")
    ids = list(ids)
    bad = [e for e in ids if not is_integer(e) or not 0 <= e < cfg.num_experts]
    if bad:
        raise OptionError(f"owned_experts holds {bad[:5]}: expert ids are integers in 0..{cfg.num_experts - 1}")
    return [int(e) for e in ids]


def _layer_output(cfg: MoeConfig, hw: HostWeights, xf: np.ndarray, token_ids: Any, owned: Any, on_rank0: bool, *,
                  dtype: np.dtype, rounding: Optional[str], activations: str, w8a8_inputs: Optional[Callable],
                  absolute: Union[bool, str], kernel_acts: Optional[Callable],
                  kernel_terms: Optional[Callable], lora: Optional["_LoraRows"] = None,
                  routing: Optional[Routing] = None, lora_plan: bool = False) -> np.ndarray:
    """moe_forward on checked options: this rank's routed experts, then rank 0's shared expert."""
    if routing is None:
        routing = _route(cfg, hw, xf, token_ids, lora)  # the router reads x, not the normed copy
    elif routing.ids.shape[0] != xf.shape[0]:
        raise MoeCallError(f"given routing has {routing.ids.shape[0]} rows, x {xf.shape[0]}")
    xe = expert_input(cfg, hw, xf, dtype=dtype)
    if rounding and cfg.pre_expert_norm:
        xe = _bf16(xe)
    out = _routed_experts(cfg, hw, xe, routing, owned, include_zero=on_rank0, rounding=rounding,
                          activations=activations, w8a8_inputs=w8a8_inputs, absolute=absolute,
                          kernel_acts=kernel_acts, kernel_terms=kernel_terms, lora=lora, lora_plan=lora_plan)
    if cfg.has_shared_expert and on_rank0:
        shared = _shared_expert(cfg, hw, xf, rounding, activations, w8a8_inputs, kernel_acts, kernel_terms,
                                down_magnitudes=absolute == "down", lora=lora, lora_plan=lora_plan)
        out = out + (np.abs(shared) if absolute else shared)
    return out


# ----------------------------------------------------------------------------------
# LoRA (section 1, step 7)
# ----------------------------------------------------------------------------------

def _plus(v: np.ndarray, delta: Optional[np.ndarray]) -> np.ndarray:
    return v if delta is None else v + delta


class _LoraRows:
    """The batch's adapters by row: `delta(target, expert, rows, v)` is each row's own module's
    `scale * B (A v)` (zero rows for rows without one), or None when no row of `rows` has one."""

    def __init__(self, lora: Mapping[int, Any], ids: np.ndarray):
        self.lora, self.ids = lora, ids

    def delta(self, target: str, expert: Optional[int], rows: np.ndarray, v: np.ndarray) -> Optional[np.ndarray]:
        slots = self.ids[rows]
        out = None
        for slot in np.unique(slots[slots >= 0]):
            m = self.lora[int(slot)].get(target, expert)
            if m is None:
                continue
            sel = slots == slot
            if out is None:
                out = np.zeros((len(rows), m.b.shape[0]), v.dtype)
            out[sel] = m.delta(v[sel])
        return out


def _lora_rows(cfg: MoeConfig, lora: Optional[Mapping[int, Any]], lora_ids: Any, n: int) -> Optional[_LoraRows]:
    """The checked ids as a _LoraRows; None when no row has an adapter (the base layer's bits)."""
    if lora_ids is None:
        return None
    ids = np.asarray(lora_ids)
    if ids.shape != (n,) or not np.issubdtype(ids.dtype, np.integer):
        raise LoraError(f"lora_ids: expected [{n}] integers (one per row of x), found shape {ids.shape} "
                        f"dtype {ids.dtype}")
    lora = dict(lora or {})
    bad = sorted(set(int(i) for i in np.unique(ids)) - set(lora) - {-1})
    if bad:
        raise LoraError(f"lora_ids holds {bad[:8]}: neither -1 (base) nor a slot of lora ({sorted(lora)})")
    for slot in set(int(i) for i in np.unique(ids)) - {-1}:
        if not isinstance(lora[slot], LoraWeights):
            raise LoraError(f"lora[{slot}]: expected a cupymoe.lora.LoraWeights, found {type(lora[slot]).__name__}")
        lora[slot].check(cfg)
    return None if (ids < 0).all() else _LoraRows(lora, ids.astype(np.int64))
