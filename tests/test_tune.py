"""CPU tests of python -m cupymoe tune's pure parts (candidates, de-duplication, the pick, the
table rows and their merge into the tuning table) and of bench's per-stage bytes and FLOPs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cupymoe.errors import ConfigError

from cupymoe import bench, tune
from cupymoe.knobs import Knobs, Sm90Fp8
from cupymoe.plan import DeviceFacts, LayerOptions, choose_path, plan_layer
from cupymoe.tuning import Choice, load

H200 = DeviceFacts.h200()
PACKAGE_TABLE = Path(tune.__file__).parent / "data" / "tuning.json"


def _empty_table(tmp_path) -> Path:
    """The package's tuning table with no by_shape rows and no by_device sections, in tmp_path."""
    data = json.loads(PACKAGE_TABLE.read_text())
    data["by_shape"] = {**data["by_shape"], "value": []}
    data.pop("by_device", None)
    p = tmp_path / "tuning.json"
    p.write_text(json.dumps(data, indent=2) + "\n")
    return p


def _plans(preset, fmt):
    """(the sweep's plan with caps admitting every candidate, the plan a layer runs by default)."""
    cfg = bench.preset_config(preset)
    cap = tune.DECODE_CAP[tune.format_key(fmt, fmt == "fp8_block")]
    wide = LayerOptions(decode_max_tokens=cap, atomic_max_tokens=min(tune.ATOMIC_CAP, cap))
    return (plan_layer(cfg, fmt, None, "sm_90a", options=wide, knobs=Knobs(), table={}),
            plan_layer(cfg, fmt, None, "sm_90a", options=LayerOptions(), knobs=Knobs(), table={}))


def test_candidates_by_rows_per_expert_and_caps():
    lp0, lpd = _plans("qwen3-30b-a3b", "bf16")
    label = lambda n: sorted(c.label() for c in tune.distinct(lp0, H200, n, [tune.default_choice(lpd, H200, n)]
                                                             + tune.candidates(lp0, n)))
    # 1 row an expert: no 128-row tiles; the swap-AB decode on both decode paths (bf16, sm_90a)
    assert label(16) == ["atomic", "atomic/swapab", "decode", "decode/swapab", "prefill/stream"]
    assert label(128) == ["prefill/stream"]  # past the plan's decode cap, under 16 rows an expert
    wide = plan_layer(bench.preset_config("qwen3-30b-a3b"), "bf16", None, "sm_90a",
                      options=LayerOptions(decode_max_tokens=tune.SWAPAB_CAP), knobs=Knobs(), table={})
    # 8 rows an expert: the rule's token tile (32) and 16, which holds an expert one deviation up
    assert [c.label() for c in tune.candidates(wide, 128)] == ["decode/swapab", "decode/swapab/nt16", "prefill/stream"]
    assert not any(c.decode_kernel for c in tune.candidates(
        plan_layer(bench.preset_config("qwen3-30b-a3b"), "bf16", None, "sm_80", knobs=Knobs(), table={}), 8))
    # math tiles: the layer's bf16 TMA GEMM (gather_wide gate/up, tma_192 down at I = 768) and each pair
    # of variants that fits it (gate/up must gather its rows: the layer keeps no xg)
    assert label(1024) == ["prefill/math", "prefill/math/gate_up=gather_wide/down=tma_wide", "prefill/stream"]
    f0, fd = _plans("qwen3-30b-a3b", "fp8_block")
    # the wgmma decode's rule takes 8-row passes at 16 rows (twice the mean: 2), 16 at 128 (16): each
    # wider tile is timed too
    assert [c.label() for c in tune.candidates(f0, 16)] == ["decode/mma", "decode/wgmma", "decode/wgmma/nt16",
                                                            "decode/wgmma/nt32", "decode/swapab", "atomic",
                                                            "atomic/swapab", "prefill", "prefill/tma64"]
    # w8a8: every decode kernel up to 512 rows (tune.DECODE_CAP: the GPU tests check them to 511);
    # the cp.async GEMM and the TMA one's 64-row form, and its 128-row form from 16 rows an expert
    assert [c.label() for c in tune.candidates(f0, 128)] == ["decode/mma", "decode/wgmma", "decode/wgmma/nt32",
                                                             "decode/swapab", "decode/swapab/nt16", "prefill",
                                                             "prefill/tma64"]
    assert [c.label() for c in tune.candidates(f0, 256)] == ["decode/mma", "decode/wgmma", "decode/swapab",
                                                             "decode/swapab/nt32", "prefill", "prefill/tma64",
                                                             "prefill/tma"]
    assert [c.label() for c in tune.candidates(f0, 512)] == ["decode/mma", "decode/wgmma", "decode/swapab", "prefill",
                                                             "prefill/tma64", "prefill/tma"]
    assert [c.label() for c in tune.candidates(f0, 1024)] == ["prefill", "prefill/tma64", "prefill/tma"]
    assert [c.label() for c in tune.distinct(f0, H200, 1024, [tune.default_choice(fd, H200, 1024)]
                                             + tune.candidates(f0, 1024))] == ["prefill", "prefill/tma64", "prefill/tma"]
    # the sweep's w8a8 plan admits every decode kernel up to SWAPAB_CAP rows
    fwide = plan_layer(bench.preset_config("qwen3-30b-a3b"), "fp8_block", None, "sm_90a",
                       options=LayerOptions(decode_max_tokens=tune.SWAPAB_CAP), knobs=Knobs(), table={})
    assert [c.label() for c in tune.candidates(fwide, 256)] == ["decode/mma", "decode/wgmma", "decode/swapab",
                                                                "decode/swapab/nt32", "prefill", "prefill/tma64",
                                                                "prefill/tma"]
    # past 256 rows the swap-AB decode while the widest token tile (bf16 128, fp8 64) holds a busy
    # expert: qwen3-30b-a3b 64 rows an expert at 1024 (bf16: 98 busy), 32 at 512 (fp8: 57 busy)
    assert [c.label() for c in tune.candidates(wide, 1024) if c.decode_kernel] == ["decode/swapab"]
    assert not any(c.decode_kernel for c in tune.candidates(wide, 2048))
    assert [c.label() for c in tune.candidates(fwide, 512) if c.decode_kernel] == ["decode/swapab"]
    assert not any(c.decode_kernel for c in tune.candidates(fwide, 1024))


