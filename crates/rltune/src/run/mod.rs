//! Training runs: the config file, the PPO loop, checkpoints.

pub mod checkpoint;
pub mod config;
pub mod critic;
pub mod episodes;
pub mod ppo_loop;

pub use config::RunConfig;
pub use ppo_loop::{PpoRun, StepReport};
