// Decode path for fp4 experts (nvfp4, mxfp4) and fp8-block ones on tensor cores: W4A16 and
// W8A16 with the GEMM's roles swapped (and, sm_89+, fp8 as W8A8: the _a8 kernels at the
// end of the file). The weights are the MMA's A operand (16 output
// columns x 16 k), loaded from HBM straight into registers and dequantized there; an
// expert's few rows are its B operand
// (8 tokens a fragment). The CUDA-core readers of decode.cu spend an FMA per weight and
// row besides the dequantization; here the MMA does the products and a weight costs its
// bit placement and a scale multiply (quant.cuh fp4x8_to_bf16_pairs).
//
//   decode_mma_gate_up<FMT, KS, NT>  act[pos, col] = act(x W_gate^T, x W_up^T) for 16 columns
//                       a warp-column group (gate and up rows side by side), the rows of an
//                       expert's run 8 NT at a time (each pass streams the weights once)
//   decode_mma_down<FMT, KS, NT>     y[pos, h] = act[pos] . W_down[h] (or, atomic, w * y added into
//                       acc[row, h]) for 16 hidden columns a warp-column group
//   decode_mma_gate_up_a8<KS, NT>, decode_mma_down_a8<KS, NT>  the same for fp8-block weights
//                       as w8a8, on the inputs' e4m3 codes (gate/up also quantizes the
//                       activation it writes)
// KS warps of a block split K (k128 steps dealt round-robin) and add their partial sums
// through shared memory in warp order, so the result is the same for every launch;
// DECODE_WARPS / KS column groups share the block. Few active experts want a large KS
// (enough blocks in flight), many want KS = 1.
//
// No repacking of rows: the checkpoint's [out, K / 2] layout (only each 32-bit word's
// bits repacked at load, quant.cuh) becomes a fragment layout by permuting k, identically
// on both operands (a dot product does not care in which order its terms are summed by the
// tensor core's K slots). Lane (g = lane / 4, t4 = lane % 4) reads, per
// k128 step at k0, the 16 bytes of weight rows g and g + 8 holding codes k0 + 32 t4 .. + 31
// (a warp's weight loads are 64 contiguous bytes a row). Word w of them (codes 8 w .. + 7)
// feeds MMAs 2 w and 2 w + 1: the dequantization pairs code i with code i + 4
// (quant.cuh fp4x8_to_bf16_pairs), so MMA 2 w takes codes (0, 4) and (1, 5) as its K slots
// (2 t4, 2 t4 + 1) and (2 t4 + 8, 2 t4 + 9), MMA 2 w + 1 codes (2, 6) and (3, 7); the B
// fragment pairs token g's activations the same way (one byte permute a register).
//
// Scales: the pairs come out as code * 2^-126; they are multiplied by scale * 2^62 (exact:
// e4m3 or e8m0 times a power of two, a 2-bit mantissa times a 4-bit one), giving the exact
// weight times 2^-64, a normal bf16 for every nvfp4 scale and for mxfp4 scales 2^-61 ..
// 2^65 (the layer runs other mxfp4 weights on decode.cu's readers:
// FP4_MMA_MXFP4_SCALE_BYTES); the epilogue multiplies by 2^64.
//
// fp8-block (Fp8Row32, fp8_step): a lane reads 32 codes of rows g and g + 8 a k128 step
// (two 16-byte loads a row), turned into bf16 pairs exactly (every e4m3 value is a bf16
// one); MMA j takes codes 4 j .. 4 j + 3 in its K slots and the B fragment the token's
// activations 4 j .. 4 j + 3 in their natural order. The step lies in one 128 x 128 scale
// block, so its fp32 sums are multiplied by the block's scale once. Against decode.cu's
// readers (one FMA per weight and row) the products move to the tensor cores: the same
// conversion cost at one row, eight or sixteen rows for it from 8 on.
#include "common.cuh"
#include "decode_common.cuh"
#include "gemm_common.cuh"
#include "decode_a8.cuh"

#define FP4_KSTEP 128  // k per step: 32 codes a lane

// 32 codes of one weight row at k (a multiple of 32) and their scale bytes: nvfp4 two groups
// of 16 (two e4m3 bytes), mxfp4 one group of 32 (one e8m0 byte). Past K: zeros (code 0 is
// +0 under any scale, and the activations there are zeros too).
template <int FMT>
struct Fp4Row32 {
    uint4 q;
    unsigned s;

