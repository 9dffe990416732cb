// Quantized expert weights, dequantized in registers (W8A16 / W4A16): the formats of
// docs/FORMATS.md as the kernels see them, and the two ways the kernels read them.
//
// Device layout (cupymoe/weights.py uploads each matrix as the checkpoint stores it, one
// expert after another; only the bits inside each fp4 code word move, so the bytes read are
// as many as on disk):
//   FMT_BF16   W bf16 [out, K]
//   FMT_FP8    q e4m3 [out, K] bytes; block scales f32 [ceil(out/128), ceil(K/128)]
//   FMT_NVFP4  packed [out, K/2], each 32-bit word (codes 8 j .. 8 j + 7 of a row) repacked
//              at load (fp4_word_repack below); group scales e4m3 [out, K/16]; the matrix's
//              global scale (scale_2) is applied to the dot products in fp32
//   FMT_MXFP4  packed [out, K/2] (the same words; gpt-oss's [out, K/32, 16] blocks are this);
//              group scales e8m0 [out, K/32]
//
// What a kernel computes with (so what the faithful reference models):
//   - fp4 formats: code * group scale is exact in bf16 and in fp32 (a 2-bit mantissa times
//     a 4-bit one, or times a power of two), so both readers use the exact weight.
//   - fp8: the decode reader applies the block scale to the fp32 dot product of 8 codes
//     (exact weights); the GEMM tile builder stores bf16(q * s), rounding each weight once
//     (relative error <= 2^-8, bf16's unit roundoff), because its tensor-core operands are bf16.
#pragma once
#include "common.cuh"

// Format codes shared with cupymoe/kernels.py (FORMAT_CODES).
#define FMT_BF16 0
#define FMT_FP8 1
#define FMT_NVFP4 2
#define FMT_MXFP4 3

typedef unsigned char u8;

// e4m3 (fn) bits -> float, exactly: the 7 magnitude bits placed at fp32's bits 26..20 read
// as 2^(e-127) * 1.m (or a denormal 0.m * 2^-126 for e = 0), which is the e4m3 value
// times 2^-120. Needs denormals kept (no -ftz). The NaN code (S.1111.111) reads as 480.
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)) * 0x1p120f;
}

// e2m1 code (4 bits) -> float, the same trick: value * 2^-126 sits at fp32's bits 24..22.
__device__ __forceinline__ float e2m1_to_f32(unsigned c) {
    return __uint_as_float(((c & 0x8u) << 28) | ((c & 0x7u) << 22)) * 0x1p126f;
}

// e8m0 biased exponent -> 2^(e - 127); e = 0 is the denormal 2^-127.
__device__ __forceinline__ float e8m0_to_f32(unsigned e) {
    return e ? __uint_as_float(e << 23) : __uint_as_float(0x00400000u);
}

// Two e4m3 codes (a 16-bit pair, element 0 in the low byte) -> two floats, exactly. sm_89+
// converts a pair in one instruction (to f16, which holds every e4m3 value), elsewhere the
// bit trick above.
__device__ __forceinline__ float2 e4m3x2_to_f32x2(unsigned pair) {
#if CUPYMOE_SM >= 89
    unsigned h;
    float2 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)pair));
    asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;}"
        : "=f"(r.x), "=f"(r.y) : "r"(h));
    return r;
#else
    return make_float2(e4m3_to_f32(pair & 0xFF), e4m3_to_f32((pair >> 8) & 0xFF));
#endif
}

template <int FMT>
struct QFormat;
template <>
struct QFormat<FMT_BF16> {
    static constexpr int BITS = 16;
};
template <>
struct QFormat<FMT_FP8> {
    static constexpr int BITS = 8;
};
template <>
struct QFormat<FMT_NVFP4> {
    static constexpr int BITS = 4;
    static constexpr int GROUP = 16;
};
template <>
struct QFormat<FMT_MXFP4> {
    static constexpr int BITS = 4;
    static constexpr int GROUP = 32;
};

// Row n of a [out, K] matrix: its first weight byte and its scales' first byte.
struct QRow {
    const u8* w;
    const u8* s;
};

