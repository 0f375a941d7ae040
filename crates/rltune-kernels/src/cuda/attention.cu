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
  RLTUNE_DYNAMIC_SHARED(float, sh);
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
  RLTUNE_DYNAMIC_SHARED(float, sh);
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

// ---- The tiled kernels ------------------------------------------------------------------------
// The kernels above read every key and value row of a head from global memory once per query
// row. These let a block of `tq` query rows (or `tj` key rows) share each tile of keys, values,
// queries or gradients in shared memory, `tq` times fewer reads. They compute the same sums in
// the same order as the kernels above (each dot product over its index in order, each output
// over the keys or queries in order, a key head's query heads one after the other), so only the
// softmax's row sums are added in another order (by warp here). The launch (cuda.rs) picks the
// tile heights so that a block's shared memory fits 48 KiB, `tq·D` and `tj·D` are at most
// RLTUNE_ATT_ACC outputs per thread, and takes the per-row kernels where no tile fits.
#define RLTUNE_ATT_TK 32
#define RLTUNE_ATT_ACC 16

// dst[r (D + 1) + e] = src[(i0 + r) stride + col + e] for rows r < n: a tile of rows into shared
// memory, D + 1 apart (no bank conflicts between rows).
__device__ __forceinline__ void load_rows(float *dst, const float *src, size_t stride, size_t col, size_t i0,
                                          size_t n, size_t d) {
  for (size_t idx = threadIdx.x; idx < n * d; idx += blockDim.x) {
    const size_t r = idx / d, e = idx % d;
    dst[r * (d + 1) + e] = src[(i0 + r) * stride + col + e];
  }
}

// f(k, r, e) for each of this thread's outputs (r, e) of n rows of D: (r, e) = idx / D, idx % D
// for idx = threadIdx.x + k blockDim.x < n D (k < RLTUNE_ATT_ACC: each thread's k-th output
// lives in registers).
template <class F> __device__ __forceinline__ void for_each_output(size_t n, size_t d, F f) {
#pragma unroll
  for (int k = 0; k < RLTUNE_ATT_ACC; ++k) {
    const size_t idx = threadIdx.x + k * blockDim.x;
    if (idx < n * d) f(k, idx / d, idx % d);
  }
}

// dst[(i0 + r) stride + col + e] = acc[k] for this thread's outputs (for_each_output).
__device__ __forceinline__ void store_rows(float *dst, const float *acc, size_t stride, size_t col, size_t i0,
                                           size_t n, size_t d) {
  for_each_output(n, d, [&](int k, size_t r, size_t e) { dst[(i0 + r) * stride + col + e] = acc[k]; });
}

// The tile of `tq` query rows of one head that block blockIdx.x = (b H + h) ceil(T / tq) + tile
// works on; `valid` is false for a block past the last head.
struct QueryTile {
  size_t head, hi, bi, d, w, ld, i0, nq;
  bool valid;
};

__device__ __forceinline__ QueryTile query_tile(size_t b, size_t t, size_t c, size_t h, size_t kv, size_t tq) {
  QueryTile q;
  const size_t tiles = (t + tq - 1) / tq;
  q.head = blockIdx.x / tiles;
  q.valid = q.head < b * h;
  q.d = c / h, q.w = c + 2 * kv * q.d, q.ld = q.d + 1, q.hi = q.head % h, q.bi = q.head / h;
  q.i0 = (blockIdx.x % tiles) * tq;
  q.nq = q.valid ? min_size(tq, t - q.i0) : 0;
  return q;
}

// s[r T + j] = a_r . x_j[col..col + D] for the block's nq rows a (shared, D + 1 apart) and every
// row j of the sequence x (B's slice, W apart), through tiles of RLTUNE_ATT_TK rows in `tile`.
// Every thread of the block must call it; the scores are complete when it returns.
__device__ __forceinline__ void rows_dot_rows(float *s, const float *a, float *tile, const float *x, size_t col, size_t nq,
                              size_t t, size_t d, size_t w) {
  const size_t ld = d + 1;
  for (size_t j0 = 0; j0 < t; j0 += RLTUNE_ATT_TK) {
    const size_t nk = min_size(RLTUNE_ATT_TK, t - j0);
    __syncthreads(); // `a` is loaded, and the previous tile is read
    load_rows(tile, x, w, col, j0, nk, d);
    __syncthreads();
    for (size_t idx = threadIdx.x; idx < nq * nk; idx += blockDim.x) {
      const size_t r = idx / nk, k = idx % nk;
      const float *ar = a + r * ld, *xr = tile + k * ld;
      float acc = 0.0f;
      for (size_t e = 0; e < d; ++e) acc += ar[e] * xr[e];
      s[r * t + j0 + k] = acc;
    }
  }
  __syncthreads();
}

