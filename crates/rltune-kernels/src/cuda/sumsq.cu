// The sum of squares of f32 tensors in f64, for the global gradient norm: each tensor's
// values are split among a fixed number of blocks (grid-stride), each block writes its partial
// sum, and one launch then sums every tensor's partials in order. Deterministic: the same
// inputs give the same bits, whatever ran before.
#include <stddef.h>

__device__ __forceinline__ double warp_sum_f64(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// partial[blockIdx.x] = sum over this block's share of g[i]^2 (blockDim.x = 256).
extern "C" __global__ void rltune_sumsq_partial_f32(double *__restrict__ partial, const float *__restrict__ g,
                                                   size_t n) {
  __shared__ double warps[8];
  double s = 0.0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const double v = (double)g[i];
    s += v * v;
  }
  s = warp_sum_f64(s);
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  if (lane == 0) warps[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (unsigned w = 0; w < (blockDim.x + 31u) / 32u; ++w) t += warps[w];
    partial[blockIdx.x] = t;
  }
}

// out[t] = sum of partial[offsets[t] .. offsets[t + 1]], one thread per tensor.
extern "C" __global__ void rltune_sumsq_finish(double *__restrict__ out, const double *__restrict__ partial,
                                               const unsigned long long *__restrict__ offsets, size_t tensors) {
  const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (t >= tensors) return;
  double s = 0.0;
  for (unsigned long long i = offsets[t]; i < offsets[t + 1]; ++i) s += partial[i];
  out[t] = s;
}
