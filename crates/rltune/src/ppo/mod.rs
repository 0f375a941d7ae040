//! PPO for language models: TRL 0.11's classic `PPOTrainer.step(queries, responses, scores)`.
//!
//! - [`config`]: `PpoConfig`, TRL's names and defaults.
//! - [`math`]: the math as pure functions (masked statistics, KL penalties, GAE, losses).
//! - [`kl_control`]: fixed and adaptive KL controllers.
//! - [`trainer`]: the trainer and its `step`.
//! - [`critic`]: an optional separate critic (value model) with its own optimizer.

pub mod config;
pub mod critic;
mod forward;
pub mod kl_control;
pub mod math;
pub mod trainer;

pub use crate::engine::stats::{Stat, Stats};
pub use config::PpoConfig;
pub use critic::Critic;
pub use kl_control::KlController;
pub use math::KlPenalty;
pub use trainer::{PpoTrainer, RolloutCache, RunningMoments, StepInput, TrainerStreams};
