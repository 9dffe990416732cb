// Swap-AB w8a8 decode on Hopper (sm_90a), fp8-block experts: decode_swapab_sm90.cu's scheme
// on e4m3 codes. An expert's weight rows are the wgmma's M side (two m64 tiles a block), the
// token rows it got its N side (NT of them a pass), both as e4m3 codes.
//
//   decode_swapab_fp8_gate_up<NT>  act[pos, col] = act(x W_gate^T, x W_up^T) for 64 columns a
//                       block (tile 0 its 64 gate rows, tile 1 the same 64 up rows, so a thread
//                       holds g and u of one (column, token)); writes the bf16 activation and,
//                       the last block of each 128-column group, its e4m3 codes (decode_a8.cuh)
//   decode_swapab_fp8_down<NT>     y[pos, h] = act[pos] . W_down[h] (or, atomic, w * y added
//                       into acc[row, h]) for 128 hidden columns a block, from those codes
//
// Why: decode_wgmma_a8.cu streams the weights through a cp.async ring its one warpgroup both
// fills and reads (two stages in flight, a block barrier a stage); here a producer warp keeps
// STAGES - 1 stages of TMA weight boxes in flight while the consumer warpgroup multiplies, as
// the bf16 swap-AB decode does (benchmarks/DECISIONS.md, "Swap-AB w8a8 decode").
//
// A stage is one k128 step: the two tiles' 64 x 128 codes (one 128-byte swizzle row each, by
// TMA from cupymoe/tma.py swapab_table's uint8 maps), the pass's NT token rows of 128 codes
// (gathered by the producer warp's cp.async: x's codes through sorted_row for gate/up, the
// activation's by position for down), and the step's scales: each token's group scale and the
// two tiles' weight block scales. The products of a step start from zero (the tensor cores'
// fp8 accumulation spans 128 k) and are promoted in fp32 with weight scale x token scale, the
// order and roundings of decode_wgmma_a8.cu's promotion. Arguments: the w8a8 decode kernels'
// (decode_a8.cuh) plus the swap-AB maps, so the layer's argument tuple serves either.
#include "decode_a8.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define SF_BK 128                   // codes of K a stage: a swizzle row, a weight scale block, a token group
#define SF_ROWS 128                 // weight rows a block: two m64 tiles
#define SF_TILE_BYTES (64 * SF_BK)  // one m64 weight tile of a stage
#define SF_MAP_BYTES 128
#define SF_GATE_UP_COLUMNS 64  // activation columns a gate/up block (cupymoe/catalog.py)

// tensor-map indices (cupymoe/tma.py: SWAPAB_MAPS, the bf16 kernels' order)
#define SF_MAP_GATE 0
#define SF_MAP_UP 1
#define SF_MAP_DOWN 2
#define SF_MAP_SHARED_GATE 3
#define SF_MAP_SHARED_UP 4
#define SF_MAP_SHARED_DOWN 5

// A token tile's configuration (cupymoe/catalog.py SWAPAB_FP8_* mirror it). One consumer
// warpgroup holds a step's fresh products and the promoted sums of both tiles (2 NT floats a
// thread), so NT stops at 64: 128 tokens would need 256 accumulator registers. A stage has the
// bf16 kernels' bytes (128-byte rows), so their stage counts: two blocks an SM.
template <int NT>
struct SwapAbFp8Config {
    static_assert(NT == 8 || NT == 16 || NT == 32 || NT == 64, "token tiles 8..64");
    static constexpr int STAGES = NT <= 32 ? 5 : 4;
    static constexpr int BLOCKS_PER_SM = 2;
    static constexpr int THREADS = 128 + 32;  // one consumer warpgroup, one producer warp
    static constexpr int LAG = STAGES - 2;    // the producer's lanes mark a stage full this many steps late
    static constexpr int STAGE_BYTES = (SF_ROWS + NT) * SF_BK;
    static constexpr int SCALES = NT + 2;     // floats a stage: the tokens' group scales, the tiles' block scales
    static constexpr int PER_LANE = NT / 4;   // token rows a producer lane copies a chunk of
    static_assert(STAGES >= 3, "a stage of token copies in flight (the lag's condition)");
};

