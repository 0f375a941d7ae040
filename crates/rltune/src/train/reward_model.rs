//! Reward-model training: a BERT or DistilBERT sequence classifier (TRL's `RewardTrainer`).
//!
//! Two modes, chosen by the data (see [`super::data`]):
//! - **labelled texts** (`{"text", "label"}`): cross-entropy over the classifier's labels; eval
//!   accuracy is the fraction classified correctly. A sentiment classifier such as
//!   `lvwerra/distilbert-imdb` is trained this way and used as PPO's reward via one logit.
//! - **preference pairs** (`{"chosen", "rejected"}`, optional `"prompt"` prepended verbatim): one
//!   output logit r (num_labels = 1) and the Bradley–Terry loss `−log σ(r_chosen − r_rejected)`
//!   (TRL `RewardTrainer.compute_loss`), optionally plus
//!   `center_rewards_coefficient · (r_chosen + r_rejected)²` (TRL's centering term, per pair).
//!   Eval accuracy is the fraction of pairs with `r_chosen > r_rejected` (ties count as wrong;
//!   TRL's argmax counts them as right).
//!
//! Texts are tokenized with the post-processor's special tokens (`[CLS] … [SEP]`) and truncated
//! by the tokenizer to `max_length` (keeping `[SEP]`). Batches are right-padded.
//!
//! [`RewardModel::from_pretrained`] starts from any BERT/DistilBERT checkpoint: a plain encoder
//! gets a new head, and a head of the wrong size (e.g. two labels when preference training needs
//! one) is re-initialized, as transformers does with `num_labels` and `ignore_mismatched_sizes=True`.
//! The names of the new tensors are logged and kept in [`RewardModel::initialized`].

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use serde::{Deserialize, Serialize};

use super::data::{Label, RewardRecord};
use super::runner::{
    self, BatchLoss, Checkpointing, EvalResult, Objective, TrainProgress, TrainSummary, TrainingArgs,
};
use crate::data::chat;
use crate::dist::Dist;
use crate::error::{ConfigError, Error, Result};
use crate::models::bert::{SequenceClassifier, SequenceClassifierConfig};
use crate::models::chat_template::{ChatTemplate, RenderOptions};
use crate::models::load::{locate, read_config_json, save_dir_atomic, save_pretrained, LoraSpec};
use crate::models::lora::LoraConfig;

/// The classifier's `config.json` inside a LoRA reward-model directory (its labels; PEFT keeps
/// no model config beside an adapter, and a `config.json` would make the directory look like a
/// full model).
pub const CLASSIFIER_CONFIG: &str = "classifier_config.json";
use crate::ops;
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide, Tokenizer};

/// Reward-model data settings (the `[reward]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// Longest text in tokens, special tokens included (default 512, BERT's limit).
    pub max_length: usize,
    /// Weight of TRL's reward-centering term `(r_chosen + r_rejected)²` (preference pairs only;
    /// default 0, off; TRL suggests 0.01).
    pub center_rewards_coefficient: f64,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self { max_length: 512, center_rewards_coefficient: 0.0 }
    }
}

impl RewardConfig {
    /// Checks every field; the message names the field.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.max_length < 2 {
            return Err(ConfigError::new(
                "reward",
                "max_length",
                format!("must be at least 2, got {}", self.max_length),
            ));
        }
        let c = self.center_rewards_coefficient;
        if !(c.is_finite() && c >= 0.0) {
            return Err(ConfigError::new(
                "reward",
                "center_rewards_coefficient",
                format!("must be ≥ 0, got {c}"),
            ));
        }
        Ok(())
    }
}

/// A sequence classifier being trained: parameters, model, config.json and tokenizer.
#[derive(Debug, Clone)]
pub struct RewardModel {
    /// Trainable parameters.
    pub store: ParamStore,
    /// The model.
    pub model: SequenceClassifier,
    /// Its parsed config.
    pub config: SequenceClassifierConfig,
    /// config.json to save (with the labels in use).
    pub config_json: serde_json::Value,
    /// The tokenizer (saved as tokenizer.json).
    pub tokenizer: Tokenizer,
    /// Tensors initialized rather than loaded (a new or resized head).
    pub initialized: Vec<String>,
    /// The model's chat template (its tokenizer_config.json), for conversational pairs.
    pub chat_template: Option<std::sync::Arc<ChatTemplate>>,
}

