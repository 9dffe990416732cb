// wgmma (sm_90a) helpers shared by the Hopper grouped GEMMs (grouped_sm90.cu: bf16,
// grouped_sm90_fp8.cu: w8a8 e4m3): the shared-memory descriptor of a K-major, 128-byte
// swizzled tile, the fences and waits.
#pragma once
#include "common.cuh"
#include "gemm_common.cuh"

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row atoms 1024 bytes apart.
__device__ __forceinline__ u64 wgmma_desc(const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    u64 d = (u64)((a & 0x3FFFF) >> 4);
    d |= (u64)1 << 16;            // leading byte offset: unused with a swizzled K-major layout
    d |= (u64)(1024 >> 4) << 32;  // stride byte offset: from one 8-row atom to the next
    d |= (u64)1 << 62;            // 128-byte swizzle
    return d;
}

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte rows (128 e4m3 codes or 64
// bf16 values a row): the 128-byte swizzle (chunk XOR row mod 8) wgmma_desc declares.
__device__ __forceinline__ int swz128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// mbarriers in shared memory (the warp-specialized kernels' stage handshakes) and TMA.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// makes the initialized barriers visible to the async proxy (TMA) before anyone uses them
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// one arrival that also announces `bytes` still to land through complete_tx (the TMA copies)
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}
// A 2-D TMA copy of one box of the tensor map at `tmap` (global memory, 64-byte aligned,
// cupymoe/tma.py) at coordinates (c0 innermost, c1) into shared memory at `dst`, counted on
// `bar` as completed transaction bytes. Parts of the box outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tmap, int c0, int c1, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_u32(dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
}
// A 2-D TMA store of one box from shared memory at `src` to the tensor of `tmap` at
// (c0 innermost, c1); parts of the box outside the tensor are not written. Its reads of
// `src` are tracked by the issuing thread's bulk groups (commit, then wait_group.read).
__device__ __forceinline__ void tma_store_2d(const void* tmap, int c0, int c1, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(tmap), "r"(c0), "r"(c1), "r"(smem_u32(src)) : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The down epilogue of a warpgroup whose 64 rows all lie in the tile, by TMA store: the
// weighted bf16 outputs (stage_down_outputs, as emit_wgmma_down_staged's) written into the
// warpgroup's A blocks as BN / 64 boxes of 64 x 64 in TMA's 128-byte swizzle (box b in
// stage b's block), then one thread stores them to yw and waits only until they are read
// out of shared memory: the warpgroup's threads issue no 16-byte loads and stores of their
// own (the stores were a large share of a short-K down's warp samples). Columns past H are
// not written (the map's extent). A warpgroup of fewer rows keeps emit_wgmma_down_staged:
// a box would write the next tile's rows.
template <int BN, int S>
__device__ __forceinline__ void emit_wgmma_down_tma(const GemmTile& t, const float* d, const float (&w)[2], int row0,
                                                    bf16* a0, int stage_elems, const u8* map_yw, GEMM_ARGS) {
    static_assert(BN / 64 <= S, "a box in each stage's block");
    const int wt = threadIdx.x & 127, wg_bar = 1 + (threadIdx.x >> 7);  // barrier 0 is __syncthreads
    const FragRows fr(0, 64);
    const int t4 = fr.t4, r = fr.r;
    auto at = [&](int r, int c) -> unsigned char* {  // row r's 16-byte chunk c: box c / 8, swizzled by row
        return reinterpret_cast<unsigned char*>(a0 + (size_t)(c >> 3) * stage_elems) + r * 128 +
               (((c & 7) ^ (r & 7)) << 4);
    };
    const float* bias = reinterpret_cast<const float*>(b0_ptrs[t.slot]);
    asm volatile("bar.sync %0, 128;\n" ::"r"(wg_bar) : "memory");  // every warp's wgmmas have read A
    stage_down_outputs<BN>(t, d, w, r, t4, bias, at);
    fence_proxy_async();  // the generic proxy's writes, before the async proxy reads them
    asm volatile("bar.sync %0, 128;\n" ::"r"(wg_bar) : "memory");
    if (wt == 0) {
#pragma unroll
        for (int b = 0; b < BN / 64; ++b)
            if (t.n0 + 64 * b < t.ncols) tma_store_2d(map_yw, t.n0 + 64 * b, t.pos0 + row0, a0 + (size_t)b * stage_elems);
        tma_store_commit();
        tma_store_wait_read<0>();  // the block's shared memory stays until the boxes are read
    }
}

// The gathering producers' handshake (grouped_sm90_tma.cu, grouped_sm90_fp8_tma.cu,
// decode_swapab_sm90.cu): cp.async writes through the generic proxy and wgmma reads through
// the async one, so a thread marks a stage full only once its own copies of it have landed
// and it has fenced. After committing step g's copies it marks step g - LAG (LAG steps of
// copies stay in flight); gather_mark_tail marks the last LAG of T steps once all have landed.
template <int LAG>
__device__ __forceinline__ void gather_mark_full(u64* full, int g, int S) {
    if (g >= LAG) {
        cp_async_wait<LAG>();
        fence_proxy_async();
        mbar_arrive(&full[(g - LAG) % S]);
    }
}
template <int LAG>
__device__ __forceinline__ void gather_mark_tail(u64* full, int T, int S) {
    cp_async_wait<0>();
    fence_proxy_async();
    for (int g = max(0, T - LAG); g < T; ++g) mbar_arrive(&full[g % S]);
}

// Keeps the compiler from moving accumulator uses across the asynchronous wgmmas.
template <int N = 64>
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64] (m64 x n128, fp32) += A (64 x 16, bf16) * B (16 x 128, bf16), both from shared memory.
__device__ __forceinline__ void wgmma_m64n128k16(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
}