def test_the_default_choice_is_what_the_layer_runs():
    _, lpd = _plans("qwen3-30b-a3b", "bf16")
    assert tune.default_choice(lpd, H200, 8) == Choice("decode")
    assert tune.default_choice(lpd, H200, 16) == Choice("prefill", "stream")
    assert tune.default_choice(lpd, H200, 2048) == Choice("prefill", "math")
    _, fd = _plans("qwen3-30b-a3b", "fp8_block")
    assert tune.default_choice(fd, H200, 4) == Choice("decode", w8a8_decode="mma")
    assert tune.default_choice(fd, H200, 64) == Choice("decode", w8a8_decode="wgmma")
    assert tune.default_choice(fd, H200, 4096) == Choice("prefill")  # the cp.async w8a8 GEMM until measured
    tma = plan_layer(bench.preset_config("qwen3-30b-a3b"), "fp8_block", None, "sm_90a",
                     knobs=Knobs(sm90_fp8_variant=Sm90Fp8.TMA), table={})
    assert tune.default_choice(tma, H200, 4096) == Choice("prefill", sm90_fp8="tma")
    # a table row on the swap-AB decode (its token tile too): the default the sweep must beat
    swapab = Choice("decode", decode_kernel="swapab", token_tile=16)
    for fmt in ("bf16", "fp8_block"):
        lp = plan_layer(bench.preset_config("qwen3-30b-a3b"), fmt, None, "sm_90a",
                        options=LayerOptions(decode_max_tokens=256), knobs=Knobs(), table={})
        assert tune.default_choice(replace(lp, tuned=((128, swapab),)), H200, 128) == swapab
    # and on the w8a8 wgmma decode's: timed as the layer runs it, not at the rule's tile
    wgmma = Choice("decode", w8a8_decode="wgmma", token_tile=16)
    lp = plan_layer(bench.preset_config("gpt-oss-120b"), "fp8_block", None, "sm_90a",
                    options=LayerOptions(decode_max_tokens=256), knobs=Knobs(), table={})
    assert tune.default_choice(replace(lp, tuned=((128, wgmma),)), H200, 128) == wgmma
    assert tune.default_choice(lp, H200, 128) == Choice("decode", w8a8_decode="wgmma")


