// What the two grouped-GEMM kernels share (grouped.cu: mma.sync, any sm_80+;
// grouped_sm90.cu: wgmma, sm_90a): the argument list, the tile a block computes, the
// cp.async tile loader with its swizzled layout, and the epilogues.
#pragma once
#include "common.cuh"
#include "quant.cuh"

#define MODE_GATE_UP 0  // act[pos, :I] = act(x[row] W_gate^T + b, x[row] W_up^T + b), bf16 (ACT_PAIR: g, u)
#define MODE_DOWN 1     // yw[pos, :H] = bf16(w_pair * (act[pos] W_down^T + b)), weighted in fp32
#define MODE_ROUTER 2   // one dense GEMM: logits[N, R] fp32 = x W_router^T (+ bias)

#define GG_BN 128  // B rows per tile: 64 gate + 64 up columns, or 128 down / router columns

// One argument list for every mode (unused ones are 0). MODE_ROUTER: w0_ptrs / b0_ptrs are
// the router matrix and bias themselves, I_max is R and P is N, and the scale tables and
// slot_fmt are null (the router is bf16). w0/w1 = gate/up (or down) weights per table slot,
// s0/s1 their scales, gs0/gs1 their global scales (nvfp4's scale_2, else 1), slot_fmt the
// slot's weight format (quant.cuh): a kernel built for one format skips other slots' tiles.
#define GEMM_ARGS                                                                                          \
    const bf16 *__restrict__ x, const bf16 *__restrict__ xe, const bf16 *__restrict__ act_in,             \
        const int *__restrict__ num_tiles, const int4 *__restrict__ tile_info,                            \
        const int *__restrict__ sorted_row, const int *__restrict__ sorted_pair,                          \
        const u64 *__restrict__ w0_ptrs, const u64 *__restrict__ w1_ptrs, const u64 *__restrict__ b0_ptrs, \
        const u64 *__restrict__ b1_ptrs, const u64 *__restrict__ s0_ptrs, const u64 *__restrict__ s1_ptrs, \
        const float *__restrict__ gs0, const float *__restrict__ gs1, const int *__restrict__ slot_fmt,    \
        const int *__restrict__ inter, const float *__restrict__ topk_w,                                  \
        int shared_slot, int H, int I_max, int P, void *__restrict__ out, int act_code, float alpha, float limit