    __device__ __forceinline__ void load(const QRow& r, int k, bool ok) {
        q = make_uint4(0, 0, 0, 0);
        s = 0;
        if (ok) {
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                         : "l"(r.w + (k >> 1)));
            s = FMT == FMT_NVFP4 ? (unsigned)__ldg(reinterpret_cast<const unsigned short*>(r.s + (k >> 4)))
                                 : (unsigned)__ldg(r.s + (k >> 5));
        }
    }

    // nvfp4's two group scales (k / 16, k / 16 + 1) times 2^62 as one bf16 pair, one e4m3x2
    // conversion a row and k step, not one a word (a shorter K loop). mxfp4 converts its one
    // byte where it is used (one integer operation; a pair made ahead made its loop longer).
    __device__ __forceinline__ unsigned scale_pair() const {
        return FMT == FMT_NVFP4 ? e4m3x2_to_bf16x2_times_2p62(s) : 0u;
    }

    // codes 8 w .. 8 w + 7 as the pairs (i, i + 4), each code times its group scale times
    // 2^-64 (exact; the file's comment); `sp`: scale_pair()
    __device__ __forceinline__ uint4 word(int w, unsigned sp) const {
        const unsigned v = w == 0 ? q.x : w == 1 ? q.y : w == 2 ? q.z : q.w;
        if (FMT == FMT_NVFP4) {  // words 0, 1: the first group's scale; 2, 3: the second's
            const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&sp);
            return fp4x8_to_bf16_pairs(v, w < 2 ? __low2bfloat162(s2) : __high2bfloat162(s2));
        }
        const unsigned short b = (unsigned short)e8m0_to_bf16x2_times_2p62(s);  // the scale in both halves
        return fp4x8_to_bf16_pairs(v, __halves2bfloat162(__ushort_as_bfloat16(b), __ushort_as_bfloat16(b)));
    }
};

// The 8 MMAs of one k128 step for one 16-row weight fragment (rows g and g + 8: lo, hi)
// against NT 8-token B fragments (xv[t]: token 8 t + g's 32 activations at the lane's k),
// each weight dequantized once for all of them. c[4 t ..]: token tile t's accumulators.
template <int FMT, int NT>
__device__ __forceinline__ void mma_fp4_step(float* c, const Fp4Row32<FMT>& lo, const Fp4Row32<FMT>& hi,
                                             const uint4 (&xv)[NT][4]) {
    const unsigned slo = lo.scale_pair(), shi = hi.scale_pair();
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const uint4 a = lo.word(w, slo), b = hi.word(w, shi);
        const unsigned f0[4] = {a.x, b.x, a.y, b.y};  // codes 0-3 of the word: MMA 2 w
        const unsigned f1[4] = {a.z, b.z, a.w, b.w};  // codes 4-7: MMA 2 w + 1
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            mma_bf16(c + 4 * t, f0, xv[t][w].x, xv[t][w].y);
            mma_bf16(c + 4 * t, f1, xv[t][w].z, xv[t][w].w);
        }
    }
}

// Word i (codes 4 i .. 4 i + 3) of a lane's 32 byte codes held as two uint4.
__device__ __forceinline__ unsigned word_of(const uint4 (&q)[2], int i) {
    const uint4& h = q[i >> 2];
    return (i & 3) == 0 ? h.x : (i & 3) == 1 ? h.y : (i & 3) == 2 ? h.z : h.w;
}

// fp8-block weights (w8a16): 32 e4m3 codes of one weight row at k (a multiple of 32; the
// row's K a multiple of 16, kernels.FORMAT_K_MULTIPLE, so past K whole 16-code halves read
// as zeros) and the fp32 scale of its 128 x 128 block. A k128 step lies in one scale block,
// so the scale multiplies the step's fp32 sums (fp8_step), as decode.cu's readers apply it
// to their 8-code dot products.
struct Fp8Row32 {
    uint4 q[2];
    float s;

    __device__ __forceinline__ void load(const QRow& r, int k, int K) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            q[h] = make_uint4(0, 0, 0, 0);
            if (k + 16 * h < K)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(q[h].x), "=r"(q[h].y), "=r"(q[h].z), "=r"(q[h].w)
                             : "l"(r.w + k + 16 * h));
        }
        // the step's block scale even where this lane's codes lie past K: it multiplies the
        // step's sums, which hold every lane's codes (k >> 7 is the step's block). None for a
        // step wholly past K, which mma_pass loads one ahead and never multiplies: its block
        // lies past the row's scales (for the last 128 rows, past the matrix's scale tensor)
        s = (k & ~127) < K ? q_scale<FMT_FP8>(r.s, k) : 0.0f;
    }

    // codes 4 j .. 4 j + 3 as two bf16 pairs (exact: every e4m3 value is a bf16 value)
    __device__ __forceinline__ void pairs(int j, unsigned& p01, unsigned& p23) const {
        const unsigned v = word_of(q, j);
        const float2 a = e4m3x2_to_f32x2(v), b = e4m3x2_to_f32x2(v >> 16);
        p01 = pack_bf16x2(a.x, a.y);
        p23 = pack_bf16x2(b.x, b.y);
    }
};

// A token's 32 bf16 activations at k (zeros past K) in their natural order, as fp8_step's
// K slots take them: MMA j's pairs (4 j, 4 j + 1) and (4 j + 2, 4 j + 3) are words 2 j, 2 j + 1.
__device__ __forceinline__ void load_x32_natural(uint4 (&xv)[4], const bf16* row, int k, int K) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        xv[i] = k + 8 * i < K ? __ldg(reinterpret_cast<const uint4*>(row + k) + i) : make_uint4(0, 0, 0, 0);
}

