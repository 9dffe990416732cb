"""GPU: the decode and atomic paths against cupymoe.reference, graphs, streams, refusals.

Every check draws fresh random inputs (the seed is printed on failure), poisons the output
with NaN before the run, and judges with cupymoe.verify.compare (tolerances justified in
cupymoe/verify.py: per element 2^-8 |ref| + 2^-7 rms(ref), normwise 2^-8).
"""

from __future__ import annotations


import numpy as np
import pytest

from cupymoe import catalog as C, reference, testing
from cupymoe.verify import bf16_bits, bits_to_f32, check, compare, references, run_layer, well_separated_input

pytestmark = pytest.mark.gpu

TOKENS = (1, 2, 3, 4, 7, 16, 33, 64)
MAX_TOKENS = 64


def _layer(cfg, hw, **kw):
    from cupymoe import MoeLayer

    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("decode_max_tokens", kw["max_tokens"])  # tests force every path at every N
    kw.setdefault("atomic_max_tokens", kw["max_tokens"])
    return MoeLayer(cfg, hw, **kw)


def _check(layer, cfg, hw, rng, n, path, token_ids=None):
    x = well_separated_input(cfg, hw, rng, n, token_ids)
    taken = layer.select_path(n, path)
    c = check(run_layer(layer, x, path, token_ids), cfg, hw, x, taken, token_ids, layer)
    assert c.ok, f"{cfg.model_type} N={n} {path} ({taken}): {c}"


@pytest.fixture(scope="module", params=testing.FAMILIES)
def family_layer(request, rng):
    cfg = testing.tiny_config(request.param)
    hw = testing.random_host_weights(cfg, rng)
    return cfg, hw, _layer(cfg, hw)


@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
def test_families_against_reference(family_layer, rng, path):
    cfg, hw, layer = family_layer
    for n in TOKENS:
        _check(layer, cfg, hw, rng, n, path)


VARIANTS = {
    "sqrtsoftplus_bias": dict(family="deepseek_v3", scoring_func="sqrtsoftplus", n_group=1, topk_group=1),
    "softmax_bias_groups": dict(family="deepseek_v3", scoring_func="softmax"),
    "pre_norm": dict(family="qwen2_moe", pre_expert_norm=True),
    "pre_norm_zero_experts": dict(family="longcat_flash", pre_expert_norm=True),
    "gelu": dict(family="qwen3_moe", hidden_act="gelu"),
    "gelu_tanh": dict(family="mixtral", hidden_act="gelu_tanh"),
    "topk_softmax_scaled": dict(family="gpt_oss", routed_scaling_factor=1.5),
    "wide_k": dict(family="qwen3_next", num_experts_per_tok=12),
    "ungated_shared": dict(family="qwen2_moe", has_shared_expert_gate=False),
    # the fused decode routing's register path (routing.cuh route_row_regs), which the tiny
    # families (R <= 20, deepseek's groups of 4) do not reach: groups of one and of two
    # registers, a router of 16 registers a lane, more than 32 picks
    "register_groups": dict(family="deepseek_v3", num_experts=128, n_group=4, topk_group=2),
    "register_group_pairs": dict(family="deepseek_v3", num_experts=128, n_group=2, topk_group=1),
    "wide_router": dict(family="qwen3_next", num_experts=300),
    "k_over_32": dict(family="qwen3_moe", num_experts=80, num_experts_per_tok=40),
}


NAN_ROUTERS = {f: dict(family=f) for f in testing.FAMILIES} | {
    v: VARIANTS[v] for v in ("register_groups", "wide_router", "k_over_32", "topk_softmax_scaled")}


@pytest.mark.parametrize("name", sorted(NAN_ROUTERS))
def test_a_nan_input_row_is_flagged_and_the_other_rows_are_as_the_reference(name, rng):
    """A row of x that is NaN makes NaN router logits: check_errors names them (ErrorBit.ROUTER_NAN)
    on every path, and the other rows are judged against the reference without that row."""
    from cupymoe.layer import MoeCallError

    kw = dict(NAN_ROUTERS[name])
    cfg = testing.tiny_config(kw.pop("family"), **kw)
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    for path in ("decode", "atomic", "prefill"):
        for n in (1, 4, 33):
            x = well_separated_input(cfg, hw, rng, n)
            bad = n // 2
            with_nan = x.copy()
            with_nan[bad] = np.nan
            out = run_layer(layer, with_nan, path)
            with pytest.raises(MoeCallError, match="NaN router logits"):
                layer.check_errors()
            keep = np.arange(n) != bad
            if keep.any():
                c = check(out[keep], cfg, hw, x[keep], layer.select_path(n, path))
                assert c.ok, f"{name} N={n} {path}: {c}"
    layer.check_errors()  # the bit was cleared


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
def test_routing_and_expert_variants(name, path, rng):
    kw = dict(VARIANTS[name])
    cfg = testing.tiny_config(kw.pop("family"), **kw)
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    for n in (1, 3, 17, 64):
        _check(layer, cfg, hw, rng, n, path)


