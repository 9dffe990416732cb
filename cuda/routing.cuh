// Routing: scores, selection and routing weights for every variant of DESIGN.md 1.3, for
// one row (route_row), shared by topk.cu's kernel and decode.cu's fused routing + lists.
//
// One warp per row; the row's scores s and selection scores c live in shared memory
// (R <= 4096), so any router width works without register arrays indexed at run time.
// Selection is k rounds of a warp arg-max; ties go to the lower expert id, the same rule
// as cupymoe.reference. A taken entry is set to NaN, which no comparison selects.
#pragma once
#include "common.cuh"

// scoring codes shared with cupymoe/kernels.py (SCORING_CODES)
#define SCORE_SOFTMAX 0
#define SCORE_SIGMOID 1
#define SCORE_SQRTSOFTPLUS 2

#define TOPK_MAX_K 64

// Error bits written to `err` (read by MoeLayer.check_errors()).
#define ERR_TOKEN_ID_RANGE 1

__device__ __forceinline__ void argmax_merge(float& best, int& bi, float ov, int oi) {
    if (ov > best || (ov == best && oi < bi)) {
        best = ov;
        bi = oi;
    }
}

__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(CUPYMOE_FULL_MASK, best, o);
        const int oi = __shfl_xor_sync(CUPYMOE_FULL_MASK, bi, o);
        argmax_merge(best, bi, ov, oi);
    }
}

// The lane-strided best of v[lo, hi) (NaN entries are never chosen), then the warp's best.
__device__ __forceinline__ int warp_select(const float* v, int lo, int hi, int lane) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + lane; i < hi; i += 32) argmax_merge(best, bi, v[i], i);
    warp_argmax(best, bi);
    return bi;
}

// Routes one row with one warp: its k expert ids and weights into ids_out / w_out[row, :].
// `s` is the warp's shared scratch of 2 R + TOPK_MAX_K floats.
__device__ __forceinline__ void route_row(int row, float* s, const float* __restrict__ logits,
                                          const float* __restrict__ corr_bias, const int* __restrict__ tid2eid,
                                          const int* __restrict__ token_ids, int* __restrict__ ids_out,
                                          float* __restrict__ w_out, int* __restrict__ err, int R, int E, int k,
                                          int scoring, int n_group, int topk_group, int topk_then_softmax, int renorm,
                                          float scale, int vocab, int lane) {
    float* c = s + R;
    int* sel = reinterpret_cast<int*>(c + R);
    const float* l = logits + (size_t)row * R;

    // 1. scores s and selection scores c
    if (topk_then_softmax) {
        for (int i = lane; i < R; i += 32) c[i] = l[i];
    } else if (scoring == SCORE_SOFTMAX) {
        float m = -INFINITY;
        for (int i = lane; i < R; i += 32) m = fmaxf(m, l[i]);
        m = warp_max(m);
        float sum = 0.0f;
        for (int i = lane; i < R; i += 32) {
            const float e = expf(l[i] - m);
            s[i] = e;
            sum += e;
        }
        const float inv = 1.0f / warp_sum(sum);
        for (int i = lane; i < R; i += 32) {
            s[i] *= inv;
            c[i] = s[i] + (corr_bias ? corr_bias[i] : 0.0f);
        }
    } else {
        for (int i = lane; i < R; i += 32) {
            const float x = l[i];
            float v;
            if (scoring == SCORE_SIGMOID) {
                v = sigmoidf_(x);
            } else {  // sqrt(softplus(x)), softplus = log(1 + e^x) computed without overflow
                const float sp = x > 20.0f ? x : log1pf(expf(x));
                v = sqrtf(sp);
            }
            s[i] = v;
            c[i] = v + (corr_bias ? corr_bias[i] : 0.0f);
        }
    }
    __syncwarp();

    // 2. selection
    if (tid2eid) {
        int tid = token_ids[row];
        if (tid < 0 || tid >= vocab) {
            if (lane == 0) atomicOr(err, ERR_TOKEN_ID_RANGE);
            tid = -1;
        }
        for (int j = lane; j < k; j += 32) sel[j] = tid < 0 ? -1 : tid2eid[(size_t)tid * k + j];
    } else {
        if (n_group > 1) {
            // group score = sum of the top-2 c of each group; keep the topk_group best groups
            const int G = E / n_group;
            float gscore = -INFINITY;
            if (lane < n_group) {
                float t1 = -INFINITY, t2 = -INFINITY;
                for (int i = lane * G; i < (lane + 1) * G; ++i) {
                    const float v = c[i];
                    if (v > t1) {
                        t2 = t1;
                        t1 = v;
                    } else if (v > t2) {
                        t2 = v;
                    }
                }
                gscore = t1 + t2;
            }
            bool keep = false;
            for (int j = 0; j < topk_group; ++j) {
                float best = lane < n_group ? gscore : -INFINITY;
                int bi = lane < n_group ? lane : 0x7fffffff;
                if (keep) { best = -INFINITY; bi = 0x7fffffff; }
                warp_argmax(best, bi);
                if (lane == bi) keep = true;
            }
            const unsigned kept = __ballot_sync(CUPYMOE_FULL_MASK, keep);
            for (int i = lane; i < E; i += 32)
                if (!((kept >> (i / G)) & 1u)) c[i] = -INFINITY;
            __syncwarp();
        }
        for (int j = 0; j < k; ++j) {
            const int bi = warp_select(c, 0, R, lane);
            if (lane == 0) {
                sel[j] = bi;
                c[bi] = NAN;
            }
            __syncwarp();
        }
    }
    __syncwarp();

    // 3. routing weights: s at the chosen ids (or softmax over the k chosen logits)
    if (lane == 0) {
        float* w = w_out + (size_t)row * k;
        int* ids = ids_out + (size_t)row * k;
        float sum = 0.0f;
        if (topk_then_softmax) {
            const float m = l[sel[0]];  // the first pick is the largest logit
            for (int j = 0; j < k; ++j) {
                const float e = expf(l[sel[j]] - m);
                w[j] = e;
                sum += e;
            }
            for (int j = 0; j < k; ++j) w[j] = w[j] / sum * scale;
        } else {
            for (int j = 0; j < k; ++j) {
                const float v = sel[j] >= 0 ? s[sel[j]] : 0.0f;
                w[j] = v;
                sum += v;
            }
            const float inv = renorm ? 1.0f / (sum + 1e-20f) : 1.0f;
            for (int j = 0; j < k; ++j) w[j] = w[j] * inv * scale;
        }
        for (int j = 0; j < k; ++j) ids[j] = sel[j];
    }
}
