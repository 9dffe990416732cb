"""GPU: LoRA adapters per row against cupymoe.reference: the router's delta, and the routed and
shared experts' deltas (the LoRA plans of every non-w8a8 layer; the expert tests at the end).

Every check draws fresh inputs (the seed is printed on failure), ids mixing -1, slot 0 and
slot 1 in one batch (ranks 8 and 3, one adapter large enough to re-route rows), poisons the
output with NaN first, and judges each group of rows by cupymoe.verify.check against the
base layer whose router is W + s B A (float64): a router delta changes nothing but the logits,
so those rows are that layer's (tolerances justified in cupymoe/verify.py; the kernel adds
an fp32 delta to fp32 logits, far inside them). Rows whose LoRA routing is a near tie
(margin < verify.ROUTING_MARGIN) are redrawn, as everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from _lora import ALL_TARGETS, merged, random_lora
from cupymoe import reference, testing, verify
from cupymoe.errors import LoraError, MoeCallError
from cupymoe.lora import LoraModule, LoraTarget, LoraWeights
from cupymoe.verify import ROUTING_MARGIN, bf16_bits, bits_to_f32, check

pytestmark = pytest.mark.gpu

MAX_TOKENS = 300
K, RMAX = 3, 8


def _layer(cfg, hw, **kw):
    from cupymoe import MoeLayer

    kw.setdefault("decode_max_tokens", 64)  # tests force every path at every N up to 64
    kw.setdefault("atomic_max_tokens", 64)
    kw.setdefault("max_lora_rank", RMAX)
    return MoeLayer(cfg, hw, max_tokens=MAX_TOKENS, max_loras=K, **kw)


def _adapters(cfg, rng):
    """Router-only adapters: on a non-w8a8 layer the LoRA plan still runs the experts' unfused
    form (g and u stored in bf16), which judge's merged-router check absorbs (2 roundings more
    than its budget of 4, each ~1.6e-3 rms; test_reference_lora measures <= 3.8e-3 normwise)."""
    return {0: random_lora(cfg, rng, rank=8, targets=[LoraTarget.ROUTER], size=0.5),
            1: random_lora(cfg, rng, rank=3, targets=[LoraTarget.ROUTER], size=3.0)}


def separated_input(cfg, hw, rng, n, adapters, ids, also_base=False):
    """A bf16 input whose every row routes with a clear margin under its own adapter (and the base router)."""
    x = testing.random_input(rng, n, cfg.hidden_size)
    for _ in range(50):
        margin = reference.route(cfg, hw, x, lora=adapters, lora_ids=ids).margin
        if also_base:
            margin = np.minimum(margin, reference.route(cfg, hw, x).margin)
        close = np.flatnonzero(margin < ROUTING_MARGIN)
        if close.size == 0:
            return x
        x[close] = testing.random_input(rng, close.size, cfg.hidden_size)
    raise AssertionError(f"rows {close.tolist()} keep drawing near-tie routings")


def run(layer, x, ids, path=None, stream=None):
    """Upload x and the ids, poison the output with NaN, run one forward; the output as float32."""
    import cupy

    s = stream or cupy.cuda.Stream(non_blocking=True)
    with s:
        xd = cupy.asarray(bf16_bits(x))
        idd = None if ids is None else cupy.asarray(np.asarray(ids, np.int32))
        out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)
    layer.forward(int(xd.data.ptr), x.shape[0], int(out.data.ptr), s.ptr, path=path,
                  lora_ids_ptr=0 if idd is None else int(idd.data.ptr))
    s.synchronize()
    return bits_to_f32(out.get())


# The LoRA plans of a non-w8a8 layer store two more bf16 intermediates than the base plans (g
# and u before the gate / up deltas), and on the grouped path round each term again after
# down's delta: verify's accounting (module docstring), one ~1.6e-3 rms rounding each.
LORA_PLAN_ROUNDINGS = {"decode": 2, "grouped": 3}
# The stacked form (CUPYMOE_LORA_IN_GEMM) adds the expert deltas in the GEMMs' fp32 accumulators,
# so it stores what the base plan stores; its one more rounding is s t's in T (the delta's only).
STACKED_ROUNDINGS = 1


def judge(out, cfg, hw, x, ids, adapters, taken, what, layer=None):
    """`out` of the forward just run (call before the layer runs again: the grouped path's check
    reads its stored activation) against the exact layer with the rows' adapters and the faithful
    one of the LoRA plan (reference.moe_forward(lora_plan=True); the stacked form's: the base
    plan's stores, s t rounded as T holds it), by verify.compare's rule with LORA_PLAN_ROUNDINGS
    (STACKED_ROUNDINGS) more roundings in the exact envelope; the envelope's cancellation terms
    (spread, the grouped terms) from each adapter's merged layer, as verify.check takes them."""
    rounding = verify.PATH_ROUNDING[taken]
    ids = np.where(np.isin(ids, list(adapters)), ids, -1)  # an empty slot adds nothing
    exact = reference.moe_forward(cfg, hw, x, lora=adapters, lora_ids=ids)
    acts = verify.KernelActivations(layer, cfg, x.shape[0]) if layer is not None and rounding == "grouped" else None
    parts = _stacked_parts(layer, x.shape[0]) if acts else 0
    faithful = reference.moe_forward(cfg, hw, x, rounding=rounding, lora=_as_stacked(adapters, parts) if parts else adapters,
                                     lora_ids=ids, lora_plan=not parts, kernel_acts=acts.feed if acts else None)
    spread, terms = np.zeros_like(exact), np.zeros_like(exact)
    for slot in np.unique(ids):
        rows = ids == slot
        w = hw if slot < 0 else merged(cfg, hw, adapters[int(slot)])
        spread[rows] = reference.moe_forward(cfg, w, x[rows], absolute="down")
        terms[rows] = reference.moe_forward(cfg, w, x[rows], absolute=True)
    c = verify.compare(out, exact, faithful,
                       roundings=verify.path_roundings(hw, taken) + (STACKED_ROUNDINGS if parts else
                                                                     LORA_PLAN_ROUNDINGS[rounding]),
                       partials=[terms] if rounding == "grouped" else None, spread=spread)
    if acts is not None:
        c.stages = acts.comparison()
    assert c.ok, f"{what}: {c}"


def _ids(rng, n):
    ids = rng.integers(-1, 2, n).astype(np.int32)
    ids[: min(n, 3)] = [-1, 0, 1][: min(n, 3)]  # every kind present whenever N allows
    return ids


def _mixed(layer, cfg, hw, rng, adapters, n, path, what=""):
    """One judged forward of N rows with mixed ids (_ids) on `path`: (ids, x, out)."""
    ids = _ids(rng, n)
    x = separated_input(cfg, hw, rng, n, adapters, ids)
    out = run(layer, x, ids, path)
    judge(out, cfg, hw, x, ids, adapters, layer.select_path(n, path), f"{what} {path} N={n}".strip(), layer)
    return ids, x, out


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_mixed_ids_every_path(family, rng):
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _layer(cfg, hw), _adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for path, ns in (("decode", (1, 3, 7, 33, 64)), ("atomic", (2, 17)), ("prefill", (1, 5, 65, 257, 300))):
        for n in ns:
            _mixed(layer, cfg, hw, rng, adapters, n, path)
    layer.check_errors()


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "nvfp4"), ("deepseek_v3", "fp8_block"),
                                         ("gpt_oss", "mxfp4"), ("qwen2_moe", "fp8_block")])
def test_mixed_ids_formats(family, fmt, rng):
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    # w8a16: verify.check's fp8 w8a8 judge reads the layer's whole-batch codes, not a group of rows
    layer, adapters = _layer(cfg, hw, fp8_compute="w8a16"), _adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for path, n in (("decode", 5), ("decode", 64), ("prefill", 129)):
        _mixed(layer, cfg, hw, rng, adapters, n, path)


def test_an_adapter_reroutes_rows(rng):
    cfg = testing.tiny_config("deepseek_v3")
    hw = testing.random_host_weights(cfg, rng)
    adapters = _adapters(cfg, rng)
    x = testing.random_input(rng, 64, cfg.hidden_size)
    lora = reference.route(cfg, hw, x, lora=adapters, lora_ids=np.ones(64, np.int32))
    moved = lora.ids != reference.route(cfg, hw, x).ids
    assert moved.any(axis=1).mean() > 0.25  # the size-3 adapter changes the experts of many rows


def _same_bits(out, expected, path, what):
    """Bit for bit, but on the atomic path, whose float atomics add the pairs in arrival order [P2]:
    there within one bf16 ulp of the larger value an element (an fp32 sum's last bits, then rounded)."""
    if path != "atomic":
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32), err_msg=what)
        return
    ulp = verify.bf16_ulp(np.maximum(np.abs(out), np.abs(expected)))
    gap = np.abs(out.astype(np.float64) - expected)
    assert np.isfinite(out).all() and (gap <= ulp).all(), f"{what}: {int((gap > ulp).sum())} elements past one ulp"


def test_no_ids_and_base_ids_are_the_base_bits(rng):
    """lora_ids_ptr=0 runs the base plans: the base layer's bits. Ids all -1, an empty slot and a
    zero-B adapter add nothing: the LoRA plan's bits, all equal (a w8a8 layer's LoRA plan, the
    router's delta alone, gives the base bits; a bf16 layer's stores g and u in bf16 first). The
    atomic path's sums follow arrival order, so there equal to one ulp (_same_bits)."""
    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    plain = _layer(cfg, hw)
    layer = _layer(cfg, hw)
    layer.set_lora(0, random_lora(cfg, rng, rank=4, targets=ALL_TARGETS, zero_b=True))
    for path, n in (("decode", 3), ("atomic", 9), ("prefill", 200)):
        x = testing.random_input(rng, n, cfg.hidden_size)
        base = run(plain, x, None, path)
        _same_bits(run(layer, x, None, path), base, path, f"{path} N={n}: no ids")
        minus = run(layer, x, np.full(n, -1), path)
        for ids in (np.zeros(n), np.full(n, 2)):  # slot 2 was never filled
            _same_bits(run(layer, x, ids, path), minus, path, f"{path} N={n}: ids {int(ids[0])}")
        c = check(minus, cfg, hw, x, path)  # the unfused form: within the exact layer's budget
        assert c.normwise <= c.exact_bound, f"{path} N={n}: {c}"


