"""Weights no kernel can use are refused by value, not only by shape (CPU).

HostWeights.validate, checkpoint.load_layer and load_layer_from_tensors refuse, with a
cupymoe.WeightError naming the tensor, the first offending index and its value: Inf / NaN in
float weights and vectors, e4m3 NaN codes in fp8 weights, fp8 block scales and nvfp4 global
scales that are not finite and > 0, NaN or negative nvfp4 group scales, and e8m0 exponent 255.
Before, all of these loaded (the scales were only looked at by the device upload, and 0 or a
negative scale not even there) and came out as NaN or silently wrong outputs. The checks run on
the raw bits in chunks, over threads for large host arrays, and on the device for CuPy arrays
(here a stand-in that refuses to be copied to the host).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from _fakes import FakeDeviceArray
from cupymoe import WeightError, checkpoint, formats
from cupymoe.checkpoint import load_layer, load_layer_from_tensors
from cupymoe.config import MoeConfig
from cupymoe.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from cupymoe.host_weights import HostWeights
from cupymoe.testing import hf_config_dict, random_host_weights, tiny_config

BF16 = np.dtype(ml_dtypes.bfloat16)
LAYER = 1


def _set(a, idx, value):
    """A copy of float array `a` with a[idx] = value."""
    a = np.array(a, copy=True)
    a[idx] = value
    return a


# ----------------------------------------------------------------------------------
# HostWeights.validate
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family, field, idx", [
    ("qwen3_moe", "gate", (3, 5, 7)), ("qwen3_moe", "down", (14, 95, 63)), ("qwen3_moe", "router", (0, 0)),
    ("qwen2_moe", "shared_up", (2, 9)), ("qwen2_moe", "shared_expert_gate", (17,)),
    ("gpt_oss", "router_bias", (8,)), ("gpt_oss", "gate_bias", (1, 2)), ("gpt_oss", "down_bias", (8, 95)),
    ("deepseek_v3", "correction_bias", (15,)), ("qwen3_moe+norm", "norm_weight", (4,)),
])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_validate_refuses_non_finite_weights_and_vectors(family, field, idx, bad):
    family, _, norm = family.partition("+")
    cfg = tiny_config(family, pre_expert_norm=bool(norm))
    hw = random_host_weights(cfg, np.random.default_rng(1))
    setattr(hw, field, _set(getattr(hw, field), idx, bad))
    with pytest.raises(WeightError) as info:
        hw.validate(cfg)
    msg = str(info.value)
    assert msg.startswith(f"HostWeights.{field}[{', '.join(map(str, idx))}] = {float(bad)!r} (bits 0x"), msg
    assert "not finite; only finite weights can be served" in msg
    hw.validate(cfg, values=False)  # shapes alone still pass


def test_validate_refuses_finite_values_the_upload_would_round_to_inf():
    """3.4e38 is a float32 but no bf16: the matrices are uploaded as bf16 and the vectors as float32 (a
    float64 1e39 bias), so such a value was served as Inf though validate passed it. The largest value
    that still rounds to a finite one passes, in each dtype and rounding."""
    cfg = tiny_config("deepseek_v3")
    hw = random_host_weights(cfg, np.random.default_rng(3))
    f32_floor = np.array(0x7F7F8000, np.uint32).view(np.float32)  # bf16's largest + half an ulp: a tie, to Inf
    cases = [("gate", np.float32, f32_floor, "bfloat16"),
             ("gate", np.float64, float(np.nextafter(np.float32(f32_floor), np.float32(0))) + 2.0 ** 103, "bfloat16"),
             ("correction_bias", np.float64, float(np.finfo(np.float32).max) + 2.0 ** 103, "float32")]
    for field, dtype, bad, served in cases:
        good = getattr(hw, field)
        t = np.asarray(good, np.float64).astype(dtype)
        idx = (1,) * t.ndim
        t[idx] = -bad
        setattr(hw, field, t)
        with pytest.raises(WeightError, match=rf"HostWeights\.{field}\[{', '.join(['1'] * t.ndim)}\] = .*: past "
                                              f"{served}'s range: it would be served as Inf"):
            hw.validate(cfg)
        t[idx] = np.nextafter(dtype(-bad), dtype(0))  # the largest magnitude still finite once served
        hw.validate(cfg)
        setattr(hw, field, good)


def test_validate_refuses_unusable_quantized_values():
    cfg = tiny_config("qwen3_moe")
    rng = np.random.default_rng(2)
    fp8 = random_host_weights(cfg, rng, "fp8_block")
    for code in (0x7F, 0xFF):  # e4m3fn's two NaNs
        fp8.gate.q.view(np.uint8)[2, 5, 7] = code
        with pytest.raises(WeightError, match=rf"HostWeights\.gate\.q\[2, 5, 7\] = byte 0x{code:02X}: an e4m3 NaN "
                                              "code; only finite weights"):
            fp8.validate(cfg)
    fp8.gate.q.view(np.uint8)[2, 5, 7] = 0x7E  # 448: the largest finite code
    fp8.validate(cfg)
    for bad in (0.0, -0.0, -1.0, np.inf, np.nan):
        scale = fp8.up.scale_inv.copy()
        fp8.up.scale_inv[4, 0, 0] = bad
        with pytest.raises(WeightError, match=rf"HostWeights\.up\.scale_inv\[4, 0, 0\] = {bad!r}: not a usable "
                                              r"scale \(1 such in 15\); expected a finite scale > 0"):
            fp8.validate(cfg)
        fp8.up.scale_inv = scale

    nv = random_host_weights(cfg, rng, "nvfp4")
    for bad in (0.0, -2.0, np.inf, np.nan):
        nv.down.scale_2[11] = bad
        with pytest.raises(WeightError, match=rf"HostWeights\.down\.weight_scale_2\[11\] = {bad!r}: not a usable "
                                              "scale"):
            nv.validate(cfg)
        with pytest.raises(WeightError, match=r"down\.weight_scale_2\[11\]"):  # the upload's check too
            nv.down.check_scales("down")
        nv.down.scale_2[11] = 1.0
    bits = nv.gate.scale.view(np.uint8)
    for code in (0x7F, 0xFF, 0x81, 0xB8):  # NaN, NaN, the smallest negative, -1.0
        old = bits[1, 2, 3]
        bits[1, 2, 3] = code
        with pytest.raises(WeightError, match=rf"HostWeights\.gate\.weight_scale\[1, 2, 3\] = byte 0x{code:02X}: "
                                              r"not a usable scale .*expected an e4m3 scale >= 0 that is not NaN"):
            nv.validate(cfg)
        bits[1, 2, 3] = old
    bits[1, 2, 3] = 0x80  # -0: a zero scale, as 0x00
    nv.validate(cfg)

    gcfg = tiny_config("gpt_oss")
    mx = random_host_weights(gcfg, rng, "mxfp4")
    mx.up.scales[0, 1, 2] = 255
    with pytest.raises(WeightError, match=r"HostWeights\.up\.scales\[0, 1, 2\] = byte 0xFF: not a usable scale "
                                          r"\(1 such in .*expected an e8m0 exponent byte 0\.\.254"):
        mx.validate(gcfg)
    mx.up.scales[0, 1, 2] = 254
    mx.validate(gcfg)


def test_non_float_plain_weights_are_refused():
    cfg = tiny_config("mixtral")
    hw = random_host_weights(cfg, np.random.default_rng(3))
    hw.router = np.asarray(hw.router).view(np.int16)
    with pytest.raises(WeightError, match=r"HostWeights\.router: expected a float array .*found dtype int16"):
        hw.validate(cfg)


# ----------------------------------------------------------------------------------
# the checks themselves: chunks, threads, strides, the device
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32, np.float64])
def test_first_bad_element_is_found_across_chunks_threads_and_strides(monkeypatch, dtype):
    """Tiny chunks and thread spans, so a 3-D array spans many of both: the reported index is the
    first offending one in C order, wherever it lies, in contiguous and strided arrays alike."""
    monkeypatch.setattr(formats, "CHECK_CHUNK", 64)
    monkeypatch.setattr(formats, "_PARALLEL_SPAN", 256)
    rng = np.random.default_rng(4)
    base = rng.standard_normal((6, 40, 50)).astype(dtype)
    formats.check_finite(base, "w")
    formats.check_finite(base.transpose(0, 2, 1), "w")
    for positions in ([(5, 39, 49)], [(0, 0, 0), (3, 3, 3)], [(4, 1, 2), (2, 30, 7)], [(1, 2, 3), (1, 2, 2)]):
        a = base.copy()
        for k, p in enumerate(positions):
            a[p] = [np.nan, -np.inf][k % 2]
        first = min(positions)
        with pytest.raises(WeightError, match=rf"^w\[{', '.join(map(str, first))}\] = "):
            formats.check_finite(a, "w")
        t = a.transpose(0, 2, 1)  # strided: pieces are copies of bounded size
        first_t = min((p[0], p[2], p[1]) for p in positions)
        with pytest.raises(WeightError, match=rf"^w\[{', '.join(map(str, first_t))}\] = "):
            formats.check_finite(t, "w")


def test_every_e4m3_and_bf16_bit_pattern_is_classified_as_numpy_does():
    codes = np.arange(256, dtype=np.uint8)
    for c in range(256):
        nan = np.isnan(codes[c:c + 1].view(ml_dtypes.float8_e4m3fn).astype(np.float32))[0]
        if nan:
            with pytest.raises(WeightError):
                formats.check_e4m3_codes(codes[c:c + 1], "q")
        else:
            formats.check_e4m3_codes(codes[c:c + 1], "q")
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = np.isfinite(bits.view(BF16).astype(np.float32))
    for lo in range(0, 1 << 16, 4096):
        piece = bits[lo:lo + 4096]
        bad = ~finite[lo:lo + 4096]
        if bad.any():
            with pytest.raises(WeightError, match=rf"^b\[{int(np.argmax(bad))}\] = "):
                formats.check_finite(piece.view(BF16), "b")
        else:
            formats.check_finite(piece.view(BF16), "b")
    f32 = np.array([0.0, -0.0, 1e-45, 1.0, 3.4028235e38, np.inf, -1e-45, np.nan], np.float32)
    for v in f32:
        ok = np.isfinite(v) and v > 0
        if ok:
            formats.check_positive_scales(np.array([v], np.float32), "s")
        else:
            with pytest.raises(WeightError):
                formats.check_positive_scales(np.array([v], np.float32), "s")


def test_device_arrays_are_checked_on_the_device():
    """CuPy weights (the benchmark draws its weights on the device) go through the same checks
    through the array's own methods: only scalars come back, never the array."""
    cfg = tiny_config("qwen3_moe")
    hw = random_host_weights(cfg, np.random.default_rng(5))
    dev = HostWeights(**{f: FakeDeviceArray(np.ascontiguousarray(getattr(hw, f)).view(np.uint16))
                         for f in ("router", "gate", "up", "down")})
    FakeDeviceArray.host_scalars = 0
    dev.validate(cfg)
    assert 0 < FakeDeviceArray.host_scalars < 20
    bad = np.ascontiguousarray(hw.up).view(np.uint16).copy()
    bad[7, 1, 2] = 0xFF80  # -inf
    dev.up = FakeDeviceArray(bad)
    with pytest.raises(WeightError, match=r"HostWeights\.up\[7, 1, 2\] = -inf \(bits 0xFF80\): not finite"):
        dev.validate(cfg)

    q = np.zeros((15, 64, 96), np.uint8)
    s = np.ones((15, 1, 1), np.float32)
    f8 = Fp8BlockWeight(FakeDeviceArray(q), FakeDeviceArray(s))
    f8.check_values("gate")
    q[3, 2, 1] = 0xFF
    with pytest.raises(WeightError, match=r"gate\.q\[3, 2, 1\] = byte 0xFF: an e4m3 NaN code"):
        f8.check_values("gate")
    s[9, 0, 0] = 0.0
    with pytest.raises(WeightError, match=r"gate\.scale_inv\[9, 0, 0\] = 0\.0: not a usable scale"):
        f8.check_scales("gate")
    nv = Nvfp4Weight(FakeDeviceArray(np.zeros((2, 8, 16), np.uint8)),
                     FakeDeviceArray(np.full((2, 8, 2), 0x38, np.uint8)), np.array([1.0, -1.0], np.float32))
    with pytest.raises(WeightError, match=r"up\.weight_scale_2\[1\] = -1\.0"):
        nv.check_values("up")
    scales = np.full((2, 8, 1), 127, np.uint8)
    scales[1, 7, 0] = 255
    mx = Mxfp4Weight(FakeDeviceArray(np.zeros((2, 8, 1, 16), np.uint8)), FakeDeviceArray(scales))
    with pytest.raises(WeightError, match=r"down\.scales\[1, 7, 0\] = byte 0xFF"):
        mx.check_values("down")


