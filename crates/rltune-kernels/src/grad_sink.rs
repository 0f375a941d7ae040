//! Parameter gradients written in place, as torch's `param.grad`.
//!
//! candle's backward keeps every gradient in a `GradStore`, and each contribution to a tensor's
//! gradient zero-fills a new tensor of that size, then adds the contribution into another new
//! one. For parameters that is pure overhead: on GPT-2 (124M parameters) it was about 1.5 GB of
//! freshly faulted memory per minibatch, zero-filled and added on one thread while the other
//! core idled (perf: the main thread's `memset`, page faults and `binary_map` adds).
//!
//! A [`GradSink`] is a persistent f32 buffer for one parameter, owned by a [`crate::Grads`]. Its
//! sinks reach the ops explicitly: a model's layers each keep their store's [`GradSlot`], hand it
//! to the ops that take their weights (`linear_with`, `embedding_with`, …), and each op reads it
//! once, at its forward ([`Sinks`]); [`crate::Grads::bind`] points the slot at its buffers. In
//! the backward those ops write a weight's gradient straight into its sink and hand candle none:
//! the linear layers and the LM head run their weight-gradient GEMM into it, the embedding
//! scatters its rows into it, layer and RMS norm add theirs. No thread-local or global says
//! where gradients go: a model trained on one thread and evaluated on another, or two models
//! trained at once, each write where their own slot points. The first write after
//! [`GradSink::clear`] overwrites, later ones add, so nothing is zero-filled (a tied weight gets
//! the LM head's product first, then the embedding's rows). Gradients that reach a parameter through other ops still arrive in candle's store; the
//! owner adds them with [`GradSink::add`] (`optim::Grads` does).
//!
//! A sink can also be *armed* with an optimizer update ([`FusedUpdate`]): the first product
//! written to it ([`Sinks::gemm_into`]) is then never stored, and each block of it updates the
//! parameter in place from the GEMM's epilogue, while the block is still in cache (torch's
//! optimizer-in-backward, done at the level of the product). The owner arms only parameters
//! whose whole gradient is that one product (one write in the previous backward, nothing in
//! candle's store); a later write to an updated parameter is an error.
//!
//! A tied table (GPT-2's `wte`: the LM head's product, then the embedding's rows) is updated in
//! its product too, all but the rows the embedding will add to: its forward, with a sink for the
//! table, *holds* the rows it looked up ([`GradSink::hold_rows`]); the product's epilogue then
//! stores the held rows' gradient in the buffer and updates every other row in place, the
//! embedding adds its rows ([`GradSink::add_rows`], only into held rows), and the optimizer
//! updates the held rows after the backward. For GPT-2 that takes the 50257 × 768 table's
//! gradient (all but a few hundred rows) out of memory: it is never written and read back.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor, TensorId};

use super::gemm::{self, with_matref};
use super::{lock, CResult};

/// An optimizer step applied inside the product that makes a weight's gradient (see the module
/// docs): `update(p, g, at)` updates the parameter's values `p`, flat indices `at..at + p.len()`,
/// from their gradient `g`. Called from several threads at once, on disjoint ranges.
pub(crate) trait FusedUpdate: Send + Sync {
    fn update(&self, p: &mut [f32], g: &[f32], at: usize);
}

/// One parameter's gradient buffer.
pub(crate) struct GradSink {
    state: Mutex<SinkState>,
    fused: Mutex<Option<Arc<dyn FusedUpdate>>>,
}

impl std::fmt::Debug for GradSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradSink").field("state", &self.state).finish_non_exhaustive()
    }
}

/// A sink's buffer and whether it holds a gradient since the last clear.
#[derive(Debug)]
pub(crate) struct SinkState {
    /// The gradient, row-major in the parameter's shape (stale while `filled` is false).
    pub buf: Vec<f32>,
    /// Whether a gradient was written since the last [`GradSink::clear`].
    pub filled: bool,
    /// Writes since the last clear (a fused update counts as one).
    pub writes: usize,
    /// Whether an armed update consumed the gradient (the buffer holds none, `filled` is false).
    pub applied: bool,
    /// Rows held for a later sparse write, as `(row length, held?)` per row
    /// ([`GradSink::hold_rows`]).
    pub held: Option<(usize, Vec<bool>)>,
    /// Whether an armed update consumed the gradient of every row but the held ones: the buffer
    /// holds the held rows' gradient only (`filled` is true).
    pub partial: bool,
    /// Whether rows were ever added to this sink ([`GradSink::add_rows`]): a table read by an
    /// embedding, which an armed product updates only where rows are held.
    pub sparse_writer: bool,
    /// Of `writes`, those of [`GradSink::add_rows`].
    pub row_writes: usize,
}

