//! Adam, exactly as `torch.optim.Adam` (the optimizer TRL's PPOTrainer creates), fused on the
//! CPU, and [`Grads`], the gradients it consumes.
//!
//! `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p − (lr/(1−β₁ᵗ)) · m / (√v/√(1−β₂ᵗ) + ε)` — torch's `_single_tensor_adam` order of
//! operations, so results agree to float rounding. f32 parameters on the CPU are updated in place
//! (a candle in-place op) from their gradient buffers, with no copy of either.
//!
//! Variables on another device (CUDA) keep their moments as f32 tensors on that device and are
//! updated with candle's element-wise ops ([`Adam::with_device_moments`] takes that path on the
//! CPU too, for tests): nothing crosses to the host during a step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor, Var};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::grad_sink::{FusedUpdate, GradSink, SinkMap, SinkScope};
use crate::simd::simd_kernel;

/// The gradients of a list of variables, summed over the backward passes of one update (torch's
/// `param.grad` between `zero_grad()` and `step()`).
///
/// Contiguous f32 CPU variables get a persistent buffer (an `ops::grad_sink::GradSink`): during
/// [`Grads::backward`] the ops that take weights write into it directly, with no zero-filled
/// tensors or adds in candle's gradient store, and whatever the store still holds for the
/// variable (from other ops) is added after. Other variables keep candle's gradient tensors,
/// summed.
pub struct Grads {
    vars: Vec<Var>,
    sinks: Vec<Option<Arc<GradSink>>>,
    map: Arc<SinkMap>,
    tensors: Vec<Option<Tensor>>,
    /// Per variable, whether the last backward gave it exactly one buffered write besides rows
    /// added by an embedding, and nothing in candle's store (so [`Adam::step_fused`] may fuse its
    /// update into that write; see `ops::grad_sink` for the rows).
    single_write: Vec<bool>,
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
        let map = vars
            .iter()
            .zip(&sinks)
            .filter_map(|(v, s)| Some((v.as_tensor().id(), Arc::clone(s.as_ref()?))))
            .collect();
        let single_write = vec![false; vars.len()];
        Self { vars: vars.to_vec(), sinks, map: Arc::new(map), tensors: vec![None; vars.len()], single_write }
    }

    /// Forgets every gradient (torch's `zero_grad(set_to_none=True)`); buffers are kept.
    pub fn clear(&mut self) {
        self.sinks.iter().flatten().for_each(|s| s.clear());
        self.tensors.iter_mut().for_each(|t| *t = None);
    }

    /// Installs these gradients' sinks on this thread until the guard drops. A forward run inside
    /// it may use ops that write weight gradients only into sinks (`ops::block`); the backward
    /// ([`Self::backward`]) installs them again itself.
    pub fn scope(&self) -> SinkScope {
        SinkScope::install(Arc::clone(&self.map))
    }

    /// `loss.backward()`, adding the variables' gradients to these.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let store = {
            let _scope = SinkScope::install(Arc::clone(&self.map));
            loss.backward()?
        };
        for i in 0..self.vars.len() {
            let stored = store.get(self.vars[i].as_tensor());
            let dense = self.sinks[i].as_ref().map_or(0, |s| {
                let s = s.state();
                s.writes - s.row_writes
            });
            self.single_write[i] = dense == 1 && stored.is_none();
            if let Some(g) = stored {
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
        for g in self.tensors.iter().flatten() {
            sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        Ok(sq.sqrt())
    }
}

/// Adam hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// β₁
    pub beta1: f64,
    /// β₂
    pub beta2: f64,
    /// ε, added to the denominator.
    pub eps: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        Self { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }
}

/// Adam's first and second moments of one variable.
enum Moments {
    /// Plain vectors, updated in place by the fused CPU kernels.
    Host { m: Vec<f32>, v: Vec<f32> },
    /// f32 tensors of the variable's shape on its device, updated with candle ops.
    Device { m: Tensor, v: Tensor },
}

impl Moments {
    fn host(n: usize) -> Self {
        Self::Host { m: zeroed(n), v: zeroed(n) }
    }

    fn device(var: &Var) -> Result<Self> {
        let zeros = || Tensor::zeros(var.shape(), DType::F32, var.device());
        Ok(Self::Device { m: zeros()?, v: zeros()? })
    }
}

/// Adam over a fixed list of variables, with its moments kept as plain vectors on the CPU and as
/// tensors on the variables' device elsewhere.
pub struct Adam {
    vars: Vec<Var>,
    moments: Vec<Moments>,
    step: u64,
    /// Hyper-parameters (the learning rate may be changed between steps).
    pub cfg: AdamConfig,
}