// The 8 MMAs of one k128 step for one 16-row fp8 fragment (rows g, g + 8: lo, hi) against
// NT 8-token B fragments: lane t4's K slots (2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9) of MMA j
// hold its codes 4 j .. 4 j + 3, and the B fragment's its activations 4 j .. 4 j + 3. The
// step's sums are scaled once (both rows share a 128-row scale block) into c.
template <int NT>
__device__ __forceinline__ void fp8_step(float* c, const Fp8Row32& lo, const Fp8Row32& hi,
                                         const uint4 (&xv)[NT][4]) {
    float t[4 * NT];
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) t[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        unsigned a[4];
        lo.pairs(j, a[0], a[2]);
        hi.pairs(j, a[1], a[3]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint4& x = xv[n][j >> 1];
            const unsigned b0 = (j & 1) ? x.z : x.x, b1 = (j & 1) ? x.w : x.y;
            mma_bf16(t + 4 * n, a, b0, b1);
        }
    }
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) c[i] = fmaf(t[i], lo.s, c[i]);
}

// A token's 32 bf16 activations at k (zeros past K), each group of 8 paired as the weights
// are (i, i + 4): .x = (0, 4), .y = (1, 5), .z = (2, 6), .w = (3, 7).
__device__ __forceinline__ void load_x32(uint4 (&xv)[4], const bf16* row, int k, bool ok) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 a = ok ? __ldg(reinterpret_cast<const uint4*>(row + k) + i) : make_uint4(0, 0, 0, 0);
        xv[i] = make_uint4(__byte_perm(a.x, a.z, 0x5410), __byte_perm(a.x, a.z, 0x7632), __byte_perm(a.y, a.w, 0x5410),
                           __byte_perm(a.y, a.w, 0x7632));
    }
}

// Adds the KS warps' partial accumulators of each column group in warp order; warp ks == 0
// of a group ends with the sums. `part` holds DECODE_WARPS * 32 * N floats.
template <int KS, int N>
__device__ __forceinline__ void reduce_k_splits(float (&c)[N], float* part, int cg, int ks, int lane) {
    if (KS == 1) return;
    float* mine = part + ((cg * KS + ks) * 32 + lane) * N;
#pragma unroll
    for (int i = 0; i < N; ++i) mine[i] = c[i];
    __syncthreads();
    if (ks == 0) {
#pragma unroll
        for (int s = 1; s < KS; ++s) {
            const float* o = part + ((cg * KS + s) * 32 + lane) * N;
#pragma unroll
            for (int i = 0; i < N; ++i) c[i] += o[i];
        }
    }
    __syncthreads();
}

// The 16 weight rows a warp streams from one matrix: output columns c0 + g (lo) and c0 + g + 8
// (hi); columns past `cols` read column cols - 1 again (never stored).
template <int FMT>
struct Fp4Frag {
    QRow lo, hi;
    __device__ __forceinline__ void init(u64 w, u64 s, int c0, int g, int cols, int K) {
        lo = q_row<FMT>(reinterpret_cast<const void*>(w), reinterpret_cast<const void*>(s), min(c0 + g, cols - 1), K);
        hi = q_row<FMT>(reinterpret_cast<const void*>(w), reinterpret_cast<const void*>(s), min(c0 + g + 8, cols - 1), K);
    }
};

// A warp's place: column group cg of the block (16 CF output columns from c0: CF 16-row
// fragments of one matrix side by side, or of gate and up at the same columns) and K split ks.
template <int KS, int CF = 1>
struct Fp4Warp {
    int lane, g, t4, cg, ks, c0;
    __device__ __forceinline__ Fp4Warp() {
        const int warp = threadIdx.x >> 5;
        lane = threadIdx.x & 31;
        g = lane >> 2;
        t4 = lane & 3;
        cg = warp / KS;
        ks = warp % KS;
        c0 = (blockIdx.x * (DECODE_WARPS / KS) + cg) * 16 * CF;
    }
    // accumulator i (of one matrix's 4 NT): its output column and its token in the pass
    __device__ __forceinline__ int col(int i) const { return c0 + g + 8 * ((i & 3) >> 1); }
    __device__ __forceinline__ int token(int i) const { return 8 * (i >> 2) + 2 * t4 + (i & 1); }
};

// One k128 step's operands of a warp: M matrices' weight fragments (rows lo, hi: Fp4Row32 or
// Fp8Row32) and NT token fragments (xv[t]: token 8 t + g's 32 activations at the lane's k),
// all zeros past K (no memory touched there).
template <int FMT>
struct MmaRow {
    using T = Fp4Row32<FMT>;
};
template <>
struct MmaRow<FMT_FP8> {
    using T = Fp8Row32;
};