/// Class names by index of a classifier config.
fn config_labels(cfg: &SequenceClassifierConfig) -> std::result::Result<Vec<String>, ConfigError> {
    match cfg {
        SequenceClassifierConfig::Bert(c) => c.labels(),
        SequenceClassifierConfig::DistilBert(c) => c.labels(),
    }
}

/// `config_json` with `id2label`/`label2id` set to `labels` (and `num_labels` removed).
pub fn with_labels(mut config_json: serde_json::Value, labels: &[String]) -> Result<serde_json::Value> {
    let obj =
        config_json.as_object_mut().ok_or_else(|| Error::config("config.json", "must be a JSON object"))?;
    let id2label: serde_json::Map<String, serde_json::Value> =
        labels.iter().enumerate().map(|(i, l)| (i.to_string(), l.clone().into())).collect();
    let label2id: serde_json::Map<String, serde_json::Value> =
        labels.iter().enumerate().map(|(i, l)| (l.clone(), i.into())).collect();
    obj.insert("id2label".into(), id2label.into());
    obj.insert("label2id".into(), label2id.into());
    obj.remove("num_labels");
    Ok(config_json)
}

/// The labels a model needs for `records`, or `None` when `current` already fits them.
///
/// Preference pairs need exactly one output (`["LABEL_0"]`). Labelled texts need at least two
/// classes covering every label in the data; when `current` does not, the data's class names
/// (sorted), or `LABEL_0..LABEL_k` for index labels.
pub fn labels_for(records: &[RewardRecord], current: &[String]) -> Option<Vec<String>> {
    if records.first().is_some_and(RewardRecord::is_preference) {
        return (current.len() != 1).then(|| vec!["LABEL_0".to_string()]);
    }
    let labels: BTreeSet<&Label> = records
        .iter()
        .filter_map(|r| match r {
            RewardRecord::Labelled { label, .. } => Some(label),
            RewardRecord::Preference { .. } | RewardRecord::ChatPreference { .. } => None,
        })
        .collect();
    let fits = |l: &&Label| match l {
        Label::Index(i) => *i < current.len(),
        Label::Name(n) => current.contains(n),
    };
    if current.len() >= 2 && labels.iter().all(fits) {
        return None;
    }
    let names: Vec<String> = labels
        .iter()
        .filter_map(|l| match l {
            Label::Name(n) => Some(n.clone()),
            Label::Index(_) => None,
        })
        .collect();
    if !names.is_empty() {
        return Some(names);
    }
    let max = labels.iter().filter_map(|l| if let Label::Index(i) = l { Some(*i) } else { None }).max();
    Some((0..(max.unwrap_or(0) + 1).max(2)).map(|i| format!("LABEL_{i}")).collect())
}

impl RewardModel {
    /// Builds the classifier over `store` (trainable; a random store initializes every tensor)
    /// from a config.json value.
    pub fn new(store: ParamStore, config_json: serde_json::Value, tokenizer: Tokenizer) -> Result<Self> {
        let config = SequenceClassifierConfig::from_json(&config_json, Path::new("config.json"))?;
        let model = SequenceClassifier::load(&store.root(), &config)?;
        let initialized = store.initialized();
        Ok(Self { store, model, config, config_json, tokenizer, initialized, chat_template: None })
    }

    /// Loads a BERT/DistilBERT directory or hub id with trainable weights, with the classes
    /// `labels` (`None`: those of its config.json). Tensors the classifier needs that the
    /// checkpoint lacks, or holds with another shape, are initialized from `seed`; tensors it
    /// does not need (e.g. a masked-LM head) are dropped. The directory must have tokenizer.json.
    pub fn from_pretrained(
        model: &str,
        labels: Option<&[String]>,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_pretrained_adapted(model, labels, seed, None, dtype, device)
    }

