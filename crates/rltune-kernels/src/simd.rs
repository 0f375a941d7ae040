//! Vectorizable f32 math and the run-time dispatch that compiles kernels for AVX2 and AVX-512.
//!
//! The crate is built for baseline x86-64 (SSE2), and libm's `expf` is a function call, so a
//! loop over `f32::exp` runs one element at a time. [`exp_f32`] is branch-free (selects, no
//! calls), so LLVM vectorizes loops over it; [`simd_kernel!`] compiles a kernel twice more,
//! with AVX2 + FMA and with AVX-512, and picks the widest copy the CPU runs. No FMA
//! contraction happens in any copy (Rust never fuses `a * b + c` on its own) and reductions
//! keep [`LANES`] partial sums whatever the vector width, so all copies give bit-identical
//! results.
//!
//! The hottest f32 loops (GELU, the LM head's and the attention's exponentials) also have a
//! hand-written AVX2 + FMA body ([`avx2`]): the compiled copies above cannot use FMA and reload
//! the polynomial's constants every iteration. Its `e^x` is [`exp_f32`]'s algorithm with fused
//! multiply-adds, so its results differ from the portable copies' in the last bit or two.
//! GELU and the LM head's row pass run those bodies on 16 lanes where the CPU has AVX-512
//! ([`avx512::exp_clamped`]): the same operations lane by lane, so the same bits as on 8.

/// `e^x` in f32, within 2 ulp of the exact value; no function calls, so loops over it vectorize.
///
/// Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (Cody–Waite two-part `ln 2`), a
/// degree-5 minimax polynomial for `(e^r − 1 − r) / r²`, then `2^n` from the exponent bits.
/// Edges as libm: `x > ln(f32::MAX)` gives +∞, `x < ln(f32::MIN_POSITIVE)` gives 0 (libm would
/// return a denormal, which FTZ flushes anyway), NaN gives NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const HI: f32 = 88.722_83;
    const LO: f32 = -87.336_55;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * C1 - n * C2;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * r2 + r + 1.0;
    // n ∈ [−126, 128]; 2^n = 2^(n/2) · 2^(n − n/2) keeps each factor a normal float.
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) << 23) as u32);
    let s2 = f32::from_bits(((n2 + 127) << 23) as u32);
    let y = p * s1 * s2;
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        y
    }
}

/// Defines `fn $name<T: $bound>(args)` from a body that is compiled twice: for the baseline
/// target, with AVX2 + FMA and with AVX-512; the widest copy the CPU supports runs.
macro_rules! simd_kernel {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$t:ident: $bound:path>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name<$t: $bound>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp<$t: $bound>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn avx512<$t: $bound>($($arg: $ty),*) $(-> $ret)? {
                    imp::<$t>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<$t: $bound>($($arg: $ty),*) $(-> $ret)? {
                    imp::<$t>($($arg),*)
                }
                if $crate::simd::has_avx512() {
                    // SAFETY: this CPU has the features `avx512` was compiled for.
                    return unsafe { avx512::<$t>($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: this CPU has the features `avx2` was compiled for.
                    return unsafe { avx2::<$t>($($arg),*) };
                }
            }
            imp::<$t>($($arg),*)
        }
    };
}
pub(crate) use simd_kernel;

/// Whether the CPU has the AVX-512 subsets that [`simd_kernel!`]'s widest copy is compiled for.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512dq")
    })
}

/// Lanes of the partial sums in [`sum`], [`dot`] and [`max`]: wide enough for one AVX-512
/// register of f32, or two AVX2 ones.
pub(crate) const LANES: usize = 16;

/// Σ x, with [`LANES`] independent partial sums so the loop vectorizes.
#[inline(always)]
pub(crate) fn sum<T: num_traits::Float>(x: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = acc[l] + c[l];
        }
    }
    let mut s = acc.iter().fold(T::zero(), |a, &b| a + b);
    for &v in rest {
        s = s + v;
    }
    s
}

/// Σ a·b, vectorized as [`sum`].
#[inline(always)]
pub(crate) fn dot<T: num_traits::Float>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [T::zero(); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = acc[l] + x[l] * y[l];
        }
    }
    let mut s = acc.iter().fold(T::zero(), |a, &b| a + b);
    for (&x, &y) in ra.iter().zip(rb) {
        s = s + x * y;
    }
    s
}

