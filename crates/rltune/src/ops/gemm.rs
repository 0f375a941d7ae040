//! f32 matrix product `C = A·B (+ bias) (+ C)` with AVX-512 and AVX2 kernels, for strided
//! operands.
//!
//! candle's CPU matmul (the `gemm` crate) has only AVX2 kernels on stable Rust and, for the
//! shapes of a small transformer (512×256×768), runs at the same speed on one thread as on two.
//! This is a Goto/BLIS-style SGEMM: B is packed into `KC × NR` column panels, A into `MR × KC`
//! row panels (one packing pass each, which is also where any stride or transpose is absorbed),
//! and an `MR × NR` register-blocked microkernel runs over them. The output is split into
//! row × column tiles that rayon's threads take in turn. The epilogue adds an optional bias row
//! (`C = A·B + bias`) or accumulates into `C` (`C += A·B`), so neither needs a pass of its own.
//!
//! Two microkernels ([`Micro`]), picked once per process by what the CPU has:
//! - AVX-512F: `14 × 32` (28 of the 32 zmm registers accumulate). Blocking for a 48 KiB L1d and
//!   2 MiB L2: a `KC × NR` panel of packed B (`256 × 32 × 4 B = 32 KiB`) stays in L1 while the
//!   microkernel walks down the `MC × KC` block of packed A (`16·MR × KC × 4 B` = 224 KiB, in
//!   L2; up to 24·MR rows, 336 KiB, when one block spans all rows).
//! - AVX2 + FMA (AMD Zen, Intel before Skylake-SP): `6 × 16` (12 of the 16 ymm registers
//!   accumulate, two hold B, one the broadcast of A). A panel of B is 16 KiB (in a 32 KiB
//!   L1d), a block of A 96 KiB (144 KiB when one block spans all rows; in a 512 KiB L2).
//!
//! Inside a [`PackScope`] (generation's decoding steps), registered weights are packed once and
//! the plain f32 products ([`sgemm`], [`sgemm_new`]) read them packed; the packed buffers outlive
//! the scope for the next one.
//!
//! With [`MatmulPrecision::Bf16`] set, products whose sides are all at least 32 run on the AMX
//! kernel of `ops/amx.rs` instead (bf16 inputs, f32 accumulation).
//!
//! [`sgemm`] checks bounds once per operand and then reads through raw pointers. Without
//! either instruction set (see [`fast_available`]) it runs a plain loop; callers that care
//! about speed fall back to candle's matmul instead.

use rayon::prelude::*;

/// Depth of one packed block.
const KC: usize = 256;

/// A strided read-only matrix: element `(i, j)` is `data[off + i·rs + j·cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows × cols` matrix.
    #[cfg(test)]
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self { data, off: 0, rows, cols, rs: cols, cs: 1 }
    }

    /// The transpose (a view; nothing moves).
    pub fn t(self) -> Self {
        Self { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }

    /// Whether every element the view addresses lies inside `data`.
    fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|r| (self.cols - 1).checked_mul(self.cs).and_then(|c| r.checked_add(c)))
            .and_then(|x| x.checked_add(self.off));
        matches!(last, Some(l) if l < self.data.len())
    }

    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[self.off + i * self.rs + j * self.cs]
    }
}

/// How f32 matrix products run on the CPU (process-wide; see [`set_matmul_precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulPrecision {
    /// f32 inputs, f32 accumulation: the default, and what TRL computes.
    #[default]
    F32,
    /// Inputs rounded to bf16, products accumulated in f32, on Intel AMX tiles (Sapphire
    /// Rapids and newer): what PyTorch's CPU autocast does with bf16. Products with a side
    /// shorter than 32 stay in f32, as does everything that is not a matrix product.
    Bf16,
}

impl MatmulPrecision {
    /// The name used on the command line and in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for MatmulPrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Self::F32, Self::Bf16]
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown matmul precision {s:?}: expected \"f32\" or \"bf16\""))
    }
}

