// Swap-AB decode on Hopper (sm_90a), bf16 experts: the decode path's gate/up and down for
// 9-256 rows, with the GEMM's roles swapped. An expert's weight rows are the wgmma's M side
// (two m64 tiles a block), the few token rows it got its N side (NT of them a pass).
//
//   decode_swapab_gate_up<NT>  act[pos, col] = act(x W_gate^T, x W_up^T) for 64 columns a
//                       block: tile 0 its 64 gate rows, tile 1 the same 64 up rows, so a
//                       thread holds g and u of the same (column, token) and the activation
//                       fuses in registers
//   decode_swapab_down<NT>     y[pos, h] = act[pos] . W_down[h] (or, atomic, w * y added into
//                       acc[row, h]) for 128 hidden columns a block
//   decode_swapab_gate_up_lora<NT>  gate/up's blocks (ACT_PAIR), then the LoRA slots' gate/up
//                       shrinks s A x as more blocks an expert, the adapters' A rows as its tiles
//
// Why: at 16-256 rows an expert gets 1-64 rows, so the grouped GEMMs' 64/128-row A tiles are
// mostly padding and the register decode (decode.cu) re-reads each weight row once per 4
// rows. Here every weight byte of a block streams once a pass of NT rows, by TMA, through a
// ring of STAGES stages that one producer warp keeps full (benchmarks/DECISIONS.md, "Next
// for #39"). The weights come by TMA from a tensor map of each stacked projection
// (cupymoe/tma.py: swapab_table, 64-row boxes); the token rows are gathered by the producer
// warp's cp.async (x / xe through sorted_row for gate/up, act's rows in position order for
// down), so no gather pass and no tensor map of the scratch is needed.
//
// Warp roles: warps 0 .. 4 CWG - 1 are CWG consumer warpgroups (each NT / CWG of the pass's
// tokens against both weight tiles: accumulators 2 x NT / CWG / 2 floats a thread); the
// last warp is the producer (lane 0 issues the weight boxes; every lane gathers token
// chunks and marks a stage full once its own copies landed, as grouped_sm90_tma.cu's
// gathering producer does). The lists, arguments and outputs are decode.cu's, so the
// decode path's stages and scratch stay as they are.
#include "decode_common.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define SA_BK 64                        // k a stage: one 128-byte swizzle row of bf16
#define SA_ROWS 128                     // weight rows a block: two m64 tiles
#define SA_TILE_BYTES (64 * SA_BK * 2)  // one m64 weight tile of a stage
#define SA_MAP_BYTES 128
#define SA_GATE_UP_COLUMNS 64  // activation columns a gate/up block (cupymoe/catalog.py)

// tensor-map indices (cupymoe/tma.py: SWAPAB_MAPS)
#define SA_MAP_GATE 0
#define SA_MAP_UP 1
#define SA_MAP_DOWN 2
#define SA_MAP_SHARED_GATE 3
#define SA_MAP_SHARED_UP 4
#define SA_MAP_SHARED_DOWN 5
#define SA_MAP_LORA_GATE_A 6  // the LoRA slots' A rows (decode_swapab_gate_up_lora), max_rank-row boxes
#define SA_MAP_LORA_UP_A 7

// A token tile's configuration (cupymoe/catalog.py SWAPAB_* mirror it). One consumer
// warpgroup holds both tiles' accumulators (NT floats a thread): two warpgroups and a producer
// warp would put three warps on one of the SM's four register files and cap a thread at
// 168 registers, which 256 tokens' accumulators spill past. Up to 64 tokens the stages fill
// about 100 KB so two blocks share an SM (one's prologue and tail hide under the other's
// stream); 128 tokens' 32 KB stages take one block an SM, with 6 of them.
template <int NT>
struct SwapAbConfig {
    static_assert(NT == 8 || NT == 16 || NT == 32 || NT == 64 || NT == 128, "token tiles 8..128");
    static constexpr int CWG = 1;         // consumer warpgroups
    static constexpr int WN = NT / CWG;   // a warpgroup's tokens: the wgmma's n
    static constexpr int STAGES = NT <= 32 ? 5 : NT <= 64 ? 4 : 6;
    static constexpr int BLOCKS_PER_SM = NT <= 64 ? 2 : 1;
    static constexpr int THREADS = CWG * 128 + 32;
    static constexpr int LAG = STAGES - 2;  // the producer's lanes mark a stage full this many steps late
    static constexpr int STAGE_BYTES = (SA_ROWS + NT) * SA_BK * 2;
    static constexpr int PER_LANE = NT / 4;  // token rows a producer lane copies a chunk of
    static_assert(STAGES >= 3, "a stage of token copies in flight (GatherLag's condition)");
};