template <int FMT>
__device__ __forceinline__ QRow q_row(const void* wbase, const void* sbase, int n, int K) {
    QRow r;
    r.w = reinterpret_cast<const u8*>(wbase) + (size_t)n * K * QFormat<FMT>::BITS / 8;
    const u8* s = reinterpret_cast<const u8*>(sbase);
    if (FMT == FMT_FP8)
        r.s = s + (size_t)(n >> 7) * ((K + 127) >> 7) * 4;
    else if (FMT == FMT_NVFP4)
        r.s = s + (size_t)n * (K / 16);
    else if (FMT == FMT_MXFP4)
        r.s = s + (size_t)n * (K / 32);
    else
        r.s = s;
    return r;
}

// The scale of the weights at [row, k .. k + 7] (k a multiple of 8).
template <int FMT>
__device__ __forceinline__ float q_scale(const u8* s, int k) {
    if (FMT == FMT_FP8) return __ldg(reinterpret_cast<const float*>(s) + (k >> 7));
    if (FMT == FMT_NVFP4) return e4m3_to_f32(__ldg(s + (k >> 4)));
    if (FMT == FMT_MXFP4) return e8m0_to_f32(__ldg(s + (k >> 5)));
    return 1.0f;
}

// 8 e2m1 codes (one word, repacked at load) -> 4 bf16 pairs (code i, code i + 4), each
// times 2^-126 exactly, by placing bits instead of looking them up: a code's 3 magnitude
// bits at bf16 bits 8..6 (the exponent field's low 2 bits and the top mantissa bit) and its
// sign at bit 15 read as 2^(E - 127) * 1.m, or for E = 0 the subnormal 2^-126 * 0.m, which
// is the e2m1 value times 2^-126 in both cases. The integer pipe (64 operations a cycle an
// SM, half the issue rate) bounds the fp4 decode, so the load repacks each word's bits
// (fp4_word_repack; cupymoe/formats.py fp4_word_bit_map is its host twin) for 8 integer
// operations a word where the stored nibbles took 13:
//   pair 0 sits where bf16 wants it: one mask;
//   pairs 1 and 2 sit rotated left by 3 and 6 (codes 4 bits wide, placements 9 bits wide:
//     three rotations of {8..6, 15} tile 12 of a half's 16 bits): a rotate and a mask;
//   pair 3 has the 4 bits left, e1 at 0, sign at 1, m at 3, e0 at 4 (+ 16 for code 7):
//     x * (2^3 + 2^8 + 2^14) makes three copies of the masked bits that cannot overlap or
//     carry, putting m e0 at 7..6 (first copy), e1 at 8 (second), the sign at 15 (third).
// `s2` (both halves the same) multiplies each pair: it must bring the value back into bf16's
// normal range (the tensor cores' input), and the caller undoes its extra power of two.
// Scale times 2^62 (e4m3x2_to_bf16x2_times_2p62, e8m0_to_bf16x2_times_2p62) leaves each
// weight times 2^-64: the fp32 sums are multiplied by FP4_PAIRS_UNSCALE with the global scale.
#define FP4_PAIRS_UNSCALE 0x1p64f
#define FP4_PAIR_MASK 0x81C081C0u  // both halves' bits 8..6 and 15
__device__ __forceinline__ uint4 fp4x8_to_bf16_pairs(unsigned v, __nv_bfloat162 s2) {
    unsigned p[4];
    p[0] = v & FP4_PAIR_MASK;
    p[1] = __funnelshift_r(v, v, 3) & FP4_PAIR_MASK;
    p[2] = __funnelshift_r(v, v, 6) & FP4_PAIR_MASK;
    p[3] = ((v & 0x001B001Bu) * 0x4108u) & FP4_PAIR_MASK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 h = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&p[i]), s2);
        p[i] = *reinterpret_cast<unsigned*>(&h);
    }
    return make_uint4(p[0], p[1], p[2], p[3]);
}

