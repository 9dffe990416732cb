"""Property-based checks of a forward's arguments (CPU): hypothesis draws the values a caller of
MoeLayer.forward / forward_experts / __call__ / run_experts could pass, and drives the pure
checks those entries make before anything is launched (cupymoe/layer_checks.py, experts.py,
arrays.py, plan.choose_path).

The property, for every draw: it is accepted and the ints returned are the values meant, or it
is refused with a cupymoe.Error subclass whose message names the argument; no other exception
escapes. What is meant is written here a second time, independently (`_oracle`): a pointer is a
Python or numpy integer (never a bool) in 1..2^64-1 with the kernels' alignment, a row count one
in 1..max_tokens, an absent token-id pointer None or 0.

The layer is a stand-in with __slots__ holding only what the checks read (an attribute read past
them raises AttributeError, which would escape). Arrays are stand-ins too: objects with torch's or
CuPy's module name and attributes (CI has neither framework on the CPU), and things that are not
arrays (a torch module, a CuPy stream, a sparse tensor, numpy arrays, lists).
"""

from __future__ import annotations

from collections import OrderedDict

import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupymoe
from cupymoe import arrays, testing
from cupymoe.errors import MoeCallError, OptionError, PathUnavailableError, UnsupportedModelError
from cupymoe.experts import check_call as experts_check_call
from cupymoe.knobs import Knobs
from cupymoe.layer_checks import (check_call, check_options, check_path, check_stream, checked_call,
                                  optional_pointer, pointer)
from cupymoe.lora_slots import check_options as lora_options
from cupymoe.plan import PATH_NAMES, DeviceFacts, LayerOptions, Path, choose_path, plan_layer

SCALE = max(1, int(os.environ.get("CUPYMOE_PROPERTY_SCALE", "1")))  # as tests/test_properties.py
TOP = 1 << 64


def examples(n: int):
    return settings(max_examples=n * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Cfg:
    __slots__ = ("hidden_size", "hash_routing", "num_experts_per_tok")

    def __init__(self, hidden_size, hash_routing, k=2):
        self.hidden_size, self.hash_routing, self.num_experts_per_tok = hidden_size, hash_routing, k


class StandIn:
    """What check_call and checked_call read of a MoeLayer, and nothing else."""

    __slots__ = ("cfg", "max_tokens", "_checked", "device_id", "_device_ptrs")

    def __init__(self, cfg, max_tokens):
        self.cfg, self.max_tokens, self._checked, self.device_id = cfg, max_tokens, (None, None), 0
        self._device_ptrs = OrderedDict()


LAYERS = st.builds(StandIn, st.builds(Cfg, st.sampled_from([64, 2048, 7168]), st.booleans()),
                   st.sampled_from([1, 8, 640, 8192]))

NP_INTS = st.one_of(st.integers(-2 ** 63, 2 ** 63 - 1).map(np.int64), st.integers(0, TOP - 1).map(np.uint64),
                    st.integers(-2 ** 31, 2 ** 31 - 1).map(np.int32), st.integers(0, 255).map(np.uint8))
ODD = st.one_of(  # what is no int: each must be refused by name
    st.booleans(), st.booleans().map(np.bool_), st.none(), st.floats(allow_nan=True), st.text(max_size=3),
    st.lists(st.integers(0, 64), max_size=3), st.tuples(st.integers(0, 64)), st.just(np.array([16, 32])),
    st.just(np.array(16)), st.just(b"\x10"), st.complex_numbers(max_magnitude=10), st.just(object()))
ADDRESSES = st.integers(1, (TOP >> 4) - 1).map(lambda a: a << 4)  # 16-byte aligned device addresses
POINTERS = st.one_of(ADDRESSES, ADDRESSES.map(np.uint64), ADDRESSES.map(lambda a: a + 4),
                     st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, -16, TOP - 16, TOP, 2 ** 70]), NP_INTS, ODD)
COUNTS = st.one_of(st.integers(-3, 10), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([639, 640, 641, 8192, 8193]),
                   NP_INTS, ODD)


