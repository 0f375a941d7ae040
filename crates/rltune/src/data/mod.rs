//! Reading user data: rollout files for `ppo-step`, prompt datasets.

pub mod rollouts;