// The ring: STAGES stages (the two weight tiles, then the NT token rows, each row 128 bytes
// in the 128-byte swizzle wgmma_desc declares), then `full` and `empty` barriers a stage.
template <int NT>
struct SaRing {
    unsigned char* base;
    u64* full;   // the weights' bytes + every producer lane's arrival
    u64* empty;  // every consumer warp's arrival once its wgmmas have read the stage
    __device__ __forceinline__ unsigned char* weights(int s) const {
        return base + s * SwapAbConfig<NT>::STAGE_BYTES;
    }
    __device__ __forceinline__ unsigned char* tokens(int s) const { return weights(s) + SA_ROWS * SA_BK * 2; }
};

// One block's work: its two weight tiles' maps and first rows, the expert's run, K and where
// the run's token rows lie (row_id(t) * pitch elements past `tok`).
struct SaWork {
    const u8* map0;
    const u8* map1;
    int row0, row1;
    int start, len;  // the expert's run of positions
    int K, KT;
    const bf16* tok;
    int pitch;
    int boxes, box_rows, box_stride;  // a LoRA block's tiles: `boxes` boxes of box_rows A rows, box_stride apart
};

template <int NT>
__device__ __forceinline__ SaRing<NT> sa_ring(unsigned char* smem) {
    using Cfg = SwapAbConfig<NT>;
    SaRing<NT> r;
    const unsigned pad = (1024u - (smem_u32(smem) & 1023u)) & 1023u;  // swizzle atoms start on 1024 bytes
    r.base = smem + pad;
    r.full = reinterpret_cast<u64*>(r.base + Cfg::STAGES * Cfg::STAGE_BYTES);
    r.empty = r.full + Cfg::STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbar_init(&r.full[s], 1 + 32);          // lane 0's arrive.expect_tx, then each lane's copies
            mbar_init(&r.empty[s], 4 * Cfg::CWG);  // every consumer warp
        }
        mbar_init_fence();
    }
    __syncthreads();
    return r;
}

// Lane 0 of the producer: step kt's two weight boxes into stage s, counted on its barrier.
// A LoRA block (LORA): each tile is w.boxes adapters' A rows (gate's, up's), w.box_rows rows a box, stacked
// in the tile in adapter order; rows past the boxes are never copied (their products are discarded).
template <int NT, bool LORA = false>
__device__ __forceinline__ void sa_copy_weights(const SaRing<NT>& ring, const SaWork& w, int s, int kt) {
    if constexpr (LORA) {
        mbar_arrive_expect_tx(&ring.full[s], 2 * w.boxes * w.box_rows * SA_BK * 2);
        for (int i = 0; i < w.boxes; ++i) {
            const int off = i * w.box_rows * SA_BK * 2, row = w.row0 + i * w.box_stride;
            tma_load_2d(ring.weights(s) + off, w.map0, kt * SA_BK, row, &ring.full[s]);
            tma_load_2d(ring.weights(s) + SA_TILE_BYTES + off, w.map1, kt * SA_BK, row, &ring.full[s]);
        }
    } else {
        mbar_arrive_expect_tx(&ring.full[s], SA_ROWS * SA_BK * 2);
        tma_load_2d(ring.weights(s), w.map0, kt * SA_BK, w.row0, &ring.full[s]);
        tma_load_2d(ring.weights(s) + SA_TILE_BYTES, w.map1, kt * SA_BK, w.row1, &ring.full[s]);
    }
}

