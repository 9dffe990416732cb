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
// copies cost the consumers no issue slots.
//
// TMA reads rectangular boxes, so A must be contiguous in sorted order: gate/up reads xg,
// the expert inputs gathered by gather_rows (below), down reads act as it is. The tensor
// maps (cupymoe/tma.py) live in global memory in the order of the TMA_MAP_* indices;
// routed experts' stacked weights are one map each ([n_local * rows, K]), the shared
// expert's its own. Every map's inner extent is its operand's exact K (act is read through
// one map for the routed experts' I and one for the shared expert's), so past K both
// operands arrive as zeros, never as whatever the buffer holds there; rows past a tile's
// expert (the next expert's, or zeros) only reach outputs the epilogue masks.
//
// Measured (benchmarks/NOTES.md v18): 1.07-1.19x the cp.async kernel on the shapes with
// I >= 1536, about even at I = 768 and slower at I = 512, where gather_rows' extra pass over
// the inputs weighs most (kernels.sm90_variant_for picks by I). v22: 128 x 256 tiles at one
// block an SM ("tma_wide") once the epilogue stopped stalling on instruction fetch
// (gemm_common.cuh emit_wgmma_rows); 256 x 128 tiles were slower. Tried and dropped: the A rows
// copied by 128 one-row TMA boxes a stage instead of xg (the swizzle lands right, but the
// copies' issue made gate/up 4x slower), pairs of blocks multicasting one A tile (1.2x
// slower: each pair waits on its slower half), 128 x 256 tiles at one block per SM.
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define TMA_BK 64
#define TMA_SUB 64       // rows of an A box and of one warpgroup's m64 wgmmas
#define TMA_THREADS 288  // 2 consumer warpgroups + 1 producer warp
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

// grid (column tiles, M-tiles), block 288, dynamic smem kernels.Sm90Variant.smem_bytes().
// BN: weight rows per tile. maps: the layer's tensor maps.
template <int MODE, int STAGES, int BN, int BLOCKS_PER_SM>
__global__ void __launch_bounds__(TMA_THREADS, BLOCKS_PER_SM)
grouped_gemm_sm90_tma(GEMM_ARGS, const u8* __restrict__ maps) {
    constexpr int BM = 2 * TMA_SUB, BK = TMA_BK, S = STAGES, NACC = BN / 2;
    static_assert(MODE == MODE_GATE_UP || MODE == MODE_DOWN, "the router keeps grouped_sm90.cu");
    static_assert(BK == 64, "one 128-byte swizzle row per tile row: TMA box and wgmma descriptor agree");
    extern __shared__ __align__(1024) unsigned char tma_smem[];
    // the swizzle atoms must start on 1024-byte boundaries of the shared window
    const unsigned pad = (1024u - (smem_u32(tma_smem) & 1023u)) & 1023u;
    bf16* sA = reinterpret_cast<bf16*>(tma_smem + pad);
    bf16* sB = sA + S * BM * BK;
    u64* full = reinterpret_cast<u64*>(sB + S * BN * BK);
    u64* empty = full + S;

    GemmTile t;
    if (!gemm_tile<MODE, BM, BN>(t, GEMM_ARG_NAMES)) return;
    const int KT = (t.K + BK - 1) / BK;
    // A arrives in 64-row boxes, only those holding rows: a run's short last tile reads and
    // multiplies no more than its rows round up to (whole boxes count, zero-filled or not)
    const int subs = (t.rows + TMA_SUB - 1) / TMA_SUB;
    const unsigned stage_bytes = (subs * TMA_SUB + BN) * BK * 2;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(&full[s], 1);   // the producer's arrive.expect_tx, then the bytes
            mbar_init(&empty[s], 8);  // every consumer warp, once its wgmmas have read the stage
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x >= 256) {  // ---- the producer ----
        if (threadIdx.x != 256) return;
        const bool sh = t.slot == shared_slot;
        const u8* mapA = maps + TMA_MAP_BYTES * (MODE == MODE_GATE_UP ? TMA_MAP_A_GATE_UP
                                                                       : (sh ? TMA_MAP_SHARED_A_DOWN : TMA_MAP_A_DOWN));
        const u8* mapB0 = maps + TMA_MAP_BYTES * (MODE == MODE_GATE_UP ? (sh ? TMA_MAP_SHARED_GATE : TMA_MAP_GATE)
                                                                        : (sh ? TMA_MAP_SHARED_DOWN : TMA_MAP_DOWN));
        const u8* mapB1 = maps + TMA_MAP_BYTES * (sh ? TMA_MAP_SHARED_UP : TMA_MAP_UP);
        // the slot's first weight row in its map: routed experts are stacked, t.ncols rows each
        const int brow = (sh ? 0 : t.slot * t.ncols) + t.n0;
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % S;
            if (kt >= S) mbar_wait(&empty[s], ((kt / S) - 1) & 1);  // its previous use is read
            mbar_arrive_expect_tx(&full[s], stage_bytes);
            for (int j = 0; j < subs; ++j)
                tma_load_2d(sA + (s * BM + j * TMA_SUB) * BK, mapA, kt * BK, t.pos0 + j * TMA_SUB, &full[s]);
            if (MODE == MODE_GATE_UP) {  // BN / 2 gate rows, then as many up rows
                tma_load_2d(sB + s * BN * BK, mapB0, kt * BK, brow, &full[s]);
                tma_load_2d(sB + s * BN * BK + (BN / 2) * BK, mapB1, kt * BK, brow, &full[s]);
            } else {
                tma_load_2d(sB + s * BN * BK, mapB0, kt * BK, brow, &full[s]);
            }
        }
        return;
    }

    // ---- consumers: warpgroup 0 rows 0..63, warpgroup 1 rows 64..127 ----
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
    // a run's last tile often holds fewer than 64 rows: the second warpgroup then issues no
    // wgmmas (the tensor cores go to the SM's other warpgroups) but keeps the handshakes
    const bool has_rows = wg < subs;
    float d[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.0f;
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % S;
        mbar_wait(&full[s], (kt / S) & 1);
        const u64 da = wgmma_desc(sA + (s * BM + wg * TMA_SUB) * BK);
        const u64 db = wgmma_desc(sB + s * BN * BK);
        if (has_rows) wgmma_k64_bf16<BN>(d, da, db);
        wgmma_wait<1>();  // this warp's wgmmas of step kt - 1 are done: free their stage for
        // the producer, when it refills it (step kt - 1 + S exists)
        if (kt > 0 && kt - 1 + S < KT && lane == 0) mbar_arrive(&empty[(kt - 1) % S]);
    }
    wgmma_wait<0>();
    fence_acc<NACC>(d);
    if (!has_rows) return;
    if (MODE == MODE_DOWN)  // the output through this warpgroup's A blocks, 16-byte stores
        emit_wgmma_down_staged<BN, S>(t, d, wg * TMA_SUB, sA + wg * TMA_SUB * BK, BM * BK, GEMM_ARG_NAMES);
    else
        emit_wgmma_rows<MODE, BN>(t, d, wg * TMA_SUB, GEMM_ARG_NAMES);
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
