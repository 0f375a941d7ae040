//! The fields of transformers' `TrainingArguments` that change the update, declared once for
//! every trainer config that takes them under those names: TRL's `GRPOConfig`, `RLOOConfig` and
//! `DPOConfig` derive from `TrainingArguments`. [`training_arguments!`] writes them at the head of
//! a config's struct and gives it `optim_args_for`; [`resolve_optim`] turns them into the
//! engine's [`OptimArgs`]. What a pass of `num_train_epochs` is, and how many optimizer steps a
//! run makes, is each trainer's (its config's docs). The `[training]` table of `rltune sft` and
//! `rltune reward` (`train::TrainingArgs`; TRL's `SFTConfig` and `RewardConfig` derive from
//! `TrainingArguments`) takes them too. PPO (`ppo::PpoConfig`) keeps TRL 0.11.4's own
//! `PPOConfig` names, which do not derive from `TrainingArguments` (docs/trl-deviations.md).

use super::schedule::{LrSchedule, ScheduleKind};
use super::OptimArgs;

/// Declares `pub struct $name` with transformers' `TrainingArguments` fields first, then the
/// config's own, and `$name::optim_args_for(total)`. The attributes (derives, serde) are the
/// caller's.
macro_rules! training_arguments {
    ($(#[$m:meta])* pub struct $name:ident { $($body:tt)* }) => {
        $(#[$m])*
        pub struct $name {
            /// AdamW learning rate (the config's default: TRL's GRPO 1e-6, transformers 5e-5).
            pub learning_rate: f64,
            /// AdamW β₁ (0.9).
            pub adam_beta1: f64,
            /// AdamW β₂ (0.999).
            pub adam_beta2: f64,
            /// AdamW ε (1e-8).
            pub adam_epsilon: f64,
            /// Decoupled weight decay (0), on every parameter but biases and norms, as transformers
            /// groups them (`Trainer.get_decay_parameter_names`).
            pub weight_decay: f64,
            /// Clip the global gradient norm to this; 0 turns clipping off (1.0).
            pub max_grad_norm: f64,
            /// LR schedule ("linear").
            pub lr_scheduler_type: $crate::engine::ScheduleKind,
            /// Warm-up steps; below 1, a fraction of the total steps (0).
            pub warmup_steps: f64,
            /// Total optimizer steps of the run (-1: `num_train_epochs` passes).
            pub max_steps: i64,
            /// Passes, used when `max_steps` ≤ 0 (3).
            pub num_train_epochs: f64,
            /// Micro-batches whose gradients make one optimizer step (1).
            pub gradient_accumulation_steps: usize,
            /// Seed (42).
            pub seed: u64,
            $($body)*
        }

        impl $name {
            /// The optimizer and schedule of a run of `total` optimizer steps.
            pub fn optim_args_for(&self, total: usize) -> $crate::engine::OptimArgs {
                $crate::engine::training_arguments::resolve_optim(
                    self.learning_rate,
                    (self.adam_beta1, self.adam_beta2, self.adam_epsilon),
                    self.weight_decay,
                    self.max_grad_norm,
                    self.lr_scheduler_type,
                    self.warmup_steps,
                    total,
                )
            }
        }
    };
}
pub(crate) use training_arguments;

/// The optimizer and schedule of a run of `total` optimizer steps, from transformers'
/// `TrainingArguments` fields.
pub(crate) fn resolve_optim(
    learning_rate: f64,
    adam: (f64, f64, f64),
    weight_decay: f64,
    max_grad_norm: f64,
    lr_scheduler_type: ScheduleKind,
    warmup_steps: f64,
    total: usize,
) -> OptimArgs {
    // transformers `TrainingArguments.get_warmup_steps`: an integer ≥ 1, or a ratio.
    let warmup = if warmup_steps >= 1.0 {
        warmup_steps as usize
    } else {
        (total as f64 * warmup_steps).ceil() as usize
    };
    OptimArgs {
        learning_rate,
        betas: (adam.0, adam.1),
        eps: adam.2,
        weight_decay,
        max_grad_norm,
        schedule: LrSchedule::new(lr_scheduler_type, learning_rate, warmup, total),
    }
}