def test_router_tiles_by_rows_and_width(rng):
    """The prefill router GEMM takes 128 x 128 tiles ("math") only when they fill at least
    half the SMs (heuristics.router_config); both configurations against the reference."""
    from cupymoe.heuristics import router_config

    cfg = testing.tiny_config("qwen3_next", num_experts=300)
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw, max_tokens=4099, decode_max_tokens=8, atomic_max_tokens=8)
    for n in (1024, 4099):
        tiles = -(-cfg.router_width // 128) * -(-n // 128)
        want = "math" if 2 * tiles >= layer.device.sm_count else "stream"
        assert router_config(layer.plan, layer.device, n) == want
        _check(layer, cfg, hw, rng, n, "prefill")


def test_hash_routing_with_token_ids(rng):
    from cupymoe.layer import MoeCallError

    cfg = testing.tiny_config("deepseek_v3", hash_routing=True, hash_vocab_size=50, n_group=1, topk_group=1)
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    for n in (1, 4, 33):
        for path in ("decode", "prefill"):
            _check(layer, cfg, hw, rng, n, path, testing.random_token_ids(rng, n, 50))
    import cupy

    x = cupy.asarray(bf16_bits(testing.random_input(rng, 2, cfg.hidden_size)))
    with pytest.raises(MoeCallError, match="hash routing .* needs token_ids_ptr"):
        layer(x)
    # a token id outside the table is flagged, not silently routed
    layer(x, token_ids=cupy.asarray(np.array([3, 99], np.int32)))
    with pytest.raises(MoeCallError, match="token id outside"):
        layer.check_errors()


def test_expert_parallel_partials_sum_to_full_layer(rng):
    """Each rank's partial (shared expert and identity terms on rank 0 only) sums to the full layer."""
    for fam in ("qwen2_moe", "longcat_flash"):
        cfg = testing.tiny_config(fam)
        hw = testing.random_host_weights(cfg, rng)
        n = 17
        x = well_separated_input(cfg, hw, rng, n)
        full = reference.moe_forward(cfg, hw, x)
        total = np.zeros_like(full)
        for rank in range(2):
            rcfg = cfg.replace(ep_world_size=2, ep_rank=rank)
            out = run_layer(_layer(rcfg, hw), x, "decode")
            c = compare(out, *references(rcfg, hw, x, "decode"))
            assert c.ok, f"{fam} rank {rank}: {c}"
            total += out
        # two bf16 partials summed: each carries its own output rounding
        assert compare(total, full).ok


def _graph_case(rng, fam="qwen3_next"):
    import cupy

    cfg = testing.tiny_config(fam)
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw)
    layer.warmup()
    return cupy, cfg, hw, layer


@pytest.mark.parametrize("path", ["decode", "atomic", "prefill"])
def test_cupy_graph_replay_is_bitwise_eager_and_follows_new_inputs(rng, path):
    cupy, cfg, hw, layer = _graph_case(rng)
    for n in (1, 4, 33):
        x = cupy.asarray(bf16_bits(well_separated_input(cfg, hw, rng, n)))
        s = cupy.cuda.Stream(non_blocking=True)
        eager, out, g = testing.eager_and_graph(layer, x, n, path, s)
        if path != "atomic":
            assert cupy.array_equal(out, eager), f"N={n}: graph replay differs from eager"
        # new contents written into the same input buffer before a replay
        x2 = well_separated_input(cfg, hw, rng, n)
        x[...] = cupy.asarray(bf16_bits(x2))
        out.fill(0x7FC0)
        cupy.cuda.runtime.deviceSynchronize()  # written on the legacy stream; the graph runs on s
        g.launch(s)
        s.synchronize()
        c = check(bits_to_f32(out.get()), cfg, hw, x2, layer.select_path(n, path), layer=layer)
        assert c.ok, f"N={n} after new input: {c}"


