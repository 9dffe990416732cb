"""The benchmark: its CLI without a GPU, its plots, floors, rows and random quantized
weights (drawn with numpy here, CuPy in the benchmark), and (GPU) the torch peers' agreement."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from cupymoe import bench, ceilings, formats, testing
from cupymoe.errors import OptionError


def test_bench_help_runs_without_a_gpu_and_says_what_it_needs():
    r = subprocess.run([sys.executable, "-m", "cupymoe", "bench", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps the description
    assert "Needs an NVIDIA GPU" in text and "--preset" in text and "--plots" in text
    assert "--format" in text and all(f in text for f in bench.FORMATS)


def test_presets_are_the_performance_grid():
    assert set(bench.PRESETS) == {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b",
                                  "qwen3-next-80b", "gpt-oss-120b"}
    ds = bench.preset_config("deepseek-v3", routed_only=False)
    assert (ds.hidden_size, ds.moe_intermediate_size, ds.num_experts, ds.num_experts_per_tok) == (7168, 2048, 256, 8)
    assert ds.shared_expert_intermediate_size == 2048 and (ds.n_group, ds.topk_group) == (8, 4)
    assert not bench.preset_config("deepseek-v3").has_shared_expert  # the peers ran routed experts only


def test_plots_one_png_per_preset(tmp_path):
    rows = [dict(shape=s, N=n, us=10.0 * n ** 0.5, floor_us=5.0 * n ** 0.5, grouped_mm_us=30.0 * n ** 0.5,
                 vllm_compute_only=20.0 * n ** 0.5) for s in ("qwen3-30b-a3b", "mixtral-8x7b") for n in (1, 64, 4096)]
    written = bench.plot_results(rows, tmp_path, stem="t")
    assert sorted(p.name for p in written) == ["t-mixtral-8x7b.png", "t-qwen3-30b-a3b.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plots_one_png_per_preset_and_format(tmp_path):
    rows = [dict(shape="qwen3-30b-a3b", format=f, N=n, us=10.0 * n ** 0.5, floor_us=5.0 * n ** 0.5,
                 floor_fp8_us=4.0 * n ** 0.5 if f == "fp8_block" else None,
                 vllm_fp8_gemms_only=8.0 * n ** 0.5 if f == "fp8_block" else None)
            for f in ("bf16", "fp8_block", "nvfp4") for n in (1, 64, 4096)]
    written = bench.plot_results(rows, tmp_path, stem="t")
    assert sorted(p.name for p in written) == ["t-qwen3-30b-a3b-fp8_block.png", "t-qwen3-30b-a3b-nvfp4.png",
                                               "t-qwen3-30b-a3b.png"]


# --- e4m3 bits and the random quantized weights ---------------------------------------

E4M3_FINITE = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)


def test_e4m3_bits_round_to_nearest_even_like_ml_dtypes_and_never_nan():
    vals = E4M3_FINITE.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert (bench.e4m3_bits(np, vals) == E4M3_FINITE).all()  # every finite code round-trips
    pos = np.sort(vals[vals > 0])
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)  # ties: to the even code
    rng = np.random.default_rng(0)
    v = np.concatenate([mids, -mids, np.float32([0.0, -0.0, 2.0 ** -10, 2.0 ** -12])]
                       + [rng.standard_normal(50_000).astype(np.float32) * s for s in (1e-3, 0.05, 1, 60, 300)])
    v = np.clip(v, -448, 448)
    assert (bench.e4m3_bits(np, v) == v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)).all()
    sat = bench.e4m3_bits(np, np.float32([449, 1e4, -1e4, 3e38]))  # saturates: never the NaN codes
    assert sat.tolist() == [0x7E, 0x7E, 0xFE, 0x7E]


# the contract the layer takes (cupymoe.formats' containers), per format: array -> (shape, dtype)
def _expected(fmt, E, out, inn):
    c = -(-out // 128), -(-inn // 128)
    return {
        "bf16": {"bits": ((E, out, inn), np.uint16)},
        "fp8_block": {"q": ((E, out, inn), np.uint8), "scale_inv": ((E,) + c, np.float32)},
        "nvfp4": {"packed": ((E, out, inn // 2), np.uint8), "scale": ((E, out, inn // 16), np.uint8),
                  "scale_2": ((E,), np.float32)},
        "mxfp4": {"blocks": ((E, out, inn // 32, 16), np.uint8), "scales": ((E, out, inn // 32), np.uint8)},
    }[fmt]


def _dequantized(fmt, raw):
    if fmt == "bf16":
        return (raw["bits"].astype(np.uint32) << 16).view(np.float32)
    return formats.dequantize(bench._container(fmt, raw))


@pytest.mark.parametrize("fmt", bench.FORMATS)
@pytest.mark.parametrize("shape", [(3, 256, 2048), (2, 2880, 2880), (2, 2048, 768)])
def test_random_quantized_weights_follow_the_containers_contract(fmt, shape):
    raw = bench._quantized_random(np, np.random.default_rng(1), fmt, shape)
    want = _expected(fmt, *shape)
    assert {k: (a.shape, a.dtype) for k, a in raw.items()} == {k: (s, np.dtype(d)) for k, (s, d) in want.items()}
    if fmt == "fp8_block":
        assert not np.isin(raw["q"], [0x7F, 0xFF]).any()
        assert (raw["scale_inv"] > 0).all() and np.isfinite(raw["scale_inv"]).all()
    if fmt == "nvfp4":  # e4m3 block scales: finite, positive
        sc = raw["scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        assert np.isfinite(sc).all() and (sc > 0).all() and (raw["scale_2"] > 0).all()
    if fmt == "mxfp4":
        assert raw["scales"].max() < 255 and raw["scales"].min() > 0
    w = _dequantized(fmt, raw)
    assert w.shape == shape and np.isfinite(w).all()
    std = float(w.std()) * math.sqrt(shape[-1])  # about 1/sqrt(fan_in): activations stay O(1)
    assert 0.85 < std < 1.2, f"{fmt} {shape}: std x sqrt(fan_in) = {std:.3f}"


@pytest.mark.parametrize("fmt", bench.FORMATS)
def test_random_stack_drawn_in_chunks_fills_every_expert(fmt):
    shape = (7, 256, 512)
    res = bench._random_stack(np, np.random.default_rng(2), fmt, shape, chunk_elems=2 * 256 * 512)  # 2 experts a chunk
    assert {k: (a.shape, a.dtype) for k, a in res.items()} == {
        k: (s, np.dtype(d)) for k, (s, d) in _expected(fmt, *shape).items()}
    w = _dequantized(fmt, res)
    per_expert = w.reshape(7, -1).std(axis=1) * math.sqrt(512)
    assert (per_expert > 0.8).all() and (per_expert < 1.25).all()  # no expert left uninitialised


def test_random_weights_reject_unknown_formats_and_bad_groups():
    with pytest.raises(OptionError, match="unknown format"):
        bench._quantized_random(np, np.random.default_rng(0), "int4", (1, 32, 32))
    with pytest.raises(OptionError, match="multiple of 32"):
        bench._quantized_random(np, np.random.default_rng(0), "mxfp4", (1, 32, 48))


# --- bytes, floors, rows ---------------------------------------------------------------

def test_expert_bytes_per_format():
    H, I = 2048, 768
    assert bench.expert_bytes("bf16", H, I) == 3 * H * I * 2
    assert bench.expert_bytes("fp8_block", H, I) == 3 * H * I + 3 * (6 * 16) * 4
    assert bench.expert_bytes("nvfp4", H, I) == 3 * H * I // 2 + 3 * H * I // 16 + 3 * 4
    assert bench.expert_bytes("mxfp4", H, I) == 3 * H * I // 2 + 3 * H * I // 32
    # gpt-oss: 2880 is not a multiple of 128, partial blocks have scales too
    assert bench.matrix_bytes("fp8_block", 2880, 2880) == 2880 * 2880 + 23 * 23 * 4
    with pytest.raises(OptionError, match="multiple of 16"):
        bench.matrix_bytes("nvfp4", 16, 24)


def test_floors_count_the_formats_bytes_and_the_right_matrix_rate():
    cfg = bench.preset_config("qwen3-30b-a3b")
    H, I, E, k = 2048, 768, 128, 8
    b16 = bench.cell_figures(cfg, "bf16", 1, 8)  # PERFORMANCE.md: 18 µs
    assert b16["bytes"] == 8 * 3 * H * I * 2 + E * H * 2 + 2 * H * 2
    assert b16["floor_us"] == pytest.approx(b16["bytes"] / 4.26e6) and 17.5 < b16["floor_us"] < 18.5
    f8 = bench.cell_figures(cfg, "fp8_block", 1, 8)
    assert f8["floor_us"] == pytest.approx(f8["bytes"] / 4.26e6) and 8.8 < f8["floor_us"] < 9.2  # baseline: 8.9
    assert f8["floor_fp8_us"] == f8["floor_us"]  # memory bound at N = 1
    nv = bench.cell_figures(cfg, "nvfp4", 1, 8)
    assert nv["bytes"] == 8 * bench.expert_bytes("nvfp4", H, I) + E * H * 2 + 2 * H * 2
    # prefill: the routed experts' FLOPs at the bf16 rate (floor_us) and at the fp8 rate (floor_fp8_us)
    n = 16384
    big = bench.cell_figures(cfg, "fp8_block", n, E, fp8_tflops=1462.0)
    routed, router = 2 * n * k * 3 * H * I, 2 * n * H * E
    assert big["floor_us"] == pytest.approx((routed + router) / 777e6)
    assert big["floor_fp8_us"] == pytest.approx(routed / 1462e6 + router / 777e6)  # baseline: 846 + router
    assert bench.cell_figures(cfg, "mxfp4", n, E)["floor_us"] == pytest.approx(big["floor_us"])
    oss = bench.preset_config("gpt-oss-120b")  # expert biases are bytes of the touched experts too
    assert (bench.cell_figures(oss, "bf16", 1, 4)["bytes"] - bench.cell_figures(oss, "bf16", 1, 0)["bytes"]
            == 4 * (3 * 2880 * 2880 * 2 + 3 * 2880 * 4))


def test_baselines_are_found_for_bf16_and_fp8(tmp_path, monkeypatch):
    b = bench.load_baselines()
    assert b[("bf16", "qwen3-30b-a3b", 1)]["vllm_compute_only"] == pytest.approx(36.3)
    assert b[("fp8_block", "qwen3-30b-a3b", 1)]["vllm_fp8_gemms_only"] == pytest.approx(18.4)
    assert not any(f in ("nvfp4", "mxfp4") for f, _, _ in b)
    (tmp_path / "h200-bf16-peers.json").write_text(json.dumps(
        {"rows": [{"shape": "qwen3-30b-a3b", "N": 1, "vllm_compute_only": 1.0}]}))
    monkeypatch.setenv("CUPYMOE_BASELINES", str(tmp_path))  # first in the search order
    b = bench.load_baselines()
    assert b[("bf16", "qwen3-30b-a3b", 1)]["vllm_compute_only"] == 1.0 and ("fp8_block", "qwen3-30b-a3b", 1) in b


CEIL = dict(copy_TBps=4.26, bf16_TFLOPs=777.0, fp8_TFLOPs=1462.0)


def test_rows_keep_their_shape_and_format_and_carry_their_formats_baselines():
    baselines = bench.load_baselines()
    cfg = bench.preset_config("qwen3-30b-a3b")
    rows = [bench.bench_row(cfg, "qwen3-30b-a3b", fmt, n, 8, [30.0, 31.0, 29.0], CEIL, baselines, path="auto",
                            layers=3) for fmt in bench.FORMATS for n in (1, 4, 16)]
    assert {(r["shape"], r["format"]) for r in rows} == {("qwen3-30b-a3b", f) for f in bench.FORMATS}
    by = {(r["format"], r["N"]): r for r in rows}
    r = by[("bf16", 1)]
    assert r["us"] == 30.0 and r["spread_us"] == 2.0 and r["layers"] == 3 and r["routed_only"]
    assert r["reps_us"] == [30.0, 31.0, 29.0]  # each repetition kept, in the order timed
    assert r["vllm_compute_only"] == pytest.approx(36.3) and r["grouped_mm"] == pytest.approx(118.1)
    assert r["pct_of_floor"] == pytest.approx(100 * r["floor_us"] / 30.0, abs=0.05)
    assert "floor_fp8_us" not in r and "vllm_fp8_gemms_only" not in r
    r = by[("fp8_block", 1)]
    assert r["vllm_fp8_gemms_only"] == pytest.approx(18.4) and r["vllm_compute_only"] == pytest.approx(36.3)
    assert r["floor_fp8_us"] <= r["floor_us"] < by[("bf16", 1)]["floor_us"] and "grouped_mm" not in r
    assert bench.bench_row(cfg, "qwen3-30b-a3b", "fp8_block", 3, 8, [30.0], CEIL, baselines, path="auto",
                           layers=1)["vllm_fp8_gemms_only"] is None  # the fp8 file has no N = 3
    r = by[("nvfp4", 16)]
    assert r["vllm_compute_only"] == pytest.approx(206, abs=1) and "vllm_fp8_gemms_only" not in r
    assert by[("mxfp4", 1)]["floor_us"] < by[("fp8_block", 1)]["floor_us"]
    json.dumps(rows)  # plain JSON


def test_terminal_line_names_the_format_and_the_peers():
    baselines = bench.load_baselines()
    cfg = bench.preset_config("qwen3-30b-a3b")
    row = bench.bench_row(cfg, "qwen3-30b-a3b", "fp8_block", 1, 8, [20.0], CEIL, baselines, path="auto", layers=2)
    line = bench.format_row(row)
    assert "fp8_block" in line and "fp8 floor" in line and "0.92x vLLM-fp8-GEMMs" in line and "1.81x vLLM-bf16" in line
    row = bench.bench_row(cfg, "qwen3-30b-a3b", "bf16", 1, 8, [40.0], CEIL, baselines, path="auto", layers=2)
    row.update(grouped_mm_us=80.0)
    line = bench.format_row(row)
    assert line.lstrip().startswith("bf16") and "0.91x vLLM" in line and "2.00x grouped_mm" in line


def test_layer_copies_keep_the_touched_experts_out_of_l2():
    gb = 1e9
    assert bench.layers_needed(22.5 * gb, 0.7 * gb, 80 * gb) == 2  # deepseek-v3 bf16
    assert bench.layers_needed(1.2 * gb, 75e6, 80 * gb) == 3  # qwen3-30b bf16, N = 1: 8 experts
    assert bench.layers_needed(0.9 * gb, 17.7e6, 80 * gb) == 12  # qwen3-next nvfp4, N = 1
    assert bench.layers_needed(0.9 * gb, 1e3, 80 * gb) == bench.MAX_LAYERS
    assert bench.layers_needed(30 * gb, 1e6, 50 * gb) == 2  # memory caps it, never below 2
    assert bench.expected_touched(128, 8, 1) == pytest.approx(8) and bench.expected_touched(8, 2, 4096) == pytest.approx(8)


@pytest.mark.gpu
def test_torch_peers_compute_cupymoes_function():
    torch = pytest.importorskip("torch")
    from cupymoe import MoeLayer
    from cupymoe.peers import TorchPeers, same_function
    from cupymoe.verify import bf16_bits, run_layer

    rng = np.random.default_rng(1)
    cfg = testing.tiny_config("qwen3_moe")
    assert same_function(cfg)
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=256)
    peers = TorchPeers(layer)
    for n in (3, 256):
        x = testing.random_input(rng, n, cfg.hidden_size)
        ours = torch.from_numpy(run_layer(layer, x)).cuda()
        xt = torch.from_numpy(bf16_bits(x).view(np.int16)).cuda().view(torch.bfloat16)
        for name, fn in peers.impls().items():
            o = torch.empty_like(xt)
            fn(xt, o)
            err = float((o.float() - ours).norm() / ours.norm())
            assert err < 2.0 ** -6, f"{name} N={n}: normwise {err:.2e} from cupymoe"


def test_measured_ceilings_floor_the_steady_state_and_keep_the_burst_beside_it(monkeypatch, capsys):
    # the figures of NOTES.md v28's probe: 8192^3 bf16 at 795 TFLOP/s in a burst, 688 sustained
    got = dict(copy_TBps=4.24, copy_TBps_burst=4.25, bf16_TFLOPs=688.0, bf16_TFLOPs_burst=795.0,
               fp8_TFLOPs=None, fp8_TFLOPs_burst=None)
    monkeypatch.setattr(ceilings, "measure_ceilings", lambda: got)
    ceil, measured, _ = ceilings.resolve_ceilings(True)
    assert ceil["bf16_TFLOPs"] == 688.0 and ceil["bf16_TFLOPs_burst"] == 795.0
    assert measured == dict(copy_TBps=True, bf16_TFLOPs=True, fp8_TFLOPs=False)
    assert ceil["fp8_TFLOPs"] == ceilings.FP8_TFLOPS and "fp8_TFLOPs_burst" not in ceil  # default, no burst
    assert "795" in capsys.readouterr().out
    cfg = bench.preset_config("qwen3-30b-a3b")
    row = bench.bench_row(cfg, "qwen3-30b-a3b", "bf16", 4096, 128, [800.0], ceil, {}, path="auto", layers=2)
    flops = 2 * 4096 * 8 * 3 * 2048 * 768 + 2 * 4096 * 2048 * 128  # FLOP-bound at N = 4096
    assert row["floor_us"] == pytest.approx(flops / 688e6, abs=0.01)
    assert row["floor_burst_us"] == pytest.approx(flops / 795e6, abs=0.01)
    assert row["pct_of_floor"] > row["pct_of_burst_floor"] == pytest.approx(100 * flops / 795e6 / 800.0, abs=0.05)
    assert "of the burst floor" in bench.format_row(row)
    plain = bench.bench_row(cfg, "qwen3-30b-a3b", "bf16", 4096, 128, [800.0], CEIL, {}, path="auto", layers=2)
    assert "pct_of_burst_floor" not in plain and "burst" not in bench.format_row(plain)


def test_ceilings_are_the_gpus_own_row_or_measured_never_another_gpus_silently(monkeypatch, capsys):
    table = json.loads(ceilings.CEILINGS_TABLE.read_text())["gpus"]
    assert ceilings.table_ceilings(ceilings.REFERENCE_GPU) == dict(
        copy_TBps=ceilings.COPY_TBPS, bf16_TFLOPs=ceilings.BF16_TFLOPS, fp8_TFLOPs=ceilings.FP8_TFLOPS)
    for gpu, row in table.items():  # every row carries every ceiling and where it was measured
        assert set(ceilings.CEILING_KEYS) <= set(row) and row["measured"], gpu
    calls = []
    monkeypatch.setattr(ceilings, "measure_ceilings", lambda: calls.append(1) or {})
    known = ceilings.resolve_ceilings(False, ceilings.REFERENCE_GPU)
    assert not calls and not any(known.measured.values()) and ceilings.REFERENCE_GPU in known.source
    got = dict(copy_TBps=3.1, copy_TBps_burst=3.2, bf16_TFLOPs=600.0, bf16_TFLOPs_burst=700.0,
               fp8_TFLOPs=1100.0, fp8_TFLOPs_burst=1300.0)
    monkeypatch.setattr(ceilings, "measure_ceilings", lambda: got)
    other = ceilings.resolve_ceilings(False, "NVIDIA B300")  # a GPU without a row is measured in the run
    assert other.values["copy_TBps"] == 3.1 and all(other.measured.values()) and "NVIDIA B300" in other.source

    def no_torch():
        raise ImportError("No module named 'torch'")
    monkeypatch.setattr(ceilings, "measure_ceilings", no_torch)
    fallback = ceilings.resolve_ceilings(False, "NVIDIA B300")  # no torch: the reference row, said so
    assert fallback.values["copy_TBps"] == ceilings.COPY_TBPS and not any(fallback.measured.values())
    assert "NVIDIA B300" in fallback.source and "not this GPU's" in fallback.source
    assert "not this GPU's" in capsys.readouterr().err
    assert ceilings.ceilings_note("NVIDIA H100 80GB HBM3").endswith("copy 3.04 TB/s, bf16 725 TFLOP/s, fp8 1136 TFLOP/s")
    assert "bench measures them" in ceilings.ceilings_note("NVIDIA B300")


def test_stored_peers_of_another_gpu_are_left_out(capsys):
    """The baselines are the H200's: on another GPU a vs-vLLM figure would divide two machines' times."""
    here = bench.load_baselines(ceilings.REFERENCE_GPU)
    if not here:
        pytest.skip("no baseline files found")
    assert bench.load_baselines("NVIDIA H100 80GB HBM3") == {}
    assert "left out" in capsys.readouterr().err
    assert bench.baseline_gpu({"gpu": "NVIDIA H200 (one GPU, Firecracker)"}) == "NVIDIA H200"


def test_random_correction_bias_leaves_deepseek_routing_balanced():
    """The bench's deepseek-v3 layer routes its uniform-random input as a trained, load-balanced
    router would: near the uniform count of distinct experts (the peers' runs touched 220 at
    N = 64). A random bias of std 0.1 steered the tokens to the same few high-bias experts (~128
    at N = 64), so every floor and peer comparison at N >= 16 read far fewer bytes. Drawn here
    with numpy as random_device_weights draws on the GPU: router std 1/sqrt(H), inputs N(0, 1)."""
    import numpy as np

    from cupymoe import bench
    from cupymoe.reference import _select_grouped, _sigmoid

    cfg = bench.preset_config("deepseek-v3")
    H, E, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    rng = np.random.default_rng(7)
    router = rng.standard_normal((E, H)) / np.sqrt(H)
    x = rng.standard_normal((64, H))
    scores = _sigmoid(x @ router.T)
    uniform = bench.expected_touched(E, k, 64)  # 222
    noise = rng.standard_normal(E)

    def touched(std: float) -> int:
        ids, _ = _select_grouped(cfg, scores + noise * std)
        return len(np.unique(ids))

    assert touched(bench.CORRECTION_BIAS_STD) >= 0.9 * uniform
    assert touched(0.1) < 0.7 * uniform  # what the bench drew before


def test_graph_timeline_splits_forwards_and_takes_medians():
    """scripts/graph_timeline.py's forward_timeline: kernel records of several
    forwards, out of order and the first forward cut by the profiler's window, become each
    position's median start / end / duration from its forward's first kernel, the span and the
    period; a router name that matches nothing is refused by name; the router's LoRA kernels
    do not start a forward."""
    import importlib.util
    from pathlib import Path

    import pytest

    path = Path(__file__).parent.parent / "scripts" / "graph_timeline.py"
    spec = importlib.util.spec_from_file_location("graph_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    records = [(3.0, 2.0, "decode_reduce")]  # the tail of a forward the window cut
    for f, (t0, late) in enumerate([(10.0, 0.0), (40.0, 1.0), (70.0, 0.5), (100.0, 0.0)]):
        records += [(t0, 2.0, "void router_logits_bf16<1, 4>"), (t0 + 1.0, 6.0 + late, "decode_route_lists"),
                    (t0 + 2.0, 15.0, "decode_mma_gate_up_a8<4, 1>"), (t0 + 7.0 + late, 17.0, "decode_reduce")]
    tl = mod.forward_timeline(records[::-1])  # any order
    assert tl["forwards"] == 3  # the first whole forward dropped, the cut one never counted
    names = [r["name"] for r in tl["kernels"]]
    assert names == ["void router_logits_bf16<1, 4>", "decode_route_lists", "decode_mma_gate_up_a8<4, 1>",
                     "decode_reduce"]
    lists = tl["kernels"][1]
    assert lists["start"] == 1.0 and lists["dur"] == 6.5 and lists["end"] == 7.5  # medians of 1.0, 0.5, 0.0 late
    assert tl["span"] == 24.5 and tl["period"] == 30.0
    with pytest.raises(ValueError, match="router_mma"):
        mod.forward_timeline(records, first="router_mma")
    lora = records + [(t0 + 1.5, 1.0, "void lora_router_expand<16>") for t0 in (10.0, 40.0, 70.0, 100.0)]
    assert mod.forward_timeline(lora)["forwards"] == 3  # a LoRA kernel named after the router starts no forward
    prefill = [(t, d, n.replace("router_logits_bf16<1, 4>", "grouped_gemm<2, 64, 64, 4, 0>")) for t, d, n in records]
    prefill += [(t0 + 3.0, 9.0, "void grouped_gemm_lora<0, 128, 32, 3, 1>") for t0 in (10.0, 40.0, 70.0, 100.0)]
    assert mod.forward_timeline(prefill)["forwards"] == 3  # prefill's router is a ROUTER-mode (2) GEMM


# --- --lora K --lora-rank R: the argument plumbing and the adapters (no GPU) -------------

def _bench_args(*argv):
    import argparse

    ap = argparse.ArgumentParser()
    bench.add_bench_args(ap)
    return ap.parse_args(list(argv))


def test_lora_arguments_reach_the_layer_options():
    args = _bench_args("--lora", "4", "--lora-rank", "16", "--format", "bf16", "fp8_block")
    assert (args.lora, args.lora_rank) == (4, 16)
    assert bench.layer_options("bf16", args) == dict(max_loras=4, max_lora_rank=16)
    # fp8_block under auto would pick w8a8, whose layer refuses expert adapters: w8a16 instead
    assert bench.layer_options("fp8_block", args) == dict(fp8_compute="w8a16", max_loras=4, max_lora_rank=16)
    forced = _bench_args("--lora", "4", "--fp8-compute", "w8a8")
    assert bench.layer_options("fp8_block", forced)["fp8_compute"] == "w8a8"  # asked: kept (router adapters only)
    plain = _bench_args()
    assert plain.lora == 0 and bench.layer_options("bf16", plain) == {}
    assert bench.layer_options("fp8_block", plain) == dict(fp8_compute="auto")


@pytest.mark.parametrize("argv", [("--lora", "-1"), ("--lora", "two"), ("--lora", "2", "--lora-rank", "0")])
def test_bad_lora_arguments_are_refused_at_parsing(argv, capsys):
    with pytest.raises(SystemExit):
        _bench_args(*argv)
    assert "must be an integer" in capsys.readouterr().err


class _FakeLoraLayer:
    def __init__(self, cfg, w8a8: bool):
        from cupymoe.lora_slots import serves_experts

        self.cfg, self.lora_experts, self.slots = cfg, serves_experts(None, w8a8), {}  # MoeLayer's default

    def set_lora(self, slot, adapter):
        self.slots[slot] = adapter


@pytest.mark.parametrize("w8a8", [False, True])
def test_install_adapters_fills_every_copys_slots_with_the_same_adapters(w8a8):
    from cupymoe.lora import LoraTarget

    cfg = testing.tiny_config("deepseek_v3")  # router, routed experts and a shared expert
    layers = [_FakeLoraLayer(cfg, w8a8) for _ in range(2)]
    targets = bench.install_adapters(layers, _bench_args("--lora", "3", "--lora-rank", "4"))
    assert targets == (["router"] if w8a8 else [t.value for t in LoraTarget])
    assert sorted(layers[0].slots) == [0, 1, 2] and all(layers[1].slots[s] is layers[0].slots[s] for s in range(3))
    lw = layers[0].slots[0]
    want = {LoraTarget.ROUTER} if w8a8 else set(LoraTarget)
    assert lw.targets == want and lw.max_rank == 4
    assert all(m.scale == bench.LORA_ALPHA / 4 for m in lw.modules.values())
    assert not np.array_equal(lw.get("router").a, layers[0].slots[1].get("router").a)  # K distinct ones


def test_random_lora_shapes_ranks_scales_and_bf16_values():
    from cupymoe.lora import LoraTarget, random_lora

    cfg = testing.tiny_config("deepseek_v3")
    H, I, Is, R = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.router_width
    lw = random_lora(cfg, np.random.default_rng(0), 8, alpha=16.0)
    lw.check(cfg, 8)
    routed = [k for k in lw.modules if k.target.per_expert]
    assert len(routed) == 3 * cfg.num_experts and lw.targets == set(LoraTarget)
    shapes = {LoraTarget.ROUTER: (H, R), LoraTarget.GATE: (H, I), LoraTarget.UP: (H, I), LoraTarget.DOWN: (I, H),
              LoraTarget.SHARED_GATE: (H, Is), LoraTarget.SHARED_UP: (H, Is), LoraTarget.SHARED_DOWN: (Is, H)}
    for key, m in lw.modules.items():
        inn, out = shapes[key.target]
        assert m.a.shape == (8, inn) and m.b.shape == (out, 8) and m.scale == 2.0 and m.rank == 8
        for v in (m.a, m.b):
            assert v.dtype == np.float32 and np.array_equal(v, v.astype(ml_dtypes.bfloat16).astype(np.float32))
    only = random_lora(cfg, np.random.default_rng(0), 2, targets=["router", "down"], experts=[1])
    assert set(only.modules) == {k for k in only.modules if k.target == LoraTarget.ROUTER or k.expert == 1}
    assert {k.target for k in only.modules} == {LoraTarget.ROUTER, LoraTarget.DOWN}


def test_round_robin_ids_and_the_lora_columns():
    from cupymoe.lora import round_robin_ids

    ids = round_robin_ids(10, 4)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert round_robin_ids(3, 0).tolist() == [-1, -1, -1] and round_robin_ids(1, 4).tolist() == [0]
    cols = bench.lora_columns([100.0, 102.0, 101.0], [110.0, 111.0, 112.0], touched=37)
    assert cols["base_us"] == 101.0 and cols["lora_us"] == 111.0 and cols["overhead_pct"] == 9.9
    assert cols["lora_touched"] == 37 and cols["lora_reps_us"] == [110.0, 111.0, 112.0]
    # each pair's ratio: 1.100, 1.088, 1.109 -> the median pair 1.100 (repetitions timed back to back)
    assert cols["overhead_paired_pct"] == 10.0


def test_lora_meta_says_how_and_which_fp8_compute():
    args = _bench_args("--lora", "4", "--lora-rank", "16")
    meta = bench.lora_meta(args, [dict(format="bf16"), dict(format="fp8_block", fp8_compute="w8a16")])
    assert (meta["adapters"], meta["rank"], meta["fp8_compute"]) == (4, 16, ["w8a16"])
    assert "inside the captured graph" in meta["method"] and "i mod K" in meta["ids"]
    assert bench.lora_meta(_bench_args(), []) is None
    assert meta["timing"] == "interleaved"
    assert bench.lora_meta(_bench_args("--lora", "2", "--lora-timing", "sequential"), [])["timing"] == "sequential"
    row = dict(format="bf16", N=64, us=100.0, floor_us=50.0, pct_of_floor=50.0, TBps=1.0, TFLOPs=1.0, touched=9,
               lora_us=110.0, base_us=100.0, overhead_pct=10.0)
    assert "LoRA 110.0 us (+10.0% over 100.0)" in bench.format_row(row)


@pytest.mark.parametrize("preset", sorted(bench.PRESETS))
def test_random_lora_serves_every_preset(preset):
    """A preset's model_type is its own name, no hub family: the adapter keys each module by target."""
    from cupymoe.lora import LoraTarget, random_lora

    cfg = bench.preset_config(preset)
    lw = random_lora(cfg, np.random.default_rng(0), 2)
    assert lw.targets == {LoraTarget.ROUTER, LoraTarget.GATE, LoraTarget.UP, LoraTarget.DOWN}
    assert sum(k.target.per_expert for k in lw.modules) == 3 * cfg.num_experts


