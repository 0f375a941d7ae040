// Adam, in place, one f32 tensor per launch: the CUDA twin of `adam_rows` (src/optim/mod.rs),
// torch's `_single_tensor_adam` order of operations. Compiled with --fmad=false and IEEE
// square root and division (nvcc's defaults without --use_fast_math), so that every element
// equals the CPU kernel's bit for bit: no multiply-add is contracted on either side.
//
//   m <- m + (g - m)(1 - b1)
//   v <- v b2 + (1 - b2) g g
//   p <- p - step_size m / (sqrt(v) / bc2s + eps)
//
// k = {step_size, b1, b2, eps, bc2s}, step_size = lr / (1 - b1^t), bc2s = sqrt(1 - b2^t).
#include <stddef.h>

extern "C" __global__ void rltune_adam_f32(float *__restrict__ p, const float *__restrict__ g,
                                           float *__restrict__ m, float *__restrict__ v,
                                           size_t n, float step_size, float b1, float b2,
                                           float eps, float bc2s) {
  const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float gi = g[i];
    const float mi = m[i] + (gi - m[i]) * one_b1;
    const float vi = v[i] * b2 + one_b2 * gi * gi;
    const float denom = sqrtf(vi) / bc2s + eps;
    p[i] = p[i] - step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}