#define GEMM_ARG_NAMES                                                                                 \
    x, xe, act_in, num_tiles, tile_info, sorted_row, sorted_pair, w0_ptrs, w1_ptrs, b0_ptrs, b1_ptrs, \
        s0_ptrs, s1_ptrs, gs0, gs1, slot_fmt, inter, topk_w, shared_slot, H, I_max, P, out, act_code, alpha, limit

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// cp_async16 with L2 fetching the 256-byte pair around the address: for rows read 128 bytes a stage,
// the next stage's half is then an L2 hit, not another DRAM request
__device__ __forceinline__ void cp_async16_l2_256(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// 4 and 8 bytes (scales), through L1: cp.async.cg takes only 16
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 4 : 0;  // 0: zero-fill, nothing read
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The mma.sync operands (any sm_80+): an ldmatrix of four 8 x 8 b16 matrices, and one
// m16n8k16 bf16 MMA with fp32 accumulators (a[]: the A fragment's four registers).
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Tiles are [rows][BK] bf16 in 16-byte chunks, the chunk index XOR-swizzled so the 8
// consecutive rows an ldmatrix reads hit 8 different bank groups: with 4 chunks (64-byte
// rows) two rows share 128 bytes, so swizzle by (row >> 1) & 3; with 8, by row & 7, which
// is also exactly wgmma's 128-byte swizzle when the tile starts on a 1024-byte boundary.
template <int BK>
__device__ __forceinline__ int swz(int row, int chunk) {
    constexpr int C = BK / 8;
    return row * BK + ((chunk ^ ((C == 4 ? row >> 1 : row) & (C - 1))) << 3);
}

struct GemmTile {
    int slot, pos0, rows;  // expert table slot, first sorted position, rows in this tile
    int k_lo, K;           // the reduction over K columns k_lo .. K - 1 (k_lo 0 but for a split router)
    int ncols, n0;         // output columns of the problem, first column
    const bf16* W0;        // gate / down / router weights [ncols, K] (bytes of any format)
    const bf16* W1;        // up weights (MODE_GATE_UP)
    const void* S0;        // their scales (quantized formats)
    const void* S1;
    float g0, g1;          // their global scales, applied to the fp32 accumulators
};

// Tile (cx, ty): column tile cx of M-tile ty; false when there is nothing to do (past the
// tiles or the columns, or a tile of another weight format than this kernel's FMT).
template <int MODE, int BM, int BN, int FMT = FMT_BF16>
__device__ __forceinline__ bool gemm_tile_at(GemmTile& t, int cx, int ty, GEMM_ARGS) {
    if (MODE == MODE_ROUTER) {
        t.slot = 0;
        t.pos0 = ty * BM;
        t.rows = min(BM, P - t.pos0);
        if (t.rows <= 0) return false;
    } else {
        if (ty >= *num_tiles) return false;
        const int4 ti = tile_info[ty];
        t.slot = ti.x;
        t.pos0 = ti.y;
        t.rows = ti.z;
    }
    if (MODE != MODE_ROUTER && slot_fmt[t.slot] != FMT) return false;
    t.K = MODE == MODE_DOWN ? inter[t.slot] : H;
    t.k_lo = 0;
    if (MODE == MODE_ROUTER && gridDim.z > 1) {
        // a narrow router's few tiles would leave SMs idle: split z sums its share of the
        // 64-wide K steps into logits copy z (topk_route adds the copies, in z order)
        const int per = ((H + 63) / 64 + gridDim.z - 1) / gridDim.z;
        t.k_lo = min(H, (int)blockIdx.z * per * 64);
        t.K = min(H, t.k_lo + per * 64);
    }
    t.ncols = MODE == MODE_GATE_UP ? inter[t.slot] : MODE == MODE_DOWN ? H : I_max;
    t.n0 = cx * (MODE == MODE_GATE_UP ? BN / 2 : BN);
    if (t.n0 >= t.ncols) return false;
    t.W0 = MODE == MODE_ROUTER ? reinterpret_cast<const bf16*>(w0_ptrs) : reinterpret_cast<const bf16*>(w0_ptrs[t.slot]);
    t.W1 = MODE == MODE_GATE_UP ? reinterpret_cast<const bf16*>(w1_ptrs[t.slot]) : nullptr;
    t.S0 = MODE == MODE_ROUTER ? nullptr : reinterpret_cast<const void*>(s0_ptrs[t.slot]);
    t.S1 = MODE == MODE_GATE_UP ? reinterpret_cast<const void*>(s1_ptrs[t.slot]) : nullptr;
    // nvfp4's weights reach the tensor cores times 2^-64 (quant.cuh gemm_weight_unscale)
    t.g0 = MODE == MODE_ROUTER ? 1.0f : gs0[t.slot] * gemm_weight_unscale<FMT>();
    t.g1 = MODE == MODE_GATE_UP ? gs1[t.slot] * gemm_weight_unscale<FMT>() : 1.0f;
    return true;
}

// The order tiles start in. Blocks start in launch order, blockIdx.x fastest. Were x the
// column tile, every column tile of one M-tile would start before the next M-tile's: an
// expert's next M-tile then finds its weights evicted from L2 once the expert's weights
// outgrow what the resident blocks keep there (mixtral-8x7b gate/up: 235 MB an expert over
// 224 column tiles, so its weights came from DRAM once per M-tile, ~17 GB at N = 4096).
// So the launch order is cut into bands of GEMM_BAND_COLS column tiles (the last band
// narrower): within a band a block's neighbours share its M-tile (A from L2) and the next
// M-tiles reuse the band's weights (B from L2). Only the order changes: every tile is
// still computed by one block, so results are bitwise those of any other order.
// CUPYMOE_GEMM_BAND_COLS overrides it (kernels.compile_options) for measurements.
#ifndef GEMM_BAND_COLS
#define GEMM_BAND_COLS 16
#endif

// (column tile, M-tile) of launch-order block L in a grid of ncol x mt.
__device__ __forceinline__ int2 banded_tile(int L, int ncol, int mt) {
    const int c0 = L / (GEMM_BAND_COLS * mt) * GEMM_BAND_COLS;  // the band's first column tile
    const int w = min(GEMM_BAND_COLS, ncol - c0);                // its width
    const int r = L - c0 * mt;                                    // rank inside the band
    return make_int2(c0 + r % w, r / w);
}

// The block's tile: grid (column tiles, M-tiles), started in banded order.
template <int MODE, int BM, int BN, int FMT = FMT_BF16>
__device__ __forceinline__ bool gemm_tile(GemmTile& t, GEMM_ARGS) {
    const int2 ct = banded_tile(blockIdx.y * gridDim.x + blockIdx.x, gridDim.x, gridDim.y);
    return gemm_tile_at<MODE, BM, BN, FMT>(t, ct.x, ct.y, GEMM_ARG_NAMES);
}

// Each thread copies a fixed set of 16-byte chunks per stage: its rows' sources are
// resolved once (A gathered through sorted_row for gate/up), K advances per stage. Rows
// past the tile and chunks past K are zero-filled, never read. B holds BN weight rows: for
// gate/up BN / 2 gate rows, then as many up rows.
template <int MODE, int BM, int BK, int THREADS, int BN = GG_BN>
struct TileLoader {
    static constexpr int CHUNKS = BK / 8;
    static constexpr int A_PER = BM * CHUNKS / THREADS;
    static constexpr int B_PER = BN * CHUNKS / THREADS;
    static_assert(A_PER * THREADS == BM * CHUNKS && B_PER * THREADS == BN * CHUNKS, "tile / threads");
    const bf16* a_src[A_PER];
    const bf16* b_src[B_PER];
    bool a_ok[A_PER], b_ok[B_PER];
    int chunk;

    __device__ __forceinline__ void init(const GemmTile& t, GEMM_ARGS) {
        const int tid = threadIdx.x;
        chunk = tid % CHUNKS;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const int r = (tid + i * THREADS) / CHUNKS;
            a_ok[i] = r < t.rows;
            const int pos = t.pos0 + min(r, t.rows - 1);
            if (MODE == MODE_GATE_UP) {
                const bf16* in = t.slot == shared_slot ? x : xe;  // the shared expert reads x
                a_src[i] = in + (size_t)sorted_row[pos] * H;
            } else if (MODE == MODE_DOWN) {
                a_src[i] = act_in + (size_t)pos * I_max;
            } else {
                a_src[i] = x + (size_t)pos * H;
            }
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const int r = (tid + i * THREADS) / CHUNKS;  // 0 .. BN - 1
            const int n = t.n0 + (MODE == MODE_GATE_UP ? (r & (BN / 2 - 1)) : r);
            const bf16* W = MODE == MODE_GATE_UP && r >= BN / 2 ? t.W1 : t.W0;
            b_ok[i] = n < t.ncols;
            b_src[i] = W + (size_t)min(n, t.ncols - 1) * (MODE == MODE_ROUTER ? H : t.K);  // a split router's t.K ends its share
        }
    }

    // this thread's chunks of one operand's stage: row (tid + i * THREADS) / CHUNKS from src[i]
    template <int PER>
    __device__ __forceinline__ void copy(bf16* dst, const bf16* const (&src)[PER], const bool (&ok)[PER], int k0,
                                         int K) const {
        const int kc = k0 + chunk * 8;
        const bool kin = kc < K;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            cp_async16(dst + swz<BK>((threadIdx.x + i * THREADS) / CHUNKS, chunk), src[i] + (kin ? kc : 0), ok[i] && kin);
    }

    __device__ __forceinline__ void load_a(bf16* sA, int k0, int K) const { copy<A_PER>(sA, a_src, a_ok, k0, K); }

    __device__ __forceinline__ void load(bf16* sA, bf16* sB, int k0, int K) const {
        load_a(sA, k0, K);
        copy<B_PER>(sB, b_src, b_ok, k0, K);
    }
};

