//! rltune: reinforcement-learning fine-tuning of transformer language models, on candle.
//!
//! rltune rebuilds Hugging Face TRL's trainers in Rust: classic PPO (TRL 0.11's
//! `PPOTrainer.step(queries, responses, scores)`), GRPO, RLOO and DPO (TRL 1.16), SFT, reward
//! models and rejection sampling, for LMs in text environments as well as on prompts.
//!
//! The crates, bottom up (this one re-exports the lower ones at the paths shown):
//! - [`ops`], [`cpu`], [`optim`] (`rltune-kernels`): differentiable fused ops with hand-written
//!   backward passes (candle's own fused kernels drop gradients), the SGEMM, the process-wide
//!   CPU settings, the gradient buffers and torch-exact Adam.
//! - [`models`], [`params`], [`tokenizer`], [`generation`], [`io`] (`rltune-models`): GPT-2, the
//!   Llama family, GPT-Neo, GPT-NeoX, BERT, DistilBERT and value heads; safetensors, GGUF and hub
//!   loading; chat templates; exact batched sampling with a KV cache.
//! - [`envs`] (`rltune-envs`): text environments, their protocol, the play loop, task metrics.
//!
//! And in this crate: [`engine`] (the optimizer step, schedules, stats every trainer shares), the
//! algorithms ([`ppo`], [`grpo`] with RLOO, [`dpo`], [`train`] for SFT and reward models,
//! [`rejection`]), [`dist`] (data parallelism), [`rewards`], [`data`], [`agent`] (models acting in environments), [`run`] (the
//! one run loop, checkpoints, `--resume`), [`logging`] and [`runtime`].
//!
//! Dropout is never applied: rollouts, scoring and PPO's forward passes all run without it, so
//! the logprobs PPO compares are those of one deterministic policy.
//!
//! ```
//! use rltune::generation::{generate, GenerationConfig};
//! use rltune::models::{gpt2::Gpt2Config, CausalLm, CausalLmConfig};
//! use rltune::params::ParamStore;
//!
//! # fn main() -> rltune::Result<()> {
//! let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(64, 16, 1, 2, 32));
//! // Where and in which precision to compute; `Runtime::resolve` reads a config's `[runtime]`.
//! let rt = rltune::runtime::Runtime::cpu();
//! let store = ParamStore::random(0, false, rt.dtype(), rt.device())?;
//! let lm = CausalLm::load(&store.root(), &cfg)?;
//! let gen = GenerationConfig { max_new_tokens: 5, seed: 1, ..Default::default() };
//! let out = generate(&lm, None, &[vec![1, 2, 3], vec![4]], &gen, rt.device())?;
//! assert_eq!(out[0].logprobs.len(), out[0].response_ids.len());
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod agent;
pub mod config_file;
pub mod data;
pub mod dist;
pub mod dpo;
pub mod engine;
pub mod error;
pub mod grpo;
pub mod logging;
pub mod ppo;
pub mod rejection;
pub mod rewards;
pub mod run;
pub mod runtime;
pub mod tagger;
pub mod train;

pub use error::{ConfigError, Error, Result};
/// Text environments, their protocol, the play loop and the task metrics (the `rltune-envs`
/// crate); [`agent`] runs models in them.
pub use rltune_envs as envs;
/// The kernels: fused differentiable ops, the SGEMM, the gradient buffers and the fused Adam
/// update (the `rltune-kernels` crate).
pub use rltune_kernels as ops;
/// Process-wide CPU settings (`rltune_kernels::cpu`): what [`cpu::ProcessSettings::install`]
/// sets, and the helpers it calls.
pub use rltune_kernels::cpu;
/// torch-exact Adam over persistent gradient buffers, and gradient clipping
/// (`rltune_kernels::optim`).
pub use rltune_kernels::optim;
/// The model zoo, its weights and tokenizers, and exact sampling (the `rltune-models` crate).
pub use rltune_models as models;
pub use rltune_models::{generation, io, params, tokenizer};
