"""Every CUPYMOE_* knob is read in one place, validated, and refused by name when bad."""

from __future__ import annotations

import pytest

from cupymoe import knobs
from cupymoe.errors import OptionError
from cupymoe.knobs import DecodeRouter, Fp4Decode, Knobs, W8a8Decode

BAD = {"build_jobs": "0", "quiet": "yes", "fp4_decode": "tensor", "fp8_decode": "cuda", "w8a8_decode": "tma",
       "decode_router": "tensor", "pdl": "2", "topk_lists": "yes", "mma_down_pairs": "on",
       "mma_blocks_per_sm": "0", "fp4_down_tiles": "-1", "sm90_variant": "fast", "sm90_down_variant": "slim",
       "math_rows": "0", "gemm_band_cols": "x", "guard": "on", "weight_l2_promotion": "512",
       "decode_sort_pairs": "4097"}


def test_unset_knobs_take_their_defaults():
    assert Knobs.from_env({}) == Knobs()
    assert Knobs().pdl and Knobs().topk_lists and Knobs().fp4_decode == Fp4Decode.AUTO


@pytest.mark.parametrize("field, value", sorted(BAD.items()))
def test_a_bad_value_is_refused_naming_the_variable_and_value(field, value):
    env = knobs.TABLE[field][0]
    with pytest.raises(OptionError, match=f"{env}={value!r}"):
        Knobs.from_env({env: value})


def test_good_values_are_read():
    k = Knobs.from_env({"CUPYMOE_PDL": "0", "CUPYMOE_W8A8_DECODE": "wgmma", "CUPYMOE_DECODE_ROUTER": "cores",
                        "CUPYMOE_FP4_DOWN_TILES": "2", "CUPYMOE_SM90_VARIANT": "twin", "CUPYMOE_PROFILE": "1"})
    assert (k.pdl, k.w8a8_decode, k.decode_router, k.fp4_down_tiles, k.sm90_variant, k.profile) == \
        (False, W8a8Decode.WGMMA, DecodeRouter.CORES, 2, "twin", True)


def test_the_decode_sort_bound_is_read_and_reaches_the_plan():
    """CUPYMOE_DECODE_SORT_PAIRS lowers the decode path's one-block sort (1024: as before the rounds);
    unset, the layer takes DECODE_SORT_PAIRS, the most the kernel's rounds hold."""
    from cupymoe import bench, catalog as C
    from cupymoe.plan import LayerOptions, plan_layer

    cfg = bench.preset_config("qwen3-30b-a3b")
    for env, want in (({}, C.DECODE_SORT_PAIRS), ({"CUPYMOE_DECODE_SORT_PAIRS": "1024"}, 1024)):
        lp = plan_layer(cfg, "bf16", None, "sm_90a", options=LayerOptions(), knobs=Knobs.from_env(env), table={})
        assert lp.decode_sort_pairs == want


def test_every_knob_is_listed_once():
    text = knobs.describe()
    for name, (env, *_rest) in knobs.TABLE.items():
        assert text.count(env + " ") == 1, env
    assert set(knobs.TABLE) == {f for f in Knobs.__dataclass_fields__}


def test_an_unknown_cupymoe_variable_is_refused_by_name():
    """A misspelt knob would leave its default in place unnoticed: any CUPYMOE_* name that is neither
    a knob nor a tool's variable is refused, naming it; the tools' variables pass."""
    with pytest.raises(OptionError, match="unknown environment variable\\(s\\) CUPYMOE_FP4_DECOD:"):
        Knobs.from_env({"CUPYMOE_FP4_DECOD": "cores"})
    assert Knobs.from_env({"CUPYMOE_TEST_SEED": "3", "CUPYMOE_COMMIT": "abc", "OTHER": "x"}) == Knobs()


@pytest.mark.parametrize("value", ["false", "off", "", "2"])
def test_profile_takes_only_0_or_1(value):
    with pytest.raises(OptionError, match=f"CUPYMOE_PROFILE={value!r}: must be '0' or '1'"):
        Knobs.from_env({"CUPYMOE_PROFILE": value})
    assert Knobs.from_env({"CUPYMOE_PROFILE": "1"}).profile and not Knobs.from_env({"CUPYMOE_PROFILE": "0"}).profile


