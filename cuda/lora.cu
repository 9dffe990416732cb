// LoRA (DESIGN.md section 1, step 7; cupymoe/lora_slots.py owns the buffers): the router's
// delta, added to the logits between the router and the routing stage, so it can change the
// routing; the routed and shared experts' deltas, added per (row, expert) pair to the
// pre-activation g, u the LoRA plans' gate/up stores side by side (ACT_PAIR) and to the
// expert's output before the routing weight (DESIGN.md section 9).
#include "gemm_common.cuh"  // mma_bf16, pack_bf16x2
#include "lora_common.cuh"

// Early start (DESIGN.md section 9): in the decode chain a per-pair kernel follows by PDL a base
// kernel that released it only after that kernel's own wait, so when its blocks start everything
// before that base kernel is done: the forward's input, the routing, act for down (and lora_part,
// lora_tickets, which no kernel in between uses). So the shrink, the ticket and the expand of the
// first LORA_HOLD* block-wide column steps (held in registers) run beside the base kernel, and the
// PDL wait comes only before the base output is read (g, u; y / acc / yw; the logits); wider
// outputs go on after it in rounds of as many columns, each round's loads together. A block
// with nothing to add leaves before it, but block 0 always waits (pdl_leave_early's rule: the grid
// never completes before the kernel it follows), through the one wait site. Launched plainly
// (prefill, separated plans) the wait is a no-op and the launch order covers everything. The
// arithmetic is the waiting form's (same operations, same order), so the bits are too.
#define LORA_HOLD_ROUTER 1  // logits a thread holds: R <= 256 at LORA_THREADS
// The router delta's shrink: every lane of the block on the rank rows (16 lanes a rank row at
// max_rank 16; 8 left half the block idle), half the dependent steps a lane.
#ifndef LORA_ROUTER_TPR
#define LORA_ROUTER_TPR 16
#endif
#define LORA_HOLD 8         // gate/up columns a thread holds (g's and u's deltas): I <= 2048
#define LORA_HOLD_DOWN 16   // down columns a thread holds: H <= 4096
// The down delta's shrink (by_cols: a block a pair's whole I, a chain of dependent loads): every
// lane of the block on the rank rows (max_rank 16 at LORA_THREADS) and 8 vectors a lane in flight
// (sm_90's 64 registers hold them; ptxas spills them elsewhere): fewer steps a lane (DECISIONS).
#ifndef LORA_DOWN_TPR
#define LORA_DOWN_TPR 16
#endif
#ifndef LORA_DOWN_VPT
#if CUPYMOE_SM >= 90
#define LORA_DOWN_VPT 8
#else
#define LORA_DOWN_VPT 4
#endif
#endif
// The held kernels' bounds on sm_90 (PDL): 4 blocks an SM, 64 registers, so one fits beside two
// swap-AB decode blocks (decode_swapab_*<64>: 148 registers x 160 threads each), where it starts
// early; sm_80 (no PDL, nothing starts early) is left unbounded.
#if CUPYMOE_SM >= 90
#define LORA_HELD_BOUNDS __launch_bounds__(LORA_THREADS, 4)
#else
#define LORA_HELD_BOUNDS __launch_bounds__(LORA_THREADS)
#endif

// B rows lo .. hi (bf16 [rows, max_rank]) into L2, a 128-byte line a thread: a block's expand
// rows fetched while its shrink runs, their loads coming only after it.
__device__ __forceinline__ void lora_prefetch_rows(const bf16* b, int lo, int hi, int max_rank) {
    const char* p = reinterpret_cast<const char*>(b + (size_t)lo * max_rank);
    const int bytes = (hi - lo) * max_rank * (int)sizeof(bf16);
    for (int o = threadIdx.x * 128; o < bytes; o += blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

// Whether this is the grid's block 0: the one that waits (PDL) even with nothing to add.
__device__ __forceinline__ bool lora_block0() { return (blockIdx.x | blockIdx.y | blockIdx.z) == 0; }

// After lora_slice_shrink into t (n = NP max_rank floats) over slice blockIdx.y of S: whether this
// block goes on to the expand, with t = the pair's rank sums (slices in order) times scale (s0 for
// rows < max_rank, s1 past). One slice: at once. More: publish, ticket, the last block sums.
__device__ __forceinline__ bool lora_slices_meet(float* t, int n, int max_rank, float s0, float s1,
                                                 float* __restrict__ part, int* __restrict__ tickets, int q,
                                                 int S) {
    const int s = blockIdx.y;
    __syncthreads();
    if (S == 1) {
        for (int e = threadIdx.x; e < n; e += blockDim.x) t[e] *= e < max_rank ? s0 : s1;
        __syncthreads();
        return true;
    }
    int* last = reinterpret_cast<int*>(t + n);
    float* mine = part + ((size_t)q * S + s) * n;
    for (int e = threadIdx.x; e < n; e += blockDim.x) mine[e] = t[e];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(tickets + q, 1) == S - 1;
        if (done) tickets[q] = 0;  // zeros between forwards
        *last = done;
    }
    __syncthreads();
    if (!*last) return false;
    __threadfence();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        const float* pe = part + (size_t)q * S * n + e;
        float sum = 0.f;
        for (int i = 0; i < S; ++i) sum += __ldcg(pe + (size_t)i * n);
        t[e] = sum * (e < max_rank ? s0 : s1);
    }
    __syncthreads();
    return true;
}

// grid (N, slices), block LORA_THREADS, max_rank + LORA_RED floats of shared memory: t = A[slot] x
// (x's slice a block), then logits[row] += Bs[slot] t by the row's last block. A [K, max_rank, H]
// and Bs = scale * B [K, R, max_rank] are fp32, zero past an adapter's rank (and all zero in an
// empty slot), so every slot runs the same loops. Rows with id -1 leave at once; an id >= K sets
// an error bit and adds nothing. A row's delta reads that row alone (row_invariant holds at a
// fixed slice count). Early start (above): everything but the logits' read-modify-write goes
// beside the router.
__global__ void __launch_bounds__(LORA_THREADS)
lora_router_delta(const bf16* __restrict__ x,       // [N, H]: the router's input
                  const int* __restrict__ lora_ids,  // [N]: -1 = base only
                  const float* __restrict__ a,       // [K, max_rank, H]
                  const float* __restrict__ bs,      // [K, R, max_rank]
                  float* __restrict__ logits,        // [N, R] (a split router's copy 0)
                  float* __restrict__ part, int* __restrict__ tickets, int* __restrict__ err, int N, int H, int R,
                  int max_rank, int max_loras) {
    extern __shared__ float t[];  // [max_rank], then LORA_RED
    const int row = blockIdx.x;
    const int slot = row < N ? lora_ids[row] : -1;
    if (lora_id_invalid(slot, max_loras) && blockIdx.y == 0 && threadIdx.x == 0) atomicOr(err, ERR_LORA_ID_RANGE);  // err only ORed
    bool add = slot >= 0 && slot < max_loras;  // block-uniform
    if (add) {
        int lo, hi;
        lora_slice(H, blockIdx.y, gridDim.y, lo, hi);
        const float* as = a + (size_t)slot * max_rank * H;
        lora_slice_shrink<1, true, LORA_ROUTER_TPR>(t, as, as, x + (size_t)row * H, lo, hi, H, max_rank);
        add = lora_slices_meet(t, max_rank, max_rank, 1.0f, 1.0f, part, tickets, row, gridDim.y);
    }
    if (!add && !lora_block0()) return;  // block 0 waits anyway; one wait site (two made ptxas spill)
    const float* b = bs + (size_t)(add ? slot : 0) * R * max_rank;
    float held[LORA_HOLD_ROUTER];
#pragma unroll
    for (int i = 0; i < LORA_HOLD_ROUTER; ++i) {
        const int e = threadIdx.x + i * blockDim.x;
        held[i] = add && e < R ? lora_router_dot(b + (size_t)e * max_rank, t, max_rank) : 0.f;
    }
    pdl_wait_then_release_next();  // the router's logits from here on
    if (!add) return;
    float* l = logits + (size_t)row * R;
#pragma unroll
    for (int i = 0; i < LORA_HOLD_ROUTER; ++i) {
        const int e = threadIdx.x + i * blockDim.x;
        if (e < R) l[e] += held[i];
    }
    for (int e = threadIdx.x + LORA_HOLD_ROUTER * blockDim.x; e < R; e += blockDim.x)
        l[e] += lora_router_dot(b + (size_t)e * max_rank, t, max_rank);
}

// The expert deltas' per-pair geometry: pair q of N k routed pairs, then (has_shared) the shared
// expert's pair of each row at N k + row. pos: the pair's position in the sorted buffers (act,
// y, yw), -1 for an identity expert's or another rank's pair; slot: its table slot.
struct LoraPair {
    int pos, row, slot;
};
__device__ __forceinline__ LoraPair lora_pair(int q, int N, int k, const int* __restrict__ ids,
                                              const int* __restrict__ pair_pos, const int* __restrict__ slot_of,
                                              int n_local) {
    const int P = N * k;
    const int pos = pair_pos[q];
    if (pos < 0) return LoraPair{-1, 0, 0};
    return q < P ? LoraPair{pos, q / k, slot_of[ids[q]]} : LoraPair{pos, q - P, n_local};
}

// v = d[i] (i < HOLD, not known at compile time) by selects, so d stays in registers.
template <int HOLD>
__device__ __forceinline__ void lora_pick(const float (&d)[HOLD], int i, float& v) {
#pragma unroll
    for (int k = 0; k < HOLD; ++k)
        if (k == i) v = d[k];
}

// The per-pair expand, a round of columns at once: d[i] = B row c (bf16 [out, max_rank]) . t for
// the thread's columns c = threadIdx.x + i blockDim.x below cols (zero past), ranks in order
// (16-byte loads of a rank row where max_rank is a multiple of 8). The rank loop outside, so the
// HOLD rows' loads go out together and the code stays one rolled loop (HOLD unrolled expands
// moved the grouped kernels' PTX through NVVM's module-wide choices).
template <int HOLD>
__device__ __forceinline__ void lora_expand_held(float (&d)[HOLD], const bf16* __restrict__ b, const float* t,
                                                 int cols, int max_rank) {
#pragma unroll
    for (int i = 0; i < HOLD; ++i) d[i] = 0.f;
    if ((max_rank & 7) == 0) {
        for (int j = 0; j < max_rank; j += 8) {
#pragma unroll
            for (int i = 0; i < HOLD; ++i) {
                const int c = threadIdx.x + i * blockDim.x;
                if (c >= cols) break;
                float f[8];
                unpack_bf16x8(load_bf16x8(b + (size_t)c * max_rank + j), f);
#pragma unroll
                for (int e = 0; e < 8; ++e) d[i] = fmaf(f[e], t[j + e], d[i]);
            }
        }
    } else {
        for (int j = 0; j < max_rank; ++j) {
#pragma unroll
            for (int i = 0; i < HOLD; ++i) {
                const int c = threadIdx.x + i * blockDim.x;
                if (c >= cols) break;
                d[i] = fmaf(__bfloat162float(b[(size_t)c * max_rank + j]), t[j], d[i]);
            }
        }
    }
}

