"""Where does the w8a8 grouped path part from the reference? Stage by stage, on the GPU.

Runs one fp8-block layer forward on the prefill path with fp8_compute="w8a8", reads the
arena's intermediates back and checks each against float64 numpy fed the kernel's own
inputs of that stage: the input's e4m3 codes and scales, the gate/up activation, the
activation's codes and scales, the weighted down outputs.

    python scripts/w8a8_probe.py [family] [N ...]
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

from cupymoe import MoeLayer, formats, reference, testing
from cupymoe.verify import run_layer, well_separated_input


def arena_array(layer, name, dtype, shape):
    ptr, nbytes = layer.arena.ptr(name), layer.arena.nbytes(name)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=layer)
    n = int(np.prod(shape))
    return cupy.ndarray((n,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0)).get().reshape(shape)


def quantize(a):
    """Per row and 128 columns: codes (e4m3) and scales, as reference.quantize_activations_fp8."""
    n, k = a.shape
    kb = -(-k // 128)
    q = np.zeros((n, k), dtype=formats.E4M3)
    s = np.zeros((n, kb), dtype=np.float32)
    for b in range(kb):
        g = a[:, b * 128:(b + 1) * 128].astype(np.float32)
        sc = (np.abs(g).max(axis=1) / np.float32(448)).astype(np.float32)
        safe = np.where(sc > 0, sc, np.float32(1))
        q[:, b * 128:(b + 1) * 128] = np.clip(g / safe[:, None], -448, 448).astype(formats.E4M3)
        s[:, b] = sc
    return q, s


def dequant_rows(q, s):
    out = q.astype(np.float64)
    for b in range(s.shape[1]):
        out[:, b * 128:(b + 1) * 128] *= s[:, b:b + 1]
    return out


def rel(a, b):
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))


def probe(family, n, rng):
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, "fp8_block", shared_fmt="bf16")
    layer = MoeLayer(cfg, hw, max_tokens=max(n, 8), decode_max_tokens=1, atomic_max_tokens=1, fp8_compute="w8a8")
    x = well_separated_input(cfg, hw, rng, n)
    run_layer(layer, x, "prefill")
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    i_max = layer.weights.i_max
    sh = 1 if cfg.has_shared_expert else 0
    P = n * k + sh * n
    xb = x.astype(formats.BF16).astype(np.float32)
    qx = arena_array(layer, "qx", np.uint8, (n, H)).view(formats.E4M3)
    sx = arena_array(layer, "sx", np.float32, (n, -(-H // 128)))
    q_ref, s_ref = quantize(xb)
    print(f"{family} N={n}: qx codes differ {np.count_nonzero(qx.view(np.uint8) != q_ref.view(np.uint8))}/{qx.size},"
          f" sx differ {np.count_nonzero(sx != s_ref)}/{sx.size}")
    ids = arena_array(layer, "topk_ids", np.int32, (n * k,))
    tw = arena_array(layer, "topk_w", np.float32, (n * k,))
    sp = arena_array(layer, "sorted_pair", np.int32, (P,))
    act = arena_array(layer, "act", np.uint16, (P, i_max))
    act = (act.astype(np.uint32) << 16).view(np.float32)
    qact = arena_array(layer, "qact", np.uint8, (P, i_max)).view(formats.E4M3)
    sact = arena_array(layer, "sact", np.float32, (P, -(-i_max // 128)))
    yw = arena_array(layer, "yw", np.uint16, (P, H))
    yw = (yw.astype(np.uint32) << 16).view(np.float32)
    xq = dequant_rows(qx, sx)
    worst = {"act": 0.0, "act_vs_unquantized_x": 0.0, "yw": 0.0}
    qact_bad = sact_bad = 0
    for p in range(P):
        pair = int(sp[p])
        if pair >= n * k:
            continue  # the shared expert's row (bf16 here)
        t, e = pair // k, int(ids[pair])
        if e >= cfg.num_experts:
            continue
        g = xq[t] @ formats.dequantize(hw.gate[e], np.float64).T
        u = xq[t] @ formats.dequantize(hw.up[e], np.float64).T
        a = reference.activation(cfg, g, u)
        worst["act"] = max(worst["act"], rel(act[p, :I], a))
        g0 = xb[t] @ formats.dequantize(hw.gate[e], np.float64).T
        u0 = xb[t] @ formats.dequantize(hw.up[e], np.float64).T
        worst["act_vs_unquantized_x"] = max(worst["act_vs_unquantized_x"], rel(act[p, :I], reference.activation(cfg, g0, u0)))
        qa, sa = quantize(act[p:p + 1, :I])
        qact_bad += np.count_nonzero(qa.view(np.uint8) != qact[p:p + 1, :I].view(np.uint8))
        sact_bad += np.count_nonzero(sa != sact[p:p + 1, :sa.shape[1]])
        y = dequant_rows(qact[p:p + 1, :I], sact[p:p + 1, :sa.shape[1]])[0] @ formats.dequantize(hw.down[e], np.float64).T
        worst["yw"] = max(worst["yw"], rel(yw[p], tw[pair] * y))
    print(f"  worst normwise per row: {', '.join(f'{k_} {v:.2e}' for k_, v in worst.items())};"
          f" qact codes differ {qact_bad}, sact differ {sact_bad}")


def main():
    family = sys.argv[1] if len(sys.argv) > 1 else "qwen3_moe"
    tokens = [int(a) for a in sys.argv[2:]] or [1, 17, 300]
    rng = np.random.default_rng(1)
    for n in tokens:
        probe(family, n, rng)


if __name__ == "__main__":
    main()
