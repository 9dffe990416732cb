// Grouped path (larger N): a stable multi-block sort of the (row, slot) pairs by expert,
// M-tiles per expert, tensor-core grouped GEMMs (mma.sync m16n8k16 bf16, cp.async
// 3-stage pipeline; any sm_80+), and the unpermute + weighted reduce.
//
//   sort_count     per block of 1024 pairs: how many pairs chose each local expert
//   sort_scan      one block: expert totals -> expert starts, active lists, per-block offsets,
//                  and the M-tiles (build_tiles) when the grouped GEMMs follow (down's own
//                  too where its tile height differs from gate/up's)
//   sort_place     per block: stable positions (pair order within an expert), shared rows
//   make_tiles     one block: BM-row tiles over the active experts' runs (after a one-block sort)
//   grouped_gemm<MODE_GATE_UP>  act[pos, :I] = act(x[row] W_gate^T + b, x[row] W_up^T + b), bf16
//   grouped_gemm<MODE_DOWN>     yw[pos, :H] = bf16(w_pair * (act[pos] W_down^T + b)): the routing
//                               weight applied in fp32 before the only rounding
//   grouped_reduce out[row] = sum over slots of yw (fixed slot order) + identity + scale * shared
#include "common.cuh"
#include "gemm_common.cuh"

#define SORT_THREADS 1024

// One block of SORT_THREADS: split each active run into BM-row tiles. tile_info[t] =
// (slot, pos0, rows). The lists were written by this block (before a __syncthreads) or a
// kernel before it.
// (No __restrict__ on the lists: sort_scan reads what it wrote, never through the
// read-only path.)
__device__ __forceinline__ void build_tiles(const int* num_active, const int* active_slot, const int* active_start,
                                            const int* active_len, int BM, int* num_tiles, int4* tile_info,
                                            int* tmp) {
    const int na = *num_active;
    int base = 0;
    for (int j0 = 0; j0 < na; j0 += SORT_THREADS) {
        const int j = j0 + threadIdx.x;
        const int len = j < na ? active_len[j] : 0;
        const int nt = (len + BM - 1) / BM;
        int tot;
        const int t0 = base + block_exclusive_scan_1024(nt, tmp, tot);
        for (int i = 0; i < nt; ++i)
            tile_info[t0 + i] = make_int4(active_slot[j], active_start[j] + i * BM, min(BM, len - i * BM), 0);
        base += tot;
    }
    if (threadIdx.x == 0) *num_tiles = base;
}