// A round of act's columns c = c0 + threadIdx.x + i blockDim.x below I (i < LORA_HOLD): act(g + dg,
// u + du) from the pair's g and u (gr: g, then u at I_max), with its deltas hg, hu where `on`. The
// round's g and u are loaded together (one round trip); the store loop stays rolled (one activation site).
__device__ __forceinline__ void lora_act_round(const bf16* __restrict__ gr, bf16* __restrict__ ar, int c0, int I,
                                               int I_max, bool on, const float (&hg)[LORA_HOLD],
                                               const float (&hu)[LORA_HOLD], int act_code, float alpha, float limit) {
    float gv[LORA_HOLD], uv[LORA_HOLD];
#pragma unroll
    for (int i = 0; i < LORA_HOLD; ++i) {
        const int c = c0 + threadIdx.x + i * blockDim.x;
        gv[i] = c < I ? __bfloat162float(gr[c]) : 0.f;
        uv[i] = c < I ? __bfloat162float(gr[I_max + c]) : 0.f;
    }
    for (int i = 0, c = c0 + threadIdx.x; i < LORA_HOLD && c < I; ++i, c += blockDim.x) {
        float g = 0.f, u = 0.f, dg = 0.f, du = 0.f;
        lora_pick(gv, i, g), lora_pick(uv, i, u);
        if (on) lora_pick(hg, i, dg), lora_pick(hu, i, du), g += dg, u += du;
        ar[c] = __float2bfloat16(apply_activation(act_code, g, u, alpha, limit));
    }
}

// grid (N k + N has_shared, slices), block LORA_THREADS, 2 max_rank + LORA_RED floats of shared
// memory. gu [positions, 2 I_max] holds the pair's g and u (bf16, stored in one pass by gate/up
// with ACT_PAIR: g at column c, u at I_max + c); this adds each adapter's gate / up delta (rows
// with an adapter: the shrinks' H split over the pair's slices, the expand by its last block) and
// writes act = act(g, u) in bf16 for every pair the gate/up stored, with or without an adapter
// (without: slice 0's block alone). Slots: A [K, S, max_rank, H], B [K, S, I_max, max_rank] bf16
// (S = n_local + 1 table slots), scale [K, S, 3] fp32 (gate, up, down); zeros past an adapter's
// rank and for modules it does not name. A pair reads its own row only. Early start (above): the
// shrink and the first LORA_HOLD column steps' expand go beside gate/up.
__global__ void LORA_HELD_BOUNDS
lora_gate_up_act(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ lora_ids,
                 const int* __restrict__ ids, const int* __restrict__ pair_pos, const int* __restrict__ slot_of,
                 const int* __restrict__ inter, const bf16* __restrict__ gate_a, const bf16* __restrict__ gate_b,
                 const bf16* __restrict__ up_a, const bf16* __restrict__ up_b, const float* __restrict__ scale,
                 const bf16* __restrict__ gu, bf16* __restrict__ act, float* __restrict__ part,
                 int* __restrict__ tickets, int N, int k, int H, int I_max, int n_local, int max_rank, int max_loras,
                 int act_code, float alpha, float limit) {
    extern __shared__ float t[];  // [2 max_rank]: gate's, then up's; then LORA_RED
    pdl_release_early();  // down streams its first weights beside this grid, as beside gate/up without LoRA
    const LoraPair pr = lora_pair(blockIdx.x, N, k, ids, pair_pos, slot_of, n_local);
    const int I = pr.pos < 0 ? 0 : inter[pr.slot];
    const int lid = pr.pos < 0 ? -1 : lora_ids[pr.row];
    const bool on = lid >= 0 && lid < max_loras;  // an id >= K was flagged (lora_router_delta, experts_route_in_lora)
    const size_t ks = on ? (size_t)lid * (n_local + 1) + pr.slot : 0;
    bool go = pr.pos >= 0 && (on || blockIdx.y == 0);  // block-uniform: this block writes act
    if (on) {
        const bf16* in = (pr.slot == n_local ? x : xe) + (size_t)pr.row * H;  // the shared expert reads x
        int lo, hi;
        lora_slice(H, blockIdx.y, gridDim.y, lo, hi);
        lora_slice_shrink<2, false>(t, gate_a + ks * max_rank * H, up_a + ks * max_rank * H, in, lo, hi, H,
                                    max_rank);
        go = lora_slices_meet(t, 2 * max_rank, max_rank, scale[ks * 3], scale[ks * 3 + 1], part, tickets,
                              blockIdx.x, gridDim.y);
    }
    if (!go && !lora_block0()) return;  // block 0 waits anyway; one wait site (two made ptxas spill)
    const bf16* gb = gate_b + ks * I_max * max_rank;
    const bf16* ub = up_b + ks * I_max * max_rank;
    const bf16* gr = gu + (size_t)pr.pos * 2 * I_max;  // g, then u at I_max
    bf16* ar = act + (size_t)pr.pos * I_max;
    const int round = LORA_HOLD * blockDim.x;  // columns a round: the held ones, then as many again
    for (int c0 = 0;; c0 += round) {
        float hg[LORA_HOLD], hu[LORA_HOLD];  // the round's expand, its loads together (round 0 beside gate/up)
        const int cols = go && on ? I - c0 : 0;
        lora_expand_held(hg, gb + (size_t)c0 * max_rank, t, cols, max_rank);
        lora_expand_held(hu, ub + (size_t)c0 * max_rank, t + max_rank, cols, max_rank);
        if (c0 == 0) {
            pdl_wait_then_release_next();  // gate/up's g and u from here on
            if (!go) return;
        }
        lora_act_round(gr, ar, c0, I, I_max, on, hg, hu, act_code, alpha, limit);
        if (c0 + round >= I) break;
    }
}

// grid (N k + N has_shared), block LORA_THREADS, 2 max_rank + LORA_RED floats of shared memory: the
// swap-AB LoRA form's second half (forward_plan.lora_swapab). decode_swapab_gate_up_lora stored g and
// u (ACT_PAIR) and each pair's s t (gate's, then up's) into lora_t [positions, 2 max_rank]; this adds
// the expands B t to g and u and writes act = act(g, u) for every pair gate/up stored, with or
// without an adapter, as lora_gate_up_act does. Before the PDL wait only the pair's B rows are
// fetched into L2 (t and g, u are gate/up's).
__global__ void LORA_HELD_BOUNDS
lora_gate_up_expand_act(const float* __restrict__ lora_t, const int* __restrict__ lora_ids,
                        const int* __restrict__ ids, const int* __restrict__ pair_pos,
                        const int* __restrict__ slot_of, const int* __restrict__ inter,
                        const bf16* __restrict__ gate_b, const bf16* __restrict__ up_b, const bf16* __restrict__ gu,
                        bf16* __restrict__ act, int N, int k, int I_max, int n_local, int max_rank, int max_loras,
                        int act_code, float alpha, float limit) {
#if CUPYMOE_SM >= 90  // its gate/up, the swap-AB kernel, is sm_90a's alone (NVVM spills this body at sm_80)
    extern __shared__ float t[];  // [2 max_rank]: gate's, then up's
    const LoraPair pr = lora_pair(blockIdx.x, N, k, ids, pair_pos, slot_of, n_local);
    const int I = pr.pos < 0 ? 0 : inter[pr.slot];
    const int lid = pr.pos < 0 ? -1 : lora_ids[pr.row];
    const bool on = lid >= 0 && lid < max_loras;  // an id >= K was flagged (lora_router_delta, experts_route_in_lora)
    const size_t ks = on ? (size_t)lid * (n_local + 1) + pr.slot : 0;
    const bf16* gb = gate_b + ks * I_max * max_rank;
    const bf16* ub = up_b + ks * I_max * max_rank;
    if (on) lora_prefetch_rows(gb, 0, I, max_rank), lora_prefetch_rows(ub, 0, I, max_rank);
    if (pr.pos < 0 && !lora_block0()) return;  // block 0 waits anyway
    pdl_wait_then_release_next();  // gate/up's g, u and s t from here on
    if (pr.pos < 0) return;
    if (on)
        for (int e = threadIdx.x; e < 2 * max_rank; e += blockDim.x) t[e] = lora_t[(size_t)pr.pos * 2 * max_rank + e];
    __syncthreads();
    const bf16* gr = gu + (size_t)pr.pos * 2 * I_max;  // g, then u at I_max
    bf16* ar = act + (size_t)pr.pos * I_max;
    const int round = LORA_HOLD * blockDim.x;
    for (int c0 = 0;; c0 += round) {
        float hg[LORA_HOLD], hu[LORA_HOLD];
        const int cols = on ? I - c0 : 0;
        lora_expand_held(hg, gb + (size_t)c0 * max_rank, t, cols, max_rank);
        lora_expand_held(hu, ub + (size_t)c0 * max_rank, t + max_rank, cols, max_rank);
        lora_act_round(gr, ar, c0, I, I_max, on, hg, hu, act_code, alpha, limit);
        if (c0 + round >= I) break;
    }
#else
    __trap();
#endif
}

#define LORA_DOWN_DECODE 0   // y [pos, H] fp32, unweighted (decode_reduce weights it)
#define LORA_DOWN_ATOMIC 1   // routed pairs: acc [row, H] += w d; the shared expert's y as decode
#define LORA_DOWN_GROUPED 2  // yw [pos, H] bf16, weighted: yw = bf16(yw + w d)

