// Hopper (sm_90a) w8a8: fp8-block experts multiplied on fp8 tensor cores, DeepSeek-V3 style.
//
//   grouped_gemm_sm90_fp8<MODE>  the grouped GEMM of grouped_sm90.cu with e4m3 operands:
//                       64-row tiles of 256 weight rows, one 128-wide K step per stage (one
//                       weight scale block); each warpgroup runs four m64n128k32 wgmmas on
//                       its 128 weight rows into a block accumulator started fresh, then
//                       promotes it on the CUDA cores: acc += blk * s_a[row] * s_w. That
//                       promotion every 128 products is DeepSeek-V3's answer to the limited
//                       accumulation precision of Hopper's fp8 tensor cores.
//
// Why 256 weight rows: a gate/up tile then covers 128 activation columns (warpgroup w the
// gate and up rows of columns n0 + 64 w .. + 63), exactly one 128-column quantization group,
// so the epilogue quantizes the activation it produces (amax per row across the two
// warpgroups through shared memory) and the down GEMM reads e4m3 codes: no pass of its own.
// The expert input's codes come from the routing stage or the norm (quant.cuh). A down tile
// covers 256 output columns, warpgroup w the 128 of weight scale block n0 / 128 + w.
//
// Both operands are K-major e4m3 tiles of 128-byte rows (128 codes), 128-byte swizzled,
// loaded by cp.async: the activations gathered through sorted_row (gate/up) or by position
// (down), the weights as the checkpoint stores them.
#include "fp8_gemm.cuh"

#define F8_BM 64
#define F8_BN 256  // weight rows per tile: 128 per warpgroup
#define F8_BK 128  // codes (bytes) per stage row: one 128 x 128 weight scale block
#define F8_STAGES 4
#define F8_THREADS 256

// The operand loads of one stage: 64 A rows and 256 B rows of 8 chunks each, 2 + 8 chunks a
// thread. Rows past the tile or the columns and chunks past K are zero-filled. B row r
// belongs to warpgroup r / 128; for gate/up its rows are 64 gate then 64 up rows of the
// warpgroup's activation columns.
template <int MODE>
struct Fp8TileLoader {
    static constexpr int CHUNKS = F8_BK / 16;
    static constexpr int A_PER = F8_BM * CHUNKS / F8_THREADS;  // 2
    static constexpr int B_PER = F8_BN * CHUNKS / F8_THREADS;  // 8
    const u8* a_src[A_PER];
    const u8* b_src[B_PER];
    bool a_ok[A_PER], b_ok[B_PER];
    int chunk;

    __device__ __forceinline__ void init(const GemmTile& t, const u8* qa, const u8* qa_shared,
                                         const int* __restrict__ sorted_row, int shared_slot, int H, int I_max) {
        chunk = threadIdx.x % CHUNKS;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const int r = (threadIdx.x + i * F8_THREADS) / CHUNKS;
            a_ok[i] = r < t.rows;
            const int pos = t.pos0 + min(r, t.rows - 1);
            if (MODE == MODE_GATE_UP)
                a_src[i] = (t.slot == shared_slot ? qa_shared : qa) + (size_t)sorted_row[pos] * H;
            else
                a_src[i] = qa + (size_t)pos * I_max;
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const int r = (threadIdx.x + i * F8_THREADS) / CHUNKS;  // 0 .. 255
            const int wr = r & 127;                                  // the row within its warpgroup's 128
            const int n = MODE == MODE_GATE_UP ? t.n0 + (r >> 7) * 64 + (wr & 63) : t.n0 + r;
            const u8* W = reinterpret_cast<const u8*>(MODE == MODE_GATE_UP && wr >= 64 ? t.W1 : t.W0);
            b_ok[i] = n < t.ncols;
            b_src[i] = W + (size_t)min(n, t.ncols - 1) * t.K;
        }
    }

    __device__ __forceinline__ void load(u8* sA, u8* sB, int k0, int K) const {
        const int kc = k0 + chunk * 16;
        const bool kin = kc < K;
#pragma unroll
        for (int i = 0; i < A_PER; ++i)
            cp_async16(sA + swz128((threadIdx.x + i * F8_THREADS) / CHUNKS, chunk), a_src[i] + (kin ? kc : 0),
                       a_ok[i] && kin);
#pragma unroll
        for (int i = 0; i < B_PER; ++i)
            cp_async16(sB + swz128((threadIdx.x + i * F8_THREADS) / CHUNKS, chunk), b_src[i] + (kin ? kc : 0),
                       b_ok[i] && kin);
    }
};

// The gate/up epilogue with the activation quantized (fp8_gemm.cuh): warpgroup wg holds
// activation columns n0 + 64 wg .. + 63 of all 64 rows, so a row's 128-column amax is the
// larger of the two warpgroups' halves, met through shared memory.
template <int ACT, bool STORE_ACT>
__device__ __forceinline__ void emit_gate_up_fp8(const GemmTile& t, float* d, int wg, float (*row_amax)[F8_BM],
                                                 u8* __restrict__ qact, float* __restrict__ sact, GEMM_ARGS) {
    const FragRows fr(0, t.rows);
    GemmTile tw = t;
    tw.n0 = t.n0 + wg * 64;
    float m[2];
    fp8_gate_up_act<ACT, STORE_ACT>(tw, d, 0, m, GEMM_ARG_NAMES);
#pragma unroll
    for (int h = 0; h < 2; ++h)
        if (fr.t4 == 0) row_amax[wg][fr.r + 8 * h] = m[h];
    __syncthreads();
    float amax[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) amax[h] = fmaxf(row_amax[0][fr.r + 8 * h], row_amax[1][fr.r + 8 * h]);
    fp8_quantize_act(tw, d, 0, amax, wg == 0, qact, sact, I_max);
}

