//! Softmax family: softmax, log-softmax, attention's scaled masked softmax, the logprob of a
//! target token and the entropy of a distribution, each over the last dimension.
//!
//! On CUDA (f32; u32 targets) softmax, log-softmax, the logprob of a target and the entropy run
//! the twins in `src/cuda/softmax.cu` ([`crate::cuda`]); attention's scaled masked softmax keeps
//! candle's composed ops there.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use super::simd::{self, simd_kernel, LANES};
use super::{contiguous, last_dim, par_rows, CResult, Elem};

/// `(Σ e^(x − m), Σ e^(x − m)·(x − m))` with vectorizable lanes; a term with `e^(x − m) = 0`
/// adds nothing to the second sum (`x − m = −∞` is taken as −MAX, so no `0 · ∞`).
#[inline(always)]
fn sum_exp<T: Elem>(x: &[T], m: T, with_x: bool) -> (T, T) {
    let mut acc = [T::zero(); LANES];
    let mut acc_x = [T::zero(); LANES];
    let lo = <T as num_traits::Float>::min_value();
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let d = c[l] - m;
            let e = d.exp_fast();
            acc[l] += e;
            if with_x {
                // Branch-free (see the doc comment): a select compiled to a masked store.
                acc_x[l] += e * if d > lo { d } else { lo };
            }
        }
    }
    let (mut s, mut sx) = (simd::sum(&acc), simd::sum(&acc_x));
    for &v in rest {
        let d = v - m;
        let e = d.exp_fast();
        s += e;
        if with_x && e > T::zero() {
            sx += e * d;
        }
    }
    (s, sx)
}

/// `log Σ e^x` of a row.
#[inline(always)]
fn logsumexp<T: Elem>(x: &[T]) -> T {
    let m = simd::max(x);
    m + sum_exp(x, m, false).0.ln()
}

simd_kernel! {
    /// One row of logits becomes its unnormalized distribution in place: `x ← e^(x/t − m)` with
    /// `m = max(x/t)`. The sampler's vectorized pass (it sums the weights itself, in f64).
    fn exp_row_inplace<T: Elem>(x: &mut [T], temperature: T) {
        if temperature != T::one() {
            for v in x.iter_mut() {
                *v /= temperature;
            }
        }
        let m = simd::max(x);
        exp_sub(x, m);
    }
}

/// `x ← e^(x − m)`: the hand-written AVX2 body for f32 where the CPU has it.
#[inline(always)]
fn exp_sub<T: Elem>(x: &mut [T], m: T) {
    #[cfg(target_arch = "x86_64")]
    if let Some(xf) = simd::as_f32_mut(x) {
        if simd::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { simd::avx2::exp_sub_inplace(xf, m.to_f32().unwrap_or(f32::NAN)) };
        }
    }
    for v in x.iter_mut() {
        *v = (*v - m).exp_fast();
    }
}

/// `exp_row_inplace` for f32 rows (the sampler's fast path).
pub fn exp_row_f32(x: &mut [f32], temperature: f32) {
    exp_row_inplace(x, temperature)
}

simd_kernel! {
    /// Softmax of each row, in place.
    fn softmax_rows_inplace<T: Elem>(o: &mut [T], n: usize) {
        for o in o.chunks_mut(n) {
            let m = simd::max(o);
            for v in o.iter_mut() {
                *v = (*v - m).exp_fast();
            }
            let inv = T::one() / simd::sum(o);
            for v in o.iter_mut() {
                *v *= inv;
            }
        }
    }
}

simd_kernel! {
    /// `out = scale · y ⊙ (g − Σ g⊙y)` per row: softmax backward.
    fn softmax_bwd_rows<T: Elem>(out: &mut [T], y: &[T], g: &[T], n: usize, scale: T) {
        for ((o, y), g) in out.chunks_mut(n).zip(y.chunks(n)).zip(g.chunks(n)) {
            let dot = simd::dot(y, g);
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = scale * y * (g - dot);
            }
        }
    }
}

simd_kernel! {
    /// Log-softmax of each row of `x` into `out`.
    fn log_softmax_rows<T: Elem>(out: &mut [T], x: &[T], n: usize) {
        for (o, x) in out.chunks_mut(n).zip(x.chunks(n)) {
            let lse = logsumexp(x);
            for (o, &v) in o.iter_mut().zip(x) {
                *o = v - lse;
            }
        }
    }
}