// The producer warp over every pass of the run: a step's weight boxes (lane 0; the first
// STAGES steps' already issued where `ahead`), then its token chunks (lane L: chunk L % 8
// of rows L / 8 + 4 i, zeros past K; rows past the pass are not copied, their outputs are
// masked and a column's products never mix with another's). A lane marks a stage full
// LAG steps after its copies went out, once they have landed and been fenced for the async
// proxy. row_of(t): the index of run row t in w.tok's rows; `ahead`: the first steps whose
// weight boxes lane 0 already issued (sa_copy_ahead).
template <int NT, bool LORA = false, class RowOf>
__device__ __forceinline__ void sa_producer(const SaRing<NT>& ring, const SaWork& w, RowOf row_of, int ahead) {
    using Cfg = SwapAbConfig<NT>;
    constexpr int S = Cfg::STAGES, LAG = Cfg::LAG;
    const int lane = threadIdx.x & 31, c = lane & 7;
    const int passes = (w.len + NT - 1) / NT, T = passes * w.KT;
#pragma unroll 1
    for (int p = 0; p < passes; ++p) {
        int rid[Cfg::PER_LANE];  // -1 past the pass's rows
        const int rows = min(NT, w.len - p * NT);
#pragma unroll
        for (int i = 0; i < Cfg::PER_LANE; ++i) {
            const int r = lane / 8 + 4 * i;
            rid[i] = r < rows ? row_of(p * NT + r) : -1;
        }
#pragma unroll 1
        for (int kt = 0; kt < w.KT; ++kt) {
            const int g = p * w.KT + kt, s = g % S;
            if (g >= S) mbar_wait(&ring.empty[s], ((g / S) - 1) & 1);  // its previous use is read
            if (lane == 0 && g >= ahead) sa_copy_weights<NT, LORA>(ring, w, s, kt);
            const int kc = kt * SA_BK + c * 8;
            const bool kin = kc < w.K;
            unsigned char* dst = ring.tokens(s);
#pragma unroll
            for (int i = 0; i < Cfg::PER_LANE; ++i)
                if (rid[i] >= 0)
                    cp_async16(dst + swz128(lane / 8 + 4 * i, c), w.tok + (size_t)rid[i] * w.pitch + (kin ? kc : 0),
                               kin);
            cp_async_commit();
            gather_mark_full<LAG>(ring.full, g, S);
        }
    }
    gather_mark_tail<LAG>(ring.full, T, S);
}

// Lane 0 of the producer, before the PDL wait: the weight boxes of the ring's first `steps`
// steps (step g: pass g / KT's k step g % KT), which need nothing from the launches before.
template <int NT, bool LORA = false>
__device__ __forceinline__ int sa_copy_ahead(const SaRing<NT>& ring, const SaWork& w, int steps) {
    if ((threadIdx.x & 31) == 0)
        for (int g = 0; g < steps; ++g) sa_copy_weights<NT, LORA>(ring, w, g, g % w.KT);
    return steps;
}

// The producer warp of a block whose expert nobody chose: the `steps` stages copied ahead
// must land before the block's shared memory is given back (every lane's arrival completes
// each stage's phase once its bytes are in).
template <int NT>
__device__ __forceinline__ void sa_drain_ahead(const SaRing<NT>& ring, int steps) {
    for (int g = 0; g < steps; ++g) {
        mbar_arrive(&ring.full[g]);
        mbar_wait(&ring.full[g], 0);
    }
}

