"""GPU: the swap-AB w8a8 decode (cuda/decode_swapab_fp8_sm90.cu, CUPYMOE_DECODE_KERNEL=swapab on
fp8-block experts as w8a8) against cupymoe.reference on the decode and atomic paths, at row
counts that take every token tile and runs longer than a tile (passes > 1): awkward N; K below
one k128 step (H = 96: the TMA box and the token chunks past K read zeros) and K of many steps
whose last is partial (H = 1040, I = 336: the ring wraps inside a pass); I not a multiple of
64 (gate/up's blocks) nor of 128 (the activation's groups, quantized by their last block);
down's 128-row blocks reaching past H; a gated fp8 shared expert (N rows in passes), one behind
a pre-expert norm (x's own codes), a bf16 one beside fp8 routed experts (the bf16 swap-AB
kernels serve it); expert biases; one expert holding most rows, experts nobody chose; outputs
poisoned with NaN first; a captured graph's replay equals the eager forward bit for bit.

Tolerances are cupymoe/verify.py check_w8a8's, unchanged (the w8a8 GPU tests' in
test_gpu_quant.py): the e4m3 codes and scales of the activation bitwise those of quantizing the
kernels' own bf16 values; the activation and the stored outputs by the faithful rule against
float64 fed the kernels' own codes (fp32 accumulation promoted every 128 k, one bf16 rounding;
a one-ulp flip an outlier); the output within w8a8_normwise_bound of the exact reference. The
kernels promote every k128 step as decode_wgmma_a8.cu does (a fresh accumulator, then fmaf with
token scale x weight scale), so the rules that hold for it hold here; nothing is widened.
sm_90a only (elsewhere fp8 runs as w8a16 and the knob leaves its decode kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import reference, testing
from cupymoe.verify import bf16_bits, bits_to_f32, check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

# name -> (family, MoeConfig overrides, shared expert's format or None = fp8_block)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}, None),  # H = 96: under one k128 step; down's block past H
    "mixtral": ("mixtral", {}, None),  # 8 experts, top-2: 64 rows an expert at 255 rows
    "qwen3_moe-I48": ("qwen3_moe", {"moe_intermediate_size": 48}, None),  # I under a 64-column block
    "qwen3_moe-longK": ("qwen3_moe", {"hidden_size": 1040, "moe_intermediate_size": 336}, None),  # 9 and 3 steps
    "qwen2_moe": ("qwen2_moe", {}, None),  # a gated fp8 shared expert of I = 96
    "qwen2_moe-prenorm": ("qwen2_moe", {"pre_expert_norm": True}, None),  # the shared expert reads x's own codes
    "deepseek_v3-bf16shared": ("deepseek_v3", {}, "bf16"),  # DeepSeek-V3's layout: both swap-AB kernels
    "gpt_oss": ("gpt_oss", {}, None),  # expert biases, swiglu_oai
}
TOKENS = (1, 9, 17, 63, 130, 255)
ATOMIC_TOKENS = (9, 17)
MAX_TOKENS = 256


def _hopper() -> bool:
    import cupy

    from cupymoe import jit

    cc = cupy.cuda.Device().compute_capability
    return jit.arch_for_capability(int(cc[:-1]), int(cc[-1])) == "sm_90a"


@pytest.fixture(autouse=True)
def _swapab(monkeypatch):
    if not _hopper():
        pytest.skip("the w8a8 swap-AB decode needs sm_90a")
    monkeypatch.setenv("CUPYMOE_DECODE_KERNEL", "swapab")


def _case(name, rng):
    from cupymoe import MoeLayer

    family, overrides, shared_fmt = CASES[name]
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng, "fp8_block", shared_fmt=shared_fmt)
    layer = MoeLayer(cfg, hw, max_tokens=MAX_TOKENS, decode_max_tokens=MAX_TOKENS, atomic_max_tokens=32,
                     fp8_compute="w8a8")
    assert layer.fp8_compute == "w8a8" and layer.plan.swapab_chosen
    return cfg, hw, layer


def _expert_kernels(layer, n, path="decode"):
    from cupymoe.forward_plan import build_forward_plan
    from cupymoe.plan import Path

    plan = build_forward_plan(layer.plan, layer.device, n, Path(path)).at(n)
    return [s.kernel for s in plan.launches if s.stage.value in ("gate_up", "down")]


def test_every_token_tile_runs():
    """The cases' row counts take each of the kernel's token tiles (8 .. 64)."""
    from cupymoe import catalog as C, heuristics as HX
    from cupymoe.plan import LayerOptions, plan_layer

    tiles = set()
    for name in CASES:
        family, overrides, shared_fmt = CASES[name]
        cfg = testing.tiny_config(family, **overrides)
        lp = plan_layer(cfg, "fp8_block", (shared_fmt or "fp8_block") if cfg.has_shared_expert else None, "sm_90a",
                        options=LayerOptions(fp8_compute="w8a8"))
        tiles |= {HX.swapab_decode_kernel(lp, "down", n, C.WeightFormat.FP8_BLOCK).name for n in TOKENS}
    assert tiles == {f"decode_swapab_fp8_down<{nt}>" for nt in C.SWAPAB_FP8_TOKEN_TILES}, tiles


@pytest.mark.parametrize("name", sorted(CASES))
def test_swapab_fp8_decode_matches_the_reference(name, rng):
    cfg, hw, layer = _case(name, rng)
    for path, tokens in (("decode", TOKENS), ("atomic", ATOMIC_TOKENS)):
        for n in tokens:
            kernels = _expert_kernels(layer, n, path)
            assert any(k.startswith("decode_swapab_fp8_") for k in kernels), (n, kernels)
            assert all(k.startswith("decode_swapab_") for k in kernels), (n, kernels)
            x = well_separated_input(cfg, hw, rng, n)
            c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
            assert c.ok, f"{name} N={n} {path} ({kernels[0]}): {c}"
    layer.check_errors()


@pytest.mark.parametrize("name", ["qwen3_moe-longK", "qwen2_moe"])
def test_swapab_past_256_rows(name, rng):
    """The rows the tune sweep offers the swap-AB decode at (tune.SWAPAB_CAP): every expert's run and
    the shared expert's N rows in many passes, the lists by the one-block sort in several rounds or
    the three-pass sort (past DECODE_SORT_PAIRS pairs)."""
    from cupymoe import MoeLayer

    family, overrides, shared_fmt = CASES[name]
    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng, "fp8_block", shared_fmt=shared_fmt)
    layer = MoeLayer(cfg, hw, max_tokens=2048, decode_max_tokens=2048, fp8_compute="w8a8")
    for n in (513, 2047):
        kernels = _expert_kernels(layer, n)
        assert all(k.startswith("decode_swapab_fp8_") for k in kernels), (n, kernels)
        x = well_separated_input(cfg, hw, rng, n)
        c = check(run_layer(layer, x, "decode"), cfg, hw, x, "decode", layer=layer)
        assert c.ok, f"{name} N={n} ({kernels[0]}): {c}"
    layer.check_errors()


def _run_experts(layer, x, ids, w, path="decode"):
    """x uploaded, the output poisoned with NaN, one experts-only forward; the output as float32."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd, idd, wd = cupy.asarray(bf16_bits(x)), cupy.asarray(ids), cupy.asarray(w)
        out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)
        layer.run_experts(xd, idd, wd, out=out, stream=s.ptr, path=path)
    s.synchronize()
    return bits_to_f32(out.get())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe-longK"])
