// Rotary position embedding while splitting the heads: the CUDA twin of src/rope.rs.
// With x = [x1 | x2] along a head's D values and cos, sin (B, 1, T, D/2):
//   forward  (inverse = 0): x (B, T, H*D) -> out (B, H, T, D), out = [x1 c - x2 s | x2 c + x1 s];
//   backward (inverse = 1): dy (B, H, T, D) -> dx (B, T, H*D), dx = [x1 c + x2 s | x2 c - x1 s].
// One thread per (b, t, h, j < D/2), the CPU kernel's products and sums in its order.
//
// The bf16 side (autocast's bf16 attention): the forward reads f32 and writes bf16, the backward
// reads the bf16 gradient and writes f32; the arithmetic is the f32 kernel's, each bf16 value
// rounded once.
#include <cuda_bf16.h>
#include <stddef.h>

__device__ __forceinline__ float rope_load(const float *x, size_t i) { return x[i]; }
__device__ __forceinline__ float rope_load(const __nv_bfloat16 *x, size_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ void rope_store(float *out, size_t i, float v) { out[i] = v; }
__device__ __forceinline__ void rope_store(__nv_bfloat16 *out, size_t i, float v) { out[i] = __float2bfloat16_rn(v); }

template <class In, class Out>
__device__ __forceinline__ void rope_kernel(Out *__restrict__ out, const In *__restrict__ x, const float *__restrict__ cos,
                                            const float *__restrict__ sin, size_t b, size_t t, size_t h, size_t d,
                                            int inverse) {
  const size_t half = d / 2, n = b * t * h * half;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t j = i % half, hi = (i / half) % h, bt = i / (half * h), ti = bt % t, bi = bt / t;
    // Position (t, h) in the (T, H*D) layout and in the (H, T, D) one.
    const size_t thd = (bt * h + hi) * d, htd = ((bi * h + hi) * t + ti) * d;
    const size_t src = inverse ? htd : thd, dst = inverse ? thd : htd;
    const float c = cos[bt * half + j], s = sin[bt * half + j];
    const float x1 = rope_load(x, src + j), x2 = rope_load(x, src + half + j);
    if (inverse) {
      rope_store(out, dst + j, x1 * c + x2 * s);
      rope_store(out, dst + half + j, x2 * c - x1 * s);
    } else {
      rope_store(out, dst + j, x1 * c - x2 * s);
      rope_store(out, dst + half + j, x2 * c + x1 * s);
    }
  }
}

extern "C" __global__ void rltune_rope_f32(float *__restrict__ out, const float *__restrict__ x,
                                           const float *__restrict__ cos, const float *__restrict__ sin,
                                           size_t b, size_t t, size_t h, size_t d, int inverse) {
  rope_kernel(out, x, cos, sin, b, t, h, d, inverse);
}

extern "C" __global__ void rltune_rope_f32_bf16(__nv_bfloat16 *__restrict__ out, const float *__restrict__ x,
                                                const float *__restrict__ cos, const float *__restrict__ sin,
                                                size_t b, size_t t, size_t h, size_t d, int inverse) {
  rope_kernel(out, x, cos, sin, b, t, h, d, inverse);
}

extern "C" __global__ void rltune_rope_bf16_f32(float *__restrict__ out, const __nv_bfloat16 *__restrict__ x,
                                                const float *__restrict__ cos, const float *__restrict__ sin,
                                                size_t b, size_t t, size_t h, size_t d, int inverse) {
  rope_kernel(out, x, cos, sin, b, t, h, d, inverse);
}

// Value j of a head whose D values start at x, rotated (inverse = 0) or by the transpose
// (inverse = 1), with the angle's c and s: rope.rs's rotate_head, product for product.
__device__ __forceinline__ float rotated(const float *x, size_t j, size_t half, float c, float s, int inverse) {
  const size_t jj = j < half ? j : j - half;
  const float x1 = x[jj], x2 = x[jj + half];
  if (j < half) return inverse ? x1 * c + x2 * s : x1 * c - x2 * s;
  return inverse ? x2 * c - x1 * s : x2 * c + x1 * s;
}

// Llama's attention operands packed for attention.cu (the CUDA twin of rope_attention.rs's
// Inputs::packed): q (B, T, H*D), k, v (B, T, KV*D) and cos, sin (B, 1, T, D/2) -> rows
// (B, T, W), W = H*D + 2*KV*D: the rotated query heads, the rotated key heads, the values.
// One thread per output value.
extern "C" __global__ void rltune_rope_pack_f32(float *__restrict__ out, const float *__restrict__ q,
                                                const float *__restrict__ k, const float *__restrict__ v,
                                                const float *__restrict__ cos, const float *__restrict__ sin,
                                                size_t b, size_t t, size_t h, size_t kv, size_t d) {
  const size_t half = d / 2, c = h * d, ckv = kv * d, w = c + 2 * ckv, n = b * t * w;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t col = i % w, bt = i / w;
    if (col >= c + ckv) {
      out[i] = v[bt * ckv + col - c - ckv];
      continue;
    }
    const float *src = col < c ? q + bt * c : k + bt * ckv;
    const size_t at = col < c ? col : col - c, j = at % d, jj = j < half ? j : j - half;
    out[i] = rotated(src + at - j, j, half, cos[bt * half + jj], sin[bt * half + jj], 0);
  }
}

// The backward of rltune_rope_pack_f32: the gradient of the packed rows (B, T, W) -> one buffer
// [dq (B*T*H*D) | dk (B*T*KV*D) | dv (B*T*KV*D)], the query and key columns rotated back
// (rope's transpose), the values' copied. One thread per input value.
extern "C" __global__ void rltune_rope_unpack_f32(float *__restrict__ out, const float *__restrict__ rows,
                                                  const float *__restrict__ cos, const float *__restrict__ sin,
                                                  size_t b, size_t t, size_t h, size_t kv, size_t d) {
  const size_t half = d / 2, c = h * d, ckv = kv * d, w = c + 2 * ckv, n = b * t * w;
  const size_t nq = b * t * c, nk = b * t * ckv;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t col = i % w, bt = i / w;
    if (col >= c + ckv) {
      out[nq + nk + bt * ckv + col - c - ckv] = rows[i];
      continue;
    }
    const size_t at = col < c ? col : col - c, j = at % d, jj = j < half ? j : j - half;
    const float r = rotated(rows + i - j, j, half, cos[bt * half + jj], sin[bt * half + jj], 1);
    if (col < c) {
      out[bt * c + at] = r;
    } else {
      out[nq + bt * ckv + at] = r;
    }
  }
}
