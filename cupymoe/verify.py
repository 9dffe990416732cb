"""Checking the GPU layer against cupymoe.reference: inputs, tolerances, the verify command.

Shared by the GPU tests and `python -m cupymoe verify`, so both judge by the same rule.

Tolerances for bf16 experts. The layer is compared with two references fed the very same
bf16 weights and input, both float64:

1. the exact layer (`rounding=None`). bf16 keeps 7 mantissa bits, so one rounding moves a
   value by at most 2^-8 of itself and by ~0.42 * 2^-8 rms over values spread across
   binades. The kernels store as bf16 the output, the activation (before the down
   projection), the pre-normed input, and on the grouped path each (row, slot)'s weighted
   output: up to four roundings of ~1.6e-3 rms each, ~3.2e-3 together, so the normwise
   error must stay under 2^-7 = 7.8e-3 (a wrong expert or a dropped term moves it by 1e-1
   or more; over few elements 2^-7 (1 + 6 / sqrt(elements)), exact_normwise_bound), and
   every element inside a loose envelope 2^-8 |ref| + 2^-5 rms(ref).
2. the kernel-faithful layer (`rounding="decode"` or `"grouped"`): the same float64 math
   with exactly those intermediates rounded to bf16. What remains is fp32 accumulation
   (~1e-6 relative), the output's own rounding (<= 2^-8 |ref| per element, ~1.6e-3
   normwise) and the rare intermediate that fp32 and float64 round to neighbouring bf16
   values: a 1-ulp flip, when the exact value sits within the fp32 error of a rounding
   boundary. A value whose terms cancel carries a larger relative fp32 error, so flips
   concentrate there; with k + 1 rounded terms per output element (grouped path) they
   touch up to ~1% of the elements, each by one ulp of one term (measured: 0.43% on a
   LongCat case with pre-norm and identity experts). So: normwise <= 2^-8, and at most
   1 element in 100 (rounded up: one of fewer than 100) beyond 2^-8 |ref| + 2^-8 rms(ref),
   every element also inside the exact reference's envelope above.
   On the grouped path one flip reaches many elements: a 1-ulp flip of one activation
   element moves its whole (row, slot) term by |W_down| ulp(act), and that term is rounded
   to bf16 in each of its H elements, so the shift flips many of those roundings at once (a
   `verify --seed 673820741` check, gpt_oss N = 3: 4 of 288 elements beyond the tight bound,
   each within one ulp of the output or of a term, the output the same on re-runs; 1.2 %
   once in a test at k = 12). So when the check has the layer (`check(layer=...)`), the
   faithful reference of the grouped path multiplies the activation the kernels stored
   (KernelActivations, read from the layer's scratch), and that activation is judged by
   itself against the reference's, by the same faithful rule: a wrong activation still
   fails there, and the output check no longer counts a legitimate flip once per element.

Quantized experts and routers (fp8_block, nvfp4, mxfp4). Both references are fed the
very same quantized weights, dequantized exactly in float64, so quantization error is not
part of any comparison; what the kernels add on top of the bf16 budget above:
- nvfp4 / mxfp4: nothing. code x group scale is exact in bf16 and fp32 (a 2-bit mantissa
  times a 4-bit one or a power of two); nvfp4's global scale multiplies fp32 dot products.
- fp8_block on the decode and atomic paths: nothing (the block scale multiplies the fp32
  dot product of each 8 codes).
- fp8_block on the grouped path: each weight is rounded once to bf16 for the tensor cores,
  relative <= 2^-8, ~1.6e-3 rms over weights spread across binades, like any value above.
  Independent errors under a K-term dot product move it by the same relative rms, so the
  three projections are three more roundings: seven of ~1.6e-3, ~4.3e-3 together (measured
  4.1e-3 normwise at N = 1000), still inside 2^-7 = 7.8e-3. The envelope's rms term is a
  multiple of the rounding budget, so it grows with it: 2^-5 * sqrt(7 / 4) (`roundings`).
  The faithful reference rounds the same weights the same way (reference.kernel_weights),
  so its tight bounds stay as they are.
- a quantized router is dequantized once at load to bf16 (the same single rounding, on the
  logits' inputs), modelled by the faithful reference; rows are redrawn until the
  rounded router and the exact one pick the same experts with a clear margin.
So the tolerances above hold for every format unchanged; none is widened.

The grouped path rounds each (row, slot)'s weighted output to bf16 and sums those terms
(and the shared expert's bf16 output): an element whose terms cancel carries up to 2^-8 of
the sum of their magnitudes, which can exceed 2^-8 |ref| + 2^-5 rms(ref) when the terms are
many times the element (seen on the H200: envelope 1.04 on one element of 400 000 at
N = 4099, with the faithful reference matched). The envelope adds 2^-8 sum |term| there
(`check`; reference.moe_forward(absolute=True)), as for the partials below.

The activation is stored as bf16 before the down projection on every path: each a_i moves
by an independent error of at most 2^-9 |a_i| (~2^-9 / sqrt(3) rms), so y_h = sum_i a_i W_hi
moves by a sum whose scale is S_h = sqrt(sum_i (a_i W_hi)^2), however much the products
cancel in y_h itself. Where they cancel (S_h many times |y_h|) neither 2^-8 |ref| nor the
rms term bounds it: an mxfp4 test with scale bytes 121..136 on alternate rows (outputs
spread over ~2^15 between rows) put an element 4.4 % off the exact reference with the
faithful one matched bit for bit (seed 1141835320; benchmarks/DECISIONS.md), and the faithful
reference alone, judged as an output, exceeds the old envelope on ~1 % of such draws. The
envelope adds DOWN_SPREAD = 2^-7 times S_h summed over the row's terms (|w| S_h each;
`check`, reference.moe_forward(absolute="down")): ~6.9 standard deviations of that error
if the roundings are uniform, far above it on no element of any draw tried. The faithful
check is unchanged.

Expert parallelism: each rank's partial output is stored as bf16 before the all-reduce
sums the partials, so an element whose partials cancel carries their roundings: at most
2^-8 sum_r |p_r| on top of the single-GPU error, which the envelope adds (`partials`);
the faithful model is the sum of the ranks' faithful partials each rounded to bf16.

Rows whose routing is a near tie (reference.route margin < 1e-4) are redrawn: fp32 logits
could legitimately pick the other expert there, which is not an error of the layer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import formats, reference, testing
from .config import MoeConfig
from .errors import ActivationNotKeptError, VerifyError
from .formats import BF16
from .host_weights import HostWeights

ROUTING_MARGIN = 1e-4
EXACT_NORMWISE = 2.0 ** -7
EXACT_ENVELOPE = (2.0 ** -8, 2.0 ** -5)  # (x |ref|, x rms(ref))
FAITHFUL_NORMWISE = 2.0 ** -8
DOWN_SPREAD = 2.0 ** -7  # the envelope's share of the down projections' root-sum-square products
FAITHFUL_TIGHT = (2.0 ** -8, 2.0 ** -8)
# the w8a8 path's stored terms against the reference's (check_w8a8): one ulp of the term
# (<= 2^-7 of it) on top of the absolute part, since the fp8 tensor cores' accumulation may
# round a term to the other bf16 neighbour of the exact value
TERM_TIGHT = (2.0 ** -7, 2.0 ** -8)
FAITHFUL_OUTLIERS = 1e-2

# Which intermediates each path rounds to bf16 (reference.moe_forward's `rounding`).
PATH_ROUNDING = {"decode": "decode", "atomic": "decode", "prefill": "grouped"}


def _normwise(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref)) / (float(np.linalg.norm(ref)) or 1.0)


@dataclass
class Comparison:
    unwritten: int  # NaN / inf elements (the output is poisoned with NaN first)
    normwise: float  # ||out - ref|| / ||ref|| against the exact reference
    envelope: float  # worst |out - ref| / envelope, <= 1 passes
    faithful_normwise: float = 0.0  # against the kernel-faithful reference (0: not checked)
    outliers: float = 0.0  # fraction of elements beyond the tight bound
    outliers_allowed: float = FAITHFUL_OUTLIERS  # 1 in 100, rounded up to whole elements
    exact_bound: float = EXACT_NORMWISE  # the normwise bound against the exact reference
    stages: Optional["Comparison"] = None  # grouped path: the activation stage (check, check_w8a8)
    terms: Optional["Comparison"] = None  # w8a8: the stored weighted terms (check_w8a8)
    codes_differ: int = 0  # w8a8: e4m3 codes or scales unlike quantizing the kernels' values
    w8a8: bool = False  # checked by check_w8a8

    @property
    def ok(self) -> bool:
        return (self.unwritten == 0 and self.normwise <= self.exact_bound and self.envelope <= 1.0
                and self.faithful_normwise <= FAITHFUL_NORMWISE and self.outliers <= self.outliers_allowed
                and self.codes_differ == 0 and (self.stages is None or self.stages.ok)
                and (self.terms is None or self.terms.ok))

    def __str__(self) -> str:
        text = (f"normwise {self.normwise:.2e} (faithful {self.faithful_normwise:.2e}), "
                f"envelope {self.envelope:.2f}, outliers {self.outliers:.1e}, unwritten {self.unwritten}")
        if self.stages is not None:
            text += (f"; {'w8a8 ' if self.w8a8 else ''}activation: faithful {self.stages.faithful_normwise:.2e}, "
                     f"outliers {self.stages.outliers:.1e}")
            if self.stages.unwritten:
                text += f", {self.stages.unwritten} rows the kernels did not compute"
            if self.terms is not None:
                text += f"; terms: faithful {self.terms.faithful_normwise:.2e}, outliers {self.terms.outliers:.1e}"
            if self.w8a8:
                text += f"; codes differing {self.codes_differ}"
        return text


BF16_ROUNDINGS = 4  # the bf16 budget above: output, activation, pre-normed input, weighted output


# w8a8 (fp8 experts on e4m3 tensor cores, activations quantized per row and 128 columns,
# cupymoe/reference.py quantize_activations_fp8). Against the exact reference, the two
# activation quantizations (3 mantissa bits: <= 2^-4 of each value, ~2.2 % rms) move the
# output by ~4 % normwise (test_reference; measured 2.9-4.5 % on the GPU). That is a mean
# over elements, so it scatters more the fewer elements a check has: the reference's own
# w8a8 model against the exact one, 400 draws per size of the tiny configs, had medians of
# 4.0-4.3 % everywhere but maxima of 8.0 % at 96 elements (N = 1, H = 96), 6.5 % at 160, 6.2 %
# at 288 (a kernel check at N = 1 had failed a flat 2^-4 at 6.35 %, its codes and faithful
# comparison exact). Bound: 2^-4 (1 + W8A8_SIZE_TERM / sqrt(elements)) (below: 7), 10.7 % at 96
# elements, 7.3 % at 1600, 2^-4 in the limit (test_reference checks the reference against it).
# Per element that error is heavy-tailed (a row's scale follows its largest value; the
# worst rows move by ~10 %), so no envelope against the exact reference is drawn; the
# element-wise rule is the faithful one below.
# A faithful reference that quantizes its own activation cannot be tight: the kernel's
# fp32 activation and float64's differ by their accumulation error, which is enough to
# round a bf16 value, and then its e4m3 code, to the neighbouring value; one e4m3 step is
# 6-12 % of the element, and a changed group maximum rescales the whole group (measured
# on the H200: 0.3-1 % normwise, up to 47 % of elements beyond the tight bound). So the
# w8a8 check goes stage by stage (check_w8a8), each stage fed the kernels' own inputs:
#   1. codes: the e4m3 codes and scales of the expert input and of the activation are
#      bitwise those of quantizing the kernels' own bf16 values (the quantizer is exact);
#   2. activation: the kernels' bf16 activation against float64 fed the kernels' input
#      codes: the faithful rule (one bf16 rounding, fp32 accumulation), a one-ulp flip an
#      outlier, not part of the normwise (discount_flips);
#   3. terms: the bf16 weighted terms the down GEMM stored, against float64 fed the kernels'
#      codes, each within one ulp (TERM_TIGHT): the fp8 tensor cores accumulate in less than
#      fp32 (promoted to fp32 every 128 k), far enough from float64 to round a term to its
#      other bf16 neighbour now and then, and each such flip would otherwise land in the
#      output check (`verify --seed 105763336`: 2 of 96 output elements); flips as in 2;
#   3b. output: against the faithful reference summing the kernels' terms: the faithful rule;
#      on the decode path the terms are the fp32 expert outputs y it stores (by the faithful
#      rule, FAITHFUL_TIGHT: fp32 values, the fp8 accumulation promoted every 128 k), and the
#      atomic path stores no routed y (it adds w * y in atomics), so its output is judged
#      against the reference fed the codes, a one-ulp flip an outlier (discount_flips);
#   4. against the exact reference: normwise <= w8a8_normwise_bound(elements).
W8A8_NORMWISE = 2.0 ** -4


# The size term: the error is a mean over elements and scatters more at few of them; the reference's own w8a8
# model at 96 elements reached 2^-4 (1 + 5.4 / sqrt(96)) in 20000 draws (scripts/normwise_tail.py,
# benchmarks/results/20261205-cpu-s30-w8a8-bound-tail.json), and its tail grows ~0.013 a decade of rarity,
# so 7 leaves about a decade more.
W8A8_SIZE_TERM = 7.0


def _sized(bound: float, size_term: float, elements: int) -> float:
    """A normwise bound over `elements`: a mean over elements scatters more the fewer there are."""
    return bound * (1.0 + size_term / math.sqrt(max(elements, 1)))


def w8a8_normwise_bound(elements: int) -> float:
    """The w8a8 output's normwise bound against the exact reference (the rules above)."""
    return _sized(W8A8_NORMWISE, W8A8_SIZE_TERM, elements)