def test_forcing_a_choice_goes_through_the_tables_lookup():
    lp0, _ = _plans("mixtral-8x7b", "bf16")
    f = tune.forced(lp0, 48, Choice("decode"))  # filed under its three-quarter bucket: 33..48
    assert choose_path(f, "auto", 48) == "decode" and choose_path(f, "auto", 33) == "decode"
    assert choose_path(f, "auto", 65) == "prefill" and f.tuned == ((48, Choice("decode")),)
    f = tune.forced(lp0, 64, Choice("decode"))  # a power of two: 33..64
    assert choose_path(f, "auto", 33) == choose_path(f, "auto", 64) == "decode" and f.tuned == ((64, Choice("decode")),)


def test_the_pick_keeps_the_default_within_the_margin():
    d = tune.Timed(Choice("prefill", "stream"), 100.0, 50.0)
    near, far = tune.Timed(Choice("decode"), 99.5, 50.2), tune.Timed(Choice("atomic"), 90.0, 55.0)
    assert tune.pick(d, [d, near]) is d and tune.pick(d, [d, near, far]) is far


def _cell(n, chosen, default):
    t = lambda c, us: dict(label=c.label(), path=c.path, grouped=c.grouped, w8a8_decode=c.w8a8_decode, us=us,
                           pct_of_floor=50.0)
    return dict(shape="qwen3-30b-a3b", shape_key="H2048 I768 E128/128 k8", format_key="bf16", N=n,
                default=t(default, 120.0), chosen=t(chosen, 100.0))


def test_rows_merge_into_the_table_and_the_layer_reads_them(tmp_path):
    args = argparse.Namespace(preset=["qwen3-30b-a3b"], formats=["bf16"], tokens=[16, 64], fp8_compute="auto")
    command = tune.sweep_command(args)
    assert command == "python -m cupymoe tune --preset qwen3-30b-a3b --format bf16 --tokens 16 64"
    cells = [_cell(16, Choice("decode"), Choice("prefill", "stream")),
             _cell(48, Choice("prefill", "math"), Choice("prefill", "stream"))]
    result = tmp_path / "20261202-h200-tune-x.json"
    result.write_text(json.dumps(dict(meta={}, cells=cells, table=tune.table_rows(cells, command, "elsewhere"))))
    table = _empty_table(tmp_path)
    assert tune.apply_result(result, table).rows == 2
    assert tune.apply_result(result, table).rows == 2  # the same rows again replace, not add
    other = tmp_path / "20261202-a100-tune-x.json"  # rows timed on another arch name its kernels, not the table's
    other.write_text(json.dumps(dict(json.loads(result.read_text()), meta={"arch": "sm_80"})))
    with pytest.raises(ConfigError, match="measured on sm_80, but the tuning table's rows are sm_90a's"):
        tune.apply_result(other, table)
    h100 = tmp_path / "20261206-h100-tune-x.json"  # the same arch, another GPU's rates: that GPU's own section
    h100.write_text(json.dumps(dict(json.loads(result.read_text()),
                                    meta={"arch": "sm_90a", "gpu": "NVIDIA H100 80GB HBM3"})))
    h100_rows = [{**r, "path": "prefill", "grouped": "stream"} if r["n"] == 16 else r
                 for r in json.loads(h100.read_text())["table"]]
    h100.write_text(json.dumps({**json.loads(h100.read_text()), "table": h100_rows}))
    assert tune.apply_result(h100, table) == tune.Applied(2, "by_device['NVIDIA H100 80GB HBM3']")
    data = json.loads(table.read_text())
    section = data["by_device"]["value"]["NVIDIA H100 80GB HBM3"]
    assert [(r["n"], r["path"]) for r in section] == [(16, "prefill"), (48, "prefill")]  # N = 48: 3/4 of 64
    assert not any("timed_on" in r for r in section) and len(data["by_shape"]["value"]) == 2
    assert data["by_device"]["result"] == ["benchmarks/results/20261206-h100-tune-x.json"]
    t = load(table.read_text())
    key = ("H2048 I768 E128/128 k8", "bf16")
    assert dict(t.rows_for(key))[16] == Choice("decode")  # the table's own GPU
    assert dict(t.rows_for(key, "NVIDIA H100 80GB HBM3"))[16] == Choice("prefill", "stream")
    assert dict(t.rows_for(key, "NVIDIA A100-SXM4-80GB"))[16] == Choice("decode")  # no section: the table's
    assert tune.apply_result(h100, table, other_gpu=True).rows == 2  # asked: into the table's rows, marked
    assert {r.get("timed_on") for r in json.loads(table.read_text())["by_shape"]["value"]} == {"NVIDIA H100 80GB HBM3"}
    load(table.read_text())  # a marked row loads
    assert tune.apply_result(result, table).rows == 2  # (the H200's rows back, unmarked)
    data = json.loads(table.read_text())
    rows = data["by_shape"]["value"]
    assert [(r["n"], r["path"], r["grouped"]) for r in rows] == [(16, "decode", None), (48, "prefill", "math")]
    assert {r["result"] for r in rows} == {"benchmarks/results/20261202-h200-tune-x.json"}
    assert not any("timed_on" in r for r in rows)
    assert rows[0]["command"] == command
    assert {k: v for k, v in data.items() if k not in ("by_shape", "by_device")} == {k: v for k, v in json.loads(
        PACKAGE_TABLE.read_text()).items() if k not in ("by_shape", "by_device")}
    lp = plan_layer(bench.preset_config("qwen3-30b-a3b"), "bf16", None, "sm_90a", knobs=Knobs(),
                    table=load(table.read_text()).by_shape)
    assert [choose_path(lp, "auto", n) for n in (8, 9, 16, 33, 48)] == ["decode", "decode", "decode", "prefill",
                                                                         "prefill"]


