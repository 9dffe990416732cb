// W4A16 decode on Hopper's tensor cores (sm_90a) for fp4 experts (nvfp4, mxfp4): the
// weights' codes staged through shared memory by a cp.async ring, turned into bf16 in
// registers and multiplied by wgmma (A from registers) against the few rows of an expert
// (bf16, the B operand, from shared memory), with the GEMM's roles swapped as in
// decode_wgmma_a8.cu (the weights are the M side).
//
//   decode_wgmma_gate_up_fp4<FMT, NTOK>  act[pos, col] = act(x W_gate^T, x W_up^T) for 64
//                       columns a block (its 128 weight rows: 64 gate rows, then the same 64
//                       up rows), the expert's run NTOK rows a pass
//   decode_wgmma_down_fp4<FMT, NTOK>     y[pos, h] = act[pos] . W_down[h] (or, atomic, w * y
//                       added into acc[row, h]) for 128 hidden columns a block
//
// Why: decode_mma.cu's fp4 kernels read the codes from HBM straight into registers, a warp
// one k128 step ahead, and stall on issuing their dequantization. Here the ring keeps
// WF_STAGES - 1 stages of codes in flight whatever the registers, a warp's loads of its
// codes are shared-memory loads, and the B operand is read by the tensor cores, so the K
// loop is the dequantization (quant.cuh fp4x8_to_bf16_pairs) and one wgmma a word. It is
// still bound by issue and the half-rate integer pipe; the per-stage barrier and the blocks
// an SM (shared memory) set the pace, which is why two warpgroups a block, finer or deeper
// rings, overlapped wgmma groups, a persistent walk and small bulk copies were slower.
//
// K order: as decode_mma.cu's. Lane (g, t4) of warp w dequantizes, per k128 step, the 16
// bytes of weight rows 16 w + g and 16 w + g + 8 of each tile holding codes 32 t4 .. + 31;
// word j of them (codes 8 j .. + 7) becomes the pairs (i, i + 4), which are the A fragment
// of k16 wgmma 2 j (pairs (0, 4), (1, 5) at K slots (2 t4, 2 t4 + 1), (2 t4 + 8, 2 t4 + 9))
// and 2 j + 1 (pairs (2, 6), (3, 7)). The B tiles hold the rows' activations in that order:
// whoever stages a row's 8 values 32 t4 + 8 j .. + 7 stores them as those four pairs.
//
// Scales: as decode_mma.cu's, each pair is multiplied by its group's scale times 2^62 in
// bf16 (exact), the weight times 2^-64 going into the tensor cores; the epilogue multiplies
// by 2^64 and nvfp4's global scale. The layer takes these kernels where every K they read
// (H, and each fp4 expert's I) is a multiple of 128: a k step is whole or past K.
#include "decode_common.cuh"
#include "gemm_common.cuh"
#include "quant.cuh"
#include "wgmma.cuh"

#define WF_ROWS 128     // weight rows a block: two m64 tiles
#define WF_BK 128       // codes of a k step: 64 bytes of a weight row, 32 codes a lane
#define WF_KSUB 2       // k steps a stage: 128 contiguous bytes of each weight row a copy
#define WF_STAGES 3     // 2 stages (32 KB of codes) in flight a block
#define WF_THREADS 128  // one warpgroup: it copies, dequantizes, multiplies and stores
// blocks an SM the registers are capped for (catalog.wgmma_fp4_decode_smem_bytes: 3 fit
// with passes of 8 rows, 2 with 16)
#define WF_MIN_BLOCKS(NTOK) ((NTOK) <= 8 ? 3 : 2)

