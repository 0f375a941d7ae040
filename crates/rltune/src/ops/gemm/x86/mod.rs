//! The x86 kernels and the parallel driver that packs operands for them and deals the tiles
//! out to threads.

mod avx2;
mod avx512;

pub(super) use avx2::Avx2;
pub(super) use avx512::Avx512;

use super::prepack::PackedB;
use super::*;
use std::arch::x86_64::*;

/// One microkernel and how B is packed for it.
pub(super) trait Micro {
    /// Rows of A per call.
    const MR: usize;
    /// Columns of B per call.
    const NR: usize;

    /// `C[..mr, ..nr] (+)= Σ_p a[p] ⊗ b[p]` for a `b` panel of `kc` steps of `NR` values,
    /// step `p` at `b + p·ldb` (packed: `ldb = NR`; or row-major B in place), and either
    /// a packed `a` panel (`kc × MR`, `DIRECT = false`) or, with `DIRECT`, `MR` rows of A
    /// read in place (`a[i·lda + p]`; all `MR` rows must exist); `load_c` adds to C, else
    /// a non-null `bias` (`nr` values) is added.
    ///
    /// # Safety
    /// The CPU has the kernel's instruction set; the pointers cover what is described above
    /// and `c` has `mr` rows of `ldc` values with `nr` writable from each.
    #[allow(clippy::too_many_arguments)]
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
    );

    /// [`pack_b_panel`] for this kernel's `NR`.
    ///
    /// # Safety
    /// The CPU has the kernel's instruction set.
    unsafe fn pack_b(b: &MatRef, p0: usize, kc: usize, j0: usize, out: &mut [f32]);

    /// [`pack_a`] for this kernel's `MR`.
    fn pack_a(a: &MatRef, i0: usize, mc: usize, p0: usize, kc: usize, out: &mut [f32]);
}

/// Runs the product on `isa`'s kernel.
///
/// # Safety
/// The CPU must have `isa`; the views must be in bounds and `c` point to `m × n` writable
/// values (they may be uninitialized when `accumulate` is false).
pub(super) unsafe fn sgemm(
    isa: Isa,
    a: MatRef,
    b: MatRef,
    c: *mut f32,
    bias: Option<&[f32]>,
    accumulate: bool,
) {
    sgemm_with(isa, a, b, c, bias, accumulate, None)
}

/// [`sgemm`], or with `epi` (then `accumulate` is false) the product, plus `bias`, handed to
/// `epi` block by block: copied (`c` unused, see [`super::sgemm_epilogue`]) or in place in
/// `c` (see [`super::sgemm_rows_then`]).
///
/// # Safety
/// As [`sgemm`].
pub(super) unsafe fn sgemm_with(
    isa: Isa,
    a: MatRef,
    b: MatRef,
    c: *mut f32,
    bias: Option<&[f32]>,
    accumulate: bool,
    epi: Option<Epi>,
) {
    match isa {
        Isa::Avx512 => drive::<Avx512>(a, b, None, c, bias, accumulate, epi),
        Isa::Avx2 => drive::<Avx2>(a, b, None, c, bias, accumulate, epi),
    }
}

/// [`sgemm`] with B already packed (`pb`, from [`pack_whole`] of `b` for `isa`).
///
/// # Safety
/// As [`sgemm`].
pub(super) unsafe fn sgemm_prepacked(
    isa: Isa,
    a: MatRef,
    b: MatRef,
    pb: &[f32],
    c: *mut f32,
    bias: Option<&[f32]>,
    accumulate: bool,
) {
    match isa {
        Isa::Avx512 => drive::<Avx512>(a, b, Some(pb), c, bias, accumulate, None),
        Isa::Avx2 => drive::<Avx2>(a, b, Some(pb), c, bias, accumulate, None),
    }
}

