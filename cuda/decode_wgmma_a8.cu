// w8a8 decode on Hopper's fp8 tensor cores (sm_90a): fp8-block experts' weights staged
// through shared memory by a deep cp.async ring and multiplied by wgmma e4m3 against the
// few rows an expert got, with the GEMM's roles swapped (the weights are the M side).
//
//   decode_wgmma_gate_up_a8<NTOK>  act[pos, col] = act(x W_gate^T, x W_up^T) for 64 columns a
//                       block (its stage: 64 gate rows, then the same 64 up rows), the
//                       expert's run NTOK rows a pass; writes the bf16 activation and, the
//                       last block of each 128-column group, its e4m3 codes (decode_a8.cuh)
//   decode_wgmma_down_a8<NTOK>     y[pos, h] = act[pos] . W_down[h] (or, atomic, w * y added
//                       into acc[row, h]) for 128 hidden columns a tile, one or more tiles a
//                       block through one ring (K = I is a few stages: the ring runs on into
//                       the next tile instead of draining)
//
// Why: decode_mma.cu's _a8 kernels load the weights into registers and keep one k128 step a
// warp in flight, below what their read pattern alone streams, and sm_90 runs their
// mma.sync e4m3 as a conversion plus an f16 MMA. Here the copies of all stages but one are in flight while a
// stage computes, the copying threads do nothing else with them, and the products are
// native e4m3 wgmmas: a block's 128 weight rows are two m64 tiles, its NTOK rows the n side.
//
// Per k128 step (one weight scale block, one activation group): the wgmmas start from zero
// (the tensor cores' fp8 accumulation spans 128 k, as the w8a8 GEMM's) and the step's sums
// are promoted in fp32 with the weight block's scale times each row's group scale.
// Arguments: the decode_mma _a8 kernels' (decode_a8.cuh), so the layer launches either.
#include "decode_a8.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define WG_ROWS 128    // weight rows a block streams: two m64 tiles
#define WG_BK 128      // codes of a k step: one weight scale block, one activation group
// The ring by pass height: k steps a stage and stages. 8 and 16 rows: two steps (256 contiguous
// bytes of each weight row a copy), three stages; 32 rows: one step, five stages (128 bytes a
// copy), so that two blocks fit an SM there too. Either way 64 KB of weights are in flight a block.
#define WG_KSUB(NTOK) ((NTOK) <= 16 ? 2 : 1)
#define WG_STAGES(NTOK) ((NTOK) <= 16 ? 3 : 5)
#define WG_THREADS 128 // one warpgroup: it copies, multiplies and stores
// blocks an SM the registers are capped for: the ring and K's weight scales leave room for 2 up
// to K = 14336 at every pass height (catalog.wgmma_decode_smem_bytes: mixtral-8x7b's down)
#define WG_MIN_BLOCKS(NTOK) 2

// A stage: WG_KSUB(NTOK) k steps of the 128 weight rows (each step's 128 x 128 codes a tile,
// 128-byte swizzled: wgmma_desc), then the same steps of the pass's NTOK rows. After the
// WG_STAGES(NTOK) stages, the scales of every k step of K of the two weight tiles (gate, up;
// down's two tiles share one block, both point at it), then each ring slot's rows' group scales
// ([NTOK][KSUB], copied with the stage: so the window grows with K only by the weights' scales).
template <int NTOK>
__host__ __device__ constexpr int wg_stage_bytes() { return (WG_ROWS + NTOK) * WG_BK * WG_KSUB(NTOK); }

// A row of the pass: its e4m3 codes and its group scales (one per k128 step).
struct WgRow {
    const u8* codes;
    const float* scales;
};