# ----------------------------------------------------------------------------------
# at load: named by the hub tensor
# ----------------------------------------------------------------------------------

def _saved(family: str, fmt: str, rng, qconfig=None):
    """config.json and the hub tensors save_layer would write (safetensors.numpy cannot read F8 back)."""
    config = hf_config_dict(family)
    if qconfig:
        config["quantization_config"] = qconfig
    cfg = MoeConfig.from_hf(config, LAYER)
    hw = random_host_weights(cfg, rng, fmt)
    tensors, _ = checkpoint._hub_tensors(cfg, hw, checkpoint.layer_prefix(family, LAYER))
    return config, tensors


def _write(root, config, tensors):
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(root / "model.safetensors"))
    return root


P = "model.layers.1.mlp."


@pytest.mark.parametrize("family, fmt, name, idx, raw, why", [
    ("qwen3_moe", "bf16", P + "experts.13.up_proj.weight", (5, 7), 0x7FC0, r"= nan \(bits 0x7FC0\): not finite"),
    ("qwen3_moe", "bf16", P + "gate.weight", (14, 95), 0x7F80, r"= inf \(bits 0x7F80\): not finite"),
    ("deepseek_v3", "bf16", P + "gate.e_score_correction_bias", (3,), np.float32(-np.inf), "= -inf"),
    ("qwen2_moe", "bf16", P + "shared_expert_gate.weight", (0, 11), np.float32(np.nan), "= nan"),
    ("gpt_oss", "bf16", P + "experts.gate_up_proj", (8, 95, 127), 0x7F80, "= inf"),
    ("gpt_oss", "bf16", P + "router.bias", (2,), np.float32(np.nan), "= nan"),
    ("deepseek_v3", "fp8_block", P + "experts.7.down_proj.weight", (100, 3), 0x7F, "= byte 0x7F: an e4m3 NaN code"),
    ("deepseek_v3", "fp8_block", P + "experts.2.gate_proj.weight_scale_inv", (0, 1), np.float32(0.0),
     r"= 0\.0: not a usable scale \(1 such in 2\); expected a finite scale > 0"),
    ("qwen3_moe", "nvfp4", P + "experts.0.down_proj.weight_scale_2", (), np.float32(-1.0), r"= -1\.0: not a usable"),
    ("qwen3_moe", "nvfp4", P + "experts.4.up_proj.weight_scale", (6, 5), 0xC0, "= byte 0xC0: not a usable scale"),
    ("gpt_oss", "mxfp4", P + "experts.down_proj_scales", (1, 2, 1), 255, "= byte 0xFF: not a usable scale"),
])
def test_load_refuses_unusable_values_naming_the_hub_tensor(tmp_path, family, fmt, name, idx, raw, why):
    """Each refused at load, by file and by mapping, naming the hub tensor and the index in it."""
    qconfig = {"fp8_block": {"quant_method": "fp8", "weight_block_size": [128, 128]},
               "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
               "mxfp4": {"quant_method": "mxfp4"}}.get(fmt)
    config, t = _saved(family, fmt, np.random.default_rng(6), qconfig)
    a = t[name].copy()
    if isinstance(raw, np.floating):
        a[idx] = raw
    else:
        a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)[idx] = raw
    t[name] = a
    root = _write(tmp_path / "bad", config, t)
    at = f"[{', '.join(map(str, idx))}]" if idx else ""
    pattern = rf"^{name.replace('.', chr(92) + '.')}{at.replace('[', chr(92) + '[')} {why}"
    with pytest.raises(WeightError, match=pattern):
        load_layer(root, LAYER)
    with pytest.raises(WeightError, match=pattern):
        load_layer_from_tensors(config, t, P)
