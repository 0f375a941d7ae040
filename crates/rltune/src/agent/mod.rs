//! LM agents in text environments: the model side of [`crate::envs`].
//!
//! - [`config`]: the `[env]` table of a run's config, which builds an environment and the agent's
//!   prompt and generation settings.
//! - [`model_agent`]: a causal LM as an [`crate::envs::play::Agent`], for `rltune play`.
//! - [`rollout`]: episodes played by the policy under training, turned into PPO transitions with
//!   per-turn discounting; with `[agent] memory = "transcript"`, one growing token sequence per
//!   episode with the KV cache carried across turns (`transcript`).
//! - [`turns`]: what both memories share: the transitions, the settings, the actor, the
//!   admissible commands' trie.

pub mod config;
pub mod model_agent;
pub mod rollout;
mod transcript;
pub mod turns;

pub use turns::prompt_budget;