// The load's repack of one word (cuda/repack.cu runs it over every fp4 matrix): the inverse
// of the placement above. A stored code c (s e1 e0 m, nibble i) goes to pair i % 4, half i / 4.
__host__ __device__ __forceinline__ unsigned fp4_code_as_pair_half(unsigned c) {  // m e0 e1 -> 6..8, s -> 15
    return ((c & 7u) << 6) | ((c & 8u) << 12);
}
__host__ __device__ __forceinline__ unsigned fp4_code_as_pair3(unsigned c) {  // e1 -> 0, s -> 1, m -> 3, e0 -> 4
    return ((c >> 2) & 1u) | (((c >> 3) & 1u) << 1) | ((c & 1u) << 3) | (((c >> 1) & 1u) << 4);
}
__host__ __device__ __forceinline__ unsigned fp4_word_repack(unsigned v) {
    unsigned out = 0;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        const unsigned p = fp4_code_as_pair_half((v >> (4 * i)) & 15u) | (fp4_code_as_pair_half((v >> (16 + 4 * i)) & 15u) << 16);
        const int r = 3 * i;  // rotate left by r
        out |= r ? (p << r) | (p >> (32 - r)) : p;
    }
    return out | fp4_code_as_pair3((v >> 12) & 15u) | (fp4_code_as_pair3(v >> 28) << 16);
}

// bf16 2^126 in both halves: the pairs' multiplier that gives the codes' own values
__device__ __forceinline__ __nv_bfloat162 fp4_pairs_unit() {
    const unsigned b = 0x7E807E80u;
    return *reinterpret_cast<const __nv_bfloat162*>(&b);
}

// A repacked word's 8 codes as their exact values, bf16 pairs (code i, code i + 4).
__device__ __forceinline__ uint4 fp4x8_values(unsigned v) { return fp4x8_to_bf16_pairs(v, fp4_pairs_unit()); }

// ---------------------------------------------------------------------------------------
// Decode reader: 8 weights of one row at k .. k + 7, streamed from HBM past L1, and their
// dot product with 8 fp32 activations. A warp reads 8 consecutive weights per lane, so one
// step covers 256 weights of the row (512 bytes of bf16, 256 of fp8, 128 of fp4).
// ---------------------------------------------------------------------------------------
template <int FMT>
struct WChunk;

template <>
struct WChunk<FMT_BF16> {
    bf16x8 v;
    __device__ __forceinline__ void load(const QRow& r, int k) {
        v = load_bf16x8_stream(reinterpret_cast<const bf16*>(r.w) + k);
    }
    __device__ __forceinline__ float dot(const float x[8], float acc) const { return dot_bf16x8(v, x, acc); }
};

template <>
struct WChunk<FMT_FP8> {
    uint2 v;
    float s;
    __device__ __forceinline__ void load(const QRow& r, int k) {
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(r.w + k));
        s = q_scale<FMT_FP8>(r.s, k);
    }
    __device__ __forceinline__ float dot(const float x[8], float acc) const {
        const unsigned w[2] = {v.x, v.y};
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = e4m3x2_to_f32x2(w[i >> 1] >> (16 * (i & 1)));
            t = fmaf(f.x, x[2 * i], t);
            t = fmaf(f.y, x[2 * i + 1], t);
        }
        return fmaf(s, t, acc);
    }
};

template <int FMT>
struct WChunkFp4 {
    unsigned v;
    float s;
    __device__ __forceinline__ void load(const QRow& r, int k) {
        asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(r.w + (k >> 1)));
        s = q_scale<FMT>(r.s, k);
    }
    __device__ __forceinline__ float dot(const float x[8], float acc) const {
        const uint4 p = fp4x8_values(v);  // pair i: codes i and i + 4
        const unsigned w[4] = {p.x, p.y, p.z, p.w};
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // bf16 -> fp32 is a shift
            t = fmaf(__uint_as_float(w[i] << 16), x[i], t);
            t = fmaf(__uint_as_float(w[i] & 0xFFFF0000u), x[i + 4], t);
        }
        return fmaf(s, t, acc);
    }
};
template <>
struct WChunk<FMT_NVFP4> : WChunkFp4<FMT_NVFP4> {};
template <>
struct WChunk<FMT_MXFP4> : WChunkFp4<FMT_MXFP4> {};

// ---------------------------------------------------------------------------------------
// GEMM tile builder: 16 bytes of a row's raw codes (16 fp8 or 32 fp4 weights, all under
// one scale group unless noted) -> bf16 chunks of 8 weights, for the tensor-core operand.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned pack_bf16x2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}

