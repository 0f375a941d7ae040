//! GELU, tanh approximation (`gelu_new`, `gelu_pytorch_tanh`), with a fused backward.
//!
//! `gelu(x) = ½x(1 + tanh u)`, `u = √(2/π)(x + 0.044715x³)`. With `s = σ(2u)` (so
//! `½(1 + tanh u) = s`) this is `x·s`, and `gelu'(x) = s + 2x·s(1 − s)·√(2/π)(1 + 3·0.044715x²)`:
//! one `exp` per element, forward or backward. candle's own backward for `gelu` is a dozen
//! element-wise ops with `powf` and `tanh`, and rounds its constants to 6 digits.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::gemm::{self, MatRef, SendPtr};
use super::simd::{self, simd_kernel};
use super::{contiguous, f32_cpu, par_rows, with_f32, CResult, Elem};

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

/// `gelu'(x)` from `s = σ(2u)`: `s + 2x·s(1 − s)·k(1 + 3c·x²)`.
#[inline(always)]
fn derivative<T: Elem>(x: T, s: T, k: T, c: T) -> T {
    let three_c = c + c + c;
    let two = T::one() + T::one();
    let du = k * (T::one() + three_c * x * x);
    s + two * x * s * (T::one() - s) * du
}

simd_kernel! {
    fn gelu_bwd_rows<T: Elem>(out: &mut [T], x: &[T], g: &[T]) {
        let (k, c) = consts::<T>();
        for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
            *o = g * derivative(x, sigmoid_2u(x, k, c), k, c);
        }
    }
}

simd_kernel! {
    /// GELU of `x` into `out` and `gelu'(x)` over `x`: one `exp` for both.
    fn gelu_and_derivative_rows<T: Elem>(out: &mut [T], x: &mut [T]) {
        let (k, c) = consts::<T>();
        for (o, x) in out.iter_mut().zip(x) {
            let s = sigmoid_2u(*x, k, c);
            *o = *x * s;
            *x = derivative(*x, s, k, c);
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
            let n = o.len().min(xf.len());
            // SAFETY: the CPU has AVX2 and FMA; both slices have at least `n` values.
            return unsafe { x86::gelu(o.as_mut_ptr(), xf.as_ptr(), n) };
        }
    }
    gelu_rows(out, x)
}

/// GELU's backward `g·gelu'(x)` into `out`, as [`gelu_into`].
fn gelu_bwd_into<T: Elem>(out: &mut [T], x: &[T], g: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(o), Some(xf), Some(gf)) = (simd::as_f32_mut(out), simd::as_f32(x), simd::as_f32(g)) {
        if simd::avx2::available() {
            let n = o.len().min(xf.len()).min(gf.len());
            // SAFETY: the CPU has AVX2 and FMA; the slices have at least `n` values.
            return unsafe { x86::gelu_bwd(o.as_mut_ptr(), xf.as_ptr(), gf.as_ptr(), n) };
        }
    }
    gelu_bwd_rows(out, x, g)
}

