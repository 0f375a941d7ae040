//! Weights packed once for many products ([`PackScope`]), as in generation's decoding steps.

use super::{Isa, MatRef};

/// B packed once, in the layout `x86::drive` packs all of B into (`KC`-deep blocks of `NR`-wide
/// panels), 64-byte aligned.
pub(crate) struct PackedB {
    buf: Vec<f32>,
    skip: usize,
}

impl PackedB {
    /// A buffer for `len` packed values, 64-byte aligned: a spare one of the last scope's where
    /// one fits (its values stale) or a new one.
    pub(super) fn with_len(len: usize) -> PackedB {
        let buf = spare_buffer(len + 16);
        let skip = buf.as_ptr().align_offset(64).min(15);
        PackedB { buf, skip }
    }

    pub(super) fn values(&self) -> &[f32] {
        &self.buf[self.skip..]
    }

    pub(super) fn values_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.skip..]
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

/// While alive, plain f32 products (`super::sgemm`, `super::sgemm_new`; not the epilogue products nor AMX)
/// on this thread whose B is a view of one of the registered matrices read B packed once (on
/// first use, per view) instead of packing it in every product: for the
/// same weights multiplied by the same few rows many times, as in each decoding step of
/// generation. At 64 rows packing B in every product cost about a fifth of the product; at 16
/// rows (`gpt2`'s decoding) B was read in place (row-major) or multiplied transposed
/// (column-major), both bound by memory: a 32-column panel of a row-major weight is 2 cache
/// lines from each of `KC` rows, a pattern the hardware prefetcher does not follow, where a
/// packed panel is one contiguous run. Packed, `gpt2`'s 16-row products read their weights at
/// 14–15 GB/s instead of 5–6 (768 × 3072: 1.8 → 0.67 ms per product on the Xeon of
/// bench/LOG.md's sixteenth session; generation 1.81 → 0.99–1.02 s).
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
pub struct PackScope {
    _pins: Vec<candle_core::Tensor>,
    prev: Option<Packed>,
}

/// Opens a [`PackScope`] for `matrices` (f32 CPU tensors; others are ignored).
pub fn pack_scope(matrices: &[candle_core::Tensor]) -> PackScope {
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

/// `b` packed for `isa`, when a [`PackScope`] registered its storage: packed now by `pack`
/// (`x86::pack_whole`) on first use.
#[cfg(target_arch = "x86_64")]
pub(super) fn prepacked(
    b: &MatRef,
    isa: Isa,
    pack: impl FnOnce() -> PackedB,
) -> Option<std::rc::Rc<PackedB>> {
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
        let v = std::rc::Rc::new(pack());
        p.done.push((key, v.clone()));
        Some(v)
    })
}

/// How many packed copies the live [`PackScope`] holds (`None` without one).
#[cfg(test)]
pub(super) fn packed_copies() -> Option<usize> {
    PREPACKED.with(|p| p.borrow().as_ref().map(|p| p.done.len()))
}

/// How many spare buffers the last dropped [`PackScope`] left.
#[cfg(test)]
pub(super) fn spare_count() -> usize {
    SPARE.with(|s| s.borrow().len())
}