def _git_tree(path, files):
    """A git repository at `path` holding `files` ({relative path: text}), committed."""
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    run = lambda *a: subprocess.run(["git", *a], cwd=path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("add", "-A")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "t")
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=path, text=True).strip()


def test_the_recorded_commit_is_the_trees_own(tmp_path, monkeypatch):
    """A results file names the commit its code was at: "+changes" where cupymoe/ or cuda/ differ
    from it, "unknown" for a copy inside another checkout (whose HEAD is not the copy's)."""
    monkeypatch.delenv("CUPYMOE_COMMIT", raising=False)
    own = tmp_path / "own"
    head = _git_tree(own, {"cupymoe/a.py": "x = 1\n", "cuda/k.cu": "//\n", "notes.txt": "n\n"})
    assert bench._git_commit(own) == head
    (own / "notes.txt").write_text("other\n")  # outside the code: the same commit
    assert bench._git_commit(own) == head
    (own / "cuda" / "k.cu").write_text("// changed\n")
    assert bench._git_commit(own) == head + "+changes"
    outer = tmp_path / "outer"
    _git_tree(outer, {"readme": "r\n", "copy/cupymoe/a.py": "x = 2\n"})
    assert bench._git_commit(outer / "copy") == "unknown"
    assert bench._git_commit(tmp_path / "no-repo-here") == "unknown"
    monkeypatch.setenv("CUPYMOE_COMMIT", "abc1234")
    assert bench._git_commit(outer / "copy") == "abc1234"


