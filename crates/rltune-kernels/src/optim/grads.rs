//! [`Grads`]: the gradients of a list of variables, in persistent buffers where the kernels can
//! write them directly.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::grad_sink::{GradSink, GradSlot, SinkMap};

/// The gradients of a list of variables, summed over the backward passes of one update (torch's
/// `param.grad` between `zero_grad()` and `step()`).
///
/// Contiguous f32 CPU variables get a persistent buffer (an `ops::grad_sink::GradSink`): once
/// [`Grads::bind`] points a model's [`GradSlot`] at them, the ops that take its weights write into
/// them directly in the backward, with no zero-filled tensors or adds in candle's gradient store,
/// and [`Grads::backward`] adds whatever the store still holds for the variable (from other ops)
/// after. Other variables keep candle's gradient tensors, summed.
pub struct Grads {
    pub(super) vars: Vec<Var>,
    pub(super) sinks: Vec<Option<Arc<GradSink>>>,
    pub(super) map: Arc<SinkMap>,
    pub(super) tensors: Vec<Option<Tensor>>,
    /// Per variable, whether the last backward gave it exactly one buffered write besides rows
    /// added by an embedding, and nothing in candle's store (so [`Adam::step_fused`] may fuse its
    /// update into that write; see `ops::grad_sink` for the rows).
    pub(super) single_write: Vec<bool>,
}

impl Grads {
    /// Empty gradients for `vars` (buffers are allocated here and kept).
    pub fn new(vars: &[Var]) -> Self {
        let sinks: Vec<Option<Arc<GradSink>>> = vars
            .iter()
            .map(|v| {
                let buffered = crate::cpu_kernels(v.device()) && v.dtype() == DType::F32 && v.is_contiguous();
                buffered.then(|| Arc::new(GradSink::new(v.elem_count())))
            })
            .collect();
        let mut map = SinkMap::default();
        for (v, s) in vars.iter().zip(&sinks) {
            let id = v.as_tensor().id();
            match s {
                Some(s) => {
                    map.sinks.insert(id, Arc::clone(s));
                }
                None => {
                    map.dense.insert(id);
                }
            }
        }
        let single_write = vec![false; vars.len()];
        Self { vars: vars.to_vec(), sinks, map: Arc::new(map), tensors: vec![None; vars.len()], single_write }
    }

    /// Forgets every gradient (torch's `zero_grad(set_to_none=True)`); buffers are kept.
    pub fn clear(&mut self) {
        self.sinks.iter().flatten().for_each(|s| s.clear());
        self.tensors.iter_mut().for_each(|t| *t = None);
    }

    /// Points `slot` at these gradients' buffers (torch's `param.grad`): the ops that read the
    /// slot in their forward (a model's layers, each holding its store's slot) then write their
    /// weights' gradients into these buffers in the backward, with no gradient tensor, until the
    /// slot is bound elsewhere or these gradients are dropped.
    /// `let grads = Grads::new(&store.vars()); grads.bind(store.grad_slot());`
    pub fn bind(&self, slot: &GradSlot) {
        slot.bind(&self.map);
    }

