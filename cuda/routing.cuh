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
#define ERR_EXPERT_ID_RANGE 2  // the experts-only entry: a caller's expert id outside 0..R-1 (topk.cu)
// NaN router scores or weights (NaN in x, or an inf logit under softmax; weights are refused non-finite
// at load): a pick that finds no non-NaN score is id -1 with weight 0, a NaN weight is kept (lora_common.cuh: 4)
#define ERR_ROUTER_NAN 8
#define NO_PICK 0x7fffffff  // a selection round that found no choosable entry

// The score of a logit x where it is element-wise (scoring sigmoid or sqrtsoftplus):
// sigmoid(x), or sqrt(softplus(x)) with softplus = log(1 + e^x) computed without overflow.
__device__ __forceinline__ float elementwise_score(float x, int scoring) {
    if (scoring == SCORE_SIGMOID) return sigmoidf_(x);
    return sqrtf(x > 20.0f ? x : log1pf(expf(x)));
}

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
    int bi = NO_PICK;
    for (int i = lo + lane; i < hi; i += 32) argmax_merge(best, bi, v[i], i);
    warp_argmax(best, bi);
    return bi;
}

// The selection order of a score as an unsigned key: a larger score has a larger key; NaN
// (and a taken entry) is 0, never chosen; -0.0 keys as +0.0, the two being equal scores.
__device__ __forceinline__ unsigned select_key(float v) {
    if (v != v) return 0u;
    const unsigned u = __float_as_uint(v + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A lane's best entry of its V keys: the largest, the lowest register (so the lowest expert
// id, entry lane + 32 j) among equals; key 0 when none is left.
template <int V>
__device__ __forceinline__ void lane_best(const unsigned (&key)[V], unsigned& bk, int& bj) {
    bk = 0u;
    bj = 0;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (key[j] > bk) {
            bk = key[j];
            bj = j;
        }
}

// p = softmax(x) over a warp's register entries, those where valid(j) holds (the others
// 0): the max and the sum across the warp, each lane's terms summed in j order. In place
// (p the same array as x) is fine: entry j is read before it is written.
template <int V, class Valid>
__device__ __forceinline__ void warp_softmax_regs(const float (&x)[V], float (&p)[V], Valid valid) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (valid(j)) m = fmaxf(m, x[j]);
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        p[j] = valid(j) ? expf(x[j] - m) : 0.0f;
        sum += p[j];
    }
    const float inv = 1.0f / warp_sum(sum);
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] *= inv;
}