@pytest.mark.parametrize("sm90", ["tma", "gather_wide", "tma_192"])
def test_tma_grouped_gemm_graph_replay_is_bitwise_eager(sm90, rng, monkeypatch):
    """The TMA GEMM (Hopper) inside a captured graph, reading xg or gathering its rows, on
    128- or 192-row tiles: replay equals eager bit for bit and follows new input;
    qwen2_moe's shared expert (I 96 beside the routed 64) reads x and act through its own
    tensor maps."""
    import cupy

    from cupymoe import MoeLayer

    monkeypatch.setenv("CUPYMOE_SM90_VARIANT", sm90)
    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=1000)
    if layer.lib.arch != "sm_90a":
        pytest.skip(f"the TMA GEMM needs sm_90a, this GPU compiles for {layer.lib.arch}")
    n = 1000
    assert any(launch.kernel.startswith("grouped_gemm_sm90_tma<0,") for launch in layer.forward_plan(n).launches)
    x = cupy.asarray(bf16_bits(well_separated_input(cfg, hw, rng, n)))
    s = cupy.cuda.Stream(non_blocking=True)
    eager, out, g = testing.eager_and_graph(layer, x, n, "prefill", s)
    assert cupy.array_equal(out, eager), "graph replay differs from eager"
    x2 = well_separated_input(cfg, hw, rng, n)
    x[...] = cupy.asarray(bf16_bits(x2))
    out.fill(0x7FC0)
    cupy.cuda.runtime.deviceSynchronize()  # written on the legacy stream; the graph runs on s
    g.launch(s)
    s.synchronize()
    c = check(bits_to_f32(out.get()), cfg, hw, x2, "prefill", layer=layer)
    assert c.ok, f"after new input: {c}"


def test_torch_graph_capture(rng):
    torch = pytest.importorskip("torch")
    cupy, cfg, hw, layer = _graph_case(rng, "deepseek_v3")
    n = 4
    xh = well_separated_input(cfg, hw, rng, n)
    x = torch.from_numpy(bf16_bits(xh).view(np.int16)).view(torch.bfloat16).cuda()
    out = torch.full_like(x, float("nan"))
    s = torch.cuda.Stream()
    torch.cuda.synchronize()  # x and the poison were written on the default stream
    with torch.cuda.stream(s):
        layer(x, out=out)  # eager warm-up on the capture stream
    torch.cuda.synchronize()
    eager = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        layer(x, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    xh2 = well_separated_input(cfg, hw, rng, n)
    x.copy_(torch.from_numpy(bf16_bits(xh2).view(np.int16)).view(torch.bfloat16).cuda())
    g.replay()
    torch.cuda.synchronize()
    got = bits_to_f32(out.view(torch.int16).cpu().numpy().view(np.uint16))
    assert check(got, cfg, hw, xh2, layer.select_path(n), layer=layer).ok


def test_two_layers_on_two_streams_run_concurrently_without_interference(rng):
    import cupy

    cases = []
    for fam in ("qwen2_moe", "longcat_flash"):
        cfg = testing.tiny_config(fam)
        hw = testing.random_host_weights(cfg, rng)
        cases.append((cfg, hw, _layer(cfg, hw)))
    n = 33
    inputs = [well_separated_input(cfg, hw, rng, n) for cfg, hw, _ in cases]
    refs = [references(cfg, hw, x, layer.select_path(n)) for (cfg, hw, layer), x in zip(cases, inputs)]
    xs = [cupy.asarray(bf16_bits(x)) for x in inputs]
    outs = [cupy.full_like(x, 0x7FC0) for x in xs]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in cases]
    cupy.cuda.runtime.deviceSynchronize()  # inputs and poison were written on the legacy stream
    for _ in range(20):  # interleave many forwards on both streams
        for (cfg, hw, layer), x, o, s in zip(cases, xs, outs, streams):
            layer.forward(int(x.data.ptr), n, int(o.data.ptr), s.ptr)
    for s in streams:
        s.synchronize()
    for o, ref in zip(outs, refs):
        assert compare(bits_to_f32(o.get()), *ref).ok


def test_from_pretrained_matches_reference(tmp_path, rng, inspect_scratch):
    """MoeLayer.from_pretrained on a bf16 checkpoint; `inspect` reports the scratch it allocates."""
    from cupymoe import MoeLayer, checkpoint

    fam = "qwen2_moe"
    cfg = testing.tiny_config(fam)
    hw = testing.random_host_weights(cfg, rng)
    checkpoint.save_layer(tmp_path, testing.hf_config_dict(fam), 1, hw)
    layer = MoeLayer.from_pretrained(tmp_path, 1, max_tokens=16)
    assert layer.cfg == cfg
    assert inspect_scratch(tmp_path, "--layer", 1, "--max-tokens", 16, "--arch", layer.lib.arch,
                           "--gpu", layer.device.name) == \
        {16: layer.workspace.nbytes}
    x = well_separated_input(cfg, hw, rng, 7)
    assert check(run_layer(layer, x), cfg, hw, x, layer.select_path(7), layer=layer).ok


