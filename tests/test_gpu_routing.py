"""GPU: topk_route (cuda/topk.cu) on planted logits against cupymoe.reference's selection.
Group-limited routers (DeepSeek-V3's) route from registers in topk_route<1> where the groups
are whole registers (route_row_regs<8>), else by route_row; test_topk_route_groups_as_the_reference.

topk_route routes a row from registers (routing.cuh route_row_vec) where the router fits
(no hash table, no groups, k <= 32, R a multiple of 4 in 16..512), and by route_row's
shared-memory rounds otherwise or where more than 32 entries tie at its threshold. Both
must pick what the reference picks: the k largest selection scores, ties to the lower id.
The logits are random but for planted rows: every entry equal (the fallback), 40 tied at
the top (the fallback), k + 2 tied at the top (ties broken in registers), the best entries
in the last columns (the lanes past R's last float4). Weights: float32 arithmetic against
float64, within 1e-5 relative (a softmax over R <= 512 terms and a sum of k <= 32). Random
rows whose best scores lie closer than float32 resolves are not judged (the layer tests
skip such near-ties by the reference's margin too); the planted ones always are.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import reference

pytestmark = pytest.mark.gpu

TOPK_WARPS = 4  # cuda/topk.cu
TOPK_MAX_K = 64  # cuda/routing.cuh

# (R, k, scoring, topk_then_softmax, correction bias, renormalise, scale)
CASES = [
    (512, 10, "softmax", False, False, True, 1.0),  # qwen3-next-80b
    (128, 8, "softmax", False, False, True, 1.0),  # qwen3-30b-a3b
    (128, 4, "softmax", True, False, False, 1.0),  # gpt-oss: top-k, then softmax over the k
    (300, 6, "sigmoid", False, True, True, 2.5),  # a partial last float4 group of lanes
    (256, 8, "sqrtsoftplus", False, True, False, 1.5),
    (100, 3, "softmax", False, False, False, 1.0),
    (512, 32, "sigmoid", False, True, True, 1.0),  # the most picks the register path takes
    (18, 2, "softmax", False, False, True, 1.0),  # R % 4 != 0: route_row only
    (512, 40, "sigmoid", False, False, True, 1.0),  # k > 32: route_row only
]
SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}  # catalog.Scoring


def _planted_logits(rng, n: int, R: int, k: int) -> np.ndarray:
    logits = (rng.standard_normal((n, R)) * 2.0).astype(np.float32)
    logits[0] = 0.5  # every entry ties
    tie = min(40, R)
    top = rng.choice(R, size=tie, replace=False)
    logits[1, top] = logits[1].max() + 1.0  # 40 tied at the top
    top = rng.choice(R, size=min(k + 2, R), replace=False)
    logits[2, top] = logits[2].max() + 1.0  # k + 2 tied at the top
    # the last columns, apart enough that float32 scores keep them apart (a sigmoid of
    # max + k saturates to 1.0, and a softmax with steps of 1 leaves the other entries'
    # scores below the correction bias's rounding)
    logits[3, R - k:] = logits[3].max() + 0.05 * np.arange(1, k + 1, dtype=np.float32)
    return logits


PLANTED = 4  # rows 0-3


def _separated(c: np.ndarray, k: int) -> np.ndarray:
    """Rows whose k + 1 best selection scores lie apart by more than float32 resolves (2e-6
    relative): there the kernel's float32 scores order them as the float64 reference does.
    Elsewhere a near-tie (not an exact one) may go either way, in the layer as here."""
    top = -np.sort(-c, axis=-1)[:, : k + 1]
    gaps = np.abs(np.diff(top, axis=-1)).min(axis=-1)
    return gaps > 2e-6 * (1.0 + np.abs(top).max(axis=-1))


def _chosen_apart(c: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows whose chosen experts' scores lie apart by more than float32 resolves: the ids are listed
    best first, and closer ones may be listed in either order (a selection margin judges only which
    ids are chosen)."""
    chosen = c[np.arange(c.shape[0])[:, None], ids]
    return np.abs(np.diff(chosen, axis=-1)).min(axis=-1) > 2e-6 * (1.0 + np.abs(c).max(axis=-1))