    /// [`Self::from_pretrained`], with LoRA adapters when `lora` is given, as PEFT's
    /// `get_peft_model` with `task_type = "SEQ_CLS"` makes them: the encoder is frozen, the
    /// adapters train, and the classifier head trains in full (`modules_to_save` gains
    /// `classifier` and `score`). [`Self::save`] then writes the adapter.
    pub fn from_pretrained_adapted(
        model: &str,
        labels: Option<&[String]>,
        seed: u64,
        lora: Option<&LoraSpec>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let files = locate(model)?;
        let mut config_json = read_config_json(&files.config)?;
        if let Some(labels) = labels {
            config_json = with_labels(config_json, labels)?;
        }
        let config = SequenceClassifierConfig::from_json(&config_json, &files.config)?;
        let tok_path = files.tokenizer.clone().ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.json; the reward model tokenizes text",
                files.dir.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        let mut checkpoint = HashMap::new();
        for f in &files.weights {
            let ts = candle_core::safetensors::load(f, &Device::Cpu)
                .map_err(|e| Error::weights(f, format!("cannot read safetensors: {e}")))?;
            checkpoint.extend(ts);
        }
        let (tensors, initialized) = complete_checkpoint(checkpoint, &config, seed, dtype, device)?;
        if !initialized.is_empty() {
            tracing::warn!(
                "{}: newly initialized (train before use): {}",
                files.dir.display(),
                initialized.join(", ")
            );
        }
        let store = ParamStore::from_tensors(tensors, lora.is_none(), dtype, device, &files.dir)?;
        let store = match lora {
            Some(spec) => {
                let spec = LoraSpec {
                    config: spec.config.as_ref().map(LoraConfig::for_sequence_classification),
                    ..spec.clone()
                };
                let s = spec.apply_to(&store, config.model_type())?;
                s.set_lora_base(model);
                s.set_lora_task_type("SEQ_CLS");
                s
            }
            None => store,
        };
        let model = SequenceClassifier::load(&store.root(), &config)?;
        let chat_template = ChatTemplate::for_model_dir(&files.dir)?.map(std::sync::Arc::new);
        Ok(Self { store, model, config, config_json, tokenizer, initialized, chat_template })
    }

    /// Like [`RewardModel::from_pretrained`], with the labels `records` need (see [`labels_for`]).
    pub fn from_pretrained_for(
        model: &str,
        records: &[RewardRecord],
        seed: u64,
        lora: Option<&LoraSpec>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let files = locate(model)?;
        let config = SequenceClassifierConfig::from_json(&read_config_json(&files.config)?, &files.config)?;
        let current = config_labels(&config).map_err(|m| Error::config(&files.config, m))?;
        let labels = labels_for(records, &current);
        Self::from_pretrained_adapted(model, labels.as_deref(), seed, lora, dtype, device)
    }

    /// The longest input the model accepts.
    pub fn max_positions(&self) -> usize {
        self.config.max_positions()
    }

    fn pad_id(&self) -> u32 {
        match &self.config {
            SequenceClassifierConfig::Bert(c) => c.pad_token_id,
            SequenceClassifierConfig::DistilBert(c) => c.pad_token_id,
        }
        .unwrap_or(0)
    }

    /// Saves a Hugging Face directory (config.json, model.safetensors, tokenizer.json) that
    /// [`SequenceClassifier::from_pretrained`] and transformers'
    /// `AutoModelForSequenceClassification` load.
    ///
    /// With LoRA: the adapter as PEFT saves it (`adapter_config.json` with `task_type =
    /// "SEQ_CLS"`, `adapter_model.safetensors` with the head in it) and tokenizer.json, plus
    /// the classifier's `config.json` under [`CLASSIFIER_CONFIG`] (its labels), so that
    /// [`Self::from_adapter`] and `rltune merge` rebuild it on the base.
    pub fn save(&self, dir: &Path) -> Result<()> {
        if self.store.has_lora() {
            return save_dir_atomic(dir, |tmp| -> crate::models::Result<()> {
                self.store.save_adapter(tmp, None)?;
                let text = serde_json::to_string_pretty(&self.config_json).map_err(|e| {
                    crate::models::Error::Internal(format!("cannot serialize config.json: {e}"))
                })?;
                crate::models::io::write_bytes_atomic(&tmp.join(CLASSIFIER_CONFIG), text.as_bytes())?;
                self.tokenizer.save(&tmp.join("tokenizer.json"))
            })
            .map_err(Into::into);
        }
        save_pretrained(dir, &self.store, &self.config_json)?;
        Ok(self.tokenizer.save(&dir.join("tokenizer.json"))?)
    }