// The ring: STAGES stages of codes (the two weight tiles, then the NT token rows, 128-byte
// swizzled as wgmma_desc declares), then each stage's scales, then `full` and `empty` barriers.
template <int NT>
struct SfRing {
    unsigned char* base;
    float* scales;
    u64* full;   // the weights' bytes + every producer lane's arrival
    u64* empty;  // every consumer warp's arrival once it has read the stage
    __device__ __forceinline__ unsigned char* weights(int s) const {
        return base + s * SwapAbFp8Config<NT>::STAGE_BYTES;
    }
    __device__ __forceinline__ unsigned char* tokens(int s) const { return weights(s) + SF_ROWS * SF_BK; }
    __device__ __forceinline__ float* scale(int s) const { return scales + s * SwapAbFp8Config<NT>::SCALES; }
};

// One block's work: its two weight tiles' maps, first rows and block-scale rows (one float a
// k128 step), the expert's run, K, and where its token rows' codes and group scales lie (run
// row t: codes + row_of(t) * pitch, tscale + row_of(t) * tscale_pitch).
struct SfWork {
    const u8* map0;
    const u8* map1;
    int row0, row1;
    const float* wscale0;
    const float* wscale1;
    int start, len;  // the expert's run of positions
    int K, KT;
    const u8* codes;
    int pitch;
    const float* tscale;
    int tscale_pitch;
};

template <int NT>
__device__ __forceinline__ SfRing<NT> sf_ring(unsigned char* smem) {
    using Cfg = SwapAbFp8Config<NT>;
    SfRing<NT> r;
    const unsigned pad = (1024u - (smem_u32(smem) & 1023u)) & 1023u;  // swizzle atoms start on 1024 bytes
    r.base = smem + pad;
    r.scales = reinterpret_cast<float*>(r.base + Cfg::STAGES * Cfg::STAGE_BYTES);
    r.full = reinterpret_cast<u64*>(r.scales + Cfg::STAGES * Cfg::SCALES);  // SCALES even: 8-byte aligned
    r.empty = r.full + Cfg::STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbar_init(&r.full[s], 1 + 32);  // lane 0's arrive.expect_tx, then each lane's copies
            mbar_init(&r.empty[s], 4);      // every consumer warp
        }
        mbar_init_fence();
    }
    __syncthreads();
    return r;
}

// Lane 0 of the producer: step kt's two weight boxes into stage s, counted on its barrier.
template <int NT>
__device__ __forceinline__ void sf_copy_weights(const SfRing<NT>& ring, const SfWork& w, int s, int kt) {
    mbar_arrive_expect_tx(&ring.full[s], SF_ROWS * SF_BK);
    tma_load_2d(ring.weights(s), w.map0, kt * SF_BK, w.row0, &ring.full[s]);
    tma_load_2d(ring.weights(s) + SF_TILE_BYTES, w.map1, kt * SF_BK, w.row1, &ring.full[s]);
}


// A producer lane's cp.async share of step kt into stage s: chunk c = lane % 8 of its rows
// lane / 8 + 4 i (zeros past K), their group scales (lanes 0, 8, 16, 24), the tiles' block
// scales (lanes 0, 1). Rows past the pass are not copied: their outputs are masked and a
// token's products never mix with another's.
template <int NT>
__device__ __forceinline__ void sf_copy_tokens(const SfRing<NT>& ring, const SfWork& w, const int (&rid)[NT / 4],
                                               int s, int kt) {
    const int lane = threadIdx.x & 31, c = lane & 7;
    const int kc = kt * SF_BK + c * 16;
    const bool kin = kc < w.K;
    unsigned char* dst = ring.tokens(s);
    float* sc = ring.scale(s);
#pragma unroll
    for (int i = 0; i < NT / 4; ++i) {
        if (rid[i] < 0) continue;
        const int r = lane / 8 + 4 * i;
        cp_async16(dst + swz128(r, c), w.codes + (size_t)rid[i] * w.pitch + (kin ? kc : 0), kin);
        if (c == 0) cp_async4(sc + r, w.tscale + (size_t)rid[i] * w.tscale_pitch + kt);
    }
    if (lane < 2) cp_async4(sc + NT + lane, (lane ? w.wscale1 : w.wscale0) + kt);
}