simd_kernel! {
    /// `out = g − e^y Σ g` per row: log-softmax backward.
    fn log_softmax_bwd_rows<T: Elem>(out: &mut [T], y: &[T], g: &[T], n: usize) {
        for ((o, y), g) in out.chunks_mut(n).zip(y.chunks(n)).zip(g.chunks(n)) {
            let sum = simd::sum(g);
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = g - y.exp_fast() * sum;
            }
        }
    }
}

fn storage<T: Elem>(v: Vec<T>, shape: &Shape) -> CResult<(CpuStorage, Shape)> {
    Ok((T::to_cpu_storage_owned(v), shape.clone()))
}

// ---------------------------------------------------------------------------------------------
// softmax

struct Softmax;
struct SoftmaxBwd {
    scale: f64,
}

fn softmax_fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s, l, "softmax")?;
    let n = last_dim(l);
    let mut out = x.to_vec();
    out.par_chunks_mut(super::rows_per_task(n) * n.max(1)).for_each(|o| softmax_rows_inplace(o, n));
    storage(out, l.shape())
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "rltune-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, "softmax", softmax_fwd(s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::softmax_fwd(false, s, l)
    }

    /// dx = y ⊙ (g − Σ g⊙y)
    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxBwd { scale: 1.0 })?))
    }
}

fn softmax_bwd<T: Elem>(
    scale: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let y = contiguous::<T>(s1, l1, "softmax-bwd")?;
    let g = contiguous::<T>(s2, l2, "softmax-bwd")?;
    let n = last_dim(l1);
    let scale = T::from(scale).unwrap_or_else(T::one);
    let mut out = vec![T::zero(); y.len()];
    par_rows(&mut out, n, &[y, g], |_, o, r| softmax_bwd_rows(o, r[0], r[1], n, scale));
    storage(out, l1.shape())
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "rltune-softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        if s1.dtype() == DType::BF16 {
            // The bf16 twin of `softmax.cu`'s bf16 kernel: in f32 from the bf16 values, rounded once.
            let ((y, ly), (g, lg)) = (widen(s1, l1, "softmax-bwd")?, widen(s2, l2, "softmax-bwd")?);
            return narrow_to_bf16(softmax_bwd::<f32>(self.scale, &y, &ly, &g, &lg)?);
        }
        by_dtype!(s1, "softmax-bwd", softmax_bwd(self.scale, s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::softmax_bwd(Some(self.scale), (s1, l1), (s2, l2))
    }
}

/// Softmax over the last dimension, differentiable.
pub fn softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    if super::cpu_kernels(x.device()) || super::cuda_f32(&[x]) {
        x.contiguous()?.apply_op1(Softmax)
    } else {
        softmax_composed(x)
    }
}

/// Softmax from differentiable candle ops (the reference for tests and the non-CPU path).
pub fn softmax_composed(x: &Tensor) -> CResult<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

// ---------------------------------------------------------------------------------------------
// scaled masked softmax (attention)

struct ScaledMaskedSoftmax {
    scale: f64,
}

/// Row `r` of `(B, H, T, S)` scores → the row of a `(B|1, H|1, T|1, S)` bias it adds.
#[inline(always)]
fn bias_row(r: usize, dims: &[usize; 4], bd: &[usize; 4]) -> usize {
    let t = r % dims[2];
    let h = (r / dims[2]) % dims[1];
    let b = r / (dims[2] * dims[1]);
    let pick = |i: usize, d: usize| if bd[d] == 1 { 0 } else { i };
    (pick(b, 0) * bd[1] + pick(h, 1)) * bd[2] + pick(t, 2)
}

simd_kernel! {
    /// `softmax(x · scale + bias)` for the rows `first_row..` of `(B, H, T, S)` scores.
    fn scaled_masked_softmax_rows<T: Elem>(
        out: &mut [T],
        x: &[T],
        bias: &[T],
        first_row: usize,
        dims: &[usize; 4],
        bd: &[usize; 4],
        scale: T,
    ) {
        let n = dims[3];
        for (i, (o, x)) in out.chunks_mut(n).zip(x.chunks(n)).enumerate() {
            let br = bias_row(first_row + i, dims, bd) * n;
            let b = &bias[br..br + n];
            for ((o, &x), &b) in o.iter_mut().zip(x).zip(b) {
                *o = x * scale + b;
            }
        }
        softmax_rows_inplace(out, n);
    }
}