def _expected(logits: np.ndarray, k: int, scoring: str, tts: bool, bias, renorm: bool, scale: float):
    l = logits.astype(np.float64)
    rows = np.arange(l.shape[0])[:, None]
    if tts:
        c = l
        ids = np.argsort(-l, axis=-1, kind="stable")[:, :k]
        e = np.exp(l[rows, ids] - l[rows, ids].max(axis=-1, keepdims=True))
        w = e / e.sum(axis=-1, keepdims=True)
    else:
        if scoring == "softmax":
            e = np.exp(l - l.max(axis=-1, keepdims=True))
            s = e / e.sum(axis=-1, keepdims=True)
        elif scoring == "sigmoid":
            s = 1.0 / (1.0 + np.exp(-l))
        else:
            s = np.sqrt(np.logaddexp(0.0, l))
        c = s + bias if bias is not None else s
        ids = np.argsort(-c, axis=-1, kind="stable")[:, :k]
        w = s[rows, ids]
        if renorm:
            w = w / (w.sum(axis=-1, keepdims=True) + reference.NORM_EPS)
    return ids, w * scale, c


def _run_topk_route(group_regs: int, logits, bias, k: int, scoring: int, n_group: int, topk_group: int, tts: bool,
                    renorm: bool, scale: float):
    """topk_route<group_regs> on planted logits, its outputs poisoned first: (ids, weights),
    after checking that every output was written and no error raised."""
    got_ids, got_w, err = _launch_topk_route(group_regs, logits, bias, k, scoring, n_group, topk_group, tts, renorm,
                                             scale)
    assert (got_ids >= 0).all() and np.isfinite(got_w).all(), "an unwritten or non-finite output"
    assert err == 0
    return got_ids, got_w


