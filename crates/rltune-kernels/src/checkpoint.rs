//! Gradient checkpointing: torch's `torch.utils.checkpoint`, as transformers'
//! `gradient_checkpointing_enable()` applies it to every decoder layer (TRL's
//! `gradient_checkpointing`).
//!
//! [`checkpoint`]`(x, f)` runs the segment `f` (a decoder block) on `x` and keeps nothing of it
//! for the backward but `x` itself: the segment's graph, with every activation it saved, is
//! dropped as soon as its output is copied out. The backward runs `f` again on the same input,
//! backpropagates the output's gradient through that fresh graph, and hands the weights'
//! gradients over to the [`crate::Grads`] that the segment's [`GradSlot`] pointed at in the
//! forward: a weight with a gradient sink gets them in its sink (the ops that take weights write
//! there directly, as in any backward of a bound model), any other variable of the `Grads` gets
//! them set aside, and [`crate::Grads::backward`] adds them after candle's backward. The input's
//! gradient goes back to candle.
//!
//! The recomputation takes the same path as the first run (the same ops on the same values, the
//! fused ones included), so the gradients are those of the plain forward: the segment's output
//! is the same bits, and so is each gradient it produces (what may differ is the order in which
//! a tensor's gradient contributions from inside and outside the segment are summed).
//!
//! With an unbound slot (no `Grads` collects the gradients) [`checkpoint`] runs `f` plainly:
//! there is no place to hand a nested backward's weight gradients to, and checkpointing never
//! changes a result, only the memory. A segment must be a pure function of its input and of tensors it
//! owns (no dropout, no state it updates).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor, Var};

use crate::grad_sink::{GradSlot, Sinks};
use crate::{lock, CResult};

/// Segments recomputed by backward passes in this process, for tests and reports that must
/// tell whether checkpointing took effect.
static RECOMPUTED: AtomicUsize = AtomicUsize::new(0);

/// How many checkpointed segments backward passes have recomputed in this process so far.
pub fn checkpoint_recomputations() -> usize {
    RECOMPUTED.load(Ordering::Relaxed)
}

/// Counts one segment recomputed by a backward pass outside [`checkpoint`] (the LM head's
/// chunks).
pub(crate) fn note_recomputation() {
    RECOMPUTED.fetch_add(1, Ordering::Relaxed);
}

/// A checkpointed segment: `x ↦ f(x)`, run twice (forward, then again in the backward).
pub type Segment = Arc<dyn Fn(&Tensor) -> CResult<Tensor> + Send + Sync>;

/// `f(x)` keeping only `x` for the backward (see the module docs); the weights' gradients go
/// where `grads` points (the slot of the store that `f`'s weights come from). With `grads`
/// unbound, or when neither `x` nor anything in `f` is tracked, this is `f(x)`.
pub fn checkpoint(x: &Tensor, f: Segment, grads: &GradSlot) -> CResult<Tensor> {
    let sinks = grads.sinks();
    if !sinks.active() {
        return f(x);
    }
    let tracked = x.track_op();
    let input = segment_input(x, tracked)?;
    let out = f(&input)?;
    if !tracked && !out.track_op() {
        return Ok(out);
    }
    // The output alone, without the graph that made it: the segment's activations are freed
    // when `out` is, at the end of this function.
    let kept = out.detach();
    drop(out);
    // The node hangs off `x` when `x` is tracked; otherwise off a fresh leaf, so that the
    // backward still reaches it for the weights inside.
    let arg = if tracked { x.clone() } else { leaf(x)? };
    arg.apply_op1(Checkpoint { f, out: Mutex::new(Some(kept)), tracked, sinks })
}

/// The segment's input, tracked as `x` is: a fresh leaf when `x` is tracked (so the fused ops
/// that need a tracked input take the same path as without checkpointing), `x` detached
/// otherwise.
fn segment_input(x: &Tensor, tracked: bool) -> CResult<Tensor> {
    if tracked {
        leaf(x)
    } else {
        Ok(x.detach())
    }
}

