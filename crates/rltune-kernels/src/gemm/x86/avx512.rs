//! The AVX-512F microkernel (`14 × 32`; an assembly loop for A read in place) and its packing of
//! B.

use super::*;
use crate::simd::avx512::transpose16;
use std::arch::x86_64::*;

/// The AVX-512F kernel: 14 rows × 2 vectors of 16 lanes.
pub(crate) struct Avx512;

impl Avx512 {
    /// 16-lane vectors per row.
    const NV: usize = 2;

    /// [`pack_b_panel`] for a full panel of column-major B (`rs == 1`): 16 × 16 blocks are
    /// loaded along the columns (16 steps of one column per load) and transposed in
    /// registers (`simd::avx512::transpose16`); steps past the last multiple of 16 gather 16
    /// columns at once. Gathers for every step (16 cache lines per load) took 7% more
    /// samples (`perf` over `bench ppo --preset small`: 597 against 557); both wait mostly
    /// on B coming from memory.
    ///
    /// # Safety
    /// AVX-512F; `b` in bounds with `rs == 1`, columns `j0..j0 + NR` and rows
    /// `p0..p0 + kc` inside it, `15·cs` within i32, `out` of `kc × NR` values.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_columns(b: &MatRef, p0: usize, kc: usize, j0: usize, out: &mut [f32]) {
        assert!(out.len() >= kc * Self::NR);
        let whole = kc / 16 * 16;
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let idx = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(b.cs as i32));
        for v in 0..Self::NV {
            let base = b.data.as_ptr().add(b.off + p0 + (j0 + 16 * v) * b.cs);
            let dst = out.as_mut_ptr().add(16 * v);
            for p in (0..whole).step_by(16) {
                let cols: [__m512i; 16] =
                    std::array::from_fn(|c| _mm512_castps_si512(_mm512_loadu_ps(base.add(c * b.cs + p))));
                for (r, x) in transpose16(&cols).into_iter().enumerate() {
                    _mm512_storeu_ps(dst.add((p + r) * Self::NR), _mm512_castsi512_ps(x));
                }
            }
            for p in whole..kc {
                let x = _mm512_i32gather_ps::<4>(idx, base.add(p));
                _mm512_storeu_ps(dst.add(p * Self::NR), x);
            }
        }
    }
}

impl Micro for Avx512 {
    const MR: usize = 14;
    const NR: usize = 16 * Self::NV;

    fn pack_a(a: &MatRef, i0: usize, mc: usize, p0: usize, kc: usize, out: &mut [f32]) {
        pack_a::<{ Self::MR }>(a, i0, mc, p0, kc, out);
    }

    unsafe fn pack_b(b: &MatRef, p0: usize, kc: usize, j0: usize, out: &mut [f32]) {
        if b.rs == 1
            && b.cs != 1
            && b.cols - j0 >= Self::NR
            && b.cs.checked_mul(15).is_some_and(|x| x <= i32::MAX as usize)
        {
            // SAFETY: AVX-512F (the caller's promise); the panel lies inside the view.
            unsafe { Self::pack_columns(b, p0, kc, j0, out) };
        } else {
            pack_b_panel::<{ Self::NR }>(b, p0, kc, j0, out);
        }
    }

    /// Runs the tile with 14 rows of accumulators, or with 8 or 4 when `mr` is that small (the
    /// last tile of a product whose rows are not a multiple of 14: 16 rows are 14 + 8
    /// computed instead of 14 + 14, 64 rows 4 × 14 + 8 instead of 5 × 14).
    #[target_feature(enable = "avx512f")]
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
        match mr {
            0..=4 => Self::tile::<4, DIRECT>(kc, a, lda, b, ldb, c, ldc, mr, nr, load_c, bias),
            5..=8 => Self::tile::<8, DIRECT>(kc, a, lda, b, ldb, c, ldc, mr, nr, load_c, bias),
            _ => Self::tile::<{ Self::MR }, DIRECT>(kc, a, lda, b, ldb, c, ldc, mr, nr, load_c, bias),
        }
    }
}