    /// `loss.backward()`, adding the variables' gradients to these (with those that checkpointed
    /// segments' backward passes set aside, [`crate::checkpoint`]). Gradients the bound ops wrote
    /// into the buffers are there already; those in candle's store are added.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        crate::lock(&self.map.aside).clear();
        self.map.collecting.store(true, Ordering::Release);
        let store = loss.backward();
        self.map.collecting.store(false, Ordering::Release);
        let store = store?;
        let mut aside = std::mem::take(&mut *crate::lock(&self.map.aside));
        for i in 0..self.vars.len() {
            let stored = store.get(self.vars[i].as_tensor());
            let nested = aside.remove(&self.vars[i].as_tensor().id());
            let dense = self.sinks[i].as_ref().map_or(0, |s| {
                let s = s.state();
                s.writes - s.row_writes
            });
            self.single_write[i] = dense == 1 && stored.is_none() && nested.is_none();
            for g in stored.into_iter().chain(nested.as_ref()) {
                self.add(i, g)?;
            }
        }
        Ok(())
    }

    /// Adds `g` to variable `i`'s gradient.
    pub fn add(&mut self, i: usize, g: &Tensor) -> Result<()> {
        match &self.sinks[i] {
            Some(sink) => sink.add(g)?,
            None => {
                // Detached: a gradient from `backward` still references the forward graph it came
                // from, and the device-side moments built from it would chain every step's graph
                // to the next (on CUDA the quickstart's SFT ran out of 80 GB this way).
                let g = g.detach();
                let slot = &mut self.tensors[i];
                *slot = Some(match slot.take() {
                    Some(prev) => (prev + g)?,
                    None => g,
                });
            }
        }
        Ok(())
    }

    /// Replaces the gradients by `reduce`'s result, over flat f32 copies: the all-reduce of a
    /// data-parallel step. `reduce` gets one slice per variable, in order (zeros where the
    /// variable has no gradient here), then one slice of presence flags (1 where it has one).
    /// Afterwards a variable has a gradient where its flag came back non-zero, so a variable
    /// that some process left without a gradient still gets the others' (as torch's DDP, with
    /// zeros). Every process must call it with the same variables. An update already fused into
    /// the backward (PPO's [`super::Adam::step_fused`]) cannot be reduced: the caller must not
    /// arm one in a data-parallel run.
    pub fn reduce_flat(&mut self, reduce: impl FnOnce(&mut [&mut [f32]]) -> Result<()>) -> Result<()> {
        let n = self.vars.len();
        let mut present: Vec<f32> = (0..n).map(|i| f32::from(u8::from(self.has(i)))).collect();
        // Variables without a sink: their gradients as host f32 vectors (zeros where none).
        let mut dense: Vec<Option<Vec<f32>>> = Vec::with_capacity(n);
        for (i, var) in self.vars.iter().enumerate() {
            dense.push(match (&self.sinks[i], &self.tensors[i]) {
                (Some(_), _) => None,
                (None, Some(t)) => Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
                (None, None) => Some(vec![0.0; var.elem_count()]),
            });
        }
        let mut states: Vec<_> = self.sinks.iter().map(|s| s.as_ref().map(|s| s.state())).collect();
        for s in states.iter_mut().flatten() {
            if s.partial || s.applied {
                return Err(Error::Internal(
                    "a gradient whose update was fused into the backward cannot be all-reduced".into(),
                ));
            }
            if !s.filled {
                s.buf.iter_mut().for_each(|g| *g = 0.0);
            }
        }
        {
            let mut slices: Vec<&mut [f32]> = states
                .iter_mut()
                .zip(dense.iter_mut())
                .map(|(s, d)| match (s, d) {
                    (Some(s), _) => s.buf.as_mut_slice(),
                    (None, Some(d)) => d.as_mut_slice(),
                    (None, None) => unreachable!("a variable has a sink or a dense gradient"),
                })
                .collect();
            slices.push(present.as_mut_slice());
            reduce(&mut slices)?;
        }
        for (i, s) in states.iter_mut().enumerate() {
            if let Some(s) = s {
                s.filled = present[i] != 0.0;
            }
        }
        drop(states);
        for (i, d) in dense.into_iter().enumerate() {
            let Some(d) = d else { continue };
            let var = &self.vars[i];
            self.tensors[i] = if present[i] != 0.0 {
                Some(Tensor::from_vec(d, var.shape(), var.device())?.to_dtype(var.dtype())?)
            } else {
                None
            };
        }
        Ok(())
    }

    /// Whether variable `i` has a gradient.
    pub fn has(&self, i: usize) -> bool {
        match &self.sinks[i] {
            Some(sink) => sink.state().filled,
            None => self.tensors[i].is_some(),
        }
    }

    /// Variable `i`'s gradient as a tensor of its shape and dtype (a copy), if it has one.
    pub fn get(&self, i: usize) -> Result<Option<Tensor>> {
        let var = &self.vars[i];
        match &self.sinks[i] {
            Some(sink) => {
                let s = sink.state();
                // A partly fused update left only the held rows' gradient: none to give.
                Ok((s.filled && !s.partial)
                    .then(|| Tensor::from_vec(s.buf.clone(), var.shape(), var.device()))
                    .transpose()?)
            }
            None => Ok(self.tensors[i].clone()),
        }
    }

    /// Scales the gradients so their global L2 norm is at most `max_norm`; returns the norm
    /// before (computed in f64). torch `clip_grad_norm_`: `coef = min(1, max_norm / (norm + 1e-6))`.
    pub fn clip_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.global_norm()?;
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        if coef < 1.0 {
            for sink in self.sinks.iter().flatten() {
                let mut s = sink.state();
                if s.filled {
                    s.buf.par_iter_mut().for_each(|g| *g *= coef as f32);
                }
            }
            for g in self.tensors.iter_mut().flatten() {
                *g = (&*g * coef)?;
            }
        }
        Ok(norm)
    }

    /// The global L2 norm of the gradients (computed in f64); non-finite when any entry is.
    /// After a partly fused product only the held rows hold a gradient: only they count.
    pub fn global_norm(&self) -> Result<f64> {
        let sum_sq = |c: &[f32]| c.iter().map(|&g| g as f64 * g as f64).sum::<f64>();
        let mut sq = 0f64;
        for sink in self.sinks.iter().flatten() {
            let s = sink.state();
            if !s.filled {
                continue;
            }
            match s.held.as_ref().filter(|_| s.partial) {
                Some((len, held)) => {
                    sq += s
                        .buf
                        .chunks(*len)
                        .zip(held)
                        .filter(|(_, &h)| h)
                        .map(|(row, _)| sum_sq(row))
                        .sum::<f64>()
                }
                None => sq += s.buf.par_chunks(1 << 16).map(sum_sq).sum::<f64>(),
            }
        }
        // Off the CPU, one transfer for all of them (each `to_scalar` is a device sync); on
        // CUDA one kernel per tensor ([`crate::cuda::sums_of_squares`]).
        #[cfg(feature = "cuda")]
        {
            let cuda: Vec<Tensor> =
                self.tensors.iter().flatten().filter(|g| crate::cuda_kernels(g.device())).cloned().collect();
            if cuda.len() == self.tensors.iter().flatten().count() {
                if let Some(sums) = crate::cuda::sums_of_squares(&cuda)? {
                    return Ok((sq + sums.iter().sum::<f64>()).sqrt());
                }
            }
        }
        let mut on_device = Vec::new();
        for g in self.tensors.iter().flatten() {
            if g.device().is_cpu() {
                sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            } else {
                on_device.push(sum_sq_by_rows(g)?);
            }
        }
        if !on_device.is_empty() {
            sq += Tensor::stack(&on_device, 0)?.to_vec1::<f64>()?.iter().sum::<f64>();
        }
        Ok(sq.sqrt())
    }
}

/// The sum of `g`'s squares in f64, summed by rows first: a 0-dimensional f64 tensor on `g`'s
/// device.
///
/// A GPU reduces each output element in one thread block, so a whole-tensor `sum_all` of a
/// weight runs on one block: on an H100 it took 550 µs a weight, 71% of a GPT-2 PPO
/// iteration's kernel time (the 2026-11-28 kernel profile). Rows first spreads it over as many
/// blocks as the weight has rows, then sums those partial sums. Equal to the single-pass sum up
/// to f64 rounding (the order of additions differs), so the CPU keeps the single pass and its
/// bits.
pub(crate) fn sum_sq_by_rows(g: &Tensor) -> Result<Tensor> {
    const COLS: usize = 1024;
    let sq = g.to_dtype(DType::F64)?.sqr()?;
    let n = sq.elem_count();
    let rows = match sq.rank() {
        0 => return Ok(sq),
        1 if n % COLS == 0 => sq.reshape((n / COLS, COLS))?,
        1 => return Ok(sq.sum_all()?),
        r => sq.flatten_to(r - 2)?,
    };
    Ok(rows.sum(1)?.sum_all()?)
}
