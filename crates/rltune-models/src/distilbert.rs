//! DistilBERT (`model_type = "distilbert"`): the encoder and its sequence-classification head,
//! the reward model of TRL's sentiment example (`lvwerra/distilbert-imdb`).
//!
//! Mirrors transformers 4.46 `models/distilbert/modeling_distilbert.py`: weight names as in
//! `DistilBertForSequenceClassification` (`distilbert.transformer.layer.{i}.attention.q_lin.weight`,
//! `pre_classifier.weight`, `classifier.weight`), post-layer-norm blocks with epsilon 1e-12, no
//! token types and no pooler. A checkpoint of a plain `DistilBertModel` (no `distilbert.` prefix)
//! loads as an encoder.
//!
//! Differences from transformers, all deliberate:
//! - dropout (including `seq_classif_dropout`) is never applied (see the crate docs);
//! - with `sinusoidal_pos_embds = true` the position table is computed here (transformers'
//!   `create_sinusoidal_embeddings`, frozen) and the copy stored in the checkpoint is not read;
//! - position ids are always `0..T`, so inputs must be right-padded;
//! - padded keys get an additive bias of [`MASK_MIN`](super::layers::MASK_MIN) instead of being
//!   filled with `finfo(dtype).min`; rows with at least one real key come out identical.
//!
//! Shape legend: B batch, T positions, C hidden size (`dim`), L labels.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::bert::{check_mask, check_positions, resolve_labels};
use super::layers::{attention, merge_heads, padding_bias, split_heads};
use super::layers::{Activation, Embedding, LayerNorm, Linear};
use crate::error::{ConfigError, Error, Result};
use crate::params::Params;

/// Layer-norm epsilon, hard-coded in transformers' DistilBERT.
const LAYER_NORM_EPS: f64 = 1e-12;

/// `config.json` of a DistilBERT model; defaults are transformers' `DistilBertConfig` defaults.
///
/// Fields rltune does not use (dropout probabilities, `qa_dropout`, `seq_classif_dropout`, …) are
/// ignored when parsing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DistilBertConfig {
    /// Vocabulary size.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Hidden size C.
    #[serde(default = "d_dim")]
    pub dim: usize,
    /// Number of transformer blocks.
    #[serde(default = "d_n_layers")]
    pub n_layers: usize,
    /// Number of attention heads.
    #[serde(default = "d_n_heads")]
    pub n_heads: usize,
    /// Feed-forward inner size.
    #[serde(default = "d_hidden_dim")]
    pub hidden_dim: usize,
    /// Feed-forward activation; `gelu` is the exact erf form.
    #[serde(default = "d_act")]
    pub activation: String,
    /// Longest sequence the position table covers.
    #[serde(default = "d_positions")]
    pub max_position_embeddings: usize,
    /// Fixed sinusoidal position table instead of a learned one.
    #[serde(default)]
    pub sinusoidal_pos_embds: bool,
    /// Padding token.
    #[serde(default = "d_pad")]
    pub pad_token_id: Option<u32>,
    /// Class names by index; the JSON keys are decimal strings (`{"0": "NEGATIVE"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id2label: Option<BTreeMap<String, String>>,
    /// Class indices by name (informational; `id2label` is authoritative).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label2id: Option<BTreeMap<String, usize>>,
    /// Number of classes, used only when `id2label` is absent (transformers' default: 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_labels: Option<usize>,
    /// `single_label_classification`, `multi_label_classification` or `regression`; the logits
    /// are the same for all three.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem_type: Option<String>,
    /// Init std for random models.
    #[serde(default = "d_init")]
    pub initializer_range: f64,
}

fn d_vocab() -> usize {
    30522
}
fn d_dim() -> usize {
    768
}
fn d_n_layers() -> usize {
    6
}
fn d_n_heads() -> usize {
    12
}
fn d_hidden_dim() -> usize {
    3072
}
fn d_act() -> String {
    "gelu".into()
}
fn d_positions() -> usize {
    512
}
fn d_pad() -> Option<u32> {
    Some(0)
}
fn d_init() -> f64 {
    0.02
}

