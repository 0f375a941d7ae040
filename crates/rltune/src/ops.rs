//! Differentiable building blocks with hand-written backward passes.
//!
//! candle's own fused kernels (`softmax_last_dim`, `layer_norm`, `rms_norm`) build no backward
//! graph: `backward()` succeeds and the gradients behind them are silently missing. The composed
//! versions are differentiable but slow (softmax backward costs 14× its forward). The ops here are
//! candle custom ops: a fused CPU forward and a fused CPU backward, in f32 and f64. On other
//! devices they fall back to composed, differentiable candle ops, so the same model code runs on
//! CUDA.
//!
//! Every op has a test against its composed twin (values and gradients) and a finite-difference
//! gradient check in f64.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};
use num_traits::Float;
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// The element types the fused ops run on (f32 and f64).
trait Elem: Float + candle_core::WithDType + Send + Sync + std::ops::AddAssign + std::ops::MulAssign {}
impl<T: Float + candle_core::WithDType + Send + Sync + std::ops::AddAssign + std::ops::MulAssign> Elem for T {}

/// Rows per rayon task: small rows are batched so a task does real work.
fn rows_per_task(row_len: usize) -> usize {
    (16384 / row_len.max(1)).max(1)
}

/// The contiguous slice a layout views, or an error naming the op.
fn contiguous<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &'static str,
) -> CResult<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

fn unsupported(op: &'static str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: unsupported dtype {dtype:?} (use f32 or f64)"))
}

/// Tensor contents as a `Vec<T>` in row-major order.
fn to_vec<T: candle_core::WithDType>(t: &Tensor) -> CResult<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

/// Applies `f` to each output row with the matching input rows, in parallel.
fn par_rows<T: Send + Sync + Copy, F>(out: &mut [T], n: usize, inputs: &[&[T]], f: F)
where
    F: Fn(&mut [T], &[&[T]]) + Sync + Send,
{
    let per = rows_per_task(n) * n;
    out.par_chunks_mut(per).enumerate().for_each(|(chunk, o)| {
        let start = chunk * per;
        let ins: Vec<&[T]> = inputs.iter().map(|x| &x[start..start + o.len()]).collect();
        for (r, orow) in o.chunks_mut(n).enumerate() {
            let rows: Vec<&[T]> = ins.iter().map(|x| &x[r * n..(r + 1) * n]).collect();
            f(orow, &rows);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// softmax

struct Softmax;
struct SoftmaxBwd;

fn softmax_row<T: Elem>(out: &mut [T], x: &[T]) {
    let max = x.iter().fold(T::neg_infinity(), |m, &v| Float::max(m, v));
    let mut sum = T::zero();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - max).exp();
        sum += *o;
    }
    let inv = T::one() / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

impl Softmax {
    fn fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous::<T>(s, l, "softmax")?;
        let n = l.dims().last().copied().unwrap_or(1);
        let mut out = vec![T::zero(); x.len()];
        par_rows(&mut out, n, &[x], |o, r| softmax_row(o, r[0]));
        Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
    }
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "rltune-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        match s {
            CpuStorage::F32(_) => Self::fwd::<f32>(s, l),
            CpuStorage::F64(_) => Self::fwd::<f64>(s, l),
            _ => Err(unsupported("softmax", s.dtype())),
        }
    }

    /// dx = y ⊙ (g − Σ g⊙y)
    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxBwd)?))
    }
}

impl SoftmaxBwd {
    fn fwd<T: Elem>(
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let y = contiguous::<T>(s1, l1, "softmax-bwd")?;
        let g = contiguous::<T>(s2, l2, "softmax-bwd")?;
        let n = l1.dims().last().copied().unwrap_or(1);
        let mut out = vec![T::zero(); y.len()];
        par_rows(&mut out, n, &[y, g], |o, r| {
            let (y, g) = (r[0], r[1]);
            let dot = y.iter().zip(g).fold(T::zero(), |a, (&y, &g)| a + y * g);
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = y * (g - dot);
            }
        });
        Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
    }
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
        match s1 {
            CpuStorage::F32(_) => Self::fwd::<f32>(s1, l1, s2, l2),
            CpuStorage::F64(_) => Self::fwd::<f64>(s1, l1, s2, l2),
            _ => Err(unsupported("softmax-bwd", s1.dtype())),
        }
    }
}