// Where NT 8-token fragments' bf16 activations are (MmaStep): token 8 t + g's row p[t].
template <int NT>
struct BfRows {
    const bf16* p[NT];
};

template <int FMT, int NT, int M>
struct MmaStep {
    using Rows = BfRows<NT>;
    // fp8's steps are twice fp4's registers: its gate/up and 16-token passes would spill
    // with two step buffers at the 128 registers of two blocks an SM (mma_pass)
    static constexpr bool kOneAtATime = FMT == FMT_FP8 && (M > 1 || NT > 1);
    static constexpr bool kTwoAhead = NT == 1;  // down's first two steps' weights before its wait (mma_pass)
    typename MmaRow<FMT>::T lo[M], hi[M];
    uint4 xv[NT][4];

    __device__ __forceinline__ void load(const Fp4Frag<FMT> (&f)[M], const Rows& rows, int k, int K) {
        load_weights(f, k, K);
        load_rows(rows, k, K);
    }
    __device__ __forceinline__ void load_weights(const Fp4Frag<FMT> (&f)[M], int k, int K) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if constexpr (FMT == FMT_FP8) {
                lo[m].load(f[m].lo, k, K);
                hi[m].load(f[m].hi, k, K);
            } else {
                lo[m].load(f[m].lo, k, k < K);
                hi[m].load(f[m].hi, k, k < K);
            }
        }
    }
    __device__ __forceinline__ void load_rows(const Rows& rows, int k, int K) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if constexpr (FMT == FMT_FP8)
                load_x32_natural(xv[t], rows.p[t], k, K);
            else
                load_x32(xv[t], rows.p[t], k, k < K);
        }
    }

    // c[4 NT m + 4 t + e]: matrix m, token tile t, the m16n8 accumulator element e
    __device__ __forceinline__ void mma(float (&c)[4 * NT * M]) const {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if constexpr (FMT == FMT_FP8)
                fp8_step<NT>(c + 4 * NT * m, lo[m], hi[m], xv);
            else
                mma_fp4_step<FMT, NT>(c + 4 * NT * m, lo[m], hi[m], xv);
        }
    }
};

// What mma_pass does between its first steps' weight loads and their rows' loads: nothing
// (NoRowsWait: the gate/up kernels waited at their top), or down's first pass's PDL wait for
// gate/up (PdlRowsWait), so its first weights stream under gate/up's tail.
struct NoRowsWait {
    static constexpr bool kWaits = false;
    __device__ __forceinline__ void operator()() const {}
};
struct PdlRowsWait {
    static constexpr bool kWaits = true;
    bool first;  // the block's first pass: every thread waits here, once
    __device__ __forceinline__ void operator()() const {
        if (first) pdl_wait_then_release_next();
    }
};

// One pass of a Step (MmaStep, A8Step): its M matrices' fragments against NT 8-token B
// fragments (`rows`: what Step::load reads the tokens from), over this warp's k128 steps of K
// (Fp4Warp::col / token place the sums). Software-pipelined: the next step's loads are
// issued before this step's dequantization and MMAs, so a warp always has a step's bytes
// in flight while it computes (with the two steps' loads issued together and then both
// computed, nothing was in flight at each loop turn). Two step buffers, used in turn, so no
// registers are copied; a Step whose two buffers would spill (Step::kOneAtATime) loads and
// computes one step at a time. RowsWait::kWaits: the first step's weights (both buffers' where
// Step::kTwoAhead) are loaded, then rows_wait() runs (in every warp, whatever its K share),
// then their rows.
template <class Step, int KS, int CF, int NC, class Frags, class Rows, class RowsWait = NoRowsWait>
__device__ __forceinline__ void mma_pass(float (&c)[NC], const Frags& f, const Rows& rows, int K,
                                         const Fp4Warp<KS, CF>& w, RowsWait rows_wait = RowsWait()) {
#pragma unroll
    for (int i = 0; i < NC; ++i) c[i] = 0.0f;
    constexpr int stride = KS * FP4_KSTEP;
    const int lane_k = 32 * w.t4;
    Step a, b;
    int k0 = w.ks * FP4_KSTEP;
    if constexpr (Step::kOneAtATime) {
        if constexpr (RowsWait::kWaits) {  // the loop's first load split by the wait
            a.load_weights(f, k0 + lane_k, K);  // past K: zeros, nothing read
            rows_wait();
            if (k0 >= K) return;
            a.load_rows(rows, k0 + lane_k, K);
            a.mma(c);
            k0 += stride;
        }
#pragma unroll 1
        for (; k0 < K; k0 += stride) {
            a.load(f, rows, k0 + lane_k, K);
            a.mma(c);
        }
        return;
    }
    if constexpr (RowsWait::kWaits && Step::kTwoAhead) {  // both buffers' weights before the wait
        a.load_weights(f, k0 + lane_k, K);
        b.load_weights(f, k0 + stride + lane_k, K);
        rows_wait();
        if (k0 >= K) return;
        a.load_rows(rows, k0 + lane_k, K);
        b.load_rows(rows, k0 + stride + lane_k, K);
#pragma unroll 1
        while (true) {  // the loop below, entered with b's step loaded
            a.mma(c);
            k0 += stride;
            if (k0 >= K) break;
            a.load(f, rows, k0 + stride + lane_k, K);
            b.mma(c);
            k0 += stride;
            if (k0 >= K) break;
            b.load(f, rows, k0 + stride + lane_k, K);
        }
        return;
    } else if constexpr (RowsWait::kWaits) {  // the first load split by the wait
        a.load_weights(f, k0 + lane_k, K);
        rows_wait();
        if (k0 >= K) return;
        a.load_rows(rows, k0 + lane_k, K);
    } else {
        if (k0 >= K) return;
        a.load(f, rows, k0 + lane_k, K);
    }
#pragma unroll 1
    while (true) {
        b.load(f, rows, k0 + stride + lane_k, K);
        a.mma(c);
        k0 += stride;
        if (k0 >= K) break;
        a.load(f, rows, k0 + stride + lane_k, K);
        b.mma(c);
        k0 += stride;
        if (k0 >= K) break;
    }
}