def test_from_hf_with_a_tensor_mapping_matches_reference(tmp_path, rng):
    """MoeLayer.from_hf: a config.json dict, hub-named tensors already in memory, the MLP prefix."""
    from safetensors.numpy import load_file

    from cupymoe import MoeLayer, checkpoint

    fam = "deepseek_v3"
    cfg = testing.tiny_config(fam)
    hw = testing.random_host_weights(cfg, rng)
    checkpoint.save_layer(tmp_path, testing.hf_config_dict(fam), 1, hw)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layer = MoeLayer.from_hf(testing.hf_config_dict(fam), tensors, "model.layers.1.mlp.", max_tokens=16)
    assert layer.cfg == cfg
    x = well_separated_input(cfg, hw, rng, 5)
    assert check(run_layer(layer, x), cfg, hw, x, layer.select_path(5), layer=layer).ok


def test_refusals_name_the_values_and_write_nothing(rng):
    import cupy

    from cupymoe import MoeCallError, PathUnavailableError

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = _layer(cfg, hw, max_tokens=8)
    x = cupy.asarray(bf16_bits(testing.random_input(rng, 8, cfg.hidden_size)))
    out = cupy.full_like(x, 0x7FC0)
    s = cupy.cuda.Stream(non_blocking=True)
    xp, op = int(x.data.ptr), int(out.data.ptr)
    cases = [
        (dict(input_ptr=xp, num_tokens=0, output_ptr=op), MoeCallError, r"num_tokens=0: must be in 1..max_tokens=8"),
        (dict(input_ptr=xp, num_tokens=9, output_ptr=op), MoeCallError, r"num_tokens=9"),
        (dict(input_ptr=0, num_tokens=1, output_ptr=op), MoeCallError, r"input_ptr=0"),
        (dict(input_ptr=xp, num_tokens=1, output_ptr=0), MoeCallError, r"output_ptr=0"),
        (dict(input_ptr=xp + 2, num_tokens=1, output_ptr=op), MoeCallError, r"16-byte aligned"),
        (dict(input_ptr=xp, num_tokens=8, output_ptr=op, path="warp"), PathUnavailableError, r"'warp'"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            layer.forward(stream=s.ptr, **kw)
    s.synchronize()
    assert int((out != 0x7FC0).sum()) == 0, "a refused call wrote to the output"
    small = _layer(cfg, hw, max_tokens=8, atomic_max_tokens=4, decode_max_tokens=6)
    with pytest.raises(PathUnavailableError, match="decode_max_tokens=6"):
        small.forward(xp, 7, op, s.ptr, path="decode")
    with pytest.raises(PathUnavailableError, match="atomic_max_tokens"):
        small.forward(xp, 5, op, s.ptr, path="atomic")
    with pytest.raises(PathUnavailableError, match="row_invariant"):
        _layer(cfg, hw, path="atomic", row_invariant=True)
    with pytest.raises(PathUnavailableError, match="row_invariant"):
        _layer(cfg, hw, row_invariant=True).forward(xp, 1, op, s.ptr, path="decode")
    # a stream of another device's context (faked: this machine may have one GPU)
    layer._ctx = -1
    other = cupy.cuda.Stream(non_blocking=True)  # kept alive: a destroyed stream is no stream
    with pytest.raises(MoeCallError, match="another device"):
        layer.forward(xp, 1, op, other.ptr)
    with pytest.raises(MoeCallError, match="x: expected a contiguous"):
        layer(x.astype(cupy.float32))


def test_profile_mode_refuses_a_capturing_stream_and_enqueues_nothing(rng, monkeypatch):
    import cupy

    from cupymoe import MoeCallError

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    monkeypatch.setenv("CUPYMOE_PROFILE", "1")  # read when a layer is built
    layer = _layer(cfg, hw)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.asarray(bf16_bits(testing.random_input(rng, 3, cfg.hidden_size)))
        out = cupy.full_like(x, 0x7FC0)
        ids = cupy.zeros((3, cfg.num_experts_per_tok), cupy.int32)
        w = cupy.full((3, cfg.num_experts_per_tok), 0.5, cupy.float32)
    s.begin_capture()
    with pytest.raises(MoeCallError, match="CUPYMOE_PROFILE / CUPYMOE_DUMP_DIR synchronise the stream"):
        layer.forward(int(x.data.ptr), 3, int(out.data.ptr), s.ptr)
    with pytest.raises(MoeCallError, match="CUPYMOE_PROFILE synchronises the stream"):
        layer.forward_experts(int(x.data.ptr), 3, int(ids.data.ptr), int(w.data.ptr), int(out.data.ptr), s.ptr)
    s.end_capture()  # nothing was enqueued into it: it ends cleanly
    s.synchronize()
    assert int((out != 0x7FC0).sum()) == 0


def test_profile_mode_and_debug_dumps(tmp_path, rng, monkeypatch, caplog):
    import logging

    cfg = testing.tiny_config("qwen2_moe")
    hw = testing.random_host_weights(cfg, rng)
    monkeypatch.setenv("CUPYMOE_PROFILE", "1")  # read when a layer is built
    monkeypatch.setenv("CUPYMOE_DUMP_DIR", str(tmp_path))
    layer = _layer(cfg, hw)
    n = 5
    x = well_separated_input(cfg, hw, rng, n)
    with caplog.at_level(logging.INFO, logger="cupymoe.profile"):
        out = run_layer(layer, x)
    stages = {"router", "topk", "gate_up", "down", "reduce"}  # N = 5: the lists come with the routing
    logged = {r.getMessage().split("[")[1].split("]")[0] for r in caplog.records if "MoE decode" in r.getMessage()}
    assert stages <= logged
    files = {p.name.split("_", 1)[1][:-4]: np.load(p) for p in tmp_path.glob("*.npy")}
    assert set(files) == {"gate_input", "gate_logits", "expert_ids", "expert_weights", "routed_only",
                          "shared_out", "moe_out"}
    routing = reference.route(cfg, hw, x)
    np.testing.assert_allclose(files["gate_logits"], routing.logits, rtol=1e-4, atol=1e-4)
    assert (np.sort(files["expert_ids"], axis=1) == np.sort(routing.ids, axis=1)).all()
    np.testing.assert_array_equal(files["moe_out"], out)
    assert files["shared_out"].shape == (n, cfg.hidden_size)
    # the prefill path's dump: its routed-only output from its own reduce (it once re-ran the
    # decode reduce over y, which the grouped path never writes), no shared_out (the grouped
    # path keeps no fp32 copy of it); the same routed-only sum as the decode path's
    for p in tmp_path.glob("*.npy"):
        p.unlink()
    monkeypatch.delenv("CUPYMOE_PROFILE")
    out_prefill = run_layer(_layer(cfg, hw), x, "prefill")
    pre = {p.name.split("_", 1)[1][:-4]: np.load(p) for p in tmp_path.glob("*.npy")}
    assert set(pre) == {"gate_input", "gate_logits", "expert_ids", "expert_weights", "routed_only", "moe_out"}
    np.testing.assert_array_equal(pre["moe_out"], out_prefill)
    assert compare(pre["routed_only"], files["routed_only"]).ok


LARGE_TOKENS = (65, 100, 1000, 4099)


@pytest.mark.parametrize("sm90", ["auto", "tma", "twin", "tma_192"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_grouped_path_at_prefill_sizes(family, sm90, rng, monkeypatch):
    """The multi-block sort and the tensor-core GEMMs at prefill sizes, auto dispatch (on
    Hopper the tiny shapes' choice is gather_wide: its gathering producer zero-fills chunks
    past K by cp.async and leaves rows past a tile's unwritten); also with the TMA GEMM
    reading xg (their K of 96 or 160 leaves partial boxes that TMA must fill with zeros), on
    192-row tiles (three warpgroups, one of whose threads copies), and the cp.async one
    forced."""
    from cupymoe import MoeLayer

    monkeypatch.setenv("CUPYMOE_SM90_VARIANT", sm90)
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=max(LARGE_TOKENS))
    for n in LARGE_TOKENS:
        assert layer.select_path(n) == "prefill"
        _check(layer, cfg, hw, rng, n, None)


@pytest.mark.parametrize("sm90", ["auto", "tma", "twin", "tma_192"])
def test_one_expert_receives_every_row(sm90, rng, monkeypatch):
    """A router bias that puts expert 3 in every row's top-k: one run of N rows, others empty."""
    monkeypatch.setenv("CUPYMOE_SM90_VARIANT", sm90)
    cfg = testing.tiny_config("gpt_oss")
    hw = testing.random_host_weights(cfg, rng)
    hw.router_bias = hw.router_bias.copy()
    hw.router_bias[3] = 50.0
    layer = _layer(cfg, hw, max_tokens=1000)
    for n, path in ((1000, "prefill"), (64, "prefill"), (64, "decode")):
        x = well_separated_input(cfg, hw, rng, n)
        assert (reference.route(cfg, hw, x).ids == 3).any(axis=1).all()
        c = check(run_layer(layer, x, path), cfg, hw, x, path, layer=layer)
        assert c.ok, f"N={n} {path}: {c}"


def test_row_invariance(rng):
    """row_invariant=True: each row's output bits equal the same row run alone and in other batches."""
    from cupymoe import MoeLayer

    for fam in ("deepseek_v3", "longcat_flash"):
        cfg = testing.tiny_config(fam)
        hw = testing.random_host_weights(cfg, rng)
        layer = MoeLayer(cfg, hw, max_tokens=1000, row_invariant=True)
        layer.warmup()  # prefill alone (it once forced the decode path, which such a layer refuses)
        pool = testing.random_input(rng, 1000, cfg.hidden_size)
        tracked = rng.choice(1000, size=12, replace=False)
        alone = {int(r): run_layer(layer, pool[r:r + 1])[0] for r in tracked}
        for n in (1, 2, 7, 64, 333, 1000):
            others = rng.permutation(np.setdiff1d(np.arange(1000), tracked))[: max(0, n - 12)]
            rows = rng.permutation(np.concatenate([tracked[: min(n, 12)], others]))
            out = run_layer(layer, pool[rows])
            for j, r in enumerate(rows):
                if int(r) in alone:
                    np.testing.assert_array_equal(out[j], alone[int(r)], err_msg=f"{fam}: row {r} in a batch of {n}")


def test_hopper_wgmma_kernels_are_used_and_agree(rng, monkeypatch):
    """On sm_90a the math-bound grouped GEMMs run on wgmma, in each pipeline variant
    (the tuning table's sm90_variants); the result matches the reference and, to rounding, the
    mma.sync kernels of a row-invariant layer."""
    from cupymoe import MoeLayer
    from cupymoe.tuning import TUNING

    def kernels_of(layer):
        return [launch.kernel for launch in layer.forward_plan(2048).launches]

    cfg = testing.tiny_config("qwen3_next")
    hw = testing.random_host_weights(cfg, rng)
    pinned = MoeLayer(cfg, hw, max_tokens=2048, row_invariant=True)
    if pinned.lib.arch != "sm_90a":
        pytest.skip(f"wgmma needs sm_90a, this GPU compiles for {pinned.lib.arch}")
    assert "grouped_gemm<0, 128, 32, 3, 0>" in kernels_of(pinned)
    x = well_separated_input(cfg, hw, rng, 2048)
    assert check(run_layer(pinned, x), cfg, hw, x, "prefill", layer=pinned).ok
    for variant in TUNING.sm90_variants:
        monkeypatch.setenv("CUPYMOE_SM90_VARIANT", variant)
        layer = MoeLayer(cfg, hw, max_tokens=2048)
        assert TUNING.sm90_variants[variant].kernel(0) in kernels_of(layer)
        c = check(run_layer(layer, x), cfg, hw, x, "prefill", layer=layer)
        assert c.ok, f"{variant}: {c}"


@pytest.mark.parametrize("sm90", ["auto", "twin", "tma", "gather_wide", "tma_192", "pinned"])
def test_grouped_gemm_tile_bands_cover_every_tile(rng, monkeypatch, sm90):
    """The grouped GEMMs start their tiles in bands of GEMM_BAND_COLS (16) column tiles
    (cuda/gemm_common.cuh): with H = 4352 and I = 1088, down has 34 column tiles of 128 or
    17 of 256 and gate/up 17 of 128 (64 gate + 64 up columns), so full bands and a last
    one of 1 or 2, over the M-tiles of 5 experts; every output element must still be
    written, right. "pinned": the mma.sync kernels of a row-invariant layer; "auto":
    192 x 256 TMA tiles (I >= 1024)."""
    from cupymoe import MoeLayer

    monkeypatch.delenv("CUPYMOE_GEMM_BAND_COLS", raising=False)
    if sm90 != "pinned":
        monkeypatch.setenv("CUPYMOE_SM90_VARIANT", sm90)
    cfg = testing.tiny_config("qwen3_moe", hidden_size=4352, moe_intermediate_size=1088, num_experts=5,
                              num_experts_per_tok=2)
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=333, row_invariant=sm90 == "pinned")
    for n in (333, 150):  # >= 40 rows an expert: the "math" tiles (wgmma on Hopper)
        x = well_separated_input(cfg, hw, rng, n)
        c = check(run_layer(layer, x, "prefill"), cfg, hw, x, "prefill", layer=layer)
        assert c.ok, f"{sm90} N={n}: {c}"


def test_split_router_sums_its_copies(rng, monkeypatch):
    """A narrow router's GEMM splits K over blocks (gridDim.z), each writing its own logits
    copy that top-k sums: on the mma.sync "stream" tiles (N = 1000) and the wgmma "math"
    ones (N = 9000); the routing and the output must match the reference. Row-invariant
    layers never split (their logits must not depend on N)."""
    from cupymoe import MoeLayer
    from cupymoe.catalog import ROUTER_MAX_SPLITS

    cfg = testing.tiny_config("deepseek_v3", hidden_size=1024)  # 16 K steps of 64: room for 4 splits
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=9000)
    for n in (1000, 9000):
        router = layer.forward_plan(n, "prefill").launches[0]
        assert 1 < router.grid[2] <= ROUTER_MAX_SPLITS, (n, router)
        assert layer.forward_plan(n, "prefill").launches[1].arg("splits") == router.grid[2]
        _check(layer, cfg, hw, rng, n, "prefill")
    pinned = MoeLayer(cfg, hw, max_tokens=1000, row_invariant=True)
    assert pinned.forward_plan(1000).launches[0].grid[2] == 1


def _model_expert_lists(ids: np.ndarray, slot_of: np.ndarray, n_local: int, has_shared: bool) -> dict:
    """The decode path's expert lists as build_expert_lists makes them (cuda/decode_common.cuh),
    from a forward's top-k ids: active experts in slot order with their runs of positions,
    pairs sorted by slot and then pair order, the shared expert's rows last."""
    N, k = ids.shape
    P = N * k
    R = len(slot_of)
    slots = np.array([slot_of[e] if 0 <= e < R else -1 for e in ids.ravel()], np.int64)
    order = sorted((int(s), p) for p, s in enumerate(slots) if s >= 0)
    pair_pos = np.full(P + (N if has_shared else 0), -1, np.int64)
    sorted_row, sorted_pair = [], []
    for pos, (_, p) in enumerate(order):
        pair_pos[p] = pos
        sorted_row.append(p // k)
        sorted_pair.append(p)
    active = sorted({s for s, _ in order})
    counts = [sum(1 for s, _ in order if s == a) for a in active]
    starts = list(np.cumsum([0] + counts[:-1])) if active else []
    slot_active = np.full(n_local + 1, -1, np.int64)
    for i, a in enumerate(active):
        slot_active[a] = i
    owned = len(order)
    if has_shared:
        slot_active[n_local] = len(active)
        active, starts, counts = active + [n_local], starts + [owned], counts + [N]
        for r in range(N):
            pair_pos[P + r] = owned + r
            sorted_row.append(r)
            sorted_pair.append(P + r)
    return dict(active_slot=active, active_start=starts, active_len=counts, sorted_row=sorted_row,
                sorted_pair=sorted_pair, pair_pos=list(pair_pos), slot_active=list(slot_active))


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "longcat_flash", "gpt_oss", "qwen2_moe-ep1",
                                  "deepseek_v3-hash-repeats", "qwen3_moe-301"])
