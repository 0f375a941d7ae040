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

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Storage, Tensor, TensorId};

use super::gemm::{self, MatRef};
use super::{lock, CResult};

/// One parameter's gradient buffer.
#[derive(Debug)]
pub(crate) struct GradSink {
    state: Mutex<SinkState>,
}

/// A sink's buffer and whether it holds a gradient since the last clear.
#[derive(Debug)]
pub(crate) struct SinkState {
    /// The gradient, row-major in the parameter's shape (stale while `filled` is false).
    pub buf: Vec<f32>,
    /// Whether a gradient was written since the last [`GradSink::clear`].
    pub filled: bool,
}

impl GradSink {
    /// A sink for a parameter of `len` values.
    pub fn new(len: usize) -> Self {
        Self { state: Mutex::new(SinkState { buf: vec![0.0; len], filled: false }) }
    }

    /// Forgets the gradient (the buffer is kept, and overwritten by the next write).
    pub fn clear(&self) {
        lock(&self.state).filled = false;
    }

    /// The buffer and whether it holds a gradient.
    pub fn state(&self) -> MutexGuard<'_, SinkState> {
        lock(&self.state)
    }

    /// Runs `f(buf, accumulate)`: `accumulate` is false for the first write since the last clear
    /// (`f` must then overwrite every value it is responsible for; see [`Self::write_sparse`]).
    pub fn write(&self, f: impl FnOnce(&mut [f32], bool)) {
        let mut s = lock(&self.state);
        let acc = s.filled;
        f(&mut s.buf, acc);
        s.filled = true;
    }

    /// Like [`Self::write`] for a writer that touches only some values (a scatter): a first write
    /// zero-fills the buffer before `f` adds into it.
    pub fn write_sparse(&self, f: impl FnOnce(&mut [f32])) {
        self.write(|buf, acc| {
            if !acc {
                buf.fill(0.0);
            }
            f(buf)
        })
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
        });
        Ok(())
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

/// Runs `f` on the f32 CPU data of a rank-2 tensor as a [`MatRef`] (any strides); `None` for
/// other tensors.
fn with_matref<R>(t: &Tensor, f: impl FnOnce(MatRef) -> R) -> Option<R> {
    let (s, l) = t.storage_and_layout();
    let (Storage::Cpu(candle_core::CpuStorage::F32(data)), &[rows, cols]) = (&*s, l.dims()) else {
        return None;
    };
    let st = l.stride();
    Some(f(MatRef { data, off: l.start_offset(), rows, cols, rs: st[0], cs: st[1] }))
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
    let done = with_matref(a, |a| {
        with_matref(b, |b| {
            sink.write(|buf, acc| gemm::sgemm(a, b, buf, None, acc));
        })
    });
    Ok(matches!(done, Some(Some(()))))
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
        });
        s.add(&Tensor::new(&[1f32, 1.0, 1.0], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(s.state().buf, [2.0, 3.0, 4.0]);
        s.clear();
        assert!(!s.state().filled);
        s.write_sparse(|b| b[1] += 5.0);
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
