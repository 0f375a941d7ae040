//! The one optimizer step of every trainer (PPO and its critic, GRPO, RLOO, DPO, SFT and the
//! reward model): transformers' `Trainer` step with torch's AdamW, in place on every device
//! (`rltune_kernels::optim::Adam`: one pass per tensor on the CPU, one kernel on CUDA). TRL
//! 0.11.4's PPO step is the same with no weight decay and a constant rate; with one minibatch
//! per update and no clipping it fuses the update into the backward's products
//! ([`Optimizer::adam_mut`], [`crate::optim::Adam::step_fused`]).
//!
//! One step, as transformers runs it:
//! 1. [`Optimizer::begin`]: the cleared gradient buffers, and the schedule's learning rate for
//!    this step;
//! 2. the caller's forward and backward passes into those buffers (gradient accumulation is
//!    several of them, each loss already divided by their number): the optimizer binds its
//!    store's gradient slot to them, so the models built from the store write their weights'
//!    gradients there directly (torch's `param.grad`);
//! 3. [`Optimizer::clip`]: in a data-parallel run the all-reduce of the gradients (their mean
//!    over the processes, [`crate::dist`]); then the global gradient norm before clipping,
//!    clipped to `max_grad_norm` when that is positive;
//! 4. [`Optimizer::finish`]: when the norm is finite, decoupled weight decay
//!    `p ← p·(1 − lr·wd)` on the decay group (not biases, not norms: [`decays`]), then Adam at
//!    that learning rate. A non-finite norm changes no weight.
//!
//! ```
//! use rltune::engine::{LrSchedule, OptimArgs, Optimizer, ScheduleKind};
//! use rltune::params::ParamStore;
//! use candle_core::{DType, Device};
//!
//! # fn main() -> rltune::Result<()> {
//! let store = ParamStore::random(0, true, DType::F32, &Device::Cpu)?;
//! let w = store.root().get_or_init("w", (2,), rltune::params::Init::Ones)?;
//! let schedule = LrSchedule { kind: ScheduleKind::Constant, base_lr: 0.1, warmup_steps: 0, total_steps: 1 };
//! let args = OptimArgs { learning_rate: 0.1, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, max_grad_norm: 1.0, schedule };
//! let mut opt = Optimizer::new(&store, args)?;
//! let (mut grads, lr) = opt.begin(0);
//! grads.backward(&w.sqr()?.sum_all()?)?;
//! let norm = opt.clip(&mut grads)?;
//! assert!(opt.finish(grads, lr, norm)?); // updated
//! assert!(w.to_vec1::<f32>()?[0] < 1.0);
//! # Ok(()) }
//! ```

use super::schedule::LrSchedule;
use crate::dist::Dist;
use crate::error::Result;
use crate::optim::{Adam, AdamConfig, Grads};
use crate::params::ParamStore;
use rltune_kernels::GradSlot;

/// The optimizer and schedule fields of transformers' `TrainingArguments`, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimArgs {
    /// Peak learning rate.
    pub learning_rate: f64,
    /// AdamW β₁, β₂.
    pub betas: (f64, f64),
    /// AdamW ε.
    pub eps: f64,
    /// Decoupled weight decay (not on biases and norms).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 or less: no clipping).
    pub max_grad_norm: f64,
    /// The LR schedule over the run.
    pub schedule: LrSchedule,
}

/// Whether transformers' `Trainer` decays parameter `name`: not biases, not norm weights
/// (`get_decay_parameter_names`: names matching `bias`, `layernorm`, `rmsnorm`, `norm`, `_norm`,
/// and parameters of `nn.LayerNorm` modules — GPT-2's `ln_1`, `ln_2`, `ln_f`).
pub fn decays(name: &str) -> bool {
    let n = name.to_lowercase();
    let segments: Vec<&str> = n.split('.').collect();
    let module = &segments[..segments.len().saturating_sub(1)];
    let norm_module = module.iter().any(|s| *s == "norm" || s.ends_with("_norm") || s.starts_with("ln_"));
    !(n.contains("bias") || n.contains("layernorm") || n.contains("rmsnorm") || norm_module)
}

/// AdamW over named variables, with its decay groups, clipping and schedule (module docs).
pub struct Optimizer {
    adam: Adam,
    /// The gradient buffers between steps (taken by [`Self::begin`], given back by
    /// [`Self::finish`]); `None` after a step that failed midway.
    grads: Option<Grads>,
    /// Per variable: whether weight decay applies.
    decay: Vec<bool>,
    args: OptimArgs,
    /// The processes whose gradients each step averages (one process by default).
    dist: Dist,
    /// The store's gradient slot, bound to every gradient buffer this optimizer hands out.
    slot: GradSlot,
}

