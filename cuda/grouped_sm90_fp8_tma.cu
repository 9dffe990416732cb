// Hopper (sm_90a) w8a8 grouped GEMM with TMA and a producer warpgroup (fp8-block experts).
//
// grouped_sm90_fp8.cu's products, promotion and epilogues (fp8_gemm.cuh) in the pipeline of
// grouped_sm90_tma.cu. There every thread copies by cp.async and the block meets at two
// barriers a K step; here, 384 threads:
//   warpgroup 2      the producer, down to PRODUCER_REGS registers (setmaxnreg): thread 0
//                    brings each stage's 256 weight rows x 128 codes by TMA (and down's A,
//                    the activation's codes by position, in 64-row boxes), counted on the
//                    stage's `full` mbarrier; for gate/up its 128 threads gather the A rows
//                    (x's codes through sorted_row) by cp.async, each arriving on `full` once
//                    its copies of a stage have landed and it has fenced (the gathering
//                    producer's proxy rule, grouped_sm90_tma.cu).
//   warpgroups 0, 1  consumers, up to CONSUMER_REGS registers, 64 token rows each: per stage
//                    two halves of 128 weight rows, each four m64n128k32 wgmmas into a block
//                    accumulator promoted into that half's (acc += blk * s_a[row] * s_w); the
//                    stage is freed (one arrival a warp) after both; then the epilogue.
// 128 x 256 tiles: a stage brings (128 + 256) x 128 bytes for 128 x 256 x 128 products, the
// cp.async kernel's 64 x 256 tiles (64 + 256) x 128 for half as many: 40 % fewer L2 bytes a
// product. A warpgroup's 256 weight rows are gate/up's 128 activation columns (half h: 64 gate
// rows, then the same 64 up rows, of columns n0 + 64 h ..), one quantization group, so the
// epilogue's amax stays in the warpgroup's registers; down's halves are weight scale blocks
// n0 / 128 and n0 / 128 + 1, written through the warpgroup's A blocks (emit_wgmma_down_staged). Registers: 2 x 64 promoted + 64 block accumulators a thread,
// hence setmaxnreg (without it a third warp on a register file caps a thread at 168).
#include "fp8_gemm.cuh"

#define F8T_BN 256   // weight rows a tile: two halves of 128
#define F8T_BK 128   // codes (bytes) a stage row: one 128 x 128 weight scale block
#define F8T_SUB 64   // rows of an A box and of one warpgroup's wgmmas
#define F8T_BOX 64   // weight rows of a B box
#define F8T_MAP_BYTES 128

// The two shapes (WGS consumer warpgroups; cupymoe/catalog.py Fp8TmaShape mirrors it):
//   WGS 2  128 x 256 tiles, 4 stages, one block an SM: the two warpgroups share each B stage.
//   WGS 1  64 x 256 tiles, 2 stages, two blocks an SM (80 KB of stages and 128 registers a
//          thread at launch each; the producer gives back to 32, the consumers take 224): one
//          block's epilogue and pipeline fill run while the other's wgmmas do, at twice the B
//          bytes from L2 a product.
template <int WGS>
struct Fp8TmaShape {
    static_assert(WGS == 1 || WGS == 2, "one or two consumer warpgroups");
    static constexpr int BM = 64 * WGS;  // token rows a tile: 64 a consumer warpgroup
    static constexpr int STAGES = WGS == 2 ? 4 : 2;
    static constexpr int THREADS = 128 * (WGS + 1);
    static constexpr int BLOCKS_PER_SM = 3 - WGS;
    // registers after setmaxnreg: the consumers take what the producer warpgroup gives back of the
    // block's launch share (65536 / blocks / threads a thread); 216 / 40 spilled down's consumers
    static constexpr int CONSUMER_REGS = WGS == 2 ? 232 : 224;
    static constexpr int PRODUCER_REGS = WGS == 2 ? 40 : 32;
};