// The gate/up epilogue of warp w's (ks == 0) sums c of pass r0 (gate c[i], up c[4 NT + i]):
// act(gate, up) of each column and token in the run, bf16 into act[position, column]; PAIR
// (not the w8a8 kernel, which quantizes act after): ACT_PAIR's g and u too (store_gate_up).
template <int NT, int KS, bool PAIR>
__device__ __forceinline__ void store_gate_up_act(const float (&c)[8 * NT], const Fp4Warp<KS>& w, int r0, int start,
                                                  int len, int I, int I_max, float gsg, float gsu, const float* bg,
                                                  const float* bu, bf16* __restrict__ act, int act_code, float alpha,
                                                  float limit) {
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) {
        const int col = w.col(i), tok = r0 + w.token(i);
        if (col < I && tok < len) {
            const float gv = c[i] * gsg + (bg ? bg[col] : 0.0f);
            const float uv = c[i + 4 * NT] * gsu + (bu ? bu[col] : 0.0f);
            if (PAIR)
                store_gate_up(act, (size_t)(start + tok), col, I_max, act_code, gv, uv, alpha, limit);
            else
                act[(size_t)(start + tok) * I_max + col] = __float2bfloat16(apply_activation(act_code, gv, uv, alpha, limit));
        }
    }
}

// The down epilogue of warp w's (ks == 0) sums c of pass r0 (fragment m's c[4 NT m + i]):
// y[position, h], or (atomic) a routed pair's w * y added into acc[row, h].
template <int NT, int CF, int KS>
__device__ __forceinline__ void store_down_outputs(const float (&c)[4 * NT * CF], const Fp4Warp<KS, CF>& w, int r0,
                                                   int start, int len, int H, float gsd, const float* bd,
                                                   const int* __restrict__ sorted_pair, const float* __restrict__ topk_w,
                                                   float* __restrict__ y, float* __restrict__ acc, int k, int P,
                                                   int atomic) {
#pragma unroll
    for (int i = 0; i < 4 * NT * CF; ++i) {
        const int h = w.col(i % (4 * NT)) + 16 * (i / (4 * NT)), tok = r0 + w.token(i % (4 * NT));
        if (h < H && tok < len)
            store_down_value(c[i] * gsd + (bd ? bd[h] : 0.0f), start + tok, h, sorted_pair, topk_w, y, acc, H, k, P,
                             atomic);
    }
}

// What the epilogue multiplies the sums by besides nvfp4's global scale: fp4 weights went
// into the MMAs as code * scale * 2^-64 (the file's comment), fp8 ones as their codes.
template <int FMT>
__device__ __forceinline__ constexpr float mma_weight_unscale() { return FMT == FMT_FP8 ? 1.0f : FP4_PAIRS_UNSCALE; }

// Two blocks an SM (<= 128 registers) keep more bytes in flight; gate/up's 16-token passes
// (two matrices, twice the accumulators) spill at 128 registers and do twice the work per
// byte, so they take one, as fp8 gate/up does below sm_89 (no e4m3 conversion instruction).
#define MMA_MIN_BLOCKS(FMT, M, NT) ((M) == 2 && ((NT) == 2 || ((FMT) == FMT_FP8 && CUPYMOE_SM < 89)) ? 1 : 2)