impl Optimizer {
    /// An optimizer over the variables of `store` (in its order), whose gradient buffers the
    /// models built from `store` write into (its [`ParamStore::grad_slot`] is bound to them).
    pub fn new(store: &ParamStore, args: OptimArgs) -> Result<Self> {
        let (names, vars): (Vec<String>, Vec<_>) = store.vars().into_iter().unzip();
        let cfg =
            AdamConfig { lr: args.learning_rate, beta1: args.betas.0, beta2: args.betas.1, eps: args.eps };
        let slot = store.grad_slot().clone();
        let grads = Grads::new(&vars);
        grads.bind(&slot);
        Ok(Self {
            grads: Some(grads),
            adam: Adam::new(vars, cfg)?,
            decay: names.iter().map(|n| decays(n)).collect(),
            args,
            dist: Dist::default(),
            slot,
        })
    }

    /// Gradient buffers for this optimizer's variables, bound to its store's slot (after a
    /// step that failed midway took the last ones).
    pub fn new_grads(&self) -> Grads {
        let grads = Grads::new(self.adam.vars());
        grads.bind(&self.slot);
        grads
    }

    /// Points the store's slot at `grads` (buffers for this optimizer's variables), so that the
    /// forwards from here on write into them. A slot points at one `Grads` at a time: whoever
    /// is about to run a step binds its own first ([`Self::begin`] does).
    pub fn bind(&self, grads: &Grads) {
        grads.bind(&self.slot);
    }

    /// This optimizer averaging the gradients over `dist`'s processes before each clip (a
    /// data-parallel run; see [`Self::clip`]).
    pub fn with_dist(mut self, dist: Dist) -> Self {
        self.dist = dist;
        self
    }

    /// Makes it average the gradients over `dist`'s processes ([`Self::with_dist`]).
    pub fn set_dist(&mut self, dist: Dist) {
        self.dist = dist;
    }

    /// The processes it averages the gradients over.
    pub fn dist(&self) -> &Dist {
        &self.dist
    }

    /// The arguments it was built with.
    pub fn args(&self) -> &OptimArgs {
        &self.args
    }

    /// The Adam state (its moments are checkpointed).
    pub fn adam(&self) -> &Adam {
        &self.adam
    }

    /// The Adam state, to restore a checkpoint's moments into.
    pub fn adam_mut(&mut self) -> &mut Adam {
        &mut self.adam
    }

    /// Starts optimizer step `step` (from 0): the cleared gradient buffers and the step's
    /// learning rate. Warns once the schedule's steps are spent.
    pub fn begin(&mut self, step: usize) -> (Grads, f64) {
        let mut grads = self.grads.take().unwrap_or_else(|| self.new_grads());
        // Another holder of buffers for these variables (PPO's trainer keeps its own) may have
        // bound the slot since.
        self.bind(&grads);
        grads.clear();
        let lr = self.args.schedule.lr(step);
        if step == self.args.schedule.total_steps {
            tracing::warn!(
                "optimizer step {} is past the schedule's {} steps (max_steps, or the steps that \
                 num_train_epochs gives when max_steps is unset): the learning rate is now {lr}; set \
                 max_steps to the run's length",
                step + 1,
                self.args.schedule.total_steps
            );
        }
        (grads, lr)
    }

    /// A stand-in holding no variables, for while the real one is lent out
    /// (`std::mem::replace`, e.g. around [`crate::optim::Adam::step_fused`]).
    pub fn placeholder(&self) -> Result<Self> {
        let cfg = AdamConfig::default();
        Ok(Self {
            grads: None,
            adam: Adam::new(Vec::new(), cfg)?,
            decay: Vec::new(),
            args: self.args.clone(),
            dist: self.dist.clone(),
            slot: GradSlot::new(),
        })
    }

    /// Replaces the learning rate, Adam's betas and ε, weight decay, clipping and schedule; the
    /// moments and the step count stay (rejection sampling fine-tunes with PPO's optimizer at
    /// its own settings, keeping its state from one step to the next).
    pub fn set_args(&mut self, args: OptimArgs) {
        self.adam.cfg.lr = args.learning_rate;
        (self.adam.cfg.beta1, self.adam.cfg.beta2, self.adam.cfg.eps) =
            (args.betas.0, args.betas.1, args.eps);
        self.args = args;
    }

