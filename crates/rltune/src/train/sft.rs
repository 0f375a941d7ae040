//! Supervised fine-tuning (behavioural cloning) of a causal LM: TRL's `SFTTrainer`.
//!
//! Each example is tokenized without special tokens, gets the model's EOS appended and is
//! truncated to `max_length`. A prompt/completion pair is tokenized as two pieces and
//! concatenated (so the boundary is exact); with `completion_only_loss` the prompt's tokens are
//! context only.
//!
//! Conversational examples follow TRL 1.16.0's `SFTTrainer._prepare_dataset`: `messages` are
//! rendered with the model's chat template and tokenized (no EOS added: the template ends the
//! turn); a conversational prompt/completion renders the prompt with the generation prompt and
//! `prompt + completion` without, and the completion starts where their ids diverge
//! (`common_prefix_length`). With `assistant_only_loss` the targets are the tokens that overlap
//! the template's `{% generation %}` blocks (transformers' `return_assistant_tokens_mask`); with
//! `completion_only_loss` (prompt/completion rows) the completion's tokens; with both, the tokens
//! in both (TRL's `build_labels`: a label is kept when every applicable mask is 1). The loss is the mean next-token negative log-likelihood over every target token
//! of an optimizer step (TRL ≥ 0.20 with transformers' `num_items_in_batch`).
//!
//! Batches are right-padded; position ids come from the attention mask and the causal bias hides
//! padding, so a padded example gives the same loss as the example alone.
//!
//! ```no_run
//! # fn main() -> rltune::Result<()> {
//! use rltune::runtime::{Runtime, RuntimeSection};
//! use rltune::train::{data::read_sft_records, sft, TrainingArgs};
//!
//! let rt = Runtime::resolve(&RuntimeSection::default())?; // CUDA when present, else the CPU
//! let model = sft::SftModel::from_pretrained("gpt2", rt.dtype(), rt.device())?;
//! let records = read_sft_records("train.jsonl".as_ref())?;
//! let summary = sft::train_sft(&model, &records, &sft::SftConfig::default(),
//!     &TrainingArgs::default(), &mut |p| println!("step {}/{} loss {:.3}", p.step, p.total_steps, p.loss))?;
//! model.save("out/sft".as_ref())?;
//! println!("final eval loss: {:?}", summary.eval.map(|e| e.loss));
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};
use serde::{Deserialize, Serialize};

use super::data::SftRecord;
use super::runner::{
    self, BatchLoss, Checkpointing, EvalResult, Objective, TrainProgress, TrainSummary, TrainingArgs,
};
use crate::data::chat;
use crate::dist::Dist;
use crate::error::{ConfigError, Error, Result};
use crate::models::chat_template::{ChatTemplate, RenderOptions};
use crate::models::layers::{causal_bias, position_ids_from_mask};
use crate::models::load::{locate, read_config_json, save_dir_atomic, save_pretrained, LoraSpec};
use crate::models::{CausalLm, CausalLmConfig};
use crate::ops;
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide, Tokenizer};

/// SFT data settings (the `[sft]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Longest example in tokens, EOS included; longer ones are cut at the end (TRL: 1024).
    pub max_length: usize,
    /// For prompt/completion data, train only on the completion (TRL's default for such data).
    pub completion_only_loss: bool,
    /// Append the model's EOS token to every non-conversational example, so the model learns to
    /// stop (TRL does; a conversation's end of turn comes from the chat template).
    pub add_eos: bool,
    /// For conversations, train only on the assistant's turns: the tokens inside the chat
    /// template's `{% generation %}` blocks (TRL's `assistant_only_loss`, default false).
    pub assistant_only_loss: bool,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self { max_length: 1024, completion_only_loss: true, add_eos: true, assistant_only_loss: false }
    }
}

impl SftConfig {
    /// Checks every field; the message names the field.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.max_length < 2 {
            return Err(ConfigError::new(
                "sft",
                "max_length",
                format!("must be at least 2 (a context token and a target), got {}", self.max_length),
            ));
        }
        Ok(())
    }
}

/// One tokenized example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    /// Token ids `(T)`.
    pub input_ids: Vec<u32>,
    /// `(T)`: 1 where token t is a target (predicted from tokens `< t`); `loss_mask[0]` is 0.
    pub loss_mask: Vec<u8>,
}