// A stage: the pass's rows (WF_KSUB k steps, each two 128-byte swizzled [NTOK][64] bf16
// tiles: wgmma_desc), the weight rows' codes (WF_KSUB k steps of [128 rows][64 bytes]) and
// their scale bytes ([128 rows][the stage's groups]).
template <int FMT>
__host__ __device__ constexpr int wf_scale_bytes() { return WF_BK * WF_KSUB / (FMT == FMT_NVFP4 ? 16 : 32); }
template <int NTOK>
__host__ __device__ constexpr int wf_rows_bytes() { return WF_KSUB * NTOK * WF_BK * 2; }
__host__ __device__ constexpr int wf_codes_bytes() { return WF_KSUB * WF_ROWS * WF_BK / 2; }
template <int FMT, int NTOK>
__host__ __device__ constexpr int wf_stage_bytes() {
    return wf_rows_bytes<NTOK>() + wf_codes_bytes() + WF_ROWS * wf_scale_bytes<FMT>();
}
// every stage's B tiles start a 1024-byte swizzle atom (the ring itself is aligned so)
static_assert(wf_stage_bytes<FMT_NVFP4, 8>() % 1024 == 0 && wf_stage_bytes<FMT_MXFP4, 8>() % 1024 == 0 &&
                  wf_stage_bytes<FMT_NVFP4, 16>() % 1024 == 0 && wf_stage_bytes<FMT_MXFP4, 16>() % 1024 == 0,
              "a stage's size keeps the next stage's B tiles on a swizzle atom");

// d[N / 2] (m64 x nN, fp32) += A (64 x 16, bf16, this thread's fragment a) * B (16 x N, bf16,
// K-major in shared memory).
template <int N>
__device__ __forceinline__ void wgmma_m64k16_bf16_rs(float* d, const unsigned (&a)[4], u64 db);

