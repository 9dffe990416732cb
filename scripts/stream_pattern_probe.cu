// Streaming-pattern probe (scripts/stream_pattern_probe.py): how fast the H200 streams the
// gate and up weights of a decode gate/up kernel in four access patterns, with nothing but
// the loads (an XOR keeps them live). A warp covers 16 rows of each of two [rows, K] byte
// matrices (the decode kernels' column group), a step 4 KB; `unroll` steps' loads are
// issued before the first is consumed (1 = the decode kernels' one step at a time).
//   mode 0 strided: the kernels' lanes, lane (g, t4) rows g and g + 8, bytes k0 + 32 t4 .. + 31
//          of each (32 rows x 128 B a step, row stride K)
//   mode 1 tiled:   the step's 4 KB contiguous (weights stored [R/16][K/128][16][128])
//   mode 2 8x256:   8 rows x 256 B of each matrix a step, k inner (row-major)
//   mode 3 4x512:   4 rows x 512 B of each matrix a step, k inner (row-major)
// What a decode block does besides streaming, optionally: `hops` dependent loads through
// `chain` (an identity table, as the kernels' active_slot -> pointers -> rows) before its
// first weight load, and with `epilogue` a fence, a barrier and a ticket (as the w8a8 gate/up's
// activation quantization) after its last.
// Measured: benchmarks/results/20261130-h200-stream-pattern-probe.txt (benchmarks/DECISIONS.md).
template <int unroll>
__device__ void probe(const unsigned char* __restrict__ w, unsigned* __restrict__ out, int K, int rows_per_mat, int mode,
                      const int* __restrict__ chain, int hops, int epilogue, int* __restrict__ tickets) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    int block = blockIdx.x;
    for (int h = 0; h < hops; ++h) block = chain[block];  // dependent: each load waits for the one before
    const int wid = block * 8 + warp;                     // 16 rows of each of 2 matrices a warp
    const size_t mat_bytes = (size_t)rows_per_mat * K;
    unsigned acc = 0;
    const int steps = K / 128;
    for (int s = 0; s < steps; s += unroll) {
        uint4 v[unroll][8];
#pragma unroll
        for (int u = 0; u < unroll; ++u) {
            if (s + u >= steps) break;
            const int k = (s + u) * 128;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned char* p;
                if (mode == 0) {   // the kernels': row (g or g+8) of matrix m, bytes k + 32 t4 + 16 h
                    const int m = i >> 2, hi = (i >> 1) & 1, h = i & 1;
                    const size_t row = (size_t)wid * 16 + g + 8 * hi;
                    p = w + m * mat_bytes + row * K + k + 32 * t4 + 16 * h;
                } else if (mode == 1) {           // tiled: the warp-step's 4 KB contiguous
                    const size_t base = ((size_t)wid * steps + (s + u)) * 4096;
                    p = w + base + i * 512 + lane * 16;
                } else if (mode == 2) {  // 8 rows x 256 B of each matrix an iteration, k chunks inner
                    const int it = s + u, kc = it % (K / 256), rh = it / (K / 256);
                    const size_t row = (size_t)wid * 16 + rh * 8 + (i % 4) * 2 + (lane >> 4);
                    p = w + (i / 4) * mat_bytes + row * K + kc * 256 + (lane & 15) * 16;
                } else {                 // 4 rows x 512 B of each matrix an iteration, k chunks inner
                    const int it = s + u, kc = it % (K / 512), rq = it / (K / 512);
                    const size_t row = (size_t)wid * 16 + rq * 4 + (i % 4);
                    p = w + (i / 4) * mat_bytes + row * K + kc * 512 + lane * 16;
                }
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(v[u][i].x), "=r"(v[u][i].y), "=r"(v[u][i].z), "=r"(v[u][i].w) : "l"(p));
            }
        }
#pragma unroll
        for (int u = 0; u < unroll; ++u) {
            if (s + u >= steps) break;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc ^= v[u][i].x ^ v[u][i].y ^ v[u][i].z ^ v[u][i].w;
        }
    }
    if (acc == 0x12345678u) out[0] = acc;
    if (epilogue) {
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(tickets + blockIdx.x, 1);
        __syncthreads();
        if (last == -1) out[1] = last;  // never: keeps the ticket's round trip
    }
}
#define PROBE_ARGS const unsigned char *w, unsigned *out, int K, int r, int mode, const int *chain, int hops, int epilogue, int *tickets
#define PROBE_NAMES w, out, K, r, mode, chain, hops, epilogue, tickets
extern "C" __global__ void __launch_bounds__(256, 2) probe1(PROBE_ARGS) { probe<1>(PROBE_NAMES); }
extern "C" __global__ void __launch_bounds__(256, 2) probe2(PROBE_ARGS) { probe<2>(PROBE_NAMES); }
extern "C" __global__ void __launch_bounds__(256, 2) probe4(PROBE_ARGS) { probe<4>(PROBE_NAMES); }