// Everything a block needs besides the stages' bytes: its weight rows, its pass's rows and
// the scales of both. TILED (down): the block takes `tiles` weight tiles one after another in
// one run of its ring, tile t WG_ROWS rows of K codes on from tile 0 (every row inside the
// matrix: the layer takes more than one tile only where H is a multiple of 128); stage s of
// the run is stage s % KS of tile s / KS, and tile t's weight scales are sw[t * KT ..].
template <int NTOK, bool TILED = false>
struct WgA8Block {
    static constexpr int KSUB = WG_KSUB(NTOK), STAGES = WG_STAGES(NTOK);
    static constexpr int CHUNKS = WG_BK * KSUB / 16;                          // 16-byte chunks a row and stage
    static constexpr int ROWS_PER = WG_THREADS / CHUNKS;                         // rows a round of copies covers
    static constexpr int A_PER = WG_ROWS / ROWS_PER;                             // a thread's weight rows
    static constexpr int B_PER = (NTOK + ROWS_PER - 1) / ROWS_PER;              // and pass rows
    const u8* a_src[A_PER];
    bool a_ok[A_PER];
    const u8* b_src[B_PER];
    bool b_ok[B_PER];
    const float* x_src;  // this thread's row scales (threads below NTOK * KSUB: row tid / KSUB, step tid % KSUB)
    bool x_ok;
    int chunk, K, KT, KS;  // this thread's chunk of a row; K, its k steps, its stages
    u8* stages;
    float* sw;  // [2][KT]: the two m64 tiles' weight scales (TILED: [tiles][KT], one a weight tile)
    float* sx;  // [STAGES][NTOK][KSUB]: each slot's rows' group scales (0 past the run or K)
    int tiles = 1;
    __device__ __forceinline__ int run_stages() const { return TILED ? KS * tiles : KS; }

    // the i-th row (of the weight tile, or of the pass) whose chunk this thread copies: a
    // warp's copies are ROWS_PER / 4 whole rows of a stage, WG_BK * KSUB contiguous bytes each
    __device__ __forceinline__ int row(int i) const { return threadIdx.x / CHUNKS + ROWS_PER * i; }
    __device__ __forceinline__ u8* stage(int s) const { return stages + (s % STAGES) * wg_stage_bytes<NTOK>(); }

    // The pass's rows from run row r0 (rows past the run read its last row, as zeros, and
    // their scales as 0): row_of(t) gives run row t's codes and scales.
    template <class RowOf>
    __device__ __forceinline__ void set_rows(int r0, int len, RowOf row_of) {
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const int t = r0 + row(i);
            b_ok[i] = t < len;
            b_src[i] = row_of(min(t, len - 1)).codes;
        }
        const int t = r0 + (int)threadIdx.x / KSUB;
        x_ok = threadIdx.x < NTOK * KSUB && t < len;
        x_src = row_of(min(t, len - 1)).scales + threadIdx.x % KSUB;
    }

    // The 16-byte copies of run stage s into its ring slot: stage ts of weight tile `tile`
    // (TILED, else tile 0 and ts = s), its weight rows' (WEIGHTS) and its pass rows' (ROWS);
    // chunks past K and rows past the matrix or the run arrive as zeros (nothing read).
    // Chunk c of a row lands in k step c / 8's tile.
    template <bool WEIGHTS, bool ROWS>
    __device__ __forceinline__ void copy_stage(int s, int tile = 0, int ts = 0) const {
        u8* st = stage(s);
        const int kc = (TILED ? ts : s) * WG_BK * KSUB + chunk * 16;
        const bool kin = kc < K;
        const int sub = chunk / 8, c = chunk % 8;
        u8* a_dst = st + sub * WG_ROWS * WG_BK;
        u8* b_dst = st + KSUB * WG_ROWS * WG_BK + sub * NTOK * WG_BK;
        const size_t toff = TILED && kin ? (size_t)tile * WG_ROWS * K : 0;
        if (WEIGHTS)
#pragma unroll
            for (int i = 0; i < A_PER; ++i) {
                u8* dst = a_dst + swz128(row(i), c);
                const u8* src = a_src[i] + toff + (kin ? kc : 0);
                if constexpr (KSUB == 1)  // a stage reads 128 bytes a row: L2 brings the next stage's too
                    cp_async16_l2_256(dst, src, a_ok[i] && kin);
                else
                    cp_async16(dst, src, a_ok[i] && kin);
            }
        if (ROWS) {
#pragma unroll
            for (int i = 0; i < B_PER; ++i)
                if (row(i) < NTOK) cp_async16(b_dst + swz128(row(i), c), b_src[i] + (kin ? kc : 0), b_ok[i] && kin);
            const int kt = (TILED ? ts : s) * KSUB;  // + this thread's step (x_src holds it)
            const bool xin = kt + (int)threadIdx.x % KSUB < KT;
            if (threadIdx.x < NTOK * KSUB)
                cp_async4(slot_scales(s) + threadIdx.x, x_src + (xin ? kt : 0), x_ok && xin);
        }
    }
    __device__ __forceinline__ float* slot_scales(int s) const { return sx + (s % STAGES) * NTOK * KSUB; }

    // The weight rows of the first STAGES - 1 stages, as one group of copies ahead of a
    // first pass that takes `weights_ahead` (down: issued before the block waits for gate/up).
    __device__ __forceinline__ void copy_weights_ahead() const {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (s < run_stages()) copy_stage<true, false>(s, TILED ? s / KS : 0, TILED ? s % KS : 0);
        cp_async_commit();
    }

    // One pass: acc[m] (tile m's m64 x NTOK sums, fp32) over all of K. Every thread copies
    // its chunks STAGES - 1 stages ahead; a stage's barrier makes everyone's copies of it
    // visible and frees the stage read before it. The caller has filled sw (the first barrier
    // orders it too); a stage's rows' scales come with its rows. `weights_ahead`:
    // copy_weights_ahead issued the first stages' weight rows (an older group than these
    // stages' own, so every wait below that covers a stage's group covers its weights too).
    // TILED: tile_done(tile, acc) as each tile's sums are whole but the last's (then zeroed for
    // the next; the last stay in acc), while the next tile's first stages are in flight.
    template <class TileDone>
    __device__ __forceinline__ void pass(float (&acc)[2][NTOK / 2], bool weights_ahead, TileDone tile_done) const {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < NTOK / 2; ++i) acc[m][i] = 0.0f;
        const int t4 = threadIdx.x & 3;
        const int RS = run_stages();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < RS) {
                if (weights_ahead)
                    copy_stage<false, true>(s, TILED ? s / KS : 0, TILED ? s % KS : 0);
                else
                    copy_stage<true, true>(s, TILED ? s / KS : 0, TILED ? s % KS : 0);
            }
            cp_async_commit();
        }
        TileRun run(KS, tiles);  // TILED: where the run is
        if (TILED) run.start(STAGES - 1);