// grid (N k + N has_shared, Y), block LORA_THREADS, max_rank + LORA_RED floats of shared memory.
// The down delta of each pair with an adapter: t = s A act[pos], d = B t, added to the expert's
// output before the routing weight multiplies (mode: where the path keeps that output). Y splits
// the pair's work: by_cols (forward_plan.lora_down_cols), its H output columns (lora_slice), each
// block the whole shrink, its B rows fetched into L2 meanwhile (Y > 1), so no block meets another and no
// block expands all of H alone (a chain of loads at 64 registers); else the shrink's I (slices),
// d by the last block. A [K, S, max_rank, I_max], B [K, S, H, max_rank] bf16. Early start (above):
// act is lora_gate_up_act's, done before down's wait, so the shrink and the first LORA_HOLD_DOWN
// column steps' expand go beside down.
__global__ void LORA_HELD_BOUNDS
lora_down_delta(const bf16* __restrict__ act, const int* __restrict__ lora_ids, const int* __restrict__ ids,
                const int* __restrict__ pair_pos, const int* __restrict__ slot_of, const int* __restrict__ inter,
                const bf16* __restrict__ down_a, const bf16* __restrict__ down_b, const float* __restrict__ scale,
                const float* __restrict__ topk_w, float* __restrict__ y, float* __restrict__ acc,
                bf16* __restrict__ yw, float* __restrict__ part, int* __restrict__ tickets, int N, int k, int H,
                int I_max, int n_local, int max_rank, int max_loras, int mode, int by_cols) {
    extern __shared__ float t[];  // [max_rank], then LORA_RED
    const LoraPair pr = lora_pair(blockIdx.x, N, k, ids, pair_pos, slot_of, n_local);
    const int lid = pr.pos < 0 ? -1 : lora_ids[pr.row];
    bool go = lid >= 0 && lid < max_loras;  // block-uniform: this block adds a delta
    const size_t ks = go ? (size_t)lid * (n_local + 1) + pr.slot : 0;
    const bf16* b = down_b + ks * H * max_rank;
    int h_lo = 0, h_hi = H;  // the output columns this block adds to
    if (by_cols) lora_slice(H, blockIdx.y, gridDim.y, h_lo, h_hi);
    if (go) {
        const int len = inter[pr.slot];
        int lo = 0, hi = len;
        if (by_cols) {
            // one block a pair (from LORA_SLICE_TARGET pairs) would fetch all of B and load it again:
            // only traffic (DECISIONS "LoRA: the down delta's B prefetch only where a pair has several blocks")
            if (gridDim.y > 1) lora_prefetch_rows(b, h_lo, h_hi, max_rank);
        } else {
            lora_slice(len, blockIdx.y, gridDim.y, lo, hi);
        }
        const bf16* a0 = down_a + ks * max_rank * I_max;
        lora_slice_shrink<1, false, LORA_DOWN_TPR, LORA_DOWN_VPT>(t, a0, a0, act + (size_t)pr.pos * I_max, lo, hi,
                                                                  I_max, max_rank);
        const float s = scale[ks * 3 + 2];
        go = lora_slices_meet(t, max_rank, max_rank, s, s, part, tickets, blockIdx.x, by_cols ? 1 : gridDim.y);
    }
    if (!go && !lora_block0()) return;  // block 0 waits anyway; one wait site (two made ptxas spill)
    const bool routed = (int)blockIdx.x < N * k;
    const float w = go && routed ? topk_w[blockIdx.x] : 1.0f;  // the shared expert is scaled in the reduce
    const bool to_y = mode == LORA_DOWN_DECODE || (mode == LORA_DOWN_ATOMIC && !routed);  // y += d
    float* yr = y + (size_t)pr.pos * H;
    const int round = LORA_HOLD_DOWN * blockDim.x;  // columns a round: the held ones, then as many again
    for (int h0 = h_lo;; h0 += round) {
        float held[LORA_HOLD_DOWN];  // the round's expand, its loads together (round 0 beside down)
        lora_expand_held(held, b + (size_t)h0 * max_rank, t, go ? h_hi - h0 : 0, max_rank);
        if (h0 == h_lo) {
            pdl_wait_then_release_next();  // down's output from here on
            if (!go) return;
        }
        float yv[LORA_HOLD_DOWN];  // the round's y, loaded together: one round trip
#pragma unroll
        for (int i = 0; i < LORA_HOLD_DOWN; ++i) {
            const int h = h0 + threadIdx.x + i * blockDim.x;
            yv[i] = to_y && h < h_hi ? yr[h] : 0.f;
        }
        for (int i = 0, h = h0 + threadIdx.x; i < LORA_HOLD_DOWN && h < h_hi; ++i, h += blockDim.x) {  // rolled: one store site
            float d = 0.f, v = 0.f;
            lora_pick(held, i, d), lora_pick(yv, i, v);
            if (to_y) {
                yr[h] = v + d;
            } else if (mode == LORA_DOWN_GROUPED) {
                bf16* o = yw + (size_t)pr.pos * H + h;
                *o = __float2bfloat16(__bfloat162float(*o) + w * d);
            } else {
                atomicAdd(acc + (size_t)pr.row * H + h, w * d);
            }
        }
        if (h0 + round >= h_hi) break;
    }
}

// ---------------------------------------------------------------------------------------------
// The grouped (prefill) path's deltas: a block a tile of the grouped GEMMs' own tile list
// (tile_info[t] = (table slot, first position, rows): consecutive positions of one expert). The
// tile's positions are bucketed by adapter into chunks of at most LORA_CHUNK rows (lora_bucket);
// the block's warps take a chunk together on tensor cores (mma.sync m16n8k16, bf16 operands,
// fp32 sums; LORA_MT 16-row tiles sharing each weight fragment): the shrink split over the input
// columns (partial sums added in warp order), the expand over the output columns, so an
// adapter's A and B are read once a chunk, not once a pair. Each mma row is its own row's sum,
// so a position's bits depend on its row and adapter alone (row_invariant holds) whatever else
// shares its chunk.
// ---------------------------------------------------------------------------------------------
#define LORA_MMA_WARPS 8
#define LORA_MT 2                                          // 16-row mma tiles a chunk
#define LORA_CHUNK (16 * LORA_MT)                          // rows a chunk (of one adapter)
#define LORA_SUB 192                                       // positions a block buckets at once (a tma_192 tile)
#define LORA_MAX_CHUNKS (LORA_SUB / LORA_CHUNK + LORA_SUB)  // full chunks, plus one partial chunk an adapter
#define LORA_NC 2                                          // 8-column steps a warp has in flight in an expand

// A sub-tile's positions by adapter: lid[i] of position pos0 + i (-1: none or an id >= K); list
// holds the indices i adapter after adapter (ascending), in position order within one; chunk c is
// list[first[c] .. first[c] + rows[c]), all of adapter key[c].
struct LoraBuckets {
    int lid[LORA_SUB];
    int list[LORA_SUB];
    int key[LORA_MAX_CHUNKS], first[LORA_MAX_CHUNKS], rows[LORA_MAX_CHUNKS];
    int chunks;
};

__device__ __forceinline__ void lora_load_ids(LoraBuckets& b, const int* __restrict__ lora_ids,
                                              const int* __restrict__ sorted_row, int pos0, int m, int max_loras) {
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int id = lora_ids[sorted_row[pos0 + i]];
        b.lid[i] = id >= 0 && id < max_loras ? id : -1;  // an id >= K was flagged (router delta, route-in)
    }
}

// Warp 0: lid[0, m) bucketed by adapter (each adapter found as the least id above the last, its
// positions placed by ballot in order), each adapter's run cut into LORA_CHUNK-row chunks.
__device__ __forceinline__ void lora_bucket(LoraBuckets& b, int m) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int prev = -1, placed = 0, chunks = 0;
    for (;;) {
        int next = 0x7fffffff;
        for (int i = lane; i < m; i += 32)
            if (b.lid[i] > prev) next = min(next, b.lid[i]);
        next = __reduce_min_sync(CUPYMOE_FULL_MASK, next);
        if (next == 0x7fffffff) break;
        const int start = placed;
        for (int i0 = 0; i0 < m; i0 += 32) {
            const bool mine = i0 + lane < m && b.lid[i0 + lane] == next;
            const unsigned bal = __ballot_sync(CUPYMOE_FULL_MASK, mine);
            if (mine) b.list[placed + __popc(bal & ((1u << lane) - 1u))] = i0 + lane;
            placed += __popc(bal);
        }
        for (int f = start; f < placed; f += LORA_CHUNK, ++chunks) {
            if (lane == 0) {
                b.key[chunks] = next;
                b.first[chunks] = f;
                b.rows[chunks] = min(LORA_CHUNK, placed - f);
            }
        }
        prev = next;
    }
    if (lane == 0) b.chunks = chunks;
}

// The lane's rows of chunk c: pos[mt][h] is row 16 mt + g + 8 h (mma tile mt's fragment rows g
// and g + 8) as a position, -1 past the chunk.
struct LoraRows {
    int pos[LORA_MT][2];
};
__device__ __forceinline__ LoraRows lora_chunk_rows(const LoraBuckets& b, int c, int pos0) {
    const int g = (threadIdx.x & 31) >> 2;
    LoraRows r;
#pragma unroll
    for (int mt = 0; mt < LORA_MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = 16 * mt + g + 8 * h;
            r.pos[mt][h] = i < b.rows[c] ? pos0 + b.list[b.first[c] + i] : -1;
        }
    }
    return r;
}

// The lane's input rows of a chunk: v[mt][h] for row 16 mt + g + 8 h, null past the chunk.
struct LoraInputs {
    const bf16* v[LORA_MT][2];
};

// The A fragments of 32 input columns of the lane's rows (f[0]: the first k step, f[1]: the
// second), zeros for a null row or past len: a lane's 16-byte vector of its row holds columns
// h .. h + 7 (h = h0 + 8 tig), the same permutation as its weight rows' vectors.
__device__ __forceinline__ void lora_x_frags(unsigned (&f)[LORA_MT][2][4], const LoraInputs& in, int h, int len) {
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int mt = 0; mt < LORA_MT; ++mt) {
        const uint4 x0 = h < len && in.v[mt][0] ? load_bf16x8(in.v[mt][0] + h).raw : z;
        const uint4 x1 = h < len && in.v[mt][1] ? load_bf16x8(in.v[mt][1] + h).raw : z;
        f[mt][0][0] = x0.x, f[mt][0][1] = x1.x, f[mt][0][2] = x0.y, f[mt][0][3] = x1.y;
        f[mt][1][0] = x0.z, f[mt][1][1] = x1.z, f[mt][1][2] = x0.w, f[mt][1][3] = x1.w;
    }
}

// C fragments of the chunk's rows (tile mt: rows 16 mt + g, + 8) and ranks kc + 8 nt + 2 tig, + 1
// into part ([LORA_CHUNK][rp] floats).
__device__ __forceinline__ void lora_store_part(float* part, int rp, int kc, const float (&c)[2][LORA_MT][4]) {
    const int g = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int mt = 0; mt < LORA_MT; ++mt) {
            float* tp = part + (16 * mt + g) * rp + kc + nt * 8 + tig * 2;
            tp[0] = c[nt][mt][0];
            tp[1] = c[nt][mt][1];
            tp[8 * rp] = c[nt][mt][2];
            tp[8 * rp + 1] = c[nt][mt][3];
        }
    }
}

// This warp's part of a chunk's shrink: part_p[i][j] = A_p[j, cols] . v_i[cols] over the warp's
// columns 32 (warp + LORA_MMA_WARPS s), for ranks j < max_rank rounded up to 16 (zero past
// max_rank), NP projections at once (gate and up share x's loads); part_p is [LORA_CHUNK][rp]
// floats at part + LORA_CHUNK rp p. A k step of two mmas covers 32 columns, a weight fragment
// (one 16-byte load) serving the LORA_MT row tiles. len and stride are multiples of 8, so a
// vector that starts below len ends by it.
template <int NP>
__device__ __forceinline__ void lora_mma_shrink_part(float* part, int rp, const bf16* a0, const bf16* a1,
                                                     const LoraInputs& in, int len, int stride, int max_rank) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3, warp = threadIdx.x >> 5;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    for (int kc = 0; kc < max_rank; kc += 16) {
        float c[NP][2][LORA_MT][4] = {};
#pragma unroll 2  // two steps' loads in flight
        for (int h0 = warp * 32; h0 < len; h0 += LORA_MMA_WARPS * 32) {
            const int h = h0 + tig * 8;
            unsigned f[LORA_MT][2][4];
            lora_x_frags(f, in, h, len);
#pragma unroll
            for (int p = 0; p < NP; ++p) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int rank = kc + 8 * nt + g;  // the B fragment's n = g
                    const bf16* ap = (p == 0 ? a0 : a1) + (size_t)rank * stride + h;
                    const uint4 w = h < len && rank < max_rank ? load_bf16x8(ap).raw : z;
#pragma unroll
                    for (int mt = 0; mt < LORA_MT; ++mt) {
                        mma_bf16(c[p][nt][mt], f[mt][0], w.x, w.y);
                        mma_bf16(c[p][nt][mt], f[mt][1], w.z, w.w);
                    }
                }
            }
        }
