// Hopper (sm_90a) w8a8: fp8-block experts multiplied on fp8 tensor cores, DeepSeek-V3 style.
//
//   quantize_rows_fp8   activations -> e4m3 codes per row and 128-column group, with the
//                       group's scale s = amax / 448 (fp32), q = e4m3(v / s) (nearest even,
//                       saturating): what reference.quantize_activations_fp8 models.
//   grouped_gemm_sm90_fp8<MODE>  the grouped GEMM of grouped_sm90.cu with e4m3 operands:
//                       128 x 128 tiles, one 128-wide K step per stage (one weight scale
//                       block), four m64n128k32 wgmmas into a block accumulator started
//                       fresh, then promoted on the CUDA cores: acc += blk * s_a[row] * s_w.
//                       That promotion every 128 products is DeepSeek-V3's answer to the
//                       limited accumulation precision of Hopper's fp8 tensor cores.
//
// Both operands are K-major e4m3 tiles of 128-byte rows (128 codes), 128-byte swizzled,
// loaded by cp.async: the activations gathered through sorted_row (gate/up) or by position
// (down), the weights as the checkpoint stores them. Epilogues: gemm_common.cuh's.
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define F8_BM 128
#define F8_BK 128  // codes (bytes) per stage row: one 128 x 128 weight scale block
#define F8_STAGES 4
#define F8_THREADS 256
#define QUANT_THREADS 256

// grid ceil(rows * ceil(ld / 128) / 8), block 256: one warp per (row, 128-column group),
// 4 columns per lane. Rows are `ld` elements apart in and out (scales: ceil(ld / 128) per
// row). A row holds K valid columns; with `sorted_pair` (the activation, by position), a
// row whose pair is >= P is the shared expert's and holds K_shared: the columns past a
// row's width are never quantized (they are stale, and must not move its last group's
// scale). K and K_shared are multiples of 16 (fp8 layers need it), so a lane's 4 columns
// are all inside a row's width or all past it.
__global__ void __launch_bounds__(QUANT_THREADS)
quantize_rows_fp8(const bf16* __restrict__ in, int rows, int ld, int K, const int* __restrict__ sorted_pair, int P,
                  int K_shared, u8* __restrict__ q, float* __restrict__ s) {
    const int KB = (ld + 127) >> 7;
    const int w = blockIdx.x * (QUANT_THREADS / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (w >= rows * KB) return;
    const int row = w / KB, kb = w % KB;
    const int width = sorted_pair && sorted_pair[row] >= P ? K_shared : K;
    if (kb * 128 >= width) return;
    const int col = kb * 128 + lane * 4;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < width) {
        const uint2 raw = *reinterpret_cast<const uint2*>(in + (size_t)row * ld + col);
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = warp_max(amax);
    const float sc = amax / 448.0f;  // IEEE division, as the reference's float32 one
    if (col < width) {
        float t[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) t[i] = sc > 0.0f ? v[i] / sc : 0.0f;
        unsigned short lo, hi;  // cvt puts its first source in the upper byte
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(t[1]), "f"(t[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(t[3]), "f"(t[2]));
        *reinterpret_cast<unsigned*>(q + (size_t)row * ld + col) = (unsigned)lo | ((unsigned)hi << 16);
    }
    if (lane == 0) s[(size_t)row * KB + kb] = sc;
}

// d[64] (m64 x n128, fp32) = (scale_d ? d : 0) + A (64 x 32, e4m3) * B (32 x 128, e4m3).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float* d, u64 da, u64 db, int scale_d) {
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

// Byte offset of 16-byte chunk c of row r in a stage tile of 128-byte rows: the 128-byte
// swizzle (chunk XOR row mod 8) that the wgmma descriptors declare.
__device__ __forceinline__ int f8_swz(int r, int c) { return r * F8_BK + ((c ^ (r & 7)) << 4); }

// The operand loads of one stage: 128 A rows and 128 B rows of 8 chunks each, 4 + 4 chunks a
// thread. Rows past the tile or the columns and chunks past K are zero-filled.
template <int MODE>
struct Fp8TileLoader {
    static constexpr int PER = F8_BM * (F8_BK / 16) / F8_THREADS;  // 4
    const u8* a_src[PER];
    const u8* b_src[PER];
    bool a_ok[PER], b_ok[PER];
    int chunk;

    __device__ __forceinline__ void init(const GemmTile& t, const u8* qa, const u8* qa_shared,
                                         const int* __restrict__ sorted_row, int shared_slot, int H, int I_max) {
        chunk = threadIdx.x % (F8_BK / 16);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int r = (threadIdx.x + i * F8_THREADS) / (F8_BK / 16);
            a_ok[i] = r < t.rows;
            const int pos = t.pos0 + min(r, t.rows - 1);
            if (MODE == MODE_GATE_UP)
                a_src[i] = (t.slot == shared_slot ? qa_shared : qa) + (size_t)sorted_row[pos] * H;
            else
                a_src[i] = qa + (size_t)pos * I_max;
            const int n = t.n0 + (MODE == MODE_GATE_UP ? (r & (GG_BN / 2 - 1)) : r);
            const u8* W = reinterpret_cast<const u8*>(MODE == MODE_GATE_UP && r >= GG_BN / 2 ? t.W1 : t.W0);
            b_ok[i] = n < t.ncols;
            b_src[i] = W + (size_t)min(n, t.ncols - 1) * t.K;
        }
    }

    __device__ __forceinline__ void load(u8* sA, u8* sB, int k0, int K) const {
        const int kc = k0 + chunk * 16;
        const bool kin = kc < K;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int r = (threadIdx.x + i * F8_THREADS) / (F8_BK / 16);
            cp_async16(sA + f8_swz(r, chunk), a_src[i] + (kin ? kc : 0), a_ok[i] && kin);
            cp_async16(sB + f8_swz(r, chunk), b_src[i] + (kin ? kc : 0), b_ok[i] && kin);
        }
    }
};

