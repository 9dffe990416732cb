// wgmma (sm_90a) helpers shared by the Hopper grouped GEMMs (grouped_sm90.cu: bf16,
// grouped_sm90_fp8.cu: w8a8 e4m3): the shared-memory descriptor of a K-major, 128-byte
// swizzled tile, the fences and waits.
#pragma once
#include "common.cuh"

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row atoms 1024 bytes apart.
__device__ __forceinline__ u64 wgmma_desc(const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    u64 d = (u64)((a & 0x3FFFF) >> 4);
    d |= (u64)1 << 16;            // leading byte offset: unused with a swizzled K-major layout
    d |= (u64)(1024 >> 4) << 32;  // stride byte offset: from one 8-row atom to the next
    d |= (u64)1 << 62;            // 128-byte swizzle
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving accumulator uses across the asynchronous wgmmas.
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
