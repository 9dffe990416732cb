"""Random-case builders shared by the CPU tests and the GPU tests.

`tiny_config(family)` is a small MoeConfig that keeps each family's routing and expert
features (scoring, correction bias, groups, zero experts, biases, shared expert and its
gate) at sizes that run in milliseconds on the CPU yet stay awkward for kernels: expert
counts that are not powers of two where the family allows it, H = 96 or 160 (multiples of
32, as mxfp4/nvfp4 need, but not of 128, so fp8 blocks are partial), I = 64.
`hf_config_dict(family)` is the same layer spelled as that family's Hugging Face
config.json, so `MoeConfig.from_hf(hf_config_dict(f)) == tiny_config(f)`.

Numpy + ml_dtypes only: no GPU needed to build a case.
"""

from __future__ import annotations

from typing import Any, Optional

import ml_dtypes
import numpy as np

from . import formats
from .config import MoeConfig
from .errors import OptionError
from .host_weights import HostWeights

FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "deepseek_v3", "mixtral", "gpt_oss", "longcat_flash")

BF16 = np.dtype(ml_dtypes.bfloat16)

# MoeConfig fields per family. Comments say which feature each family brings.
_TINY: dict[str, dict[str, Any]] = {
    # softmax over 15 experts, top-4, renormalised; no shared expert.
    "qwen3_moe": dict(hidden_size=96, moe_intermediate_size=64, num_experts=15, num_experts_per_tok=4,
                      scoring_func="softmax", norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6),
    # softmax, top-k NOT renormalised; sigmoid-gated shared expert of another width.
    "qwen2_moe": dict(hidden_size=160, moe_intermediate_size=64, num_experts=10, num_experts_per_tok=4,
                      scoring_func="softmax", norm_topk_prob=False, hidden_act="silu", rms_norm_eps=1e-6,
                      shared_expert_intermediate_size=96, has_shared_expert_gate=True),
    # like qwen2_moe but renormalised (Qwen3-Next's default) and a larger k.
    "qwen3_next": dict(hidden_size=96, moe_intermediate_size=64, num_experts=20, num_experts_per_tok=5,
                       scoring_func="softmax", norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6,
                       shared_expert_intermediate_size=64, has_shared_expert_gate=True),
    # sigmoid + correction bias, 4 groups keep 2, renormalised then scaled; ungated shared
    # expert of width I * n_shared_experts = 64 * 2.
    "deepseek_v3": dict(hidden_size=160, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                        scoring_func="sigmoid", has_correction_bias=True, n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5, hidden_act="silu", rms_norm_eps=1e-6,
                        shared_expert_intermediate_size=128),
    # softmax over 8, top-2, renormalised.
    "mixtral": dict(hidden_size=96, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                    scoring_func="softmax", norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-5),
    # top-k of the logits (with router bias), softmax over the k; expert biases; swiglu_oai.
    # swiglu_limit is 1.25 instead of gpt-oss's 7.0 so that the clamps fire on O(1)
    # activations (with 7.0 random tests would never exercise them).
    "gpt_oss": dict(hidden_size=96, moe_intermediate_size=64, num_experts=9, num_experts_per_tok=4,
                    topk_then_softmax=True, has_router_bias=True, has_expert_bias=True,
                    hidden_act="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=1.25, rms_norm_eps=1e-5),
    # softmax over E + Z = 15 incl. 3 identity experts, correction bias, no renorm, scaled.
    "longcat_flash": dict(hidden_size=96, moe_intermediate_size=64, num_experts=12, num_experts_per_tok=4,
                          zero_expert_num=3, scoring_func="softmax", has_correction_bias=True,
                          norm_topk_prob=False, routed_scaling_factor=6.0, hidden_act="silu", rms_norm_eps=1e-5),
}

# The same layers in each family's config.json spelling (keys as transformers writes them).
_HF: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 96, "intermediate_size": 192, "moe_intermediate_size": 64,
        "num_experts": 15, "num_experts_per_tok": 4, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "vocab_size": 1000,
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_size": 160, "intermediate_size": 320, "moe_intermediate_size": 64,
        "num_experts": 10, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "shared_expert_intermediate_size": 96, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "vocab_size": 1000,
    },
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 96, "intermediate_size": 192, "moe_intermediate_size": 64,
        "num_experts": 20, "num_experts_per_tok": 5, "norm_topk_prob": True,
        "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "vocab_size": 1000,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 160, "intermediate_size": 320, "moe_intermediate_size": 64,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 2,
        "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "hidden_act": "silu", "num_hidden_layers": 3, "rms_norm_eps": 1e-6,
        "vocab_size": 1000,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 96, "intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
        "hidden_act": "silu", "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "vocab_size": 1000,
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 96, "intermediate_size": 64, "num_local_experts": 9, "num_experts_per_tok": 4,
        "experts_per_token": 4, "swiglu_limit": 1.25, "hidden_act": "silu",
        "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "vocab_size": 1000,
    },
    "longcat_flash": {
        "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash",
        "hidden_size": 96, "ffn_hidden_size": 192, "expert_ffn_hidden_size": 64,
        "n_routed_experts": 12, "zero_expert_num": 3, "zero_expert_type": "identity", "moe_topk": 4,
        "routed_scaling_factor": 6.0, "norm_topk_prob": False, "hidden_act": "silu",
        "num_layers": 2, "rms_norm_eps": 1e-5, "vocab_size": 1000,
    },
}


