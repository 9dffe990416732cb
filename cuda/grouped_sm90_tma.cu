// Hopper (sm_90a) grouped GEMM, bf16: TMA loads and a producer warp.
//
// The tiles, modes, arguments and epilogues of grouped_sm90.cu (gemm_common.cuh); what
// differs is how a stage arrives. There every thread issues cp.async copies (A rows
// gathered through sorted_row) and the block meets at two barriers a K step. Here:
//   warp 8 (one lane)  the producer: a TMA copy of each 64-row half of the A tile that
//                      holds rows and one or two of the B tile per stage, counted on the
//                      stage's `full` mbarrier;
//   warps 0 .. 7       two consumer warpgroups, 64 rows each: wait for `full`, issue the
//                      m64nBNk16 wgmmas, and once a step's wgmmas are done mark its stage
//                      `empty` (one arrival per warp); then the tile's epilogue.
// No block-wide barrier in the main loop, no address arithmetic in the consumers, and the
// copies cost the consumers no issue slots. 192-row tiles (WGS = 3) have three consumer
// warpgroups and no producer warp: their thread 0 issues the copies between its wgmmas.
//
// TMA reads rectangular boxes, so A must be contiguous in sorted order: gate/up reads xg,
// the expert inputs gathered by gather_rows (below), down reads act as it is; or gate/up's
// producer is 4 warps that gather the A rows themselves by cp.async (GATHER,
// gather_producer below) and only B comes by TMA. The tensor
// maps (cupymoe/tma.py) live in global memory in the order of the TMA_MAP_* indices;
// routed experts' stacked weights are one map each ([n_local * rows, K]), the shared
// expert's its own. Every map's inner extent is its operand's exact K (act is read through
// one map for the routed experts' I and one for the shared expert's), so past K both
// operands arrive as zeros, never as whatever the buffer holds there; rows past a tile's
// expert (the next expert's, or zeros) only reach outputs the epilogue masks.
//
// Variants (kernels.sm90_variant_for picks by I): 128 x 128 tiles ("tma"), 128 x 256 at
// one block an SM ("tma_wide"), the same with the gathering producer ("gather_wide": no
// gather_rows pass, worth most where a gathered row feeds the fewest columns, small I), and
// 192 x 256 ("tma_192": the tiles run at L2's throughput, and these read fewer L2 bytes a
// product). Slower, so not kept: A rows by one-row TMA boxes (the copies' issue), blocks
// paired in clusters to multicast A or B (each pair waits on its slower half), persistent
// tile walks, and 192-row gate/up tiles whose consumers gather A themselves.
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define TMA_BK 64
#define TMA_SUB 64       // rows of an A box and of one warpgroup's m64 wgmmas
#define GATHER_WARPS 4   // the gathering producer's warps (GATHER): 384 threads
#define TMA_MAP_BYTES 128

// tensor-map indices (cupymoe/tma.py: TMA_MAPS)
#define TMA_MAP_A_GATE_UP 0
#define TMA_MAP_A_DOWN 1         // act's first I columns (routed experts' K)
#define TMA_MAP_SHARED_A_DOWN 2  // act's first I_shared columns
#define TMA_MAP_GATE 3
#define TMA_MAP_UP 4
#define TMA_MAP_DOWN 5
#define TMA_MAP_SHARED_GATE 6
#define TMA_MAP_SHARED_UP 7
#define TMA_MAP_SHARED_DOWN 8
#define TMA_MAP_YW 9             // down's output (TMA stores of full 64-row blocks)
// the LoRA stacked form's extra K (grouped_gemm_sm90_tma_lora; cupymoe/lora_stack.py)
#define TMA_MAP_LORA_T_GU 10     // gate/up's extra A: T [P, 2 KS] (gate's KS columns, then up's)
#define TMA_MAP_LORA_T_DOWN 11   // down's extra A: T [P, KS]
#define TMA_MAP_LORA_B_GATE 12   // Bext of gate [S I_max, KS] (every table slot, the shared expert's too)
#define TMA_MAP_LORA_B_UP 13     // Bext of up [S I_max, KS]
#define TMA_MAP_LORA_B_DOWN 14   // Bext of down [S H, KS]