# The bf16 bound, 2^-7, scatters likewise: with the LoRA plans' stores the faithful model alone passed it in
# up to 25 of 10000 single rows, the largest needing 2.9 (benchmarks/results/20261205-cpu-s31-exact-bound-tail.json,
# scripts/normwise_tail.py --rule faithful); 6 leaves about a decade of its tail and the kernels' own error.
EXACT_SIZE_TERM = 6.0


def exact_normwise_bound(elements: int) -> float:
    """The bf16 paths' normwise bound against the exact reference (EXACT_SIZE_TERM above)."""
    return _sized(EXACT_NORMWISE, EXACT_SIZE_TERM, elements)


def compare(out: np.ndarray, ref: np.ndarray, faithful: Optional[np.ndarray] = None, *,
            roundings: int = BF16_ROUNDINGS, partials: Optional[list] = None, w8a8: bool = False,
            tight: tuple = FAITHFUL_TIGHT, spread: Optional[np.ndarray] = None) -> Comparison:
    """Judge `out` against the exact reference `ref` (and the faithful one). `roundings`:
    how many bf16 roundings the path makes (`path_roundings`); `partials`: magnitudes of
    which the output may carry 2^-8 on top (the exact expert-parallel partials it sums, the
    grouped path's terms); `spread`: the down projections' root-sum-square products, of which
    it may carry DOWN_SPREAD (check, module docstring)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    bad = int(np.count_nonzero(~np.isfinite(out)))
    o = np.where(np.isfinite(out), out, 0.0)
    rms = float(np.sqrt(np.mean(ref ** 2))) or 1.0
    env = EXACT_ENVELOPE[0] * np.abs(ref) + EXACT_ENVELOPE[1] * np.sqrt(roundings / BF16_ROUNDINGS) * rms
    if partials is not None:
        env = env + EXACT_ENVELOPE[0] * sum(np.abs(np.asarray(p, dtype=np.float64)) for p in partials)
    if spread is not None:
        env = env + DOWN_SPREAD * np.asarray(spread, dtype=np.float64)
    worst = 0.0 if w8a8 else float((np.abs(o - ref) / env).max())  # w8a8: no envelope (above)
    c = Comparison(bad, _normwise(o, ref), worst, exact_bound=w8a8_normwise_bound(o.size) if w8a8 else exact_normwise_bound(o.size))
    if faithful is not None:
        f = np.asarray(faithful, dtype=np.float64)
        frms = float(np.sqrt(np.mean(f ** 2))) or 1.0
        bound = tight[0] * np.abs(f) + tight[1] * frms
        c.faithful_normwise = _normwise(o, f)
        c.outliers = float(np.mean(np.abs(o - f) > bound))
        # "1 in 100" of fewer than 100 elements (N = 1, H = 96) still allows one
        c.outliers_allowed = math.ceil(FAITHFUL_OUTLIERS * o.size) / o.size
    return c


def references(cfg: MoeConfig, hw: HostWeights, x: np.ndarray, path: str,
               token_ids: Optional[np.ndarray] = None, owned_experts=None,
               routing: Optional[reference.Routing] = None) -> tuple[np.ndarray, np.ndarray]:
    """(exact, kernel-faithful) reference outputs for a forward that took `path` (fp8
    experts as w8a16: for w8a8, check_w8a8); `owned_experts`: an expert-parallel rank's
    explicit share (reference.moe_forward)."""
    exact = reference.moe_forward(cfg, hw, x, token_ids, owned_experts=owned_experts, routing=routing)
    faithful = reference.moe_forward(cfg, hw, x, token_ids, rounding=PATH_ROUNDING[path], owned_experts=owned_experts,
                                     routing=routing)
    return exact, faithful


def path_roundings(hw: HostWeights, path: str) -> int:
    """bf16 roundings on `path` for these weights: the bf16 budget, plus the three
    projections' weights when the grouped GEMM rounds fp8 experts (module docstring)."""
    fp8 = any(formats.weight_format(getattr(hw, n)) == "fp8_block" for n in
              ("gate", "up", "down", "shared_gate", "shared_up", "shared_down") if getattr(hw, n) is not None)
    return BF16_ROUNDINGS + (3 if fp8 and PATH_ROUNDING[path] == "grouped" else 0)


