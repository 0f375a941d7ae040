// Helpers shared by rltune's CUDA kernels.
#pragma once
#include <math.h>
#include <stddef.h>

// A block's dynamic shared memory as `type *name` (tools/cuda/emulate defines it for the CPU
// emulation that CI runs the kernels in).
#ifndef RLTUNE_DYNAMIC_SHARED
#define RLTUNE_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

__device__ __forceinline__ size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// The sum of v over a warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The maximum of v over a warp, in every lane.
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
// Every thread of the block must call it; it may be called again right after.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const unsigned warps = (blockDim.x + 31u) >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) partial[0] = t;
  }
  __syncthreads();
  const float total = partial[0];
  __syncthreads(); // the next call writes partial again
  return total;
}

// The maximum of v over the block, in every thread (as block_sum).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const unsigned warps = (blockDim.x + 31u) >> 5;
    float t = lane < warps ? partial[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    if (lane == 0) partial[0] = t;
  }
  __syncthreads();
  const float total = partial[0];
  __syncthreads();
  return total;
}
