//! Training runs: the config file, the one run loop ([`run_loop`]) and the algorithms in it (PPO and
//! rejection sampling, GRPO and RLOO), checkpoints.

pub mod checkpoint;
pub mod config;
pub mod critic;
pub mod episodes;
pub mod eval;
pub mod group_config;
pub mod group_loop;
pub mod logging_config;
pub mod ppo_loop;
pub mod prompts;
pub mod reward_config;
pub(crate) mod rollout;
pub mod run_loop;
pub mod tracking;

pub use config::RunConfig;
pub use group_loop::GroupRun;
pub use ppo_loop::PpoRun;
pub use run_loop::{Algorithm, StepReport};
