//! rltune's models: transformers as Hugging Face writes them (one file per `model_type`),
//! their weights (safetensors, GGUF, the hub), tokenizers and chat templates, and exact batched
//! sampling with a KV cache. No RL here: the model zoo and its sampler, usable on their own.
//!
//! ```
//! use rltune_models::generation::{generate, GenerationConfig};
//! use rltune_models::{gpt2::Gpt2Config, CausalLm, CausalLmConfig};
//! use rltune_models::params::ParamStore;
//! use candle_core::{DType, Device};
//!
//! # fn main() -> rltune_models::Result<()> {
//! let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(64, 16, 1, 2, 32));
//! let store = ParamStore::random(0, false, DType::F32, &Device::Cpu)?;
//! let lm = CausalLm::load(&store.root(), &cfg)?;
//! let gen = GenerationConfig { max_new_tokens: 5, seed: 1, ..Default::default() };
//! let out = generate(&lm, None, &[vec![1, 2, 3], vec![4]], &gen, &Device::Cpu)?;
//! assert_eq!(out[0].logprobs.len(), out[0].response_ids.len());
//! # Ok(()) }
//! ```
//!
//! # Models
//!
//! Every model returns hidden states and logits at **every** position and takes an **external**
//! [`KvCache`] for incremental decoding. Every op on the training path has a backward pass (see
//! [`rltune_kernels`]); each model's gradients are checked against finite differences (the
//! `gradients_*` unit tests in `bert.rs`, `distilbert.rs` and `llama.rs`, and
//! `tests/integration/gpt2.rs`'s `gpt2_gradients_match_finite_differences`).
//!
//! | `model_type` | type | used as |
//! |---|---|---|
//! | `gpt2` (gpt2, distilgpt2) | [`gpt2::Gpt2`] | policy, reference |
//! | `llama`, `qwen2`, `mistral` | [`llama::Llama`] | policy, reference |
//! | `gpt_neo` | [`gpt_neo::GptNeo`] | policy, reference |
//! | `gpt_neox` (Pythia) | [`gpt_neox::GptNeoX`] | policy, reference |
//! | `bert` | [`bert`] | reward model (sequence classification), embeddings |
//! | `distilbert` | [`distilbert`] | reward model (sequence classification) |

#![deny(missing_docs)]

pub mod bert;
pub mod chat_template;
pub mod classifier;
pub mod distilbert;
pub mod error;
pub mod generation;
pub mod gguf;
pub mod gguf_export;
pub mod gguf_vocab;
pub mod gguf_write;
pub mod gpt2;
pub mod gpt_neo;
pub mod gpt_neox;
pub mod hub;
pub mod io;
pub mod layers;
pub mod llama;
pub mod load;
pub mod lora;
pub mod params;
pub mod tokenizer;
pub mod value_head;

use std::path::Path;

use candle_core::Tensor;

pub use error::{ConfigError, Error, Result};
pub use layers::KvCache;
pub use value_head::{CausalLmWithValueHead, ValueHead, ValueHeadKind, ValueHeadSpec};

use crate::params::Params;

/// Causal LM `model_type`s rltune implements.
pub const CAUSAL_LM_TYPES: &[&str] = &["gpt2", "llama", "qwen2", "mistral", "gpt_neo", "gpt_neox"];

/// The config of a causal LM, by architecture.
#[derive(Debug, Clone)]
pub enum CausalLmConfig {
    /// `gpt2`
    Gpt2(gpt2::Gpt2Config),
    /// `llama`, `qwen2`, `mistral`
    Llama(llama::LlamaConfig),
    /// `gpt_neo`
    GptNeo(gpt_neo::GptNeoConfig),
    /// `gpt_neox`
    GptNeoX(gpt_neox::GptNeoXConfig),
}