// grid ceil(P / 1024), block 1024, dynamic smem n_local ints.
__global__ void __launch_bounds__(SORT_THREADS)
sort_count(const int* __restrict__ ids, int P, const int* __restrict__ slot_of, int R, int n_local,
           int* __restrict__ block_counts) {
    extern __shared__ int cnt[];
    for (int i = threadIdx.x; i < n_local; i += SORT_THREADS) cnt[i] = 0;
    __syncthreads();
    const int p = blockIdx.x * SORT_THREADS + threadIdx.x;
    if (p < P) {
        const int e = ids[p];
        const int sl = e >= 0 && e < R ? slot_of[e] : -1;
        if (sl >= 0) atomicAdd(&cnt[sl], 1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_local; i += SORT_THREADS) block_counts[(size_t)blockIdx.x * n_local + i] = cnt[i];
}

// Walks an expert's column of block counts (`col[b * stride]`, blocks b0 .. b1 - 1) with
// eight loads in flight: returns `run` plus their sum; with OFFSETS it also replaces each
// count by the running total before it (that block's first position of the expert).
template <bool OFFSETS>
__device__ __forceinline__ int walk_counts(int* col, size_t stride, int b0, int b1, int run) {
    int b = b0;
    for (; b + 8 <= b1; b += 8) {
        int c[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = col[(b + j) * stride];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (OFFSETS) col[(b + j) * stride] = run;
            run += c[j];
        }
    }
    for (; b < b1; ++b) {
        const int c = col[b * stride];
        if (OFFSETS) col[b * stride] = run;
        run += c;
    }
    return run;
}

// One block. block_counts[b, e] becomes the position where block b's first pair of expert e
// goes. Also the active lists (as decode_build_lists makes them) and the shared expert's run.
// Where experts are fewer than threads, G adjacent lanes share an expert, each summing a
// contiguous range of the blocks (one thread walking all of qwen3-30b-a3b's 32 blocks, or
// qwen3-next-80b's 160, is a chain of dependent L2 round trips).
__global__ void __launch_bounds__(SORT_THREADS)
sort_scan(int* __restrict__ block_counts, int nblk, int n_local, int N, int k, int has_shared,
          int* __restrict__ num_active, int* __restrict__ active_slot, int* __restrict__ active_start,
          int* __restrict__ active_len, int BM, int* __restrict__ num_tiles, int4* __restrict__ tile_info,
          int BM2, int* __restrict__ num_tiles2, int4* __restrict__ tile_info2) {
    __shared__ int tmp[33];
    int G = 1;
    while (G < 32 && G * 2 * n_local <= SORT_THREADS) G *= 2;
    const int g = threadIdx.x % G, L = (nblk + G - 1) / G, b0 = min(nblk, g * L), b1 = min(nblk, b0 + L);
    int pos_base = 0, act_base = 0;
    for (int e0 = 0; e0 < n_local; e0 += SORT_THREADS / G) {
        const int e = e0 + threadIdx.x / G;
        int* col = block_counts + e;  // expert e's count in block b: col[b * n_local]
        const int part = e < n_local ? walk_counts<false>(col, n_local, b0, b1, 0) : 0;
        int incl = part;  // the expert's blocks before this thread's range: a scan over its G lanes
        for (int o = 1; o < G; o <<= 1) {
            const int t = __shfl_up_sync(CUPYMOE_FULL_MASK, incl, o, G);
            if (g >= o) incl += t;
        }
        const int total = __shfl_sync(CUPYMOE_FULL_MASK, incl, G - 1, G);
        // the expert's start and active index: the scans' values at its first lane (the
        // other lanes' values come after the whole expert's)
        int tot_c, tot_a;
        const int sc = block_exclusive_scan_1024(g == 0 ? total : 0, tmp, tot_c);
        const int sa = block_exclusive_scan_1024(g == 0 && total > 0 ? 1 : 0, tmp, tot_a);
        const int start = pos_base + __shfl_sync(CUPYMOE_FULL_MASK, sc, 0, G);
        const int aidx = act_base + __shfl_sync(CUPYMOE_FULL_MASK, sa, 0, G);
        if (e < n_local) {
            walk_counts<true>(col, n_local, b0, b1, start + incl - part);
            if (g == 0 && total > 0) {
                active_slot[aidx] = e;
                active_start[aidx] = start;
                active_len[aidx] = total;
            }
        }
        pos_base += tot_c;
        act_base += tot_a;
    }
    if (threadIdx.x == 0) {
        if (has_shared) {
            active_slot[act_base] = n_local;
            active_start[act_base] = pos_base;
            active_len[act_base] = N;
        }
        *num_active = act_base + (has_shared ? 1 : 0);
    }
    if (BM > 0) {  // the grouped GEMMs' tiles too (one launch fewer than make_tiles)
        __syncthreads();
        build_tiles(num_active, active_slot, active_start, active_len, BM, num_tiles, tile_info, tmp);
    }
    if (BM2 > 0) {  // and down's, where its tiles have another height than gate/up's
        __syncthreads();
        build_tiles(num_active, active_slot, active_start, active_len, BM2, num_tiles2, tile_info2, tmp);
    }
}

// grid ceil(P / 1024), block 1024, dynamic smem kernels.sort_place_smem_bytes(n_local).
// Stable: a pair's place in its expert's run within the block is the count of that
// expert's pairs in the warps before its warp (a per-warp count table, scanned over the
// warps) plus its rank among its warp's lanes (__match_any_sync). Three barriers; placing
// warp after warp took 32 (qwen3-next-80b N = 16384: 160 blocks of 32 rounds).
__global__ void __launch_bounds__(SORT_THREADS)
sort_place(const int* __restrict__ ids, int P, int N, const int* __restrict__ slot_of, int R, int n_local,
           int has_shared,
           const int* __restrict__ block_counts, const int* __restrict__ active_start,
           const int* __restrict__ num_active, int* __restrict__ sorted_row, int* __restrict__ sorted_pair,
           int* __restrict__ pair_pos, int k) {
    constexpr int WARPS = SORT_THREADS / 32;
    extern __shared__ int next[];  // [n_local]: this block's first position of each expert
    // [WARPS][n_local]: each warp's count of each expert, then the warps' exclusive prefix
    // (at most SORT_THREADS: 16 bits)
    unsigned short* before = reinterpret_cast<unsigned short*>(next + n_local);
    for (int i = threadIdx.x; i < n_local; i += SORT_THREADS)
        next[i] = block_counts[(size_t)blockIdx.x * n_local + i];
    for (int i = threadIdx.x; i < WARPS * n_local / 2; i += SORT_THREADS) reinterpret_cast<int*>(before)[i] = 0;
    __syncthreads();
    const int p = blockIdx.x * SORT_THREADS + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = p < P ? ids[p] : -1;
    const int sl = e >= 0 && e < R ? slot_of[e] : -1;
    const bool mine = sl >= 0;
    const int rank = warp_slot_rank(before, n_local, sl, warp, lane);
    __syncthreads();
    for (int i = threadIdx.x; i < n_local; i += SORT_THREADS) warps_exclusive_prefix(before, n_local, WARPS, i);
    __syncthreads();
    if (mine) {
        const int pos = next[sl] + before[warp * n_local + sl] + rank;
        sorted_row[pos] = p / k;
        sorted_pair[pos] = p;
        pair_pos[p] = pos;
    } else if (p < P) {
        pair_pos[p] = -1;
    }
    if (has_shared) {  // the shared expert's run follows the routed positions
        const int base = active_start[*num_active - 1];
        for (int r = blockIdx.x * SORT_THREADS + threadIdx.x; r < N; r += gridDim.x * SORT_THREADS) {
            sorted_row[base + r] = r;
            sorted_pair[base + r] = P + r;
            pair_pos[P + r] = base + r;
        }
    }
}

// One block: build_tiles, after a sort that did not (decode_build_lists), or for a kernel
// of another tile height.
__global__ void __launch_bounds__(SORT_THREADS)
make_tiles(const int* __restrict__ num_active, const int* __restrict__ active_slot,
           const int* __restrict__ active_start, const int* __restrict__ active_len, int BM,
           int* __restrict__ num_tiles, int4* __restrict__ tile_info) {
    __shared__ int tmp[33];
    build_tiles(num_active, active_slot, active_start, active_len, BM, num_tiles, tile_info, tmp);
}

// ---------------------------------------------------------------------------------------
// Tensor-core grouped GEMM, mma.sync (any sm_80+). Hopper's wgmma version: grouped_sm90.cu.
// ---------------------------------------------------------------------------------------

// The warp's 16-row A fragment mt (rows wm 32 + 16 mt ..) of k16 chunk kk of stage tile tA.
template <int BK>
__device__ __forceinline__ void grouped_a_frag(unsigned (&af)[4], const bf16* tA, int wm, int mt, int kk, int lane) {
    const int r = wm * 32 + mt * 16 + (lane & 15);
    ldmatrix_x4(af[0], af[1], af[2], af[3], tA + swz<BK>(r, kk * 2 + (lane >> 4)));
}

// The B fragments of the warp's n-tile pair jp (n-tiles 2 jp, 2 jp + 1) of k16 chunk kk of stage tile
// tB: gate/up's n-tiles j < 4 are gate's B rows (0 ..), the rest up's (64 ..); down's run on.
template <int MODE, int BK>
__device__ __forceinline__ void grouped_b_frags(unsigned& b0, unsigned& b1, unsigned& b2, unsigned& b3, const bf16* tB,
                                                int wn, int jp, int kk, int lane) {
    const int j = 2 * jp;
    const int row = MODE == MODE_GATE_UP ? (j < 4 ? 0 : 64) + wn * 32 + (j & 3) * 8 : wn * 64 + j * 8;
    ldmatrix_x4(b0, b1, b2, b3, tB + swz<BK>(row + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
}

// One BK step of a warp's 32 x 64 accumulators (rows wm 32 .., columns grouped_b_frags') from stage tiles tA, tB.
template <int MODE, int BK>
__device__ __forceinline__ void grouped_mma_step(float (&acc)[2][8][4], const bf16* tA, const bf16* tB, int wm, int wn,
                                                 int lane) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        unsigned af[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) grouped_a_frag<BK>(af[mt], tA, wm, mt, kk, lane);
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
            unsigned b0, b1, b2, b3;
            grouped_b_frags<MODE, BK>(b0, b1, b2, b3, tB, wn, jp, kk, lane);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                mma_bf16(acc[mt][2 * jp], af[mt], b0, b1);
                mma_bf16(acc[mt][2 * jp + 1], af[mt], b2, b3);
            }
        }
    }
}

