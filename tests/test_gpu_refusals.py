"""GPU: call refusals that need a device. A refused call names the argument and its value and
enqueues nothing: the output (poisoned with bf16 NaN) and the whole scratch region (poisoned
with a byte pattern) are untouched afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import testing
from cupymoe.errors import MoeCallError
from cupymoe.verify import bf16_bits, check, well_separated_input

pytestmark = pytest.mark.gpu

NAN = 0x7FC0  # bf16 NaN bits
POISON = 0xAB  # the scratch's bytes before a refused call


def _layer(rng, family="qwen3_moe", **overrides):
    from cupymoe import MoeLayer

    cfg = testing.tiny_config(family, **overrides)
    hw = testing.random_host_weights(cfg, rng)
    return cfg, hw, MoeLayer(cfg, hw, max_tokens=16, decode_max_tokens=16, atomic_max_tokens=16)


def _poison_scratch(layer) -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.runtime.memset(layer.workspace.scratch_base, POISON, layer.workspace.scratch_bytes)
    cupy.cuda.runtime.deviceSynchronize()


def _assert_nothing_ran(layer, *outs) -> None:
    """No launch of the layer ran: every scratch byte still the poison, every output still NaN."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    ws = layer.workspace
    mem = cupy.cuda.UnownedMemory(ws.scratch_base, ws.scratch_bytes, layer)
    scratch = cupy.ndarray((ws.scratch_bytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    assert int((scratch != POISON).sum()) == 0, "a refused call launched a kernel (the scratch changed)"
    for o in outs:
        assert int((o != NAN).sum()) == 0, "a refused call wrote to the output"


def _torch_bf16(torch, a: np.ndarray, device="cuda"):
    return torch.from_numpy(bf16_bits(a).view(np.int16)).view(torch.bfloat16).to(device)


def test_torch_out_and_token_ids_off_device_strided_short_or_mistyped_are_refused(rng):
    torch = pytest.importorskip("torch")
    cfg, hw, layer = _layer(rng, "deepseek_v3", hash_routing=True, hash_vocab_size=50, n_group=1, topk_group=1)
    n, H = 8, cfg.hidden_size
    ids_h = testing.random_token_ids(rng, n, 50)
    xh = well_separated_input(cfg, hw, rng, n, ids_h)
    x = _torch_bf16(torch, xh)
    ids = torch.from_numpy(ids_h).cuda()
    out = torch.full((n, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    bad_outs = {
        "on the host": torch.full((n, H), float("nan"), dtype=torch.bfloat16),
        "strided": torch.full((H, n), float("nan"), dtype=torch.bfloat16, device="cuda").t(),
        "short": torch.full((n - 1, H), float("nan"), dtype=torch.bfloat16, device="cuda"),
        "float16": torch.full((n, H), float("nan"), dtype=torch.float16, device="cuda"),
    }
    bad_ids = {
        "on the host": ids.cpu(),
        "strided": torch.stack([ids, ids], 1)[:, 0],
        "short": ids[: n - 1].clone(),
        "int64": ids.long(),
    }
    _poison_scratch(layer)
    for what, o in bad_outs.items():
        with pytest.raises(MoeCallError, match=r"out: expected a contiguous bfloat16 or uint16 array"):
            layer(x, out=o, token_ids=ids)
    for what, t in bad_ids.items():
        with pytest.raises(MoeCallError, match=r"token_ids: expected a contiguous int32 array \[8\]"):
            layer(x, out=out, token_ids=t)
    bits = [o.view(torch.int16) for o in bad_outs.values() if o.dtype == torch.bfloat16] + [out.view(torch.int16)]
    torch.cuda.synchronize()
    _assert_nothing_ran(layer)
    for b in bits:
        assert bool((b.cpu() == NAN).all()), "a refused call wrote to an output"
    # the same call with good arguments runs and is right
    layer(x, out=out, token_ids=ids)
    torch.cuda.synchronize()
    got = (out.view(torch.int16).cpu().numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert check(got, cfg, hw, xh, layer.select_path(n), ids.cpu().numpy(), layer=layer).ok


def test_out_overlapping_x_is_refused_and_adjacent_memory_is_not(rng):
    import cupy

    cfg, hw, layer = _layer(rng)
    n, H = 8, cfg.hidden_size
    xh = well_separated_input(cfg, hw, rng, n)
    buf = cupy.full((3 * n, H), NAN, cupy.uint16)
    buf[n:2 * n] = cupy.asarray(bf16_bits(xh))
    x = buf[n:2 * n]
    s = cupy.cuda.Stream(non_blocking=True)
    _poison_scratch(layer)
    # the same memory, a row either side, the last element's 16 bytes only
    for lo in (n, n - 1, n + 1, 2 * n - 1, 1):
        with pytest.raises(MoeCallError, match=r"output_ptr=0x[0-9a-f]+ overlaps input_ptr"):
            layer(x, out=buf[lo:lo + n], stream=s.ptr)
    with pytest.raises(MoeCallError, match="overlaps"):
        layer.forward(int(x.data.ptr), n, int(x.data.ptr) + (n * H * 2 - 16), s.ptr)
    s.synchronize()
    _assert_nothing_ran(layer, buf[:n], buf[2 * n:])
    assert bool((buf[n:2 * n] == cupy.asarray(bf16_bits(xh))).all()), "a refused call changed x"
    for out in (buf[:n], buf[2 * n:]):  # adjacent on either side: accepted, right
        layer(x, out=out, stream=s.ptr)
        s.synchronize()
        got = (cupy.asnumpy(out).astype(np.uint32) << 16).view(np.float32)
        assert check(got, cfg, hw, xh, layer.select_path(n), layer=layer).ok


@pytest.mark.parametrize("bad", [-16, 2**70, 2**64, -(2**64)])
def test_pointers_outside_the_address_space_are_refused_before_the_first_launch(rng, bad):
    """For every pointer argument, on every path: refused before the router or top-k is enqueued."""
    import cupy

    cfg, hw, layer = _layer(rng, "deepseek_v3", hash_routing=True, hash_vocab_size=50, n_group=1, topk_group=1)
    n = 4
    ids_h = testing.random_token_ids(rng, n, 50)
    x = cupy.asarray(bf16_bits(well_separated_input(cfg, hw, rng, n, ids_h)))
    out = cupy.full_like(x, NAN)
    ids = cupy.asarray(ids_h)
    s = cupy.cuda.Stream(non_blocking=True)
    good = dict(input_ptr=int(x.data.ptr), output_ptr=int(out.data.ptr), token_ids_ptr=int(ids.data.ptr))
    _poison_scratch(layer)
    for name in good:
        for path in ("decode", "atomic", "prefill"):
            with pytest.raises(MoeCallError, match=rf"{name}={bad}: not a device address"):
                layer.forward(num_tokens=n, stream=s.ptr, path=path, **{**good, name: bad})
    s.synchronize()
    _assert_nothing_ran(layer, out)


def test_raw_pointers_to_host_memory_are_refused_before_the_first_launch(rng):
    """A server's raw pointer into pageable host memory (or a stray address) would fault the kernels and
    leave the context unusable: refused by name, for each pointer, before anything is enqueued."""
    import cupy

    cfg, hw, layer = _layer(rng, "deepseek_v3", hash_routing=True, hash_vocab_size=50, n_group=1, topk_group=1)
    n = 4
    ids_h = testing.random_token_ids(rng, n, 50)
    x = cupy.asarray(bf16_bits(well_separated_input(cfg, hw, rng, n, ids_h)))
    ids = cupy.asarray(ids_h)
    out = cupy.full_like(x, NAN)
    host = np.zeros((n, cfg.hidden_size + 64), np.uint16)
    hp = (host.ctypes.data + 15) // 16 * 16  # 16-byte aligned, as the pointer checks want
    s = cupy.cuda.Stream(non_blocking=True)
    good = dict(input_ptr=int(x.data.ptr), output_ptr=int(out.data.ptr), token_ids_ptr=int(ids.data.ptr))
    _poison_scratch(layer)
    for name in good:
        with pytest.raises(MoeCallError, match=rf"{name}=0x{hp:x}: not CUDA memory"):
            layer.forward(num_tokens=n, stream=s.ptr, **{**good, name: hp})
    s.synchronize()
    _assert_nothing_ran(layer, out)


def test_experts_and_lora_id_pointers_to_host_memory_are_refused_before_the_first_launch(rng):
    """forward_experts' raw pointers (x, a server's router ids or weights left on the host, out) and
    forward's lora_ids_ptr into pageable host memory: refused by name, nothing enqueued."""
    import cupy

    from cupymoe import MoeLayer

    cfg = testing.tiny_config("qwen3_moe")
    hw = testing.random_host_weights(cfg, rng)
    layer = MoeLayer(cfg, hw, max_tokens=16, max_loras=2, max_lora_rank=4)
    n, k = 4, cfg.num_experts_per_tok
    x = cupy.asarray(bf16_bits(testing.random_input(rng, n, cfg.hidden_size)))
    ids = cupy.asarray(np.tile(np.arange(k, dtype=np.int32), (n, 1)))
    w = cupy.full((n, k), 1.0 / k, cupy.float32)
    out = cupy.full_like(x, NAN)
    host = np.zeros((n, cfg.hidden_size + 64), np.uint16)
    hp = (host.ctypes.data + 15) // 16 * 16
    s = cupy.cuda.Stream(non_blocking=True)
    good = dict(input_ptr=int(x.data.ptr), topk_ids_ptr=int(ids.data.ptr), topk_weights_ptr=int(w.data.ptr),
                output_ptr=int(out.data.ptr))
    _poison_scratch(layer)
    for name in good:
        with pytest.raises(MoeCallError, match=rf"{name}=0x{hp:x}: not CUDA memory"):
            layer.forward_experts(num_tokens=n, stream=s.ptr, **{**good, name: hp})
    with pytest.raises(MoeCallError, match=rf"lora_ids_ptr=0x{hp:x}: not CUDA memory"):
        layer.forward_experts(num_tokens=n, stream=s.ptr, lora_ids_ptr=hp, **good)
    with pytest.raises(MoeCallError, match=rf"lora_ids_ptr=0x{hp:x}: not CUDA memory"):
        layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr, lora_ids_ptr=hp)
    s.synchronize()
    _assert_nothing_ran(layer, out)
    layer.forward_experts(num_tokens=n, stream=s.ptr, **good)  # the same call on device memory runs
    s.synchronize()
    assert int((out == NAN).sum()) == 0


def test_arrays_on_another_device_are_refused(rng):
    """A CuPy x (or out, or token ids) on another GPU than the layer's: refused by name (needs two GPUs)."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs: an array on another device than the layer's")
    cfg, hw, layer = _layer(rng)
    n = 4
    xh = bf16_bits(well_separated_input(cfg, hw, rng, n))
    x, out = cupy.asarray(xh), cupy.full((n, cfg.hidden_size), NAN, cupy.uint16)
    with cupy.cuda.Device(1):
        x1, out1 = cupy.asarray(xh), cupy.full((n, cfg.hidden_size), NAN, cupy.uint16)
    _poison_scratch(layer)
    with pytest.raises(MoeCallError, match=r"x: expected .* on cuda:0, got cupy uint16 \[4, 96\] on cuda:1"):
        layer(x1, out=out)
    with pytest.raises(MoeCallError, match=r"out: expected .* on cuda:0, got cupy uint16 \[4, 96\] on cuda:1"):
        layer(x, out=out1)
    _assert_nothing_ran(layer, out)
    with cupy.cuda.Device(1):
        assert int((out1 != NAN).sum()) == 0


def test_each_flagged_forward_on_a_non_blocking_stream_raises_after_the_last_reset(rng):
    """check_errors resets the flags on the null stream, which a non-blocking caller stream does not wait
    for: unless the reset has finished when check_errors returns, it can land after the next forward's
    flags and erase them (a bad id then goes unreported). Flag, check, flag again, many times."""
    import cupy

    cfg, hw, layer = _layer(rng, "deepseek_v3", hash_routing=True, hash_vocab_size=50, n_group=1, topk_group=1)
    s = cupy.cuda.Stream(non_blocking=True)
    x = cupy.asarray(bf16_bits(rng.standard_normal((2, cfg.hidden_size)).astype(np.float32)))  # outputs unread
    out = cupy.zeros_like(x)
    bad = cupy.asarray(np.array([3, 99], np.int32))  # 99 >= hash_vocab_size: error bit 0
    for _ in range(50):
        layer.forward(int(x.data.ptr), 2, int(out.data.ptr), s.ptr, token_ids_ptr=int(bad.data.ptr))
        with pytest.raises(MoeCallError, match="bit 0 = a token id outside"):
            layer.check_errors()
    layer.check_errors()  # the flags were reset: nothing left to raise