// The producer warp over every pass of the run: a step's weight boxes (lane 0; the first
// STAGES steps' already issued where `ahead`), then its token codes and scales. A lane marks a
// stage full LAG steps after its copies went out, once they have landed and been fenced for
// the async proxy. row_of(t): the index of run row t in w.codes' rows.
template <int NT, class RowOf>
__device__ __forceinline__ void sf_producer(const SfRing<NT>& ring, const SfWork& w, RowOf row_of, bool ahead) {
    using Cfg = SwapAbFp8Config<NT>;
    constexpr int S = Cfg::STAGES, LAG = Cfg::LAG;
    const int lane = threadIdx.x & 31;
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
            if (lane == 0 && !(ahead && g < S)) sf_copy_weights(ring, w, s, kt);
            sf_copy_tokens<NT>(ring, w, rid, s, kt);
            cp_async_commit();
            gather_mark_full<LAG>(ring.full, g, S);
        }
    }
    gather_mark_tail<LAG>(ring.full, T, S);
}

// Stage s's products: blk[m] = tile m's 64 weight rows x the NT tokens over the step's 128 k,
// from zero (scale_d = 0 at the first k32), waited for.
template <int NT>
__device__ __forceinline__ void sf_k128(const SfRing<NT>& ring, int s, float (&blk)[2][NT / 2]) {
    const u64 da0 = wgmma_desc(ring.weights(s)), da1 = wgmma_desc(ring.weights(s) + SF_TILE_BYTES);
    const u64 db = wgmma_desc(ring.tokens(s));
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < NT / 2; ++i) blk[m][i] = 0.0f;  // overwritten; zeroed so no value is undefined
    fence_acc<NT / 2>(blk[0]);
    fence_acc<NT / 2>(blk[1]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < SF_BK / 32; ++kk) {  // +32 bytes of K each
        wgmma_m64nNk32_e4m3<NT>(blk[0], da0 + 2 * kk, db + 2 * kk, kk);
        wgmma_m64nNk32_e4m3<NT>(blk[1], da1 + 2 * kk, db + 2 * kk, kk);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc<NT / 2>(blk[0]);
    fence_acc<NT / 2>(blk[1]);
}

// One pass of the consumer warpgroup: acc[m] = tile m's 64 weight rows x the pass's NT tokens
// over all of K (steps g0 .. g0 + KT - 1 of the ring), each step promoted with token scale x
// weight scale (decode_wgmma_a8.cu's fmaf, in its order). A warp frees a stage once its
// products and scales of it are read.
template <int NT>
__device__ __forceinline__ void sf_consume_pass(const SfRing<NT>& ring, int g0, int KT, float (&acc)[2][NT / 2]) {
    constexpr int S = SwapAbFp8Config<NT>::STAGES;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < NT / 2; ++i) acc[m][i] = 0.0f;
    const int lane = threadIdx.x & 31, t4 = threadIdx.x & 3;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
        const int g = g0 + kt, s = g % S;
        mbar_wait(&ring.full[s], (g / S) & 1);
        float blk[2][NT / 2];
        sf_k128<NT>(ring, s, blk);
        const float* sc = ring.scale(s);
        const float ws[2] = {sc[NT], sc[NT + 1]};
        // element 4 j + 2 h + e holds token 8 j + 2 t4 + e
#pragma unroll
        for (int j = 0; j < NT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = sc[8 * j + 2 * t4 + e];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const float f = x * ws[m];
                    acc[m][j * 4 + e] = fmaf(blk[m][j * 4 + e], f, acc[m][j * 4 + e]);
                    acc[m][j * 4 + 2 + e] = fmaf(blk[m][j * 4 + 2 + e], f, acc[m][j * 4 + 2 + e]);
                }
            }
        __syncwarp();  // every lane's reads of the stage are done
        if (lane == 0) mbar_arrive(&ring.empty[s]);
    }
}

// Accumulator element i of a thread: the weight row (of its m64 tile) and token (of the pass)
// it holds, the m64nN fragment layout: element 4 j + 2 h + e is row 16 warp + 8 h + g, token
// 8 j + 2 t4 + e.
struct SfFrag {
    int row, tok;
    __device__ __forceinline__ SfFrag(int i) {
        const int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
        row = 16 * warp + g + 8 * ((i >> 1) & 1);
        tok = 8 * (i >> 2) + 2 * t4 + (i & 1);
    }
};

