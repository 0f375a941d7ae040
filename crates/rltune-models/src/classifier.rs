//! Sequence classifiers (reward models) of either encoder family, chosen by `model_type`:
//! [`crate::bert`] or [`crate::distilbert`].

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::bert::{BertConfig, BertForSequenceClassification};
use crate::distilbert::{DistilBertConfig, DistilBertForSequenceClassification};
use crate::error::{Error, Result};
use crate::params::{ParamStore, Params};
/// Sequence-classification `model_type`s rltune implements.
pub const SEQUENCE_CLASSIFIER_TYPES: &[&str] = &["bert", "distilbert"];

/// The config of a sequence classifier (a reward model), by architecture.
#[derive(Debug, Clone)]
pub enum SequenceClassifierConfig {
    /// `bert`
    Bert(BertConfig),
    /// `distilbert`
    DistilBert(DistilBertConfig),
}

impl SequenceClassifierConfig {
    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Bert(c) => c.vocab_size,
            Self::DistilBert(c) => c.vocab_size,
        }
    }

    /// The longest input the model accepts (`max_position_embeddings`).
    pub fn max_positions(&self) -> usize {
        match self {
            Self::Bert(c) => c.max_position_embeddings,
            Self::DistilBert(c) => c.max_position_embeddings,
        }
    }

    /// The `model_type`: `"bert"` or `"distilbert"`.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Bert(_) => "bert",
            Self::DistilBert(_) => "distilbert",
        }
    }

    /// Parses and validates a `config.json` value; `path` names the file in errors.
    pub fn from_json(value: &serde_json::Value, path: &Path) -> Result<Self> {
        let model_type = value.get("model_type").and_then(|v| v.as_str()).ok_or_else(|| {
            Error::config(path, "missing string field \"model_type\" (e.g. \"distilbert\", \"bert\")")
        })?;
        let bad = |e: serde_json::Error| Error::config(path, format!("invalid {model_type} config: {e}"));
        let cfg = match model_type {
            "bert" => Self::Bert(serde_json::from_value(value.clone()).map_err(bad)?),
            "distilbert" => Self::DistilBert(serde_json::from_value(value.clone()).map_err(bad)?),
            other => {
                return Err(Error::UnsupportedModel {
                    path: path.to_path_buf(),
                    model_type: other.to_string(),
                    supported: SEQUENCE_CLASSIFIER_TYPES.join(", "),
                })
            }
        };
        let valid = match &cfg {
            Self::Bert(c) => c.validate(),
            Self::DistilBert(c) => c.validate(),
        };
        valid.map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }
}

/// A sequence classifier of any supported architecture: the reward model of TRL's sentiment
/// example (`lvwerra/distilbert-imdb`) and its kin.
#[derive(Debug, Clone)]
pub enum SequenceClassifier {
    /// `BertForSequenceClassification`
    Bert(BertForSequenceClassification),
    /// `DistilBertForSequenceClassification`
    DistilBert(DistilBertForSequenceClassification),
}

impl SequenceClassifier {
    /// Partial freezing of a reward model (`[model] trainable_layers` of `rltune reward`): the
    /// last `trainable` encoder layers and the head train; the embeddings and the layers below
    /// leave the optimizer (`store`) and their output is detached. More layers than the model
    /// has is an error naming both.
    pub fn freeze_trunk(mut self, store: &crate::params::ParamStore, trainable: usize) -> Result<Self> {
        let n = match &mut self {
            Self::Bert(m) => m.encoder_mut().config().num_hidden_layers,
            Self::DistilBert(m) => m.encoder_mut().config().n_layers,
        };
        if trainable > n {
            return Err(Error::Input(format!(
                "trainable_layers = {trainable}, but the model has {n} layers: use at most {n}"
            )));
        }
        let frozen = n - trainable;
        match &mut self {
            Self::Bert(m) => m.encoder_mut().frozen_layers = Some(frozen),
            Self::DistilBert(m) => m.encoder_mut().frozen_layers = Some(frozen),
        }
        store.freeze(|name| crate::CausalLm::is_trunk_param(name, frozen));
        Ok(self)
    }

    /// Builds the model from `p`, the checkpoint root.
    pub fn load(p: &Params, cfg: &SequenceClassifierConfig) -> Result<Self> {
        let model = match cfg {
            SequenceClassifierConfig::Bert(c) => Self::Bert(BertForSequenceClassification::load(p, c)?),
            SequenceClassifierConfig::DistilBert(c) => {
                Self::DistilBert(DistilBertForSequenceClassification::load(p, c)?)
            }
        };
        p.store().check_lora()?;
        Ok(model)
    }

    /// Loads a frozen classifier from a local directory or hub id (see [`super::load::locate`]).
    pub fn from_pretrained(model: &str, dtype: DType, device: &Device) -> Result<Self> {
        let files = super::load::locate(model)?;
        let config_json: serde_json::Value = crate::io::read_json(&files.config)?;
        let cfg = SequenceClassifierConfig::from_json(&config_json, &files.config)?;
        let store = ParamStore::load_safetensors(&files.weights, false, dtype, device)?;
        Self::load(&store.root(), &cfg)
    }

    /// Logits `(B, L)` for right-padded `input_ids (B, T)` with `attention_mask` rows (1 = token).
    /// BERT's token types are all 0 (a single segment).
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &[Vec<u8>]) -> Result<Tensor> {
        match self {
            Self::Bert(m) => m.forward(input_ids, None, attention_mask),
            Self::DistilBert(m) => m.forward(input_ids, attention_mask),
        }
    }

    /// Class names by index (`id2label`).
    pub fn id2label(&self) -> &[String] {
        match self {
            Self::Bert(m) => m.labels(),
            Self::DistilBert(m) => m.labels(),
        }
    }

    /// Number of classes L.
    pub fn num_labels(&self) -> usize {
        self.id2label().len()
    }

    /// The index of the class named `name` (e.g. `"POSITIVE"`); a decimal index below L is
    /// accepted too. The error lists the available labels.
    pub fn label_index(&self, name: &str) -> Result<usize> {
        let labels = self.id2label();
        if let Some(i) = labels.iter().position(|l| l == name) {
            return Ok(i);
        }
        match name.trim().parse::<usize>() {
            Ok(i) if i < labels.len() => Ok(i),
            _ => Err(Error::Input(format!(
                "label {name:?} is not one of the classifier's labels; available (id2label): {}",
                labels.iter().enumerate().map(|(i, l)| format!("{i}={l}")).collect::<Vec<_>>().join(", ")
            ))),
        }
    }
}