static BF16: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets how f32 matrix products run from now on, in the whole process (like PyTorch's
/// `torch.set_float32_matmul_precision`). [`MatmulPrecision::Bf16`] is an error where the CPU
/// or OS has no AMX-BF16, naming what is missing; it changes results at the level of bf16
/// rounding (about 3 significant digits per input), so runs are not bit-comparable with f32.
/// CUDA tensors are not affected.
pub fn set_matmul_precision(p: MatmulPrecision) -> crate::Result<()> {
    if p == MatmulPrecision::Bf16 && !super::amx::available() {
        return Err(crate::Error::Unsupported(
            "matmul precision bf16 needs Intel AMX-BF16 (Xeon Sapphire Rapids or newer) on Linux \
             5.16 or newer, and this machine has none; use f32 (the default)"
                .into(),
        ));
    }
    BF16.store(p == MatmulPrecision::Bf16, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The precision set by [`set_matmul_precision`] (f32 until then).
pub fn matmul_precision() -> MatmulPrecision {
    if BF16.load(std::sync::atomic::Ordering::Relaxed) {
        MatmulPrecision::Bf16
    } else {
        MatmulPrecision::F32
    }
}

/// Whether this product runs on AMX: bf16 precision set and every side at least one
/// 32-wide block (below that the tiles would be mostly padding).
fn on_amx(m: usize, k: usize, n: usize) -> bool {
    m >= 32 && k >= 32 && n >= 32 && matmul_precision() == MatmulPrecision::Bf16
}

/// The instruction set the SGEMM runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    /// Columns of one microkernel call.
    #[cfg(target_arch = "x86_64")]
    fn nr(self) -> usize {
        match self {
            Isa::Avx512 => <x86::Avx512 as x86::Micro>::NR,
            Isa::Avx2 => <x86::Avx2 as x86::Micro>::NR,
        }
    }
}

/// The widest kernel this CPU runs (checked once), or `None` for the plain loop.
fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ISA: OnceLock<Option<Isa>> = OnceLock::new();
        *ISA.get_or_init(|| {
            if is_x86_feature_detected!("avx512f") {
                Some(Isa::Avx512)
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                Some(Isa::Avx2)
            } else {
                None
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Whether [`sgemm`] has a vector kernel on this CPU (AVX-512F, or AVX2 with FMA).
pub(crate) fn fast_available() -> bool {
    isa().is_some()
}

/// `c = a·b`, plus `bias` (one value per column) when given, or `c += a·b` when `accumulate`.
///
/// `c` is row-major `a.rows × b.cols`. Panics when the shapes disagree or a view reaches
/// outside its slice (callers build the views from candle layouts, so this is a bug).
pub(crate) fn sgemm(a: MatRef, b: MatRef, c: &mut [f32], bias: Option<&[f32]>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    check_args(&a, &b, bias, accumulate);
    assert_eq!(c.len(), m * n, "sgemm: output has the wrong size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(n) {
                match bias {
                    Some(bias) => row.copy_from_slice(bias),
                    None => row.fill(0.0),
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = isa() {
        if on_amx(m, k, n) {
            // SAFETY: set_matmul_precision checked AMX; views checked above; c has m × n values.
            unsafe { super::amx::sgemm(a, b, c.as_mut_ptr(), bias, accumulate) };
            return;
        }
        if let Some(pb) = prepacked(&b, isa) {
            // SAFETY: as below; `pb` is `b` packed for `isa`.
            unsafe { x86::sgemm_prepacked(isa, a, b, pb.values(), c.as_mut_ptr(), bias, accumulate) };
            return;
        }
        if swap_pays(&a, &b, isa.nr()) {
            let ct = sgemm_new(b.t(), a.t(), None);
            transpose_into(&ct, n, m, c, bias, accumulate);
            return;
        }
        // SAFETY: the CPU has `isa`; the views were checked above and `c` has m × n values.
        unsafe { x86::sgemm(isa, a, b, c.as_mut_ptr(), bias, accumulate) };
        return;
    }
    sgemm_ref(a, b, c, bias, accumulate);
}

/// What [`sgemm_epilogue`] hands its consumer: a finished block of the product, rows `i0..i0 +
/// rows` × columns `j0..j0 + cols`, row `r` at `block[r·ld..r·ld + cols]` (scratch of the GEMM's,
/// which the consumer may overwrite).
pub(crate) type Epilogue<'a> = dyn Fn(usize, usize, usize, usize, &mut [f32], usize) + Sync + 'a;

/// `a·b` (plus `bias`, one value per column, when given) handed to `epi` block by block, each
/// block once, while it is still in cache, and never stored as a whole (a weight gradient
/// consumed by the optimizer in place: see `grad_sink::gemm_into_sink`). Blocks are disjoint
/// and may be handed over from several threads at once. Values equal [`sgemm`]'s bit for bit
/// (the same kernel and depth order), but only the f32 kernels are used (no AMX, no transposed
/// product).
pub(crate) fn sgemm_epilogue(a: MatRef, b: MatRef, bias: Option<&[f32]>, epi: &Epilogue) {
    // SAFETY: `c` is unused with a block epilogue.
    if unsafe { epilogue_product(a, b, bias, std::ptr::null_mut(), Epi::Block(epi)) } {
        return;
    }
    let (m, n) = (a.rows, b.cols);
    let mut c = vec![0f32; m * n];
    sgemm_ref(a, b, &mut c, bias, false);
    epi(0, m, 0, n, &mut c, n);
}

/// What [`sgemm_rows_then`] hands its consumer: row `i` of the product, columns `j0..j0 +
/// row.len()`, in place in the output.
pub(crate) type RowEpilogue<'a> = dyn Fn(usize, usize, &mut [f32]) + Sync + 'a;

/// `c = a·b` (plus `bias`, one value per column, when given), written in place like [`sgemm`]'s,
/// and each task's finished block handed to `epi` row by row while it is still in cache (GELU
/// turning the MLP's product into its activation next to it, or the MLP's backward scaling the
/// product by GELU's derivative in place). Each row segment is handed over once, possibly from
/// several threads at once. The product's values equal [`sgemm`]'s bit for bit (the same kernel
/// and depth order), but only the f32 kernels are used (no AMX, no transposed product). `c` may
/// be uninitialized memory of `a.rows × b.cols` values (every value is written before `epi`
/// sees it).
///
/// # Safety
/// `c` points to `a.rows × b.cols` writable values that nothing else reads or writes during
/// the call.
pub(crate) unsafe fn sgemm_rows_then(
    a: MatRef,
    b: MatRef,
    bias: Option<&[f32]>,
    c: *mut f32,
    epi: &RowEpilogue,
) {
    // SAFETY: `c` has m × n values (the caller's promise).
    if unsafe { epilogue_product(a, b, bias, c, Epi::Rows(epi)) } {
        return;
    }
    let (m, n) = (a.rows, b.cols);
    let mut out = vec![0f32; m * n];
    sgemm_ref(a, b, &mut out, bias, false);
    for (i, row) in out.chunks_mut(n).enumerate() {
        epi(i, 0, row);
    }
    // SAFETY: `c` has m × n values (the caller's promise); `out` is a separate buffer.
    unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), c, m * n) };
}

/// The shared part of [`sgemm_epilogue`] and [`sgemm_rows_then`]: checks the views, then runs
/// the f32 kernels with `epi`; `false` (nothing done) where they do not apply (no fast SGEMM,
/// zero depth) and the caller computes the product itself.
///
/// # Safety
/// With [`Epi::Rows`], `c` as for [`sgemm_rows_then`].
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn epilogue_product(a: MatRef, b: MatRef, bias: Option<&[f32]>, c: *mut f32, epi: Epi) -> bool {
    check_args(&a, &b, bias, false);
    if a.rows == 0 || b.cols == 0 {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = isa().filter(|_| a.cols > 0) {
        // SAFETY: the CPU has `isa`, the views were checked, and `c` is unused (block epilogue)
        // or has m × n values (the caller's promise).
        unsafe { x86::sgemm_with(isa, a, b, c, bias, false, Some(epi)) };
        return true;
    }
    false
}

/// How a product's finished blocks reach a consumer: copied into a scratch block
/// ([`sgemm_epilogue`]) or row by row in place in C ([`sgemm_rows_then`]).
#[derive(Clone, Copy)]
enum Epi<'a> {
    Block(&'a Epilogue<'a>),
    Rows(&'a RowEpilogue<'a>),
}

/// Whether to compute `Cᵀ = Bᵀ·Aᵀ` instead: when B is column-major (a transposed weight, as in
/// `x·Wᵀ`) and A has few rows, packing B costs more than the product itself (per value of B,
/// 2m FLOPs against a gather). `Bᵀ` is row-major and the microkernel reads it in place, so
/// only the small `Aᵀ` is packed, and the result is transposed into place (16 rows against a
/// 768 × 50257 B, GPT-2's LM head, outside a [`PackScope`]). Measured on the bench shapes: a
/// loss for m = 512, a gain for m ≤ 128. `nr` is the microkernel's width.
#[cfg(target_arch = "x86_64")]
fn swap_pays(a: &MatRef, b: &MatRef, nr: usize) -> bool {
    b.rs == 1 && b.cs != 1 && a.rows <= 128 && b.cols > a.rows && b.cols >= nr
}

/// `c (m × n) = ctᵀ (+ bias) (+ c)` for `ct` row-major `n × m`, in 32 × 32 blocks, in parallel
/// over row blocks of `c`.
fn transpose_into(ct: &[f32], n: usize, m: usize, c: &mut [f32], bias: Option<&[f32]>, accumulate: bool) {
    const BLK: usize = 32;
    c.par_chunks_mut(BLK * n).enumerate().for_each(|(bi, rows)| {
        let i0 = bi * BLK;
        for j0 in (0..n).step_by(BLK) {
            let j1 = (j0 + BLK).min(n);
            for (i, row) in rows.chunks_exact_mut(n).enumerate() {
                let src = ct[j0 * m + i0 + i..].iter().step_by(m);
                let out = &mut row[j0..j1];
                match (accumulate, bias) {
                    (true, _) => out.iter_mut().zip(src).for_each(|(o, &v)| *o += v),
                    (false, Some(bias)) => {
                        out.iter_mut().zip(src).zip(&bias[j0..j1]).for_each(|((o, &v), &b)| *o = v + b)
                    }
                    (false, None) => out.iter_mut().zip(src).for_each(|(o, &v)| *o = v),
                }
            }
        }
    });
}

/// `a·b (+ bias)` into a new row-major vector, without zero-filling it first.
pub(crate) fn sgemm_new(a: MatRef, b: MatRef, bias: Option<&[f32]>) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    check_args(&a, &b, bias, false);
    #[cfg(target_arch = "x86_64")]
    let amx = on_amx(m, k, n);
    #[cfg(target_arch = "x86_64")]
    let packed = isa().filter(|_| m > 0 && n > 0 && k > 0 && !amx).and_then(|isa| prepacked(&b, isa));
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = isa()
        .filter(|&isa| m > 0 && n > 0 && k > 0 && (amx || packed.is_some() || !swap_pays(&a, &b, isa.nr())))
    {
        let mut c: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(m * n);
        // SAFETY: MaybeUninit needs no initialization; the views were checked above (and
        // set_matmul_precision checked AMX for the bf16 path).
        unsafe {
            c.set_len(m * n);
            let c = c.as_mut_ptr().cast::<f32>();
            if amx {
                super::amx::sgemm(a, b, c, bias, false);
            } else if let Some(pb) = &packed {
                x86::sgemm_prepacked(isa, a, b, pb.values(), c, bias, false);
            } else {
                x86::sgemm(isa, a, b, c, bias, false);
            }
        }
        // The first depth block stores every tile of C without reading it, so every value is
        // written; MaybeUninit<f32> and f32 have the same layout.
        let mut c = std::mem::ManuallyDrop::new(c);
        // SAFETY: same allocation, length and capacity; all values initialized (above).
        return unsafe { Vec::from_raw_parts(c.as_mut_ptr().cast::<f32>(), c.len(), c.capacity()) };
    }
    let mut c = vec![0f32; m * n];
    sgemm(a, b, &mut c, bias, false);
    c
}

/// B packed once, in the layout [`x86::drive`] packs all of B into (`KC`-deep blocks of `NR`-wide
/// panels), 64-byte aligned.
pub(crate) struct PackedB {
    buf: Vec<f32>,
    skip: usize,
}

impl PackedB {
    fn values(&self) -> &[f32] {
        &self.buf[self.skip..]
    }
}

/// Which view of which registered matrix a [`PackedB`] holds, for which kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackKey {
    start: usize,
    len: usize,
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
    isa: Isa,
}

/// The registry of a [`PackScope`]: the storage starts of its matrices and what was packed.
struct Packed {
    starts: Vec<usize>,
    done: Vec<(PackKey, std::rc::Rc<PackedB>)>,
}

thread_local! {
    /// The innermost live [`PackScope`] of this thread.
    static PREPACKED: std::cell::RefCell<Option<Packed>> = const { std::cell::RefCell::new(None) };
}

/// While alive, plain f32 products ([`sgemm`], [`sgemm_new`]; not the epilogue products nor AMX)
/// on this thread whose B is a view of one of the registered matrices read B packed once (on
/// first use, per view) instead of packing it in every product: for the
/// same weights multiplied by the same few rows many times, as in each decoding step of
/// generation. At 64 rows packing B in every product cost about a fifth of the product; at 16
/// rows (`gpt2`'s decoding) B was read in place (row-major) or multiplied transposed
/// (column-major), both bound by memory: a 32-column panel of a row-major weight is 2 cache
/// lines from each of `KC` rows, a pattern the hardware prefetcher does not follow, where a
/// packed panel is one contiguous run. Packed, `gpt2`'s 16-row products read their weights at
/// 14–15 GB/s instead of 5–6 (768 × 3072: 1.8 → 0.67 ms per product on the Xeon of
/// BENCHMARKS.md's sixteenth session; generation 1.81 → 0.99–1.02 s).
///
/// The registered tensors are kept alive (their storage cannot be freed and reused by other
/// data while the scope lives) and must not be written to while it lives: the packed copies
/// would go stale. Scopes nest; dropping one restores the one before.
///
/// Dropping a scope keeps its packed buffers on the thread for the next scope's copies of
/// matrices of the same sizes (the next generation's weights), so the packed size stays
/// allocated between generations (~475 MiB for GPT-2 small, 21 MiB for the `small` preset): a
/// fresh allocation is first touched page by page, which made packing 6–18× slower (a 768 ×
/// 3072 weight in 16 ms instead of 0.9, GPT-2's `wte` in 305 ms instead of 17, in a VM).
pub(crate) struct PackScope {
    _pins: Vec<candle_core::Tensor>,
    prev: Option<Packed>,
}

/// Opens a [`PackScope`] for `matrices` (f32 CPU tensors; others are ignored).
pub(crate) fn pack_scope(matrices: &[candle_core::Tensor]) -> PackScope {
    let starts = matrices
        .iter()
        .filter_map(|t| match &*t.storage_and_layout().0 {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => Some(v.as_ptr() as usize),
            _ => None,
        })
        .collect();
    let prev = PREPACKED.with(|p| p.replace(Some(Packed { starts, done: Vec::new() })));
    PackScope { _pins: matrices.to_vec(), prev }
}

impl Drop for PackScope {
    fn drop(&mut self) {
        let prev = self.prev.take();
        let mine = PREPACKED.with(|p| p.replace(prev));
        let bufs = mine.into_iter().flat_map(|p| p.done).filter_map(|(_, v)| std::rc::Rc::try_unwrap(v).ok());
        // The last scope's buffers replace (and free) those it did not take.
        SPARE.with(|s| *s.borrow_mut() = bufs.map(|v| v.buf).collect());
    }
}

thread_local! {
    /// The packed buffers of the last [`PackScope`] dropped on this thread, for the next one.
    static SPARE: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of `len` values: a spare one of that length (its values stale) or a new one (zeros).
fn spare_buffer(len: usize) -> Vec<f32> {
    SPARE.with(|s| {
        let mut s = s.borrow_mut();
        match s.iter().position(|b| b.len() == len) {
            Some(i) => s.swap_remove(i),
            None => vec![0f32; len],
        }
    })
}

/// `b` packed for `isa`, when a [`PackScope`] registered its storage (packed now on first use).
#[cfg(target_arch = "x86_64")]
fn prepacked(b: &MatRef, isa: Isa) -> Option<std::rc::Rc<PackedB>> {
    PREPACKED.with(|p| {
        let mut p = p.try_borrow_mut().ok()?;
        let p = p.as_mut()?;
        let start = b.data.as_ptr() as usize;
        if !p.starts.contains(&start) {
            return None;
        }
        let key = PackKey {
            start,
            len: b.data.len(),
            off: b.off,
            rows: b.rows,
            cols: b.cols,
            rs: b.rs,
            cs: b.cs,
            isa,
        };
        if let Some((_, v)) = p.done.iter().find(|(k, _)| *k == key) {
            return Some(v.clone());
        }
        // SAFETY: the CPU has `isa` (from `isa()`); the caller checked the view's bounds.
        let v = std::rc::Rc::new(unsafe { x86::pack_whole(isa, b) });
        p.done.push((key, v.clone()));
        Some(v)
    })
}

/// Runs `f` on the f32 CPU data of a rank-2 tensor as a [`MatRef`] (any strides); `None` for
/// other tensors.
pub(crate) fn with_matref<R>(t: &candle_core::Tensor, f: impl FnOnce(MatRef) -> R) -> Option<R> {
    let (s, l) = t.storage_and_layout();
    let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)), &[rows, cols]) = (&*s, l.dims())
    else {
        return None;
    };
    let st = l.stride();
    Some(f(MatRef { data, off: l.start_offset(), rows, cols, rs: st[0], cs: st[1] }))
}