// acc[k] = sum_j s[r T + j] x_j[col + e] for this thread's outputs (r, e) = idx / D, idx % D,
// idx = threadIdx.x + k blockDim.x < nq D, through tiles of x's rows in `tile`. Every thread of
// the block must call it.
__device__ __forceinline__ void rows_times_rows(float *acc, const float *s, float *tile, const float *x, size_t col, size_t nq,
                                size_t t, size_t d, size_t w) {
  const size_t ld = d + 1;
#pragma unroll
  for (int k = 0; k < RLTUNE_ATT_ACC; ++k) acc[k] = 0.0f;
  for (size_t j0 = 0; j0 < t; j0 += RLTUNE_ATT_TK) {
    const size_t nk = min_size(RLTUNE_ATT_TK, t - j0);
    __syncthreads(); // `s` is complete, and the previous tile is read
    load_rows(tile, x, w, col, j0, nk, d);
    __syncthreads();
    for_each_output(nq, d, [&](int k, size_t r, size_t e) {
      const float *sr = s + r * t + j0;
      float a = acc[k];
      for (size_t j = 0; j < nk; ++j) a += sr[j] * tile[j * ld + e];
      acc[k] = a;
    });
  }
}

// The forward for `tq` query rows of one head, blockIdx.x = (b H + h) ceil(T / tq) + tile.
// Dynamic shared memory: the rows' queries (tq, D + 1), a tile (RLTUNE_ATT_TK, D + 1), the rows'
// scores (tq, T).
extern "C" __global__ void rltune_attention_tiled_f32(float *__restrict__ y, float *__restrict__ p,
                                                      const float *__restrict__ qkv, const float *__restrict__ bias,
                                                      size_t b, size_t t, size_t c, size_t h, size_t kv, size_t bb,
                                                      size_t bh, size_t bt, float scale, size_t tq) {
  RLTUNE_DYNAMIC_SHARED(float, sh);
  const QueryTile q = query_tile(b, t, c, h, kv, tq);
  if (!q.valid) return;
  const size_t d = q.d, w = q.w, hi = q.hi, bi = q.bi, head = q.head, i0 = q.i0, nq = q.nq;
  float *a = sh, *tile = a + tq * q.ld, *s = tile + RLTUNE_ATT_TK * q.ld;
  const float *x = qkv + bi * t * w;
  load_rows(a, x, w, hi * d, i0, nq, d);
  rows_dot_rows(s, a, tile, x, key_col(hi, c, h, kv), nq, t, d, w);
  const size_t lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
  for (size_t r = threadIdx.x >> 5; r < nq; r += warps) {
    const float *br = bias + bias_row(bi, hi, i0 + r, bb, bh, bt, t);
    float *sr = s + r * t, mx = -INFINITY, sum = 0.0f;
    for (size_t j = lane; j < t; j += 32) {
      const float v = sr[j] * scale + br[j];
      sr[j] = v;
      mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    for (size_t j = lane; j < t; j += 32) {
      const float e = expf(sr[j] - mx);
      sr[j] = e;
      sum += e;
    }
    const float inv = 1.0f / warp_sum(sum);
    float *pr = p + (head * t + i0 + r) * t;
    for (size_t j = lane; j < t; j += 32) {
      sr[j] *= inv;
      pr[j] = sr[j];
    }
  }
  float acc[RLTUNE_ATT_ACC];
  rows_times_rows(acc, s, tile, x, value_col(hi, c, h, kv), nq, t, d, w);
  store_rows(y + bi * t * c, acc, c, hi * d, i0, nq, d);
}

// The backward's query side for `tq` query rows of one head, laid out as the tiled forward:
// dS's rows (kept in ds for the key side) and dq. Shared memory: the rows' gradients g_i
// (tq, D + 1), a tile (RLTUNE_ATT_TK, D + 1), the rows of dS (tq, T).
extern "C" __global__ void rltune_attention_tiled_bwd_q_f32(float *__restrict__ dqkv, float *__restrict__ ds,
                                                            const float *__restrict__ g, const float *__restrict__ p,
                                                            const float *__restrict__ qkv, size_t b, size_t t,
                                                            size_t c, size_t h, size_t kv, float scale, size_t tq) {
  RLTUNE_DYNAMIC_SHARED(float, sh);
  const QueryTile q = query_tile(b, t, c, h, kv, tq);
  if (!q.valid) return;
  const size_t d = q.d, w = q.w, hi = q.hi, bi = q.bi, head = q.head, i0 = q.i0, nq = q.nq;
  float *a = sh, *tile = a + tq * q.ld, *s = tile + RLTUNE_ATT_TK * q.ld;
  const float *x = qkv + bi * t * w;
  load_rows(a, g + bi * t * c, c, hi * d, i0, nq, d);
  rows_dot_rows(s, a, tile, x, value_col(hi, c, h, kv), nq, t, d, w); // dP
  const size_t lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
  for (size_t r = threadIdx.x >> 5; r < nq; r += warps) {
    const size_t row = (head * t + i0 + r) * t;
    const float *pr = p + row;
    float *sr = s + r * t, dot = 0.0f;
    for (size_t j = lane; j < t; j += 32) dot += pr[j] * sr[j];
    dot = warp_sum(dot);
    for (size_t j = lane; j < t; j += 32) {
      sr[j] = scale * pr[j] * (sr[j] - dot);
      ds[row + j] = sr[j];
    }
  }
  float acc[RLTUNE_ATT_ACC];
  rows_times_rows(acc, s, tile, x, key_col(hi, c, h, kv), nq, t, d, w);
  store_rows(dqkv + bi * t * w, acc, w, hi * d, i0, nq, d);
}

// hk, hv (this thread's outputs, for_each_output over nj rows of D) += query head hi's share of
// dk_j and dv_j for the `nj` key rows from j0 of batch row bi, through tiles of `ti` query rows.
// Shared memory `sh`: the queries and the gradients of `ti` rows (ti, D + 1) each, dS and P of
// those rows at the block's keys (ti, tj + 1) each.
__device__ __forceinline__ void key_tile_head(float *hk, float *hv, float *sh, const float *__restrict__ ds,
                                              const float *__restrict__ g, const float *__restrict__ p,
                                              const float *__restrict__ qkv, size_t bi, size_t hi, size_t j0,
                                              size_t nj, size_t t, size_t c, size_t h, size_t kv, size_t tj,
                                              size_t ti) {
  const size_t d = c / h, w = c + 2 * kv * d, ld = d + 1, lj = tj + 1, head = (bi * h + hi) * t;
  float *sq = sh, *sg = sq + ti * ld, *sds = sg + ti * ld, *sp = sds + ti * lj;
  const float *x = qkv + bi * t * w;
  for (size_t i0 = 0; i0 < t; i0 += ti) {
    const size_t ni = min_size(ti, t - i0);
    __syncthreads(); // the previous tiles are read
    load_rows(sq, x, w, hi * d, i0, ni, d);
    load_rows(sg, g + bi * t * c, c, hi * d, i0, ni, d);
    for (size_t idx = threadIdx.x; idx < ni * nj; idx += blockDim.x) {
      const size_t r = idx / nj, k = idx % nj, at = (head + i0 + r) * t + j0 + k;
      sds[r * lj + k] = ds[at];
      sp[r * lj + k] = p[at];
    }
    __syncthreads();
    for_each_output(nj, d, [&](int k, size_t jj, size_t e) {
      float ak = hk[k], av = hv[k];
      for (size_t r = 0; r < ni; ++r) {
        ak += sds[r * lj + jj] * sq[r * ld + e];
        av += sp[r * lj + jj] * sg[r * ld + e];
      }
      hk[k] = ak;
      hv[k] = av;
    });
  }
}

// The backward's key side for `tj` key rows of key head g, blockIdx.x = (b KV + g) ceil(T / tj)
// + tile: dk_j and dv_j summed over g's query heads in order, through tiles of `ti` query rows
// (shared memory: key_tile_head's).
extern "C" __global__ void rltune_attention_tiled_bwd_kv_f32(float *__restrict__ dqkv, const float *__restrict__ ds,
                                                             const float *__restrict__ g, const float *__restrict__ p,
                                                             const float *__restrict__ qkv, size_t b, size_t t,
                                                             size_t c, size_t h, size_t kv, size_t tj, size_t ti) {
  RLTUNE_DYNAMIC_SHARED(float, sh);
  const size_t tiles = (t + tj - 1) / tj, key_head = blockIdx.x / tiles;
  if (key_head >= b * kv) return;
  const size_t d = c / h, w = c + 2 * kv * d, rep = h / kv;
  const size_t gi = key_head % kv, bi = key_head / kv;
  const size_t j0 = (blockIdx.x % tiles) * tj, nj = min_size(tj, t - j0);
  float dk[RLTUNE_ATT_ACC], dv[RLTUNE_ATT_ACC], hk[RLTUNE_ATT_ACC], hv[RLTUNE_ATT_ACC];
#pragma unroll
  for (int k = 0; k < RLTUNE_ATT_ACC; ++k) dk[k] = dv[k] = 0.0f;
  for (size_t hi = gi * rep; hi < (gi + 1) * rep; ++hi) {
#pragma unroll
    for (int k = 0; k < RLTUNE_ATT_ACC; ++k) hk[k] = hv[k] = 0.0f;
    key_tile_head(hk, hv, sh, ds, g, p, qkv, bi, hi, j0, nj, t, c, h, kv, tj, ti);
#pragma unroll
    for (int k = 0; k < RLTUNE_ATT_ACC; ++k) {
      dk[k] += hk[k];
      dv[k] += hv[k];
    }
  }
  store_rows(dqkv + bi * t * w, dk, w, c + gi * d, j0, nj, d);
  store_rows(dqkv + bi * t * w, dv, w, c + kv * d + gi * d, j0, nj, d);
}

// The key side with grouped query heads split over blocks, blockIdx.x = (b H + h) ceil(T / tj)
// + tile: query head h's share of dk_j and dv_j for `tj` key rows, into part (B, H, T, 2 D)
// rows [dk | dv]; rltune_attention_kv_sum_f32 then sums each key head's shares. With H / KV
// query heads per key head, H / KV times the blocks of rltune_attention_tiled_bwd_kv_f32 (which
// left most of a GPU idle at Qwen2's 14 query and 2 key heads), and the same bits.
extern "C" __global__ void rltune_attention_tiled_bwd_kv_part_f32(float *__restrict__ part,
                                                                  const float *__restrict__ ds,
                                                                  const float *__restrict__ g,
                                                                  const float *__restrict__ p,
                                                                  const float *__restrict__ qkv, size_t b, size_t t,
                                                                  size_t c, size_t h, size_t kv, size_t tj,
                                                                  size_t ti) {
  RLTUNE_DYNAMIC_SHARED(float, sh);
  const size_t tiles = (t + tj - 1) / tj, head = blockIdx.x / tiles;
  if (head >= b * h) return;
  const size_t d = c / h, hi = head % h, bi = head / h;
  const size_t j0 = (blockIdx.x % tiles) * tj, nj = min_size(tj, t - j0);
  float hk[RLTUNE_ATT_ACC], hv[RLTUNE_ATT_ACC];
#pragma unroll
  for (int k = 0; k < RLTUNE_ATT_ACC; ++k) hk[k] = hv[k] = 0.0f;
  key_tile_head(hk, hv, sh, ds, g, p, qkv, bi, hi, j0, nj, t, c, h, kv, tj, ti);
  store_rows(part + head * t * 2 * d, hk, 2 * d, 0, j0, nj, d);
  store_rows(part + head * t * 2 * d, hv, 2 * d, d, j0, nj, d);
}

// dqkv's key and value columns from rltune_attention_tiled_bwd_kv_part_f32's shares: each key
// head's dk_j and dv_j as the sum of its query heads' shares from 0, in order (the per-group
// kernel's order). One thread per value (B, T, KV, 2 D), grid-stride.
extern "C" __global__ void rltune_attention_kv_sum_f32(float *__restrict__ dqkv, const float *__restrict__ part,
                                                       size_t b, size_t t, size_t c, size_t h, size_t kv) {
  const size_t d = c / h, w = c + 2 * kv * d, rep = h / kv, n = b * t * kv * 2 * d;
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
    const size_t e2 = idx % (2 * d), gi = idx / (2 * d) % kv, j = idx / (2 * d * kv) % t, bi = idx / (2 * d * kv * t);
    const size_t which = e2 / d, e = e2 % d;
    float acc = 0.0f;
    for (size_t r = 0; r < rep; ++r) acc += part[((bi * h + gi * rep + r) * t + j) * 2 * d + e2];
    dqkv[(bi * t + j) * w + c + which * kv * d + gi * d + e] = acc;
  }
}
