"""PTX equality of a module's kernels between two source trees (a kernel change that must leave
the base instantiations' code as it was): each .entry of OLD's PTX against the same entry of
NEW's, ignoring .loc / .file lines, comments, the debug sections and label numbers (labels are
numbered by function order, so a kernel added before another renumbers its labels); entries that
differ only in virtual register names are counted apart, as equal.

    python scripts/ptx_equal.py OLD_TREE NEW_TREE MODULE [MODULE ...]   (no GPU: NVRTC on the CPU)
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COMPILE = ("import sys; from cupymoe import jit; "
           "open(sys.argv[2], 'w').write(jit.compile_module(sys.argv[1], 'sm_90a', use_cache=False).ptx)")


def entries(ptx: str) -> dict:
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    out, cur = {}, None
    for line in ptx.splitlines():
        m = re.match(r"\s*\.(?:visible|weak)?\s*\.entry\s+(\S+)\(", line)
        if m:
            cur = out[m.group(1)] = []
        st = line.strip()
        if cur is None or not st or st.startswith((".loc", ".file", "//")):
            continue
        cur.append(re.sub(r"\$L__BB\d+_", "$L__BB_", st))
    return out


def canonical(lines: list) -> list:
    """`lines` with each virtual register renamed by its first appearance (ptxas allocates physical
    registers itself, so two entries equal up to these names compile alike)."""
    names: dict = {}
    return [re.sub(r"%(rd|rs|r|fd|f|p|h)(\d+)\b", lambda m: names.setdefault(m.group(0), f"%{m.group(1)}_{len(names)}"), ln)
            for ln in lines]


def ptx_of(tree: str, module: str, tmp: Path) -> str:
    dst = tmp / f"{Path(tree).name}-{module}.ptx"
    subprocess.run([sys.executable, "-c", COMPILE, module, str(dst)], check=True, cwd=tree,
                   env=dict(os.environ, PYTHONPATH=tree))
    return dst.read_text()


def main(old: str, new: str, modules: list) -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for m in modules:
            (Path(d) / "old").mkdir(exist_ok=True), (Path(d) / "new").mkdir(exist_ok=True)
            a, b = entries(ptx_of(old, m, Path(d) / "old")), entries(ptx_of(new, m, Path(d) / "new"))
            diff = [k for k in a if a[k] != b.get(k)]
            renamed = [k for k in diff if k in b and canonical(a[k]) == canonical(b[k])]
            diff = [k for k in diff if k not in renamed]
            moved = [k for k in diff if k in b and sorted(a[k]) == sorted(b[k])]  # the same instructions, reordered
            bad += len(diff)
            print(f"{m}: {len(a)} entries of {old} in {new}: {len(diff)} differ {diff} (of which the same "
                  f"instructions in another order: {moved}); equal but for register names: {len(renamed)}; "
                  f"new only: {len(set(b) - set(a))}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