/// All of `b` packed for `isa`'s kernel, in the layout [`drive`] packs it into.
///
/// # Safety
/// The CPU has `isa`; `b` is in bounds.
pub(super) unsafe fn pack_whole(isa: Isa, b: &MatRef) -> PackedB {
    match isa {
        Isa::Avx512 => pack_all::<Avx512>(b),
        Isa::Avx2 => pack_all::<Avx2>(b),
    }
}

/// [`pack_whole`] for `K`.
///
/// # Safety
/// As [`pack_whole`].
unsafe fn pack_all<K: Micro>(b: &MatRef) -> PackedB {
    let (k, n, nr) = (b.rows, b.cols, K::NR);
    let panels = n.div_ceil(nr);
    let len = k * panels * nr;
    // Every value is written below.
    let mut packed = PackedB::with_len(len);
    let chunks: Vec<(usize, usize)> =
        (0..k.div_ceil(KC)).flat_map(|q| (0..panels).map(move |j| (q, j))).collect();
    let out = SendPtr(packed.values_mut().as_mut_ptr());
    crate::cpu::for_each_task(chunks.len(), |i| {
        let (q, j) = chunks[i];
        let kc = KC.min(k - q * KC);
        // SAFETY: the blocks `q·KC·panels·NR + j·kc·NR` (`kc·NR` long) are disjoint and
        // inside the `len` values; the CPU has K's instruction set.
        unsafe {
            let dst =
                std::slice::from_raw_parts_mut(out.get().add(q * KC * panels * nr + j * kc * nr), kc * nr);
            K::pack_b(b, q * KC, kc, j * nr, dst);
        }
    });
    packed
}

/// Whether the microkernel reads the full panels of row-major B in place (`ldb = rs`)
/// instead of packing B: when A has so few rows that packing B costs about as much as the
/// product (a weight times a few rows outside a `PackScope`; generation's decoding reads
/// its weights packed once, which is faster still). Measured (AVX2, 2 threads):
/// 16 × 768 × 2304 went from 25–28 to 42–55 GFLOP/s and 16 × 3072 × 768 from 16–18 to
/// 32–47; at 64 and 128 rows reading in place was no better (L1 set conflicts between the
/// rows of B, which packing avoids).
fn reads_b_in_place(b: &MatRef, m: usize) -> bool {
    b.cs == 1 && m <= 32
}