impl Adam {
    /// A fresh optimizer over `vars`: moments as vectors for CPU variables, as tensors on the
    /// device for the others (and inside an `ops::ComposedScope`).
    pub fn new(vars: Vec<Var>, cfg: AdamConfig) -> Result<Self> {
        let moments = vars
            .iter()
            .map(|v| {
                if crate::cpu_kernels(v.device()) {
                    Ok(Moments::host(v.elem_count()))
                } else {
                    Moments::device(v)
                }
            })
            .collect::<Result<_>>()?;
        Ok(Self { vars, moments, step: 0, cfg })
    }

    /// A fresh optimizer that keeps every moment as a tensor on its variable's device and
    /// updates with candle's element-wise ops: what a GPU runs, here on any device (the CPU's
    /// fused and in-place paths are not used; see the module docs).
    pub fn with_device_moments(vars: Vec<Var>, cfg: AdamConfig) -> Result<Self> {
        let moments = vars.iter().map(Moments::device).collect::<Result<_>>()?;
        Ok(Self { vars, moments, step: 0, cfg })
    }

    /// Number of steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The variables, in order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// First and second moments of variable `i` as f32 CPU tensors of its shape (copies, for
    /// checkpoints).
    pub fn moments(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let shape = self.vars[i].shape();
        let cpu = candle_core::Device::Cpu;
        Ok(match &self.moments[i] {
            Moments::Host { m, v } => {
                (Tensor::from_slice(m, shape, &cpu)?, Tensor::from_slice(v, shape, &cpu)?)
            }
            Moments::Device { m, v } => (m.to_device(&cpu)?, v.to_device(&cpu)?),
        })
    }

    /// Restores moments (flattened, one pair per variable) and the step count (from a
    /// checkpoint); sizes are checked.
    pub fn restore(&mut self, m: Vec<Vec<f32>>, v: Vec<Vec<f32>>, step: u64) -> Result<()> {
        if m.len() != self.vars.len() || v.len() != self.vars.len() {
            return Err(Error::StateMismatch(format!(
                "optimizer state for {} / {} variables given to an optimizer over {}",
                m.len(),
                v.len(),
                self.vars.len()
            )));
        }
        for (i, (m, v)) in m.into_iter().zip(v).enumerate() {
            let var = &self.vars[i];
            if m.len() != var.elem_count() || v.len() != var.elem_count() {
                return Err(Error::StateMismatch(format!(
                    "optimizer state of variable {i}: {} / {} values for a parameter of {}",
                    m.len(),
                    v.len(),
                    var.elem_count()
                )));
            }
            self.moments[i] = match self.moments[i] {
                Moments::Host { .. } => Moments::Host { m, v },
                Moments::Device { .. } => Moments::Device {
                    m: Tensor::from_vec(m, var.shape(), var.device())?,
                    v: Tensor::from_vec(v, var.shape(), var.device())?,
                },
            };
        }
        self.step = step;
        Ok(())
    }

    /// One update from `grads` (built over the same variables); variables without a gradient
    /// are skipped.
    ///
    /// f32 CPU variables are updated in place, in one pass over parameter, gradient buffer and
    /// moments; others go through a copy.
    pub fn step(&mut self, grads: &Grads) -> Result<()> {
        self.check(grads)?;
        self.step += 1;
        let k = self.consts(self.step);
        self.apply(grads, k)
    }

    /// `backward(grads)` and one update, with the update of each variable whose whole gradient
    /// is one weight-gradient product (a linear layer's weight, an untied LM head) fused into
    /// that product: its blocks update the parameter from the GEMM's epilogue, so the gradient
    /// is never stored and read back (for GPT-2 the update's memory traffic drops by a third,
    /// and overlaps the backward's products). A tied table (the LM head's product, then an
    /// embedding's rows) is updated in the product too, except the rows its embedding held in
    /// a forward run inside the gradients' scope (see `ops::grad_sink`), which are updated after
    /// the backward with the other variables. Results are those of `backward` then
    /// [`Self::step`], bit for bit (at the default f32 matmul precision: the fused products always
    /// run the f32 kernels, so under `MatmulPrecision::Bf16` their gradients are the f32 ones).
    ///
    /// `backward` returns whether it ran a backward pass (false: no update, as for a skipped
    /// minibatch). Which variables are fused is learned from the previous backward on `grads`
    /// (the first runs unfused). Not for accumulated or clipped gradients, which need all of
    /// them before any update. If `backward` fails, some variables may have been updated.
    ///
    /// A non-finite gradient never reaches the weights: a fused block holding one is not
    /// applied (its weights and moments stay), and the update of the other variables is then
    /// skipped ([`FusedStep::NonFinite`]). Blocks fused before it was met keep their update.
    ///
    /// `E` is the caller's error type: `backward`'s errors come back as they are.
    pub fn step_fused<E: From<Error>>(
        &mut self,
        grads: &mut Grads,
        backward: impl FnOnce(&mut Grads) -> std::result::Result<bool, E>,
    ) -> std::result::Result<FusedStep, E> {
        self.check(grads)?;
        let k = self.consts(self.step + 1);
        let armed = Armed(grads.sinks.iter().flatten().cloned().collect());
        let non_finite = Arc::new(AtomicBool::new(false));
        for (i, sink) in grads.sinks.iter().enumerate() {
            let Some(sink) = sink.as_ref().filter(|_| grads.single_write[i]) else { continue };
            let Moments::Host { m, v } = &mut self.moments[i] else { continue };
            let update = FusedAdam {
                m: RawVec(m.as_mut_ptr()),
                v: RawVec(v.as_mut_ptr()),
                len: m.len(),
                k,
                non_finite: non_finite.clone(),
            };
            sink.arm(Some(Arc::new(update)));
        }
        let ran = backward(grads);
        drop(armed);
        if !ran? {
            return Ok(FusedStep::Skipped);
        }
        if non_finite.load(Ordering::Relaxed) || !grads.global_norm()?.is_finite() {
            return Ok(FusedStep::NonFinite);
        }
        self.step += 1;
        self.apply(grads, k)?;
        Ok(FusedStep::Updated)
    }

