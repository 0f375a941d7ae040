//! Parameter gradients written in place, as torch's `param.grad`.
//!
//! candle's backward keeps every gradient in a `GradStore`, and each contribution to a tensor's
//! gradient zero-fills a new tensor of that size, then adds the contribution into another new
//! one. For parameters that is pure overhead: on GPT-2 (124M parameters) it was about 1.5 GB of
//! freshly faulted memory per minibatch, zero-filled and added on one thread while the other
//! core idled (perf: the main thread's `memset`, page faults and `binary_map` adds).
//!
//! A [`GradSink`] is a persistent f32 buffer for one parameter. While a [`SinkScope`] is
//! installed on the thread that runs `backward()`, the ops that take weights write a weight's
//! gradient straight into its sink and hand candle none: the linear layers and the LM head run
//! their weight-gradient GEMM into it, the embedding scatters its rows into it, layer and RMS
//! norm add theirs. The first write after [`GradSink::clear`] overwrites, later ones add, so
//! nothing is zero-filled (a tied weight gets the LM head's product first, then the embedding's
//! rows). Gradients that reach a parameter through other ops still arrive in candle's store; the
//! owner adds them with [`GradSink::add`] (`ppo::optim::Grads` does).
//!
//! A sink can also be *armed* with an optimizer update ([`FusedUpdate`]): the first product
//! written to it ([`gemm_into_sink`]) is then never stored, and each block of it updates the
//! parameter in place from the GEMM's epilogue, while the block is still in cache (torch's
//! optimizer-in-backward, done at the level of the product). The owner arms only parameters
//! whose whole gradient is that one product (one write in the previous backward, nothing in
//! candle's store); a later write to an updated parameter is an error.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

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
}

impl GradSink {
    /// A sink for a parameter of `len` values.
    pub fn new(len: usize) -> Self {
        let state = SinkState { buf: vec![0.0; len], filled: false, writes: 0, applied: false };
        Self { state: Mutex::new(state), fused: Mutex::new(None) }
    }

