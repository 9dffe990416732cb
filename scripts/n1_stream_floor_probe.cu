// Kernels of scripts/n1_stream_floor_probe.py: how fast a few MB of weights can be read at all,
// a launch a graph node, whatever the arithmetic (result: benchmarks/DECISIONS.md, decode).
//
//   bulk_stream  each block walks chunks blockIdx.x, + gridDim.x, ... of `chunk` contiguous bytes
//                through a ring of `stages` shared-memory slots, one cp.async.bulk (TMA engine)
//                a chunk on an mbarrier a slot, issued by thread 0; the block touches a word a
//                thread of each chunk and refills its slot
//   reg_stream   grid-strided 16-byte register loads, eight in flight a thread
//
// Neither computes anything: the sink's store (never taken) keeps the loads alive. The two
// bulk-copy issues (the ring's first chunks, a slot's next) are written out twice on purpose:
// this is the machine code the recorded figures came from, and a shared helper compiled to
// other code.
extern "C" __global__ void __launch_bounds__(128)
    bulk_stream(const char* __restrict__ w, long long total, int chunk, int stages, unsigned* sink) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) unsigned long long bar[16];
    const long long nchunks = total / chunk;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s)
            asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"((unsigned)__cvta_generic_to_shared(&bar[s])));
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    unsigned acc = 0;
    long long c = blockIdx.x;
    int it = 0;
    if (threadIdx.x == 0) {  // the ring's first `stages` chunks
        for (int s = 0; s < stages; ++s) {
            long long cc = blockIdx.x + (long long)s * gridDim.x;
            if (cc < nchunks) {
                unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
                asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(chunk));
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                        (unsigned)__cvta_generic_to_shared(smem + (size_t)s * chunk)),
                    "l"(w + cc * chunk), "r"(chunk), "r"(b)
                    : "memory");
            }
        }
    }
    for (; c < nchunks; c += gridDim.x, ++it) {
        int s = it % stages;
        unsigned phase = (it / stages) & 1;
        unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
        asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" ::"r"(b),
                     "r"(phase));
        acc += *(const unsigned*)(smem + (size_t)s * chunk + threadIdx.x * 4);
        __syncthreads();
        long long cn = c + (long long)stages * gridDim.x;
        if (threadIdx.x == 0 && cn < nchunks) {  // the slot's next chunk
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(chunk));
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    (unsigned)__cvta_generic_to_shared(smem + (size_t)s * chunk)),
                "l"(w + cn * chunk), "r"(chunk), "r"(b)
                : "memory");
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(256) reg_stream(const uint4* __restrict__ w, long long n16, unsigned* sink) {
    unsigned acc = 0;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = __ldg(w + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) {
        uint4 v = __ldg(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
