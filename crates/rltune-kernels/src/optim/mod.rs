//! Adam, exactly as `torch.optim.Adam` (the optimizer TRL's PPOTrainer creates), fused on the
//! CPU, and [`Grads`], the gradients it consumes.
//!
//! `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p − (lr/(1−β₁ᵗ)) · m / (√v/√(1−β₂ᵗ) + ε)` — torch's `_single_tensor_adam` order of
//! operations, so results agree to float rounding. f32 parameters on the CPU are updated in place
//! (a candle in-place op) from their gradient buffers, with no copy of either.
//!
//! Variables on another device (CUDA) keep their moments as f32 tensors on that device: nothing
//! crosses to the host during a step. On CUDA each f32 variable is updated in place by one
//! kernel, the CPU kernel's twin (`crate::cuda`); elsewhere, and inside a composed scope, with
//! candle's element-wise ops ([`Adam::with_device_moments`] takes that path on the CPU too, for
//! tests).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor, Var};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::grad_sink::{FusedUpdate, GradSink};
use crate::simd::simd_kernel;

mod grads;
pub use grads::Grads;

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
    /// a forward bound to these gradients (see `ops::grad_sink`), which are updated after
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
        let g = g.to_dtype(DType::F32)?;
        // On CUDA, one in-place kernel (the CPU kernel's twin, bit for bit) instead of the ops.
        #[cfg(feature = "cuda")]
        if crate::cuda_kernels(var.device())
            && crate::cuda::adam_inplace(var, &g.contiguous()?, m, v, [step_size, b1, b2, eps, bc2s])?
        {
            return Ok(());
        }
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
mod tests;
