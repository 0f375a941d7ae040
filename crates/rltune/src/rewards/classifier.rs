//! A sequence classifier as the reward: TRL's sentiment example.
//!
//! TRL v0.11 `examples/scripts/ppo.py` scores `texts = [q + r for q, r in zip(query, response)]`
//! with `pipeline("sentiment-analysis", "lvwerra/distilbert-imdb")` and
//! `{"return_all_scores": True, "function_to_apply": "none", "batch_size": 16}`, taking
//! `output[1]["score"]`: the raw logit of `POSITIVE`. [`ClassifierRewardConfig::default`] does the
//! same: the query and response texts concatenated without a separator, the `POSITIVE` logit,
//! batches of 16. Texts are encoded with the classifier's own tokenizer, with its special tokens
//! (`[CLS] … [SEP]` from the post-processor), right-padded.
//!
//! Deviation: a text longer than the model's `max_position_embeddings` is truncated (the
//! tokenizer's right truncation, which keeps the special tokens) with a warning, once; the
//! pipeline in TRL's example does not truncate and fails on such texts.
//!
//! Shape legend: B batch, T positions, L labels.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{RewardInput, RewardSource};
use crate::error::{ConfigError, Error, Result};
use crate::models::bert::{SequenceClassifier, SequenceClassifierConfig};
use crate::models::load::{locate, read_config_json};
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide, Tokenizer};
use crate::train::reward_model::RewardModel;

/// What a [`ClassifierReward`] returns for its label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClassifierOutput {
    /// The label's raw logit (TRL's `function_to_apply="none"`).
    #[default]
    Logit,
    /// The label's softmax probability over all labels, in `[0, 1]`.
    Probability,
}

/// Which text a [`ClassifierReward`] classifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoredText {
    /// `query + response`, concatenated without a separator (TRL's sentiment example).
    #[default]
    QueryAndResponse,
    /// The response alone.
    ResponseOnly,
}

/// Options of a [`ClassifierReward`]; as a TOML table every field is optional.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierRewardConfig {
    /// The label whose score is the reward: a name from `id2label` or a decimal index.
    /// Default `"POSITIVE"`.
    #[serde(default = "d_label")]
    pub label: String,
    /// Logit (default) or probability.
    #[serde(default)]
    pub output: ClassifierOutput,
    /// Query and response (default) or the response only.
    #[serde(default)]
    pub text: ScoredText,
    /// Texts per forward pass. Default 16.
    #[serde(default = "d_batch_size")]
    pub batch_size: usize,
}

fn d_label() -> String {
    "POSITIVE".into()
}
fn d_batch_size() -> usize {
    16
}

impl Default for ClassifierRewardConfig {
    fn default() -> Self {
        Self {
            label: d_label(),
            output: ClassifierOutput::default(),
            text: ScoredText::default(),
            batch_size: 16,
        }
    }
}

/// The classifier-score reward (see the module docs).
pub struct ClassifierReward {
    model: SequenceClassifier,
    /// The classifier's tokenizer, without padding, truncating to `max_positions`.
    tokenizer: tokenizers::Tokenizer,
    cfg: ClassifierRewardConfig,
    label_index: usize,
    max_positions: usize,
    device: Device,
    name: String,
    warned_truncation: bool,
}

impl ClassifierReward {
    /// Loads a frozen classifier and its `tokenizer.json` from a local directory or hub id. A
    /// directory holding a LoRA reward model (`rltune reward` with `[lora]`, or PEFT's `SEQ_CLS`
    /// adapter) is applied to its base (`base_model_name_or_path`) and merged.
    pub fn from_pretrained(
        model: &str,
        cfg: ClassifierRewardConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if RewardModel::is_adapter_dir(Path::new(model)) {
            let m = RewardModel::from_adapter(Path::new(model), None, dtype, device)?;
            let store = m.store.merged()?;
            let classifier = SequenceClassifier::load(&store.root(), &m.config)?;
            m.tokenizer.check_fits(m.config.vocab_size())?;
            return Self::new(classifier, &m.tokenizer, m.config.max_positions(), cfg, device);
        }
        let files = locate(model)?;
        let config_json = read_config_json(&files.config)?;
        let model_cfg = SequenceClassifierConfig::from_json(&config_json, &files.config)?;
        let (vocab_size, max_positions) = (model_cfg.vocab_size(), model_cfg.max_positions());
        let tokenizer_path = files.tokenizer.as_ref().ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.json; the classifier reward encodes text with the classifier's own \
                 tokenizer. Save it beside the model: `AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR)`",
                files.dir.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_file(tokenizer_path)?;
        tokenizer.check_fits(vocab_size)?;
        let store = ParamStore::load_safetensors(&files.weights, false, dtype, device)?;
        let classifier = SequenceClassifier::load(&store.root(), &model_cfg)?;
        Self::new(classifier, &tokenizer, max_positions, cfg, device)
    }