// The B operand of quantized weights (FMT != FMT_BF16): cp.async brings the raw codes of a
// stage into a ring of [GG_BN][BK * BITS / 8] byte tiles; the thread that copied a 16-byte
// raw chunk later turns it into bf16 chunks of the swizzled tile the MMA reads (quant.cuh),
// so only its own cp.async groups need to have landed, no barrier. Rows past the columns
// and chunks past K come out as zeros. Needs K % (128 / BITS) == 0 (whole raw chunks).
// fp4 chunks by bit placement (quant.cuh fp4x8_to_bf16_in_order): nvfp4's two scale bytes
// as one pair times 2^62, so its weights arrive times 2^-64 (gemm_tile_at's global scales
// carry the 2^64); mxfp4's one byte e as the exact multiplier 2^(e - 1) up to byte 128.
template <int MODE, int BK, int THREADS, int FMT>
struct QuantBLoader {
    static constexpr int BITS = QFormat<FMT>::BITS;
    static constexpr int EPC = 128 / BITS;           // weights per 16-byte raw chunk: 16 fp8 / 32 fp4
    static constexpr int RAWC = BK / EPC;            // raw chunks per tile row
    static constexpr int ROW_BYTES = BK * BITS / 8;  // raw bytes per tile row
    static constexpr int UNITS = GG_BN * RAWC;
    static constexpr int PER = (UNITS + THREADS - 1) / THREADS;
    static_assert(RAWC >= 1 && RAWC * EPC == BK, "BK must hold whole raw chunks");
    QRow src[PER];
    bool ok[PER];