impl DistilBertConfig {
    /// A small config for tests: `n_labels` classes named `LABEL_i`.
    pub fn tiny(vocab_size: usize, dim: usize, n_layers: usize, n_heads: usize, n_labels: usize) -> Self {
        let mut c: Self =
            serde_json::from_str("{}").unwrap_or_else(|_| unreachable!("all fields have defaults"));
        c.vocab_size = vocab_size;
        c.dim = dim;
        c.n_layers = n_layers;
        c.n_heads = n_heads;
        c.hidden_dim = 2 * dim;
        c.max_position_embeddings = 32;
        c.num_labels = Some(n_labels);
        c
    }

    /// Class names by index (see [`resolve_labels`]).
    pub fn labels(&self) -> std::result::Result<Vec<String>, ConfigError> {
        resolve_labels(self.id2label.as_ref(), self.num_labels)
    }

    /// Checks the fields that would otherwise fail deep inside a forward pass.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.n_heads == 0 || !self.dim.is_multiple_of(self.n_heads) {
            return Err(ConfigError::new(
                "",
                "dim",
                format!("({}) must be a positive multiple of n_heads ({})", self.dim, self.n_heads),
            ));
        }
        if self.vocab_size == 0 || self.n_layers == 0 || self.max_position_embeddings == 0 {
            return Err(ConfigError::table(
                "",
                "vocab_size, n_layers and max_position_embeddings must be positive",
            ));
        }
        if self.sinusoidal_pos_embds && !self.dim.is_multiple_of(2) {
            return Err(ConfigError::new(
                "",
                "sinusoidal_pos_embds",
                format!("needs an even dim, got {}", self.dim),
            ));
        }
        Activation::parse("activation", &self.activation)?;
        self.labels().map(|_| ())
    }
}

/// transformers' `create_sinusoidal_embeddings`: `(n_pos, dim)` with
/// `θ(pos, j) = pos / 10000^(2⌊j/2⌋/dim)`, `sin θ` in even columns and `cos θ` in odd ones.
pub fn sinusoidal_positions(n_pos: usize, dim: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mut data = Vec::with_capacity(n_pos * dim);
    for pos in 0..n_pos {
        for j in 0..dim {
            let theta = pos as f64 / 10000f64.powf((2 * (j / 2)) as f64 / dim as f64);
            data.push(if j % 2 == 0 { theta.sin() } else { theta.cos() });
        }
    }
    Ok(Tensor::from_vec(data, (n_pos, dim), device)?.to_dtype(dtype)?)
}

/// DistilBERT's `Embeddings`: word + position, then LayerNorm (no token types).
#[derive(Debug, Clone)]
struct Embeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    layer_norm: LayerNorm,
}

impl Embeddings {
    fn load(p: &Params, cfg: &DistilBertConfig) -> Result<Self> {
        let (c, std, n_pos) = (cfg.dim, cfg.initializer_range, cfg.max_position_embeddings);
        let word_embeddings = Embedding::load(&p.pp("word_embeddings"), cfg.vocab_size, c, std)?;
        let position_embeddings = if cfg.sinusoidal_pos_embds {
            let store = p.store();
            Embedding::fixed(sinusoidal_positions(n_pos, c, store.dtype(), store.device())?)
        } else {
            Embedding::load(&p.pp("position_embeddings"), n_pos, c, std)?
        };
        let layer_norm = LayerNorm::load(&p.pp("LayerNorm"), c, LAYER_NORM_EPS)?;
        Ok(Self { word_embeddings, position_embeddings, layer_norm })
    }

    /// `input_ids (B, T) -> (B, T, C)`
    fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        check_positions(seq_len, self.position_embeddings.weight.dim(0)?)?;
        // (T)
        let positions = Tensor::arange(0u32, seq_len as u32, input_ids.device())?;
        let x = self
            .word_embeddings
            .forward(input_ids)?
            .broadcast_add(&self.position_embeddings.forward(&positions)?)?;
        self.layer_norm.forward(&x)
    }
}

/// `MultiHeadSelfAttention`: `out_lin(softmax(q kᵀ / √D + bias) v)`.
#[derive(Debug, Clone)]
struct MultiHeadSelfAttention {
    q_lin: Linear,
    k_lin: Linear,
    v_lin: Linear,
    out_lin: Linear,
    n_heads: usize,
    scale: f64,
}