// The score a key stands for (select_key's inverse; key 0, NaN, as -inf: the group scores'
// convention).
__device__ __forceinline__ float key_score(unsigned key) {
    if (key == 0u) return -INFINITY;
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The k <= 32 largest of the warp's keys (V a lane, entry lane + 32 j), largest first and ties
// to the lower id, as k rounds of a warp max and a min over the tied ids pick them; pick t
// (its id and val) to lane t. Without rounds: T, the k-th largest of the lanes' maxima, bounds
// the k-th largest key from below, so the picks are among the entries at or above it; those
// (when at most 32) go one a lane through `scratch` (64 ints of shared memory), and each
// one's rank in that order is counted against the others by shuffles: independent shuffles
// instead of k dependent rounds (a max, a min and the winner's lane rescanning). false,
// nothing picked (the caller then runs the rounds): fewer than k lanes hold a choosable
// key, or more than 32 entries reach T.
template <int V>
__device__ __forceinline__ bool warp_select_by_rank(const unsigned (&key)[V], const float (&val)[V],
                                                    unsigned lane_max, int k, int* scratch, int lane, int& id,
                                                    float& v) {
    // T is kth_largest_lane_key's value, found by each lane's rank among the lanes' maxima
    // (larger first, then the lower lane): 32 independent shuffles, not k dependent rounds
    int r = 0;
#pragma unroll
    for (int q = 0; q < 32; ++q) {
        const unsigned mq = __shfl_sync(CUPYMOE_FULL_MASK, lane_max, q);
        r += mq > lane_max || (mq == lane_max && q < lane);
    }
    const unsigned T = __shfl_sync(CUPYMOE_FULL_MASK, lane_max, __ffs(__ballot_sync(CUPYMOE_FULL_MASK, r == k - 1)) - 1);
    if (T == 0u) return false;
    int n = 0;  // this lane's entries at or above T (k of them at least: the best k lanes' maxima)
#pragma unroll
    for (int j = 0; j < V; ++j) n += key[j] >= T;
    int C;
    const int incl = warp_inclusive_scan(n, lane, C);
    if (C > 32) return false;
    unsigned* ck = reinterpret_cast<unsigned*>(scratch);
    int* ci = scratch + 32;
    int at = incl - n;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (key[j] >= T) {
            ck[at] = key[j];
            ci[at++] = lane + 32 * j;
        }
    __syncwarp();
    const unsigned mk = lane < C ? ck[lane] : 0u;
    const int mi = lane < C ? ci[lane] : 0x7fffffff;
    __syncwarp();
    int rank = 0;  // candidates before this one: a larger key, or the same key and a lower id
#pragma unroll
    for (int q = 0; q < 32; ++q) {
        const unsigned kq = __shfl_sync(CUPYMOE_FULL_MASK, mk, q);
        const int iq = __shfl_sync(CUPYMOE_FULL_MASK, mi, q);
        rank += q < C && (kq > mk || (kq == mk && iq < mi));
    }
    if (lane < C) scratch[rank] = mi;  // the ranks are 0 .. C - 1, each once
    __syncwarp();
    id = lane < k ? scratch[lane] : 0x7fffffff;
    __syncwarp();
    v = 0.0f;
    const int src = id & 31, reg = id >> 5;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const float x = __shfl_sync(CUPYMOE_FULL_MASK, val[j], src);
        if (j == reg) v = x;
    }
    if (lane >= k) v = 0.0f;
    return true;
}

// Whether route_row_regs<V> serves a row of this router: no hash table, at most 32 V
// scores, and groups (if any) made of whole registers (E / n_group a multiple of 32).
__device__ __forceinline__ bool regs_route_fits(int V, int R, int E, int n_group, const int* tid2eid) {
    if (tid2eid || R > 32 * V) return false;
    return n_group <= 1 || (n_group <= 32 && E % n_group == 0 && (E / n_group) % 32 == 0);
}

