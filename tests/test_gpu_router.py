"""GPU: the decode path's routers against float64: router_mma.cu (tensor cores, K split over
a cluster or over the grid into logits copies, sm_90a) and router.cu (CUDA cores).

Tolerance: a logit is a float32 sum of H bf16 x bf16 products (each exact in float32). In
router_logits_mma an element's sum is at most ~40 additions deep (16 inside an MMA's k16, a
warp's k steps, the block's three-level tree, the cluster's 8 ranks), so its error is below
~40 * 2^-24 of sum |x_i w_i| (2^-18.7), twice that if the tensor cores truncate where they
align products; the bound tested is 2^-16 of sum |x_i w_i|, a 3-6x margin. router_logits_split's
sums are shallower (16 in an MMA, at most H / 256 steps a warp, 8 K warps, 4 copies added in float32
in split order, as top-k adds them). Outputs are poisoned with NaN and a guard row past N must stay
poisoned.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupymoe import catalog as C
from cupymoe.heuristics import row_tile as _row_tile

pytestmark = pytest.mark.gpu

# (N, R, H, bias): deepseek-v3 and qwen3-30b-a3b's routers, a router width no multiple of a
# block's 32 columns, H with a partial last k32 step (136) and gpt-oss's H (2880), rows past a
# block's 64 (1000: 16 row tiles)
CASES = [
    (1, 256, 7168, True),
    (3, 128, 2048, False),
    (17, 72, 2880, True),
    (64, 256, 7168, False),
    (100, 40, 136, True),
    (1000, 128, 2048, False),
]


def _lib():
    from cupymoe import jit

    lib = jit.library(0)
    if lib.arch != "sm_90a":
        pytest.skip(f"router_mma.cu needs sm_90a (clusters); this GPU is {lib.arch}")
    return lib, C


def _draw(rng, N: int, R: int, H: int, bias: bool):
    x = (rng.standard_normal((N, H)) * 0.5).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((R, H)) / np.sqrt(H)).astype(ml_dtypes.bfloat16)
    b = (rng.standard_normal(R) * 0.1).astype(np.float32) if bias else None
    return x, w, b


def _run_mma(lib, kernels, x, w, b, N: int, R: int, H: int, qx=None, sx=None):
    import cupy

    nt = _row_tile(-(-N // 8), C.ROUTER_MMA_TILES)  # as the layer picks it
    d_x, d_w = cupy.asarray(x.view(np.uint16)), cupy.asarray(w.view(np.uint16))
    d_b = cupy.asarray(b) if b is not None else None
    out = cupy.full((N + 1, R), cupy.nan, dtype=cupy.float32)  # poisoned, a guard row past N
    null = np.uint64(0)
    lib[f"router_logits_mma<{nt}>"](
        (-(-R // C.ROUTER_MMA_COLS), C.ROUTER_MMA_CLUSTER, -(-N // (8 * nt))),
        (C.ROUTER_MMA_THREADS,),
        (d_x, d_w, d_b if d_b is not None else null, out, np.int32(N), np.int32(R), np.int32(H),
         qx if qx is not None else null, sx if sx is not None else null))
    cupy.cuda.runtime.deviceSynchronize()
    return cupy.asnumpy(out)


def _run_split(lib, x, w, b, N: int, R: int, H: int, qx=None, sx=None):
    """router_logits_split's copies (poisoned, a guard row past the last), summed in split order in
    float32 as topk.cu sum_logit_splits adds them; row N of the result is the guard."""
    import cupy

    nt = _row_tile(-(-N // 8), C.ROUTER_SPLIT_TILES)
    copies = C.router_split_copies(H)
    d_x, d_w = cupy.asarray(x.view(np.uint16)), cupy.asarray(w.view(np.uint16))
    d_b = cupy.asarray(b) if b is not None else None
    out = cupy.full((copies * N + 1, R), cupy.nan, dtype=cupy.float32)
    null = np.uint64(0)
    lib[f"router_logits_split<{nt}>"](
        (-(-R // C.ROUTER_MMA_COLS), copies, -(-N // (8 * nt))), (C.ROUTER_MMA_THREADS,),
        (d_x, d_w, d_b if d_b is not None else null, out, np.int32(N), np.int32(R), np.int32(H),
         qx if qx is not None else null, sx if sx is not None else null))
    cupy.cuda.runtime.deviceSynchronize()
    got = cupy.asnumpy(out)
    total = got[:N].copy()
    for z in range(1, copies):
        total += got[z * N:(z + 1) * N]
    return np.concatenate([total, got[copies * N:]])


RUNNERS = {"mma": lambda lib, *a: _run_mma(lib, C, *a), "split": _run_split}


@pytest.mark.parametrize("form", sorted(RUNNERS))
@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}-R{c[1]}-H{c[2]}{'-bias' if c[3] else ''}" for c in CASES])
def test_tensor_core_router_matches_float64(case, form, rng):
    lib, kernels = _lib()
    N, R, H, bias = case
    x, w, b = _draw(rng, N, R, H, bias)
    got = RUNNERS[form](lib, x, w, b, N, R, H)
    assert np.isnan(got[N]).all(), "the guard row past N was written"
    got = got[:N]
    assert np.isfinite(got).all(), "an unwritten or non-finite logit"
    xf, wf = x.astype(np.float64), w.astype(np.float64)
    exp = xf @ wf.T + (b.astype(np.float64) if b is not None else 0.0)
    bound = 2.0**-16 * (np.abs(xf) @ np.abs(wf).T) + 1e-30
    err = np.abs(got - exp)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"logit {worst}: {got[worst]} vs {exp[worst]} (bound {bound[worst]:.3g})"


@pytest.mark.parametrize("form", sorted(RUNNERS))
def test_tensor_core_router_rows_do_not_depend_on_the_batch(form, rng):
    """A row's logits are the same bits alone (N = 1, one n8 tile) as in a batch of 64 (eight
    tiles) or 17: each element's sum runs over the same K split in the same order."""
    lib, _ = _lib()
    run = RUNNERS[form]
    R, H = 256, 7168
    x, w, b = _draw(rng, 64, R, H, True)
    full = run(lib, x, w, b, 64, R, H)[:64]
    part = run(lib, x[:17], w, b, 17, R, H)[:17]
    assert np.array_equal(part, full[:17])
    for r in (0, 9, 63):
        alone = run(lib, x[r:r + 1], w, b, 1, R, H)[0]
        assert np.array_equal(alone, full[r]), f"row {r}: bits differ alone"


