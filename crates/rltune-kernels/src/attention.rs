//! GPT-2's self-attention core as one op: from the fused `qkv` projection to the merged heads.
//!
//! `(B, T, 3C) → (B, T, C)`: for each sequence and head, `softmax(q·kᵀ·scale + bias)·v`, read
//! from and written to the row-major activations in place. The composed version splits `qkv`
//! with three `narrow`s, copies each into `(B, H, T, D)`, multiplies with candle's batched
//! matmul and copies the heads back: eleven graph nodes, each of which costs the backward a
//! zero-filled gradient buffer and an add (the `narrow`s a zero-padded concatenation). Here
//! the probabilities `(B, H, T, T)` are kept for the backward, which writes `dq`, `dk`, `dv`
//! straight into one `(B, T, 3C)` gradient:
//!
//! | | |
//! |---|---|
//! | `dv_j = Σ_i P_ij·do_i` | `dP_ij = do_i·v_j` |
//! | `dS_ij = scale·P_ij·(dP_ij − Σ_j' P_ij'·dP_ij')` | |
//! | `dq_i = Σ_j dS_ij·k_j` | `dk_j = Σ_i dS_ij·q_i` |
//!
//! On CUDA (f32) the op runs `attention.cu`'s twin: one block per query row forward, keeping
//! the probabilities; backward the query side (`dS`, `dq`) then the key side (`dk`, `dv`).
//!
//! Sequences run in parallel. A row skips the keys after its last live one (bias above −10⁸;
//! with the causal mask, the future): their probabilities are exactly 0 either way, so the
//! results are those of the composed version, and the causal half of every product is not
//! computed. A fully masked (padding) row takes every key, as
//! [`super::scaled_masked_softmax`] does, and gets the same uniform distribution. Each
//! product keeps its outputs in registers, [`LANES`] or more per row, for 4 rows (queries, or
//! keys for `dk` and `dv`) at a time where a row alone has few; rows are padded to whole
//! vectors.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::simd::{self, simd_kernel, LANES};
use super::{contiguous, CResult, Elem};

/// `+= a·x`
#[inline(always)]
fn axpy<T: Elem>(out: &mut [T], a: T, x: &[T]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o += a * x;
    }
}

/// The geometry of one call. A row of the packed projection holds the `h` query heads, then the
/// `kv` key heads, then the `kv` value heads (GPT-2's `qkv` has `kv = h`); query head `i` reads
/// key and value head `i / (h / kv)` (grouped-query attention).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub t: usize,
    /// The query width `H·D` (the output's).
    pub c: usize,
    pub h: usize,
    /// Key and value heads (`h` for multi-head attention).
    pub kv: usize,
    /// Rows of the bias: `(B|1, H|1, T|1)` as multipliers; see [`Dims::bias_row`].
    pub bias: [usize; 3],
}

impl Dims {
    pub fn d(&self) -> usize {
        self.c / self.h
    }

    /// Query heads per key head.
    fn rep(&self) -> usize {
        self.h / self.kv
    }

    /// The packed row's width: `H·D + 2·H_kv·D` (`3C` for GPT-2).
    pub fn width(&self) -> usize {
        self.c + 2 * self.kv * self.d()
    }

    /// The columns of query head `h`'s query, key and value in a packed row.
    fn cols(&self, h: usize) -> (usize, usize, usize) {
        let (d, g) = (self.d(), h / self.rep());
        (h * d, self.c + g * d, self.c + (self.kv + g) * d)
    }

    /// The bias row for query `i` of head `h` in sequence `b`.
    fn bias_row(&self, b: usize, h: usize, i: usize) -> usize {
        let [bb, bh, bt] = self.bias;
        let pick = |x: usize, n: usize| if n == 1 { 0 } else { x };
        ((pick(b, bb) * bh + pick(h, bh)) * bt + pick(i, bt)) * self.t
    }
}

/// `t` rounded up to whole SIMD vectors: the row length of the transposed heads and of the
/// score rows, so the loops along positions have no scalar remainder (T = 31 in PPO: 3 vectors
/// and 7 scalar steps per row otherwise). The padding columns hold zeros.
pub(crate) fn padded(t: usize) -> usize {
    t.div_ceil(LANES) * LANES
}

/// Columns `col..col + d` of the `t` rows of `qkv` (row stride `w`), transposed into
/// `out (d, ld)`: a head's keys or values with the positions contiguous.
#[inline(always)]
fn transpose_head<T: Elem>(out: &mut [T], qkv: &[T], col: usize, t: usize, w: usize, d: usize, ld: usize) {
    for j in 0..t {
        let row = &qkv[j * w + col..j * w + col + d];
        for (e, &x) in row.iter().enumerate() {
            out[e * ld + j] = x;
        }
    }
}

/// `out = Σ_j w[j] · rows[j·stride..][..out.len()]`, summed in `j` order: `P·V` and the other
/// products of a head, and a row of `q·Kᵀ` from the transposed keys (`w = q`, `rows = Kᵀ`, a
/// multiple of `LANES` outputs).
///
/// Up to four `LANES`-wide blocks of outputs are summed in one pass over `w` (a head of 64
/// values is one pass): each block's sum is a chain of dependent adds, so one block alone
/// waits on the add latency every step, while four keep the vector units busy. Every output
/// still sums its terms in `j` order, so the blocking does not change a bit. It is
/// [`weighted_rows_by`]'s code for one row.
#[inline(always)]
fn weighted_rows<T: Elem>(out: &mut [T], w: &[T], rows: &[T], stride: usize) {
    let n = out.len();
    weighted_rows_r::<T, 1>(out, 0, w, 0, w.len(), rows, stride, n);
}

