"""Property-based checks of the host side (CPU): configs and checkpoints drawn by hypothesis,
good and bad, and what cupymoe makes of them.

The property, for every draw: it is accepted, or refused with a cupymoe.Error subclass; no other
exception escapes, nothing hangs, and loading never allocates much more than the files hold
(tracemalloc's peak against a bound of a few times their size). A checkpoint that loads after a
corruption that leaves its meaning intact (extra tensors, float dtypes that hold the same values,
shards moved into a subdirectory, symlinks that stay inside) gives the layer output
`cupymoe.reference.moe_forward` gives on the uncorrupted weights, bit for bit; corruptions that
change what a file says (truncation, a wrong shape or dtype, NaN, an unusable scale, a hostile
shard name, a symlink out) must be refused.

Checkpoints are small (H = I = 32, four experts) so that about a thousand draws run in well under
a minute. Safetensors files are read and written here byte by byte (safetensors.numpy cannot read
the F8 dtypes), which also lets a draw write headers no library would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupymoe
from cupymoe import reference
from cupymoe.checkpoint import load_layer, save_layer
from cupymoe.config import MoeConfig, kernel_limits_violations
from cupymoe.host_weights import HostWeights
from cupymoe.testing import hf_config_dict, random_host_weights, random_input

LAYER = 1
BF16 = np.dtype(ml_dtypes.bfloat16)


# CUPYMOE_PROPERTY_SCALE=k draws k times as many cases (a deeper search than CI's)
SCALE = max(1, int(os.environ.get("CUPYMOE_PROPERTY_SCALE", "1")))


def examples(n: int):
    return settings(max_examples=n * SCALE, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def refused_or(fn):
    """fn()'s result, or None when it is refused with a cupymoe.Error (anything else escapes)."""
    try:
        return fn()
    except cupymoe.Error:
        return None


# ----------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------

HOSTILE = st.one_of(
    st.integers(-3, 12), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([10 ** 9, 2 ** 31, 2 ** 63]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=4),
    st.lists(st.integers(-2, 4), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus", "silu", "gelu", "swiglu_oai", "bf16", "nvfp4",
                     "fp8_block", "mxfp4", "qwen3_moe", "gpt_oss"]),
)
BASE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
FIELDS = [f.name for f in __import__("dataclasses").fields(MoeConfig)]


@examples(400)
@given(st.dictionaries(st.sampled_from(FIELDS), HOSTILE, max_size=4))
def test_drawn_moe_configs_are_built_or_refused_with_a_config_error(changes):
    cfg = refused_or(lambda: MoeConfig(**{**BASE, **changes}))
    if cfg is None:
        return
    # an accepted config is whole: every derived quantity and the kernels' verdict can be asked
    assert cfg.router_width == cfg.num_experts + cfg.zero_expert_num >= cfg.num_experts_per_tok
    assert all(isinstance(v, str) for v in kernel_limits_violations(cfg))
    assert isinstance(cfg.quant_exclude, tuple) and all(isinstance(p, str) for p in cfg.quant_exclude)
    owned = cfg.owned_experts()
    assert owned.stop - owned.start == cfg.experts_per_rank and 0 <= owned.start < owned.stop <= cfg.num_experts
    HostWeights(None, None, None, None).expected_shapes(cfg)


HF_KEYS = ["model_type", "hidden_size", "moe_intermediate_size", "intermediate_size", "num_experts",
           "n_routed_experts", "num_local_experts", "num_experts_per_tok", "experts_per_token", "moe_topk",
           "norm_topk_prob", "n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor",
           "first_k_dense_replace", "moe_layer_freq", "mlp_only_layers", "decoder_sparse_step", "n_shared_experts",
           "shared_expert_intermediate_size", "zero_expert_num", "zero_expert_type", "router_bias", "hidden_act",
           "swiglu_limit", "rms_norm_eps", "num_hidden_layers", "num_layers", "quantization_config"]