    __device__ __forceinline__ void init(const GemmTile& t) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int u = threadIdx.x + i * THREADS;
            const int r = min(u, UNITS - 1) / RAWC;  // 0 .. GG_BN - 1
            const int n = t.n0 + (MODE == MODE_GATE_UP ? (r & (GG_BN / 2 - 1)) : r);
            const bool second = MODE == MODE_GATE_UP && r >= GG_BN / 2;
            ok[i] = u < UNITS && n < t.ncols;
            src[i] = q_row<FMT>(second ? t.W1 : t.W0, second ? t.S1 : t.S0, min(n, t.ncols - 1), t.K);
        }
    }

    __device__ __forceinline__ void load(u8* raw, int k0, int K) const {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int u = threadIdx.x + i * THREADS;
            if (u >= UNITS) break;
            const int r = u / RAWC, c = u % RAWC;
            const int kc = k0 + c * EPC;
            const bool v = ok[i] && kc < K;
            cp_async16(raw + r * ROW_BYTES + c * 16, src[i].w + (v ? kc * BITS / 8 : 0), v);
        }
    }

    __device__ __forceinline__ void convert(const u8* raw, bf16* sB, int k0, int K) const {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int u = threadIdx.x + i * THREADS;
            if (u >= UNITS) break;
            const int r = u / RAWC, c = u % RAWC;
            const int kc = k0 + c * EPC;
            const uint4 q = *reinterpret_cast<const uint4*>(raw + r * ROW_BYTES + c * 16);
            uint4 o[EPC / 8];
            if (!(ok[i] && kc < K)) {
#pragma unroll
                for (int j = 0; j < EPC / 8; ++j) o[j] = make_uint4(0, 0, 0, 0);
            } else if (FMT == FMT_FP8) {  // 16 weights, one 128 x 128 block scale
                const float s = q_scale<FMT>(src[i].s, kc);
                o[0] = fp8x8_to_bf16(q.x, q.y, s);
                o[EPC / 8 - 1] = fp8x8_to_bf16(q.z, q.w, s);
            } else {  // 32 weights: 2 nvfp4 groups of 16, or 1 mxfp4 group of 32
                const unsigned w[4] = {q.x, q.y, q.z, q.w};
                if (FMT == FMT_NVFP4) {  // the two scale bytes as one pair
                    const unsigned pair = __ldg(reinterpret_cast<const unsigned short*>(src[i].s + (kc >> 4)));
                    const unsigned b = e4m3x2_to_bf16x2_times_2p62(pair);
                    const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
                    for (int j = 0; j < EPC / 8; ++j)
                        o[j] = fp4x8_to_bf16_in_order(w[j & 3], j < 2 ? __low2bfloat162(s2) : __high2bfloat162(s2));
                } else {
                    const unsigned e = __ldg(src[i].s + (kc >> 5));
                    if (e <= FP4_PAIRS_MXFP4_MAX_SCALE_BYTE) {
                        const unsigned m = ((e + 126u) << 7) * 0x10001u;  // bf16 2^(e - 1) = s * 2^126, twice
                        const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&m);
#pragma unroll
                        for (int j = 0; j < EPC / 8; ++j) o[j] = fp4x8_to_bf16_in_order(w[j & 3], s2);
                    } else {
#pragma unroll
                        for (int j = 0; j < EPC / 8; ++j) o[j] = fp4x8_to_bf16(w[j & 3], e8m0_to_f32(e));
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < EPC / 8; ++j)
                *reinterpret_cast<uint4*>(sB + swz<BK>(r, c * (EPC / 8) + j)) = o[j];
        }
    }
};

