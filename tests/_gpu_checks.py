"""Checks several GPU test files run on their own layers: a skewed given routing judged against the
reference, and a captured graph's replay against the eager forward."""

import numpy as np

from cupymoe import reference, testing
from cupymoe.verify import bf16_bits, check, well_separated_input


def check_skewed_routing(layer, cfg, hw, rng, ns, path, name, assert_written=False):
    """Every row's first pick expert 0 (testing.skewed_routing), outputs poisoned first, judged."""
    for n in ns:
        ids, w = testing.skewed_routing(rng, n, cfg.num_experts_per_tok, cfg.router_width)
        x = testing.random_input(rng, n, cfg.hidden_size)
        out = testing.run_experts_poisoned(layer, x, ids, w, path)
        if assert_written:
            assert not np.isnan(out).any(), f"{name} N={n}: unwritten outputs"
        c = check(out, cfg, hw, x, path, layer=layer, routing=reference.given_routing(cfg, ids, w))
        assert c.ok, f"{name} N={n}: {c}"


def check_replay_matches_eager(layer, cfg, hw, rng, ns, path, name):
    """A graph captured on a non-blocking stream writes every output and replays the eager bits."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    for n in ns:
        x = cupy.asarray(bf16_bits(well_separated_input(cfg, hw, rng, n)))
        written, equal = testing.replay_matches_eager(layer, x, n, path, s)
        assert written, f"{name} N={n}: unwritten outputs"
        assert equal, f"{name} N={n}: the replay differs from the eager forward"