// d[128] (m64 x n256, fp32) += A (64 x 16, bf16) * B (16 x 256, bf16), both from shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db));
}

// d[N / 2] (m64 x nN, fp32) += A (64 x 16, bf16) * B (16 x N, bf16), both K-major from shared
// memory: the swap-AB decode's products (decode_swapab_sm90.cu: weights as M, tokens as N).
template <int N>
__device__ __forceinline__ void wgmma_m64nNk16_bf16(float* d, u64 da, u64 db);
template <>
__device__ __forceinline__ void wgmma_m64nNk16_bf16<8>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk16_bf16<16>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk16_bf16<32>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk16_bf16<64>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk16_bf16<128>(float* d, u64 da, u64 db) { wgmma_m64n128k16(d, da, db); }
template <>
__device__ __forceinline__ void wgmma_m64nNk16_bf16<256>(float* d, u64 da, u64 db) { wgmma_m64n256k16(d, da, db); }

// One 64-wide K step of a warpgroup's 64 x BN accumulator: four k16 wgmmas from 128-byte
// swizzled K-major tiles (descriptors da, db; +32 bytes per k16), committed as one group.
template <int BN>
__device__ __forceinline__ void wgmma_k64_bf16(float* d, u64 da, u64 db) {
    static_assert(BN == 64 || BN == 128 || BN == 256, "m64n64, m64n128 or m64n256");
    fence_acc<BN / 2>(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64nNk16_bf16<BN>(d, da + kk * 2, db + kk * 2);
    wgmma_commit();
    fence_acc<BN / 2>(d);
}

// The same step on one half of the B tile's BN rows (its columns 0 .. BN / 2 - 1, or the rest: the
// accumulators d[BN / 4 ..] and the B rows BN / 2 .. of 128 bytes each, BN * 4 in the descriptor's
// 16-byte address units), leaving the other half's accumulators as they are.
template <int BN>
__device__ __forceinline__ void wgmma_k64_bf16_half(float* d, u64 da, u64 db, bool first) {
    if (first)
        wgmma_k64_bf16<BN / 2>(d, da, db);
    else
        wgmma_k64_bf16<BN / 2>(d + BN / 4, da, db + BN * 4);
}

// d[N / 2] (m64 x nN, fp32) = (scale_d ? d : 0) + A (64 x 32, e4m3) * B (32 x N, e4m3), both K-major
// from shared memory: the w8a8 swap-AB decode's products (decode_swapab_fp8_sm90.cu), a fresh
// accumulator every 128 k (scale_d = 0 at its first k32) so the block scales promote it in fp32.
template <int N>
__device__ __forceinline__ void wgmma_m64nNk32_e4m3(float* d, u64 da, u64 db, int scale_d);
template <>
__device__ __forceinline__ void wgmma_m64nNk32_e4m3<8>(float* d, u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk32_e4m3<16>(float* d, u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk32_e4m3<32>(float* d, u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk32_e4m3<64>(float* d, u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_m64nNk32_e4m3<128>(float* d, u64 da, u64 db, int scale_d) {  // the grouped GEMMs'
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}