    /// A reward model saved with LoRA ([`Self::save`]): its base (`base_model_name_or_path`, or
    /// `base` when given) with the adapter applied, the labels of its [`CLASSIFIER_CONFIG`], and
    /// its tokenizer.json (else the base's). Trainable, so training can go on from it.
    pub fn from_adapter(dir: &Path, base: Option<&str>, dtype: DType, device: &Device) -> Result<Self> {
        let cfg_path = dir.join(crate::models::lora::ADAPTER_CONFIG);
        let value: serde_json::Value = crate::models::io::read_json(&cfg_path)?;
        let (_, meta) = LoraConfig::from_adapter_json(&value, &cfg_path)?;
        let base = match (base, meta.base_model.as_deref()) {
            (Some(b), _) | (None, Some(b)) => b.to_string(),
            (None, None) => {
                return Err(Error::config(
                    &cfg_path,
                    "no base_model_name_or_path: the adapter does not say which model it was trained                      on; pass the base model (e.g. `rltune merge --model BASE --adapter DIR`)",
                ))
            }
        };
        let labels = match dir.join(CLASSIFIER_CONFIG) {
            p if p.is_file() => {
                let cfg = SequenceClassifierConfig::from_json(&read_config_json(&p)?, &p)?;
                Some(config_labels(&cfg).map_err(|m| Error::config(&p, m))?)
            }
            _ => None,
        };
        let spec = LoraSpec::from_dir(dir);
        let mut model =
            Self::from_pretrained_adapted(&base, labels.as_deref(), 0, Some(&spec), dtype, device)
                .map_err(|e| Error::checkpoint(dir, format!("cannot apply the adapter to {base}: {e}")))?;
        let tok = dir.join("tokenizer.json");
        if tok.is_file() {
            model.tokenizer = Tokenizer::from_file(&tok)?;
        }
        Ok(model)
    }

    /// Whether `dir` holds a LoRA adapter rather than a full model.
    pub fn is_adapter_dir(dir: &Path) -> bool {
        dir.join(crate::models::lora::ADAPTER_CONFIG).is_file()
    }
}

/// The checkpoint's tensors completed for a `…ForSequenceClassification` model
/// ([`crate::models::load::complete_checkpoint`]).
fn complete_checkpoint(
    checkpoint: HashMap<String, Tensor>,
    config: &SequenceClassifierConfig,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, Vec<String>)> {
    let prefix = match config {
        SequenceClassifierConfig::Bert(_) => "bert.",
        SequenceClassifierConfig::DistilBert(_) => "distilbert.",
    };
    Ok(crate::models::load::complete_checkpoint(checkpoint, prefix, seed, dtype, device, |p| {
        SequenceClassifier::load(p, config).map(|_| ())
    })?)
}

/// A tokenized labelled text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifiedExample {
    /// Token ids with special tokens.
    pub input_ids: Vec<u32>,
    /// Class index.
    pub label: usize,
}

/// A tokenized preference pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceExample {
    /// Token ids of prompt + chosen, with special tokens.
    pub chosen: Vec<u32>,
    /// Token ids of prompt + rejected, with special tokens.
    pub rejected: Vec<u32>,
}

/// Tokenized reward-model data, of one kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewardExamples {
    /// Labelled texts.
    Labelled(Vec<ClassifiedExample>),
    /// Preference pairs.
    Preference(Vec<PreferenceExample>),
}

