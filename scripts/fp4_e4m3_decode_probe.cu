// What would fp4 decode cost on e4m3 tensor cores? (scripts/fp4_e4m3_decode_probe.py; the
// result is in benchmarks/DECISIONS.md, fp4.) One kernel, four compute sides on one copy skeleton, timed on mxfp4
// codes of deepseek-v3's gate/up shape. The skeleton is decode_wgmma_fp4.cu's at its default
// shape: a warpgroup a block streams 128 weight rows through a 3-stage cp.async ring of 2 k128
// steps a stage (128 contiguous code bytes of each row, a row's 8 scale bytes a copy) against
// 8 activation rows staged the same way (by cp.async here, where the kernel stages them
// through registers). Only the instruction streams are compared: the
// codes, scales and rows are random and the sums are nobody's (values wrong by design; the
// outputs are stored only so that nothing is optimized away).
//
//   MODE 0  W4A16 on the stored nibbles (before the load-time repack): a word's 8 codes -> 4 bf16
//           pairs by bit placement (fp4x8_to_bf16_pairs_nibbles below, each pair times its
//           scale, HMUL2), m64n8k16 bf16 wgmmas from registers
//   MODE 1  W4A8: a word's 8 codes -> two e4m3 registers by a byte-permute lookup
//           (fp4x8_to_e4m3x8: the magnitudes index an 8-byte table, the signs are ORed in; a
//           layout repacked at load puts each bit where those operations want it), m64n8k32
//           e4m3 wgmmas from registers into one partial sum a 32-code scale group, each
//           promoted in fp32 by its scale (mxfp4: a power of two), the activation's 128-code
//           group scale after the step
//   MODE 2  MODE 1 with each activation as two e4m3 terms (hi + lo, one scale): twice the
//           wgmmas into the same partial sums, ~8 significant bits of each activation
//   MODE 3  the copies and barriers alone (no compute)
//   MODE 4  MODE 0 on words whose bits the load repacked (quant.cuh fp4x8_to_bf16_pairs: 8
//           integer operations a word where MODE 0 takes 13)
#include "gemm_common.cuh"
#include "quant.cuh"
#include "wgmma.cuh"

// The skeleton's shape is a template argument (KSUB k steps a stage, STAGES stages, MINB blocks
// an SM for the registers, ROWS weight rows a block: one or two m64 tiles); decode_wgmma_fp4.cu's
// is <2, 3, 3, 128>.
#define PR_BK 128       // codes of a k step (64 bytes of a row)
#define PR_THREADS 128
#define PR_NTOK 8       // activation rows a pass
#define PR_SBK 4        // mxfp4 scale bytes of a row and k step (128 codes / 32)

// activation tile bytes of a k step: bf16 two [8][64] tiles; e4m3 one [8][128]; hi + lo two
template <int MODE>
__host__ __device__ constexpr int pr_x_bytes() { return MODE == 1 ? PR_NTOK * 128 : 2 * PR_NTOK * 128; }
template <int MODE, int KSUB, int ROWS>
__host__ __device__ constexpr int pr_stage_bytes() {
    return KSUB * (pr_x_bytes<MODE>() + ROWS * PR_BK / 2) + ROWS * PR_SBK * KSUB;
}

// 8 e2m1 codes -> two registers of 4 e4m3 each, exactly, in 7 operations: the magnitudes
// (bits 0-2 of nibbles 0-3 for codes 0-3, of nibbles 4-7 for codes 4-7) index a table of the
// 8 magnitudes' e4m3 bytes (prmt: a selector nibble's bit 3 would sign-replicate, so it is
// masked off); the signs sit at bit 3 of nibbles 1, 3, 5, 7 (codes 0-3: bits 7, 15, 23, 31,
// where e4m3 wants them) and 0, 2, 4, 6 (codes 4-7, four bits lower).
__device__ __forceinline__ void fp4x8_to_e4m3x8(unsigned v, unsigned& a, unsigned& b) {
    const unsigned lo = 0x3C383000u, hi = 0x4C484440u;  // e4m3 of 0, 0.5, 1, 1.5 | 2, 3, 4, 6
    const unsigned m = v & 0x77777777u;
    a = __byte_perm(lo, hi, m) | (v & 0x80808080u);
    b = __byte_perm(lo, hi, m >> 16) | ((v << 4) & 0x80808080u);
}

