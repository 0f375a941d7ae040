// The softmax family over the last dimension: the CUDA twins of src/softmax.rs. One block per
// row of n values; nothing of size (rows, n) is kept for the backward but the op's own input
// or output, as on the CPU.
#include "common.cuh"

#include <cuda_bf16.h>

// m = max(x), s = sum e^(x - m) of row xr.
__device__ __forceinline__ void row_max_sum(const float *xr, size_t n, float *m, float *s) {
  float mx = -INFINITY;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
  mx = block_max(mx);
  float acc = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) acc += expf(xr[i] - mx);
  *m = mx;
  *s = block_sum(acc);
}

// out[r] = x[r, t_r] - logsumexp(x[r]).
extern "C" __global__ void rltune_logprobs_of_f32(float *__restrict__ out, const float *__restrict__ x,
                                                  const unsigned *__restrict__ targets, size_t rows, size_t n) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float m, s;
  row_max_sum(xr, n, &m, &s);
  const unsigned t = targets[r];
  if (threadIdx.x == 0) out[r] = t < n ? xr[t] - (m + logf(s)) : NAN; // NaN, not a read past the row
}

// dx[r] = g[r] (onehot(t_r) - softmax(x[r])).
extern "C" __global__ void rltune_logprobs_of_bwd_f32(float *__restrict__ dx, const float *__restrict__ x,
                                                      const unsigned *__restrict__ targets,
                                                      const float *__restrict__ g, size_t rows, size_t n) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float *d = dx + r * n;
  float m, s;
  row_max_sum(xr, n, &m, &s);
  const float lse = m + logf(s), gr = g[r];
  const size_t t = targets[r];
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = -gr * expf(xr[i] - lse);
    d[i] = i == t ? v + gr : v;
  }
}

// out[r] = log s - sum e^(x - m)(x - m) / s; terms with e^(x - m) = 0 add nothing (no 0 * inf).
extern "C" __global__ void rltune_entropy_f32(float *__restrict__ out, const float *__restrict__ x, size_t rows,
                                              size_t n) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float mx = -INFINITY;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
  mx = block_max(mx);
  float s = 0.0f, sx = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float dv = xr[i] - mx, e = expf(dv);
    s += e;
    if (e > 0.0f) sx += e * dv;
  }
  s = block_sum(s);
  sx = block_sum(sx);
  if (threadIdx.x == 0) out[r] = logf(s) - sx / s;
}

// y = softmax(x) per row.
extern "C" __global__ void rltune_softmax_f32(float *__restrict__ y, const float *__restrict__ x, size_t rows,
                                              size_t n) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float *yr = y + r * n;
  float m, s;
  row_max_sum(xr, n, &m, &s);
  const float inv = 1.0f / s;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = expf(xr[i] - m) * inv;
}

// dx = scale y (g - sum g y) per row.
extern "C" __global__ void rltune_softmax_bwd_f32(float *__restrict__ dx, const float *__restrict__ y,
                                                  const float *__restrict__ g, size_t rows, size_t n, float scale) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *yr = y + r * n, *gr = g + r * n;
  float *d = dx + r * n;
  float dot = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) dot += gr[i] * yr[i];
  dot = block_sum(dot);
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = scale * yr[i] * (gr[i] - dot);
}

// y = x - logsumexp(x) per row.
extern "C" __global__ void rltune_log_softmax_f32(float *__restrict__ y, const float *__restrict__ x, size_t rows,
                                                  size_t n) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float *yr = y + r * n;
  float m, s;
  row_max_sum(xr, n, &m, &s);
  const float lse = m + logf(s);
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] - lse;
}

// dx = g - e^y sum g per row.
extern "C" __global__ void rltune_log_softmax_bwd_f32(float *__restrict__ dx, const float *__restrict__ y,
                                                      const float *__restrict__ g, size_t rows, size_t n) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *yr = y + r * n, *gr = g + r * n;
  float *d = dx + r * n;
  float sum = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) sum += gr[i];
  sum = block_sum(sum);
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = gr[i] - expf(yr[i]) * sum;
}

