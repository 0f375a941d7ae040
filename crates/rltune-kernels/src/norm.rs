//! Layer norm and RMS norm over the last dimension, with fused backward passes.
//!
//! The backward ops return one `(R + k, C)` tensor: the rows of `dx`, then the parameter
//! gradients (`dw`, and `db` for layer norm), which the caller slices without copying.
//!
//! On CUDA (f32) the same ops run the twins in `src/cuda/norms.cu` ([`crate::cuda`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use super::grad_sink::{GradSlot, Sinks};
use super::simd::{self, simd_kernel, LANES};
use super::{contiguous, last_dim, par_rows, rows_per_task, CResult, Elem};

/// Σ (x − c)², vectorized.
#[inline(always)]
fn sum_sq_dev<T: Elem>(x: &[T], c: T) -> T {
    let mut acc = [T::zero(); LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for ch in chunks {
        for l in 0..LANES {
            let d = ch[l] - c;
            acc[l] += d * d;
        }
    }
    let mut s = simd::sum(&acc);
    for &v in rest {
        s += (v - c) * (v - c);
    }
    s
}

/// Mean and 1/sqrt(var + eps) of a row (biased variance, as torch's layer_norm).
#[inline(always)]
fn row_stats<T: Elem>(x: &[T], eps: T) -> (T, T) {
    let n = T::from(x.len()).unwrap_or_else(T::one);
    let mean = simd::sum(x) / n;
    let var = sum_sq_dev(x, mean) / n;
    (mean, T::one() / (var + eps).sqrt())
}

/// 1/sqrt(mean(x²) + eps) of a row.
#[inline(always)]
fn rms_rstd<T: Elem>(x: &[T], eps: T) -> T {
    let n = T::from(x.len()).unwrap_or_else(T::one);
    T::one() / (sum_sq_dev(x, T::zero()) / n + eps).sqrt()
}

/// Sums the per-task partial parameter gradients (`k` rows of `n` each) into `out`.
fn reduce_partials<T: Elem>(out: &mut [T], partials: Vec<Vec<T>>) {
    for p in partials {
        for (o, v) in out.iter_mut().zip(p) {
            *o += v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// layer norm

struct LayerNorm {
    eps: f64,
    /// Where the backward writes the weight's and bias's gradients.
    sinks: Sinks,
}

struct LayerNormBwd {
    eps: f64,
}

simd_kernel! {
    fn layer_norm_rows<T: Elem>(out: &mut [T], x: &[T], w: &[T], b: &[T], eps: T) {
        let n = w.len();
        for (o, x) in out.chunks_mut(n).zip(x.chunks(n)) {
            let (mean, rstd) = row_stats(x, eps);
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                *o = (x - mean) * rstd * w + b;
            }
        }
    }
}

simd_kernel! {
    /// dx rows into `dx`; dw, db accumulated into `dwdb` (`[dw; db]`).
    fn layer_norm_bwd_rows<T: Elem>(dx: &mut [T], dwdb: &mut [T], x: &[T], w: &[T], g: &[T], eps: T) {
        let n = w.len();
        let nf = T::from(n).unwrap_or_else(T::one);
        let (dw, db) = dwdb.split_at_mut(n);
        for ((dxr, xr), gr) in dx.chunks_mut(n).zip(x.chunks(n)).zip(g.chunks(n)) {
            let (mean, rstd) = row_stats(xr, eps);
            let mut s_gw = [T::zero(); LANES];
            let mut s_gwx = [T::zero(); LANES];
            // xhat goes into dxr first, then dxr is overwritten with dx. Whole vectors first
            // (indexed by `i % LANES` in one loop, the compiler kept it scalar: 1.7% of a `small`
            // PPO step), then the tail; each lane sums in the same order either way.
            let full = n / LANES * LANES;
            let whole = dxr[..full]
                .chunks_exact_mut(LANES)
                .zip(xr.chunks_exact(LANES))
                .zip(gr.chunks_exact(LANES))
                .zip(w.chunks_exact(LANES))
                .zip(dw.chunks_exact_mut(LANES).zip(db.chunks_exact_mut(LANES)));
            for ((((d, x), g), w), (dw, db)) in whole {
                for l in 0..LANES {
                    let xhat = (x[l] - mean) * rstd;
                    d[l] = xhat;
                    let gw = g[l] * w[l];
                    s_gw[l] += gw;
                    s_gwx[l] += gw * xhat;
                    dw[l] += g[l] * xhat;
                    db[l] += g[l];
                }
            }
            for i in full..n {
                let xhat = (xr[i] - mean) * rstd;
                dxr[i] = xhat;
                let gw = gr[i] * w[i];
                s_gw[i % LANES] += gw;
                s_gwx[i % LANES] += gw * xhat;
                dw[i] += gr[i] * xhat;
                db[i] += gr[i];
            }
            let (m_gw, m_gwx) = (simd::sum(&s_gw) / nf, simd::sum(&s_gwx) / nf);
            for ((d, &g), &w) in dxr.iter_mut().zip(gr).zip(w) {
                *d = rstd * (g * w - m_gw - *d * m_gwx);
            }
        }
    }
}

fn layer_norm_fwd<T: Elem>(
    eps: f64,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    (s3, l3): (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "layer-norm")?;
    let w = contiguous::<T>(s2, l2, "layer-norm")?;
    let b = contiguous::<T>(s3, l3, "layer-norm")?;
    check_param("layer-norm", l1, w.len())?;
    let eps = T::from(eps).unwrap_or_else(T::zero);
    let mut out = super::zeros_par(x.len());
    par_rows(&mut out, w.len(), &[x], |_, o, r| layer_norm_rows(o, r[0], w, b, eps));
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

fn check_param(op: &'static str, l: &Layout, n: usize) -> CResult<()> {
    if last_dim(l) != n || n == 0 {
        candle_core::bail!("{op}: parameter length {n} differs from the last dimension {}", last_dim(l));
    }
    Ok(())
}

/// `(R + k, n)` output: `dx` rows, then `k` parameter-gradient rows summed over tasks.
fn norm_bwd<T: Elem, F>(x: &[T], n: usize, k: usize, f: F) -> Vec<T>
where
    F: Fn(&mut [T], &mut [T], usize) + Sync + Send,
{
    let rows = x.len() / n;
    let mut out = super::zeros_par((rows + k) * n);
    let (dx, params) = out.split_at_mut(rows * n);
    let per = rows_per_task(n) * n;
    let partials: Vec<Vec<T>> = dx
        .par_chunks_mut(per)
        .enumerate()
        .map(|(c, dxc)| {
            let mut p = vec![T::zero(); k * n];
            f(dxc, &mut p, c * per);
            p
        })
        .collect();
    reduce_partials(params, partials);
    out
}

fn layer_norm_bwd<T: Elem>(
    eps: f64,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    (s3, l3): (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "layer-norm-bwd")?;
    let w = contiguous::<T>(s2, l2, "layer-norm-bwd")?;
    let g = contiguous::<T>(s3, l3, "layer-norm-bwd")?;
    let n = w.len();
    check_param("layer-norm-bwd", l1, n)?;
    let eps = T::from(eps).unwrap_or_else(T::zero);
    let out = norm_bwd(x, n, 2, |dx, dwdb, start| {
        let (xs, gs) = (&x[start..start + dx.len()], &g[start..start + dx.len()]);
        layer_norm_bwd_rows(dx, dwdb, xs, w, gs, eps)
    });
    let rows = x.len() / n + 2;
    Ok((T::to_cpu_storage_owned(out), (rows, n).into()))
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
        by_dtype!(s1, "layer-norm", layer_norm_fwd(self.eps, (s1, l1), (s2, l2), (s3, l3)))
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
        crate::cuda::norm_fwd(self.eps, (s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = layer_norm_bwd_parts(x, w, g, self.eps)?;
        Ok((Some(dx), self.sinks.give(w, dw)?, self.sinks.give(b, db)?))
    }
}

impl CustomOp3 for LayerNormBwd {
    fn name(&self) -> &'static str {
        "rltune-layer-norm-bwd"
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
        by_dtype!(s1, "layer-norm-bwd", layer_norm_bwd(self.eps, (s1, l1), (s2, l2), (s3, l3)))
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
        crate::cuda::norm_bwd(self.eps, 2, (s1, l1), (s2, l2), (s3, l3))
    }
}

/// Layer norm's `(dx, dw, db)` for upstream gradient `g` (no graph; CPU, f32 or f64).
pub(crate) fn layer_norm_bwd_parts(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f64,
) -> CResult<(Tensor, Tensor, Tensor)> {
    let all = x.contiguous()?.apply_op3_no_bwd(&w.contiguous()?, &g.contiguous()?, &LayerNormBwd { eps })?;
    let rows = all.dim(0)? - 2;
    let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
    let dw = all.narrow(0, rows, 1)?.reshape(w.shape())?;
    let db = all.narrow(0, rows + 1, 1)?.reshape(w.shape())?;
    Ok((dx, dw, db))
}

/// Layer norm over the last dimension with weight and bias (torch's `nn.LayerNorm`), differentiable.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> CResult<Tensor> {
    layer_norm_with(x, w, b, eps, &GradSlot::new())
}

/// [`layer_norm`], whose backward writes the gradients of `w` and `b` into the buffers `grads`
/// points at when its forward runs (see [`GradSlot`]).
pub fn layer_norm_with(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64, grads: &GradSlot) -> CResult<Tensor> {
    if super::cpu_kernels(x.device()) || super::cuda_f32(&[x, w, b]) {
        let op = LayerNorm { eps, sinks: grads.sinks() };
        x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, op)
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
    /// Where the backward writes the weight's gradient.
    sinks: Sinks,
}

struct RmsNormBwd {
    eps: f64,
}

simd_kernel! {
    fn rms_norm_rows<T: Elem>(out: &mut [T], x: &[T], w: &[T], eps: T) {
        let n = w.len();
        for (o, x) in out.chunks_mut(n).zip(x.chunks(n)) {
            let rstd = rms_rstd(x, eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = x * rstd * w;
            }
        }
    }
}

simd_kernel! {
    /// dx rows into `dx`; dw accumulated into `dw`.
    fn rms_norm_bwd_rows<T: Elem>(dx: &mut [T], dw: &mut [T], x: &[T], w: &[T], g: &[T], eps: T) {
        let n = w.len();
        let nf = T::from(n).unwrap_or_else(T::one);
        for ((dxr, xr), gr) in dx.chunks_mut(n).zip(x.chunks(n)).zip(g.chunks(n)) {
            let rstd = rms_rstd(xr, eps);
            let mut s_gwx = [T::zero(); LANES];
            // Whole vectors, then the tail (as in `layer_norm_bwd_rows`).
            let full = n / LANES * LANES;
            let whole = xr[..full]
                .chunks_exact(LANES)
                .zip(gr.chunks_exact(LANES))
                .zip(w.chunks_exact(LANES))
                .zip(dw.chunks_exact_mut(LANES));
            for (((x, g), w), dw) in whole {
                for l in 0..LANES {
                    let xhat = x[l] * rstd;
                    s_gwx[l] += g[l] * w[l] * xhat;
                    dw[l] += g[l] * xhat;
                }
            }
            for i in full..n {
                let xhat = xr[i] * rstd;
                s_gwx[i % LANES] += gr[i] * w[i] * xhat;
                dw[i] += gr[i] * xhat;
            }
            let m = simd::sum(&s_gwx) / nf;
            for (((d, &x), &g), &w) in dxr.iter_mut().zip(xr).zip(gr).zip(w) {
                *d = rstd * (g * w - x * rstd * m);
            }
        }
    }
}

fn rms_norm_fwd<T: Elem>(
    eps: f64,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "rms-norm")?;
    let w = contiguous::<T>(s2, l2, "rms-norm")?;
    check_param("rms-norm", l1, w.len())?;
    let eps = T::from(eps).unwrap_or_else(T::zero);
    let mut out = super::zeros_par(x.len());
    par_rows(&mut out, w.len(), &[x], |_, o, r| rms_norm_rows(o, r[0], w, eps));
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

fn rms_norm_bwd<T: Elem>(
    eps: f64,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    (s3, l3): (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "rms-norm-bwd")?;
    let w = contiguous::<T>(s2, l2, "rms-norm-bwd")?;
    let g = contiguous::<T>(s3, l3, "rms-norm-bwd")?;
    let n = w.len();
    check_param("rms-norm-bwd", l1, n)?;
    let eps = T::from(eps).unwrap_or_else(T::zero);
    let out = norm_bwd(x, n, 1, |dx, dw, start| {
        let (xs, gs) = (&x[start..start + dx.len()], &g[start..start + dx.len()]);
        rms_norm_bwd_rows(dx, dw, xs, w, gs, eps)
    });
    let rows = x.len() / n + 1;
    Ok((T::to_cpu_storage_owned(out), (rows, n).into()))
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
        by_dtype!(s1, "rms-norm", rms_norm_fwd(self.eps, (s1, l1), (s2, l2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::norm_fwd(self.eps, (s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let all = x.apply_op3_no_bwd(&w.contiguous()?, &g.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let rows = all.dim(0)? - 1;
        let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = all.narrow(0, rows, 1)?.reshape(w.shape())?;
        Ok((Some(dx), self.sinks.give(w, dw)?))
    }
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rltune-rms-norm-bwd"
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
        by_dtype!(s1, "rms-norm-bwd", rms_norm_bwd(self.eps, (s1, l1), (s2, l2), (s3, l3)))
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
        crate::cuda::norm_bwd(self.eps, 1, (s1, l1), (s2, l2), (s3, l3))
    }
}

/// RMS norm over the last dimension (Llama's `LlamaRMSNorm`), differentiable.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    rms_norm_with(x, w, eps, &GradSlot::new())
}

/// [`rms_norm`], whose backward writes the gradient of `w` into the buffers `grads` points at
/// when its forward runs (see [`GradSlot`]).
pub fn rms_norm_with(x: &Tensor, w: &Tensor, eps: f64, grads: &GradSlot) -> CResult<Tensor> {
    if super::cpu_kernels(x.device()) || super::cuda_f32(&[x, w]) {
        x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps, sinks: grads.sinks() })
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
    use crate::testutil::{check, fd_check, max_diff, randn};
    use candle_core::DType;

    #[test]
    fn layer_norm_matches_composed() {
        check(
            &[&[2, 3, 8], &[8], &[8]],
            |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
            |t| layer_norm_composed(&t[0], &t[1], &t[2], 1e-5).unwrap(),
        );
        // Rows longer than the vector lanes, many rows (several rayon tasks).
        check(
            &[&[70, 37], &[37], &[37]],
            |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
            |t| layer_norm_composed(&t[0], &t[1], &t[2], 1e-5).unwrap(),
        );
        fd_check(&[&[3, 4], &[4], &[4]], |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap());
    }

    #[test]
    fn rms_norm_matches_composed() {
        check(
            &[&[4, 6], &[6]],
            |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(),
            |t| rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
        );
        check(
            &[&[50, 33], &[33]],
            |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(),
            |t| rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
        );
        fd_check(&[&[3, 4], &[4]], |t| rms_norm(&t[0], &t[1], 1e-6).unwrap());
    }

    #[test]
    fn layer_norm_f32_matches_composed() {
        let x = randn(&[600, 64], 1).to_dtype(DType::F32).unwrap();
        let w = randn(&[64], 2).to_dtype(DType::F32).unwrap();
        let b = randn(&[64], 3).to_dtype(DType::F32).unwrap();
        let d =
            max_diff(&layer_norm(&x, &w, &b, 1e-5).unwrap(), &layer_norm_composed(&x, &w, &b, 1e-5).unwrap());
        assert!(d < 1e-5, "max diff {d}");
    }
}