fn scaled_masked_softmax_fwd<T: Elem>(
    scale: f64,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "scaled-masked-softmax")?;
    let bias = contiguous::<T>(s2, l2, "scaled-masked-softmax")?;
    let (dims, bd) = match (l1.dims(), l2.dims()) {
        (&[a, b, c, d], &[e, f, g, h]) => ([a, b, c, d], [e, f, g, h]),
        _ => candle_core::bail!("scaled-masked-softmax: scores and bias must be 4-D"),
    };
    let scale = T::from(scale).unwrap_or_else(T::one);
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, dims[3], &[x], |row0, o, r| {
        scaled_masked_softmax_rows(o, r[0], bias, row0, &dims, &bd, scale)
    });
    storage(out, l1.shape())
}

impl CustomOp2 for ScaledMaskedSoftmax {
    fn name(&self) -> &'static str {
        "rltune-scaled-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        if s1.dtype() == DType::BF16 && s2.dtype() == DType::F32 {
            // The bf16 twin of `softmax.cu`'s bf16 kernel: in f32 from the bf16 scores, rounded once.
            let (x, lx) = widen(s1, l1, "scaled-masked-softmax")?;
            return narrow_to_bf16(scaled_masked_softmax_fwd::<f32>(self.scale, &x, &lx, s2, l2)?);
        }
        if s1.dtype() != s2.dtype() {
            candle_core::bail!("scaled-masked-softmax: scores and bias dtypes differ");
        }
        by_dtype!(s1, "scaled-masked-softmax", scaled_masked_softmax_fwd(self.scale, s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::scaled_masked_softmax_fwd(self.scale, (s1, l1), (s2, l2))
    }

    /// d scores = scale · y ⊙ (g − Σ g⊙y); the bias gets no gradient.
    fn bwd(
        &self,
        _x: &Tensor,
        _bias: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let dx = y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxBwd { scale: self.scale })?;
        Ok((Some(dx), None))
    }
}

/// Attention probabilities `softmax(scores · scale + bias)` over the last dimension.
///
/// `scores (B, H, T, S)`, `bias (B|1, H|1, T|1, S)` (an additive mask, see
/// [`crate::causal_bias`]). Differentiable in `scores`; the bias gets no
/// gradient (masks are constants). One fused op on the CPU (f32, f64) and on CUDA (f32:
/// `softmax.cu`, keeping only the probabilities for the backward).
///
/// bf16 scores with an f32 bias (autocast's attention on the tensor cores,
/// [`crate::bf16_attention`]) give bf16 probabilities, each computed in f32 and rounded once,
/// and the backward's gradients likewise, from the bf16 probabilities: one node on CUDA
/// (`softmax.cu`'s bf16 kernels) and on the CPU (the f32 kernels between conversions, in any
/// scope), the f32 op between casts elsewhere.
pub fn scaled_masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> CResult<Tensor> {
    let fits = match (scores.dims(), bias.dims()) {
        (&[b, h, t, s], &[bb, bh, bt, bs]) => {
            bs == s && (bb == 1 || bb == b) && (bh == 1 || bh == h) && (bt == 1 || bt == t)
        }
        _ => false,
    };
    if scores.dtype() == DType::BF16 && bias.dtype() == DType::F32 {
        if fits && (super::cuda_kernels(scores.device()) || scores.device().is_cpu()) {
            return scores.contiguous()?.apply_op2(&bias.contiguous()?, ScaledMaskedSoftmax { scale });
        }
        return scaled_masked_softmax(&scores.to_dtype(DType::F32)?, bias, scale)?.to_dtype(DType::BF16);
    }
    let device = super::cpu_kernels(scores.device()) || super::cuda_f32(&[scores, bias]);
    if device && fits && scores.dtype() == bias.dtype() {
        scores.contiguous()?.apply_op2(&bias.contiguous()?, ScaledMaskedSoftmax { scale })
    } else {
        scaled_masked_softmax_composed(scores, bias, scale)
    }
}