def check(out: np.ndarray, cfg: MoeConfig, hw: HostWeights, x: np.ndarray, path: str,
          token_ids: Optional[np.ndarray] = None, layer=None, owned_experts=None,
          routing: Optional[reference.Routing] = None, shared_expert: bool = True) -> Comparison:
    """compare() against both references, with the rounding budget of `path` and `hw`.
    `layer`: the layer that computed `out`, read for how it ran fp8 experts: as w8a8 (on
    every path), the check is check_w8a8 (which reads the layer's intermediates, so call
    it before the layer runs again). `routing` (reference.given_routing) and `shared_expert`:
    an experts-only forward's (MoeLayer.forward_experts)."""
    if not shared_expert:
        cfg, hw = reference.without_shared_expert(cfg, hw)
    if layer is not None and layer.fp8_compute == "w8a8":
        return check_w8a8(out, layer, cfg, hw, x, token_ids, owned_experts, path, routing)
    # the activation's bf16 rounding where down's products cancel (module docstring)
    spread = reference.moe_forward(cfg, hw, x, token_ids, rounding=PATH_ROUNDING[path], absolute="down",
                                   owned_experts=owned_experts, routing=routing)
    terms = None
    if PATH_ROUNDING[path] == "grouped":  # each term rounded before the sum (module docstring)
        terms = [reference.moe_forward(cfg, hw, x, token_ids, rounding="grouped", absolute=True,
                                       owned_experts=owned_experts, routing=routing)]
        if layer is not None:  # the faithful reference fed the kernels' own activation
            acts = KernelActivations(layer, cfg, x.shape[0])
            exact = reference.moe_forward(cfg, hw, x, token_ids, owned_experts=owned_experts, routing=routing)
            faithful = reference.moe_forward(cfg, hw, x, token_ids, rounding="grouped", owned_experts=owned_experts,
                                             kernel_acts=acts.feed, routing=routing)
            c = compare(out, exact, faithful, roundings=path_roundings(hw, path), partials=terms, spread=spread)
            c.stages = acts.comparison()
            return c
    return compare(out, *references(cfg, hw, x, path, token_ids, owned_experts, routing),
                   roundings=path_roundings(hw, path),
                   partials=terms, spread=spread)


