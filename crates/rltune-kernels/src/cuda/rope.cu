// Rotary position embedding while splitting the heads: the CUDA twin of src/rope.rs.
// With x = [x1 | x2] along a head's D values and cos, sin (B, 1, T, D/2):
//   forward  (inverse = 0): x (B, T, H*D) -> out (B, H, T, D), out = [x1 c - x2 s | x2 c + x1 s];
//   backward (inverse = 1): dy (B, H, T, D) -> dx (B, T, H*D), dx = [x1 c + x2 s | x2 c - x1 s].
// One thread per (b, t, h, j < D/2), the CPU kernel's products and sums in its order.
#include <stddef.h>

extern "C" __global__ void rltune_rope_f32(float *__restrict__ out, const float *__restrict__ x,
                                           const float *__restrict__ cos, const float *__restrict__ sin,
                                           size_t b, size_t t, size_t h, size_t d, int inverse) {
  const size_t half = d / 2, n = b * t * h * half;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t j = i % half, hi = (i / half) % h, bt = i / (half * h), ti = bt % t, bi = bt / t;
    // Position (t, h) in the (T, H*D) layout and in the (H, T, D) one.
    const size_t thd = (bt * h + hi) * d, htd = ((bi * h + hi) * t + ti) * d;
    const size_t src = inverse ? htd : thd, dst = inverse ? thd : htd;
    const float c = cos[bt * half + j], s = sin[bt * half + j];
    const float x1 = x[src + j], x2 = x[src + half + j];
    if (inverse) {
      out[dst + j] = x1 * c + x2 * s;
      out[dst + half + j] = x2 * c - x1 * s;
    } else {
      out[dst + j] = x1 * c - x2 * s;
      out[dst + half + j] = x2 * c + x1 * s;
    }
  }
}