// 8 e2m1 codes of a word as stored (code i in nibble i) -> the 4 bf16 pairs (i, i + 4) times
// 2^-126, times s2: quant.cuh fp4x8_to_bf16_pairs before the load repacked each word (MODE 0,
// 13 integer operations a word: a mask, a multiply making two copies, a mask a pair).
__device__ __forceinline__ uint4 fp4x8_to_bf16_pairs_nibbles(unsigned v, __nv_bfloat162 s2) {
    const unsigned w = v >> 8;  // codes 2, 3, 6, 7 where v has 0, 1, 4, 5
    unsigned p[4];
    p[0] = ((v & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;  // (x << 6) + (x << 12)
    p[1] = ((v & 0x00F000F0u) * 0x104u) & 0x81C081C0u;   // (x << 2) + (x << 8)
    p[2] = ((w & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;
    p[3] = ((w & 0x00F000F0u) * 0x104u) & 0x81C081C0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 h = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&p[i]), s2);
        p[i] = *reinterpret_cast<unsigned*>(&h);
    }
    return make_uint4(p[0], p[1], p[2], p[3]);
}

// d (m64 x n8, fp32) = (scale_d ? d : 0) + A (64 x 32 e4m3, this thread's fragment a) * B
// (32 x 8 e4m3, K-major in shared memory)
__device__ __forceinline__ void wgmma_m64n8k32_e4m3_rs(float* d, const unsigned (&a)[4], u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %8, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(db));
}
__device__ __forceinline__ void wgmma_m64n8k16_bf16_rs(float* d, const unsigned (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// one k step of both m64 tiles from stage `st`, step `sub`: acc[m][4] (rows 16 w + g, + 8;
// columns 2 t4, + 1)
template <int MODE, int KSUB, int ROWS>
__device__ __forceinline__ void pr_step(float (&acc)[2][4], float (&blk)[2][4][4], const u8* st, int sub, float sx) {
    constexpr int SB = PR_SBK * KSUB;  // scale bytes of a row and stage
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
    const u8* x = st + sub * pr_x_bytes<MODE>();
    constexpr int MT = ROWS / 64;  // m64 tiles
    const u8* codes = st + KSUB * pr_x_bytes<MODE>() + sub * ROWS * PR_BK / 2;
    const u8* sc = st + KSUB * (pr_x_bytes<MODE>() + ROWS * PR_BK / 2);
    if (MODE == 0 || MODE == 4) {
        unsigned a[2][8][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const int r = 64 * m + 16 * warp + g;
            const uint4 lo = *reinterpret_cast<const uint4*>(codes + r * (PR_BK / 2) + 16 * t4);
            const uint4 hi = *reinterpret_cast<const uint4*>(codes + (r + 8) * (PR_BK / 2) + 16 * t4);
            const unsigned bl = e8m0_to_bf16x2_times_2p62(sc[r * SB + sub * 4 + t4]);
            const unsigned bh = e8m0_to_bf16x2_times_2p62(sc[(r + 8) * SB + sub * 4 + t4]);
            const __nv_bfloat162 sl = *reinterpret_cast<const __nv_bfloat162*>(&bl);
            const __nv_bfloat162 sh = *reinterpret_cast<const __nv_bfloat162*>(&bh);
            const unsigned wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 pa = MODE == 4 ? fp4x8_to_bf16_pairs(wl[j], sl) : fp4x8_to_bf16_pairs_nibbles(wl[j], sl);
                const uint4 pb = MODE == 4 ? fp4x8_to_bf16_pairs(wh[j], sh) : fp4x8_to_bf16_pairs_nibbles(wh[j], sh);
                a[m][2 * j][0] = pa.x, a[m][2 * j][1] = pb.x, a[m][2 * j][2] = pa.y, a[m][2 * j][3] = pb.y;
                a[m][2 * j + 1][0] = pa.z, a[m][2 * j + 1][1] = pb.z, a[m][2 * j + 1][2] = pa.w,
                a[m][2 * j + 1][3] = pb.w;
            }
        }
        fence_acc<4>(acc[0]);
        fence_acc<4>(acc[1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const u64 db = wgmma_desc(x + (kk >> 2) * PR_NTOK * 128) + 2 * (kk & 3);
            wgmma_m64n8k16_bf16_rs(acc[0], a[0][kk], db);
            wgmma_m64n8k16_bf16_rs(acc[1], a[1][kk], db);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<4>(acc[0]);
        fence_acc<4>(acc[1]);
    } else if (MODE == 1 || MODE == 2) {
        unsigned a[2][4][4];   // tile, k32 group, fragment
        unsigned s[2][2];      // tile, row g / g + 8: the step's four scale bytes
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const int r = 64 * m + 16 * warp + g;
            const uint4 lo = *reinterpret_cast<const uint4*>(codes + r * (PR_BK / 2) + 16 * t4);
            const uint4 hi = *reinterpret_cast<const uint4*>(codes + (r + 8) * (PR_BK / 2) + 16 * t4);
            s[m][0] = *reinterpret_cast<const unsigned*>(sc + r * SB + sub * 4);
            s[m][1] = *reinterpret_cast<const unsigned*>(sc + (r + 8) * SB + sub * 4);
            const unsigned wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // word j: group j's 8 codes of this thread (k 4 t4 .., 16 + 4 t4 ..)
                fp4x8_to_e4m3x8(wl[j], a[m][j][0], a[m][j][2]);
                fp4x8_to_e4m3x8(wh[j], a[m][j][1], a[m][j][3]);
            }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) fence_acc<4>(blk[m][j]);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u64 db = wgmma_desc(x) + 2 * j;  // +32 bytes of K a group
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                wgmma_m64n8k32_e4m3_rs(blk[m][j], a[m][j], db, 0);
                if (MODE == 2) wgmma_m64n8k32_e4m3_rs(blk[m][j], a[m][j], db + (PR_NTOK * 128 >> 4), 1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                fence_acc<4>(blk[m][j]);
                // an e8m0 byte e -> 2^(e - 127) as fp32: e at the exponent field
                const float fl = __uint_as_float(((s[m][0] >> (8 * j)) & 0xFFu) << 23);
                const float fh = __uint_as_float(((s[m][1] >> (8 * j)) & 0xFFu) << 23);
                part[0] = fmaf(blk[m][j][0], fl, part[0]);
                part[1] = fmaf(blk[m][j][1], fl, part[1]);
                part[2] = fmaf(blk[m][j][2], fh, part[2]);
                part[3] = fmaf(blk[m][j][3], fh, part[3]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][i] = fmaf(part[i], sx, acc[m][i]);
        }
    }
}

// grid (rows / ROWS), block PR_THREADS, dynamic shared memory STAGES * pr_stage_bytes + 1024.
// codes [rows][K / 2], scales [rows][K / 32], xs [8][K * 2] bytes (the activation rows, read
// by every block: L2-resident, as a decode pass's few rows are), out [rows][8].
template <int MODE, int KSUB, int STAGES, int MINB, int ROWS>
__global__ void __launch_bounds__(PR_THREADS, MINB)
fp4_probe(const u8* __restrict__ codes, const u8* __restrict__ scales, const u8* __restrict__ xs,
          float* __restrict__ out, int K) {
    extern __shared__ unsigned char pr_smem[];
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(pr_smem) & 1023u)) & 1023u;
    u8* stages = pr_smem + pad;
    constexpr int SB = PR_SBK * KSUB, CH = KSUB * PR_BK / 2 / 16;  // a row's scale bytes, 16-byte code chunks a stage
    const int KS = K / (PR_BK * KSUB);  // K: whole stages
    const size_t row0 = (size_t)blockIdx.x * ROWS;
    constexpr int MT = ROWS / 64;
    const int tid = threadIdx.x;
    // this thread's copies of a stage: code chunk tid % CH of rows tid / CH + (128 / CH) i;
    // scale row tid; activation chunks tid (+ 128 j) of the stage's x bytes. Addresses made
    // once: a stage adds a constant to each.
    constexpr int A_ROWS = PR_THREADS / CH, A_PER = ROWS / A_ROWS;
    const u8* a_src = codes + (row0 + tid / CH) * (K / 2) + (tid % CH) * 16;
    const u8* s_src = scales + (row0 + tid) * (K / 32);
    const int a_dst = KSUB * pr_x_bytes<MODE>() + ((tid % CH) / 4) * ROWS * PR_BK / 2 + (tid / CH) * (PR_BK / 2) +
                      (tid % 4) * 16;
    const int s_dst = KSUB * (pr_x_bytes<MODE>() + ROWS * PR_BK / 2) + tid * SB;
    constexpr int XQ = KSUB * pr_x_bytes<MODE>() / 16 / PR_THREADS;  // x chunks a thread and stage
    constexpr int X_ROW_STAGE = KSUB * pr_x_bytes<MODE>() / PR_NTOK;  // x bytes a row and stage
    int x_dst[XQ];
    const u8* x_src[XQ];
