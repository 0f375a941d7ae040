//! Vectorizable f32 math and the run-time dispatch that compiles kernels for AVX2 and AVX-512.
//!
//! The crate is built for baseline x86-64 (SSE2), and libm's `expf` is a function call, so a
//! loop over `f32::exp` runs one element at a time. [`exp_f32`] is branch-free (selects, no
//! calls), so LLVM vectorizes loops over it; [`simd_kernel!`] compiles a kernel twice more,
//! with AVX2 + FMA and with AVX-512, and picks the widest copy the CPU runs. No FMA
//! contraction happens in any copy (Rust never fuses `a * b + c` on its own) and reductions
//! keep [`LANES`] partial sums whatever the vector width, so all copies give bit-identical
//! results.

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
                if $crate::ops::simd::has_avx512() {
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