def _read_scratch(layer, name: str, dtype, shape) -> np.ndarray:
    """A copy of the first prod(shape) elements of the layer's scratch buffer `name`."""
    import cupy

    count = int(np.prod(shape))
    mem = cupy.cuda.UnownedMemory(layer.scratch.ptr(name), count * np.dtype(dtype).itemsize, layer)
    return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(mem, 0)).get().reshape(shape)


def _by_pair(entries: list) -> dict:
    """(expert, token) -> its stored rows as float64, in the order of the token's slots."""
    out: dict = {}
    for key, row in entries:
        out.setdefault(key, []).append(np.asarray(row, dtype=np.float64))
    return out


def _stored_rows(layer, cfg: MoeConfig, n: int) -> list:
    """(key, token, position, width) of each expert row of the layer's last forward of n
    tokens: routed pair p = token * k + j sits at pair_pos[p] (-1: an identity expert or
    another rank's), the shared expert's row of token t at pair_pos[n k + t]; key: the expert
    id or "shared"."""
    k = cfg.num_experts_per_tok
    P = n * k + (n if cfg.has_shared_expert else 0)
    ids = _read_scratch(layer, "topk_ids", np.int32, (n * k,))
    pair_pos = _read_scratch(layer, "pair_pos", np.int32, (P,))
    rows = []
    for p in range(P):
        pos = int(pair_pos[p])
        if pos < 0 or pos >= P:
            continue
        key = "shared" if p >= n * k else int(ids[p])
        token = p - n * k if p >= n * k else p // k
        width = cfg.shared_expert_intermediate_size if key == "shared" else cfg.moe_intermediate_size
        rows.append((key, token, pos, width))
    return rows


