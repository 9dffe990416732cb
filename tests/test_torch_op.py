"""CPU: the torch ops' schemas and fake implementations (what torch.compile traces), no GPU."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")


class StandIn:
    """What MoeModule reads of a MoeLayer (its width); held weakly by the op's registry, as a layer is."""

    def __init__(self, hidden_size=8, has_shared_expert=False):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(hidden_size=hidden_size, has_shared_expert=has_shared_expert)


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

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    module = MoeModule(StandIn(64))
    with pytest.raises(MoeCallError, match=r"x has shape \(5, 128\): its last dimension must be the layer's "
                                           r"hidden size 64"):
        module(torch.empty(5, 128, dtype=torch.bfloat16))


def test_the_module_passes_token_and_lora_ids_as_int32_rows(monkeypatch):
    """Its docstring's promise: token_ids and lora_ids of any integer dtype, flat or shaped as x without
    its hidden size, reach the op as contiguous int32 rows (int32 ones as they are); a stand-in op and layer, nothing reaches a GPU."""

    from cupymoe.torch import MoeModule

    seen = {}

    def fake_op(rows, layer_id, token_ids, lora_ids):
        seen.update(token_ids=token_ids, lora_ids=lora_ids)
        return rows

    monkeypatch.setattr(torch.ops.cupymoe, "moe_forward", fake_op)
    module = MoeModule(StandIn(8))
    x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    tokens = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    lora = torch.tensor([[0, -1, 1], [1, 0, -1]], dtype=torch.int32)
    assert module(x, tokens, lora).shape == x.shape
    assert seen["token_ids"].dtype == torch.int32 and seen["token_ids"].tolist() == list(range(6))
    assert seen["lora_ids"].dtype == torch.int32 and seen["lora_ids"].tolist() == [0, -1, 1, 1, 0, -1]
    module(x.reshape(6, 8))
    assert seen == {"token_ids": None, "lora_ids": None}


def test_the_module_refuses_ids_that_are_not_integers():

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    module = MoeModule(StandIn(8))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(MoeCallError, match=r"token_ids: an integer tensor of dtype int8, uint8, int16, int32, int64 "
                                           r"is required, got torch.float32"):
        module(x, torch.zeros(3))
    with pytest.raises(MoeCallError, match=r"lora_ids: an integer tensor of dtype .* is required, got torch.bool"):
        module(x, None, torch.zeros(3, dtype=torch.bool))


def test_int64_ids_outside_int32_reach_the_kernels_as_out_of_range():
    """A plain cast would wrap 2^32 into slot 0 (a valid adapter) and 2^32 + 3 into expert 3: every id
    outside int32 goes on as INT32_MAX, which the kernels flag, and the rest unchanged (no host sync)."""
    from cupymoe.torch import _int32_rows

    t = torch.tensor([0, -1, 2**32, 2**32 + 3, -(2**31) - 5, 7, 2**31 - 1, -(2**31)], dtype=torch.int64)
    out = _int32_rows("lora_ids", t, (8,))
    assert out.dtype == torch.int32
    assert out.tolist() == [0, -1, 2**31 - 1, 2**31 - 1, 2**31 - 1, 7, 2**31 - 1, -(2**31)]
    assert _int32_rows("ids", torch.tensor([-3, 5], dtype=torch.int16), (2,)).tolist() == [-3, 5]


def test_the_experts_entry_refuses_ids_and_weights_of_the_wrong_kind(monkeypatch):
    """(x, topk_weights, topk_ids) swapped passes every shape check: float ids and integer weights are
    refused by name before the op, where a cast would have run wrong routing."""

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    seen = {}

    def fake_op(x, layer_id, topk_ids, topk_weights, shared_expert, lora_ids):
        seen.update(ids=topk_ids, w=topk_weights)
        return x

    monkeypatch.setattr(torch.ops.cupymoe, "moe_experts", fake_op)
    module = MoeModule(StandIn(8))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    ids, w = torch.tensor([[0, 1]] * 3, dtype=torch.int64), torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    with pytest.raises(MoeCallError, match="topk_ids: an integer tensor of dtype .* is required, got torch.bfloat16"):
        module.experts(x, w, ids)
    with pytest.raises(MoeCallError, match="topk_weights: a floating-point tensor is required, got torch.int64"):
        module.experts(x, ids, ids)
    module.experts(x, torch.tensor([[0, 2**32 + 1]] * 3), w)
    assert seen["ids"].dtype == torch.int32 and seen["ids"].tolist() == [[0, 2**31 - 1]] * 3
    assert seen["w"].dtype == torch.float32


def test_the_ops_refuse_host_tensors():
    """x in host memory: the op's named refusal, not torch's error about the stream of a CPU device."""
    import cupymoe.torch as ct

    from cupymoe.errors import MoeCallError

    held = StandIn()
    layer_id = ct.register(held)
    with pytest.raises(MoeCallError, match="x: a CUDA tensor is required, got one on cpu"):
        torch.ops.cupymoe.moe_forward(torch.zeros(2, 8, dtype=torch.bfloat16), layer_id)


