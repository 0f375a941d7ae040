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
/// itself, just before its row tiles use it, instead of all of B going to a packed copy in
/// memory and back (at 128 rows that round trip cost as much as a fifth of the product).
///
/// A panel of row-major B is `KC` pieces of a cache line or two from as many rows, each a
/// separate miss when B is a weight coming from memory (once per pass in training), and the
/// hardware prefetcher does not follow such strides. So a task packs all its panels of a
/// depth block at once, row by row ([`pack_b_rows`]): each row of its column range is one
/// contiguous run, which the prefetcher does follow. `bench_gemm --cold`, 2 threads:
/// 128 × 768 × 2304 198 → 231 GFLOP/s, 128 × 3072 × 768 198 → 210, 128 × 768 × 768 190 → 210;
/// `bench ppo --preset gpt2`, 3 alternating pairs: 8.54 → 8.28 s. The rows of the task's next
/// depth block are prefetched into L2 while this block's tiles run, an even share after each
/// tile, so that its packing finds them there: `bench_gemm --cold`, 3 alternating runs,
/// 128 × 768 × 768 184 → 215 GFLOP/s, 128 × 768 × 2304 197 → 209, 128 × 768 × 3072 199 → 213,
/// 128 × 3072 × 768 207 → 214. (Only each row's first line, for the hardware prefetcher to
/// follow, gained nothing; every other line was slower; into L1 instead of L2 the same.)
/// (Packing panel by panel, the next panel's lines were prefetched while a panel's tiles ran,
/// a share before each tile: all at once filled the miss buffers and stalled the kernel. That
/// still holds for column-major B packed in the tasks, whose columns are contiguous runs
/// already, and for the panels read in place.)
///
/// With a block epilogue, each task multiplies into a buffer of its own block of C instead
/// and hands the finished block to `epi`; with a row epilogue, into C, then hands `epi` the
/// block's rows there.
///
/// With `prepacked` (all of `b` packed by [`pack_all`]), nothing is packed or prefetched
/// from B: prefetching the next packed panel, as for the panels read unpacked, made the
/// `small` preset's generation 4% slower (its prefetches stalled on the line-fill buffers
/// while the weights streamed from L3).
///
/// What is packed where and how the output is cut into tasks is decided up front ([`Plan`]);
/// the tasks run [`Plan::run_task`].
///
/// # Safety
/// As [`sgemm`], for `K`'s instruction set.
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
    let plan = Plan::new::<K>(&a, &b, prepacked.is_some());
    with_buffer(&PACKED_B, plan.packed_len + plan.shared_len, |buf| {
        let (pb, sa) = buf.split_at_mut(plan.packed_len);
        if plan.shared_a {
            plan.pack_all_of_a::<K>(&a, sa);
        }
        if !plan.local_b && prepacked.is_none() {
            // SAFETY: the CPU has K's instruction set (the caller's promise).
            unsafe { plan.pack_b_up_front::<K>(&b, pb) };
        }
        let ops = Operands { a, b, pb: prepacked.unwrap_or(pb), sa, c: SendPtr(c), bias, accumulate, epi };
        let tasks: Vec<(usize, usize)> =
            (0..plan.row_chunks).flat_map(|ti| (0..plan.col_chunks).map(move |tj| (ti, tj))).collect();
        // SAFETY: the tasks' blocks of C are disjoint; the rest as the caller promised.
        crate::cpu::for_each_task(tasks.len(), |i| unsafe { plan.run_task::<K>(&ops, tasks[i]) });
    });
}