// One pipeline stage's operands: A (and bf16 B) by cp.async straight into their tiles;
// quantized B raw into `raw`, turned into the bf16 B tile by convert() once the same
// thread's copies have landed (QuantBLoader).
template <int MODE, int BM, int BK, int THREADS, int BN, int FMT>
struct StageLoader {
    static constexpr bool QUANT = FMT != FMT_BF16;
    typedef QuantBLoader<MODE, BK, THREADS, QUANT ? FMT : FMT_FP8> QB;  // a stand-in type for bf16
    static constexpr int RAW_STAGE = GG_BN * QB::ROW_BYTES;            // bytes of one raw stage
    TileLoader<MODE, BM, BK, THREADS, BN> ld;
    QB qb;

    __device__ __forceinline__ void init(const GemmTile& t, GEMM_ARGS) {
        ld.init(t, GEMM_ARG_NAMES);
        if (QUANT) qb.init(t);
    }
    __device__ __forceinline__ void load(bf16* sA, bf16* sB, u8* raw, int k0, int K) const {
        if (QUANT) {
            ld.load_a(sA, k0, K);
            qb.load(raw, k0, K);
        } else {
            ld.load(sA, sB, k0, K);
        }
    }
    __device__ __forceinline__ void convert(const u8* raw, bf16* sB, int k0, int K) const {
        if (QUANT) qb.convert(raw, sB, k0, K);
    }
};

// The pre-activation g, u of two adjacent columns c, c + 1 (of the tile's BN / 2 per matrix)
// in fp32, in place: global scales, then biases. Needs t.n0 + c < t.ncols.
__device__ __forceinline__ void gate_up_scaled(const GemmTile& t, int c, float& g0, float& g1, float& u0, float& u1,
                                               const u64* __restrict__ b0_ptrs, const u64* __restrict__ b1_ptrs) {
    const int col = t.n0 + c;
    g0 *= t.g0;  // the matrices' global scales (1 but for nvfp4), before the biases
    g1 *= t.g0;
    u0 *= t.g1;
    u1 *= t.g1;
    const float* bg = reinterpret_cast<const float*>(b0_ptrs[t.slot]);
    const float* bu = reinterpret_cast<const float*>(b1_ptrs[t.slot]);
    if (bg) {
        g0 += bg[col];
        g1 += bg[col + 1];
    }
    if (bu) {
        u0 += bu[col];
        u1 += bu[col + 1];
    }
}

// The activations ACT of those two columns in fp32 (gate_up_scaled, then the function).
template <int ACT>
__device__ __forceinline__ float2 gate_up_pair(const GemmTile& t, int c, float g0, float g1, float u0, float u1,
                                               GEMM_ARGS) {
    gate_up_scaled(t, c, g0, g1, u0, u1, b0_ptrs, b1_ptrs);
    return make_float2(activation<ACT>(g0, u0, alpha, limit), activation<ACT>(g1, u1, alpha, limit));
}

// Gate/up epilogue for one row r of the tile and two adjacent columns c, c + 1: the
// activations ACT, bf16 store into act[pos, :]; ACT_PAIR: g and u in bf16 into the row's two
// halves (out [P, 2 I_max], the LoRA plans' scratch).
template <int ACT>
__device__ __forceinline__ void emit_gate_up(const GemmTile& t, int r, int c, float g0, float g1, float u0,
                                             float u1, GEMM_ARGS) {
    if (r >= t.rows || t.n0 + c >= t.ncols) return;
    if (ACT == ACT_PAIR) {
        gate_up_scaled(t, c, g0, g1, u0, u1, b0_ptrs, b1_ptrs);
        bf16* o = reinterpret_cast<bf16*>(out) + (size_t)(t.pos0 + r) * (2 * I_max) + t.n0 + c;
        *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(g0, g1);
        *reinterpret_cast<__nv_bfloat162*>(o + I_max) = __floats2bfloat162_rn(u0, u1);
        return;
    }
    const float2 a = gate_up_pair<ACT>(t, c, g0, g1, u0, u1, GEMM_ARG_NAMES);
    *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<bf16*>(out) + (size_t)(t.pos0 + r) * I_max + t.n0 + c) =
        __floats2bfloat162_rn(a.x, a.y);
}

