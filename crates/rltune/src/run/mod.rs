//! Training runs: the config file, the PPO loop, the GRPO/RLOO loop, checkpoints.

pub mod checkpoint;
pub mod config;
pub mod critic;
pub mod episodes;
pub mod group_config;
pub mod group_loop;
pub mod ppo_loop;
pub mod reward_config;

pub use config::RunConfig;
pub use group_loop::{GroupRun, GroupTrainer};
pub use ppo_loop::{PpoRun, StepReport};
