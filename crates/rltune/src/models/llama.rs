//! The Llama family (`model_type` = `llama`, `qwen2`, `mistral`). Placeholder until implemented.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::layers::KvCache;
use crate::error::{Error, Result};
use crate::params::Params;

/// `config.json` of a Llama-family model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `qwen2` or `mistral`.
    #[serde(default)]
    pub model_type: String,
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Hidden size C.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// End-of-sequence token.
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Padding token.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Maximum positions.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
}

/// A Llama-family causal LM.
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: LlamaConfig,
}

impl Llama {
    /// Builds the model from the checkpoint root.
    pub fn load(p: &Params, cfg: &LlamaConfig) -> Result<Self> {
        let _ = cfg;
        Err(Error::config(p.store().source(), "llama models are not implemented yet"))
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Final hidden states at every new position: `(B, T) -> (B, T, C)`.
    pub fn forward(
        &self,
        _ids: &Tensor,
        _pos: &Tensor,
        _bias: &Tensor,
        _cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        Err(Error::Input("llama not implemented".into()))
    }

    /// `(B, T, C) -> (B, T, V)`
    pub fn logits(&self, _hidden: &Tensor) -> Result<Tensor> {
        Err(Error::Input("llama not implemented".into()))
    }
}