// tensor-map indices (cupymoe/tma.py: FP8_MAPS)
#define F8T_MAP_A_DOWN 0         // the activation's codes, the routed experts' I columns
#define F8T_MAP_SHARED_A_DOWN 1  // the shared expert's I_shared columns
#define F8T_MAP_GATE 2
#define F8T_MAP_UP 3
#define F8T_MAP_DOWN 4
#define F8T_MAP_SHARED_GATE 5
#define F8T_MAP_SHARED_UP 6
#define F8T_MAP_SHARED_DOWN 7

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The B boxes of one stage (step kt): gate/up's gate rows n0 .., up rows n0 .., gate rows
// n0 + 64 .., up rows n0 + 64 .. (half h: 64 gate then 64 up rows); down's 256 rows in order.
template <int MODE>
__device__ __forceinline__ void fp8_tma_b(u8* sB, const u8* mapB0, const u8* mapB1, int kt, int brow, u64* bar) {
#pragma unroll
    for (int b = 0; b < F8T_BN / F8T_BOX; ++b) {
        const bool up = MODE == MODE_GATE_UP && (b & 1);
        const int row = MODE == MODE_GATE_UP ? brow + (b >> 1) * F8T_BOX : brow + b * F8T_BOX;
        tma_load_2d(sB + b * F8T_BOX * F8T_BK, up ? mapB1 : mapB0, kt * F8T_BK, row, bar);
    }
}

// The gate/up producer warpgroup: thread T copies 16-byte chunk T % 8 of rows T / 8 + 16 i
// (i < 8) from x's codes through sorted_row, skipping rows past the tile (their outputs are
// masked; a row's products never mix with another's) and zero-filling chunks past K (B's
// are zeros there: codes times zero stay finite). Thread 0 also brings B by TMA. A thread
// marks stage kt full LAG steps later, once its copies have landed and it has fenced.
template <int S, int BM>
__device__ __forceinline__ void fp8_gather_producer(const GemmTile& t, u8* sA, u8* sB, u64* full, u64* empty, int KT,
                                                    const u8* in, int H, const int* __restrict__ sorted_row,
                                                    const u8* mapB0, const u8* mapB1, int brow) {
    // LAG: steps a stage's copies stay in flight before it is marked full (two stages: one, so
    // that the next stage's copies go out before this one's are awaited)
    constexpr int BK = F8T_BK, LAG = S >= 3 ? S - 2 : S - 1, PASS = 128 / 8, RPL = BM / PASS;
    static_assert(S >= 2 && LAG >= 1, "at least one stage of copies in flight");
    const int pt = threadIdx.x - 2 * BM, c = pt & 7;  // the producer warpgroup follows BM / 64 consumer ones
    int src[RPL];  // the thread's rows' input rows, -1 past the tile
#pragma unroll
    for (int i = 0; i < RPL; ++i) {
        const int r = pt / 8 + PASS * i;
        src[i] = r < t.rows ? sorted_row[t.pos0 + r] : -1;
    }
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % S;
        if (kt >= S) mbar_wait(&empty[s], ((kt / S) - 1) & 1);  // its previous use is read
        if (pt == 0) {
            mbar_arrive_expect_tx(&full[s], F8T_BN * BK);
            fp8_tma_b<MODE_GATE_UP>(sB + s * F8T_BN * BK, mapB0, mapB1, kt, brow, &full[s]);
        }
        const int kc = kt * BK + c * 16;
        const bool kin = kc < t.K;
        u8* a = sA + s * BM * BK;
#pragma unroll
        for (int i = 0; i < RPL; ++i)
            if (src[i] >= 0) cp_async16(a + swz128(pt / 8 + PASS * i, c), in + (size_t)src[i] * H + (kin ? kc : 0), kin);
        cp_async_commit();
        gather_mark_full<LAG>(full, kt, S);
    }
    gather_mark_tail<LAG>(full, KT, S);
}