// The block of a gate/up kernel (decode_mma_gate_up, decode_mma_gate_up_a8): active expert
// j = blockIdx.y if its weights are of format FMT, its columns 16 DECODE_WARPS / KS from
// blockIdx.x (none left: false), passes of 8 NT tokens over the expert's run, each Step
// reading the rows fill_row(rows, t, slot, token row) gives it, and the bf16 activation
// stored (PAIR: store_gate_up_act's). `start`, `len`, `I`: the run and the expert's width, for
// what the kernel does next.
template <int FMT, int KS, int NT, bool PAIR, class Step, class FillRow>
__device__ __forceinline__ bool gate_up_block(float* part, FillRow fill_row, int& start, int& len, int& I,
                                              DECODE_GATE_UP_ARGS) {
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return false;
    I = inter[slot];
    if (blockIdx.x * (DECODE_WARPS / KS) * 16 >= I) return false;  // the whole block is past the columns
    const Fp4Warp<KS> w;
    Fp4Frag<FMT> f[2];  // gate, up
    f[0].init(gate_ptrs[slot], gate_scale_ptrs[slot], w.c0, w.g, I, H);
    f[1].init(up_ptrs[slot], up_scale_ptrs[slot], w.c0, w.g, I, H);
    // nvfp4's scale_2 (else 1), and the 2^64 fp4 weights were scaled down by
    const float gsg = gate_gscale[slot] * mma_weight_unscale<FMT>(), gsu = up_gscale[slot] * mma_weight_unscale<FMT>();
    const float* bg = reinterpret_cast<const float*>(gate_bias_ptrs[slot]);
    const float* bu = reinterpret_cast<const float*>(up_bias_ptrs[slot]);
    start = active_start[j];
    len = active_len[j];

    for (int r0 = 0; r0 < len; r0 += 8 * NT) {
        // token 8 t + g of this pass (past the run: its last row again, never stored)
        typename Step::Rows rows;
#pragma unroll
        for (int t = 0; t < NT; ++t) fill_row(rows, t, slot, (size_t)sorted_row[start + min(r0 + 8 * t + w.g, len - 1)]);
        float c[8 * NT];  // gate c[i], up c[4 NT + i]
        mma_pass<Step, KS, 1>(c, f, rows, H, w);
        reduce_k_splits<KS>(c, part, w.cg, w.ks, w.lane);
        if (w.ks == 0) store_gate_up_act<NT, KS, PAIR>(c, w, r0, start, len, I, I_max, gsg, gsu, bg, bu, act, act_code, alpha, limit);
    }
    return true;
}

// The block of a down kernel (decode_mma_down, decode_mma_down_a8): active expert j =
// blockIdx.y if of format FMT, its hidden columns 16 CF DECODE_WARPS / KS from blockIdx.x,
// passes of 8 NT positions over its run (fill_row(rows, t, position)), the outputs stored.
// The kernel's PDL wait for gate/up is inside: before it a block reads its run from the lists
// (made before gate/up, whose blocks passed their own wait for them before this grid could
// launch) and loads its first steps' weights (mma_pass, PdlRowsWait); the activation after.
template <int FMT, int KS, int NT, int CF, class Step, class FillRow>
__device__ __forceinline__ void down_block(float* part, FillRow fill_row, DECODE_DOWN_ARGS) {
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return pdl_leave_early();
    if (blockIdx.x * (DECODE_WARPS / KS) * 16 * CF >= H) return pdl_leave_early();
    const int I = inter[slot];
    const Fp4Warp<KS, CF> w;
    Fp4Frag<FMT> f[CF];
#pragma unroll
    for (int m = 0; m < CF; ++m) f[m].init(down_ptrs[slot], down_scale_ptrs[slot], w.c0 + 16 * m, w.g, H, I);
    const float gsd = down_gscale[slot] * mma_weight_unscale<FMT>();  // nvfp4's scale_2 (else 1), fp4's 2^64
    const float* bd = reinterpret_cast<const float*>(down_bias_ptrs[slot]);
    const int start = active_start[j], len = active_len[j];
    if (len <= 0) return pdl_leave_early();  // (an active expert has rows: the wait below always runs)

    for (int r0 = 0; r0 < len; r0 += 8 * NT) {
        typename Step::Rows rows;
#pragma unroll
        for (int t = 0; t < NT; ++t) fill_row(rows, t, (size_t)(start + min(r0 + 8 * t + w.g, len - 1)));
        float c[4 * NT * CF];  // fragment m's c[4 NT m + i]
        mma_pass<Step, KS, CF>(c, f, rows, I, w, PdlRowsWait{r0 == 0});
        reduce_k_splits<KS>(c, part, w.cg, w.ks, w.lane);
        if (w.ks == 0) store_down_outputs<NT, CF>(c, w, r0, start, len, H, gsd, bd, sorted_pair, topk_w, y, acc, k, P, atomic);
    }
}

#define DECODE_GATE_UP_ARG_NAMES                                                                                \
    x, xe, num_active, active_slot, active_start, active_len, sorted_row, gate_ptrs, up_ptrs, gate_scale_ptrs, \
        up_scale_ptrs, gate_gscale, up_gscale, slot_fmt, gate_bias_ptrs, up_bias_ptrs, inter, shared_slot, act, H, \
        I_max, act_code, alpha, limit