/// [`scaled_masked_softmax`] from differentiable candle ops.
pub fn scaled_masked_softmax_composed(scores: &Tensor, bias: &Tensor, scale: f64) -> CResult<Tensor> {
    softmax_composed(&(scores * scale)?.broadcast_add(bias)?)
}

/// The contiguous f32 values of a bf16 CPU storage viewed by `l`, and their layout.
fn widen(s: &CpuStorage, l: &Layout, op: &'static str) -> CResult<(CpuStorage, Layout)> {
    let v = contiguous::<half::bf16>(s, l, op)?;
    Ok((CpuStorage::F32(v.iter().map(|x| x.to_f32()).collect()), Layout::contiguous(l.shape().clone())))
}

/// An f32 result rounded to bf16 (to nearest, ties to even).
fn narrow_to_bf16((s, shape): (CpuStorage, Shape)) -> CResult<(CpuStorage, Shape)> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("narrow_to_bf16: an f32 result was due") };
    Ok((CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()), shape))
}

// ---------------------------------------------------------------------------------------------
// log-softmax

struct LogSoftmax;
struct LogSoftmaxBwd;

fn log_softmax_fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s, l, "log-softmax")?;
    let n = last_dim(l);
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, n, &[x], |_, o, r| log_softmax_rows(o, r[0], n));
    storage(out, l.shape())
}

impl CustomOp1 for LogSoftmax {
    fn name(&self) -> &'static str {
        "rltune-log-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, "log-softmax", log_softmax_fwd(s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::softmax_fwd(true, s, l)
    }

    /// dx = g − exp(y) Σ g
    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &LogSoftmaxBwd)?))
    }
}

fn log_softmax_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let y = contiguous::<T>(s1, l1, "log-softmax-bwd")?;
    let g = contiguous::<T>(s2, l2, "log-softmax-bwd")?;
    let n = last_dim(l1);
    let mut out = vec![T::zero(); y.len()];
    par_rows(&mut out, n, &[y, g], |_, o, r| log_softmax_bwd_rows(o, r[0], r[1], n));
    storage(out, l1.shape())
}

impl CustomOp2 for LogSoftmaxBwd {
    fn name(&self) -> &'static str {
        "rltune-log-softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "log-softmax-bwd", log_softmax_bwd(s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::softmax_bwd(None, (s1, l1), (s2, l2))
    }
}

/// Log-softmax over the last dimension, differentiable.
pub fn log_softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    if super::cpu_kernels(x.device()) || super::cuda_f32(&[x]) {
        x.contiguous()?.apply_op1(LogSoftmax)
    } else {
        log_softmax_composed(x)
    }
}

/// Log-softmax from differentiable candle ops.
pub fn log_softmax_composed(x: &Tensor) -> CResult<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

// ---------------------------------------------------------------------------------------------
// logprob of a target

struct LogprobsOf;
struct LogprobsOfBwd;

/// Target ids as `usize`, each checked against the vocabulary size `v`.
fn target_ids(s: &CpuStorage, l: &Layout, v: usize) -> CResult<Vec<usize>> {
    let ids: Vec<usize> = match s {
        CpuStorage::U32(_) => contiguous::<u32>(s, l, "logprobs-of")?.iter().map(|&t| t as usize).collect(),
        CpuStorage::I64(_) => contiguous::<i64>(s, l, "logprobs-of")?
            .iter()
            .map(|&t| usize::try_from(t).unwrap_or(usize::MAX))
            .collect(),
        CpuStorage::U8(_) => contiguous::<u8>(s, l, "logprobs-of")?.iter().map(|&t| t as usize).collect(),
        _ => candle_core::bail!("logprobs-of: targets must be u32, i64 or u8, got {:?}", s.dtype()),
    };
    if let Some(&bad) = ids.iter().find(|&&t| t >= v) {
        candle_core::bail!("logprobs-of: target id {bad} is not below the vocabulary size {v}");
    }
    Ok(ids)
}

simd_kernel! {
    /// `out[r] = x[r, t_r] − logsumexp(x[r])`.
    fn logprobs_rows<T: Elem>(out: &mut [T], x: &[T], targets: &[usize], n: usize) {
        for ((o, x), &t) in out.iter_mut().zip(x.chunks(n)).zip(targets) {
            *o = x[t] - logsumexp(x);
        }
    }
}