/// How [`drive`] cuts a product up and where its packed operands go, decided before any work.
struct Plan {
    m: usize,
    k: usize,
    n: usize,
    mr: usize,
    nr: usize,
    /// `NR`-wide panels of B.
    panels: usize,
    /// `KC`-deep blocks of the depth.
    blocks: usize,
    /// `MR`-high tiles of A.
    mt: usize,
    row_chunks: usize,
    col_chunks: usize,
    /// The full panels of B are read in place ([`reads_b_in_place`]).
    direct_b: bool,
    /// The tasks pack their own panels of B (one task per column range).
    local_b: bool,
    /// With `local_b`, B is row-major and each task packs all its panels of a depth block at
    /// once, row by row ([`pack_b_rows`]).
    local_rows: bool,
    /// A is packed whole, once, up front: block `q` (depth `kc`) of row tile `t` at
    /// `q·KC·MT·MR + t·kc·MR`.
    shared_a: bool,
    /// Values of B packed up front.
    packed_len: usize,
    /// Values of A packed up front.
    shared_len: usize,
}

/// The operands of a product, as its tasks read them: `pb` is B packed (up front or by the
/// caller), `sa` A packed up front (both empty where not used).
struct Operands<'a> {
    a: MatRef<'a>,
    b: MatRef<'a>,
    pb: &'a [f32],
    sa: &'a [f32],
    c: SendPtr<f32>,
    bias: Option<&'a [f32]>,
    accumulate: bool,
    epi: Option<Epi<'a>>,
}

impl Plan {
    fn new<K: Micro>(a: &MatRef, b: &MatRef, prepacked: bool) -> Plan {
        let (mr, nr) = (K::MR, K::NR);
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let panels = n.div_ceil(nr);
        let s = split(m, n, k, rayon::current_num_threads(), (mr, nr));
        let direct_b = !prepacked && reads_b_in_place(b, m);
        let row_chunks = m.div_ceil(s.row_tiles * mr);
        let col_chunks = panels.div_ceil(s.col_panels);
        let local_b = !prepacked && !direct_b && row_chunks == 1;
        // Packed panels per depth block: all of them, or with `direct_b` only the last,
        // partial one; none with `local_b` or `prepacked`.
        let packed_panels = match (local_b || prepacked, direct_b) {
            (true, _) => 0,
            (false, true) => 1,
            (false, false) => panels,
        };
        // A that is not row-major is packed whole; with several column ranges per row range,
        // every task of a row range would pack the same rows again (4 times over for a weight
        // gradient of the `small` preset), so then all of A is packed once, up front.
        let shared_a = a.cs != 1 && col_chunks > 1;
        let mt = m.div_ceil(mr);
        Plan {
            m,
            k,
            n,
            mr,
            nr,
            panels,
            blocks: k.div_ceil(KC),
            mt,
            row_chunks,
            col_chunks,
            direct_b,
            local_b,
            local_rows: local_b && b.cs == 1,
            shared_a,
            packed_len: k * packed_panels * nr,
            shared_len: if shared_a { mt * mr * k } else { 0 },
        }
    }

    /// The depth of block `q`.
    fn kc(&self, q: usize) -> usize {
        KC.min(self.k - q * KC)
    }

    /// Whether panel `j` is read in place (only full panels are).
    fn in_place(&self, j: usize) -> bool {
        self.direct_b && (j + 1) * self.nr <= self.n
    }

    /// Row range `ti`: its first row and its row count. The tiles are dealt out evenly (86
    /// tiles in 6 ranges are 14 or 15 each, not five of 15 and one of 11), so equal tasks
    /// finish together.
    fn row_range(&self, ti: usize) -> (usize, usize) {
        let (t0, t1) = (ti * self.mt / self.row_chunks, (ti + 1) * self.mt / self.row_chunks);
        (t0 * self.mr, (t1 * self.mr).min(self.m) - t0 * self.mr)
    }

    /// Where block `q` (depth `kc`) of packed panel `j` starts: `q·KC·panels·NR + j·kc·NR`,
    /// or `q·KC·NR` for the one panel packed with `direct_b`.
    fn slot(&self, q: usize, j: usize, kc: usize) -> usize {
        if self.direct_b {
            q * KC * self.nr
        } else {
            q * KC * self.panels * self.nr + j * kc * self.nr
        }
    }