#define DECODE_DOWN_ARG_NAMES                                                                                    \
    act, num_active, active_slot, active_start, active_len, sorted_pair, down_ptrs, down_scale_ptrs, down_gscale, \
        slot_fmt, down_bias_ptrs, inter, topk_w, y, acc, H, I_max, k, P, atomic

// grid (ceil(I_max / (16 * DECODE_WARPS / KS)), max_active), block DECODE_WARPS * 32.
// Arguments: DECODE_GATE_UP_ARGS (decode_common.cuh).
template <int FMT, int KS, int NT>
__global__ void __launch_bounds__(DECODE_WARPS * 32, MMA_MIN_BLOCKS(FMT, 2, NT))
decode_mma_gate_up(DECODE_GATE_UP_ARGS) {
    __shared__ float part[KS > 1 ? DECODE_WARPS * 32 * 8 * NT : 1];
    pdl_wait_then_release_next();
    int start, len, I;
    gate_up_block<FMT, KS, NT, true, MmaStep<FMT, NT, 2>>(
        part,
        [&](BfRows<NT>& rows, int t, int slot, size_t row) {
            rows.p[t] = (slot == shared_slot ? x : xe) + row * H;  // the shared expert reads x
        },
        start, len, I, DECODE_GATE_UP_ARG_NAMES);
}

// grid (ceil(H / (16 CF * DECODE_WARPS / KS)), max_active), block DECODE_WARPS * 32.
// Arguments: DECODE_DOWN_ARGS (decode_common.cuh); outputs as decode_down's: y[pos, h], or with `atomic` the
// routed pairs' w * y added into acc[row, h] (the shared expert still stores y).
// CF: 16-row fragments a warp streams side by side (32 columns at 2), as gate/up streams its
// gate and up rows: at 2 the blocks are half as many, each warp's a step's bytes twice, so
// a layer whose down had 1.7 waves of blocks (deepseek-v3 at N = 1: 448 for 264 places)
// takes one (layer._decode_kernel picks it where it still fills every SM without a K split).
template <int FMT, int KS, int NT, int CF = 1>
__global__ void __launch_bounds__(DECODE_WARPS * 32, MMA_MIN_BLOCKS(FMT, CF, NT))
decode_mma_down(DECODE_DOWN_ARGS) {
    __shared__ float part[KS > 1 ? DECODE_WARPS * 32 * 4 * NT * CF : 1];
    down_block<FMT, KS, NT, CF, MmaStep<FMT, NT, CF>>(  // (its PDL wait inside)
        part, [&](BfRows<NT>& rows, int t, size_t pos) { rows.p[t] = act + pos * I_max; }, DECODE_DOWN_ARG_NAMES);
}

#if CUPYMOE_SM >= 89
// ---------------------------------------------------------------------------------------
// w8a8 (fp8-block experts, layer fp8_compute "w8a8"): the weights' e4m3 codes and the
// activations' go into e4m3 MMAs (m16n8k32) as they are, with nothing to convert. The
// activations come quantized per row and 128-column group (quant.cuh's rule): x by the
// routing stage (or the norm), the activation by decode_mma_gate_up_a8's own epilogue.
//
// Fragments: lane (g, t4) holds, per k128 step at k0, codes k0 + 32 t4 .. + 31 of weight
// rows g and g + 8 (Fp8Row32) and of token g (A8Tokens). MMA j (0..3) takes words 2 j and
// 2 j + 1 of them (codes 8 j .. 8 j + 7) as its K slots 4 t4 .. 4 t4 + 3 and 16 + 4 t4 ..
// 16 + 4 t4 + 3, on both operands, so the slots hold the same k on both sides. A step lies
// in one weight scale block and one activation group: its sums (started from zero, so the
// tensor cores' fp8 accumulation spans 128 k at most, as the w8a8 GEMM promotes every 128)
// are multiplied by the weight block's scale and the token's group scale into fp32 c.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void mma_e4m3(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Where NT 8-token fragments' codes and scales are: token 8 t + g's e4m3 row q[t] and its
// group scales s[t] (one per 128 columns).
template <int NT>
struct A8Rows {
    const u8* q[NT];
    const float* s[NT];
};

template <int NT, int M>
struct A8Step {
    // as fp8's MmaStep: two step buffers of two matrices (or of 16 tokens) would spill at the
    // 128 registers of two blocks an SM
    static constexpr bool kOneAtATime = M > 1 || NT > 1;
    static constexpr bool kTwoAhead = NT == 1;
    using Rows = A8Rows<NT>;
    Fp8Row32 lo[M], hi[M];
    uint4 xq[NT][2];  // token 8 t + g's 32 codes at the lane's k (zeros past K)
    float xs[NT];     // and its group's scale (0 for a step past K)

