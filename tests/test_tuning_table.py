"""CPU tests of the tuning table's per-(shape, format, N bucket) entries: an empty table builds
bitwise the plans the global rules built before the table existed (tests/plan_digests.json,
every preset and format at row counts 1..16384); an entry moves only its own bucket's row
counts; a knob that forces a choice wins over the table; bad entries are refused by name."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from cupymoe import bench, heuristics as HX
from cupymoe.forward_plan import build_forward_plan
from cupymoe.knobs import Knobs, LoraShrink
from cupymoe.plan import DeviceFacts, LayerOptions, choose_path, plan_layer
from cupymoe.errors import ConfigError
from cupymoe.tuning import (Choice, bucket_start, fine_bucket, format_key, is_bucket, load, n_bucket, parse_by_shape,
                            shape_key)

H200 = DeviceFacts.h200()
DIGESTS = Path(__file__).with_name("plan_digests.json")
PACKAGE_TABLE = Path(__file__).parents[1] / "cupymoe" / "data" / "tuning.json"
# powers of two and three times them, each +-1: every bucket edge of 1..16384
NS = sorted({m + d for p in range(15) for m in (1 << p, 3 << p) for d in (-1, 0, 1) if 1 <= m + d <= 16384})


def plan_digests(table=None) -> dict[str, str]:
    """A digest of the auto path's plan at every NS row count, per preset (routed only and full) and format."""
    out = {}
    for preset in bench.PRESETS:
        for routed_only in (True, False):
            cfg = bench.preset_config(preset, routed_only=routed_only)
            for fmt in bench.FORMATS:
                shared = fmt if cfg.has_shared_expert else None
                lp = plan_layer(cfg, fmt, shared, "sm_90a", options=LayerOptions(), knobs=Knobs(), table=table)
                h = hashlib.sha256()
                for n in NS:
                    p = choose_path(lp, "auto", n)
                    h.update(f"{n}:{p}:{build_forward_plan(lp, H200, n, p).at(n).steps!r}\n".encode())
                out[f"{preset}{'' if routed_only else '+shared'}/{fmt}"] = h.hexdigest()[:16]
    return out


def test_an_empty_table_builds_the_plans_of_the_global_rules():
    """The digests were written by the code before the table existed (regenerate after a deliberate
    plan change: python tests/test_tuning_table.py --write)."""
    assert plan_digests(table={}) == json.loads(DIGESTS.read_text())


def test_the_packaged_table_loads_and_names_known_shapes():
    t = load()
    for (shape, fmt), buckets in [*t.by_shape.items(), *(kv for rows in t.by_device.values() for kv in rows.items())]:
        assert shape.startswith("H") and fmt.split(":")[0] in bench.FORMATS
        assert all(is_bucket(b) for b, _ in buckets)
    doc = json.loads(PACKAGE_TABLE.read_text())
    assert doc["device"] not in t.by_device  # the table's own GPU's rows are by_shape


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-next-80b", "qwen3-235b-a22b", "mixtral-8x7b",
                                    "gpt-oss-120b", "deepseek-v3"])
