//! Reading user data: rollout files for `ppo-step`, prompt datasets.

pub mod prompts;
pub mod rollouts;