// The bias a down / router tile adds: the slot's, or the router's (split 0 alone: the
// splits' logits are summed).
template <int MODE>
__device__ __forceinline__ const float* router_or_slot_bias(const GemmTile& t, const u64* __restrict__ b0_ptrs) {
    if (MODE == MODE_ROUTER) return blockIdx.z == 0 ? reinterpret_cast<const float*>(b0_ptrs) : nullptr;
    return reinterpret_cast<const float*>(b0_ptrs[t.slot]);
}

// Router logits, fp32, of row pos and columns col (even), col + 1 into split z's own copy:
// one 8-byte store where R is even, else one by one (R may be odd).
__device__ __forceinline__ void store_logit_pair(const GemmTile& t, int pos, int col, float v0, float v1, int P,
                                                 void* out) {
    float* lg = reinterpret_cast<float*>(out) + ((size_t)blockIdx.z * P + pos) * t.ncols + col;
    if ((t.ncols & 1) == 0) {
        *reinterpret_cast<float2*>(lg) = make_float2(v0, v1);
    } else {
        lg[0] = v0;
        if (col + 1 < t.ncols) lg[1] = v1;
    }
}

// Down / router epilogue for row r and columns c, c + 1 of the tile's BN.
template <int MODE>
__device__ __forceinline__ void emit_out(const GemmTile& t, int r, int c, float v0, float v1, GEMM_ARGS) {
    const int col = t.n0 + c;
    if (r >= t.rows || col >= t.ncols) return;
    const int pos = t.pos0 + r;
    v0 *= t.g0;  // the matrix's global scale (1 but for nvfp4), before the bias
    v1 *= t.g0;
    const float* bias = router_or_slot_bias<MODE>(t, b0_ptrs);
    if (bias) {
        v0 += bias[col];
        v1 += col + 1 < t.ncols ? bias[col + 1] : 0.0f;
    }
    if (MODE == MODE_DOWN) {
        const int pair = sorted_pair[pos];
        const float w = pair < P ? topk_w[pair] : 1.0f;  // the shared expert is scaled in the reduce
        *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<bf16*>(out) + (size_t)pos * H + col) =
            __floats2bfloat162_rn(w * v0, w * v1);
    } else {
        store_logit_pair(t, pos, col, v0, v1, P, out);
    }
}

// The epilogues of one warpgroup's 64 x BN wgmma accumulator (its rows row0 .. row0 + 63 of
// the tile): d[j * 4 + h * 2 + e] is row 16 * warp + g + 8 h, column 8 j + 2 t4 + e (the
// m16n8 fragment layout, one per 8-column block j). Gate/up tiles hold the gate columns in
// blocks 0 .. BN/16 - 1 and the up columns after them. What is per row (its place, its
// routing weight) or per column (biases) is read once, not per element; the arithmetic is
// emit_gate_up's and emit_out's, in the same order.
//
// FragRows: a thread's place in that layout: its lane group g and thread t4 in the group,
// its first row r (row0 + 16 * warp + g; the second is r + 8) and whether each lies inside
// the tile's `rows`.
struct FragRows {
    int g, t4, r;
    bool ok[2];
    __device__ __forceinline__ FragRows(int row0, int rows) {
        const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
        g = lane >> 2;
        t4 = lane & 3;
        r = row0 + warp * 16 + g;
        ok[0] = r < rows;
        ok[1] = r + 8 < rows;
    }
};

// The routing weights of a down tile's rows pos and pos + 8 (those inside the tile): the
// pair's weight, 1 for the shared expert's rows (scaled in the reduce).
__device__ __forceinline__ void frag_row_weights(float (&w)[2], const bool (&ok)[2], int pos,
                                                 const int* __restrict__ sorted_pair, const float* __restrict__ topk_w,
                                                 int P) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        w[h] = 1.0f;
        if (!ok[h]) continue;
        const int pair = sorted_pair[pos + 8 * h];
        w[h] = pair < P ? topk_w[pair] : 1.0f;
    }
}

