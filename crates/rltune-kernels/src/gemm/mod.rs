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
//! Two microkernels (`x86::Micro`), picked once per process by what the CPU has:
//! - AVX-512F: `14 × 32` (28 of the 32 zmm registers accumulate). Blocking for a 48 KiB L1d and
//!   2 MiB L2: a `KC × NR` panel of packed B (`256 × 32 × 4 B = 32 KiB`) stays in L1 while the
//!   microkernel walks down the `MC × KC` block of packed A (`16·MR × KC × 4 B` = 224 KiB, in
//!   L2; up to 24·MR rows, 336 KiB, when one block spans all rows).
//! - AVX2 + FMA (AMD Zen, Intel before Skylake-SP): `6 × 16` (12 of the 16 ymm registers
//!   accumulate, two hold B, one the broadcast of A). A panel of B is 16 KiB (in a 32 KiB
//!   L1d), a block of A 96 KiB (144 KiB when one block spans all rows; in a 512 KiB L2).
//!
//! Inside a [`PackScope`] (generation's decoding steps), registered weights are packed once and
//! the plain f32 products (`sgemm`, `sgemm_new`) read them packed; the packed buffers outlive
//! the scope for the next one.
//!
//! With [`MatmulPrecision::Bf16`] set, products whose sides are all at least 32 run on the AMX
//! kernel of `ops/amx.rs` instead (bf16 inputs, f32 accumulation).
//!
//! `sgemm` checks bounds once per operand and then reads through raw pointers. Without
//! either instruction set (see [`fast_available`]) it runs a plain loop; callers that care
//! about speed fall back to candle's matmul instead.
//!
//! This file holds the entry points, the split of the output into tasks and the portable
//! packing; `x86/` the driver and the two kernels (`x86/avx512.rs`, `x86/avx2.rs`);
//! `prepack.rs` the [`PackScope`].

mod prepack;
pub(crate) mod view;
// The AVX-512 intrinsics are stable since Rust 1.89; the workspace still declares 1.85.
#[cfg(target_arch = "x86_64")]
mod x86;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use prepack::prepacked;
pub use prepack::{pack_scope, PackScope};
pub(crate) use view::{with_buffer, MatRef, SendPtr};

/// Depth of one packed block.
const KC: usize = 256;

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
pub fn set_matmul_precision(p: MatmulPrecision) -> crate::error::Result<()> {
    check_matmul_precision(p)?;
    BF16.store(p == MatmulPrecision::Bf16, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Whether this machine can run products at precision `p` (bf16 needs AMX-BF16), without
/// setting it; the error names what is missing.
pub fn check_matmul_precision(p: MatmulPrecision) -> crate::error::Result<()> {
    if p == MatmulPrecision::Bf16 && !super::amx::available() {
        return Err(crate::error::Error::Unsupported(
            "matmul precision bf16 needs Intel AMX-BF16 (Xeon Sapphire Rapids or newer) on Linux \
             5.16 or newer, and this machine has none; use f32 (the default)"
                .into(),
        ));
    }
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

static DEVICE_BF16: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets how f32 matrix products run off the CPU (CUDA) from now on, in the whole process:
/// [`MatmulPrecision::Bf16`] is mixed precision as PyTorch's `torch.autocast("cuda",
/// dtype=torch.bfloat16)` does it: both inputs rounded to bf16, the product on the tensor
/// cores with f32 accumulation, the result rounded to bf16 and handed on as f32. Weights,
/// gradients, optimizer state and every op that is not a product stay f32. The CPU is not
/// affected (see [`set_matmul_precision`]).
pub fn set_device_matmul_precision(p: MatmulPrecision) {
    DEVICE_BF16.store(p == MatmulPrecision::Bf16, std::sync::atomic::Ordering::Relaxed);
}

/// The precision set by [`set_device_matmul_precision`] (f32 until then).
pub fn device_matmul_precision() -> MatmulPrecision {
    if DEVICE_BF16.load(std::sync::atomic::Ordering::Relaxed) {
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

/// Whether `sgemm` has a vector kernel on this CPU (AVX-512F, or AVX2 with FMA).
pub fn fast_available() -> bool {
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
        // SAFETY (the packing): the CPU has `isa` (from `isa()`); the views were checked above.
        if let Some(pb) = prepacked(&b, isa, || unsafe { x86::pack_whole(isa, &b) }) {
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
/// 768 × 50257 B, GPT-2's LM head, outside a [`PackScope`](prepack::PackScope)). Measured on the bench shapes: a
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
    // SAFETY (the packing): the CPU has `isa` (from `isa()`); `check_args` checked the views.
    let packed = isa()
        .filter(|_| m > 0 && n > 0 && k > 0 && !amx)
        .and_then(|isa| prepacked(&b, isa, || unsafe { x86::pack_whole(isa, &b) }));
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

/// Values of A in a row chunk above which [`split`] aims at one task per thread instead of
/// about four: each column range reads all of its row chunk's A again, and past about three
/// quarters of L2 that A comes from memory each time. GPT-2's LM head backward `dlogits·W`
/// (96 × 50257 × 768, A 19 MB) read A eight times, as much traffic as B. `bench_gemm --cold`,
/// 2 threads, four tasks → one per thread: 96×50257×768 157–170 → 209–214 GFLOP/s,
/// 128×3072×768 202–209 → 222–236, 384×8192×256 260–275 → 280–290; `bench ppo --preset gpt2`,
/// 6 alternating pairs: 8.13 → 8.06 s; `small` within noise. (At 128 × 2304 × 768 with B
/// transposed, A 1.2 MB, one task per thread was 2–5% slower: hence the threshold.)
const BIG_A_ROWS: usize = 3 << 17;

/// Picks task sizes for an `mr × nr` microkernel: blocks that fit the caches (up to 16 row tiles
/// — or all of them, when there are at most [`ONE_ROW_CHUNK`], or [`ONE_ROW_CHUNK_WIDE`] for a
/// wide B — by 32 column panels, in chunks of even size), then halved until every thread has
/// about four tasks (rayon balances the rest; one when A is large, see [`BIG_A_ROWS`]), but no
/// smaller than one tile.
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
    let per_thread = if s.row_tiles * mr * k > BIG_A_ROWS { 1 } else { 4 };
    while threads > 1 && count(s) < per_thread * threads {
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

#[cfg(test)]
mod tests;