def _check_family(family: str) -> None:
    if family not in _TINY:
        raise OptionError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def tiny_config(family: str, **overrides: Any) -> MoeConfig:
    """A small MoeConfig with `family`'s routing and expert features; `overrides` set fields."""
    _check_family(family)
    return MoeConfig(**{**_TINY[family], "model_type": family, **overrides})


def hf_config_dict(family: str, **overrides: Any) -> dict[str, Any]:
    """`tiny_config(family)` spelled as that family's config.json; `overrides` set raw keys."""
    _check_family(family)
    d = {k: (list(v) if isinstance(v, list) else v) for k, v in _HF[family].items()}
    d.update(overrides)
    return d


# ----------------------------------------------------------------------------------
# weights and inputs
# ----------------------------------------------------------------------------------

def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def random_host_weights(cfg: MoeConfig, rng: np.random.Generator, fmt: str = "bf16", *,
                        router_fmt: str = "bf16", shared_fmt: str | None = None) -> HostWeights:
    """Random weights for `cfg`, scaled so every activation stays O(1).

    Projections have std 1/sqrt(fan_in), so with O(1) inputs the router logits, the
    gate/up outputs and the expert outputs are all ~N(0, 1): no score saturates, no
    activation sits in a flat tail, and float64 comparisons keep relative meaning.
    `fmt` is the routed experts' format, `router_fmt` the router's, `shared_fmt` the
    shared expert's (default: `fmt`). Biases are small fp32; the correction bias is
    comparable to the score spread so it changes some selections; tid2eid rows hold
    k distinct ids in [0, R).
    """
    E, H, I, R, k = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.router_width,
                     cfg.num_experts_per_tok)
    shared_fmt = fmt if shared_fmt is None else shared_fmt
    hw = HostWeights(
        router=formats.quantize(_normal(rng, (R, H), H ** -0.5), router_fmt),
        gate=formats.quantize(_normal(rng, (E, I, H), H ** -0.5), fmt),
        up=formats.quantize(_normal(rng, (E, I, H), H ** -0.5), fmt),
        down=formats.quantize(_normal(rng, (E, H, I), I ** -0.5), fmt),
    )
    if cfg.has_router_bias:
        hw.router_bias = _normal(rng, (R,), 0.1)
    if cfg.has_correction_bias:
        # Scores are ~1/R (softmax), ~0.5 +- 0.2 (sigmoid) or ~0.8 +- 0.3 (sqrtsoftplus): a bias of the
        # order of their spread reorders some candidates, as trained biases do.
        spread = 1.0 / R if cfg.scoring_func == "softmax" else 0.1
        hw.correction_bias = _normal(rng, (R,), spread)
    if cfg.has_expert_bias:
        hw.gate_bias = _normal(rng, (E, I), 0.1)
        hw.up_bias = _normal(rng, (E, I), 0.1)
        hw.down_bias = _normal(rng, (E, H), 0.1)
    if cfg.has_shared_expert:
        Is = cfg.shared_expert_intermediate_size
        hw.shared_gate = formats.quantize(_normal(rng, (Is, H), H ** -0.5), shared_fmt)
        hw.shared_up = formats.quantize(_normal(rng, (Is, H), H ** -0.5), shared_fmt)
        hw.shared_down = formats.quantize(_normal(rng, (H, Is), Is ** -0.5), shared_fmt)
    if cfg.has_shared_expert_gate:
        hw.shared_expert_gate = _normal(rng, (H,), H ** -0.5)
    if cfg.pre_expert_norm:
        hw.norm_weight = (1.0 + _normal(rng, (H,), 0.1)).astype(np.float32)
    if cfg.hash_routing:
        table = np.stack([rng.permutation(R)[:k] for _ in range(cfg.hash_vocab_size)])
        hw.tid2eid = table.astype(np.int32)
    return hw.validate(cfg)