def _launch_topk_route(group_regs: int, logits, bias, k: int, scoring: int, n_group: int, topk_group: int, tts: bool,
                       renorm: bool, scale: float):
    """topk_route<group_regs>'s (ids, weights, error bits), its outputs poisoned first (-7, NaN)."""
    import cupy

    from cupymoe import jit

    n, R = logits.shape
    d_logits = cupy.asarray(logits)
    d_bias = cupy.asarray(bias) if bias is not None else None
    null = np.uint64(0)
    ids = cupy.full((n, k), -7, dtype=cupy.int32)  # poisoned: an unwritten entry fails
    w = cupy.full((n, k), cupy.nan, dtype=cupy.float32)
    err = cupy.zeros(1, dtype=cupy.int32)
    jit.library(0)[f"topk_route<{group_regs}>"](
        ((n + TOPK_WARPS - 1) // TOPK_WARPS,), (TOPK_WARPS * 32,),
        (d_logits, d_bias if d_bias is not None else null, null, null, ids, w, err,
         np.int32(n), np.int32(R), np.int32(R), np.int32(k), np.int32(scoring), np.int32(n_group),
         np.int32(topk_group), np.int32(int(tts)), np.int32(int(renorm)), np.float32(scale), np.int32(0),
         np.int32(1)),
        shared_mem=TOPK_WARPS * (2 * R + TOPK_MAX_K) * 4)
    cupy.cuda.runtime.deviceSynchronize()
    return cupy.asnumpy(ids), cupy.asnumpy(w), int(err[0])


@pytest.mark.parametrize("case", CASES, ids=[f"R{c[0]}-k{c[1]}-{c[2]}{'-tts' if c[3] else ''}" for c in CASES])
def test_topk_route_picks_what_the_reference_picks(case, rng):
    R, k, scoring, tts, has_bias, renorm, scale = case
    n = 203  # not a multiple of the block's 4 rows
    logits = _planted_logits(rng, n, R, k)
    # a bias of exact multiples of 2^-6 steers the choice without breaking the planted ties
    bias = (rng.integers(-8, 9, size=R) / 64.0).astype(np.float32) if has_bias else None
    ids_exp, w_exp, c = _expected(logits, k, scoring, tts, bias.astype(np.float64) if bias is not None else None,
                               renorm, scale)

    got_ids, got_w = _run_topk_route(0, logits, bias, k, SCORING[scoring], 1, 1, tts, renorm, scale)
    judged = _separated(c, k)
    judged[:PLANTED] = True  # exact ties, or planted apart: both orders agree
    assert judged[PLANTED:].mean() > 0.8, f"only {judged[PLANTED:].sum()} of {n - PLANTED} random rows separated"
    bad = np.nonzero(judged & (got_ids != ids_exp).any(axis=1))[0]
    assert bad.size == 0, f"rows {bad[:8].tolist()}: ids {got_ids[bad[0]].tolist()} vs {ids_exp[bad[0]].tolist()}"
    np.testing.assert_allclose(got_w[judged], w_exp[judged], rtol=1e-5, atol=1e-7)


# group-limited routing (DeepSeek-V3's): (R, n_group, topk_group, k, scoring, bias, renorm,
# scale). Groups of 32 experts (whole registers) route from registers (route_row_regs<8>, R <=
# 256); groups of 16 and R = 512 by route_row's shared-memory rounds.
GROUPED_CASES = [
    (256, 8, 4, 8, "sigmoid", True, True, 2.5),  # deepseek-v3 (a group a register: its top two by warp reductions)
    (256, 4, 2, 8, "sigmoid", True, True, 1.0),  # groups of two registers: the lanes' top twos merged
    (64, 2, 1, 6, "softmax", False, False, 1.0),
    (128, 8, 3, 4, "sigmoid", True, True, 1.0),  # groups of 16: shared memory
    (512, 16, 4, 8, "sigmoid", True, True, 1.0),  # past 256: shared memory
]


@pytest.mark.parametrize("variant", [1, 0])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=[f"R{c[0]}-g{c[1]}of{c[2]}-k{c[3]}" for c in GROUPED_CASES])
def test_topk_route_groups_as_the_reference(case, variant, rng):
    """topk_route (<1>: groups of whole registers from registers, <0>: by route_row's shared
    memory) keeps the topk_group groups of the best two-score sums and picks the k best inside
    them, as reference._select_grouped (ties to the lower group and id); the weights
    within 1e-5 relative. Rows whose group or expert choice lies closer than float32
    resolves (the reference's margin) are not judged; without a correction bias the planted
    exact ties (every entry tied; k + 2 tied at the top) always are. Rows whose chosen experts'
    scores lie that close are not judged either: their ids may be listed in either order."""
    import types

    from cupymoe import reference

    R, n_group, topk_group, k, scoring, has_bias, renorm, scale = case
    n = 131
    logits = _planted_logits(rng, n, R, k)
    bias = (rng.integers(-8, 9, size=R) / 64.0).astype(np.float32) if has_bias else None
    _, _, c = _expected(logits, k, scoring, False, bias.astype(np.float64) if bias is not None else None,
                        renorm, scale)
    cfg = types.SimpleNamespace(n_group=n_group, topk_group=topk_group, num_experts_per_tok=k)
    ids_exp, margin = reference._select_grouped(cfg, c)
    l = logits.astype(np.float64)
    s = (np.exp(l - l.max(axis=-1, keepdims=True)) / np.exp(l - l.max(axis=-1, keepdims=True)).sum(-1, keepdims=True)
         if scoring == "softmax" else 1.0 / (1.0 + np.exp(-l)))
    w_exp = s[np.arange(n)[:, None], ids_exp]
    if renorm:
        w_exp = w_exp / (w_exp.sum(axis=-1, keepdims=True) + reference.NORM_EPS)
    w_exp *= scale

    got_ids, got_w = _run_topk_route(variant, logits, bias, k, SCORING[scoring], n_group, topk_group, False, renorm,
                                     scale)
    judged = (margin > 2e-6 * (1.0 + np.abs(c).max(axis=-1))) & _chosen_apart(c, ids_exp)
    if not has_bias:  # every entry tied; k + 2 tied at the top: exact ties in float32 too
        judged[[0, 2]] = True
    assert judged[PLANTED:].mean() > 0.8, f"only {judged[PLANTED:].sum()} of {n - PLANTED} random rows separated"
    bad = np.nonzero(judged & (got_ids != ids_exp).any(axis=1))[0]
    assert bad.size == 0, f"rows {bad[:8].tolist()}: ids {got_ids[bad[0]].tolist()} vs {ids_exp[bad[0]].tolist()}"
    np.testing.assert_allclose(got_w[judged], w_exp[judged], rtol=1e-5, atol=1e-7)


