//! `C = A·B` with bf16 inputs and f32 accumulation on Intel AMX tiles: the kernel behind
//! [`MatmulPrecision::Bf16`](super::MatmulPrecision).
//!
//! Both operands are rounded to bf16 (round to nearest even) while they are packed into
//! 16 × 64-byte tiles, and `TDPBF16PS` accumulates their products in f32: the numerics of
//! PyTorch's bf16 matmul with f32 accumulation (its CPU autocast), up to the order of the f32
//! sums; about 3 significant decimal digits per input. A is packed as 16-row tiles of 32 depth
//! values; B in AMX's pair layout (row `r` of a tile holds `(B[2r, j], B[2r+1, j])` for 16
//! columns `j`), step-major when B is row-major (each packing task reads 32 whole rows in
//! order), column-block-major otherwise. Column-major operands go through 16 × 16 register
//! transposes. Depth, rows and columns are padded with zeros to whole tiles. Each task runs a 32 × 32 block of C at a
//! time in the four accumulator tiles `tmm0..tmm3` (two A tiles × two B tiles per depth step,
//! `tmm4..tmm7`), over a column panel and a range of row blocks, so the panel of B stays in
//! cache while A streams; the block goes through a small f32 buffer into C, adding the bias
//! or the old C on the way.
//!
//! Linux only: a process must ask the kernel for the tile state (`arch_prctl`) before its
//! first tile instruction; [`available`] does that once.

use super::gemm::view::MatRef;

/// Whether this CPU and OS run AMX-BF16 tiles (checked, and the tile state requested, once).
pub(crate) fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(imp::detect)
}