/// [`weighted_rows`] for `r ≤ ROWS` weight vectors at once: `out[i·ld..][..n] = Σ_j w[i·ws + j] ·
/// rows[j·stride..][..n]` for `i < r`, `j < k`. The scores `q·Kᵀ` and `dP = g·Vᵀ` of a head have
/// only `T` outputs per row (2 vectors at T = 31), so one row alone waits on the add latency at
/// every step; [`ROWS`] rows share each load of `rows` and keep 8 sums in flight. `dk` and `dv`
/// take [`ROWS`] keys at a time the same way. Every output still sums its terms in `j` order,
/// as [`weighted_rows`] does, so the results are the same to the bit.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn weighted_rows_by<T: Elem>(
    r: usize,
    out: &mut [T],
    ld: usize,
    w: &[T],
    ws: usize,
    k: usize,
    rows: &[T],
    stride: usize,
    n: usize,
) {
    match r {
        ROWS => weighted_rows_r::<T, ROWS>(out, ld, w, ws, k, rows, stride, n),
        2 => weighted_rows_r::<T, 2>(out, ld, w, ws, k, rows, stride, n),
        _ => weighted_rows_r::<T, 1>(out, ld, w, ws, k, rows, stride, n),
    }
}

/// [`weighted_rows_by`] for exactly `R` rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn weighted_rows_r<T: Elem, const R: usize>(
    out: &mut [T],
    ld: usize,
    w: &[T],
    ws: usize,
    k: usize,
    rows: &[T],
    stride: usize,
    n: usize,
) {
    let mut c0 = 0;
    // One row keeps four vectors of sums in flight, several rows two each.
    if R == 1 {
        while c0 + 4 * LANES <= n {
            weighted_tile::<T, R, { 4 * LANES }>(&mut out[c0..], ld, w, ws, k, &rows[c0..], stride);
            c0 += 4 * LANES;
        }
    }
    while c0 + 2 * LANES <= n {
        weighted_tile::<T, R, { 2 * LANES }>(&mut out[c0..], ld, w, ws, k, &rows[c0..], stride);
        c0 += 2 * LANES;
    }
    if c0 + LANES <= n {
        weighted_tile::<T, R, LANES>(&mut out[c0..], ld, w, ws, k, &rows[c0..], stride);
        c0 += LANES;
    }
    for i in 0..R {
        for cc in c0..n {
            let mut a = T::zero();
            for j in 0..k {
                a += w[i * ws + j] * rows[j * stride + cc];
            }
            out[i * ld + cc] = a;
        }
    }
}

/// [`weighted_rows_by`] for exactly `N` outputs per row, held in registers.
#[inline(always)]
fn weighted_tile<T: Elem, const R: usize, const N: usize>(
    out: &mut [T],
    ld: usize,
    w: &[T],
    ws: usize,
    k: usize,
    rows: &[T],
    stride: usize,
) {
    let ws: [&[T]; R] = std::array::from_fn(|i| &w[i * ws..i * ws + k]);
    let mut acc = [[T::zero(); N]; R];
    for j in 0..k {
        let r = &rows[j * stride..j * stride + N];
        for (a, w) in acc.iter_mut().zip(&ws) {
            let wj = w[j];
            for l in 0..N {
                a[l] += wj * r[l];
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        out[i * ld..i * ld + N].copy_from_slice(a);
    }
}

/// Rows per call of [`weighted_rows_by`]: 4 rows of 2 vectors are 8 sums in flight, enough to
/// cover the add latency on two ports.
pub(crate) const ROWS: usize = 4;

/// The blocks `(first, count)` that cover the rows `0..t`: [`ROWS`] rows each, then 2 and 1.
fn row_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut i = 0;
    std::iter::from_fn(move || {
        (i < t).then(|| {
            let r = match t - i {
                n if n >= ROWS => ROWS,
                n if n >= 2 => 2,
                _ => 1,
            };
            i += r;
            (i - r, r)
        })
    })
}

/// Bias values at or below this mask their key: its probability underflows to exactly 0 for
/// any score below 10⁷ in magnitude (`causal_bias` uses −10⁹).
const DEAD: f64 = -1e8;

/// One past the last key of a bias row that is not masked; `t` when all are (a fully masked
/// row gets its uniform distribution from the full computation, as the composed op gives).
#[inline(always)]
fn live_keys<T: Elem>(bias: &[T], dead: T) -> usize {
    match bias.iter().rposition(|&b| b > dead) {
        Some(j) => j + 1,
        None => bias.len(),
    }
}

simd_kernel! {
    /// One sequence: `out (T, C)` and the probabilities `p (H, T, T)` from the packed rows
    /// `qkv (T, W)` ([`Dims::width`]); `kt (D, Tp)` (zeros) and `srows (ROWS, Tp)` are scratch,
    /// `Tp = padded(T)`. Keys past the last live one of a row (the causal future) are skipped:
    /// their probabilities are exactly 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fwd_seq<T: Elem>(out: &mut [T], p: &mut [T], kt: &mut [T], srows: &mut [T], qkv: &[T], bias: &[T], b: usize, dims: &Dims, scale: T) {
        let (t, c, d, w) = (dims.t, dims.c, dims.d(), dims.width());
        let tp = padded(t);
        let dead = T::from(DEAD).unwrap_or_else(T::min_value);
        for h in 0..dims.h {
            let (q, k, v) = dims.cols(h);
            // The group's first query head transposes its keys; the others reuse them.
            if h % dims.rep() == 0 {
                transpose_head(kt, qkv, k, t, w, d, tp);
            }
            let live_of = |i: usize| {
                let br = dims.bias_row(b, h, i);
                live_keys(&bias[br..br + t], dead)
            };
            for (i0, r) in row_blocks(t) {
                // The block's scores up to its longest row (a row's extra scores are unused).
                let n = padded((i0..i0 + r).map(live_of).max().unwrap_or(0));
                weighted_rows_by(r, srows, tp, &qkv[i0 * w + q..], w, d, kt, tp, n);
                for i in i0..i0 + r {
                    let br = dims.bias_row(b, h, i);
                    let brow = &bias[br..br + t];
                    let live = live_keys(brow, dead);
                    let srow = &srows[(i - i0) * tp..];
                    let full = &mut p[(h * t + i) * t..(h * t + i + 1) * t];
                    full[live..].fill(T::zero());
                    let row = &mut full[..live];
                    for ((s, &x), &bias) in row.iter_mut().zip(&srow[..live]).zip(brow) {
                        *s = x * scale + bias;
                    }
                    let m = simd::max(row);
                    for s in row.iter_mut() {
                        *s = (*s - m).exp_fast();
                    }
                    let inv = T::one() / simd::sum(row);
                    for s in row.iter_mut() {
                        *s *= inv;
                    }
                    weighted_rows(&mut out[i * c + h * d..i * c + h * d + d], row, &qkv[v..], w);
                }
            }
        }
    }
}

