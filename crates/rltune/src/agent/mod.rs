//! LM agents in text environments: the model side of [`crate::envs`].
//!
//! - [`config`]: the `[env]` table of a run's config, which builds an environment and the agent's
//!   prompt and generation settings.
//! - [`model_agent`]: a causal LM as an [`crate::envs::play::Agent`], for `rltune play`.
//! - [`rollout`]: episodes played by the policy under training, turned into PPO transitions with
//!   per-turn discounting.

pub mod config;
pub mod model_agent;
pub mod rollout;

pub use model_agent::prompt_budget;