/// Softmax over the last dimension, differentiable.
pub fn softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() {
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
// log-softmax

struct LogSoftmax;
struct LogSoftmaxBwd;

fn log_softmax_row<T: Float>(out: &mut [T], x: &[T]) {
    let max = x.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
    let sum = x.iter().fold(T::zero(), |a, &v| a + (v - max).exp());
    let lse = max + Float::ln(sum);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v - lse;
    }
}

impl LogSoftmax {
    fn fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous::<T>(s, l, "log-softmax")?;
        let n = l.dims().last().copied().unwrap_or(1);
        let mut out = vec![T::zero(); x.len()];
        par_rows(&mut out, n, &[x], |o, r| log_softmax_row(o, r[0]));
        Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
    }
}

impl CustomOp1 for LogSoftmax {
    fn name(&self) -> &'static str {
        "rltune-log-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        match s {
            CpuStorage::F32(_) => Self::fwd::<f32>(s, l),
            CpuStorage::F64(_) => Self::fwd::<f64>(s, l),
            _ => Err(unsupported("log-softmax", s.dtype())),
        }
    }

    /// dx = g − exp(y) Σ g
    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &LogSoftmaxBwd)?))
    }
}

impl LogSoftmaxBwd {
    fn fwd<T: Elem>(
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let y = contiguous::<T>(s1, l1, "log-softmax-bwd")?;
        let g = contiguous::<T>(s2, l2, "log-softmax-bwd")?;
        let n = l1.dims().last().copied().unwrap_or(1);
        let mut out = vec![T::zero(); y.len()];
        par_rows(&mut out, n, &[y, g], |o, r| {
            let (y, g) = (r[0], r[1]);
            let sum = g.iter().fold(T::zero(), |a, &g| a + g);
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = g - y.exp() * sum;
            }
        });
        Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
    }
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
        match s1 {
            CpuStorage::F32(_) => Self::fwd::<f32>(s1, l1, s2, l2),
            CpuStorage::F64(_) => Self::fwd::<f64>(s1, l1, s2, l2),
            _ => Err(unsupported("log-softmax-bwd", s1.dtype())),
        }
    }
}