/// The shape and bounds checks of [`sgemm`].
fn check_args(a: &MatRef, b: &MatRef, bias: Option<&[f32]>, accumulate: bool) {
    assert_eq!(b.rows, a.cols, "sgemm: inner dimensions differ");
    assert!(a.in_bounds() && b.in_bounds(), "sgemm: operand view out of bounds");
    assert!(!(accumulate && bias.is_some()), "sgemm: bias with accumulate");
    if let Some(bias) = bias {
        assert_eq!(bias.len(), b.cols, "sgemm: bias has the wrong size");
    }
}

/// The plain triple loop (f64 accumulation is not used: it would differ from the fast path).
pub(crate) fn sgemm_ref(a: MatRef, b: MatRef, c: &mut [f32], bias: Option<&[f32]>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f32;
            for p in 0..k {
                s += a.at(i, p) * b.at(p, j);
            }
            let o = &mut c[i * n + j];
            *o = match (accumulate, bias) {
                (true, _) => *o + s,
                (false, Some(bias)) => s + bias[j],
                (false, None) => s,
            };
        }
    }
}

/// A raw pointer that rayon tasks may share; they write disjoint tiles.
#[derive(Clone, Copy)]
pub(super) struct SendPtr<T>(pub(super) *mut T);
// SAFETY: tasks write disjoint regions, and the owner outlives the parallel section.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub(super) fn get(self) -> *mut T {
        self.0
    }
}