def require_kept_activation(layer, path: str) -> None:
    """Refuse to read the bf16 activation of a w8a8 forward that took the grouped `path` on a layer
    built without keep_w8a8_activation=True: its gate/up stored only the e4m3 codes, so the `act`
    scratch holds another forward's bytes."""
    if layer.plan.w8a8 and PATH_ROUNDING[path] == "grouped" and not layer.plan.keep_w8a8_activation:
        raise ActivationNotKeptError(
            f"the w8a8 {path} forward stored no bf16 activation to check: build the layer with "
            "MoeLayer(..., keep_w8a8_activation=True) to inspect it (cupymoe.verify's checks do)")


def _stored_activations(layer, cfg: MoeConfig, n: int, path: str):
    """_stored_rows of the layer's last forward of n tokens (which took `path`), and the bf16
    `act` buffer they index as float32 (require_kept_activation first)."""
    require_kept_activation(layer, path)
    P = n * cfg.num_experts_per_tok + (n if cfg.has_shared_expert else 0)
    rows = _stored_rows(layer, cfg, n)
    return rows, bits_to_f32(_read_scratch(layer, "act", np.uint16, (P, layer.weights.i_max)))


class StoredRows:
    """Rows the kernels stored in the layer's last forward, by (expert, token), for a
    reference.moe_forward hook (`kernel_acts`, `kernel_terms`) to take in place of its own.
    `feed` keeps the reference's rows next to the kernels', and `comparison()` judges those
    by the faithful rule with `tight` (both are bf16 values: a flip is the rule's to count,
    so no envelope). A row the reference asks for that the kernels did not compute (a
    different expert chosen) is counted as unwritten: the check fails."""

    def __init__(self, rows: dict, tight: tuple = FAITHFUL_TIGHT):
        self.rows = rows  # (expert, token) -> that token's rows for that expert, in slot order (_by_pair)
        self.tight = tight
        self.kernel: list[np.ndarray] = []
        self.reference: list[np.ndarray] = []
        self.missing = 0

    def feed(self, expert, rows: np.ndarray, a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, dtype=np.float64)
        got, taken = [], {}
        for i, t in enumerate(rows):  # a token naming an expert twice (the experts-only entry): its slots in order
            nth = taken[int(t)] = taken.get(int(t), -1) + 1
            stored = self.rows.get((expert, int(t)), [])
            row = stored[nth] if nth < len(stored) else None
            if row is None or row.shape != a[i].shape:
                self.missing += 1
                row = a[i]
            got.append(row)
        got = np.stack(got)
        self.reference.append(a)
        self.kernel.append(got)
        return got

    def comparison(self) -> Optional[Comparison]:
        if not self.reference:
            return None
        ref = np.concatenate([a.ravel() for a in self.reference])
        got = np.concatenate([a.ravel() for a in self.kernel])
        c = compare(got, ref, ref, tight=self.tight)
        c.envelope = 0.0
        c.unwritten += self.missing
        if self.tight == TERM_TIGHT:  # the w8a8 terms: out of the fp8 tensor cores too
            discount_flips(c, got, ref, self.tight)
        return c


