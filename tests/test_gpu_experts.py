"""GPU: the experts-only entry (MoeLayer.forward_experts / run_experts, torch.ops.cupymoe.moe_experts)
on every path and weight format against cupymoe.reference with the same routing.

The routing is drawn here, not by the router: ids in 0..router_width-1 (zero experts included
where the family has them) with experts repeated across rows and inside a row, one expert nobody
chose, weights in [0.05, 1) used as given. Outputs are poisoned with NaN first and judged by
cupymoe.verify.check (the tolerances of the routed forward: cupymoe/verify.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import reference, testing
from cupymoe.errors import MoeCallError
from cupymoe.verify import _read_scratch, bf16_bits, bits_to_f32, check, run_layer

pytestmark = pytest.mark.gpu

# (family, routed experts' format, shared expert's format or None = the same)
CASES = {
    "qwen2_moe-bf16": ("qwen2_moe", "bf16", None),  # a gated shared expert
    "longcat_flash-bf16": ("longcat_flash", "bf16", None),  # zero (identity) experts among the ids
    "deepseek_v3-fp8-bf16shared": ("deepseek_v3", "fp8_block", "bf16"),  # w8a8 on Hopper
    "qwen3_next-nvfp4": ("qwen3_next", "nvfp4", None),
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", None),  # expert biases, swiglu_oai
}
TOKENS = {"decode": (1, 5, 37), "atomic": (1, 5, 37), "prefill": (1, 5, 37, 300)}
MAX_TOKENS = 300
SMALL = 64  # the decode and atomic paths serve up to this many rows here, as in test_gpu_layer


def _case(name, rng):
    from cupymoe import MoeLayer

    family, fmt, shared_fmt = CASES[name]
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt, shared_fmt=shared_fmt)
    return cfg, hw, MoeLayer(cfg, hw, max_tokens=MAX_TOKENS, decode_max_tokens=SMALL, atomic_max_tokens=SMALL,
                             keep_w8a8_activation=True)  # the w8a8 prefill checks read the bf16 activation


def draw_routing(cfg, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [n, k] int32 over every id but one (expert 1: nobody chooses it), row 0 naming its first
    expert twice; weights [n, k] float32 in [0.05, 1)."""
    k, R = cfg.num_experts_per_tok, cfg.router_width
    choices = np.array([e for e in range(R) if e != 1])
    ids = rng.choice(choices, size=(n, k)).astype(np.int32)
    if k > 1:
        ids[0, 1] = ids[0, 0]
    return ids, rng.uniform(0.05, 1.0, size=(n, k)).astype(np.float32)


_run = testing.run_experts_poisoned  # x uploaded, the output poisoned with NaN, one experts-only forward


@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_experts_on_a_given_routing_match_the_reference(name, path, rng):
    cfg, hw, layer = _case(name, rng)
    for n in TOKENS[path]:
        for shared in ((None, False) if cfg.has_shared_expert else (None,)):
            x = testing.random_input(rng, n, cfg.hidden_size)
            ids, w = draw_routing(cfg, rng, n)
            out = _run(layer, x, ids, w, path, shared)
            c = check(out, cfg, hw, x, path, layer=layer, routing=reference.given_routing(cfg, ids, w),
                      shared_expert=shared is not False)
            assert c.ok, f"{name} N={n} {path} shared_expert={shared}: {c}"
    layer.check_errors()  # nothing flagged


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("name", ["qwen2_moe-bf16", "deepseek_v3-fp8-bf16shared"])
def test_the_layers_own_routing_given_back_reproduces_its_forward_bit_for_bit(name, path, rng):
    """forward, then its routing stage's ids and weights (read from scratch) handed to forward_experts:
    every stage after routing is the same kernels on the same values, so the same bits."""
    cfg, hw, layer = _case(name, rng)
    k = cfg.num_experts_per_tok
    for n in TOKENS[path]:
        x = testing.random_input(rng, n, cfg.hidden_size)
        want = run_layer(layer, x, path)
        ids = _read_scratch(layer, "topk_ids", np.int32, (n, k))
        w = _read_scratch(layer, "topk_w", np.float32, (n, k))
        got = _run(layer, x, ids, w, path)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name} N={n} {path}"


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_ids_outside_the_router_are_flagged_and_add_nothing(path, rng):
    cfg, hw, layer = _case("qwen2_moe-bf16", rng)
    n, R = 5, cfg.router_width
    x = testing.random_input(rng, n, cfg.hidden_size)
    ids, w = draw_routing(cfg, rng, n)
    ids[1, 0], ids[3, -1] = -1, R  # two bad pairs
    out = _run(layer, x, ids, w, path)
    with pytest.raises(MoeCallError, match="expert id outside 0..router_width-1"):
        layer.check_errors()
    layer.check_errors()  # the bits were cleared
    dropped = ids.copy()
    dropped[3, -1] = -1  # both bad pairs as the reference's "no expert"
    c = check(out, cfg, hw, x, path, layer=layer, routing=reference.given_routing(cfg, dropped, w))
    assert c.ok, f"{path}: {c}"


