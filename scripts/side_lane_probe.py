"""Where a small kernel B runs against a many-wave kernel A that a PDL chain launched: B as A's
PDL successor (today's LoRA per-pair kernels: launched once A's last wave has started), B forked
onto a second stream (with and without a higher priority), or B before A in the chain (A waiting
for it, or not). A: 1536 blocks of 160 threads and 88 KB of shared memory (two an SM, as the
swap-AB decode), 600 KB streamed a block; B: 90 MB over 512 blocks (132 where it goes first).
Times inside one replayed CUDA graph by %globaltimer stamps, µs from the chain's first kernel.

    python3 scripts/side_lane_probe.py        (a GPU; prints one line a form, then the JSON)
"""
import ctypes
import json
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cupymoe.launch import (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION as PDL, Driver,  # noqa: E402
                            LaunchConfig, _dims, _LaunchAttribute)

CU_LAUNCH_ATTRIBUTE_PRIORITY = 8

SRC = r'''
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ float stream_bytes(const float4* p, long n4) {
  float s = 0.f;
  for (long i = threadIdx.x; i < n4; i += blockDim.x) { float4 v = __ldcs(p + i); s += v.x + v.y + v.z + v.w; }
  return s;
}
extern "C" __global__ void k_small(unsigned long long* st) { pdl_wait(); if (threadIdx.x == 0) st[0] = now(); }
// wait: 1 waits at the top (PDL), 2 only block 0 at the end, 3 releases its successor at once
extern "C" __global__ void k_stream(const float4* buf, long per_block4, long total4, unsigned long long* st,
                                   float* sink, int wait) {
  extern __shared__ float smem[];
  unsigned long long t0 = now();
  if (wait == 1) pdl_wait();
  if (wait == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  long off = ((long)blockIdx.x * per_block4) % (total4 - per_block4);
  float s = stream_bytes(buf + off, per_block4);
  smem[threadIdx.x] = s;
  __syncthreads();
  if (wait == 2 && blockIdx.x == 0) pdl_wait();  // the grid completes after the one it follows
  if (threadIdx.x == 0) {
    st[2 * blockIdx.x] = t0;
    st[2 * blockIdx.x + 1] = now();
    if (smem[0] == 123.f) sink[0] = s;  // keeps the loads
  }
}
'''

mod = cp.RawModule(code=SRC, options=("-arch=sm_90a",))
k_small = mod.get_function("k_small").kernel
k_stream = mod.get_function("k_stream").kernel
drv = cp.cuda.driver
drv.funcSetAttribute(k_stream.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100 * 1024)

buf = cp.ones(1 << 29, dtype=cp.float32)  # 2 GB: A's blocks stream 900 MB, B's 90 MB from the second GB
total4 = buf.size // 4
sink = cp.zeros(4, cp.float32)
A_BLOCKS, A_PER = 1536, 600 * 1024 // 16
B_BLOCKS, B_PER = 512, 176 * 1024 // 16
stA, stB = cp.zeros(2 * A_BLOCKS, cp.uint64), cp.zeros(2 * B_BLOCKS, cp.uint64)  # each block's start, end
st0, st9 = cp.zeros(2, cp.uint64), cp.zeros(2, cp.uint64)  # the chain's first and last kernels

keep = []  # launch configurations and arguments outlive their launches


def launch(fn, grid, block, smem, stream, args, pdl=False, priority=None):
    attrs = []
    if pdl:
        a = _LaunchAttribute(id=PDL)
        a.value.programmatic_stream_serialization_allowed = 1
        attrs.append(a)
    if priority is not None:
        a = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PRIORITY)
        ctypes.c_int.from_buffer(a.value, 0).value = priority
        attrs.append(a)
    arr = (_LaunchAttribute * max(1, len(attrs)))(*attrs) if attrs else None
    cfg = LaunchConfig(_dims(grid), _dims(block), smem, stream,
                       ctypes.cast(arr, ctypes.POINTER(_LaunchAttribute)) if arr else None, len(attrs))
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(c) for c in args])
    keep.extend([cfg, arr, args, ptrs])
    Driver.check(Driver.lib().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.ptr), ptrs, None), "launch")


def u64(v):
    return ctypes.c_uint64(int(v))


def i64(v):
    return ctypes.c_int64(int(v))


def i32(v):
    return ctypes.c_int32(int(v))


def a_args(wait=1):
    return [u64(buf.data.ptr), i64(A_PER), i64(total4), u64(stA.data.ptr), u64(sink.data.ptr), i32(wait)]


B_OFF4 = 64 * 1024 * 1024  # B streams from the second GB
B_FEW = 132  # B's blocks where it goes first (one an SM, its bytes the same)