// One BK step of the stacked form's extra K: grouped_mma_step's without the products that are zeros,
// so the accumulators keep their bits (an exact zero sum may keep a - sign): a 16-row fragment's 16
// columns of T that are all zeros (other adapters' columns, rows without an adapter or past the
// tile), and in gate/up the n-tiles of the projection whose Bext half of this step is zeros. Gate's
// n-tiles read T tile tG, up's tU (down: tG for all). HALF: 0 gate's n-tiles alone, 1 up's, 2 both.
template <int MODE, int BK, int HALF>
__device__ __forceinline__ void grouped_lora_mma_step(float (&acc)[2][8][4], const bf16* tG, const bf16* tU,
                                                      const bf16* tB, int wm, int wn, int lane) {
    constexpr bool GU = MODE == MODE_GATE_UP;
    constexpr int JP0 = HALF == 1 ? 2 : 0, JP1 = HALF == 0 ? 2 : 4;
    constexpr bool USE_G = !GU || HALF != 1, USE_U = GU && HALF != 0;
    auto frags = [&](unsigned (&af)[2][4], bool (&live)[2], const bf16* tA, int kk) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            grouped_a_frag<BK>(af[mt], tA, wm, mt, kk, lane);
            const unsigned bits = (af[mt][0] | af[mt][1] | af[mt][2] | af[mt][3]) & 0x7fff7fffu;  // -0 is a zero
            live[mt] = __any_sync(CUPYMOE_FULL_MASK, bits != 0u);
        }
    };
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        unsigned ag[2][4], au[2][4];
        bool lg[2] = {false, false}, lu[2] = {false, false};
        if (USE_G) frags(ag, lg, tG, kk);
        if (USE_U) frags(au, lu, tU, kk);
        if (!(lg[0] || lg[1] || lu[0] || lu[1])) continue;