ROUTER_NAN = 8  # cuda/routing.cuh ERR_ROUTER_NAN (plan.ErrorBit.ROUTER_NAN)
# (R, k, scoring, topk_then_softmax, n_group, topk_group): every selection path (the register
# path's fallback to route_row's rounds, the group-limited register and shared-memory paths)
NAN_CASES = [(c[0], c[1], c[2], c[3], 1, 1) for c in CASES] + [
    (256, 8, "sigmoid", False, 8, 4), (256, 4, "sigmoid", False, 4, 2), (512, 8, "sigmoid", False, 16, 4)]


@pytest.mark.parametrize("variant", [1, 0])
@pytest.mark.parametrize("case", NAN_CASES, ids=[f"R{c[0]}-k{c[1]}-{c[2]}{'-tts' if c[3] else ''}-g{c[4]}"
                                                 for c in NAN_CASES])
def test_topk_route_flags_nan_logits_and_routes_the_other_rows_as_without_them(case, variant, rng):
    """A row of NaN logits (NaN in x or the router) sets ERR_ROUTER_NAN; its picks that find no
    non-NaN score are id -1 with weight 0 (no expert), and a pick whose weight is NaN keeps it
    (the reference's output is NaN there). A row with one NaN logit: under softmax every score
    is NaN (flagged the same way); element-wise scores never pick the NaN entry. Every other row
    gets the bits it gets without the NaN rows (one warp a row)."""
    R, k, scoring, tts, n_group, topk_group = case
    n = 9
    logits = _planted_logits(rng, n, R, k)
    clean = _launch_topk_route(variant, logits, None, k, SCORING[scoring], n_group, topk_group, tts, True, 1.0)
    assert clean[2] == 0
    col = int(clean[0][5, 0])  # row 5's first pick, made NaN
    logits[2] = np.nan
    logits[5, col] = np.nan
    ids, w, err = _launch_topk_route(variant, logits, None, k, SCORING[scoring], n_group, topk_group, tts, True, 1.0)
    assert err == ROUTER_NAN
    others = [r for r in range(n) if r not in (2, 5)]
    np.testing.assert_array_equal(ids[others], clean[0][others])
    np.testing.assert_array_equal(w[others].view(np.int32), clean[1][others].view(np.int32))
    nan_rows = [2] + ([5] if scoring == "softmax" and not tts else [])
    for r in nan_rows:
        no_pick = ids[r] == -1
        assert ((ids[r] >= 0) & (ids[r] < R) | no_pick).all(), f"row {r}: ids {ids[r].tolist()}"
        assert (w[r][no_pick] == 0).all() and (no_pick | np.isnan(w[r])).all(), f"row {r}: {w[r].tolist()}"
    if n_group == 1:  # (group-limited: the groups left out score -inf, which is choosable, with NaN weights)
        assert (ids[2] == -1).all()
    if 5 not in nan_rows:  # one NaN logit: never picked
        assert col not in ids[5] and (ids[5] >= 0).all() and np.isfinite(w[5]).all()


INF_CASES = [c for c in NAN_CASES if c[3] or c[2] == "softmax"]