#pragma unroll
        for (int p = 0; p < NP; ++p) lora_store_part(part + p * LORA_CHUNK * rp, rp, kc, c[p]);
    }
}

// t[e] = scale of e's projection * the warps' parts of e added in warp order (n = NP LORA_CHUNK rp
// floats a part; e < LORA_CHUNK rp: projection 0).
__device__ __forceinline__ void lora_sum_parts(float* t, const float* parts, int n, int rp, float s0, float s1) {
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < LORA_MMA_WARPS; ++w) s += parts[w * n + e];
        t[e] = s * (e < LORA_CHUNK * rp ? s0 : s1);
    }
}

// (a, b) as a bf16 pair and the bf16 pair of what that rounding left: t = hi + lo to ~16 bits.
__device__ __forceinline__ void lora_split(float a, float b, unsigned& hi, unsigned& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = pack_bf16x2(a - hf.x, b - hf.y);
}

// The expand's A fragments of t (tile mt's rows 16 mt + g, + 8) for ranks kc .. kc + 15, permuted
// as lora_b_frag reads B (k = 2 tig + e: rank kc + 4 tig + e; k = 8 + 2 tig + e: kc + 4 tig + 2
// + e), t split in two bf16 parts so that B t keeps t to ~16 bits (two mmas) and the reference
// needs no rounding of t.
struct LoraFrag {
    unsigned hi[4], lo[4];
};
__device__ __forceinline__ LoraFrag lora_t_frag(const float* t, int rp, int kc, int mt) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const float4 r0 = *reinterpret_cast<const float4*>(t + (16 * mt + g) * rp + kc + tig * 4);
    const float4 r1 = *reinterpret_cast<const float4*>(t + (16 * mt + g + 8) * rp + kc + tig * 4);
    LoraFrag f;
    lora_split(r0.x, r0.y, f.hi[0], f.lo[0]);
    lora_split(r1.x, r1.y, f.hi[1], f.lo[1]);
    lora_split(r0.z, r0.w, f.hi[2], f.lo[2]);
    lora_split(r1.z, r1.w, f.hi[3], f.lo[3]);
    return f;
}

// B's rank row c (B bf16 [out, max_rank]), ranks r0 .. r0 + 3, zeros past max_rank: the B
// fragment (x: r0, r0 + 1; y: r0 + 2, r0 + 3).
__device__ __forceinline__ uint2 lora_b_frag(const bf16* __restrict__ b, int c, int r0, int max_rank) {
    const bf16* p = b + (size_t)c * max_rank + r0;
    if ((max_rank & 3) == 0 && r0 + 4 <= max_rank) return __ldg(reinterpret_cast<const uint2*>(p));
    unsigned e[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = r0 + i < max_rank ? (unsigned)__bfloat16_as_ushort(p[i]) : 0u;
    return make_uint2(e[0] | e[1] << 16, e[2] | e[3] << 16);
}

// LORA_NC 8-column steps of an expand at once: d[j][mt] (C fragment: rows 16 mt + g, + 8;
// columns c0[j] + 2 tig, + 1) = B t, for the steps whose columns exist (c0[j] < cols); a B
// fragment serves the LORA_MT row tiles.
__device__ __forceinline__ void lora_mma_expand(float (&d)[LORA_NC][LORA_MT][4], const float* t, int rp,
                                                const bf16* __restrict__ b, const int (&c0)[LORA_NC], int cols,
                                                int max_rank) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int j = 0; j < LORA_NC; ++j)
#pragma unroll
        for (int mt = 0; mt < LORA_MT; ++mt) d[j][mt][0] = d[j][mt][1] = d[j][mt][2] = d[j][mt][3] = 0.f;
    for (int kc = 0; kc < max_rank; kc += 16) {
        uint2 bf[LORA_NC];
#pragma unroll
        for (int j = 0; j < LORA_NC; ++j)
            bf[j] = c0[j] < cols ? lora_b_frag(b, c0[j] + g, kc + tig * 4, max_rank) : make_uint2(0u, 0u);
#pragma unroll
        for (int mt = 0; mt < LORA_MT; ++mt) {
            const LoraFrag f = lora_t_frag(t, rp, kc, mt);
#pragma unroll
            for (int j = 0; j < LORA_NC; ++j) {
                mma_bf16(d[j][mt], f.hi, bf[j].x, bf[j].y);
                mma_bf16(d[j][mt], f.lo, bf[j].x, bf[j].y);
            }
        }
    }
}

// The warp's column steps s, s + LORA_MMA_WARPS, ... of round i (8-column steps).
__device__ __forceinline__ void lora_round_cols(int (&c0)[LORA_NC], int round) {
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < LORA_NC; ++j) c0[j] = (warp + LORA_MMA_WARPS * (round * LORA_NC + j)) * 8;
}

// act = bf16(act(g, u)) for the sub-tile's positions without an adapter, two columns a step;
// the tile's gridDim.y blocks take every gridDim.y-th block-wide step (this block: blockIdx.y's).
__device__ __forceinline__ void lora_plain_act(const LoraBuckets& b, const bf16* __restrict__ gu,
                                               bf16* __restrict__ act, int pos0, int m, int I, int I_max,
                                               int act_code, float alpha, float limit) {
    const int half = I >> 1;
    for (int e = threadIdx.x + blockIdx.y * blockDim.x; e < m * half; e += blockDim.x * gridDim.y) {
        const int i = e / half, c = (e - i * half) * 2;
        if (b.lid[i] >= 0) continue;
        const bf16* row = gu + (size_t)(pos0 + i) * 2 * I_max + c;
        const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row));
        const float2 uv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + I_max));
        *reinterpret_cast<unsigned*>(act + (size_t)(pos0 + i) * I_max + c) =
            pack_bf16x2(apply_activation(act_code, gv.x, uv.x, alpha, limit),
                        apply_activation(act_code, gv.y, uv.y, alpha, limit));
    }
}

#define LORA_STAGE_COLS (8 * LORA_NC)                            // columns a warp stages a round
#define LORA_STAGE (2 * LORA_CHUNK * LORA_STAGE_COLS)            // floats: g, then u, [LORA_CHUNK][cols]
static_assert(LORA_STAGE <= 2 * LORA_CHUNK * 16, "the staging must fit in a warp's gate/up part at rank 16");

// A round's g + B_g t_g and u + B_u t_u into the warp's staging gs, by fragment.
__device__ __forceinline__ void lora_stage_gu(float* gs, const LoraRows& r, const int (&c0)[LORA_NC], int I,
                                              int I_max, const bf16* __restrict__ gu,
                                              const float (&dg)[LORA_NC][LORA_MT][4],
                                              const float (&du)[LORA_NC][LORA_MT][4]) {
    const int g = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < LORA_NC; ++j) {
#pragma unroll
        for (int mt = 0; mt < LORA_MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (r.pos[mt][h] < 0 || c0[j] >= I) continue;
                const bf16* row = gu + (size_t)r.pos[mt][h] * 2 * I_max + c0[j] + tig * 2;
                const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row));
                const float2 uv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + I_max));
                float* o = gs + (16 * mt + g + 8 * h) * LORA_STAGE_COLS + 8 * j + tig * 2;
                o[0] = gv.x + dg[j][mt][2 * h];
                o[1] = gv.y + dg[j][mt][2 * h + 1];
                o[LORA_STAGE / 2] = uv.x + du[j][mt][2 * h];
                o[LORA_STAGE / 2 + 1] = uv.y + du[j][mt][2 * h + 1];
            }
        }
    }
}

// A chunk's act, the warp's rounds of columns: g + B_g t_g and u + B_u t_u on tensor cores,
// staged in the warp's gs so that one activation site (a lane an element at a time: row e /
// cols, step (e % cols) / 8) stores bf16(act(g, u)); an activation inlined a fragment element
// made ptxas spill.
__device__ __forceinline__ void lora_chunk_act(const float* t, int rp, float* gs, const LoraBuckets& b, int ch,
                                               int pos0, const LoraRows& r, const bf16* __restrict__ gb,
                                               const bf16* __restrict__ ub, const bf16* __restrict__ gu,
                                               bf16* __restrict__ act, int I, int I_max, int max_rank, int act_code,
                                               float alpha, float limit) {
    const int lane = threadIdx.x & 31;
    constexpr int W = LORA_STAGE_COLS;
    for (int round = 0;; ++round) {
        int c0[LORA_NC];
        lora_round_cols(c0, round);
        if (c0[0] >= I) break;
        float dg[LORA_NC][LORA_MT][4], du[LORA_NC][LORA_MT][4];
        lora_mma_expand(dg, t, rp, gb, c0, I, max_rank);
        lora_mma_expand(du, t + LORA_CHUNK * rp, rp, ub, c0, I, max_rank);
        lora_stage_gu(gs, r, c0, I, I_max, gu, dg, du);
        __syncwarp();
        for (int e = lane; e < b.rows[ch] * W; e += 32) {
            const int i = e / W, c = c0[0] + LORA_MMA_WARPS * 8 * ((e % W) >> 3) + (e & 7);
            if (c >= I) continue;
            const int pos = pos0 + b.list[b.first[ch] + i];
            act[(size_t)pos * I_max + c] =
                __float2bfloat16(apply_activation(act_code, gs[e], gs[LORA_STAGE / 2 + e], alpha, limit));
        }
        __syncwarp();  // gs is rewritten by the next round
    }
}

// A chunk's down delta over output columns [lo, hi) (lo a multiple of 8), the warp's rounds of
// columns: yw = bf16(yw + w B t) (w[mt][h]: the lane's rows' routing weights).
__device__ __forceinline__ void lora_chunk_down(const float* t, int rp, const LoraRows& r,
                                                const float (&w)[LORA_MT][2], const bf16* __restrict__ db,
                                                bf16* __restrict__ yw, int H, int lo, int hi, int max_rank) {
    const int tig = threadIdx.x & 3;
    for (int round = 0;; ++round) {
        int c0[LORA_NC];
        lora_round_cols(c0, round);
#pragma unroll
        for (int j = 0; j < LORA_NC; ++j) c0[j] += lo;
        if (c0[0] >= hi) break;
        unsigned yv[LORA_NC][LORA_MT][2];  // the round's yw pairs, loaded before the expand's B (in flight together)
#pragma unroll
        for (int j = 0; j < LORA_NC; ++j)
#pragma unroll
            for (int mt = 0; mt < LORA_MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    yv[j][mt][h] = r.pos[mt][h] < 0 || c0[j] >= hi ? 0u
                        : *reinterpret_cast<const unsigned*>(yw + (size_t)r.pos[mt][h] * H + c0[j] + tig * 2);
        float d[LORA_NC][LORA_MT][4];
        lora_mma_expand(d, t, rp, db, c0, hi, max_rank);
#pragma unroll
        for (int j = 0; j < LORA_NC; ++j) {
#pragma unroll
            for (int mt = 0; mt < LORA_MT; ++mt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (r.pos[mt][h] < 0 || c0[j] >= hi) continue;
                    unsigned* o = reinterpret_cast<unsigned*>(yw + (size_t)r.pos[mt][h] * H + c0[j] + tig * 2);
                    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&yv[j][mt][h]));
                    *o = pack_bf16x2(y.x + w[mt][h] * d[j][mt][2 * h], y.y + w[mt][h] * d[j][mt][2 * h + 1]);
                }
            }
        }
    }
}