template <>
__device__ __forceinline__ void wgmma_m64k16_bf16_rs<8>(float* d, const unsigned (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_m64k16_bf16_rs<16>(float* d, const unsigned (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// The bf16x2 multipliers of a lane's 32 codes of a k step (decode_mma.cu Fp4Row32::word's
// values): its group scales times 2^62, from its scale bytes `s` (nvfp4: two, groups 2 t4
// and 2 t4 + 1, as one pair; mxfp4: one). scale2(j) multiplies word j (codes 8 j .. + 7).
template <int FMT>
struct WfScales {
    __nv_bfloat162 s2;
    __device__ __forceinline__ explicit WfScales(unsigned s) {
        const unsigned b = FMT == FMT_NVFP4 ? e4m3x2_to_bf16x2_times_2p62(s) : e8m0_to_bf16x2_times_2p62(s);
        s2 = *reinterpret_cast<const __nv_bfloat162*>(&b);
    }
    __device__ __forceinline__ __nv_bfloat162 scale2(int j) const {
        if (FMT == FMT_MXFP4) return s2;
        return j < 2 ? __low2bfloat162(s2) : __high2bfloat162(s2);
    }
};

// Everything a block needs besides the stages' bytes: where its weight rows' codes and
// scales and its pass's rows come from, and which chunks of them this thread copies.
template <int FMT, int NTOK, bool TILED = false>
struct WfBlock {
    static constexpr int CHUNKS = WF_KSUB * WF_BK / 2 / 16;  // 16-byte code chunks a row and stage: 8
    static constexpr int A_ROWS = WF_THREADS / CHUNKS;       // rows a round of code copies covers
    static constexpr int A_PER = WF_ROWS / A_ROWS;           // a thread's weight rows (codes)
    static constexpr int SB = wf_scale_bytes<FMT>();         // scale bytes a row and stage: 16 / 8
    static constexpr int SCH = SB / 4;                       // 4-byte scale chunks a row and stage
    static constexpr int S_ROWS = WF_THREADS / SCH;
    static constexpr int S_PER = WF_ROWS / S_ROWS;           // a thread's weight rows (scales)
    static constexpr int XCH = WF_KSUB * WF_BK / 8;           // 16-byte chunks of a pass row a stage: 32
    static constexpr int X_ROWS = WF_THREADS / XCH;
    static constexpr int X_PER = NTOK / X_ROWS;               // a thread's pass rows
    static_assert(NTOK % X_ROWS == 0, "whole rows a round of activation copies");
    static_assert(A_ROWS * A_PER / 2 == 64 && S_ROWS * S_PER / 2 == 64,
                  "a thread's first half of rows lies in weight rows 0-63, its second in 64-127");
    // this thread's code chunk (stage 0) of its first row in weight rows 0-63 and 64-127;
    // its next rows of each half lie a_step bytes apart (gate/up's halves are two matrices)
    const u8* a_src[2];
    const u8* s_src[2];      // and its scale chunk, s_step apart
    size_t a_step, s_step;
    const u8* row_scales;    // weight row tid's scale bytes (whole_stages)
    const bf16* x_src[X_PER];  // null past the run
    int K, KT, KS;             // K, its k steps, its stages (of one tile)
    // TILED: weight tiles a block takes one after another in one run of its ring (down where
    // K is a few stages), each WF_ROWS rows of K codes on from the one before (tile_a_bytes,
    // tile_s_bytes); stage s of the run is stage s % KS of tile s / KS
    int tiles = 1;
    __device__ __forceinline__ int run_stages() const { return TILED ? KS * tiles : KS; }
    __device__ __forceinline__ size_t tile_a_bytes(int tile) const { return (size_t)tile * WF_ROWS * (K / 2); }
    __device__ __forceinline__ size_t tile_s_bytes(int tile) const {
        return (size_t)tile * WF_ROWS * (K / (FMT == FMT_NVFP4 ? 16 : 32));
    }
    bool whole_stages;         // K a multiple of a stage's WF_KSUB * WF_BK codes
    u8* stages;

    __device__ __forceinline__ int a_row(int i) const { return threadIdx.x / CHUNKS + A_ROWS * i; }
    __device__ __forceinline__ int s_row(int i) const { return threadIdx.x / SCH + S_ROWS * i; }
    __device__ __forceinline__ int x_row(int i) const { return threadIdx.x / XCH + X_ROWS * i; }
    __device__ __forceinline__ u8* stage(int s) const { return stages + (s % WF_STAGES) * wf_stage_bytes<FMT, NTOK>(); }
    __device__ __forceinline__ static u8* rows_of(u8* st, int sub) { return st + sub * NTOK * WF_BK * 2; }
    __device__ __forceinline__ static u8* codes_of(u8* st, int sub) {
        return st + wf_rows_bytes<NTOK>() + sub * WF_ROWS * WF_BK / 2;
    }
    __device__ __forceinline__ static u8* scales_of(u8* st) { return st + wf_rows_bytes<NTOK>() + wf_codes_bytes(); }

    // Weight row r (0..127) of the block reads codes and scale bytes from `row_of(r, codes)`
    // (its row's starts; the layer runs these kernels where every row of a block lies in
    // its matrix: I a multiple of 64, H of 128). This thread's chunks: code chunk c of its
    // rows, scale chunk sc of theirs.
    template <class RowOf>
    __device__ __forceinline__ void set_weights(RowOf row_of) {
        const int c = threadIdx.x % CHUNKS, sc = threadIdx.x % SCH;
        a_src[0] = row_of(a_row(0), true) + c * 16;
        a_src[1] = row_of(a_row(0) + 64, true) + c * 16;
        a_step = row_of(a_row(1), true) - row_of(a_row(0), true);
        s_src[0] = row_of(s_row(0), false) + sc * 4;
        s_src[1] = row_of(s_row(0) + 64, false) + sc * 4;
        s_step = row_of(s_row(1), false) - row_of(s_row(0), false);
        row_scales = row_of(threadIdx.x, false);
        // with whole stages every row's stage of scale bytes lies a multiple of SB bytes
        // from its matrix's first row of the block (gate/up: rows 0 and 64), which must be
        // SB-aligned too (a caller's scale array may start anywhere)
        whole_stages = whole_stages && (reinterpret_cast<size_t>(row_of(0, false)) % SB) == 0 &&
                       (reinterpret_cast<size_t>(row_of(64, false)) % SB) == 0;
    }

    // The stage's codes and scale bytes (k steps past K arrive as zeros, nothing read).
    // Where they land: this thread's first row's chunk, the others A_ROWS (S_ROWS) rows on.
    // Stage run_s of the run: stage s of weight tile `tile` (TILED, else tile 0 and s = run_s).
    __device__ __forceinline__ void copy_weights(int run_s, int tile = 0, int s_of_tile = -1) const {
        u8* st = stage(run_s);
        const int s = TILED ? s_of_tile : run_s;
        const int c = threadIdx.x % CHUNKS, sub = c / (CHUNKS / WF_KSUB);
        const bool kin = (s * WF_KSUB + sub) * WF_BK < K;
        u8* dst = codes_of(st, sub) + a_row(0) * (WF_BK / 2) + (c % (CHUNKS / WF_KSUB)) * 16;
        const int off = kin ? s * (WF_KSUB * WF_BK / 2) : 0;
        const size_t toff = TILED && kin ? tile_a_bytes(tile) : 0;
#pragma unroll
        for (int i = 0; i < A_PER; ++i)
            cp_async16(dst + i * A_ROWS * (WF_BK / 2), a_src[i / (A_PER / 2)] + (i % (A_PER / 2)) * a_step + off + toff,
                       kin);
        // Scale bytes. K in whole stages: a row's stage of them is one aligned SB-byte chunk,
        // one copy a thread (row tid). Why: as SB / 4 four-byte copies a row (512 a stage
        // for nvfp4) they cost a large share of the copies' issue for 1/9 of the bytes.
        // Else (K an odd number of k steps) four-byte chunks, zeros past K.
        static_assert(SB == 16 || SB == 8, "a row's stage of scale bytes: one 16- or 8-byte copy");
        if (whole_stages) {
            if (SB == 16)
                cp_async16(scales_of(st) + threadIdx.x * SB, row_scales + s * SB + (TILED ? tile_s_bytes(tile) : 0), true);
            else
                cp_async8(scales_of(st) + threadIdx.x * SB, row_scales + s * SB + (TILED ? tile_s_bytes(tile) : 0));
            return;
        }
        const int sc = threadIdx.x % SCH, ssub = sc / (SCH / WF_KSUB);
        const bool skin = (s * WF_KSUB + ssub) * WF_BK < K;
        u8* sdst = scales_of(st) + s_row(0) * SB + sc * 4;
        const int soff = skin ? s * SB : 0;
        const size_t tsoff = TILED && skin ? tile_s_bytes(tile) : 0;
#pragma unroll
        for (int i = 0; i < S_PER; ++i)
            cp_async4(sdst + i * S_ROWS * SB, s_src[i / (S_PER / 2)] + (i % (S_PER / 2)) * s_step + soff + tsoff, skin);
    }

    // The pass's rows' chunks of stage s: loaded into registers (zeros past K or the run) ...
    // (s: the stage of its tile; every tile multiplies the same rows)
    __device__ __forceinline__ void load_rows(int s, uint4 (&v)[X_PER]) const {
        const int c = threadIdx.x % XCH, sub = c / (XCH / WF_KSUB);
        const bool kin = (s * WF_KSUB + sub) * WF_BK < K;
#pragma unroll
        for (int i = 0; i < X_PER; ++i)
            v[i] = x_src[i] && kin ? __ldg(reinterpret_cast<const uint4*>(x_src[i] + s * WF_KSUB * WF_BK) + c)
                                   : make_uint4(0, 0, 0, 0);
    }

    // ... and stored into its B tiles as the K order pairs them: values 32 t4 + 8 j .. + 7
    // of a k step become the pairs (i, i + 4) at K slots 2 t4 (+ 8) of wgmmas 2 j, 2 j + 1.
    __device__ __forceinline__ void store_rows(int s, const uint4 (&v)[X_PER]) const {
        u8* st = stage(s);
        const int c = threadIdx.x % XCH, sub = c / (XCH / WF_KSUB), c16 = c % (XCH / WF_KSUB);
        const int e0 = 32 * (c16 & 3) + 2 * (c16 >> 2);  // element of pair (0, 4) in the k step's row
        u8* tiles = rows_of(st, sub);
#pragma unroll
        for (int i = 0; i < X_PER; ++i) {
            const int r = x_row(i);
            const unsigned p[4] = {__byte_perm(v[i].x, v[i].z, 0x5410), __byte_perm(v[i].x, v[i].z, 0x7632),
                                   __byte_perm(v[i].y, v[i].w, 0x5410), __byte_perm(v[i].y, v[i].w, 0x7632)};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int e = e0 + 8 * q, b = 2 * (e & 63);
                *reinterpret_cast<unsigned*>(tiles + (e >> 6) * NTOK * 128 + swz128(r, b >> 4) + (b & 15)) = p[q];
            }
        }
    }

    // The weight stages' copies ahead of a first pass that takes `weights_ahead`, as one
    // group (down: issued before the block waits for gate/up).
    __device__ __forceinline__ void copy_weights_ahead() const {
#pragma unroll
        for (int s = 0; s < WF_STAGES - 1; ++s)
            if (s < run_stages()) copy_weights(s, s / KS, s % KS);
        cp_async_commit();
    }

    // One k step's wgmmas of both tiles from stage st: dequantize this thread's fragments
    // (rows 16 w + g, + 8 of each tile, codes 32 t4 .. + 31), then 8 k16 wgmmas a tile.
    __device__ __forceinline__ void step(float (&acc)[2][NTOK / 2], u8* st, int sub) const {
        const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
        unsigned a[2][8][4];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const int r = 64 * m + 16 * warp + g;
            const u8* codes = codes_of(st, sub);
            const uint4 lo = *reinterpret_cast<const uint4*>(codes + r * (WF_BK / 2) + 16 * t4);
            const uint4 hi = *reinterpret_cast<const uint4*>(codes + (r + 8) * (WF_BK / 2) + 16 * t4);
            const u8* sc = scales_of(st) + sub * (SB / WF_KSUB);
            unsigned slo, shi;
            if (FMT == FMT_NVFP4) {
                slo = *reinterpret_cast<const unsigned short*>(sc + r * SB + 2 * t4);
                shi = *reinterpret_cast<const unsigned short*>(sc + (r + 8) * SB + 2 * t4);
            } else {
                slo = sc[r * SB + t4];
                shi = sc[(r + 8) * SB + t4];
            }
            const unsigned wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
            const WfScales<FMT> sl(slo), sh(shi);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 pa = fp4x8_to_bf16_pairs(wl[j], sl.scale2(j));
                const uint4 pb = fp4x8_to_bf16_pairs(wh[j], sh.scale2(j));
                a[m][2 * j][0] = pa.x;
                a[m][2 * j][1] = pb.x;
                a[m][2 * j][2] = pa.y;
                a[m][2 * j][3] = pb.y;
                a[m][2 * j + 1][0] = pa.z;
                a[m][2 * j + 1][1] = pb.z;
                a[m][2 * j + 1][2] = pa.w;
                a[m][2 * j + 1][3] = pb.w;
            }
        }
        const u8* rows = rows_of(st, sub);
        fence_acc<NTOK / 2>(acc[0]);
        fence_acc<NTOK / 2>(acc[1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const u64 db = wgmma_desc(rows + (kk >> 2) * NTOK * 128) + 2 * (kk & 3);  // +32 bytes a k16
            wgmma_m64k16_bf16_rs<NTOK>(acc[0], a[0][kk], db);
            wgmma_m64k16_bf16_rs<NTOK>(acc[1], a[1][kk], db);
        }
        wgmma_commit();
        wgmma_wait<0>();  // the fragments' registers are rewritten by the next step
        fence_acc<NTOK / 2>(acc[0]);
        fence_acc<NTOK / 2>(acc[1]);
    }

    // One pass: acc[m] (tile m's m64 x NTOK sums, fp32) over all of K, for the rows set in
    // x_src. Stage s's codes are copied WF_STAGES - 1 stages ahead (cp.async); its rows are
    // loaded into registers one iteration ahead of being stored, so their latency hides
    // behind a stage's work. `weights_ahead`: copy_weights_ahead issued the first stages'
    // codes (an older group, so every wait below that covers a stage covers them too).
    // With several tiles the run goes through them one after another, calling
    // tile_done(tile, acc) as each one's sums are whole (then zeroed for the next; the last
    // tile's stay in acc).
    template <class TileDone>
    __device__ __forceinline__ void pass(float (&acc)[2][NTOK / 2], bool weights_ahead, TileDone tile_done) const {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < NTOK / 2; ++i) acc[m][i] = 0.0f;
        const int RS = run_stages();
        // the first stages' rows: every load out before the first store waits for one, so
        // the prologue is one L2 round trip, not one a stage (much of a short K's block)
        uint4 first[WF_STAGES - 1][X_PER];
#pragma unroll
        for (int s = 0; s < WF_STAGES - 1; ++s) {
            if (s < RS) {
                if (!weights_ahead) copy_weights(s, s / KS, s % KS);
                load_rows(TILED ? s % KS : s, first[s]);
            }
            cp_async_commit();
        }
#pragma unroll
        for (int s = 0; s < WF_STAGES - 1; ++s)
            if (s < RS) store_rows(s, first[s]);
        TileRun run(KS, tiles);  // TILED: where the run is
        if (TILED) run.start(WF_STAGES - 1);
#pragma unroll 1
        for (int s = 0; s < RS; ++s) {
            cp_async_wait<WF_STAGES - 2>();  // this thread's copies of stage s have landed
            fence_proxy_async();             // its stores of the stage's rows: visible to the tensor cores
            __syncthreads();                 // everyone's; the stage of s - 1 is free
            const int ahead = s + WF_STAGES - 1;
            uint4 v[X_PER];
            if (ahead < RS) {
                copy_weights(ahead, run.at, run.ats);
                load_rows(TILED ? run.ats : ahead, v);
            }
            cp_async_commit();
            u8* st = stage(s);
            const int k0 = (TILED ? run.ts : s) * WF_KSUB;
#pragma unroll
            for (int sub = 0; sub < WF_KSUB; ++sub)
                if (k0 + sub < KT) step(acc, st, sub);
            if (ahead < RS) store_rows(ahead, v);
            if (TILED) run.step(acc, tile_done);
        }
        cp_async_wait<0>();
        __syncthreads();  // the stages are free for the next pass
    }
};

template <int FMT, int NTOK, bool TILED = false>
__device__ __forceinline__ WfBlock<FMT, NTOK, TILED> wf_block(unsigned char* smem, int K) {
    WfBlock<FMT, NTOK, TILED> b;
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(smem) & 1023u)) & 1023u;
    b.stages = smem + pad;
    b.K = K;
    b.KT = K / WF_BK;
    b.KS = (b.KT + WF_KSUB - 1) / WF_KSUB;
    b.whole_stages = K % (WF_KSUB * WF_BK) == 0;
    return b;
}

