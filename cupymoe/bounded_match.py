"""Regular expressions that come from files a user loads (PEFT's rank_pattern / alpha_pattern keys),
matched against a fixed list of names in bounded time.

Python's `re` backtracks and holds the GIL, so a key such as `(.+)+Q` against a 40-character module
name would stop every thread of a serving process for hours. A key whose structure bounds the
backtracking is matched in process, its names checked against the deadline one by one: no
back-reference, nothing that repeats or chooses inside a repeat, and at most two choice points (a
repeat of variable count, `?` and `{0,9}` included, or an alternation), so a name of n characters
costs polynomial steps, not 2^(choices). Any other key goes to a child interpreter killed past
`timeout_s`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Optional, Sequence

try:  # the parser `re` compiles with (private, stable since 3.11); without it every key goes to the child
    from re import _constants as _sre_c, _parser as _sre_parse
except ImportError:  # pragma: no cover
    _sre_c = _sre_parse = None

_CHILD = """
import json, re, sys
job = json.load(sys.stdin)
rx = [re.compile(job["template"].format(k)) for k in job["keys"]]
print(json.dumps([next((i for i, r in enumerate(rx) if r.match(n)), None) for n in job["names"]]))
"""
# choice points a key matched in process may hold: each multiplies a name's steps by at most n + 1 (or its
# alternatives); with the template's own `.*` at most ~n^3 steps over a name of n characters
MAX_CHOICE_POINTS = 2


class MatchError(Exception):
    """The keys could not be matched in bounded time: args[0] says why (a timeout names the keys)."""


_REPEATS = tuple(getattr(_sre_c, op) for op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                 if hasattr(_sre_c, op)) if _sre_c else ()


def _children(op, av) -> list:
    """The sub-patterns of one parsed node (empty for a leaf)."""
    c = _sre_c
    if op in _REPEATS:
        return [av[2]]
    if op == c.SUBPATTERN:
        return [av[-1]]
    if op == c.BRANCH:
        return list(av[1])
    if op in (c.ASSERT, c.ASSERT_NOT):
        return [av[1]]
    if op == c.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    if op == getattr(c, "ATOMIC_GROUP", None):
        return [av]
    return []


def in_process_safe(key: str) -> bool:
    """Whether `key`'s backtracking is bounded by its structure (module docstring), so it is matched in
    process; a key the parser refuses is left to the caller's compile (False here)."""
    if _sre_parse is None:
        return re.fullmatch(r"(?:[\w.\-^$]|\\[\w.\-])*", key) is not None
    try:
        tree = _sre_parse.parse(key)
    except Exception:  # noqa: BLE001 (re.error, OverflowError, RecursionError: the compile check names it)
        return False
    choices = 0

    def walk(items, in_repeat: bool) -> bool:
        nonlocal choices
        for op, av in items:
            if op == _sre_c.GROUPREF:
                return False
            chooses = op in (_sre_c.BRANCH, _sre_c.GROUPREF_EXISTS) or (op in _REPEATS and av[0] != av[1])
            repeats = op in _REPEATS and av[1] > 1
            if in_repeat and (chooses or repeats):
                return False
            choices += chooses
            if not all(walk(sub, in_repeat or repeats or (chooses and op in _REPEATS))
                       for sub in _children(op, av)):
                return False
        return choices <= MAX_CHOICE_POINTS

    return walk(tree, False)


def first_matches(keys: Sequence[str], names: Sequence[str], template: str = "{}",
                  timeout_s: float = 10.0) -> list[Optional[int]]:
    """For each name, the index of the first key whose `template.format(key)` matches it at its start
    (`re.match`; the template anchors its end), or None. Raises MatchError where a key that is not
    in_process_safe keeps the child past `timeout_s`, or the child cannot run."""
    keys, names = list(keys), list(names)
    if not keys or not names:
        return [None] * len(names)
    slow = [k for k in keys if not in_process_safe(k)]
    if not slow:
        return _in_process(keys, names, template, timeout_s)
    return _in_child(keys, names, template, timeout_s, slow)


def _in_process(keys: list[str], names: list[str], template: str, timeout_s: float) -> list[Optional[int]]:
    """One name's match is polynomial here (in_process_safe); the deadline bounds their sum."""
    rx = [re.compile(template.format(k)) for k in keys]
    deadline, hits = time.monotonic() + timeout_s, []
    for n in names:
        if time.monotonic() > deadline:
            raise MatchError(f"key(s) {keys}: matching {len(names)} names took over {timeout_s:g} s")
        hits.append(next((i for i, r in enumerate(rx) if r.match(n)), None))
    return hits


def _in_child(keys: list[str], names: list[str], template: str, timeout_s: float,
              slow: list[str]) -> list[Optional[int]]:
    """All keys matched by a child interpreter killed past `timeout_s`; `slow`: the keys that sent them there."""
    if not sys.executable or getattr(sys, "frozen", False):  # an embedding app: no interpreter to run
        raise MatchError(f"key(s) {slow} need a Python interpreter to be matched in bounded time, and "
                         f"sys.executable is {sys.executable!r}")
    job = json.dumps({"template": template, "keys": keys, "names": names})
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD], input=job, capture_output=True, text=True,
                              timeout=timeout_s, check=True)
        hits = json.loads(done.stdout)
    except subprocess.TimeoutExpired:
        raise MatchError(f"key(s) {slow}: matching {len(names)} names took over {timeout_s:g} s (nested or "
                         "many repeats backtrack without bound)") from None
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-1:] or ["no message"]
        raise MatchError(f"key(s) {slow}: the matching interpreter {sys.executable} exited {e.returncode} "
                         f"({tail[0]})") from None
    except (OSError, ValueError) as e:  # cannot start it; its output no JSON
        raise MatchError(f"key(s) {slow}: the matching interpreter {sys.executable!r} failed "
                         f"({type(e).__name__}: {e})") from None
    if not (isinstance(hits, list) and len(hits) == len(names)
            and all(h is None or (type(h) is int and 0 <= h < len(keys)) for h in hits)):
        raise MatchError(f"key(s) {slow}: the matching interpreter {sys.executable!r} answered {str(hits)[:80]}")
    return hits