/// A fresh variable holding `x`'s values: a tracked leaf with no graph behind it.
fn leaf(x: &Tensor) -> CResult<Tensor> {
    Ok(Var::from_tensor(&x.detach())?.as_tensor().clone())
}

struct Checkpoint {
    f: Segment,
    /// The output of the first run, until the node's forward copies it out.
    out: Mutex<Option<Tensor>>,
    /// Whether the segment's input is tracked (then the backward gives it a gradient).
    tracked: bool,
    /// The buffers of the `Grads` that collects the segment's weight gradients.
    sinks: Sinks,
}

impl Checkpoint {
    fn take(&self) -> CResult<Tensor> {
        lock(&self.out)
            .take()
            .ok_or_else(|| candle_core::Error::Msg("internal: a checkpoint's forward ran twice".into()))
    }
}

/// A contiguous copy of `out`, on the CPU: the forward of a node that hands over a tensor
/// computed before it (a checkpoint's output, the LM head's log-probabilities). `err` when `out`
/// is elsewhere.
pub(crate) fn cpu_copy(out: &Tensor, err: &str) -> CResult<(CpuStorage, Shape)> {
    let (s, l) = out.storage_and_layout();
    match &*s {
        Storage::Cpu(s) => Ok((copy_out(s, l)?, l.shape().clone())),
        _ => candle_core::bail!("{err}"),
    }
}

/// [`cpu_copy`] on CUDA.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_copy(out: &Tensor, err: &str) -> CResult<(candle_core::CudaStorage, Shape)> {
    let (s, l) = out.storage_and_layout();
    match &*s {
        Storage::Cuda(s) => Ok((copy_out(s, l)?, l.shape().clone())),
        _ => candle_core::bail!("{err}"),
    }
}

/// A copy of `s` laid out as `l`, contiguous.
fn copy_out<S>(s: &S, l: &Layout) -> CResult<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: every element of the fresh buffer is written by the strided copy below.
    let mut dst = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok(dst)
}