/// Log-softmax over the last dimension, differentiable.
pub fn log_softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() {
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

/// Log-probability of each target under `logits`: `(B, T, V), (B, T) -> (B, T)`.
///
/// TRL `core.py::logprobs_from_logits`: `log_softmax(logits).gather(-1, labels)`.
pub fn logprobs_of(logits: &Tensor, targets: &Tensor) -> CResult<Tensor> {
    let logp = log_softmax_last_dim(logits)?;
    logp.gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?.squeeze(D::Minus1)
}

/// Entropy of the softmax distribution over the last dimension: `(…, V) -> (…)`.
///
/// TRL `core.py::entropy_from_logits`: `logsumexp(l) − Σ softmax(l)·l`.
pub fn entropy_from_logits(logits: &Tensor) -> CResult<Tensor> {
    let logp = log_softmax_last_dim(logits)?;
    let p = logp.exp()?;
    (p * logp)?.sum(D::Minus1)?.neg()
}

// ---------------------------------------------------------------------------------------------
// layer norm

struct LayerNorm {
    eps: f64,
}

/// Mean and 1/sqrt(var + eps) of a row (biased variance, as torch's layer_norm).
fn row_stats<T: Float>(x: &[T], eps: f64) -> (T, T) {
    let n = T::from(x.len()).unwrap_or_else(T::one);
    let mean = x.iter().fold(T::zero(), |a, &v| a + v) / n;
    let var = x.iter().fold(T::zero(), |a, &v| a + (v - mean) * (v - mean)) / n;
    let eps = T::from(eps).unwrap_or_else(T::zero);
    (mean, T::one() / (var + eps).sqrt())
}

impl LayerNorm {
    #[allow(clippy::too_many_arguments)]
    fn fwd<T: Elem>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous::<T>(s1, l1, "layer-norm")?;
        let w = contiguous::<T>(s2, l2, "layer-norm")?;
        let b = contiguous::<T>(s3, l3, "layer-norm")?;
        let n = w.len();
        let mut out = vec![T::zero(); x.len()];
        let eps = self.eps;
        par_rows(&mut out, n, &[x], |o, r| {
            let (mean, rstd) = row_stats(r[0], eps);
            for (((o, &x), &w), &b) in o.iter_mut().zip(r[0]).zip(w).zip(b) {
                *o = (x - mean) * rstd * w + b;
            }
        });
        Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
    }

    /// Returns (dx, dw, db) for rows of x with upstream gradient g.
    fn grads<T: Elem>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let n = w.len();
        let mut dx = vec![T::zero(); x.len()];
        let per = rows_per_task(n) * n;
        let nf = T::from(n).unwrap_or_else(T::one);
        let partial: Vec<(Vec<T>, Vec<T>)> = dx
            .par_chunks_mut(per)
            .enumerate()
            .map(|(c, dxc)| {
                let start = c * per;
                let mut dw = vec![T::zero(); n];
                let mut db = vec![T::zero(); n];
                for (r, dxr) in dxc.chunks_mut(n).enumerate() {
                    let xr = &x[start + r * n..start + (r + 1) * n];
                    let gr = &g[start + r * n..start + (r + 1) * n];
                    let (mean, rstd) = row_stats(xr, self.eps);
                    let (mut s_gw, mut s_gwx) = (T::zero(), T::zero());
                    for i in 0..n {
                        let xhat = (xr[i] - mean) * rstd;
                        let gw = gr[i] * w[i];
                        s_gw += gw;
                        s_gwx += gw * xhat;
                        dw[i] += gr[i] * xhat;
                        db[i] += gr[i];
                    }
                    let (m_gw, m_gwx) = (s_gw / nf, s_gwx / nf);
                    for i in 0..n {
                        let xhat = (xr[i] - mean) * rstd;
                        dxr[i] = rstd * (gr[i] * w[i] - m_gw - xhat * m_gwx);
                    }
                }
                (dw, db)
            })
            .collect();
        let mut dw = vec![T::zero(); n];
        let mut db = vec![T::zero(); n];
        for (pw, pb) in partial {
            for i in 0..n {
                dw[i] += pw[i];
                db[i] += pb[i];
            }
        }
        (dx, dw, db)
    }

    fn bwd_typed<T: Elem>(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> CResult<(Tensor, Tensor, Tensor)> {
        let (dx, dw, db) = self.grads(&to_vec::<T>(x)?, &to_vec::<T>(w)?, &to_vec::<T>(g)?);
        let dev = x.device();
        Ok((
            Tensor::from_vec(dx, x.shape(), dev)?,
            Tensor::from_vec(dw, w.shape(), dev)?,
            Tensor::from_vec(db, w.shape(), dev)?,
        ))
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "rltune-layer-norm"
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
        match s1 {
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2, s3, l3),
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2, s3, l3),
            _ => Err(unsupported("layer-norm", s1.dtype())),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = match x.dtype() {
            DType::F32 => self.bwd_typed::<f32>(x, w, g)?,
            DType::F64 => self.bwd_typed::<f64>(x, w, g)?,
            dt => return Err(unsupported("layer-norm-bwd", dt)),
        };
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// Layer norm over the last dimension with weight and bias (torch's `nn.LayerNorm`), differentiable.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> CResult<Tensor> {
    if x.device().is_cpu() {
        x.contiguous()?.apply_op3(w, b, LayerNorm { eps })
    } else {
        layer_norm_composed(x, w, b, eps)
    }
}

/// Layer norm from differentiable candle ops.
pub fn layer_norm_composed(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> CResult<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xhat.broadcast_mul(w)?.broadcast_add(b)
}

// ---------------------------------------------------------------------------------------------
// RMS norm

struct RmsNorm {
    eps: f64,
}

fn rms_rstd<T: Float>(x: &[T], eps: f64) -> T {
    let n = T::from(x.len()).unwrap_or_else(T::one);
    let ms = x.iter().fold(T::zero(), |a, &v| a + v * v) / n;
    T::one() / (ms + T::from(eps).unwrap_or_else(T::zero)).sqrt()
}

