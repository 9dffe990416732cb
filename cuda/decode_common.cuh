// What the decode kernels share (decode.cu: CUDA-core streams of every format;
// decode_fp4.cu: fp4 weights on tensor cores): the block size and the active-expert lookup.
#pragma once

#define DECODE_WARPS 8

// The table slot of active expert j (a decode block's blockIdx.y), or -1 when the block has
// nothing to do: past the active experts, or an expert of another weight format than FMT
// (the launch for that format serves it).
template <int FMT>
__device__ __forceinline__ int decode_block_slot(int j, const int* __restrict__ num_active,
                                                 const int* __restrict__ active_slot, const int* __restrict__ slot_fmt) {
    if (j >= *num_active) return -1;
    const int slot = active_slot[j];
    return slot_fmt[slot] == FMT ? slot : -1;
}