impl MultiHeadSelfAttention {
    fn load(p: &Params, cfg: &DistilBertConfig) -> Result<Self> {
        let (c, std) = (cfg.dim, cfg.initializer_range);
        Ok(Self {
            q_lin: Linear::load(&p.pp("q_lin"), c, c, true, std)?,
            k_lin: Linear::load(&p.pp("k_lin"), c, c, true, std)?,
            v_lin: Linear::load(&p.pp("v_lin"), c, c, true, std)?,
            out_lin: Linear::load(&p.pp("out_lin"), c, c, true, std)?,
            n_heads: cfg.n_heads,
            scale: 1.0 / ((c / cfg.n_heads) as f64).sqrt(),
        })
    }

    /// `(B, T, C)`, `bias (B, 1, 1, T) -> (B, T, C)`
    fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let q = split_heads(&self.q_lin.forward(x)?, self.n_heads)?;
        let k = split_heads(&self.k_lin.forward(x)?, self.n_heads)?;
        let v = split_heads(&self.v_lin.forward(x)?, self.n_heads)?;
        self.out_lin.forward(&merge_heads(&attention(&q, &k, &v, bias, self.scale)?)?)
    }
}

/// `TransformerBlock`: `sa_layer_norm(attention(x) + x)`, then
/// `output_layer_norm(lin2(act(lin1(h))) + h)`.
#[derive(Debug, Clone)]
struct TransformerBlock {
    attention: MultiHeadSelfAttention,
    sa_layer_norm: LayerNorm,
    lin1: Linear,
    lin2: Linear,
    act: Activation,
    output_layer_norm: LayerNorm,
}

impl TransformerBlock {
    fn load(p: &Params, cfg: &DistilBertConfig) -> Result<Self> {
        let (c, inner, std) = (cfg.dim, cfg.hidden_dim, cfg.initializer_range);
        Ok(Self {
            attention: MultiHeadSelfAttention::load(&p.pp("attention"), cfg)?,
            sa_layer_norm: LayerNorm::load(&p.pp("sa_layer_norm"), c, LAYER_NORM_EPS)?,
            lin1: Linear::load(&p.pp("ffn").pp("lin1"), c, inner, true, std)?,
            lin2: Linear::load(&p.pp("ffn").pp("lin2"), inner, c, true, std)?,
            act: Activation::parse("activation", &cfg.activation)?,
            output_layer_norm: LayerNorm::load(&p.pp("output_layer_norm"), c, LAYER_NORM_EPS)?,
        })
    }

    /// `(B, T, C)`, `bias (B, 1, 1, T) -> (B, T, C)`
    fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let h = self.sa_layer_norm.forward(&(self.attention.forward(x, bias)? + x)?)?;
        let ffn = self.lin2.forward(&self.act.forward(&self.lin1.forward(&h)?)?)?;
        self.output_layer_norm.forward(&(ffn + &h)?)
    }
}

/// The DistilBERT encoder (`DistilBertModel`).
#[derive(Debug, Clone)]
pub struct DistilBert {
    embeddings: Embeddings,
    layers: Vec<TransformerBlock>,
    cfg: DistilBertConfig,
    /// Partial freezing: the output of the embeddings and of the layers below this one is
    /// detached.
    pub(crate) frozen_layers: Option<usize>,
}