    /// Sets the clipping threshold (0 or less: no clipping).
    pub fn set_max_grad_norm(&mut self, max_grad_norm: f64) {
        self.args.max_grad_norm = max_grad_norm;
    }

    /// The learning rate of the last step (the schedule's first before any).
    pub fn learning_rate(&self) -> f64 {
        self.adam.cfg.lr
    }

    /// [`Self::clip`], then, when the norm is finite, [`Self::finish`]'s update at `lr`,
    /// leaving the buffers with the caller. Returns the norm before clipping: a non-finite one
    /// changed no weight.
    pub fn clip_and_step(&mut self, grads: &mut Grads, lr: f64) -> Result<f64> {
        let norm = self.clip(grads)?;
        if norm.is_finite() {
            self.apply(grads, lr)?;
        }
        Ok(norm)
    }

    /// The global gradient norm before clipping; the gradients are clipped to `max_grad_norm`
    /// when it is positive. In a data-parallel run the gradients are first averaged over the
    /// processes ([`Dist::all_reduce_grads`]), so every process clips and steps alike.
    pub fn clip(&self, grads: &mut Grads) -> Result<f64> {
        self.dist.all_reduce_grads(grads)?;
        Ok(if self.args.max_grad_norm > 0.0 {
            grads.clip_norm(self.args.max_grad_norm)?
        } else {
            grads.global_norm()?
        })
    }

    /// Ends the step: when `norm` is finite, weight decay on the decay group then Adam at `lr`;
    /// returns whether the weights changed. The buffers are kept for the next step.
    pub fn finish(&mut self, grads: Grads, lr: f64, norm: f64) -> Result<bool> {
        let update = norm.is_finite();
        if update {
            self.apply(&grads, lr)?;
        }
        self.grads = Some(grads);
        Ok(update)
    }

    /// Weight decay on the decay group, then Adam at `lr`.
    fn apply(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        self.adam.cfg.lr = lr;
        let wd = self.args.weight_decay;
        if wd != 0.0 {
            for (i, var) in self.adam.vars().iter().enumerate() {
                if self.decay[i] && grads.has(i) {
                    var.set(&(var.as_tensor() * (1.0 - lr * wd))?)?;
                }
            }
        }
        Ok(self.adam.step(grads)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ScheduleKind;
    use candle_core::{DType, Device, Tensor};

    /// A step's buffers get the gradients of the store's ops even after other buffers for the
    /// same variables were bound since (PPO's trainer keeps its own; rejection sampling's steps
    /// take the optimizer's): `begin` binds the store's slot to what it hands out.
    #[test]
    fn begin_binds_the_buffers_it_hands_out() {
        let store = ParamStore::random(0, true, DType::F32, &Device::Cpu).unwrap();
        let w = store.root().get_or_init("w", (3, 4), crate::params::Init::Ones).unwrap();
        let schedule =
            LrSchedule { kind: ScheduleKind::Constant, base_lr: 0.1, warmup_steps: 0, total_steps: 2 };
        let args = OptimArgs {
            learning_rate: 0.1,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 0.0,
            schedule,
        };
        let mut opt = Optimizer::new(&store, args).unwrap();
        let other = opt.new_grads();
        let x = Tensor::arange(0f32, 8.0, &Device::Cpu).unwrap().reshape((2, 4)).unwrap();
        let loss = || {
            let y = crate::ops::linear_with(&x, &w, None, store.grad_slot()).unwrap();
            y.sum_all().unwrap()
        };
        let (mut grads, _) = opt.begin(0);
        grads.backward(&loss()).unwrap();
        // d Σ(x·Wᵀ) / dW[o, i] = Σ_rows x[r, i]: 4, 6, 8, 10 in every row.
        let g = grads.get(0).unwrap().expect("the step's buffers hold the gradient");
        assert_eq!(g.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [4.0, 6.0, 8.0, 10.0].repeat(3));
        assert!(!other.has(0), "the other buffers got nothing");
    }

    #[test]
    fn decay_groups_follow_transformers() {
        for name in [
            "transformer.wte.weight",
            "transformer.h.0.attn.c_attn.weight",
            "model.layers.0.mlp.up_proj.weight",
        ] {
            assert!(decays(name), "{name}");
        }
        for name in [
            "transformer.h.0.attn.c_attn.bias",
            "transformer.h.1.ln_2.weight",
            "transformer.ln_f.weight",
            "model.layers.3.input_layernorm.weight",
            "model.norm.weight",
            "model.layers.0.self_attn.q_norm.weight",
        ] {
            assert!(!decays(name), "{name}");
        }
    }
}