/// The largest element (−∞ for an empty slice); NaNs are skipped, as `Float::max` does.
#[inline(always)]
pub(crate) fn max<T: num_traits::Float>(x: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    let mut m = acc.iter().fold(T::neg_infinity(), |a, &b| if b > a { b } else { a });
    for &v in rest {
        m = if v > m { v } else { m };
    }
    m
}

/// The f32 slice behind `x` when `T` is f32 (for kernels with a hand-written f32 body).
pub(crate) fn as_f32<T: 'static>(x: &[T]) -> Option<&[f32]> {
    // SAFETY: T is f32 (same type, so same layout and length).
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { &*(x as *const [T] as *const [f32]) })
}

/// [`as_f32`] for a mutable slice.
pub(crate) fn as_f32_mut<T: 'static>(x: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: T is f32 (same type, so same layout and length).
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { &mut *(x as *mut [T] as *mut [f32]) })
}

/// AVX-512 helpers shared by the kernels that need a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// The transpose of a 16 × 16 matrix of 32-bit values held as 16 row vectors (f32 values
    /// go through `_mm512_castps_si512`, which costs nothing). Inlined into its callers, which
    /// enable AVX-512F: the AMX kernel's bf16 packing and the SGEMM's packing of column-major B.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    pub(crate) unsafe fn transpose16(r: &[__m512i; 16]) -> [__m512i; 16] {
        // Pairs of rows interleaved, then quads: u[4g + c] holds, in its 128-bit lane L,
        // rows 4g..4g + 4 at column 4L + c.
        let t: [__m512i; 16] = std::array::from_fn(|i| {
            let (x, y) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(x, y)
            } else {
                _mm512_unpackhi_epi32(x, y)
            }
        });
        let u: [__m512i; 16] = std::array::from_fn(|i| {
            let (g, c) = (i / 4, i % 4);
            let (x, y) = (t[4 * g + c / 2], t[4 * g + 2 + c / 2]);
            if c % 2 == 0 {
                _mm512_unpacklo_epi64(x, y)
            } else {
                _mm512_unpackhi_epi64(x, y)
            }
        });
        // Lanes L of u[c], u[4 + c], u[8 + c], u[12 + c] make row 4L + c of the transpose.
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
            let v1 = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
            let w0 = _mm512_shuffle_i32x4::<0xEE>(u[c], u[4 + c]);
            let w1 = _mm512_shuffle_i32x4::<0xEE>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(v0, v1);
            out[4 + c] = _mm512_shuffle_i32x4::<0xDD>(v0, v1);
            out[8 + c] = _mm512_shuffle_i32x4::<0x88>(w0, w1);
            out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(w0, w1);
        }
        out
    }

    /// [`super::avx2::exp_clamped`] on 16 lanes: the same operations lane by lane, so the same
    /// bits.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp_clamped(x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let xc = _mm512_min_ps(c(80.0), _mm512_max_ps(c(-80.0), x));
        let t = _mm512_fmadd_ps(xc, c(std::f32::consts::LOG2_E), c(super::avx2::MAGIC));
        let n = _mm512_sub_ps(t, c(super::avx2::MAGIC));
        let r = _mm512_fnmadd_ps(n, c(0.693_359_4), xc);
        let r = _mm512_fnmadd_ps(n, c(-2.121_944_4e-4), r);
        let r2 = _mm512_mul_ps(r, r);
        let mut p = _mm512_fmadd_ps(c(1.987_569_1e-4), r, c(1.398_199_9e-3));
        p = _mm512_fmadd_ps(p, r, c(8.333_452e-3));
        p = _mm512_fmadd_ps(p, r, c(4.166_579_6e-2));
        p = _mm512_fmadd_ps(p, r, c(1.666_666_5e-1));
        p = _mm512_fmadd_ps(p, r, c(0.5));
        let p = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), c(1.0));
        let n_exp = _mm512_slli_epi32::<23>(_mm512_castps_si512(t));
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), n_exp))
    }
}