def test_one_expert_holding_most_rows_and_experts_nobody_chose(name, rng):
    """A given routing: every row's first pick expert 0 (its run of N rows takes several passes
    of the token tile the plan sized for an even spread), the rest over every expert but 1."""
    cfg, hw, layer = _case(name, rng)
    k, R = cfg.num_experts_per_tok, cfg.router_width
    others = np.array([e for e in range(2, R)])
    for n in (17, 130, 255):
        ids = np.empty((n, k), np.int32)
        ids[:, 0] = 0
        if k > 1:
            ids[:, 1:] = rng.choice(others, size=(n, k - 1), replace=True)
        w = rng.uniform(0.05, 1.0, size=(n, k)).astype(np.float32)
        x = testing.random_input(rng, n, cfg.hidden_size)
        out = _run_experts(layer, x, ids, w)
        c = check(out, cfg, hw, x, "decode", layer=layer, routing=reference.given_routing(cfg, ids, w))
        assert c.ok, f"{name} N={n}: {c}"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3-bf16shared"])
def test_a_captured_graph_replays_the_eager_forward(name, rng):
    import cupy

    cfg, hw, layer = _case(name, rng)
    s = cupy.cuda.Stream(non_blocking=True)
    for n in (17, 255):
        x = cupy.asarray(bf16_bits(well_separated_input(cfg, hw, rng, n)))
        eager, replayed, graph = testing.eager_and_graph(layer, x, n, "decode", s)
        assert not np.isnan(bits_to_f32(eager.get())).any(), f"{name} N={n}: unwritten outputs"
        assert cupy.array_equal(eager, replayed), f"{name} N={n}: the replay differs from the eager forward"
        del graph