impl CustomOp1 for Checkpoint {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        cpu_copy(&self.take()?, "checkpoint: the segment's output is not on the CPU, its input is")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda_copy(&self.take()?, "checkpoint: the segment's output is not on CUDA, its input is")
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> CResult<Option<Tensor>> {
        if !self.sinks.collecting() {
            candle_core::bail!(
                "checkpoint: the backward of a checkpointed forward must run through Grads::backward, \
                 which collects the segment's weight gradients"
            );
        }
        let input = segment_input(arg, self.tracked)?;
        let out = (self.f)(&input)?;
        RECOMPUTED.fetch_add(1, Ordering::Relaxed);
        // d(Σ out ⊙ g)/d out = g exactly: the segment's backward starts from the gradient given.
        let mut grads = (out * grad_res.detach())?.sum_all()?.backward()?;
        self.sinks.hand_over(&mut grads)?;
        Ok(if self.tracked { grads.remove(&input) } else { None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Grads;
    use candle_core::{DType, Device};

    fn var(n: usize, shape: impl Into<Shape>, dtype: DType, k: f64) -> Var {
        let v: Vec<f64> = (0..n).map(|i| ((i as f64 + k) * 0.731).sin() * 0.5).collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
    }

    /// A residual block: `x + W2·gelu(W1·x + b1)`, its weights the segment's own, their
    /// gradients written where `slot` points.
    fn block(w1: &Var, b1: &Var, w2: &Var, slot: &GradSlot) -> Segment {
        let (w1, b1, w2) = (w1.as_tensor().clone(), b1.as_tensor().clone(), w2.as_tensor().clone());
        let slot = slot.clone();
        Arc::new(move |x: &Tensor| {
            let h = crate::gelu_tanh(&crate::linear_with(x, &w1, Some(&b1), &slot)?)?;
            x + crate::linear_with(&h, &w2, None, &slot)?
        })
    }

    /// The gradients of every variable for `Σ y²`, `y` two blocks over the input (`x = a·2`, or
    /// the constant `a` when `tracked_input` is false), with or without checkpointing.
    fn grads(dtype: DType, checkpointed: bool, tracked_input: bool) -> (Vec<u32>, Vec<Vec<f64>>) {
        let a = var(24, (4, 6), dtype, 0.0);
        let layers: Vec<(Var, Var, Var)> = (0..2)
            .map(|l| {
                let k = 10.0 * (l + 1) as f64;
                (var(48, (8, 6), dtype, k), var(8, 8, dtype, k + 1.0), var(48, (6, 8), dtype, k + 2.0))
            })
            .collect();
        let mut vars = vec![a.clone()];
        for (w1, b1, w2) in &layers {
            vars.extend([w1.clone(), b1.clone(), w2.clone()]);
        }
        let mut g = Grads::new(&vars);
        let slot = GradSlot::new();
        g.bind(&slot);
        let loss = (|| -> CResult<Tensor> {
            let mut x = if tracked_input { (a.as_tensor() * 2.0)? } else { a.as_tensor().detach() };
            for (w1, b1, w2) in &layers {
                let f = block(w1, b1, w2, &slot);
                x = if checkpointed { checkpoint(&x, f, &slot)? } else { f(&x)? };
            }
            x.sqr()?.sum_all()
        })()
        .unwrap();
        let bits = loss.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        g.backward(&loss).unwrap();
        let all = (0..vars.len())
            .map(|i| match g.get(i).unwrap() {
                Some(t) => t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                None => Vec::new(),
            })
            .collect();
        (bits.iter().map(|v| v.to_bits()).collect(), all)
    }

    #[test]
    fn checkpointed_gradients_equal_the_plain_ones() {
        // f32 variables have gradient sinks; f64 ones are set aside and added after.
        for dtype in [DType::F32, DType::F64] {
            for tracked_input in [true, false] {
                let (plain_loss, plain) = grads(dtype, false, tracked_input);
                let (ckpt_loss, ckpt) = grads(dtype, true, tracked_input);
                assert_eq!(plain_loss, ckpt_loss, "{dtype:?}: the forward is the same bits");
                for (i, (p, c)) in plain.iter().zip(&ckpt).enumerate() {
                    assert_eq!(p.len(), c.len(), "{dtype:?} tracked {tracked_input}: variable {i}");
                    assert_eq!(p.is_empty(), i == 0 && !tracked_input, "variable {i} has a gradient");
                    // Bit for bit: the same ops on the same values, summed in the same order.
                    let diff = p.iter().zip(c).map(|(p, c)| (p - c).abs()).fold(0.0, f64::max);
                    assert_eq!(diff, 0.0, "{dtype:?} tracked {tracked_input}: variable {i} off by {diff}");
                }
            }
        }
    }

    #[test]
    fn with_an_unbound_slot_it_is_the_plain_forward() {
        let (w1, b1, w2) =
            (var(48, (8, 6), DType::F32, 1.0), var(8, 8, DType::F32, 2.0), var(48, (6, 8), DType::F32, 3.0));
        let x = var(24, (4, 6), DType::F32, 0.0);
        let slot = GradSlot::new();
        let y = checkpoint(x.as_tensor(), block(&w1, &b1, &w2, &slot), &slot).unwrap();
        // A plain graph: candle's own backward reaches the weights.
        let store = y.sum_all().unwrap().backward().unwrap();
        assert!(store.get(w1.as_tensor()).is_some() && store.get(x.as_tensor()).is_some());
    }

    #[test]
    fn a_backward_outside_grads_is_an_error_not_lost_gradients() {
        let (w1, b1, w2) =
            (var(48, (8, 6), DType::F32, 1.0), var(8, 8, DType::F32, 2.0), var(48, (6, 8), DType::F32, 3.0));
        let x = var(24, (4, 6), DType::F32, 0.0);
        let g = Grads::new(&[w1.clone(), b1.clone(), w2.clone()]);
        let slot = GradSlot::new();
        g.bind(&slot);
        let y = checkpoint(x.as_tensor(), block(&w1, &b1, &w2, &slot), &slot).unwrap();
        let err = y.sum_all().unwrap().backward().unwrap_err().to_string();
        assert!(err.contains("must run through Grads::backward"), "{err}");
    }
}