impl RmsNorm {
    fn fwd<T: Elem>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous::<T>(s1, l1, "rms-norm")?;
        let w = contiguous::<T>(s2, l2, "rms-norm")?;
        let n = w.len();
        let mut out = vec![T::zero(); x.len()];
        let eps = self.eps;
        par_rows(&mut out, n, &[x], |o, r| {
            let rstd = rms_rstd(r[0], eps);
            for ((o, &x), &w) in o.iter_mut().zip(r[0]).zip(w) {
                *o = x * rstd * w;
            }
        });
        Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
    }

    fn bwd_typed<T: Elem>(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> CResult<(Tensor, Tensor)> {
        let (xv, wv, gv) = (to_vec::<T>(x)?, to_vec::<T>(w)?, to_vec::<T>(g)?);
        let n = wv.len();
        let nf = T::from(n).unwrap_or_else(T::one);
        let mut dx = vec![T::zero(); xv.len()];
        let per = rows_per_task(n) * n;
        let partial: Vec<Vec<T>> = dx
            .par_chunks_mut(per)
            .enumerate()
            .map(|(c, dxc)| {
                let start = c * per;
                let mut dw = vec![T::zero(); n];
                for (r, dxr) in dxc.chunks_mut(n).enumerate() {
                    let xr = &xv[start + r * n..start + (r + 1) * n];
                    let gr = &gv[start + r * n..start + (r + 1) * n];
                    let rstd = rms_rstd(xr, self.eps);
                    let mut s_gwx = T::zero();
                    for i in 0..n {
                        let xhat = xr[i] * rstd;
                        s_gwx += gr[i] * wv[i] * xhat;
                        dw[i] += gr[i] * xhat;
                    }
                    let m = s_gwx / nf;
                    for i in 0..n {
                        dxr[i] = rstd * (gr[i] * wv[i] - xr[i] * rstd * m);
                    }
                }
                dw
            })
            .collect();
        let mut dw = vec![T::zero(); n];
        for p in partial {
            for i in 0..n {
                dw[i] += p[i];
            }
        }
        let dev = x.device();
        Ok((Tensor::from_vec(dx, x.shape(), dev)?, Tensor::from_vec(dw, w.shape(), dev)?))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rltune-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        match s1 {
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2),
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2),
            _ => Err(unsupported("rms-norm", s1.dtype())),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = match x.dtype() {
            DType::F32 => self.bwd_typed::<f32>(x, w, g)?,
            DType::F64 => self.bwd_typed::<f64>(x, w, g)?,
            dt => return Err(unsupported("rms-norm-bwd", dt)),
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// RMS norm over the last dimension (Llama's `LlamaRMSNorm`), differentiable.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    if x.device().is_cpu() {
        x.contiguous()?.apply_op2(w, RmsNorm { eps })
    } else {
        rms_norm_composed(x, w, eps)
    }
}

/// RMS norm from differentiable candle ops.
pub fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    /// Checks values and gradients of `fused` against `composed` for random inputs, in f64.
    fn check<F, G>(shapes: &[&[usize]], fused: F, composed: G)
    where
        F: Fn(&[Tensor]) -> Tensor,
        G: Fn(&[Tensor]) -> Tensor,
    {
        let vars: Vec<Var> =
            shapes.iter().enumerate().map(|(i, s)| Var::from_tensor(&randn(s, i as u64)).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        // A random projection makes the upstream gradient non-uniform.
        let yf = fused(&ts);
        let yc = composed(&ts);
        let d = max_diff(&yf, &yc);
        assert!(d < 1e-10, "forward max diff {d}");
        let proj = randn(yf.dims(), 99);
        let gf = (yf * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = (yc * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let a = gf.get(v).expect("fused op dropped a gradient");
            let b = gc.get(v).unwrap();
            let d = max_diff(a, b);
            assert!(d < 1e-10, "grad {i} max diff {d}");
        }
    }

    #[test]
    fn softmax_matches_composed() {
        check(&[&[3, 4, 7]], |t| softmax_last_dim(&t[0]).unwrap(), |t| softmax_composed(&t[0]).unwrap());
    }

    #[test]
    fn log_softmax_matches_composed() {
        check(
            &[&[5, 11]],
            |t| log_softmax_last_dim(&t[0]).unwrap(),
            |t| log_softmax_composed(&t[0]).unwrap(),
        );
    }

    #[test]
    fn layer_norm_matches_composed() {
        check(
            &[&[2, 3, 8], &[8], &[8]],
            |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
            |t| layer_norm_composed(&t[0], &t[1], &t[2], 1e-5).unwrap(),
        );
    }

    #[test]
    fn rms_norm_matches_composed() {
        check(
            &[&[4, 6], &[6]],
            |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(),
            |t| rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
        );
    }

    #[test]
    fn softmax_rows_sum_to_one_on_large_rows() {
        // Many rows so several rayon tasks run.
        let x = randn(&[300, 129], 3).to_dtype(DType::F32).unwrap();
        let y = softmax_last_dim(&x).unwrap();
        let s = y.sum(D::Minus1).unwrap().to_vec1::<f32>().unwrap();
        assert!(s.iter().all(|v| (v - 1.0).abs() < 1e-5));
    }

    #[test]
    fn entropy_of_uniform_is_log_v() {
        let x = Tensor::zeros((2, 10), DType::F64, &Device::Cpu).unwrap();
        let h = entropy_from_logits(&x).unwrap().to_vec1::<f64>().unwrap();
        assert!(h.iter().all(|v| (v - 10f64.ln()).abs() < 1e-12));
    }
}