fn logprobs_of_fwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "logprobs-of")?;
    let v = last_dim(l1);
    let targets = target_ids(s2, l2, v)?;
    if targets.len() * v != x.len() {
        candle_core::bail!("logprobs-of: {} targets for {} rows", targets.len(), x.len() / v.max(1));
    }
    let mut out = vec![T::zero(); targets.len()];
    let rows = super::rows_per_task(v);
    out.par_chunks_mut(rows).enumerate().for_each(|(c, o)| {
        let r0 = c * rows;
        logprobs_rows(o, &x[r0 * v..(r0 + o.len()) * v], &targets[r0..r0 + o.len()], v);
    });
    storage(out, l2.shape())
}

impl CustomOp2 for LogprobsOf {
    fn name(&self) -> &'static str {
        "rltune-logprobs-of"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "logprobs-of", logprobs_of_fwd(s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::logprobs_of_fwd((s1, l1), (s2, l2))
    }

    /// d logits = g · (onehot(target) − softmax(logits)), row by row; targets get none.
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let dx = logits.apply_op3_no_bwd(targets, &g.contiguous()?, &LogprobsOfBwd)?;
        Ok((Some(dx), None))
    }
}

simd_kernel! {
    /// `out[r] = g[r] · (onehot(t_r) − softmax(x[r]))`.
    fn logprobs_bwd_rows<T: Elem>(out: &mut [T], x: &[T], targets: &[usize], g: &[T], n: usize) {
        for (((o, x), &t), &g) in out.chunks_mut(n).zip(x.chunks(n)).zip(targets).zip(g) {
            let lse = logsumexp(x);
            let ng = -g;
            for (o, &v) in o.iter_mut().zip(x) {
                *o = ng * (v - lse).exp_fast();
            }
            o[t] += g;
        }
    }
}

fn logprobs_of_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "logprobs-of-bwd")?;
    let v = last_dim(l1);
    let targets = target_ids(s2, l2, v)?;
    let g = contiguous::<T>(s3, l3, "logprobs-of-bwd")?;
    let mut out = vec![T::zero(); x.len()];
    let rows = super::rows_per_task(v);
    out.par_chunks_mut(rows * v).enumerate().for_each(|(c, o)| {
        let (r0, nr) = (c * rows, o.len() / v);
        logprobs_bwd_rows(o, &x[r0 * v..(r0 + nr) * v], &targets[r0..r0 + nr], &g[r0..r0 + nr], v);
    });
    storage(out, l1.shape())
}

impl CustomOp3 for LogprobsOfBwd {
    fn name(&self) -> &'static str {
        "rltune-logprobs-of-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "logprobs-of-bwd", logprobs_of_bwd(s1, l1, s2, l2, s3, l3))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::logprobs_of_bwd((s1, l1), (s2, l2), (s3, l3))
    }
}

/// Log-probability of each target under `logits`: `(B, T, V), (B, T) -> (B, T)`, differentiable
/// in `logits`.
///
/// TRL `core.py::logprobs_from_logits`: `log_softmax(logits).gather(-1, labels)`. On the CPU one
/// fused op: the forward keeps no `(B, T, V)` log-softmax, the backward writes
/// `g · (onehot − softmax)` row by row. Targets are u32 (or i64, u8) ids below V.
pub fn logprobs_of(logits: &Tensor, targets: &Tensor) -> CResult<Tensor> {
    if logprobs_kernel_runs(logits, targets) {
        logits.contiguous()?.apply_op2(&targets.contiguous()?, LogprobsOf)
    } else {
        logprobs_of_composed(logits, targets)
    }
}

/// Whether [`logprobs_of`]'s kernels take these operands: f32 or f64 on the CPU, f32 with u32
/// targets on CUDA, one more dimension in the logits than in the targets.
fn logprobs_kernel_runs(logits: &Tensor, targets: &Tensor) -> bool {
    let ok_dtype = matches!(logits.dtype(), DType::F32 | DType::F64);
    let cuda = super::cuda_f32(&[logits]) && targets.dtype() == DType::U32;
    ((super::cpu_kernels(logits.device()) && ok_dtype) || cuda) && logits.rank() == targets.rank() + 1
}