// grid (column tiles, M-tiles of 128 rows), block 256, dynamic smem kernels.sm90_fp8_smem_bytes().
// Beyond GEMM_ARGS: the quantized activations and their scales [rows, ceil(K / 128)]: for
// gate/up `qa` / `sa` are the expert input's (indexed by token row), `qa_shared` /
// `sa_shared` x's for the shared expert (the same buffers unless a pre-expert norm makes
// them differ); for down, the activation's (indexed by position, row stride I_max).
template <int MODE>
__global__ void __launch_bounds__(F8_THREADS, 1)
grouped_gemm_sm90_fp8(GEMM_ARGS, const u8* __restrict__ qa, const float* __restrict__ sa,
                      const u8* __restrict__ qa_shared, const float* __restrict__ sa_shared) {
    constexpr int BM = F8_BM, BK = F8_BK, S = F8_STAGES;
    extern __shared__ __align__(1024) unsigned char f8_smem[];
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(f8_smem) & 1023u)) & 1023u;
    u8* sA = f8_smem + pad;
    u8* sB = sA + S * BM * BK;
    GemmTile t;
    if (!gemm_tile<MODE, BM, GG_BN, FMT_FP8>(t, GEMM_ARG_NAMES)) return;
    Fp8TileLoader<MODE> ld;
    ld.init(t, qa, qa_shared, sorted_row, shared_slot, H, I_max);
    const int wg = threadIdx.x / 128;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int g = lane >> 2, t4 = lane & 3;

    // this thread's two accumulator rows (h = 0, 1) and where their activation scales live
    const float* sa_row[2];
    int KBA;  // activation scale blocks per row
    {
        const bool shared = t.slot == shared_slot;
        KBA = MODE == MODE_GATE_UP ? (H + 127) >> 7 : (I_max + 127) >> 7;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(wg * 64 + warp * 16 + g + 8 * h, t.rows - 1);
            const int pos = t.pos0 + r;
            sa_row[h] = MODE == MODE_GATE_UP ? (shared ? sa_shared : sa) + (size_t)sorted_row[pos] * KBA
                                             : sa + (size_t)pos * KBA;
        }
    }
    // the weight scale blocks: [ceil(ncols / 128), ceil(K / 128)]; one column block per
    // matrix of the tile (gate/up tiles hold 64 columns of each, inside one block)
    const int KBW = (t.K + 127) >> 7;
    const float* sw0 = reinterpret_cast<const float*>(t.S0) + (size_t)(t.n0 >> 7) * KBW;
    const float* sw1 = MODE == MODE_GATE_UP ? reinterpret_cast<const float*>(t.S1) + (size_t)(t.n0 >> 7) * KBW : sw0;

    float acc[64], blk[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = blk[i] = 0.0f;

    const int KT = (t.K + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < KT) ld.load(sA + s * BM * BK, sB + s * GG_BN * BK, s * BK, t.K);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 2>();  // this thread's copies of stage kt have landed
        fence_proxy_async();     // ... visible to the tensor cores' (async) proxy
        __syncthreads();         // everyone's copies of stage kt; stage kt - 1 is free
        const int kn = kt + S - 1;
        if (kn < KT) ld.load(sA + (kn % S) * BM * BK, sB + (kn % S) * GG_BN * BK, kn * BK, t.K);
        cp_async_commit();
        const u64 da = wgmma_desc(sA + (kt % S) * BM * BK + wg * 64 * BK);
        const u64 db = wgmma_desc(sB + (kt % S) * GG_BN * BK);
        fence_acc(blk);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 32; ++kk) wgmma_m64n128k32_e4m3(blk, da + kk * 2, db + kk * 2, kk);  // +32 bytes
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(blk);
        // promote the block's products: fp32 on the CUDA cores, both scales applied
        const float s0 = sw0[kt], s1 = sw1[kt];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float a = sa_row[h][kt];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float sc = a * (MODE == MODE_GATE_UP && j >= 8 ? s1 : s0);
                acc[j * 4 + h * 2] = fmaf(blk[j * 4 + h * 2], sc, acc[j * 4 + h * 2]);
                acc[j * 4 + h * 2 + 1] = fmaf(blk[j * 4 + h * 2 + 1], sc, acc[j * 4 + h * 2 + 1]);
            }
        }
    }
    cp_async_wait<0>();

    emit_wgmma_rows<MODE, GG_BN>(t, acc, wg * 64, GEMM_ARG_NAMES);
}