simd_kernel! {
    /// One sequence's `dqkv (T, W)` from `g (T, C)`. Scratch: `vt (D, Tp)` (zeros), `dsp (ROWS,
    /// Tp)`, `dsm (T, T)`, `col (2·ROWS·T)`, `kv (2·ROWS·D)`, `Tp = padded(T)`. Per head: the rows
    /// of `dS` (skipping the keys whose probability is 0) and `dq_i = Σ_j dS_ij·k_j`, then per
    /// key `dk_j = Σ_i dS_ij·q_i` and `dv_j = Σ_i P_ij·g_i`. Every query output is written once;
    /// a key or value head shared by several query heads gets the first one's terms written,
    /// then each other's added in head order (GPT-2's heads write each output once).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bwd_seq<T: Elem>(dqkv: &mut [T], vt: &mut [T], dsp: &mut [T], dsm: &mut [T], col: &mut [T], kv: &mut [T], g: &[T], p: &[T], qkv: &[T], dims: &Dims, scale: T) {
        let (t, c, d, w) = (dims.t, dims.c, dims.d(), dims.width());
        let tp = padded(t);
        let (wds, wp) = col.split_at_mut(ROWS * t);
        for h in 0..dims.h {
            let (q, k, v) = dims.cols(h);
            let first_of_group = h % dims.rep() == 0;
            if first_of_group {
                transpose_head(vt, qkv, v, t, w, d, tp);
            }
            let live_of = |i: usize| {
                let pi = &p[(h * t + i) * t..(h * t + i + 1) * t];
                pi.iter().rposition(|&x| x != T::zero()).map_or(0, |j| j + 1)
            };
            for (i0, r) in row_blocks(t) {
                // dP = g · Vᵀ for the block's rows, up to its longest row.
                let n = padded((i0..i0 + r).map(live_of).max().unwrap_or(0));
                weighted_rows_by(r, dsp, tp, &g[i0 * c + h * d..], c, d, vt, tp, n);
                for i in i0..i0 + r {
                    let pi = &p[(h * t + i) * t..(h * t + i + 1) * t];
                    let live = live_of(i);
                    let dsp = &dsp[(i - i0) * tp..];
                    // The softmax backward.
                    let dsi = &mut dsm[i * t..(i + 1) * t];
                    dsi[live..].fill(T::zero());
                    let dot = simd::dot(&pi[..live], &dsp[..live]);
                    for ((x, &dp), &pij) in dsi.iter_mut().zip(&dsp[..live]).zip(pi) {
                        *x = scale * pij * (dp - dot);
                    }
                    let qi = i * w + q;
                    weighted_rows(&mut dqkv[qi..qi + d], &dsi[..live], &qkv[k..], w);
                }
            }
            // Queries before the first that attends to key j add exact zeros (the causal past).
            let first = |j: usize| (0..t).find(|&i| p[(h * t + i) * t + j] != T::zero()).unwrap_or(t);
            for (j0, r) in row_blocks(t) {
                let lo = (j0..j0 + r).map(first).min().unwrap_or(t);
                if lo == t {
                    if first_of_group {
                        for j in j0..j0 + r {
                            dqkv[j * w + k..][..d].fill(T::zero());
                            dqkv[j * w + v..][..d].fill(T::zero());
                        }
                    }
                    continue;
                }
                // The block's columns of dS and P, each contiguous from query `lo` (a key's
                // terms before its own first query are exact zeros).
                for jj in 0..r {
                    for i in lo..t {
                        wds[jj * t + i] = dsm[i * t + j0 + jj];
                        wp[jj * t + i] = p[(h * t + i) * t + j0 + jj];
                    }
                }
                let (n, at) = (t - lo, j0 * w);
                let (qs, gs) = (&qkv[lo * w + q..], &g[lo * c + h * d..]);
                if first_of_group {
                    weighted_rows_by(r, &mut dqkv[at + k..], w, &wds[lo..], t, n, qs, w, d);
                    weighted_rows_by(r, &mut dqkv[at + v..], w, &wp[lo..], t, n, gs, c, d);
                } else {
                    let (dk, dv) = kv.split_at_mut(ROWS * d);
                    weighted_rows_by(r, dk, d, &wds[lo..], t, n, qs, w, d);
                    weighted_rows_by(r, dv, d, &wp[lo..], t, n, gs, c, d);
                    for jj in 0..r {
                        let row = &mut dqkv[(j0 + jj) * w..];
                        axpy(&mut row[k..k + d], T::one(), &dk[jj * d..][..d]);
                        axpy(&mut row[v..v + d], T::one(), &dv[jj * d..][..d]);
                    }
                }
            }
        }
    }
}

/// The probabilities `(B, H, T, T)` a forward keeps for its backward, on its device.
pub(crate) enum Probs {
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::CudaStorage),
}

