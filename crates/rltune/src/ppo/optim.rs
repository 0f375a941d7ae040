//! Adam, exactly as `torch.optim.Adam` (the optimizer TRL's PPOTrainer creates), fused on the CPU.
//!
//! `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p − (lr/(1−β₁ᵗ)) · m / (√v/√(1−β₂ᵗ) + ε)` — torch's `_single_tensor_adam` order of
//! operations, so results agree to float rounding. f32 parameters on the CPU are updated in place
//! (a candle in-place op), with no copy of parameters or gradients.

use std::sync::Mutex;

use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor, Var};
use rayon::prelude::*;

use crate::error::Result;
use crate::ops::simd::simd_kernel;

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

/// Adam over a fixed list of variables, with its moments kept as plain vectors.
pub struct Adam {
    vars: Vec<Var>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    step: u64,
    /// Hyper-parameters (the learning rate may be changed between steps).
    pub cfg: AdamConfig,
}

impl Adam {
    /// A fresh optimizer over `vars`.
    pub fn new(vars: Vec<Var>, cfg: AdamConfig) -> Self {
        let m = vars.iter().map(|v| vec![0f32; v.elem_count()]).collect();
        let v = vars.iter().map(|v| vec![0f32; v.elem_count()]).collect();
        Self { vars, m, v, step: 0, cfg }
    }

    /// Number of steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The variables, in order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// First and second moments of variable `i` (for checkpoints).
    pub fn moments(&self, i: usize) -> (&[f32], &[f32]) {
        (&self.m[i], &self.v[i])
    }

    /// Restores moments and the step count (from a checkpoint).
    pub fn restore(&mut self, m: Vec<Vec<f32>>, v: Vec<Vec<f32>>, step: u64) {
        self.m = m;
        self.v = v;
        self.step = step;
    }

    /// One update with `grads[i]` the gradient of variable `i` (`None`: no gradient, skipped).
    ///
    /// f32 variables on the CPU are updated in place, in one pass over parameter, gradient and
    /// moments; others go through a copy.
    pub fn step(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        let k = AdamConsts {
            step_size: (c.lr / bc1) as f32,
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            eps: c.eps as f32,
            bc2s: bc2_sqrt as f32,
        };
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let var = &self.vars[i];
            let (m, v) = (&mut self.m[i], &mut self.v[i]);
            if var.device().is_cpu() && var.dtype() == DType::F32 && g.dtype() == DType::F32 {
                let op = AdamInplace { m: Mutex::new(m), v: Mutex::new(v), k };
                var.as_tensor().inplace_op2(&g.contiguous()?, &op)?;
                continue;
            }
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
        let AdamConsts { step_size, b1, b2, eps, bc2s } = *self;
        p.par_chunks_mut(4096)
            .zip(m.par_chunks_mut(4096))
            .zip(v.par_chunks_mut(4096))
            .zip(g.par_chunks(4096))
            .for_each(|(((p, m), v), g)| adam_rows(p, g, m, v, [step_size, b1, b2, eps, bc2s]));
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

/// The in-place update of one f32 CPU variable from its gradient.
struct AdamInplace<'a> {
    m: Mutex<&'a mut Vec<f32>>,
    v: Mutex<&'a mut Vec<f32>>,
    k: AdamConsts,
}

impl InplaceOp2 for AdamInplace<'_> {
    fn name(&self) -> &'static str {
        "rltune-adam"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("adam: parameter and gradient must be contiguous");
        };
        let (CpuStorage::F32(p), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("adam: parameter and gradient must be f32");
        };
        let mut m = self.m.lock().map_err(|_| candle_core::Error::Msg("adam: poisoned lock".into()))?;
        let mut v = self.v.lock().map_err(|_| candle_core::Error::Msg("adam: poisoned lock".into()))?;
        let (p, g) = (&mut p[p0..p1], &g[g0..g1]);
        if p.len() != g.len() || p.len() != m.len() || p.len() != v.len() {
            candle_core::bail!("adam: parameter, gradient and moments differ in size");
        }
        self.k.update(p, g, &mut m[..], &mut v[..]);
        Ok(())
    }
}

/// Scales gradients so their global L2 norm is at most `max_norm`; returns the norm before.
///
/// torch `clip_grad_norm_`: `coef = min(1, max_norm / (norm + 1e-6))`.
pub fn clip_grad_norm(grads: &mut [Option<Tensor>], max_norm: f64) -> Result<f64> {
    let mut sq = 0f64;
    for g in grads.iter().flatten() {
        sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    let norm = sq.sqrt();
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    if coef < 1.0 {
        for g in grads.iter_mut().flatten() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adam_first_step_moves_each_weight_by_lr() {
        // With bias correction, step 1 moves every weight by lr·sign(g) (up to ε).
        let var = Var::from_tensor(&Tensor::new(&[1f32, -2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
        let mut adam = Adam::new(vec![var.clone()], AdamConfig { lr: 0.1, ..Default::default() });
        adam.step(&[Some(Tensor::new(&[0.5f32, -3.0, 1e-3], &Device::Cpu).unwrap())]).unwrap();
        let p = var.as_tensor().to_vec1::<f32>().unwrap();
        for (got, want) in p.iter().zip([0.9f32, -1.9, 2.9]) {
            assert!((got - want).abs() < 1e-4, "{got} vs {want}");
        }
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
        let (mut oa, mut ob) = (Adam::new(vec![a.clone()], cfg), Adam::new(vec![b.clone()], cfg));
        for s in 0..3 {
            let g: Vec<f32> = (0..9000).map(|i| ((i * (s + 2)) as f32 * 0.11).cos()).collect();
            let g = Tensor::from_vec(g, (90, 100), &dev).unwrap();
            oa.step(&[Some(g.clone())]).unwrap();
            ob.step(&[Some(g.to_dtype(DType::F64).unwrap())]).unwrap();
        }
        let pa = a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let pb = b.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(pa, pb);
        assert_eq!(oa.moments(0), ob.moments(0));
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let mut g = vec![Some(Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap()), None];
        let n = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-9);
        let v = g[0].as_ref().unwrap().to_vec1::<f32>().unwrap();
        assert!((v[0] - 0.6).abs() < 1e-5 && (v[1] - 0.8).abs() < 1e-5);
    }
}