def test_route_lists_expert_lists_match_a_model_of_them(case, rng):
    """Every list builder's expert lists are the model's, made from the same top-k ids:
    decode_route_lists' (the decode path at N <= 8: at N = 1 the routing warp builds them
    alone, cuda/decode.cu warp_expert_lists; past that the block), decode_topk_lists' (to 32
    rows, one a warp), decode_build_lists' (the prefill path's up to 1024 pairs, the decode and
    atomic paths' past 32 rows up to DECODE_SORT_PAIRS: several warps of pairs, whose ranks come
    from the warps' counts, up to LISTS_MAX_ROUNDS pairs a thread) and the three-pass sort's
    (past those: 1025 rows of 4 pairs), on the
    decode, atomic and prefill paths: a shared expert (deepseek-v3, qwen2-moe), zero experts
    (longcat), softmax after top-k (gpt-oss), EP rank 1's slots (the other rank's experts
    nobody's here), a hash table whose rows repeat an expert, and 301 experts (an odd count
    of 16-bit counts a warp; a router too wide for decode_topk_lists). The outputs are
    checked against the reference too."""
    from cupymoe.verify import _read_scratch

    fam, _, variant = case.partition("-")
    overrides = (dict(hash_routing=True, hash_vocab_size=20, n_group=1, topk_group=1) if variant == "hash-repeats"
                 else dict(num_experts=301) if variant == "301" else {})  # 301: past 256 experts, odd
    cfg = testing.tiny_config(fam, **overrides)
    hw = testing.random_host_weights(cfg, rng)
    if variant == "hash-repeats":  # every row names one expert twice (and then its weights twice)
        k = cfg.num_experts_per_tok
        hw.tid2eid = np.stack([np.r_[p[:k - 1], p[0]] for p in (rng.permutation(cfg.num_experts)
                                                              for _ in range(20))]).astype(np.int32)
    if variant == "ep1":
        cfg = cfg.replace(ep_world_size=2, ep_rank=1)
    layer = _layer(cfg, hw, max_tokens=1025)
    slot_of = layer.weights.slot_of.get()
    k, n_local = cfg.num_experts_per_tok, layer.weights.n_local
    assert k * 1024 == C.DECODE_SORT_PAIRS, "the sizes below straddle the one-block sort's rounds at k = 4"
    # 250 rows: 1000 pairs, 32 warps of them; 300: two rounds a thread; 1024: four (the most); 1025: past them
    for n in (1, 2, 3, 8, 13, 17, 32, 45, 64, 250, 300, 1024, 1025):
        token_ids = testing.random_token_ids(rng, n, 20) if cfg.hash_routing else None
        for path in ("decode", "atomic") if n <= 16 else ("decode", "atomic", "prefill"):
            _check(layer, cfg, hw, rng, n, path, token_ids)
            ids = _read_scratch(layer, "topk_ids", np.int32, (n, k))
            want = _model_expert_lists(ids, slot_of, n_local, cfg.has_shared_expert)
            # slot_active is the one-block builders' alone (the three-pass sort's readers never take it)
            if not any(s.kernel.startswith(("decode_route_lists", "decode_topk_lists", "decode_build_lists"))
                       for s in layer.forward_plan(n, path).launches):
                del want["slot_active"]
            A = int(_read_scratch(layer, "num_active", np.int32, (1,))[0])
            assert A == len(want["active_slot"]), f"{case} N={n} {path}: {A} active experts"
            got = {name: list(_read_scratch(layer, name, np.int32, (len(v),))) for name, v in want.items() if len(v)}
            for name, v in want.items():
                if len(v):
                    assert got[name] == [int(a) for a in v], f"{case} N={n} {path}: {name} {got[name]} != {v}"