impl Probs {
    /// The probabilities kept on the CPU.
    pub(crate) fn cpu(&self) -> CResult<&CpuStorage> {
        match self {
            Probs::Cpu(p) => Ok(p),
            #[cfg(feature = "cuda")]
            Probs::Cuda(_) => candle_core::bail!("self-attention backward: the probabilities are on the GPU"),
        }
    }
}

/// The forward op; it keeps the probabilities for its backward.
struct SelfAttention {
    n_head: usize,
    scale: f64,
    probs: Mutex<Option<Probs>>,
}

/// The backward op: `(qkv, g) → dqkv`, with the kept probabilities.
struct SelfAttentionBwd {
    dims: Dims,
    scale: f64,
    probs: Probs,
}

fn dims_of(qkv: &Layout, bias: &Layout, n_head: usize) -> CResult<Dims> {
    let (b, t, c3) = match qkv.dims() {
        &[b, t, c3] => (b, t, c3),
        d => candle_core::bail!("self-attention: qkv must be (B, T, 3C), got {d:?}"),
    };
    let c = c3 / 3;
    if c3 % 3 != 0 || n_head == 0 || c % n_head != 0 {
        candle_core::bail!("self-attention: 3C = {c3} does not split into 3 × {n_head} heads");
    }
    let bias = bias_rows(bias.dims(), [b, n_head, t], "self-attention")?;
    Ok(Dims { t, c, h: n_head, kv: n_head, bias })
}

/// A bias of shape `(B|1, H|1, T|1, T)` as its `(B|1, H|1, T|1)` multipliers ([`Dims::bias`])
/// for `[b, h, t]`, or `op`'s error naming the shape.
pub(crate) fn bias_rows(bias: &[usize], [b, h, t]: [usize; 3], op: &str) -> CResult<[usize; 3]> {
    match *bias {
        [bb, bh, bt, bs]
            if bs == t && (bb == 1 || bb == b) && (bh == 1 || bh == h) && (bt == 1 || bt == t) =>
        {
            Ok([bb, bh, bt])
        }
        _ => candle_core::bail!("{op}: bias {bias:?} does not broadcast to ({b}, {h}, {t}, {t})"),
    }
}

impl SelfAttention {
    fn fwd<T: Elem>(
        &self,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
    ) -> CResult<(CpuStorage, Shape)> {
        let dims = dims_of(l1, l2, self.n_head)?;
        let qkv = contiguous::<T>(s1, l1, "self-attention")?;
        let bias = contiguous::<T>(s2, l2, "self-attention")?;
        let b = l1.dims()[0];
        let (t, c, h) = (dims.t, dims.c, dims.h);
        let scale = T::from(self.scale).unwrap_or_else(T::one);
        let mut out = super::zeros_par(b * t * c);
        let mut p = super::zeros_par(b * h * t * t);
        if t > 0 && c > 0 {
            out.par_chunks_mut(t * c)
                .zip(p.par_chunks_mut(h * t * t))
                .zip(qkv.par_chunks(t * 3 * c))
                .enumerate()
                .for_each(|(bi, ((o, p), x))| {
                    let tp = padded(t);
                    fwd_seq(
                        o,
                        p,
                        &mut vec![T::zero(); c / h * tp],
                        &mut vec![T::zero(); ROWS * tp],
                        x,
                        bias,
                        bi,
                        &dims,
                        scale,
                    )
                });
        }
        *super::lock(&self.probs) = Some(Probs::Cpu(T::to_cpu_storage_owned(p)));
        Ok((T::to_cpu_storage_owned(out), (b, t, c).into()))
    }
}

impl CustomOp2 for SelfAttention {
    fn name(&self) -> &'static str {
        "rltune-self-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        if s1.dtype() != s2.dtype() {
            candle_core::bail!("self-attention: qkv and bias dtypes differ");
        }
        by_dtype!(s1, "self-attention", self.fwd((s1, l1), (s2, l2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        let dims = dims_of(l1, l2, self.n_head)?;
        let b = l1.dims()[0];
        let geometry = [b, dims.t, dims.c, dims.h, dims.kv];
        let (y, p) = crate::cuda::attention_fwd((s1, l1), (s2, l2), geometry, dims.bias, self.scale as f32)?;
        *super::lock(&self.probs) = Some(Probs::Cuda(p));
        Ok((y, (b, dims.t, dims.c).into()))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let probs = match super::lock(&self.probs).take() {
            Some(p) => p,
            // A second backward through the same graph: recompute them.
            None => self_attention_keep(qkv, bias, self.n_head, self.scale)?.1,
        };
        Ok((Some(self_attention_bwd(qkv, bias, g, self.n_head, self.scale, probs)?), None))
    }
}

impl SelfAttentionBwd {
    fn run<T: Elem>(
        &self,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
    ) -> CResult<(CpuStorage, Shape)> {
        let qkv = contiguous::<T>(s1, l1, "self-attention backward")?;
        let g = contiguous::<T>(s2, l2, "self-attention backward")?;
        let p = self.probs.cpu()?.as_slice::<T>()?;
        let Dims { t, c, h, .. } = self.dims;
        let b = l1.dims()[0];
        let scale = T::from(self.scale).unwrap_or_else(T::one);
        let mut dqkv = super::zeros_par(b * t * 3 * c);
        if t > 0 && c > 0 {
            dqkv.par_chunks_mut(t * 3 * c)
                .zip(g.par_chunks(t * c))
                .zip(p.par_chunks(h * t * t))
                .zip(qkv.par_chunks(t * 3 * c))
                .for_each(|(((dx, g), p), x)| {
                    let tp = padded(t);
                    let (vt, dsp) = (&mut vec![T::zero(); c / h * tp], &mut vec![T::zero(); ROWS * tp]);
                    let (dsm, col) = (&mut vec![T::zero(); t * t], &mut vec![T::zero(); 2 * ROWS * t]);
                    bwd_seq(dx, vt, dsp, dsm, col, &mut [], g, p, x, &self.dims, scale)
                });
        }
        Ok((T::to_cpu_storage_owned(dqkv), l1.shape().clone()))
    }
}

impl CustomOp2 for SelfAttentionBwd {
    fn name(&self) -> &'static str {
        "rltune-self-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "self-attention backward", self.run((s1, l1), (s2, l2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        let Probs::Cuda(p) = &self.probs else {
            candle_core::bail!("self-attention backward: the probabilities are on another device")
        };
        let Dims { t, c, h, kv, .. } = self.dims;
        let geometry = [l1.dims()[0], t, c, h, kv];
        let dqkv = crate::cuda::attention_bwd((s1, l1), (s2, l2), p, geometry, self.scale as f32)?;
        Ok((dqkv, l1.shape().clone()))
    }
}