#pragma unroll
        for (int jp = JP0; jp < JP1; ++jp) {
            const bool up = GU && jp >= 2;
            const bool* live = up ? lu : lg;
            if (!(live[0] || live[1])) continue;
            unsigned b0, b1, b2, b3;
            grouped_b_frags<MODE, BK>(b0, b1, b2, b3, tB, wn, jp, kk, lane);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                if (!live[mt]) continue;
                if (up) {
                    mma_bf16(acc[mt][2 * jp], au[mt], b0, b1);
                    mma_bf16(acc[mt][2 * jp + 1], au[mt], b2, b3);
                } else {
                    mma_bf16(acc[mt][2 * jp], ag[mt], b0, b1);
                    mma_bf16(acc[mt][2 * jp + 1], ag[mt], b2, b3);
                }
            }
        }
    }
}

// The stacked form's extra K steps (grouped_gemm_lora), after the main loop: a two-stage cp.async
// pipeline through the first A and B stage tiles (bf16 both: T's rows and Bext's), the MMAs of
// grouped_lora_mma_step. Down: step j reads T's columns j BK .. (j + 1) BK - 1 of the tile's rows
// against Bext rows slot H + column. Gate/up: gate's Bext rows fill the B tile's first GG_BN / 2
// rows, up's the rest. PAIRED (four A tiles fit the stages): step j holds gate's T columns j BK ..
// and up's KS + j BK .. in two A tiles against both halves at those columns, KS / BK steps; else
// the 2 KS / BK steps of one A tile each, gate's first, a step's other half zeros and skipped.
// Each accumulator sums its k-chunks in the same order either way.
template <int MODE, int BM, int BK, bool PAIRED>
__device__ __forceinline__ void grouped_lora_steps(const GemmTile& t, bf16* sA, bf16* sB, float (&acc)[2][8][4], int wm,
                                                   int wn, int lane,
                                                   const bf16* __restrict__ lora_t, const bf16* __restrict__ lora_b0,
                                                   const bf16* __restrict__ lora_b1, int KS, GEMM_ARGS) {
    constexpr bool GU = MODE == MODE_GATE_UP;
    constexpr int THREADS = BM * 2, CHUNKS = BK / 8, NP = GU ? 2 : 1, AT = PAIRED ? 2 : 1;  // A tiles a step
    // KS is whole 64-column steps (lora_stack.stack_width), so each step is gate's or up's, or both whole
    static_assert(64 % BK == 0, "a step within one 64-column block of KS (grouped_lora_mma_step)");
    static_assert(!PAIRED || GU, "pairs are gate's and up's");
    constexpr int A_PER = BM * CHUNKS / THREADS, B_PER = GG_BN * CHUNKS / THREADS;
    const int width = NP * KS, steps = (PAIRED ? KS : width) / BK, chunk = threadIdx.x % CHUNKS;
    auto load = [&](int s, int j) {
        const int kc = j * BK + chunk * 8;  // this thread's column of T (of NP KS)
#pragma unroll
        for (int a = 0; a < AT; ++a)
#pragma unroll
            for (int i = 0; i < A_PER; ++i) {
                const int r = (threadIdx.x + i * THREADS) / CHUNKS;
                const int pos = t.pos0 + min(r, t.rows - 1);
                cp_async16(sA + (AT * s + a) * BM * BK + swz<BK>(r, chunk), lora_t + (size_t)pos * width + kc + a * KS,
                           r < t.rows);
            }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const int r = (threadIdx.x + i * THREADS) / CHUNKS;
            const bool up = GU && r >= GG_BN / 2;
            const int n = t.n0 + (GU ? (r & (GG_BN / 2 - 1)) : r);
            const int c = up && !PAIRED ? kc - KS : kc;  // the column of this half's Bext
            const bool ok = n < t.ncols && c >= 0 && c < KS;
            const size_t row = (size_t)t.slot * (GU ? I_max : H) + min(n, t.ncols - 1);
            cp_async16(sB + s * GG_BN * BK + swz<BK>(r, chunk), (up ? lora_b1 : lora_b0) + row * KS + (ok ? c : 0), ok);
        }
    };
    load(0, 0);
    cp_async_commit();
    for (int j = 0; j < steps; ++j) {
        if (j + 1 < steps) load((j + 1) & 1, j + 1);
        cp_async_commit();
        cp_async_wait<1>();  // step j's copies have landed
        __syncthreads();
        const bf16 *tA = sA + AT * (j & 1) * BM * BK, *tB = sB + (j & 1) * GG_BN * BK;
        if (!GU)
            grouped_lora_mma_step<MODE, BK, 2>(acc, tA, tA, tB, wm, wn, lane);
        else if (PAIRED)
            grouped_lora_mma_step<MODE, BK, 2>(acc, tA, tA + BM * BK, tB, wm, wn, lane);
        else if (j * BK < KS)  // KS is whole steps: a step's columns are gate's or up's
            grouped_lora_mma_step<MODE, BK, 0>(acc, tA, tA, tB, wm, wn, lane);
        else
            grouped_lora_mma_step<MODE, BK, 1>(acc, tA, tA, tB, wm, wn, lane);
        __syncthreads();  // its tiles are refilled by step j + 2's copies
    }
    cp_async_wait<0>();
}