#pragma unroll 1
        for (int s = 0; s < RS; ++s) {
            cp_async_wait<STAGES - 2>();  // this thread's copies of stage s have landed
            fence_proxy_async();             // ... visible to the tensor cores (async proxy)
            __syncthreads();                 // everyone's; the stage of s - 1 is free
            if (s + STAGES - 1 < RS) copy_stage<true, true>(s + STAGES - 1, run.at, run.ats);
            cp_async_commit();
            const u8* st = stage(s);
            const float* sxs = slot_scales(s);
            const float* swt = sw + (TILED ? run.tile * KT : 0);
#pragma unroll
            for (int sub = 0; sub < KSUB; ++sub) {
                const int kt = (TILED ? run.ts : s) * KSUB + sub;
                if (kt >= KT) break;
                const u8* a = st + sub * WG_ROWS * WG_BK;
                const u64 da0 = wgmma_desc(a), da1 = wgmma_desc(a + 64 * WG_BK);
                const u64 db = wgmma_desc(st + KSUB * WG_ROWS * WG_BK + sub * NTOK * WG_BK);
                float blk[2][NTOK / 2] = {};  // overwritten (scale_d = 0 at kk = 0); zeroed so no value is undefined
                fence_acc<NTOK / 2>(blk[0]);
                fence_acc<NTOK / 2>(blk[1]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < WG_BK / 32; ++kk) {  // +32 bytes of K each
                    wgmma_m64nNk32_e4m3<NTOK>(blk[0], da0 + 2 * kk, db + 2 * kk, kk);
                    wgmma_m64nNk32_e4m3<NTOK>(blk[1], da1 + 2 * kk, db + 2 * kk, kk);
                }
                wgmma_commit();
                wgmma_wait<0>();
                fence_acc<NTOK / 2>(blk[0]);
                fence_acc<NTOK / 2>(blk[1]);
                // promote: element j * 4 + h * 2 + e holds column (row of the pass) 8 j + 2 t4 + e
#pragma unroll
                for (int j = 0; j < NTOK / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float x = sxs[(8 * j + 2 * t4 + e) * KSUB + sub];
#pragma unroll
                        for (int m = 0; m < 2; ++m) {
                            const float f = x * swt[(TILED ? 0 : m * KT) + kt];
                            acc[m][j * 4 + e] = fmaf(blk[m][j * 4 + e], f, acc[m][j * 4 + e]);
                            acc[m][j * 4 + 2 + e] = fmaf(blk[m][j * 4 + 2 + e], f, acc[m][j * 4 + 2 + e]);
                        }
                    }
            }
            if (TILED) run.step(acc, tile_done);
        }
        cp_async_wait<0>();
        __syncthreads();  // the stages are free for the next pass
    }
};