/// How the output is cut into tasks: `row_tiles × col_panels` microkernel tiles each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    row_tiles: usize,
    col_panels: usize,
}

/// Most row tiles kept in one task (so B is packed inside the tasks, see `x86::drive`).
const ONE_ROW_CHUNK: usize = 24;

/// Most row tiles kept in one task when B is at least 8 times wider than A is tall (the LM head's
/// forward, `h·Wᵀ` with `W` the vocabulary's embeddings): then B is by far the larger operand,
/// and with all rows in one chunk each of its panels is packed once, into L1, and used by every
/// row tile, instead of all of B going through a packed copy in memory that each row chunk reads
/// again. The `small` preset's LM head forward (384 × 256 × 8192, 28 tiles of 14 rows on
/// AVX-512) went from 601–646 to 546–587 ms over a benchmark run (3 alternating runs; the
/// microkernel from 70–73% to 83–86% of the FMA peak). Narrower products keep
/// [`ONE_ROW_CHUNK`]: at 36 tiles the minibatch's 496-row products were no faster, and `dh`
/// (384 × 8192 × 256, where A is the big operand) slower.
const ONE_ROW_CHUNK_WIDE: usize = 36;

/// Picks task sizes for an `mr × nr` microkernel: blocks that fit the caches (up to 16 row tiles
/// — or all of them, when there are at most [`ONE_ROW_CHUNK`], or [`ONE_ROW_CHUNK_WIDE`] for a
/// wide B — by 32 column panels, in chunks of even size), then halved until every thread has
/// about four tasks (rayon balances the rest), but no smaller than one tile.
fn split(m: usize, n: usize, k: usize, threads: usize, (mr, nr): (usize, usize)) -> Split {
    let (mt, nt) = (m.div_ceil(mr), n.div_ceil(nr));
    // Even chunks: 22 tiles are 2 × 11, not 16 + 6.
    let even = |tiles: usize, most: usize| tiles.div_ceil(tiles.div_ceil(most).max(1)).max(1);
    let one_chunk = mt <= ONE_ROW_CHUNK || (mt <= ONE_ROW_CHUNK_WIDE && n >= 8 * m);
    let rows = if one_chunk { mt.max(1) } else { even(mt, 16) };
    let mut s = Split { row_tiles: rows, col_panels: even(nt, 32) };
    // Below about 4 MFLOP per task the fork-join costs more than it saves.
    let min_flops = 4e6;
    let count = |s: Split| mt.div_ceil(s.row_tiles) * nt.div_ceil(s.col_panels);
    let flops = |s: Split| 2.0 * (s.row_tiles * mr * s.col_panels * nr * k) as f64;
    while threads > 1 && count(s) < 4 * threads {
        let halve_cols = s.col_panels > 1 && (s.col_panels * nr >= s.row_tiles * mr || s.row_tiles == 1);
        let next = if halve_cols {
            Split { col_panels: s.col_panels.div_ceil(2), ..s }
        } else if s.row_tiles > 1 {
            Split { row_tiles: s.row_tiles.div_ceil(2), ..s }
        } else {
            break;
        };
        if flops(next) < min_flops && count(s) >= threads {
            break;
        }
        s = next;
    }
    s
}

