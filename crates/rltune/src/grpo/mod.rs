//! GRPO and RLOO for language models: TRL 1.16.0's `GRPOTrainer` and `RLOOTrainer`, one
//! generation batch (groups of `num_generations` completions per prompt, with rewards) per step.
//!
//! - [`config`]: `GrpoConfig` and `RlooConfig`, TRL's names and defaults.
//! - [`math`]: advantages, the clipped objective, KL and the loss normalizations, as pure
//!   functions.
//! - [`trainer`]: the GRPO trainer and its `step`.
//! - [`rloo`]: the RLOO trainer and its `step`.
//! - [`gigpo`]: GiGPO's step-level credit for trajectory GRPO on games.
//!
//! See `docs/algorithms.md` for the formulas and metrics.

pub mod config;
pub(crate) mod core;
pub mod gigpo;
pub mod math;
pub mod rloo;
pub mod trainer;

pub use self::core::{GroupBatch, RewardTable, TurnBatch};
pub use crate::engine::decays;
pub use config::{GrpoConfig, LossType, RlooConfig, ScaleRewards};
pub use rloo::RlooTrainer;
pub use trainer::GrpoTrainer;
