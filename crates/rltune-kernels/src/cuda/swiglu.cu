// SwiGLU, silu(gate) * up, forward and backward: the CUDA twin of src/swiglu.rs.
// silu(g) = g / (1 + e^-g), as the CPU kernel (and candle's CPU silu) computes it;
// with s = 1 / (1 + e^-g): d gate = dy * up * s * (1 + g (1 - s)), d up = dy * g * s.
#include <stddef.h>

extern "C" __global__ void rltune_swiglu_f32(float *__restrict__ out, const float *__restrict__ g,
                                             const float *__restrict__ u, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float gi = g[i];
    out[i] = gi / (1.0f + expf(-gi)) * u[i];
  }
}

// out holds [d gate; d up]: 2n values, d gate first.
extern "C" __global__ void rltune_swiglu_bwd_f32(float *__restrict__ out, const float *__restrict__ g,
                                                 const float *__restrict__ u, const float *__restrict__ dy,
                                                 size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float gi = g[i], s = 1.0f / (1.0f + expf(-gi));
    out[i] = dy[i] * u[i] * s * (1.0f + gi * (1.0f - s));
    out[n + i] = dy[i] * gi * s;
  }
}