// One pass of a consumer warpgroup: acc[m] = tile m's 64 weight rows x its WN tokens over all
// of K (steps g0 .. g0 + KT - 1 of the ring). A warpgroup with no rows in the pass issues no
// wgmmas but keeps the handshakes. Each warp frees a stage once its wgmmas of it are done.
template <int NT>
__device__ __forceinline__ void sa_consume_pass(const SaRing<NT>& ring, int g0, int KT, bool has_rows,
                                                float (&acc)[2][SwapAbConfig<NT>::WN / 2]) {
    using Cfg = SwapAbConfig<NT>;
    constexpr int S = Cfg::STAGES, WN = Cfg::WN;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) acc[m][i] = 0.0f;
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
        const int g = g0 + kt, s = g % S;
        mbar_wait(&ring.full[s], (g / S) & 1);
        if (has_rows) {
            const u64 da0 = wgmma_desc(ring.weights(s)), da1 = wgmma_desc(ring.weights(s) + SA_TILE_BYTES);
            const u64 db = wgmma_desc(ring.tokens(s) + wg * WN * SA_BK * 2);
            fence_acc<WN / 2>(acc[0]);
            fence_acc<WN / 2>(acc[1]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < SA_BK / 16; ++kk) {  // +32 bytes of K each
                wgmma_m64nNk16_bf16<WN>(acc[0], da0 + 2 * kk, db + 2 * kk);
                wgmma_m64nNk16_bf16<WN>(acc[1], da1 + 2 * kk, db + 2 * kk);
            }
            wgmma_commit();
            fence_acc<WN / 2>(acc[0]);
            fence_acc<WN / 2>(acc[1]);
        }
        wgmma_wait<1>();  // step g - 1's wgmmas are done: its stage is free
        if (kt > 0 && lane == 0) mbar_arrive(&ring.empty[(g - 1) % S]);
    }
    wgmma_wait<0>();
    fence_acc<WN / 2>(acc[0]);
    fence_acc<WN / 2>(acc[1]);
    if (KT > 0 && lane == 0) mbar_arrive(&ring.empty[(g0 + KT - 1) % S]);
}

// Accumulator element i of a thread: weight row (of its m64 tile) and token (of its
// warpgroup's WN) it holds, the m64nNk16 fragment layout: element 4 j + 2 h + e is row
// 16 warp + 8 h + g, token 8 j + 2 t4 + e.
struct SaFrag {
    int row, tok;
    __device__ __forceinline__ SaFrag(int i) {
        const int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
        row = 16 * warp + g + 8 * ((i >> 1) & 1);
        tok = 8 * (i >> 2) + 2 * t4 + (i & 1);
    }
};

// A gate/up block's expert run, once its tiles are set in `w`: by slot (slot_active) its first
// stages' weight boxes go out before the wait for the lists; then the run's start and length.
// False where nobody chose the expert (the copies drained: the block leaves).
template <int NT, bool LORA>
__device__ __forceinline__ bool sa_gate_up_run(const SaRing<NT>& ring, SaWork& w, int slot,
                                               const int* __restrict__ slot_active,
                                               const int* __restrict__ active_start,
                                               const int* __restrict__ active_len, bool producer, int& ahead) {
    using Cfg = SwapAbConfig<NT>;
    int j = blockIdx.y;
    // by slot: pass 0's first steps (every chosen expert has one), then the lists
    ahead = slot_active && producer ? sa_copy_ahead<NT, LORA>(ring, w, min(Cfg::STAGES, w.KT)) : 0;
    if (slot_active) {
        pdl_wait_then_release_next();
        j = slot_active[slot];
        if (j < 0) {  // nobody chose the expert: the copies were for nothing
            if (producer) sa_drain_ahead(ring, ahead);
            return false;
        }
    }
    w.start = active_start[j], w.len = active_len[j];
    return true;
}

