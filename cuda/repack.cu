// The fp4 device layout, made once at load (cupymoe/weights.py): every 32-bit word of an
// nvfp4 or mxfp4 matrix's packed codes gets its bits moved to where the kernels' bit
// placement wants them (quant.cuh fp4_word_repack, fp4x8_to_bf16_pairs). In place, one
// word a thread-iteration; the words of a row never straddle rows (the layer takes fp4 K
// in multiples of 32 codes), so the flat buffer is repacked whole.
#include "quant.cuh"

__global__ void fp4_repack_words(unsigned* __restrict__ words, unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        words[i] = fp4_word_repack(words[i]);
}