#pragma unroll
    for (int q = 0; q < XQ; ++q) {
        const int i = tid + q * PR_THREADS, tile = i / (PR_NTOK * 8), r = (i / 8) % PR_NTOK, cc = i % 8;
        x_dst[q] = tile * PR_NTOK * 128 + swz128(r, cc);
        x_src[q] = xs + (size_t)r * (2 * K) + tile * 128 + cc * 16;
    }
    const unsigned smem0 = (unsigned)__cvta_generic_to_shared(stages);
    auto copy_stage = [&](int s) {
        const unsigned st = smem0 + (s % STAGES) * pr_stage_bytes<MODE, KSUB, ROWS>();
        const size_t ka = (size_t)s * (PR_BK * KSUB / 2);
#pragma unroll
        for (int i = 0; i < A_PER; ++i)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(st + a_dst + i * A_ROWS * (PR_BK / 2)),
                         "l"(a_src + (size_t)i * A_ROWS * (K / 2) + ka));
        if (tid < ROWS) {  // a row's stage of scale bytes a thread
            if (SB == 16)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(st + s_dst), "l"(s_src + s * SB));
            else
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(st + s_dst), "l"(s_src + s * SB));
        }
#pragma unroll
        for (int q = 0; q < XQ; ++q)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(st + x_dst[q]),
                         "l"(x_src[q] + (size_t)s * X_ROW_STAGE));
    };
    float acc[2][4] = {};
    float blk[2][4][4] = {};  // MODE 1 / 2: a step's partial sums a scale group (overwritten: scale_d = 0)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KS) copy_stage(s);
        cp_async_commit();
    }
#pragma unroll 1
    for (int s = 0; s < KS; ++s) {
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        if (s + STAGES - 1 < KS) copy_stage(s + STAGES - 1);
        cp_async_commit();
        const u8* st = stages + (s % STAGES) * pr_stage_bytes<MODE, KSUB, ROWS>();
        if (MODE == 3) {  // the skeleton alone: touch the stage so the copies are waited for
            acc[0][0] += (float)st[KSUB * pr_x_bytes<MODE>() + tid];
        } else {
#pragma unroll
            for (int sub = 0; sub < KSUB; ++sub) pr_step<MODE, KSUB, ROWS>(acc, blk, st, sub, 1.0f + (float)sub);
        }
    }
    cp_async_wait<0>();
    const int warp = tid >> 5, g = (tid & 31) >> 2, t4 = tid & 3;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            out[(row0 + 64 * m + 16 * warp + g + 8 * (i >> 1)) * PR_NTOK + 2 * t4 + (i & 1)] = acc[m][i];
}