template <int NTOK, bool TILED = false>
__device__ __forceinline__ WgA8Block<NTOK, TILED> wg_block(unsigned char* smem, int K, int tiles = 1) {
    WgA8Block<NTOK, TILED> b;
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(smem) & 1023u)) & 1023u;
    b.stages = smem + pad;
    b.K = K;
    b.KT = (K + WG_BK - 1) / WG_BK;
    b.KS = (b.KT + b.KSUB - 1) / b.KSUB;
    b.tiles = tiles;
    b.sw = reinterpret_cast<float*>(b.stages + b.STAGES * wg_stage_bytes<NTOK>());
    b.sx = b.sw + max(2, tiles) * b.KT;  // 4-byte aligned, as cp_async4 wants
    b.chunk = threadIdx.x % b.CHUNKS;
    return b;
}

// grid (ceil(I_max / 64), max_active), or with `slot_active` (ceil(I_max / 64), n_local + 1
// with a shared expert, else n_local), block WG_THREADS, dynamic shared memory
// kernels.wgmma_decode_smem_bytes(NTOK, ceil(H / 128)). Arguments: DECODE_A8_GATE_UP_ARGS.
// With `slot_active` a block is a table slot's: its weight rows, their scales and the first
// stages' weight copies go out before it waits for the lists (PDL; the launch right before
// makes them), so the stream is in flight as they land; a slot nobody chose wastes that
// (the layer takes this where those copies come to little: heuristics.gate_up_by_slot).
// Else a block is an active expert's: it waits for the lists first, then its first stages'
// weight copies go out before its other loads.
template <int NTOK>
__global__ void __launch_bounds__(WG_THREADS, WG_MIN_BLOCKS(NTOK)) decode_wgmma_gate_up_a8(DECODE_A8_GATE_UP_ARGS) {
    extern __shared__ unsigned char wg_smem[];
    const int slot = gate_up_block_slot<FMT_FP8>(slot_active, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    int j = blockIdx.y;
    const int I = inter[slot], c0 = blockIdx.x * 64;
    if (c0 >= I) return pdl_leave_early();  // past the columns: no ticket to take either
    WgA8Block<NTOK> b = wg_block<NTOK>(wg_smem, H);
    const u8* gate = reinterpret_cast<const u8*>(gate_ptrs[slot]);
    const u8* up = reinterpret_cast<const u8*>(up_ptrs[slot]);
#pragma unroll
    for (int i = 0; i < b.A_PER; ++i) {  // rows 0-63: gate columns c0 + r, 64-127: up's
        const int r = b.row(i), col = c0 + (r & 63);
        b.a_ok[i] = col < I;
        b.a_src[i] = (r < 64 ? gate : up) + (size_t)min(col, I - 1) * H;
    }
    b.copy_weights_ahead();  // the stream first: the loads below are round trips it need not wait for
    // the tiles' weight scale rows: columns c0 .. c0 + 63 lie in block c0 / 128 of each matrix
    const int KT = b.KT;
    for (int i = threadIdx.x; i < 2 * KT; i += WG_THREADS) {
        const u64 sp = i < KT ? gate_scale_ptrs[slot] : up_scale_ptrs[slot];
        b.sw[i] = reinterpret_cast<const float*>(sp)[(size_t)(c0 >> 7) * KT + i % KT];
    }
    const bool shared = slot == shared_slot;  // the shared expert reads x's codes
    const u8* q_in = shared ? qx_shared : qx;
    const float* s_in = shared ? sx_shared : sx;
    const float gsg = gate_gscale[slot], gsu = up_gscale[slot];
    const float* bg = reinterpret_cast<const float*>(gate_bias_ptrs[slot]);
    const float* bu = reinterpret_cast<const float*>(up_bias_ptrs[slot]);
    if (slot_active) {
        pdl_wait_then_release_next();  // the lists from here on
        j = slot_active[slot];
        if (j < 0) {  // nobody chose the expert: the copies were for nothing
            cp_async_wait<0>();
            return;
        }
    }
    const int start = active_start[j], len = active_len[j];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;

    for (int r0 = 0; r0 < len; r0 += NTOK) {
        b.set_rows(r0, len, [&](int t) {  // the token rows of the expert's run
            const size_t row = sorted_row[start + t];
            return WgRow{q_in + row * H, s_in + row * KT};
        });
        float acc[2][NTOK / 2];  // gate, up
        b.pass(acc, r0 == 0, [](int, float (&)[2][NTOK / 2]) {});
#pragma unroll
        for (int i = 0; i < NTOK / 2; ++i) {  // element (j, h, e) = 4 j + 2 h + e
            const int col = c0 + 16 * warp + g + 8 * ((i >> 1) & 1), t = r0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
            if (col < I && t < len) {
                const float gv = acc[0][i] * gsg + (bg ? bg[col] : 0.0f);
                const float uv = acc[1][i] * gsu + (bu ? bu[col] : 0.0f);
                act[(size_t)(start + t) * I_max + col] = __float2bfloat16(apply_activation(act_code, gv, uv, alpha, limit));
            }
        }
    }
    quantize_act_group_if_last(act, qact, sact, act_tickets, j, c0, 64, I, I_max, start, len);
}

// grid (ceil(H / 128) / T, max_active), block WG_THREADS, dynamic shared memory
// kernels.wgmma_decode_smem_bytes(NTOK, ceil(I_max / 128), T): the stages, aligned to 1024
// bytes (the swizzle's atom), every k step's weight scales and each ring slot's rows' scales.
// A block takes T = ceil(H / 128) / gridDim.x tiles of 128 hidden columns through one ring
// (T > 1 only where H is a multiple of 128 that T tiles divide). Arguments: DECODE_A8_DOWN_ARGS; outputs as
// decode_mma_down_a8's: y[pos, h], or with `atomic` the routed pairs' w * y added into
// acc[row, h] (the shared expert still stores y).
template <int NTOK>
__global__ void __launch_bounds__(WG_THREADS, WG_MIN_BLOCKS(NTOK)) decode_wgmma_down_a8(DECODE_A8_DOWN_ARGS) {
    extern __shared__ unsigned char wg_smem[];
    // Before the wait for gate/up (PDL), what does not come from it: the expert's run (the
    // lists, made by a launch before gate/up, which passed its own wait for them before this
    // grid could launch), its weight rows and their scales, and the first stages' weights,
    // so the stream is in flight when gate/up ends.
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT_FP8>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return pdl_leave_early();
    const int tiles = max(1, (H + WG_ROWS - 1) / WG_ROWS / (int)gridDim.x), h0 = blockIdx.x * WG_ROWS * tiles;
    if (h0 >= H) return pdl_leave_early();
    const int I = inter[slot];
    WgA8Block<NTOK, true> b = wg_block<NTOK, true>(wg_smem, I, tiles);
    const u8* down = reinterpret_cast<const u8*>(down_ptrs[slot]);
#pragma unroll
    for (int i = 0; i < b.A_PER; ++i) {
        const int h = h0 + b.row(i);
        b.a_ok[i] = h < H;
        b.a_src[i] = down + (size_t)min(h, H - 1) * I;
    }
    b.copy_weights_ahead();
    // each tile's 128 rows are one weight scale block: its two m64 halves take its scales
    const int KT = b.KT, KBI = (I_max + 127) >> 7;
    for (int i = threadIdx.x; i < tiles * KT; i += WG_THREADS)
        b.sw[i] = reinterpret_cast<const float*>(down_scale_ptrs[slot])[(size_t)(h0 >> 7) * KT + i];
    const float gsd = down_gscale[slot];
    const float* bd = reinterpret_cast<const float*>(down_bias_ptrs[slot]);
    const int start = active_start[j], len = active_len[j];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
    pdl_wait_then_release_next();  // gate/up's activation codes and scales from here on

    for (int r0 = 0; r0 < len; r0 += NTOK) {
        b.set_rows(r0, len, [&](int t) {  // the activation's rows, by position
            const size_t pos = start + t;
            return WgRow{qact + pos * I_max, sact + pos * KBI};
        });
        auto store = [&](int tile, float (&c)[2][NTOK / 2]) {  // hidden columns +0..63, +64..127 of the tile
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int i = 0; i < NTOK / 2; ++i) {
                    const int h = h0 + WG_ROWS * tile + 64 * m + 16 * warp + g + 8 * ((i >> 1) & 1);
                    const int t = r0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
                    if (h < H && t < len)
                        store_down_value(c[m][i] * gsd + (bd ? bd[h] : 0.0f), start + t, h, sorted_pair, topk_w, y,
                                         acc, H, k, P, atomic);
                }
        };
        float c[2][NTOK / 2];
        b.pass(c, r0 == 0, store);
        store(tiles - 1, c);
    }
}