// An mxfp4 scale byte e (e8m0) -> the bf16 pair (2^(e - 127) * 2^62, the same): bf16
// exponent field e + 62, exact while e <= 192 (the layer checks: FP4_MMA_MXFP4_SCALE_BYTES).
__device__ __forceinline__ unsigned e8m0_to_bf16x2_times_2p62(unsigned e) {
    const unsigned b = ((e & 0xFFu) + 62u) << 7;
    return b | (b << 16);
}

// Two e4m3 scale bytes (the low one first) -> the bf16 pair (s0 * 2^62, s1 * 2^62), exactly
// (4 significant bits; every e4m3 value times 2^62 is a normal bf16): on sm_89+ one
// conversion of the pair to f16 and the power of two in fp32, no integer operation (the
// fp4 decode's bound); before, e4m3x2_to_f32x2's bit trick.
__device__ __forceinline__ unsigned e4m3x2_to_bf16x2_times_2p62(unsigned pair) {
    const float2 f = e4m3x2_to_f32x2(pair);
    return pack_bf16x2(f.x * 0x1p62f, f.y * 0x1p62f);
}

__device__ __forceinline__ unsigned fp8x2_scaled(unsigned pair, float s) {
    const float2 f = e4m3x2_to_f32x2(pair);
    return pack_bf16x2(f.x * s, f.y * s);
}

// 8 fp8 codes (two words) times s -> 8 bf16, each rounded once: bf16(fp32(q) * s).
__device__ __forceinline__ uint4 fp8x8_to_bf16(unsigned lo, unsigned hi, float s) {
    return make_uint4(fp8x2_scaled(lo, s), fp8x2_scaled(lo >> 16, s), fp8x2_scaled(hi, s), fp8x2_scaled(hi >> 16, s));
}

// The same 8 codes in k order (a GEMM tile's bf16 chunk: element 2 i in the low half of
// word i): fp4x8_to_bf16_pairs, then four byte permutes to undo its (i, i + 4) pairing.
// Why: the fp4 GEMMs are bound by their conversion's instructions, and bit placement plus
// four permutes is shorter than the table lookup; fp4x8_to_bf16 below serves the mxfp4
// scale bytes whose 2^(e - 1) is no bf16.
__device__ __forceinline__ uint4 fp4x8_to_bf16_in_order(unsigned v, __nv_bfloat162 s2) {
    const uint4 p = fp4x8_to_bf16_pairs(v, s2);
    return make_uint4(__byte_perm(p.x, p.y, 0x5410), __byte_perm(p.z, p.w, 0x5410), __byte_perm(p.x, p.y, 0x7632),
                      __byte_perm(p.z, p.w, 0x7632));
}

// 8 e2m1 codes (one repacked word) times s -> 8 bf16 in k order, exact (a 2-bit mantissa
// times an e4m3 or a power-of-two scale fits bf16's 8 bits, so the product is not rounded):
// the grouped GEMM's mxfp4 chunks with scale bytes past FP4_PAIRS_MXFP4_MAX_SCALE_BYTE, whose
// multiplier 2^(e - 1) is no bf16, take it: the values first (times 2^126), then s.
__device__ __forceinline__ uint4 fp4x8_to_bf16(unsigned v, float s) {
    uint4 o = fp4x8_to_bf16_in_order(v, fp4_pairs_unit());
    const __nv_bfloat162 s2 = __float2bfloat162_rn(s);
    unsigned* w = reinterpret_cast<unsigned*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 p = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&w[i]), s2);
        w[i] = *reinterpret_cast<unsigned*>(&p);
    }
    return o;
}

// The GEMM tile's weights come out of fp4x8_to_bf16_in_order times 2^-64 for nvfp4 (each
// pair times its scale times 2^62: every e4m3 scale times 2^62 is a normal bf16, and so is
// every product), so its epilogue multiplies by 2^64 with the matrix's global scale
// (gemm_common.cuh gemm_tile_at). mxfp4 takes the pair multiplier 2^(e - 1) = s * 2^126,
// exact values, while that is a bf16 (scale byte e <= 128), else fp4x8_to_bf16.
template <int FMT>
__device__ __forceinline__ constexpr float gemm_weight_unscale() { return FMT == FMT_NVFP4 ? FP4_PAIRS_UNSCALE : 1.0f; }
#define FP4_PAIRS_MXFP4_MAX_SCALE_BYTE 128u