template <int ACT, int BN>
__device__ __forceinline__ void emit_wgmma_gate_up(const GemmTile& t, const float* d, int row0, GEMM_ARGS) {
    const FragRows fr(row0, t.rows);
    const int t4 = fr.t4, r = fr.r;
    const bool(&ok)[2] = fr.ok;
    constexpr int JB = BN / 8;
    const size_t stride = ACT == ACT_PAIR ? 2 * (size_t)I_max : (size_t)I_max;  // ACT_PAIR: g, then u, a row
    bf16* dst = reinterpret_cast<bf16*>(out) + (size_t)(t.pos0 + r) * stride + t.n0;
    const float* bg = reinterpret_cast<const float*>(b0_ptrs[t.slot]);
    const float* bu = reinterpret_cast<const float*>(b1_ptrs[t.slot]);
#pragma unroll
    for (int j = 0; j < JB / 2; ++j) {
        const int c = j * 8 + 2 * t4;
        if (t.n0 + c >= t.ncols) break;  // I is even: both columns of the pair lie inside
        float2 b = make_float2(0.0f, 0.0f), e = b;
        if (bg) b = make_float2(bg[t.n0 + c], bg[t.n0 + c + 1]);
        if (bu) e = make_float2(bu[t.n0 + c], bu[t.n0 + c + 1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (!ok[h]) continue;
            float g0 = d[j * 4 + h * 2] * t.g0, g1 = d[j * 4 + h * 2 + 1] * t.g0;
            float u0 = d[(j + JB / 2) * 4 + h * 2] * t.g1, u1 = d[(j + JB / 2) * 4 + h * 2 + 1] * t.g1;
            if (bg) {
                g0 += b.x;
                g1 += b.y;
            }
            if (bu) {
                u0 += e.x;
                u1 += e.y;
            }
            bf16* o = dst + (size_t)h * 8 * stride + c;
            if (ACT == ACT_PAIR) {
                *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(g0, g1);
                *reinterpret_cast<__nv_bfloat162*>(o + I_max) = __floats2bfloat162_rn(u0, u1);
            } else {
                *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(activation<ACT>(g0, u0, alpha, limit),
                                                                              activation<ACT>(g1, u1, alpha, limit));
            }
        }
    }
}

template <int MODE, int BN>
__device__ __forceinline__ void emit_wgmma_out(const GemmTile& t, const float* d, int row0, GEMM_ARGS) {
    const FragRows fr(row0, t.rows);
    const int t4 = fr.t4, r = fr.r;
    const bool(&ok)[2] = fr.ok;
    constexpr int JB = BN / 8;
    float w[2] = {1.0f, 1.0f};  // the pairs' routing weights (the shared expert is scaled in the reduce)
    if (MODE == MODE_DOWN) frag_row_weights(w, ok, t.pos0 + r, sorted_pair, topk_w, P);
    const float* bias = router_or_slot_bias<MODE>(t, b0_ptrs);
#pragma unroll
    for (int j = 0; j < JB; ++j) {
        const int col = t.n0 + j * 8 + 2 * t4;
        if (col >= t.ncols) break;
        float b0 = 0.0f, b1 = 0.0f;
        if (bias) {
            b0 = bias[col];
            b1 = col + 1 < t.ncols ? bias[col + 1] : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (!ok[h]) continue;
            const int pos = t.pos0 + r + 8 * h;
            float v0 = d[j * 4 + h * 2] * t.g0, v1 = d[j * 4 + h * 2 + 1] * t.g0;
            if (bias) {
                v0 += b0;
                v1 += b1;
            }
            if (MODE == MODE_DOWN) {
                *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<bf16*>(out) + (size_t)pos * H + col) =
                    __floats2bfloat162_rn(w[h] * v0, w[h] * v1);
            } else {
                store_logit_pair(t, pos, col, v0, v1, P, out);
            }
        }
    }
}

// The down epilogue of one warpgroup, through shared memory: the 64 x BN weighted bf16
// outputs (emit_wgmma_out's arithmetic) are written into the warpgroup's own 64-row A blocks
// of the pipeline's S stages (8 KB each, read only by its own wgmmas, all done here), then
// read back and stored to yw in 16-byte pieces, a warp covering whole row segments. The
// fragments' own 4-byte stores touched 16 bytes of each of 8 rows a warp instruction.
// a0: the warpgroup's A block in stage 0; stage_elems: bf16 elements from one stage's to
// the next. A row's BN * 2 bytes hold its 16-byte chunks c at c ^ (row & 7) (no bank
// conflicts when the 8 rows of a fragment write).
// The routing weights emit_wgmma_down_staged applies to a thread's two rows of the
// warpgroup at row0: a kernel reads them before its main loop, so their two dependent loads
// (sorted_pair, then topk_w) land under the wgmmas instead of after the last one.
__device__ __forceinline__ void down_row_weights(float (&w)[2], const GemmTile& t, int row0, GEMM_ARGS) {
    const FragRows fr(0, t.rows - row0);
    frag_row_weights(w, fr.ok, t.pos0 + row0 + fr.r, sorted_pair, topk_w, P);
}