impl GradSink {
    /// A sink for a parameter of `len` values.
    pub fn new(len: usize) -> Self {
        let state = SinkState {
            buf: vec![0.0; len],
            filled: false,
            writes: 0,
            applied: false,
            held: None,
            partial: false,
            sparse_writer: false,
            row_writes: 0,
        };
        Self { state: Mutex::new(state), fused: Mutex::new(None) }
    }

    /// Forgets the gradient (the buffer is kept, and overwritten by the next write).
    pub fn clear(&self) {
        let mut s = lock(&self.state);
        (s.filled, s.writes, s.row_writes, s.applied, s.partial) = (false, 0, 0, false, false);
        s.held = None;
    }

    /// Holds rows `ids` of this `(rows, row_len)` parameter for a sparse write later in the
    /// backward (an embedding's forward calls it for the rows it looked up): an armed product
    /// leaves those rows' gradient in the buffer instead of updating them. Holds add up until
    /// the next [`Self::clear`].
    pub fn hold_rows(&self, ids: &[u32], row_len: usize) -> CResult<()> {
        let mut s = lock(&self.state);
        let rows = s.buf.len() / row_len.max(1);
        let (len, held) = s.held.get_or_insert_with(|| (row_len, vec![false; rows]));
        if *len != row_len {
            candle_core::bail!("rows of {row_len} values held in a sink that holds rows of {len}");
        }
        for &id in ids {
            match held.get_mut(id as usize) {
                Some(h) => *h = true,
                None => candle_core::bail!("row {id} held in a sink of {rows} rows"),
            }
        }
        Ok(())
    }

    /// Arms (or with `None` disarms) the optimizer update that the next first write applies.
    pub fn arm(&self, update: Option<Arc<dyn FusedUpdate>>) {
        *lock(&self.fused) = update;
    }

    /// The buffer and whether it holds a gradient.
    pub fn state(&self) -> MutexGuard<'_, SinkState> {
        lock(&self.state)
    }

    /// Runs `f(buf, accumulate)`: `accumulate` is false for the first write since the last clear
    /// (`f` must then overwrite every value it is responsible for; a writer of some rows is
    /// [`Self::add_rows`]).
    ///
    /// An error after an armed update consumed this backward's gradient (the parameter has moved;
    /// it should not have been armed).
    pub fn write(&self, f: impl FnOnce(&mut [f32], bool)) -> CResult<()> {
        let mut s = lock(&self.state);
        if s.applied || s.partial {
            candle_core::bail!(
                "a second gradient for a parameter already updated inside this backward (an \
                 optimizer fused into the backward must only be armed for parameters with one \
                 gradient product; run the optimizer after the backward instead)"
            );
        }
        let acc = s.filled;
        f(&mut s.buf, acc);
        s.filled = true;
        s.writes += 1;
        Ok(())
    }

    /// Adds `g` (one row of `row_len` values per id) to rows `ids` (an embedding's backward); a
    /// first write zero-fills the buffer first. After a partly fused product (see the module
    /// docs) only held rows may be added to; another is an error.
    pub fn add_rows(&self, ids: &[u32], row_len: usize, g: &[f32]) -> CResult<()> {
        let mut s = lock(&self.state);
        if s.applied {
            candle_core::bail!(
                "rows added to the gradient of a parameter already updated inside this backward \
                 (its forward held no rows: run the forward inside the gradients' scope)"
            );
        }
        let rows = s.buf.len() / row_len.max(1);
        if g.len() != ids.len() * row_len {
            candle_core::bail!("{} gradient values for {} rows of {row_len}", g.len(), ids.len());
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
            candle_core::bail!("row {bad} added to a sink of {rows} rows");
        }
        if s.partial {
            let held = |id: u32| s.held.as_ref().is_some_and(|(len, h)| *len == row_len && h[id as usize]);
            if let Some(&bad) = ids.iter().find(|&&id| !held(id)) {
                candle_core::bail!(
                    "row {bad} added to a gradient whose unheld rows were updated inside this \
                     backward (hold the rows in the forward: GradSink::hold_rows)"
                );
            }
        }
        if !s.filled {
            s.buf.fill(0.0);
        }
        for (row, &id) in g.chunks_exact(row_len.max(1)).zip(ids) {
            let dst = &mut s.buf[id as usize * row_len..][..row_len];
            dst.iter_mut().zip(row).for_each(|(d, g)| *d += g);
        }
        s.filled = true;
        s.writes += 1;
        s.row_writes += 1;
        s.sparse_writer = true;
        Ok(())
    }

    /// The armed update, if this is the first write since the last clear and the update may
    /// consume it: a table that gets rows added later only with rows held.
    fn first_fused(&self) -> Option<Arc<dyn FusedUpdate>> {
        let s = lock(&self.state);
        if s.writes > 0 || (s.sparse_writer && s.held.is_none()) {
            return None;
        }
        lock(&self.fused).clone()
    }

    /// Adds a gradient tensor of the parameter's size (any shape, f32 after conversion).
    pub fn add(&self, g: &Tensor) -> CResult<()> {
        let g = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let len = lock(&self.state).buf.len();
        if g.len() != len {
            candle_core::bail!("gradient of {} values for a parameter of {len}", g.len());
        }
        self.write(|buf, acc| {
            if acc {
                buf.iter_mut().zip(&g).for_each(|(b, g)| *b += g);
            } else {
                buf.copy_from_slice(&g);
            }
        })
    }
}