def test_a_watched_lora_forward_records_its_stages_and_keeps_the_bits(rng):
    """Stage events (bench --stages, NVTX tools) watch a LoRA forward as they watch a base one:
    the separated plan (no PDL between stages) gives the same bits and a time for every stage."""
    from cupymoe.profiling import record_stage_events

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    layer.set_lora(0, random_lora(cfg, rng, rank=4, targets=ALL_TARGETS))
    for path, n in (("decode", 5), ("prefill", 200)):
        x = testing.random_input(rng, n, cfg.hidden_size)
        ids = np.where(np.arange(n) % 2 == 0, 0, -1)
        plain = run(layer, x, ids, path)
        events: list = []
        with record_stage_events(events):
            watched = run(layer, x, ids, path)
        np.testing.assert_array_equal(watched.view(np.uint32), plain.view(np.uint32))
        stages = [st for st, _, _ in events]
        assert {"router", "gate_up", "down", "reduce"} <= set(stages), f"{path} N={n}: {stages}"


def test_graph_captured_before_set_lora_replays_the_new_adapter(rng):
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _layer(cfg, hw), _adapters(cfg, rng)
    for path, n in (("decode", 7), ("prefill", 100)):
        _captured_with_empty_slots(layer, cfg, hw, rng, adapters, path, n, "replay")


def _captured_with_empty_slots(layer, cfg, hw, rng, adapters, path, n, what):
    """A forward of N mixed-id rows captured with slots 0 and 1 empty, then _set_replay_clear."""
    import cupy

    ids = _ids(rng, n)
    x = separated_input(cfg, hw, rng, n, adapters, ids, also_base=True)  # judged with slot 1 empty too
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd, idd = cupy.asarray(bf16_bits(x)), cupy.asarray(ids)
        out = cupy.full(xd.shape, 0x7FC0, cupy.uint16)
    layer.clear_lora(0, stream=s.ptr)
    layer.clear_lora(1, stream=s.ptr)
    layer.forward(int(xd.data.ptr), n, int(out.data.ptr), s.ptr, path=path, lora_ids_ptr=int(idd.data.ptr))
    s.begin_capture()
    layer.forward(int(xd.data.ptr), n, int(out.data.ptr), s.ptr, path=path, lora_ids_ptr=int(idd.data.ptr))
    graph = s.end_capture()
    _set_replay_clear(layer, cfg, hw, x, ids, adapters, s, out, graph, path, f"{what} {path} N={n}")


def _set_replay_clear(layer, cfg, hw, x, ids, adapters, s, out, graph, path, what):
    """The adapters set after `graph`'s capture, on its stream; its replay judged and equal to the
    eager forward bit for bit; slot 1 emptied again and the replay judged without it."""
    for slot, lw in adapters.items():  # after the capture, on the replaying stream
        layer.set_lora(slot, lw, stream=s.ptr)
    with s:
        out.fill(0x7FC0)
    graph.launch(s)
    s.synchronize()
    replayed = bits_to_f32(out.get())
    n = x.shape[0]
    judge(replayed, cfg, hw, x, ids, adapters, layer.select_path(n, path), what, layer)
    eager = run(layer, x, ids, path)
    np.testing.assert_array_equal(replayed.view(np.uint32), eager.view(np.uint32))
    layer.clear_lora(1, stream=s.ptr)  # and emptied again: slot 1's rows get the base layer
    graph.launch(s)
    s.synchronize()
    rest = {k: v for k, v in adapters.items() if k != 1}
    judge(bits_to_f32(out.get()), cfg, hw, x, ids, rest, layer.select_path(n, path), f"{what} after clear", layer)


def test_row_invariant_with_lora(rng):
    """A row's bits with its adapter do not depend on N or on the other rows' adapters."""
    cfg = testing.tiny_config("qwen3_next")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _layer(cfg, hw, row_invariant=True, decode_max_tokens=None, atomic_max_tokens=None), \
        _adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    ids = _ids(rng, 37)
    x = testing.random_input(rng, 37, cfg.hidden_size)
    whole = run(layer, x, ids)
    for rows in (slice(0, 1), slice(3, 8), slice(30, 37)):
        part = run(layer, x[rows], ids[rows])
        np.testing.assert_array_equal(part.view(np.uint32), whole[rows].view(np.uint32))


@pytest.mark.parametrize("experts", [288, 48])
def test_grouped_router_delta_spans_and_row_groups(experts, rng):
    """lora_grouped_router_delta at spans of 32 rows (N 1, 37, 300) and 64 (N 3500: one wave of
    blocks at two an SM, the last span 44 rows), its expand (a thread a column, every G-th row of a chunk, two
    rows at once) for a router wider than the block (288: one group walking the columns twice) and
    narrower (48: five groups, 16 threads idle), ids -1 mixed, the output poisoned: judged; rows of
    the 3500-row call equal the same rows run alone (another span) bit for bit."""
    from cupymoe import MoeLayer
    from cupymoe.forward_plan import LoraShape, build_forward_plan, lora_chunk_blocks, lora_router_span
    from cupymoe.plan import Path

    cfg = testing.tiny_config("qwen3_moe", num_experts=experts)
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=3500, max_loras=K, max_lora_rank=RMAX, row_invariant=True)
    adapters = _adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    assert [lora_router_span(n, lora_chunk_blocks(K)) for n in (300, 3500)] == [32, 64]
    for n in (1, 37, 300, 3500):
        plan = build_forward_plan(layer.plan, layer.device, n, Path.PREFILL, lora=LoraShape(K, RMAX, False)).at(n)
        assert "lora_grouped_router_delta" in {getattr(s, "kernel", None) for s in plan.steps}
        ids = _ids(rng, n)
        x = separated_input(cfg, hw, rng, n, adapters, ids)
        out = run(layer, x, ids, "prefill")
        judge(out, cfg, hw, x, ids, adapters, layer.select_path(n, "prefill"), f"router E={experts} N={n}", layer)
    rows = slice(3450, 3500)
    np.testing.assert_array_equal(run(layer, x[rows], ids[rows], "prefill").view(np.uint32), out[rows].view(np.uint32))


def test_a_slot_fill_waits_for_every_workspace_that_reads_the_slots(rng, monkeypatch):
    """with_workspace copies share the adapter slots: set_lora / clear_lora on any of them wait for the
    last forward of every bound workspace (a second stream's forwards could read a slot mid-copy)."""
    import cupy

    from cupymoe import Workspace, lora_slots

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    ws2 = Workspace.for_layers([layer.workspace_need()])
    other = layer.with_workspace(ws2)
    waited = []
    real_wait = lora_slots.Driver.wait
    monkeypatch.setattr(lora_slots.Driver, "wait", staticmethod(lambda s, e: (waited.append(e), real_wait(s, e))))
    s = cupy.cuda.Stream(non_blocking=True)
    adapter = random_lora(cfg, rng, rank=2, targets=[LoraTarget.ROUTER])
    for fill in (lambda: layer.set_lora(0, adapter, s.ptr), lambda: other.clear_lora(0, s.ptr)):
        waited.clear()
        fill()
        assert sorted(waited) == sorted([layer.workspace.done_event, ws2.done_event])
    s.synchronize()


def test_refusals(rng):
    import cupy

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    experts = random_lora(cfg, rng, rank=2, targets=[LoraTarget.ROUTER, LoraTarget.GATE], experts=[1])
    with pytest.raises(LoraError, match=f"rank 9 exceeds the maximum rank {RMAX}"):
        layer.set_lora(0, random_lora(cfg, rng, rank=9, targets=[LoraTarget.ROUTER]))
    with pytest.raises(LoraError, match=r"slot=3: must be in 0..max_loras-1 = 0..2"):
        layer.set_lora(3, random_lora(cfg, rng, rank=2, targets=[LoraTarget.ROUTER]))
    with pytest.raises(LoraError, match="reserved no adapter slots"):
        from cupymoe import MoeLayer

        MoeLayer(cfg, hw, max_tokens=8).set_lora(0, experts)
    s = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros((4, cfg.hidden_size), cupy.uint16)
    out = cupy.zeros_like(x)
    with pytest.raises(MoeCallError, match="lora_ids_ptr=0x3: must be 4-byte aligned"):
        layer.forward(int(x.data.ptr), 4, int(out.data.ptr), s.ptr, lora_ids_ptr=3)
    s.begin_capture()
    try:
        with pytest.raises(LoraError, match="during stream capture"):
            layer.set_lora(0, random_lora(cfg, rng, rank=2, targets=[LoraTarget.ROUTER]), stream=s.ptr)
    finally:
        s.end_capture()
    with s:  # uploaded on the forward's stream: a non-blocking stream does not wait for the null stream's copy
        ids = cupy.asarray(np.array([0, 5, -1, 1], np.int32))  # 5 >= max_loras: an error bit, no delta
    layer.forward(int(x.data.ptr), 4, int(out.data.ptr), s.ptr, lora_ids_ptr=int(ids.data.ptr))
    with pytest.raises(MoeCallError, match="bit 2 = a LoRA id"):
        layer.check_errors()
    with s:
        ids = cupy.asarray(np.array([0, -2, -1, 1], np.int32))  # -2: neither the base layer nor a slot
    layer.forward(int(x.data.ptr), 4, int(out.data.ptr), s.ptr, lora_ids_ptr=int(ids.data.ptr))
    with pytest.raises(MoeCallError, match="bit 2 = a LoRA id outside -1"):
        layer.check_errors()


# --- the experts' deltas -------------------------------------------------------------------------

def _expert_adapters(cfg, rng):
    """Adapters on every module the layer has (router, routed experts, shared expert): ranks 8
    and 3, deltas ~0.3 and ~0.5 of each map's output (a re-routing router delta included)."""
    return {0: random_lora(cfg, rng, rank=8, targets=ALL_TARGETS, size=0.3),
            1: random_lora(cfg, rng, rank=3, targets=ALL_TARGETS, size=0.5)}


EXPERT_CASES = (("decode", (1, 5, 37)), ("atomic", (5, 37)), ("prefill", (1, 5, 37, 300)))


@pytest.mark.parametrize("family, fmt, kernel", [("qwen3_moe", "bf16", "register"), ("qwen3_moe", "bf16", "swapab"),
                                                 ("deepseek_v3", "bf16", "swapab"), ("qwen3_moe", "fp8_block", None),
                                                 ("deepseek_v3", "fp8_block", None), ("qwen3_moe", "nvfp4", None)])