// The gathering producer (GATHER): the whole producer warp copies the A rows of gate/up
// straight from x / xe through sorted_row by cp.async, 16 bytes a lane, into the layout
// the TMA box would have left (128-byte swizzle), while lane 0 still brings B by TMA: no
// gather_rows pass, whose P x H bytes are written and then read back from HBM. cp.async
// writes through the generic proxy and wgmma reads through the async one, so a lane marks
// a stage full only once its own copies of it have landed and it has fenced
// (fence.proxy.async, as grouped_sm90.cu's threads do before their barrier): it waits for
// them GatherLag stages later, keeping that many stages of copies in flight.
// Lag <= S - 2: a consumer frees stage kt - 1 only after stage kt is full, and the
// producer's wait for that free slot (at step kt - 1 + S) must come after it marked kt full
// (at step kt + LAG).
template <int S>
struct GatherLag {
    static constexpr int value = S - 2;
    static_assert(S >= 3, "the gathering producer keeps at least one stage of copies in flight");
};

// The TMA copies of one stage (step kt): A's 64-row boxes that hold rows (`subs` of them),
// then B (gate/up: BN / 2 gate rows and as many up rows; down: BN rows), all counted on
// the stage's `full` barrier after one arrival announcing `bytes`.
template <int MODE, int BM, int BN>
__device__ __forceinline__ void tma_copy_stage(bf16* sA, bf16* sB, u64* full, int kt, int S, int subs, unsigned bytes,
                                               const u8* mapA, const u8* mapB0, const u8* mapB1, int arow, int brow) {
    constexpr int BK = TMA_BK;
    const int s = kt % S;
    mbar_arrive_expect_tx(&full[s], bytes);
    for (int j = 0; j < subs; ++j)
        tma_load_2d(sA + (s * BM + j * TMA_SUB) * BK, mapA, kt * BK, arow + j * TMA_SUB, &full[s]);
    if (MODE == MODE_GATE_UP) {  // BN / 2 gate rows, then as many up rows
        tma_load_2d(sB + s * BN * BK, mapB0, kt * BK, brow, &full[s]);
        tma_load_2d(sB + s * BN * BK + (BN / 2) * BK, mapB1, kt * BK, brow, &full[s]);
    } else {
        tma_load_2d(sB + s * BN * BK, mapB0, kt * BK, brow, &full[s]);
    }
}

// The LoRA stacked form's extra K steps (LORA): after the KT steps of K, `lora_steps` steps of
// 64 columns (down) or 2 lora_steps (gate/up) whose A is the shrink's T (cuda/lora.cu
// lora_stack_t_*: row pos's s t in the columns of its adapter, zeros elsewhere) and whose B is
// the experts' stacked B (Bext: row c of table slot e, column (q K + a) R + r = B_{a,e}[c, r]).
// Gate/up: T's first KS = 64 lora_steps columns are gate's, the next KS up's; the gate half of
// the B tile reads gate's Bext at k = 64 j and the up half up's at k = 64 j - KS, so each half
// is zeros (TMA's fill: the box lies past its map's KS columns) on the other's steps and the
// accumulator gets g + B_g t_g in gate's columns, u + B_u t_u in up's. Bytes as a base step; the
// consumers multiply only the half a step holds (wgmma_k64_bf16_half: the other's products are zeros).
// The coordinates of a box wholly out of its map stay non-negative (KS + 64 j for up's first
// steps): the fill needs no negative coordinate.
template <int MODE, int BM, int BN>
__device__ __forceinline__ void tma_copy_stage_lora(bf16* sA, bf16* sB, u64* full, int kt, int j, int KS, int S,
                                                    int subs, unsigned bytes, const u8* maps, int arow,
                                                    int brow) {
    constexpr int BK = TMA_BK;
    const int s = kt % S;
    const u8* mapA = maps + TMA_MAP_BYTES * (MODE == MODE_GATE_UP ? TMA_MAP_LORA_T_GU : TMA_MAP_LORA_T_DOWN);
    pdl_wait();  // T is the shrink's, the launch before (by PDL on the prefill path: it may still run)
    mbar_arrive_expect_tx(&full[s], bytes);
    for (int i = 0; i < subs; ++i)
        tma_load_2d(sA + (s * BM + i * TMA_SUB) * BK, mapA, j * BK, arow + i * TMA_SUB, &full[s]);
    if (MODE == MODE_GATE_UP) {
        const int kg = j * BK, ku = kg < KS ? kg + KS : kg - KS;  // past KS: that half's zeros
        tma_load_2d(sB + s * BN * BK, maps + TMA_MAP_BYTES * TMA_MAP_LORA_B_GATE, kg, brow, &full[s]);
        tma_load_2d(sB + s * BN * BK + (BN / 2) * BK, maps + TMA_MAP_BYTES * TMA_MAP_LORA_B_UP, ku, brow, &full[s]);
    } else {
        tma_load_2d(sB + s * BN * BK, maps + TMA_MAP_BYTES * TMA_MAP_LORA_B_DOWN, j * BK, brow, &full[s]);
    }
}