/// The gradient of `Σ g · logprobs_of(logits, targets)` in `logits`, without a graph:
/// `g · (onehot(target) − softmax(logits))` row by row, by [`logprobs_of`]'s backward kernel
/// where it runs, else through the composed form's backward.
pub(crate) fn logprobs_of_grad(logits: &Tensor, targets: &Tensor, g: &Tensor) -> CResult<Tensor> {
    if logprobs_kernel_runs(logits, targets) {
        return logits.contiguous()?.apply_op3_no_bwd(
            &targets.contiguous()?,
            &g.contiguous()?,
            &LogprobsOfBwd,
        );
    }
    let x = candle_core::Var::from_tensor(&logits.detach())?;
    let logp = logprobs_of_composed(x.as_tensor(), targets)?;
    let grads = (logp * g.detach())?.sum_all()?.backward()?;
    match grads.get(x.as_tensor()) {
        Some(dx) => Ok(dx.clone()),
        None => Tensor::zeros_like(x.as_tensor()),
    }
}

/// [`logprobs_of`] from differentiable candle ops: log-softmax, then gather.
pub fn logprobs_of_composed(logits: &Tensor, targets: &Tensor) -> CResult<Tensor> {
    let logp = log_softmax_last_dim(logits)?;
    logp.gather(&targets.contiguous()?.unsqueeze(D::Minus1)?, D::Minus1)?.squeeze(D::Minus1)
}

// ---------------------------------------------------------------------------------------------
// entropy

struct Entropy;

simd_kernel! {
    /// `out[r] = log Σ e^x − Σ softmax(x)·x` of each row, as `ln s − Σ e^(x−m)(x−m) / s`.
    fn entropy_rows<T: Elem>(out: &mut [T], x: &[T], n: usize) {
        for (o, x) in out.iter_mut().zip(x.chunks(n)) {
            let m = simd::max(x);
            let (s, sx) = sum_exp(x, m, true);
            *o = s.ln() - sx / s;
        }
    }
}

fn entropy_fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s, l, "entropy")?;
    let n = last_dim(l);
    let dims = l.dims();
    let out_shape: Shape = dims[..dims.len().saturating_sub(1)].to_vec().into();
    let mut out = vec![T::zero(); x.len() / n.max(1)];
    let rows = super::rows_per_task(n);
    out.par_chunks_mut(rows).enumerate().for_each(|(c, o)| {
        let r0 = c * rows;
        entropy_rows(o, &x[r0 * n..(r0 + o.len()) * n], n);
    });
    storage(out, &out_shape)
}

impl CustomOp1 for Entropy {
    fn name(&self) -> &'static str {
        "rltune-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, "entropy", entropy_fwd(s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::entropy_fwd(s, l)
    }

    /// dH/dx = p ⊙ (Σ p·x − x) · g (composed: entropy is a statistic, rarely differentiated).
    fn bwd(&self, x: &Tensor, _h: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        let x = x.detach();
        let p = softmax_last_dim(&x)?;
        let mean = (&p * &x)?.sum_keepdim(D::Minus1)?;
        let d = (p * mean.broadcast_sub(&x)?)?;
        Ok(Some(d.broadcast_mul(&g.unsqueeze(D::Minus1)?)?))
    }
}

/// Entropy of the softmax distribution over the last dimension: `(…, V) -> (…)`.
///
/// TRL `core.py::entropy_from_logits`: `logsumexp(l) − Σ softmax(l)·l`. On the CPU one pass over
/// each row (no `(…, V)` temporaries).
pub fn entropy_from_logits(logits: &Tensor) -> CResult<Tensor> {
    let ok_dtype = matches!(logits.dtype(), DType::F32 | DType::F64);
    if ((super::cpu_kernels(logits.device()) && ok_dtype) || super::cuda_f32(&[logits])) && logits.rank() > 0
    {
        logits.contiguous()?.apply_op1(Entropy)
    } else {
        entropy_from_logits_composed(logits)
    }
}