// Scale bytes of a weight row: nvfp4 one a 16-code group, mxfp4 one a 32-code group.
template <int FMT>
__device__ __forceinline__ size_t wf_scale_row_bytes(int K) { return (size_t)K / (FMT == FMT_NVFP4 ? 16 : 32); }

// grid (ceil(I_max / 64), max_active), block WF_THREADS, dynamic shared memory
// kernels.wgmma_fp4_decode_smem_bytes(FMT, NTOK). Arguments: DECODE_GATE_UP_ARGS (decode_mma_gate_up's).
template <int FMT, int NTOK>
__global__ void __launch_bounds__(WF_THREADS, WF_MIN_BLOCKS(NTOK)) decode_wgmma_gate_up_fp4(DECODE_GATE_UP_ARGS) {
    extern __shared__ unsigned char wf_smem[];
    pdl_wait_then_release_next();
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    const int I = inter[slot], c0 = blockIdx.x * 64;
    if (c0 >= I) return;
    WfBlock<FMT, NTOK> b = wf_block<FMT, NTOK>(wf_smem, H);
    const u8* gate = reinterpret_cast<const u8*>(gate_ptrs[slot]);
    const u8* up = reinterpret_cast<const u8*>(up_ptrs[slot]);
    const u8* gate_s = reinterpret_cast<const u8*>(gate_scale_ptrs[slot]);
    const u8* up_s = reinterpret_cast<const u8*>(up_scale_ptrs[slot]);
    b.set_weights([&](int r, bool codes) {  // rows 0-63: gate columns c0 + r, 64-127: up's
        const size_t col = c0 + (r & 63);
        return codes ? (r < 64 ? gate : up) + col * (H / 2) : (r < 64 ? gate_s : up_s) + col * wf_scale_row_bytes<FMT>(H);
    });
    const bf16* in = slot == shared_slot ? x : xe;  // the shared expert reads x
    const float gsg = gate_gscale[slot] * FP4_PAIRS_UNSCALE, gsu = up_gscale[slot] * FP4_PAIRS_UNSCALE;
    const float* bg = reinterpret_cast<const float*>(gate_bias_ptrs[slot]);
    const float* bu = reinterpret_cast<const float*>(up_bias_ptrs[slot]);
    const int start = active_start[j], len = active_len[j];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;

    for (int r0 = 0; r0 < len; r0 += NTOK) {
#pragma unroll
        for (int i = 0; i < b.X_PER; ++i) {
            const int t = r0 + b.x_row(i);
            b.x_src[i] = t < len ? in + (size_t)sorted_row[start + t] * H : nullptr;
        }
        float acc[2][NTOK / 2];  // gate, up
        b.pass(acc, false, [](int, float (&)[2][NTOK / 2]) {});  // one tile
#pragma unroll
        for (int i = 0; i < NTOK / 2; ++i) {  // element (j, h, e) = 4 j + 2 h + e
            const int col = c0 + 16 * warp + g + 8 * ((i >> 1) & 1), t = r0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
            if (t < len) {  // col < I: I is a multiple of 64
                const float gv = acc[0][i] * gsg + (bg ? bg[col] : 0.0f);
                const float uv = acc[1][i] * gsu + (bu ? bu[col] : 0.0f);
                store_gate_up(act, (size_t)(start + t), col, I_max, act_code, gv, uv, alpha, limit);
            }
        }
    }
}