// route_row with the row's scores in registers (entry lane + 32 j in register j): k <= 32
// picks by rank (warp_select_by_rank), else (and where it declines) k rounds, each a warp
// max of the lanes' best keys and a warp min of the tied ids (REDUX), where the
// shared-memory path re-reads R scores and runs a shuffle arg-max; a group's score from two
// warp max reductions where it is one register, else warp top-2 merges of whole registers.
// Same choices as the shared-memory path (ties to the lower id, NaN never chosen), so the
// ids agree; the weights' renormalising sum runs as a warp tree. The ids also go to sel_out
// (shared memory, TOPK_MAX_K ints, also warp_select_by_rank's scratch) for the expert lists
// of decode_route_lists.
template <int V>
__device__ __forceinline__ void route_row_regs(int row, int* sel_out, const float* logits,
                                               const float* __restrict__ corr_bias, int* __restrict__ ids_out,
                                               float* __restrict__ w_out, int* __restrict__ err, int R, int E,
                                               int k, int scoring, int n_group, int topk_group,
                                               int topk_then_softmax, int renorm, float scale, int lane) {
    const float* l = logits + (size_t)row * R;
    float s[V], c[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int i = lane + 32 * j;
        c[j] = i < R ? l[i] : NAN;  // past R: NaN, never chosen
        s[j] = i < R && corr_bias ? corr_bias[i] : 0.0f;  // the correction bias, for now
    }
    // 1. scores s and selection scores c
    if (topk_then_softmax) {
        // c are the logits; the weights come from the chosen ones
    } else if (scoring == SCORE_SOFTMAX) {
        warp_softmax_regs(c, c, [&](int j) { return lane + 32 * j < R; });
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float b = s[j];
            s[j] = c[j];
            c[j] = lane + 32 * j < R ? s[j] + b : NAN;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float v = elementwise_score(c[j], scoring);
            const float b = s[j];
            s[j] = v;
            c[j] = lane + 32 * j < R ? v + b : NAN;
        }
    }

    // 2. groups: a group's score is the sum of its two largest c (NaN ignored); entries of
    // groups outside the topk_group best (ties: lower group) are set to -inf
    if (n_group > 1) {
        const int per = E / n_group / 32;  // registers a group
        float gs[32 > V ? V : 32];         // n_group <= E / 32 <= V
        float best_g[32 > V ? V : 32];
#pragma unroll
        for (int g = 0; g < (32 > V ? V : 32); ++g) gs[g] = best_g[g] = -INFINITY;
        if (per == 1) {
            // a group is one register (deepseek-v3: 8 of 32 experts): its two largest by two
            // warp max reductions of the keys, every group's independent of the others' (a
            // shorter path than the lane merges below: 5 shuffle rounds of every group's top
            // two). The same values: keys order the scores as the float compares do, NaN
            // (key 0) as -inf.
#pragma unroll
            for (int g = 0; g < (32 > V ? V : 32); ++g) {
                const unsigned kg = g < n_group && lane + 32 * g < E ? select_key(c[g]) : 0u;
                const unsigned k1 = __reduce_max_sync(CUPYMOE_FULL_MASK, kg);
                const unsigned holders = __ballot_sync(CUPYMOE_FULL_MASK, kg == k1);
                const unsigned k2 = __popc(holders) > 1
                                        ? k1
                                        : __reduce_max_sync(CUPYMOE_FULL_MASK, kg == k1 ? 0u : kg);
                best_g[g] = key_score(k1);
                gs[g] = key_score(k2);
            }
        }
#pragma unroll
        for (int j = 0; j < V && per > 1; ++j) {  // each lane's top two of each group
            const int g = j / per;
            const float v = c[j] == c[j] ? c[j] : -INFINITY;
            if (lane + 32 * j < E) {
#pragma unroll
                for (int h = 0; h < (32 > V ? V : 32); ++h)
                    if (h == g) {
                        const float lo = fminf(best_g[h], v);
                        best_g[h] = fmaxf(best_g[h], v);
                        gs[h] = fmaxf(gs[h], lo);
                    }
            }
        }
#pragma unroll
        for (int o = 16; o > 0 && per > 1; o >>= 1) {  // merge the lanes' top twos (every group at once)
#pragma unroll
            for (int h = 0; h < (32 > V ? V : 32); ++h) {
                const float b1 = __shfl_xor_sync(CUPYMOE_FULL_MASK, best_g[h], o);
                const float b2 = __shfl_xor_sync(CUPYMOE_FULL_MASK, gs[h], o);
                const float lo = fminf(best_g[h], b1);
                best_g[h] = fmaxf(best_g[h], b1);
                gs[h] = fmaxf(lo, fmaxf(gs[h], b2));
            }
        }
        unsigned kept = 0u;  // every lane has every group's score: select on each lane alike
        for (int t = 0; t < topk_group; ++t) {
            float bv = -INFINITY;
            int bg = -1;
#pragma unroll
            for (int h = 0; h < (32 > V ? V : 32); ++h) {
                const float v = best_g[h] + gs[h];
                if (h < n_group && !((kept >> h) & 1u) && (bg < 0 || v > bv)) {
                    bv = v;
                    bg = h;
                }
            }
            if (bg >= 0) kept |= 1u << bg;
        }
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (lane + 32 * j < E && !((kept >> (j / per)) & 1u)) c[j] = -INFINITY;
    }

    // 3. selection: by rank where it serves (k <= 32: warp_select_by_rank), else k rounds of
    // the warp's largest key, then the lowest id holding it
    unsigned key[V];
#pragma unroll
    for (int j = 0; j < V; ++j) key[j] = select_key(c[j]);
    unsigned bk;
    int bj;
    lane_best(key, bk, bj);
    int my_id[2] = {NO_PICK, NO_PICK};  // round lane and lane + 32 (k <= TOPK_MAX_K)
    float my_v[2] = {0.0f, 0.0f};
    float val[V];  // a pick's weight source: its logit (topk_then_softmax) or its score
