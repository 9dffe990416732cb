"""CPU: cuda/lora.cu's grouped LoRA kernels (lora_grouped_gate_up_act, lora_grouped_down_delta)
emulated lane by lane in numpy, with the mma.sync m16n8k16 fragment maps of the PTX ISA (A:
row g + 8 (r % 2), k pair tig + 4 (r // 2); B: n g, k pair tig + 4 r; C: row g + 8 (r // 2), col
2 tig + r % 2), the kernels' k permutations (a lane's 16-byte vectors in the shrink, its 4 ranks
in the expand), the bucketing into 16-row chunks, the warps' split of the input and output
columns and the bf16 hi / lo split of t, against the plain math in float64: what the GPU tests
judge on the device, checked here for the index maps alone. The constants are read from the
kernel source, so the model follows them."""

from __future__ import annotations

import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from cupymoe import jit

SRC = (jit.kernel_dir() / "lora.cu").read_text()
WARPS, NC, SUB, MT = (int(re.search(rf"#define {n} (\d+)", SRC).group(1))
                       for n in ("LORA_MMA_WARPS", "LORA_NC", "LORA_SUB", "LORA_MT"))
CHUNK = 16 * MT
G, TIG = np.arange(32) >> 2, np.arange(32) & 3


def bf(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def mma(c, a, b):
    """D = A B + C of one m16n8k16: c [32, 4], a [32, 4, 2] (registers of two bf16, the low one
    first), b [32, 2, 2], by the lanes' fragment maps."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = G[lane], TIG[lane]
        for r in range(4):
            A[g + 8 * (r % 2), 2 * (t + 4 * (r // 2)):][:2] = a[lane, r]
            C[g + 8 * (r // 2), 2 * t + r % 2] = c[lane, r]
        for r in range(2):
            B[2 * (t + 4 * r):2 * (t + 4 * r) + 2, g] = b[lane, r]
    D = A @ B + C
    return np.array([[D[G[i] + 8 * (r // 2), 2 * TIG[i] + r % 2] for r in range(4)] for i in range(32)], np.float32)


@dataclass
class Chunk:
    key: int
    pos: list  # [lane][mt][h]: the lane's rows 16 mt + g + 8 h as positions, -1 past the chunk


def chunks(lid: list, pos0: int) -> list:
    """lora_bucket and lora_chunk_rows: adapters ascending, positions in order, CHUNK-row chunks."""
    out, prev = [], -1
    while any(v > prev for v in lid):
        key = min(v for v in lid if v > prev)
        run = [i for i, v in enumerate(lid) if v == key]
        for f in range(0, len(run), CHUNK):
            rows = run[f:f + CHUNK]
            out.append(Chunk(key, [[[pos0 + rows[i] if i < len(rows) else -1
                                     for i in (16 * mt + g, 16 * mt + g + 8)] for mt in range(MT)] for g in G]))
        prev = key
    return out


def shrink_part(warp, rp, mats, vecs, length, max_rank):
    """lora_mma_shrink_part: the warp's partial t of each matrix in mats ([max_rank, stride]);
    vecs[lane][mt][h]: the lane's input rows (None past the chunk)."""
    part = np.zeros((len(mats), CHUNK, rp), np.float32)
    for kc in range(0, max_rank, 16):
        c = np.zeros((len(mats), 2, MT, 32, 4), np.float32)
        for h0 in range(warp * 32, length, WARPS * 32):
            x = np.zeros((MT, 2, 32, 4, 2))
            w = np.zeros((len(mats), 2, 32, 4, 2))
            for lane in range(32):
                h = h0 + 8 * TIG[lane]
                if h >= length:
                    continue
                for mt in range(MT):
                    for i in range(2):
                        if vecs[lane][mt][i] is not None:
                            x[mt, i, lane] = vecs[lane][mt][i][h:h + 8].reshape(4, 2)
                for p, m in enumerate(mats):
                    for nt in range(2):
                        if kc + 8 * nt + G[lane] < max_rank:
                            w[p, nt, lane] = m[kc + 8 * nt + G[lane], h:h + 8].reshape(4, 2)
            for mt in range(MT):
                f0 = np.stack([x[mt, 0, :, 0], x[mt, 1, :, 0], x[mt, 0, :, 1], x[mt, 1, :, 1]], 1)
                f1 = np.stack([x[mt, 0, :, 2], x[mt, 1, :, 2], x[mt, 0, :, 3], x[mt, 1, :, 3]], 1)
                for p in range(len(mats)):
                    for nt in range(2):
                        c[p, nt, mt] = mma(mma(c[p, nt, mt], f0, w[p, nt][:, 0:2]), f1, w[p, nt][:, 2:4])
        for p in range(len(mats)):
            for nt in range(2):
                for mt in range(MT):
                    for lane in range(32):
                        col, row = kc + 8 * nt + 2 * TIG[lane], 16 * mt + G[lane]
                        part[p, row, col:col + 2] = c[p, nt, mt, lane, 0:2]
                        part[p, row + 8, col:col + 2] = c[p, nt, mt, lane, 2:4]
    return part


def t_frag(t, kc, mt):
    """lora_t_frag: (hi, lo) registers of t's rows 16 mt + g, + 8 and ranks kc + 4 tig .. + 3."""
    hi, lo = np.zeros((32, 4, 2)), np.zeros((32, 4, 2))
    for lane in range(32):
        r, g = kc + 4 * TIG[lane], 16 * mt + G[lane]
        for reg, (row, off) in enumerate(((g, 0), (g + 8, 0), (g, 2), (g + 8, 2))):
            pair = t[row, r + off:r + off + 2]
            hi[lane, reg] = bf(pair)
            lo[lane, reg] = bf(pair - bf(pair))
    return hi, lo


def expand(t, b, c0, cols, max_rank):
    """lora_mma_expand: NC 8-column steps of B t (b [out, max_rank]) for the MT row tiles."""
    d = np.zeros((NC, MT, 32, 4), np.float32)
    for kc in range(0, max_rank, 16):
        for j in range(NC):
            frag = np.zeros((32, 2, 2))
            for lane in range(32):
                if c0[j] < cols:
                    r = kc + 4 * TIG[lane]
                    frag[lane] = [[b[c0[j] + G[lane], r + i] if r + i < max_rank else 0.0
                                   for i in range(2 * q, 2 * q + 2)] for q in range(2)]
            for mt in range(MT):
                hi, lo = t_frag(t, kc, mt)
                d[j, mt] = mma(mma(d[j, mt], hi, frag), lo, frag)
    return d


def rounds(warp, cols, lo=0):
    """lora_round_cols: the warp's rounds of NC 8-column steps of columns [lo, cols)."""
    r = 0
    while lo + (warp + WARPS * r * NC) * 8 < cols:
        yield [lo + (warp + WARPS * (r * NC + j)) * 8 for j in range(NC)]
        r += 1


def col_slice(length, s, S):
    """lora_slice: slice s of S of length columns, whole 8-column vectors: [lo, hi)."""
    vecs = (length + 7) >> 3
    per = -(-vecs // S)
    return min(length, 8 * per * s), min(length, 8 * per * (s + 1))


def each_output(chunk, c0, cols, fn):
    """fn(position, column, j, mt, lane, register) for the lane's stored outputs of a round."""
    for j in range(NC):
        for mt in range(MT):
            for lane in range(32):
                for h in range(2):
                    for e in range(2):
                        c = c0[j] + 2 * TIG[lane] + e
                        if chunk.pos[lane][mt][h] >= 0 and c0[j] < cols:
                            fn(chunk.pos[lane][mt][h], c, j, mt, lane, 2 * h + e)


def block_t(chunk, mats, scales, vecs, length, max_rank):
    """The warps' parts added in warp order, scaled: t of each projection."""
    rp = -(-max_rank // 16) * 16
    parts = sum(shrink_part(w, rp, mats, vecs, length, max_rank) for w in range(WARPS))
    return [parts[p] * np.float32(s) for p, s in enumerate(scales)]


@dataclass
class Case:
    max_rank: int
    ranks: tuple
    rows: int  # the tile's positions (over SUB: several passes)


def staged_act(act, gu, ch, c0, I, dg, du):
    """lora_chunk_act's round: g + dg and u + du staged in gs ([2][CHUNK][8 NC]) by fragment
    (lora_stage_gu), then act stored from the staging, a lane an element (row e / W, step
    (e % W) / 8, column e % 8)."""
    W = 8 * NC
    gs = np.full((2, CHUNK * W), np.nan, np.float32)
    rows = {}  # chunk row -> position
    for j in range(NC):
        for mt in range(MT):
            for lane in range(32):
                for h in range(2):
                    p = ch.pos[lane][mt][h]
                    if p < 0 or c0[j] >= I:
                        continue
                    rows[16 * mt + G[lane] + 8 * h] = p
                    for e in range(2):
                        c = c0[j] + 2 * TIG[lane] + e
                        o = (16 * mt + G[lane] + 8 * h) * W + 8 * j + 2 * TIG[lane] + e
                        gs[0, o] = gu[p, c] + dg[j, mt, lane, 2 * h + e]
                        gs[1, o] = gu[p, I + c] + du[j, mt, lane, 2 * h + e]
    for e in range(len(rows) * W):
        c = c0[0] + WARPS * 8 * ((e % W) >> 3) + (e & 7)
        if c < I:
            act[rows[e // W], c] = bf(silu(gs[0, e], gs[1, e]))


def silu(g, u):
    return g / (1 + np.exp(-g)) * u


def draw(rng, case, K, H, I_max):
    """The gate and up slots' A [K, max_rank, H] and B [K, I_max, max_rank], zero past each
    adapter's rank (as lora_slots fills them)."""
    mats = {}
    for proj in ("gate", "up"):
        a = bf(rng.standard_normal((K, case.max_rank, H)) * 0.3)
        b = bf(rng.standard_normal((K, I_max, case.max_rank)) * 0.3)
        for k, r in enumerate(case.ranks):
            a[k, r:], b[k, :, r:] = 0, 0
        mats[f"{proj}_a"], mats[f"{proj}_b"] = a, b
    return mats


@pytest.mark.parametrize("case", [Case(16, (16, 3, 1), 37), Case(12, (12, 5, 2), SUB + 19), Case(5, (5, 4, 1), 9)],
                         ids=["r16", "r12-two-passes", "r5"])
def test_grouped_gate_up_act_model(case, rng):
    K, H, I, N = 3, 96, 40, 300
    m = draw(rng, case, K, H, I)
    scale = rng.uniform(0.5, 2, (K, 2)).astype(np.float32)
    x = bf(rng.standard_normal((N, H)))
    ids = rng.integers(-1, K + 1, N)  # K: past the slots, as no adapter
    sorted_row = rng.permutation(N)[:case.rows]
    gu = bf(rng.standard_normal((case.rows, 2 * I)))
    act = np.full((case.rows, I), np.nan, np.float32)
    Y, threads = 3, 32 * WARPS  # the tile's blocks (grid y): block y, chunks y, y + Y, ...
    for s0 in range(0, case.rows, SUB):
        lid = [int(v) if 0 <= v < K else -1 for v in ids[sorted_row[s0:s0 + SUB]]]
        half, seen = I // 2, np.zeros(len(lid) * (I // 2), int)
        for y in range(Y):  # lora_plain_act: block y's steps e = tid + y threads, stride Y threads
            for e in range(y * threads, len(lid) * half, Y * threads):
                seen[e:e + threads] += 1
        assert (seen == 1).all()
        for i in (i for i, v in enumerate(lid) if v < 0):
            act[s0 + i] = bf(silu(gu[s0 + i, :I], gu[s0 + i, I:]))
        cs = chunks(lid, s0)
        for ch in (ch for y in range(Y) for ch in cs[y::Y]):
            vecs = [[[None if p < 0 else x[sorted_row[p]] for p in tile] for tile in ch.pos[lane]]
                    for lane in range(32)]
            tg, tu = block_t(ch, [m["gate_a"][ch.key], m["up_a"][ch.key]], scale[ch.key], vecs, H, case.max_rank)
            for warp in range(WARPS):
                for c0 in rounds(warp, I):
                    staged_act(act, gu, ch, c0, I, expand(tg, m["gate_b"][ch.key], c0, I, case.max_rank),
                               expand(tu, m["up_b"][ch.key], c0, I, case.max_rank))
    for p in range(case.rows):
        k, xr = ids[sorted_row[p]], x[sorted_row[p]].astype(np.float64)
        g, u = gu[p, :I].astype(np.float64), gu[p, I:].astype(np.float64)
        if 0 <= k < K:
            g = g + scale[k, 0] * (m["gate_b"][k] @ (m["gate_a"][k] @ xr))
            u = u + scale[k, 1] * (m["up_b"][k] @ (m["up_a"][k] @ xr))
        want = silu(g, u)
        np.testing.assert_allclose(act[p], want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max(), err_msg=f"p {p}")


def test_grouped_down_delta_model(rng):
    """lora_grouped_down_delta over its grid (tile, Y, Z): block (y, z) takes the chunks c with c
    mod Y = y and expands columns lora_slice(H, z, Z), recomputing the chunk's t; each output
    written once, the same bits at every (Y, Z), and the plain math's values."""
    K, H, I, max_rank, rows = 3, 200, 40, 16, 41  # H: 25 vectors, uneven slices
    a = bf(rng.standard_normal((K, max_rank, I)) * 0.3)
    b = bf(rng.standard_normal((K, H, max_rank)) * 0.3)
    a[1, 3:], b[1, :, 3:] = 0, 0
    scale = rng.uniform(0.5, 2, K).astype(np.float32)
    act = bf(rng.standard_normal((rows, I)))
    ids = rng.integers(-1, K, rows)
    w = rng.uniform(0, 1, rows).astype(np.float32)  # each position's routing weight
    yw = bf(rng.standard_normal((rows, H)))
    cs = chunks([int(v) for v in ids], 0)

    def grid(Y, Z):
        out, writes = yw.copy(), np.zeros((rows, H), int)
        for y, z in np.ndindex(Y, Z):
            lo, hi = col_slice(H, z, Z)
            for ch in cs[y::Y]:
                vecs = [[[None if p < 0 else act[p] for p in tile] for tile in ch.pos[lane]] for lane in range(32)]
                (t,) = block_t(ch, [a[ch.key]], [scale[ch.key]], vecs, I, max_rank)
                for warp in range(WARPS):
                    for c0 in rounds(warp, hi, lo):
                        d = expand(t, b[ch.key], c0, hi, max_rank)

                        def store(p, c, j, mt, lane, r):
                            out[p, c] = bf(out[p, c] + w[p] * d[j, mt, lane, r])
                            writes[p, c] += 1
                        each_output(ch, c0, hi, store)
        np.testing.assert_array_equal(writes, np.repeat((ids >= 0)[:, None].astype(int), H, 1), err_msg=f"{Y} {Z}")
        return out

    out = grid(1, 1)
    for Y, Z in ((2, 3), (4, 2)):
        np.testing.assert_array_equal(grid(Y, Z).view(np.uint32), out.view(np.uint32), err_msg=f"Y {Y} Z {Z}")
    for p in range(rows):
        k = ids[p]
        want = yw[p].astype(np.float64)
        if k >= 0:
            want = want + w[p] * scale[k] * (b[k].astype(np.float64) @ (a[k].astype(np.float64) @ act[p]))
        np.testing.assert_allclose(out[p], want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max(), err_msg=f"p {p}")


def test_expand_keeps_t_past_bf16(rng):
    """B t from t's two bf16 parts stays within ~2^-16 of the fp32 t's product (one bf16 t
    would be 2^-9 off), so the reference models no rounding of t."""
    max_rank, cols = 16, 16
    t = (rng.standard_normal((CHUNK, max_rank)) * rng.uniform(0.1, 10, (CHUNK, 1))).astype(np.float32)
    b = bf(rng.standard_normal((cols, max_rank)))
    want = t.astype(np.float64) @ b.T.astype(np.float64)  # [row, column]
    bound = np.abs(t).astype(np.float64) @ np.abs(b.T).astype(np.float64)
    for warp in range(WARPS):
        for c0 in rounds(warp, cols):
            d = expand(t, b, c0, cols, max_rank)
            for j, mt, lane, r in np.ndindex(NC, MT, 32, 4):
                row, c = 16 * mt + G[lane] + 8 * (r // 2), c0[j] + 2 * TIG[lane] + r % 2
                if c0[j] < cols:
                    assert abs(d[j, mt, lane, r] - want[row, c]) <= 2 ** -15 * bound[row, c]


def test_router_shrink_keeps_fp32_a(rng):
    """lora_grouped_router_delta's shrink: fp32 A as three bf16 parts (lora_split3), each part's
    products exact, so t = A x to fp32's precision, as lora_router_delta's fp32 loop has it."""
    H, max_rank = 96, 16
    a = (rng.standard_normal((max_rank, H)) * rng.uniform(0.01, 1, (max_rank, 1))).astype(np.float32)
    x = bf(rng.standard_normal((16, H)))
    a1 = bf(a)
    a2 = bf(a - a1)
    a3 = bf(a - a1 - a2)
    assert np.abs(a1.astype(np.float64) + a2 + a3 - a).max() <= 2 ** -26 * np.abs(a).max()
    vecs = [[[x[g], x[g + 8]]] + [[None, None]] * (MT - 1) for g in G]
    t = sum(shrink_part(w, max_rank, [part], vecs, H, max_rank)[0] for w in range(WARPS) for part in (a1, a2, a3))[:16]
    want = x.astype(np.float64) @ a.T.astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(a.T).astype(np.float64)
    assert (np.abs(t - want) <= 2 ** -20 * bound).all()


def test_router_expand_writes_each_logit_once():
    """lora_router_expand's threads (a column each, every G-th row of the chunk, LORA_RX rows a
    step, rows past the chunk clamped for the loads and not stored): each (row, column) of a chunk
    stored once, by routers narrower and wider than the block's 256 threads."""
    RX = int(re.search(r"#define LORA_RX (\d+)", SRC).group(1))
    threads = WARPS * 32
    for R in (8, 48, 100, 128, 256, 288, 600):
        W = min(R, threads)
        G = threads // W
        for rows in range(1, CHUNK + 1):
            stores = []
            for tid in range(threads):
                g = tid // W
                if g >= G:
                    continue
                for col in range(tid % W, R, W):
                    for i0 in range(g, rows, RX * G):
                        stores += [(i0 + u * G, col) for u in range(RX) if i0 + u * G < rows]
            assert sorted(stores) == [(i, c) for i in range(rows) for c in range(R)], (R, rows)