/// Causal self-attention from GPT-2's fused projection: `qkv (B, T, 3C)` holds `q`, `k`, `v`
/// side by side (heads of `C / n_head` columns each), `bias (B|1, 1|H, T|1, T)` is the additive
/// mask of [`crate::causal_bias`]; returns `softmax(q·kᵀ·scale + bias)·v` with
/// the heads merged, `(B, T, C)`. Differentiable in `qkv` (the mask gets no gradient).
///
/// On the CPU (f32, f64) and on CUDA (f32, `attention.cu`, rows of up to
/// `crate::cuda::ATTENTION_MAX_ROW` head and key values) one fused op; elsewhere (and for a key
/// length other than `T`, as with a KV cache) use [`self_attention_composed`], which gives the
/// same results.
pub fn self_attention(qkv: &Tensor, bias: &Tensor, n_head: usize, scale: f64) -> CResult<Tensor> {
    if (super::cpu_kernels(qkv.device()) || cuda_fits(qkv, bias, n_head)) && qkv.dtype() == bias.dtype() {
        let op = SelfAttention { n_head, scale, probs: Mutex::new(None) };
        qkv.contiguous()?.apply_op2(&bias.contiguous()?, op)
    } else {
        self_attention_composed(qkv, bias, n_head, scale)
    }
}

/// Whether the CUDA kernel takes these operands: f32 on a GPU, rows it can hold.
#[cfg(feature = "cuda")]
fn cuda_fits(qkv: &Tensor, bias: &Tensor, n_head: usize) -> bool {
    let (t, c3) = (qkv.dims().get(1).copied().unwrap_or(0), qkv.dims().last().copied().unwrap_or(0));
    super::cuda_f32(&[qkv, bias]) && n_head > 0 && c3 / 3 / n_head + t <= crate::cuda::ATTENTION_MAX_ROW
}

#[cfg(not(feature = "cuda"))]
fn cuda_fits(_: &Tensor, _: &Tensor, _: usize) -> bool {
    false
}

/// [`self_attention`] without a graph, with the probabilities `(B, H, T, T)` for
/// [`self_attention_bwd`] (`qkv` and `bias` of one dtype: f32 or f64 on the CPU, f32 on CUDA).
pub(crate) fn self_attention_keep(
    qkv: &Tensor,
    bias: &Tensor,
    n_head: usize,
    scale: f64,
) -> CResult<(Tensor, Probs)> {
    let op = SelfAttention { n_head, scale, probs: Mutex::new(None) };
    let y = qkv.contiguous()?.apply_op2_no_bwd(&bias.contiguous()?, &op)?;
    let p = super::lock(&op.probs).take();
    Ok((y, p.ok_or_else(|| candle_core::Error::Msg("self-attention: no probabilities".into()))?))
}

/// `dqkv` for upstream gradient `g (B, T, C)`, from the probabilities of [`self_attention_keep`].
pub(crate) fn self_attention_bwd(
    qkv: &Tensor,
    bias: &Tensor,
    g: &Tensor,
    n_head: usize,
    scale: f64,
    probs: Probs,
) -> CResult<Tensor> {
    let dims = dims_of(qkv.layout(), bias.layout(), n_head)?;
    let bwd = SelfAttentionBwd { dims, scale, probs };
    qkv.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &bwd)
}

/// The keys and values of one layer during generation, appended in place: for each sequence and
/// head, the `D`-vectors of its positions one after another (no `(B, H, S, D)` tensor is rebuilt
/// per step, as a concatenation would).
#[derive(Debug, Clone, Default)]
pub struct KvBlock {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    /// Heads per sequence (set by the first append).
    heads: usize,
}

impl KvBlock {
    /// Cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the sequences `rows` (indices among the cached ones, in the order given): the
    /// batch becomes them, their cached keys and values untouched. A row named twice is copied
    /// (a prompt prefilled once for several samples).
    pub fn select_rows(&mut self, rows: &[usize]) -> CResult<()> {
        if self.k.is_empty() {
            return Ok(());
        }
        // Sequence × head slots; the heads of a sequence are consecutive.
        let h = self.heads.max(1);
        let b = self.k.len() / h;
        if let Some(&bad) = rows.iter().find(|&&r| r >= b) {
            candle_core::bail!("KV block: row {bad} of {b} cached sequences");
        }
        let pick = |slots: &mut Vec<Vec<f32>>| {
            let mut old: Vec<Option<Vec<f32>>> = std::mem::take(slots).into_iter().map(Some).collect();
            // Where each row's first copy went: a later one clones it.
            let mut placed: Vec<Option<usize>> = vec![None; b];
            for &r in rows {
                let at = slots.len();
                for i in 0..h {
                    let slot = match placed[r] {
                        Some(first) => slots[first + i].clone(),
                        None => old[r * h + i].take().unwrap_or_default(),
                    };
                    slots.push(slot);
                }
                placed[r].get_or_insert(at);
            }
        };
        pick(&mut self.k);
        pick(&mut self.v);
        Ok(())
    }