#pragma unroll
    for (int j = 0; j < V; ++j) val[j] = topk_then_softmax ? c[j] : s[j];
    const bool ranked = k <= 32 && sel_out && warp_select_by_rank(key, val, bk, k, sel_out, lane, my_id[0], my_v[0]);
    for (int t = 0; t < (ranked ? 0 : k); ++t) {
        const unsigned m = __reduce_max_sync(CUPYMOE_FULL_MASK, bk);
        const int win = __reduce_min_sync(CUPYMOE_FULL_MASK, m != 0u && bk == m ? lane + 32 * bj : NO_PICK);
        float v = 0.0f;  // the winner's weight source (val)
        const int wj = win >> 5;
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (j == wj) v = val[j];
        v = __shfl_sync(CUPYMOE_FULL_MASK, v, win & 31);
        if (win != NO_PICK && lane == (win & 31)) {
#pragma unroll
            for (int j = 0; j < V; ++j)
                if (j == wj) key[j] = 0u;
            lane_best(key, bk, bj);
        }
        if (lane == (t & 31)) {  // (two named registers: an index would put them in local memory)
            const float mv = win != NO_PICK ? v : 0.0f;
            if (t < 32) {
                my_id[0] = win;
                my_v[0] = mv;
            } else {
                my_id[1] = win;
                my_v[1] = mv;
            }
        }
    }

    // 4. routing weights (lanes t, t + 32 hold round t's; a round that found nothing weighs 0)
    float w[2];
    float part = 0.0f;
    if (topk_then_softmax) {
        const float m = __shfl_sync(CUPYMOE_FULL_MASK, my_v[0], 0);  // the first pick is the largest logit
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            w[h] = lane + 32 * h < k && my_id[h] != NO_PICK ? expf(my_v[h] - m) : 0.0f;
            part += w[h];
        }
        const float sum = warp_sum(part);
#pragma unroll
        for (int h = 0; h < 2; ++h) w[h] = w[h] / sum * scale;
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            w[h] = lane + 32 * h < k ? my_v[h] : 0.0f;
            part += w[h];
        }
        const float sum = warp_sum(part);
        const float inv = renorm ? 1.0f / (sum + 1e-20f) : 1.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) w[h] = w[h] * inv * scale;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int t = lane + 32 * h;
        if (t < k) {
            const bool picked = my_id[h] != NO_PICK;
            if (!picked || w[h] != w[h]) atomicOr(err, ERR_ROUTER_NAN);
            ids_out[(size_t)row * k + t] = picked ? my_id[h] : -1;
            w_out[(size_t)row * k + t] = picked ? w[h] : 0.0f;
            if (sel_out) sel_out[t] = picked ? my_id[h] : -1;
        }
    }
}

// The k-th largest of the lanes' keys v (0 when fewer than k lanes hold a nonzero one): k
// rounds of a warp max, each taking out the lowest lane that holds it.
__device__ __forceinline__ unsigned kth_largest_lane_key(unsigned v, int k, int lane) {
    unsigned T = 0u;
    for (int t = 0; t < k; ++t) {
        T = __reduce_max_sync(CUPYMOE_FULL_MASK, v);
        const unsigned holders = __ballot_sync(CUPYMOE_FULL_MASK, v == T);
        if (lane == __ffs(holders) - 1) v = 0u;
    }
    return T;
}