// The lane's input rows of chunk rows r: base + row(pos) stride, null past the chunk (row(pos):
// sorted_row[pos] where given, else pos itself).
__device__ __forceinline__ LoraInputs lora_inputs(const LoraRows& r, const bf16* base, const int* sorted_row,
                                                  int stride) {
    LoraInputs in;
#pragma unroll
    for (int mt = 0; mt < LORA_MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int p = r.pos[mt][h];
            in.v[mt][h] = p < 0 ? nullptr : base + (size_t)(sorted_row ? sorted_row[p] : p) * stride;
        }
    }
    return in;
}

// A sub-tile's positions pos0 .. pos0 + m - 1 bucketed by adapter (lid by every thread, then the
// buckets by warp 0: the caller syncs before reading them).
__device__ __forceinline__ void lora_sub_tile(LoraBuckets& b, const int* __restrict__ lora_ids,
                                              const int* __restrict__ sorted_row, int pos0, int m, int max_loras) {
    lora_load_ids(b, lora_ids, sorted_row, pos0, m, max_loras);
    __syncthreads();
    lora_bucket(b, m);
}

// A chunk's scaled t (NP projections, [LORA_CHUNK][rp] each, at t): the warps' parts of the
// shrink, then their sum scaled by s[0] (and s[1]: projection 1), the block met after each.
template <int NP>
__device__ __forceinline__ void lora_chunk_t(float* parts, float* t, int rp, const bf16* a0, const bf16* a1,
                                             const LoraInputs& in, int len, int stride, int max_rank,
                                             const float* __restrict__ s) {
    const int n = NP * LORA_CHUNK * rp;
    lora_mma_shrink_part<NP>(parts + (threadIdx.x >> 5) * n, rp, a0, a1, in, len, stride, max_rank);
    __syncthreads();
    lora_sum_parts(t, parts, n, rp, s[0], NP > 1 ? s[1] : 0.f);
    __syncthreads();
}

// grid (the last gate/up GEMM's tile bound, Y), block LORA_MMA_WARPS warps, shared memory
// (LORA_MMA_WARPS + 1) 2 LORA_CHUNK rp floats (rp: max_rank rounded up to 16; the warps' partial
// t, then t; lora_chunk_act's staging reuses the parts). The grouped path's lora_gate_up_act
// (same slots and outputs): a tile's positions without an adapter get act(g, u) (the tile's Y
// blocks splitting them); those with one, a chunk at a time (chunk c by the tile's block y = c
// mod Y: each block buckets the tile alike and takes its chunks), t = s A x_e for gate and up,
// then act(g + B_g t_g, u + B_u t_u). A chunk's work is the same whichever block does it.
__global__ void __launch_bounds__(LORA_MMA_WARPS * 32, 2)
lora_grouped_gate_up_act(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ lora_ids,
                         const int* __restrict__ num_tiles, const int4* __restrict__ tile_info,
                         const int* __restrict__ sorted_row, const int* __restrict__ inter,
                         const bf16* __restrict__ gate_a, const bf16* __restrict__ gate_b,
                         const bf16* __restrict__ up_a, const bf16* __restrict__ up_b,
                         const float* __restrict__ scale, const bf16* __restrict__ gu, bf16* __restrict__ act,
                         int H, int I_max, int n_local, int max_rank, int max_loras, int act_code, float alpha,
                         float limit) {
    __shared__ LoraBuckets b;
    extern __shared__ __align__(16) float parts[];
    pdl_wait_then_release_next();  // by PDL only inside a decode chain (never today): nothing read before
    if ((int)blockIdx.x >= *num_tiles) return;
    const int4 ti = tile_info[blockIdx.x];
    const int I = inter[ti.x], rp = (max_rank + 15) & ~15, n = 2 * LORA_CHUNK * rp;
    const bf16* in = ti.x == n_local ? x : xe;  // the shared expert reads x
    float* t = parts + LORA_MMA_WARPS * n;
    float* gs = parts + (threadIdx.x >> 5) * LORA_STAGE;
    for (int s0 = 0; s0 < ti.z; s0 += LORA_SUB) {
        const int pos0 = ti.y + s0, m = min(LORA_SUB, ti.z - s0);
        lora_sub_tile(b, lora_ids, sorted_row, pos0, m, max_loras);
        lora_plain_act(b, gu, act, pos0, m, I, I_max, act_code, alpha, limit);
        __syncthreads();
        for (int c = blockIdx.y; c < b.chunks; c += gridDim.y) {
            const LoraRows r = lora_chunk_rows(b, c, pos0);
            const size_t ks = (size_t)b.key[c] * (n_local + 1) + ti.x;
            lora_chunk_t<2>(parts, t, rp, gate_a + ks * max_rank * H, up_a + ks * max_rank * H,
                            lora_inputs(r, in, sorted_row, H), H, H, max_rank, scale + ks * 3);
            lora_chunk_act(t, rp, gs, b, c, pos0, r, gate_b + ks * I_max * max_rank, up_b + ks * I_max * max_rank,
                           gu, act, I, I_max, max_rank, act_code, alpha, limit);
            __syncthreads();  // the next chunk's parts overwrite the staging
        }
    }
}

