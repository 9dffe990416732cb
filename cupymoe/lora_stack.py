"""The LoRA stacked form (Punica / S-LoRA): the experts' deltas as extra K of the TMA grouped GEMMs.

For a tile of sorted positions (rows of mixed adapters) the GEMM's accumulator gets C += T Bext^T
past its K steps (cuda/grouped_sm90_tma.cu, grouped_gemm_sm90_tma_lora), so gate/up's epilogue
activates g + s B_g A_g x and u + s B_u A_u x, and down's weights and stores y + s B_d A_d act:
no ACT_PAIR round trip of lora_gu and no read-modify-write of yw.

Columns (K = max_loras, R = max_rank, `parts` 1 or 2, KS = stack_width: a multiple of 64): a
projection's block of KS columns holds column (q K + a) R + r for part q, adapter slot a, rank r;
past parts K R, zeros. T (cuda/lora.cu lora_stack_t_*, [P, NP KS] bf16, NP = 2 for gate/up: gate's
block, then up's) holds part q of s t_r for the row's adapter a, zeros elsewhere; part 0 =
bf16(s t), part 1 = bf16(s t - part 0) (two parts keep s t to ~16 bits, as the grouped delta
kernels' split does; one part rounds it to bf16). Bext ([S rows, KS] bf16 a projection, table slot
e's `out` rows at e out, the shared expert at slot n_local) holds B_{a,e}[c, r] at every part q's
column of (a, r): LoraSlots fills slot a's columns at set_lora, so graphs captured before stay valid.

This module is the index math and the numpy models the tests hold the kernels and the packing to.
"""

from __future__ import annotations

import numpy as np

BOX_K = 64  # columns of one TMA K step (cuda/grouped_sm90_tma.cu TMA_BK)
PARTS = (1, 2)  # bf16 parts of s t: CUPYMOE_LORA_IN_GEMM's values


def stack_width(max_loras: int, max_rank: int, parts: int) -> int:
    """KS: a projection's T / Bext columns, parts K R rounded up to whole K steps."""
    if parts not in PARTS:
        raise ValueError(f"parts={parts!r}: 1 or 2")
    return -(-parts * max_loras * max_rank // BOX_K) * BOX_K


def lora_steps(max_loras: int, max_rank: int, parts: int) -> int:
    """The GEMM's lora_steps argument: KS / 64 (down runs that many extra K steps, gate/up twice)."""
    return stack_width(max_loras, max_rank, parts) // BOX_K


def column(q: int, a: int, r: int, max_loras: int, max_rank: int) -> int:
    """The column of part q, adapter slot a, rank r within a projection's KS."""
    return (q * max_loras + a) * max_rank + r


def decode_column(u: int, max_loras: int, max_rank: int, parts: int):
    """(q, a, r) of column u within a projection's KS, None past parts K R (cuda/lora.cu lora_stack_elem)."""
    kr = max_loras * max_rank
    if u >= parts * kr:
        return None
    q, rem = divmod(u, kr)
    a, r = divmod(rem, max_rank)
    return q, a, r


def split_parts(v: np.ndarray, parts: int) -> list[np.ndarray]:
    """v (fp32) as `parts` bf16 values (float32 arrays holding bf16 values): hi, then v - hi rounded."""
    from .formats import BF16

    hi = v.astype(np.float32).astype(BF16).astype(np.float32)
    if parts == 1:
        return [hi]
    return [hi, (v.astype(np.float32) - hi).astype(BF16).astype(np.float32)]


def stacked_t(t: np.ndarray, lid: np.ndarray, max_loras: int, max_rank: int, parts: int) -> np.ndarray:
    """One projection's KS block of T: t [P, max_rank] (s t of each row's adapter, fp32), lid [P]
    (the row's adapter slot; -1 or >= max_loras: none). float32 holding bf16 values."""
    P = t.shape[0]
    ks = stack_width(max_loras, max_rank, parts)
    out = np.zeros((P, ks), np.float32)
    for i in range(P):
        a = int(lid[i])
        if not 0 <= a < max_loras:
            continue
        for q, part in enumerate(split_parts(t[i], parts)):
            c = column(q, a, 0, max_loras, max_rank)
            out[i, c:c + max_rank] = part
    return out


def stacked_b(b: np.ndarray, parts: int) -> np.ndarray:
    """Bext of one projection from the slots' B [K, S, out, R] (any dtype): [S, out, KS] with
    B[a, e, c, r] at every part's column of (a, r), zeros elsewhere."""
    K, S, out, R = b.shape
    ks = stack_width(K, R, parts)
    ext = np.zeros((S, out, ks), b.dtype)
    for a in range(K):
        for q in range(parts):
            c = column(q, a, 0, K, R)
            ext[:, :, c:c + R] = b[a]
    return ext


def slot_columns(slot: int, max_loras: int, max_rank: int, parts: int) -> list[int]:
    """The first columns of slot's R-wide column blocks (one a part) in Bext."""
    return [column(q, slot, 0, max_loras, max_rank) for q in range(parts)]