    __device__ __forceinline__ void load(const Fp4Frag<FMT_FP8> (&f)[M], const A8Rows<NT>& rows, int k, int K) {
        load_weights(f, k, K);
        load_rows(rows, k, K);
    }
    __device__ __forceinline__ void load_weights(const Fp4Frag<FMT_FP8> (&f)[M], int k, int K) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            lo[m].load(f[m].lo, k, K);
            hi[m].load(f[m].hi, k, K);
        }
    }
    __device__ __forceinline__ void load_rows(const A8Rows<NT>& rows, int k, int K) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                xq[t][h] = k + 16 * h < K ? __ldg(reinterpret_cast<const uint4*>(rows.q[t] + k + 16 * h))
                                          : make_uint4(0, 0, 0, 0);
            // the step's group scale even where this lane's codes lie past K: it scales the
            // step's sums, which hold every lane's codes (k >> 7 is the step's group)
            xs[t] = (k & ~127) < K ? __ldg(rows.s[t] + (k >> 7)) : 0.0f;
        }
    }

    // c[4 NT m + 4 t + e]: matrix m, token tile t, the m16n8 accumulator element e (tokens
    // 8 t + 2 t4 and + 1: their scales from the lanes that loaded them, g = 2 t4, 2 t4 + 1)
    __device__ __forceinline__ void mma(float (&c)[4 * NT * M]) const {
        const int t4 = threadIdx.x & 3;
        float s0[NT], s1[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            s0[t] = __shfl_sync(CUPYMOE_FULL_MASK, xs[t], 8 * t4);
            s1[t] = __shfl_sync(CUPYMOE_FULL_MASK, xs[t], 8 * t4 + 4);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float d[4 * NT];
#pragma unroll
            for (int i = 0; i < 4 * NT; ++i) d[i] = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned a[4] = {word_of(lo[m].q, 2 * j), word_of(hi[m].q, 2 * j), word_of(lo[m].q, 2 * j + 1),
                                       word_of(hi[m].q, 2 * j + 1)};
#pragma unroll
                for (int t = 0; t < NT; ++t) mma_e4m3(d + 4 * t, a, word_of(xq[t], 2 * j), word_of(xq[t], 2 * j + 1));
            }
            const float sw = lo[m].s;  // rows g and g + 8 share a 128-row scale block
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                float* o = c + 4 * NT * m + 4 * t;
                o[0] = fmaf(d[4 * t + 0], sw * s0[t], o[0]);
                o[1] = fmaf(d[4 * t + 1], sw * s1[t], o[1]);
                o[2] = fmaf(d[4 * t + 2], sw * s0[t], o[2]);
                o[3] = fmaf(d[4 * t + 3], sw * s1[t], o[3]);
            }
        }
    }
};

// grid (ceil(I_max / (16 * DECODE_WARPS / KS)), max_active), block DECODE_WARPS * 32: as
// decode_mma_gate_up, on the inputs' e4m3 codes; writes the bf16 activation and its codes.
template <int KS, int NT>
__global__ void __launch_bounds__(DECODE_WARPS * 32, MMA_MIN_BLOCKS(FMT_FP8, 2, NT))
decode_mma_gate_up_a8(DECODE_A8_GATE_UP_ARGS) {
    __shared__ float part[KS > 1 ? DECODE_WARPS * 32 * 8 * NT : 1];
    pdl_wait_then_release_next();
    const int KBH = (H + 127) >> 7;
    int start, len, I;
    if (!gate_up_block<FMT_FP8, KS, NT, false, A8Step<NT, 2>>(
            part,
            [&](A8Rows<NT>& rows, int t, int slot, size_t row) {
                const bool shared = slot == shared_slot;  // the shared expert reads x
                rows.q[t] = (shared ? qx_shared : qx) + row * H;
                rows.s[t] = (shared ? sx_shared : sx) + row * KBH;
            },
            start, len, I, DECODE_GATE_UP_ARG_NAMES))
        return;
    constexpr int cols_per_block = (DECODE_WARPS / KS) * 16;
    quantize_act_group_if_last(act, qact, sact, act_tickets, blockIdx.y, blockIdx.x * cols_per_block, cols_per_block,
                               I, I_max, start, len);
}

// grid (ceil(H / (16 CF * DECODE_WARPS / KS)), max_active), block DECODE_WARPS * 32: as
// decode_mma_down, on the activation's e4m3 codes.
template <int KS, int NT, int CF = 1>
__global__ void __launch_bounds__(DECODE_WARPS * 32, MMA_MIN_BLOCKS(FMT_FP8, CF, NT))
decode_mma_down_a8(DECODE_A8_DOWN_ARGS) {
    __shared__ float part[KS > 1 ? DECODE_WARPS * 32 * 4 * NT * CF : 1];
    const int KBI = (I_max + 127) >> 7;
    down_block<FMT_FP8, KS, NT, CF, A8Step<NT, CF>>(  // (its PDL wait inside)
        part,
        [&](A8Rows<NT>& rows, int t, size_t pos) {
            rows.q[t] = qact + pos * I_max;
            rows.s[t] = sact + pos * KBI;
        },
        DECODE_DOWN_ARG_NAMES);
}
#endif