    /// Wraps a loaded classifier and its tokenizer; texts longer than `max_positions` tokens
    /// (the model's `max_position_embeddings`) are truncated. `device` is the model's device.
    ///
    /// Fails when the label is not one of the model's (the error lists them) or `batch_size` is 0.
    pub fn new(
        model: SequenceClassifier,
        tokenizer: &Tokenizer,
        max_positions: usize,
        cfg: ClassifierRewardConfig,
        device: &Device,
    ) -> Result<Self> {
        if cfg.batch_size == 0 {
            return Err(Error::Setting(ConfigError::new(
                "reward.sources",
                "batch_size",
                "must be at least 1 for a classifier reward",
            )));
        }
        let label_index = model.label_index(&cfg.label)?;
        let mut inner = tokenizer.inner().clone();
        let trunc = tokenizers::TruncationParams { max_length: max_positions, ..Default::default() };
        inner.with_truncation(Some(trunc)).map_err(|e| {
            Error::Tokenizer(format!("cannot truncate to the classifier's {max_positions} positions: {e}"))
        })?;
        let output = match cfg.output {
            ClassifierOutput::Logit => "logit",
            ClassifierOutput::Probability => "prob",
        };
        let text = match cfg.text {
            ScoredText::QueryAndResponse => "",
            ScoredText::ResponseOnly => ", response only",
        };
        let label = &model.id2label()[label_index];
        let name = format!("classifier({label} {output}{text})");
        Ok(Self {
            model,
            tokenizer: inner,
            cfg,
            label_index,
            max_positions,
            device: device.clone(),
            name,
            warned_truncation: false,
        })
    }

    /// The scored label: its index and name.
    pub fn label(&self) -> (usize, &str) {
        (self.label_index, &self.model.id2label()[self.label_index])
    }

    /// The text classified for `sample` (see [`ScoredText`]).
    pub fn text_of(&self, sample: &RewardInput<'_>) -> String {
        match self.cfg.text {
            ScoredText::QueryAndResponse => format!("{}{}", sample.query, sample.response),
            ScoredText::ResponseOnly => sample.response.to_string(),
        }
    }

    /// The classifier's token ids for `text`: special tokens added, truncated to the model's
    /// positions (warning once per reward).
    pub fn encode(&mut self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| Error::Tokenizer(format!("classifier reward: cannot encode {text:?}: {e}")))?;
        if !enc.get_overflowing().is_empty() && !self.warned_truncation {
            self.warned_truncation = true;
            tracing::warn!(
                "classifier reward: a text is longer than the classifier's {} positions and was truncated \
                 (warned once); the reward sees only its beginning",
                self.max_positions
            );
        }
        Ok(enc.get_ids().to_vec())
    }

    /// Logits `[sample][label]` for `batch`, in forward passes of at most `batch_size` texts.
    pub fn logits(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(batch.len());
        for (c, chunk) in batch.chunks(self.cfg.batch_size).enumerate() {
            let mut rows = Vec::with_capacity(chunk.len());
            for (j, sample) in chunk.iter().enumerate() {
                let ids = self.encode(&self.text_of(sample))?;
                if ids.is_empty() {
                    let i = c * self.cfg.batch_size + j;
                    return Err(Error::reward(
                        "classifier reward",
                        format!(
                            "sample {i} encodes to no tokens (empty text and a tokenizer without special \
                             tokens)"
                        ),
                    ));
                }
                rows.push(ids);
            }
            // The pad id does not matter: padded keys are masked out and [CLS] is at position 0.
            let (ids, mask) = pad(&rows, 0, PaddingSide::Right);
            let (b_sz, seq_len) = (ids.len(), ids[0].len());
            // (B, T)
            let input_ids = Tensor::from_vec(ids.concat(), (b_sz, seq_len), &self.device)?;
            // (B, L)
            let logits = self.model.forward(&input_ids, &mask)?.to_dtype(DType::F32)?;
            out.extend(logits.to_vec2::<f32>()?);
        }
        Ok(out)
    }
}