/// The buffers of one [`crate::Grads`], by tensor id: the sinks of its parameters, and the ids of
/// its other variables (those without a sink), whose gradients from a nested backward
/// ([`crate::checkpoint`]) are set aside here for their owner to add.
#[derive(Debug, Default)]
pub(crate) struct SinkMap {
    pub sinks: HashMap<TensorId, Arc<GradSink>>,
    pub dense: HashSet<TensorId>,
    pub aside: Mutex<HashMap<TensorId, Tensor>>,
    /// Whether [`crate::Grads::backward`] is running the backward, and so will collect what is
    /// set aside.
    pub collecting: AtomicBool,
}

impl FromIterator<(TensorId, Arc<GradSink>)> for SinkMap {
    fn from_iter<I: IntoIterator<Item = (TensorId, Arc<GradSink>)>>(sinks: I) -> Self {
        Self { sinks: sinks.into_iter().collect(), ..Self::default() }
    }
}

/// Where the backward of a model's ops writes its weights' gradients: torch's `param.grad`, for
/// the parameters of one store. A model's layers keep a clone of their store's slot and hand it to
/// the ops that take weights ([`crate::linear_with`], …); [`crate::Grads::bind`] points it at the
/// gradient buffers of one [`crate::Grads`]. Each op reads the slot once, at its forward, and its
/// backward writes where the slot pointed then (so a checkpointed segment's recomputation, run in
/// the backward, writes where the first forward did).
///
/// The slot holds the buffers weakly: once its `Grads` is dropped, the ops behind it hand their
/// gradients to candle's store again, as an unbound slot's do.
#[derive(Clone, Default)]
pub struct GradSlot(Arc<RwLock<Weak<SinkMap>>>);

impl std::fmt::Debug for GradSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradSlot").field("bound", &self.is_bound()).finish()
    }
}

impl GradSlot {
    /// An unbound slot.
    pub fn new() -> Self {
        Self::default()
    }

    /// Points the slot at `map` (replacing what it pointed at).
    pub(crate) fn bind(&self, map: &Arc<SinkMap>) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::downgrade(map);
    }

    /// Unbinds the slot: the ops behind it hand their gradients to candle's store.
    pub fn unbind(&self) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Weak::new();
    }

    /// Whether the slot points at the buffers of a live [`crate::Grads`].
    pub fn is_bound(&self) -> bool {
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).strong_count() > 0
    }

    /// The sinks the slot points at now, for an op's forward to keep.
    pub(crate) fn sinks(&self) -> Sinks {
        Sinks(self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).upgrade())
    }
}