// The weighted bf16 outputs of a thread's down fragments (emit_wgmma_out's arithmetic: the
// slot's scale, the bias, then the routing weight in fp32 and one rounding) written into
// shared memory where the caller's `at(row, chunk)` puts row r + 8 h's 16-byte chunk j:
// emit_wgmma_down_staged's row-major swizzle or emit_wgmma_down_tma's 64 x 64 TMA boxes.
template <int BN, class At>
__device__ __forceinline__ void stage_down_outputs(const GemmTile& t, const float* d, const float (&w)[2], int r,
                                                   int t4, const float* bias, At at) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int col = t.n0 + j * 8 + 2 * t4;
        float b0 = 0.0f, b1 = 0.0f;
        if (bias && col < t.ncols) {
            b0 = bias[col];
            b1 = col + 1 < t.ncols ? bias[col + 1] : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v0 = d[j * 4 + h * 2] * t.g0, v1 = d[j * 4 + h * 2 + 1] * t.g0;
            if (bias) {
                v0 += b0;
                v1 += b1;
            }
            *reinterpret_cast<__nv_bfloat162*>(at(r + 8 * h, j) + t4 * 4) = __floats2bfloat162_rn(w[h] * v0, w[h] * v1);
        }
    }
}

template <int BN, int S>
__device__ __forceinline__ void emit_wgmma_down_staged(const GemmTile& t, const float* d, const float (&w)[2],
                                                       int row0, bf16* a0, int stage_elems, GEMM_ARGS) {
    static_assert(64 * BN * 2 <= S * 8192, "the warpgroup's A blocks hold its output tile");
    constexpr int ROW_BYTES = BN * 2;
    const int wt = threadIdx.x & 127, wg_bar = 1 + (threadIdx.x >> 7);  // barrier 0 is __syncthreads
    const FragRows fr(0, t.rows - row0);  // rows relative to the warpgroup's first
    const int t4 = fr.t4, r = fr.r;
    auto at = [&](int r, int c) -> unsigned char* {  // byte address of row r's chunk c
        const int o = r * ROW_BYTES + ((c ^ (r & 7)) << 4);
        return reinterpret_cast<unsigned char*>(a0 + (size_t)(o >> 13) * stage_elems) + (o & 8191);
    };
    // w: the pairs' routing weights, down_row_weights' (the shared expert is scaled in the reduce)
    const float* bias = reinterpret_cast<const float*>(b0_ptrs[t.slot]);
    asm volatile("bar.sync %0, 128;\n" ::"r"(wg_bar) : "memory");  // every warp's wgmmas have read A
    stage_down_outputs<BN>(t, d, w, r, t4, bias, at);
    asm volatile("bar.sync %0, 128;\n" ::"r"(wg_bar) : "memory");
    constexpr int CPR = BN / 8, RPP = 128 / CPR;  // 16-byte chunks a row, rows a pass
    const int c = wt % CPR, col = t.n0 + c * 8;
    if (col >= t.ncols) return;  // H is a multiple of 8: a chunk lies wholly inside or outside
#pragma unroll 4
    for (int rr = wt / CPR; rr < 64; rr += RPP) {
        if (row0 + rr >= t.rows) break;
        *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(out) + (size_t)(t.pos0 + row0 + rr) * H + col) =
            *reinterpret_cast<const uint4*>(at(rr, c));
    }
}

// A warpgroup's epilogue: gate/up switches on the activation once, so each activation's
// epilogue is straight code (one switch per element inlined every activation 32-128 times
// and left the code that runs scattered in ~10k instructions, stalled on instruction fetch).
template <int MODE, int BN>
__device__ __forceinline__ void emit_wgmma_rows(const GemmTile& t, const float* d, int row0, GEMM_ARGS) {
    if (MODE == MODE_GATE_UP) {
        with_activation<true>(act_code, [&](auto act) {  // ACT_PAIR too: LoRA's gate/up
            emit_wgmma_gate_up<decltype(act)::value, BN>(t, d, row0, GEMM_ARG_NAMES);
        });
    } else {
        emit_wgmma_out<MODE, BN>(t, d, row0, GEMM_ARG_NAMES);
    }
}