QUANT = st.one_of(HOSTILE, st.fixed_dictionaries({}, optional={
    "quant_method": st.one_of(st.sampled_from(["fp8", "modelopt", "mxfp4", "awq", "FP8"]), HOSTILE),
    "weight_block_size": st.one_of(st.just([128, 128]), HOSTILE),
    "quant_algo": st.one_of(st.sampled_from(["NVFP4", "nvfp4", "FP8"]), HOSTILE),
    "group_size": st.one_of(st.just(16), HOSTILE),
    "exclude_modules": st.one_of(st.lists(st.text(max_size=4), max_size=2), HOSTILE),
    "ignore": HOSTILE, "modules_to_not_convert": HOSTILE}))


@examples(300)
@given(family=st.sampled_from(cupymoe.testing.FAMILIES),
       changes=st.dictionaries(st.sampled_from(HF_KEYS), HOSTILE, max_size=3),
       quant=st.one_of(st.nothing(), QUANT) | st.none(),
       layer=st.one_of(st.none(), st.integers(-2, 6)))
def test_drawn_config_json_maps_or_is_refused_with_a_cupymoe_error(family, changes, quant, layer):
    d = {**hf_config_dict(family), **changes}
    if quant is not None:
        d["quantization_config"] = quant
    cfg = refused_or(lambda: MoeConfig.from_hf(d, layer))
    if cfg is not None:
        assert cfg.model_type == d["model_type"] and all(isinstance(v, str) for v in kernel_limits_violations(cfg))


# ----------------------------------------------------------------------------------
# safetensors, byte by byte
# ----------------------------------------------------------------------------------

def read_st(path: Path) -> tuple[dict, bytes]:
    """(header without __metadata__, data bytes) of a well-formed file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def tensors_of(path: Path) -> dict[str, tuple[str, list, bytes]]:
    header, data = read_st(path)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def write_st(path: Path, tensors: dict[str, tuple[str, list, bytes]]) -> None:
    header, chunks, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        chunks.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(chunks))


_NP = {"BF16": BF16, "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "F16": np.dtype(np.float16),
       "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "U8": np.dtype(np.uint8)}


# ----------------------------------------------------------------------------------
# small checkpoints: every family's features, every format
# ----------------------------------------------------------------------------------

SMALL = {
    "qwen3_moe": dict(hidden_size=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=32),
    "deepseek_v3": dict(hidden_size=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, n_shared_experts=1),
    "gpt_oss": dict(hidden_size=32, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    experts_per_token=2),
    "longcat_flash": dict(hidden_size=32, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2,
                          moe_topk=2),
}
QCONFIG = {"fp8_block": {"quant_method": "fp8", "weight_block_size": [128, 128]},
           "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
           "mxfp4": {"quant_method": "mxfp4"}}
CASES = [("qwen3_moe", "bf16", None), ("qwen2_moe", "bf16", 7), ("deepseek_v3", "fp8_block", 9),
         ("qwen3_moe", "nvfp4", None), ("gpt_oss", "mxfp4", None), ("gpt_oss", "bf16", 3),
         ("longcat_flash", "bf16", None)]


class Base:
    """One saved small checkpoint, its weights, and the reference output on a fixed input."""

    def __init__(self, root: Path, family: str, fmt: str, shard: int | None, seed: int):
        self.config = hf_config_dict(family, **SMALL[family])
        if fmt != "bf16":
            self.config["quantization_config"] = QCONFIG[fmt]
        rng = np.random.default_rng(seed)
        self.cfg = MoeConfig.from_hf(self.config, LAYER)
        self.hw = random_host_weights(self.cfg, rng, fmt)
        self.root = save_layer(root, self.config, LAYER, self.hw, shard_max_tensors=shard)
        self.x = random_input(rng, 5, self.cfg.hidden_size)
        self.want = reference.moe_forward(self.cfg, self.hw, self.x)
        self.files = sorted(p.name for p in self.root.iterdir() if p.suffix == ".safetensors")
        self.size = sum(p.stat().st_size for p in self.root.iterdir())
        # every tensor the layer reads, by file
        self.tensors = {f: list(tensors_of(self.root / f)) for f in self.files}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return [Base(root / f"{f}-{fmt}", f, fmt, shard, seed) for seed, (f, fmt, shard) in enumerate(CASES)]


def load_bounded(root: Path, size: int):
    """load_layer(root) with its allocations traced: the result, or None when refused with a
    cupymoe.Error; asserts the peak and the time stay within what the files justify."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        return refused_or(lambda: load_layer(root, LAYER))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 * size + (1 << 20), f"load_layer peaked at {peak} bytes for {size} bytes of files"
        assert time.perf_counter() - t < 10, "load_layer took over 10 s on a tiny checkpoint"