// A block's active expert: the grid's rows from the last (past num_active: nothing to do, then
// the shared expert, whose N rows take ceil(N / NT) passes, the longest blocks) so the longest
// runs start in the first wave instead of trailing the last one.
__device__ __forceinline__ int sf_active_index() { return gridDim.y - 1 - blockIdx.y; }

// What gate/up's epilogue applies to a product: the global scales, biases and activation.
struct SfActivation {
    float gsg, gsu;
    const float* bg;
    const float* bu;
    int code;
    float alpha, limit;
    __device__ __forceinline__ float operator()(float g, float u, int col) const {
        const float gv = g * gsg + (bg ? bg[col] : 0.0f), uv = u * gsu + (bu ? bu[col] : 0.0f);
        return apply_activation(code, gv, uv, alpha, limit);
    }
};

// gate/up's block work: the gate and up tiles of columns c0 .. c0 + 63 (the shared expert's
// own maps), their block-scale rows (block c0 / 128 of each), and x's codes for the run.
__device__ __forceinline__ SfWork sf_gate_up_work(const u8* maps, bool sh, int slot, int I, int c0, int H,
                                                  const u64* gate_scale_ptrs, const u64* up_scale_ptrs,
                                                  const u8* codes, const float* scales) {
    SfWork w;
    w.map0 = maps + SF_MAP_BYTES * (sh ? SF_MAP_SHARED_GATE : SF_MAP_GATE);
    w.map1 = maps + SF_MAP_BYTES * (sh ? SF_MAP_SHARED_UP : SF_MAP_UP);
    w.row0 = w.row1 = (sh ? 0 : slot * I) + c0;  // routed experts stacked, I rows each
    w.K = H, w.KT = (H + SF_BK - 1) / SF_BK;
    w.wscale0 = reinterpret_cast<const float*>(gate_scale_ptrs[slot]) + (size_t)(c0 >> 7) * w.KT;
    w.wscale1 = reinterpret_cast<const float*>(up_scale_ptrs[slot]) + (size_t)(c0 >> 7) * w.KT;
    w.codes = codes, w.pitch = H;
    w.tscale = scales, w.tscale_pitch = w.KT;
    return w;
}

// grid (ceil(I_max / 64), max_active), block SwapAbFp8Config<NT>::THREADS, dynamic shared
// memory catalog.swapab_fp8_smem_bytes(NT). Arguments: DECODE_A8_GATE_UP_ARGS (slot_active
// unread: blocks go by active index), then the layer's swap-AB maps (uint8 for fp8 experts; a
// block of another format's expert leaves). Every thread, producer included, joins the
// activation's quantization at the end (its block barriers).
template <int NT>
__global__ void __launch_bounds__(SwapAbFp8Config<NT>::THREADS, SwapAbFp8Config<NT>::BLOCKS_PER_SM)
decode_swapab_fp8_gate_up(DECODE_A8_GATE_UP_ARGS, const u8* __restrict__ maps) {
    extern __shared__ unsigned char sf_smem[];
    pdl_wait_then_release_next();
    const int j = sf_active_index();
    const int slot = decode_block_slot<FMT_FP8>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    const int I = inter[slot], c0 = blockIdx.x * SF_GATE_UP_COLUMNS;
    if (c0 >= I) return;  // past the columns: no ticket to take either
    const SfRing<NT> ring = sf_ring<NT>(sf_smem);
    const bool sh = slot == shared_slot;  // the shared expert reads x's codes
    SfWork w = sf_gate_up_work(maps, sh, slot, I, c0, H, gate_scale_ptrs, up_scale_ptrs, sh ? qx_shared : qx,
                               sh ? sx_shared : sx);
    w.start = active_start[j], w.len = active_len[j];
    if (threadIdx.x >= 128) {
        const int start = w.start;
        sf_producer<NT>(ring, w, [&](int t) { return sorted_row[start + t]; }, false);
    } else {
        const SfActivation fn{gate_gscale[slot], up_gscale[slot], reinterpret_cast<const float*>(gate_bias_ptrs[slot]),
                              reinterpret_cast<const float*>(up_bias_ptrs[slot]), act_code, alpha, limit};
#pragma unroll 1
        for (int p = 0, r0 = 0; r0 < w.len; ++p, r0 += NT) {
            float acc[2][NT / 2];  // gate, up
            sf_consume_pass<NT>(ring, p * w.KT, w.KT, acc);
#pragma unroll
            for (int i = 0; i < NT / 2; ++i) {
                const SfFrag f(i);
                const int col = c0 + f.row, t = r0 + f.tok;
                if (col < I && t < w.len)
                    act[(size_t)(w.start + t) * I_max + col] = __float2bfloat16(fn(acc[0][i], acc[1][i], col));
            }
        }
    }
    quantize_act_group_if_last(act, qact, sact, act_tickets, j, c0, SF_GATE_UP_COLUMNS, I, I_max, w.start, w.len);
}