def b_args(wait, per=None):
    return [u64(buf.data.ptr + 16 * B_OFF4), i64(per or B_PER), i64(total4 - B_OFF4), u64(stB.data.ptr),
            u64(sink.data.ptr), i32(wait)]


main = cp.cuda.Stream(non_blocking=True)
_lo, _hi = ctypes.c_int(), ctypes.c_int()
Driver.check(Driver.lib().cuCtxGetStreamPriorityRange(ctypes.byref(_lo), ctypes.byref(_hi)), "priority range")
lo, hi = _lo.value, _hi.value
side = {p: cp.cuda.Stream(non_blocking=True, priority=p) for p in (lo, hi)}
ev1, ev2 = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)


def forward(mode):
    launch(k_small, (1,), (32,), 0, main.ptr, [u64(st0.data.ptr)], pdl=True)
    if mode == "chain":  # today: B a PDL successor of A
        launch(k_stream, (A_BLOCKS,), (160,), 88 * 1024, main.ptr, a_args(), pdl=True)
        launch(k_stream, (B_BLOCKS,), (256,), 1024, main.ptr, b_args(1), pdl=True)
    elif mode == "b_first":  # B before A in the chain, 132 blocks, released at once; A skips its start wait
        launch(k_stream, (B_FEW,), (256,), 1024, main.ptr, b_args(3, B_PER * B_BLOCKS // B_FEW), pdl=True)
        launch(k_stream, (A_BLOCKS,), (160,), 88 * 1024, main.ptr, a_args(2), pdl=True)
    elif mode == "b_first_wait":  # the same, A waiting at its start (for B's completion)
        launch(k_stream, (B_FEW,), (256,), 1024, main.ptr, b_args(3, B_PER * B_BLOCKS // B_FEW), pdl=True)
        launch(k_stream, (A_BLOCKS,), (160,), 88 * 1024, main.ptr, a_args(1), pdl=True)
    elif mode == "fork_early":  # B forked after k_small; A behind one more 1-block link
        ev1.record(main)
        side[hi].wait_event(ev1)
        launch(k_stream, (B_FEW,), (256,), 1024, side[hi].ptr, b_args(0, B_PER * B_BLOCKS // B_FEW), priority=hi)
        ev2.record(side[hi])
        launch(k_small, (1,), (32,), 0, main.ptr, [u64(st0.data.ptr + 8)], pdl=True)
        launch(k_stream, (A_BLOCKS,), (160,), 88 * 1024, main.ptr, a_args(), pdl=True)
        main.wait_event(ev2)
    elif mode == "alone":
        launch(k_stream, (A_BLOCKS,), (160,), 88 * 1024, main.ptr, a_args(), pdl=True)
    else:  # fork_lo / fork_hi / fork_hi_attr: B forked after k_small (that stream's priority, and the
        # launch's), A the first kernel's PDL successor
        s = side[lo if mode == "fork_lo" else hi]
        ev1.record(main)
        s.wait_event(ev1)
        launch(k_stream, (B_BLOCKS,), (256,), 1024, s.ptr, b_args(0), priority=hi if mode == "fork_hi_attr" else None)
        ev2.record(s)
        launch(k_stream, (A_BLOCKS,), (160,), 88 * 1024, main.ptr, a_args(), pdl=True)
        main.wait_event(ev2)
    launch(k_small, (1,), (32,), 0, main.ptr, [u64(st9.data.ptr)], pdl=True)


out = {"priority_range": [lo, hi]}
for mode in ("alone", "chain", "fork_lo", "fork_hi", "fork_hi_attr", "fork_early", "b_first", "b_first_wait"):
    main.begin_capture()
    forward(mode)
    g = main.end_capture()
    g.upload(main)
    for _ in range(20):
        g.launch(main)
    main.synchronize()
    spans, bstart, bend, aend = [], [], [], []
    for _ in range(15):
        g.launch(main)
        main.synchronize()
        t0 = int(st0.get()[0])
        a, b = stA.get().astype(np.int64) - t0, stB.get().astype(np.int64) - t0
        spans.append((int(st9.get()[0]) - t0) / 1e3)
        aend.append(a[1::2].max() / 1e3)
        if mode != "alone":
            nb = B_FEW if mode in ("b_first", "b_first_wait", "fork_early") else B_BLOCKS
            bstart.append(np.median(b[0:2 * nb:2]) / 1e3); bend.append(b[1:2 * nb:2].max() / 1e3)
    out[mode] = dict(span_us=float(np.median(spans)), a_end_us=float(np.median(aend)),
                     b_median_start_us=float(np.median(bstart)) if bstart else None,
                     b_end_us=float(np.median(bend)) if bend else None)
    print(mode, out[mode], flush=True)
print(json.dumps(out))