/// [`entropy_from_logits`] from differentiable candle ops.
pub fn entropy_from_logits_composed(logits: &Tensor) -> CResult<Tensor> {
    let logp = log_softmax_last_dim(logits)?;
    let p = logp.exp()?;
    (p * logp)?.sum(D::Minus1)?.neg()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check, fd_check, max_diff, randn};
    use candle_core::Device;

    #[test]
    fn softmax_matches_composed() {
        check(&[&[3, 4, 7]], |t| softmax_last_dim(&t[0]).unwrap(), |t| softmax_composed(&t[0]).unwrap());
        // Rows longer than the vector lanes, with a remainder.
        check(&[&[3, 37]], |t| softmax_last_dim(&t[0]).unwrap(), |t| softmax_composed(&t[0]).unwrap());
        fd_check(&[&[2, 5]], |t| softmax_last_dim(&t[0]).unwrap());
    }

    #[test]
    fn log_softmax_matches_composed() {
        check(
            &[&[5, 11]],
            |t| log_softmax_last_dim(&t[0]).unwrap(),
            |t| log_softmax_composed(&t[0]).unwrap(),
        );
        check(
            &[&[2, 40]],
            |t| log_softmax_last_dim(&t[0]).unwrap(),
            |t| log_softmax_composed(&t[0]).unwrap(),
        );
        fd_check(&[&[2, 5]], |t| log_softmax_last_dim(&t[0]).unwrap());
    }

    fn bias(shape: &[usize], seed: u64) -> Tensor {
        // Some keys masked with the models' additive mask value.
        let r = randn(shape, seed);
        let masked = r.ge(1.0).unwrap();
        masked.where_cond(&(r.ones_like().unwrap() * -1e9).unwrap(), &r).unwrap()
    }

    /// bf16 scores, f32 bias: the probabilities are the f32 op's rounded once, and the scores'
    /// gradient is the f32 backward from the bf16 probabilities and gradient, rounded once; the
    /// same node in a composed scope (the GPU's code path on the CPU).
    #[test]
    fn scaled_masked_softmax_bf16_is_the_f32_op_rounded_once() {
        use candle_core::Var;
        for composed in [false, true] {
            let _scope = composed.then(crate::composed_scope);
            let (b, h, t) = (2, 3, 7);
            let x = randn(&[b, h, t, t], 1).affine(3.0, 0.0).unwrap().to_dtype(DType::BF16).unwrap();
            let r = randn(&[b, h, t, t], 2).to_dtype(DType::BF16).unwrap();
            let mask = vec![vec![1u8; t], [vec![0u8; 2], vec![1; t - 2]].concat()];
            let bias = crate::causal_bias(&mask, t, DType::F32, &candle_core::Device::Cpu).unwrap();
            let xv = Var::from_tensor(&x).unwrap();
            let y = scaled_masked_softmax(xv.as_tensor(), &bias, 0.3).unwrap();
            assert_eq!(y.dtype(), DType::BF16);
            let want = scaled_masked_softmax(&x.to_dtype(DType::F32).unwrap(), &bias, 0.3).unwrap();
            assert_eq!(max_diff(&y, &want.to_dtype(DType::BF16).unwrap()), 0.0, "composed: {composed}");
            let dx = (&y * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
                .get(xv.as_tensor())
                .unwrap()
                .clone();
            assert_eq!(dx.dtype(), DType::BF16);
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want = f32(&y).apply_op2_no_bwd(&f32(&r), &SoftmaxBwd { scale: 0.3 }).unwrap();
            assert_eq!(max_diff(&dx, &want.to_dtype(DType::BF16).unwrap()), 0.0, "composed: {composed}");
            assert!(max_diff(&dx, &(&dx * 0.0).unwrap()) > 0.0);
        }
    }

    #[test]
    fn scaled_masked_softmax_matches_composed() {
        for bias_shape in [[2, 1, 3, 5], [2, 1, 1, 5], [1, 1, 3, 5], [2, 4, 3, 5]] {
            let b = bias(&bias_shape, 7);
            check(
                &[&[2, 4, 3, 5]],
                |t| scaled_masked_softmax(&t[0], &b, 0.125).unwrap(),
                |t| scaled_masked_softmax_composed(&t[0], &b, 0.125).unwrap(),
            );
        }
        let b = bias(&[1, 1, 2, 3], 3);
        fd_check(&[&[1, 2, 2, 3]], |t| scaled_masked_softmax(&t[0], &b, 0.5).unwrap());
    }

    #[test]
    fn scaled_masked_softmax_f32_long_rows() {
        let x = randn(&[2, 3, 4, 70], 1).to_dtype(DType::F32).unwrap();
        let b = bias(&[2, 1, 4, 70], 2).to_dtype(DType::F32).unwrap();
        let y = scaled_masked_softmax(&x, &b, 0.3).unwrap();
        let want = scaled_masked_softmax_composed(&x, &b, 0.3).unwrap();
        assert!(max_diff(&y, &want) < 1e-6);
    }

    fn targets(shape: &[usize], v: u32) -> Tensor {
        let n: usize = shape.iter().product();
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % v).collect();
        Tensor::from_vec(ids, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn logprobs_of_matches_composed() {
        let t = targets(&[2, 3], 19);
        check(
            &[&[2, 3, 19]],
            |x| logprobs_of(&x[0], &t).unwrap(),
            |x| logprobs_of_composed(&x[0], &t).unwrap(),
        );
        let t = targets(&[2, 2], 5);
        fd_check(&[&[2, 2, 5]], |x| logprobs_of(&x[0], &t).unwrap());
    }

    #[test]
    fn logprobs_of_f32_matches_composed_and_rejects_bad_ids() {
        let x = randn(&[3, 4, 1000], 5).to_dtype(DType::F32).unwrap();
        let t = targets(&[3, 4], 1000);
        let d = max_diff(&logprobs_of(&x, &t).unwrap(), &logprobs_of_composed(&x, &t).unwrap());
        assert!(d < 1e-5, "max diff {d}");
        let bad = Tensor::new(&[[0u32, 1000]], &Device::Cpu).unwrap();
        let x = randn(&[1, 2, 1000], 5).to_dtype(DType::F32).unwrap();
        let err = logprobs_of(&x, &bad).unwrap_err().to_string();
        assert!(err.contains("not below the vocabulary size"), "{err}");
    }

    #[test]
    fn entropy_matches_composed() {
        check(
            &[&[3, 2, 21]],
            |t| entropy_from_logits(&t[0]).unwrap(),
            |t| entropy_from_logits_composed(&t[0]).unwrap(),
        );
        fd_check(&[&[2, 6]], |t| entropy_from_logits(&t[0]).unwrap());
        let x = randn(&[4, 3000], 2).to_dtype(DType::F32).unwrap();
        let d = max_diff(&entropy_from_logits(&x).unwrap(), &entropy_from_logits_composed(&x).unwrap());
        assert!(d < 1e-5, "f32 max diff {d}");
    }

    #[test]
    fn entropy_of_uniform_is_log_v() {
        let x = Tensor::zeros((2, 10), DType::F64, &Device::Cpu).unwrap();
        let h = entropy_from_logits(&x).unwrap().to_vec1::<f64>().unwrap();
        assert!(h.iter().all(|v| (v - 10f64.ln()).abs() < 1e-12));
    }

    #[test]
    fn entropy_ignores_impossible_tokens() {
        // A −∞ logit (a banned token) has probability 0 and adds nothing: no 0·∞ NaN.
        let x = Tensor::new(&[[0f32, 0.0, f32::NEG_INFINITY]], &Device::Cpu).unwrap();
        let h = entropy_from_logits(&x).unwrap().to_vec1::<f32>().unwrap();
        assert!((h[0] - 2f32.ln()).abs() < 1e-6, "{h:?}");
        // Wider than the vector lanes, −∞ inside the vectorized part: 20 equal tokens of 40.
        let row: Vec<f32> = (0..40).map(|i| if i % 2 == 0 { 1.5 } else { f32::NEG_INFINITY }).collect();
        let x = Tensor::from_vec(row, (1, 40), &Device::Cpu).unwrap();
        let h = entropy_from_logits(&x).unwrap().to_vec1::<f32>().unwrap();
        assert!((h[0] - 20f32.ln()).abs() < 1e-5, "{h:?}");
    }

    #[test]
    fn softmax_rows_sum_to_one_on_large_rows() {
        // Many rows so several rayon tasks run.
        let x = randn(&[300, 129], 3).to_dtype(DType::F32).unwrap();
        let y = softmax_last_dim(&x).unwrap();
        let s = y.sum(D::Minus1).unwrap().to_vec1::<f32>().unwrap();
        assert!(s.iter().all(|v| (v - 1.0).abs() < 1e-5));
    }
}
