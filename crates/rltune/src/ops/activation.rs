//! GELU, tanh approximation (`gelu_new`, `gelu_pytorch_tanh`), with a fused backward.
//!
//! `gelu(x) = ½x(1 + tanh u)`, `u = √(2/π)(x + 0.044715x³)`. With `s = σ(2u)` (so
//! `½(1 + tanh u) = s`) this is `x·s`, and `gelu'(x) = s + 2x·s(1 − s)·√(2/π)(1 + 3·0.044715x²)`:
//! one `exp` per element, forward or backward. candle's own backward for `gelu` is a dozen
//! element-wise ops with `powf` and `tanh`, and rounds its constants to 6 digits.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::simd::{self, simd_kernel};
use super::{contiguous, par_rows, CResult, Elem};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const COEF: f64 = 0.044_715;

struct GeluTanh;
struct GeluTanhBwd;

/// `(s, 2u)` for one element: `s = σ(2u) = 1 / (1 + e^(−2u))`.
#[inline(always)]
fn sigmoid_2u<T: Elem>(x: T, k: T, c: T) -> T {
    let two_u = (k + k) * (x + c * x * x * x);
    T::one() / (T::one() + (-two_u).exp_fast())
}

simd_kernel! {
    fn gelu_rows<T: Elem>(out: &mut [T], x: &[T]) {
        let (k, c) = consts::<T>();
        for (o, &x) in out.iter_mut().zip(x) {
            *o = x * sigmoid_2u(x, k, c);
        }
    }
}

simd_kernel! {
    fn gelu_bwd_rows<T: Elem>(out: &mut [T], x: &[T], g: &[T]) {
        let (k, c) = consts::<T>();
        let three_c = c + c + c;
        let two = T::one() + T::one();
        for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
            let s = sigmoid_2u(x, k, c);
            let du = k * (T::one() + three_c * x * x);
            *o = g * (s + two * x * s * (T::one() - s) * du);
        }
    }
}

#[inline(always)]
fn consts<T: Elem>() -> (T, T) {
    (T::from(SQRT_2_OVER_PI).unwrap_or_else(T::one), T::from(COEF).unwrap_or_else(T::zero))
}

/// GELU of `x` into `out` (same length): the hand-written AVX2 body for f32 where the CPU has
/// it, else [`gelu_rows`].
fn gelu_into<T: Elem>(out: &mut [T], x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(o), Some(xf)) = (simd::as_f32_mut(out), simd::as_f32(x)) {
        if simd::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { x86::gelu(o, xf) };
        }
    }
    gelu_rows(out, x)
}

/// GELU's backward `g·gelu'(x)` into `out`, as [`gelu_into`].
fn gelu_bwd_into<T: Elem>(out: &mut [T], x: &[T], g: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(o), Some(xf), Some(gf)) = (simd::as_f32_mut(out), simd::as_f32(x), simd::as_f32(g)) {
        if simd::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { x86::gelu_bwd(o, xf, gf) };
        }
    }
    gelu_bwd_rows(out, x, g)
}

/// GELU and its backward on 8 lanes with FMA: [`gelu_rows`] and [`gelu_bwd_rows`] with
/// [`simd::avx2::exp`] (the same formulas; a tail of fewer than 8 values goes to them).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::simd::avx2::exp;
    use super::{gelu_bwd_rows, gelu_rows, COEF, SQRT_2_OVER_PI};

    /// `(s, x)` per lane: `s = σ(2u) = 1 / (1 + e^(−2u))`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sigmoid_2u(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        // 2u = 2k·(x + c·x³)
        let cx2 = _mm256_mul_ps(_mm256_mul_ps(c(COEF as f32), x), x);
        let two_u = _mm256_mul_ps(c(2.0 * SQRT_2_OVER_PI as f32), _mm256_fmadd_ps(cx2, x, x));
        let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), two_u));
        _mm256_div_ps(c(1.0), _mm256_add_ps(c(1.0), e))
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `out` and `x` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu(out: &mut [f32], x: &[f32]) {
        let n = out.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ both lengths.
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, sigmoid_2u(v)));
        }
        gelu_rows(&mut out[n..], &x[n..]);
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `out`, `x` and `g` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_bwd(out: &mut [f32], x: &[f32], g: &[f32]) {
        let c = _mm256_set1_ps;
        let n = out.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ every length.
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let s = sigmoid_2u(v);
            // gelu'(x) = s + 2x·s(1 − s)·k(1 + 3c·x²)
            let du = _mm256_mul_ps(
                c(SQRT_2_OVER_PI as f32),
                _mm256_fmadd_ps(c(3.0 * COEF as f32), _mm256_mul_ps(v, v), c(1.0)),
            );
            let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(v, v), s), _mm256_sub_ps(c(1.0), s));
            let d = _mm256_fmadd_ps(t, du, s);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(gv, d));
        }
        gelu_bwd_rows(&mut out[n..], &x[n..], &g[n..]);
    }
}