def test_replaced_blocks_take_row_ids_only_in_the_rows_order():
    """[batch, seq] ids or flat ones fit hidden_states [batch, seq, H]; a [seq, batch] tensor of as many ids
    would cross sequences' slots and is refused naming both shapes."""
    from cupymoe.errors import MoeCallError
    from cupymoe.integrations.transformers import _row_ids

    shape = (2, 3, 8)
    flat = torch.arange(6)
    assert _row_ids(flat, shape).tolist() == list(range(6))
    assert _row_ids(flat.reshape(2, 3), shape).tolist() == list(range(6))
    assert _row_ids(torch.tensor([4, 7]), shape).tolist() == [4, 4, 4, 7, 7, 7]
    with pytest.raises(MoeCallError, match=r"lora_ids of shape \(3, 2\) fit neither the 6 rows of hidden_states "
                                           r"\(2, 3, 8\)"):
        _row_ids(flat.reshape(3, 2), shape)


def test_the_module_refuses_ids_that_cross_the_rows():
    """x [batch, seq, H] with ids [seq, batch] (as many values) would give rows other rows' adapters or
    tokens: refused naming both shapes, as the replaced blocks refuse them."""
    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    module = MoeModule(StandIn(8))
    x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    for name, shape in (("token_ids", (3, 2)), ("lora_ids", (1, 6)), ("lora_ids", (5,))):
        ids = torch.zeros(shape, dtype=torch.int32)
        with pytest.raises(MoeCallError, match=rf"{name} of shape {re.escape(str(shape))}: one id a row of x is "
                                               r"required, \[6\] or \(2, 3\)"):
            module(x, **{name: ids})


def test_arguments_that_are_no_tensors_are_refused_by_name():
    """A list, a numpy array or a number where a tensor goes: the argument named, not an AttributeError."""
    import numpy as np

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    module = MoeModule(StandIn(8))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    cases = [(lambda: module(np.zeros((3, 8))), "x", "numpy.ndarray"),
             (lambda: module(x, None, [0, 1, -1]), "lora_ids", "builtins.list"),
             (lambda: module(x, np.zeros(3, np.int32)), "token_ids", "numpy.ndarray"),
             (lambda: module.experts(x, ids, [[1.0, 1.0]] * 3), "topk_weights", "builtins.list"),
             (lambda: module.experts(x.tolist(), ids, w), "x", "builtins.list")]
    for call, name, kind in cases:
        with pytest.raises(MoeCallError, match=rf"{name}: a torch tensor is required, got {kind}"):
            call()


def test_the_experts_entry_refuses_a_shared_expert_flag_that_is_no_bool(monkeypatch):
    """The op's bool schema would read 2 or -1 as True: the module checks the flag as the layer does."""
    import numpy as np

    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    monkeypatch.setattr(torch.ops.cupymoe, "moe_experts", lambda x, *a: x)
    module = MoeModule(StandIn(8, has_shared_expert=True))
    x, ids, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    for bad in (2, -1, 0, "no", np.True_):
        with pytest.raises(MoeCallError, match=rf"shared_expert={re.escape(repr(bad))}: must be True, False or None"):
            module.experts(x, ids, w, shared_expert=bad)
    for good in (None, True, False):
        module.experts(x, ids, w, shared_expert=good)


def _cpu_op(monkeypatch):
    """The op's body on the CPU: its two GPU-only calls stood in for."""
    from types import SimpleNamespace

    import cupymoe.torch as ct

    monkeypatch.setattr(ct, "_on_gpu", lambda name, t: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))


class DoublingLayer(StandIn):
    """A layer whose forward writes 2 x: the op's body runs, nothing reaches a GPU."""

    def __init__(self, hidden_size=8):
        super().__init__(hidden_size)
        self.calls = 0

    def __call__(self, x, *, out, token_ids=None, lora_ids=None, stream=None):
        self.calls += 1
        out.copy_(x * 2)

    def run_experts(self, x, ids, w, *, out, stream=None, shared_expert=None, lora_ids=None):
        out.copy_(x * 3)


def test_backward_through_the_ops_is_refused_by_name(monkeypatch):
    """The layer has no gradient: a forward with grad on runs, its backward raises the named error."""
    from cupymoe.errors import MoeCallError
    from cupymoe.torch import MoeModule

    _cpu_op(monkeypatch)
    module = MoeModule(DoublingLayer(8))
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    for y in (module(x), module.experts(x, torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2))):
        assert y.requires_grad
        with pytest.raises(MoeCallError, match="cupymoe's ops are inference-only"):
            y.float().sum().backward()
    with torch.no_grad():
        assert torch.equal(module(x), x * 2)


def test_the_registry_keeps_no_layer_alive_and_follows_a_new_layer(monkeypatch):
    """A dropped module frees its layer (a server reloading models would otherwise keep every layer's
    device memory); `module.layer = other` (e.g. with_workspace) is what forward then runs."""
    import gc
    import weakref

    import cupymoe.torch as ct
    from cupymoe.errors import MoeCallError

    _cpu_op(monkeypatch)
    module = ct.MoeModule(DoublingLayer(8))
    gone, old_id = weakref.ref(module.layer), module.layer_id
    other = DoublingLayer(8)
    module.layer = other
    assert module.layer is other and module.layer_id != old_id
    gc.collect()
    assert gone() is None
    with pytest.raises(MoeCallError, match=rf"layer_id={old_id}: no cupymoe layer is registered under it"):
        torch.ops.cupymoe.moe_forward(torch.zeros(2, 8, dtype=torch.bfloat16), old_id)
    module(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert other.calls == 1
    other_id, held = module.layer_id, weakref.ref(other)
    del module, other
    gc.collect()
    assert held() is None and other_id not in ct._LAYERS