impl SftExample {
    /// Number of target tokens.
    pub fn targets(&self) -> usize {
        self.loss_mask.iter().skip(1).map(|&m| m as usize).sum()
    }
}

/// Tokenizes records; returns the examples and how many were dropped because truncation left
/// them without a target token (e.g. a prompt longer than `max_length`).
pub fn tokenize_sft(
    records: &[SftRecord],
    tokenizer: &Tokenizer,
    eos_id: Option<u32>,
    cfg: &SftConfig,
) -> Result<(Vec<SftExample>, usize)> {
    tokenize_sft_with(records, tokenizer, None, eos_id, cfg)
}

/// [`tokenize_sft`] with the model's chat template, which conversational records need.
pub fn tokenize_sft_with(
    records: &[SftRecord],
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    eos_id: Option<u32>,
    cfg: &SftConfig,
) -> Result<(Vec<SftExample>, usize)> {
    cfg.validate()?;
    check_assistant_only_loss(records, template, cfg)?;
    let eos = match (cfg.add_eos, eos_id) {
        (true, None) => {
            return Err(Error::Setting(ConfigError::new(
                "sft",
                "add_eos",
                "is true but the model's config.json has no eos_token_id; add it there or set \
                 sft.add_eos = false",
            )))
        }
        (true, Some(e)) => Some(e),
        (false, _) => None,
    };
    let (mut out, mut dropped) = (Vec::with_capacity(records.len()), 0);
    for (i, rec) in records.iter().enumerate() {
        let (mut ids, mut mask) = match rec {
            SftRecord::Text(t) => {
                let ids = tokenizer.encode(t)?;
                let n = ids.len();
                (ids, vec![1u8; n])
            }
            SftRecord::PromptCompletion { prompt, completion } => {
                let (p, c) = (tokenizer.encode(prompt)?, tokenizer.encode(completion)?);
                let m = u8::from(!cfg.completion_only_loss);
                let mask = [vec![m; p.len()], vec![1u8; c.len()]].concat();
                ([p, c].concat(), mask)
            }
            SftRecord::Messages(_) | SftRecord::ChatPromptCompletion { .. } => {
                let template =
                    template.ok_or_else(|| chat::no_template(&format!("SFT example {}", i + 1)))?;
                tokenize_chat(rec, tokenizer, template, cfg)
                    .map_err(|e| Error::data(format!("SFT example {}", i + 1), e))?
            }
        };
        if let (Some(e), false) = (eos, rec.is_conversational()) {
            ids.push(e);
            mask.push(1);
        }
        ids.truncate(cfg.max_length);
        mask.truncate(cfg.max_length);
        if let Some(m) = mask.first_mut() {
            *m = 0;
        }
        let ex = SftExample { input_ids: ids, loss_mask: mask };
        if ex.targets() == 0 {
            tracing::debug!("example {i}: no target token within sft.max_length; dropped");
            dropped += 1;
        } else {
            out.push(ex);
        }
    }
    if dropped > 0 {
        tracing::warn!(
            "{dropped} of {} examples have no target token within sft.max_length; dropped",
            records.len()
        );
    }
    Ok((out, dropped))
}

/// TRL's checks before tokenizing with `assistant_only_loss`: the data must be conversational,
/// and the template must mark the assistant's text with `{% generation %}`.
fn check_assistant_only_loss(
    records: &[SftRecord],
    template: Option<&ChatTemplate>,
    cfg: &SftConfig,
) -> Result<()> {
    if !cfg.assistant_only_loss {
        return Ok(());
    }
    if let Some(i) = records.iter().position(|r| !r.is_conversational()) {
        return Err(Error::Setting(ConfigError::new(
            "sft",
            "assistant_only_loss",
            format!(
                "is true, but SFT example {} is not conversational; it applies to `messages` (or \
                 conversational prompt/completion) rows only: set it to false",
                i + 1
            ),
        )));
    }
    if let Some(t) = template.filter(|t| !t.has_generation_markers()) {
        return Err(Error::Setting(ConfigError::new(
            "sft",
            "assistant_only_loss",
            format!(
                "is true, but the chat template ({t:?}) has no `{{% generation %}}` markers, so the \
                 assistant's tokens cannot be told apart. Wrap each assistant message's text (and its \
                 end-of-turn token) in `{{% generation %}}…{{% endgeneration %}}` in \
                 tokenizer_config.json's chat_template (TRL 1.16 swaps in its own training template for \
                 some known models), or set sft.assistant_only_loss = false"
            ),
        )));
    }
    Ok(())
}