    /// Checks that `grads` were built over this optimizer's variables.
    fn check(&self, grads: &Grads) -> Result<()> {
        let same =
            |a: &[Var], b: &[Var]| a.iter().zip(b).all(|(x, y)| x.as_tensor().id() == y.as_tensor().id());
        if grads.vars.len() != self.vars.len() || !same(&grads.vars, &self.vars) {
            return Err(Error::GradsMismatch(format!(
                "gradients for {} variables given to an optimizer over {} other ones (build Grads from Adam::vars)",
                grads.vars.len(),
                self.vars.len()
            )));
        }
        Ok(())
    }

    /// The constants of step `t` (counted from 1).
    fn consts(&self, t: u64) -> AdamConsts {
        let t = t as i32;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        AdamConsts {
            step_size: (c.lr / bc1) as f32,
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            eps: c.eps as f32,
            bc2s: bc2_sqrt as f32,
        }
    }

    /// Updates every variable with a gradient in `grads` (a fused update leaves none).
    fn apply(&mut self, grads: &Grads, k: AdamConsts) -> Result<()> {
        for (i, var) in self.vars.iter().enumerate() {
            let (m, v) = match &mut self.moments[i] {
                Moments::Host { m, v } => (m, v),
                Moments::Device { m, v } => {
                    let g = match (&grads.sinks[i], &grads.tensors[i]) {
                        (Some(_), _) => grads.get(i)?,
                        (None, g) => g.clone(),
                    };
                    if let Some(g) = g {
                        k.update_tensors(var, &g, m, v)?;
                    }
                    continue;
                }
            };
            if let Some(sink) = &grads.sinks[i] {
                let s = sink.state();
                if s.filled {
                    // After a partly fused product, only the held rows are left to update.
                    let rows = s.held.as_ref().filter(|_| s.partial);
                    let op = AdamInplace { g: &s.buf, m: Mutex::new(m), v: Mutex::new(v), k, rows };
                    var.as_tensor().inplace_op1(&op)?;
                }
                continue;
            }
            let Some(g) = &grads.tensors[i] else { continue };
            let dtype = var.dtype();
            let mut p = var.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let g = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            k.update(&mut p, &g, m, v);
            let new = Tensor::from_vec(p, var.shape(), var.device())?.to_dtype(dtype)?;
            var.set(&new)?;
        }
        Ok(())
    }
}

/// `n` zeros written now, in parallel. `vec![0.0; n]` is calloc's untouched zero pages: the first
/// update reads each page (mapping the shared zero page), then writes it, a second fault that
/// copies the page and flushes the other CPU's TLB.
fn zeroed(n: usize) -> Vec<f32> {
    let mut v = Vec::new();
    v.par_extend(rayon::iter::repeat_n(0f32, n));
    v
}

/// Disarms the sinks when dropped (also when the backward fails or panics), so no sink keeps
/// a pointer into the optimizer's moments.
struct Armed(Vec<Arc<GradSink>>);

impl Drop for Armed {
    fn drop(&mut self) {
        self.0.iter().for_each(|s| s.arm(None));
    }
}

/// A pointer to a moment vector, shared by the epilogue's threads (they update disjoint ranges).
#[derive(Clone, Copy)]
struct RawVec(*mut f32);
// SAFETY: only dereferenced in `FusedAdam::update`, on disjoint ranges, while the optimizer that
// owns the vector is mutably borrowed by `Adam::step_fused` (the sinks are disarmed before it
// returns).
unsafe impl Send for RawVec {}
unsafe impl Sync for RawVec {}

/// What [`Adam::step_fused`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedStep {
    /// The backward ran and every variable was updated.
    Updated,
    /// The backward reported no pass (a skipped minibatch): nothing was updated.
    Skipped,
    /// A gradient was not finite: the update was skipped (see [`Adam::step_fused`]).
    NonFinite,
}