// ---------------------------------------------------------------------------------------
// w8a8's activation quantization (sm_89+: the e4m3 conversions), fused into the stages
// that produce each activation (the routing stage for x, the norm for its output, the
// gate/up epilogue for the down GEMM's input). The rule is reference.quantize_activations_fp8's:
// per row and 128-column group, s = amax / 448 (IEEE float32 division), q = e4m3(v / s),
// nearest even, saturating; a group of zeros has s = 0 and codes 0.
// ---------------------------------------------------------------------------------------
#if CUPYMOE_SM >= 89
// Two scaled values -> two e4m3 codes (ta in the low byte), rounded to nearest, saturating.
__device__ __forceinline__ unsigned short e4m3x2_codes(float ta, float tb) {
    unsigned short p;  // cvt puts its first source in the upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p) : "f"(tb), "f"(ta));
    return p;
}

// Two values -> two e4m3 codes (a in the low byte) under scale sc.
__device__ __forceinline__ unsigned e4m3x2_quantize(float a, float b, float sc) {
    return e4m3x2_codes(sc > 0.0f ? a / sc : 0.0f, sc > 0.0f ? b / sc : 0.0f);
}

// One 128-column group held by 16 consecutive lanes, 8 values a lane; every lane of the
// warp calls it (the amax is a half-warp shuffle). Returns the group's scale and the lane's
// 8 codes (element 0 in the low byte). Lanes past a row's width pass zeros, which leave
// the amax as it is.
__device__ __forceinline__ float e4m3_group_quantize16(const float v[8], uint2& codes) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(CUPYMOE_FULL_MASK, amax, o));
    const float sc = amax / 448.0f;
    codes.x = e4m3x2_quantize(v[0], v[1], sc) | (e4m3x2_quantize(v[2], v[3], sc) << 16);
    codes.y = e4m3x2_quantize(v[4], v[5], sc) | (e4m3x2_quantize(v[6], v[7], sc) << 16);
    return sc;
}

// A whole warp quantizes columns c0 .. c0 + 255 (c0 a multiple of 256; two groups) of one
// bf16 row of n columns (n a multiple of 8): codes q[n], scales s[ceil(n / 128)].
__device__ __forceinline__ void e4m3_quantize_chunk(const bf16* __restrict__ in, int n, u8* __restrict__ q,
                                                    float* __restrict__ s, int c0, int lane) {
    const int col = c0 + lane * 8;
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (col < n) unpack_bf16x8(load_bf16x8(in + col), v);
    uint2 codes;
    const float sc = e4m3_group_quantize16(v, codes);
    if (col < n) {
        *reinterpret_cast<uint2*>(q + col) = codes;
        if ((lane & 15) == 0) s[col >> 7] = sc;
    }
}

// A whole warp quantizes units u, u + stride, ... of x's N rows of H columns (a unit: 256
// columns of a row, ceil(H / 256) a row): codes qx[N, H], scales sx[N, ceil(H / 128)]. For
// warps that deal a launch's units among them (the routers; decode_route_lists' idle warps).
__device__ __forceinline__ void e4m3_quantize_units(const bf16* __restrict__ x, int N, int H, u8* __restrict__ qx,
                                                    float* __restrict__ sx, int u, int stride, int lane) {
    const int chunks = (H + 255) >> 8;
    for (; u < N * chunks; u += stride) {
        const int row = u / chunks;
        e4m3_quantize_chunk(x + (size_t)row * H, H, qx + (size_t)row * H, sx + (size_t)row * ((H + 127) >> 7),
                            (u % chunks) << 8, lane);
    }
}

// A whole warp quantizes one bf16 row of n columns (n a multiple of 8): codes q[n], scales
// s[ceil(n / 128)]. Every lane runs the same iterations.
__device__ __forceinline__ void e4m3_quantize_row(const bf16* __restrict__ in, int n, u8* __restrict__ q,
                                                  float* __restrict__ s, int lane) {
    for (int c0 = 0; c0 < n; c0 += 256) e4m3_quantize_chunk(in, n, q, s, c0, lane);
}
#endif