    /// Keeps the cached positions `keep` (increasing indices) of every sequence.
    pub fn select_positions(&mut self, keep: &[usize]) -> CResult<()> {
        if self.len == 0 {
            return Ok(());
        }
        if let Some(&bad) = keep.iter().find(|&&p| p >= self.len) {
            candle_core::bail!("KV block: position {bad} of {}", self.len);
        }
        let d = self.k.first().map_or(0, |k| k.len() / self.len);
        let pick = |slot: &mut Vec<f32>| {
            let old = std::mem::take(slot);
            slot.reserve(keep.len() * d);
            for &p in keep {
                slot.extend_from_slice(&old[p * d..(p + 1) * d]);
            }
        };
        self.k.iter_mut().for_each(pick);
        self.v.iter_mut().for_each(pick);
        self.len = keep.len();
        Ok(())
    }
}

simd_kernel! {
    /// One sequence of [`cached_attention`]: appends its `t` new keys and values to `ks`, `vs`
    /// (one vector per key/value head), then attends each new query over all `s` positions.
    /// Row `i` of `qkv` is `[q (H·D) | k (H_kv·D) | v (H_kv·D)]`; query head `hh` reads key and
    /// value head `hh / (H / H_kv)`, as transformers' `repeat_kv` pairs them.
    #[allow(clippy::too_many_arguments)]
    fn cached_seq<T: Elem>(out: &mut [T], ks: &mut [Vec<T>], vs: &mut [Vec<T>], qkv: &[T], bias: &[T], t: usize, h: usize, d: usize, scale: T) {
        let h_kv = ks.len();
        let n_rep = h / h_kv;
        let (width, k_at, v_at) = ((h + 2 * h_kv) * d, h * d, (h + h_kv) * d);
        let s = ks.first().map_or(0, |k| k.len() / d) + t;
        let mut row = vec![T::zero(); s];
        for (g, (k, v)) in ks.iter_mut().zip(vs.iter_mut()).enumerate() {
            for i in 0..t {
                k.extend_from_slice(&qkv[i * width + k_at + g * d..][..d]);
                v.extend_from_slice(&qkv[i * width + v_at + g * d..][..d]);
            }
            for hh in g * n_rep..(g + 1) * n_rep {
                for i in 0..t {
                    let q = &qkv[i * width + hh * d..][..d];
                    for ((x, kj), &b) in row.iter_mut().zip(k.chunks_exact(d)).zip(&bias[i * s..(i + 1) * s]) {
                        *x = simd::dot(q, kj) * scale + b;
                    }
                    let m = simd::max(&row);
                    for x in row.iter_mut() {
                        *x = (*x - m).exp_fast();
                    }
                    let inv = T::one() / simd::sum(&row);
                    let o = &mut out[i * h * d + hh * d..][..d];
                    o.fill(T::zero());
                    for (&p, vj) in row.iter().zip(v.chunks_exact(d)) {
                        axpy(o, p * inv, vj);
                    }
                }
            }
        }
    }
}

/// The generation op: `(qkv, bias) → out`, appending to the cache it holds.
struct CachedAttention<'a> {
    cache: Mutex<&'a mut KvBlock>,
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
}

impl CustomOp2 for CachedAttention<'_> {
    fn name(&self) -> &'static str {
        "rltune-cached-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (b, t, width) = match l1.dims() {
            &[b, t, width] => (b, t, width),
            d => candle_core::bail!("cached attention: qkv must be (B, T, (H + 2 H_kv)·D), got {d:?}"),
        };
        let (h, h_kv) = (self.n_head, self.n_kv_head);
        let slots = h + 2 * h_kv;
        if h == 0 || h_kv == 0 || h % h_kv != 0 || width % slots != 0 {
            candle_core::bail!(
                "cached attention: a qkv row of {width} does not split into {h} query heads and 2 × {h_kv} \
                 key/value heads of one size (H must be a multiple of H_kv)"
            );
        }
        let d = width / slots;
        let mut cache = super::lock(&self.cache);
        if cache.k.is_empty() {
            cache.k = vec![Vec::new(); b * h_kv];
            cache.v = vec![Vec::new(); b * h_kv];
            cache.heads = h_kv;
        }
        if cache.k.len() != b * h_kv {
            candle_core::bail!(
                "cached attention: the cache holds {} sequence × head slots, the input needs {b} × {h_kv}",
                cache.k.len()
            );
        }
        let s = cache.len + t;
        if l2.dims() != [b, 1, t, s] {
            candle_core::bail!("cached attention: bias {:?} is not ({b}, 1, {t}, {s})", l2.dims());
        }
        let qkv = contiguous::<f32>(s1, l1, "cached attention")?;
        let bias = contiguous::<f32>(s2, l2, "cached attention")?;
        let c = h * d;
        let mut out = vec![0f32; b * t * c];
        if t > 0 && c > 0 {
            let KvBlock { k, v, .. } = &mut **cache;
            out.par_chunks_mut(t * c)
                .zip(k.par_chunks_mut(h_kv))
                .zip(v.par_chunks_mut(h_kv))
                .zip(qkv.par_chunks(t * width))
                .zip(bias.par_chunks(t * s))
                .for_each(|((((o, ks), vs), x), bias)| cached_seq(o, ks, vs, x, bias, t, h, d, self.scale));
        }
        cache.len = s;
        Ok((CpuStorage::F32(out), (b, t, c).into()))
    }
}