impl Avx512 {
    /// The microkernel with `R ≤ MR` rows of accumulators; packed A still advances `MR`
    /// values a step (its panels are `MR` rows, zero-padded).
    ///
    /// # Safety
    /// As [`Micro::kernel`], with `mr ≤ R`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const R: usize, const DIRECT: bool>(
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
        const MR: usize = Avx512::MR;
        const NV: usize = Avx512::NV;
        debug_assert!(mr <= R && R <= MR);
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        if DIRECT && R == MR {
            // SAFETY: a full tile read in place (the caller's promise).
            for (row, sums) in acc.iter_mut().zip(Self::direct_sums(kc, a, lda, b, ldb)) {
                row.copy_from_slice(&sums);
            }
        } else {
            let (mut a, mut b) = (a, b);
            for _ in 0..kc {
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(b.add(16 * v));
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(if DIRECT { *a.add(i * lda) } else { *a.add(i) });
                    for (x, bx) in row.iter_mut().zip(&bv) {
                        *x = _mm512_fmadd_ps(ai, *bx, *x);
                    }
                }
                a = a.add(if DIRECT { 1 } else { MR });
                b = b.add(ldb);
            }
        }
        let masks: [__mmask16; NV] = std::array::from_fn(|v| {
            let rem = nr.saturating_sub(16 * v).min(16);
            if rem == 16 {
                0xffff
            } else {
                ((1u32 << rem) - 1) as __mmask16
            }
        });
        // Constant trip counts keep `acc` in registers; rows past `mr` are skipped.
        for (i, row) in acc.iter().enumerate() {
            if i >= mr {
                break;
            }
            for (v, &x) in row.iter().enumerate() {
                let mask = masks[v];
                if mask == 0 {
                    continue;
                }
                let p = c.add(i * ldc + 16 * v);
                let r = if load_c {
                    _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, p))
                } else if !bias.is_null() {
                    _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, bias.add(16 * v)))
                } else {
                    x
                };
                _mm512_mask_storeu_ps(p, mask, r);
            }
        }
    }
}

/// One row of a step of [`Avx512::direct_sums`]: A's value `4·$s` bytes past `$addr`,
/// broadcast into `$t`, times B's two vectors (`zmm28`, `zmm29`), added to the row's sums.
macro_rules! direct_row {
    ($addr:literal, $s:literal, $t:literal, $c0:literal, $c1:literal) => {
        concat!(
            "vbroadcastss ",
            $t,
            ", dword ptr [",
            $addr,
            " + 4*",
            stringify!($s),
            "]\n",
            "vfmadd231ps ",
            $c0,
            ", ",
            $t,
            ", zmm28\n",
            "vfmadd231ps ",
            $c1,
            ", ",
            $t,
            ", zmm29\n",
        )
    };
}

/// Step `$s` of [`Avx512::direct_sums`]'s unrolled loop: B's two vectors at `{b}` (which
/// then moves on one step), the 14 rows' values `$s` values past their block's start.
macro_rules! direct_step {
    ($s:literal) => {
        concat!(
            "vmovups zmm28, [{b}]\n",
            "vmovups zmm29, [{b} + 64]\n",
            direct_row!("{a0}", $s, "zmm30", "zmm0", "zmm1"),
            direct_row!("{a0} + {l}", $s, "zmm31", "zmm2", "zmm3"),
            direct_row!("{a0} + {l}*2", $s, "zmm30", "zmm4", "zmm5"),
            direct_row!("{a0} + {l3}", $s, "zmm31", "zmm6", "zmm7"),
            direct_row!("{a4}", $s, "zmm30", "zmm8", "zmm9"),
            direct_row!("{a4} + {l}", $s, "zmm31", "zmm10", "zmm11"),
            direct_row!("{a4} + {l}*2", $s, "zmm30", "zmm12", "zmm13"),
            direct_row!("{a4} + {l3}", $s, "zmm31", "zmm14", "zmm15"),
            direct_row!("{a8}", $s, "zmm30", "zmm16", "zmm17"),
            direct_row!("{a8} + {l}", $s, "zmm31", "zmm18", "zmm19"),
            direct_row!("{a8} + {l}*2", $s, "zmm30", "zmm20", "zmm21"),
            direct_row!("{a8} + {l3}", $s, "zmm31", "zmm22", "zmm23"),
            direct_row!("{a12}", $s, "zmm30", "zmm24", "zmm25"),
            direct_row!("{a12} + {l}", $s, "zmm31", "zmm26", "zmm27"),
            "add {b}, {ldb4}\n",
        )
    };
}