def _int(v):
    """The int a value means, or None where it is no integer (bools, floats, arrays...)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _address(name, v, align):
    """(address, None) or (None, the argument a refusal must name)."""
    p = _int(v)
    return (p, None) if p is not None and 0 < p < TOP and p % align == 0 else (None, name)


def _oracle(layer, x_ptr, n, out_ptr, tid_ptr):
    """What check_call should make of a call: (the 4 ints, None) or (None, the argument it must name)."""
    rows = _int(n)
    if rows is None or not 1 <= rows <= layer.max_tokens:
        return None, "num_tokens"
    x, bad = _address("input_ptr", x_ptr, 16)
    if bad:
        return None, bad
    out, bad = _address("output_ptr", out_ptr, 16)
    if bad:
        return None, bad
    nbytes = rows * layer.cfg.hidden_size * 2
    if x < out + nbytes and out < x + nbytes:
        return None, "output_ptr"
    tid = 0 if tid_ptr is None or _int(tid_ptr) == 0 else _address("token_ids_ptr", tid_ptr, 4)[0]
    if tid is None or (tid == 0 and layer.cfg.hash_routing):
        return None, "token_ids_ptr"
    return (rows, x, out, tid), None


def _same(fn, want, name):
    """fn() returns `want`, or, where want is None, raises a cupymoe.Error naming `name`."""
    try:
        got = fn()
    except cupymoe.Error as e:
        assert want is None, f"refused a good call ({e})"
        assert name in str(e), f"{name} is not named in: {e}"
        return
    assert want is not None, f"accepted {got}, {name} should be refused"
    assert got == want and all(type(v) is int for v in got if v is not None)


def _near(layer, data, x):
    """An output pointer within a row block of `x`: the overlap cases."""
    span = layer.max_tokens * layer.cfg.hidden_size * 2
    return int(x) + 16 * data.draw(st.integers(-span // 16, span // 16))


@examples(500)
@given(layer=LAYERS, data=st.data())
def test_drawn_forward_arguments_are_accepted_as_meant_or_refused_by_name(layer, data):
    n = data.draw(COUNTS)
    x = data.draw(POINTERS)
    out = data.draw(st.one_of(POINTERS, st.just(_near(layer, data, x)) if _int(x) is not None else POINTERS))
    tid = data.draw(st.one_of(st.none(), st.just(0), POINTERS))
    want, name = _oracle(layer, x, n, out, tid)
    _same(lambda: check_call(layer, x, n, out, tid), want, name)


@examples(200)
@given(layer=LAYERS, calls=st.lists(st.tuples(st.sampled_from([16, 16.0, np.uint64(16), 0x1000, True, 4096]),
                                               st.sampled_from([1, 1.0, np.int32(1), True, 2, 0]),
                                               st.sampled_from([0x100000, 0x100000 + 8, np.int64(0x100000), None]),
                                               st.sampled_from([0, 0.0, None, False, 64, np.array([64, 64])])),
                                     min_size=1, max_size=4))
def test_a_forward_repeating_the_last_calls_values_is_checked_as_if_it_were_new(layer, calls):
    """forward skips check_call for the last call's arguments: only where they are the same plain ints
    (16.0 == 16 and True == 1, yet neither is a pointer or a count)."""
    for call in calls:
        want, name = _oracle(layer, *call)
        _same(lambda: checked_call(layer, *call), want, name)


@examples(300)
@given(layer=LAYERS, data=st.data())
def test_drawn_experts_only_arguments_are_accepted_as_meant_or_refused_by_name(layer, data):
    n, x, ids, w = data.draw(COUNTS), data.draw(POINTERS), data.draw(POINTERS), data.draw(POINTERS)
    out = data.draw(st.one_of(POINTERS, st.just(_near(layer, data, x)) if _int(x) is not None else POINTERS))
    want, name = _oracle(layer, x, n, out, 0x40)  # num_tokens, input and output as forward's
    if want is None and name == "output_ptr" and _address("output_ptr", out, 16)[0] is not None:
        name = "overlap"  # the experts' check takes the ids and weights before the overlap
    if want is not None or name == "overlap":
        ids_v, bad = _address("topk_ids_ptr", ids, 4)
        w_v, bad = (None, bad) if bad else _address("topk_weights_ptr", w, 4)
        name = bad or ("output_ptr" if name == "overlap" else None)
        want = None if name else (want[0], want[1], ids_v, w_v, want[2], 0)  # no lora_ids_ptr: 0
    _same(lambda: experts_check_call(layer, x, n, ids, w, out), want, name)


def test_a_good_experts_only_call_returns_its_ints_and_no_lora_ids():
    """The accepted path the draws above reach only now and then: six ints, lora_ids_ptr absent as 0."""
    layer = StandIn(Cfg(64, False), 1)
    got = experts_check_call(layer, 0x10, 1, 0x10, 0x10, 0x90)
    assert got == (1, 0x10, 0x10, 0x10, 0x90, 0) and all(type(v) is int for v in got)


@examples(200)
@given(st.one_of(st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, 2, TOP - 1, TOP]), NP_INTS, ODD))
def test_drawn_streams_are_raw_ints_or_refused_by_name(stream):
    want = _int(stream)
    want = want if want is not None and 0 <= want < TOP else None
    _same(lambda: (check_stream(stream),), None if want is None else (want,), "stream=")


@examples(200)
@given(st.one_of(POINTERS, st.just(0), st.just(np.int64(0))), st.sampled_from(["lora_ids_ptr", "token_ids_ptr"]))
def test_drawn_optional_pointers_are_absent_addresses_or_refused_by_name(p, name):
    want = 0 if p is None or _int(p) == 0 else _address(name, p, 4)[0]
    _same(lambda: (optional_pointer(name, p, 4),), None if want is None else (want,), name)
    if p is not None and _int(p) != 0:  # pointer() is optional_pointer() where a pointer is required
        _same(lambda: (pointer(name, p, 4),), None if want is None else (want,), name)


@pytest.fixture(scope="module")
def layer_plan():
    cfg = testing.tiny_config("qwen3_moe")
    return plan_layer(cfg, "bf16", None, DeviceFacts.h200().arch, options=LayerOptions(decode_max_tokens=16),
                      knobs=Knobs())


PATHS = st.one_of(st.sampled_from(PATH_NAMES), st.sampled_from(PATH_NAMES).map(np.str_), st.text(max_size=8),
                  st.just(np.array(["auto", "decode"])), st.just(["auto"]), st.just(Path.DECODE), ODD)


@examples(200)
@given(path=PATHS, n=st.integers(1, 64))
def test_drawn_paths_choose_one_or_are_refused_by_name(layer_plan, path, n):
    ok = path is None or (isinstance(path, str) and path in PATH_NAMES)
    _same(lambda: (check_path(path),), (None,) if ok else None, "path=")
    try:
        chosen = choose_path(layer_plan, path, n)
    except PathUnavailableError as e:
        assert "path=" in str(e)
        return
    assert isinstance(path, str) and path in PATH_NAMES and chosen in PATH_NAMES[1:]


QWEN3 = testing.tiny_config("qwen3_moe")


@examples(200)
@given(max_tokens=COUNTS, path=PATHS, row_invariant=st.booleans(), loras=st.tuples(COUNTS, COUNTS))
def test_drawn_layer_options_are_taken_or_refused_by_name(max_tokens, path, row_invariant, loras):
    """MoeLayer's options, checked before anything is uploaded (layer_checks.check_options, lora_slots)."""
    cfg = QWEN3
    m = _int(max_tokens)
    if m is None or m <= 0:
        name = "max_tokens="
    elif not (isinstance(path, str) and path in PATH_NAMES):
        name = "path="
    else:
        name = "row_invariant" if row_invariant and path in ("decode", "atomic") else None
    _same(lambda: (check_options(cfg, max_tokens, path, row_invariant),), None if name else (None,), name)
    k, r = (_int(v) for v in loras)
    bad = next((f"{n}=" for n, v in zip(("max_loras", "max_lora_rank"), (k, r)) if v is None or v < 0), None)
    bad = bad or (None if (k == 0) == (r == 0) else "give both")
    _same(lambda: lora_options(*loras), None if bad else (k, r), bad)