class KernelActivations(StoredRows):
    """The grouped path's bf16 activations of the layer's last forward (module docstring:
    the faithful reference fed the kernels' activation), for `kernel_acts`."""

    def __init__(self, layer, cfg: MoeConfig, n: int):
        rows, act = _stored_activations(layer, cfg, n, "prefill")
        super().__init__(_by_pair([((key, token), act[pos, :width]) for key, token, pos, width in rows]))


class KernelTerms(StoredRows):
    """The w8a8 path's stored terms (`yw`: bf16(w * y) of each routed pair, the shared
    expert's bf16 output) of the layer's last forward, for `kernel_terms`, judged within one
    ulp of the reference's (TERM_TIGHT)."""

    def __init__(self, layer, cfg: MoeConfig, n: int):
        rows = _stored_rows(layer, cfg, n)
        P, H = n * cfg.num_experts_per_tok + (n if cfg.has_shared_expert else 0), cfg.hidden_size
        yw = bits_to_f32(_read_scratch(layer, "yw", np.uint16, (P, H)))
        super().__init__(_by_pair([((key, token), yw[pos]) for key, token, pos, _ in rows]), TERM_TIGHT)


def _quantize_rows_fp8(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes as bytes, fp32 scales) of rows `a`, per 128 columns: what the kernels'
    quantizers (quant.cuh: in top-k, the norm and the gate/up epilogue) must produce bit
    for bit (reference.quantize_activations_fp8's rule)."""
    n, k = a.shape
    kb = -(-k // formats.FP8_BLOCK)
    q = np.zeros((n, k), dtype=np.uint8)
    s = np.zeros((n, kb), dtype=np.float32)
    for b in range(kb):
        cols = slice(b * formats.FP8_BLOCK, (b + 1) * formats.FP8_BLOCK)
        g = a[:, cols].astype(np.float32)
        sc = (np.abs(g).max(axis=1) / np.float32(formats.E4M3_MAX)).astype(np.float32)
        safe = np.where(sc > 0, sc, np.float32(1))
        q[:, cols] = np.clip(g / safe[:, None], -formats.E4M3_MAX, formats.E4M3_MAX).astype(formats.E4M3).view(np.uint8)
        s[:, b] = sc
    return q, s


def _dequantize_rows_fp8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    out = q.view(formats.E4M3).astype(np.float64)
    return out * np.repeat(s.astype(np.float64), formats.FP8_BLOCK, axis=1)[:, :q.shape[1]]


class KernelOutputs(StoredRows):
    """The decode path's expert outputs of the layer's last forward (`y`: fp32, unweighted,
    by position), for `kernel_terms` under rounding "decode". fp32 values, so the faithful
    rule judges them (FAITHFUL_TIGHT) and a w8a8 forward's fp8 accumulation (promoted to
    fp32 every 128 k) must stay within it."""

    def __init__(self, layer, cfg: MoeConfig, n: int):
        rows = _stored_rows(layer, cfg, n)
        P, H = n * cfg.num_experts_per_tok + (n if cfg.has_shared_expert else 0), cfg.hidden_size
        y = _read_scratch(layer, "y", np.float32, (P, H))
        super().__init__(_by_pair([((key, token), y[pos]) for key, token, pos, _ in rows]))


class W8a8Stages:
    """The w8a8 path's intermediates of the layer's last forward (on input `x`, taking `path`),
    read from its scratch: the e4m3 codes of the expert input (by token) and of the
    activation (by expert and token; the shared expert's key is "shared"), and the bf16
    activation, for the experts whose weights are fp8 (the others take no codes). `codes_differ` counts codes and scales unlike quantizing the kernels' own
    bf16 values. `feed` is reference.moe_forward's `w8a8_inputs`: it hands the reference
    the kernels' codes and keeps the reference's activation rows next to the kernels'. On the
    grouped path the layer must keep its bf16 activation (require_kept_activation)."""

    def __init__(self, layer, cfg: MoeConfig, hw: HostWeights, x: np.ndarray, path: str = "prefill"):
        require_kept_activation(layer, path)  # before any scratch is read
        n, H, k = x.shape[0], cfg.hidden_size, cfg.num_experts_per_tok
        i_max, kb_h, kb_i = layer.weights.i_max, -(-H // formats.FP8_BLOCK), -(-layer.weights.i_max // formats.FP8_BLOCK)
        x_bf16 = bits_to_f32(bf16_bits(x))
        self.codes_differ = 0
        # the gate/up inputs: the expert input (the pre-expert norm's output, or x), and x for
        # an fp8 shared expert behind a norm
        expert_input = bits_to_f32(_read_scratch(layer, "xe", np.uint16, (n, H))) if cfg.pre_expert_norm else x_bf16
        self.inputs = {}
        for key, qname, sname, src in (("routed", "qx", "sx", expert_input),
                                       ("shared", "qx_shared", "sx_shared", x_bf16)):
            if key == "shared" and not layer.plan.w8a8_shared_x:
                self.inputs[key] = self.inputs["routed"]  # no norm: the same rows
                continue
            q, sc = _read_scratch(layer, qname, np.uint8, (n, H)), _read_scratch(layer, sname, np.float32, (n, kb_h))
            want_q, want_s = _quantize_rows_fp8(src)
            self.codes_differ += int(np.count_nonzero(q != want_q) + np.count_nonzero(sc != want_s))
            self.inputs[key] = _dequantize_rows_fp8(q, sc)
        # the activations (and their codes), by position (_stored_activations)
        P = n * k + (n if cfg.has_shared_expert else 0)
        rows, act = _stored_activations(layer, cfg, n, path)
        qact, sact = _read_scratch(layer, "qact", np.uint8, (P, i_max)), _read_scratch(layer, "sact", np.float32, (P, kb_i))
        fp8 = {"routed": formats.weight_format(hw.down) == "fp8_block",
               "shared": formats.weight_format(hw.shared_down) == "fp8_block"}
        self.act, self.act_codes = {}, {}
        for key, token, pos, width in rows:
            if not fp8["shared" if key == "shared" else "routed"]:
                continue
            a = act[pos:pos + 1, :width]
            want_q, want_s = _quantize_rows_fp8(a)
            kb = want_s.shape[1]
            self.codes_differ += int(np.count_nonzero(qact[pos:pos + 1, :width] != want_q)
                                     + np.count_nonzero(sact[pos:pos + 1, :kb] != want_s))
            self.act[key, token] = a[0].astype(np.float64)
            self.act_codes[key, token] = _dequantize_rows_fp8(qact[pos:pos + 1, :width], sact[pos:pos + 1, :kb])[0]
        self.kernel_acts: list[np.ndarray] = []
        self.reference_acts: list[np.ndarray] = []

    def feed(self, stage: str, expert, rows: np.ndarray, a: np.ndarray) -> np.ndarray:
        if stage == "gate_up":
            return self.inputs["shared" if expert == "shared" else "routed"][rows]
        self.reference_acts.append(np.asarray(a, dtype=np.float64))
        self.kernel_acts.append(np.stack([self.act[expert, int(t)] for t in rows]))
        return np.stack([self.act_codes[expert, int(t)] for t in rows])


def discount_flips(c: Comparison, out: np.ndarray, ref: np.ndarray, tight: tuple = FAITHFUL_TIGHT) -> None:
    """For the stages the fp8 tensor cores produce (w8a8's activation and stored terms),
    whose accumulation is not fp32's, so a bf16 value may round to its other neighbour: an
    element beyond the tight bound but within one bf16 ulp of the reference is such a flip,
    the outlier rule's to count (at most 1 in 100), and left out of the faithful normwise.
    At N = 1 one flip on an element holding 63 % of the activation's norm measured 4.9e-3
    normwise, above 2^-8, with every element within one ulp (`verify --seed 129993660`,
    qwen2_moe fp8_block). An element off by more than one ulp still counts in full."""
    o = np.asarray(out, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    err = np.abs(np.where(np.isfinite(o), o, 0.0) - r)
    rms = float(np.sqrt(np.mean(r ** 2))) or 1.0
    flip = (err > tight[0] * np.abs(r) + tight[1] * rms) & (err <= bf16_ulp(r))
    c.faithful_normwise = _normwise(np.where(flip, r, o), r)


def check_w8a8(out: np.ndarray, layer, cfg: MoeConfig, hw: HostWeights, x: np.ndarray,
               token_ids: Optional[np.ndarray] = None, owned_experts=None, path: str = "prefill",
               routing: Optional[reference.Routing] = None) -> Comparison:
    """A w8a8 forward that took `path`, stage by stage (the rules above the Comparison
    class): the kernels' codes, their activation against float64 fed their input codes,
    their stored terms against float64 fed their codes (grouped: the bf16 weighted terms,
    within one ulp, TERM_TIGHT; decode: the fp32 expert outputs, by the faithful rule), the
    output against the faithful reference summing their terms, and the output against the
    exact one. The atomic path stores no routed outputs (it adds them into fp32 atomics):
    its output is judged against the faithful reference fed the codes, a one-ulp flip an
    outlier (discount_flips: the fp8 accumulation may round an output to its other
    neighbour)."""
    rounding = PATH_ROUNDING[path]
    stages = W8a8Stages(layer, cfg, hw, x, path)
    terms = (KernelTerms(layer, cfg, x.shape[0]) if rounding == "grouped"
             else KernelOutputs(layer, cfg, x.shape[0]) if path == "decode" else None)
    exact = reference.moe_forward(cfg, hw, x, token_ids, owned_experts=owned_experts, routing=routing)
    faithful = reference.moe_forward(cfg, hw, x, token_ids, rounding=rounding, activations="fp8_block",
                                     w8a8_inputs=stages.feed, kernel_terms=terms.feed if terms else None,
                                     owned_experts=owned_experts, routing=routing)
    c = compare(out, exact, faithful, w8a8=True)
    if terms is None:
        discount_flips(c, out, faithful)
    else:
        c.terms = terms.comparison()
    c.w8a8 = True
    c.codes_differ = stages.codes_differ
    if stages.reference_acts:
        ref_act = np.concatenate([a.ravel() for a in stages.reference_acts])
        kernel_act = np.concatenate([a.ravel() for a in stages.kernel_acts])
        c.stages = compare(kernel_act, ref_act, ref_act)
        # both sides are bf16 values out of the fp8 tensor cores: a 1-ulp flip (up to 2^-7 of
        # the value) is the faithful rule's to count as an outlier (discount_flips), not an
        # error against the exact envelope (2^-8: one rounding)
        c.stages.envelope = 0.0
        discount_flips(c.stages, kernel_act, ref_act)
    return c


def well_separated_input(cfg: MoeConfig, hw: HostWeights, rng: np.random.Generator, n: int,
                         token_ids: Optional[np.ndarray] = None, *, lora=None, lora_ids=None) -> np.ndarray:
    """A random bf16 input whose every row routes with a clear margin (redraws near ties); `lora` /
    `lora_ids` (reference.route's): under the rows' adapters, whose router deltas move the margins."""
    x = testing.random_input(rng, n, cfg.hidden_size)
    # a quantized router runs as bf16 (reference.kernel_weights): both must agree, clearly
    kernel_hw = reference.kernel_weights(hw, "decode")
    for _ in range(50):
        exact = reference.route(cfg, hw, x, token_ids, lora=lora, lora_ids=lora_ids)
        margin = exact.margin
        if kernel_hw.router is not hw.router:
            held = reference.route(cfg, kernel_hw, x, token_ids, lora=lora, lora_ids=lora_ids)
            margin = np.where((held.ids == exact.ids).all(axis=1), np.minimum(margin, held.margin), 0.0)
        close = np.flatnonzero(margin < ROUTING_MARGIN)
        if close.size == 0:
            return x
        x[close] = testing.random_input(rng, close.size, cfg.hidden_size)
    raise VerifyError(f"could not draw {n} rows with routing margin >= {ROUTING_MARGIN}")


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """One unit in the last place of bf16 (8 significant bits) at each |v|; zero's: the least normal's."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(np.asarray(v, np.float64)), 2.0 ** -126))) - 7)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a).astype(BF16)).view(np.uint16)


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def run_layer(layer, x: np.ndarray, path: Optional[str] = None, token_ids: Optional[np.ndarray] = None,
              stream=None, lora_ids: Optional[np.ndarray] = None) -> np.ndarray:
    """Upload x, poison the output with NaN, run one forward, return the output as float32 (`lora_ids`:
    each row's adapter slot, -1 = base)."""
    import cupy

    s = stream or cupy.cuda.Stream(non_blocking=True)
    with s:  # the upload and the poison on the forward's own stream: ordered before it
        xd = cupy.asarray(bf16_bits(x))
        out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)  # bf16 NaN: unwritten elements fail
        tids, lids = (None if a is None else cupy.asarray(a.astype(np.int32)) for a in (token_ids, lora_ids))
        layer(xd, out=out, token_ids=tids, path=path, stream=s.ptr, lora_ids=lids)
    s.synchronize()
    return bits_to_f32(out.get())


DECODE_LIMIT = 64  # the decode and atomic paths are checked up to this many rows
# `python -m cupymoe verify`'s defaults (scripts/verify_replay.py replays them)
VERIFY_TOKENS = (1, 3, 17, 64, 1000)
VERIFY_PATHS = ("decode", "atomic", "prefill")
VERIFY_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")


def verify_families(families, tokens, paths, *, formats_=("bf16",), seed: Optional[int] = None) -> int:
    """The main job: every family's layer, in every weight format, on this GPU against the
    float64 reference, on every path (decode and atomic up to DECODE_LIMIT rows)."""
    from .layer import MoeLayer

    seed = int(time.time_ns() % 2**31) if seed is None else seed
    rng = np.random.default_rng(seed)
    print(f"cupymoe verify: seed {seed}, tokens {tokens}, paths {paths}, formats {list(formats_)}")
    failures = checked = 0
    small = min(DECODE_LIMIT, max(tokens))
    for fam in families:
        cfg = testing.tiny_config(fam)
        for fmt in formats_:
            hw = testing.random_host_weights(cfg, rng, fmt)
            t0 = time.perf_counter()
            # the w8a8 checks read the prefill gate/up's bf16 activation (require_kept_activation)
            layer = MoeLayer(cfg, hw, max_tokens=max(tokens), decode_max_tokens=small, atomic_max_tokens=small,
                             keep_w8a8_activation=True)
            print(f"  {fam} {fmt}: layer built in {time.perf_counter() - t0:.2f} s", flush=True)
            for n in tokens:
                tids = testing.random_token_ids(rng, n, cfg.hash_vocab_size) if cfg.hash_routing else None
                x = well_separated_input(cfg, hw, rng, n, tids)
                for p in paths:
                    if p != "prefill" and n > small:
                        continue
                    c = check(run_layer(layer, x, p, tids), cfg, hw, x, layer.select_path(n, p), tids, layer)
                    failures += not c.ok
                    checked += 1
                    print(f"    N={n:<5} {p:<7} {'ok  ' if c.ok else 'FAIL'} {c}", flush=True)
    print(f"cupymoe verify: {checked} checks, {'all passed' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0
