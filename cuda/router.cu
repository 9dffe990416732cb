// Router stage: fp32 router logits (bf16 weights) and the pre-expert RMSNorm.
//
// router_logits_bf16<ROWS, SPLIT>: logits[n, r] = x[n, :] . W[r, :] (+ bias[r]), fp32 accumulation.
// SPLIT warps per router column r stream W[r, :] once per ROWS-row tile; each lane owns a
// fixed 8-element slice pattern of H, so a row's logit has the same accumulation order
// whatever N or ROWS is (row invariance: a row's bits never depend on its batch).
#include "common.cuh"
#include "lora_common.cuh"  // router_logits_bf16_lora's shrink
#include "quant.cuh"

// A block is 2 router columns x SPLIT warps splitting H. The split is fixed by H alone
// (kernels.router_split: 4 up to H = 4096, else 8, so a lane's share of a row is at most
// 1024 columns) and the SPLIT partial sums are added in split order, so the bits stay
// N-independent. A lane issues a round of ROUTER_UNROLL steps' loads before its first
// product: at 1-2 rows and H <= 8192 the router is one latency round trip, not H / 1024 of
// them. Four warps up to H = 4096: there eight only add partial sums for the same work.
#define ROUTER_COLS 2
#define ROUTER_UNROLL(ROWS) ((ROWS) <= 2 ? 4 : 2)  // steps of 256 columns whose loads a lane issues together