/// One variable's Adam update, run on blocks of its gradient from the GEMM's epilogue.
struct FusedAdam {
    m: RawVec,
    v: RawVec,
    len: usize,
    k: AdamConsts,
    /// Set when a block's gradient is not finite (that block is left alone).
    non_finite: Arc<AtomicBool>,
}

impl FusedUpdate for FusedAdam {
    fn update(&self, p: &mut [f32], g: &[f32], at: usize) {
        assert!(at + p.len() <= self.len && g.len() == p.len(), "fused adam: a block outside the parameter");
        // SAFETY: in bounds (checked above); ranges handed over are disjoint, and the moments
        // outlive the armed sink (see `RawVec`).
        let (m, v) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.m.0.add(at), p.len()),
                std::slice::from_raw_parts_mut(self.v.0.add(at), p.len()),
            )
        };
        if !all_finite(g) {
            self.non_finite.store(true, Ordering::Relaxed);
            return;
        }
        if self.non_finite.load(Ordering::Relaxed) {
            return;
        }
        self.k.update_rows(p, g, m, v);
    }
}

/// The per-step constants of the update.
#[derive(Debug, Clone, Copy)]
struct AdamConsts {
    step_size: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    bc2s: f32,
}

impl AdamConsts {
    /// torch `_single_tensor_adam`, element by element, in parallel chunks.
    fn update(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        p.par_chunks_mut(4096)
            .zip(m.par_chunks_mut(4096))
            .zip(v.par_chunks_mut(4096))
            .zip(g.par_chunks(4096))
            .for_each(|(((p, m), v), g)| self.update_rows(p, g, m, v));
    }

    /// The same update with candle ops on `var`'s device (torch's order of operations; the
    /// divisions by constants are multiplications by their inverse, so results agree with
    /// [`Self::update`] to float rounding, not bit for bit).
    fn update_tensors(&self, var: &Var, g: &Tensor, m: &mut Tensor, v: &mut Tensor) -> Result<()> {
        let AdamConsts { step_size, b1, b2, eps, bc2s } = *self;
        let (one, f) = (1f32, |x: f32| x as f64);
        let g = g.detach().to_dtype(DType::F32)?;
        // m + (g − m)(1 − β₁): torch's `lerp_`.
        *m = (&*m + ((&g - &*m)? * f(one - b1))?)?;
        // v·β₂ + (1 − β₂)·g·g: `mul_(β₂).addcmul_(g, g, 1 − β₂)`.
        *v = ((&*v * f(b2))? + ((&g * f(one - b2))? * &g)?)?;
        let denom = ((v.sqrt()? / f(bc2s))? + f(eps))?;
        let p = var.as_tensor().to_dtype(DType::F32)?;
        let p = (p - ((&*m * f(step_size))? / denom)?)?;
        var.set(&p.to_dtype(var.dtype())?)?;
        Ok(())
    }

    /// The update of one range on this thread.
    fn update_rows(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let AdamConsts { step_size, b1, b2, eps, bc2s } = *self;
        adam_rows(p, g, m, v, [step_size, b1, b2, eps, bc2s]);
    }
}

simd_kernel! {
    /// One chunk of the update, `k = [step_size, β₁, β₂, ε, √(1−β₂ᵗ)]`; compiled for AVX2 and
    /// AVX-512 too (the update is memory-bound, but the square root and division are not
    /// free: 124M of each per step on GPT-2).
    fn adam_rows<T: num_traits::Float>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], k: [T; 5]) {
        let [step_size, b1, b2, eps, bc2s] = k;
        let one = T::one();
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m = *m + (g - *m) * (one - b1);
            *v = *v * b2 + (one - b2) * g * g;
            let denom = v.sqrt() / bc2s + eps;
            *p = *p - step_size * *m / denom;
        }
    }
}

simd_kernel! {
    /// Whether every value is finite: `x · 0` is 0 for a finite x and NaN for NaN or ±∞, summed
    /// in 64 independent lanes so the pass over a block still in cache vectorizes.
    fn all_finite<T: num_traits::Float>(g: &[T]) -> bool {
        const W: usize = 64;
        let mut acc = [T::zero(); W];
        let chunks = g.chunks_exact(W);
        let rest = chunks.remainder();
        for c in chunks {
            for l in 0..W {
                acc[l] = acc[l] + c[l] * T::zero();
            }
        }
        let tail = rest.iter().fold(T::zero(), |a, &x| a + x * T::zero());
        acc.iter().fold(tail, |a, &x| a + x) == T::zero()
    }
}

/// The in-place update of one f32 CPU variable from its gradient buffer.
struct AdamInplace<'a> {
    g: &'a [f32],
    m: Mutex<&'a mut Vec<f32>>,
    v: Mutex<&'a mut Vec<f32>>,
    k: AdamConsts,
    /// Only these rows, as `(row length, updated?)` per row.
    rows: Option<&'a (usize, Vec<bool>)>,
}