/// GELU and its backward on 8 lanes with FMA: [`gelu_rows`] and [`gelu_bwd_rows`] with
/// [`simd::avx2::exp`] (the same formulas; a tail of fewer than 8 values goes to them).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::simd::{self, avx2::exp_clamped, avx512};
    use super::{gelu_and_derivative_rows, gelu_bwd_rows, gelu_rows, COEF, SQRT_2_OVER_PI};

    /// `σ(2u) = 1 / (1 + e^(−2u))` per lane, `−2u = −2k·(x + c·x³)`. The exponent is clamped
    /// to ±80 ([`exp_clamped`]); where `−2u ≥ 80` (x below about −8.7) σ is set to 0, what the
    /// unclamped `1 / (1 + e^(−2u))` gives in f32 from x ≈ −10 on (torch's and the scalar
    /// [`gelu_rows`]' value there: GELU −0, −∞ times 0 = NaN at −∞), instead of the clamped
    /// `e^−80`. Above, the clamp changes nothing: σ is within 2·10⁻³⁵ of 1 where it applies.
    /// NaN stays NaN (an unordered compare keeps it).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sigmoid_2u(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let cx2 = _mm256_mul_ps(_mm256_mul_ps(c(COEF as f32), x), x);
        let m2u = _mm256_mul_ps(c(-2.0 * SQRT_2_OVER_PI as f32), _mm256_fmadd_ps(cx2, x, x));
        let s = _mm256_div_ps(c(1.0), _mm256_add_ps(c(1.0), exp_clamped(m2u)));
        _mm256_and_ps(s, _mm256_cmp_ps::<_CMP_NGE_UQ>(m2u, c(80.0)))
    }

    /// `gelu'(x) = s + 2x·s(1 − s)·k(1 + 3c·x²)` per lane, from `s = σ(2u)`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn derivative(x: __m256, s: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let du = _mm256_mul_ps(
            c(SQRT_2_OVER_PI as f32),
            _mm256_fmadd_ps(c(3.0 * COEF as f32), _mm256_mul_ps(x, x), c(1.0)),
        );
        let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(x, x), s), _mm256_sub_ps(c(1.0), s));
        _mm256_fmadd_ps(t, du, s)
    }

    /// [`sigmoid_2u`] on 16 lanes (the same operations, so the same bits).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sigmoid_2u_16(x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let cx2 = _mm512_mul_ps(_mm512_mul_ps(c(COEF as f32), x), x);
        let m2u = _mm512_mul_ps(c(-2.0 * SQRT_2_OVER_PI as f32), _mm512_fmadd_ps(cx2, x, x));
        let s = _mm512_div_ps(c(1.0), _mm512_add_ps(c(1.0), avx512::exp_clamped(m2u)));
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NGE_UQ>(m2u, c(80.0)), s)
    }

    /// [`derivative`] on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn derivative_16(x: __m512, s: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let du = _mm512_mul_ps(
            c(SQRT_2_OVER_PI as f32),
            _mm512_fmadd_ps(c(3.0 * COEF as f32), _mm512_mul_ps(x, x), c(1.0)),
        );
        let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(x, x), s), _mm512_sub_ps(c(1.0), s));
        _mm512_fmadd_ps(t, du, s)
    }

    /// The bodies below on 16 lanes where the CPU has AVX-512 (the same bits as on 8, in
    /// about two thirds of the time): over the first `len / 16 · 16` values, whose count they
    /// return; the 8-lane body does the rest.
    ///
    /// # Safety
    /// The CPU has AVX-512F; the pointers as for the 8-lane bodies.
    #[target_feature(enable = "avx512f")]
    unsafe fn gelu_and_derivative_16(out: *mut f32, x: *mut f32, len: usize) -> usize {
        let n = len / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ len.
            let v = _mm512_loadu_ps(x.add(i));
            let s = sigmoid_2u_16(v);
            _mm512_storeu_ps(out.add(i), _mm512_mul_ps(v, s));
            _mm512_storeu_ps(x.add(i), derivative_16(v, s));
        }
        n
    }

    /// See [`gelu_and_derivative_16`].
    ///
    /// # Safety
    /// As [`gelu_and_derivative_16`].
    #[target_feature(enable = "avx512f")]
    unsafe fn gelu_16(out: *mut f32, x: *const f32, len: usize) -> usize {
        let n = len / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ len.
            let v = _mm512_loadu_ps(x.add(i));
            _mm512_storeu_ps(out.add(i), _mm512_mul_ps(v, sigmoid_2u_16(v)));
        }
        n
    }

    /// See [`gelu_and_derivative_16`].
    ///
    /// # Safety
    /// As [`gelu_and_derivative_16`].
    #[target_feature(enable = "avx512f")]
    unsafe fn gelu_bwd_16(out: *mut f32, x: *const f32, g: *const f32, len: usize) -> usize {
        let n = len / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ len.
            let v = _mm512_loadu_ps(x.add(i));
            let gv = _mm512_loadu_ps(g.add(i));
            _mm512_storeu_ps(out.add(i), _mm512_mul_ps(gv, derivative_16(v, sigmoid_2u_16(v))));
        }
        n
    }

    /// GELU of `len` values at `x` into `out`, and `gelu'(x)` over `x` in place.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` and `x` are valid for `len` values and do not overlap.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_and_derivative(out: *mut f32, x: *mut f32, len: usize) {
        let done = if simd::has_avx512() { gelu_and_derivative_16(out, x, len) } else { 0 };
        let (out, x, len) = (out.add(done), x.add(done), len - done);
        let n = len / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ len.
            let v = _mm256_loadu_ps(x.add(i));
            let s = sigmoid_2u(v);
            _mm256_storeu_ps(out.add(i), _mm256_mul_ps(v, s));
            _mm256_storeu_ps(x.add(i), derivative(v, s));
        }
        let (mut xs, mut os) = ([0f32; 8], [0f32; 8]);
        let r = len - n;
        std::ptr::copy_nonoverlapping(x.add(n), xs.as_mut_ptr(), r);
        gelu_and_derivative_rows(&mut os[..r], &mut xs[..r]);
        std::ptr::copy_nonoverlapping(os.as_ptr(), out.add(n), r);
        std::ptr::copy_nonoverlapping(xs.as_ptr(), x.add(n), r);
    }

    /// GELU of `len` values at `x` into `out`, which may be `x` itself (each vector is loaded
    /// before it is stored).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` and `x` are valid for `len` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu(out: *mut f32, x: *const f32, len: usize) {
        let done = if simd::has_avx512() { gelu_16(out, x, len) } else { 0 };
        let (out, x, len) = (out.add(done), x.add(done), len - done);
        let n = len / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ len.
            let v = _mm256_loadu_ps(x.add(i));
            _mm256_storeu_ps(out.add(i), _mm256_mul_ps(v, sigmoid_2u(v)));
        }
        let (mut xs, mut os) = ([0f32; 8], [0f32; 8]);
        let r = len - n;
        std::ptr::copy_nonoverlapping(x.add(n), xs.as_mut_ptr(), r);
        gelu_rows(&mut os[..r], &xs[..r]);
        std::ptr::copy_nonoverlapping(os.as_ptr(), out.add(n), r);
    }

    /// `g·gelu'(x)` of `len` values into `out`, which may be `g` itself.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out`, `x` and `g` are valid for `len` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_bwd(out: *mut f32, x: *const f32, g: *const f32, len: usize) {
        let done = if simd::has_avx512() { gelu_bwd_16(out, x, g, len) } else { 0 };
        let (out, x, g, len) = (out.add(done), x.add(done), g.add(done), len - done);
        let n = len / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ len.
            let v = _mm256_loadu_ps(x.add(i));
            let gv = _mm256_loadu_ps(g.add(i));
            _mm256_storeu_ps(out.add(i), _mm256_mul_ps(gv, derivative(v, sigmoid_2u(v))));
        }
        let (mut xs, mut gs, mut os) = ([0f32; 8], [0f32; 8], [0f32; 8]);
        let r = len - n;
        std::ptr::copy_nonoverlapping(x.add(n), xs.as_mut_ptr(), r);
        std::ptr::copy_nonoverlapping(g.add(n), gs.as_mut_ptr(), r);
        gelu_bwd_rows(&mut os[..r], &xs[..r], &gs[..r]);
        std::ptr::copy_nonoverlapping(os.as_ptr(), out.add(n), r);
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::gelu_fwd(s, l)
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        crate::cuda::gelu_bwd((s1, l1), (s2, l2))
    }
}