// Block bx's two router columns of the row tile blockIdx.y (router_logits_bf16's products).
template <int ROWS, int ROUTER_SPLIT>
__device__ __forceinline__ void router_logits_cols(const bf16* __restrict__ x, const bf16* __restrict__ W,
                                                   const float* __restrict__ bias, float* __restrict__ logits, int N,
                                                   int R, int H, int bx) {
    __shared__ float part[ROUTER_COLS * ROUTER_SPLIT][ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = bx * ROUTER_COLS + warp / ROUTER_SPLIT;
    const int split = warp % ROUTER_SPLIT;
    const int chunk = ((H / 8 + ROUTER_SPLIT - 1) / ROUTER_SPLIT) * 8;
    const int k0 = split * chunk, k1 = min(H, k0 + chunk);
    const int row0 = blockIdx.y * ROWS;
    float acc[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
    if (r < R) {
        const bf16* w = W + (size_t)r * H;
        constexpr int U = ROUTER_UNROLL(ROWS);
        // U steps of 256 columns a round: every load of the round issued before the first
        // product (the same order of products per lane as one step at a time)
#pragma unroll 1
        for (int kb = k0 + lane * 8; kb < k1; kb += 256 * U) {
            bf16x8 wv[U], xv[U][ROWS];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = kb + 256 * u;
                if (k < k1) {
                    wv[u] = load_bf16x8_stream(w + k);
#pragma unroll
                    for (int i = 0; i < ROWS; ++i)  // past N: recompute a valid row, never stored
                        xv[u][i] = load_bf16x8(x + (size_t)min(row0 + i, N - 1) * H + k);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (kb + 256 * u < k1) {
                    float wf[8];
                    unpack_bf16x8(wv[u], wf);
#pragma unroll
                    for (int i = 0; i < ROWS; ++i) acc[i] = dot_bf16x8(xv[u][i], wf, acc[i]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0) part[warp][i] = v;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < ROUTER_COLS * ROWS; t += blockDim.x) {
        const int c = t / ROWS, i = t % ROWS;
        const int rc = bx * ROUTER_COLS + c, row = row0 + i;
        if (rc >= R || row >= N) continue;
        float v = 0.0f;
#pragma unroll
        for (int s = 0; s < ROUTER_SPLIT; ++s) v += part[c * ROUTER_SPLIT + s][i];
        logits[(size_t)row * R + rc] = v + (bias ? bias[rc] : 0.0f);
    }
}

// w8a8 (qx set): the launch also quantizes x into qx / sx (quant.cuh's rule) for the experts,
// since it reads x anyway: 256 columns of a row are a warp's unit, dealt over the grid's
// warps block by block (unit u to block u % blocks), so no block takes more than its share
// and the chain gains no launch (one warp quantizing a whole row after routing it was on the
// chain's path). At one or two rows decode_route_lists' idle warps do it instead, hidden
// behind the routing.
// Every block of the grid takes its units (router_logits_bf16_lora's LoRA blocks too).
__device__ __forceinline__ void router_quantize_x(const bf16* __restrict__ x, int N, int H, u8* __restrict__ qx,
                                                  float* __restrict__ sx, int warps_per_block) {
#if CUPYMOE_SM >= 89
    if (qx) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int blocks = gridDim.x * gridDim.y, block = blockIdx.y * gridDim.x + blockIdx.x;
        e4m3_quantize_units(x, N, H, qx, sx, block + blocks * warp, blocks * warps_per_block, lane);
    }
#endif
}

template <int ROWS, int ROUTER_SPLIT>
__global__ void __launch_bounds__(ROUTER_COLS * ROUTER_SPLIT * 32)
router_logits_bf16(const bf16* __restrict__ x, const bf16* __restrict__ W, const float* __restrict__ bias,
                   float* __restrict__ logits, int N, int R, int H, u8* __restrict__ qx, float* __restrict__ sx) {
    pdl_wait_then_release_next();  // (the chain's first kernel: only the release does anything)
    router_logits_cols<ROWS, ROUTER_SPLIT>(x, W, bias, logits, N, R, H, blockIdx.x);
    router_quantize_x(x, N, H, qx, sx, ROUTER_COLS * ROUTER_SPLIT);
}

// router_logits_bf16 with the router's LoRA delta beside it (forward_plan.lora_fold: the decode
// chain's fewest rows): grid x (R + 1) / 2 router blocks, then S <= LORA_FOLD_SLICES LoRA blocks.
// LoRA block s takes slice s of H (lora_slice) of each row of its tile that has an adapter: t_s =
// A[slot][:, slice] x[row, slice] (lora_slice_shrink), then its share of the expand, part
// [row][s][e] = Bs[slot] row e . t_s for every logit e (the expand is linear in t, so the slices
// need not meet: decode_route_lists_lora sums the S shares in slice order). No block waits for
// another, so the work is one shrink slice and one expand long, beside the router's. An id >= K
// sets the error bit (slice 0's block) and adds nothing. Dynamic smem: max_rank floats.
template <int ROWS, int ROUTER_SPLIT>
__global__ void __launch_bounds__(ROUTER_COLS * ROUTER_SPLIT * 32, 1)  // 1: ptxas held sm_80's at 48 and spilled
router_logits_bf16_lora(const bf16* __restrict__ x, const bf16* __restrict__ W, const float* __restrict__ bias,
                        float* __restrict__ logits, int N, int R, int H, u8* __restrict__ qx, float* __restrict__ sx,
                        const int* __restrict__ lora_ids, const float* __restrict__ lora_a,
                        const float* __restrict__ lora_bs, float* __restrict__ part, int* __restrict__ err,
                        int max_rank, int max_loras) {
    extern __shared__ float lora_t[];  // [max_rank]
    pdl_wait_then_release_next();  // (the chain's first kernel: only the release does anything)
    const int rb = (R + 1) / 2, S = gridDim.x - rb, s = blockIdx.x - rb;
    if (s < 0) {
        router_logits_cols<ROWS, ROUTER_SPLIT>(x, W, bias, logits, N, R, H, blockIdx.x);
    } else {
        int lo, hi;
        lora_slice(H, s, S, lo, hi);
        for (int i = 0; i < ROWS; ++i) {  // block-uniform: every thread reads the row's id
            const int row = blockIdx.y * ROWS + i;
            const int id = row < N ? lora_ids[row] : -1;
            if (lora_id_invalid(id, max_loras) && s == 0 && threadIdx.x == 0) atomicOr(err, ERR_LORA_ID_RANGE);
            if (id < 0 || id >= max_loras) continue;
            const float* b = lora_bs + (size_t)id * R * max_rank;
            // the first B row a thread expands, into L1 while the shrink's loads are out
            if ((int)threadIdx.x < R) asm volatile("prefetch.global.L1 [%0];" ::"l"(b + (size_t)threadIdx.x * max_rank));
            const float* as = lora_a + (size_t)id * max_rank * H;
            lora_slice_shrink<1, true>(lora_t, as, as, x + (size_t)row * H, lo, hi, H, max_rank);
            __syncthreads();
            float* share = part + ((size_t)row * S + s) * R;
            for (int e = threadIdx.x; e < R; e += blockDim.x)
                share[e] = lora_router_dot(b + (size_t)e * max_rank, lora_t, max_rank);
            __syncthreads();  // lora_t again for the next row
        }
    }
    router_quantize_x(x, N, H, qx, sx, ROUTER_COLS * ROUTER_SPLIT);
}

// y[n, :] = bf16(x[n, :] * rsqrt(mean(x[n, :]^2) + eps) * w), one block per row. w8a8
// (qy set): also y's e4m3 codes and scales per 128 columns, from the bf16 values stored.
#define NORM_THREADS 256
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_bf16(const bf16* __restrict__ x, const float* __restrict__ w, bf16* __restrict__ y, int H, float eps,
             u8* __restrict__ qy, float* __restrict__ sy) {
    __shared__ float partial[NORM_THREADS / 32];
    pdl_wait_then_release_next();
    const size_t base = (size_t)blockIdx.x * H;
    float ss = 0.0f;
    for (int h = threadIdx.x * 8; h < H; h += NORM_THREADS * 8) {
        float f[8];
        unpack_bf16x8(load_bf16x8(x + base + h), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
    }
    const float inv = rsqrtf(block_sum<NORM_THREADS>(ss, partial) / (float)H + eps);
    // every lane runs every iteration: the quantization's amax is a half-warp shuffle
    for (int h0 = 0; h0 < H; h0 += NORM_THREADS * 8) {
        const int h = h0 + threadIdx.x * 8;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // past H: zeros, never stored
        if (h < H) {
            float f[8];
            unpack_bf16x8(load_bf16x8(x + base + h), f);
            __align__(16) bf16 o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                o[i] = __float2bfloat16(f[i] * inv * w[h + i]);
                v[i] = __bfloat162float(o[i]);
            }
            *reinterpret_cast<uint4*>(y + base + h) = *reinterpret_cast<const uint4*>(o);
        }
#if CUPYMOE_SM >= 89
        if (qy) {  // 16 lanes hold one 128-column group (h0 and the warp's 256 columns are 128-aligned)
            uint2 codes;
            const float sc = e4m3_group_quantize16(v, codes);
            if (h < H) {
                *reinterpret_cast<uint2*>(qy + base + h) = codes;
                if ((threadIdx.x & 15) == 0) sy[(size_t)blockIdx.x * ((H + 127) >> 7) + (h >> 7)] = sc;
            }
        }
#endif
    }
}