/// The sinks an op writes its weights' gradients into, read from a [`GradSlot`] at its forward
/// (`Sinks::default()`: none, every gradient goes to candle's store).
#[derive(Clone, Default)]
pub(crate) struct Sinks(Option<Arc<SinkMap>>);

impl Sinks {
    /// The sink of `w`, if any.
    pub fn of(&self, w: &Tensor) -> Option<Arc<GradSink>> {
        self.0.as_ref().and_then(|m| m.sinks.get(&w.id()).cloned())
    }

    /// Whether these are the buffers of a [`crate::Grads`].
    pub fn active(&self) -> bool {
        self.0.is_some()
    }

    /// Whether their [`crate::Grads`] is running a backward ([`crate::Grads::backward`]), which
    /// collects the gradients set aside.
    pub fn collecting(&self) -> bool {
        self.0.as_ref().is_some_and(|m| m.collecting.load(Ordering::Acquire))
    }

    /// `dw` for candle, or `None` after adding it to `w`'s sink.
    pub fn give(&self, w: &Tensor, dw: Tensor) -> CResult<Option<Tensor>> {
        match self.of(w) {
            Some(sink) => sink.add(&dw).map(|()| None),
            None => Ok(Some(dw)),
        }
    }

    /// Hands the gradients of these sinks' variables in `grads` (a nested backward's store) to
    /// their owner: into a variable's sink when it has one, else set aside
    /// ([`SinkMap::aside`]). The other gradients in `grads` (the segment's activations') are left.
    pub fn hand_over(&self, grads: &mut candle_core::backprop::GradStore) -> CResult<()> {
        let Some(map) = &self.0 else {
            candle_core::bail!("internal: gradients handed over with no gradient buffers");
        };
        let ids: Vec<TensorId> = grads.get_ids().copied().collect();
        for id in ids {
            let Some(g) = grads.get_id(id) else { continue };
            if let Some(sink) = map.sinks.get(&id) {
                sink.add(g)?;
            } else if map.dense.contains(&id) {
                let g = g.detach();
                let mut aside = lock(&map.aside);
                let sum = match aside.remove(&id) {
                    Some(prev) => (prev + g)?,
                    None => g,
                };
                aside.insert(id, sum);
            }
        }
        Ok(())
    }

    /// Writes `a·b` into `w`'s sink with the GEMM (accumulating in its epilogue after the first
    /// write); `Ok(false)` when `w` has no sink, the CPU has no fast SGEMM, or the operands are
    /// not f32 CPU matrices; the caller then computes the product itself.
    pub fn gemm_into(&self, w: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
        let Some(sink) = self.of(w) else { return Ok(false) };
        if !gemm::fast_available() {
            return Ok(false);
        }
        let (m, n) = (a.dim(0)?, b.dim(1)?);
        if m * n != w.elem_count() {
            candle_core::bail!("weight gradient of {m} × {n} for a weight of shape {:?}", w.dims());
        }
        let f32_matrix = |t: &Tensor| super::f32_cpu(t) && t.rank() == 2;
        if f32_matrix(a) && f32_matrix(b) {
            if let Some(update) = sink.first_fused() {
                let mut s = sink.state();
                let held = s.held.take();
                let rows = held.as_ref().filter(|(len, _)| *len == n).map(|(_, h)| h.as_slice());
                let buf = gemm::SendPtr(s.buf.as_mut_ptr());
                let done = w.inplace_op1(&FusedProduct { a, b, update, held: rows.map(|h| (h, buf)) });
                s.writes += 1;
                // With rows held, the buffer holds their gradient; without, nothing.
                (s.applied, s.partial, s.filled) = (rows.is_none(), rows.is_some(), rows.is_some());
                s.held = held;
                return done.map(|()| true);
            }
        }
        let done =
            with_matref(a, |a| with_matref(b, |b| sink.write(|buf, acc| gemm::sgemm(a, b, buf, None, acc))));
        match done {
            Some(Some(r)) => r.map(|()| true),
            _ => Ok(false),
        }
    }
}

/// `w ← update(w, a·b)` block by block from the GEMM's epilogue (an armed sink's first write);
/// rows marked in `held` are instead stored in the sink's buffer (`a·b`'s shape).
struct FusedProduct<'a> {
    a: &'a Tensor,
    b: &'a Tensor,
    update: Arc<dyn FusedUpdate>,
    held: Option<(&'a [bool], gemm::SendPtr<f32>)>,
}