/// GELU with the tanh approximation (transformers' `gelu_new`), differentiable.
pub fn gelu_tanh(x: &Tensor) -> CResult<Tensor> {
    if (super::cpu_kernels(x.device()) && matches!(x.dtype(), DType::F32 | DType::F64))
        || super::cuda_f32(&[x])
    {
        x.contiguous()?.apply_op1(GeluTanh)
    } else {
        x.gelu()
    }
}

/// `g · gelu'(x)` (no graph; CPU, f32 or f64).
pub(crate) fn gelu_tanh_bwd(x: &Tensor, g: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &GeluTanhBwd)
}

/// GELU of `x` written to `out`, which may be uninitialized (no slice is made of it): the AVX2
/// body where the CPU has it, else [`gelu_rows`] through a small buffer (the same values as
/// [`gelu_into`]).
///
/// # Safety
/// `out` is valid for `x.len()` writes and overlaps nothing else in use.
unsafe fn gelu_to(out: *mut f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA; `out` and `x` are valid for `x.len()` values.
        return unsafe { x86::gelu(out, x.as_ptr(), x.len()) };
    }
    for (i, chunk) in x.chunks(64).enumerate() {
        let mut o = [0f32; 64];
        gelu_rows(&mut o[..chunk.len()], chunk);
        // SAFETY: `out` is valid for `x.len()` values (the caller's promise).
        unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), out.add(i * 64), chunk.len()) };
    }
}

