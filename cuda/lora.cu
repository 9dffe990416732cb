// LoRA (DESIGN.md section 1, step 7; cupymoe/lora_slots.py owns the buffers): the router's
// delta, added to the logits between the router and the routing stage, so it can change the
// routing. The routed and shared experts' deltas are not served here yet (DESIGN.md "LoRA").
#include "common.cuh"

#define LORA_THREADS 256
#define ERR_LORA_ID_RANGE 4  // routing.cuh: ERR_TOKEN_ID_RANGE 1, ERR_EXPERT_ID_RANGE 2

// One block a row: t = A[slot] x (a warp a rank row, fp32 sums), then logits[row] += Bs[slot] t.
// A [K, max_rank, H] and Bs = scale * B [K, R, max_rank] are fp32, zero past an adapter's rank
// (and all zero in an empty slot), so every slot runs the same loops. Rows with id -1 leave at
// once; an id >= K sets an error bit and adds nothing. A row's delta reads that row alone, so
// its bits depend on neither N nor the batch (row_invariant holds).
__global__ void __launch_bounds__(LORA_THREADS)
lora_router_delta(const bf16* __restrict__ x,       // [N, H]: the router's input
                  const int* __restrict__ lora_ids,  // [N]: -1 = base only
                  const float* __restrict__ a,       // [K, max_rank, H]
                  const float* __restrict__ bs,      // [K, R, max_rank]
                  float* __restrict__ logits,        // [N, R] (a split router's copy 0)
                  int* __restrict__ err, int N, int H, int R, int max_rank, int max_loras) {
    extern __shared__ float t[];  // [max_rank]
    const int row = blockIdx.x;
    if (row >= N) return;
    const int slot = lora_ids[row];
    if (slot < 0) return;
    if (slot >= max_loras) {
        if (threadIdx.x == 0) atomicOr(err, ERR_LORA_ID_RANGE);
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const bf16* xr = x + (size_t)row * H;
    for (int j = warp; j < max_rank; j += warps) {
        const float* aj = a + ((size_t)slot * max_rank + j) * H;
        float s = 0.f;
        for (int i = lane; i < H; i += 32) s = fmaf(aj[i], __bfloat162float(xr[i]), s);
        s = warp_sum(s);
        if (lane == 0) t[j] = s;
    }
    __syncthreads();
    float* l = logits + (size_t)row * R;
    for (int e = threadIdx.x; e < R; e += blockDim.x) {
        const float* be = bs + ((size_t)slot * R + e) * max_rank;
        float d = 0.f;
        for (int j = 0; j < max_rank; ++j) d = fmaf(be[j], t[j], d);
        l[e] += d;
    }
}