impl InplaceOp1 for FusedProduct<'_> {
    fn name(&self) -> &'static str {
        "rltune-fused-weight-update"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> CResult<()> {
        let (Some((p0, p1)), CpuStorage::F32(p)) = (l.contiguous_offsets(), s) else {
            candle_core::bail!("fused weight update: the parameter must be a contiguous f32 tensor");
        };
        let p = &mut p[p0..p1];
        let (len, ptr) = (p.len(), gemm::SendPtr(p.as_mut_ptr()));
        let done = with_matref(self.a, |a| {
            with_matref(self.b, |b| {
                let n = b.cols;
                if a.rows * n != len {
                    return false;
                }
                if self.held.is_some_and(|(h, _)| h.len() != a.rows) {
                    return false;
                }
                gemm::sgemm_epilogue(a, b, None, &|i0, rows, j0, cols, block, ld| {
                    for r in 0..rows {
                        let at = (i0 + r) * n + j0;
                        let g = &block[r * ld..r * ld + cols];
                        if let Some((_, buf)) = self.held.filter(|(h, _)| h[i0 + r]) {
                            // SAFETY: as below, for the sink's buffer of the same size, which
                            // the caller holds locked.
                            unsafe { std::slice::from_raw_parts_mut(buf.get().add(at), cols) }
                                .copy_from_slice(g);
                            continue;
                        }
                        // SAFETY: the epilogue's blocks are disjoint and lie inside the
                        // `rows(a) × cols(b)` product, which has the parameter's `len` values;
                        // the parameter's storage is locked for writing by this in-place op.
                        let p = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(at), cols) };
                        self.update.update(p, g, at);
                    }
                });
                true
            })
        });
        match done {
            Some(Some(true)) => Ok(()),
            _ => candle_core::bail!(
                "fused weight update: operands are not f32 matrices of the parameter's size"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn map_of(pairs: &[(&Tensor, &Arc<GradSink>)]) -> Arc<SinkMap> {
        Arc::new(pairs.iter().map(|(t, s)| (t.id(), Arc::clone(s))).collect())
    }

    fn sinks_of(pairs: &[(&Tensor, &Arc<GradSink>)]) -> Sinks {
        Sinks(Some(map_of(pairs)))
    }

    #[test]
    fn first_write_overwrites_then_adds() {
        let s = GradSink::new(3);
        s.write(|b, acc| {
            assert!(!acc);
            b.copy_from_slice(&[1.0, 2.0, 3.0])
        })
        .unwrap();
        s.add(&Tensor::new(&[1f32, 1.0, 1.0], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(s.state().buf, [2.0, 3.0, 4.0]);
        s.clear();
        assert!(!s.state().filled);
        s.add_rows(&[1, 1], 1, &[5.0, 1.0]).unwrap();
        assert_eq!(s.state().buf, [0.0, 6.0, 0.0]);
        let err = s.add_rows(&[3], 1, &[1.0]).unwrap_err().to_string();
        assert!(err.contains("row 3 added to a sink of 3 rows"), "{err}");
        let err = s.add(&Tensor::new(&[1f32], &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(err.contains("1 values for a parameter of 3"), "{err}");
    }

    /// Records the flat offsets it updated; subtracts the gradient.
    struct Recorder(Mutex<Vec<usize>>);

    impl FusedUpdate for Recorder {
        fn update(&self, p: &mut [f32], g: &[f32], at: usize) {
            lock(&self.0).extend(at..at + p.len());
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= g);
        }
    }

    #[test]
    fn an_armed_product_leaves_held_rows_to_the_sparse_write() {
        let dev = Device::Cpu;
        // A (3, 2) table: the product writes all rows, an embedding adds to row 1.
        let w = Var::zeros((3, 2), DType::F32, &dev).unwrap();
        let a = Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((3, 4)).unwrap();
        let b = Tensor::arange(0f32, 8.0, &dev).unwrap().reshape((4, 2)).unwrap();
        let ab = a.matmul(&b).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let sink = Arc::new(GradSink::new(6));
        let sinks = sinks_of(&[(w.as_tensor(), &sink)]);
        if !gemm::fast_available() {
            return;
        }
        let run = |hold: Option<&[u32]>| {
            sink.clear();
            if let Some(ids) = hold {
                sink.hold_rows(ids, 2).unwrap();
            }
            let rec = Arc::new(Recorder(Mutex::new(Vec::new())));
            sink.arm(Some(rec.clone()));
            let done = sinks.gemm_into(&w, &a, &b);
            sink.arm(None);
            done.unwrap();
            let mut at = lock(&rec.0).clone();
            at.sort();
            at
        };
        // Before any rows were added, the product is consumed whole.
        assert_eq!(run(None), [0, 1, 2, 3, 4, 5]);
        assert!(sink.state().applied);
        sink.clear();
        sink.add_rows(&[1], 2, &[1.0, 1.0]).unwrap();
        // A table that gets rows added: without held rows the product is not fused.
        assert_eq!(run(None), Vec::<usize>::new());
        assert_eq!(sink.state().buf, ab);
        // With row 1 held: rows 0 and 2 are updated, row 1 stays in the buffer for the rows.
        let before = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(run(Some(&[1])), [0, 1, 4, 5]);
        let after = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(after[2..4], before[2..4]);
        assert_eq!(after[0], before[0] - ab[0]);
        assert!(sink.state().partial && sink.state().filled);
        assert_eq!(sink.state().buf[2..4], ab[2..4]);
        sink.add_rows(&[1], 2, &[0.5, 0.5]).unwrap();
        assert_eq!(sink.state().buf[2..4], [ab[2] + 0.5, ab[3] + 0.5]);
        let err = sink.add_rows(&[2], 2, &[1.0, 1.0]).unwrap_err().to_string();
        assert!(err.contains("row 2 added to a gradient whose unheld rows were updated"), "{err}");
        let err = sink.add(&Tensor::zeros(6, DType::F32, &dev).unwrap()).unwrap_err().to_string();
        assert!(err.contains("already updated inside this backward"), "{err}");
    }

    #[test]
    fn a_slot_points_at_live_buffers_only() {
        let w = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let sink = Arc::new(GradSink::new(2));
        let slot = GradSlot::new();
        assert!(!slot.is_bound() && slot.sinks().of(&w).is_none());
        let map = map_of(&[(w.as_tensor(), &sink)]);
        slot.bind(&map);
        let sinks = slot.sinks();
        assert!(slot.is_bound() && sinks.of(&w).is_some());
        // A detached copy is another tensor.
        assert!(sinks.of(&w.as_tensor().detach()).is_none());
        // Read from another thread, the slot is the same.
        let elsewhere = std::thread::scope(|s| s.spawn(|| slot.sinks().of(&w).is_some()).join().unwrap());
        assert!(elsewhere);
        // What an op kept stays valid after its owner drops the buffers; once nobody keeps
        // them, the slot is unbound.
        drop(map);
        assert!(sinks.of(&w).is_some());
        drop(sinks);
        assert!(!slot.is_bound() && slot.sinks().of(&w).is_none());
        slot.bind(&map_of(&[(w.as_tensor(), &sink)]));
        assert!(!slot.is_bound(), "bound to buffers nobody keeps");
        let map = map_of(&[(w.as_tensor(), &sink)]);
        slot.bind(&map);
        slot.unbind();
        assert!(!slot.is_bound());
    }

    #[test]
    fn gemm_into_sink_accumulates_strided_products() {
        let dev = Device::Cpu;
        let w = Var::zeros((3, 2), DType::F32, &dev).unwrap();
        let a = Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((4, 3)).unwrap().t().unwrap();
        let b = Tensor::arange(0f32, 8.0, &dev).unwrap().reshape((4, 2)).unwrap();
        let want = a.matmul(&b).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let sink = Arc::new(GradSink::new(6));
        let sinks = sinks_of(&[(w.as_tensor(), &sink)]);
        if !gemm::fast_available() {
            assert!(!sinks.gemm_into(&w, &a, &b).unwrap());
            return;
        }
        assert!(sinks.gemm_into(&w, &a, &b).unwrap());
        assert!(sinks.gemm_into(&w, &a, &b).unwrap());
        let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
        assert_eq!(sink.state().buf, twice);
        let err = sinks.gemm_into(&w, &a, &b.narrow(1, 0, 1).unwrap()).unwrap_err().to_string();
        assert!(err.contains("3 × 1 for a weight of shape [3, 2]"), "{err}");
    }
}
