//! rltune: reinforcement-learning fine-tuning of transformer language models, on candle.
//!
//! rltune rebuilds Hugging Face TRL's classic PPO trainer (`PPOTrainer.step(queries, responses,
//! scores)`) in Rust: a causal LM with a scalar value head, a frozen reference model, a per-token
//! KL penalty with a fixed or adaptive controller, GAE, whitened advantages, clipped policy and
//! value losses, and TRL-compatible statistics.
//!
//! The pieces, bottom up:
//! - [`ops`]: differentiable fused ops (softmax, layer norm, RMS norm, log-softmax) with
//!   hand-written backward passes; candle's own fused kernels drop gradients.
//! - [`params`]: named parameters loaded from safetensors or initialized in-process.
//! - [`models`]: GPT-2, the Llama family, BERT and DistilBERT, and TRL's value head (or trlx's
//!   MLP head).
//! - [`tokenizer`]: `tokenizer.json` with configurable padding.
//! - [`generation`]: batched, exact sampling with a KV cache that returns each token's logprob.
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
pub mod train;

pub use error::{Error, Result};
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