impl Avx512 {
    /// The sums of a full `MR × NR` tile with A read in place (`DIRECT`): `Σ_p a[i·lda + p] ·
    /// b[p·ldb..][..NR]` for the 14 rows `i`, row `i`'s two vectors at `[i]`.
    ///
    /// In assembly, unrolled by 16 steps (one cache line of each row of A): LLVM compiled
    /// the loop of [`Avx512::tile`] with the 14 row addresses `a + i·lda + p` recomputed by a
    /// chain of about ten integer adds per step. Here four row pointers (rows 0, 4, 8, 12)
    /// move once per 16 steps, the other rows are addressed from them with `lda` and
    /// `3·lda` (scaled index modes) and the steps by displacements. `bench_gemm`, 2
    /// threads: 512×256×768 and 512×1024×256 from 253–271 to 262–285 GFLOP/s, the LM
    /// head's 384×256×8192 from 262–294 to 287–317 and `dh` (384×8192×256) from 223–254
    /// to 243–268. Rolled up (one step per iteration) the assembly was no faster than
    /// LLVM's loop; prefetching each row's next lines as well gained nothing more. Each sum
    /// adds its terms in `p` order with FMAs, as [`Avx512::tile`] does: the same results
    /// to the bit.
    ///
    /// # Safety
    /// AVX-512F; rows `0..14` of A (`kc` values from `a`, `lda` apart) and `kc` steps of
    /// `NR` values of B (`ldb` apart) are readable.
    #[target_feature(enable = "avx512f")]
    unsafe fn direct_sums(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
    ) -> [[__m512; 2]; 14] {
        let mut c = [_mm512_setzero_ps(); 28];
        // SAFETY: the caller's promise: the loop reads rows 0..14 of A at steps 0..kc and
        // `kc` steps of B, and writes only registers.
        unsafe {
            std::arch::asm!(
                "test {n16}, {n16}",
                "jz 3f",
                "2:",
                direct_step!(0), direct_step!(1), direct_step!(2), direct_step!(3),
                direct_step!(4), direct_step!(5), direct_step!(6), direct_step!(7),
                direct_step!(8), direct_step!(9), direct_step!(10), direct_step!(11),
                direct_step!(12), direct_step!(13), direct_step!(14), direct_step!(15),
                "add {a0}, 64",
                "add {a4}, 64",
                "add {a8}, 64",
                "add {a12}, 64",
                "dec {n16}",
                "jnz 2b",
                "3:",
                "test {rem}, {rem}",
                "jz 5f",
                "4:",
                direct_step!(0),
                "add {a0}, 4",
                "add {a4}, 4",
                "add {a8}, 4",
                "add {a12}, 4",
                "dec {rem}",
                "jnz 4b",
                "5:",
                n16 = inout(reg) kc / 16 => _,
                rem = inout(reg) kc % 16 => _,
                a0 = inout(reg) a => _,
                a4 = inout(reg) a.add(4 * lda) => _,
                a8 = inout(reg) a.add(8 * lda) => _,
                a12 = inout(reg) a.add(12 * lda) => _,
                b = inout(reg) b => _,
                l = in(reg) 4 * lda,
                l3 = in(reg) 12 * lda,
                ldb4 = in(reg) 4 * ldb,
            inout("zmm0") c[0],
            inout("zmm1") c[1],
            inout("zmm2") c[2],
            inout("zmm3") c[3],
            inout("zmm4") c[4],
            inout("zmm5") c[5],
            inout("zmm6") c[6],
            inout("zmm7") c[7],
            inout("zmm8") c[8],
            inout("zmm9") c[9],
            inout("zmm10") c[10],
            inout("zmm11") c[11],
            inout("zmm12") c[12],
            inout("zmm13") c[13],
            inout("zmm14") c[14],
            inout("zmm15") c[15],
            inout("zmm16") c[16],
            inout("zmm17") c[17],
            inout("zmm18") c[18],
            inout("zmm19") c[19],
            inout("zmm20") c[20],
            inout("zmm21") c[21],
            inout("zmm22") c[22],
            inout("zmm23") c[23],
            inout("zmm24") c[24],
            inout("zmm25") c[25],
            inout("zmm26") c[26],
            inout("zmm27") c[27],
                out("zmm28") _,
                out("zmm29") _,
                out("zmm30") _,
                out("zmm31") _,
                options(nostack, readonly),
            );
        }
        std::array::from_fn(|i| [c[2 * i], c[2 * i + 1]])
    }
}