@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
def test_the_entry_inside_a_captured_graph(path, rng):
    """Captured once; replay equals the eager run bit for bit (not atomic: its sums' order varies),
    then new x, ids and weights written into the same buffers are followed by the replay."""
    import cupy

    cfg, hw, layer = _case("deepseek_v3-fp8-bf16shared", rng)
    n = 37
    x = testing.random_input(rng, n, cfg.hidden_size)
    ids, w = draw_routing(cfg, rng, n)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd, idd, wd = cupy.asarray(bf16_bits(x)), cupy.asarray(ids), cupy.asarray(w)
        eager, replayed = (cupy.full(xd.shape, 0x7FC0, cupy.uint16) for _ in range(2))
    args = (int(xd.data.ptr), n, int(idd.data.ptr), int(wd.data.ptr))
    layer.forward_experts(*args, int(eager.data.ptr), s.ptr, path=path)
    s.begin_capture()
    layer.forward_experts(*args, int(replayed.data.ptr), s.ptr, path=path)
    g = s.end_capture()
    g.launch(s)
    s.synchronize()
    if path != "atomic":
        assert cupy.array_equal(replayed, eager)
    x2 = testing.random_input(rng, n, cfg.hidden_size)
    ids2, w2 = draw_routing(cfg, rng, n)
    with s:
        xd[...], idd[...], wd[...] = cupy.asarray(bf16_bits(x2)), cupy.asarray(ids2), cupy.asarray(w2)
        replayed.fill(0x7FC0)
    g.launch(s)
    s.synchronize()
    c = check(bits_to_f32(replayed.get()), cfg, hw, x2, path, layer=layer,
              routing=reference.given_routing(cfg, ids2, w2))
    assert c.ok, f"{path} after new inputs: {c}"


def test_the_torch_op_and_module_under_compile_and_graph_capture(rng):
    torch = pytest.importorskip("torch")
    import cupymoe.torch as ct

    cfg, hw, layer = _case("qwen2_moe-bf16", rng)
    module = ct.MoeModule(layer)
    n = 7
    x = testing.random_input(rng, n, cfg.hidden_size)
    ids, w = draw_routing(cfg, rng, n)
    xt = torch.from_numpy(bf16_bits(x).view(np.int16)).view(torch.bfloat16).cuda()
    it, wt = torch.from_numpy(ids).long().cuda(), torch.from_numpy(w).cuda()  # int64 ids: the module converts
    y = module.experts(xt, it, wt)
    got = bits_to_f32(y.view(torch.int16).cpu().numpy().view(np.uint16))
    c = check(got, cfg, hw, x, layer.select_path(n), layer=layer, routing=reference.given_routing(cfg, ids, w))
    assert c.ok, str(c)
    op = torch.ops.cupymoe.moe_experts(xt, module.layer_id, it.int(), wt, None)
    assert torch.equal(op.view(torch.int16), y.view(torch.int16))
    routed = torch.ops.cupymoe.moe_experts(xt, module.layer_id, it.int(), wt, False)
    got = bits_to_f32(routed.view(torch.int16).cpu().numpy().view(np.uint16))
    assert check(got, cfg, hw, x, layer.select_path(n), layer=layer, routing=reference.given_routing(cfg, ids, w),
                 shared_expert=False).ok
    compiled = torch.compile(lambda a, b, c: module.experts(a, b, c) * 2, fullgraph=True)
    assert torch.equal(compiled(xt, it, wt).view(torch.int16), (y * 2).view(torch.int16))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        module.experts(xt, it, wt)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = module.experts(xt, it, wt)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