def test_the_time_limit_skips_what_it_leaves_untimed():
    """Past --time-limit no cell starts and no layer is built: the result's skipped lists the preset's N."""
    args = argparse.Namespace(tokens=[16, 64, 256])
    skipped: list = []
    assert tune._tune_format("qwen3-30b-a3b", None, "bf16", args, {}, skipped, deadline=0.0) == []
    assert skipped == [dict(shape="qwen3-30b-a3b", format="bf16", N=[16, 64, 256], reason="--time-limit reached")]
    assert not tune._out_of_time(None, "qwen3-30b-a3b", "bf16", [16], skipped)  # no limit: never out of time
    ap = argparse.ArgumentParser()
    tune.add_tune_args(ap)
    assert ap.parse_args(["--time-limit", "300"]).time_limit == 300.0 and ap.parse_args([]).time_limit is None


def test_tune_apply_runs_without_a_gpu(tmp_path):
    result = tmp_path / "r.json"
    result.write_text(json.dumps(dict(table=tune.table_rows([_cell(32, Choice("decode"), Choice("prefill", "stream"))],
                                                            "python -m cupymoe tune", "x"))))
    table = _empty_table(tmp_path)
    r = subprocess.run([sys.executable, "-m", "cupymoe", "tune", "--apply", str(result), "--table", str(table)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(table.read_text())["by_shape"]["value"][0]["n"] == 32


def test_apply_refuses_a_result_the_table_could_not_load_and_writes_nothing(tmp_path):
    """A row the table would refuse (n 40, an unknown path), rows that cannot be sorted together, or a file
    that is no tune result is a ConfigError naming it, and the table file is left byte for byte: a bad
    row merged into the package's own table would make every later `import cupymoe` fail."""
    good = tune.table_rows([_cell(32, Choice("decode"), Choice("prefill", "stream"))], "python -m cupymoe tune", "x")[0]
    table = _empty_table(tmp_path)
    before = table.read_bytes()
    cases = [
        (dict(table=[{**good, "n": 40}]), "n=40 is neither a power of two nor three quarters of one"),
        (dict(table=[{**good, "path": "warp-speed"}]), "path"),
        (dict(table=[good, {**good, "n": "16"}]), "n='16' is neither a power of two"),
        (dict(table=[{k: v for k, v in good.items() if k != "shape"}]), "shape must read like"),
        (dict(rows=[good]), "not a tune result"),
        (dict(table=good), "not a tune result"),
        (dict(table=[good], meta={"gpu": 0}), "meta.gpu must be the GPU's name, found 0"),
        (dict(table=[good], meta={"gpu": ["NVIDIA H100 80GB HBM3"]}), "meta.gpu must be the GPU's name"),
        ([good], "not a tune result .expected a JSON object, found list"),
    ]
    for i, (doc, message) in enumerate(cases):
        result = tmp_path / f"r{i}.json"
        result.write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=message):
            tune.apply_result(result, table)
        assert table.read_bytes() == before
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: cannot be read as a tune result"):
        tune.apply_result(tmp_path / "bad.json", table)
    broken = tmp_path / "broken-table.json"
    broken.write_text(json.dumps({"by_shape": {"value": []}}))
    (tmp_path / "ok.json").write_text(json.dumps(dict(table=[good])))
    with pytest.raises(ConfigError, match="broken-table.json: not a loadable tuning table"):
        tune.apply_result(tmp_path / "ok.json", broken)
    r = subprocess.run([sys.executable, "-m", "cupymoe", "tune", "--apply", str(tmp_path / "r0.json"),
                        "--table", str(table)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("cupymoe tune --apply: ConfigError: ") and r.stderr.count("\n") == 1
    assert table.read_bytes() == before


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_stage_bytes_and_flops_add_up_to_the_cell(path):
    cfg = bench.preset_config("qwen3-30b-a3b")
    n, touched = 64, 100
    fig = bench.stage_figures(cfg, "fp8_block", n, touched, path)
    cell = bench.cell_figures(cfg, "fp8_block", n, touched)
    assert sum(f for _, f in fig.values()) == cell["flops"]  # every FLOP in exactly one stage
    moved = n * 2048 * 2 + 2 * n * 8 * 768 * 2 + n * 8 * 2048 * (2 if path == "prefill" else 4)  # x, act, y
    weights = fig["gate_up"][0] + fig["down"][0] - moved
    assert weights == touched * bench.expert_bytes("fp8_block", 2048, 768)
    stages = bench.stage_rows({"router": 10.0, "gate_up": 30.0, "down": 60.0}, fig)
    assert [s["share_pct"] for s in stages.values()] == [10.0, 30.0, 60.0]
    assert stages["gate_up"]["TFLOPs"] == round(fig["gate_up"][1] / 30.0 / 1e6, 2)
    assert stages["down"]["TBps"] == round(fig["down"][0] / 60.0 / 1e6, 3)
    assert "gate_up 30.0 (30%" in bench.format_stages(stages)


def test_bench_rows_carry_stages_only_when_timed():
    cfg = bench.preset_config("qwen3-30b-a3b")
    ceilings = dict(copy_TBps=4.26, bf16_TFLOPs=777.0, fp8_TFLOPs=1462.0)
    plain = bench.bench_row(cfg, "qwen3-30b-a3b", "bf16", 16, 90, [100.0], ceilings, {}, path="auto", layers=2)
    assert plain["stages_us"] is None and "stages" not in plain
    timed = bench.bench_row(cfg, "qwen3-30b-a3b", "bf16", 16, 90, [100.0], ceilings, {}, path="auto", layers=2,
                            stage_us={"router": 5.0, "down": 45.0}, path_taken="prefill")
    assert timed["stages"]["down"]["share_pct"] == 90.0 and timed["stages_us"] == {"router": 5.0, "down": 45.0}


def test_the_tune_arguments_hold_every_field_the_bench_cell_timer_reads():
    import argparse
    import inspect
    import re

    from cupymoe import bench
    from cupymoe.tune import add_tune_args

    ap = argparse.ArgumentParser()
    add_tune_args(ap)
    args = ap.parse_args([])
    read = set()
    for fn in (bench._time_cell, bench.build_layers, bench.cell_input):
        read |= set(re.findall(r"args\.([a-z_]+)", inspect.getsource(fn)))
    assert read and all(hasattr(args, name) for name in read), sorted(n for n in read if not hasattr(args, n))


def test_a_tuned_token_tile_reaches_the_swapab_kernels():
    """A table row's token_tile replaces the rule's tile in the swap-AB launches of its bucket (bf16
    and fp8 as w8a8); a tile the format's kernels lack (fp8 has none of 128) leaves the rule's;
    token_tile without decode_kernel='swapab' is refused by name; the label names it."""
    from dataclasses import replace

    from cupymoe import heuristics as HX
    from cupymoe.catalog import WeightFormat

    for fmt, fp8 in (("bf16", False), ("fp8_block", True)):
        lp = plan_layer(bench.preset_config("qwen3-30b-a3b"), fmt, None, "sm_90a",
                        options=LayerOptions(decode_max_tokens=tune.SWAPAB_CAP), knobs=Knobs(), table={})
        assert HX.swapab_token_tile(lp, 256, fp8) == 64  # the rule: 16 + 4 x 4 + 2 rows
        tuned = replace(lp, tuned=((256, Choice("decode", decode_kernel="swapab", token_tile=32)),))
        assert HX.swapab_token_tile(tuned, 256, fp8) == 32
        assert HX.swapab_token_tile(tuned, 64, fp8) == 16  # another bucket: the rule's
        name = HX.swapab_decode_kernel(tuned, "down", 256, WeightFormat.FP8_BLOCK if fp8 else WeightFormat.BF16).name
        assert name.endswith("<32>"), name
        too_wide = replace(lp, tuned=((256, Choice("decode", decode_kernel="swapab", token_tile=128)),))
        assert HX.swapab_token_tile(too_wide, 256, fp8) == (64 if fp8 else 128)
    with pytest.raises(ValueError, match="token_tile=32 needs decode_kernel='swapab' or w8a8_decode='wgmma'"):
        Choice("decode", token_tile=32)
    with pytest.raises(ValueError, match="token_tile=24"):
        Choice("decode", decode_kernel="swapab", token_tile=24)
    assert Choice("decode", decode_kernel="swapab", token_tile=32).label() == "decode/swapab/nt32"


def test_a_tuned_sm90_variant_reaches_the_bf16_grouped_gemms():
    """A table row's sm90_gate_up / sm90_down replace the layer's bf16 TMA GEMM variant in its
    bucket's prefill launches where it fits the layer (the same 256-row weight boxes; a gate/up
    reading xg only where the layer keeps it): mixtral-8x7b (tma_192 gate/up with xg, tma_wide down)
    takes gather_wide's gate/up without gather_rows and tma_192's down with 192-row down tiles;
    qwen3-30b-a3b (gather_wide gate/up, no xg) leaves a tma_192 gate/up to its own; a variant outside
    TUNED_SM90 is refused by name; the knobs drop the table's variants."""
    from cupymoe.forward_plan import build_forward_plan
    from cupymoe.plan import Path as P

    def gemms(lp, n):
        plan = build_forward_plan(lp, H200, n, P.PREFILL).at(n)
        return [s.kernel for s in plan.launches
                if s.stage.value in ("gate_up", "down") and s.kernel.startswith(("grouped_gemm", "gather_rows"))]

    cfg = bench.preset_config("mixtral-8x7b")
    lp = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs(), table={})
    own = gemms(lp, 512)
    assert own == ["gather_rows", "grouped_gemm_sm90_tma<0, 4, 256, 1, 0, 3>", "grouped_gemm_sm90_tma<1, 4, 256, 1>"]
    tuned = replace(lp, tuned=((512, Choice("prefill", "math", sm90_gate_up="gather_wide", sm90_down="tma_192")),))
    assert gemms(tuned, 512) == ["grouped_gemm_sm90_tma<0, 4, 256, 1, 1>", "grouped_gemm_sm90_tma<1, 4, 256, 1, 0, 3>"]
    assert gemms(tuned, 1024) == own  # another bucket: the layer's
    qwen = plan_layer(bench.preset_config("qwen3-30b-a3b"), "bf16", None, "sm_90a", knobs=Knobs(), table={})
    lone = replace(qwen, tuned=((1024, Choice("prefill", "math", sm90_gate_up="tma_192", sm90_down="tma_wide")),))
    assert gemms(lone, 1024) == ["grouped_gemm_sm90_tma<0, 4, 256, 1, 1>", "grouped_gemm_sm90_tma<1, 4, 256, 1>"]
    with pytest.raises(ValueError, match="sm90_down='tma'"):
        Choice("prefill", "math", sm90_down="tma")
    forced = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs(sm90_down_variant="tma_wide"),
                        table={tune.layer_keys(lp): ((512, Choice("prefill", "math", sm90_gate_up="gather_wide",
                                                                       sm90_down="tma_192")),)})
    assert forced.choice(512) == Choice("prefill", "math", sm90_gate_up="gather_wide")


def test_a_tuned_token_tile_reaches_the_wgmma_decode():
    """A table row of decode/wgmma naming token_tile sizes both w8a8 wgmma decode launches of its bucket
    (passes of that many rows); the swap-AB kernels never take a wgmma row's tile; tiles the wgmma
    kernels lack, or a tile on a decode/mma row, are refused by name."""
    from dataclasses import replace

    from cupymoe import heuristics as HX

    lp = plan_layer(bench.preset_config("qwen3-30b-a3b"), "fp8_block", None, "sm_90a",
                    options=LayerOptions(decode_max_tokens=512), knobs=Knobs(), table={})
    rows = HX.decode_rows_per_expert(lp, 64)  # twice the mean: 8 rows
    assert rows == 8.0 and HX.a8_token_tile(lp, rows, 64) == 8
    assert HX.a8_token_tiles_to_time(lp, rows) == (16, 32)
    tuned = replace(lp, tuned=((64, Choice("decode", w8a8_decode="wgmma", token_tile=16)),))
    assert HX.a8_token_tile(tuned, rows, 64) == 16
    assert HX.a8_token_tile(tuned, rows, 16) == 8  # another bucket: the rule's
    for stage in ("gate_up", "down"):
        dk = HX.w8a8_decode_kernel(tuned, H200, stage, rows, 64, 64)
        assert dk.name == f"decode_wgmma_{stage}_a8<16>", dk.name
    assert HX.swapab_token_tile(tuned, 64, True) == HX.swapab_token_tile(lp, 64, True)
    with pytest.raises(ValueError, match="token_tile=64 with w8a8_decode='wgmma' must be one of"):
        Choice("decode", w8a8_decode="wgmma", token_tile=64)
    with pytest.raises(ValueError, match="w8a8_decode='mma'"):
        Choice("decode", w8a8_decode="mma", token_tile=16)
    assert Choice("decode", w8a8_decode="wgmma", token_tile=16).label() == "decode/wgmma/nt16"


def test_output_paths_that_cannot_be_written_are_refused_before_any_timing(tmp_path, monkeypatch, capsys):
    """bench --json, tune --json / --table-out were written after the sweep (its minutes lost to a traceback),
    tune --apply's --table after the merge; each is now tried first: one line, exit 2, nothing timed. A path
    the check creates is removed again, and an existing file keeps its bytes."""
    from cupymoe import __main__ as cli

    monkeypatch.setattr(cli, "require_gpu", lambda what: None)
    monkeypatch.setattr("cupymoe.bench.run_bench", lambda args: pytest.fail("timed"))
    monkeypatch.setattr("cupymoe.tune.run_tune", lambda args: pytest.fail("timed"))
    monkeypatch.setattr("cupymoe.tune.apply_result", lambda *a, **k: pytest.fail("merged"))
    missing = tmp_path / "no-such-dir" / "x.json"
    cases = [(["bench", "--json", str(missing)], "cupymoe bench: --json"),
             (["tune", "--json", str(tmp_path)], "cupymoe tune: --json"),  # a directory
             (["tune", "--table-out", str(missing)], "cupymoe tune: --table-out"),
             (["tune", "--apply", str(tmp_path / "r.json"), "--table", str(missing)], "cupymoe tune --apply: --table")]
    for argv, head in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"{head} ") and "cannot be written" in err and err.count("\n") == 1, err
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    assert not cli._cannot_write("bench", {"--json": str(kept), "--table-out": str(tmp_path / "new.json")})
    assert kept.read_text() == "{}" and not (tmp_path / "new.json").exists()