// Step kt's copies: K's (kt < KT) or, with LORA, the extra K's (lora_brow: the tile's first
// row in the Bext maps).
template <int MODE, int BM, int BN, int LORA>
__device__ __forceinline__ void tma_copy_step(bf16* sA, bf16* sB, u64* full, int kt, int KT, int KS, int S, int subs,
                                              unsigned bytes, const u8* mapA, const u8* mapB0, const u8* mapB1,
                                              const u8* maps, int arow, int brow, int lora_brow) {
    if (LORA && kt >= KT)
        tma_copy_stage_lora<MODE, BM, BN>(sA, sB, full, kt, kt - KT, KS, S, subs, bytes, maps, arow, lora_brow);
    else
        tma_copy_stage<MODE, BM, BN>(sA, sB, full, kt, S, subs, bytes, mapA, mapB0, mapB1, arow, brow);
}

// The gathering producer's main loop (GATHER_WARPS warps): thread T copies 16-byte chunk
// T % 8 of the tile's rows T / 8 + 4 GATHER_WARPS i, skipping rows past the tile's
// (their outputs are masked; a row's products never mix with another's) and zero-filling
// chunks past K (B's are zeros there, and garbage times zero could be NaN). Its thread 0
// also brings the stage's B tile by TMA, as the plain producer does. Four warps, because one
// alone (32 copies a lane a stage) keeps too few copies in flight.
template <int S, int BN, int LORA = 0>
__device__ __forceinline__ void gather_producer(const GemmTile& t, bf16* sA, bf16* sB, u64* full, u64* empty, int KT,
                                                unsigned b_bytes, const u8* maps, GEMM_ARGS, int KX = 0,
                                                int lora_brow = 0) {
    constexpr int BM = 2 * TMA_SUB, BK = TMA_BK, LAG = GatherLag<S>::value;  // beside two consumer warpgroups
    constexpr int PASS = GATHER_WARPS * 32 / 8, RPL = BM / PASS;  // rows a pass, rows a thread
    const int pt = threadIdx.x - 256, c = pt & 7;
    const bool sh = t.slot == shared_slot;
    const bf16* in = sh ? x : xe;  // the shared expert reads x
    int src[RPL];                   // the thread's rows' input rows, -1 past the tile
#pragma unroll
    for (int i = 0; i < RPL; ++i) {
        const int r = pt / 8 + PASS * i;
        src[i] = r < t.rows ? sorted_row[t.pos0 + r] : -1;
    }
    const u8* mapB0 = maps + TMA_MAP_BYTES * (sh ? TMA_MAP_SHARED_GATE : TMA_MAP_GATE);
    const u8* mapB1 = maps + TMA_MAP_BYTES * (sh ? TMA_MAP_SHARED_UP : TMA_MAP_UP);
    const int brow = (sh ? 0 : t.slot * t.ncols) + t.n0;
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % S;
        if (kt >= S) mbar_wait(&empty[s], ((kt / S) - 1) & 1);  // its previous use is read
        if (pt == 0) {
            mbar_arrive_expect_tx(&full[s], b_bytes);
            tma_load_2d(sB + s * BN * BK, mapB0, kt * BK, brow, &full[s]);
            tma_load_2d(sB + s * BN * BK + (BN / 2) * BK, mapB1, kt * BK, brow, &full[s]);
        }
        const int kc = kt * BK + c * 8;
        const bool kin = kc < t.K;
        bf16* a = sA + s * BM * BK;
#pragma unroll
        for (int i = 0; i < RPL; ++i)
            if (src[i] >= 0) cp_async16(a + swz<BK>(pt / 8 + PASS * i, c), in + (size_t)src[i] * H + (kin ? kc : 0), kin);
        cp_async_commit();
        gather_mark_full<LAG>(full, kt, S);
    }
    if (LORA) {  // the extra K's steps: T is in sorted order already, so A comes by TMA too
        const int subs = (t.rows + TMA_SUB - 1) / TMA_SUB;
        for (int kt = KT; kt < KT + KX; ++kt) {
            const int s = kt % S;
            if (kt >= S) mbar_wait(&empty[s], ((kt / S) - 1) & 1);
            if (pt == 0)
                tma_copy_stage_lora<MODE_GATE_UP, BM, BN>(sA, sB, full, kt, kt - KT, KX / 2 * BK, S, subs,
                                                          b_bytes + subs * TMA_SUB * BK * 2, maps, t.pos0, lora_brow);
            cp_async_commit();  // no copies of its own: the group keeps gather_mark_full's count
            gather_mark_full<LAG>(full, kt, S);
        }
    }
    gather_mark_tail<LAG>(full, KT + KX, S);
}