def test_widths_the_kernels_cannot_read_are_refused_as_options():
    with pytest.raises(UnsupportedModelError, match="cannot serve this layer: MoeConfig.hidden_size=100"):
        check_options(testing.tiny_config("qwen3_moe", hidden_size=100), 8, "auto", False)
    with pytest.raises(OptionError, match=r"max_tokens=True: must be a positive integer"):
        check_options(testing.tiny_config("qwen3_moe"), True, "auto", False)
    with pytest.raises(OptionError, match=r"path=array"):  # was a ValueError from the array's truth value
        check_options(testing.tiny_config("qwen3_moe"), 8, np.array(["auto", "decode"]), False)


# --- arrays: torch tensors and CuPy arrays as __call__ and run_experts take them ------------

class _Device:
    def __init__(self, kind, index):
        self.type, self.index, self.id = kind, index, index


class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


def _torch(ptr, shape, dtype, device, contiguous):
    t = type("Tensor", (), {"__module__": "torch"})()
    t.device = _Device("cpu", None) if device is None else _Device("cuda", device)
    t.shape, t.dtype = shape, _TorchDtype(dtype)
    t.data_ptr, t.is_contiguous = (lambda: ptr), (lambda: contiguous)
    return t


def _cupy(ptr, shape, dtype, device, contiguous):
    a = type("ndarray", (), {"__module__": "cupy._core.core"})()
    a.data, a.shape, a.dtype = SimpleNamespace(ptr=ptr), shape, np.dtype(dtype)
    a.device, a.flags = _Device("cuda", device), SimpleNamespace(c_contiguous=contiguous)
    return a