// The router's LoRA form (grouped_gemm_lora<MODE_ROUTER, ...>): past the logits' column tiles
// (I_max = R columns) the grid holds ceil(cols / GG_BN) more, whose B rows are the adapter slots'
// A rows in three bf16 parts ([max_loras][3][max_rank] rows of H: lora_slots.py) and whose output
// is t's split copy z ([splits][P][cols] fp32), so the shrink runs beside the router in its grid.
template <int BM>
__device__ __forceinline__ bool router_t_tile(GemmTile& t, bool& t_tile, const bf16* __restrict__ a3, int cols,
                                              GEMM_ARGS) {
    const int xr = (I_max + GG_BN - 1) / GG_BN;  // the logits' column tiles
    const int2 ct = banded_tile(blockIdx.y * gridDim.x + blockIdx.x, gridDim.x, gridDim.y);
    t_tile = ct.x >= xr;
    if (!gemm_tile_at<MODE_ROUTER, BM, GG_BN>(t, t_tile ? 0 : ct.x, ct.y, GEMM_ARG_NAMES)) return false;
    if (t_tile) {
        t.n0 = (ct.x - xr) * GG_BN;
        t.ncols = cols;
        t.W0 = a3;
    }
    return t.n0 < t.ncols;
}

// Block: BM rows x GG_BN columns, BM / 16 warps as (BM / 32) x 2, each 32 rows x 64 columns;
// K in BK-wide steps through a STAGES-deep cp.async pipeline. Two configurations are built
// (kernels.GROUPED_CONFIGS): deep 64-wide steps where the weights stream (few rows per
// expert: bytes in flight decide), 128-row tiles with 3 shallow stages where the math
// decides (fewer registers: two blocks per SM). Arguments: GEMM_ARGS (gemm_common.cuh).
//
// FMT (quant.cuh) is the weights' format. bf16 weights go to the MMA tiles by cp.async;
// quantized ones arrive raw (QuantBLoader) and are turned into bf16 B tiles, double
// buffered, right before the step that reads them.
// (grouped_gemm and its stacked-form twin grouped_gemm_lora, below, share this body.)
template <int MODE, int BM, int BK, int STAGES, int FMT, int LORA>
__device__ __forceinline__ void grouped_gemm_body(GEMM_ARGS, const bf16* __restrict__ lora_t,
                                                  const bf16* __restrict__ lora_b0, const bf16* __restrict__ lora_b1,
                                                  int KS) {
    constexpr int THREADS = BM * 2;
    constexpr bool QUANT = FMT != FMT_BF16;
    // dynamic (kernels.grouped_smem_bytes): A stages, then bf16 B stages (2 when quantized),
    // then the raw quantized B stages
    extern __shared__ __align__(128) unsigned char gg_smem[];
    bf16* sA = reinterpret_cast<bf16*>(gg_smem);
    bf16* sB = sA + STAGES * BM * BK;
    u8* sRaw = reinterpret_cast<u8*>(sB + (QUANT ? 2 : STAGES) * GG_BN * BK);
    // the router's logits: its LoRA delta may start its shrink beside it (forward_plan.with_lora)
    if constexpr (MODE == MODE_ROUTER) pdl_wait_then_release_next();
    constexpr bool STACKED = LORA && MODE != MODE_ROUTER, ROUTER_T = LORA && MODE == MODE_ROUTER;
    GemmTile t;
    bool t_tile = false;  // ROUTER_T: a tile of the LoRA t columns (router_t_tile)
    if constexpr (ROUTER_T) {
        if (!router_t_tile<BM>(t, t_tile, lora_b0, KS, GEMM_ARG_NAMES)) return;
    } else if (!gemm_tile<MODE, BM, GG_BN, FMT>(t, GEMM_ARG_NAMES)) {
        if (STACKED) pdl_leave_early();  // the grid never completes before the shrink it follows
        return;
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    typedef StageLoader<MODE, BM, BK, THREADS, GG_BN, FMT> Loader;
    Loader ld;
    ld.init(t, GEMM_ARG_NAMES);
    auto load_stage = [&](int s, int k0) {  // quantized: sB is not a stage ring (two tiles, below)
        ld.load(sA + s * BM * BK, sB + s * GG_BN * BK, sRaw + s * Loader::RAW_STAGE, t.k_lo + k0, t.K);
    };

    float acc[2][8][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 8; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

    auto mma_step = [&](const bf16* tA, const bf16* tB) { grouped_mma_step<MODE, BK>(acc, tA, tB, wm, wn, lane); };

    const int KT = (t.K - t.k_lo + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        // quantized: this thread's raw chunks of step kt have landed; make them bf16. The
        // buffer written here was last read in step kt - 2, before the barrier of kt - 1.
        ld.convert(sRaw + (kt % STAGES) * Loader::RAW_STAGE, sB + (kt & 1) * GG_BN * BK, t.k_lo + kt * BK, t.K);
        __syncthreads();
        // the stage refilled here was read (and, raw, converted by its own thread) in kt - 1
        const int kn = kt + STAGES - 1;
        if (kn < KT) load_stage(kn % STAGES, kn * BK);
        cp_async_commit();
        mma_step(sA + (kt % STAGES) * BM * BK, sB + (QUANT ? (kt & 1) : (kt % STAGES)) * GG_BN * BK);
    }
    cp_async_wait<0>();
    if constexpr (STACKED) {  // the stacked form's extra K: T's columns against Bext's, after the weights' K
        __syncthreads();  // every warp is done with the main loop's tiles
        pdl_wait();       // T is the shrink's, the launch before (by PDL on the prefill path: it may still run)
        constexpr bool PAIRED = MODE == MODE_GATE_UP && STAGES >= 4;  // gate's and up's T tiles a step fit
        grouped_lora_steps<MODE, BM, BK, PAIRED>(t, sA, sB, acc, wm, wn, lane, lora_t, lora_b0, lora_b1, KS,
                                                 GEMM_ARG_NAMES);
    }

    // Epilogue: accumulator (mt, j, h * 2 + e) is row wm*32 + mt*16 + g + 8h, column
    // (wn's 64 or gate/up 32 + 32) + j*8 + 2*t4 + e. Gate/up switches on the activation
    // once (with_activation), not per element.
    const int g = lane >> 2, t4 = lane & 3;
    if (MODE == MODE_GATE_UP) {
        with_activation<true>(act_code, [&](auto act) {  // ACT_PAIR too: LoRA's gate/up
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        emit_gate_up<decltype(act)::value>(t, wm * 32 + mt * 16 + g + h * 8, wn * 32 + j * 8 + t4 * 2,
                                                           acc[mt][j][h * 2], acc[mt][j][h * 2 + 1], acc[mt][j + 4][h * 2],
                                                           acc[mt][j + 4][h * 2 + 1], GEMM_ARG_NAMES);
        });
    } else if (ROUTER_T && t_tile) {  // t's split copy, no bias: topk_route_lora sums and expands it
        float* tz = const_cast<float*>(reinterpret_cast<const float*>(lora_t));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int r = wm * 32 + mt * 16 + g + h * 8, c = wn * 64 + j * 8 + t4 * 2;
                    if (r < t.rows && t.n0 + c < t.ncols)
                        store_logit_pair(t, t.pos0 + r, t.n0 + c, acc[mt][j][h * 2], acc[mt][j][h * 2 + 1], P, tz);
                }
    } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    emit_out<MODE>(t, wm * 32 + mt * 16 + g + h * 8, wn * 64 + j * 8 + t4 * 2, acc[mt][j][h * 2],
                                   acc[mt][j][h * 2 + 1], GEMM_ARG_NAMES);
    }
}