impl DistilBert {
    /// Builds the encoder from `p`, the checkpoint root: names `distilbert.*` (a
    /// `DistilBertForSequenceClassification` checkpoint) or unprefixed (a plain `DistilBertModel`).
    pub fn load(p: &Params, cfg: &DistilBertConfig) -> Result<Self> {
        cfg.validate().map_err(|m| Error::config(p.store().source(), m))?;
        let body =
            if p.contains("embeddings.word_embeddings.weight") { p.clone() } else { p.pp("distilbert") };
        let embeddings = Embeddings::load(&body.pp("embeddings"), cfg)?;
        let layers = (0..cfg.n_layers)
            .map(|i| TransformerBlock::load(&body.pp("transformer").pp("layer").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { embeddings, layers, cfg: cfg.clone(), frozen_layers: None })
    }

    /// The config this model was built from.
    pub fn config(&self) -> &DistilBertConfig {
        &self.cfg
    }

    /// Last hidden state: `input_ids (B, T)` u32 → `(B, T, C)`.
    ///
    /// `attention_mask` holds `B` rows of `T` entries, 1 for tokens and 0 for (right) padding.
    /// Padded positions still get hidden states but carry no meaning.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &[Vec<u8>]) -> Result<Tensor> {
        let (b_sz, seq_len) = input_ids.dims2()?;
        check_mask(attention_mask, b_sz, seq_len)?;
        let mut x = self.embeddings.forward(input_ids)?;
        // (B, 1, 1, T)
        let bias = padding_bias(attention_mask, x.dtype(), input_ids.device())?;
        for (i, layer) in self.layers.iter().enumerate() {
            if self.frozen_layers == Some(i) {
                x = x.detach();
            }
            x = layer.forward(&x, &bias)?;
        }
        if self.frozen_layers == Some(self.layers.len()) {
            x = x.detach();
        }
        Ok(x)
    }
}

/// `DistilBertForSequenceClassification`: `classifier(relu(pre_classifier(hidden[:, 0])))`.
#[derive(Debug, Clone)]
pub struct DistilBertForSequenceClassification {
    distilbert: DistilBert,
    pre_classifier: Linear,
    classifier: Linear,
    labels: Vec<String>,
}

impl DistilBertForSequenceClassification {
    pub(crate) fn encoder_mut(&mut self) -> &mut DistilBert {
        &mut self.distilbert
    }

    /// Builds the model from `p`, the checkpoint root (names `distilbert.*`, `pre_classifier.*`,
    /// `classifier.*`).
    pub fn load(p: &Params, cfg: &DistilBertConfig) -> Result<Self> {
        let distilbert = DistilBert::load(p, cfg)?;
        let labels = cfg.labels().map_err(|m| Error::config(p.store().source(), m))?;
        let (c, std) = (cfg.dim, cfg.initializer_range);
        let pre_classifier = Linear::load(&p.pp("pre_classifier"), c, c, true, std)?;
        let classifier = Linear::load(&p.pp("classifier"), c, labels.len(), true, std)?;
        Ok(Self { distilbert, pre_classifier, classifier, labels })
    }

    /// The encoder.
    pub fn distilbert(&self) -> &DistilBert {
        &self.distilbert
    }