/// [`gelu_to`], and `gelu'(x)` over `x` in place (the same values as [`gelu_tanh_bwd`]'s factor:
/// the same operations).
///
/// # Safety
/// `out` is valid for `x.len()` writes and overlaps neither `x` nor anything else in use.
unsafe fn gelu_and_derivative_to(out: *mut f32, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA; `out` and `x` are valid for `x.len()` values and
        // do not overlap (the caller's promise).
        return unsafe { x86::gelu_and_derivative(out, x.as_mut_ptr(), x.len()) };
    }
    for (i, chunk) in x.chunks_mut(64).enumerate() {
        let mut o = [0f32; 64];
        gelu_and_derivative_rows(&mut o[..chunk.len()], chunk);
        // SAFETY: `out` is valid for `x.len()` values (the caller's promise).
        unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), out.add(i * 64), chunk.len()) };
    }
}

/// `(u, gelu(u))` with `u = x·W + b`, for GPT-2's MLP (`W (in, out)`, Conv1D layout), or with
/// `with_derivative` `(gelu'(u), gelu(u))`: what the backward needs ([`gelu_bwd_of_product`]),
/// so it multiplies instead of evaluating GELU's derivative again (its `exp` and division,
/// shared with the forward's GELU here). GELU runs in the product's epilogue, on each block of
/// `u` while the block is in cache, instead of in a second pass that reads all of `u` back;
/// neither output is zero-filled first. The same values as [`super::linear_in_out`] then [`gelu_tanh`] (and
/// [`gelu_tanh_bwd`] of ones), from the same kernels, without a graph. Other dtypes, devices,
/// CPUs without the fast SGEMM and the bf16 matmul precision take those ops (the derivative's
/// is a CPU op: the GPT-2 block that asks for it runs on the CPU only).
pub(crate) fn linear_in_out_gelu(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    with_derivative: bool,
) -> CResult<(Tensor, Tensor)> {
    let fused = f32_products()
        && [x, w, b].iter().all(|t| f32_cpu(t))
        && b.rank() == 1
        && b.dim(0)? == w.dim(1)?
        && x.dim(1)? == w.dim(0)?;
    let fused = fused.then(|| {
        with_f32(&b.contiguous()?, "linear-gelu", |bias| {
            gemm::with_matref(x, |x| gemm::with_matref(w, |w| product_gelu(x, w, bias, with_derivative)))
        })
    });
    match fused.transpose()?.flatten().flatten() {
        Some((u, g)) => {
            let shape = (x.dim(0)?, w.dim(1)?);
            Ok((Tensor::from_vec(u, shape, x.device())?, Tensor::from_vec(g, shape, x.device())?))
        }
        None => {
            let (x, w, b) = (x.detach(), w.detach(), b.detach());
            let u = super::linear_in_out(&x, &w, Some(&b))?;
            let g = gelu_tanh(&u)?;
            match with_derivative {
                true => Ok((gelu_tanh_bwd(&u, &u.ones_like()?)?, g)),
                false => Ok((u, g)),
            }
        }
    }
}

/// Whether products run on the f32 SGEMM, which the epilogues need: with the bf16 matmul
/// precision (AMX) the fused functions take the separate product and GELU instead, so the
/// product keeps its AMX speed.
fn f32_products() -> bool {
    gemm::fast_available() && gemm::matmul_precision() == gemm::MatmulPrecision::F32
}