// A gate/up block of 64 activation columns (xb: its column block) of expert `slot`.
template <int NT>
__device__ __forceinline__ void sa_gate_up_columns(
    unsigned char* smem, int slot, int xb, const bf16* __restrict__ x, const bf16* __restrict__ xe,
    const int* __restrict__ active_start, const int* __restrict__ active_len, const int* __restrict__ sorted_row,
    const u64* __restrict__ gate_bias_ptrs, const u64* __restrict__ up_bias_ptrs, const int* __restrict__ inter,
    int shared_slot, bf16* __restrict__ act, int H, int I_max, int act_code, float alpha, float limit,
    const u8* __restrict__ maps, const int* __restrict__ slot_active) {
    using Cfg = SwapAbConfig<NT>;
    const int I = inter[slot], c0 = xb * SA_GATE_UP_COLUMNS;
    if (c0 >= I) return pdl_leave_early();  // (by active expert the wait came first: then a no-op)
    const SaRing<NT> ring = sa_ring<NT>(smem);
    const bool sh = slot == shared_slot;  // the shared expert reads x and its own maps
    SaWork w;
    w.map0 = maps + SA_MAP_BYTES * (sh ? SA_MAP_SHARED_GATE : SA_MAP_GATE);
    w.map1 = maps + SA_MAP_BYTES * (sh ? SA_MAP_SHARED_UP : SA_MAP_UP);
    w.row0 = w.row1 = (sh ? 0 : slot * I) + c0;  // routed experts stacked, I rows each
    w.K = H, w.KT = (H + SA_BK - 1) / SA_BK;
    w.tok = sh ? x : xe, w.pitch = H;
    const bool producer = threadIdx.x >= Cfg::CWG * 128;
    int ahead;
    if (!sa_gate_up_run<NT, false>(ring, w, slot, slot_active, active_start, active_len, producer, ahead)) return;
    if (producer) {
        const int start = w.start;
        sa_producer<NT>(ring, w, [&](int t) { return sorted_row[start + t]; }, ahead);
        return;
    }
    const float* bg = reinterpret_cast<const float*>(gate_bias_ptrs[slot]);
    const float* bu = reinterpret_cast<const float*>(up_bias_ptrs[slot]);
    const int wg = threadIdx.x / 128;
#pragma unroll 1
    for (int p = 0, r0 = 0; r0 < w.len; ++p, r0 += NT) {
        float acc[2][Cfg::WN / 2];  // gate, up
        const int t0 = r0 + wg * Cfg::WN;  // this warpgroup's first run row
        sa_consume_pass<NT>(ring, p * w.KT, w.KT, t0 < w.len, acc);
#pragma unroll
        for (int i = 0; i < Cfg::WN / 2; ++i) {
            const SaFrag f(i);
            const int col = c0 + f.row, t = t0 + f.tok;
            if (col < I && t < w.len) {
                const float gv = acc[0][i] + (bg ? bg[col] : 0.0f), uv = acc[1][i] + (bu ? bu[col] : 0.0f);
                // ACT_PAIR (a LoRA plan's gate/up): g and u side by side into lora_gu, as every
                // non-w8a8 gate/up stores them (common.cuh store_gate_up); else act(g, u)
                store_gate_up(act, (size_t)(w.start + t), col, I_max, act_code, gv, uv, alpha, limit);
            }
        }
    }
}

