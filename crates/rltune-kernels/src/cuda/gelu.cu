// GELU with the tanh approximation, forward and backward: the CUDA twin of src/activation.rs.
// gelu(x) = x s, s = sigmoid(2u), u = k (x + c x^3), k = sqrt(2/pi), c = 0.044715;
// gelu'(x) = s + 2 x s (1 - s) k (1 + 3 c x^2).
#include <stddef.h>

#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

__device__ __forceinline__ float sigmoid_2u(float x) {
  const float two_u = (GELU_K + GELU_K) * (x + GELU_C * x * x * x);
  return 1.0f / (1.0f + expf(-two_u));
}

extern "C" __global__ void rltune_gelu_f32(float *__restrict__ out, const float *__restrict__ x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float xi = x[i];
    out[i] = xi * sigmoid_2u(xi);
  }
}

extern "C" __global__ void rltune_gelu_bwd_f32(float *__restrict__ out, const float *__restrict__ x,
                                               const float *__restrict__ g, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float xi = x[i], s = sigmoid_2u(xi);
    const float du = GELU_K * (1.0f + (GELU_C + GELU_C + GELU_C) * xi * xi);
    out[i] = g[i] * (s + 2.0f * xi * s * (1.0f - s) * du);
  }
}