def assert_same_output(base: Base, loaded) -> None:
    cfg, hw = loaded
    got = reference.moe_forward(cfg, hw, base.x)
    assert got.dtype == base.want.dtype and np.array_equal(got, base.want), "a benign change altered the layer"


# ----------------------------------------------------------------------------------
# corruptions of the files; each says whether it must be refused, must load, or may do either
# ----------------------------------------------------------------------------------

MUST_REFUSE, BENIGN, EITHER = "refuse", "benign", "either"


def judge(base: Base, expect: str, loaded, what: str, same: bool = True) -> None:
    """The outcome against the expectation; a layer that loads is the reference layer where `same`."""
    if expect == MUST_REFUSE:
        assert loaded is None, f"{what}: loaded what it must refuse"
    elif expect == BENIGN:
        assert loaded is not None, f"{what}: refused a benign change"
    if loaded is not None and same:
        assert_same_output(base, loaded)


def _pick_tensor(data, base: Base) -> tuple[str, str]:
    file = data.draw(st.sampled_from(base.files), label="file")
    return file, data.draw(st.sampled_from(base.tensors[file]), label="tensor")


def _rewrite(root: Path, file: str, fn) -> None:
    t = tensors_of(root / file)
    fn(t)
    write_st(root / file, t)


def c_truncate(data, base, root):
    file = data.draw(st.sampled_from(base.files), label="file")
    raw = (root / file).read_bytes()
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    cut = data.draw(st.one_of(st.integers(0, header_end + 8), st.integers(0, len(raw) - 1)), label="cut")
    (root / file).write_bytes(raw[:cut])
    return MUST_REFUSE


def c_flip_header(data, base, root):
    file = data.draw(st.sampled_from(base.files), label="file")
    raw = bytearray((root / file).read_bytes())
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    at = data.draw(st.integers(0, header_end - 1), label="at")
    raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    (root / file).write_bytes(bytes(raw))
    return EITHER  # a flip in the metadata or the padding changes nothing the layer reads


def c_retype(data, base, root):
    file, name = _pick_tensor(data, base)
    dtype, shape, raw = tensors_of(root / file)[name]
    if dtype in ("BF16", "F32"):
        a = np.frombuffer(raw, _NP[dtype])
        target = data.draw(st.sampled_from(["F32", "F64", "I16", "I32", "U8", "BOOL", "F8_E4M3", "X9"]), label="to")
        if target in ("F32", "F64"):  # the same values, wider: read as what they are
            _rewrite(root, file, lambda t: t.__setitem__(name, (target, shape, a.astype(_NP[target]).tobytes())))
            # one expert of a stack in another dtype than the rest is refused (a layer's experts share one)
            return EITHER if re.search(r"experts\.\d+\.", name) else BENIGN
    else:
        target = data.draw(st.sampled_from(["I8", "BOOL", "F16", "BF16", "I64"]), label="to")
    width = {"I16": 2, "I32": 4, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "X9": 1, "I8": 1, "F16": 2, "BF16": 2, "I64": 8}
    n = int(np.prod(shape))
    _rewrite(root, file, lambda t: t.__setitem__(name, (target, shape, bytes(n * width[target]))))
    return MUST_REFUSE