impl CausalLmConfig {
    /// Parses a `config.json` value; `path` names the file in errors.
    pub fn from_json(value: &serde_json::Value, path: &Path) -> Result<Self> {
        let model_type = value.get("model_type").and_then(|v| v.as_str()).ok_or_else(|| {
            Error::config(path, "missing string field \"model_type\" (e.g. \"gpt2\", \"llama\")")
        })?;
        let bad = |e: serde_json::Error, field: Option<String>| {
            let field = field.map(|f| format!("field {f:?}: ")).unwrap_or_default();
            Error::config(path, format!("invalid {model_type} config: {field}{e}; fix it in config.json"))
        };
        let invalid = |m: ConfigError| {
            Error::config(path, format!("{m}; fix config.json to describe the checkpoint's model"))
        };
        match model_type {
            "gpt2" => {
                let c: gpt2::Gpt2Config = parse_config(value).map_err(|(e, f)| bad(e, f))?;
                c.validate().map_err(invalid)?;
                Ok(Self::Gpt2(c))
            }
            "llama" | "qwen2" | "mistral" => {
                let c: llama::LlamaConfig = parse_config(value).map_err(|(e, f)| bad(e, f))?;
                c.validate().map_err(invalid)?;
                Ok(Self::Llama(c))
            }
            "gpt_neo" => {
                let c: gpt_neo::GptNeoConfig = parse_config(value).map_err(|(e, f)| bad(e, f))?;
                c.validate().map_err(invalid)?;
                Ok(Self::GptNeo(c))
            }
            "gpt_neox" => {
                let c: gpt_neox::GptNeoXConfig = parse_config(value).map_err(|(e, f)| bad(e, f))?;
                c.validate().map_err(invalid)?;
                Ok(Self::GptNeoX(c))
            }
            other => Err(Error::UnsupportedModel {
                path: path.to_path_buf(),
                model_type: other.to_string(),
                supported: CAUSAL_LM_TYPES.join(", "),
            }),
        }
    }

    /// The architecture's `model_type` (`"llama"` also for Qwen2 and Mistral: they share PEFT's
    /// default LoRA targets).
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Gpt2(_) => "gpt2",
            Self::Llama(_) => "llama",
            Self::GptNeo(_) => "gpt_neo",
            Self::GptNeoX(_) => "gpt_neox",
        }
    }

    /// Vocabulary size V.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2(c) => c.vocab_size,
            Self::Llama(c) => c.vocab_size,
            Self::GptNeo(c) => c.vocab_size,
            Self::GptNeoX(c) => c.vocab_size,
        }
    }

    /// The end-of-sequence ids (Llama 3 configs list several).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self {
            Self::Gpt2(c) => c.eos_token_id.into_iter().collect(),
            Self::Llama(c) => match &c.eos_token_id {
                Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
                Some(serde_json::Value::Array(a)) => {
                    a.iter().filter_map(|v| v.as_u64()).map(|n| n as u32).collect()
                }
                _ => Vec::new(),
            },
            Self::GptNeo(c) => c.eos_token_id.into_iter().collect(),
            Self::GptNeoX(c) => c.eos_token_id.into_iter().collect(),
        }
    }

    /// The padding id from config.json, if it names one.
    pub fn pad_token_id(&self) -> Option<u32> {
        match self {
            Self::Gpt2(c) => c.pad_token_id,
            Self::Llama(c) => c.pad_token_id,
            Self::GptNeo(c) => c.pad_token_id,
            Self::GptNeoX(c) => c.pad_token_id,
        }
    }

    /// The longest sequence the model accepts, if it has a limit.
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            Self::Gpt2(c) => Some(c.n_positions),
            Self::Llama(c) => Some(c.max_positions()),
            Self::GptNeo(c) => Some(c.max_position_embeddings),
            Self::GptNeoX(c) => Some(c.max_position_embeddings),
        }
    }
}

/// Deserializes a config; on failure also returns the field at fault when the error does not name
/// it (serde's "invalid type" errors from a `Value` do not): the one field whose removal fixes it.
fn parse_config<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> std::result::Result<T, (serde_json::Error, Option<String>)> {
    serde_json::from_value(value.clone()).map_err(|e| {
        let culprit =
            value.as_object().filter(|_| !e.to_string().starts_with("missing field")).and_then(|obj| {
                obj.keys()
                    .find(|k| {
                        let mut without = obj.clone();
                        without.remove(k.as_str());
                        serde_json::from_value::<T>(serde_json::Value::Object(without)).is_ok()
                    })
                    .cloned()
            });
        (e, culprit)
    })
}