type Buffer = std::cell::RefCell<Vec<f32>>;

thread_local! {
    /// Packed B, on the calling thread.
    static PACKED_B: Buffer = const { Buffer::new(Vec::new()) };
    /// Packed A, on each task's thread.
    static PACKED_A: Buffer = const { Buffer::new(Vec::new()) };
}

/// A buffer of at least `len` values whose start is 64-byte aligned, reused per thread.
pub(super) fn with_buffer<T: Copy + Default, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    // Values per 64 bytes: enough slack to align the start.
    let pad = 64 / std::mem::size_of::<T>();
    let run = |v: &mut Vec<T>| {
        if v.len() < len + pad {
            *v = vec![T::default(); len + pad];
        }
        let skip = v.as_ptr().align_offset(64).min(pad - 1);
        f(&mut v[skip..skip + len])
    };
    key.with(|b| match b.try_borrow_mut() {
        Ok(mut v) => run(&mut v),
        // Re-entered on this thread (a rayon task nested in another): use a fresh buffer.
        Err(_) => run(&mut Vec::new()),
    })
}

/// Packs rows `i0..i0 + mc` × columns `p0..p0 + kc` of `a` into `MR`-row panels: panel `t`,
/// step `p`, row `r` at `t·kc·MR + p·MR + r`; rows past the end are zero.
fn pack_a<const MR: usize>(a: &MatRef, i0: usize, mc: usize, p0: usize, kc: usize, out: &mut [f32]) {
    let full = mc / MR;
    if a.rs == 1 && full > 1 {
        // Column-major: step by step, the full panels' values of a step are one contiguous run
        // of the stored matrix, read once. Panel by panel, each step reads MR values from a
        // different cache line, `kc` lines per panel at a stride of `cs` values; at a stride of
        // a power of two (the LM head's `dlogitsᵀ`, 8192 values) those lines share one L1 set,
        // so the next panel may find them evicted. (Measured within noise: `bench_gemm
        // --trans-a` 8192×384×256, 137 → 140 GFLOP/s.)
        for p in 0..kc {
            let s = a.off + i0 + (p0 + p) * a.cs;
            for (t, src) in a.data[s..s + full * MR].chunks_exact(MR).enumerate() {
                let at = t * kc * MR + p * MR;
                if let (Ok(dst), Ok(src)) =
                    (<&mut [f32; MR]>::try_from(&mut out[at..at + MR]), <&[f32; MR]>::try_from(src))
                {
                    *dst = *src;
                }
            }
        }
        if full * MR < mc {
            pack_a::<MR>(a, i0 + full * MR, mc - full * MR, p0, kc, &mut out[full * kc * MR..]);
        }
        return;
    }
    for (t, panel) in out[..mc.div_ceil(MR) * kc * MR].chunks_exact_mut(kc * MR).enumerate() {
        let r0 = i0 + t * MR;
        let rows = MR.min(i0 + mc - r0);
        if a.rs == 1 && rows == MR {
            // Column-major (a transposed row-major matrix): each step is MR contiguous values,
            // copied as a fixed-size array (`copy_from_slice` of a runtime length was a call to
            // memmove per 24 bytes: 3.6% of the `small` preset's time).
            for (p, dst) in panel.chunks_exact_mut(MR).enumerate() {
                let s = a.off + r0 + (p0 + p) * a.cs;
                if let (Ok(dst), Ok(src)) =
                    (<&mut [f32; MR]>::try_from(dst), <&[f32; MR]>::try_from(&a.data[s..s + MR]))
                {
                    *dst = *src;
                }
            }
        } else {
            if rows < MR {
                panel.fill(0.0);
            }
            for r in 0..rows {
                let base = a.off + (r0 + r) * a.rs + p0 * a.cs;
                if a.cs == 1 {
                    let src = &a.data[base..base + kc];
                    for (p, &v) in src.iter().enumerate() {
                        panel[p * MR + r] = v;
                    }
                } else {
                    for p in 0..kc {
                        panel[p * MR + r] = a.data[base + p * a.cs];
                    }
                }
            }
        }
    }
}

/// Packs rows `p0..p0 + kc` × the `NR` columns from `j0` of `b` into one panel: step `p`,
/// column `c` at `p·NR + c`; columns past the end are zero.
fn pack_b_panel<const NR: usize>(b: &MatRef, p0: usize, kc: usize, j0: usize, out: &mut [f32]) {
    let cols = NR.min(b.cols - j0);
    if b.cs == 1 {
        for (p, dst) in out.chunks_exact_mut(NR).enumerate() {
            let s = b.off + (p0 + p) * b.rs + j0;
            match (<&mut [f32; NR]>::try_from(&mut *dst), <&[f32; NR]>::try_from(&b.data[s..s + cols])) {
                // A fixed-size copy compiles to vector moves; `copy_from_slice` of a runtime
                // length is a call to memmove per row.
                (Ok(dst), Ok(src)) => *dst = *src,
                _ => {
                    dst[..cols].copy_from_slice(&b.data[s..s + cols]);
                    dst[cols..].fill(0.0);
                }
            }
        }
        return;
    }
    if cols < NR {
        out.fill(0.0);
    }
    // Column by column: reads run along a row of the stored (transposed) matrix.
    for c in 0..cols {
        let base = b.off + p0 * b.rs + (j0 + c) * b.cs;
        if b.rs == 1 {
            let src = &b.data[base..base + kc];
            for (p, &v) in src.iter().enumerate() {
                out[p * NR + c] = v;
            }
        } else {
            for p in 0..kc {
                out[p * NR + c] = b.data[base + p * b.rs];
            }
        }
    }
}