def test_the_h100_rows_are_what_an_h100_layer_runs_across_their_buckets(preset):
    """Each row of the packaged H100 section is the layer's choice at both ends of the row counts it
    serves on that GPU, and the plans there build; its decode-path rows raise that GPU's decode cap
    (and so its scratch), not the table's GPU's."""
    from cupymoe.workspace import layer_need

    cfg = bench.preset_config(preset)
    h100 = DeviceFacts("sm_90a", 132, 232448, H100)
    table = load()
    for fmt in ("bf16", "fp8_block", "nvfp4", "mxfp4"):
        lp = plan_layer(cfg, fmt, None, "sm_90a", knobs=Knobs(), device_name=H100)
        key = (shape_key(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts,
                         cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size), format_key(fmt, lp.w8a8))
        rows = dict(table.by_device[H100].get(key, ()))
        assert rows or fmt in ("nvfp4", "mxfp4"), key  # fp4: the presets served in it
        for b, c in rows.items():
            lo = bucket_start(b) + 1
            if b == n_bucket(b) and 3 * b // 4 in rows:
                lo = 3 * b // 4 + 1  # its three quarters' row serves below
            for n in (lo, b):
                assert lp.choice(n) == c, (key, b, n)
                path = choose_path(lp, "auto", n)
                assert c.path is None or path == c.path, (key, b, n, path)
                assert build_forward_plan(lp, h100, n, path).at(n).launches
    gpt = bench.preset_config("gpt-oss-120b")
    h200_plan = plan_layer(gpt, "bf16", None, "sm_90a", knobs=Knobs())
    h100_plan = plan_layer(gpt, "bf16", None, "sm_90a", knobs=Knobs(), device_name=H100)
    assert h100_plan.decode_max_tokens > h200_plan.decode_max_tokens
    assert layer_need(h100_plan, 4096)[1].total_bytes > layer_need(h200_plan, 4096)[1].total_bytes


def test_three_quarter_buckets_take_the_lower_part_of_their_power_of_two():
    """A row at m = 3b/4 serves b/2 < N <= m; the row at b keeps m < N <= b (all of b/2 < N <= b where
    no row has m); the plans' segments cut at both."""
    assert [fine_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 33, 48, 49, 64, 257, 384, 385)] == \
        [1, 2, 3, 4, 6, 6, 8, 8, 48, 48, 64, 64, 384, 384, 512]
    assert [is_bucket(b) for b in (1, 2, 3, 6, 12, 24, 48, 96, 384, 5, 9, 40, 72, 0)] == [True] * 9 + [False] * 5
    assert [bucket_start(b) for b in (64, 48, 512, 384)] == [32, 32, 256, 256]
    lp = _qwen(rows=[(48, Choice(path="prefill")), (64, Choice(path="decode"))])
    assert [choose_path(lp, "auto", n) for n in (33, 48, 49, 64)] == ["prefill", "prefill", "decode", "decode"]
    alone = _qwen(rows=[(48, Choice(path="prefill"))])  # no row at 64: 49..64 take the rules
    assert [choose_path(alone, "auto", n) for n in (33, 48)] == ["prefill", "prefill"]
    assert alone.choice(49) == Choice() and alone.choice(64) == Choice()
    from cupymoe.forward_plan import _table_segments
    assert _table_segments(lp, 1, 100) == [(1, 32), (33, 48), (49, 64), (65, 100)]


def test_a_devices_own_rows_replace_the_tables_bucket_by_bucket():
    """by_device rows replace the table's row of their bucket on that GPU (by the driver's name) and
    nowhere else; buckets they lack keep the table's; CUPYMOE_DEVICE_ROWS=0 leaves them out."""
    key = (shape_key(2048, 768, 128, 128, 8), "bf16")
    doc = json.loads(PACKAGE_TABLE.read_text())
    row = dict(shape=key[0], format="bf16", path="decode")
    doc["by_shape"]["value"] = [{**row, "n": 16}, {**row, "n": 64}]
    doc["by_device"] = {"value": {"NVIDIA H100 80GB HBM3": [{**row, "n": 64, "path": "prefill"},
                                                            {**row, "n": 96, "path": "prefill"}]}}
    t = load(json.dumps(doc))
    assert t.rows_for(key) == ((16, Choice("decode")), (64, Choice("decode")))
    assert t.rows_for(key, "NVIDIA H100 80GB HBM3") == ((16, Choice("decode")), (64, Choice("prefill")),
                                                         (96, Choice("prefill")))
    assert t.rows_for(key, "NVIDIA H100 PCIe") == t.rows_for(key)
    with pytest.raises(ConfigError, match=r"n=40 is neither .*by_device\['NVIDIA H100 80GB HBM3'\]"):
        load(json.dumps({**doc, "by_device": {"value": {"NVIDIA H100 80GB HBM3": [{**row, "n": 40}]}}}))
    with pytest.raises(ConfigError, match="by_device must map a GPU's name to its rows"):
        load(json.dumps({**doc, "by_device": {"value": [row]}}))
    cfg = bench.preset_config("qwen3-30b-a3b")
    packaged = load()
    h100 = "NVIDIA H100 80GB HBM3"
    for knobs, want in ((Knobs(), packaged.rows_for(key, h100)), (Knobs(device_rows=False), packaged.rows_for(key))):
        lp = plan_layer(cfg, "bf16", None, "sm_90a", knobs=knobs, device_name=h100)
        assert lp.tuned == tuple((b, c) for b, c in want)