// The k (<= 32) best entries of c[0, R) into sel[0, k), exactly as k rounds of warp_select
// pick them (largest first, ties to the lower id, NaN never): the k-th largest of the
// lanes' maxima bounds the k-th largest entry from below, so only entries at or above it
// can be chosen; when at most 32 are (nearly always), they go one a lane through sel's 64
// ints (keys, then ids) and each round is two warp reductions. A round of warp_select
// re-reads all R entries and runs a 5-step shuffle arg-max (qwen3-next-80b: R = 512, k =
// 10). false, sel used as scratch only: more than 32 candidates, or fewer than k
// choosable lane maxima; the caller then runs the k rounds.
__device__ __forceinline__ bool warp_topk_by_threshold(const float* c, int R, int k, int* sel, int lane) {
    unsigned best = 0u;
    for (int i = lane; i < R; i += 32) best = max(best, select_key(c[i]));
    const unsigned T = kth_largest_lane_key(best, k, lane);  // the k-th largest lane maximum
    if (T == 0u) return false;
    int n = 0;  // this lane's candidates, then where they go
    for (int i = lane; i < R; i += 32) n += select_key(c[i]) >= T ? 1 : 0;
    int C;
    const int incl = warp_inclusive_scan(n, lane, C);
    if (C > 32) return false;
    unsigned* ck = reinterpret_cast<unsigned*>(sel);
    int* ci = sel + 32;
    int at = incl - n;
    for (int i = lane; i < R; i += 32) {
        const unsigned key = select_key(c[i]);
        if (key >= T) {
            ck[at] = key;
            ci[at++] = i;
        }
    }
    __syncwarp();
    unsigned mk = lane < C ? ck[lane] : 0u;
    const int mi = lane < C ? ci[lane] : 0x7fffffff;
    __syncwarp();
    for (int t = 0; t < k; ++t) {  // C >= k candidates: every round finds one
        const unsigned m = __reduce_max_sync(CUPYMOE_FULL_MASK, mk);
        const int win = __reduce_min_sync(CUPYMOE_FULL_MASK, mk == m ? mi : 0x7fffffff);
        if (mi == win) mk = 0u;
        if (lane == 0) sel[t] = win;
    }
    __syncwarp();
    return true;
}

// Whether route_row_vec<Q> serves a row of this router (topk_route's common case): no
// hash table, no groups, k <= 32, R a multiple of 4 from 16 up to 128 Q (Q float4 loads a
// lane; its 96-float candidate scratch fits the warp's 2 R + TOPK_MAX_K).
#define ROUTE_MAX_COPIES 4  // a split router's logits copies at most (catalog.ROUTER_MAX_SPLITS)
__device__ __forceinline__ bool vec_route_fits(int Q, int R, int k, int n_group, const int* tid2eid) {
    return !tid2eid && n_group <= 1 && k <= 32 && (R & 3) == 0 && R >= 16 && R <= 128 * Q;
}