    /// Class names by index.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Logits `(B, L)` for `input_ids (B, T)`; arguments as in [`DistilBert::forward`].
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &[Vec<u8>]) -> Result<Tensor> {
        let hidden = self.distilbert.forward(input_ids, attention_mask)?;
        self.classify(&hidden)
    }

    /// The head alone: `hidden (B, T, C) -> logits (B, L)` from the first (`[CLS]`) position.
    pub fn classify(&self, hidden: &Tensor) -> Result<Tensor> {
        // (B, C)
        let cls = hidden.narrow(1, 0, 1)?.squeeze(1)?;
        self.classifier.forward(&self.pre_classifier.forward(&cls)?.relu()?)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::bert::tests::{
        check_gradients, load_fixture, mask_rows, masked_max_abs_diff, max_abs_diff, projection, tiny_batch,
    };
    use crate::bert::{sentence_embedding, SequenceClassifierConfig};
    use crate::params::ParamStore;

    #[test]
    fn distilbert_matches_transformers_fixture() {
        let (config, store, expected) = load_fixture("distilbert");
        let cfg = match SequenceClassifierConfig::from_json(&config, Path::new("config.json")).unwrap() {
            SequenceClassifierConfig::DistilBert(c) => c,
            other => panic!("expected a distilbert config, got {other:?}"),
        };
        let model = DistilBertForSequenceClassification::load(&store.root(), &cfg).unwrap();
        assert_eq!(model.labels(), ["NEGATIVE", "POSITIVE"]);
        let ids = expected["input_ids"].to_dtype(DType::U32).unwrap();
        let mask = mask_rows(&expected["attention_mask"]);
        let hidden = model.distilbert().forward(&ids, &mask).unwrap();
        let d_hidden = masked_max_abs_diff(&hidden, &expected["hidden"], &mask);
        let d_logits = max_abs_diff(&model.forward(&ids, &mask).unwrap(), &expected["logits"]);
        let mean = sentence_embedding(&hidden, &mask, false).unwrap();
        let d_mean = max_abs_diff(&mean, &expected["mean_pooled"]);
        println!(
            "distilbert vs transformers: hidden {d_hidden:e}, logits {d_logits:e}, mean_pooled {d_mean:e}"
        );
        for (what, d) in [("hidden", d_hidden), ("logits", d_logits), ("mean", d_mean)] {
            assert!(d < 1e-4, "{what}: max abs diff {d:e}");
        }
    }

    #[test]
    fn gradients_reach_every_parameter_and_match_finite_differences() {
        let store = ParamStore::random(4, true, DType::F64, &Device::Cpu).unwrap();
        let mut cfg = DistilBertConfig::tiny(11, 8, 2, 2, 3);
        cfg.initializer_range = 0.3;
        let model = DistilBertForSequenceClassification::load(&store.root(), &cfg).unwrap();
        let (ids, _, mask) = tiny_batch();
        let proj = projection(2, 3, 12);
        let loss = || Ok(model.forward(&ids, &mask)?.mul(&proj)?.sum_all()?);
        check_gradients(&store, &["attention.k_lin.bias"], loss);
    }

    #[test]
    fn padding_does_not_change_real_positions() {
        let store = ParamStore::random(6, false, DType::F64, &Device::Cpu).unwrap();
        let cfg = DistilBertConfig::tiny(11, 8, 2, 2, 2);
        let model = DistilBertForSequenceClassification::load(&store.root(), &cfg).unwrap();
        let (ids, _, mask) = tiny_batch();
        let batch = model.forward(&ids, &mask).unwrap();
        let one =
            model.forward(&ids.narrow(0, 1, 1).unwrap().narrow(1, 0, 4).unwrap(), &[vec![1; 4]]).unwrap();
        let d = max_abs_diff(&batch.narrow(0, 1, 1).unwrap(), &one);
        assert!(d < 1e-12, "{d:e}");
    }

    #[test]
    fn sinusoids_follow_transformers_formula() {
        let t = sinusoidal_positions(3, 4, DType::F64, &Device::Cpu).unwrap().to_vec2::<f64>().unwrap();
        // Row 2: θ = [2, 2, 2/100, 2/100] (10000^(2/4) = 100).
        let want = [2f64.sin(), 2f64.cos(), 0.02f64.sin(), 0.02f64.cos()];
        assert!(t[2].iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-15), "{:?}", t[2]);
        assert_eq!(t[0], [0.0, 1.0, 0.0, 1.0]);
        // The table is computed, not read: a sinusoidal model makes no position parameter.
        let store = ParamStore::random(0, true, DType::F32, &Device::Cpu).unwrap();
        let mut cfg = DistilBertConfig::tiny(11, 8, 1, 2, 2);
        cfg.sinusoidal_pos_embds = true;
        DistilBert::load(&store.root(), &cfg).unwrap();
        assert!(store.names().iter().all(|n| !n.contains("position_embeddings")));
    }

    #[test]
    fn plain_encoder_checkpoint_loads_without_prefix() {
        let random = ParamStore::random(2, false, DType::F32, &Device::Cpu).unwrap();
        let cfg = DistilBertConfig::tiny(11, 8, 1, 2, 2);
        let prefixed = DistilBert::load(&random.root(), &cfg).unwrap();
        let tensors = random.snapshot().unwrap().into_iter();
        let tensors = tensors.map(|(k, t)| (k.trim_start_matches("distilbert.").to_string(), t)).collect();
        let store =
            ParamStore::from_tensors(tensors, false, DType::F32, &Device::Cpu, Path::new("m")).unwrap();
        let plain = DistilBert::load(&store.root(), &cfg).unwrap();
        let (ids, _, mask) = tiny_batch();
        let a = prefixed.forward(&ids, &mask).unwrap();
        let b: Tensor = plain.forward(&ids, &mask).unwrap();
        assert_eq!(max_abs_diff(&a, &b), 0.0);
    }
}