@pytest.mark.parametrize("variant", [1, 0])
@pytest.mark.parametrize("case", INF_CASES, ids=[f"R{c[0]}-k{c[1]}-{c[2]}{'-tts' if c[3] else ''}" for c in INF_CASES])
def test_topk_route_flags_inf_logits_that_make_nan_weights(case, variant, rng):
    """Under softmax (scores or the chosen logits' weights) a +inf logit, or a row all -inf, makes NaN
    (inf - inf): flagged as NaN logits are, on the register path and on route_row's (the all -inf row ties
    past 32 entries, so route_row takes it); the picks found keep their NaN weights, every other row its bits."""
    R, k, scoring, tts, n_group, topk_group = case
    n = 9
    logits = _planted_logits(rng, n, R, k)
    clean = _launch_topk_route(variant, logits, None, k, SCORING[scoring], n_group, topk_group, tts, True, 1.0)
    logits[6, int(clean[0][6, 0])] = np.inf
    logits[7] = -np.inf
    ids, w, err = _launch_topk_route(variant, logits, None, k, SCORING[scoring], n_group, topk_group, tts, True, 1.0)
    assert err == ROUTER_NAN
    others = [r for r in range(n) if r not in (6, 7)]
    np.testing.assert_array_equal(ids[others], clean[0][others])
    np.testing.assert_array_equal(w[others].view(np.int32), clean[1][others].view(np.int32))
    for r in (6, 7):
        no_pick = ids[r] == -1
        assert ((ids[r] >= 0) & (ids[r] < R) | no_pick).all(), f"row {r}: ids {ids[r].tolist()}"
        assert (w[r][no_pick] == 0).all() and (no_pick | np.isnan(w[r])).all(), f"row {r}: {w[r].tolist()}"


def _w8a8_codes(x) -> tuple:
    """x's e4m3 codes [n, H] (uint8) and scales [n, ceil(H / 128)] by the w8a8 rule
    (reference.quantize_activations_fp8's): per row and 128 columns s = amax / 448 in float32, codes
    e4m3(x / s) rounded to nearest even; a group of zeros has scale 0 and codes 0."""
    from cupymoe import formats

    n, H = x.shape
    groups = -(-H // formats.FP8_BLOCK)
    g = np.pad(x.astype(np.float32), ((0, 0), (0, groups * formats.FP8_BLOCK - H))).reshape(n, groups, -1)
    s = (np.abs(g).max(axis=2) / np.float32(formats.E4M3_MAX)).astype(np.float32)
    scaled = np.where(s[..., None] > 0, g / np.where(s > 0, s, np.float32(1))[..., None], np.float32(0))
    codes = np.clip(scaled, -formats.E4M3_MAX, formats.E4M3_MAX).astype(formats.E4M3).view(np.uint8)
    return codes.reshape(n, -1)[:, :H], s


def _x_and_poisoned_codes(rng, n: int, H: int):
    """x (bf16, row 2's first group zeros) on the device, and its codes and scales poisoned with a guard
    row past n."""
    import cupy
    import ml_dtypes

    x = (rng.standard_normal((n, H)) * 3).astype(ml_dtypes.bfloat16)
    x[2, :128] = 0
    qx = cupy.full((n + 1, H), 0xAB, dtype=cupy.uint8)
    sx = cupy.full((n + 1, -(-H // 128)), cupy.nan, dtype=cupy.float32)
    return x, cupy.asarray(x.view(np.uint16)), qx, sx


def _assert_w8a8_codes(x, qx, sx) -> None:
    import cupy

    n = x.shape[0]
    codes, s = _w8a8_codes(x)
    got_q, got_s = cupy.asnumpy(qx), cupy.asnumpy(sx)
    assert (got_q[n] == 0xAB).all() and np.isnan(got_s[n]).all(), "the guard row past N was written"
    np.testing.assert_array_equal(got_s[:n].view(np.int32), s.view(np.int32))
    np.testing.assert_array_equal(got_q[:n], codes)
    assert s[2, 0] == 0 and (got_q[2, :128] == 0).all()


@pytest.mark.parametrize("n,H", [(9, 136), (33, 2880), (130, 7168)])
def test_x_codes_kernel_writes_x_codes_by_the_w8a8_rule(n, H, rng):
    """w8a8 prefill's x codes ahead of the router (topk.cu x_codes_e4m3, a 256-column unit a warp over the
    grid, the grid as forward_plan sizes it): bit for bit the w8a8 rule, the guard row left poisoned."""
    import cupy

    from cupymoe import catalog as C
    from cupymoe import jit

    x, d_x, qx, sx = _x_and_poisoned_codes(rng, n, H)
    units = -(-H // 256)
    jit.library(0)["x_codes_e4m3"]((-(-n * units // C.X_CODES_WARPS),), (C.X_CODES_WARPS * 32,),
                                   (d_x, np.int32(n), np.int32(H), qx, sx))
    cupy.cuda.runtime.deviceSynchronize()
    _assert_w8a8_codes(x, qx, sx)