def c_reshape(data, base, root):
    file, name = _pick_tensor(data, base)
    dtype, shape, raw = tensors_of(root / file)[name]
    item = len(raw) // max(1, int(np.prod(shape)))
    how = data.draw(st.sampled_from(["swap", "grow", "shrink", "flat", "extra_axis"]), label="how")
    if how == "swap" and len(shape) >= 2 and shape[-1] != shape[-2]:
        new, payload = shape[:-2] + [shape[-1], shape[-2]], raw
    elif how == "grow" or not shape:
        new = (shape or [1])[:-1] + [(shape or [1])[-1] + 1]
        payload = bytes(int(np.prod(new)) * item)
    elif how == "shrink" and shape[-1] > 1:
        new = shape[:-1] + [shape[-1] - 1]
        payload = raw[:int(np.prod(new)) * item]
    elif how == "flat" and len(shape) >= 2:
        new, payload = [int(np.prod(shape))], raw
    else:
        new, payload = shape + [1], raw
    _rewrite(root, file, lambda t: t.__setitem__(name, (dtype, new, payload)))
    return MUST_REFUSE


def c_poison(data, base, root):
    """A value no kernel can use, where the format has one: NaN / Inf weights and vectors, e4m3
    NaN codes, block or global scales <= 0 or not finite, negative or NaN group scales, e8m0 255."""
    file, name = _pick_tensor(data, base)
    dtype, shape, raw = tensors_of(root / file)[name]
    a = bytearray(raw)
    n = len(raw) // max(1, int(np.prod(shape)))
    i = data.draw(st.integers(0, max(0, int(np.prod(shape)) - 1)), label="at") * n
    if dtype in ("BF16", "F32"):
        bad = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
        if name.endswith(("weight_scale_inv", "weight_scale_2")):
            bad = data.draw(st.sampled_from([np.nan, np.inf, 0.0, -0.0, -1.0]), label="scale")
        a[i:i + n] = np.array(bad, _NP[dtype]).tobytes()
    elif dtype == "F8_E4M3" and name.endswith("weight_scale"):  # nvfp4 group scales
        a[i] = data.draw(st.sampled_from([0x7F, 0xFF, 0x81, 0xC0]), label="byte")
    elif dtype == "F8_E4M3":
        a[i] = data.draw(st.sampled_from([0x7F, 0xFF]), label="byte")
    elif name.endswith("_scales"):  # mxfp4 e8m0
        a[i] = 255
    else:  # packed e2m1 codes: every code is a number, so there is no poison; make it a missing tensor
        _rewrite(root, file, lambda t: t.pop(name))
        return MUST_REFUSE
    if name.endswith("input_scale"):  # kept for W4A4 users, unread by the layer: not checked
        return EITHER
    _rewrite(root, file, lambda t: t.__setitem__(name, (dtype, shape, bytes(a))))
    return MUST_REFUSE


def c_drop(data, base, root):
    file, name = _pick_tensor(data, base)
    if name.endswith("input_scale"):
        return EITHER
    _rewrite(root, file, lambda t: t.pop(name))
    return MUST_REFUSE