def random_input(rng: np.random.Generator, n: int, h: int) -> np.ndarray:
    """[n, h] bf16, std ~1, never zero (|x| >= 1/64): a zero row would make the
    pre-expert norm's eps dominate and an all-zero input hides missing terms."""
    v = rng.standard_normal((n, h))
    v = np.where(np.abs(v) < 1 / 64, np.copysign(1 / 64, v), v)
    return v.astype(np.float32).astype(BF16)


def random_token_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """[n] int32 token ids in [0, vocab)."""
    return rng.integers(0, vocab, size=n).astype(np.int32)


# ----------------------------------------------------------------------------------
# GPU runs: the arch, a plan's expert kernels, given routings, CUDA graphs
# ----------------------------------------------------------------------------------

def on_sm90a() -> bool:
    """Whether the current GPU runs the sm_90a kernels (wgmma, TMA, e4m3 tensor cores)."""
    import cupy

    from . import jit

    cc = cupy.cuda.Device().compute_capability
    return jit.arch_for_capability(int(cc[:-1]), int(cc[-1])) == "sm_90a"


def expert_kernels(layer, n: int, path: str = "decode") -> list[str]:
    """The kernels of the gate/up and down stages of `layer`'s plan for `n` rows on `path`."""
    from .forward_plan import build_forward_plan
    from .plan import Path

    plan = build_forward_plan(layer.plan, layer.device, n, Path(path)).at(n)
    return [s.kernel for s in plan.launches if s.stage.value in ("gate_up", "down")]


def skewed_routing(rng: np.random.Generator, n: int, k: int, router_width: int) -> tuple[np.ndarray, np.ndarray]:
    """A given routing of `n` rows: every row's first pick expert 0 (one run of n rows), the
    other k - 1 over experts 2 .. R - 1 (expert 1 chosen by nobody); weights in 0.05 .. 1."""
    ids = np.empty((n, k), np.int32)
    ids[:, 0] = 0
    if k > 1:
        ids[:, 1:] = rng.choice(np.arange(2, router_width), size=(n, k - 1), replace=True)
    return ids, rng.uniform(0.05, 1.0, size=(n, k)).astype(np.float32)


def run_experts_poisoned(layer, x: np.ndarray, ids: np.ndarray, w: np.ndarray, path: str,
                         shared_expert: Optional[bool] = None) -> np.ndarray:
    """x uploaded, the output poisoned with NaN, one experts-only forward on a stream of its
    own; the output as float32."""
    import cupy

    from .verify import bf16_bits, bits_to_f32

    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xd, idd, wd = cupy.asarray(bf16_bits(x)), cupy.asarray(ids), cupy.asarray(w)
        out = cupy.full(xd.shape, 0x7FC0, dtype=cupy.uint16)
        layer.run_experts(xd, idd, wd, out=out, stream=s.ptr, shared_expert=shared_expert, path=path)
    s.synchronize()
    return bits_to_f32(out.get())