def test_expert_deltas_on_the_decode_path_past_64_rows(family, fmt, kernel, rng, monkeypatch):
    """The tuning table sends bf16, w8a16 and fp4 layers' decode path past 64 rows (bf16 swap-AB to 1024 on
    the H100, w8a16 to 512, fp4 to 768): the LoRA forwards there, mixed ids, N = 65, 200, 300, 769, judged."""
    if kernel == "swapab" and not testing.on_sm90a():
        pytest.skip("the swap-AB decode needs sm_90a")
    if kernel:
        monkeypatch.setenv("CUPYMOE_DECODE_KERNEL", kernel)
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    from cupymoe import MoeLayer

    layer = MoeLayer(cfg, hw, max_tokens=800, max_loras=K, max_lora_rank=RMAX, fp8_compute="w8a16",
                     decode_max_tokens=800, atomic_max_tokens=64)
    adapters = _expert_adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for n in (65, 200, 300, 769):
        assert layer.select_path(n) == "decode"
        _mixed(layer, cfg, hw, rng, adapters, n, "decode", f"{family} {fmt} {kernel or ''}")
    layer.check_errors()


@pytest.mark.parametrize("family, fmt", [(f, "bf16") for f in testing.FAMILIES] +
                         [("qwen3_moe", "nvfp4"), ("deepseek_v3", "fp8_block"), ("gpt_oss", "mxfp4"),
                          ("qwen2_moe", "fp8_block")])
def test_expert_deltas_every_path(family, fmt, rng):
    """Mixed ids (-1, 0, 1) over awkward N on every path, outputs poisoned first, judged by
    `judge` (tolerances there); the expert deltas must move the output far beyond them."""
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    layer, adapters = _layer(cfg, hw, fp8_compute="w8a16"), _expert_adapters(cfg, rng)
    # gpt-oss's experts are fused tensors, which PEFT's per-module naming cannot name: router only
    experts_named = any(k.target != LoraTarget.ROUTER for k in adapters[0].modules)
    assert experts_named == (family != "gpt_oss")
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for path, ns in EXPERT_CASES:
        for n in ns:
            ids, x, out = _mixed(layer, cfg, hw, rng, adapters, n, path, f"{family} {fmt}")
            lora_rows = ids >= 0
            if lora_rows.any() and experts_named:  # the same rows through the merged router alone: far off
                router_only = {s: LoraWeights({k: m for k, m in lw.modules.items() if k.target == LoraTarget.ROUTER})
                               for s, lw in adapters.items()}
                other = reference.moe_forward(cfg, hw, x, lora=router_only, lora_ids=ids)
                moved = verify.compare(out[lora_rows], other[lora_rows]).normwise
                assert moved > 8 * verify.EXACT_NORMWISE, f"{path} N={n}: expert deltas moved the output {moved:.2e}"
    layer.check_errors()


@pytest.mark.parametrize("family, fmt, version", [("gpt_oss", "bf16", "0.20.0"), ("gpt_oss", "mxfp4", "0.17.1"),
                                                   ("qwen3_moe", "bf16", "0.18.0"), ("longcat_flash", "bf16", "0.19.1")])
def test_stacked_expert_adapters_from_peft(family, fmt, version, tmp_path, rng):
    """PEFT target_parameters adapters on the stacked experts (cupymoe/lora_fused.py), loaded by load_peft:
    gpt-oss's experts take expert deltas this way only (its interleaved gate / up, its clamped
    activation and biases); PEFT's two orientations (0.17-0.18: lora_A spans qwen's output). Mixed ids
    on every path, judged as test_expert_deltas_every_path's, the deltas far beyond the tolerance."""
    from _lora import STACKED_LAYER, stacked_adapter, write_stacked_peft
    from cupymoe.lora import load_peft

    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    layer = _layer(cfg, hw, fp8_compute="w8a16")
    adapters = {}
    for slot, rank in ((0, 8), (1, 3)):
        tensors, _ = stacked_adapter(cfg, rng, version, rank=rank, size=0.5 / rank ** 0.5)
        adapters[slot] = load_peft(write_stacked_peft(tmp_path / f"a{slot}", tensors, version, rank=rank),
                                   STACKED_LAYER, cfg, max_rank=RMAX)
        assert {k.target for k in adapters[slot].modules} == {LoraTarget.GATE, LoraTarget.UP, LoraTarget.DOWN}
        layer.set_lora(slot, adapters[slot])
    for path, ns in EXPERT_CASES:
        for n in ns:
            ids, x, out = _mixed(layer, cfg, hw, rng, adapters, n, path, f"{family} {fmt} stacked")
            lora_rows = ids >= 0
            if lora_rows.any():  # the same rows without their adapters: far off
                moved = verify.compare(out[lora_rows], reference.moe_forward(cfg, hw, x)[lora_rows]).normwise
                assert moved > 8 * verify.EXACT_NORMWISE, f"{path} N={n}: expert deltas moved the output {moved:.2e}"
    layer.check_errors()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_expert_deltas_fp4_wgmma_decode(fmt, rng, monkeypatch):
    """The tiny configs' K are no multiples of 128, so their fp4 decode never runs
    decode_wgmma_fp4.cu: its gate/up epilogue's g and u stores (ACT_PAIR) are judged here, at
    H = 256, I = 128 with the knob forcing it, in 8-row (N = 1, 5) and 16-row passes (N = 37)."""
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    monkeypatch.setenv("CUPYMOE_FP4_DECODE", "wgmma")
    cfg = testing.tiny_config("qwen3_moe", hidden_size=256, moe_intermediate_size=128)
    hw = testing.random_host_weights(cfg, rng, fmt)
    layer, adapters = _layer(cfg, hw), _expert_adapters(cfg, rng)
    if not layer.plan.fp4_wgmma_ok:
        pytest.skip("decode_wgmma_fp4.cu needs sm_90a")
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for n in (1, 5, 37):
        plan = build_forward_plan(layer.plan, layer.device, n, Path.DECODE, lora=LoraShape(K, RMAX, True)).at(n)
        assert any(getattr(s, "kernel", "").startswith("decode_wgmma_gate_up_fp4<") for s in plan.steps), n
        ids = _ids(rng, n)
        x = separated_input(cfg, hw, rng, n, adapters, ids)
        judge(run(layer, x, ids, "decode"), cfg, hw, x, ids, adapters, layer.select_path(n, "decode"),
              f"wgmma {fmt} decode N={n}", layer)
    layer.check_errors()


def test_router_slots_refuse_expert_adapters(rng):
    """fp8 w8a8 quantizes the activation inside gate/up: by default its slots take router adapters
    alone and refuse an expert module by name, before anything is copied; so does any layer built
    with lora_experts=False."""
    cfg = testing.tiny_config("deepseek_v3")
    experts = random_lora(cfg, rng, rank=2, targets=[LoraTarget.ROUTER, LoraTarget.GATE], experts=[1])
    for fmt, kw in (("fp8_block", dict(fp8_compute="w8a8")), ("bf16", dict(lora_experts=False))):
        layer = _layer(cfg, testing.random_host_weights(cfg, rng, fmt), **kw)
        assert not layer.lora_experts
        with pytest.raises(LoraError, match=r"gate modules \(model.layers.0.mlp.experts.1.gate_proj\): this "
                                            r"layer's slots take the router's alone"):
            layer.set_lora(0, experts)
        assert 0 not in layer._lora.loaded
        layer.set_lora(0, random_lora(cfg, rng, rank=2, targets=[LoraTarget.ROUTER]))
        # the experts-only entry leaves the router's delta to the caller: these slots would add nothing
        import cupy as cp
        n, k = 3, cfg.num_experts_per_tok
        x, ids = cp.zeros((n, cfg.hidden_size), cp.uint16), cp.zeros((n, k), cp.int32)
        w, out, lids = cp.ones((n, k), cp.float32), cp.zeros((n, cfg.hidden_size), cp.uint16), cp.zeros(n, cp.int32)
        with pytest.raises(LoraError, match=r"lora_experts=False\), and the experts-only entry adds expert deltas"):
            layer.forward_experts(x.data.ptr, n, ids.data.ptr, w.data.ptr, out.data.ptr, 0, lora_ids_ptr=lids.data.ptr)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_w8a8_layer_with_expert_slots(family, rng):
    """MoeLayer(fp8_compute="w8a8", lora_experts=True): the base forwards keep the w8a8 kernels, the LoRA
    forwards run the experts as w8a16 (plan.lora_options) on one workspace; mixed ids on every path,
    judged as test_expert_deltas_every_path's (the w8a16 layer's roundings)."""
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, "fp8_block")
    # keep_w8a8_activation: verify.require_kept_activation reads layer.plan (w8a8); the LoRA forwards' w8a16
    # plans store their bf16 act either way, which judge's grouped check reads
    layer = _layer(cfg, hw, fp8_compute="w8a8", lora_experts=True, keep_w8a8_activation=True)
    adapters = _expert_adapters(cfg, rng)
    assert layer.lora_experts and layer.fp8_compute == "w8a8"
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for path, ns in EXPERT_CASES:
        for n in ns:
            base = [getattr(s, "kernel", "") for s in layer.forward_plan(n, path).steps]
            assert any("a8" in k or "fp8" in k for k in base), (path, n, base)  # the w8a8 kernels
            _mixed(layer, cfg, hw, rng, adapters, n, path, f"{family} w8a8 layer")
            lora = [getattr(s, "kernel", "") for s in layer._lora_plans[(path, n, False)].plan.at(n).steps]
            assert not any("_a8" in k or "sm90_fp8" in k for k in lora), (path, n, lora)
    layer.check_errors()


def test_the_torch_module_passes_lora_ids_bit_for_bit(rng):
    """MoeModule(layer)(x, lora_ids=...) (any integer dtype) and the op under torch.cuda.graph give
    the raw forward's bits."""
    torch = pytest.importorskip("torch")
    import cupymoe.torch as ct

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _layer(cfg, hw), _expert_adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    module = ct.MoeModule(layer)
    n = 37
    ids = _ids(rng, n)
    x = separated_input(cfg, hw, rng, n, adapters, ids)
    want = run(layer, x, ids)
    xt = torch.from_numpy(bf16_bits(x).view(np.int16)).view(torch.bfloat16).cuda()
    got = module(xt, lora_ids=torch.from_numpy(ids).long().cuda())
    torch.cuda.synchronize()
    assert np.array_equal(bits_to_f32(got.view(torch.int16).cpu().numpy().view(np.uint16)), want)
    static_ids = torch.from_numpy(ids).cuda()
    module(xt, lora_ids=static_ids)  # warm outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = module(xt, lora_ids=static_ids)
    g.replay()
    torch.cuda.synchronize()
    assert np.array_equal(bits_to_f32(out.view(torch.int16).cpu().numpy().view(np.uint16)), want)


# --- the grouped (prefill) deltas: lora_grouped_gate_up_act / lora_grouped_down_delta ----------