/// The parallel driver: pack all of B once (in parallel, `KC`-deep blocks of `NR`-wide
/// panels; unless [`reads_b_in_place`]), then each task packs its rows of A block by block
/// and runs the microkernel.
///
/// When one task spans all rows (A has at most [`super::ONE_ROW_CHUNK`] tiles, as PPO's
/// minibatches of 96–128 rows), each B panel is used by one task only: the task packs it
/// into an L1-sized buffer just before its row tiles use it, instead of all of B going to a
/// packed copy in memory and back (at 128 rows that round trip cost as much as a fifth of
/// the product).
///
/// A panel of row-major B is `KC` cache lines from as many rows, each a separate miss when B
/// is a weight coming from memory (once per pass in training), and the hardware prefetcher
/// does not follow such strides: packing it alone waited on them (the product ran at 141
/// GFLOP/s instead of 160 at 128 × 768 × 3072 with B cold). So while a panel's tiles run,
/// the next panel's lines are prefetched, a share before each tile (all at once filled the
/// miss buffers and stalled the kernel): 152–157 GFLOP/s cold. The same holds for the panels
/// read in place.
///
/// # Safety
/// As [`sgemm`], for `K`'s instruction set.
///
/// With a block epilogue, each task multiplies into a buffer of its own block of C instead
/// and hands the finished block to `epi`; with a row epilogue, into C, then hands `epi` the
/// block's rows there.
///
/// With `prepacked` (all of `b` packed by [`pack_all`]), nothing is packed or prefetched
/// from B.
#[allow(clippy::too_many_arguments)]
unsafe fn drive<K: Micro>(
    a: MatRef,
    b: MatRef,
    prepacked: Option<&[f32]>,
    c: *mut f32,
    bias: Option<&[f32]>,
    accumulate: bool,
    epi: Option<Epi>,
) {
    debug_assert!(epi.is_none() || !accumulate);
    let block_epi = match epi {
        Some(Epi::Block(e)) => Some(e),
        _ => None,
    };
    let (mr_, nr_) = (K::MR, K::NR);
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let panels = n.div_ceil(nr_);
    let blocks = k.div_ceil(KC);
    let s = split(m, n, k, rayon::current_num_threads(), (mr_, nr_));
    let direct_b = prepacked.is_none() && reads_b_in_place(&b, m);
    // Whether panel `j` is read in place (only full panels are).
    let in_place = |j: usize| direct_b && (j + 1) * nr_ <= n;
    // Whether the tasks pack their own panels (one task per column range).
    let local_b = prepacked.is_none() && !direct_b && m.div_ceil(s.row_tiles * mr_) == 1;
    // Packed panels per depth block: all of them, or with `direct_b` only the last, partial
    // one; none with `local_b` or `prepacked`.
    let packed_panels = match (local_b || prepacked.is_some(), direct_b) {
        (true, _) => 0,
        (false, true) => 1,
        (false, false) => panels,
    };
    let packed_len = k * packed_panels * nr_;
    let (row_chunks, col_chunks) = (m.div_ceil(s.row_tiles * mr_), panels.div_ceil(s.col_panels));
    let mt = m.div_ceil(mr_);
    // Row range `ti`: its first row and its row count. The tiles are dealt out evenly (86
    // tiles in 6 ranges are 14 or 15 each, not five of 15 and one of 11), so equal tasks
    // finish together.
    let row_range = |ti: usize| {
        let (t0, t1) = (ti * mt / row_chunks, (ti + 1) * mt / row_chunks);
        (t0 * mr_, (t1 * mr_).min(m) - t0 * mr_)
    };
    // A that is not row-major is packed whole; with several column ranges per row range,
    // every task of a row range would pack the same rows again (4 times over for a weight
    // gradient of the `small` preset), so then all of A is packed once, up front: block `q`
    // (depth `kc`) of row tile `t` at `q·KC·MT·MR + t·kc·MR`.
    let shared_a = a.cs != 1 && col_chunks > 1;
    let shared_len = if shared_a { mt * mr_ * k } else { 0 };
    // Where block `q` (depth `kc`) of packed panel `j` starts: `q·KC·panels·NR + j·kc·NR`,
    // or `q·KC·NR` for the one panel packed with `direct_b`.
    let slot = |q: usize, j: usize, kc: usize| {
        if direct_b {
            q * KC * nr_
        } else {
            q * KC * panels * nr_ + j * kc * nr_
        }
    };
    with_buffer(&PACKED_B, packed_len + shared_len, |buf| {
        let (pb, sa) = buf.split_at_mut(packed_len);
        if shared_a {
            let units: Vec<(usize, usize)> =
                (0..blocks).flat_map(|q| (0..row_chunks).map(move |ti| (q, ti))).collect();
            let sa_ptr = SendPtr(sa.as_mut_ptr());
            crate::cpu::for_each_task(units.len(), |u| {
                let (q, ti) = units[u];
                let kc = KC.min(k - q * KC);
                let (i0, mc) = row_range(ti);
                // SAFETY: the units' ranges are disjoint and inside `sa` (`shared_len` covers
                // every block of every row tile).
                let out = unsafe {
                    std::slice::from_raw_parts_mut(
                        sa_ptr.get().add(q * KC * mt * mr_ + i0 * kc),
                        mc.div_ceil(mr_) * kc * mr_,
                    )
                };
                K::pack_a(&a, i0, mc, q * KC, kc, out);
            });
        }
        let sa: &[f32] = sa;
        let chunks: Vec<(usize, usize)> = match local_b || prepacked.is_some() {
            true => Vec::new(),
            false => {
                (0..blocks).flat_map(|q| (0..panels).filter(|&j| !in_place(j)).map(move |j| (q, j))).collect()
            }
        };
        let pb_ptr = SendPtr(pb.as_mut_ptr());
        let pack = |&(q, j): &(usize, usize)| {
            let kc = KC.min(k - q * KC);
            let start = slot(q, j, kc);
            // SAFETY: chunks are disjoint and inside `pb` (packed_len covers every packed
            // block); the CPU has K's instruction set (the caller's promise).
            unsafe {
                let out = std::slice::from_raw_parts_mut(pb_ptr.get().add(start), kc * nr_);
                K::pack_b(&b, q * KC, kc, j * nr_, out);
            }
        };
        if (packed_len as f64) * (m as f64) > 2e6 {
            crate::cpu::for_each_task(chunks.len(), |i| pack(&chunks[i]));
        } else {
            chunks.iter().for_each(pack);
        }
        let pb: &[f32] = prepacked.unwrap_or(pb);
        let tasks: Vec<(usize, usize)> =
            (0..row_chunks).flat_map(|ti| (0..col_chunks).map(move |tj| (ti, tj))).collect();
        let c_ptr = SendPtr(c);
        let run = |&(ti, tj): &(usize, usize)| {
            let (i0, mc) = row_range(ti);
            let (j0, j1) = (tj * panels / col_chunks, (tj + 1) * panels / col_chunks);
            // Rows stored contiguously are read in place by the microkernel; only a
            // partial last tile (and other layouts) go through the packing buffer.
            let tiles = mc.div_ceil(mr_);
            let full = if a.cs == 1 { mc / mr_ } else { 0 };
            let panel_len = if local_b { KC * nr_ } else { 0 };
            // With a block epilogue, C is this task's block: `tiles·MR` rows of `width` values.
            let width = (j1 - j0) * nr_;
            let block_len = if block_epi.is_some() { tiles * mr_ * width } else { 0 };
            let pa_len = if shared_a { 0 } else { tiles * mr_ * KC };
            with_buffer(&PACKED_A, pa_len + panel_len + block_len, |buf| {
                let (pa, rest) = buf.split_at_mut(pa_len);
                let (panel, block) = rest.split_at_mut(panel_len);
                let (c_base, ldc, c_row0, c_col0) = match block_epi {
                    Some(_) => (block.as_mut_ptr(), width, i0, j0 * nr_),
                    None => (c_ptr.get(), n, 0, 0),
                };
                for q in 0..blocks {
                    let kc = KC.min(k - q * KC);
                    if full < tiles && !shared_a {
                        K::pack_a(&a, i0 + full * mr_, mc - full * mr_, q * KC, kc, pa);
                    }
                    let load_c = accumulate || q > 0;
                    let bias_ptr = match bias {
                        Some(bias) if q == 0 => bias.as_ptr(),
                        _ => std::ptr::null(),
                    };
                    for j in j0..j1 {
                        let col = j * nr_;
                        let nr = nr_.min(n - col);
                        // The next panel this task reads from B (unpacked), fetched while
                        // this one is multiplied: a panel is `kc` separate cache lines of a
                        // weight that comes from memory, which packing alone waits on.
                        let span = j1 - j0;
                        let at = q * span + (j - j0) + 1;
                        let next = (at < blocks * span).then(|| (at / span, j0 + at % span));
                        let next = next.filter(|&(_, nj)| local_b || in_place(nj) || prepacked.is_some());
                        let next_kc = next.map_or(0, |(nq, _)| KC.min(k - nq * KC));
                        let per_tile = next_kc.div_ceil(tiles);
                        // SAFETY (this block): tile (row.., col..) lies inside c and belongs
                        // to this task; a full direct tile reads rows row..row + MR of `a`;
                        // the packed panels lie inside `pa`, `pb` or `panel`; the CPU has K's
                        // instruction set (the caller's promise).
                        unsafe {
                            let (bp, ldb) = if in_place(j) {
                                (b.data.as_ptr().add(b.off + q * KC * b.rs + col), b.rs)
                            } else if local_b {
                                K::pack_b(&b, q * KC, kc, col, &mut panel[..kc * nr_]);
                                (panel.as_ptr(), nr_)
                            } else {
                                (pb.as_ptr().add(slot(q, j, kc)), nr_)
                            };
                            let bias = if bias_ptr.is_null() { bias_ptr } else { bias_ptr.add(col) };
                            for t in 0..tiles {
                                if let Some((nq, nj)) = next {
                                    let p = (t * per_tile).min(next_kc);
                                    let p1 = (p + per_tile).min(next_kc);
                                    match prepacked {
                                        // Packed steps are `NR` values each, one after another.
                                        Some(pb) => {
                                            prefetch_lines(&pb[slot(nq, nj, next_kc)..][p * nr_..p1 * nr_])
                                        }
                                        None => prefetch_panel(&b, nq * KC + p, p1 - p, nj * nr_, nr_),
                                    }
                                }
                                let row = i0 + t * mr_;
                                let mr = mr_.min(m - row);
                                let cp = c_base.add((row - c_row0) * ldc + col - c_col0);
                                if t < full {
                                    let ap = a.data.as_ptr().add(a.off + row * a.rs + q * KC);
                                    K::kernel::<true>(kc, ap, a.rs, bp, ldb, cp, ldc, mr, nr, load_c, bias);
                                } else {
                                    let ap = match shared_a {
                                        true => sa.as_ptr().add(q * KC * mt * mr_ + row * kc),
                                        false => pa.as_ptr().add((t - full) * kc * mr_),
                                    };
                                    K::kernel::<false>(kc, ap, 0, bp, ldb, cp, ldc, mr, nr, load_c, bias);
                                }
                            }
                        }
                    }
                }
                let col0 = j0 * nr_;
                let cols = width.min(n - col0);
                match epi {
                    Some(Epi::Block(epi)) => epi(i0, mc, col0, cols, block, width),
                    Some(Epi::Rows(epi)) => {
                        for i in i0..i0 + mc {
                            // SAFETY: this task wrote rows i0..i0 + mc × columns col0..col0 +
                            // cols of C, which no other task touches; C has m × n values.
                            let row = unsafe {
                                std::slice::from_raw_parts_mut(c_ptr.get().add(i * n + col0), cols)
                            };
                            epi(i, col0, row);
                        }
                    }
                    None => {}
                }
            });
        };
        crate::cpu::for_each_task(tasks.len(), |i| run(&tasks[i]));
    });
}