    /// Forgets the gradient (the buffer is kept, and overwritten by the next write).
    pub fn clear(&self) {
        let mut s = lock(&self.state);
        (s.filled, s.writes, s.applied) = (false, 0, false);
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
    /// (`f` must then overwrite every value it is responsible for; see [`Self::write_sparse`]).
    ///
    /// An error after an armed update consumed this backward's gradient (the parameter has moved;
    /// it should not have been armed).
    pub fn write(&self, f: impl FnOnce(&mut [f32], bool)) -> CResult<()> {
        let mut s = lock(&self.state);
        if s.applied {
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

    /// Like [`Self::write`] for a writer that touches only some values (a scatter): a first write
    /// zero-fills the buffer before `f` adds into it.
    pub fn write_sparse(&self, f: impl FnOnce(&mut [f32])) -> CResult<()> {
        self.write(|buf, acc| {
            if !acc {
                buf.fill(0.0);
            }
            f(buf)
        })
    }

    /// The armed update, if this is the first write since the last clear.
    fn first_fused(&self) -> Option<Arc<dyn FusedUpdate>> {
        let s = lock(&self.state);
        if s.writes > 0 {
            return None;
        }
        lock(&self.fused).clone()
    }

    /// Records that the armed update consumed the gradient.
    fn mark_applied(&self) {
        let mut s = lock(&self.state);
        s.writes += 1;
        s.applied = true;
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

/// The sinks of a set of parameters, by tensor id.
pub(crate) type SinkMap = HashMap<TensorId, Arc<GradSink>>;

thread_local! {
    static ACTIVE: RefCell<Option<Arc<SinkMap>>> = const { RefCell::new(None) };
}

/// While alive, the ops on this thread write the gradients of the parameters in its map into
/// their sinks (see the module docs); dropping it restores the previous scope.
pub(crate) struct SinkScope {
    prev: Option<Arc<SinkMap>>,
}

impl SinkScope {
    /// Installs `map` on this thread.
    pub fn install(map: Arc<SinkMap>) -> Self {
        Self { prev: ACTIVE.with(|a| a.borrow_mut().replace(map)) }
    }
}

impl Drop for SinkScope {
    fn drop(&mut self) {
        let prev = self.prev.take();
        ACTIVE.with(|a| *a.borrow_mut() = prev);
    }
}

/// The sink of `w` in the installed scope, if any.
pub(crate) fn sink_of(w: &Tensor) -> Option<Arc<GradSink>> {
    ACTIVE.with(|a| a.borrow().as_ref().and_then(|m| m.get(&w.id()).cloned()))
}

/// `dw` for candle, or `None` after adding it to `w`'s sink.
pub(crate) fn give(w: &Tensor, dw: Tensor) -> CResult<Option<Tensor>> {
    match sink_of(w) {
        Some(sink) => sink.add(&dw).map(|()| None),
        None => Ok(Some(dw)),
    }
}

/// Writes `a·b` into `w`'s sink with the GEMM (accumulating in its epilogue after the first
/// write); `Ok(false)` when `w` has no sink, the CPU has no fast SGEMM, or the operands are not
/// f32 CPU matrices; the caller then computes the product itself.
pub(crate) fn gemm_into_sink(w: &Tensor, a: &Tensor, b: &Tensor) -> CResult<bool> {
    let Some(sink) = sink_of(w) else { return Ok(false) };
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
            w.inplace_op1(&FusedProduct { a, b, update })?;
            sink.mark_applied();
            return Ok(true);
        }
    }
    let done =
        with_matref(a, |a| with_matref(b, |b| sink.write(|buf, acc| gemm::sgemm(a, b, buf, None, acc))));
    match done {
        Some(Some(r)) => r.map(|()| true),
        _ => Ok(false),
    }
}

/// `w ← update(w, a·b)` block by block from the GEMM's epilogue (an armed sink's first write).
struct FusedProduct<'a> {
    a: &'a Tensor,
    b: &'a Tensor,
    update: Arc<dyn FusedUpdate>,
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
                gemm::sgemm_epilogue(a, b, None, &|i0, rows, j0, cols, block, ld| {
                    for r in 0..rows {
                        let at = (i0 + r) * n + j0;
                        // SAFETY: the epilogue's blocks are disjoint and lie inside the
                        // `rows(a) × cols(b)` product, which has the parameter's `len` values;
                        // the parameter's storage is locked for writing by this in-place op.
                        let p = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(at), cols) };
                        self.update.update(p, &block[r * ld..r * ld + cols], at);
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
        s.write_sparse(|b| b[1] += 5.0).unwrap();
        assert_eq!(s.state().buf, [0.0, 5.0, 0.0]);
        let err = s.add(&Tensor::new(&[1f32], &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(err.contains("1 values for a parameter of 3"), "{err}");
    }

    #[test]
    fn scope_is_per_thread_and_restored() {
        let w = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let sink = Arc::new(GradSink::new(2));
        assert!(sink_of(&w).is_none());
        {
            let _scope = SinkScope::install(map_of(&[(w.as_tensor(), &sink)]));
            assert!(sink_of(&w).is_some());
            // A detached copy is another tensor.
            assert!(sink_of(&w.as_tensor().detach()).is_none());
            let on_other_thread = std::thread::scope(|s| s.spawn(|| sink_of(&w).is_some()).join().unwrap());
            assert!(!on_other_thread);
        }
        assert!(sink_of(&w).is_none());
    }

    #[test]
    fn gemm_into_sink_accumulates_strided_products() {
        let dev = Device::Cpu;
        let w = Var::zeros((3, 2), DType::F32, &dev).unwrap();
        let a = Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((4, 3)).unwrap().t().unwrap();
        let b = Tensor::arange(0f32, 8.0, &dev).unwrap().reshape((4, 2)).unwrap();
        let want = a.matmul(&b).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let sink = Arc::new(GradSink::new(6));
        let _scope = SinkScope::install(map_of(&[(w.as_tensor(), &sink)]));
        if !gemm::fast_available() {
            assert!(!gemm_into_sink(&w, &a, &b).unwrap());
            return;
        }
        assert!(gemm_into_sink(&w, &a, &b).unwrap());
        assert!(gemm_into_sink(&w, &a, &b).unwrap());
        let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
        assert_eq!(sink.state().buf, twice);
        let err = gemm_into_sink(&w, &a, &b.narrow(1, 0, 1).unwrap()).unwrap_err().to_string();
        assert!(err.contains("3 × 1 for a weight of shape [3, 2]"), "{err}");
    }
}
