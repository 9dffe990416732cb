"""Reading a kernel file's constants, for the tests that hold a catalog mirror to them."""

import re


def define(src: str, name: str) -> int:
    """The integer of `#define name N` in src."""
    return int(re.search(rf"^#define {name} (\d+)", src, re.M).group(1))


def map_indices(src: str, prefix: str) -> dict:
    """{map name (lower case): index} of src's `#define <prefix>MAP_<NAME> i` (not <prefix>MAP_BYTES)."""
    return {m.group(1).lower(): int(m.group(2)) for m in re.finditer(rf"#define {prefix}MAP_(\w+) (\d+)", src)
            if m.group(1) != "BYTES"}