/// Prefetches the cache lines of `values`.
fn prefetch_lines(values: &[f32]) {
    for line in values.chunks(16) {
        // SAFETY: prefetching never faults; the address lies inside the slice anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
}

/// Prefetches the values of B that a panel (`kc` steps from `p0`, `nr` columns from `j0`)
/// packs or reads, one touch per cache line.
fn prefetch_panel(b: &MatRef, p0: usize, kc: usize, j0: usize, nr: usize) {
    let nr = nr.min(b.cols - j0);
    let base = b.data.as_ptr().wrapping_add(b.off);
    let touch = |i: usize, j: usize| {
        // SAFETY: prefetching never faults; the address lies inside the view anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(i * b.rs + j * b.cs).cast()) };
    };
    if kc == 0 {
        return;
    }
    if b.cs == 1 {
        let straddles = |p: usize| {
            let first = base.wrapping_add(p * b.rs + j0) as usize;
            first / 64 != (first + 4 * (nr - 1)) / 64
        };
        for p in p0..p0 + kc {
            touch(p, j0);
            if straddles(p) {
                touch(p, j0 + nr - 1);
            }
        }
    } else if b.rs == 1 {
        for c in j0..j0 + nr {
            for p in (p0..p0 + kc).step_by(16) {
                touch(p, c);
            }
            touch(p0 + kc - 1, c);
        }
    }
}