/// [`linear_in_out_gelu`] on f32 matrices: `(u, g)` or `(gelu'(u), g)`, row-major.
fn product_gelu(x: MatRef, w: MatRef, bias: &[f32], with_derivative: bool) -> (Vec<f32>, Vec<f32>) {
    let (m, n) = (x.rows, w.cols);
    let mut u = Vec::<f32>::with_capacity(m * n);
    let mut g = Vec::<f32>::with_capacity(m * n);
    let gp = SendPtr(g.as_mut_ptr());
    // SAFETY: `u` has capacity for the m × n product, which only this call touches.
    unsafe {
        gemm::sgemm_rows_then(x, w, Some(bias), u.as_mut_ptr(), &|i, j0, row| {
            // SAFETY: the row segments are disjoint and cover the m × n product once, so this
            // one lies in `g`'s capacity and no other segment writes it; `g` and `u` are
            // separate buffers.
            let out = gp.get().add(i * n + j0);
            match with_derivative {
                true => gelu_and_derivative_to(out, row),
                false => gelu_to(out, row),
            }
        })
    };
    // SAFETY: the product wrote all m × n values of `u`, the epilogue all of `g`.
    unsafe {
        u.set_len(m * n);
        g.set_len(m * n);
    }
    (u, g)
}

/// `gelu'(u) ⊙ (dz·Wᵀ)`: the gradient at the MLP's pre-activation `u (N, I)` from the gradient
/// `dz (N, C)` at its output, for `w_t = Wᵀ (C, I)` (a view of the Conv1D weight `W (I, C)`)
/// and `dgelu = gelu'(u)` from [`linear_in_out_gelu`]. The product is scaled in its epilogue,
/// so `dz·Wᵀ` is never stored. The same values as the product then [`gelu_tanh_bwd`]; no graph.
pub(crate) fn gelu_bwd_of_product(dz: &Tensor, w_t: &Tensor, dgelu: &Tensor) -> CResult<Tensor> {
    let shape = (dz.dim(0)?, w_t.dim(1)?);
    let fused = f32_products()
        && [dz, w_t, dgelu].iter().all(|t| f32_cpu(t))
        && dgelu.dims() == [shape.0, shape.1]
        && dz.dim(1)? == w_t.dim(0)?;
    let fused = fused.then(|| {
        with_f32(&dgelu.contiguous()?, "gelu-bwd", |d| {
            gemm::with_matref(dz, |dz| gemm::with_matref(w_t, |w_t| product_scaled(dz, w_t, d)))
        })
    });
    match fused.transpose()?.flatten().flatten() {
        Some(du) => Tensor::from_vec(du, shape, dz.device()),
        None => super::linear::gemm_no_bwd(dz, w_t)? * dgelu,
    }
}