def test_device_weights_off_16_byte_alignment_are_copied_not_borrowed(rng):
    """A caller's device arrays at an address off 16 bytes (a view into a file's bytes, whose offsets
    are only element-aligned) would fault the kernels' 16-byte loads: the layer copies them (owned,
    none borrowed) and computes the host-weights layer's bits on both paths."""
    from dataclasses import replace

    import cupy

    from cupymoe import MoeLayer

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)

    def off_by_two(a):
        a = np.ascontiguousarray(a).view(np.uint16)
        v = cupy.empty(a.size + 1, cupy.uint16)[1:].reshape(a.shape)
        v.set(a)
        assert v.data.ptr % 16 == 2
        return v  # bf16 bits, as a caller's device bf16 weights arrive

    dev = replace(hw, gate=off_by_two(hw.gate), up=off_by_two(hw.up), down=off_by_two(hw.down))
    aligned = replace(hw, **{p: cupy.asarray(np.ascontiguousarray(getattr(hw, p)).view(np.uint16))
                             for p in ("gate", "up", "down")})
    host, layer = MoeLayer(cfg, hw, max_tokens=16), MoeLayer(cfg, dev, max_tokens=16)
    assert layer.weights.memory.borrowed == 0
    stacks = sum(getattr(aligned, p).nbytes for p in ("gate", "up", "down"))
    assert MoeLayer(cfg, aligned, max_tokens=16).weights.memory.borrowed >= stacks  # the same, aligned: borrowed
    x = testing.random_input(rng, 5, cfg.hidden_size)
    for path in ("decode", "prefill"):
        want, got = run_layer(host, x, path), run_layer(layer, x, path)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), path
