// The self-attention core: the CUDA twin of src/attention.rs. A packed row of qkv (B, T, W)
// holds H query heads, then KV key heads, then KV value heads, D = C / H columns each
// (W = C + 2 KV D; GPT-2's fused qkv has KV = H, W = 3C); query head h reads key and value
// head h / (H / KV) (grouped-query attention). bias (bB, bH, bT, T) broadcasts to (B, H, T, T).
// The forward keeps P = softmax(q k^T scale + bias) (B, H, T, T) for the backward:
//   y_i = sum_j P_ij v_j (heads merged, (B, T, C)),
//   dP_ij = g_i . v_j,  dS_ij = scale P_ij (dP_ij - sum_j' P_ij' dP_ij'),
//   dq_i = sum_j dS_ij k_j,  dk_j = sum_h sum_i dS_ij q_i,  dv_j = sum_h sum_i P_ij g_i,
// written straight into one dqkv (B, T, W); a key head's sums over its query heads run in head
// order, the first head's sum first, as the CPU kernel adds them. Every dot product sums over
// its index in order, as the CPU kernel does; keys the mask removes get a probability of
// exactly 0 either way (the CPU kernel skips them), so only the softmax's sums are added in
// another order.
#include "common.cuh"

// The start of the bias row of query i of head h in sequence b.
__device__ __forceinline__ size_t bias_row(size_t b, size_t h, size_t i, size_t bb, size_t bh, size_t bt,
                                           size_t t) {
  const size_t pb = bb == 1 ? 0 : b, ph = bh == 1 ? 0 : h, pi = bt == 1 ? 0 : i;
  return ((pb * bh + ph) * bt + pi) * t;
}

// The columns of query head h's key and value in a packed row.
__device__ __forceinline__ size_t key_col(size_t h, size_t c, size_t hs, size_t kv) {
  return c + h / (hs / kv) * (c / hs);
}
__device__ __forceinline__ size_t value_col(size_t h, size_t c, size_t hs, size_t kv) {
  return key_col(h, c, hs, kv) + kv * (c / hs);
}

