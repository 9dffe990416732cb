"""CPU: LoRA on a transformers model's replaced blocks (cupymoe.integrations.transformers: load_lora,
clear_lora, set_lora_ids), with stand-in layers and a stand-in op: nothing reaches a GPU.

Evidence: every block takes its own layer's share of the adapter (load_peft at the block's layer
index), all blocks check it before any block takes it (a refusal names the block and leaves every
slot as it was), and each forward hands the op its rows' slots: [batch] ids spread over each
sequence's rows, one-a-row ids as they are, cut with the rows where a call exceeds max_tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from _lora import stacked_adapter, write_stacked_peft
from cupymoe import testing
from cupymoe.errors import LoraError, MoeCallError
from cupymoe.lora import load_peft

torch = pytest.importorskip("torch")

FAMILY = "qwen3_moe"


class StandInLayer:
    """What the replaced block and load_lora use of a MoeLayer, recording the LoRA calls."""

    def __init__(self, cfg, max_tokens=4, max_lora_rank=8, refuse=False):
        self.cfg, self.max_tokens, self.max_lora_rank, self.refuse = cfg, max_tokens, max_lora_rank, refuse
        self.calls = []

    def check_lora(self, slot, adapter):
        adapter.check(self.cfg, self.max_lora_rank)
        if self.refuse:
            raise LoraError("this stand-in refuses every adapter")

    def set_lora(self, slot, adapter, stream=None):
        self.calls.append(("set", slot, adapter))

    def clear_lora(self, slot, stream=None):
        self.calls.append(("clear", slot))


def _model(layers):
    """A module tree whose model.layers.<i>.mlp are replaced blocks over `layers`."""
    from cupymoe.integrations.transformers import _block_module

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for i, layer in enumerate(layers):
        decoder = torch.nn.Module()
        decoder.mlp = _block_module(layer, FAMILY, i)
        model.model.layers.append(decoder)
    return model


def _adapter(tmp_path, cfg, layers=2):
    tensors = {}
    for i in range(layers):
        tensors.update(stacked_adapter(cfg, np.random.default_rng(i), "0.20.0", layer_idx=i)[0])
    return write_stacked_peft(tmp_path / "adapter", tensors, "0.20.0")


def test_each_block_takes_its_layers_share(tmp_path):
    from cupymoe.integrations.transformers import clear_lora, load_lora, replaced_blocks

    cfg = testing.tiny_config(FAMILY)
    layers = [StandInLayer(cfg), StandInLayer(cfg)]
    model = _model(layers)
    assert [p for p, _ in replaced_blocks(model)] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    d = _adapter(tmp_path, cfg)
    assert load_lora(model, 2, d) == 2
    for i, layer in enumerate(layers):
        (kind, slot, got), = layer.calls
        want = load_peft(d, i, cfg)
        assert (kind, slot) == ("set", 2) and set(got.modules) == set(want.modules)
        for key, m in want.modules.items():
            np.testing.assert_array_equal(got.modules[key].a, m.a)
    assert clear_lora(model, 2) == 2 and all(layer.calls[-1] == ("clear", 2) for layer in layers)


def test_a_refusal_names_the_block_and_no_block_takes_the_adapter(tmp_path):
    from cupymoe.integrations.transformers import load_lora

    cfg = testing.tiny_config(FAMILY)
    layers = [StandInLayer(cfg), StandInLayer(cfg, refuse=True)]
    with pytest.raises(LoraError, match=r"model\.layers\.1\.mlp: this stand-in refuses"):
        load_lora(_model(layers), 0, _adapter(tmp_path, cfg))
    assert layers[0].calls == [] and layers[1].calls == []
    small = [StandInLayer(cfg, max_lora_rank=2)]
    with pytest.raises(LoraError, match=r"model\.layers\.0\.mlp: .*rank 3 exceeds the maximum rank 2"):
        load_lora(_model(small), 0, _adapter(tmp_path, cfg, layers=1))


def test_lora_tensors_outside_the_blocks_refused_unless_moe_only(tmp_path):
    """An adapter of attention modules too (or of a layer with no replaced block) would run without them:
    refused, naming one, unless moe_only=True."""
    from _lora import write_stacked_peft
    from cupymoe.integrations.transformers import load_lora

    cfg = testing.tiny_config(FAMILY)
    layers = [StandInLayer(cfg), StandInLayer(cfg)]
    tensors = {}
    for i in range(2):
        tensors.update(stacked_adapter(cfg, np.random.default_rng(i), "0.20.0", layer_idx=i)[0])
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = np.zeros((3, 8), np.float32)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = np.zeros((8, 3), np.float32)
    d = write_stacked_peft(tmp_path / "a", tensors, "0.20.0")
    with pytest.raises(LoraError, match=r"2 LoRA tensors lie outside the replaced MoE blocks \(e\.g\. "
                                        r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj"):
        load_lora(_model(layers), 0, d)
    assert layers[0].calls == []
    assert load_lora(_model(layers), 0, d, moe_only=True) == 2


def test_without_replaced_blocks_refused():
    from cupymoe.integrations.transformers import load_lora, set_lora_ids

    with pytest.raises(LoraError, match="no cupymoe block; call replace_moe_blocks"):
        load_lora(torch.nn.Linear(2, 2), 0, "unused")
    with pytest.raises(LoraError, match="no cupymoe block"):
        set_lora_ids(torch.nn.Linear(2, 2), None)


def test_forwards_carry_the_rows_slots(monkeypatch):
    from cupymoe.integrations.transformers import set_lora_ids

    cfg = testing.tiny_config(FAMILY)
    model = _model([StandInLayer(cfg, max_tokens=4)])
    block = model.model.layers[0].mlp
    seen = []

    def fake_op(rows, layer_id, token_ids, lora_ids):
        seen.append(None if lora_ids is None else lora_ids.tolist())
        return rows

    monkeypatch.setattr(torch.ops.cupymoe, "moe_forward", fake_op)
    h = torch.zeros(2, 3, cfg.hidden_size, dtype=torch.bfloat16)
    assert block(h).shape == h.shape and seen == [None, None]  # 6 rows in calls of 4 and 2
    seen.clear()
    assert set_lora_ids(model, torch.tensor([1, -1])) == 1  # a slot a sequence
    block(h)
    assert seen == [[1, 1, 1, -1], [-1, -1]]
    seen.clear()
    set_lora_ids(model, torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int64))  # one a row
    block(h)
    assert seen == [[0, 1, 2, 2], [1, 0]]
    set_lora_ids(model, torch.tensor([0, 1, 2]))
    with pytest.raises(MoeCallError, match=r"lora_ids of shape \(3,\) fit neither the 6 rows"):
        block(h)
    with pytest.raises(MoeCallError, match=r"a torch integer tensor of dtype int8, uint8, int16, int32, int64 or None is required, found list"):
        set_lora_ids(model, [0, 1])
    for bad, what in ((np.zeros(2, np.int32), "int32"), (torch.zeros(2), "torch.float32"),
                      (torch.zeros(2, dtype=torch.bool), "torch.bool"), (torch.zeros(2, dtype=torch.uint32), "torch.uint32")):
        with pytest.raises(MoeCallError, match=f"or None is required, found {what}"):
            set_lora_ids(model, bad)
    with pytest.raises(MoeCallError, match="a 0-d tensor"):
        set_lora_ids(model, torch.tensor(1))
    seen.clear()
    set_lora_ids(model, None)
    block(h)
    assert seen == [None, None]


def test_a_block_refuses_arguments_it_would_drop(monkeypatch):
    """The blocks it replaces take hidden_states alone; anything else (a mask, routing) would be ignored."""
    cfg = testing.tiny_config(FAMILY)
    block = _model([StandInLayer(cfg, max_tokens=4)]).model.layers[0].mlp
    monkeypatch.setattr(torch.ops.cupymoe, "moe_forward", lambda rows, layer_id, token_ids, lora_ids: rows)
    h = torch.zeros(1, 3, cfg.hidden_size, dtype=torch.bfloat16)
    assert block(h, None, padding_mask=None).shape == h.shape  # None is no argument
    with pytest.raises(MoeCallError, match=r"the replaced qwen3_moe MoE block takes hidden_states alone; it was "
                                           r"also given argument 2, padding_mask"):
        block(h, torch.ones(3), padding_mask=torch.ones(3))


def test_moe_only_must_be_a_bool(tmp_path):
    """moe_only="False" is truthy: it would skip the refusal of the adapter's tensors outside the blocks."""
    from cupymoe.errors import OptionError
    from cupymoe.integrations.transformers import load_lora

    model = _model([StandInLayer(testing.tiny_config(FAMILY))])
    for bad in ("False", "no", 0, 1.0, None):
        with pytest.raises(OptionError, match=rf"load_lora: moe_only={bad!r}: must be True or False"):
            load_lora(model, 0, tmp_path, moe_only=bad)


def test_a_model_whose_blocks_are_replaced_is_refused_a_second_replacement():
    """The replaced blocks are no transformers blocks: a second call names them, not their weights' device."""
    from cupymoe.errors import OptionError
    from cupymoe.integrations.transformers import replace_moe_blocks

    cfg = testing.tiny_config(FAMILY)
    model = _model([StandInLayer(cfg), StandInLayer(cfg)])
    with pytest.raises(OptionError, match=r"model\.layers\.0\.mlp \(and 1 more\) is already a cupymoe block"):
        replace_moe_blocks(model, max_tokens=8)