/// `(dz·w_t) ⊙ d` on f32 matrices, `d` row-major.
fn product_scaled(dz: MatRef, w_t: MatRef, d: &[f32]) -> Vec<f32> {
    let (m, n) = (dz.rows, w_t.cols);
    let mut du = Vec::<f32>::with_capacity(m * n);
    // SAFETY: `du` has capacity for the m × n product, which only this call touches.
    unsafe {
        gemm::sgemm_rows_then(dz, w_t, None, du.as_mut_ptr(), &|i, j0, row| {
            row.iter_mut().zip(&d[i * n + j0..]).for_each(|(v, &d)| *v *= d)
        })
    };
    // SAFETY: the product wrote all m × n values.
    unsafe { du.set_len(m * n) };
    du
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
    use crate::testutil::{check, check_tol, fd_check, max_diff, randn};

    #[test]
    fn gelu_matches_composed() {
        check(&[&[3, 41]], |t| gelu_tanh(&t[0]).unwrap(), |t| gelu_tanh_composed(&t[0]).unwrap());
        // candle's gelu: same forward, backward with 6-digit constants.
        check_tol(&[&[2, 9]], 1e-5, |t| gelu_tanh(&t[0]).unwrap(), |t| t[0].gelu().unwrap());
        fd_check(&[&[2, 7]], |t| gelu_tanh(&t[0]).unwrap());
    }

    /// `(m, n)` values in −3..3 (f32), a strided view when `t` (stored `(n, m)`).
    fn mat(m: usize, n: usize, seed: u64, t: bool) -> Tensor {
        let shape: &[usize] = if t { &[n, m] } else { &[m, n] };
        let x = (randn(shape, seed) * 1.5).unwrap().to_dtype(DType::F32).unwrap();
        if t {
            x.t().unwrap()
        } else {
            x
        }
    }

    #[test]
    fn gelu_in_the_products_epilogue_equals_the_product_then_gelu() {
        // 512 × 256 → 1024 is the `small` preset's MLP: blocks of whole vectors, so every value
        // takes the same vector path as the separate pass, and the results are the same bits.
        // Odd widths put some values on the scalar tail in one version and not in the other
        // (the AVX2 sigmoid uses FMA, the scalar one does not): a few roundings apart at most.
        for (m, k, n, exact) in [(512, 256, 1024, true), (37, 29, 45, false), (6, 3, 17, false)] {
            let (x, w, b) =
                (mat(m, k, 1, false), mat(k, n, 2, false), mat(1, n, 3, false).flatten_all().unwrap());
            let (u, g) = linear_in_out_gelu(&x, &w, &b, false).unwrap();
            let u0 = crate::linear_in_out(&x, &w, Some(&b)).unwrap();
            let g0 = gelu_tanh(&u0).unwrap();
            let tol = if exact { 0.0 } else { 1e-6 };
            assert!(max_diff(&u, &u0) == 0.0, "{m}×{k}×{n}: u differs");
            assert!(max_diff(&g, &g0) <= tol, "{m}×{k}×{n}: gelu differs by {}", max_diff(&g, &g0));
            let (dgelu, g1) = linear_in_out_gelu(&x, &w, &b, true).unwrap();
            assert!(max_diff(&g1, &g) == 0.0, "{m}×{k}×{n}: gelu with the derivative differs");
            let dgelu0 = gelu_tanh_bwd(&u0, &u0.ones_like().unwrap()).unwrap();
            let d = max_diff(&dgelu, &dgelu0);
            assert!(d <= tol, "{m}×{k}×{n}: gelu' differs by {d}");

            let dz = mat(m, k, 4, false);
            let w_t = mat(k, n, 5, true); // Wᵀ as a view of a `(n, k)` weight, as in the block.
            let du = gelu_bwd_of_product(&dz, &w_t, &dgelu).unwrap();
            let du0 = gelu_tanh_bwd(&u, &crate::linear::gemm_no_bwd(&dz, &w_t).unwrap()).unwrap();
            let scale = du0.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            let rel = max_diff(&du, &du0) / f64::from(scale);
            assert!(rel <= tol, "{m}×{k}×{n}: du differs by {rel} of its largest value");
        }
        // f64 (no fused SGEMM) takes the two ops.
        let (x, w, b) = (randn(&[5, 4], 6), randn(&[4, 7], 7), randn(&[7], 8));
        let (u, g) = linear_in_out_gelu(&x, &w, &b, false).unwrap();
        assert!(max_diff(&g, &gelu_tanh_composed(&u).unwrap()) < 1e-12);
        let (dgelu, _) = linear_in_out_gelu(&x, &w, &b, true).unwrap();
        let (dz, w_t) = (randn(&[5, 3], 9), randn(&[7, 3], 10).t().unwrap());
        let du = gelu_bwd_of_product(&dz, &w_t, &dgelu).unwrap();
        let du0 = gelu_tanh_bwd(&u, &dz.matmul(&w_t).unwrap()).unwrap();
        assert!(max_diff(&du, &du0) < 1e-12);
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

    /// Where the CPU has AVX-512, the bodies on 16 lanes give the 8-lane bodies' bits (a call on
    /// 8 values runs the 8-lane body only), over a wide range and at the edges.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn gelu_on_16_lanes_has_the_bits_of_8() {
        if !simd::has_avx512() || !simd::avx2::available() {
            return;
        }
        let mut xs: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) * 0.006).collect();
        xs.extend([f32::NAN, f32::NEG_INFINITY, -1e6, -30.0, -8.7, 30.0, 1e6, f32::INFINITY]);
        let gs: Vec<f32> = (0..xs.len()).map(|i| (i as f32 * 0.1).cos()).collect();
        let n = xs.len();
        let run = |piece: usize| {
            let (mut y, mut dy, mut both, mut d) = (vec![0f32; n], vec![0f32; n], vec![0f32; n], xs.clone());
            for i in (0..n).step_by(piece) {
                let len = piece.min(n - i);
                // SAFETY: the CPU has AVX2 and FMA (checked above); every buffer has `n` values.
                unsafe {
                    x86::gelu(y.as_mut_ptr().add(i), xs.as_ptr().add(i), len);
                    x86::gelu_bwd(dy.as_mut_ptr().add(i), xs.as_ptr().add(i), gs.as_ptr().add(i), len);
                    x86::gelu_and_derivative(both.as_mut_ptr().add(i), d.as_mut_ptr().add(i), len);
                }
            }
            [y, dy, both, d]
        };
        let (wide, narrow) = (run(n), run(8));
        let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
        for (w, v) in wide.iter().zip(&narrow) {
            for (i, (&a, &b)) in w.iter().zip(v).enumerate() {
                assert!(same(a, b), "x = {}: {a} on 16 lanes, {b} on 8", xs[i]);
            }
        }
    }

    /// The vector body (8 values at a time) against GELU and its derivative in f64, over a
    /// wide range, and at the edges as torch: NaN stays NaN, −∞ gives NaN (−∞·0), large
    /// negative values (−)0, +∞ gives +∞; the derivative is NaN at ±∞, as in the scalar tail.
    #[test]
    fn gelu_vector_body_matches_f64_and_keeps_the_edges() {
        let xs: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) * 0.006).collect();
        let gelu64 = |x: f64| {
            let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
            0.5 * x * (1.0 + u.tanh())
        };
        let dgelu64 = |x: f64| {
            let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
            let t = u.tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x * x)
        };
        let mut y = vec![0f32; xs.len()];
        gelu_into(&mut y, &xs);
        let mut dy = vec![0f32; xs.len()];
        gelu_bwd_into(&mut dy, &xs, &vec![1f32; xs.len()]);
        for ((&x, &y), &dy) in xs.iter().zip(&y).zip(&dy) {
            let (want, dwant) = (gelu64(x as f64), dgelu64(x as f64));
            assert!((y as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "gelu({x}) = {y}, want {want}");
            assert!(
                (dy as f64 - dwant).abs() <= 1e-6 * (1.0 + dwant.abs()),
                "gelu'({x}) = {dy}, want {dwant}"
            );
        }
        let edges = [f32::NAN, f32::NEG_INFINITY, -1e6, -30.0, 30.0, 1e6, f32::INFINITY, 0.0];
        let mut y = [0f32; 8];
        gelu_into(&mut y, &edges);
        assert!(y[0].is_nan() && y[1].is_nan(), "{y:?}");
        assert!(y[2..4].iter().all(|v| v.abs() < 1e-30), "{y:?}");
        assert_eq!(y[4..], [30.0, 1e6, f32::INFINITY, 0.0]);
        let mut tail = [0f32; 8];
        gelu_rows(&mut tail, &edges);
        let mut dy = [0f32; 8];
        gelu_bwd_into(&mut dy, &edges, &[1.0; 8]);
        let mut dtail = [0f32; 8];
        gelu_bwd_rows(&mut dtail, &edges, &[1.0; 8]);
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for (i, &x) in edges.iter().enumerate() {
            assert!(same(y[i], tail[i]), "gelu({x}): {}, scalar {}", y[i], tail[i]);
            assert!(same(dy[i], dtail[i]), "gelu'({x}): {}, scalar {}", dy[i], dtail[i]);
        }
    }
}
