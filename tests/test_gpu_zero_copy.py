"""GPU: weights from torch CUDA tensors: used where they lie when already in the kernels' layout,
copied on the device (never through the host) when not, the layer's memory reported; the layer's
output bit for bit the host-loaded layer's."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from cupymoe import checkpoint, hf_layouts, testing
from cupymoe.formats import E4M3
from cupymoe.verify import bf16_bits, run_layer

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

LAYER = 1


def _hub(family, fmt, rng):
    cfg = testing.tiny_config(family)
    hw = testing.random_host_weights(cfg, rng, fmt)
    config = testing.hf_config_dict(family)
    if fmt == "fp8_block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    prefix = checkpoint.layer_prefix(family, LAYER)
    return cfg, hw, config, prefix, checkpoint._hub_tensors(cfg, hw, prefix)[0]


def _transformers5(tensors, prefix, hw):
    """The routed experts as transformers 5 holds them: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    (block fp8: their _scale_inv beside)."""
    base = prefix + hf_layouts.EXPERTS
    out = {k: v for k, v in tensors.items() if not k.startswith(base)}
    fp8 = hasattr(hw.gate, "q")
    for suffix, part in (("", "q" if fp8 else None), (hf_layouts.SCALE, "scale_inv" if fp8 else None)):
        if suffix and not fp8:
            continue
        g, u, d = ((getattr(t, part) if part else t) for t in (hw.gate, hw.up, hw.down))
        out[base + "gate_up_proj" + suffix] = np.concatenate([g, u], axis=1)
        out[base + "down_proj" + suffix] = np.ascontiguousarray(d)
    return out


def _cuda(a):
    """A host array as the torch CUDA tensor a loaded model holds (bf16 / fp8 / float32)."""
    a = np.ascontiguousarray(a)
    if a.dtype == testing.BF16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    if a.dtype == E4M3:
        return torch.from_numpy(a.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(a).cuda()


def _pool_used():
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    return cupy.get_default_memory_pool().used_bytes()


CASES = {  # (family, format, layout): what is borrowed in each is asserted below
    "qwen2_moe-bf16-transformers5": ("qwen2_moe", "bf16", "transformers5"),
    "deepseek_v3-fp8-transformers5": ("deepseek_v3", "fp8_block", "transformers5"),
    "mixtral-bf16-hub": ("mixtral", "bf16", "hub"),
    "gpt_oss-mxfp4-hub": ("gpt_oss", "mxfp4", "hub"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_weights_from_torch_cuda_tensors(name, rng, monkeypatch):
    from cupymoe import MoeLayer

    family, fmt, layout = CASES[name]
    cfg, hw, config, prefix, tensors = _hub(family, fmt, rng)
    if layout == "transformers5":
        tensors = _transformers5(tensors, prefix, hw)
    on_gpu = {k: _cuda(v) for k, v in tensors.items()}
    host = MoeLayer.from_hf(config, tensors, prefix, max_tokens=16)

    def no_host(t):  # the device path must never bring a CUDA tensor to the host
        assert not (hasattr(t, "device") and getattr(t.device, "type", None) == "cuda"), "a CUDA tensor went to the host"
        return to_numpy(t)

    to_numpy = checkpoint._to_numpy
    monkeypatch.setattr(checkpoint, "_to_numpy", no_host)
    gc.collect()  # an earlier test's garbage freed mid-build would lower torch's count
    torch_before, pool_before = torch.cuda.memory_allocated(), _pool_used()
    layer = MoeLayer.from_hf(config, on_gpu, prefix, max_tokens=16)
    torch_after, pool_after = torch.cuda.memory_allocated(), _pool_used()
    report = layer.memory_report()
    print(name, report)
    assert torch_after == torch_before  # nothing allocated through torch's allocator
    # CuPy's pool holds exactly what the layer reports as its own (its workspace is a plain cudaMalloc)
    assert report.added <= pool_after - pool_before <= report.added + 512 * 96, (pool_after - pool_before, report)
    router = on_gpu[prefix + checkpoint.naming_for(family).router + ".weight"]
    if layout == "transformers5":  # down_proj and the router are the kernels' layout: borrowed in place
        down = on_gpu[prefix + "experts.down_proj"]
        assert layer.weights.experts["down"].data.ptr == down.data_ptr()
        assert layer.weights.router.data.ptr == router.data_ptr()
        assert report.weights_borrowed >= down.nbytes + router.nbytes
        # gate_up_proj's halves are copied on the device into their own stacks (TMA reads each whole)
        assert report.weights_owned >= 2 * layer.weights.experts["gate"].nbytes
    elif fmt == "bf16":  # per-expert hub tensors: stacked on the device (owned), the router borrowed
        assert layer.weights.router.data.ptr == router.data_ptr()
        assert report.weights_owned >= sum(layer.weights.experts[p].nbytes for p in ("gate", "up", "down"))
    else:  # mxfp4: the codes are the layer's own (repacked); the router borrowed
        assert layer.weights.router.data.ptr == router.data_ptr()
    n = 5
    x = testing.random_input(rng, n, cfg.hidden_size)
    for path in ("decode", "prefill"):
        want, got = run_layer(host, x, path), run_layer(layer, x, path)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name} {path}: differs from the host layer"
    assert bf16_bits(x).shape == (n, cfg.hidden_size)