// The AVX-512 intrinsics are stable since Rust 1.89; the workspace still declares 1.85.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::ops::simd::avx512::transpose16;
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
        // Every value but the alignment slack is written below.
        let mut buf = spare_buffer(len + 16);
        let skip = buf.as_ptr().align_offset(64).min(15);
        let chunks: Vec<(usize, usize)> =
            (0..k.div_ceil(KC)).flat_map(|q| (0..panels).map(move |j| (q, j))).collect();
        let out = SendPtr(buf[skip..].as_mut_ptr());
        crate::cpu::for_each_task(chunks.len(), |i| {
            let (q, j) = chunks[i];
            let kc = KC.min(k - q * KC);
            // SAFETY: the blocks `q·KC·panels·NR + j·kc·NR` (`kc·NR` long) are disjoint and
            // inside the `len` values after `skip`; the CPU has K's instruction set.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(
                    out.get().add(q * KC * panels * nr + j * kc * nr),
                    kc * nr,
                );
                K::pack_b(b, q * KC, kc, j * nr, dst);
            }
        });
        PackedB { buf, skip }
    }

    /// Whether the microkernel reads the full panels of row-major B in place (`ldb = rs`)
    /// instead of packing B: when A has so few rows that packing B costs about as much as the
    /// product (a weight times a few rows outside a [`PackScope`]; generation's decoding reads
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
                false => (0..blocks)
                    .flat_map(|q| (0..panels).filter(|&j| !in_place(j)).map(move |j| (q, j)))
                    .collect(),
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
                                            Some(pb) => prefetch_lines(
                                                &pb[slot(nq, nj, next_kc)..][p * nr_..p1 * nr_],
                                            ),
                                            None => prefetch_panel(&b, nq * KC + p, p1 - p, nj * nr_, nr_),
                                        }
                                    }
                                    let row = i0 + t * mr_;
                                    let mr = mr_.min(m - row);
                                    let cp = c_base.add((row - c_row0) * ldc + col - c_col0);
                                    if t < full {
                                        let ap = a.data.as_ptr().add(a.off + row * a.rs + q * KC);
                                        K::kernel::<true>(
                                            kc, ap, a.rs, bp, ldb, cp, ldc, mr, nr, load_c, bias,
                                        );
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

    /// The AVX-512F kernel: 14 rows × 2 vectors of 16 lanes.
    pub(super) struct Avx512;

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

    /// The AVX2 + FMA kernel: 6 rows × 2 vectors of 8 lanes.
    pub(super) struct Avx2;

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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    /// The vector kernels this CPU can run (each is tested, not only the one `sgemm` picks).
    fn kernels() -> Vec<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            let mut v = vec![];
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
            v
        }
        #[cfg(not(target_arch = "x86_64"))]
        vec![]
    }

    /// Max |x − y| / (1 + |y|) between our product and the f64 triple loop, over `sgemm` and
    /// every kernel of [`kernels`] run directly.
    fn check(a: MatRef, b: MatRef, bias: Option<&[f32]>, accumulate: bool) -> f32 {
        let (m, n) = (a.rows, b.cols);
        let init = data(m * n, 9);
        let fresh = || if accumulate { init.clone() } else { vec![f32::NAN; m * n] };
        let mut results = vec![{
            let mut c = fresh();
            sgemm(a, b, &mut c, bias, accumulate);
            c
        }];
        #[cfg(target_arch = "x86_64")]
        for isa in kernels() {
            let mut c = fresh();
            if m > 0 && n > 0 && a.cols > 0 {
                // SAFETY: the CPU has `isa`; the views are in bounds and c has m × n values.
                unsafe { x86::sgemm(isa, a, b, c.as_mut_ptr(), bias, accumulate) };
            } else {
                sgemm(a, b, &mut c, bias, accumulate);
            }
            results.push(c);
        }
        let mut worst = 0f32;
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..a.cols {
                    s += a.at(i, p) as f64 * b.at(p, j) as f64;
                }
                if accumulate {
                    s += init[i * n + j] as f64;
                } else if let Some(bias) = bias {
                    s += bias[j] as f64;
                }
                for ours in &results {
                    let d = (ours[i * n + j] as f64 - s).abs() / (1.0 + s.abs());
                    worst = worst.max(if d.is_nan() { f32::INFINITY } else { d as f32 });
                }
            }
        }
        worst
    }

    #[test]
    fn odd_shapes_match_the_triple_loop() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (17, 33, 65),
            (14, 256, 32),
            (15, 257, 33),
            (3, 600, 2),
            (100, 7, 1000),
            (6, 16, 16),
            (7, 513, 17),
            // Row-major B packed inside the tasks (one row chunk, several depth blocks), and
            // packed up front (more than one row chunk).
            (40, 600, 50),
            (150, 300, 70),
        ] {
            let a = data(m * k, 1);
            let b = data(k * n, 2);
            let bias = data(n, 3);
            let (a, b) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
            for (bias, acc) in [(None, false), (Some(&bias[..]), false), (None, true)] {
                // On 2 threads, as on the dev machines: with many threads the small shapes
                // split their rows and would skip the one-row-chunk path.
                let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
                let d = pool.install(|| check(a, b, bias, acc));
                assert!(d < 1e-5, "{m}×{k}×{n} bias {} acc {acc}: {d}", bias.is_some());
            }
        }
    }

    #[test]
    fn transposed_a_packed_once_for_several_column_ranges_matches_the_triple_loop() {
        // A column-major (a weight gradient's `xᵀ`): with more than one column range per row
        // range, A is packed once up front and shared by the tasks; partial tiles, several depth
        // blocks, a partial last panel.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
        for &(m, k, n) in &[(256, 300, 768), (97, 513, 300), (7, 40, 1000)] {
            let a = data(k * m, 1);
            let b = data(k * n, 2);
            let bias = data(n, 3);
            let (a, b) = (MatRef::row_major(&a, k, m).t(), MatRef::row_major(&b, k, n));
            let s = split(m, n, k, 2, (6, 16));
            assert!(n.div_ceil(16).div_ceil(s.col_panels) > 1, "{m}×{k}×{n}: one column range");
            for (bias, acc) in [(None, false), (Some(&bias[..]), false), (None, true)] {
                let d = pool.install(|| check(a, b, bias, acc));
                assert!(d < 1e-5, "{m}×{k}×{n} bias {} acc {acc}: {d}", bias.is_some());
            }
        }
    }

    /// How many packed copies the live [`PackScope`] holds (`None` without one).
    fn packed_copies() -> Option<usize> {
        PREPACKED.with(|p| p.borrow().as_ref().map(|p| p.done.len()))
    }

    #[test]
    fn products_on_prepacked_weights_equal_the_packing_ones() {
        use candle_core::{CpuStorage, Device, Storage, Tensor};
        // On the test's thread: the scope is a thread's. Row-major B (a Conv1D weight) and
        // column-major B (a transposed nn.Linear weight or LM head); several depth blocks and a
        // partial last panel.
        for (k, n, transposed) in [(300, 70, false), (300, 70, true), (513, 17, false)] {
            let shape = if transposed { (n, k) } else { (k, n) };
            let w = Tensor::from_vec(data(k * n, 2), shape, &Device::Cpu).expect("tensor");
            let other = Tensor::from_vec(data(k * n, 4), shape, &Device::Cpu).expect("tensor");
            let run = |w: &Tensor, m: usize, bias: Option<&[f32]>, acc: bool| -> Vec<f32> {
                let (st, _) = w.storage_and_layout();
                let Storage::Cpu(CpuStorage::F32(v)) = &*st else { panic!("f32 CPU tensor") };
                let b = if transposed { MatRef::row_major(v, n, k).t() } else { MatRef::row_major(v, k, n) };
                let a_data = data(m * k, 1);
                let a = MatRef::row_major(&a_data, m, k);
                if acc {
                    let mut c = data(m * n, 9);
                    sgemm(a, b, &mut c, None, true);
                    c
                } else {
                    sgemm_new(a, b, bias)
                }
            };
            let bias = data(n, 3);
            let cases = [(None, false), (Some(&bias[..]), false), (None, true)];
            let plain: Vec<Vec<f32>> =
                [16, 40, 100].iter().flat_map(|&m| cases.map(|(b, acc)| run(&w, m, b, acc))).collect();
            let other_plain = run(&other, 40, None, false);
            let scope = pack_scope(std::slice::from_ref(&w));
            assert_eq!(packed_copies(), Some(0));
            let mut packed = Vec::new();
            for m in [16, 40, 100] {
                for (b, acc) in cases {
                    packed.push(run(&w, m, b, acc));
                }
                // One copy from the first product on, whatever its rows.
                let want = usize::from(isa().is_some());
                assert_eq!(packed_copies(), Some(want), "{k}×{n} transposed {transposed}, m = {m}");
            }
            assert!(run(&other, 40, None, false) == other_plain, "an unregistered B's product changed");
            assert_eq!(packed_copies(), Some(usize::from(isa().is_some())));
            // Without the scope, column-major B at up to 128 rows is multiplied transposed, which
            // adds the bias (or C) after the last depth block instead of the first: the same
            // products, rounded in another order.
            let tol = if transposed { 1e-6 } else { 0.0 };
            let check = |x: &[f32], y: &[f32], what: &str| {
                let worst =
                    x.iter().zip(y).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max);
                assert!(worst <= tol, "{k}×{n} transposed {transposed}, {what}: differs by {worst}");
            };
            for (i, (x, y)) in packed.iter().zip(&plain).enumerate() {
                check(x, y, &format!("case {i}"));
            }
            drop(scope);
            assert_eq!(packed_copies(), None);
            // The next scope packs `other` (the same size) into the dropped scope's buffer, over
            // `w`'s values.
            let spares = || SPARE.with(|s| s.borrow().len());
            assert_eq!(spares(), usize::from(isa().is_some()));
            let scope = pack_scope(std::slice::from_ref(&other));
            check(&run(&other, 40, None, false), &other_plain, "a reused buffer");
            assert_eq!(spares(), 0);
            drop(scope);
            assert_eq!(spares(), usize::from(isa().is_some()));
        }
    }

    /// Runs `run(a, b, bias, seen)` on 2 threads for the epilogue tests' shapes — one row chunk
    /// with several depth blocks (B packed in the tasks), several row chunks (B packed up front),
    /// a weight gradient's transposed A, partial tiles everywhere; with and without a bias —
    /// where `run` records each value its epilogue sees into `seen` (value, times seen), then
    /// checks that every value was seen once with `sgemm`'s bits; returns what `run` returned
    /// for each case, with `sgemm`'s result.
    fn each_value_once<R: Send>(
        run: impl Fn(MatRef, MatRef, Option<&[f32]>, &std::sync::Mutex<(Vec<f32>, Vec<u32>)>) -> R + Sync,
    ) -> Vec<(R, Vec<f32>)> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
        let mut out = Vec::new();
        for (m, k, n, a_transposed) in [
            (1, 1, 1, false),
            (40, 600, 50, false),
            (150, 300, 70, false),
            (200, 96, 130, true),
            (13, 5, 700, true),
        ] {
            let a_data = data(m * k, 1);
            let b_data = data(k * n, 2);
            let a = match a_transposed {
                true => MatRef::row_major(&a_data, k, m).t(),
                false => MatRef::row_major(&a_data, m, k),
            };
            let b = MatRef::row_major(&b_data, k, n);
            let bias_data = data(n, 3);
            for bias in [None, Some(&bias_data[..])] {
                let mut want = vec![0f32; m * n];
                pool.install(|| sgemm(a, b, &mut want, bias, false));
                let seen = std::sync::Mutex::new((vec![f32::NAN; m * n], vec![0u32; m * n]));
                let r = pool.install(|| run(a, b, bias, &seen));
                let (got, count) = seen.into_inner().unwrap();
                assert!(
                    count.iter().all(|&s| s == 1),
                    "{m}×{k}×{n}: a value handed over {:?} times",
                    count.iter().max()
                );
                let same = got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{m}×{k}×{n}, bias {}: the epilogue's values differ from sgemm's",
                    bias.is_some()
                );
                out.push((r, want));
            }
        }
        out
    }

    #[test]
    fn epilogue_gets_every_block_once_with_the_products_values() {
        each_value_once(|a, b, bias, seen| {
            let n = b.cols;
            sgemm_epilogue(a, b, bias, &|i0, rows, j0, cols, block, ld| {
                let mut s = seen.lock().unwrap();
                for r in 0..rows {
                    for c in 0..cols {
                        s.0[(i0 + r) * n + j0 + c] = block[r * ld + c];
                        s.1[(i0 + r) * n + j0 + c] += 1;
                    }
                }
            })
        });
    }

    #[test]
    fn row_epilogue_sees_every_row_segment_once_in_place() {
        // The epilogue records what it saw, then doubles the row in place.
        let cases = each_value_once(|a, b, bias, seen| {
            let n = b.cols;
            let mut c = vec![f32::NAN; a.rows * n];
            let cp = SendPtr(c.as_mut_ptr());
            // SAFETY: `c` has m × n values and nothing else touches it during the call.
            unsafe {
                sgemm_rows_then(a, b, bias, cp.get(), &|i, j0, row| {
                    let mut s = seen.lock().unwrap();
                    for (j, v) in row.iter_mut().enumerate() {
                        s.0[i * n + j0 + j] = *v;
                        s.1[i * n + j0 + j] += 1;
                        *v *= 2.0;
                    }
                })
            };
            c
        });
        for (c, want) in cases {
            let kept = c.iter().zip(&want).all(|(x, y)| x.to_bits() == (2.0 * y).to_bits());
            assert!(kept, "{} values: the epilogue's writes did not stay in C", c.len());
        }
    }

    #[test]
    fn transposed_and_strided_operands() {
        let (m, k, n) = (37, 300, 45);
        // Stored transposed: aᵀ is k × m row-major, bᵀ is n × k row-major.
        let at = data(k * m, 4);
        let bt = data(n * k, 5);
        let a = MatRef::row_major(&at, k, m).t();
        let b = MatRef::row_major(&bt, n, k).t();
        let a_rm = data(m * k, 6);
        let b_rm = data(k * n, 7);
        for (a, b) in [(a, b), (a, MatRef::row_major(&b_rm, k, n)), (MatRef::row_major(&a_rm, m, k), b)] {
            assert!(check(a, b, None, false) < 1e-5);
        }
        // Column-major B wider than A is computed as (Bᵀ·Aᵀ)ᵀ: bias and accumulation, a
        // generation-like single row, and a wide matrix (several transpose blocks).
        let bias = data(n, 11);
        let a_rm = MatRef::row_major(&a_rm, m, k);
        for (bias, acc) in [(Some(&bias[..]), false), (None, true)] {
            assert!(check(a_rm, b, bias, acc) < 1e-5);
        }
        let (k2, n2) = (64, 100);
        let bt2 = data(n2 * k2, 12);
        let b2 = MatRef::row_major(&bt2, n2, k2).t();
        let a_row = data(k2, 13);
        assert!(check(MatRef::row_major(&a_row, 1, k2), b2, None, false) < 1e-5);
        let a_wide = data(40 * k2, 14);
        assert!(check(MatRef::row_major(&a_wide, 40, k2), b2, None, true) < 1e-5);
        // A strided view: every other row and column of a larger matrix, from an offset.
        let big = data(3 + 2 * m * 2 * k, 8);
        let a = MatRef { data: &big, off: 3, rows: m, cols: k, rs: 4 * k, cs: 2 };
        let b = MatRef { data: &big, off: 1, rows: k, cols: n, rs: 3, cs: 2 * k + 1 };
        assert!(check(a, b, None, false) < 1e-5);
    }

    /// A read in place (row-major: the assembly loop of the AVX-512 kernel) and packed (the
    /// same values stored column-major) give the same bits: both add each product in depth
    /// order. Depths cover the unrolled 16-step blocks, their remainder and several `KC` blocks.
    #[test]
    fn a_in_place_and_packed_give_the_same_bits() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
        for &(m, k, n) in &[(28, 16, 32), (42, 37, 64), (30, 600, 40), (14, 5, 32)] {
            let a = data(m * k, 21);
            let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
            let b = data(k * n, 22);
            let b = MatRef::row_major(&b, k, n);
            #[cfg(target_arch = "x86_64")]
            for isa in kernels() {
                let run = |a: MatRef| {
                    let mut c = vec![f32::NAN; m * n];
                    // SAFETY: the CPU has `isa`; the views are in bounds and c has m × n values.
                    pool.install(|| unsafe { x86::sgemm(isa, a, b, c.as_mut_ptr(), None, false) });
                    c
                };
                let in_place = run(MatRef::row_major(&a, m, k));
                let packed = run(MatRef::row_major(&at, k, m).t());
                let same = in_place.iter().zip(&packed).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{isa:?} {m}×{k}×{n}");
            }
        }
    }

    #[test]
    fn empty_and_zero_depth() {
        let a: Vec<f32> = vec![];
        let mut c = vec![1f32; 6];
        sgemm(
            MatRef::row_major(&a, 2, 0),
            MatRef::row_major(&a, 0, 3),
            &mut c,
            Some(&[1.0, 2.0, 3.0]),
            false,
        );
        assert_eq!(c, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        sgemm(MatRef::row_major(&a, 0, 0), MatRef::row_major(&a, 0, 3), &mut [], None, false);
    }

    #[test]
    fn splits_cover_the_output() {
        for &(m, n, k, t) in &[
            (512, 768, 256, 2),
            (64, 8192, 256, 2),
            (1, 1, 1, 2),
            (8192, 256, 512, 2),
            (5, 5, 5, 1),
            (128, 3072, 768, 2),
            (384, 8192, 256, 2),
            (496, 1024, 256, 2),
        ] {
            for (mr, nr) in [(14, 32), (6, 16)] {
                let s = split(m, n, k, t, (mr, nr));
                assert!(s.row_tiles >= 1 && s.col_panels >= 1);
                assert!(s.row_tiles <= ONE_ROW_CHUNK_WIDE && s.col_panels <= 32);
                let (mt, nt) = (m.div_ceil(mr), n.div_ceil(nr));
                // A wide B (the LM head's forward) keeps up to ONE_ROW_CHUNK_WIDE tiles in one
                // chunk; others up to ONE_ROW_CHUNK.
                let one = mt <= ONE_ROW_CHUNK || (n >= 8 * m && mt <= ONE_ROW_CHUNK_WIDE);
                assert_eq!(s.row_tiles == mt, one, "{m}×{k}×{n} on ({mr}, {nr}): {s:?}");
                // Even chunks: padding the last one to full size takes fewer tiles than there
                // are chunks (22 tiles are 2 × 11, not 16 + 6).
                assert!(mt.div_ceil(s.row_tiles) * s.row_tiles - mt < mt.div_ceil(s.row_tiles));
                assert!(nt.div_ceil(s.col_panels) * s.col_panels - nt < nt.div_ceil(s.col_panels));
            }
        }
    }
}