def test_lora_forwards_routing_given_back_reproduces_it_bit_for_bit(path, rng):
    """forward with lora_ids (every module adapted, the router's delta re-routing rows), then its routing
    stage's ids and weights handed to forward_experts with the same lora_ids: every stage after routing
    is the same LoRA plan kernels on the same values (the experts' deltas; the router's is in the
    routing given back), so the same bits (atomic: its sums' order varies, so judged by its
    tolerance against the same call with the reference's adapters); an id past the slots is flagged."""
    import cupy

    from _lora import random_lora
    from cupymoe import MoeLayer
    from cupymoe.verify import check

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=MAX_TOKENS, decode_max_tokens=SMALL, atomic_max_tokens=SMALL,
                     max_loras=2, max_lora_rank=8)
    adapters = {0: random_lora(cfg, rng, rank=8, size=0.3), 1: random_lora(cfg, rng, rank=3, size=0.5)}
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    k = cfg.num_experts_per_tok
    for n in TOKENS[path]:
        x = testing.random_input(rng, n, cfg.hidden_size)
        lora = rng.integers(-1, 2, n).astype(np.int32)
        lora[: min(n, 3)] = [0, 1, -1][: min(n, 3)]  # an adapted row whatever the draw (N = 1: slot 0)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            xd, ld = cupy.asarray(bf16_bits(x)), cupy.asarray(lora)
            want_d, got_d = (cupy.full(xd.shape, 0x7FC0, cupy.uint16) for _ in range(2))
        layer.forward(int(xd.data.ptr), n, int(want_d.data.ptr), s.ptr, path=path, lora_ids_ptr=int(ld.data.ptr))
        s.synchronize()
        ids = _read_scratch(layer, "topk_ids", np.int32, (n, k))
        w = _read_scratch(layer, "topk_w", np.float32, (n, k))
        with s:
            idd, wd = cupy.asarray(ids), cupy.asarray(w)
        layer.forward_experts(int(xd.data.ptr), n, int(idd.data.ptr), int(wd.data.ptr), int(got_d.data.ptr), s.ptr,
                              path=path, lora_ids_ptr=int(ld.data.ptr))
        s.synchronize()
        got = bits_to_f32(got_d.get())
        if path != "atomic":
            assert np.array_equal(got.view(np.uint32), bits_to_f32(want_d.get()).view(np.uint32)), f"{path} N={n}"
        exact = reference.experts_forward(cfg, hw, x, ids, w, lora=adapters, lora_ids=lora)
        moved = np.linalg.norm(exact - reference.experts_forward(cfg, hw, x, ids, w)) / np.linalg.norm(exact)
        err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert err < moved / 8, f"{path} N={n}: normwise {err:.2e} against the adapters' {moved:.2e}"
        with s:  # the same call without the shared expert: its pairs' deltas left out too
            alone_d = cupy.full(xd.shape, 0x7FC0, cupy.uint16)
        layer.forward_experts(int(xd.data.ptr), n, int(idd.data.ptr), int(wd.data.ptr), int(alone_d.data.ptr),
                              s.ptr, path=path, lora_ids_ptr=int(ld.data.ptr), shared_expert=False)
        s.synchronize()
        alone = reference.experts_forward(cfg, hw, x, ids, w, lora=adapters, lora_ids=lora, shared_expert=False)
        err = np.linalg.norm(bits_to_f32(alone_d.get()) - alone) / np.linalg.norm(alone)
        assert err < moved / 8, f"{path} N={n} shared_expert=False: normwise {err:.2e}"
    layer.check_errors()
    bad = np.array([0, 2, -1], np.int32)  # 2: past the 2 slots
    x = testing.random_input(rng, 3, cfg.hidden_size)
    ids, w = draw_routing(cfg, rng, 3)
    testing.run_experts_poisoned(layer, x, ids, w, path)  # no ids: nothing flagged
    layer.check_errors()
    with cupy.cuda.Stream(non_blocking=True) as s:
        xd, idd, wd, ld = (cupy.asarray(a) for a in (bf16_bits(x), ids, w, bad))
        out = cupy.empty_like(xd)
        layer.run_experts(xd, idd, wd, out=out, stream=s.ptr, path=path, lora_ids=ld)
    s.synchronize()
    with pytest.raises(MoeCallError, match="bit 2 = a LoRA id"):
        layer.check_errors()
    with cupy.cuda.Stream(non_blocking=True) as s:  # below -1: flagged as well
        layer.run_experts(xd, idd, wd, out=out, stream=s.ptr, path=path, lora_ids=cupy.asarray(bad[[2, 0, 2]] - 1))
    s.synchronize()
    with pytest.raises(MoeCallError, match="bit 2 = a LoRA id outside -1"):
        layer.check_errors()