@pytest.mark.parametrize("form", sorted(RUNNERS))
@pytest.mark.parametrize("N", [2, 40])
def test_tensor_core_router_quantizes_x_as_the_cuda_core_router(N, form, rng):
    """w8a8: x's e4m3 codes and scales from router_logits_mma are router_logits_bf16's (both
    run quant.cuh e4m3_quantize_chunk); their logits agree within the bound above."""
    import cupy

    lib, kernels = _lib()
    R, H = 256, 7168
    x, w, b = _draw(rng, N, R, H, True)
    groups = -(-H // 128)
    qx = [cupy.full((N, H), 0xAB, dtype=cupy.uint8) for _ in range(2)]  # poisoned
    sx = [cupy.full((N, groups), cupy.nan, dtype=cupy.float32) for _ in range(2)]
    got_mma = RUNNERS[form](lib, x, w, b, N, R, H, qx[0], sx[0])[:N]

    d_x, d_w, d_b = cupy.asarray(x.view(np.uint16)), cupy.asarray(w.view(np.uint16)), cupy.asarray(b)
    got_cores = cupy.full((N, R), cupy.nan, dtype=cupy.float32)
    rt = _row_tile(N, C.ROW_TILES)
    split = C.router_split(H)
    lib[f"router_logits_bf16<{rt}, {split}>"](
        ((R + 1) // 2, -(-N // rt)), (2 * split * 32,),
        (d_x, d_w, d_b, got_cores, np.int32(N), np.int32(R), np.int32(H), qx[1], sx[1]))
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(qx[0]), cupy.asnumpy(qx[1]))
    assert np.array_equal(cupy.asnumpy(sx[0]), cupy.asnumpy(sx[1]))
    assert np.isfinite(cupy.asnumpy(sx[0])).all()
    xf, wf = x.astype(np.float64), w.astype(np.float64)
    bound = 2.0**-15 * (np.abs(xf) @ np.abs(wf).T)  # each within 2^-16 of float64
    assert (np.abs(got_mma - cupy.asnumpy(got_cores)) <= bound).all()
