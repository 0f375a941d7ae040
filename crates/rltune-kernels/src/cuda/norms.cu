// Layer norm and RMS norm over the last dimension, forward and backward: the CUDA twins of
// src/norm.rs (torch's nn.LayerNorm with biased variance, and LlamaRMSNorm). One block per
// row for the forward and the input gradient; the weight (and bias) gradients are summed
// over chunks of rows, column by column, then over the chunks: deterministic, no atomics.
//
// The backward's output is one (rows + k, n) buffer, as on the CPU: dx rows, then dw (and db).
#include "common.cuh"

// mean and 1/sqrt(var + eps) of row xr (two passes, as the CPU kernel).
__device__ __forceinline__ void ln_stats(const float *xr, size_t n, float eps, float *mean, float *rstd) {
  float s = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
  const float m = block_sum(s) / (float)n;
  float q = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = xr[i] - m;
    q += d * d;
  }
  const float var = block_sum(q) / (float)n;
  *mean = m;
  *rstd = 1.0f / sqrtf(var + eps);
}

// 1/sqrt(mean(x^2) + eps) of row xr.
__device__ __forceinline__ float rms_rstd(const float *xr, size_t n, float eps) {
  float q = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) q += xr[i] * xr[i];
  return 1.0f / sqrtf(block_sum(q) / (float)n + eps);
}

extern "C" __global__ void rltune_layer_norm_f32(float *__restrict__ out, const float *__restrict__ x,
                                                 const float *__restrict__ w, const float *__restrict__ b,
                                                 size_t rows, size_t n, float eps) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float *o = out + r * n;
  float mean, rstd;
  ln_stats(xr, n, eps, &mean, &rstd);
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

extern "C" __global__ void rltune_rms_norm_f32(float *__restrict__ out, const float *__restrict__ x,
                                               const float *__restrict__ w, size_t rows, size_t n, float eps) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n;
  float *o = out + r * n;
  const float rstd = rms_rstd(xr, n, eps);
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * rstd * w[i];
}

// dx = rstd (g w - mean(g w) - xhat mean(g w xhat)); stats[2r] = mean, stats[2r + 1] = rstd.
extern "C" __global__ void rltune_layer_norm_bwd_dx_f32(float *__restrict__ dx, float *__restrict__ stats,
                                                        const float *__restrict__ x, const float *__restrict__ w,
                                                        const float *__restrict__ g, size_t rows, size_t n,
                                                        float eps) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n, *gr = g + r * n;
  float *d = dx + r * n;
  float mean, rstd;
  ln_stats(xr, n, eps, &mean, &rstd);
  float s_gw = 0.0f, s_gwx = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float xhat = (xr[i] - mean) * rstd, gw = gr[i] * w[i];
    s_gw += gw;
    s_gwx += gw * xhat;
  }
  const float m_gw = block_sum(s_gw) / (float)n, m_gwx = block_sum(s_gwx) / (float)n;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float xhat = (xr[i] - mean) * rstd;
    d[i] = rstd * (gr[i] * w[i] - m_gw - xhat * m_gwx);
  }
  if (threadIdx.x == 0) {
    stats[2 * r] = mean;
    stats[2 * r + 1] = rstd;
  }
}

// dx = rstd (g w - x rstd mean(g w xhat)); stats[2r] = 0, stats[2r + 1] = rstd.
extern "C" __global__ void rltune_rms_norm_bwd_dx_f32(float *__restrict__ dx, float *__restrict__ stats,
                                                      const float *__restrict__ x, const float *__restrict__ w,
                                                      const float *__restrict__ g, size_t rows, size_t n,
                                                      float eps) {
  const size_t r = blockIdx.x;
  if (r >= rows) return;
  const float *xr = x + r * n, *gr = g + r * n;
  float *d = dx + r * n;
  const float rstd = rms_rstd(xr, n, eps);
  float s_gwx = 0.0f;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) s_gwx += gr[i] * w[i] * (xr[i] * rstd);
  const float m = block_sum(s_gwx) / (float)n;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = rstd * (gr[i] * w[i] - xr[i] * rstd * m);
  if (threadIdx.x == 0) {
    stats[2 * r] = 0.0f;
    stats[2 * r + 1] = rstd;
  }
}

// Per chunk of `chunk_rows` rows (blockIdx.y) and column c: partial[(chunk k + 0) n + c] =
// sum g xhat (dw), and with k = 2 partial[(chunk k + 1) n + c] = sum g (db); xhat from stats.
extern "C" __global__ void rltune_norm_bwd_params_f32(float *__restrict__ partial, const float *__restrict__ stats,
                                                      const float *__restrict__ x, const float *__restrict__ g,
                                                      size_t rows, size_t n, size_t chunk_rows, int k) {
  const size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (c >= n) return;
  const size_t chunk = blockIdx.y, r0 = chunk * chunk_rows;
  const size_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float dw = 0.0f, db = 0.0f;
  for (size_t r = r0; r < r1; ++r) {
    const float xhat = (x[r * n + c] - stats[2 * r]) * stats[2 * r + 1], gv = g[r * n + c];
    dw += gv * xhat;
    db += gv;
  }
  partial[(chunk * k) * n + c] = dw;
  if (k == 2) partial[(chunk * k + 1) * n + c] = db;
}

// out[j] = sum over chunks of partial[chunk len + j], j < len.
extern "C" __global__ void rltune_sum_chunks_f32(float *__restrict__ out, const float *__restrict__ partial,
                                                 size_t chunks, size_t len) {
  const size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (j >= len) return;
  float s = 0.0f;
  for (size_t c = 0; c < chunks; ++c) s += partial[c * len + j];
  out[j] = s;
}
