//! Adam, exactly as `torch.optim.Adam` (the optimizer TRL's PPOTrainer creates), fused on the CPU.
//!
//! `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p − (lr/(1−β₁ᵗ)) · m / (√v/√(1−β₂ᵗ) + ε)` — torch's `_single_tensor_adam` order of
//! operations, so results agree to float rounding.

use candle_core::{DType, Tensor, Var};
use rayon::prelude::*;

use crate::error::Result;

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
    pub fn step(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        let step_size = (c.lr / bc1) as f32;
        let (b1, b2, eps, bc2s) = (c.beta1 as f32, c.beta2 as f32, c.eps as f32, bc2_sqrt as f32);
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let var = &self.vars[i];
            let dtype = var.dtype();
            let mut p = var.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let g = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let (m, v) = (&mut self.m[i], &mut self.v[i]);
            p.par_chunks_mut(4096)
                .zip(m.par_chunks_mut(4096))
                .zip(v.par_chunks_mut(4096))
                .zip(g.par_chunks(4096))
                .for_each(|(((p, m), v), g)| {
                    for j in 0..p.len() {
                        m[j] += (g[j] - m[j]) * (1.0 - b1);
                        v[j] = v[j] * b2 + (1.0 - b2) * g[j] * g[j];
                        let denom = v[j].sqrt() / bc2s + eps;
                        p[j] -= step_size * m[j] / denom;
                    }
                });
            let new = Tensor::from_vec(p, var.shape(), var.device())?.to_dtype(dtype)?;
            var.set(&new)?;
        }
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
    fn clipping_scales_to_max_norm() {
        let mut g = vec![Some(Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap()), None];
        let n = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-9);
        let v = g[0].as_ref().unwrap().to_vec1::<f32>().unwrap();
        assert!((v[0] - 0.6).abs() < 1e-5 && (v[1] - 0.8).abs() < 1e-5);
    }
}