// grid (column tiles, M-tiles of 64 rows), block 256, dynamic smem kernels.sm90_fp8_smem_bytes().
// Beyond GEMM_ARGS: the quantized inputs and their scales [rows, ceil(K / 128)]: for gate/up
// `qa` / `sa` are the expert input's (indexed by token row), `qa_shared` / `sa_shared` x's
// for the shared expert (the same buffers unless a pre-expert norm makes them differ), and
// `q_out` / `s_out` receive the activation's codes and scales ([P, I_max], [P, ceil(I_max /
// 128)]), and with STORE_ACT its bf16 values `out` (read by no kernel: for inspection,
// MoeLayer(keep_w8a8_activation=True)); for down, `qa` / `sa` are the activation's (indexed by
// position, row stride I_max) and `q_out` / `s_out` are unused.
template <int MODE, bool STORE_ACT = false>
__global__ void __launch_bounds__(F8_THREADS, 1)
grouped_gemm_sm90_fp8(GEMM_ARGS, const u8* __restrict__ qa, const float* __restrict__ sa,
                      const u8* __restrict__ qa_shared, const float* __restrict__ sa_shared, u8* __restrict__ q_out,
                      float* __restrict__ s_out) {
    constexpr int BM = F8_BM, BN = F8_BN, BK = F8_BK, S = F8_STAGES;
    static_assert(MODE == MODE_GATE_UP || !STORE_ACT, "only gate/up has an activation to store");
    extern __shared__ __align__(1024) unsigned char f8_smem[];
    __shared__ float row_amax[2][F8_BM];  // gate/up: each warpgroup's amax of a row's 64 columns
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(f8_smem) & 1023u)) & 1023u;
    u8* sA = f8_smem + pad;
    u8* sB = sA + S * BM * BK;
    GemmTile t;
    if (!gemm_tile<MODE, BM, BN, FMT_FP8>(t, GEMM_ARG_NAMES)) return;
    Fp8TileLoader<MODE> ld;
    ld.init(t, qa, qa_shared, sorted_row, shared_slot, H, I_max);
    const int wg = threadIdx.x / 128;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int g = lane >> 2;

    // this thread's two accumulator rows (h = 0, 1; both warpgroups hold all 64 rows) and
    // where their activation scales live
    const float* sa_row[2];
    {
        const bool shared = t.slot == shared_slot;
        const int KBA = MODE == MODE_GATE_UP ? (H + 127) >> 7 : (I_max + 127) >> 7;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(warp * 16 + g + 8 * h, t.rows - 1);
            const int pos = t.pos0 + r;
            sa_row[h] = MODE == MODE_GATE_UP ? (shared ? sa_shared : sa) + (size_t)sorted_row[pos] * KBA
                                             : sa + (size_t)pos * KBA;
        }
    }
    // the weight scale blocks: [ceil(ncols / 128), ceil(K / 128)]. Gate/up: the tile's 128
    // columns of each matrix are one block (n0 is a multiple of 128); down: warpgroup wg's
    // 128 columns are block n0 / 128 + wg (clamped: past the columns nothing is stored).
    const int KBW = (t.K + 127) >> 7;
    const int nb = MODE == MODE_GATE_UP ? t.n0 >> 7 : min(t.n0 + wg * 128, t.ncols - 1) >> 7;
    const float* sw0 = reinterpret_cast<const float*>(t.S0) + (size_t)nb * KBW;
    const float* sw1 = MODE == MODE_GATE_UP ? reinterpret_cast<const float*>(t.S1) + (size_t)nb * KBW : sw0;

    float acc[64], blk[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = blk[i] = 0.0f;

    const int KT = (t.K + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < KT) ld.load(sA + s * BM * BK, sB + s * BN * BK, s * BK, t.K);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 2>();  // this thread's copies of stage kt have landed
        fence_proxy_async();     // ... visible to the tensor cores' (async) proxy
        __syncthreads();         // everyone's copies of stage kt; stage kt - 1 is free
        const int kn = kt + S - 1;
        if (kn < KT) ld.load(sA + (kn % S) * BM * BK, sB + (kn % S) * BN * BK, kn * BK, t.K);
        cp_async_commit();
        const u64 da = wgmma_desc(sA + (kt % S) * BM * BK);
        const u64 db = wgmma_desc(sB + (kt % S) * BN * BK + wg * 128 * BK);
        fp8_block_products(blk, da, db);
        const float a[2] = {sa_row[0][kt], sa_row[1][kt]};
        fp8_promote<MODE == MODE_GATE_UP>(acc, blk, a, sw0[kt], sw1[kt]);
    }
    cp_async_wait<0>();

    if (MODE == MODE_GATE_UP) {
        with_activation(act_code, [&](auto act) {  // one switch, not one per element
            emit_gate_up_fp8<decltype(act)::value, STORE_ACT>(t, acc, wg, row_amax, q_out, s_out, GEMM_ARG_NAMES);
        });
    } else {
        GemmTile tw = t;
        tw.n0 = t.n0 + wg * 128;
        emit_wgmma_rows<MODE, GG_BN>(tw, acc, 0, GEMM_ARG_NAMES);
    }
}