/// A conversational record's ids and loss mask (see the module docs).
fn tokenize_chat(
    rec: &SftRecord,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    cfg: &SftConfig,
) -> Result<(Vec<u32>, Vec<u8>)> {
    let aol = cfg.assistant_only_loss;
    let (ids, mut mask, assistant) = match rec {
        SftRecord::Messages(m) => {
            let out = chat::encode_chat(tokenizer, template, m, RenderOptions::default(), aol)?;
            let n = out.ids.len();
            (out.ids, vec![1u8; n], out.assistant_mask)
        }
        SftRecord::ChatPromptCompletion { prompt, completion } => {
            let gen = RenderOptions { add_generation_prompt: true, continue_final_message: false };
            let p = chat::encode_chat(tokenizer, template, prompt, gen, false)?.ids;
            let whole: Vec<serde_json::Value> =
                prompt.as_array().into_iter().chain(completion.as_array()).flatten().cloned().collect();
            let pc = chat::encode_chat(
                tokenizer,
                template,
                &serde_json::Value::Array(whole),
                RenderOptions::default(),
                aol,
            )?;
            let n = chat::common_prefix_length(&p, &pc.ids);
            if n < p.len() {
                tracing::debug!("the tokenized prompt is not a prefix of prompt + completion; the completion starts at token {n}");
            }
            let m = u8::from(!cfg.completion_only_loss);
            let mask = [vec![m; n], vec![1u8; pc.ids.len() - n]].concat();
            (pc.ids, mask, pc.assistant_mask)
        }
        _ => {
            return Err(Error::Internal("tokenize_chat was given a record that is not conversational".into()))
        }
    };
    if let Some(a) = assistant {
        if !a.contains(&1) {
            return Err(Error::Setting(ConfigError::new(
                "sft",
                "assistant_only_loss",
                "is true, but the rendered conversation has no assistant token (no `{% generation %}` \
                 block rendered any text); check the template and the roles",
            )));
        }
        for (m, a) in mask.iter_mut().zip(a) {
            *m &= a;
        }
    }
    Ok((ids, mask))
}

/// A causal LM being fine-tuned: trainable parameters, the model over them, the config.json to
/// save and the tokenizer.
#[derive(Debug, Clone)]
pub struct SftModel {
    /// Trainable parameters.
    pub store: ParamStore,
    /// The model.
    pub lm: CausalLm,
    /// config.json as loaded (saved back unchanged).
    pub config_json: serde_json::Value,
    /// The tokenizer (saved as tokenizer.json).
    pub tokenizer: Tokenizer,
    /// generation_config.json of the source model, copied when saving.
    pub generation_config: Option<PathBuf>,
    /// The source model's chat template (its tokenizer_config.json), for conversational data.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// tokenizer_config.json of the source model, copied when saving (it holds the chat template).
    pub tokenizer_config: Option<PathBuf>,
}

impl SftModel {
    /// Builds the model over `store` (trainable) from a config.json value.
    pub fn new(store: ParamStore, config_json: serde_json::Value, tokenizer: Tokenizer) -> Result<Self> {
        let cfg = CausalLmConfig::from_json(&config_json, Path::new("config.json"))?;
        tokenizer.check_fits(cfg.vocab_size())?;
        let lm = CausalLm::load(&store.root(), &cfg)?;
        Ok(Self {
            store,
            lm,
            config_json,
            tokenizer,
            generation_config: None,
            chat_template: None,
            tokenizer_config: None,
        })
    }

    /// Loads a model directory or hub id with trainable weights; it must have `tokenizer.json`.
    pub fn from_pretrained(model: &str, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_pretrained_adapted(model, None, dtype, device)
    }