    /// Packs all of A into `sa` (`shared_len` values), in parallel by depth block and row range.
    fn pack_all_of_a<K: Micro>(&self, a: &MatRef, sa: &mut [f32]) {
        let units: Vec<(usize, usize)> =
            (0..self.blocks).flat_map(|q| (0..self.row_chunks).map(move |ti| (q, ti))).collect();
        let sa_ptr = SendPtr(sa.as_mut_ptr());
        crate::cpu::for_each_task(units.len(), |u| {
            let (q, ti) = units[u];
            let kc = self.kc(q);
            let (i0, mc) = self.row_range(ti);
            // SAFETY: the units' ranges are disjoint and inside `sa` (`shared_len` covers every
            // block of every row tile).
            let out = unsafe {
                std::slice::from_raw_parts_mut(
                    sa_ptr.get().add(q * KC * self.mt * self.mr + i0 * kc),
                    mc.div_ceil(self.mr) * kc * self.mr,
                )
            };
            K::pack_a(a, i0, mc, q * KC, kc, out);
        });
    }

    /// Packs the panels of B that are not read in place into `pb` (`packed_len` values), in
    /// parallel when the product is large enough to pay for it.
    ///
    /// # Safety
    /// The CPU has K's instruction set.
    unsafe fn pack_b_up_front<K: Micro>(&self, b: &MatRef, pb: &mut [f32]) {
        let chunks: Vec<(usize, usize)> = (0..self.blocks)
            .flat_map(|q| (0..self.panels).filter(|&j| !self.in_place(j)).map(move |j| (q, j)))
            .collect();
        let pb_ptr = SendPtr(pb.as_mut_ptr());
        let pack = |&(q, j): &(usize, usize)| {
            let kc = self.kc(q);
            // SAFETY: chunks are disjoint and inside `pb` (packed_len covers every packed
            // block); the CPU has K's instruction set (the caller's promise).
            unsafe {
                let out = std::slice::from_raw_parts_mut(pb_ptr.get().add(self.slot(q, j, kc)), kc * self.nr);
                K::pack_b(b, q * KC, kc, j * self.nr, out);
            }
        };
        if (self.packed_len as f64) * (self.m as f64) > 2e6 {
            crate::cpu::for_each_task(chunks.len(), |i| pack(&chunks[i]));
        } else {
            chunks.iter().for_each(pack);
        }
    }

    /// The panel that task `j0..j1` reads from B after panel `j` of depth block `q`, where it
    /// reads B unpacked (packing its own panels one by one, or in place), to be fetched while
    /// panel `j` is multiplied: a panel is `kc` separate cache lines of a weight that comes from
    /// memory, which packing alone waits on.
    fn next_panel(&self, q: usize, j: usize, j0: usize, j1: usize) -> Option<(usize, usize)> {
        let span = j1 - j0;
        let at = q * span + (j - j0) + 1;
        let next = (at < self.blocks * span).then(|| (at / span, j0 + at % span));
        next.filter(|&(_, nj)| (self.local_b && !self.local_rows) || self.in_place(nj))
    }

    /// Hands a task's finished block (rows `i0..i0 + mc` × columns `col0..col0 + cols`) to the
    /// epilogue: the task's `block` buffer (`width` values a row), or the rows in place in C.
    ///
    /// # Safety
    /// The task wrote that block of C, which no other task touches; C has `m × n` values.
    unsafe fn hand_over(
        ops: &Operands,
        i0: usize,
        mc: usize,
        col0: usize,
        cols: usize,
        block: &mut [f32],
        width: usize,
    ) {
        match ops.epi {
            Some(Epi::Block(epi)) => epi(i0, mc, col0, cols, block, width),
            Some(Epi::Rows(epi)) => {
                let n = ops.b.cols;
                for i in i0..i0 + mc {
                    // SAFETY: as the caller promised.
                    let row = unsafe { std::slice::from_raw_parts_mut(ops.c.get().add(i * n + col0), cols) };
                    epi(i, col0, row);
                }
            }
            None => {}
        }
    }