// route_row for topk_route's many rows, from registers: lane L holds entries 128 q + 4 L
// + c (one float4 load per q), and selection is warp_topk_by_threshold's with the scan
// over registers: the k-th largest lane maximum T bounds the k-th largest score from
// below, so only entries at or above it are candidates; at most 32 go one a lane through
// `cand` (shared: keys, ids, scores) and each of the k rounds is two warp reductions. Same
// choices (the largest selection score, ties to the lower id, NaN never). The shared-memory
// path is issue-bound over many rows (~1900 warp instructions a row): it loops over R three
// times per step and its lane 0 computes the weights alone. Returns false, having written nothing, where more than
// 32 entries tie at the threshold or fewer than k are choosable: the caller routes the row
// by route_row. Softmax sums its row in another order than route_row (per-lane sums over
// other entries), so a weight may differ from route_row's in its last bits. `sel_out`
// (optional) gets the ids too, as route_row_regs' (decode_topk_lists builds its lists from
// them in shared memory). `copies` > 1: the logits are a split router's copies `copy_stride`
// floats apart, summed here in split order (topk.cu sum_logit_splits' sums, in registers).
template <int Q>
__device__ __forceinline__ bool route_row_vec(int row, float* cand, const float* logits,
                                              const float* __restrict__ corr_bias, int* __restrict__ ids_out,
                                              float* __restrict__ w_out, int R, int k, int scoring,
                                              int topk_then_softmax, int renorm, float scale, int* err, int lane,
                                              int* sel_out = nullptr, int copies = 1, size_t copy_stride = 0) {
    constexpr int V = 4 * Q;
    const float* l = logits + (size_t)row * R;
    float c[V], s[V];  // selection scores, weight sources (entry 128 (j / 4) + 4 lane + j % 4)
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        const int i = 128 * q + 4 * lane;
        float4 v = make_float4(NAN, NAN, NAN, NAN);  // past R: NaN, never chosen
        if (i < R) v = *reinterpret_cast<const float4*>(l + i);
        if (copies > 1 && i < R) {  // a split router's copies, every load in flight, added in split order
            float4 more[ROUTE_MAX_COPIES - 1];
#pragma unroll
            for (int z = 1; z < ROUTE_MAX_COPIES; ++z)
                more[z - 1] = z < copies ? *reinterpret_cast<const float4*>(l + z * copy_stride + i)
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int z = 1; z < ROUTE_MAX_COPIES; ++z)
                if (z < copies) {
                    v.x += more[z - 1].x;
                    v.y += more[z - 1].y;
                    v.z += more[z - 1].z;
                    v.w += more[z - 1].w;
                }
        }
        c[4 * q] = v.x;
        c[4 * q + 1] = v.y;
        c[4 * q + 2] = v.z;
        c[4 * q + 3] = v.w;
    }
    auto valid = [&](int j) { return 128 * (j >> 2) + 4 * lane + (j & 3) < R; };
    // 1. scores s and selection scores c (route_row's arithmetic, element by element)
    if (topk_then_softmax) {
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] = c[j];  // the weights come from the chosen logits
    } else if (scoring == SCORE_SOFTMAX) {
        warp_softmax_regs(c, s, valid);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] = elementwise_score(c[j], scoring);
    }
    if (!topk_then_softmax) {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int i = 128 * q + 4 * lane;
            float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (corr_bias && i < R) b = *reinterpret_cast<const float4*>(corr_bias + i);
            c[4 * q] = valid(4 * q) ? s[4 * q] + b.x : NAN;
            c[4 * q + 1] = valid(4 * q + 1) ? s[4 * q + 1] + b.y : NAN;
            c[4 * q + 2] = valid(4 * q + 2) ? s[4 * q + 2] + b.z : NAN;
            c[4 * q + 3] = valid(4 * q + 3) ? s[4 * q + 3] + b.w : NAN;
        }
    }

    // 2. the threshold: the k-th largest of the lanes' maxima
    unsigned key[V], best = 0u;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        key[j] = select_key(c[j]);
        best = max(best, key[j]);
    }
    const unsigned T = kth_largest_lane_key(best, k, lane);
    if (T == 0u) return false;
    int n = 0;  // this lane's candidates, then where they go
#pragma unroll
    for (int j = 0; j < V; ++j) n += key[j] >= T ? 1 : 0;
    int C;
    const int incl = warp_inclusive_scan(n, lane, C);
    if (C > 32) return false;
    unsigned* ck = reinterpret_cast<unsigned*>(cand);
    int* ci = reinterpret_cast<int*>(cand + 32);
    float* cs = cand + 64;
    int at = incl - n;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (key[j] >= T) {
            ck[at] = key[j];
            ci[at] = 128 * (j >> 2) + 4 * lane + (j & 3);
            cs[at++] = s[j];
        }
    __syncwarp();
    unsigned mk = lane < C ? ck[lane] : 0u;
    const int mi = lane < C ? ci[lane] : 0x7fffffff;
    const float ms = lane < C ? cs[lane] : 0.0f;
    __syncwarp();

    // 3. k rounds over the candidates, one a lane: lane t keeps round t's id and source
    int my_id = 0x7fffffff;
    float my_v = 0.0f;
    for (int t = 0; t < k; ++t) {  // C >= k candidates: every round finds one
        const unsigned m = __reduce_max_sync(CUPYMOE_FULL_MASK, mk);
        const int win = __reduce_min_sync(CUPYMOE_FULL_MASK, mk == m ? mi : 0x7fffffff);
        const unsigned holder = __ballot_sync(CUPYMOE_FULL_MASK, mi == win);
        const float wv = __shfl_sync(CUPYMOE_FULL_MASK, ms, __ffs(holder) - 1);
        if (mi == win) mk = 0u;
        if (lane == t) {
            my_id = win;
            my_v = wv;
        }
    }

    // 4. routing weights, as route_row_regs makes them (a warp sum over the k lanes)
    float w;
    if (topk_then_softmax) {
        const float m = __shfl_sync(CUPYMOE_FULL_MASK, my_v, 0);  // the first pick is the largest logit
        w = lane < k ? expf(my_v - m) : 0.0f;
        const float sum = warp_sum(w);
        w = w / sum * scale;
    } else {
        w = lane < k ? my_v : 0.0f;
        const float sum = warp_sum(w);
        const float inv = renorm ? 1.0f / (sum + 1e-20f) : 1.0f;
        w = w * inv * scale;
    }
    if (sel_out) __syncwarp();  // (sel_out may overlap `cand`, whose reads are done above)
    if (lane < k) {
        if (w != w) atomicOr(err, ERR_ROUTER_NAN);  // an inf logit's softmax
        ids_out[(size_t)row * k + lane] = my_id;
        w_out[(size_t)row * k + lane] = w;
        if (sel_out) sel_out[lane] = my_id;
    }
    return true;
}