template <int MODE, int BM, int BK, int STAGES, int FMT>
__global__ void __launch_bounds__(BM * 2)
grouped_gemm(GEMM_ARGS) {
    grouped_gemm_body<MODE, BM, BK, STAGES, FMT, 0>(GEMM_ARG_NAMES, nullptr, nullptr, nullptr, 0);
}

// MODE_ROUTER: the router's LoRA form (router_t_tile): lora_t is t's fp32 output [splits][P][KS],
// lora_b0 the slots' A rows in parts [KS rows, H] bf16, KS their count (lora_b1 unused).
// The LoRA stacked form (cupymoe/lora_stack.py) on this kernel: grouped_gemm with NP KS / BK more
// K steps past the weights' (NP: gate/up 2, down 1) whose A is T ([P, NP KS], lora_t) and whose
// B is Bext (lora_b0: gate's or down's, lora_b1: up's, [S rows, KS] bf16); gate/up's activation
// sees g + B_g t_g and u + B_u t_u, down stores w (y + B t). A kernel of its own, so the base
// instances' code stays what it was.
template <int MODE, int BM, int BK, int STAGES, int FMT>
__global__ void __launch_bounds__(BM * 2)
grouped_gemm_lora(GEMM_ARGS, const bf16* __restrict__ lora_t, const bf16* __restrict__ lora_b0,
                  const bf16* __restrict__ lora_b1, int KS) {
    grouped_gemm_body<MODE, BM, BK, STAGES, FMT, 1>(GEMM_ARG_NAMES, lora_t, lora_b0, lora_b1, KS);
}