def _grouped_layer(cfg, hw, max_rank, stack=0, shrink="chunks", max_loras=4, **kw):
    """A layer for the grouped deltas (stack 0: CUPYMOE_LORA_IN_GEMM off, read at build) or the stacked form
    (its shrinks as CUPYMOE_LORA_STACK_SHRINK says)."""
    import os
    from unittest import mock

    from cupymoe import MoeLayer

    if not kw.get("row_invariant"):
        kw.setdefault("decode_max_tokens", 64)
        kw.setdefault("atomic_max_tokens", 64)
    with mock.patch.dict(os.environ, {"CUPYMOE_LORA_IN_GEMM": str(stack), "CUPYMOE_LORA_STACK_SHRINK": shrink}):
        return MoeLayer(cfg, hw, max_tokens=1100, max_loras=max_loras, max_lora_rank=max_rank, **kw)


def _ranked_adapters(cfg, rng, max_rank):
    """Four adapters of different ranks (max_rank, 3, 1 and one on two experts only, so that most
    experts' segments of slot 3 are empty), every module."""
    return {0: random_lora(cfg, rng, rank=max_rank, targets=ALL_TARGETS, size=0.3),
            1: random_lora(cfg, rng, rank=3, targets=ALL_TARGETS, size=0.5),
            2: random_lora(cfg, rng, rank=1, targets=ALL_TARGETS, size=0.4),
            3: random_lora(cfg, rng, rank=2, targets=ALL_TARGETS, experts=[0, 1], size=0.5)}


def _prefill_uses_grouped(layer, n, max_rank):
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    plan = build_forward_plan(layer.plan, layer.device, n, Path.PREFILL, lora=LoraShape(4, max_rank, True)).at(n)
    kinds = {getattr(s, "kernel", None) for s in plan.steps}
    return {"lora_grouped_gate_up_act", "lora_grouped_down_delta"} <= kinds


def _captured_prefill(layer, x, ids):
    """A prefill forward of x with ids run once eagerly and once under capture on a new stream:
    (the stream, the output, the graph, the uploads the graph reads)."""
    import cupy

    n = x.shape[0]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd, idd = cupy.asarray(bf16_bits(x)), cupy.asarray(ids)
        out = cupy.full(xd.shape, 0x7FC0, cupy.uint16)
    layer.forward(int(xd.data.ptr), n, int(out.data.ptr), s.ptr, path="prefill", lora_ids_ptr=int(idd.data.ptr))
    s.begin_capture()
    layer.forward(int(xd.data.ptr), n, int(out.data.ptr), s.ptr, path="prefill", lora_ids_ptr=int(idd.data.ptr))
    graph = s.end_capture()
    return s, out, graph, (xd, idd)  # keep the uploads alive while the graph replays


@pytest.mark.parametrize("max_rank, invariant", [(16, True), (32, True), (12, True), (5, True), (16, False)])
def test_grouped_deltas_awkward_n(max_rank, invariant, rng):
    """The prefill path's grouped deltas at awkward N (tiles of 1 row, partial 16-row chunks, tiles
    of up to 192 rows, one LORA_SUB pass each, at 1100), ids -1 mixed with four adapters of ranks max_rank, 3, 1, 2
    (B rows of max_rank 5 and 12 read by the unaligned fragment loads; max_rank 32: shared memory
    past 48 KB, opted in at load), output poisoned first;
    then ids past the slots (base rows and an error bit). A row-invariant layer runs them (and
    lora_grouped_router_delta) at every prefill N; a plain one past the one-block sort (the
    per-pair kernels below it)."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _grouped_layer(cfg, hw, max_rank, row_invariant=invariant)
    adapters = _ranked_adapters(cfg, rng, max_rank)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for n in (1, 5, 67, 300, 1100):
        assert _prefill_uses_grouped(layer, n, max_rank) == (invariant or n * cfg.num_experts_per_tok > 1024)
        _judge_ranked(layer, cfg, hw, rng, adapters, n, f"grouped r{max_rank}")
    layer.check_errors()
    _judge_id_past_slots(layer, cfg, hw, rng, adapters, f"grouped r{max_rank}")


def _judge_ranked(layer, cfg, hw, rng, adapters, n, what):
    """A prefill of n rows, ids -1 .. 3 (each present where N allows), judged."""
    ids = rng.integers(-1, 4, n).astype(np.int32)
    ids[: min(n, 5)] = [-1, 0, 1, 2, 3][: min(n, 5)]
    x = separated_input(cfg, hw, rng, n, adapters, ids)
    judge(run(layer, x, ids, "prefill"), cfg, hw, x, ids, adapters, layer.select_path(n, "prefill"), f"{what} N={n}",
          layer)


def _judge_id_past_slots(layer, cfg, hw, rng, adapters, what, n=1100):
    """Ids -1 .. 3, every 97th row 4 (past the 4 slots) and every 97th from row 50 -3: those rows get
    the base layer and the call an error bit."""
    ids = rng.integers(-1, 4, n).astype(np.int32)
    ids[::97], ids[50::97] = 4, -3
    x = separated_input(cfg, hw, rng, n, adapters, np.where((ids < 4) & (ids >= -1), ids, -1))
    judge(run(layer, x, ids, "prefill"), cfg, hw, x, ids, adapters, layer.select_path(n, "prefill"),
          f"{what} N={n} with id 4", layer)
    with pytest.raises(MoeCallError, match="bit 2 = a LoRA id"):
        layer.check_errors()


def _near_copies(cfg, hw, rng, adapters, n):
    """n near-copies of one row (ids 0, 1, -1, 2, 0, 3 over and over), those routing with a clear
    margin kept (over half of them): a few experts take ~all rows."""
    ids = np.resize(np.array([0, 1, -1, 2, 0, 3], np.int32), n)
    base = testing.random_input(rng, 1, cfg.hidden_size)
    x = (base + 0.01 * testing.random_input(rng, n, cfg.hidden_size)).astype(base.dtype)
    keep = reference.route(cfg, hw, x, lora=adapters, lora_ids=ids).margin >= ROUTING_MARGIN
    assert keep.sum() > n // 2, "the near-copies should route with a clear margin"
    return x[keep], ids[keep]


def test_grouped_deltas_one_expert_takes_most_rows(rng):
    """Near-copies of one row route alike: a few experts get ~all 600 rows (full tiles,
    chunks of one adapter back to back); the shared expert's run too."""
    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _grouped_layer(cfg, hw, 16, row_invariant=True), _ranked_adapters(cfg, rng, 16)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    x, ids = _near_copies(cfg, hw, rng, adapters, 600)
    counts = np.bincount(reference.route(cfg, hw, x, lora=adapters, lora_ids=ids).ids.ravel(),
                         minlength=cfg.num_experts)
    assert counts.max() > 128
    judge(run(layer, x, ids, "prefill"), cfg, hw, x, ids, adapters, layer.select_path(x.shape[0], "prefill"),
          "one expert most rows", layer)