// grid (H / (128 T), max_active), block WF_THREADS, dynamic shared memory
// kernels.wgmma_fp4_decode_smem_bytes(FMT, NTOK). A block takes T = H / (128 gridDim.x)
// tiles of 128 hidden columns (T > 1: the layer's grid where I is a few stages, so that a
// block's ring runs on from one tile into the next). Arguments: DECODE_DOWN_ARGS; outputs as
// decode_mma_down's: y[pos, h], or with `atomic` the routed pairs' w * y added into
// acc[row, h] (the shared expert still stores y). Before its wait for gate/up (PDL) a block
// reads its run from the lists (made before gate/up, whose blocks passed their own wait for
// them before this grid could launch) and copies its first stages' codes and scales.
template <int FMT, int NTOK>
__global__ void __launch_bounds__(WF_THREADS, WF_MIN_BLOCKS(NTOK)) decode_wgmma_down_fp4(DECODE_DOWN_ARGS) {
    extern __shared__ unsigned char wf_smem[];
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return pdl_leave_early();
    const int tiles = max(1, H / (WF_ROWS * (int)gridDim.x)), h0 = blockIdx.x * WF_ROWS * tiles;
    if (h0 >= H) return pdl_leave_early();
    const int I = inter[slot];
    WfBlock<FMT, NTOK, true> b = wf_block<FMT, NTOK, true>(wf_smem, I);
    b.tiles = tiles;
    const u8* down = reinterpret_cast<const u8*>(down_ptrs[slot]);
    const u8* down_s = reinterpret_cast<const u8*>(down_scale_ptrs[slot]);
    b.set_weights([&](int r, bool codes) {
        const size_t h = h0 + r;
        return codes ? down + h * (I / 2) : down_s + h * wf_scale_row_bytes<FMT>(I);
    });
    const float gsd = down_gscale[slot] * FP4_PAIRS_UNSCALE;
    const float* bd = reinterpret_cast<const float*>(down_bias_ptrs[slot]);
    const int start = active_start[j], len = active_len[j];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
    b.copy_weights_ahead();
    pdl_wait_then_release_next();  // gate/up's activation from here on

    for (int r0 = 0; r0 < len; r0 += NTOK) {
#pragma unroll
        for (int i = 0; i < b.X_PER; ++i) {
            const int t = r0 + b.x_row(i);
            b.x_src[i] = t < len ? act + (size_t)(start + t) * I_max : nullptr;
        }
        const auto store = [&](int tile, float (&c)[2][NTOK / 2]) {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int i = 0; i < NTOK / 2; ++i) {
                    const int h = h0 + WF_ROWS * tile + 64 * m + 16 * warp + g + 8 * ((i >> 1) & 1);
                    const int t = r0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
                    if (t < len)  // h < H: H is a multiple of 128 T
                        store_down_value(c[m][i] * gsd + (bd ? bd[h] : 0.0f), start + t, h, sorted_pair, topk_w, y,
                                         acc, H, k, P, atomic);
                }
        };
        float c[2][NTOK / 2];  // hidden columns h0 + 128 tile + 0..63, + 64..127
        b.pass(c, r0 == 0, store);
        store(tiles - 1, c);
    }
}