def test_the_knobs_command_reads_this_environment(monkeypatch, capsys):
    """`python -m cupymoe knobs` lists the table, then this environment's settings as a layer reads
    them; an unknown name is its refusal's line and exit status 2."""
    from cupymoe.__main__ import main

    for k in [k for k in __import__("os").environ if k.startswith("CUPYMOE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CUPYMOE_PDL", "0")
    assert main(["knobs"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("this environment: CUPYMOE_PDL=0")
    monkeypatch.setenv("CUPYMOE_PLD", "0")
    assert main(["knobs"]) == 2
    assert "this environment: unknown environment variable(s) CUPYMOE_PLD" in capsys.readouterr().out


def test_info_refuses_a_misspelt_knob_with_or_without_a_gpu(monkeypatch, capsys):
    """Without a GPU `info` returned 0 before it read the environment, so a misspelt knob went unnamed."""
    from cupymoe.__main__ import main

    for k in [k for k in __import__("os").environ if k.startswith("CUPYMOE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CUPYMOE_PLD", "0")
    assert main(["info"]) == 2
    assert "cupymoe info: OptionError: unknown environment variable(s) CUPYMOE_PLD" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "--preset", "nope"], ["inspect", "ck", "--max-tokens", "0"], ["frob"],
                                  ["tune", "--tokens", "x"]])
def test_bad_command_arguments_are_one_line_and_exit_2(argv, capsys):
    """A bad argument of `python -m cupymoe` is one stderr line naming it (no usage block), exit 2."""
    from cupymoe.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error: " in err and "--help for usage" in err


def test_the_no_gpu_refusal_is_one_line(monkeypatch, capsys):
    """verify / bench / tune without a GPU: one stderr line saying why and what runs without one, exit 2."""
    from cupymoe import __main__ as cli

    monkeypatch.setattr(cli, "_no_gpu_reason", lambda: "no CUDA device found")
    with pytest.raises(SystemExit) as e:
        cli.require_gpu("verify")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "kernels --arch" in err


@pytest.mark.parametrize("value", ["16", "32x8", "16x0", "12x4", "x"])
def test_lora_down_lanes_refused_outside_one_mask_word(value):
    with pytest.raises(OptionError, match=f"CUPYMOE_LORA_DOWN_LANES={value!r}"):
        Knobs.from_env({"CUPYMOE_LORA_DOWN_LANES": value})
    assert Knobs.from_env({"CUPYMOE_LORA_DOWN_LANES": "16x8"}).lora_down_lanes == (16, 8)


@pytest.mark.parametrize("value", ["32", "12", "0", "x"])
def test_lora_router_lanes_refused_outside_one_mask_word(value):
    with pytest.raises(OptionError, match=f"CUPYMOE_LORA_ROUTER_TPR={value!r}"):
        Knobs.from_env({"CUPYMOE_LORA_ROUTER_TPR": value})
    assert Knobs.from_env({"CUPYMOE_LORA_ROUTER_TPR": "8"}).lora_router_tpr == 8


@pytest.mark.parametrize("value", ["\u00b2", "1\u00b9", "9" * 5000, "", "+3", "3 "])
def test_row_counts_are_ascii_digits(value):
    """str.isdigit takes superscripts (int() then raises ValueError) and int() a 5000-digit string: refused
    by name as every other bad value."""
    with pytest.raises(OptionError, match="CUPYMOE_MATH_ROWS="):
        Knobs.from_env({"CUPYMOE_MATH_ROWS": value})


def test_an_empty_folder_knob_is_unset():
    """CUPYMOE_DUMP_DIR="" would have dumped into the current folder: an empty folder knob is unset."""
    k = Knobs.from_env({"CUPYMOE_DUMP_DIR": "", "CUPYMOE_CACHE_DIR": ""})
    assert k.dump_dir is None and k.cache_dir is None


def test_a_result_records_the_knobs_set_but_no_folder():
    env = {"CUPYMOE_GEMM_BAND_COLS": "8", "CUPYMOE_CACHE_DIR": "/x/y", "CUPYMOE_DUMP_DIR": "/d", "HOME": "/h",
           "CUPYMOE_SM90_FP8_VARIANT": "tma"}
    assert knobs.chosen(env) == {"CUPYMOE_GEMM_BAND_COLS": "8", "CUPYMOE_SM90_FP8_VARIANT": "tma"}
    assert knobs.chosen({}) == {}