/// Tokenizes `records` for `model`: labels resolved against its `id2label`, texts truncated to
/// `max_length` by the tokenizer (special tokens kept).
pub fn tokenize_reward(
    model: &RewardModel,
    records: &[RewardRecord],
    cfg: &RewardConfig,
) -> Result<RewardExamples> {
    cfg.validate()?;
    if cfg.max_length > model.max_positions() {
        return Err(Error::Setting(ConfigError::new(
            "reward",
            "max_length",
            format!(
                "({}) exceeds the model's max_position_embeddings ({}); lower it",
                cfg.max_length,
                model.max_positions()
            ),
        )));
    }
    let mut inner = model.tokenizer.inner().clone();
    let trunc = tokenizers::TruncationParams { max_length: cfg.max_length, ..Default::default() };
    inner.with_truncation(Some(trunc)).map_err(|e| Error::Tokenizer(format!("cannot truncate: {e}")))?;
    let tok = Tokenizer::from_inner(inner);
    let encode = |t: &str| tok.encode_with(t, true);
    let first_pref = records.first().is_some_and(RewardRecord::is_preference);
    if first_pref {
        if model.model.num_labels() != 1 {
            return Err(Error::argument(
                "model",
                format!(
                    "preference pairs train a single reward logit, but the model has {} labels; load it \
                     with one label (RewardModel::from_pretrained_for does)",
                    model.model.num_labels()
                ),
            ));
        }
        let pairs = records.iter().enumerate().map(|(i, r)| match r {
            RewardRecord::Preference { prompt, chosen, rejected } => {
                let p = prompt.as_deref().unwrap_or("");
                Ok(PreferenceExample {
                    chosen: encode(&format!("{p}{chosen}"))?,
                    rejected: encode(&format!("{p}{rejected}"))?,
                })
            }
            RewardRecord::ChatPreference { chosen, rejected } => {
                // TRL's reward `tokenize_fn`: each whole conversation through the chat template,
                // no special tokens added; cut to max_length like the text pairs.
                let template = model
                    .chat_template
                    .as_deref()
                    .ok_or_else(|| chat::no_template(&format!("example {i}")))?;
                tokenize_chat_pair(&model.tokenizer, template, chosen, rejected, cfg.max_length)
            }
            RewardRecord::Labelled { .. } => Err(mixed(i)),
        });
        return Ok(RewardExamples::Preference(pairs.collect::<Result<_>>()?));
    }
    if model.model.num_labels() < 2 {
        return Err(Error::argument(
            "model",
            "labelled texts need a classifier with at least 2 labels; set id2label (RewardModel::from_pretrained_for does)",
        ));
    }
    let texts = records.iter().enumerate().map(|(i, r)| match r {
        RewardRecord::Labelled { text, label } => Ok(ClassifiedExample {
            input_ids: encode(text)?,
            label: model
                .model
                .label_index(&label.to_string())
                .map_err(|e| Error::data(format!("example {i}"), e))?,
        }),
        RewardRecord::Preference { .. } | RewardRecord::ChatPreference { .. } => Err(mixed(i)),
    });
    Ok(RewardExamples::Labelled(texts.collect::<Result<_>>()?))
}

/// A conversational preference pair as TRL 1.16.0's `RewardTrainer` tokenizes it: each whole
/// conversation rendered with the chat template (no generation prompt) and tokenized without
/// adding special tokens; then cut to `max_length` as the text pairs are.
pub fn tokenize_chat_pair(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    chosen: &serde_json::Value,
    rejected: &serde_json::Value,
    max_length: usize,
) -> Result<PreferenceExample> {
    let enc = |m: &serde_json::Value| -> Result<Vec<u32>> {
        let mut ids = chat::encode_chat(tokenizer, template, m, RenderOptions::default(), false)?.ids;
        ids.truncate(max_length);
        Ok(ids)
    };
    Ok(PreferenceExample { chosen: enc(chosen)?, rejected: enc(rejected)? })
}

fn mixed(i: usize) -> Error {
    Error::data(format!("example {i}"), "labelled texts and preference pairs are mixed; use one kind")
}

/// Forward passes of a classifier on right-padded rows.
struct Scorer<'a> {
    model: &'a SequenceClassifier,
    pad_id: u32,
    device: Device,
}

impl<'a> Scorer<'a> {
    fn new(m: &'a RewardModel) -> Self {
        Self { model: &m.model, pad_id: m.pad_id(), device: m.store.device().clone() }
    }

    /// Logits `(B, L)` of `rows`.
    fn logits(&self, rows: &[&[u32]]) -> Result<Tensor> {
        let rows: Vec<Vec<u32>> = rows.iter().map(|r| r.to_vec()).collect();
        let (ids, mask) = pad(&rows, self.pad_id, PaddingSide::Right);
        Ok(self.model.forward(&Tensor::new(ids, &self.device)?, &mask)?)
    }
}

/// Cross-entropy on labelled texts.
struct CrossEntropy<'a>(Scorer<'a>);

impl Objective for CrossEntropy<'_> {
    type Example = ClassifiedExample;
    const PERPLEXITY: bool = false;

    fn terms(&self, _: &ClassifiedExample) -> usize {
        1
    }

    fn batch_loss(&self, batch: &[&ClassifiedExample], count_correct: bool) -> Result<BatchLoss> {
        let rows: Vec<&[u32]> = batch.iter().map(|e| e.input_ids.as_slice()).collect();
        // (B, L)
        let logits = self.0.logits(&rows)?;
        let labels: Vec<u32> = batch.iter().map(|e| e.label as u32).collect();
        let labels = Tensor::new(labels, &self.0.device)?;
        let loss_sum = ops::logprobs_of(&logits, &labels)?.sum_all()?.neg()?;
        let correct = if count_correct {
            let pred = logits.detach().argmax(D::Minus1)?.to_vec1::<u32>()?;
            pred.iter().zip(batch).filter(|(p, e)| **p as usize == e.label).count()
        } else {
            0
        };
        Ok(BatchLoss { loss_sum, correct })
    }
}

