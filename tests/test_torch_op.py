"""CPU: the torch ops' schemas and fake implementations (what torch.compile traces), no GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_the_ops_take_token_and_lora_ids_and_fake_their_output():
    import cupymoe.torch  # noqa: F401 (registers the ops)
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = str(torch.ops.cupymoe.moe_forward.default._schema)
    assert "Tensor? token_ids=None" in schema and "Tensor? lora_ids=None" in schema, schema
    experts_schema = str(torch.ops.cupymoe.moe_experts.default._schema)
    assert "Tensor topk_ids" in experts_schema and "Tensor? lora_ids=None" in experts_schema, experts_schema
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        ids = torch.empty(5, dtype=torch.int32)
        y = torch.ops.cupymoe.moe_forward(x, 1, None, ids)
        z = torch.ops.cupymoe.moe_experts(x, 1, torch.empty(5, 2, dtype=torch.int32), torch.empty(5, 2), None)
    assert y.shape == z.shape == x.shape and y.dtype == x.dtype


def test_the_module_refuses_rows_that_are_not_the_layers_width():
    """x [N, 2H] would reshape into 2N rows of H and pass the layer's own shape check: refused by
    name before any launch (a stand-in layer: nothing reaches a GPU)."""
    from types import SimpleNamespace

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    module = MoeModule(SimpleNamespace(cfg=SimpleNamespace(hidden_size=64)))
    with pytest.raises(MoeCallError, match=r"x has shape \(5, 128\): its last dimension must be the layer's "
                                           r"hidden size 64"):
        module(torch.empty(5, 128, dtype=torch.bfloat16))


def test_the_module_passes_token_and_lora_ids_as_int32_rows(monkeypatch):
    """Its docstring's promise: token_ids and lora_ids of any integer dtype and shape reach the op as
    contiguous int32 rows (int32 ones as they are); a stand-in op and layer, nothing reaches a GPU."""
    from types import SimpleNamespace

    from cupymoe.torch import MoeModule

    seen = {}

    def fake_op(rows, layer_id, token_ids, lora_ids):
        seen.update(token_ids=token_ids, lora_ids=lora_ids)
        return rows

    monkeypatch.setattr(torch.ops.cupymoe, "moe_forward", fake_op)
    module = MoeModule(SimpleNamespace(cfg=SimpleNamespace(hidden_size=8)))
    x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    tokens = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    lora = torch.tensor([[0, -1, 1], [1, 0, -1]], dtype=torch.int32)
    assert module(x, tokens, lora).shape == x.shape
    assert seen["token_ids"].dtype == torch.int32 and seen["token_ids"].tolist() == list(range(6))
    assert seen["lora_ids"].dtype == torch.int32 and seen["lora_ids"].tolist() == [0, -1, 1, 1, 0, -1]
    module(x.reshape(6, 8))
    assert seen == {"token_ids": None, "lora_ids": None}


def test_the_module_refuses_ids_that_are_not_integers():
    from types import SimpleNamespace

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    module = MoeModule(SimpleNamespace(cfg=SimpleNamespace(hidden_size=8)))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(MoeCallError, match="token_ids: an integer tensor is required, got torch.float32"):
        module(x, torch.zeros(3))
    with pytest.raises(MoeCallError, match="lora_ids: an integer tensor is required, got torch.bool"):
        module(x, None, torch.zeros(3, dtype=torch.bool))