// Routes one row with one warp: its k expert ids and weights into ids_out / w_out[row, :].
// `s` is the warp's shared scratch of 2 R + TOPK_MAX_K floats; its last TOPK_MAX_K hold
// the row's ids afterwards (decode_route_lists builds the expert lists from them).
// `regs`: route_row_regs where it fits. The fused decode launch, one row a warp and bound
// by the row's latency, takes it; topk_route over thousands of rows is bound by throughput
// instead and measured the same or slower with it, so it keeps the shared-memory path.
// `logits` is not __restrict__: topk_route writes a split router's sum into it first, so it
// must not be read through the read-only (non-coherent) path.
__device__ __forceinline__ void route_row(int row, float* s, const float* logits,
                                          const float* __restrict__ corr_bias, const int* __restrict__ tid2eid,
                                          const int* __restrict__ token_ids, int* __restrict__ ids_out,
                                          float* __restrict__ w_out, int* __restrict__ err, int R, int E, int k,
                                          int scoring, int n_group, int topk_group, int topk_then_softmax, int renorm,
                                          float scale, int vocab, int lane, bool regs) {
    float* c = s + R;
    int* sel = reinterpret_cast<int*>(c + R);
    if (regs && regs_route_fits(8, R, E, n_group, tid2eid)) {
        route_row_regs<8>(row, sel, logits, corr_bias, ids_out, w_out, err, R, E, k, scoring, n_group, topk_group,
                          topk_then_softmax, renorm, scale, lane);
        return;
    }
    if (regs && regs_route_fits(16, R, E, n_group, tid2eid)) {
        route_row_regs<16>(row, sel, logits, corr_bias, ids_out, w_out, err, R, E, k, scoring, n_group, topk_group,
                           topk_then_softmax, renorm, scale, lane);
        return;
    }
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
            const float v = elementwise_score(l[i], scoring);
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
            __syncwarp();  // every lane's group scan read c before any lane overwrites it
            for (int i = lane; i < E; i += 32)
                if (!((kept >> (i / G)) & 1u)) c[i] = -INFINITY;
            __syncwarp();
        }
        if (!(k <= 32 && warp_topk_by_threshold(c, R, k, sel, lane))) {
            for (int j = 0; j < k; ++j) {
                const int bi = warp_select(c, 0, R, lane);
                if (lane == 0) {
                    sel[j] = bi == NO_PICK ? -1 : bi;
                    if (bi != NO_PICK) c[bi] = NAN;
                    else atomicOr(err, ERR_ROUTER_NAN);
                }
                __syncwarp();
            }
        }
    }
    __syncwarp();

    // 3. routing weights: s at the chosen ids (or softmax over the k chosen logits)
    if (lane == 0) {
        float* w = w_out + (size_t)row * k;
        int* ids = ids_out + (size_t)row * k;
        float sum = 0.0f;
        if (topk_then_softmax) {
            const float m = sel[0] >= 0 ? l[sel[0]] : 0.0f;  // the first pick is the largest logit
            for (int j = 0; j < k; ++j) {
                const float e = sel[j] >= 0 ? expf(l[sel[j]] - m) : 0.0f;
                w[j] = e;
                sum += e;
            }
            for (int j = 0; j < k; ++j) w[j] = sel[j] >= 0 ? w[j] / sum * scale : 0.0f;  // (an inf logit: NaN)
        } else {
            for (int j = 0; j < k; ++j) {
                const float v = sel[j] >= 0 ? s[sel[j]] : 0.0f;
                w[j] = v;
                sum += v;
            }
            const float inv = renorm ? 1.0f / (sum + 1e-20f) : 1.0f;
            for (int j = 0; j < k; ++j) w[j] = w[j] * inv * scale;
        }
        for (int j = 0; j < k; ++j) {
            ids[j] = sel[j];
            if (w[j] != w[j]) atomicOr(err, ERR_ROUTER_NAN);
        }
    }
}