def _sparse():  # torch's sparse tensors have no data pointer
    t = _torch(16, (4, 64), "bfloat16", 0, True)

    def no_storage():
        raise RuntimeError("Cannot access data pointer of Tensor that doesn't have storage")

    t.data_ptr = no_storage
    return t


NOT_ARRAYS = st.one_of(st.sampled_from([type("Linear", (), {"__module__": "torch.nn.modules.linear"}),
                                        type("Stream", (), {"__module__": "cupy.cuda.stream"}),
                                        type("csr_matrix", (), {"__module__": "cupyx.scipy.sparse._csr"})]).map(
    lambda cls: cls()), st.builds(_sparse), st.just(np.zeros((4, 64), np.uint16)), ODD, st.integers())
DTYPES = ["bfloat16", "uint16", "int32", "float32", "float16", "int64", "uint8"]


@st.composite
def described_arrays(draw, shape):
    """(array stand-in, its DeviceArray as meant): right or wrong in each property the checks read."""
    fw = draw(st.sampled_from(["torch", "cupy"]))
    dtype = draw(st.sampled_from(DTYPES if fw == "torch" else [d for d in DTYPES if d != "bfloat16"]))
    shape = draw(st.one_of(st.just(shape), st.lists(st.integers(0, 9), max_size=3).map(tuple),
                           st.just(shape[:1]), st.just(tuple(d + 1 for d in shape))))
    device = draw(st.sampled_from([0, 1] + ([None] if fw == "torch" else [])))
    contiguous, ptr = draw(st.booleans()), draw(ADDRESSES)
    make = _torch if fw == "torch" else _cupy
    return make(ptr, shape, dtype, device, contiguous), arrays.DeviceArray(ptr, shape, dtype, device, contiguous, fw)


@examples(400)
@given(data=st.data(), hidden=st.sampled_from([64, 2048]), n=st.integers(1, 6), which=st.sampled_from(
    [("out", arrays.BF16_BITS, "x"), ("token_ids", ("int32",), "n"), ("topk_ids", ("int32",), "nk"),
     ("topk_weights", ("float32",), "nk")]))