def eager_and_graph(layer, x, n: int, path, stream):
    """`layer` run on the device input `x` (bf16 bits) once eagerly and once captured into a
    CUDA graph and replayed, each into an output poisoned with NaN first. Returns (eager,
    replayed, graph): the outputs as uint16 device arrays, and the graph, which a caller may
    replay after writing new contents into `x` (and must drop before a communicator it
    captured closes)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()  # x may come from another stream (the legacy one)
    with stream:
        eager = cupy.full(x.shape, 0x7FC0, cupy.uint16)
        replayed = cupy.full(x.shape, 0x7FC0, cupy.uint16)
    layer.forward(int(x.data.ptr), n, int(eager.data.ptr), stream.ptr, path=path)
    stream.begin_capture()
    layer.forward(int(x.data.ptr), n, int(replayed.data.ptr), stream.ptr, path=path)
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    return eager, replayed, graph


def replay_matches_eager(layer, x, n: int, path, stream) -> tuple[bool, bool]:
    """eager_and_graph's two outputs: (every output of the eager forward written, i.e. no NaN
    left of the poison; the replay equal to it bit for bit)."""
    import cupy

    from .verify import bits_to_f32

    eager, replayed, graph = eager_and_graph(layer, x, n, path, stream)
    written = not np.isnan(bits_to_f32(eager.get())).any()
    equal = bool(cupy.array_equal(eager, replayed))
    del graph
    return written, equal


# ----------------------------------------------------------------------------------
# expert parallelism: one rank's part of the multi-GPU test (cupymoe.parallel.spawn_ranks)
# ----------------------------------------------------------------------------------

def ep_rank_check(rank: int, world_size: int, unique_id, family: str, seed: int, tokens, paths, fmt: str = "bf16",
                  interleaved: bool = False, fp8_compute: str = "auto") -> dict:
    """Build `family`'s tiny layer in `fmt` (a bf16 shared expert) as EP rank `rank` with an NCCL
    communicator, its experts the contiguous block or (`interleaved`) every world_size-th, run every
    (N, path) eagerly and as a replayed CUDA graph, and return the inputs and outputs, plus
    "fp8_compute": what the layer runs. Every rank draws the same weights and inputs from `seed`,
    in the same order."""
    import cupy

    from .layer import MoeLayer
    from .parallel import NcclCommunicator
    from .verify import bf16_bits, bits_to_f32, well_separated_input

    rng = np.random.default_rng(seed)
    cfg = tiny_config(family)
    hw = random_host_weights(cfg, rng, fmt, shared_fmt="bf16" if fmt != "bf16" else None)
    owner = [e % world_size for e in range(cfg.num_experts)] if interleaved else None
    comm = NcclCommunicator(world_size, rank, unique_id)
    layer = MoeLayer(cfg.replace(ep_world_size=world_size, ep_rank=rank), hw, max_tokens=max(tokens),
                     decode_max_tokens=64, comm=comm, expert_owner=owner, fp8_compute=fp8_compute)
    out: dict = {"fp8_compute": layer.fp8_compute}
    s = cupy.cuda.Stream(non_blocking=True)
    for n in tokens:
        x = well_separated_input(cfg, hw, rng, n)
        xd = cupy.asarray(bf16_bits(x))
        for path in paths:
            if path != "prefill" and n > 64:
                continue
            eager, graph_out, g = eager_and_graph(layer, xd, n, path, s)
            del g  # graphs that captured NCCL calls go before the communicator (cupymoe.parallel)
            out[(n, path)] = (x, bits_to_f32(eager.get()), bits_to_f32(graph_out.get()))
    comm.close()
    return out