def test_grouped_deltas_graph_replay_and_row_invariance(rng):
    """Graph replay of a grouped-delta prefill equals the eager forward bit for bit, and a row's
    bits do not depend on the batch (each mma row is its own sum)."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _grouped_layer(cfg, hw, 16, row_invariant=True), _ranked_adapters(cfg, rng, 16)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    n = 1100
    ids = rng.integers(-1, 4, n).astype(np.int32)
    x = testing.random_input(rng, n, cfg.hidden_size)
    eager = run(layer, x, ids, "prefill")
    s, out, graph, _inputs = _captured_prefill(layer, x, ids)
    with s:
        out.fill(0x7FC0)
    graph.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(bits_to_f32(out.get()).view(np.uint32), eager.view(np.uint32))
    for rows in (slice(0, 1), slice(5, 72), slice(700, 1100)):
        part = run(layer, x[rows], ids[rows], "prefill")
        np.testing.assert_array_equal(part.view(np.uint32), eager[rows].view(np.uint32))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_sliced_pair_deltas(family, rng, monkeypatch):
    """The per-pair kernels with their shrinks split over slices (forward_plan.lora_slices > 1,
    lora_tickets electing each item's last block): H = 776 and I = 392 (slices of uneven vector
    counts), ranks 16 / 12 / 5 beside 3 and 1, ids -1, 0..2 and one past the slots, on decode,
    atomic and the one-block-sort prefill; each forward twice and the second bit for bit the
    first (the tickets are zeros again; decode and prefill: the atomic path adds in arrival
    order), and the judged output against the reference."""
    from cupymoe.forward_plan import LoraShape, build_forward_plan, lora_slices
    from cupymoe.plan import Path

    monkeypatch.setenv("CUPYMOE_LORA_FOLD", "0")  # lora_router_delta at one row too (the fold: its own test)
    monkeypatch.setenv("CUPYMOE_LORA_ROUTER_T_ROWS", "0")  # and in prefill (the router's t in its GEMM: its own test)
    cfg = testing.tiny_config(family, hidden_size=776, moe_intermediate_size=392)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    for ranks in ((16, 12, 5), (3, 1, 16)):
        layer = _layer(cfg, hw, fp8_compute="w8a16", max_lora_rank=16)
        adapters = {s: random_lora(cfg, rng, rank=r, targets=ALL_TARGETS, size=0.3) for s, r in enumerate(ranks)}
        for slot, lw in adapters.items():
            layer.set_lora(slot, lw)
        for path, ns in (("decode", (1, 3, 17)), ("atomic", (5,)), ("prefill", (1, 6, 41))):
            for n in ns:
                plan = build_forward_plan(layer.plan, layer.device, n, Path(path),
                                          lora=LoraShape(K, 16, True, fold=False)).at(n)
                split = [s for s in plan.steps if getattr(s, "kernel", "") in
                         ("lora_router_delta", "lora_gate_up_act", "lora_down_delta")]
                assert split and all(s.grid[1] > 1 for s in split), (path, n, [s.grid for s in split])
                assert split[0].grid == (n, lora_slices(n, cfg.hidden_size))
                ids = rng.integers(-1, 3, n).astype(np.int32)
                ids[: min(n, 4)] = [-1, 0, 1, 2][: min(n, 4)]
                x = separated_input(cfg, hw, rng, n, adapters, ids)
                out = run(layer, x, ids, path)
                judge(out, cfg, hw, x, ids, adapters, layer.select_path(n, path), f"sliced {path} N={n} {ranks}",
                      layer)
                if path == "atomic":  # float atomics add the pairs in arrival order: not bit-reproducible [P2]
                    continue
                again = run(layer, x, ids, path)
                assert np.array_equal(again.view(np.uint32), out.view(np.uint32)), f"{path} N={n}: not reproducible"
        layer.check_errors()
        bad = np.array([0, K], np.int32)  # an id past the slots: flagged, adds nothing
        run(layer, testing.random_input(rng, 2, cfg.hidden_size), bad, "decode")
        with pytest.raises(MoeCallError):
            layer.check_errors()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_grouped_deltas_split_grid(family, rng):
    """The grouped deltas' grids: lora_chunk_blocks blocks a tile (a tile's chunks spread over
    them) and lora_grouped_down_delta's column slices, here H = 1544 (3 slices of 65, 65, 63
    vectors) and I = 392, ranks 16 / 12 / 5 beside 3 (max_rank 16, 4 slots) and, on a layer of 6
    slots (8 blocks a tile), 16 / 1 / 2 / 5 / 3 / 12; ids -1 and past the slots; each forward
    twice bit for bit, and a row's bits the same alone and in the batch (row_invariant)."""
    from cupymoe import MoeLayer
    from cupymoe.forward_plan import LoraShape, build_forward_plan, lora_chunk_blocks, lora_down_slices
    from cupymoe.plan import Path

    cfg = testing.tiny_config(family, hidden_size=1544, moe_intermediate_size=392)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    assert lora_down_slices(cfg.hidden_size) == 3
    for ranks in ((16, 12, 5, 3), (16, 1, 2, 5, 3, 12)):
        K = len(ranks)
        layer = MoeLayer(cfg, hw, max_tokens=1100, max_loras=K, max_lora_rank=16, row_invariant=True)
        adapters = {s: random_lora(cfg, rng, rank=r, targets=ALL_TARGETS, size=0.3) for s, r in enumerate(ranks)}
        for slot, lw in adapters.items():
            layer.set_lora(slot, lw)
        for n in (5, 1100):
            plan = build_forward_plan(layer.plan, layer.device, n, Path.PREFILL, lora=LoraShape(K, 16, True)).at(n)
            grids = {s.kernel: s.grid for s in plan.steps if getattr(s, "kernel", "").startswith("lora_grouped_")}
            y = lora_chunk_blocks(K)
            assert grids["lora_grouped_gate_up_act"][1:] == (y,) and grids["lora_grouped_down_delta"][1:] == (y, 3)
            assert grids["lora_grouped_router_delta"][1:] == (y,)
            ids = rng.integers(-1, K + 1, n).astype(np.int32)  # K: past the slots
            ids[: min(n, K + 1)] = np.arange(-1, K)[: min(n, K + 1)]
            x = separated_input(cfg, hw, rng, n, adapters, np.where(ids < K, ids, -1))
            out = run(layer, x, ids, "prefill")
            judge(out, cfg, hw, x, ids, adapters, layer.select_path(n, "prefill"), f"split grid N={n} {ranks}", layer)
            again = run(layer, x, ids, "prefill")
            assert np.array_equal(again.view(np.uint32), out.view(np.uint32)), f"N={n}: not reproducible"
            if n > 1:
                one = run(layer, x[n // 2: n // 2 + 1], ids[n // 2: n // 2 + 1], "prefill")
                assert np.array_equal(one.view(np.uint32), out[n // 2: n // 2 + 1].view(np.uint32)), f"N={n}: row"
        with pytest.raises(MoeCallError, match="bit 2 = a LoRA id"):
            layer.check_errors()


# --- the stacked form (CUPYMOE_LORA_IN_GEMM; cupymoe/lora_stack.py) ---------------------------------
# The experts' deltas as extra K of the TMA GEMMs: gate/up activates g + B_g t_g and u + B_u t_u from
# fp32 accumulators and down stores bf16(w (y + B t)) once, so the form makes fewer roundings than
# LORA_PLAN_ROUNDINGS["grouped"] grants; s t is rounded to bf16 (parts 1: ~2^-9 of a delta that is
# ~0.3-0.5 of its map's output) or kept to ~2^-17 (parts 2). The judge and its tolerances are the
# grouped deltas' own.



@dataclass(frozen=True)
class _StackedModule(LoraModule):
    """A routed or shared expert's module as the stacked form computes it: B (s t) with s t held
    as T holds it (`parts` bf16 values, lora_stack.split_parts)."""

    parts: int = 1

    def delta(self, x):
        from cupymoe import lora_stack

        st = (x @ self.a.astype(x.dtype).T * x.dtype.type(self.scale)).astype(np.float32)
        t = sum(lora_stack.split_parts(st, self.parts)).astype(x.dtype)
        return t @ self.b.astype(x.dtype).T


def _as_stacked(adapters, parts):
    """The adapters with each expert map's s t rounded as the stacked form's T (the router's delta is not stacked)."""
    def mod(k, m):
        if k.target == LoraTarget.ROUTER:
            return m
        return _StackedModule(m.name, m.a, m.b, m.scale, parts)
    return {slot: LoraWeights({k: mod(k, m) for k, m in lw.modules.items()}, lw.source) for slot, lw in adapters.items()}


def _stacked_parts(layer, n):
    """The stacked form's parts where `layer`'s prefill of n rows runs it, else 0."""
    slots = getattr(layer, "_lora", None)
    if slots is None or not slots.stack_parts:
        return 0
    return slots.stack_parts if _prefill_uses_stacked(layer, n, slots.max_rank) else 0


def _stacked_layer(monkeypatch, cfg, hw, max_rank, parts, variant="auto", shrink="chunks", **kw):
    if variant != "auto":
        monkeypatch.setenv("CUPYMOE_SM90_VARIANT", variant)
    layer = _grouped_layer(cfg, hw, max_rank, stack=parts, shrink=shrink, **kw)
    assert layer._lora.stack_parts == parts
    return layer


def _prefill_uses_stacked(layer, n, max_rank):
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    shape = LoraShape(layer._lora.max_loras, max_rank, True, layer._lora.stack_parts, layer._lora_stack_shrink)
    # the LoRA plans' LayerPlan (a w8a8 layer with expert slots: its w8a16 one)
    plan = build_forward_plan(layer._lora_plan, layer.device, n, Path.PREFILL, lora=shape).at(n)
    kinds = [getattr(s, "kernel", "") for s in plan.steps]
    # a gate/up shrink and a down shrink, each in any form (auto mixes them: down's by segments where its K is short)
    stacked = all(any(k.startswith(forms) for k in kinds)
                  for forms in (("lora_stack_t_seg<2,", "lora_stack_t_seg_experts<2,", "lora_stack_t_gate_up"),
                                ("lora_stack_t_seg<1,", "lora_stack_t_seg_experts<1,", "lora_stack_t_down")))
    if layer._lora_stack_shrink in ("segments", "experts"):
        assert not stacked or "lora_stack_t_gate_up" not in kinds
    assert stacked == (sum(k.startswith(("grouped_gemm_sm90_tma_lora<", "grouped_gemm_lora<0", "grouped_gemm_lora<1")) for k in kinds) == 2)
    return stacked and not {"lora_grouped_gate_up_act", "lora_grouped_down_delta"} & set(kinds)


def _judge_stacked_ns(layer, cfg, hw, rng, max_rank, what):
    """Four ranked adapters into the layer's slots, then prefills of N 67 (below the one-block sort:
    today's kernels), 300 and 1100 (the stacked form) judged; returns the adapters."""
    adapters = _ranked_adapters(cfg, rng, max_rank)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    for n in (67, 300, 1100):
        assert _prefill_uses_stacked(layer, n, max_rank) == (n * cfg.num_experts_per_tok > 1024)
        _judge_ranked(layer, cfg, hw, rng, adapters, n, what)
    return adapters


SHRINKS = ("chunks", "segments", "experts")  # CUPYMOE_LORA_STACK_SHRINK


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("variant, max_rank, parts", [("auto", 16, 1), ("auto", 16, 2), ("auto", 5, 1),
                                                     ("tma", 16, 1), ("tma_wide", 16, 2), ("tma_192", 5, 1),
                                                     ("auto", 32, 1)])
def test_stacked_awkward_n(variant, max_rank, parts, shrink, rng, monkeypatch):
    """The stacked form on each TMA variant (auto: gather_wide gate/up, tma_192 down) at N 300 and 1100 (past the one-block sort; below it today's kernels), ids -1
    mixed with four adapters of ranks max_rank, 3, 1 and 2 (the last on two experts only), the
    output poisoned first, judged against the reference; then ids past the slots (base rows and an
    error bit). Rank 32: the segments' widest B (2 R = 64 columns)."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _stacked_layer(monkeypatch, cfg, hw, max_rank, parts, variant, shrink)
    what = f"stacked {shrink} {variant} r{max_rank} parts {parts}"
    adapters = _judge_stacked_ns(layer, cfg, hw, rng, max_rank, what)
    layer.check_errors()
    _judge_id_past_slots(layer, cfg, hw, rng, adapters, what)


@pytest.mark.parametrize("shrink", SHRINKS)
def test_stacked_eight_slots_rank_12(shrink, rng):
    """Eight slots of rank 12 (K R = 96: KS 128 at one part; the segments' gate/up BN 32 for 24
    columns), adapters in slots 1, 3, 6 and 7 only, I = 200 (down's K past its last whole 64-column
    step), the shared expert, ids -1 .. 7 mixed (an empty slot's rows get the base layer), N 1100
    judged against the reference, and again bit for bit."""
    cfg = testing.tiny_config("qwen2_moe", moe_intermediate_size=200)
    hw = testing.random_host_weights(cfg, rng)
    layer = _grouped_layer(cfg, hw, 12, stack=1, shrink=shrink, max_loras=8)
    assert layer._lora.stack_parts == 1
    adapters = dict(zip((1, 3, 6, 7), _ranked_adapters(cfg, rng, 12).values()))
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    n = 1100
    assert _prefill_uses_stacked(layer, n, 12)
    ids = rng.integers(-1, 8, n).astype(np.int32)
    ids[:9] = np.arange(-1, 8)
    ref_ids = np.where(np.isin(ids, list(adapters)), ids, -1)
    x = separated_input(cfg, hw, rng, n, adapters, ref_ids)
    out = run(layer, x, ids, "prefill")
    judge(out, cfg, hw, x, ref_ids, adapters, layer.select_path(n, "prefill"), f"stacked {shrink} eight slots r12", layer)
    assert np.array_equal(run(layer, x, ids, "prefill").view(np.uint32), out.view(np.uint32)), "not reproducible"
    layer.check_errors()


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("max_rank, parts", [(16, 1), (5, 2)])
def test_stacked_w8a16(family, max_rank, parts, shrink, rng):
    """The stacked form on fp8_block experts with bf16 activations (grouped_gemm_lora: grouped.cu's
    GEMM and its extra K pass over T and Bext) at N 67 (today's per-pair kernels), 300 and 1100,
    with and without the shared expert, ids -1 mixed with four adapters of ranks max_rank, 3, 1,
    2, judged against the reference; the forward twice bit for bit; then ids past the slots."""
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, "fp8_block")
    layer = _grouped_layer(cfg, hw, max_rank, stack=parts, shrink=shrink, fp8_compute="w8a16")
    assert layer._lora.stack_parts == parts
    what = f"stacked {shrink} w8a16 {family} r{max_rank} parts {parts}"
    adapters = _judge_stacked_ns(layer, cfg, hw, rng, max_rank, what)
    ids = rng.integers(-1, 4, 1100).astype(np.int32)
    x = separated_input(cfg, hw, rng, 1100, adapters, ids)
    out = run(layer, x, ids, "prefill")
    assert np.array_equal(run(layer, x, ids, "prefill").view(np.uint32), out.view(np.uint32)), "not reproducible"
    layer.check_errors()
    _judge_id_past_slots(layer, cfg, hw, rng, adapters, what)


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("parts", [1, 2])
def test_stacked_one_expert_takes_most_rows(parts, shrink, rng, monkeypatch):
    """Near-copies of one row: a few experts (and the shared expert's run) get ~all rows, full tiles
    for the shrinks, many M tiles of one expert for the GEMMs."""
    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _stacked_layer(monkeypatch, cfg, hw, 16, parts, shrink=shrink), _ranked_adapters(cfg, rng, 16)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    x, ids = _near_copies(cfg, hw, rng, adapters, 1000)
    assert _prefill_uses_stacked(layer, x.shape[0], 16)
    counts = np.bincount(reference.route(cfg, hw, x, lora=adapters, lora_ids=ids).ids.ravel(),
                         minlength=cfg.num_experts)
    assert counts.max() > 256
    judge(run(layer, x, ids, "prefill"), cfg, hw, x, ids, adapters, layer.select_path(x.shape[0], "prefill"),
          f"stacked {shrink} parts {parts}: one expert most rows", layer)


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("variant", ["tma", "tma_192"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_stacked_several_column_tiles(variant, family, shrink, rng, monkeypatch):
    """The stacked form where both GEMMs have several column tiles (H = 1544, I = 392: 4-13 tiles,
    so Bext's boxes past the first tile and the B row n0 of the extra steps are read), with and
    without the shared expert; ids -1 .. 3, judged, and the forward twice bit for bit."""
    cfg = testing.tiny_config(family, hidden_size=1544, moe_intermediate_size=392)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    layer = _stacked_layer(monkeypatch, cfg, hw, 16, 1, variant, shrink)
    adapters = _ranked_adapters(cfg, rng, 16)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    n = 1100
    assert _prefill_uses_stacked(layer, n, 16)
    ids = rng.integers(-1, 4, n).astype(np.int32)
    ids[:5] = [-1, 0, 1, 2, 3]
    x = separated_input(cfg, hw, rng, n, adapters, ids)
    out = run(layer, x, ids, "prefill")
    judge(out, cfg, hw, x, ids, adapters, layer.select_path(n, "prefill"), f"stacked {shrink} {variant} {family} tiles",
          layer)
    again = run(layer, x, ids, "prefill")
    assert np.array_equal(again.view(np.uint32), out.view(np.uint32)), "not reproducible"
    layer.check_errors()


def test_stacked_bext_packing(rng, monkeypatch):
    """Each Bext on the device is lora_stack.stacked_b of the slots' B (every part's columns), after
    set_lora of four adapters and after a clear (its columns zeros again, the others untouched)."""
    from cupymoe import lora_stack

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    for parts in (1, 2):
        layer = _stacked_layer(monkeypatch, cfg, hw, 5, parts)
        for slot, lw in _ranked_adapters(cfg, rng, 5).items():
            layer.set_lora(slot, lw)
        for cleared in (None, 1):
            if cleared is not None:
                layer.clear_lora(cleared)
            slots = layer._lora
            for p in ("gate", "up", "down"):
                b = slots._arrays[f"lora_{p}_b"].get()  # [K, S, out, R] bf16 bits
                want = lora_stack.stacked_b(b, parts).reshape(-1, slots.stack_width)
                np.testing.assert_array_equal(slots._stacked[f"lora_{p}_bx"].get(), want, err_msg=f"{p} {cleared}")


def test_stacked_without_adapters_is_the_base_layer(rng, monkeypatch):
    """Ids all -1 and an empty slot: T is zeros, so the extra K adds exact zeros to every
    accumulator: the base plan's values (and the router's zero delta leaves the logits)."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _stacked_layer(monkeypatch, cfg, hw, 16, 1)
    layer.set_lora(0, random_lora(cfg, rng, rank=4, targets=ALL_TARGETS))
    for n in (300, 1100):
        assert _prefill_uses_stacked(layer, n, 16)
        x = testing.random_input(rng, n, cfg.hidden_size)
        base = run(layer, x, None, "prefill")
        for ids in (np.full(n, -1), np.full(n, 2)):  # slot 2 was never filled
            np.testing.assert_array_equal(run(layer, x, ids, "prefill"), base)  # -0 == +0


def test_stacked_graph_captured_before_set_lora(rng, monkeypatch):
    """A graph captured with empty slots replays the adapters set after it (Bext's columns filled in
    place), equal to the eager forward bit for bit; cleared again, slot 1's rows get the base layer."""
    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _stacked_layer(monkeypatch, cfg, hw, 16, 1), _ranked_adapters(cfg, rng, 16)
    n = 1100
    assert _prefill_uses_stacked(layer, n, 16)
    ids = rng.integers(-1, 4, n).astype(np.int32)
    x = separated_input(cfg, hw, rng, n, adapters, ids, also_base=True)
    s, out, graph, _inputs = _captured_prefill(layer, x, ids)
    _set_replay_clear(layer, cfg, hw, x, ids, adapters, s, out, graph, "prefill", "stacked replay")


# --- the prefill overlap (forward_plan.lora_overlap, CUPYMOE_LORA_OVERLAP): the router delta by PDL
# after the router (its shrinks beside it, the logits after its wait), each stacked GEMM by PDL after
# its shrink (T read after its wait, before the extra K). The arithmetic is the plain launches'.
@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_prefill_overlap_bit_for_bit(fmt, shrink, rng, monkeypatch):
    """qwen2_moe (its shared expert), four adapters of ranks 16, 3, 1 and 2, ids -1 .. 3 mixed: a
    prefill graph of the overlapped layer captured with empty slots replays the adapters set after
    it (judged, bit for bit the eager forward); then N 300 and 1100 (the stacked form; fp8_block as
    w8a16) judged, the overlapped layer bit for bit the plainly launched one, and an id past the
    slots flagged by the overlapped router delta."""
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng, fmt)
    kw = {"fp8_compute": "w8a16"} if fmt == "fp8_block" else {}
    layers = {}
    for v in ("1", "0"):
        monkeypatch.setenv("CUPYMOE_LORA_OVERLAP", v)
        layers[v] = _grouped_layer(cfg, hw, 16, stack=1, shrink=shrink, **kw)
    layer, adapters, n = layers["1"], _ranked_adapters(cfg, rng, 16), 1100
    plan = build_forward_plan(layer.plan, layer.device, n, Path.PREFILL,
                              lora=LoraShape(4, 16, True, 1, layer._lora_stack_shrink)).at(n)
    pdl = sorted(s.kernel.split("<")[0] for s in plan.steps if getattr(s, "pdl", False))
    assert pdl == ["grouped_gemm_lora" if fmt == "fp8_block" else "grouped_gemm_sm90_tma_lora"] * 2 + \
        ["lora_grouped_router_delta"], pdl
    ids = rng.integers(-1, 4, n).astype(np.int32)
    ids[:5] = [-1, 0, 1, 2, 3]
    x = separated_input(cfg, hw, rng, n, adapters, ids, also_base=True)
    s, out, graph, _inputs = _captured_prefill(layer, x, ids)
    _set_replay_clear(layer, cfg, hw, x, ids, adapters, s, out, graph, "prefill", f"overlap {fmt} {shrink} replay")
    for each in layers.values():
        for slot, lw in adapters.items():
            each.set_lora(slot, lw)
    for m in (300, n):
        assert _prefill_uses_stacked(layer, m, 16) and _prefill_uses_stacked(layers["0"], m, 16)
        over = run(layer, x[:m], ids[:m], "prefill")
        judge(over, cfg, hw, x[:m], ids[:m], adapters, layer.select_path(m, "prefill"), f"overlap {fmt} N={m}", layer)
        plain = run(layers["0"], x[:m], ids[:m], "prefill")
        assert np.array_equal(over.view(np.uint32), plain.view(np.uint32)), f"{fmt} {shrink} N={m}: not the plain bits"
    layer.check_errors()
    _judge_id_past_slots(layer, cfg, hw, rng, adapters, f"overlap {fmt} {shrink}")


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_shrink_runs_bit_for_bit(fmt, rng, monkeypatch):
    """The stacked gate/up shrink with a run's tiles LORA_SUB rows a block (lora_stack_t_gate_up_runs,
    CUPYMOE_LORA_SHRINK_RUNS=1) against a tile a block (=0): qwen2_moe (its shared expert's run
    too), four adapters of ranks 16, 3, 1 and 2, ids -1 .. 3 mixed, N 300 and 1100: judged, and bit
    for bit the tile form (a row's t does not depend on the rows beside it in its chunk). w8a16 on
    64-row tiles (CUPYMOE_MATH_ROWS past every run): runs of several tiles taken three a block, cut
    at LORA_SUB rows and at the run's end; bf16 on the TMA GEMM's 128-row tiles: the plan keeps a tile a
    block (forward_plan._stacked_gemm), the same bits."""
    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng, fmt)
    kw = {"fp8_compute": "w8a16"} if fmt == "fp8_block" else {}
    if fmt == "fp8_block":
        monkeypatch.setenv("CUPYMOE_MATH_ROWS", "65536")  # grouped.cu's 64-row tiles (stream_q)
    layers = {}
    for v in ("1", "0"):
        monkeypatch.setenv("CUPYMOE_LORA_SHRINK_RUNS", v)
        layers[v] = _grouped_layer(cfg, hw, 16, stack=1, **kw)
    adapters, n = _ranked_adapters(cfg, rng, 16), 1100
    for each in layers.values():
        for slot, lw in adapters.items():
            each.set_lora(slot, lw)
    ids = rng.integers(-1, 4, n).astype(np.int32)
    ids[:5] = [-1, 0, 1, 2, 3]
    x = separated_input(cfg, hw, rng, n, adapters, ids)
    for m in (300, n):
        # bf16: the TMA GEMM's tiles hold an expert's rows whole, so the plan keeps the tile form
        assert ("lora_stack_t_gate_up_runs" if fmt == "fp8_block" else "lora_stack_t_gate_up") \
            in _stack_kernels(layers["1"], m)
        assert "lora_stack_t_gate_up" in _stack_kernels(layers["0"], m)
        runs = run(layers["1"], x[:m], ids[:m], "prefill")
        judge(runs, cfg, hw, x[:m], ids[:m], adapters, layers["1"].select_path(m, "prefill"), f"runs {fmt} N={m}",
              layers["1"])
        tiles = run(layers["0"], x[:m], ids[:m], "prefill")
        assert np.array_equal(runs.view(np.uint32), tiles.view(np.uint32)), f"{fmt} N={m}: not the tile form's bits"
    layers["1"].check_errors()


def _stack_kernels(layer, n):
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    shape = LoraShape(layer._lora.max_loras, layer._lora.max_rank, True, layer._lora.stack_parts,
                      layer._lora_stack_shrink, shrink_runs=layer._lora_shrink_runs)
    plan = build_forward_plan(layer.plan, layer.device, n, Path.PREFILL, lora=shape).at(n)
    return [s.kernel for s in plan.steps if getattr(s, "kernel", "").startswith("lora_stack_t")]


def _router_kernels(layer, n):
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    shape = LoraShape(layer._lora.max_loras, layer._lora.max_rank, True, layer._lora.stack_parts,
                      layer._lora_stack_shrink)
    plan = build_forward_plan(layer.plan, layer.device, n, Path.PREFILL, lora=shape).at(n)
    return [s.kernel.split("<")[0] for s in plan.steps[:3] if hasattr(s, "kernel")]


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])  # topk_route_lora<0>; <1>: group-limited
def test_prefill_router_t(family, rng, monkeypatch):
    """The router's LoRA t as more column tiles of the router GEMM and its expand inside top-k
    (forward_plan.lora_router_t, up to CUPYMOE_LORA_ROUTER_T_ROWS rows), four adapters of ranks 16,
    3, 1 and 2, ids -1 .. 3 mixed: a prefill graph captured with empty slots replays the adapters set
    after it (judged, bit for bit the eager forward); N 300 and 1000 judged (the router's K split
    copies summed by top-k), as is the same layer with lora_grouped_router_delta (the knob 0); an id
    past the slots flagged by topk_route_lora."""
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    layers = {}
    for v in ("1024", "0"):
        monkeypatch.setenv("CUPYMOE_LORA_ROUTER_T_ROWS", v)
        layers[v] = _grouped_layer(cfg, hw, 16, stack=1)
    layer, adapters, n = layers["1024"], _ranked_adapters(cfg, rng, 16), 1000
    assert _router_kernels(layer, n)[:2] == ["grouped_gemm_lora", "topk_route_lora"]
    assert _router_kernels(layer, 1025)[1] == "lora_grouped_router_delta"
    assert _router_kernels(layers["0"], n)[1] == "lora_grouped_router_delta"
    ids = rng.integers(-1, 4, n).astype(np.int32)
    ids[:5] = [-1, 0, 1, 2, 3]
    x = separated_input(cfg, hw, rng, n, adapters, ids, also_base=True)
    s, out, graph, _inputs = _captured_prefill(layer, x, ids)
    _set_replay_clear(layer, cfg, hw, x, ids, adapters, s, out, graph, "prefill", f"router t {family} replay")
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
        layers["0"].set_lora(slot, lw)
    for m in (300, n):
        for v, each in layers.items():
            judge(run(each, x[:m], ids[:m], "prefill"), cfg, hw, x[:m], ids[:m], adapters,
                  each.select_path(m, "prefill"), f"router t rows {v} {family} N={m}", each)
    layer.check_errors()
    _judge_id_past_slots(layer, cfg, hw, rng, adapters, f"router t {family}", n=700)


# --- the per-pair kernels' early start (cuda/lora.cu "Early start"; DECISIONS.md "LoRA: the decode
# deltas start beside the base kernels"): the shrink, the ticket and the expand of the held columns
# run before the PDL wait, only the base output's read-modify-write after it.
EARLY_CASES = (("decode", (1, 37)), ("atomic", (5,)), ("prefill", (3,)))  # 37: swap-AB's 64-row tile


def _early_check(layer, cfg, hw, rng, adapters, what):
    """Every EARLY_CASES path and N: mixed ids, output poisoned, judged; each forward again bit for
    bit (not atomic: arrival order, DECISIONS P2) and, on decode, equal bit for bit to the separated
    plan's (stage events: no PDL, so each wait is a no-op and the launch order covers everything);
    then an id past the slots flagged."""
    from cupymoe.profiling import record_stage_events

    for path, ns in EARLY_CASES:
        for n in ns:
            ids, x, out = _mixed(layer, cfg, hw, rng, adapters, n, path, what)
            if path == "atomic":
                continue
            again = run(layer, x, ids, path)
            assert np.array_equal(again.view(np.uint32), out.view(np.uint32)), f"{what} {path} N={n}: not reproducible"
            if path == "decode":
                with record_stage_events([]):
                    watched = run(layer, x, ids, path)
                assert np.array_equal(watched.view(np.uint32), out.view(np.uint32)), f"{what} N={n}: separated differs"
    layer.check_errors()
    bad = np.array([0, K, -1], np.int32)  # an id past the slots: flagged, adds nothing
    run(layer, testing.random_input(rng, 3, cfg.hidden_size), bad, "decode")
    with pytest.raises(MoeCallError):
        layer.check_errors()


# Past the held columns, each on a small layer (the float64 reference's cost): H = 4104 (down's
# expand past LORA_HOLD_DOWN 16 x 256 columns) or the shared expert's I = 2056 (gate/up's past
# LORA_HOLD 8 x 256; routed I = 64, held alone); fp8_block's I = 2064, whole 16-byte chunks of codes
# (the layer refuses 2056 with UnsupportedFormatError).
WIDE = {"H": dict(hidden_size=4104), "I": dict(shared_expert_intermediate_size=2056),
        "I16": dict(shared_expert_intermediate_size=2064)}


@pytest.mark.parametrize("decode_kernel, fmt, max_rank, wide", [("register", "bf16", 12, "H"),
                                                                ("register", "bf16", 8, "I"),
                                                                ("swapab", "bf16", 8, "H"),
                                                                ("auto", "fp8_block", 12, "I16")])
def test_early_start_held_and_rest_columns(decode_kernel, fmt, max_rank, wide, rng, monkeypatch):
    """The per-pair kernels' second round of columns after the wait (WIDE), ranks 8 and 3 in slots
    of max_rank 8 (16-byte B rows) or 12 (the scalar rank loop), on the decode kernel the knob
    picks (bf16; fp8_block as w8a16), judged by `judge` (_early_check)."""
    monkeypatch.setenv("CUPYMOE_DECODE_KERNEL", decode_kernel)  # read when the layer is built
    cfg = testing.tiny_config("qwen2_moe", **WIDE[wide])
    hw = testing.random_host_weights(cfg, rng, fmt)
    layer = _layer(cfg, hw, fp8_compute="w8a16", max_lora_rank=max_rank)
    adapters = _expert_adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    _early_check(layer, cfg, hw, rng, adapters, f"{decode_kernel} {fmt} rank {max_rank} wide {wide}")


def test_early_start_router_past_held_logits(rng):
    """A router of 288 experts: lora_router_delta holds LORA_HOLD_ROUTER x 256 logits a row before
    its wait and adds the other 32 after it; expert deltas on too, judged as above."""
    cfg = testing.tiny_config("qwen3_moe", num_experts=288)
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _layer(cfg, hw), _expert_adapters(cfg, rng)
    for slot, lw in adapters.items():
        layer.set_lora(slot, lw)
    _early_check(layer, cfg, hw, rng, adapters, "288 experts")


def test_early_start_graph_replay(rng):
    """A decode graph (the PDL chain with early starts) captured with empty slots replays the
    adapters set after it, judged and equal to the eager forward bit for bit (_set_replay_clear)."""
    cfg = testing.tiny_config("deepseek_v3")
    hw = testing.random_host_weights(cfg, rng)
    layer, adapters = _layer(cfg, hw), _expert_adapters(cfg, rng)
    for n in (1, 33):
        _captured_with_empty_slots(layer, cfg, hw, rng, adapters, "decode", n, "early replay")


def _layers_by_knob(monkeypatch, knob, values, cfg, hw):
    """{value: a layer built with the environment variable `knob` set to it} (fp8_block as w8a16;
    the LoRA knobs are read when a layer is built)."""
    layers = {}
    for v in values:
        monkeypatch.setenv(knob, v)
        layers[v] = _layer(cfg, hw, fp8_compute="w8a16")
    return layers


# --- the router's delta folded in at the decode chain's fewest rows (forward_plan.lora_fold): each
# block of a slice of its shrink and that slice's share of its expand more blocks of the router's
# grid (router_logits_bf16_lora), the shares added inside the routing launch
# (decode_route_lists_lora). The tests above judge it wherever they run one decode row (the knob's
# default); this one takes it against the unfolded launches too.
FOLD_CASES = [("qwen3_moe", "bf16"), ("qwen2_moe", "bf16"), ("deepseek_v3", "bf16"), ("mixtral", "bf16"),
              ("deepseek_v3", "fp8_block"), ("qwen3_next", "bf16")]


@pytest.mark.parametrize("family, fmt", FOLD_CASES)
def test_decode_fold_against_the_unfolded_form(family, fmt, rng, monkeypatch):
    """H = 776 (seven uneven slices at one row; 896 in fp8_block, seven of 128 columns): for each id
    (-1, slot 0, slot 1) the folded layer's output and the unfolded layer's are each judged
    (`judge`) and agree to fp32 summation order (a slice's share expanded on its own, the shares
    then summed); a decode graph of the folded layer captured with empty slots replays the adapters
    set after it, bit for bit the eager forward, twice; an id past the slots is flagged (by the
    router's LoRA blocks) and adds nothing."""
    import cupy

    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    cfg = testing.tiny_config(family, hidden_size=776 if fmt == "bf16" else 896)  # fp8_block: 128-column blocks
    hw = testing.random_host_weights(cfg, rng, fmt)
    adapters = _expert_adapters(cfg, rng)
    layers = _layers_by_knob(monkeypatch, "CUPYMOE_LORA_FOLD", ("1", "0"), cfg, hw)
    layer = layers["1"]
    kinds = [getattr(s, "kernel", "") for s in
             build_forward_plan(layer.plan, layer.device, 1, Path.DECODE, lora=LoraShape(K, RMAX, True)).at(1).steps]
    assert kinds[1] == "decode_route_lists_lora" and kinds[0].startswith("router_logits_bf16_lora<"), kinds
    s = cupy.cuda.Stream(non_blocking=True)
    with s:  # captured before any adapter is set
        xd = cupy.zeros((1, cfg.hidden_size), dtype=cupy.uint16)
        idd = cupy.zeros(1, dtype=cupy.int32)
        out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)
        args = (int(xd.data.ptr), 1, int(out.data.ptr), s.ptr)
        layer.forward(*args, path="decode", lora_ids_ptr=int(idd.data.ptr))
        s.begin_capture()
        layer.forward(*args, path="decode", lora_ids_ptr=int(idd.data.ptr))
        graph = s.end_capture()
    s.synchronize()
    for fold_layer in layers.values():
        for slot, lw in adapters.items():
            fold_layer.set_lora(slot, lw)
    for lid in (-1, 0, 1):
        ids = np.array([lid], np.int32)
        x = separated_input(cfg, hw, rng, 1, adapters, ids)
        apart = run(layers["0"], x, ids, "decode")
        judge(apart, cfg, hw, x, ids, adapters, "decode", f"{family} {fmt} unfolded id {lid}", layers["0"])
        folded = run(layer, x, ids, "decode")
        judge(folded, cfg, hw, x, ids, adapters, "decode", f"{family} {fmt} folded id {lid}", layer)
        gap = verify.compare(folded, apart).normwise
        assert gap <= verify.EXACT_NORMWISE, f"{family} {fmt} id {lid}: folded and unfolded {gap:.2e} apart"
        if lid < 0:  # no delta at all: the same logits, the same bits
            assert np.array_equal(folded.view(np.uint32), apart.view(np.uint32))
        with s:
            xd.set(bf16_bits(x))
            idd.set(ids)
            for _ in range(2):
                out.fill(0x7FC0)
                graph.launch(s)
                s.synchronize()
                assert np.array_equal(bits_to_f32(out.get()).view(np.uint32), folded.view(np.uint32)), f"replay {lid}"
    layer.check_errors()
    run(layer, x, np.array([K], np.int32), "decode")  # an id past the slots: flagged
    with pytest.raises(MoeCallError):
        layer.check_errors()


# --- what lora_down_delta's blocks of one pair split (CUPYMOE_LORA_DOWN_SPLIT): its expand's output
# columns (by_cols, the default: each block the pair's whole shrink and lora_slice of H, no ticket)
# or the shrink's input columns (slices meeting at a ticket, the last block expanding). H = 776 and
# 584-row experts (896 / 640 in fp8_block): several uneven column blocks and slices at 1-5 rows. The
# tests above run the default; this one takes it against the sliced form.
SPLIT_CASES = [("qwen3_moe", "bf16"), ("qwen2_moe", "bf16"), ("deepseek_v3", "fp8_block"), ("mixtral", "bf16")]


@pytest.mark.parametrize("family, fmt", SPLIT_CASES)
def test_decode_down_by_columns_against_the_sliced_form(family, fmt, rng, monkeypatch):
    """For decode at N = 1, 3, 37 and atomic at N = 5, mixed ids: the by-columns layer's output and the
    sliced layer's are each judged (`judge`) and agree to fp32 summation order (the shrink summed whole
    against in slices); a row of id -1 alone is bit-equal; a decode graph of the by-columns layer
    captured with empty slots replays the adapters set after it, bit for bit the eager forward."""
    from cupymoe.forward_plan import LoraShape, build_forward_plan
    from cupymoe.plan import Path

    cfg = testing.tiny_config(family, hidden_size=776 if fmt == "bf16" else 896,
                              moe_intermediate_size=584 if fmt == "bf16" else 640)
    hw = testing.random_host_weights(cfg, rng, fmt)
    adapters = _expert_adapters(cfg, rng)
    layers = _layers_by_knob(monkeypatch, "CUPYMOE_LORA_DOWN_SPLIT", ("cols", "shrink"), cfg, hw)
    for lay in layers.values():
        for slot, lw in adapters.items():
            lay.set_lora(slot, lw)
    layer = layers["cols"]
    steps = build_forward_plan(layer.plan, layer.device, 1, Path.DECODE, lora=LoraShape(K, RMAX, True)).at(1).steps
    down = next(s for s in steps if getattr(s, "kernel", "") == "lora_down_delta")
    assert next(a.value for a in down.args if a.name == "by_cols") == 1 and down.grid[1] > 1, down.grid
    for path, n in (("decode", 1), ("decode", 3), ("decode", 37), ("atomic", 5)):
        ids = _ids(rng, n)
        x = separated_input(cfg, hw, rng, n, adapters, ids)
        outs = {}
        for form, lay in layers.items():
            outs[form] = run(lay, x, ids, path)
            judge(outs[form], cfg, hw, x, ids, adapters, path, f"{family} {fmt} {form} {path} N={n}", lay)
        gap = verify.compare(outs["cols"], outs["shrink"]).normwise
        assert gap <= verify.EXACT_NORMWISE, f"{family} {fmt} {path} N={n}: by columns and sliced {gap:.2e} apart"
        if path == "decode" and (ids < 0).all():  # no delta at all: the same bits
            assert np.array_equal(outs["cols"].view(np.uint32), outs["shrink"].view(np.uint32))
    layer.check_errors()
    _captured_with_empty_slots(layer, cfg, hw, rng, adapters, "decode", 3, f"{family} {fmt} by columns")


# --- the decode's gate/up shrinks as blocks of the bf16 swap-AB gate/up (CUPYMOE_LORA_SWAPAB,
# forward_plan.lora_swapab): decode_swapab_gate_up_lora's LoRA blocks stream the adapters' A rows
# through its ring and store s t, lora_gate_up_expand_act adds the expands and makes act. Ranks 8
# and 16 (one LoRA block an expert: 3 adapters of 8 or 16 rows, the tile's other rows never
# copied), 32 (two blocks: adapters 0-1, then 2 alone) and 64 (a block an adapter), on a routed-only
# family and on shared experts; N from 9 (the smallest swap-AB decode) to 64 with one expert taking
# most rows; the grid by table slot (the tiny layers' default) and by active expert
# (CUPYMOE_GATE_UP_AHEAD=off: the lists first, as where the three-pass sort makes them).
SWAPAB_LORA_CASES = [("qwen3_moe", 8, "auto"), ("qwen2_moe", 16, "auto"), ("deepseek_v3", 32, "off"),
                     ("mixtral", 16, "off"), ("qwen2_moe", 64, "off")]


@pytest.mark.parametrize("family, max_rank, ahead", SWAPAB_LORA_CASES)
def test_swapab_lora_shrink(family, max_rank, ahead, rng, monkeypatch):
    """Mixed ids (-1, 0, 1, and 2: an empty slot) at N = 9, 37, 64 on the decode path (and 37 on the
    atomic path), outputs
    poisoned first and judged (`judge`); the same inputs through the per-pair kernels' layer (knob
    off) agree to fp32 summation order (the shrink's sums in the wgmma's order, not the block's
    reduction), and bit for bit where no row has an adapter; the plan runs the swap-AB form;
    each forward again bit for bit; a captured decode graph replays the eager bits; an id past the
    slots is flagged and adds nothing."""
    import cupy

    from cupymoe.forward_plan import build_forward_plan
    from cupymoe.plan import Path

    monkeypatch.setenv("CUPYMOE_DECODE_KERNEL", "swapab")  # read when the layer is built
    monkeypatch.setenv("CUPYMOE_GATE_UP_AHEAD", ahead)
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, "bf16")
    adapters = _expert_adapters(cfg, rng)
    layers = {}
    for v in ("on", "off"):
        monkeypatch.setenv("CUPYMOE_LORA_SWAPAB", v)
        layers[v] = _layer(cfg, hw, max_lora_rank=max_rank)
        for slot, lw in adapters.items():
            layers[v].set_lora(slot, lw)
    layer = layers["on"]
    for n in (9, 37, 64):
        kinds = [getattr(s, "kernel", "") for s in
                 build_forward_plan(layer.plan, layer.device, n, Path.DECODE, lora=layer.lora_shape("test")).at(n).steps]
        assert any(k.startswith("decode_swapab_gate_up_lora<") for k in kinds) and "lora_gate_up_expand_act" in kinds, kinds
        ids = rng.integers(-1, K, n).astype(np.int32)
        ids[:4] = [-1, 0, 1, 2]  # slot 2 is empty: no delta
        if n == 64:
            ids[4:36] = 0
        x = separated_input(cfg, hw, rng, n, adapters, np.where(ids < 2, ids, -1))  # slot 2 routes as the base
        if n == 64:  # one expert takes most rows (row 1's, adapter 0): a run of several token passes
            x[4:36] = x[1]
        out = run(layer, x, ids, "decode")
        judge(out, cfg, hw, x, ids, adapters, "decode", f"{family} rank {max_rank} swap-AB N={n}", layer)
        again = run(layer, x, ids, "decode")
        assert np.array_equal(again.view(np.uint32), out.view(np.uint32)), f"N={n}: not reproducible"
        apart = run(layers["off"], x, ids, "decode")
        gap = verify.compare(out, apart).normwise
        assert gap <= verify.EXACT_NORMWISE, f"N={n}: swap-AB and per-pair forms {gap:.2e} apart"
        base = run(layer, x, np.full(n, -1, np.int32), "decode")
        assert np.array_equal(base.view(np.uint32), run(layers["off"], x, np.full(n, -1, np.int32),
                                                        "decode").view(np.uint32)), f"N={n}: base rows differ"
        if n == 37:  # the atomic path's gate/up is the same launch (its down adds into acc)
            judge(run(layer, x, ids, "atomic"), cfg, hw, x, ids, adapters, "atomic",
                  f"{family} rank {max_rank} swap-AB atomic N={n}", layer)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd = cupy.asarray(bf16_bits(x))
        idd = cupy.asarray(ids)
        o = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)
        args = (int(xd.data.ptr), n, int(o.data.ptr), s.ptr)
        s.begin_capture()
        layer.forward(*args, path="decode", lora_ids_ptr=int(idd.data.ptr))
        graph = s.end_capture()
        graph.launch(s)
    s.synchronize()
    assert np.array_equal(bits_to_f32(o.get()).view(np.uint32), out.view(np.uint32)), "graph replay differs"
    layer.check_errors()
    run(layer, x, np.full(n, K, np.int32), "decode")  # ids past the slots: flagged
    with pytest.raises(MoeCallError):
        layer.check_errors()