/// `c = a·b (+ bias)`, or `c += a·b` with `accumulate`, in bf16 × bf16 → f32.
///
/// # Safety
/// [`available`] must have returned true; the views must be in bounds and `c` point to
/// `a.rows × b.cols` writable values (they may be uninitialized unless `accumulate`).
pub(crate) unsafe fn sgemm(a: MatRef, b: MatRef, c: *mut f32, bias: Option<&[f32]>, accumulate: bool) {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    imp::sgemm(a, b, c, bias, accumulate);
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = (a, b, c, bias, accumulate);
        unreachable!("amx::sgemm without AMX");
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    pub(super) fn detect() -> bool {
        false
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use super::MatRef;
    use crate::gemm::view::{with_buffer, SendPtr};
    use crate::simd::avx512::transpose16;
    use rayon::prelude::*;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// bf16 values per tile row (64 bytes), i.e. depth per step.
    const KT: usize = 32;
    /// Values (u16) per tile: 16 rows × 32.
    const TILE: usize = 16 * KT;

    pub(super) fn detect() -> bool {
        // CPUID.(7, 0).EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
        #[allow(unused_unsafe)]
        let edx = unsafe { __cpuid_count(7, 0) }.edx;
        let amx = edx & (1 << 22) != 0 && edx & (1 << 24) != 0;
        amx && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512bw")
            && request_tile_state()
    }

    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: without it the first tile
    /// instruction raises SIGILL (Linux ≥ 5.16 enables the large tile state per process).
    fn request_tile_state() -> bool {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: a plain system call; it reads no memory of ours.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    /// Palette 1, tiles 0–7 of 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    const CONFIG: TileConfig = {
        let mut b = [0u8; 64];
        b[0] = 1;
        let mut t = 0;
        while t < 8 {
            b[16 + 2 * t] = 64;
            b[48 + t] = 16;
            t += 1;
        }
        TileConfig(b)
    };

    thread_local! {
        /// Packed A and B (bf16), on the calling thread.
        static PACKED: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    pub(super) unsafe fn sgemm(a: MatRef, b: MatRef, c: *mut f32, bias: Option<&[f32]>, accumulate: bool) {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        // Whole 32-row / 32-column blocks (pairs of tiles), whole 32-deep steps.
        let (mb, nb, kt) = (m.div_ceil(32), n.div_ceil(32), k.div_ceil(KT));
        let a_len = 2 * mb * kt * TILE;
        let b_len = 2 * nb * kt * TILE;
        with_buffer(&PACKED, a_len + b_len, |buf| {
            let (pa, pb) = buf.split_at_mut(a_len);
            // Tile (row block r of 16, step s) of A at (r·kt + s)·TILE.
            pa.par_chunks_mut(kt * TILE).enumerate().for_each(|(r, out)| pack_a(&a, 16 * r, out));
            // B's tile (column block j of 16, step s) at `j·b_col + s·b_step` tiles.
            let (b_col, b_step) = if b.cs == 1 {
                // Row-major B: packed by depth steps, step-major, so that a task reads whole
                // rows in order and writes one contiguous run of tiles (column blocks would
                // read 64 bytes per row, a page apart at GPT-2 widths).
                pb.par_chunks_mut(2 * nb * TILE).enumerate().for_each(|(s, out)| pack_b_rows(&b, s, out));
                (1, 2 * nb)
            } else {
                pb.par_chunks_mut(kt * TILE).enumerate().for_each(|(j, out)| pack_b(&b, 16 * j, out));
                (kt, 1)
            };
            let (pa, pb): (&[u16], &[u16]) = (pa, pb);
            // Tasks: a column panel × a run of row blocks, enough for ~4 per thread.
            let threads = rayon::current_num_threads();
            let per_panel = (4 * threads).div_ceil(nb).clamp(1, mb);
            let run_len = mb.div_ceil(per_panel);
            let tasks: Vec<(usize, usize)> =
                (0..nb).flat_map(|j| (0..mb.div_ceil(run_len)).map(move |t| (j, t))).collect();
            let c = SendPtr(c);
            tasks.par_iter().for_each(|&(j, t)| {
                load_config();
                let mut block = Block([0f32; 32 * 32]);
                for r in t * run_len..((t + 1) * run_len).min(mb) {
                    let at = pa.as_ptr().add(2 * r * kt * TILE);
                    let bt = pb.as_ptr().add(2 * j * b_col * TILE);
                    let step = 2 * b_step * TILE;
                    kernel(at, at.add(kt * TILE), bt, bt.add(b_col * TILE), step, kt, block.0.as_mut_ptr());
                    let (i0, j0) = (32 * r, 32 * j);
                    store(&block.0, c.get(), n, i0, (m - i0).min(32), j0, (n - j0).min(32), bias, accumulate);
                }
            });
        });
    }

    #[repr(C, align(64))]
    struct Block([f32; 32 * 32]);

    fn load_config() {
        // SAFETY: the process has the tile state (available() returned true before any call).
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
    }

    /// The 32 × 32 block `out` (row-major) = A rows (tiles `a0`, `a1`, consecutive steps
    /// 1 KiB apart) · B columns (tiles `b0`, `b1`, steps `b_step` bytes apart), over `kt` steps
    /// of 32.
    #[inline(always)]
    unsafe fn kernel(
        a0: *const u16,
        a1: *const u16,
        b0: *const u16,
        b1: *const u16,
        b_step: usize,
        kt: usize,
        out: *mut f32,
    ) {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {s}]",
            "tileloadd tmm6, [{b0} + {s}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b1} + {s}]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a1} + {s}]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 1024",
            "add {a1}, 1024",
            "add {b0}, {bs}",
            "add {b1}, {bs}",
            "dec {kt}",
            "jnz 2b",
            // `out` has rows of 128 bytes: tiles at +0, +64 (columns 16..), +2048 (rows 16..).
            "tilestored [{o} + {os}], tmm0",
            "lea {a0}, [{o} + 64]",
            "tilestored [{a0} + {os}], tmm1",
            "lea {a0}, [{o} + 2048]",
            "tilestored [{a0} + {os}], tmm2",
            "lea {a0}, [{o} + 2112]",
            "tilestored [{a0} + {os}], tmm3",
            a0 = inout(reg) a0 => _,
            a1 = inout(reg) a1 => _,
            b0 = inout(reg) b0 => _,
            b1 = inout(reg) b1 => _,
            kt = inout(reg) kt => _,
            bs = in(reg) b_step,
            s = in(reg) 64usize,
            o = in(reg) out,
            os = in(reg) 128usize,
            options(nostack),
        );
    }

    /// Writes rows `..mr`, columns `..nr` of `block` into `c` at `(i0, j0)`, adding the bias
    /// or the old value.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn store(
        block: &[f32; 1024],
        c: *mut f32,
        ldc: usize,
        i0: usize,
        mr: usize,
        j0: usize,
        nr: usize,
        bias: Option<&[f32]>,
        accumulate: bool,
    ) {
        let masks = [mask(nr.min(16)), mask(nr.saturating_sub(16))];
        for i in 0..mr {
            for (v, &mk) in masks.iter().enumerate() {
                if mk == 0 {
                    continue;
                }
                let x = _mm512_loadu_ps(block.as_ptr().add(32 * i + 16 * v));
                let p = c.add((i0 + i) * ldc + j0 + 16 * v);
                let x = if accumulate {
                    _mm512_add_ps(x, _mm512_maskz_loadu_ps(mk, p))
                } else if let Some(b) = bias {
                    _mm512_add_ps(x, _mm512_maskz_loadu_ps(mk, b.as_ptr().add(j0 + 16 * v)))
                } else {
                    x
                };
                _mm512_mask_storeu_ps(p, mk, x);
            }
        }
    }

    /// The lowest `n` (≤ 16) lanes.
    fn mask(n: usize) -> __mmask16 {
        ((1u32 << n.min(16)) - 1) as __mmask16
    }

    /// 16 values from `p` with stride `s` (the first `n` of them; the rest 0).
    #[inline(always)]
    unsafe fn load16(p: *const f32, s: usize, n: usize) -> __m512 {
        let mk = mask(n);
        if s == 1 {
            _mm512_maskz_loadu_ps(mk, p)
        } else if s <= (i32::MAX as usize) / 16 {
            let idx = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(s as i32),
            );
            _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mk, idx, p)
        } else {
            let mut v = [0f32; 16];
            for (i, x) in v.iter_mut().enumerate().take(n) {
                *x = *p.add(i * s);
            }
            _mm512_loadu_ps(v.as_ptr())
        }
    }

    /// `lo` then `hi` as 32 bf16 values (round to nearest even).
    #[inline(always)]
    unsafe fn to_bf16(lo: __m512, hi: __m512) -> __m512i {
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
    }

    /// (`x0[0], x1[0], x0[1], x1[1], …`) from the 32 bf16 values (`x0[0..16]`, `x1[0..16]`).
    #[inline(always)]
    unsafe fn interleave(v: __m512i) -> __m512i {
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
            18, 2, 17, 1, 16, 0,
        );
        _mm512_permutexvar_epi16(idx, v)
    }

    /// Stores 16 tile rows.
    #[inline(always)]
    unsafe fn store_tile(rows: &[__m512i; 16], tile: &mut [u16]) {
        for (dst, v) in tile.chunks_exact_mut(KT).zip(rows) {
            _mm512_storeu_si512(dst.as_mut_ptr().cast(), *v);
        }
    }

    /// The valid counts `(n0, n1)` of the two 16-value halves of depth step `s`.
    fn halves(k: usize, s: usize) -> (usize, usize) {
        let left = k - s * KT;
        (left.min(16), left.saturating_sub(16).min(16))
    }

    /// 32 values from `p` with stride `st`, the first `n0 + n1` of them, as bf16.
    #[inline(always)]
    unsafe fn load32_bf16(p: *const f32, st: usize, (n0, n1): (usize, usize)) -> __m512i {
        let hi = if n1 > 0 { load16(p.add(16 * st), st, n1) } else { _mm512_setzero_ps() };
        to_bf16(load16(p, st, n0), hi)
    }

    /// Packs rows `i0..i0 + 16` of `a` (zeros past the end) into `kt` tiles.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_a(a: &MatRef, i0: usize, out: &mut [u16]) {
        let k = a.cols;
        let rows = a.rows.saturating_sub(i0).min(16);
        let column_major = a.rs == 1 && a.cs != 1;
        for (s, tile) in out.chunks_exact_mut(TILE).enumerate() {
            let tile_rows: [__m512i; 16] = if column_major {
                // 16 rows of a column are contiguous: pair p of every row is columns
                // (2p, 2p + 1) interleaved, and the transpose makes rows of the pairs.
                let col = |q: usize| {
                    if q < k && rows > 0 {
                        load16(a.data.as_ptr().add(a.off + i0 + q * a.cs), 1, rows)
                    } else {
                        _mm512_setzero_ps()
                    }
                };
                let pairs = std::array::from_fn(|p| {
                    let q = s * KT + 2 * p;
                    interleave(to_bf16(col(q), col(q + 1)))
                });
                transpose16(&pairs)
            } else {
                std::array::from_fn(|r| {
                    if r < rows {
                        let p = a.data.as_ptr().add(a.off + (i0 + r) * a.rs + s * KT * a.cs);
                        load32_bf16(p, a.cs, halves(k, s))
                    } else {
                        _mm512_setzero_si512()
                    }
                })
            };
            store_tile(&tile_rows, tile);
        }
    }

    /// Packs depth step `s` (rows `32s..32s + 32`) of a row-major `b` into one tile per
    /// 16-column block, consecutive in `out` (zeros past the end).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_b_rows(b: &MatRef, s: usize, out: &mut [u16]) {
        let (k, n) = (b.rows, b.cols);
        let blocks = out.len() / TILE;
        for r in 0..16 {
            let p = s * KT + 2 * r;
            let row = |p: usize, j0: usize| {
                if p < k && j0 < n {
                    load16(b.data.as_ptr().add(b.off + p * b.rs + j0), 1, n - j0)
                } else {
                    _mm512_setzero_ps()
                }
            };
            for j in 0..blocks {
                let v = interleave(to_bf16(row(p, 16 * j), row(p + 1, 16 * j)));
                _mm512_storeu_si512(out.as_mut_ptr().add(j * TILE + r * KT).cast(), v);
            }
        }
    }

    /// Packs columns `j0..j0 + 16` of `b` (zeros past the end) into `kt` tiles of pairs.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_b(b: &MatRef, j0: usize, out: &mut [u16]) {
        let k = b.rows;
        let cols = b.cols.saturating_sub(j0).min(16);
        let column_major = b.rs == 1 && b.cs != 1;
        for (s, tile) in out.chunks_exact_mut(TILE).enumerate() {
            let tile_rows: [__m512i; 16] = if column_major {
                // A column's 32 depth values are contiguous and, as bf16, already its 16
                // pairs in order; the transpose makes rows of the pairs.
                let columns = std::array::from_fn(|j| {
                    if j < cols {
                        let p = b.data.as_ptr().add(b.off + s * KT + (j0 + j) * b.cs);
                        load32_bf16(p, 1, halves(k, s))
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                transpose16(&columns)
            } else {
                let row = |p: usize| {
                    if p < k && cols > 0 {
                        load16(b.data.as_ptr().add(b.off + p * b.rs + j0 * b.cs), b.cs, cols)
                    } else {
                        _mm512_setzero_ps()
                    }
                };
                std::array::from_fn(|r| {
                    let p = s * KT + 2 * r;
                    interleave(to_bf16(row(p), row(p + 1)))
                })
            };
            store_tile(&tile_rows, tile);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> f64 {
        // Round to nearest even, as the packing does (no NaNs here).
        let b = x.to_bits();
        let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
        f32::from_bits(r) as f64
    }

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every layout, ragged sizes, bias and accumulation, against an f64 product of the
    /// bf16-rounded inputs: only the f32 accumulation differs.
    #[test]
    fn matches_rounded_f64_product() {
        if !available() {
            eprintln!("no AMX-BF16 here; skipped");
            return;
        }
        for &(m, k, n) in &[(1, 1, 1), (17, 33, 15), (32, 32, 32), (50, 100, 70), (64, 257, 33), (5, 600, 40)]
        {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let av = data(m * k, 1 + m as u64);
                let bv = data(k * n, 2 + n as u64);
                // Stored transposed when `t`: the view reads (i, j) at j·rows + i.
                let a = if ta {
                    MatRef { data: &av, off: 0, rows: m, cols: k, rs: 1, cs: m }
                } else {
                    MatRef { data: &av, off: 0, rows: m, cols: k, rs: k, cs: 1 }
                };
                let b = if tb {
                    MatRef { data: &bv, off: 0, rows: k, cols: n, rs: 1, cs: k }
                } else {
                    MatRef { data: &bv, off: 0, rows: k, cols: n, rs: n, cs: 1 }
                };
                let at = |i: usize, j: usize| av[if ta { j * m + i } else { i * k + j }];
                let bt = |i: usize, j: usize| bv[if tb { j * k + i } else { i * n + j }];
                let bias = data(n, 3);
                let old = data(m * n, 4);
                for mode in 0..3 {
                    let mut c = if mode == 2 { old.clone() } else { vec![f32::NAN; m * n] };
                    let bias_arg = (mode == 1).then_some(&bias[..]);
                    // SAFETY: AMX present; row-major views in bounds; c has m × n values.
                    unsafe { sgemm(a, b, c.as_mut_ptr(), bias_arg, mode == 2) };
                    for i in 0..m {
                        for j in 0..n {
                            let (mut s, mut mag) = (0f64, 0f64);
                            for p in 0..k {
                                let x = bf16(at(i, p)) * bf16(bt(p, j));
                                s += x;
                                mag += x.abs();
                            }
                            s += match mode {
                                1 => bias[j] as f64,
                                2 => old[i * n + j] as f64,
                                _ => 0.0,
                            };
                            let got = c[i * n + j] as f64;
                            assert!(
                                (got - s).abs() <= 1e-5 * (mag + 1.0),
                                "({m},{k},{n}) t=({ta},{tb}) mode {mode} at ({i},{j}): {got} vs {s}"
                            );
                        }
                    }
                }
            }
        }
    }
}
