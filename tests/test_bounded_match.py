"""CPU tests of cupymoe/bounded_match.py: a loaded file's regular expressions matched as PEFT matches
them, in bounded time, with every way the child interpreter can fail named."""

from __future__ import annotations

import re
import sys

import pytest

from cupymoe import bounded_match as BM
from cupymoe.lora import PEFT_PATTERN

NAMES = ["model.layers.3.mlp.experts.0.gate_proj", "model.layers.3.mlp.experts.12.down_proj", "model.layers.3.mlp.gate",
         "abc", "x.abc", "model.layers.3.mlp.shared_expert.up_proj", "gate_proj"]
KEYS = [["gate_proj"], ["^model.layers.3.mlp.gate"], [r"experts\.\d+\.down_proj", "down_proj"], ["a)|(b"],
        ["(gate|up)_proj"], [r"mlp\.[a-z_]+\.up_proj"], ["mlp.gate", "gate"], [r"(a)\3"], ["nothing", "ab"]]


def peft_first(keys, name):
    """PEFT's get_pattern_key: the first key with re.match(rf"(.*\\.)?({key})$", name)."""
    return next((i for i, k in enumerate(keys) if re.match(rf"(.*\.)?({k})$", name)), None)


@pytest.mark.parametrize("keys", KEYS, ids=lambda k: "|".join(k))
@pytest.mark.parametrize("where", ["in_process", "child"])
def test_first_matches_are_pefts(keys, where, monkeypatch):
    if where == "child":
        monkeypatch.setattr(BM, "in_process_safe", lambda key: False)
    assert BM.first_matches(keys, NAMES, PEFT_PATTERN) == [peft_first(keys, n) for n in NAMES]


@pytest.mark.parametrize("key, safe", [
    ("gate_proj", True), (r"^model\.layers\.\d+\.mlp\.experts\.\d+\.gate_proj$", True), ("(gate|up)_proj", True),
    (r"[a-z]+\.[0-9]+", True), ("(.+)+Q", False), ("(a|a)*b", False), (r"(a)\1", False), (".*.*.*x", False),
    ("(ab|a)+c", False), ("(a+){2,}", False), ("a{1,99999999999}", False), ("(" * 3000 + ")" * 3000, False),
    ("gate(", False),
    # optional and bounded repeats choose too: n of them in a row backtrack 2^n ways
    ("(.?){20}.{20}Q", False), (".?" * 22 + ".{22}Q", False), ("a?b?c?", False), ("(ab|cd)(ef|gh)(ij|kl)", False),
    ("(a?){2}", False), ("a?b?", True), (".{0,30}x", True), ("(ab|cd)_proj", True), ("x{3}(ab){2}", True)])
def test_keys_whose_structure_bounds_their_backtracking_match_in_process(key, safe):
    assert BM.in_process_safe(key) is safe


@pytest.mark.parametrize("key", ["(.?){25}.{25}Q", ".?" * 25 + ".{25}Q"])
def test_optional_repeats_that_backtrack_are_cut_off_too(key):
    """Matched in process, one name of these would hold the GIL for seconds to days (2^25 steps and up)."""
    with pytest.raises(BM.MatchError, match="took over 0.5 s"):
        BM.first_matches([key], ["model.layers.3.mlp.experts.0.gate_proj"], PEFT_PATTERN, 0.5)


def test_a_key_that_backtracks_without_bound_is_cut_off_and_named():
    with pytest.raises(BM.MatchError, match=r"key\(s\) \['\(\.\+\)\+Q'\]: matching 1 names took over 0.5 s"):
        BM.first_matches(["gate", "(.+)+Q"], ["model.layers.3.mlp.experts.0.gate_projection_x"], PEFT_PATTERN, 0.5)


@pytest.mark.parametrize("exe, why", [(None, "need a Python interpreter"), ("", "need a Python interpreter"),
                                      ("/bin/false", "exited 1"), ("/bin/true", "failed .*JSONDecodeError"),
                                      ("/nonexistent/python", "failed .*FileNotFoundError")])
def test_a_child_that_cannot_match_is_named(exe, why, monkeypatch):
    monkeypatch.setattr(sys, "executable", exe)
    with pytest.raises(BM.MatchError, match=why):
        BM.first_matches(["(.+)+Q"], ["abc"], PEFT_PATTERN)


def test_nothing_to_match_starts_no_child(monkeypatch):
    monkeypatch.setattr(BM, "_in_child", lambda *a: pytest.fail("a child for nothing"))
    assert BM.first_matches(["(.+)+Q"], [], PEFT_PATTERN) == [] and BM.first_matches([], ["a"]) == [None]


def test_the_in_process_matches_keep_the_deadline_too(monkeypatch):
    """Keys matched in process (polynomial a name) still stop at the bound over many names."""
    clock = iter(range(0, 1000, 4))
    monkeypatch.setattr(BM.time, "monotonic", lambda: next(clock))
    with pytest.raises(BM.MatchError, match=r"key\(s\) \['gate'\]: matching 5 names took over 10 s"):
        BM.first_matches(["gate"], ["a.gate", "b", "c", "d", "e"], PEFT_PATTERN, 10.0)
