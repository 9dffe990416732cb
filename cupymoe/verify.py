"""Checking the GPU layer against cupymoe.reference: inputs, tolerances, the verify command.

Shared by the GPU tests and `python -m cupymoe verify`, so both judge by the same rule.

Tolerance for bf16 experts (weights and input bf16, the reference fed the very same values
and computing in float64). bf16 keeps 7 mantissa bits, so one rounding moves a value by at
most 2^-8 of itself (half an ulp at the bottom of a binade) and by about 0.42 * 2^-8 rms over
values spread across binades. What the kernels round, beyond fp32 accumulation (~1e-6):
  - the output itself is bf16: <= 2^-8 |ref| per element;
  - the activation a = act(g, u) is stored as bf16 before the down projection (as every
    grouped-GEMM implementation does): y moves by sum_i d_i a_i W_i with |d_i| <= 2^-8,
    a random walk of standard deviation ~ 2^-8 / sqrt(3) * rms(ref); over the ~10^4
    elements of a test its largest excursion is ~4.5 sigma, about 2.6 * 2^-8 rms(ref);
  - the pre-expert norm's output is stored as bf16: one more rounding of the same size.
So per element |out - ref| <= 2^-8 |ref| + 2^-6 rms(ref) (the 2^-6 = 4 * 2^-8 covers the
tail with margin): this is the primary check. Normwise, each rounding adds ~0.42 * 2^-8 =
1.6e-3 rms relative error, independent of the others: sqrt(3) * 1.6e-3 = 2.8e-3 with all
three (measured on the H200: 2.2e-3 to 3.1e-3 over thousands of elements). A single small
case (N = 1, H = 96: 96 elements) is one noisy draw of that rms, and identity experts
scaled by 6 (LongCat) put the bf16 rounding of the normed input straight into the output;
one such case measured 3.98e-3. The normwise bound is 2^-7 = 7.8e-3: twice the largest
rms the rounding model allows, still far below any real defect (a wrong expert or a
dropped term moves it by 1e-1 or more). Rows whose routing is a near tie
(reference.route margin < 1e-4) are redrawn: fp32 logits could legitimately pick the other
expert there, which is not an error of the layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import reference, testing
from .config import MoeConfig
from .formats import BF16
from .host_weights import HostWeights

ROUTING_MARGIN = 1e-4
BF16_RTOL = 2.0 ** -8
BF16_ATOL_RMS = 2.0 ** -6
BF16_NORMWISE = 2.0 ** -7


@dataclass
class Comparison:
    normwise: float  # ||out - ref|| / ||ref||
    worst_ratio: float  # max |out - ref| / (rtol |ref| + atol), <= 1 passes
    unwritten: int  # NaN / inf elements (the output is poisoned with NaN first)

    @property
    def ok(self) -> bool:
        return self.unwritten == 0 and self.worst_ratio <= 1.0 and self.normwise <= BF16_NORMWISE

    def __str__(self) -> str:
        return f"normwise {self.normwise:.2e}, worst {self.worst_ratio:.2f} of tolerance, unwritten {self.unwritten}"


def compare(out: np.ndarray, ref: np.ndarray) -> Comparison:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    bad = int(np.count_nonzero(~np.isfinite(out)))
    rms = float(np.sqrt(np.mean(ref ** 2))) or 1.0
    diff = np.abs(np.where(np.isfinite(out), out, 0.0) - ref)
    tol = BF16_RTOL * np.abs(ref) + BF16_ATOL_RMS * rms
    norm = float(np.linalg.norm(ref)) or 1.0
    return Comparison(float(np.linalg.norm(diff)) / norm, float((diff / tol).max()), bad)


def well_separated_input(cfg: MoeConfig, hw: HostWeights, rng: np.random.Generator, n: int,
                         token_ids: Optional[np.ndarray] = None) -> np.ndarray:
    """A random bf16 input whose every row routes with a clear margin (redraws near ties)."""
    x = testing.random_input(rng, n, cfg.hidden_size)
    for _ in range(50):
        margin = reference.route(cfg, hw, x, token_ids).margin
        close = np.flatnonzero(margin < ROUTING_MARGIN)
        if close.size == 0:
            return x
        x[close] = testing.random_input(rng, close.size, cfg.hidden_size)
    raise RuntimeError(f"could not draw {n} rows with routing margin >= {ROUTING_MARGIN}")


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a).astype(BF16)).view(np.uint16)


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def run_layer(layer, x: np.ndarray, path: Optional[str] = None, token_ids: Optional[np.ndarray] = None,
              stream=None) -> np.ndarray:
    """Upload x, poison the output with NaN, run one forward, return the output as float32."""
    import cupy

    xd = cupy.asarray(bf16_bits(x))
    out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)  # bf16 NaN: unwritten elements fail
    tids = None if token_ids is None else cupy.asarray(token_ids.astype(np.int32))
    s = stream or cupy.cuda.Stream(non_blocking=True)
    with s:
        layer(xd, out=out, token_ids=tids, path=path, stream=s.ptr)
    s.synchronize()
    return bits_to_f32(out.get())


def verify_families(families, tokens, paths, *, seed: Optional[int] = None) -> int:
    """The main job: every family's layer on this GPU against the float64 reference."""
    from .layer import MoeLayer

    seed = int(time.time_ns() % 2**31) if seed is None else seed
    rng = np.random.default_rng(seed)
    print(f"cupymoe verify: seed {seed}, tokens {tokens}, paths {paths}")
    failures = 0
    for fam in families:
        cfg = testing.tiny_config(fam)
        hw = testing.random_host_weights(cfg, rng)
        t0 = time.perf_counter()
        layer = MoeLayer(cfg, hw, max_tokens=max(tokens))
        print(f"  {fam}: layer built in {time.perf_counter() - t0:.2f} s", flush=True)
        for n in tokens:
            tids = testing.random_token_ids(rng, n, cfg.hash_vocab_size) if cfg.hash_routing else None
            x = well_separated_input(cfg, hw, rng, n, tids)
            ref = reference.moe_forward(cfg, hw, x, tids)
            for p in paths:
                c = compare(run_layer(layer, x, p, tids), ref)
                failures += not c.ok
                print(f"    N={n:<5} {p:<7} {'ok  ' if c.ok else 'FAIL'} {c}", flush=True)
    print(f"cupymoe verify: {'all passed' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0