/// The score of label `index` from one sample's `logits (L)`: the logit, or its softmax
/// probability (computed in f64, max-subtracted).
pub fn label_score(logits: &[f32], index: usize, output: ClassifierOutput) -> f32 {
    match output {
        ClassifierOutput::Logit => logits[index],
        ClassifierOutput::Probability => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let denom: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
            ((logits[index] as f64 - max).exp() / denom) as f32
        }
    }
}

impl std::fmt::Debug for ClassifierReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClassifierReward")
            .field("name", &self.name)
            .field("cfg", &self.cfg)
            .field("max_positions", &self.max_positions)
            .finish_non_exhaustive()
    }
}

impl RewardSource for ClassifierReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        let logits = self.logits(batch)?;
        Ok(logits.iter().map(|l| label_score(l, self.label_index, self.cfg.output)).collect())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// `tools/fixtures/models/<name>`.
    fn fixture_dir(name: &str) -> std::path::PathBuf {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/fixtures/models")).join(name)
    }

    /// A word-level tokenizer with BERT's post-processor over ids below the fixture's vocab (101):
    /// `[PAD]`=0, `[UNK]`=1, `[CLS]`=2, `[SEP]`=3, then `WORDS` from 4.
    const WORDS: &[&str] = &["this", "movie", "was", "great", "terrible", "i", "loved", "it", "not", "."];

    fn tokenizer_json() -> String {
        let mut vocab = serde_json::json!({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3});
        for (i, w) in WORDS.iter().enumerate() {
            vocab[*w] = serde_json::json!(i + 4);
        }
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": {"type": "Lowercase"},
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]},
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        })
        .to_string()
    }

    /// The distilbert fixture copied into a temporary directory with the tokenizer above.
    fn model_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture_dir("distilbert").join(f), dir.path().join(f)).unwrap();
        }
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer_json()).unwrap();
        dir
    }

    fn reward(dir: &Path, cfg: ClassifierRewardConfig) -> ClassifierReward {
        ClassifierReward::from_pretrained(dir.to_str().unwrap(), cfg, DType::F32, &Device::Cpu).unwrap()
    }

    /// Logits of one id sequence by a direct forward of the fixture.
    fn direct_logits(ids: &[u32]) -> Vec<f32> {
        let dir = fixture_dir("distilbert");
        let model =
            SequenceClassifier::from_pretrained(dir.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap();
        let input = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
        model.forward(&input, &[vec![1; ids.len()]]).unwrap().to_vec2::<f32>().unwrap().remove(0)
    }

    fn samples() -> Vec<RewardInput<'static>> {
        vec![
            RewardInput::text("this movie was", " great ."),
            RewardInput::text("i", " loved it not"),
            RewardInput::text("this movie was", " terrible"),
        ]
    }

    #[test]
    fn classifier_reward_matches_direct_forward_logit_and_prob() {
        let dir = model_dir();
        let mut logit = reward(dir.path(), ClassifierRewardConfig::default());
        assert_eq!(logit.name(), "classifier(POSITIVE logit)");
        let cfg = ClassifierRewardConfig {
            output: ClassifierOutput::Probability,
            batch_size: 2,
            ..Default::default()
        };
        let mut prob = reward(dir.path(), cfg);
        let (logits, probs) = (logit.score(&samples()).unwrap(), prob.score(&samples()).unwrap());
        // "this movie was great ." -> [CLS] this movie was great . [SEP]
        let expected_ids: [&[u32]; 3] =
            [&[2, 4, 5, 6, 7, 13, 3], &[2, 9, 10, 11, 12, 3], &[2, 4, 5, 6, 8, 3]];
        let mut max_diff = 0f32;
        for (i, ids) in expected_ids.iter().enumerate() {
            assert_eq!(logit.encode(&logit.text_of(&samples()[i])).unwrap(), *ids);
            let direct = direct_logits(ids);
            let p = (direct[1] - direct[0]).exp();
            max_diff = max_diff.max((logits[i] - direct[1]).abs()).max((probs[i] - p / (1.0 + p)).abs());
        }
        println!("max diff vs direct forward: {max_diff:e}");
        assert!(max_diff < 1e-5, "{max_diff}");
        assert!(logits.windows(2).any(|w| w[0] != w[1]), "texts should score differently: {logits:?}");
    }

    #[test]
    fn classifier_reward_response_only_and_label_by_index() {
        let dir = model_dir();
        let cfg = ClassifierRewardConfig {
            text: ScoredText::ResponseOnly,
            label: "0".into(),
            ..Default::default()
        };
        let mut r = reward(dir.path(), cfg);
        assert_eq!(r.label(), (0, "NEGATIVE"));
        assert_eq!(r.name(), "classifier(NEGATIVE logit, response only)");
        let scores = r.score(&samples()).unwrap();
        assert!((scores[2] - direct_logits(&[2, 8, 3])[0]).abs() < 1e-5);
    }

    #[test]
    fn classifier_reward_truncates_long_texts_keeping_sep() {
        let dir = model_dir();
        let mut r = reward(dir.path(), ClassifierRewardConfig::default());
        let long = "great ".repeat(100);
        let ids = r.encode(&long).unwrap();
        assert_eq!(ids.len(), 64, "the fixture's max_position_embeddings");
        assert_eq!((ids[0], ids[62], ids[63]), (2, 7, 3));
        assert!(r.warned_truncation);
        let sample = [RewardInput::text("", &long), RewardInput::text("i", "")];
        let scores = r.score(&sample).unwrap();
        assert!((scores[0] - direct_logits(&ids)[1]).abs() < 1e-5);
        assert!((scores[1] - direct_logits(&[2, 9, 3])[1]).abs() < 1e-5, "padded row in the batch");
    }

    #[test]
    fn classifier_reward_errors_list_labels_and_missing_tokenizer() {
        let dir = model_dir();
        let cfg = ClassifierRewardConfig { label: "positive".into(), ..Default::default() };
        let err =
            ClassifierReward::from_pretrained(dir.path().to_str().unwrap(), cfg, DType::F32, &Device::Cpu);
        let err = err.err().unwrap().to_string();
        assert!(err.contains("\"positive\"") && err.contains("0=NEGATIVE, 1=POSITIVE"), "{err}");
        let cfg = ClassifierRewardConfig { batch_size: 0, ..Default::default() };
        let err =
            ClassifierReward::from_pretrained(dir.path().to_str().unwrap(), cfg, DType::F32, &Device::Cpu);
        assert!(err.err().unwrap().to_string().contains("batch_size"));
        let fixture = fixture_dir("distilbert");
        let err = ClassifierReward::from_pretrained(
            fixture.to_str().unwrap(),
            Default::default(),
            DType::F32,
            &Device::Cpu,
        );
        let err = err.err().unwrap().to_string();
        assert!(err.contains("no tokenizer.json") && err.contains("save_pretrained"), "{err}");
    }

    #[test]
    fn label_score_softmax_is_stable() {
        assert_eq!(label_score(&[1.0, 2.0], 1, ClassifierOutput::Logit), 2.0);
        let p = label_score(&[1000.0, 1000.0 + 2f32.ln()], 1, ClassifierOutput::Probability);
        // No overflow at large logits; the tolerance is f32 spacing near 1000.
        assert!((p - 2.0 / 3.0).abs() < 1e-4, "{p}");
        let toml: ClassifierRewardConfig =
            toml::from_str("output = \"probability\"\ntext = \"response_only\"").unwrap();
        assert_eq!(
            (toml.output, toml.text, toml.batch_size),
            (ClassifierOutput::Probability, ScoredText::ResponseOnly, 16)
        );
        assert!(toml::from_str::<ClassifierRewardConfig>("lable = \"x\"").is_err());
    }
}