// grid (ceil(I_max / 64), max_active), block SwapAbConfig<NT>::THREADS, dynamic shared memory
// catalog.swapab_smem_bytes(NT). Arguments: DECODE_GATE_UP_ARGS, then the layer's swap-AB
// tensor maps (bf16 experts only: a block of another format's expert leaves), then
// `slot_active`: where set (the lists' slot -> active index), the grid's y is the table slot
// (n_local, and the shared expert's) and a block's first weight stages go out before it waits
// for the lists (PDL), so the stream is in flight while routing runs; a slot nobody chose
// copies them for nothing (forward_plan takes this where that comes to few bytes). Else y is
// the active expert and the block waits first.
template <int NT>
__global__ void __launch_bounds__(SwapAbConfig<NT>::THREADS, SwapAbConfig<NT>::BLOCKS_PER_SM)
decode_swapab_gate_up(DECODE_GATE_UP_ARGS, const u8* __restrict__ maps, const int* __restrict__ slot_active) {
    extern __shared__ unsigned char sa_smem[];
    const int slot = gate_up_block_slot<FMT_BF16>(slot_active, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    sa_gate_up_columns<NT>(sa_smem, slot, blockIdx.x, x, xe, active_start, active_len, sorted_row, gate_bias_ptrs,
                           up_bias_ptrs, inter, shared_slot, act, H, I_max, act_code, alpha, limit, maps,
                           slot_active);
}

// A LoRA block of decode_swapab_gate_up_lora (group: which 64 / max_rank adapters it takes): the
// shrinks t = A x of every adapter of the group against every row of the expert's run, the adapters'
// gate A rows as tile 0 and up's as tile 1 (the slots' arrays [K, S, max_rank, H] by the LoRA maps, a
// box an adapter), so the adapters' A stream through the ring as the expert's weights do; a row's
// own adapter's sums, times its scales, go to lora_t [positions, 2 max_rank] (gate's, then up's),
// the others are discarded.
template <int NT>
__device__ __forceinline__ void sa_lora_shrink(
    unsigned char* smem, int slot, int group, const bf16* __restrict__ x, const bf16* __restrict__ xe,
    const int* __restrict__ active_start, const int* __restrict__ active_len, const int* __restrict__ sorted_row,
    int shared_slot, int H, const u8* __restrict__ maps, const int* __restrict__ slot_active,
    const int* __restrict__ lora_ids, const float* __restrict__ lora_scale, float* __restrict__ lora_t, int n_local,
    int max_rank, int max_loras) {
    using Cfg = SwapAbConfig<NT>;
    const int per = 64 / max_rank, a0 = group * per, S = n_local + 1;  // table slot `slot` (shared: n_local)
    const SaRing<NT> ring = sa_ring<NT>(smem);
    const bool sh = slot == shared_slot;
    SaWork w;
    w.map0 = maps + SA_MAP_BYTES * SA_MAP_LORA_GATE_A;
    w.map1 = maps + SA_MAP_BYTES * SA_MAP_LORA_UP_A;
    w.row0 = (a0 * S + slot) * max_rank;  // box i at row0 + i box_stride (sa_copy_weights<NT, true>)
    w.boxes = min(per, max_loras - a0), w.box_rows = max_rank, w.box_stride = S * max_rank;
    w.K = H, w.KT = (H + SA_BK - 1) / SA_BK;
    w.tok = sh ? x : xe, w.pitch = H;
    const bool producer = threadIdx.x >= Cfg::CWG * 128;
    int ahead;
    if (!sa_gate_up_run<NT, true>(ring, w, slot, slot_active, active_start, active_len, producer, ahead)) return;
    if (producer) {
        const int start = w.start;
        sa_producer<NT, true>(ring, w, [&](int t) { return sorted_row[start + t]; }, ahead);
        return;
    }
    const int wg = threadIdx.x / 128;
#pragma unroll 1
    for (int p = 0, r0 = 0; r0 < w.len; ++p, r0 += NT) {
        float acc[2][Cfg::WN / 2];  // gate's shrinks, up's
        const int t0 = r0 + wg * Cfg::WN;
        sa_consume_pass<NT>(ring, p * w.KT, w.KT, t0 < w.len, acc);
#pragma unroll
        for (int i = 0; i < Cfg::WN / 2; ++i) {
            const SaFrag f(i);
            const int a = a0 + f.row / max_rank, r = f.row % max_rank, t = t0 + f.tok;
            if (a < max_loras && t < w.len) {
                const int pos = w.start + t;
                if (lora_ids[sorted_row[pos]] == a) {
                    const float* sc = lora_scale + ((size_t)a * S + slot) * 3;
                    float* o = lora_t + (size_t)pos * 2 * max_rank + r;
                    o[0] = acc[0][i] * sc[0];
                    o[max_rank] = acc[1][i] * sc[1];
                }
            }
        }
    }
}

// decode_swapab_gate_up with the LoRA plans' gate/up shrinks (forward_plan.lora_swapab): grid x
// lora_x0 column blocks (decode_swapab_gate_up's, storing g and u with ACT_PAIR), then
// ceil(max_loras max_rank / 64) LoRA blocks an expert (sa_lora_shrink; max_rank 8, 16, 32 or 64);
// lora_gate_up_expand_act adds B t and makes act after it. Arguments: decode_swapab_gate_up's, then
// the rows' adapter ids, the slots' scales [K, S, 3], lora_t, and the slots' shape.
template <int NT>
__global__ void __launch_bounds__(SwapAbConfig<NT>::THREADS, SwapAbConfig<NT>::BLOCKS_PER_SM)
decode_swapab_gate_up_lora(DECODE_GATE_UP_ARGS, const u8* __restrict__ maps, const int* __restrict__ slot_active,
                           const int* __restrict__ lora_ids, const float* __restrict__ lora_scale,
                           float* __restrict__ lora_t, int lora_x0, int n_local, int max_rank, int max_loras) {
    extern __shared__ unsigned char sa_smem[];
    const int slot = gate_up_block_slot<FMT_BF16>(slot_active, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    if ((int)blockIdx.x < lora_x0)
        sa_gate_up_columns<NT>(sa_smem, slot, blockIdx.x, x, xe, active_start, active_len, sorted_row,
                               gate_bias_ptrs, up_bias_ptrs, inter, shared_slot, act, H, I_max, act_code, alpha,
                               limit, maps, slot_active);
    else
        sa_lora_shrink<NT>(sa_smem, slot, blockIdx.x - lora_x0, x, xe, active_start, active_len, sorted_row,
                           shared_slot, H, maps, slot_active, lora_ids, lora_scale, lora_t, n_local, max_rank,
                           max_loras);
}

// grid (ceil(H / 128), max_active), block SwapAbConfig<NT>::THREADS, dynamic shared memory
// catalog.swapab_smem_bytes(NT). Arguments: DECODE_DOWN_ARGS, then the swap-AB maps and the
// shared expert's table slot (its maps are its own); outputs
// as decode_down's: y[pos, h], or with `atomic` the routed pairs' w * y added into acc[row, h].
// Before the wait for gate/up (PDL), what does not come from it: the expert's run (the
// lists, made before gate/up, which waited for them before this grid could launch) and the
// first stages' weight boxes, so the stream is in flight as gate/up ends.
template <int NT>
__global__ void __launch_bounds__(SwapAbConfig<NT>::THREADS, SwapAbConfig<NT>::BLOCKS_PER_SM)
decode_swapab_down(DECODE_DOWN_ARGS, const u8* __restrict__ maps, int shared_slot) {
    using Cfg = SwapAbConfig<NT>;
    extern __shared__ unsigned char sa_smem[];
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT_BF16>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return pdl_leave_early();
    const int h0 = blockIdx.x * SA_ROWS;
    if (h0 >= H) return pdl_leave_early();
    const SaRing<NT> ring = sa_ring<NT>(sa_smem);
    const bool sh = slot == shared_slot;
    SaWork w;
    w.map0 = w.map1 = maps + SA_MAP_BYTES * (sh ? SA_MAP_SHARED_DOWN : SA_MAP_DOWN);
    w.row0 = (sh ? 0 : slot * H) + h0, w.row1 = w.row0 + 64;
    w.start = active_start[j], w.len = active_len[j];
    w.K = inter[slot], w.KT = (w.K + SA_BK - 1) / SA_BK;
    w.tok = act, w.pitch = I_max;
    if (threadIdx.x >= Cfg::CWG * 128) {
        const int T = (w.len + NT - 1) / NT * w.KT;
        const int ahead = sa_copy_ahead(ring, w, min(Cfg::STAGES, T));  // the first steps
        pdl_wait_then_release_next();  // gate/up's act from here on
        const int start = w.start;
        sa_producer<NT>(ring, w, [&](int t) { return start + t; }, ahead);
        return;
    }
    pdl_wait_then_release_next();
    const float* bd = reinterpret_cast<const float*>(down_bias_ptrs[slot]);
    const int wg = threadIdx.x / 128;
#pragma unroll 1
    for (int p = 0, r0 = 0; r0 < w.len; ++p, r0 += NT) {
        float c[2][Cfg::WN / 2];  // hidden columns h0 + 0..63, h0 + 64..127
        const int t0 = r0 + wg * Cfg::WN;
        sa_consume_pass<NT>(ring, p * w.KT, w.KT, t0 < w.len, c);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < Cfg::WN / 2; ++i) {
                const SaFrag f(i);
                const int h = h0 + 64 * m + f.row, t = t0 + f.tok;
                if (h < H && t < w.len)
                    store_down_value(c[m][i] + (bd ? bd[h] : 0.0f), w.start + t, h, sorted_pair, topk_w, y, acc, H,
                                     k, P, atomic);
            }
    }
}