    /// [`Self::from_pretrained`], with LoRA adapters when `lora` is given: the base is frozen,
    /// the adapters train, and [`Self::save`] writes the adapter.
    pub fn from_pretrained_adapted(
        model: &str,
        lora: Option<&LoraSpec>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let files = locate(model)?;
        let config_json = read_config_json(&files.config)?;
        let cfg = CausalLmConfig::from_json(&config_json, &files.config)?;
        let tok_path = files.tokenizer.clone().ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.json; SFT tokenizes text, so the model directory needs one",
                files.dir.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        tokenizer.check_fits(cfg.vocab_size())?;
        let store = ParamStore::load_safetensors(&files.weights, lora.is_none(), dtype, device)?;
        let store = match lora {
            Some(l) => {
                let s = l.apply(&store, &cfg)?;
                s.set_lora_base(model);
                s
            }
            None => store,
        };
        let lm = CausalLm::load(&store.root(), &cfg)?;
        let tc = files.dir.join("tokenizer_config.json");
        let tokenizer_config = tc.is_file().then_some(tc);
        let chat_template = ChatTemplate::for_model_dir(&files.dir)?.map(Arc::new);
        Ok(Self {
            store,
            lm,
            config_json,
            tokenizer,
            generation_config: files.generation_config,
            chat_template,
            tokenizer_config,
        })
    }

    /// The EOS id appended to examples: config.json's (first) `eos_token_id`.
    pub fn eos_id(&self) -> Option<u32> {
        self.lm.config().eos_token_ids().first().copied()
    }

    /// Saves a Hugging Face directory: config.json, model.safetensors, tokenizer.json (and the
    /// source's generation_config.json). It loads with [`crate::models::load::load_policy`]
    /// (which adds a fresh value head) and with transformers.
    ///
    /// With LoRA: the adapter (`adapter_config.json`, `adapter_model.safetensors`, PEFT's
    /// format) and tokenizer.json instead; `rltune merge` makes a full model of it.
    pub fn save(&self, dir: &Path) -> Result<()> {
        if self.store.has_lora() {
            return save_dir_atomic(dir, |tmp| -> crate::models::Result<()> {
                self.store.save_adapter(tmp, None)?;
                self.tokenizer.save(&tmp.join("tokenizer.json"))?;
                if let Some(src) = &self.tokenizer_config {
                    let dst = tmp.join("tokenizer_config.json");
                    std::fs::copy(src, &dst).map_err(|e| crate::models::Error::io(&dst, e))?;
                }
                Ok(())
            })
            .map_err(Into::into);
        }
        save_pretrained(dir, &self.store, &self.config_json)?;
        self.tokenizer.save(&dir.join("tokenizer.json"))?;
        for (src, name) in [
            (&self.generation_config, "generation_config.json"),
            (&self.tokenizer_config, "tokenizer_config.json"),
        ] {
            if let Some(src) = src {
                let dst = dir.join(name);
                std::fs::copy(src, &dst).map_err(|e| Error::io(&dst, e))?;
            }
        }
        Ok(())
    }
}

/// The SFT loss on a causal LM.
struct SftObjective<'a> {
    lm: &'a CausalLm,
    pad_id: u32,
    dtype: DType,
    device: Device,
}

impl<'a> SftObjective<'a> {
    fn new(model: &'a SftModel) -> Self {
        let cfg = model.lm.config();
        let pad_id = cfg.pad_token_id().or(model.eos_id()).unwrap_or(0);
        Self { lm: &model.lm, pad_id, dtype: model.store.dtype(), device: model.store.device().clone() }
    }
}

impl Objective for SftObjective<'_> {
    type Example = SftExample;
    const PERPLEXITY: bool = true;

    fn terms(&self, ex: &SftExample) -> usize {
        ex.targets()
    }

    fn batch_loss(&self, batch: &[&SftExample], count_correct: bool) -> Result<BatchLoss> {
        let rows: Vec<Vec<u32>> = batch.iter().map(|e| e.input_ids.clone()).collect();
        let (ids, attn) = pad(&rows, self.pad_id, PaddingSide::Right);
        let (b_sz, seq_len) = (rows.len(), ids.first().map_or(0, Vec::len));
        // (B, T−1): weight of the target at t + 1; padding is 0 (loss_mask is shorter).
        let w: Vec<f32> = batch
            .iter()
            .flat_map(|e| (1..seq_len).map(move |t| f32::from(e.loss_mask.get(t).copied().unwrap_or(0))))
            .collect();
        let w = Tensor::from_vec(w, (b_sz, seq_len - 1), &self.device)?.to_dtype(self.dtype)?;
        // (B, T)
        let ids = Tensor::new(ids, &self.device)?;
        let pos = position_ids_from_mask(&attn, &self.device)?;
        let bias = causal_bias(&attn, seq_len, self.dtype, &self.device)?;
        // (B, T, C) → logits at the first T−1 positions (B, T−1, V)
        let hidden = self.lm.forward(&ids, &pos, &bias, None)?;
        let logits = self.lm.logits(&hidden.narrow(1, 0, seq_len - 1)?.contiguous()?)?;
        // (B, T−1)
        let targets = ids.narrow(1, 1, seq_len - 1)?.contiguous()?;
        let logp = ops::logprobs_of(&logits, &targets)?;
        let loss_sum = (&logp * &w)?.sum_all()?.neg()?;
        let correct = if count_correct {
            let hit = logits.detach().argmax(D::Minus1)?.eq(&targets)?.to_dtype(self.dtype)?;
            (hit * &w)?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?.round() as usize
        } else {
            0
        };
        Ok(BatchLoss { loss_sum, correct })
    }
}