/// Hand-written AVX2 + FMA kernels for f32 (see the module docs). Every `unsafe fn` here needs
/// a CPU with AVX2 and FMA ([`avx2::available`]).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// Whether the CPU runs this module's kernels.
    pub(crate) fn available() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }

    /// The shared core of [`exp`] and [`exp_clamped`] for `xc` already clamped: `(t, p)` with
    /// `n = round(xc·log₂e)` in `t`'s low mantissa bits (`t = xc·log₂e + MAGIC`, `MAGIC = 1.5·2²³`)
    /// and `p = e^(xc − n·ln 2)`, so that `e^xc = p·2ⁿ`.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_reduced(xc: __m256) -> (__m256, __m256) {
        let c = _mm256_set1_ps;
        let t = _mm256_fmadd_ps(xc, c(std::f32::consts::LOG2_E), c(MAGIC));
        let n = _mm256_sub_ps(t, c(MAGIC));
        let r = _mm256_fnmadd_ps(n, c(0.693_359_4), xc);
        let r = _mm256_fnmadd_ps(n, c(-2.121_944_4e-4), r);
        let r2 = _mm256_mul_ps(r, r);
        let mut p = _mm256_fmadd_ps(c(1.987_569_1e-4), r, c(1.398_199_9e-3));
        p = _mm256_fmadd_ps(p, r, c(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, c(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, c(1.666_666_5e-1));
        p = _mm256_fmadd_ps(p, r, c(0.5));
        (t, _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), c(1.0)))
    }

    /// `1.5·2²³`: added to a float below 2²², it leaves the value rounded to an integer in the
    /// low mantissa bits.
    pub(super) const MAGIC: f32 = 12_582_912.0;

    /// `e^x` on 8 lanes: [`super::exp_f32`]'s algorithm and edges, with fused multiply-adds.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(x: __m256) -> __m256 {
        const HI: f32 = 88.722_83;
        const LO: f32 = -87.336_55;
        let c = _mm256_set1_ps;
        // min/max return their second operand when either is NaN: NaN goes through.
        let xc = _mm256_min_ps(c(HI), _mm256_max_ps(c(LO), x));
        let (t, p) = exp_reduced(xc);
        // 2^n = 2^(n/2) · 2^(n − n/2), each factor a normal float for n ∈ [−126, 128].
        let ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(MAGIC.to_bits() as i32));
        let n1 = _mm256_srai_epi32::<1>(ni);
        let n2 = _mm256_sub_epi32(ni, n1);
        let bias = _mm256_set1_epi32(127);
        let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
        let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
        let y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
        let y = _mm256_blendv_ps(y, c(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x, c(HI)));
        // x < LO gives 0 (an unordered compare keeps NaN).
        _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_NLT_UQ>(x, c(LO)))
    }

    /// `e^x` on 8 lanes for `x` clamped to `[−80, 80]`, for saturating uses such as σ(x) (0 or 1
    /// to float precision well inside that range): [`exp`]'s polynomial, but `2^n` is added
    /// straight into the exponent bits (it stays a normal float there) and there are no edge
    /// cases to blend in. NaN stays NaN (`max`/`min` return their second operand then, and the
    /// polynomial of NaN is NaN). GELU's forward took 18 cycles a vector with this (and a mask
    /// for the clamped range), 27 with [`exp`] (AMD EPYC, Zen 3).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_clamped(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let xc = _mm256_min_ps(c(80.0), _mm256_max_ps(c(-80.0), x));
        let (t, p) = exp_reduced(xc);
        // Shifting t's bits by 23 leaves n << 23 (MAGIC's bits shift out): p·2ⁿ for |n| ≤ 116,
        // with p in [0.7, 1.42].
        let n_exp = _mm256_slli_epi32::<23>(_mm256_castps_si256(t));
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), n_exp))
    }

    /// `x ← e^(x − m)` over a slice.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_sub_inplace(x: &mut [f32], m: f32) {
        let mut chunks = x.chunks_exact_mut(8);
        let mv = _mm256_set1_ps(m);
        for ch in &mut chunks {
            // SAFETY: a chunk holds 8 values.
            let v = _mm256_loadu_ps(ch.as_ptr());
            _mm256_storeu_ps(ch.as_mut_ptr(), exp(_mm256_sub_ps(v, mv)));
        }
        for v in chunks.into_remainder() {
            *v = super::exp_f32(*v - m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_within_2_ulp() {
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            let ulp = (want as f32).abs() * f32::EPSILON;
            worst = worst.max((got - want).abs() / ulp as f64);
            x += 0.001_37;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp_f32_edges() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1e9), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.72).is_finite());
    }

    /// `f` on the 8 lanes of `xs`.
    #[cfg(target_arch = "x86_64")]
    fn lanes8(
        f: unsafe fn(std::arch::x86_64::__m256) -> std::arch::x86_64::__m256,
        xs: [f32; 8],
    ) -> [f32; 8] {
        use std::arch::x86_64::*;
        let mut out = [0f32; 8];
        // SAFETY: the tests call this only where the CPU has AVX2 and FMA (all `f` needs).
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), f(_mm256_loadu_ps(xs.as_ptr()))) };
        out
    }

    /// The worst error of the vector `e^x` `f` against f64's over `[lo, hi]`, in ulps.
    #[cfg(target_arch = "x86_64")]
    fn worst_exp_ulp(
        f: unsafe fn(std::arch::x86_64::__m256) -> std::arch::x86_64::__m256,
        lo: f32,
        hi: f32,
    ) -> f64 {
        let mut worst = 0f64;
        let mut x = lo;
        while x < hi {
            let xs: [f32; 8] = std::array::from_fn(|l| (x + l as f32 * 0.000_17).min(hi));
            for (&xi, got) in xs.iter().zip(lanes8(f, xs)) {
                let want = (xi as f64).exp();
                let ulp = (want as f32).abs() * f32::EPSILON;
                worst = worst.max((got as f64 - want).abs() / ulp as f64);
            }
            x += 0.0137;
        }
        worst
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_exp_is_within_2_ulp_with_the_same_edges() {
        if !avx2::available() {
            return;
        }
        let exp8 = |xs| lanes8(avx2::exp, xs);
        let worst = worst_exp_ulp(avx2::exp, -87.3, 88.7);
        assert!(worst <= 2.0, "worst error {worst} ulp");
        let edges = [0.0, 100.0, f32::INFINITY, -100.0, f32::NEG_INFINITY, -1e9, f32::NAN, 88.72];
        let got = exp8(edges);
        for (&x, g) in edges.iter().zip(got) {
            let want = exp_f32(x);
            assert!(g == want || (g.is_nan() && want.is_nan()), "e^{x}: {g} against {want}");
        }
        let mut row: Vec<f32> = (0..21).map(|i| i as f32 * 0.5 - 3.0).collect();
        let want: Vec<f32> = row.iter().map(|&v| exp_f32(v - 2.0)).collect();
        // SAFETY: checked above.
        unsafe { avx2::exp_sub_inplace(&mut row, 2.0) };
        for (g, w) in row.iter().zip(&want) {
            assert!((g - w).abs() <= 2.0 * f32::EPSILON * w, "{g} against {w}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_exp_clamped_is_within_2_ulp_inside_its_range_and_clamps_outside() {
        if !avx2::available() {
            return;
        }
        let exp8 = |xs| lanes8(avx2::exp_clamped, xs);
        let worst = worst_exp_ulp(avx2::exp_clamped, -80.0, 80.0);
        assert!(worst <= 2.0, "worst error {worst} ulp");
        let edges = [f32::INFINITY, 1e9, 80.5, f32::NEG_INFINITY, -1e9, -80.5, 0.0, f32::NAN];
        let got = exp8(edges);
        let (hi, lo) = (exp8([80.0; 8])[0], exp8([-80.0; 8])[0]);
        assert_eq!(got[..3], [hi; 3]);
        assert_eq!(got[3..6], [lo; 3]);
        assert_eq!(got[6], 1.0);
        assert!(got[7].is_nan());
        assert!(hi.is_finite() && lo > 0.0);
    }

    #[test]
    fn reductions_match_sequential() {
        let x: Vec<f64> = (0..37).map(|i| (i as f64 * 0.7).sin()).collect();
        let y: Vec<f64> = (0..37).map(|i| (i as f64 * 0.3).cos()).collect();
        assert!((sum(&x) - x.iter().sum::<f64>()).abs() < 1e-12);
        assert!((dot(&x, &y) - x.iter().zip(&y).map(|(a, b)| a * b).sum::<f64>()).abs() < 1e-12);
        assert_eq!(max(&x), x.iter().copied().fold(f64::NEG_INFINITY, f64::max));
        assert_eq!(max::<f64>(&[]), f64::NEG_INFINITY);
    }
}