#[derive(Debug, Clone)]
enum Arch {
    Gpt2(gpt2::Gpt2),
    Llama(llama::Llama),
    GptNeo(gpt_neo::GptNeo),
    GptNeoX(gpt_neox::GptNeoX),
}

/// A causal language model of any supported architecture.
#[derive(Debug, Clone)]
pub struct CausalLm {
    arch: Arch,
    cfg: CausalLmConfig,
    n_layers: usize,
    hidden_size: usize,
    /// With partial freezing: the blocks below this one (and the embeddings) are the frozen
    /// trunk, whose output is detached ([`Self::with_trainable_layers`]).
    frozen_layers: Option<usize>,
}

impl CausalLm {
    /// Builds the model from `p` (the checkpoint root).
    pub fn load(p: &Params, cfg: &CausalLmConfig) -> Result<Self> {
        let (arch, n_layers, hidden_size) = match cfg {
            CausalLmConfig::Gpt2(c) => (Arch::Gpt2(gpt2::Gpt2::load(p, c)?), c.n_layer, c.n_embd),
            CausalLmConfig::Llama(c) => {
                (Arch::Llama(llama::Llama::load(p, c)?), c.num_hidden_layers, c.hidden_size)
            }
            CausalLmConfig::GptNeo(c) => {
                (Arch::GptNeo(gpt_neo::GptNeo::load(p, c)?), c.num_layers, c.hidden_size)
            }
            CausalLmConfig::GptNeoX(c) => {
                (Arch::GptNeoX(gpt_neox::GptNeoX::load(p, c)?), c.num_hidden_layers, c.hidden_size)
            }
        };
        p.store().check_lora()?;
        Ok(Self { arch, cfg: cfg.clone(), n_layers, hidden_size, frozen_layers: None })
    }

    /// The config.
    pub fn config(&self) -> &CausalLmConfig {
        &self.cfg
    }