// One row's routing as topk_route does it (and decode_topk_lists, which must give its very
// bits): the register path route_row_vec<Q> where it serves the router (Q = 1, 2 or, when
// MAX_Q allows, 4 registers of 128 logits a lane); with GROUP_REGS (on sm_90+), group-limited
// routers whose groups are whole registers and R <= 256 (deepseek-v3) by route_row_regs<8>, as
// decode_route_lists routes them (the kernels instantiate it for group-limited routers only:
// its code made the ungrouped instances slower); else the shared-memory
// route_row. `scratch`: the warp's 2 R + TOPK_MAX_K floats.
template <int MAX_Q, bool GROUP_REGS, bool KEEP_IDS = false>
__device__ __forceinline__ void route_row_topk(int row, float* scratch, const float* logits,
                                               const float* __restrict__ corr_bias, const int* __restrict__ tid2eid,
                                               const int* __restrict__ token_ids, int* __restrict__ ids_out,
                                               float* __restrict__ w_out, int* __restrict__ err, int R, int E, int k,
                                               int scoring, int n_group, int topk_group, int topk_then_softmax,
                                               int renorm, float scale, int vocab, int lane) {
    // KEEP_IDS: route_row_vec leaves the row's ids at scratch + 2 R too, as the other two do
    int* kept_ids = KEEP_IDS ? reinterpret_cast<int*>(scratch + 2 * R) : nullptr;
    bool done = false;
    if (vec_route_fits(4, R, k, n_group, tid2eid)) {
        if (R <= 128)
            done = route_row_vec<1>(row, scratch, logits, corr_bias, ids_out, w_out, R, k, scoring, topk_then_softmax,
                                    renorm, scale, err, lane, kept_ids);
        else if (R <= 256)
            done = route_row_vec<2>(row, scratch, logits, corr_bias, ids_out, w_out, R, k, scoring, topk_then_softmax,
                                    renorm, scale, err, lane, kept_ids);
        else if (MAX_Q >= 4)  // (the instantiation without it names route_row_vec<2> here, never run)
            done = route_row_vec<(MAX_Q >= 4 ? 4 : 2)>(row, scratch, logits, corr_bias, ids_out, w_out, R, k, scoring,
                                                      topk_then_softmax, renorm, scale, err, lane, kept_ids);
    }
    // (sm_90+ only: on sm_80 decode_topk_lists' 64 registers spilled with it, and both kernels
    // must route alike)
    if (GROUP_REGS && CUPYMOE_SM >= 90 && !done && n_group > 1 && regs_route_fits(8, R, E, n_group, tid2eid)) {
        route_row_regs<8>(row, reinterpret_cast<int*>(scratch + 2 * R), logits, corr_bias, ids_out, w_out, err, R, E, k,
                          scoring, n_group, topk_group, topk_then_softmax, renorm, scale, lane);
        done = true;
    }
    if (!done)
        route_row(row, scratch, logits, corr_bias, tid2eid, token_ids, ids_out, w_out, err, R, E, k, scoring, n_group,
                  topk_group, topk_then_softmax, renorm, scale, vocab, lane, false);
}
