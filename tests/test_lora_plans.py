"""CPU tests of the LoRA plan variant and the layer's LoRA options (no GPU needed).

A LoRA plan is the base plan with one launch more, `lora_router_delta`, right after the
router and before the routing stage reads the logits; everything else is the base plan's.
"""

from __future__ import annotations

import pytest

from cupymoe import jit, testing
from cupymoe.errors import OptionError
from cupymoe.forward_plan import LoraShape, build_forward_plan
from cupymoe.knobs import Knobs
from cupymoe.lora_slots import check_options
from cupymoe.plan import Buf, CallValue, DeviceFacts, LayerOptions, Path, Space, Stage, plan_layer

H200 = DeviceFacts.h200()
A100 = DeviceFacts("sm_80", 108, 166912)
SHAPE = LoraShape(max_loras=3, max_rank=16)


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_lora_plan_is_the_base_plan_plus_the_router_delta(family, dev):
    cfg = testing.tiny_config(family)
    lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, dev.arch,
                    options=LayerOptions(decode_max_tokens=64), knobs=Knobs())
    names = {n for m in jit.modules_for(dev.arch) for n in jit.MODULES[m].names}
    for path, n in ((Path.DECODE, 1), (Path.DECODE, 17), (Path.ATOMIC, 5), (Path.PREFILL, 300), (Path.PREFILL, 5000)):
        base = build_forward_plan(lp, dev, n, path).at(n)
        plan = build_forward_plan(lp, dev, n, path, lora=SHAPE).at(n)
        assert len(plan.steps) == len(base.steps) + 1
        at = [i for i, s in enumerate(plan.steps) if getattr(s, "kernel", "") == "lora_router_delta"]
        assert len(at) == 1 and plan.steps[at[0] - 1].stage == Stage.ROUTER
        assert plan.steps[at[0] + 1].stage != Stage.ROUTER  # the routing stage reads the logits after it
        assert plan.steps[:at[0]] + plan.steps[at[0] + 1:] == base.steps
        d = plan.steps[at[0]]
        assert d.kernel in names and not d.pdl and d.grid == (n,) and d.smem == SHAPE.max_rank * 4
        assert d.arg("lora_ids") == CallValue.LORA_IDS and d.arg("logits") == Buf(Space.SCRATCH, "logits")
        assert (d.arg("R"), d.arg("max_rank"), d.arg("max_loras"), d.arg("N")) == (cfg.router_width, 16, 3, n)


@pytest.mark.parametrize("k, r, match", [(-1, 0, "max_loras=-1"), (2, 0, "give both"), (0, 4, "give both"),
                                         (True, 4, "max_loras=True"), (2, 1.5, "max_lora_rank=1.5")])
def test_lora_options_refused(k, r, match):
    with pytest.raises(OptionError, match=match):
        check_options(k, r)
    assert check_options(0, 0) == (0, 0) and check_options(4, 16) == (4, 16)