/// [`self_attention`] for generation with a KV cache: appends the keys and values of
/// `qkv (B, T, 3C)` to `cache`, then attends each of the `T` new positions over the cached ones
/// and the new ones; `bias (B, 1, T, S)` masks the `S` keys (padding, future positions). f32 on
/// the CPU; no gradient. The same results as the composed attention over concatenated keys and
/// values, up to summation order.
pub fn cached_self_attention(
    qkv: &Tensor,
    bias: &Tensor,
    cache: &mut KvBlock,
    n_head: usize,
    scale: f64,
) -> CResult<Tensor> {
    cached_attention(qkv, bias, cache, n_head, n_head, scale)
}

/// [`cached_self_attention`] with grouped-query attention: each row of `qkv` is
/// `[q (H·D) | k (H_kv·D) | v (H_kv·D)]` (queries and keys already rotated, for RoPE models), and
/// query head `h` attends with key/value head `h / (H / H_kv)`, as transformers' `repeat_kv`
/// pairs them, without repeating them. The cache keeps `H_kv` heads per sequence. Returns
/// `(B, T, H·D)`, heads merged. f32 on the CPU; no gradient.
pub fn cached_attention(
    qkv: &Tensor,
    bias: &Tensor,
    cache: &mut KvBlock,
    n_head: usize,
    n_kv_head: usize,
    scale: f64,
) -> CResult<Tensor> {
    if !cached_attention_takes(qkv, bias) {
        candle_core::bail!("cached attention runs on f32 CPU tensors");
    }
    let op = CachedAttention { cache: Mutex::new(cache), n_head, n_kv_head, scale: scale as f32 };
    qkv.contiguous()?.apply_op2_no_bwd(&bias.contiguous()?, &op)
}

/// Whether [`cached_attention`] and [`cached_self_attention`] take a layer's activations `x`
/// (or its `qkv`) and `bias`: f32, on the CPU with the fused kernels on. Elsewhere a model
/// concatenates its cached keys and values instead.
pub fn cached_attention_takes(x: &Tensor, bias: &Tensor) -> bool {
    super::cpu_kernels(x.device()) && x.dtype() == DType::F32 && bias.dtype() == DType::F32
}

