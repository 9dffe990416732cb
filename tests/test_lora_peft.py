"""cupymoe.lora.load_peft against adapters PEFT itself makes and runs (CPU, float64).

tests/_lora.py writes adapters the way PEFT's code reads; here PEFT writes them. For each family a
tiny transformers model (tests/_hf.py) gets a PEFT LoRA on its router, its shared expert and its
stacked experts (`target_parameters`; modules where a case asks), random factors, rank_pattern /
alpha_pattern / rsLoRA where a case asks; `save_pretrained` writes the directory (factors cast to
float32, as a float32 or bf16 run saves them: load_peft refuses float64, which float32 cannot hold
exactly). Then

* the reference with the loaded adapter equals PEFT's own forward of the block and the block after
  PEFT's `merge_and_unload` (FLOAT32_ROUTING_BOUND: transformers' float32 routing weights);
* the input's rows route with a clear margin under the adapted router (the adapter may change routing).

Needs torch, transformers and peft (none among the test dependencies: skipped without them; the lent
GPU's image has all three).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from cupymoe import checkpoint, reference
from cupymoe.integrations import transformers as hf
from cupymoe.lora import LoraKey, LoraTarget, load_peft
from cupymoe.verify import well_separated_input

from _hf import (PEFT_ROUTER_AND_SHARED, PEFT_STACKED, block_rows, normwise, peft_or_skip, random_peft_adapter,
                 run_block, tiny_model)
from _hf import one_torch_thread  # noqa: F401 (autouse: one intra-op thread)
from _lora import merged

torch = pytest.importorskip("torch", reason="needs torch")
transformers = pytest.importorskip("transformers", reason="needs transformers")
peft = peft_or_skip()

FLOAT32_ROUTING_BOUND = 1e-6  # normwise: float32 routing weights (~6e-8 each) and nothing else


def _adapted(family, tmp_path, modules=(), params=None, seed=1, **lora_options):
    """(cfg, hw, block ref, PEFT model): the family's tiny model with a random PEFT adapter on target
    `modules` and target `params` (default: the router's and shared expert's weights and the stacked
    experts, tests/_hf.py), saved in `tmp_path`."""
    model = tiny_model(family)
    ref = hf.moe_blocks(model)[0]
    cfg, hw = checkpoint.load_layer_from_tensors(*hf.block_tensors(model, ref))
    params = PEFT_ROUTER_AND_SHARED[family] + PEFT_STACKED if params is None else params
    wrapped = random_peft_adapter(model, tmp_path, params, modules, seed, **lora_options)
    return cfg, hw, ref, wrapped


def _ours(cfg, hw, lw, n=37):
    """(x, the reference's output with the adapter): rows that route with a clear margin under it."""
    x = well_separated_input(cfg, merged(cfg, hw, lw), np.random.default_rng(4), n)
    return x, reference.moe_forward(cfg, hw, x, lora={0: lw}, lora_ids=np.zeros(n, np.int32))


def _check(family, tmp_path, **options):
    """load_peft's adapter in the reference against PEFT's forward and merge; the loaded LoraWeights."""
    cfg, hw, ref, wrapped = _adapted(family, tmp_path, **options)
    lw = load_peft(tmp_path, ref.layer_idx, cfg)
    x, ours = _ours(cfg, hw, lw)
    base = reference.moe_forward(cfg, hw, x)
    returns_tuple = hf.BLOCK_OUTPUT[family].returns_tuple
    assert normwise(base, ours) > 1e-2, "the adapter must move the output for the comparison to mean anything"

    try:
        unmerged = block_rows(run_block(wrapped.base_model.model.get_submodule(ref.path), x), returns_tuple)
    except AttributeError as e:  # transformers 5.0 / 5.10 read router attributes past a ParamWrapper
        pytest.skip(f"PEFT {peft.__version__}'s wrapped block does not run on transformers "
                    f"{transformers.__version__}: {e}")
    err = normwise(unmerged, ours)
    assert err < FLOAT32_ROUTING_BOUND, f"{family}: normwise {err:.3e} against PEFT's forward"

    merged_model = copy.deepcopy(wrapped).merge_and_unload()
    theirs = block_rows(run_block(merged_model.get_submodule(ref.path), x), returns_tuple)
    err = normwise(theirs, ours)
    assert err < FLOAT32_ROUTING_BOUND, f"{family}: normwise {err:.3e} against PEFT's merged block"
    return lw


@pytest.mark.parametrize("family", sorted(PEFT_ROUTER_AND_SHARED))
def test_peft_adapter_matches_peft(family, tmp_path):
    lw = _check(family, tmp_path)
    targets = {k.target.value for k in lw.modules}
    router = {"router"} if PEFT_ROUTER_AND_SHARED[family] else set()
    shared = {"shared_gate", "shared_up", "shared_down"} if len(PEFT_ROUTER_AND_SHARED[family]) > 1 else set()
    assert targets == {"gate", "up", "down"} | router | shared


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_peft_patterns_and_rslora(family, tmp_path):
    """rank_pattern / alpha_pattern as PEFT matches them: a parameter (router, shared expert) on
    `<module>.weight`, the stacked experts on `experts.<parameter>`; the first matching key wins."""
    router = "gate" if family == "qwen2_moe" else "router"
    lw = _check(family, tmp_path, use_rslora=True,
                rank_pattern={router: 3, f"{router}.weight": 5, "down_proj": 7, "down_proj.weight": 2},
                alpha_pattern={"gate_up_proj": 5, "up_proj.weight": 12})
    ranks = {(k.target.value, k.expert): m.rank for k, m in lw.modules.items()}
    assert ranks[("router", None)] == 5 and ranks[("down", 0)] == 7 and ranks[("gate", 0)] == 4
    if family == "qwen2_moe":
        assert ranks[("shared_down", None)] == 2 and ranks[("shared_up", None)] == 4


@pytest.mark.parametrize("how", ["module", "parameter"])
def test_linear_router_adapter_follows_the_merge(how, tmp_path):
    """LongCat's router reads its classifier's weight directly (F.linear on classifier.weight), so PEFT's
    unmerged forward skips a LoRA on the classifier, as a module or as a parameter, while its merge
    applies it: load_peft serves the merge's math (the adapter as PEFT defines it)."""
    target = dict(modules=["router.classifier"], params=[]) if how == "module" else \
        dict(params=["router.classifier.weight"])
    cfg, hw, ref, wrapped = _adapted("longcat_flash", tmp_path, seed=2, **target)
    lw = load_peft(tmp_path, ref.layer_idx, cfg)
    assert set(lw.modules) == {LoraKey(LoraTarget.ROUTER)}
    x, ours = _ours(cfg, hw, lw)
    theirs = block_rows(run_block(wrapped.merge_and_unload().get_submodule(ref.path), x), False)
    assert normwise(theirs, ours) < FLOAT32_ROUTING_BOUND


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_v4_style_shared_expert_targets(family, tmp_path):
    """The shared expert named as modules (nn.Linear wrappers). For a family transformers 5 converts
    from v4 naming (deepseek_v3; qwen2_moe in early 5.x), PEFT from 0.19 rewrites those targets into the
    routed experts' stacked parameters (gate_up at rank 2r and alpha 2 alpha, by rank_pattern /
    alpha_pattern) and adapts no shared expert; otherwise the shared expert's modules are adapted.
    Either way load_peft reads the saved config and follows PEFT's forward."""
    shared = [f"{'shared_experts' if family == 'deepseek_v3' else 'shared_expert'}.{p}_proj"
              for p in ("gate", "up", "down")]
    lw = _check(family, tmp_path, modules=shared, params=[])
    targets = {k.target.value for k in lw.modules}
    if "shared_gate" not in targets:  # rewritten
        assert targets == {"gate", "up", "down"} and lw.get(LoraTarget.GATE, 0).rank == 8


@pytest.mark.parametrize("params", [PEFT_STACKED, ["gate.weight"]], ids=["experts", "router"])
def test_a_peft_model_s_blocks_refused_by_name(params, tmp_path):
    """replace_moe_blocks / block_tensors on PEFT's own model (its blocks found under base_model.model.)
    refuse a block its adapter wraps, naming the wrapped tensor, rather than load it without the adapter."""
    from cupymoe.errors import CheckpointError

    wrapped = random_peft_adapter(tiny_model("qwen3_moe"), tmp_path, params)
    refs = hf.moe_blocks(wrapped)
    assert [r.path for r in refs] == ["base_model.model.model.layers.0.mlp", "base_model.model.model.layers.1.mlp"]
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.\S*base_layer\S*: the block carries PEFT LoRA"):
        hf.block_tensors(wrapped, refs[0])