    /// Number of layers (the KV cache's length).
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Hidden size C.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// Vocabulary size V.
    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab_size()
    }

    /// An empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.n_layers)
    }

    /// Partial freezing (the textworld fork's "use only the last third of the model for
    /// training"): the last `trainable` blocks train, with the final norm and the heads; the
    /// embeddings and the blocks below are a frozen trunk whose output is detached, so no
    /// gradient is computed through it. The store's variables are frozen separately
    /// ([`params::ParamStore::freeze`]). `trainable` above the model's layer count is an error naming
    /// both.
    pub fn with_trainable_layers(mut self, trainable: usize) -> Result<Self> {
        if trainable > self.n_layers {
            return Err(Error::Input(format!(
                "trainable_layers = {trainable}, but the model has {} layers: use at most {}",
                self.n_layers, self.n_layers
            )));
        }
        self.frozen_layers = Some(self.n_layers - trainable);
        Ok(self)
    }

    /// Whether the checkpoint tensor `name` belongs to the frozen trunk of a model whose first
    /// `frozen_layers` blocks are frozen: the embeddings (and so a tied LM head) and those
    /// blocks, by the names of every supported family (`wte`/`wpe`, `embed_tokens`, `embed_in`,
    /// BERT's `embeddings`; `h.N.`, `layers.N.`, `layer.N.`).
    pub fn is_trunk_param(name: &str, frozen_layers: usize) -> bool {
        let parts: Vec<&str> = name.split('.').collect();
        let embedding = |p: &str| matches!(p, "wte" | "wpe" | "embed_tokens" | "embed_in" | "embeddings");
        if parts.iter().any(|p| embedding(p)) {
            return true;
        }
        parts.windows(2).any(|w| {
            matches!(w[0], "h" | "layers" | "layer") && w[1].parse::<usize>().is_ok_and(|i| i < frozen_layers)
        })
    }

    /// Partial freezing of a loaded policy (`[model] trainable_layers`): the trunk's variables
    /// in `store` are frozen ([`params::ParamStore::freeze`]) and the model's trunk output detached
    /// ([`Self::with_trainable_layers`]). Refused with LoRA (the base is frozen already).
    pub fn freeze_trunk(self, store: &params::ParamStore, trainable: usize) -> Result<Self> {
        if store.has_lora() {
            return Err(Error::Input(
                "trainable_layers with LoRA: the adapters already leave the base frozen; use one of \
                 [lora] and trainable_layers"
                    .into(),
            ));
        }
        let lm = self.with_trainable_layers(trainable)?;
        let frozen = lm.frozen_layers.unwrap_or(0);
        store.freeze(|name| Self::is_trunk_param(name, frozen));
        Ok(lm)
    }

    /// Gradient checkpointing (TRL's `gradient_checkpointing`, transformers'
    /// `gradient_checkpointing_enable()`): training forwards keep only each block's input for
    /// the backward, which runs the block again (`rltune_kernels::checkpoint`); the gradients are
    /// those of the plain forward. It takes effect where a `rltune_kernels::Grads` collects the
    /// gradients (every trainer's binds the store's slot to one), and never in generation (a KV
    /// cache).
    pub fn with_gradient_checkpointing(mut self, on: bool) -> Self {
        match &mut self.arch {
            Arch::Gpt2(m) => m.set_checkpointing(on),
            Arch::Llama(m) => m.set_checkpointing(on),
            Arch::GptNeo(m) => m.set_checkpointing(on),
            Arch::GptNeoX(m) => m.set_checkpointing(on),
        }
        self
    }

    /// The number of frozen blocks below the trainable ones, with partial freezing.
    pub fn frozen_layers(&self) -> Option<usize> {
        self.frozen_layers
    }

    /// The frozen trunk's output: the detached hidden states entering the first trainable block
    /// (no cache). Two models that [share a trunk](Self::shares_trunk) compute it once.
    pub fn trunk(&self, input_ids: &Tensor, position_ids: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let end = self.frozen_layers.unwrap_or(0);
        let h = match &self.arch {
            Arch::Gpt2(m) => m.trunk(input_ids, position_ids, bias, end),
            Arch::Llama(m) => m.trunk(input_ids, position_ids, bias, end),
            Arch::GptNeo(m) => m.trunk(input_ids, position_ids, bias, end),
            Arch::GptNeoX(m) => m.trunk(input_ids, position_ids, bias, end),
        }?;
        Ok(h.detach())
    }

    /// The trainable blocks and the final norm on `trunk` ([`Self::trunk`]'s output): what
    /// [`Self::forward_rows`] returns (`rows` empty: every row).
    pub fn forward_from_trunk(
        &self,
        trunk: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        rows: &[usize],
    ) -> Result<Tensor> {
        let start = self.frozen_layers.unwrap_or(0);
        match &self.arch {
            Arch::Gpt2(m) => m.top(trunk, bias, start, rows),
            Arch::Llama(m) => m.top(trunk, position_ids, bias, start),
            Arch::GptNeo(m) => m.top(trunk, bias, start),
            Arch::GptNeoX(m) => m.top(trunk, position_ids, bias, start),
        }
    }

    /// Whether `other` has the same frozen trunk, the same tensors (not copies): then its
    /// [`Self::trunk`] is this model's, and the policy and its reference compute it once.
    pub fn shares_trunk(&self, other: &CausalLm) -> bool {
        let (Some(n), Some(m)) = (self.frozen_layers, other.frozen_layers) else { return false };
        if n != m || n == 0 || self.n_layers != other.n_layers {
            return false;
        }
        let (a, b) = (self.weight_matrices(), other.weight_matrices());
        let per_block = (a.len() - 1) / self.n_layers;
        a.len() == b.len()
            && a[..n * per_block].iter().zip(&b[..n * per_block]).all(|(x, y)| x.id() == y.id())
    }

    /// Final (post-norm) hidden states at every new position: `(B, T) -> (B, T, C)`.
    ///
    /// `position_ids (B, T)`, `bias (B, 1, T, S)` (see [`layers::causal_bias`]). With partial
    /// freezing and no cache, the trunk's output is detached.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        if self.frozen_layers.is_some() && cache.is_none() {
            let trunk = self.trunk(input_ids, position_ids, bias)?;
            return self.forward_from_trunk(&trunk, position_ids, bias, &[]);
        }
        match &self.arch {
            Arch::Gpt2(m) => m.forward(input_ids, position_ids, bias, cache),
            Arch::Llama(m) => m.forward(input_ids, position_ids, bias, cache),
            Arch::GptNeo(m) => m.forward(input_ids, position_ids, bias, cache),
            Arch::GptNeoX(m) => m.forward(input_ids, position_ids, bias, cache),
        }
    }

    /// [`Self::forward`] (no cache) where only the hidden states of `rows` (indices into the
    /// flattened `(B·T)` positions, ascending) will be read; the others are unspecified. GPT-2
    /// skips the last block's work for the other rows ([`gpt2::Gpt2::forward_rows`]); other
    /// architectures compute every row.
    pub fn forward_rows(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        rows: &[usize],
    ) -> Result<Tensor> {
        if self.frozen_layers.is_some() {
            let trunk = self.trunk(input_ids, position_ids, bias)?;
            return self.forward_from_trunk(&trunk, position_ids, bias, rows);
        }
        match &self.arch {
            Arch::Gpt2(m) => m.forward_rows(input_ids, position_ids, bias, rows),
            Arch::Llama(m) => m.forward(input_ids, position_ids, bias, None),
            Arch::GptNeo(m) => m.forward(input_ids, position_ids, bias, None),
            Arch::GptNeoX(m) => m.forward(input_ids, position_ids, bias, None),
        }
    }

    /// The LM head's weight `(V, C)`; `logits(h) = h·Wᵀ`.
    pub fn lm_head_weight(&self) -> &Tensor {
        match &self.arch {
            Arch::Gpt2(m) => m.lm_head_weight(),
            Arch::Llama(m) => m.lm_head_weight(),
            Arch::GptNeo(m) => m.lm_head_weight(),
            Arch::GptNeoX(m) => m.lm_head_weight(),
        }
    }

    /// The gradient slot of the store this model was built from: the backward of its ops writes
    /// the weights' gradients where `rltune_kernels::Grads::bind` pointed it (torch's
    /// `param.grad`); an op that takes one of its weights outside the model (the LM head's
    /// log-probabilities) takes this slot too.
    pub fn grad_slot(&self) -> &rltune_kernels::GradSlot {
        match &self.arch {
            Arch::Gpt2(m) => m.grad_slot(),
            Arch::Llama(m) => m.grad_slot(),
            Arch::GptNeo(m) => m.grad_slot(),
            Arch::GptNeoX(m) => m.grad_slot(),
        }
    }

    /// A copy for inference with every LoRA adapter folded into its weight (`W + ΔW`, detached,
    /// PEFT's `merge`); `None` when the model has no adapter. The copy holds new tensors for the
    /// adapted weights only: the rest is shared.
    pub fn with_adapters_merged(&self) -> Result<Option<Self>> {
        let mut m = self.clone();
        let any = match &mut m.arch {
            Arch::Gpt2(a) => a.merge_adapters()?,
            Arch::Llama(a) => a.merge_adapters()?,
            Arch::GptNeo(a) => a.merge_adapters()?,
            Arch::GptNeoX(a) => a.merge_adapters()?,
        };
        Ok(any.then_some(m))
    }

    /// The weight matrices of the linear layers and the LM head (each a matrix product's
    /// right-hand side).
    pub fn weight_matrices(&self) -> Vec<Tensor> {
        match &self.arch {
            Arch::Gpt2(m) => m.weight_matrices(),
            Arch::Llama(m) => m.weight_matrices(),
            Arch::GptNeo(m) => m.weight_matrices(),
            Arch::GptNeoX(m) => m.weight_matrices(),
        }
    }

    /// `(B, T, C) -> (B, T, V)`
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        match &self.arch {
            Arch::Gpt2(m) => m.logits(hidden),
            Arch::Llama(m) => m.logits(hidden),
            Arch::GptNeo(m) => m.logits(hidden),
            Arch::GptNeoX(m) => m.logits(hidden),
        }
    }
}