// One block per query row (b, h, i), blockIdx.x = (b H + h) T + i. Dynamic shared memory: the
// query (D floats), then the row's scores (T floats).
extern "C" __global__ void rltune_attention_f32(float *__restrict__ y, float *__restrict__ p,
                                                const float *__restrict__ qkv, const float *__restrict__ bias,
                                                size_t b, size_t t, size_t c, size_t h, size_t kv, size_t bb,
                                                size_t bh, size_t bt, float scale) {
  extern __shared__ float sh[];
  const size_t row = blockIdx.x;
  if (row >= b * h * t) return;
  const size_t d = c / h, w = c + 2 * kv * d, i = row % t, hi = (row / t) % h, bi = row / (t * h);
  const size_t kc = key_col(hi, c, h, kv), vc = value_col(hi, c, h, kv);
  float *q = sh, *s = sh + d;
  const float *x = qkv + bi * t * w;
  for (size_t e = threadIdx.x; e < d; e += blockDim.x) q[e] = x[i * w + hi * d + e];
  __syncthreads();
  const float *br = bias + bias_row(bi, hi, i, bb, bh, bt, t);
  float mx = -INFINITY;
  for (size_t j = threadIdx.x; j < t; j += blockDim.x) {
    const float *k = x + j * w + kc;
    float acc = 0.0f;
    for (size_t e = 0; e < d; ++e) acc += q[e] * k[e];
    const float v = acc * scale + br[j];
    s[j] = v;
    mx = fmaxf(mx, v);
  }
  mx = block_max(mx);
  float sum = 0.0f;
  for (size_t j = threadIdx.x; j < t; j += blockDim.x) {
    const float e = expf(s[j] - mx);
    s[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum);
  float *pr = p + row * t;
  for (size_t j = threadIdx.x; j < t; j += blockDim.x) {
    s[j] *= inv;
    pr[j] = s[j];
  }
  __syncthreads();
  float *yr = y + (bi * t + i) * c + hi * d;
  for (size_t e = threadIdx.x; e < d; e += blockDim.x) {
    float acc = 0.0f;
    for (size_t j = 0; j < t; ++j) acc += s[j] * x[j * w + vc + e];
    yr[e] = acc;
  }
}

// The backward's query side, one block per query row as the forward: the row of dS (kept in
// ds (B, H, T, T) for the key side) and dq_i. Dynamic shared memory: g_i's head (D), dS_i (T).
extern "C" __global__ void rltune_attention_bwd_q_f32(float *__restrict__ dqkv, float *__restrict__ ds,
                                                      const float *__restrict__ g, const float *__restrict__ p,
                                                      const float *__restrict__ qkv, size_t b, size_t t, size_t c,
                                                      size_t h, size_t kv, float scale) {
  extern __shared__ float sh[];
  const size_t row = blockIdx.x;
  if (row >= b * h * t) return;
  const size_t d = c / h, w = c + 2 * kv * d, i = row % t, hi = (row / t) % h, bi = row / (t * h);
  const size_t kc = key_col(hi, c, h, kv), vc = value_col(hi, c, h, kv);
  float *gi = sh, *dsr = sh + d;
  const float *x = qkv + bi * t * w;
  for (size_t e = threadIdx.x; e < d; e += blockDim.x) gi[e] = g[(bi * t + i) * c + hi * d + e];
  __syncthreads();
  const float *pr = p + row * t;
  float dot = 0.0f;
  for (size_t j = threadIdx.x; j < t; j += blockDim.x) {
    const float *v = x + j * w + vc;
    float acc = 0.0f;
    for (size_t e = 0; e < d; ++e) acc += gi[e] * v[e];
    dsr[j] = acc;
    dot += pr[j] * acc;
  }
  dot = block_sum(dot);
  for (size_t j = threadIdx.x; j < t; j += blockDim.x) {
    dsr[j] = scale * pr[j] * (dsr[j] - dot);
    ds[row * t + j] = dsr[j];
  }
  __syncthreads();
  float *dq = dqkv + (bi * t + i) * w + hi * d;
  for (size_t e = threadIdx.x; e < d; e += blockDim.x) {
    float acc = 0.0f;
    for (size_t j = 0; j < t; ++j) acc += dsr[j] * x[j * w + kc + e];
    dq[e] = acc;
  }
}

// The backward's key side, one block per key row (b, g, j) of key head g: dk_j and dv_j summed
// over g's query heads, one thread per column.
extern "C" __global__ void rltune_attention_bwd_kv_f32(float *__restrict__ dqkv, const float *__restrict__ ds,
                                                       const float *__restrict__ g, const float *__restrict__ p,
                                                       const float *__restrict__ qkv, size_t b, size_t t, size_t c,
                                                       size_t h, size_t kv) {
  const size_t row = blockIdx.x;
  if (row >= b * kv * t) return;
  const size_t d = c / h, w = c + 2 * kv * d, rep = h / kv;
  const size_t j = row % t, gi = (row / t) % kv, bi = row / (t * kv);
  const float *x = qkv + bi * t * w;
  float *out = dqkv + (bi * t + j) * w + c + gi * d;
  for (size_t e = threadIdx.x; e < d; e += blockDim.x) {
    float dk = 0.0f, dv = 0.0f;
    for (size_t hi = gi * rep; hi < (gi + 1) * rep; ++hi) {
      const size_t head = (bi * h + hi) * t;
      float hk = 0.0f, hv = 0.0f;
      for (size_t i = 0; i < t; ++i) {
        const size_t r = (head + i) * t + j;
        hk += ds[r] * x[i * w + hi * d + e];
        hv += p[r] * g[(bi * t + i) * c + hi * d + e];
      }
      dk += hk;
      dv += hv;
    }
    out[e] = dk;
    out[kv * d + e] = dv;
  }
}