def _qwen(fmt="bf16", rows=(), knobs=None, **options):
    cfg = bench.preset_config("qwen3-30b-a3b")
    key = (shape_key(2048, 768, 128, 128, 8), format_key(fmt, fmt == "fp8_block"))
    table = {key: tuple(sorted(rows))}
    return plan_layer(cfg, fmt, None, "sm_90a", options=LayerOptions(**options), knobs=knobs or Knobs(), table=table)


def test_a_path_entry_moves_its_bucket_only_and_raises_the_decode_cap():
    lp = _qwen(rows=[(16, Choice(path="decode")), (64, Choice(path="prefill"))])
    assert lp.decode_max_tokens == 16 and lp.auto_decode_max == 8
    paths = {n: choose_path(lp, "auto", n) for n in (1, 8, 9, 16, 17, 32, 33, 64, 65)}
    assert paths == {1: "decode", 8: "decode", 9: "decode", 16: "decode", 17: "prefill", 32: "prefill",
                     33: "prefill", 64: "prefill", 65: "prefill"}
    down = _qwen(rows=[(8, Choice(path="prefill")), (16, Choice(path="atomic"))])
    assert [choose_path(down, "auto", n) for n in (4, 5, 8, 12)] == ["decode", "prefill", "prefill", "atomic"]
    assert down.atomic_max_tokens == 16


def test_an_explicit_decode_cap_bounds_the_table():
    lp = _qwen(rows=[(32, Choice(path="decode"))], decode_max_tokens=20)
    assert [choose_path(lp, "auto", n) for n in (17, 20, 21, 32)] == ["decode", "decode", "prefill", "prefill"]


def test_grouped_and_w8a8_entries_follow_the_bucket_unless_a_knob_forces_them():
    lp = _qwen(rows=[(1024, Choice(grouped="stream")), (64, Choice(grouped="math"))])
    assert HX.grouped_config(lp, 1024) == "stream" and HX.grouped_config(_qwen(), 1024) == "math"
    assert HX.grouped_config(lp, 33) == "math" and HX.grouped_config(lp, 2048) == HX.grouped_config(_qwen(), 2048)
    forced = _qwen(rows=[(1024, Choice(grouped="stream"))], knobs=Knobs(math_rows=1))
    assert HX.grouped_config(forced, 1024) == "math"
    fp8 = _qwen("fp8_block", rows=[(4, Choice(w8a8_decode="wgmma")), (16, Choice(w8a8_decode="mma"))])
    assert HX.w8a8_decode_wgmma(fp8, H200, 32, 4) and not HX.w8a8_decode_wgmma(_qwen("fp8_block"), H200, 32, 4)
    assert not HX.w8a8_decode_wgmma(fp8, H200, 128, 16) and HX.w8a8_decode_wgmma(_qwen("fp8_block"), H200, 128, 16)
    plan = build_forward_plan(fp8, H200, 4, "decode").at(4)
    assert any(s.kernel.startswith("decode_wgmma_gate_up_a8") for s in plan.launches)


def test_row_invariant_layers_ignore_the_table():
    lp = _qwen(rows=[(16, Choice(path="decode", grouped="stream"))], row_invariant=True)
    assert lp.tuned == () and choose_path(lp, "auto", 16) == "prefill"