def c_extra(data, base, root):
    """Tensors the layer does not read: other layers', other modules', odd names and dtypes."""
    file = data.draw(st.sampled_from(base.files), label="file")
    names = data.draw(st.lists(st.sampled_from([
        "model.layers.0.mlp.gate.weight", "model.layers.7.self_attn.q_proj.weight", "lm_head.weight",
        "model.layers.1.input_layernorm.weight", "x" * 200, "model.layers.99999999999999.mlp.gate.weight",
        "model.layers.1.mlp.experts.4.gate_proj.weight.bak"]), min_size=1, max_size=3, unique=True), label="extra")
    dtype = data.draw(st.sampled_from(["BF16", "F32", "I64", "U8", "F8_E4M3"]), label="dtype")

    def add(t):
        for k in names:
            if k not in t:
                t[k] = (dtype, [2, 3], bytes(6 * {"BF16": 2, "F32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}[dtype]))

    _rewrite(root, file, add)
    return BENIGN


def _index(root: Path) -> dict:
    p = root / "model.safetensors.index.json"
    if not p.exists():  # make the single-file checkpoint a one-shard one
        (root / "model.safetensors").rename(root / "model-00001-of-00001.safetensors")
        names = list(tensors_of(root / "model-00001-of-00001.safetensors"))
        p.write_text(json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    return json.loads(p.read_text())


def _write_index(root: Path, index) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


HOSTILE_NAMES = ["../x.safetensors", "../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors",
                 "..\\x.safetensors", "C:\\x.safetensors", "a\x00b", "~/x.safetensors", "x" * 300, ".", "sub",
                 "/dev/zero", "", "model.safetensors.index.json", "config.json"]


def c_index(data, base, root):
    """The index: hostile shard names, values that are no file names, moves into subdirectories,
    symlinks in and out."""
    index = _index(root)
    wm = index["weight_map"]
    shard = data.draw(st.sampled_from(sorted(set(wm.values()))), label="shard")
    mine = [n for n, f in wm.items() if f == shard]
    how = data.draw(st.sampled_from(["hostile", "not_a_name", "no_map", "subdir", "link_in", "link_out",
                                     "link_dir_out", "link_loop", "unrelated_missing"]), label="how")
    outside = root.parent / "x.safetensors"
    shutil.copy(root / shard, outside)
    if how == "hostile":
        name = data.draw(st.sampled_from(HOSTILE_NAMES), label="name")
        wm.update({n: name for n in mine})
        _write_index(root, index)
        return MUST_REFUSE
    if how == "not_a_name":
        wm[mine[0]] = data.draw(st.sampled_from([None, 5, [], {"a": 1}, True]), label="value")
        _write_index(root, index)
        return MUST_REFUSE
    if how == "no_map":
        _write_index(root, data.draw(st.sampled_from([{}, {"weight_map": []}, [], {"weight_map": None}]), label="idx"))
        return MUST_REFUSE
    if how == "subdir":
        (root / "sub" / "deeper").mkdir(parents=True)
        (root / shard).rename(root / "sub" / "deeper" / shard)
        wm.update({n: f"sub/deeper/{shard}" for n in mine})
        _write_index(root, index)
        return BENIGN
    if how == "link_in":
        (root / "store").mkdir()
        (root / shard).rename(root / "store" / shard)
        (root / shard).symlink_to(Path("store") / shard)
        return BENIGN
    if how == "link_out":
        (root / shard).unlink()
        (root / shard).symlink_to(data.draw(st.sampled_from([str(outside), "../x.safetensors"]), label="target"))
        return MUST_REFUSE
    if how == "link_dir_out":
        (root / "d").symlink_to(root.parent)
        wm.update({n: "d/x.safetensors" for n in mine})
        _write_index(root, index)
        return MUST_REFUSE
    if how == "link_loop":
        (root / shard).unlink()
        (root / shard).symlink_to(shard)
        return MUST_REFUSE
    # an unrelated tensor mapped to a shard that is not there: never opened
    wm["lm_head.weight"] = "model-99999-of-99999.safetensors"
    _write_index(root, index)
    return BENIGN


def c_json_bytes(data, base, root):
    """config.json or the index replaced by drawn bytes (not UTF-8, not JSON, deep, huge numbers)."""
    target = data.draw(st.sampled_from(["config.json", "model.safetensors.index.json"]), label="which")
    if target != "config.json":
        _index(root)
    payload = data.draw(st.one_of(st.binary(max_size=64), st.sampled_from([
        b"\xff\xfe{}", b"[" * 50_000, b'{"a": ' + b"9" * 5000 + b"}", b"null", b"[]", b'"s"', b"1e999",
        b'{"weight_map": {"a": "b"}}', b"{}", json.dumps(base.config).encode()[:-5]])), label="bytes")
    (root / target).write_bytes(payload)
    return EITHER


def c_config(data, base, root):
    """config.json with a key set to a hostile value: loads (with that meaning) or is refused."""
    key = data.draw(st.sampled_from(HF_KEYS), label="key")
    value = data.draw(HOSTILE, label="value")
    (root / "config.json").write_text(json.dumps({**base.config, key: value}))
    return EITHER


CORRUPTIONS = [c_truncate, c_flip_header, c_retype, c_reshape, c_poison, c_drop, c_extra, c_index,
               c_json_bytes, c_config]


@examples(450)
@given(data=st.data(), case=st.integers(0, len(CASES) - 1), corruption=st.sampled_from(CORRUPTIONS))
def test_drawn_checkpoint_corruptions_load_the_same_layer_or_are_refused(bases, data, case, corruption):
    base = bases[case]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(base.root, root, symlinks=True)
        expect = corruption(data, base, root)
        loaded = load_bounded(root, base.size)
    judge(base, expect, loaded, corruption.__name__, same=corruption is not c_config)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{f}-{fmt}" for f, fmt, _ in CASES])
def test_uncorrupted_checkpoints_load_the_reference_layer(bases, case):
    """The control: each base loads within the bounds and gives the reference output."""
    base = bases[case]
    loaded = load_bounded(base.root, base.size)
    assert loaded is not None
    assert_same_output(base, loaded)


# ----------------------------------------------------------------------------------
# the mapping form: tensors a caller already holds
# ----------------------------------------------------------------------------------

def mapping_of(base: Base) -> dict:
    out = {}
    for f in base.files:
        for name, (dtype, shape, raw) in tensors_of(base.root / f).items():
            out[name] = np.frombuffer(raw, _NP[dtype]).reshape(shape).copy()
    return out


NOT_ARRAYS = st.sampled_from([None, [1, 2], "x", 3.5, np.array(1.0), np.array([object()] * 2, dtype=object),
                              np.zeros((2, 2), np.complex64), b"bytes", {"a": 1}])


@examples(250)
@given(data=st.data(), case=st.integers(0, len(CASES) - 1),
       how=st.sampled_from(["not_an_array", "int_dtype", "wider", "nan", "drop", "extra", "reshape"]))
def test_drawn_tensor_mappings_load_the_same_layer_or_are_refused(bases, data, case, how):
    base = bases[case]
    t = mapping_of(base)
    name = data.draw(st.sampled_from(sorted(t)), label="tensor")
    a = t[name]
    expect, same = MUST_REFUSE, True
    if how == "not_an_array":
        t[name] = data.draw(NOT_ARRAYS, label="value")
        if a.ndim == 0:  # a scalar scale given as a Python number: another value, but a scale all the same
            expect, same = EITHER, False
    elif how == "int_dtype":
        t[name] = np.ones(a.shape, data.draw(st.sampled_from([np.int32, np.int8, np.bool_, np.int64]), label="dtype"))
    elif how == "wider" and a.dtype in (BF16, np.float32):
        t[name] = a.astype(np.float64)
        expect = EITHER if re.search(r"experts\.\d+\.", name) else BENIGN
    elif how == "nan" and a.dtype in (BF16, np.float32) and a.size:
        b = a.copy()
        b.reshape(-1)[data.draw(st.integers(0, a.size - 1), label="at")] = np.nan
        t[name] = b
    elif how == "extra":
        t.update({5: np.zeros(3), None: "x", "model.layers.1.mlp.unused": np.zeros((2, 2), np.float32)})
        expect = BENIGN
    elif how == "reshape":
        t[name] = a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1) if a.ndim == 1 else a.reshape(1, 1)
    else:  # drop (and the cases above that do not apply to this tensor)
        del t[name]
    if name.endswith("input_scale") and expect == MUST_REFUSE:
        expect = EITHER  # unread by the W4A16 layer
    loaded = refused_or(lambda: cupymoe.checkpoint.load_layer_from_tensors(base.config, t, "model.layers.1.mlp."))
    judge(base, expect, loaded, f"{how} of {name}", same)
