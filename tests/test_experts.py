"""CPU tests of the experts-only entry (cupymoe/experts.py): its plans launch no router and no
routing kernel but experts_route_in on the call's ids and weights, then the routed plan's very
stages; its refusals name the values; the reference with a given routing is the routed one's."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from cupymoe import bench, reference, testing
from cupymoe.errors import MoeCallError
from cupymoe.experts import check_call, shared_flag
from cupymoe.layer_checks import note_device_pointers
from cupymoe.forward_plan import S, build_forward_plan
from cupymoe.knobs import Knobs
from cupymoe.plan import ErrorBit, CallValue, DeviceFacts, LayerOptions, Path, Stage, plan_layer

H200 = DeviceFacts.h200()
ROUTING_KERNELS = ("router_logits", "topk_route", "decode_route_lists", "decode_topk_lists")


def _plan(cfg, fmt="bf16", dev=H200):
    shared = fmt if cfg.has_shared_expert else None
    return plan_layer(cfg, fmt, shared, dev.arch, options=LayerOptions(decode_max_tokens=64), knobs=Knobs())


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_an_experts_plan_takes_the_calls_routing_then_runs_the_routed_stages(family, fmt):
    cfg = testing.tiny_config(family)
    lp = _plan(cfg, fmt)
    for path, n in ((Path.DECODE, 1), (Path.DECODE, 37), (Path.ATOMIC, 5), (Path.PREFILL, 300)):
        plan = build_forward_plan(lp, H200, n, path, given_routing=True).at(n)
        # w8a8 prefill: x_codes_e4m3, then the ids (x's codes, or x's for a shared expert behind a norm)
        codes_first = path == Path.PREFILL and lp.w8a8 and (not cfg.pre_expert_norm or lp.w8a8_shared_x)
        assert (plan.launches[0].kernel == "x_codes_e4m3") == codes_first
        if codes_first:
            assert plan.launches[0].arg("qx") in (S("qx"), S("qx_shared"))
        first, rest = plan.launches[int(codes_first)], plan.launches[int(codes_first) + 1:]
        assert first.kernel == "experts_route_in" and not first.pdl
        assert first.arg("ids_in") == CallValue.TOPK_IDS and first.arg("w_in") == CallValue.TOPK_WEIGHTS
        assert first.arg("ids_out") == S("topk_ids") and first.arg("w_out") == S("topk_w")
        assert (first.arg("N"), first.arg("R"), first.arg("k")) == (n, cfg.router_width, cfg.num_experts_per_tok)
        assert first.grid == (-(-n // 4),)
        # x's e4m3 codes where w8a8 needs them (at prefill by x_codes_e4m3)
        assert lp.w8a8 == (first.arg("qx") != 0 or codes_first) or cfg.pre_expert_norm
        assert not any(launch.kernel.startswith(ROUTING_KERNELS) for launch in plan.launches)
        assert all(S("logits") not in [a.value for a in launch.args] for launch in plan.launches)  # no router GEMM
        assert all(CallValue.TOKEN_IDS not in [a.value for a in launch.args] for launch in plan.launches)
        if n == 300 or n == 37:  # past the fused routing + lists: the routed plan's steps after its routing
            routed = build_forward_plan(lp, H200, n, path).at(n)
            past_routing = [s for s in routed.steps if s.stage not in (Stage.ROUTER, Stage.TOPK)]
            assert past_routing == list(plan.steps[int(codes_first) + 1:]), (path, n)
        assert rest[-1].kernel in ("decode_reduce", "grouped_reduce") and rest[-1].arg("out") == CallValue.OUTPUT


def test_an_experts_plan_without_the_shared_expert_leaves_it_out_everywhere():
    cfg = bench.preset_config("qwen3-next-80b", routed_only=False)
    assert cfg.has_shared_expert
    lp = _plan(cfg)
    for path, n in ((Path.DECODE, 3), (Path.PREFILL, 700)):
        plan = build_forward_plan(lp, H200, n, path, given_routing=True, shared_expert=False).at(n)
        with_shared = build_forward_plan(lp, H200, n, path, given_routing=True).at(n)
        flags = [a.value for launch in plan.launches for a in launch.args if a.name == "has_shared"]
        assert flags and set(flags) == {0}
        assert {a.value for launch in with_shared.launches for a in launch.args if a.name == "has_shared"} == {1}
        assert [x.kernel for x in plan.launches] == [x.kernel for x in with_shared.launches]


def test_the_error_bits_are_named():
    bits = (ErrorBit.TOKEN_ID_RANGE, ErrorBit.EXPERT_ID_RANGE, ErrorBit.LORA_ID_RANGE, ErrorBit.ROUTER_NAN)
    assert bits == (1, 2, 4, 8)
    from cupymoe.plan import error_text

    assert "expert id outside 0..router_width-1" in error_text(3) and "token id" in error_text(3)
    assert "LoRA id outside -1..max_loras-1" in error_text(4) and error_text(16) == "unknown bits"
    assert "NaN router logits" in error_text(8)


def test_the_kernels_error_bits_are_the_named_ones():
    import re
    from pathlib import Path

    cuda = Path(__file__).resolve().parents[1] / "cuda"
    defined = {m[1]: int(m[2]) for f in sorted(cuda.glob("*.cu*"))
               for m in re.finditer(r"#define ERR_(\w+) (\d+)", f.read_text())}
    assert defined == {b.name: b.value for b in ErrorBit}


def test_bad_experts_calls_are_refused_by_name():
    cfg = testing.tiny_config("qwen3_moe")
    layer = SimpleNamespace(cfg=cfg, max_tokens=8, _device_ptrs=OrderedDict(), device_id=0)
    ok = dict(input_ptr=0x10000, num_tokens=4, topk_ids_ptr=0x20000, topk_weights_ptr=0x30000, output_ptr=0x40000)
    note_device_pointers(layer, *(p for k, p in ok.items() if k.endswith("_ptr")))  # as if the runtime had said so
    assert check_call(layer, **ok) == (4, 0x10000, 0x20000, 0x30000, 0x40000, 0)
    for change, match in (({"num_tokens": 9}, "1..max_tokens=8"), ({"num_tokens": 0}, "num_tokens=0"),
                          ({"num_tokens": True}, "must be an int"), ({"topk_ids_ptr": 0x20002}, "topk_ids_ptr=.*4-byte"),
                          ({"topk_weights_ptr": 0}, "topk_weights_ptr=0"), ({"topk_ids_ptr": None}, "topk_ids_ptr=None"),
                          ({"output_ptr": 0x10000 + 64}, "overlaps input_ptr")):
        with pytest.raises(MoeCallError, match=match):
            check_call(layer, **{**ok, **change})
    assert shared_flag(layer, None) is False
    with pytest.raises(MoeCallError, match="no shared expert"):
        shared_flag(layer, True)
    with pytest.raises(MoeCallError, match="shared_expert='yes'"):
        shared_flag(layer, "yes")
    shared = SimpleNamespace(cfg=testing.tiny_config("qwen2_moe"), max_tokens=8)
    assert shared_flag(shared, None) is True and shared_flag(shared, False) is False


def test_experts_call_pointers_are_asked_of_the_runtime_once(monkeypatch):
    """forward_experts' raw pointers (x, ids, weights, out, LoRA ids) are asked of the runtime as
    forward's are (a host topk_ids_ptr would fault the kernels and lose the context), each new pointer
    once, a pointer the runtime calls host memory refused by name."""
    from cupymoe import layer_checks

    asked = []

    def runtime(name, p, device_id):
        asked.append(p)
        if p == 0x50000:
            raise MoeCallError(f"{name}=0x{p:x}: not CUDA memory")

    monkeypatch.setattr(layer_checks, "check_device_memory", runtime)
    layer = SimpleNamespace(cfg=testing.tiny_config("qwen3_moe"), max_tokens=8, _device_ptrs=OrderedDict(), device_id=0)
    ok = dict(input_ptr=0x10000, num_tokens=4, topk_ids_ptr=0x20000, topk_weights_ptr=0x30000, output_ptr=0x40000)
    check_call(layer, **ok, lora_ids_ptr=0x60000)
    check_call(layer, **ok)
    assert asked == [0x10000, 0x20000, 0x30000, 0x40000, 0x60000]
    with pytest.raises(MoeCallError, match="topk_ids_ptr=0x50000: not CUDA memory"):
        check_call(layer, **{**ok, "topk_ids_ptr": 0x50000})
    layer_checks.note_device_pointers(layer, *range(0x100000, 0x100000 + 16 * 100, 16))
    assert len(layer._device_ptrs) == layer_checks.DEVICE_POINTERS_KEPT  # the oldest dropped


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_the_reference_with_the_routers_own_routing_is_the_layers_output(family, rng):
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng)
    x = testing.random_input(rng, 6, cfg.hidden_size)
    tids = testing.random_token_ids(rng, 6, cfg.hash_vocab_size) if cfg.hash_routing else None
    r = reference.route(cfg, hw, x, tids)
    w = r.weights.astype(np.float32)
    r32 = reference.Routing(r.logits, r.ids, w.astype(np.float64), r.margin)  # the weights as a caller holds them
    want = reference.moe_forward(cfg, hw, x, tids, routing=r32)
    got = reference.experts_forward(cfg, hw, x, r.ids.astype(np.int32), w)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, reference.moe_forward(cfg, hw, x, tids), rtol=1e-5, atol=1e-6)
    if cfg.has_shared_expert:
        routed = reference.experts_forward(cfg, hw, x, r.ids, w, shared_expert=False)
        shared = reference._shared_expert(cfg, hw, np.asarray(x, dtype=np.float64))
        np.testing.assert_allclose(routed + shared, got, rtol=1e-12, atol=1e-12)


def test_the_reference_refuses_a_routing_it_cannot_read():
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, np.random.default_rng(0))
    x = testing.random_input(np.random.default_rng(1), 2, cfg.hidden_size)
    k, R = cfg.num_experts_per_tok, cfg.router_width
    ids, w = np.zeros((2, k), np.int32), np.ones((2, k), np.float32)
    with pytest.raises(ValueError, match=rf"0\.\.{R - 1} \(or -1: no expert\), found 0\.\.{R}"):
        reference.experts_forward(cfg, hw, x, np.where(np.arange(k) == 1, R, ids), w)
    with pytest.raises(ValueError, match=r"ids \(2, 1\)"):
        reference.experts_forward(cfg, hw, x, ids[:, :1], w[:, :1])
    with pytest.raises(ValueError, match="3 rows, x 2"):
        reference.experts_forward(cfg, hw, x, np.zeros((3, k), np.int32), np.ones((3, k), np.float32))


@pytest.mark.parametrize("shared", [True, False])
def test_verify_judges_an_experts_output_against_the_given_routing(shared, rng):
    """verify.check with a given routing: the faithful reference's own output passes, the routed
    forward's (the router's routing, not the given one) fails."""
    from cupymoe.verify import check

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    n, k = 9, cfg.num_experts_per_tok
    x = testing.random_input(rng, n, cfg.hidden_size)
    ids = rng.integers(0, cfg.router_width, size=(n, k)).astype(np.int32)
    w = rng.uniform(0.05, 1.0, size=(n, k)).astype(np.float32)
    routing = reference.given_routing(cfg, ids, w)
    out = reference.experts_forward(cfg, hw, x, ids, w, shared_expert=shared, rounding="decode")
    out = out.astype(np.float32).astype(testing.BF16).astype(np.float32)
    assert check(out, cfg, hw, x, "decode", routing=routing, shared_expert=shared).ok
    assert not check(out, cfg, hw, x, "decode", routing=routing, shared_expert=not shared).ok
    routed = reference.moe_forward(cfg, hw, x).astype(np.float32)
    assert not check(routed, cfg, hw, x, "decode", routing=routing, shared_expert=shared).ok


def test_a_pair_without_expert_adds_nothing_in_the_reference(rng):
    """-1 in a given routing is the kernels' fate of a flagged id: that pair adds nothing."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    x = testing.random_input(rng, 3, cfg.hidden_size)
    ids = np.tile(np.arange(cfg.num_experts_per_tok, dtype=np.int32), (3, 1))
    w = np.full(ids.shape, 0.5, np.float32)
    dropped, zero = ids.copy(), w.copy()
    dropped[1, 0], zero[1, 0] = -1, 0.0
    want = reference.moe_forward(cfg, hw, x, routing=reference.given_routing(cfg, ids, zero))
    got = reference.moe_forward(cfg, hw, x, routing=reference.given_routing(cfg, dropped, w))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # float64; an expert's rows batched otherwise
    with pytest.raises(ValueError, match=r"0\.\.\d+ \(or -1: no expert\)"):
        reference.given_routing(cfg, ids - 2, w)


def test_stored_rows_of_a_token_naming_an_expert_twice_are_fed_in_slot_order():
    from cupymoe.verify import StoredRows, _by_pair

    rows = StoredRows(_by_pair([((3, 0), np.full(4, 1.0)), ((3, 0), np.full(4, 2.0)), ((5, 1), np.full(4, 7.0))]))
    got = rows.feed(3, np.array([0, 0]), np.zeros((2, 4)))
    assert got[0, 0] == 1.0 and got[1, 0] == 2.0 and rows.missing == 0
    rows.feed(5, np.array([1, 1]), np.zeros((2, 4)))  # a second row the kernels did not store
    assert rows.missing == 1