// grid (the last down GEMM's tile bound, Y, Z), block LORA_MMA_WARPS warps, shared memory
// (LORA_MMA_WARPS + 1) LORA_CHUNK rp floats. The grouped path's lora_down_delta: for a tile's
// positions with an adapter, a chunk at a time (chunk c by the tile's blocks y = c mod Y), t = s
// A act[pos], then yw = bf16(yw + w B t) (w: the pair's routing weight, 1 for the shared expert,
// which the reduce scales) over column slice z of Z of H (lora_slice: whole 8-column vectors).
// Each of a chunk's Z blocks computes the same t (the small shrink, A [max_rank, I] and the
// chunk's act rows, again from L2) and expands its own columns, so an output's bits do not
// depend on Y or Z.
__global__ void __launch_bounds__(LORA_MMA_WARPS * 32, 2)
lora_grouped_down_delta(const bf16* __restrict__ act, const int* __restrict__ lora_ids,
                        const int* __restrict__ num_tiles, const int4* __restrict__ tile_info,
                        const int* __restrict__ sorted_row, const int* __restrict__ sorted_pair,
                        const int* __restrict__ inter, const bf16* __restrict__ down_a,
                        const bf16* __restrict__ down_b, const float* __restrict__ scale,
                        const float* __restrict__ topk_w, bf16* __restrict__ yw, int H, int I_max, int n_local,
                        int max_rank, int max_loras) {
    __shared__ LoraBuckets b;
    extern __shared__ __align__(16) float parts[];
    pdl_wait_then_release_next();  // by PDL only inside a decode chain (never today): nothing read before
    if ((int)blockIdx.x >= *num_tiles) return;
    const int4 ti = tile_info[blockIdx.x];
    const int I = inter[ti.x], rp = (max_rank + 15) & ~15, n = LORA_CHUNK * rp;
    float* t = parts + LORA_MMA_WARPS * n;
    int lo, hi;
    lora_slice(H, blockIdx.z, gridDim.z, lo, hi);
    for (int s0 = 0; s0 < ti.z; s0 += LORA_SUB) {
        const int pos0 = ti.y + s0, m = min(LORA_SUB, ti.z - s0);
        lora_sub_tile(b, lora_ids, sorted_row, pos0, m, max_loras);
        __syncthreads();
        for (int c = blockIdx.y; c < b.chunks; c += gridDim.y) {
            const LoraRows r = lora_chunk_rows(b, c, pos0);
            const size_t ks = (size_t)b.key[c] * (n_local + 1) + ti.x;
            const bf16* a0 = down_a + ks * max_rank * I_max;
            lora_chunk_t<1>(parts, t, rp, a0, a0, lora_inputs(r, act, nullptr, I_max), I, I_max, max_rank,
                            scale + ks * 3 + 2);
            float w[LORA_MT][2];
#pragma unroll
            for (int mt = 0; mt < LORA_MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    w[mt][h] = r.pos[mt][h] < 0 || ti.x == n_local ? 1.0f : topk_w[sorted_pair[r.pos[mt][h]]];
            lora_chunk_down(t, rp, r, w, down_b + ks * H * max_rank, yw, H, lo, hi, max_rank);
            __syncthreads();  // the next chunk's sum rewrites t
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The stacked form's shrinks (forward_plan.lora_in_gemm): the experts' deltas go into the TMA
// grouped GEMMs as extra K (grouped_sm90_tma.cu, grouped_gemm_sm90_tma_lora), whose A is T, one
// row a sorted position, NP KS bf16 columns (NP projections: gate/up 2, down 1; KS a multiple of
// 64): projection p's column p KS + (q K + a) R + r (K = max_loras, R = max_rank, q < parts) holds
// part q of s t_r (t = A_{a,e} v, s the slot's scale; part 0 = bf16(s t), part 1 = bf16(s t -
// part 0), so two parts keep s t to ~16 bits, as lora_t_frag's split does) where the row's adapter
// is a, zeros elsewhere (other adapters, rows without one, columns past parts K R). The GEMM's
// Bext rows hold B_{a,e}[c, r] at the same columns (cupymoe/lora_stack.py), so T Bext^T = s B t.
// A chunk's t as lora_grouped_*'s (the same shrink; a row's bits do not depend on its chunk).
// ---------------------------------------------------------------------------------------------

// T's rows of the sub-tile's positions without an adapter: zeros (16-byte stores), the tile's
// gridDim.y blocks splitting them.
__device__ __forceinline__ void lora_stack_zero_rows(const LoraBuckets& b, bf16* __restrict__ T, int pos0, int m,
                                                     int width) {
    const int V = width >> 3;
    for (int e = threadIdx.x + blockIdx.y * blockDim.x; e < m * V; e += blockDim.x * gridDim.y) {
        const int i = e / V;
        if (b.lid[i] >= 0) continue;
        *reinterpret_cast<uint4*>(T + (size_t)(pos0 + i) * width + 8 * (e - i * V)) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// Column col of T (of np KS) for a row whose projection p's scaled t starts at row[p pstride]: part q
// of t's rank r where col is adapter `key`'s, else 0.
__device__ __forceinline__ float lora_stack_elem(const float* row, int pstride, int col, int KS, int parts, int key,
                                                 int max_loras, int max_rank) {
    const int p = col / KS, u = col - p * KS, kr = max_loras * max_rank;
    if (u >= parts * kr) return 0.f;
    const int q = u / kr, rem = u - q * kr, a = rem / max_rank, r = rem - a * max_rank;
    if (a != key) return 0.f;
    const float v = row[p * pstride + r];
    const float hi = __bfloat162float(__float2bfloat16(v));
    return q == 0 ? hi : v - hi;  // rounded to bf16 by the store
}

// T's vector of columns c0 .. c0 + 7 (c0 a multiple of 8) for one row, as lora_stack_elem's: where
// max_rank is a multiple of 8 the vector lies in one (projection, part, adapter) block (KS and K R are
// too), so it is decoded once, not per element.
__device__ __forceinline__ uint4 lora_stack_vec(const float* row, int pstride, int c0, int KS, int parts, int key,
                                                int max_loras, int max_rank) {
    unsigned w[4];
    if ((max_rank & 7) == 0) {
        const int p = c0 / KS, u = c0 - p * KS, kr = max_loras * max_rank;
        const int q = u / kr, rem = u - q * kr, a = rem / max_rank;
        if (u >= parts * kr || a != key) return make_uint4(0u, 0u, 0u, 0u);
        const float* v = row + p * pstride + rem - a * max_rank;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float e[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float x = v[2 * j + h], hi = __bfloat162float(__float2bfloat16(x));
                e[h] = q == 0 ? hi : x - hi;  // rounded to bf16 by the store
            }
            w[j] = pack_bf16x2(e[0], e[1]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            w[j] = pack_bf16x2(lora_stack_elem(row, pstride, c0 + 2 * j, KS, parts, key, max_loras, max_rank),
                               lora_stack_elem(row, pstride, c0 + 2 * j + 1, KS, parts, key, max_loras, max_rank));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// T's whole rows of chunk c (t: the chunk's scaled t, np projections of [LORA_CHUNK][rp]).
__device__ __forceinline__ void lora_stack_write(const float* t, int rp, int np, const LoraBuckets& b, int c,
                                                 int pos0, bf16* __restrict__ T, int KS, int parts, int max_loras,
                                                 int max_rank) {
    const int width = np * KS, V = width >> 3, key = b.key[c];
    for (int e = threadIdx.x; e < b.rows[c] * V; e += blockDim.x) {
        const int i = e / V, c0 = 8 * (e - i * V);
        *reinterpret_cast<uint4*>(T + (size_t)(pos0 + b.list[b.first[c] + i]) * width + c0) =
            lora_stack_vec(t + i * rp, LORA_CHUNK * rp, c0, KS, parts, key, max_loras, max_rank);
    }
}

// T [P, 2 KS] of the positions ti.y .. ti.y + ti.z - 1 of table slot ti.x (lora_grouped_gate_up_act's
// buckets, chunks and shrink; the block's grid-y peers split its chunks and its rows without an adapter).
__device__ __forceinline__ void lora_stack_t_gate_up_rows(int4 ti, const bf16* __restrict__ x,
                                                          const bf16* __restrict__ xe, const int* __restrict__ lora_ids,
                                                          const int* __restrict__ sorted_row,
                                                          const bf16* __restrict__ gate_a, const bf16* __restrict__ up_a,
                                                          const float* __restrict__ scale, bf16* __restrict__ T, int H,
                                                          int n_local, int max_rank, int max_loras, int parts, int KS) {
    __shared__ LoraBuckets b;
    extern __shared__ __align__(16) float parts_[];
    const int rp = (max_rank + 15) & ~15, n = 2 * LORA_CHUNK * rp;
    const bf16* in = ti.x == n_local ? x : xe;  // the shared expert reads x
    float* t = parts_ + LORA_MMA_WARPS * n;
    for (int s0 = 0; s0 < ti.z; s0 += LORA_SUB) {
        const int pos0 = ti.y + s0, m = min(LORA_SUB, ti.z - s0);
        lora_sub_tile(b, lora_ids, sorted_row, pos0, m, max_loras);
        lora_stack_zero_rows(b, T, pos0, m, 2 * KS);
        __syncthreads();
        for (int c = blockIdx.y; c < b.chunks; c += gridDim.y) {
            const LoraRows r = lora_chunk_rows(b, c, pos0);
            const size_t ks = (size_t)b.key[c] * (n_local + 1) + ti.x;
            lora_chunk_t<2>(parts_, t, rp, gate_a + ks * max_rank * H, up_a + ks * max_rank * H,
                            lora_inputs(r, in, sorted_row, H), H, H, max_rank, scale + ks * 3);
            lora_stack_write(t, rp, 2, b, c, pos0, T, KS, parts, max_loras, max_rank);
            __syncthreads();  // the next chunk's parts and t
        }
    }
}

// grid (the gate/up GEMM's tile bound, Y), block LORA_MMA_WARPS warps, shared memory as
// lora_grouped_gate_up_act's. T [P, 2 KS] of the tile's positions (lora_stack_t_gate_up_rows).
__global__ void __launch_bounds__(LORA_MMA_WARPS * 32, 2)
lora_stack_t_gate_up(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ lora_ids,
                     const int* __restrict__ num_tiles, const int4* __restrict__ tile_info,
                     const int* __restrict__ sorted_row, const bf16* __restrict__ gate_a,
                     const bf16* __restrict__ up_a, const float* __restrict__ scale, bf16* __restrict__ T, int H,
                     int n_local, int max_rank, int max_loras, int parts, int KS) {
    pdl_wait_then_release_next();  // launched plainly: the release lets its GEMM (by PDL) run its K beside it
    if ((int)blockIdx.x >= *num_tiles) return;
    lora_stack_t_gate_up_rows(tile_info[blockIdx.x], x, xe, lora_ids, sorted_row, gate_a, up_a, scale, T, H, n_local,
                              max_rank, max_loras, parts, KS);
}

// The rows tile b's blocks take where a run's tiles go LORA_SUB rows at a time (forward_plan:
// CUPYMOE_LORA_SHRINK_RUNS): a run's (one table slot's) tiles are consecutive, BM rows each but its
// last; the blocks of the run's tiles k = 0, per, 2 per, ... (per = LORA_SUB / BM) take their tile
// and the next per - 1, the others nothing (false), so the slot's adapters' A rows are read once a
// LORA_SUB rows, not once a tile. The run (its first position) from the sort's active lists.
__device__ __forceinline__ bool lora_run_piece(int4& ti, const int* __restrict__ num_tiles,
                                               const int4* __restrict__ tile_info, const int* __restrict__ num_active,
                                               const int* __restrict__ active_start,
                                               const int* __restrict__ active_len, int n_local) {
    __shared__ int run_start, run_end;
    const int tb = blockIdx.x;
    if (tb >= *num_tiles) return false;  // the whole block alike
    ti = tile_info[tb];
    const int4 prev = tb > 0 ? tile_info[tb - 1] : make_int4(-1, 0, 0, 0);
    const int na = *num_active;
    bool hit = false;
    for (int i = threadIdx.x; i <= n_local; i += blockDim.x) {
        if (i >= na) break;
        const int s = active_start[i], l = active_len[i];
        if (s <= ti.y && ti.y < s + l) {  // exactly one run holds the tile
            run_start = s;
            run_end = s + l;
            hit = true;
        }
    }
    if (!__syncthreads_or(hit)) return true;  // no run holds it (lists and tiles disagree): the tile alone
    const bool first = prev.x != ti.x;  // the run's first tile: a full one where the run has more
    const int bm = first ? ti.z : ti.y - prev.y, per = max(1, LORA_SUB / bm);
    if (!first && ((ti.y - run_start) / bm) % per != 0) return false;
    ti.z = min(per * bm, run_end - ti.y);
    return true;
}

// lora_stack_t_gate_up with a run's tiles LORA_SUB rows a block (lora_run_piece): its arguments,
// then the sort's active lists and the table's slot count.
__global__ void __launch_bounds__(LORA_MMA_WARPS * 32, 2)
lora_stack_t_gate_up_runs(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ lora_ids,
                          const int* __restrict__ num_tiles, const int4* __restrict__ tile_info,
                          const int* __restrict__ sorted_row, const bf16* __restrict__ gate_a,
                          const bf16* __restrict__ up_a, const float* __restrict__ scale, bf16* __restrict__ T, int H,
                          int n_local, int max_rank, int max_loras, int parts, int KS,
                          const int* __restrict__ num_active, const int* __restrict__ active_start,
                          const int* __restrict__ active_len) {
    pdl_wait_then_release_next();  // as lora_stack_t_gate_up
    int4 ti;
    if (!lora_run_piece(ti, num_tiles, tile_info, num_active, active_start, active_len, n_local)) return;
    lora_stack_t_gate_up_rows(ti, x, xe, lora_ids, sorted_row, gate_a, up_a, scale, T, H, n_local, max_rank,
                              max_loras, parts, KS);
}

// grid (the down GEMM's tile bound, Y), block LORA_MMA_WARPS warps, shared memory as
// lora_grouped_down_delta's. T [P, KS] of the tile's positions: t = s A_down act[pos]
// (the routing weight is the GEMM epilogue's, applied to base and delta alike).
__global__ void __launch_bounds__(LORA_MMA_WARPS * 32, 2)
lora_stack_t_down(const bf16* __restrict__ act, const int* __restrict__ lora_ids, const int* __restrict__ num_tiles,
                  const int4* __restrict__ tile_info, const int* __restrict__ sorted_row,
                  const int* __restrict__ inter, const bf16* __restrict__ down_a, const float* __restrict__ scale,
                  bf16* __restrict__ T, int I_max, int n_local, int max_rank, int max_loras, int parts, int KS) {
    __shared__ LoraBuckets b;
    extern __shared__ __align__(16) float parts_[];
    pdl_wait_then_release_next();  // launched plainly: the release lets its GEMM (by PDL) run its K beside it
    if ((int)blockIdx.x >= *num_tiles) return;
    const int4 ti = tile_info[blockIdx.x];
    const int I = inter[ti.x], rp = (max_rank + 15) & ~15, n = LORA_CHUNK * rp;
    float* t = parts_ + LORA_MMA_WARPS * n;
    for (int s0 = 0; s0 < ti.z; s0 += LORA_SUB) {
        const int pos0 = ti.y + s0, m = min(LORA_SUB, ti.z - s0);
        lora_sub_tile(b, lora_ids, sorted_row, pos0, m, max_loras);
        lora_stack_zero_rows(b, T, pos0, m, KS);
        __syncthreads();
        for (int c = blockIdx.y; c < b.chunks; c += gridDim.y) {
            const LoraRows r = lora_chunk_rows(b, c, pos0);
            const size_t ks = (size_t)b.key[c] * (n_local + 1) + ti.x;
            const bf16* a0 = down_a + ks * max_rank * I_max;
            lora_chunk_t<1>(parts_, t, rp, a0, a0, lora_inputs(r, act, nullptr, I_max), I, I_max, max_rank,
                            scale + ks * 3 + 2);
            lora_stack_write(t, rp, 1, b, c, pos0, T, KS, parts, max_loras, max_rank);
            __syncthreads();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The stacked form's shrink by adapter segments (CUPYMOE_LORA_STACK_SHRINK=segments; auto past 2048
// rows): block (tile, a) takes the tile's positions whose adapter is a (in position order), LSS_BM at
// a time, against adapter a's A rows of the tile's expert, C [rows, NP R] = v A_{a,e}^T: a cp.async
// ring of LSS_STAGES 64-column K steps (the rows' inputs and the NP R A rows), mma.sync with a warp 16
// rows x BN columns (BN: NP R rounded up to 16), so each stage's loads are in flight while earlier
// ones multiply. The epilogue scales each column by its projection's s and writes the rows' whole T
// rows as lora_stack_t_* do (part q of s t in adapter a's columns, zeros elsewhere); the tile's rows
// without an adapter get zero rows, its blocks splitting them. A row's t is its own row's K-order sum,
// whatever shares its block.
// ---------------------------------------------------------------------------------------------
#define LSS_BM 64
#define LSS_BK 64
#define LSS_STAGES 4
#define LSS_THREADS 128  // four warps of 16 rows

template <int BN>
struct LssShape {
    static_assert(BN == 16 || BN == 32 || BN == 64, "whole ldmatrix pairs of 8-column n-tiles");
    static constexpr int CHUNKS = LSS_BK / 8;  // 16-byte chunks a stage row
    static constexpr int A_PER = LSS_BM * CHUNKS / LSS_THREADS, B_PER = BN * CHUNKS / LSS_THREADS;
    static constexpr int LD = BN + 4;  // the fp32 staging's row stride
    // the blocks an SM its stages allow on sm_90 (48 or 64 KB; fewer fit on sm_80 / 8x): bounding ptxas
    // to them keeps its registers from spilling
    static constexpr int MIN_BLOCKS = BN == 64 ? 3 : 4;
    static_assert(A_PER * LSS_THREADS == LSS_BM * CHUNKS && B_PER * LSS_THREADS == BN * CHUNKS, "tile / threads");
    static_assert(LSS_BM * LD * 4 <= LSS_STAGES * (LSS_BM + BN) * LSS_BK * 2, "the staging fits the stages");
};

// A slice's cp.async copies of a stage: its rows' inputs (zeros past the slice's rows) and the
// block's A rows (zeros past NP R), each thread's sources resolved once.
template <int BN>
struct LssLoader {
    using Shape = LssShape<BN>;
    const bf16* a_src[Shape::A_PER];
    const bf16* b_src[Shape::B_PER];
    unsigned a_ok, b_ok;  // bit i: chunk i's row exists
    int chunk;

    __device__ __forceinline__ void load(bf16* sA, bf16* sB, int k0, int K) const {
        const int kc = k0 + chunk * 8;
        const bool kin = kc < K;
        const int k = kin ? kc : 0;
#pragma unroll
        for (int i = 0; i < Shape::A_PER; ++i)
            cp_async16(sA + swz<LSS_BK>((threadIdx.x + i * LSS_THREADS) / Shape::CHUNKS, chunk), a_src[i] + k,
                       ((a_ok >> i) & 1) && kin);
#pragma unroll
        for (int i = 0; i < Shape::B_PER; ++i)
            cp_async16(sB + swz<LSS_BK>((threadIdx.x + i * LSS_THREADS) / Shape::CHUNKS, chunk), b_src[i] + k,
                       ((b_ok >> i) & 1) && kin);
    }
};

// One LSS_BK step of the warp's 16 x BN accumulators from stage tiles tA (rows 16 warp ..) and tB.
template <int BN>
__device__ __forceinline__ void lora_seg_mma_step(float (&acc)[BN / 8][4], const bf16* tA, const bf16* tB, int warp,
                                                  int lane) {
#pragma unroll
    for (int kk = 0; kk < LSS_BK / 16; ++kk) {
        unsigned af[4];
        ldmatrix_x4(af[0], af[1], af[2], af[3], tA + swz<LSS_BK>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int jp = 0; jp < BN / 16; ++jp) {  // pairs of n-tiles (2 jp, 2 jp + 1)
            unsigned b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, tB + swz<LSS_BK>(16 * jp + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
            mma_bf16(acc[2 * jp], af, b0, b1);
            mma_bf16(acc[2 * jp + 1], af, b2, b3);
        }
    }
}

// The sub-tile's positions (pos0 .., m of them) of adapter a appended to list[n0, n) in position
// order (a ballot a warp, the warps' counts met in shared memory); returns n. lid must be
// written and the block met.
__device__ __forceinline__ int lora_seg_list(const int* lid, int* list, int* warp_n, int m, int a, int pos0, int n0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n = n0;
    for (int i0 = 0; i0 < m; i0 += LSS_THREADS) {
        const int i = i0 + threadIdx.x;
        const bool mine = i < m && lid[i] == a;
        const unsigned bal = __ballot_sync(CUPYMOE_FULL_MASK, mine);
        if (lane == 0) warp_n[warp] = __popc(bal);
        __syncthreads();
        int before = n, total = n;
#pragma unroll
        for (int w = 0; w < LSS_THREADS / 32; ++w) {
            before += w < warp ? warp_n[w] : 0;
            total += warp_n[w];
        }
        if (mine) list[before + __popc(bal & ((1u << lane) - 1u))] = pos0 + i;
        n = total;
        __syncthreads();  // warp_n is rewritten next round
    }
    return n;
}

// Block (t, a)'s rows: ti = (expert, first position, rows) of its tile or expert piece. Adapter a's
// positions are listed sub-tile by sub-tile (LORA_SUB at a time) and multiplied LSS_BM at a time, the
// fewer left over waiting for the next sub-tile's, so a's A rows stream once for each LSS_BM of its rows.
#define LORA_SEG_ARGS const bf16 *__restrict__ x, const bf16 *__restrict__ xe, const bf16 *__restrict__ act, \
    const int *__restrict__ lora_ids, const int *__restrict__ sorted_row, const int *__restrict__ inter, \
    const bf16 *__restrict__ a0, const bf16 *__restrict__ a1, const float *__restrict__ scale, bf16 *__restrict__ T, \
    int H, int I_max, int n_local, int max_rank, int max_loras, int parts, int KS
#define LORA_SEG_ARG_NAMES x, xe, act, lora_ids, sorted_row, inter, a0, a1, scale, T, H, I_max, n_local, max_rank, \
    max_loras, parts, KS

template <int NP, int BN>
__device__ __forceinline__ void lora_seg_rows(const int4 ti, LORA_SEG_ARGS) {
    using Shape = LssShape<BN>;
    constexpr int LD = Shape::LD;
    extern __shared__ __align__(128) unsigned char lss_smem[];
    __shared__ int lid[LORA_SUB], list[LORA_SUB + LSS_BM], warp_n[LSS_THREADS / 32];
    __shared__ float col_scale[BN];
    const int e = ti.x, a = blockIdx.y, R = max_rank, width = NP * KS;
    const int K = NP == 2 ? H : inter[e], stride = NP == 2 ? H : I_max, KT = (K + LSS_BK - 1) / LSS_BK;
    const bf16* in = NP == 2 ? (e == n_local ? x : xe) : act;  // the shared expert reads x
    const size_t slot = (size_t)a * (n_local + 1) + e;
    bf16* sA = reinterpret_cast<bf16*>(lss_smem);
    bf16* sB = sA + LSS_STAGES * LSS_BM * LSS_BK;
    float* st = reinterpret_cast<float*>(lss_smem);  // after a slice's main loop: s t [LSS_BM][LD]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;

    // the B rows (a's NP R A rows, zeros past them) and the columns' s: the same for every slice
    LssLoader<BN> ld;
    ld.chunk = threadIdx.x % Shape::CHUNKS;
    ld.b_ok = 0u;
#pragma unroll
    for (int i = 0; i < Shape::B_PER; ++i) {
        const int c = (threadIdx.x + i * LSS_THREADS) / Shape::CHUNKS, cc = min(c, NP * R - 1);
        ld.b_ok |= (unsigned)(c < NP * R) << i;
        ld.b_src[i] = (cc >= R ? a1 : a0) + (slot * R + cc % R) * stride;
    }
    for (int c = threadIdx.x; c < BN; c += LSS_THREADS)
        col_scale[c] = c < NP * R ? scale[slot * 3 + (NP == 2 ? c / R : 2)] : 0.f;

    int have = 0;  // adapter a's positions listed, not yet multiplied (fewer than LSS_BM between sub-tiles)
    for (int s0 = 0; s0 < ti.z; s0 += LORA_SUB) {
        const int pos0 = ti.y + s0, m = min(LORA_SUB, ti.z - s0);
        for (int i = threadIdx.x; i < m; i += LSS_THREADS) {
            const int id = lora_ids[sorted_row[pos0 + i]];
            lid[i] = id >= 0 && id < max_loras ? id : -1;  // an id >= K was flagged (router delta, route-in)
        }
        __syncthreads();
        // the rows without an adapter: zero rows, the tile's blocks splitting them
        for (int v = threadIdx.x + blockIdx.y * LSS_THREADS; v < m * (width >> 3); v += LSS_THREADS * gridDim.y) {
            const int i = v / (width >> 3);
            if (lid[i] < 0)
                *reinterpret_cast<uint4*>(T + (size_t)(pos0 + i) * width + 8 * (v - i * (width >> 3))) = make_uint4(0u, 0u, 0u, 0u);
        }
        have = lora_seg_list(lid, list, warp_n, m, a, pos0, have);
        const bool last = s0 + LORA_SUB >= ti.z;
        int r0 = 0;
        for (; have - r0 >= LSS_BM || (last && r0 < have); r0 += LSS_BM) {
            const int rows = min(LSS_BM, have - r0);
            ld.a_ok = 0u;
#pragma unroll
            for (int i = 0; i < Shape::A_PER; ++i) {
                const int r = (threadIdx.x + i * LSS_THREADS) / Shape::CHUNKS;
                const int pos = list[r0 + min(r, rows - 1)];
                ld.a_ok |= (unsigned)(r < rows) << i;
                ld.a_src[i] = in + (size_t)(NP == 2 ? sorted_row[pos] : pos) * stride;
            }
            float acc[BN / 8][4];
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
            for (int s = 0; s < LSS_STAGES - 1; ++s) {
                if (s < KT) ld.load(sA + s * LSS_BM * LSS_BK, sB + s * BN * LSS_BK, s * LSS_BK, K);
                cp_async_commit();
            }
            for (int kt = 0; kt < KT; ++kt) {
                cp_async_wait<LSS_STAGES - 2>();
                __syncthreads();  // stage kt has landed for every thread; the stage refilled below was read in kt - 1
                const int kn = kt + LSS_STAGES - 1;
                if (kn < KT) {
                    const int sn = kn % LSS_STAGES;
                    ld.load(sA + sn * LSS_BM * LSS_BK, sB + sn * BN * LSS_BK, kn * LSS_BK, K);
                }
                cp_async_commit();
                const int s = kt % LSS_STAGES;
                if (warp * 16 < rows)  // a warp whose 16 rows are past the slice's has nothing to multiply
                    lora_seg_mma_step<BN>(acc, sA + s * LSS_BM * LSS_BK, sB + s * BN * LSS_BK, warp, lane);
            }
            cp_async_wait<0>();
            __syncthreads();  // every warp is done with the stages: they become the staging
            // C fragment: row 16 warp + g + 8 h, column 8 j + 2 t4 + u
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const int c = 8 * j + 2 * t4 + u;
                        st[(warp * 16 + g + 8 * h) * LD + c] = acc[j][2 * h + u] * col_scale[c];
                    }
            __syncthreads();
            // the rows' whole T rows (16-byte stores): part q of s t in adapter a's columns, zeros elsewhere
            const int V = width >> 3;
            for (int v = threadIdx.x; v < rows * V; v += LSS_THREADS) {
                const int i = v / V, c0 = 8 * (v - i * V);
                *reinterpret_cast<uint4*>(T + (size_t)list[r0 + i] * width + c0) =
                    lora_stack_vec(st + i * LD, R, c0, KS, parts, a, max_loras, R);
            }
            __syncthreads();  // the next slice's stages overwrite the staging
        }
        if (r0 > 0) {  // fewer than LSS_BM listed rows wait for the next sub-tile's: to the list's front
            const int rest = have - r0, p = threadIdx.x < rest ? list[r0 + threadIdx.x] : 0;
            __syncthreads();
            if (threadIdx.x < rest) list[threadIdx.x] = p;
            __syncthreads();
            have = rest;
        }
    }
}

// grid (the GEMM's tile bound, max_loras), block LSS_THREADS, dynamic shared memory LSS_STAGES
// (LSS_BM + BN) LSS_BK bf16 (catalog.lora_seg_smem). NP 2: gate/up (x's rows through sorted_row,
// xe for routed experts; gate_a, up_a; K = H); NP 1: down (act's rows by position; down_a; K = the
// expert's I, row stride I_max). T as lora_stack_t_gate_up / lora_stack_t_down write it.
template <int NP, int BN>
__global__ void __launch_bounds__(LSS_THREADS, LssShape<BN>::MIN_BLOCKS)
lora_stack_t_seg(const bf16* __restrict__ x, const bf16* __restrict__ xe, const bf16* __restrict__ act,
                 const int* __restrict__ lora_ids, const int* __restrict__ num_tiles, const int4* __restrict__ tile_info,
                 const int* __restrict__ sorted_row, const int* __restrict__ inter, const bf16* __restrict__ a0,
                 const bf16* __restrict__ a1, const float* __restrict__ scale, bf16* __restrict__ T, int H, int I_max,
                 int n_local, int max_rank, int max_loras, int parts, int KS) {
    // launched plainly (the prefill path alone); its GEMM may follow by PDL and run its K beside it
    pdl_wait_then_release_next();
    if ((int)blockIdx.x >= *num_tiles) return;
    lora_seg_rows<NP, BN>(tile_info[blockIdx.x], LORA_SEG_ARG_NAMES);
}

// The same by expert pieces (CUPYMOE_LORA_STACK_SHRINK=experts): grid (the active experts' bound,
// max_loras, ceil(N / LSS_PIECE)), block (j, a, p) taking rows p LSS_PIECE .. of active expert j's run,
// so an expert's adapter rows share one block and its A rows are not read again for each GEMM tile.
#define LSS_PIECE 768  // four LORA_SUB sub-tiles (catalog.LORA_SEG_PIECE_ROWS)
template <int NP, int BN>
__global__ void __launch_bounds__(LSS_THREADS, LssShape<BN>::MIN_BLOCKS)
lora_stack_t_seg_experts(const bf16* __restrict__ x, const bf16* __restrict__ xe, const bf16* __restrict__ act,
                         const int* __restrict__ lora_ids, const int* __restrict__ num_active,
                         const int* __restrict__ active_slot, const int* __restrict__ active_start,
                         const int* __restrict__ active_len, const int* __restrict__ sorted_row,
                         const int* __restrict__ inter, const bf16* __restrict__ a0, const bf16* __restrict__ a1,
                         const float* __restrict__ scale, bf16* __restrict__ T, int H, int I_max, int n_local,
                         int max_rank, int max_loras, int parts, int KS) {
    pdl_wait_then_release_next();  // as lora_stack_t_seg
    const int j = blockIdx.x, p0 = blockIdx.z * LSS_PIECE;
    if (j >= *num_active) return;
    const int len = active_len[j];
    if (p0 >= len) return;
    lora_seg_rows<NP, BN>(make_int4(active_slot[j], active_start[j] + p0, min(LSS_PIECE, len - p0), 0),
                          LORA_SEG_ARG_NAMES);
}

// ---------------------------------------------------------------------------------------------
// The router's delta by row spans (prefill): a block `span` consecutive rows (at most LORA_SUB;
// forward_plan.lora_router_span), bucketed by adapter as the expert tiles are, so an adapter's
// fp32 A is read once a chunk, not once a row. The shrink on tensor cores: x is bf16 (exact), A
// fp32 split in three bf16 parts (a = a1 + a2 + a3 to 2^-27 of a: fp32's own precision), each product exact in the
// fp32 sums; the expand as lora_router_delta's (fp32, ranks in order).
// ---------------------------------------------------------------------------------------------
// v (8 fp32) as three sets of four bf16 pair registers: v = p[0] + p[1] + p[2] per element.
__device__ __forceinline__ void lora_split3(const float4& lo4, const float4& hi4, unsigned (&p)[3][4]) {
    float r[8] = {lo4.x, lo4.y, lo4.z, lo4.w, hi4.x, hi4.y, hi4.z, hi4.w};
#pragma unroll
    for (int s = 0; s < 3; ++s) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(r[2 * q], r[2 * q + 1]);
            const float2 hf = __bfloat1622float2(h);
            p[s][q] = *reinterpret_cast<const unsigned*>(&h);
            r[2 * q] -= hf.x;
            r[2 * q + 1] -= hf.y;
        }
    }
}

// This warp's part of a chunk's router shrink (as lora_mma_shrink_part, one fp32 matrix a
// [max_rank, len], each weight fragment's three bf16 parts serving the LORA_MT row tiles).
__device__ __forceinline__ void lora_mma_shrink_part_f32(float* part, int rp, const float* __restrict__ a,
                                                         const LoraInputs& in, int len, int max_rank) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3, warp = threadIdx.x >> 5;
    const float4 zf = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int kc = 0; kc < max_rank; kc += 16) {
        float c[2][LORA_MT][4] = {};
#pragma unroll 4  // four steps' loads in flight
        for (int h0 = warp * 32; h0 < len; h0 += LORA_MMA_WARPS * 32) {
            const int h = h0 + tig * 8;
            unsigned f[LORA_MT][2][4];
            lora_x_frags(f, in, h, len);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int rank = kc + 8 * nt + g;  // the B fragment's n = g
                const bool ok = h < len && rank < max_rank;
                const float* ar = a + (size_t)rank * len + h;
                unsigned p[3][4];
                lora_split3(ok ? __ldg(reinterpret_cast<const float4*>(ar)) : zf,
                            ok ? __ldg(reinterpret_cast<const float4*>(ar + 4)) : zf, p);
#pragma unroll
                for (int s = 0; s < 3; ++s) {
#pragma unroll
                    for (int mt = 0; mt < LORA_MT; ++mt) {
                        mma_bf16(c[nt][mt], f[mt][0], p[s][0], p[s][1]);
                        mma_bf16(c[nt][mt], f[mt][1], p[s][2], p[s][3]);
                    }
                }
            }
        }
        lora_store_part(part, rp, kc, c);
    }
}

// logits[row] += Bs[key] t_i for the chunk's rows (fp32, ranks in order, as lora_router_delta):
// a thread a column and every G-th row (G = blockDim / R groups of R threads, or one group walking
// the columns), LORA_RX rows at once so that their logits loads are in flight together. A column's
// first LORA_ROUTER_HELD ranks of Bs (the slots', not the router's) are loaded together before the
// PDL wait, so after it the rows cost their logits' trip alone.
#define LORA_RX 2
#define LORA_ROUTER_HELD 16
__device__ __forceinline__ void lora_router_expand(const LoraBuckets& b, int c, int row0, const float* t, int rp,
                                                   const float* __restrict__ bs, float* __restrict__ logits, int R,
                                                   int max_rank) {
    const int W = min(R, (int)blockDim.x), G = (int)blockDim.x / W, g = (int)threadIdx.x / W;
    if (g >= G) return;  // reads no logits: no wait
    const int rows = b.rows[c];
    for (int col = threadIdx.x % W; col < R; col += W) {
        const float* be = bs + ((size_t)b.key[c] * R + col) * max_rank;
        float bh[LORA_ROUTER_HELD];
#pragma unroll
        for (int j = 0; j < LORA_ROUTER_HELD; ++j) bh[j] = j < max_rank ? __ldg(be + j) : 0.f;
        pdl_wait_then_release_next();  // the router's logits from here on
        for (int i0 = g; i0 < rows; i0 += LORA_RX * G) {
            float d[LORA_RX], l[LORA_RX];
            size_t o[LORA_RX];
            const float* ti[LORA_RX];
#pragma unroll
            for (int u = 0; u < LORA_RX; ++u) {
                const int i = min(i0 + u * G, rows - 1);  // rows past the chunk: computed, not stored
                o[u] = (size_t)(row0 + b.list[b.first[c] + i]) * R + col;
                l[u] = logits[o[u]];
                ti[u] = t + i * rp;
                d[u] = 0.f;
            }
#pragma unroll
            for (int j = 0; j < LORA_ROUTER_HELD; ++j)
                if (j < max_rank)
#pragma unroll
                    for (int u = 0; u < LORA_RX; ++u) d[u] = fmaf(bh[j], ti[u][j], d[u]);
            for (int j = LORA_ROUTER_HELD; j < max_rank; ++j) {
                const float bj = __ldg(be + j);
#pragma unroll
                for (int u = 0; u < LORA_RX; ++u) d[u] = fmaf(bj, ti[u][j], d[u]);
            }
#pragma unroll
            for (int u = 0; u < LORA_RX; ++u)
                if (i0 + u * G < rows) logits[o[u]] = l[u] + d[u];
        }
    }
}

// grid (ceil(N / span), Y), block LORA_MMA_WARPS warps, shared memory (LORA_MMA_WARPS
// + 1) LORA_CHUNK rp floats. lora_router_delta's work (same slots, ids, error bit: block y = 0)
// for a span of rows, chunk c by the span's block y = c mod Y. By PDL after the router (the
// prefill overlap, forward_plan.with_lora) its bucketing and shrinks read only the call's x and ids
// and the slots, so they run beside the router; the wait comes before the logits are read.
__global__ void __launch_bounds__(LORA_MMA_WARPS * 32, 2)
lora_grouped_router_delta(const bf16* __restrict__ x, const int* __restrict__ lora_ids, const float* __restrict__ a,
                          const float* __restrict__ bs, float* __restrict__ logits, int* __restrict__ err, int N,
                          int H, int R, int max_rank, int max_loras, int span) {
    __shared__ LoraBuckets b;
    extern __shared__ __align__(16) float parts[];
    const int row0 = blockIdx.x * span, m = min(span, N - row0);
    const int rp = (max_rank + 15) & ~15, n = LORA_CHUNK * rp;
    float* t = parts + LORA_MMA_WARPS * n;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int id = lora_ids[row0 + i];
        if (lora_id_invalid(id, max_loras) && blockIdx.y == 0) atomicOr(err, ERR_LORA_ID_RANGE);
        b.lid[i] = id >= 0 && id < max_loras ? id : -1;
    }
    __syncthreads();
    lora_bucket(b, m);
    __syncthreads();
    for (int c = blockIdx.y; c < b.chunks; c += gridDim.y) {
        const LoraRows r = lora_chunk_rows(b, c, row0);
        lora_mma_shrink_part_f32(parts + (threadIdx.x >> 5) * n, rp, a + (size_t)b.key[c] * max_rank * H,
                                 lora_inputs(r, x, nullptr, H), H, max_rank);
        __syncthreads();
        lora_sum_parts(t, parts, n, rp, 1.0f, 0.f);
        __syncthreads();
        lora_router_expand(b, c, row0, t, rp, bs, logits, R, max_rank);  // waits for the router inside
        __syncthreads();  // the next chunk's sum rewrites t
    }
    pdl_leave_early();  // a block 0 without chunks: the grid never completes before the router
}
