"""PTX equality of a module's kernels between two source trees (a kernel change that must leave
the base instantiations' code as it was): each .entry of OLD's PTX against the same entry of
NEW's, ignoring .loc / .file lines, comments, the debug sections and label numbers (labels are
numbered by function order, so a kernel added before another renumbers its labels); entries that
differ only in virtual register names are counted apart, as equal. Entries are matched by name
expression (NVRTC's lowered names), so `--as 'OLD_EXPR=NEW_EXPR'` compares a kernel with its
instance under another name (an added template parameter changes the mangled name everywhere).

    python scripts/ptx_equal.py OLD_TREE NEW_TREE MODULE [MODULE ...] [--as OLD_EXPR=NEW_EXPR ...]
    (no GPU: NVRTC on the CPU)
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COMPILE = ("import json, sys; from cupymoe import jit; "
           "cm = jit.compile_module(sys.argv[1], 'sm_90a', use_cache=False); "
           "open(sys.argv[2], 'w').write(json.dumps({'ptx': cm.ptx, 'lowered': cm.lowered}))")


def entries(ptx: str, lowered: dict = None) -> dict:
    """Each .entry's lines, keyed by its name expression where `lowered` (expression -> mangled
    name) knows it, its mangled name (less `_Z`) written as <entry> inside: parameter names and
    its function-local shared variables' names (_ZZ<name>E...) hold it."""
    names = {v: k for k, v in (lowered or {}).items()}
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    out, cur, mangled = {}, None, None
    for line in ptx.splitlines():
        m = re.match(r"\s*\.(?:visible|weak)?\s*\.entry\s+(\S+)\(", line)
        if m:
            mangled = m.group(1)
            cur = out[names.get(mangled, mangled)] = []
        st = line.strip()
        if cur is None or not st or st.startswith((".loc", ".file", "//")):
            continue
        cur.append(re.sub(r"\$L__BB\d+_", "$L__BB_", st).replace(mangled[2:], "<entry>"))
    return out


def canonical(lines: list) -> list:
    """`lines` with each virtual register renamed by its first appearance (ptxas allocates physical
    registers itself, so two entries equal up to these names compile alike)."""
    names: dict = {}
    return [re.sub(r"%(rd|rs|r|fd|f|p|h)(\d+)\b", lambda m: names.setdefault(m.group(0), f"%{m.group(1)}_{len(names)}"), ln)
            for ln in lines]


def ptx_of(tree: str, module: str, tmp: Path) -> dict:
    """The module's entries compiled in `tree` (entries)."""
    dst = tmp / f"{Path(tree).name}-{module}.json"
    subprocess.run([sys.executable, "-c", COMPILE, module, str(dst)], check=True, cwd=tree,
                   env=dict(os.environ, PYTHONPATH=tree))
    out = json.loads(dst.read_text())
    return entries(out["ptx"], out["lowered"])


def main(old: str, new: str, modules: list, renames: dict = None) -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for m in modules:
            (Path(d) / "old").mkdir(exist_ok=True), (Path(d) / "new").mkdir(exist_ok=True)
            a, b = ptx_of(old, m, Path(d) / "old"), ptx_of(new, m, Path(d) / "new")
            to = {k: (renames or {}).get(k, k) for k in a}  # each old entry's name in NEW
            diff = [k for k in a if a[k] != b.get(to[k])]
            renamed = [k for k in diff if to[k] in b and canonical(a[k]) == canonical(b[to[k]])]
            diff = [k for k in diff if k not in renamed]
            # the same instructions, reordered
            moved = [k for k in diff if to[k] in b and sorted(a[k]) == sorted(b[to[k]])]
            bad += len(diff)
            pairs = [f"{k} as {to[k]}" for k in a if to[k] != k]
            print(f"{m}: {len(a)} entries of {old} in {new}{' (' + ', '.join(pairs) + ')' if pairs else ''}: "
                  f"{len(diff)} differ {diff} (of which the same instructions in another order: {moved}); "
                  f"equal but for register names: {len(renamed)}; new only: {sorted(set(b) - set(to.values()))}")
    return 1 if bad else 0


if __name__ == "__main__":
    args, renames = [], {}
    it = iter(sys.argv[1:])
    for arg in it:
        if arg == "--as":
            old_name, _, new_name = next(it).partition("=")
            renames[old_name.strip()] = new_name.strip()
        else:
            args.append(arg)
    if len(args) < 3:
        sys.exit(__doc__)
    sys.exit(main(args[0], args[1], args[2:], renames))
