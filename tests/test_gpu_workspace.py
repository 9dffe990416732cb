"""GPU: layers sharing one workspace, a second workspace on a second stream, and prebuilt plans.

Every comparison here is bitwise (paths that are bit-reproducible: decode and prefill): a
workspace changes where scratch lives, never what is computed.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import testing
from cupymoe.errors import WorkspaceError
from cupymoe.verify import bf16_bits, check, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

# different shapes, formats (w8a8 decode tickets live in the zeroed region), a shared expert
FAMILIES = (("qwen2_moe", "bf16"), ("deepseek_v3", "fp8_block"), ("gpt_oss", "mxfp4"), ("qwen3_moe", "nvfp4"))
TOKENS = ((1, "decode"), (5, "decode"), (17, "decode"), (64, "prefill"), (300, "prefill"))


def _layers(rng, **kw):
    from cupymoe import MoeLayer

    out = []
    for fam, fmt in FAMILIES:
        cfg = testing.tiny_config(fam)
        hw = testing.random_host_weights(cfg, rng, fmt)
        out.append((cfg, hw, MoeLayer(cfg, hw, max_tokens=300, decode_max_tokens=64, atomic_max_tokens=64, **kw)))
    return out


def _inputs(cases, rng):
    return {(i, n): well_separated_input(cfg, hw, rng, n) for i, (cfg, hw, _) in enumerate(cases) for n, _ in TOKENS}


def test_layers_sharing_one_workspace_match_their_own_scratch_bit_for_bit(rng):
    from cupymoe import MoeLayer, Workspace

    cases = _layers(rng)
    xs = _inputs(cases, rng)
    alone = {(i, n): run_layer(layer, xs[i, n], path) for i, (_, _, layer) in enumerate(cases) for n, path in TOKENS}
    ws = Workspace.for_layers(layer.workspace_need() for _, _, layer in cases)
    assert ws.nbytes < sum(layer.workspace.nbytes for _, _, layer in cases)
    shared = [layer.with_workspace(ws) for _, _, layer in cases]
    built = [MoeLayer(cfg, hw, max_tokens=300, decode_max_tokens=64, atomic_max_tokens=64, workspace=ws)
             for cfg, hw, _ in cases]
    for group in (shared, built):
        for n, path in TOKENS:  # every layer in turn on one stream, as a model runs them
            for i, layer in enumerate(group):
                assert layer.workspace is ws and layer.scratch.ptr("act") >= ws.scratch_base
                np.testing.assert_array_equal(run_layer(layer, xs[i, n], path), alone[i, n], err_msg=f"{i} N={n}")
    cfg, hw, big = cases[1]
    with pytest.raises(WorkspaceError, match="workspace too small"):
        MoeLayer(cfg, hw, max_tokens=4096, workspace=Workspace(1024))


def test_two_workspaces_run_one_layer_set_on_two_streams_at_once(rng):
    """Two-batch overlap: the same layers (one copy of the weights) on a second workspace, the two
    batches' forwards interleaved on two streams without syncs; each equals its serial result."""
    import cupy

    from cupymoe import Workspace

    cases = _layers(rng)
    ws2 = Workspace.for_layers(layer.workspace_need() for _, _, layer in cases)
    second = [layer.with_workspace(ws2) for _, _, layer in cases]
    assert all(b.weights is a.weights for (_, _, a), b in zip(cases, second))
    n = 64
    hosts = [[well_separated_input(cfg, hw, rng, n) for cfg, hw, _ in cases] for _ in range(2)]
    serial = [[run_layer(layer, x, "prefill") for (_, _, layer), x in zip(cases, xb)] for xb in hosts]
    batches = [[cupy.asarray(bf16_bits(x)) for x in xb] for xb in hosts]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = [[cupy.full_like(x, 0x7FC0) for x in xb] for xb in batches]
    cupy.cuda.runtime.deviceSynchronize()  # written on the legacy stream
    for _ in range(10):
        for i in range(len(cases)):  # batch 0 on workspace 1, batch 1 on workspace 2, interleaved
            for b, layers in ((0, [c[2] for c in cases]), (1, second)):
                x, o = batches[b][i], outs[b][i]
                layers[i].forward(int(x.data.ptr), n, int(o.data.ptr), streams[b].ptr, path="prefill")
    for s in streams:
        s.synchronize()
    for b in range(2):
        for i in range(len(cases)):
            got = (cupy.asnumpy(outs[b][i]).astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got, serial[b][i], err_msg=f"batch {b} layer {i}")


def _spin(stream, ms: float) -> None:
    """Keep `stream` busy for about `ms` milliseconds (a one-thread clock loop)."""
    import cupy

    kernel = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "spin")
    kernel((1,), (1,), (np.int64(int(ms * 2e6)),), stream=stream)


def test_a_workspace_used_from_a_new_stream_waits_for_the_old_one(rng):
    """Forwards on one workspace from two streams in turn, no host sync between: the second orders
    itself after the first (an event wait), so both outputs are right."""
    import cupy

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    from cupymoe import MoeLayer

    layer = MoeLayer(cfg, hw, max_tokens=300)
    n = 300
    xs = [well_separated_input(cfg, hw, rng, n) for _ in range(2)]
    want = [run_layer(layer, x, "prefill") for x in xs]
    d = [cupy.asarray(bf16_bits(x)) for x in xs]
    outs = [cupy.full_like(x, 0x7FC0) for x in d]
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.runtime.deviceSynchronize()  # written on the legacy stream
    for _ in range(3):
        _spin(s1, 20)  # the first forward starts late; the second must not overtake it
        layer.forward(int(d[0].data.ptr), n, int(outs[0].data.ptr), s1.ptr)
        layer.forward(int(d[1].data.ptr), n, int(outs[1].data.ptr), s2.ptr)
        s2.synchronize()
        s1.synchronize()
        for o, w in zip(outs, want):
            np.testing.assert_array_equal((cupy.asnumpy(o).astype(np.uint32) << 16).view(np.float32), w)


def test_prebuilt_plans_give_the_bits_of_plans_built_afresh(rng):
    """A forward from a memoised plan (arguments packed once, per-call values patched) equals one from
    a plan built anew, bit for bit; row counts of one prefill shape share one plan; warmup builds
    every plan, after which no forward builds another."""
    cfg = testing.tiny_config("deepseek_v3")
    hw = testing.random_host_weights(cfg, rng, "fp8_block")
    from cupymoe import MoeLayer

    layer = MoeLayer(cfg, hw, max_tokens=1000, decode_max_tokens=16, atomic_max_tokens=16, keep_w8a8_activation=True)
    report = layer.warmup()
    assert report.plans == len(layer._packed) and report.plans >= 16 + 16
    built = len(layer._packed)
    outs = {}
    for n in (1, 7, 16, 17, 100, 333, 1000):
        x = well_separated_input(cfg, hw, rng, n)
        first = run_layer(layer, x)
        assert len(layer._packed) == built, f"N={n} built a plan after warmup"
        assert check(first, cfg, hw, x, layer.select_path(n), layer=layer).ok
        outs[n] = (x, first)
    assert layer.plan_for(333) is layer.plan_for(334)  # one prefill shape
    layer._packed.clear()
    layer._by_n.clear()
    for n, (x, first) in outs.items():
        np.testing.assert_array_equal(run_layer(layer, x), first, err_msg=f"N={n}")