impl InplaceOp1 for AdamInplace<'_> {
    fn name(&self) -> &'static str {
        "rltune-adam"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let Some((p0, p1)) = l.contiguous_offsets() else {
            candle_core::bail!("adam: the parameter must be contiguous");
        };
        let CpuStorage::F32(p) = s else {
            candle_core::bail!("adam: the parameter must be f32");
        };
        let mut m = self.m.lock().map_err(|_| candle_core::Error::Msg("adam: poisoned lock".into()))?;
        let mut v = self.v.lock().map_err(|_| candle_core::Error::Msg("adam: poisoned lock".into()))?;
        let p = &mut p[p0..p1];
        if p.len() != self.g.len() || p.len() != m.len() || p.len() != v.len() {
            candle_core::bail!("adam: parameter, gradient and moments differ in size");
        }
        match self.rows {
            None => self.k.update(p, self.g, &mut m[..], &mut v[..]),
            Some((len, rows)) => {
                let len = *len;
                if rows.len() * len != p.len() {
                    candle_core::bail!("adam: rows of {len} do not cover a parameter of {}", p.len());
                }
                for (r, _) in rows.iter().enumerate().filter(|(_, &held)| held) {
                    let at = r * len..(r + 1) * len;
                    self.k.update_rows(
                        &mut p[at.clone()],
                        &self.g[at.clone()],
                        &mut m[at.clone()],
                        &mut v[at],
                    );
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate as ops;
    use crate::grad_sink::SinkState;
    use candle_core::Device;

    /// Gradients holding `g` for the single variable `var`.
    fn grads_of(var: &Var, g: Tensor) -> Grads {
        let mut grads = Grads::new(std::slice::from_ref(var));
        grads.add(0, &g).unwrap();
        grads
    }

    #[test]
    fn adam_first_step_moves_each_weight_by_lr() {
        // With bias correction, step 1 moves every weight by lr·sign(g) (up to ε).
        let var = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
        let mut adam = Adam::new(vec![var.clone()], AdamConfig { lr: 0.1, ..Default::default() }).unwrap();
        adam.step(&grads_of(&var, Tensor::new(&[0.5f32, -3.0, 1e-3], &Device::Cpu).unwrap())).unwrap();
        let p = var.as_tensor().to_vec1::<f32>().unwrap();
        for (got, want) in p.iter().zip([0.9f32, -1.9, 2.9]) {
            assert!((got - want).abs() < 1e-4, "{got} vs {want}");
        }
        let err = adam.step(&Grads::new(&[])).unwrap_err().to_string();
        assert!(err.contains("gradients for 0 variables given to an optimizer over 1"), "{err}");
        let other = Var::new(&[0f32, 0.0, 0.0], &Device::Cpu).unwrap();
        let err = adam.step(&Grads::new(&[other])).unwrap_err().to_string();
        assert!(err.contains("build Grads from Adam::vars"), "{err}");
    }

    #[test]
    fn inplace_update_equals_copy_update() {
        // An f64 variable takes the copy path (computed in f32, like the in-place f32 path).
        let init: Vec<f32> = (0..9000).map(|i| ((i as f32) * 0.37).sin()).collect();
        let dev = Device::Cpu;
        let a = Var::from_tensor(&Tensor::from_vec(init.clone(), (90, 100), &dev).unwrap()).unwrap();
        let b =
            Var::from_tensor(&Tensor::from_vec(init, (90, 100), &dev).unwrap().to_dtype(DType::F64).unwrap())
                .unwrap();
        let cfg = AdamConfig { lr: 0.01, ..Default::default() };
        let (mut oa, mut ob) =
            (Adam::new(vec![a.clone()], cfg).unwrap(), Adam::new(vec![b.clone()], cfg).unwrap());
        let (mut ga, mut gb) = (Grads::new(std::slice::from_ref(&a)), Grads::new(std::slice::from_ref(&b)));
        for s in 0..3 {
            let g: Vec<f32> = (0..9000).map(|i| ((i * (s + 2)) as f32 * 0.11).cos()).collect();
            let g = Tensor::from_vec(g, (90, 100), &dev).unwrap();
            ga.clear();
            gb.clear();
            ga.add(0, &g).unwrap();
            gb.add(0, &g.to_dtype(DType::F64).unwrap()).unwrap();
            oa.step(&ga).unwrap();
            ob.step(&gb).unwrap();
        }
        let pa = a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let pb = b.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(pa, pb);
        let flat = |(m, v): (Tensor, Tensor)| {
            (
                m.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        };
        assert_eq!(flat(oa.moments(0).unwrap()), flat(ob.moments(0).unwrap()));
    }

    /// Issue #30: the GPU's update (moments as device tensors, candle ops) against the fused CPU
    /// one, on the CPU: the same weights and moments to float rounding, three steps in, and the
    /// moments survive a checkpoint round trip.
    #[test]
    fn device_moments_update_like_the_fused_cpu_path() {
        let init = |seed: u64| crate::testutil::randn(&[37, 19], seed).to_dtype(DType::F32).unwrap();
        let vars = |_| vec![Var::from_tensor(&init(1)).unwrap(), Var::from_tensor(&init(2)).unwrap()];
        let (va, vb): (Vec<Var>, Vec<Var>) = (vars(0), vars(1));
        let cfg = AdamConfig { lr: 0.01, ..Default::default() };
        let mut oa = Adam::new(va.clone(), cfg).unwrap();
        let mut ob = Adam::with_device_moments(vb.clone(), cfg).unwrap();
        assert!(
            matches!(oa.moments[0], Moments::Host { .. }) && matches!(ob.moments[0], Moments::Device { .. })
        );
        let (mut ga, mut gb) = (Grads::new(&va), Grads::new(&vb));
        for step in 0..3u64 {
            ga.clear();
            gb.clear();
            for i in 0..2 {
                let g =
                    (crate::testutil::randn(&[37, 19], 10 * step + i as u64).to_dtype(DType::F32).unwrap()
                        * 0.1)
                        .unwrap();
                ga.add(i, &g).unwrap();
                gb.add(i, &g).unwrap();
            }
            oa.step(&ga).unwrap();
            ob.step(&gb).unwrap();
        }
        let max_diff = |a: &Tensor, b: &Tensor| {
            (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
        };
        for i in 0..2 {
            let d = max_diff(va[i].as_tensor(), vb[i].as_tensor());
            assert!(d < 1e-6, "weights of variable {i}: max diff {d}");
            let moved = max_diff(va[i].as_tensor(), &init(i as u64 + 1));
            assert!(moved > 1e-3, "the update moved the weights ({moved})");
            let ((ma, sa), (mb, sb)) = (oa.moments(i).unwrap(), ob.moments(i).unwrap());
            assert!(max_diff(&ma, &mb) < 1e-6 && max_diff(&sa, &sb) < 1e-6, "moments of variable {i}");
        }
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (m, v): (Vec<_>, Vec<_>) =
            (0..2).map(|i| ob.moments(i).unwrap()).map(|(m, v)| (flat(m), flat(v))).unzip();
        let mut restored = Adam::with_device_moments(vb.clone(), cfg).unwrap();
        restored.restore(m.clone(), v, 3).unwrap();
        assert_eq!((flat(restored.moments(1).unwrap().0), restored.steps()), (m[1].clone(), 3));
        let err = restored.restore(vec![vec![0.0; 3]; 2], vec![vec![0.0; 3]; 2], 1).unwrap_err().to_string();
        assert!(err.contains("variable 0") && err.contains("703"), "{err}");
    }

    #[test]
    fn clipping_scales_to_max_norm_in_buffers_and_tensors() {
        let dev = Device::Cpu;
        let vars = [
            Var::new(&[0f32, 0.0], &dev).unwrap(),
            Var::new(&[0f64], &dev).unwrap(),
            Var::new(&[0f32], &dev).unwrap(),
        ];
        let mut g = Grads::new(&vars);
        g.add(0, &Tensor::new(&[3f32, 0.0], &dev).unwrap()).unwrap();
        g.add(1, &Tensor::new(&[4f64], &dev).unwrap()).unwrap();
        assert!(g.has(0) && g.has(1) && !g.has(2));
        let n = g.clip_norm(1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-9);
        let v0 = g.get(0).unwrap().unwrap().to_vec1::<f32>().unwrap();
        let v1 = g.get(1).unwrap().unwrap().to_vec1::<f64>().unwrap();
        assert!((v0[0] - 0.6).abs() < 1e-5 && v0[1] == 0.0 && (v1[0] - 0.8).abs() < 1e-5);
        assert!(g.get(2).unwrap().is_none());
        g.clear();
        assert!(!g.has(0) && !g.has(1));
    }

    /// A tiny model through every op that writes into gradient buffers (the linear layers, layer
    /// norm, the embedding and the LM head, tied), plus a candle matmul whose gradient arrives in
    /// candle's store: two backward passes into [`Grads`] give the sums of candle's own gradients.
    #[test]
    fn buffered_gradients_equal_candle_gradients() {
        let dev = Device::Cpu;
        let r = |shape: &[usize], seed| {
            let t = crate::testutil::randn(shape, seed).to_dtype(DType::F32).unwrap();
            Var::from_tensor(&t).unwrap()
        };
        let (wte, w1, b1, w2, lnw, lnb, vh) =
            (r(&[11, 8], 1), r(&[8, 8], 2), r(&[8], 3), r(&[8, 8], 4), r(&[8], 5), r(&[8], 6), r(&[8, 1], 7));
        let vars = [wte.clone(), w1.clone(), b1.clone(), w2.clone(), lnw.clone(), lnb.clone(), vh.clone()];
        let ids = Tensor::new(&[[1u32, 4, 4, 9], [0, 10, 3, 1]], &dev).unwrap();
        let targets = Tensor::new(&[2u32, 5, 5, 1, 7, 0, 3, 3], &dev).unwrap();
        let loss = |scale: f64| {
            let x = ops::embedding(&wte, &ids).unwrap().reshape((8, 8)).unwrap();
            let x = ops::linear(&x, &w1, Some(&b1)).unwrap();
            let x = ops::gelu_tanh(&x).unwrap();
            let x = ops::linear_in_out(&x, &w2, None).unwrap();
            let h = ops::layer_norm(&x, &lnw, &lnb, 1e-5).unwrap();
            let (lp, _) = ops::lm_head_logprobs(&h, &wte, &targets, None, 1.0, true).unwrap();
            let v = h.matmul(&vh).unwrap().sqr().unwrap().sum_all().unwrap();
            ((lp.sum_all().unwrap() + v).unwrap() * scale).unwrap()
        };
        let store = |scale| loss(scale).backward().unwrap();
        let (s1, s2) = (store(1.0), store(-0.5));
        let mut grads = Grads::new(&vars);
        {
            // The weights of the fused ops go to the buffers, the matmul's to candle's store.
            let _scope = SinkScope::install(Arc::clone(&grads.map));
            let s = loss(1.0).backward().unwrap();
            for (i, var) in vars.iter().enumerate() {
                assert_eq!(s.get(var).is_some(), i == 6, "variable {i} in candle's store");
            }
        }
        for _ in 0..2 {
            grads.clear();
            grads.backward(&loss(1.0)).unwrap();
            grads.backward(&loss(-0.5)).unwrap();
            for (i, var) in vars.iter().enumerate() {
                let want = (s1.get(var).unwrap() + s2.get(var).unwrap()).unwrap();
                let got = grads.get(i).unwrap().unwrap();
                let d = crate::testutil::max_diff(&got, &want);
                assert!(d < 1e-5, "variable {i}: max diff {d}");
            }
        }
    }

    /// A small model through the ops that write gradient buffers: a tied embedding / LM head
    /// (two writes), an untied head, both linear layouts, a bias, layer norm and a candle
    /// matmul (candle's store). `twice` runs `w1` a second time.
    fn fused_model_loss(vars: &[Var], twice: bool) -> Tensor {
        let dev = Device::Cpu;
        let [wte, w1, b1, w2, lnw, lnb, vh, wh] = vars else { panic!("8 variables") };
        let ids = Tensor::new(&[[1u32, 4, 4, 9], [0, 10, 3, 1]], &dev).unwrap();
        let targets = Tensor::new(&[2u32, 5, 5, 1, 7, 0, 3, 3], &dev).unwrap();
        let x = ops::embedding(wte, &ids).unwrap().reshape((8, 8)).unwrap();
        let mut x = ops::linear(&x, w1, Some(b1)).unwrap();
        if twice {
            x = ops::linear(&x, w1, None).unwrap();
        }
        let x = ops::gelu_tanh(&x).unwrap();
        let x = ops::linear_in_out(&x, w2, None).unwrap();
        let h = ops::layer_norm(&x, lnw, lnb, 1e-5).unwrap();
        let (lp, _) = ops::lm_head_logprobs(&h, wte, &targets, None, 1.0, true).unwrap();
        let (lp2, _) = ops::lm_head_logprobs(&h, wh, &targets, None, 1.0, true).unwrap();
        let v = h.matmul(vh).unwrap().sqr().unwrap().sum_all().unwrap();
        ((lp.sum_all().unwrap() + lp2.sum_all().unwrap()).unwrap() + v).unwrap()
    }

    fn fused_model_vars() -> Vec<Var> {
        let shapes: [&[usize]; 8] = [&[11, 8], &[8, 8], &[8], &[8, 8], &[8], &[8], &[8, 1], &[11, 8]];
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = crate::testutil::randn(s, 20 + i as u64).to_dtype(DType::F32).unwrap();
                Var::from_tensor(&t).unwrap()
            })
            .collect()
    }

    /// Three steps of `backward` then `step` on one copy of the model and of `step_fused` on
    /// another (its forward inside the gradients' scope with `in_scope`), which must give the
    /// same bits; `check(step, grads)` looks at the fused side's gradients after each step.
    /// Returns the fused side.
    fn unfused_and_fused_steps(in_scope: bool, check: impl Fn(usize, &Grads)) -> (Adam, Vec<Var>, Grads) {
        let cfg = AdamConfig { lr: 1e-2, ..AdamConfig::default() };
        let (va, vb) = (fused_model_vars(), fused_model_vars());
        let (mut oa, mut ob) = (Adam::new(va.clone(), cfg).unwrap(), Adam::new(vb.clone(), cfg).unwrap());
        let (mut ga, mut gb) = (Grads::new(&va), Grads::new(&vb));
        for step in 0..3 {
            ga.clear();
            ga.backward(&fused_model_loss(&va, false)).unwrap();
            oa.step(&ga).unwrap();
            gb.clear();
            let ran = ob
                .step_fused(&mut gb, |g| {
                    // Inside the scope, the embedding holds the rows it looks up in the table.
                    let loss = {
                        let _scope = in_scope.then(|| g.scope());
                        fused_model_loss(&vb, false)
                    };
                    g.backward(&loss)?;
                    Ok::<_, Error>(true)
                })
                .unwrap();
            assert_eq!(ran, FusedStep::Updated);
            for (i, (a, b)) in va.iter().zip(&vb).enumerate() {
                let (a, b) = (
                    a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "step {step}, variable {i} differs"
                );
            }
            check(step, &gb);
        }
        assert_eq!(oa.steps(), ob.steps());
        (ob, vb, gb)
    }

    /// Per sink of `grads`, `flag` of its state (false without a sink).
    fn sink_flags(grads: &Grads, flag: impl Fn(&SinkState) -> bool) -> Vec<bool> {
        grads.sinks.iter().map(|s| s.as_ref().is_some_and(|s| flag(&s.state()))).collect()
    }

    #[test]
    fn fused_steps_equal_backward_then_step() {
        let (mut ob, vb, mut gb) = unfused_and_fused_steps(false, |step, gb| {
            // From the second step the single-product weights (w1, w2, the untied head) are
            // updated inside their products; the tied table (its forward held no rows), the
            // bias and the norm are not.
            let want = step > 0;
            let applied = sink_flags(gb, |s| s.applied);
            assert_eq!(applied, [false, want, false, want, false, false, false, want], "step {step}");
        });
        // A skipped backward changes nothing.
        let before = vb[1].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        gb.clear();
        assert_eq!(ob.step_fused(&mut gb, |_| Ok::<_, Error>(false)).unwrap(), FusedStep::Skipped);
        assert_eq!(ob.steps(), 3);
        assert_eq!(vb[1].flatten_all().unwrap().to_vec1::<f32>().unwrap(), before);
    }

    /// Issue #28: a non-finite gradient never reaches the weights or the moments, in the fused
    /// products (armed after the steps above) or in the update after the backward.
    #[test]
    fn a_non_finite_gradient_is_not_applied() {
        let (mut ob, vb, mut gb) = unfused_and_fused_steps(false, |_, _| {});
        let flat = |v: &Var| v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let before: Vec<Vec<f32>> = vb.iter().map(flat).collect();
        let host = |o: &Adam, i: usize| {
            let (m, v) = o.moments(i).unwrap();
            (
                m.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        };
        let moments: Vec<(Vec<f32>, Vec<f32>)> = (0..vb.len()).map(|i| host(&ob, i)).collect();
        gb.clear();
        let ran = ob
            .step_fused(&mut gb, |g| {
                g.backward(&(fused_model_loss(&vb, false) * f64::INFINITY)?)?;
                Ok::<_, Error>(true)
            })
            .unwrap();
        assert_eq!(ran, FusedStep::NonFinite);
        assert_eq!(ob.steps(), 3, "no Adam step counted");
        for (i, v) in vb.iter().enumerate() {
            assert_eq!(flat(v), before[i], "variable {i} changed");
            assert_eq!(host(&ob, i), moments[i], "moments {i} changed");
        }
        assert!(
            !all_finite(&[1f32, f32::NAN]) && !all_finite(&[f32::NEG_INFINITY]) && all_finite(&[0f32; 100])
        );
    }

    #[test]
    fn a_tied_table_with_held_rows_is_updated_in_its_product_with_the_same_bits() {
        unfused_and_fused_steps(true, |step, gb| {
            // From the second step the table (the LM head's product, then the embedding's
            // rows) is updated in its product but for the held rows.
            let partial = sink_flags(gb, |s| s.partial);
            assert_eq!(partial, [step > 0, false, false, false, false, false, false, false], "step {step}");
            if step > 0 {
                assert!(gb.get(0).unwrap().is_none(), "a partly consumed gradient is not handed out");
            }
        });
    }

    #[test]
    fn a_second_gradient_after_a_fused_update_is_an_error() {
        let vars = fused_model_vars();
        let mut opt = Adam::new(vars.clone(), AdamConfig::default()).unwrap();
        let mut grads = Grads::new(&vars);
        grads.backward(&fused_model_loss(&vars, false)).unwrap();
        opt.step(&grads).unwrap();
        // w1 had one product last time and is armed; now it gets two.
        grads.clear();
        let err = opt
            .step_fused(&mut grads, |g| {
                g.backward(&fused_model_loss(&vars, true))?;
                Ok::<_, Error>(true)
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("already updated inside this backward"), "{err}");
        // Nothing stays armed: a plain backward and step work again.
        grads.clear();
        grads.backward(&fused_model_loss(&vars, true)).unwrap();
        opt.step(&grads).unwrap();
    }
}