// grid (column tiles, M-tiles of 128 rows), block 384, dynamic smem
// catalog.sm90_fp8_tma_smem_bytes(). The arguments of grouped_gemm_sm90_fp8 (GEMM_ARGS, the
// inputs' codes and scales, the activation's codes and scales out), then `maps`: the
// layer's FP8_MAPS (cupymoe/tma.py). STORE_ACT: gate/up also stores the bf16 activation into
// `out`, as grouped_gemm_sm90_fp8's does.
template <int MODE, bool STORE_ACT = false, int WGS = 2>
__global__ void __launch_bounds__(Fp8TmaShape<WGS>::THREADS, Fp8TmaShape<WGS>::BLOCKS_PER_SM)
grouped_gemm_sm90_fp8_tma(GEMM_ARGS, const u8* __restrict__ qa, const float* __restrict__ sa,
                          const u8* __restrict__ qa_shared, const float* __restrict__ sa_shared,
                          u8* __restrict__ q_out, float* __restrict__ s_out, const u8* __restrict__ maps) {
    using Shape = Fp8TmaShape<WGS>;
    constexpr int BM = Shape::BM, BN = F8T_BN, BK = F8T_BK, S = Shape::STAGES, CONSUMERS = 128 * WGS;
    static_assert(MODE == MODE_GATE_UP || MODE == MODE_DOWN, "the router keeps grouped_sm90.cu");
    static_assert(MODE == MODE_GATE_UP || !STORE_ACT, "only gate/up has an activation to store");
    extern __shared__ __align__(1024) unsigned char f8t_smem[];
    // the swizzle atoms must start on 1024-byte boundaries of the shared window
    const unsigned pad = (1024u - (smem_u32(f8t_smem) & 1023u)) & 1023u;
    u8* sA = f8t_smem + pad;
    u8* sB = sA + S * BM * BK;
    u64* full = reinterpret_cast<u64*>(sB + S * BN * BK);
    u64* empty = full + S;

    GemmTile t;
    if (!gemm_tile<MODE, BM, BN, FMT_FP8>(t, GEMM_ARG_NAMES)) return;
    const int KT = (t.K + BK - 1) / BK;
    const int subs = (t.rows + F8T_SUB - 1) / F8T_SUB;  // A boxes holding rows (down); warpgroups with rows
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            // the producer's arrive.expect_tx, then the bytes (gate/up: and each gathering thread's arrival)
            mbar_init(&full[s], MODE == MODE_GATE_UP ? 1 + 128 : 1);
            mbar_init(&empty[s], 4 * WGS);  // every consumer warp, once its wgmmas have read the stage
        }
        mbar_init_fence();
    }
    __syncthreads();

    const bool sh = t.slot == shared_slot;
    const u8* mapB0 = maps + F8T_MAP_BYTES * (MODE == MODE_GATE_UP ? (sh ? F8T_MAP_SHARED_GATE : F8T_MAP_GATE)
                                                                    : (sh ? F8T_MAP_SHARED_DOWN : F8T_MAP_DOWN));
    const u8* mapB1 = maps + F8T_MAP_BYTES * (sh ? F8T_MAP_SHARED_UP : F8T_MAP_UP);
    // the slot's first weight row in its map: routed experts are stacked, t.ncols rows each
    const int brow = (sh ? 0 : t.slot * t.ncols) + t.n0;

    if (threadIdx.x >= CONSUMERS) {  // ---- the producer warpgroup ----
        setmaxnreg_dec<Shape::PRODUCER_REGS>();
        if (threadIdx.x == CONSUMERS) {  // the tensor maps into the TMA unit's cache before their first copies
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(mapB0) : "memory");
            if (MODE == MODE_GATE_UP) asm volatile("prefetch.tensormap [%0];\n" ::"l"(mapB1) : "memory");
        }
        if (MODE == MODE_GATE_UP) {
            fp8_gather_producer<S, BM>(t, sA, sB, full, empty, KT, sh ? qa_shared : qa, H, sorted_row, mapB0, mapB1, brow);
        } else if (threadIdx.x == CONSUMERS) {
            const u8* mapA = maps + F8T_MAP_BYTES * (sh ? F8T_MAP_SHARED_A_DOWN : F8T_MAP_A_DOWN);
            const unsigned bytes = (subs * F8T_SUB + BN) * BK;
            for (int kt = 0; kt < KT; ++kt) {
                const int s = kt % S;
                if (kt >= S) mbar_wait(&empty[s], ((kt / S) - 1) & 1);
                mbar_arrive_expect_tx(&full[s], bytes);
                for (int j = 0; j < subs; ++j)
                    tma_load_2d(sA + (s * BM + j * F8T_SUB) * BK, mapA, kt * BK, t.pos0 + j * F8T_SUB, &full[s]);
                fp8_tma_b<MODE_DOWN>(sB + s * BN * BK, mapB0, mapB1, kt, brow, &full[s]);
            }
        }
        return;
    }
    setmaxnreg_inc<Shape::CONSUMER_REGS>();

    // ---- consumers: warpgroup wg rows 64 wg .. 64 wg + 63 ----
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
    const bool has_rows = wg < subs;  // past the tile's rows: no wgmmas, the handshakes kept
    float w[2];  // down: the rows' routing weights, read before the main loop (down_row_weights)
    if (MODE == MODE_DOWN && has_rows) down_row_weights(w, t, wg * F8T_SUB, GEMM_ARG_NAMES);
    const FragRows fr(wg * F8T_SUB, t.rows);
    // the thread's two rows' activation scales ([rows, ceil(K / 128)]; clamped into the tile)
    const float* sa_row[2];
    {
        const int KBA = MODE == MODE_GATE_UP ? (H + 127) >> 7 : (I_max + 127) >> 7;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int pos = t.pos0 + min(fr.r + 8 * h, t.rows - 1);
            sa_row[h] = MODE == MODE_GATE_UP ? (sh ? sa_shared : sa) + (size_t)sorted_row[pos] * KBA
                                             : sa + (size_t)pos * KBA;
        }
    }
    // the weight scale blocks [ceil(ncols / 128), ceil(K / 128)]: gate/up's 128 columns are one
    // block of each matrix (n0 a multiple of 128); down's half h is block n0 / 128 + h (clamped:
    // past the columns nothing is stored)
    const int KBW = (t.K + 127) >> 7;
    const float* S0 = reinterpret_cast<const float*>(t.S0);
    const float* sw0 = S0 + (size_t)(t.n0 >> 7) * KBW;
    const float* sw1 = MODE == MODE_GATE_UP ? reinterpret_cast<const float*>(t.S1) + (size_t)(t.n0 >> 7) * KBW
                                            : S0 + (size_t)(min(t.n0 + 128, t.ncols - 1) >> 7) * KBW;

    float acc[2][64], blk[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = blk[i] = 0.0f;
    // the scales a step ahead: step kt + 1's loads are in flight through step kt's products
    float a_next[2] = {sa_row[0][0], sa_row[1][0]}, s0_next = sw0[0], s1_next = sw1[0];
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % S;
        const float a[2] = {a_next[0], a_next[1]};
        const float s0 = s0_next, s1 = s1_next;
        if (kt + 1 < KT) {
            a_next[0] = sa_row[0][kt + 1];
            a_next[1] = sa_row[1][kt + 1];
            s0_next = sw0[kt + 1];
            s1_next = sw1[kt + 1];
        }
        mbar_wait(&full[s], (kt / S) & 1);
        if (has_rows) {
            const u64 da = wgmma_desc(sA + (s * BM + wg * F8T_SUB) * BK);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                fp8_block_products(blk, da, wgmma_desc(sB + (s * BN + half * 128) * BK));
                // the stage is read once the last half's wgmmas are: free it before promoting
                if (half == 1 && lane == 0) mbar_arrive(&empty[s]);
                if (MODE == MODE_GATE_UP)
                    fp8_promote<true>(acc[half], blk, a, s0, s1);
                else
                    fp8_promote<false>(acc[half], blk, a, half ? s1 : s0, 0.0f);
            }
        } else if (lane == 0) {
            mbar_arrive(&empty[s]);  // no wgmmas: the handshake alone
        }
    }
    if (!has_rows) return;

    if (MODE == MODE_GATE_UP) {
        with_activation(act_code, [&](auto act) {  // one switch, not one per element
            GemmTile tw[2] = {t, t};
            float m[2][2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                tw[half].n0 = t.n0 + half * 64;
                fp8_gate_up_act<decltype(act)::value, STORE_ACT>(tw[half], acc[half], wg * F8T_SUB, m[half],
                                                                 GEMM_ARG_NAMES);
            }
            const float amax[2] = {fmaxf(m[0][0], m[1][0]), fmaxf(m[0][1], m[1][1])};  // the row's 128 columns
#pragma unroll
            for (int half = 0; half < 2; ++half)
                fp8_quantize_act(tw[half], acc[half], wg * F8T_SUB, amax, half == 0, q_out, s_out, I_max);
        });
    } else {  // each half's weighted bf16 outputs through the warpgroup's A blocks, 16-byte stores
        bf16* a0 = reinterpret_cast<bf16*>(sA + wg * F8T_SUB * BK);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            GemmTile tw = t;
            tw.n0 = t.n0 + half * 128;
            if (tw.n0 < tw.ncols) emit_wgmma_down_staged<GG_BN, S>(tw, acc[half], w, wg * F8T_SUB, a0, BM * BK / 2,
                                                                   GEMM_ARG_NAMES);
        }
    }
}