// grid (ceil(H / 128), max_active), block SwapAbFp8Config<NT>::THREADS, dynamic shared memory
// catalog.swapab_fp8_smem_bytes(NT). Arguments: DECODE_A8_DOWN_ARGS, then the swap-AB maps and
// the shared expert's table slot (its maps are its own); outputs as decode_wgmma_down_a8's:
// y[pos, h], or with `atomic` the routed pairs' w * y added into acc[row, h]. Before the wait
// for gate/up (PDL), what does not come from it: the expert's run (the lists, made before
// gate/up) and the first stages' weight boxes, so the stream is in flight as gate/up ends.
template <int NT>
__global__ void __launch_bounds__(SwapAbFp8Config<NT>::THREADS, SwapAbFp8Config<NT>::BLOCKS_PER_SM)
decode_swapab_fp8_down(DECODE_A8_DOWN_ARGS, const u8* __restrict__ maps, int shared_slot) {
    using Cfg = SwapAbFp8Config<NT>;
    extern __shared__ unsigned char sf_smem[];
    const int j = sf_active_index();
    const int slot = decode_block_slot<FMT_FP8>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return pdl_leave_early();
    const int h0 = blockIdx.x * SF_ROWS;
    if (h0 >= H) return pdl_leave_early();
    const SfRing<NT> ring = sf_ring<NT>(sf_smem);
    const bool sh = slot == shared_slot;
    SfWork w;
    w.map0 = w.map1 = maps + SF_MAP_BYTES * (sh ? SF_MAP_SHARED_DOWN : SF_MAP_DOWN);
    w.row0 = (sh ? 0 : slot * H) + h0, w.row1 = w.row0 + 64;
    w.start = active_start[j], w.len = active_len[j];
    w.K = inter[slot], w.KT = (w.K + SF_BK - 1) / SF_BK;
    // rows h0 .. h0 + 127 are one weight scale block: both tiles take its scales
    w.wscale0 = w.wscale1 = reinterpret_cast<const float*>(down_scale_ptrs[slot]) + (size_t)(h0 >> 7) * w.KT;
    w.codes = qact, w.pitch = I_max;
    w.tscale = sact, w.tscale_pitch = (I_max + SF_BK - 1) / SF_BK;
    if (threadIdx.x >= 128) {
        const int T = (w.len + NT - 1) / NT * w.KT;
        if ((threadIdx.x & 31) == 0)
            for (int g = 0; g < min(Cfg::STAGES, T); ++g) sf_copy_weights(ring, w, g, g % w.KT);  // the first steps
        pdl_wait_then_release_next();  // gate/up's activation codes from here on
        const int start = w.start;
        sf_producer<NT>(ring, w, [&](int t) { return start + t; }, true);
        return;
    }
    pdl_wait_then_release_next();
    const float gsd = down_gscale[slot];
    const float* bd = reinterpret_cast<const float*>(down_bias_ptrs[slot]);
#pragma unroll 1
    for (int p = 0, r0 = 0; r0 < w.len; ++p, r0 += NT) {
        float c[2][NT / 2];  // hidden columns h0 + 0..63, h0 + 64..127
        sf_consume_pass<NT>(ring, p * w.KT, w.KT, c);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < NT / 2; ++i) {
                const SfFrag f(i);
                const int h = h0 + 64 * m + f.row, t = r0 + f.tok;
                if (h < H && t < w.len)
                    store_down_value(c[m][i] * gsd + (bd ? bd[h] : 0.0f), w.start + t, h, sorted_pair, topk_w, y, acc,
                                     H, k, P, atomic);
            }
    }
}