/// The Bradley–Terry loss on preference pairs, with TRL's optional centering term.
struct BradleyTerry<'a> {
    scorer: Scorer<'a>,
    center: f64,
}

impl Objective for BradleyTerry<'_> {
    type Example = PreferenceExample;
    const PERPLEXITY: bool = false;

    fn terms(&self, _: &PreferenceExample) -> usize {
        1
    }

    fn batch_loss(&self, batch: &[&PreferenceExample], count_correct: bool) -> Result<BatchLoss> {
        let b_sz = batch.len();
        // Chosen rows, then rejected rows, in one forward: r (2B)
        let rows: Vec<&[u32]> = batch
            .iter()
            .map(|e| e.chosen.as_slice())
            .chain(batch.iter().map(|e| e.rejected.as_slice()))
            .collect();
        let r = self.scorer.logits(&rows)?.squeeze(1)?;
        let (r_c, r_r) = (r.narrow(0, 0, b_sz)?, r.narrow(0, b_sz, b_sz)?);
        // TRL: -nn.functional.logsigmoid(rewards_chosen - rewards_rejected) = softplus(−d)
        let d = (&r_c - &r_r)?;
        let mut loss_sum = softplus(&d.neg()?)?.sum_all()?;
        if self.center > 0.0 {
            // TRL: center_rewards_coefficient * mean((rewards_chosen + rewards_rejected) ** 2)
            loss_sum = (loss_sum + ((&r_c + &r_r)?.sqr()?.sum_all()? * self.center)?)?;
        }
        let correct = if count_correct {
            let d = d.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?;
            d.iter().filter(|&&x| x > 0.0).count()
        } else {
            0
        };
        Ok(BatchLoss { loss_sum, correct })
    }
}

/// `log(1 + eˣ)`, stable for large |x|: `relu(x) + log(1 + e^{−|x|})`.
fn softplus(x: &Tensor) -> Result<Tensor> {
    Ok((x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?)?)
}

/// Trains `model` on `records` (labelled texts or preference pairs); `progress` is called after
/// every optimizer step.
pub fn train_reward_model(
    model: &RewardModel,
    records: &[RewardRecord],
    cfg: &RewardConfig,
    args: &TrainingArgs,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    train_reward_model_with(model, records, cfg, args, &Dist::default(), None, progress)
}

/// [`train_reward_model`] on `dist`'s processes (a data-parallel run: each a share of every
/// step; one process: [`Dist::default`]), with checkpoints, `--resume` and a stop flag
/// ([`Checkpointing`]).
pub fn train_reward_model_with(
    model: &RewardModel,
    records: &[RewardRecord],
    cfg: &RewardConfig,
    args: &TrainingArgs,
    dist: &Dist,
    checkpoints: Option<Checkpointing>,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    if records.is_empty() {
        return Err(Error::argument("records", "no reward-model examples to train on"));
    }
    let scorer = Scorer::new(model);
    match tokenize_reward(model, records, cfg)? {
        RewardExamples::Labelled(ex) => runner::run_with(
            &CrossEntropy(scorer),
            &model.store,
            &ex,
            args,
            dist,
            progress,
            true,
            checkpoints,
        ),
        RewardExamples::Preference(ex) => {
            let obj = BradleyTerry { scorer, center: cfg.center_rewards_coefficient };
            runner::run_with(&obj, &model.store, &ex, args, dist, progress, true, checkpoints)
        }
    }
}

/// Loss and accuracy of `model` on `records` (all of them; no split).
pub fn evaluate_reward_model(
    model: &RewardModel,
    records: &[RewardRecord],
    cfg: &RewardConfig,
    batch_size: usize,
) -> Result<EvalResult> {
    let scorer = Scorer::new(model);
    match tokenize_reward(model, records, cfg)? {
        RewardExamples::Labelled(ex) => {
            runner::evaluate(&CrossEntropy(scorer), &ex.iter().collect::<Vec<_>>(), batch_size)
        }
        RewardExamples::Preference(ex) => {
            let obj = BradleyTerry { scorer, center: cfg.center_rewards_coefficient };
            runner::evaluate(&obj, &ex.iter().collect::<Vec<_>>(), batch_size)
        }
    }
}