// grid N, block 256: out[row] = sum_s yw[pos(row, s)] + identity terms + scale * shared.
#define GREDUCE_THREADS 256
__global__ void __launch_bounds__(GREDUCE_THREADS)
grouped_reduce(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ ids,
               const float* __restrict__ topk_w, const int* __restrict__ pair_pos, const bf16* __restrict__ yw,
               const float* __restrict__ shared_gate_w, bf16* __restrict__ out, int N, int H, int k, int E,
               int has_shared, int primary) {
    __shared__ int s_pos[64];
    const int row = blockIdx.x;
    const size_t rbase = (size_t)row * H;
    const RowPrologue pro = reduce_row_prologue<GREDUCE_THREADS>(row, N, k, E, H, pair_pos, ids, topk_w, x, shared_gate_w,
                                                                 has_shared, primary, false, s_pos, nullptr);
    const float scale = pro.shared_scale, zw = pro.zero_w;
    const int shared_pos = pro.shared_pos;
    for (int h = threadIdx.x * 8; h < H; h += GREDUCE_THREADS * 8) {
        float o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = 0.0f;
        // the slots' rows 8 at a time, every load of a batch issued before the first sum
        // (yw is read once: past L1); the same sums in the same slot order
        for (int s0 = 0; s0 < k; s0 += 8) {
            bf16x8 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int pos = s0 + j < k ? s_pos[s0 + j] : -1;
                if (pos >= 0) v[j] = load_bf16x8_stream(yw + (size_t)pos * H + h);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (s0 + j >= k || s_pos[s0 + j] < 0) continue;
                float f[8];
                unpack_bf16x8(v[j], f);
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] += f[i];
            }
        }
        if (zw != 0.0f) {
            float f[8];
            unpack_bf16x8(load_bf16x8(xe + rbase + h), f);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = fmaf(zw, f[i], o[i]);
        }
        if (shared_pos >= 0) {
            float f[8];
            unpack_bf16x8(load_bf16x8(yw + (size_t)shared_pos * H + h), f);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = fmaf(scale, f[i], o[i]);
        }
        __align__(16) bf16 r[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = __float2bfloat16(o[i]);
        *reinterpret_cast<uint4*>(out + rbase + h) = *reinterpret_cast<const uint4*>(r);
    }
}
