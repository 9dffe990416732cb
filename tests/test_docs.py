"""The documents' cheap invariants: links resolve, knobs exist, cited result files and tests exist."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from cupymoe import knobs

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KNOB_DOCS = DOCS + sorted((ROOT / "benchmarks").glob("*.md"))


def _expand(path: str) -> list[str]:
    """`a-{x,y}.json` -> both names (the documents abbreviate alternatives with braces)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    options = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*options)]


def _exists(rel: str, base: Path) -> bool:
    return all(any(base.glob(p)) if "*" in p else (base / p).exists() for p in _expand(rel))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repository(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name}: link {target} leaves the repository"
        assert path.exists(), f"{doc.name}: link {target} names no file"


def test_every_cupymoe_variable_the_documents_name_is_a_knob():
    known = {t[0] for t in knobs.TABLE.values()} | set(knobs.TOOL_KNOBS)
    for doc in KNOB_DOCS:
        named = set(re.findall(r"CUPYMOE_[A-Z0-9_]*[A-Z0-9]", doc.read_text()))
        assert named <= known, f"{doc.relative_to(ROOT)}: unknown {sorted(named - known)}"


def _cited_results(text: str) -> set[str]:
    """results/... paths as cited (under benchmarks/ or relative to it), trailing punctuation off, and
    DECISIONS.md's short form: `-x.json` alone is the one file `results/*-h200-x.json`."""
    cited = {c.rstrip(".,") for c in re.findall(r"(?:benchmarks/)?results/([A-Za-z0-9_.+*{},-]+)", text)}
    cited.discard("*-h200-x")  # the convention's own example
    short = re.findall(r"`(-[A-Za-z0-9_.+{},-]+\.(?:json|txt|log))`", text)
    return {c for c in cited if c} | {f"*-h200{s}" for s in short}


def test_result_files_cited_by_the_decisions_and_the_tuning_table_exist():
    results = ROOT / "benchmarks" / "results"
    table = json.loads((ROOT / "cupymoe" / "data" / "tuning.json").read_text())
    sources = {"benchmarks/DECISIONS.md": (ROOT / "benchmarks" / "DECISIONS.md").read_text(),
               "cupymoe/data/tuning.json": json.dumps(table)}
    for name, text in sources.items():
        cited = _cited_results(text)
        assert cited, name
        missing = sorted(c for c in cited if not _exists(c, results))
        assert not missing, f"{name} cites missing result files: {missing}"


def test_tests_cited_by_refusals_exist():
    text = (ROOT / "docs" / "REFUSALS.md").read_text()
    missing, count = [], 0
    for line in text.splitlines():
        # "tests/a.py::test_x, ::test_y" cites test_y in tests/a.py too
        for file, rest in re.findall(r"(tests/[\w/]+\.py)((?:::\w+(?:, )?)+)", line):
            source = (ROOT / file).read_text() if (ROOT / file).exists() else ""
            for name in re.findall(r"::(\w+)", rest):
                count += 1
                if not re.search(rf"^def {name}\(", source, re.M):
                    missing.append(f"{file}::{name}")
    assert count > 40 and not missing, missing