/// Fine-tunes `model` on `records`; `progress` is called after every optimizer step.
///
/// The eval split (`args.eval_fraction`) is taken after tokenization, from the examples that
/// have a target token.
pub fn train_sft(
    model: &SftModel,
    records: &[SftRecord],
    cfg: &SftConfig,
    args: &TrainingArgs,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    train_sft_with(model, records, cfg, args, &Dist::default(), None, progress)
}

/// [`train_sft`] on `dist`'s processes (a data-parallel run: each a share of every step; one
/// process: [`Dist::default`]), with checkpoints, `--resume` and a stop flag
/// ([`Checkpointing`]).
pub fn train_sft_with(
    model: &SftModel,
    records: &[SftRecord],
    cfg: &SftConfig,
    args: &TrainingArgs,
    dist: &Dist,
    checkpoints: Option<Checkpointing>,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    check_max_length(model, cfg)?;
    let (examples, skipped) =
        tokenize_sft_with(records, &model.tokenizer, model.chat_template.as_deref(), model.eos_id(), cfg)?;
    if records.is_empty() {
        return Err(Error::argument("records", "no SFT example to train on"));
    }
    if examples.is_empty() {
        return Err(Error::Setting(ConfigError::new(
            "sft",
            "max_length",
            format!(
                "= {}: no SFT example left to train on ({skipped} dropped: no target token within \
                 sft.max_length); raise it",
                cfg.max_length
            ),
        )));
    }
    let obj = SftObjective::new(model);
    let mut summary =
        runner::run_with(&obj, &model.store, &examples, args, dist, progress, true, checkpoints)?;
    summary.skipped_examples = skipped;
    Ok(summary)
}

/// Fine-tunes `model` on examples tokenized already (e.g. the kept (prompt, action) pairs of
/// rejection sampling, with the loss on the action's tokens), without announcing it in the log.
pub fn train_sft_examples(
    model: &SftModel,
    examples: &[SftExample],
    args: &TrainingArgs,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    if examples.is_empty() {
        return Err(Error::argument("examples", "no SFT example to train on"));
    }
    runner::run_with(
        &SftObjective::new(model),
        &model.store,
        examples,
        args,
        &Dist::default(),
        progress,
        false,
        None,
    )
}

/// [`train_sft_examples`] through `opt`, whose learning rate, clipping and schedule replace
/// `args`' and whose Adam state carries on into the next call (rejection sampling).
pub fn train_sft_examples_on(
    model: &SftModel,
    examples: &[SftExample],
    args: &TrainingArgs,
    opt: &mut crate::engine::Optimizer,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    if examples.is_empty() {
        return Err(Error::argument("examples", "no SFT example to train on"));
    }
    runner::run_on(&SftObjective::new(model), &model.store, examples, args, opt, progress)
}

/// Mean next-token loss, perplexity and token accuracy of `model` on `examples`.
pub fn evaluate_sft(model: &SftModel, examples: &[SftExample], batch_size: usize) -> Result<EvalResult> {
    let refs: Vec<&SftExample> = examples.iter().collect();
    runner::evaluate(&SftObjective::new(model), &refs, batch_size)
}

fn check_max_length(model: &SftModel, cfg: &SftConfig) -> Result<()> {
    match model.lm.config().max_positions() {
        Some(max) if cfg.max_length > max => Err(Error::Setting(ConfigError::new(
            "sft",
            "max_length",
            format!("({}) exceeds the model's {max} positions; set sft.max_length ≤ {max}", cfg.max_length),
        ))),
        _ => Ok(()),
    }
}
