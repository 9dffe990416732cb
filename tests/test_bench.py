"""The benchmark: its CLI without a GPU, its plots, and (GPU) the torch peers' agreement."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from cupymoe import bench, testing


def test_bench_help_runs_without_a_gpu_and_says_what_it_needs():
    r = subprocess.run([sys.executable, "-m", "cupymoe", "bench", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps the description
    assert "Needs an NVIDIA GPU" in text and "--preset" in text and "--plots" in text


def test_presets_are_the_performance_grid():
    assert set(bench.PRESETS) == {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b",
                                  "qwen3-next-80b", "gpt-oss-120b"}
    ds = bench.preset_config("deepseek-v3", routed_only=False)
    assert (ds.hidden_size, ds.moe_intermediate_size, ds.num_experts, ds.num_experts_per_tok) == (7168, 2048, 256, 8)
    assert ds.shared_expert_intermediate_size == 2048 and (ds.n_group, ds.topk_group) == (8, 4)
    assert not bench.preset_config("deepseek-v3").has_shared_expert  # the peers ran routed experts only


def test_plots_one_png_per_preset(tmp_path):
    rows = [dict(shape=s, N=n, us=10.0 * n ** 0.5, floor_us=5.0 * n ** 0.5, grouped_mm_us=30.0 * n ** 0.5,
                 vllm_compute_only=20.0 * n ** 0.5) for s in ("qwen3-30b-a3b", "mixtral-8x7b") for n in (1, 64, 4096)]
    written = bench.plot_results(rows, tmp_path, stem="t")
    assert sorted(p.name for p in written) == ["t-mixtral-8x7b.png", "t-qwen3-30b-a3b.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


@pytest.mark.gpu
def test_torch_peers_compute_cupymoes_function():
    torch = pytest.importorskip("torch")
    from cupymoe import MoeLayer
    from cupymoe.peers import TorchPeers, same_function
    from cupymoe.verify import bf16_bits, run_layer

    rng = np.random.default_rng(1)
    cfg = testing.tiny_config("qwen3_moe")
    assert same_function(cfg)
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=256)
    peers = TorchPeers(layer)
    for n in (3, 256):
        x = testing.random_input(rng, n, cfg.hidden_size)
        ours = torch.from_numpy(run_layer(layer, x)).cuda()
        xt = torch.from_numpy(bf16_bits(x).view(np.int16)).cuda().view(torch.bfloat16)
        for name, fn in peers.impls().items():
            o = torch.empty_like(xt)
            fn(xt, o)
            err = float((o.float() - ours).norm() / ours.norm())
            assert err < 2.0 ** -6, f"{name} N={n}: normwise {err:.2e} from cupymoe"
