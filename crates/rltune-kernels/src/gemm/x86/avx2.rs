//! The AVX2 + FMA microkernel (`6 × 16`) and its packing of B.

use super::*;
use std::arch::x86_64::*;

/// The AVX2 + FMA kernel: 6 rows × 2 vectors of 8 lanes.
pub(crate) struct Avx2;

impl Avx2 {
    /// [`pack_b_panel`] for a full panel of column-major B (`rs == 1`): 8 × 8 blocks are
    /// loaded along the columns (8 steps of one column per load) and transposed in
    /// registers, instead of one scalar store per value.
    ///
    /// # Safety
    /// AVX2; `b` in bounds with `rs == 1`, columns `j0..j0 + NR` and rows `p0..p0 + kc`
    /// inside it, `out` of `kc × NR` values.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pack_columns(b: &MatRef, p0: usize, kc: usize, j0: usize, out: &mut [f32]) {
        const NR: usize = Avx2::NR;
        assert!(out.len() >= kc * NR);
        let src = b.data.as_ptr().add(b.off + p0 + j0 * b.cs);
        let dst = out.as_mut_ptr();
        let whole = kc / 8 * 8;
        for p in (0..whole).step_by(8) {
            for g in 0..NR / 8 {
                let col = |c: usize| _mm256_loadu_ps(src.add((8 * g + c) * b.cs + p));
                let rows = transpose8([col(0), col(1), col(2), col(3), col(4), col(5), col(6), col(7)]);
                for (r, v) in rows.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add((p + r) * NR + 8 * g), v);
                }
            }
        }
        for p in whole..kc {
            for c in 0..NR {
                *dst.add(p * NR + c) = *src.add(c * b.cs + p);
            }
        }
    }
}

/// The transpose of an 8 × 8 block held as 8 row vectors.
#[target_feature(enable = "avx2")]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

impl Micro for Avx2 {
    const MR: usize = 6;
    const NR: usize = 16;

    fn pack_a(a: &MatRef, i0: usize, mc: usize, p0: usize, kc: usize, out: &mut [f32]) {
        pack_a::<{ Self::MR }>(a, i0, mc, p0, kc, out);
    }

    unsafe fn pack_b(b: &MatRef, p0: usize, kc: usize, j0: usize, out: &mut [f32]) {
        if b.rs == 1 && b.cs != 1 && b.cols - j0 >= Self::NR {
            // SAFETY: AVX2 (the caller's promise); the panel lies inside the view.
            unsafe { Self::pack_columns(b, p0, kc, j0, out) };
        } else {
            pack_b_panel::<{ Self::NR }>(b, p0, kc, j0, out);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn kernel<const DIRECT: bool>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        mr: usize,
        nr: usize,
        load_c: bool,
        bias: *const f32,
    ) {
        const MR: usize = Avx2::MR;
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            let b0 = _mm256_loadu_ps(b);
            let b1 = _mm256_loadu_ps(b.add(8));
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_broadcast_ss(&*a.add(if DIRECT { i * lda } else { i }));
                row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
            }
            a = a.add(if DIRECT { 1 } else { MR });
            b = b.add(ldb);
        }
        // Lane masks of the (possibly partial) last columns: all ones where `lane < rem`.
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let masks: [__m256i; 2] = std::array::from_fn(|v| {
            let rem = nr.saturating_sub(8 * v).min(8) as i32;
            _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lanes)
        });
        let full = nr == Self::NR;
        // Constant trip counts keep `acc` in registers; rows past `mr` are skipped.
        for (i, row) in acc.iter().enumerate() {
            if i >= mr {
                break;
            }
            for (v, &x) in row.iter().enumerate() {
                if 8 * v >= nr {
                    continue;
                }
                let p = c.add(i * ldc + 8 * v);
                if full {
                    let r = if load_c {
                        _mm256_add_ps(x, _mm256_loadu_ps(p))
                    } else if !bias.is_null() {
                        _mm256_add_ps(x, _mm256_loadu_ps(bias.add(8 * v)))
                    } else {
                        x
                    };
                    _mm256_storeu_ps(p, r);
                } else {
                    let mask = masks[v];
                    let r = if load_c {
                        _mm256_add_ps(x, _mm256_maskload_ps(p, mask))
                    } else if !bias.is_null() {
                        _mm256_add_ps(x, _mm256_maskload_ps(bias.add(8 * v), mask))
                    } else {
                        x
                    };
                    _mm256_maskstore_ps(p, mask, r);
                }
            }
        }
    }
}