def _copy_tree(dest):
    """The package and its kernels copied to `dest` (what a carried .old holds)."""
    from cupymoe import jit

    root = jit.kernel_dir().parent
    for d in ("cupymoe", "cuda"):
        shutil.copytree(root / d, dest / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return root


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P (3.11+): what the A/B scripts run on the device")
def test_the_tree_digest_names_the_imported_sources(tmp_path):
    """Results carry jit.tree_digest(): the same for the same sources, another for a copy whose
    kernels differ, and the copy's own when PYTHONPATH names it under `python -P` (plain `python -m`
    from a checkout's root would import the checkout's package instead)."""
    from cupymoe import jit

    digest = jit.tree_digest()
    assert len(digest) == 12 and int(digest, 16) >= 0 and jit.tree_digest() == digest
    root = _copy_tree(tmp_path)
    probe = [sys.executable, "-P", "-c", "from cupymoe import jit; print(jit.tree_digest())"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = lambda: subprocess.run(probe, env=env, cwd=root, capture_output=True, text=True, check=True).stdout.strip()  # noqa: E731
    assert run() == digest
    (tmp_path / "cuda" / "common.cuh").write_text((tmp_path / "cuda" / "common.cuh").read_text() + "\n// changed\n")
    assert run() != digest


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P (3.11+): what the A/B scripts run on the device")
def test_ab_bench_refuses_two_trees_with_the_same_sources(tmp_path):
    """scripts/ab_bench.sh compares the trees' source digests before any GPU work: two copies of
    one tree stop it (exit 3), whatever the working folder."""
    root = _copy_tree(tmp_path / "a")
    _copy_tree(tmp_path / "b")
    env = {**os.environ, "OUT": str(tmp_path), "A": str(tmp_path / "a"), "B": str(tmp_path / "b"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}  # this python3
    done = subprocess.run(["bash", str(root / "scripts" / "ab_bench.sh"), "--tokens", "1"], env=env, cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 3 and "same sources" in done.stderr, (done.returncode, done.stdout, done.stderr)