/// [`self_attention`] from differentiable candle ops (split heads, attention, merge heads).
pub fn self_attention_composed(qkv: &Tensor, bias: &Tensor, n_head: usize, scale: f64) -> CResult<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let split = |i: usize| -> CResult<Tensor> {
        qkv.narrow(2, i * c, c)?.reshape((b, t, n_head, c / n_head))?.transpose(1, 2)?.contiguous()
    };
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let scores = super::matmul(&q, &k.t()?.contiguous()?)?;
    let probs = super::scaled_masked_softmax(&scores, bias, scale)?;
    super::matmul(&probs, &v)?.transpose(1, 2)?.contiguous()?.reshape((b, t, c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check, fd_check, max_diff, randn};
    use candle_core::Device;

    /// Prefill of 3 positions (one sequence left-padded), then two decoding steps through the
    /// cache: every output equals the full-sequence attention at that position.
    #[test]
    fn cached_attention_equals_full_attention() {
        use crate::mask::causal_bias;
        let (b, s, h, c) = (2, 5, 3, 12);
        let qkv = randn(&[b, s, 3 * c], 4).to_dtype(DType::F32).unwrap();
        let mask = vec![vec![0, 1, 1, 1, 1], vec![1, 1, 1, 1, 1]];
        let full =
            self_attention(&qkv, &causal_bias(&mask, s, DType::F32, &Device::Cpu).unwrap(), h, 0.3).unwrap();
        let mut cache = KvBlock::default();
        let mut at = 0;
        for t in [3, 1, 1] {
            let m: Vec<Vec<u8>> = mask.iter().map(|r| r[..at + t].to_vec()).collect();
            let bias = causal_bias(&m, t, DType::F32, &Device::Cpu).unwrap();
            let y = cached_self_attention(&qkv.narrow(1, at, t).unwrap(), &bias, &mut cache, h, 0.3).unwrap();
            for (bi, row) in mask.iter().enumerate() {
                for i in (0..t).filter(|&i| row[at + i] == 1) {
                    // (A padding query sees no key: its uniform average spans different keys.)
                    let got = y.get(bi).unwrap().get(i).unwrap();
                    let d = max_diff(&got, &full.get(bi).unwrap().get(at + i).unwrap());
                    assert!(d < 1e-5, "sequence {bi} position {}: max diff {d}", at + i);
                }
            }
            at += t;
            assert_eq!(cache.len(), at);
        }
        let bias = causal_bias(&mask, 1, DType::F32, &Device::Cpu).unwrap();
        let err =
            cached_self_attention(&qkv.narrow(1, 0, 1).unwrap(), &bias, &mut cache, h, 0.3).unwrap_err();
        assert!(err.to_string().contains("bias [2, 1, 1, 5] is not (2, 1, 1, 6)"), "{err}");
        let one = qkv.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap();
        let err = cached_self_attention(&one, &bias, &mut cache, h, 0.3).unwrap_err();
        assert!(err.to_string().contains("holds 6 sequence × head slots, the input needs 1 × 3"), "{err}");
    }

    /// Grouped-query attention through the cache (3 query heads per key/value head): prefill, then
    /// two decoding steps, each equal to full attention over the key and value heads repeated
    /// the way transformers' `repeat_kv` repeats them; the cache keeps only the H_kv heads.
    #[test]
    fn cached_gqa_attention_equals_full_attention_with_repeated_heads() {
        use crate::mask::causal_bias;
        let (b, s, h, h_kv, d) = (2, 5, 6, 2, 4);
        let q = randn(&[b, s, h * d], 7).to_dtype(DType::F32).unwrap();
        let k = randn(&[b, s, h_kv * d], 8).to_dtype(DType::F32).unwrap();
        let v = randn(&[b, s, h_kv * d], 9).to_dtype(DType::F32).unwrap();
        let repeat = |x: &Tensor| {
            let idx =
                Tensor::new((0..h as u32).map(|i| i / (h / h_kv) as u32).collect::<Vec<_>>(), &Device::Cpu)
                    .unwrap();
            x.reshape((b, s, h_kv, d)).unwrap().index_select(&idx, 2).unwrap().reshape((b, s, h * d)).unwrap()
        };
        let mask = vec![vec![0, 0, 1, 1, 1], vec![1, 1, 1, 1, 1]];
        let full_qkv = Tensor::cat(&[&q, &repeat(&k), &repeat(&v)], 2).unwrap();
        let full =
            self_attention(&full_qkv, &causal_bias(&mask, s, DType::F32, &Device::Cpu).unwrap(), h, 0.4)
                .unwrap();
        let qkv = Tensor::cat(&[&q, &k, &v], 2).unwrap();
        let mut cache = KvBlock::default();
        let mut at = 0;
        for t in [3, 1, 1] {
            let m: Vec<Vec<u8>> = mask.iter().map(|r| r[..at + t].to_vec()).collect();
            let bias = causal_bias(&m, t, DType::F32, &Device::Cpu).unwrap();
            let y =
                cached_attention(&qkv.narrow(1, at, t).unwrap(), &bias, &mut cache, h, h_kv, 0.4).unwrap();
            assert_eq!(y.dims(), [b, t, h * d]);
            for (bi, row) in mask.iter().enumerate() {
                for i in (0..t).filter(|&i| row[at + i] == 1) {
                    let got = y.get(bi).unwrap().get(i).unwrap();
                    let d = max_diff(&got, &full.get(bi).unwrap().get(at + i).unwrap());
                    assert!(d < 1e-5, "sequence {bi} position {}: max diff {d}", at + i);
                }
            }
            at += t;
            assert_eq!(cache.len(), at);
        }
        assert_eq!(cache.k.len(), b * h_kv, "the cache keeps the un-repeated heads");
        let bias = causal_bias(&mask, 1, DType::F32, &Device::Cpu).unwrap();
        let err = cached_attention(&qkv.narrow(1, 0, 1).unwrap(), &bias, &mut cache, 4, 3, 0.4).unwrap_err();
        assert!(err.to_string().contains("does not split into 4 query heads"), "{err}");
    }

    fn causal(mask: &[Vec<u8>], dtype: DType) -> Tensor {
        let t = mask[0].len();
        crate::causal_bias(mask, t, dtype, &Device::Cpu).unwrap()
    }

    #[test]
    fn matches_composed_values_and_gradients() {
        // Left padding (a fully masked row) in the second sequence.
        let bias = causal(&[vec![1, 1, 1, 1, 1], vec![0, 0, 1, 1, 1]], DType::F64);
        check(
            &[&[2, 5, 24]],
            |t| self_attention(&t[0], &bias, 2, 0.35).unwrap(),
            |t| self_attention_composed(&t[0], &bias, 2, 0.35).unwrap(),
        );
        // T = 21: rows longer than one 16-lane vector.
        let long = causal(&[vec![1; 21]], DType::F64);
        check(
            &[&[1, 21, 24]],
            |t| self_attention(&t[0], &long, 2, 0.3).unwrap(),
            |t| self_attention_composed(&t[0], &long, 2, 0.3).unwrap(),
        );
        let shared = causal(&[vec![1, 1, 1]], DType::F64);
        check(
            &[&[3, 3, 12]],
            |t| self_attention(&t[0], &shared, 4, 0.5).unwrap(),
            |t| self_attention_composed(&t[0], &shared, 4, 0.5).unwrap(),
        );
    }

    #[test]
    fn a_second_backward_recomputes_the_probabilities() {
        let bias = causal(&[vec![1, 1, 1, 1], vec![0, 1, 1, 1]], DType::F64);
        let x = candle_core::Var::from_tensor(&randn(&[2, 4, 12], 5)).unwrap();
        let w = randn(&[2, 4, 4], 6);
        let y = self_attention(x.as_tensor(), &bias, 2, 0.4).unwrap();
        let loss = (y * &w).unwrap().sum_all().unwrap();
        let first = loss.backward().unwrap().get(&x).unwrap().clone();
        let second = loss.backward().unwrap().get(&x).unwrap().clone();
        assert_eq!(max_diff(&first, &second), 0.0);
    }

    /// Right padding only: a fully masked query row (left padding) sits at −1e9, where a
    /// step of 1e-5 is below f64's resolution and the difference quotient is noise.
    #[test]
    fn finite_differences() {
        let bias = causal(&[vec![1, 1, 1, 1], vec![1, 1, 1, 0]], DType::F64);
        fd_check(&[&[2, 4, 12]], |t| self_attention(&t[0], &bias, 2, 0.7).unwrap());
    }

    #[test]
    fn f32_matches_f64_and_bad_shapes_are_errors() {
        let x = randn(&[4, 32, 3 * 64], 9);
        // No padding: a fully masked row's scores sit at −1e9, where f32 keeps no fraction.
        let mask = vec![vec![1u8; 32]; 4];
        let y64 = self_attention(&x, &causal(&mask, DType::F64), 4, 0.125).unwrap();
        let x32 = x.to_dtype(DType::F32).unwrap();
        let y32 = self_attention(&x32, &causal(&mask, DType::F32), 4, 0.125).unwrap();
        let diff = max_diff(&y32, &y64);
        assert!(diff < 1e-5, "f32 vs f64: {diff}");
        let bias = causal(&mask, DType::F64);
        let err = self_attention(&x, &bias, 5, 0.1).unwrap_err().to_string();
        assert!(err.contains("heads"), "{err}");
        let short = causal(&vec![vec![1; 31]; 4], DType::F64);
        let err = self_attention(&x, &short, 4, 0.1).unwrap_err().to_string();
        assert!(err.contains("does not broadcast"), "{err}");
    }
}