// grid (column tiles, M-tiles), block kernels.Sm90Variant.threads(), dynamic smem
// kernels.Sm90Variant.smem_bytes(). BN: weight rows per tile. maps: the layer's tensor
// maps. GATHER (gate/up only): A rows gathered by the producer warps' cp.async instead of
// read from xg by TMA. WGS: consumer warpgroups, 64 rows each: 2 (128-row tiles, and a
// producer warp, or GATHER_WARPS gathering ones), or 3 (192-row tiles, no producer warp:
// thread 0 also issues the copies, refilling a stage once every warp has freed it). A
// thirteenth warp would put four warps on one of the SM's four register files, capping a
// thread at 128 registers, and the m64n256 wgmma's accumulators alone are 128.
//
// Why 192 rows: the GEMMs run at L2's throughput, and a tile's L2 bytes a stage are
// (BM + BN) rows: 192 x 256 tiles read 23 % fewer bytes per product than 128 x 256, and an
// expert of 257-384 rows takes 2 tiles, not 3.
template <int MODE, int STAGES, int BN, int GATHER, int WGS, int LORA>
__device__ __forceinline__ void grouped_sm90_tma_body(GEMM_ARGS, const u8* __restrict__ maps, int lora_steps) {
    constexpr int BM = WGS * TMA_SUB, BK = TMA_BK, S = STAGES, NACC = BN / 2, CONSUMERS = WGS * 128;
    static_assert(MODE == MODE_GATE_UP || MODE == MODE_DOWN, "the router keeps grouped_sm90.cu");
    static_assert(!GATHER || MODE == MODE_GATE_UP, "down reads act in sorted order already");
    static_assert(BK == 64, "one 128-byte swizzle row per tile row: TMA box and wgmma descriptor agree");
    static_assert(WGS == 2 || WGS == 3, "128- or 192-row tiles");
    static_assert(!GATHER || WGS == 2, "the gathering producer's warps would cap the registers (see above)");
    constexpr bool INLINE = WGS == 3;  // thread 0 copies; no producer warp
    extern __shared__ __align__(1024) unsigned char tma_smem[];
    // the swizzle atoms must start on 1024-byte boundaries of the shared window
    const unsigned pad = (1024u - (smem_u32(tma_smem) & 1023u)) & 1023u;
    bf16* sA = reinterpret_cast<bf16*>(tma_smem + pad);
    bf16* sB = sA + S * BM * BK;
    u64* full = reinterpret_cast<u64*>(sB + S * BN * BK);
    u64* empty = full + S;

    GemmTile t;
    if (!gemm_tile<MODE, BM, BN>(t, GEMM_ARG_NAMES)) {
        if (LORA) pdl_leave_early();  // the grid never completes before the shrink it follows
        return;
    }
    const int KT = (t.K + BK - 1) / BK;
    // LORA: the extra K's steps (tma_copy_stage_lora), after K's; KS: T's columns a projection
    const int KX = LORA ? (MODE == MODE_GATE_UP ? 2 : 1) * lora_steps : 0, KS = LORA ? lora_steps * BK : 0;
    const int KTT = KT + KX;
    // A arrives in 64-row boxes, only those holding rows: a run's short last tile reads and
    // multiplies no more than its rows round up to (whole boxes count, zero-filled or not)
    const int subs = (t.rows + TMA_SUB - 1) / TMA_SUB;
    // the bytes TMA brings a stage (with GATHER, B's alone)
    const unsigned stage_bytes = ((GATHER ? 0 : subs * TMA_SUB) + BN) * BK * 2;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            // the producer's arrive.expect_tx, then the bytes (and with GATHER each producer
            // lane's arrival once its copies have landed)
            mbar_init(&full[s], GATHER ? 1 + 32 * GATHER_WARPS : 1);
            mbar_init(&empty[s], 4 * WGS);  // every consumer warp, once its wgmmas have read the stage
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (GATHER && threadIdx.x >= CONSUMERS) {  // ---- the gathering producer ----
        gather_producer<S, BN, LORA>(t, sA, sB, full, empty, KT, stage_bytes, maps, GEMM_ARG_NAMES, KX,
                                     t.slot * I_max + t.n0);
        return;
    }
    if (!INLINE && threadIdx.x > CONSUMERS) return;
    const bool sh = t.slot == shared_slot;
    const u8* mapA = maps + TMA_MAP_BYTES * (MODE == MODE_GATE_UP ? TMA_MAP_A_GATE_UP
                                                                   : (sh ? TMA_MAP_SHARED_A_DOWN : TMA_MAP_A_DOWN));
    const u8* mapB0 = maps + TMA_MAP_BYTES * (MODE == MODE_GATE_UP ? (sh ? TMA_MAP_SHARED_GATE : TMA_MAP_GATE)
                                                                    : (sh ? TMA_MAP_SHARED_DOWN : TMA_MAP_DOWN));
    const u8* mapB1 = maps + TMA_MAP_BYTES * (sh ? TMA_MAP_SHARED_UP : TMA_MAP_UP);
    // the slot's first weight row in its map: routed experts are stacked, t.ncols rows each
    const int brow = (sh ? 0 : t.slot * t.ncols) + t.n0;
    // LORA: the slot's first row in the Bext maps (every table slot I_max rows for gate/up, H for down)
    const int lora_brow = LORA ? t.slot * (MODE == MODE_GATE_UP ? I_max : H) + t.n0 : 0;
    if (!INLINE && threadIdx.x == CONSUMERS) {  // ---- the producer ----
        for (int kt = 0; kt < KTT; ++kt) {
            if (kt >= S) mbar_wait(&empty[kt % S], ((kt / S) - 1) & 1);  // its previous use is read
            tma_copy_step<MODE, BM, BN, LORA>(sA, sB, full, kt, KT, KS, S, subs, stage_bytes, mapA, mapB0, mapB1, maps,
                                              t.pos0, brow, lora_brow);
        }
        return;
    }
    if (INLINE && threadIdx.x == 0)  // the first stages
        for (int kt = 0; kt < min(S, KTT); ++kt)
            tma_copy_step<MODE, BM, BN, LORA>(sA, sB, full, kt, KT, KS, S, subs, stage_bytes, mapA, mapB0, mapB1, maps,
                                              t.pos0, brow, lora_brow);

    // ---- consumers: warpgroup w rows 64 w .. 64 w + 63 ----
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
    // a run's last tile often holds fewer rows: a warpgroup past them issues no wgmmas
    // (the tensor cores go to the SM's other warpgroups) but keeps the handshakes
    const bool has_rows = wg < subs;
    float w[2];  // down: the rows' routing weights, read before the main loop (down_row_weights)
    if (MODE == MODE_DOWN && has_rows) down_row_weights(w, t, wg * TMA_SUB, GEMM_ARG_NAMES);
    float d[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.0f;
    for (int kt = 0; kt < KTT; ++kt) {
        const int s = kt % S;
        mbar_wait(&full[s], (kt / S) & 1);
        const u64 da = wgmma_desc(sA + (s * BM + wg * TMA_SUB) * BK);
        const u64 db = wgmma_desc(sB + s * BN * BK);
        if (has_rows) {
            if (LORA && MODE == MODE_GATE_UP && kt >= KT)  // an extra K step: the other half's B is zeros
                wgmma_k64_bf16_half<BN>(d, da, db, kt - KT < KX / 2);
            else
                wgmma_k64_bf16<BN>(d, da, db);
        }
        wgmma_wait<1>();  // this warp's wgmmas of step kt - 1 are done: free their stage for
        // the producer, when it refills it (step kt - 1 + S exists)
        if (kt > 0 && kt - 1 + S < KTT && lane == 0) {
            mbar_arrive(&empty[(kt - 1) % S]);
            if (INLINE && threadIdx.x == 0) {  // every warp freed it: refill for step kt - 1 + S
                mbar_wait(&empty[(kt - 1) % S], ((kt - 1) / S) & 1);
                tma_copy_step<MODE, BM, BN, LORA>(sA, sB, full, kt - 1 + S, KT, KS, S, subs, stage_bytes, mapA,
                                                  mapB0, mapB1, maps, t.pos0, brow, lora_brow);
            }
        }
    }
    wgmma_wait<0>();
    fence_acc<NACC>(d);
    if (!has_rows) return;
    if (MODE == MODE_DOWN && t.rows - wg * TMA_SUB >= TMA_SUB)  // a full warpgroup: TMA stores
        emit_wgmma_down_tma<BN, S>(t, d, w, wg * TMA_SUB, sA + wg * TMA_SUB * BK, BM * BK,
                                   maps + TMA_MAP_BYTES * TMA_MAP_YW, GEMM_ARG_NAMES);
    else if (MODE == MODE_DOWN)  // the output through this warpgroup's A blocks, 16-byte stores
        emit_wgmma_down_staged<BN, S>(t, d, w, wg * TMA_SUB, sA + wg * TMA_SUB * BK, BM * BK, GEMM_ARG_NAMES);
    else
        emit_wgmma_rows<MODE, BN>(t, d, wg * TMA_SUB, GEMM_ARG_NAMES);
}

template <int MODE, int STAGES, int BN, int BLOCKS_PER_SM, int GATHER = 0, int WGS = 2>
__global__ void __launch_bounds__(WGS * 128 + (WGS == 3 ? 0 : GATHER ? 32 * GATHER_WARPS : 32), BLOCKS_PER_SM)
grouped_gemm_sm90_tma(GEMM_ARGS, const u8* __restrict__ maps) {
    grouped_sm90_tma_body<MODE, STAGES, BN, GATHER, WGS, 0>(GEMM_ARG_NAMES, maps, 0);
}

// The LoRA stacked form (docs/DESIGN.md, LoRA): grouped_gemm_sm90_tma with the experts' deltas as
// lora_steps (down) or 2 lora_steps (gate/up) extra K steps of 64 (tma_copy_stage_lora): gate/up's
// activation sees g + B_g t_g and u + B_u t_u, down's epilogue weights and stores y + B t. A
// kernel of its own, so the base kernels' code and names stay what they were.
template <int MODE, int STAGES, int BN, int BLOCKS_PER_SM, int GATHER, int WGS>
__global__ void __launch_bounds__(WGS * 128 + (WGS == 3 ? 0 : GATHER ? 32 * GATHER_WARPS : 32), BLOCKS_PER_SM)
grouped_gemm_sm90_tma_lora(GEMM_ARGS, const u8* __restrict__ maps, int lora_steps) {
    grouped_sm90_tma_body<MODE, STAGES, BN, GATHER, WGS, 1>(GEMM_ARG_NAMES, maps, lora_steps);
}

// xg[pos] = the expert input of sorted position pos (x for the shared expert's rows, else
// xe: x itself or its pre-expert norm), so the TMA kernel's gate/up reads contiguous rows.
// grid (tile bound), block 256: one block per M-tile of tile_info (128-row tiles).
__global__ void __launch_bounds__(256)
gather_rows(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ num_tiles,
            const int4* __restrict__ tile_info, const int* __restrict__ sorted_row, int shared_slot, int H,
            bf16* __restrict__ xg) {
    if ((int)blockIdx.x >= *num_tiles) return;
    const int4 ti = tile_info[blockIdx.x];
    const bf16* in = ti.x == shared_slot ? x : xe;
    const int V = H / 8;  // 16-byte vectors per row
    for (int r = threadIdx.x / 32; r < ti.z; r += 8) {  // a warp per row
        const int pos = ti.y + r;
        const uint4* src = reinterpret_cast<const uint4*>(in + (size_t)sorted_row[pos] * H);
        uint4* dst = reinterpret_cast<uint4*>(xg + (size_t)pos * H);
        for (int v = threadIdx.x & 31; v < V; v += 32) dst[v] = src[v];
    }
}