    /// Task `(ti, tj)`: rows `row_range(ti)` × column range `tj` of C, every depth block, then
    /// the epilogue on the finished block. Rows stored contiguously are read in place by the
    /// microkernel; only a partial last tile (and other layouts) go through the packing buffer.
    ///
    /// # Safety
    /// The CPU has K's instruction set; `ops` as [`drive`] was given them; no other task
    /// has the same `(ti, tj)`.
    unsafe fn run_task<K: Micro>(&self, ops: &Operands, (ti, tj): (usize, usize)) {
        let (mr_, nr_) = (self.mr, self.nr);
        let (a, n) = (&ops.a, self.n);
        let (i0, mc) = self.row_range(ti);
        let (j0, j1) = (tj * self.panels / self.col_chunks, (tj + 1) * self.panels / self.col_chunks);
        let tiles = mc.div_ceil(mr_);
        let full = if a.cs == 1 { mc / mr_ } else { 0 };
        let panel_len = match (self.local_b, self.local_rows) {
            (false, _) => 0,
            (true, false) => KC * nr_,
            (true, true) => KC * (j1 - j0) * nr_,
        };
        let block_epi = matches!(ops.epi, Some(Epi::Block(_)));
        // With a block epilogue, C is this task's block: `tiles·MR` rows of `width` values.
        let width = (j1 - j0) * nr_;
        let block_len = if block_epi { tiles * mr_ * width } else { 0 };
        let pa_len = if self.shared_a { 0 } else { tiles * mr_ * KC };
        with_buffer(&PACKED_A, pa_len + panel_len + block_len, |buf| {
            let (pa, rest) = buf.split_at_mut(pa_len);
            let (panel, block) = rest.split_at_mut(panel_len);
            let (c_base, ldc, c_row0, c_col0) = match block_epi {
                true => (block.as_mut_ptr(), width, i0, j0 * nr_),
                false => (ops.c.get(), n, 0, 0),
            };
            for q in 0..self.blocks {
                let kc = self.kc(q);
                if full < tiles && !self.shared_a {
                    K::pack_a(a, i0 + full * mr_, mc - full * mr_, q * KC, kc, pa);
                }
                if self.local_rows {
                    pack_b_rows(&ops.b, q * KC, kc, j0 * nr_, j1 - j0, nr_, panel);
                }
                // With `local_rows`, the rows of this task's next depth block are prefetched
                // while this block's tiles run, an even share after each tile.
                let ahead = match self.local_rows && q + 1 < self.blocks {
                    true => self.kc(q + 1),
                    false => 0,
                };
                let calls = (j1 - j0) * tiles;
                let load_c = ops.accumulate || q > 0;
                let bias_ptr = match ops.bias {
                    Some(bias) if q == 0 => bias.as_ptr(),
                    _ => std::ptr::null(),
                };
                for j in j0..j1 {
                    let col = j * nr_;
                    let nr = nr_.min(n - col);
                    let next = self.next_panel(q, j, j0, j1);
                    let next_kc = next.map_or(0, |(nq, _)| self.kc(nq));
                    let per_tile = next_kc.div_ceil(tiles);
                    // SAFETY (this block): tile (row.., col..) lies inside c and belongs to this
                    // task; a full direct tile reads rows row..row + MR of `a`; the packed panels
                    // lie inside `pa`, `pb` or `panel`; the CPU has K's instruction set (the
                    // caller's promise).
                    unsafe {
                        let (bp, ldb) = if self.in_place(j) {
                            (ops.b.data.as_ptr().add(ops.b.off + q * KC * ops.b.rs + col), ops.b.rs)
                        } else if self.local_rows {
                            (panel.as_ptr().add((j - j0) * kc * nr_), nr_)
                        } else if self.local_b {
                            K::pack_b(&ops.b, q * KC, kc, col, &mut panel[..kc * nr_]);
                            (panel.as_ptr(), nr_)
                        } else {
                            (ops.pb.as_ptr().add(self.slot(q, j, kc)), nr_)
                        };
                        let bias = if bias_ptr.is_null() { bias_ptr } else { bias_ptr.add(col) };
                        for t in 0..tiles {
                            if let Some((nq, nj)) = next {
                                let p = (t * per_tile).min(next_kc);
                                let p1 = (p + per_tile).min(next_kc);
                                prefetch_panel(&ops.b, nq * KC + p, p1 - p, nj * nr_, nr_);
                            }
                            let row = i0 + t * mr_;
                            let mr = mr_.min(self.m - row);
                            let cp = c_base.add((row - c_row0) * ldc + col - c_col0);
                            if t < full {
                                let ap = a.data.as_ptr().add(a.off + row * a.rs + q * KC);
                                K::kernel::<true>(kc, ap, a.rs, bp, ldb, cp, ldc, mr, nr, load_c, bias);
                            } else {
                                let ap = match self.shared_a {
                                    true => ops.sa.as_ptr().add(q * KC * self.mt * mr_ + row * kc),
                                    false => pa.as_ptr().add((t - full) * kc * mr_),
                                };
                                K::kernel::<false>(kc, ap, 0, bp, ldb, cp, ldc, mr, nr, load_c, bias);
                            }
                            if ahead > 0 {
                                let call = (j - j0) * tiles + t;
                                let (r0, r1) = (call * ahead / calls, (call + 1) * ahead / calls);
                                prefetch_rows(&ops.b, (q + 1) * KC + r0, r1 - r0, j0 * nr_, width);
                            }
                        }
                    }
                }
            }
            // SAFETY: this task wrote its block of C (the caller's promise for the rest).
            unsafe { Self::hand_over(ops, i0, mc, j0 * nr_, width.min(n - j0 * nr_), block, width) };
        });
    }
}