def test_drawn_arrays_give_their_address_or_are_refused_by_name(data, hidden, n, which):
    what, dtypes, form = which
    shape = {"x": (n, hidden), "n": (n,), "nk": (n, 2)}[form]
    obj, meant = data.draw(st.one_of(described_arrays(shape), NOT_ARRAYS.map(lambda o: (o, None))))
    ok = meant is not None and (meant.device, meant.shape, meant.contiguous) == (0, shape, True) and \
        meant.dtype in arrays.accepted_dtypes(meant.framework, dtypes)
    _same(lambda: (arrays.checked_ptr(obj, what, device=0, dtypes=dtypes, shape=shape),),
          (meant.ptr,) if ok else None, what)


@examples(200)
@given(data=st.data(), hidden=st.sampled_from([64, 2048]))
def test_drawn_inputs_give_their_row_count_or_are_refused_by_name(data, hidden):
    n = data.draw(st.integers(0, 6))
    obj, meant = data.draw(st.one_of(described_arrays((n, hidden)), NOT_ARRAYS.map(lambda o: (o, None))))
    ok = meant is not None and meant.device == 0 and meant.contiguous and len(meant.shape) == 2 and \
        meant.dtype in arrays.accepted_dtypes(meant.framework, arrays.BF16_BITS) and meant.shape[1] == hidden and \
        meant.shape[0] >= 1
    _same(lambda: (arrays.rows_of(arrays.view(obj, "x"), hidden, 0),), (meant.shape[0],) if ok else None, "x")


# --- the escapes these draws found, one by one --------------------------------------------

def test_a_torch_uint16_tensor_is_no_bf16():
    """CuPy carries bf16 as uint16 bits; torch has bfloat16, and its uint16 holds integers: refused, not read as
    bf16."""
    x = _torch(0x1000, (3, 64), "uint16", 0, True)
    with pytest.raises(MoeCallError, match=r"x: expected a contiguous bfloat16 array \[3, 64\] on cuda:0, "
                                           r"got torch uint16"):
        arrays.rows_of(arrays.view(x, "x"), 64, 0)
    with pytest.raises(MoeCallError, match="out: expected a contiguous bfloat16 array"):
        arrays.checked_ptr(x, "out", device=0, dtypes=arrays.BF16_BITS, shape=(3, 64))
    assert arrays.rows_of(arrays.view(_cupy(0x1000, (3, 64), "uint16", 0, True), "x"), 64, 0) == 3
    assert arrays.rows_of(arrays.view(_torch(0x1000, (3, 64), "bfloat16", 0, True), "x"), 64, 0) == 3


def test_an_array_as_token_ids_ptr_is_refused_by_name_not_by_its_truth_value():
    layer = StandIn(Cfg(64, False), 8)
    with pytest.raises(MoeCallError, match="token_ids_ptr=array"):
        check_call(layer, 0x1000, 1, 0x2000, np.array([64, 64]))
    with pytest.raises(MoeCallError, match="token_ids_ptr=0.0"):  # 0.0 is no "absent" and no pointer
        check_call(layer, 0x1000, 1, 0x2000, 0.0)
    assert check_call(layer, 0x1000, 1, 0x2000, np.int64(0)) == (1, 0x1000, 0x2000, 0)


def test_a_float_equal_to_the_last_calls_pointer_is_not_taken_from_the_cache():
    layer = StandIn(Cfg(64, False), 8)
    assert checked_call(layer, 0x1000, 1, 0x2000, 0) == (1, 0x1000, 0x2000, 0)
    with pytest.raises(MoeCallError, match="input_ptr=4096.0"):
        checked_call(layer, 0x1000 * 1.0, 1, 0x2000, 0)


def test_an_array_or_a_list_as_path_is_refused_by_name(layer_plan):
    for path in (np.array(["auto", "decode"]), ["auto"]):
        with pytest.raises(PathUnavailableError, match="path="):
            choose_path(layer_plan, path, 1)
        with pytest.raises(PathUnavailableError, match="path="):
            check_path(path)
    assert check_stream(np.uint64(TOP - 1)) == TOP - 1
    with pytest.raises(MoeCallError, match=r"stream=\[1\]"):
        check_stream([1])


