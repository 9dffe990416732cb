"""Regular expressions that come from files a user loads (PEFT's rank_pattern / alpha_pattern keys),
matched against a fixed list of names in bounded time.

Python's `re` backtracks and holds the GIL, so a key such as `(.+)+Q` against a 40-character module
name would stop every thread of a serving process for hours. Keys made only of name characters (no
quantifier, group, class or alternation) match in linear time here; any other key is matched in a
child interpreter that is killed past `timeout_s`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Optional, Sequence

# word characters, dots, dashes and escapes of them: no way to backtrack more than once a character
_PLAIN = re.compile(r"(?:[\w.\-]|\\[\w.\-])*")

_CHILD = """
import json, re, sys
job = json.load(sys.stdin)
rx = [re.compile(job["template"].format(k)) for k in job["keys"]]
print(json.dumps([next((i for i, r in enumerate(rx) if r.fullmatch(n)), None) for n in job["names"]]))
"""


class MatchTimeout(Exception):
    """The keys did not finish matching the names within the time bound; args[0]: the keys that are not plain."""


def is_plain(key: str) -> bool:
    """Whether `key` matches in linear time (no quantifier, group, class or alternation)."""
    return _PLAIN.fullmatch(key) is not None


def first_matches(keys: Sequence[str], names: Sequence[str], template: str = "{}",
                  timeout_s: float = 10.0) -> list[Optional[int]]:
    """For each name, the index of the first key whose `template.format(key)` fullmatches it, or None.
    Raises MatchTimeout when a key that is not plain keeps the child matching past `timeout_s`."""
    keys, names = list(keys), list(names)
    if all(is_plain(k) for k in keys):
        rx = [re.compile(template.format(k)) for k in keys]
        return [next((i for i, r in enumerate(rx) if r.fullmatch(n)), None) for n in names]
    job = json.dumps({"template": template, "keys": keys, "names": names})
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD], input=job, capture_output=True, text=True,
                              timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        raise MatchTimeout([k for k in keys if not is_plain(k)]) from None
    return json.loads(done.stdout)
