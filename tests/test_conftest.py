"""The test suite's own machinery (tests/conftest.py): a failure drawn from the rng fixture
names its seed, and CUPYMOE_TEST_SEED replays it."""

from __future__ import annotations

from pathlib import Path


def test_a_failing_draw_names_its_seed_and_the_seed_replays_it(pytester, monkeypatch):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_draw="""
        def test_draw(rng):
            print("drew", rng.integers(1 << 30))
            assert False
        def test_plain():
            assert False
    """)
    monkeypatch.setenv("CUPYMOE_TEST_SEED", "12345")
    first = pytester.runpytest("-q", "-s")
    first.assert_outcomes(failed=2)
    out = first.stdout.str()
    assert out.count("CUPYMOE_TEST_SEED=12345") == 1, out  # named once: test_plain draws nothing
    drew = [line for line in out.splitlines() if line.startswith("drew")]
    assert len(drew) == 1, out
    again = pytester.runpytest("-q", "-s")
    assert [line for line in again.stdout.str().splitlines() if line.startswith("drew")] == drew