fn gelu_fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s, l, "gelu")?;
    let mut out = super::zeros_par(x.len());
    par_rows(&mut out, 1, &[x], |_, o, r| gelu_into(o, r[0]));
    Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
}

fn gelu_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let x = contiguous::<T>(s1, l1, "gelu-bwd")?;
    let g = contiguous::<T>(s2, l2, "gelu-bwd")?;
    if g.len() != x.len() {
        candle_core::bail!("gelu-bwd: {} gradients for {} inputs", g.len(), x.len());
    }
    let mut out = super::zeros_par(x.len());
    par_rows(&mut out, 1, &[x, g], |_, o, r| gelu_bwd_into(o, r[0], r[1]));
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "rltune-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, "gelu", gelu_fwd(s, l))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(gelu_tanh_bwd(x, g)?))
    }
}

impl CustomOp2 for GeluTanhBwd {
    fn name(&self) -> &'static str {
        "rltune-gelu-tanh-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "gelu-bwd", gelu_bwd(s1, l1, s2, l2))
    }
}

/// GELU with the tanh approximation (transformers' `gelu_new`), differentiable.
pub fn gelu_tanh(x: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        x.contiguous()?.apply_op1(GeluTanh)
    } else {
        x.gelu()
    }
}

/// `g · gelu'(x)` (no graph; CPU, f32 or f64).
pub(crate) fn gelu_tanh_bwd(x: &Tensor, g: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &GeluTanhBwd)
}

/// [`gelu_tanh`] from differentiable candle ops: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, with
/// exact constants (candle's own `gelu` backward rounds them to 6 digits).
pub fn gelu_tanh_composed(x: &Tensor) -> CResult<Tensor> {
    let inner = ((x + (x.sqr()? * x)? * COEF)? * SQRT_2_OVER_PI)?;
    (x * 0.5)? * (inner.tanh()? + 1.0)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{check, check_tol, fd_check, max_diff, randn};

    #[test]
    fn gelu_matches_composed() {
        check(&[&[3, 41]], |t| gelu_tanh(&t[0]).unwrap(), |t| gelu_tanh_composed(&t[0]).unwrap());
        // candle's gelu: same forward, backward with 6-digit constants.
        check_tol(&[&[2, 9]], 1e-5, |t| gelu_tanh(&t[0]).unwrap(), |t| t[0].gelu().unwrap());
        fd_check(&[&[2, 7]], |t| gelu_tanh(&t[0]).unwrap());
    }

    #[test]
    fn gelu_f32_matches_candle_and_tails() {
        // Wide range, including both tails where σ saturates.
        let x = (randn(&[5000], 4) * 6.0).unwrap().to_dtype(DType::F32).unwrap();
        let d = max_diff(&gelu_tanh(&x).unwrap(), &x.gelu().unwrap());
        assert!(d < 1e-5, "max diff {d}");
        let x = Tensor::new(&[-100f32, -20.0, 0.0, 20.0, 100.0], &candle_core::Device::Cpu).unwrap();
        let y = gelu_tanh(&x).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(y[2], 0.0);
        assert!(y[0].abs() < 1e-30 && y[1].abs() < 1e-30, "{y:?}");
        assert_eq!((y[3], y[4]), (20.0, 100.0));
    }
}