// The offset of the bias row (bB, bH, bT, S) that row r of (B, H, T, S) scores reads: each of
// the bias's first three sizes is 1 (broadcast) or the scores'.
__device__ __forceinline__ size_t masked_bias_row(size_t r, size_t n, size_t h, size_t t, size_t bb, size_t bh,
                                                  size_t bt) {
  const size_t i = r % t, hi = (r / t) % h, bi = r / (t * h);
  return (((bb == 1 ? 0 : bi) * bh + (bh == 1 ? 0 : hi)) * bt + (bt == 1 ? 0 : i)) * n;
}

// y = softmax(x scale + bias) per row of (B, H, T, S) attention scores (the CPU's
// scaled_masked_softmax_rows); the bias (bB, bH, bT, S) broadcasts, each of its first three
// sizes 1 or the scores'. Its backward is rltune_softmax_bwd_f32 with the scale.
extern "C" __global__ void rltune_scaled_masked_softmax_f32(float *__restrict__ y, const float *__restrict__ x,
                                                            const float *__restrict__ bias, size_t rows, size_t n,
                                                            size_t h, size_t t, size_t bb, size_t bh, size_t bt,
                                                            float scale) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n, *b = bias + masked_bias_row(r, n, h, t, bb, bh, bt);
  float *yr = y + r * n;
  float mx = -INFINITY;
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) {
    const float v = xr[k] * scale + b[k];
    yr[k] = v;
    mx = fmaxf(mx, v);
  }
  mx = block_max(mx);
  float s = 0.0f;
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) {
    const float e = expf(yr[k] - mx);
    yr[k] = e;
    s += e;
  }
  const float inv = 1.0f / block_sum(s);
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) yr[k] *= inv;
}

// rltune_scaled_masked_softmax_f32 for bf16 scores and probabilities (autocast's attention on
// the tensor cores: the scores come from a bf16 product, the probabilities go into one). Each
// value is computed in f32 as there, from the bf16 score, and rounded to bf16 once; the bias
// stays f32. The row is read three times (maximum, sum, output) instead of keeping the f32
// intermediates in the bf16 output.
extern "C" __global__ void rltune_scaled_masked_softmax_bf16(__nv_bfloat16 *__restrict__ y,
                                                             const __nv_bfloat16 *__restrict__ x,
                                                             const float *__restrict__ bias, size_t rows, size_t n,
                                                             size_t h, size_t t, size_t bb, size_t bh, size_t bt,
                                                             float scale) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const __nv_bfloat16 *xr = x + r * n;
  const float *b = bias + masked_bias_row(r, n, h, t, bb, bh, bt);
  __nv_bfloat16 *yr = y + r * n;
  float mx = -INFINITY;
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) mx = fmaxf(mx, __bfloat162float(xr[k]) * scale + b[k]);
  mx = block_max(mx);
  float s = 0.0f;
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) s += expf(__bfloat162float(xr[k]) * scale + b[k] - mx);
  const float inv = 1.0f / block_sum(s);
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) {
    yr[k] = __float2bfloat16_rn(expf(__bfloat162float(xr[k]) * scale + b[k] - mx) * inv);
  }
}

// rltune_softmax_bwd_f32 for bf16 probabilities and gradients: dx = scale y (g - sum g y) per
// row, in f32, each value rounded to bf16 once.
extern "C" __global__ void rltune_softmax_bwd_bf16(__nv_bfloat16 *__restrict__ dx, const __nv_bfloat16 *__restrict__ y,
                                                   const __nv_bfloat16 *__restrict__ g, size_t rows, size_t n,
                                                   float scale) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const __nv_bfloat16 *yr = y + r * n, *gr = g + r * n;
  __nv_bfloat16 *d = dx + r * n;
  float dot = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) dot += __bfloat162float(gr[i]) * __bfloat162float(yr[i]);
  dot = block_sum(dot);
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    d[i] = __float2bfloat16_rn(scale * __bfloat162float(yr[i]) * (__bfloat162float(gr[i]) - dot));
  }
}