def test_bad_entries_are_refused_by_name():
    with pytest.raises(ValueError, match="path='warp'"):
        Choice(path="warp")
    row = dict(shape="H2048 I768 E128/128 k8", format="bf16", n=16, path="decode")
    with pytest.raises(ConfigError, match="n=20 is neither a power of two nor three quarters of one"):
        parse_by_shape([{**row, "n": 20}])
    assert n_bucket(1) == 1 and n_bucket(9) == 16 and n_bucket(16) == 16 and n_bucket(17) == 32


@pytest.mark.parametrize("change, message", [
    (dict(decode_kernal="swapab"), r"unknown field\(s\) \['decode_kernal'\]"),
    (dict(shape="H1"), "shape must read like"),
    (dict(format="fp8_block"), "format must be one of"),
    (dict(n=True), "n=True is neither a power of two"),
    (dict(path="warp"), "path='warp'"),
])
def test_a_bad_row_is_refused_naming_the_row(change, message):
    """A by_shape row with an unknown field (a misspelt choice would be dropped), a key no layer has
    (the row would never apply), or a bad choice is a ConfigError naming the row; so is a second row
    of one (shape, format, N bucket), which would otherwise replace the first unnoticed."""
    row = dict(shape="H2048 I768 E128/128 k8", format="bf16", n=16, path="decode")
    with pytest.raises(ConfigError, match=message) as e:
        parse_by_shape([{**row, **change}])
    assert "by_shape row shape=" in str(e.value)
    with pytest.raises(ConfigError, match="a second row for this shape, format and N bucket"):
        parse_by_shape([row, {**row, "path": "prefill"}])


def test_the_tables_rows_apply_on_the_arch_they_were_measured_on():
    """The package table's by_shape rows name sm_90a kernels and were timed there: on sm_80 the layer
    takes the global rules alone (the caps included)."""
    cfg = bench.preset_config("qwen3-30b-a3b")
    hopper = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs())
    ampere = plan_layer(cfg, "bf16", None, "sm_80", knobs=Knobs())
    assert hopper.tuned and not ampere.tuned
    assert ampere.decode_max_tokens == plan_layer(cfg, "bf16", None, "sm_80", knobs=Knobs(), table={}).decode_max_tokens


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    DIGESTS.write_text(json.dumps(plan_digests(table={}), indent=1) + "\n")


def test_prefill_buckets_cut_at_the_tables_buckets():
    """A table can flip the grouped configuration back and forth over N: the runs still match N by N."""
    from cupymoe.forward_plan import prefill_buckets, prefill_shape

    lp = _qwen(rows=[(256, Choice(grouped="math")), (512, Choice(grouped="stream")), (2048, Choice(grouped="math"))])
    runs = prefill_buckets(lp, H200, 9, 4096)
    assert runs[0][0] == 9 and runs[-1][1] == 4096
    assert all(b + 1 == c for (_, b, _), (c, _, _) in zip(runs, runs[1:]))
    for a, b, shape in runs:
        assert all(prefill_shape(lp, H200, n) == shape for n in list(range(a, b + 1, 7)) + [b])
    # the last cut is the stacked LoRA shrinks' (heuristics.LORA_SEGMENTS_FROM_ROWS)
    assert [s.grouped_config for _, _, s in runs] == ["stream", "math", "stream", "math", "math"]
    assert runs[-1][0] == 2049 and runs[-1][2].lora_gate_up_shrink == LoraShrink.SEGMENTS
    assert runs[-2][2].lora_gate_up_shrink == LoraShrink.EXPERTS


def test_a_row_names_the_swapab_token_tile():
    """by_shape rows carry token_tile (the tune's `decode/swapab/ntT` choices) into the Choice."""
    rows = [dict(shape="H2048 I768 E128/128 k8", format="bf16", n=256, path="decode", decode_kernel="swapab",
                 token_tile=32),
            dict(shape="H2048 I768 E128/128 k8", format="bf16", n=128, path="decode", decode_kernel="swapab",
                 token_tile=None)]
    buckets = dict(parse_by_shape(rows)[("H2048 I768 E128/128 k8", "bf16")])
    assert buckets[256].token_tile == 32 and buckets[128].token_tile is None
    with pytest.raises(ValueError, match="token_tile"):
        parse_by_shape([{**rows[0], "decode_kernel": None}])