def test_a_torch_or_cupy_object_that_is_no_array_is_refused_by_name():
    for obj in (type("Linear", (), {"__module__": "torch.nn.modules.linear"})(), _sparse(),
                type("Stream", (), {"__module__": "cupy.cuda.stream"})()):
        with pytest.raises(MoeCallError, match="out: expected a dense torch tensor or CuPy array, got"):
            arrays.view(obj, "out")


def test_raw_pointers_the_runtime_knows_as_no_memory_of_the_layers_gpu_are_refused(monkeypatch):
    """check_device_memory reads cudaPointerGetAttributes (a stand-in runtime here): unregistered memory
    and another GPU's device memory are refused by name; pinned host and managed memory pass, and so does
    an address the runtime cannot answer for (a guard that never stands in a correct call's way)."""
    from types import SimpleNamespace

    import cupy

    from cupymoe.layer_checks import check_device_memory

    answers = {0x1000: (0, -2), 0x2000: (2, 1), 0x3000: (2, 0), 0x4000: (1, 0), 0x5000: (3, 1)}

    def attrs(p):
        if p == 0x6000:
            raise RuntimeError("no driver")
        kind, device = answers[p]
        return SimpleNamespace(type=kind, device=device)

    monkeypatch.setattr(cupy.cuda.runtime, "pointerGetAttributes", attrs)
    with pytest.raises(MoeCallError, match=r"input_ptr=0x1000: not CUDA memory \(host memory or a stray address\); "
                                           r"the layer reads device memory of cuda:0"):
        check_device_memory("input_ptr", 0x1000, 0)
    with pytest.raises(MoeCallError, match=r"output_ptr=0x2000: device memory of cuda:1, the layer on cuda:0"):
        check_device_memory("output_ptr", 0x2000, 0)
    for p in (0x3000, 0x4000, 0x5000, 0x6000):
        check_device_memory("input_ptr", p, 0)


def test_a_default_stream_of_another_devices_context_is_refused_every_call(monkeypatch):
    """Streams 0, 1 and 2 are the thread's current context's: a layer on cuda:1 called while cuda:0 (or no
    device) is current would launch its kernels into the wrong context (the driver's error, and the forward
    graph dropped). Checked on every call, since the current device changes; a non-default stream once."""
    from types import SimpleNamespace

    from cupymoe.launch import Driver
    from cupymoe.layer import MoeLayer

    current = {"ctx": 0xC1}
    monkeypatch.setattr(Driver, "current_context", staticmethod(lambda: current["ctx"]))
    monkeypatch.setattr(Driver, "stream_context", classmethod(lambda cls, s: {0x7000: 0xC1, 0x8000: 0xC0}[s]))
    layer = SimpleNamespace(_streams={}, _ctx=0xC1, device_id=1)
    for s in (0, 1, 2, np.int64(2), 0x7000):
        assert MoeLayer._stream(layer, s) == int(s)
    with pytest.raises(MoeCallError, match="stream 0x8000 belongs to another device's context"):
        MoeLayer._stream(layer, 0x8000)
    current["ctx"] = 0xC0
    assert MoeLayer._stream(layer, 0x7000) == 0x7000  # a stream carries its own context
    for s in (0, 1, 2):
        with pytest.raises(MoeCallError, match=rf"stream={s} is the default stream of the thread's current device, "
                                               r"here a device other than this layer's device 1: make it current"):
            MoeLayer._stream(layer, s)
    current["ctx"] = 0
    with pytest.raises(MoeCallError, match=r"here no device \(no CUDA context\) for this layer's device 1"):
        MoeLayer._stream(layer, 0)


@pytest.mark.parametrize("bad", [1.9, True, "0"])
def test_a_device_that_is_no_index_is_refused(bad):
    """int(1.9) and int(True) picked device 1 silently."""
    import cupy

    from cupymoe.layer_checks import device_of

    with pytest.raises(OptionError, match=rf"device={bad!r}: a device index \(int\) is required"):
        device_of(cupy, bad)