/// Packs `span` panels of row-major B (`nr` columns each from column `c0`, steps `p0..p0 + kc`)
/// into `out` (panel after panel, `kc × nr` each), reading B row by row: each row's
/// `span · nr` values are one contiguous run.
fn pack_b_rows(b: &MatRef, p0: usize, kc: usize, c0: usize, span: usize, nr: usize, out: &mut [f32]) {
    let width = (span * nr).min(b.cols - c0);
    for p in 0..kc {
        let s = b.off + (p0 + p) * b.rs + c0;
        let row = &b.data[s..s + width];
        for jj in 0..span {
            let dst = &mut out[jj * kc * nr + p * nr..][..nr];
            let src = &row[jj * nr..(jj * nr + nr).min(width)];
            if src.len() == nr {
                for (d, s) in dst.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                    if let (Ok(d), Ok(s)) = (<&mut [f32; 8]>::try_from(d), <&[f32; 8]>::try_from(s)) {
                        *d = *s;
                    }
                }
            } else {
                dst[..src.len()].copy_from_slice(src);
                dst[src.len()..].fill(0.0);
            }
        }
    }
}

/// Prefetches rows `p0..p0 + rows` of row-major B, columns `c0..c0 + width`, into L2, every
/// cache line.
fn prefetch_rows(b: &MatRef, p0: usize, rows: usize, c0: usize, width: usize) {
    let width = width.min(b.cols - c0);
    let base = b.data.as_ptr().wrapping_add(b.off) as usize;
    for p in p0..p0 + rows {
        let first = (base + 4 * (p * b.rs + c0)) / 64;
        let last = (base + 4 * (p * b.rs + c0 + width) - 1) / 64;
        for line in first..=last {
            // SAFETY: prefetching never faults; the lines hold values of the view anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T1>((line * 64) as *const i8) };
        }
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