def test_a_wgmma_token_tile_goes_with_its_kernel_under_the_knobs():
    """A decode/wgmma row's token_tile is dropped with the row's w8a8_decode when CUPYMOE_W8A8_DECODE
    forces the kernels, and kept when only CUPYMOE_DECODE_KERNEL is forced (a swap-AB row's tile goes
    with decode_kernel, as before)."""
    from cupymoe.catalog import WeightFormat
    from cupymoe.plan import tuned_buckets

    key = ("H2048 I768 E128/128 k8", "fp8_block:w8a8")
    table = {key: ((64, Choice("decode", w8a8_decode="wgmma", token_tile=16)),
                   (128, Choice("decode", decode_kernel="swapab", token_tile=32)))}
    cfg = bench.preset_config("qwen3-30b-a3b")

    def buckets(env):
        return dict(tuned_buckets(cfg, WeightFormat.FP8_BLOCK, 128, True, Knobs.from_env(env), False, table))
    assert buckets({})[64].token_tile == 16 and buckets({})[128].token_tile == 32
    forced_wgmma = buckets({"CUPYMOE_W8A8_DECODE": "wgmma"})
    assert forced_wgmma[64] == Choice("decode") and forced_wgmma[128].token_tile == 32
    forced_kernel = buckets({"CUPYMOE_DECODE_KERNEL": "register"})
    assert forced_kernel[64].token_tile == 16 and forced_kernel[128] == Choice("decode")


def test_w8a8_layers_lora_forwards_take_the_w8a16_rows():
    """The LoRA forwards of a w8a8 layer run its experts as w8a16 and take the table's w8a16 decode rows
    (qwen3-30b-a3b: to 256 rows) as a w8a16 layer does; a cap the caller set stays."""
    from cupymoe.plan import lora_options

    cfg = bench.preset_config("qwen3-30b-a3b")
    w8a16 = plan_layer(cfg, "fp8_block", None, "sm_90a", options=LayerOptions(fp8_compute="w8a16"), knobs=Knobs())
    assert w8a16.decode_max_tokens == 256 and choose_path(w8a16, "auto", 200) == "decode"
    lora = plan_layer(cfg, "fp8_block", None, "sm_90a", options=lora_options(LayerOptions()), knobs=Knobs())
    assert not lora.w8a8 and lora.decode_max_tokens == w8a16.decode_max_tokens
    assert choose_path(lora, "auto", 200) == "decode" and choose_path(lora, "auto", 257) == "prefill"
    asked = plan_layer(cfg, "fp8_block", None, "sm_90a", options=lora_options(LayerOptions(decode_max_tokens=100)),
                       knobs=Knobs())
    assert asked.decode_max_tokens == 100
    assert lora_options(LayerOptions(atomic_max_tokens=16)).atomic_max_tokens == 16


def test_info_says_which_rows_a_device_takes():
    """`python -m cupymoe info`'s line on the tuning table: the device's own section, the table's GPU, another
    GPU of the arch (none of its own), another arch (the rules)."""
    t = load()
    assert t.device == "NVIDIA H200"
    assert t.note("NVIDIA H100 80GB HBM3", "sm_90a").startswith("tuning table: ") and "rows timed on this GPU, the table's" in \
        t.note("NVIDIA H100 80GB HBM3", "sm_90a")
    assert t.note("NVIDIA H200", "sm_90a").endswith("per-shape rows, for this GPU")
    assert "CUPYMOE_DEVICE_ROWS=0 leaves this GPU's own out" in t.note("NVIDIA H100 80GB HBM3", "sm_90a", device_rows=False)
    assert "none of this GPU's own" in t.note("NVIDIA H100 PCIe", "sm_90a")
    assert t.note("NVIDIA A100-SXM4-80GB", "sm_80").endswith("on sm_80 the global rules decide")
