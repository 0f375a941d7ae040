//! Sequence tagging as a policy: a pretrained BERT encoder with a token-classification head
//! tags each word of a sentence under the BIO constraint ([`bio`]), trained by imitation
//! (cross-entropy on the gold tags) and then by reinforcement on entity F1 ([`train`]).
//!
//! **The policy.** A sentence's words are tokenized one by one (each word's word pieces, between
//! `[CLS]` and `[SEP]` when the tokenizer has them); the tag of a word is read at its first piece,
//! as transformers' token-classification examples label it. The tags are picked left to right,
//! each from the softmax of the word's logits with the tags that may not follow the previous tag
//! masked out. One encoder pass gives every word's logits; a tag sequence's log-probability is
//! the sum of its words' constrained log-probabilities, exactly.
//!
//! **Long sentences.** Words whose first piece falls past `max_position_embeddings − 1` are not
//! covered: the tagger tags them `O` and never trains on them.

pub mod bio;
pub mod train;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::models::bert::{BertConfig, BertForTokenClassification};
use crate::models::load::{locate, read_config_json, save_pretrained};
use crate::params::ParamStore;
use crate::tokenizer::Tokenizer;
pub use bio::Bio;

/// A sentence's word pieces and where each covered word begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Piece ids, with `[CLS]`/`[SEP]` when the tokenizer has them.
    pub ids: Vec<u32>,
    /// The position of each covered word's first piece (a prefix of the sentence's words).
    pub first: Vec<usize>,
    /// Words in the sentence (covered or not).
    pub words: usize,
}

/// A BERT token tagger over a BIO tag set.
#[derive(Debug, Clone)]
pub struct Tagger {
    store: ParamStore,
    model: BertForTokenClassification,
    config_json: serde_json::Value,
    tokenizer: Tokenizer,
    bio: Bio,
    cls: Option<u32>,
    sep: Option<u32>,
    unk: u32,
    pad: u32,
    max_len: usize,
}

impl Tagger {
    /// A tagger over `tags` on the BERT encoder `model` (a directory or hub id with config.json,
    /// safetensors weights and tokenizer.json): the encoder's weights, a new head initialized from
    /// `seed` (or the checkpoint's own, when it already tags `tags`). Trainable.
    pub fn from_pretrained(model: &str, tags: &[String], seed: u64, device: &Device) -> Result<Self> {
        let files = locate(model)?;
        let json = read_config_json(&files.config)?;
        let json = crate::train::reward_model::with_labels(json, tags)?;
        let cfg = bert_config(&json, &files.config)?;
        let mut checkpoint = HashMap::new();
        for f in &files.weights {
            let ts = candle_core::safetensors::load(f, &Device::Cpu)
                .map_err(|e| Error::weights(f, format!("cannot read safetensors: {e}")))?;
            checkpoint.extend(ts);
        }
        let (tensors, initialized) =
            crate::models::load::complete_checkpoint(checkpoint, "bert.", seed, DType::F32, device, |p| {
                BertForTokenClassification::load(p, &cfg).map(|_| ())
            })?;
        if !initialized.is_empty() {
            tracing::info!("{}: newly initialized: {}", files.dir.display(), initialized.join(", "));
        }
        let store = ParamStore::from_tensors(tensors, true, DType::F32, device, &files.dir)?;
        let tok = files.tokenizer.clone().ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.json; the tagger tokenizes words",
                files.dir.display()
            ))
        })?;
        Self::assemble(store, json, cfg, Tokenizer::from_file(&tok)?)
    }

    /// A tagger saved by [`Self::save`] (or any `BertForTokenClassification` directory whose
    /// `id2label` is a BIO tag set); trainable when `trainable`.
    pub fn load(dir: &Path, trainable: bool, device: &Device) -> Result<Self> {
        let config = dir.join("config.json");
        let json = read_config_json(&config)?;
        let cfg = bert_config(&json, &config)?;
        let store =
            ParamStore::load_safetensors(&[dir.join("model.safetensors")], trainable, DType::F32, device)?;
        Self::assemble(store, json, cfg, Tokenizer::from_file(&dir.join("tokenizer.json"))?)
    }

    fn assemble(
        store: ParamStore,
        config_json: serde_json::Value,
        cfg: BertConfig,
        tokenizer: Tokenizer,
    ) -> Result<Self> {
        let model = BertForTokenClassification::load(&store.root(), &cfg)?;
        tokenizer.check_fits(cfg.vocab_size)?;
        let bio = Bio::new(model.labels())?;
        let unk = tokenizer.token_to_id("[UNK]").unwrap_or(0);
        Ok(Self {
            cls: tokenizer.token_to_id("[CLS]"),
            sep: tokenizer.token_to_id("[SEP]"),
            unk,
            pad: cfg.pad_token_id.unwrap_or(0),
            max_len: cfg.max_position_embeddings,
            store,
            model,
            config_json,
            tokenizer,
            bio,
        })
    }

    /// Saves a Hugging Face directory (config.json with the tags as `id2label`,
    /// model.safetensors, tokenizer.json) that transformers' `AutoModelForTokenClassification`
    /// and [`Self::load`] read.
    pub fn save(&self, dir: &Path) -> Result<()> {
        save_pretrained(dir, &self.store, &self.config_json)?;
        Ok(self.tokenizer.save(&dir.join("tokenizer.json"))?)
    }

    /// A frozen copy (the reference policy of RL).
    pub fn frozen_copy(&self) -> Result<Self> {
        let store = self.store.frozen_copy()?;
        let model = BertForTokenClassification::load(
            &store.root(),
            &bert_config(&self.config_json, Path::new("config.json"))?,
        )?;
        Ok(Self { store, model, ..self.clone() })
    }

    /// The weights.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The tag set and its constraint.
    pub fn bio(&self) -> &Bio {
        &self.bio
    }

    /// The tags by index.
    pub fn tags(&self) -> &[String] {
        self.bio.tags()
    }

    /// Tokenizes a sentence's words (module docs).
    pub fn encode<S: AsRef<str>>(&self, words: &[S]) -> Result<Encoded> {
        let mut ids: Vec<u32> = self.cls.into_iter().collect();
        let room = self.max_len - usize::from(self.sep.is_some());
        let mut first = Vec::with_capacity(words.len());
        for w in words {
            let mut pieces = self.tokenizer.encode_with(w.as_ref(), false)?;
            if pieces.is_empty() {
                pieces.push(self.unk);
            }
            if ids.len() >= room {
                break;
            }
            first.push(ids.len());
            let take = pieces.len().min(room - ids.len());
            ids.extend_from_slice(&pieces[..take]);
        }
        ids.extend(self.sep);
        Ok(Encoded { ids, first, words: words.len() })
    }

    /// The covered words' logits `(B, W, L)`, `W` the most covered words of the batch (rows
    /// past a sentence's words are zeros' logits and mean nothing).
    pub fn logits(&self, batch: &[&Encoded]) -> Result<Tensor> {
        let device = self.store.device();
        let (b, t) = (batch.len(), batch.iter().map(|e| e.ids.len()).max().unwrap_or(1).max(1));
        let width = batch.iter().map(|e| e.first.len()).max().unwrap_or(0).max(1);
        let mut ids = vec![self.pad; b * t];
        let mut mask = vec![vec![0u8; t]; b];
        let mut gather = vec![0u32; b * width];
        for (r, e) in batch.iter().enumerate() {
            ids[r * t..r * t + e.ids.len()].copy_from_slice(&e.ids);
            mask[r][..e.ids.len()].fill(1);
            for (w, &p) in e.first.iter().enumerate() {
                gather[r * width + w] = (r * t + p) as u32;
            }
        }
        let ids = Tensor::from_vec(ids, (b, t), device)?;
        // (B, T, L) → (B·T, L) → (B·W, L)
        let logits = self.model.forward(&ids, None, &mask)?;
        let l = logits.dim(2)?;
        let picked =
            logits.reshape((b * t, l))?.index_select(&Tensor::from_vec(gather, b * width, device)?, 0)?;
        Ok(picked.reshape((b, width, l))?)
    }
}

/// The BERT config of a tagger's config.json.
fn bert_config(json: &serde_json::Value, path: &Path) -> Result<BertConfig> {
    let kind = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("bert");
    if kind != "bert" {
        return Err(Error::config(
            path,
            format!("model_type {kind:?}: the tagger is a BERT encoder (model_type \"bert\"), e.g. all-MiniLM-L6-v2"),
        ));
    }
    let cfg: BertConfig = serde_json::from_value(json.clone())
        .map_err(|e| Error::config(path, format!("not a BERT config: {e}")))?;
    cfg.validate().map_err(|m| Error::config(path, m))?;
    Ok(cfg)
}

/// Writes a tiny random BERT tagger checkpoint to `dir` (atomically: a sibling temporary folder,
/// then a rename): a word-level tokenizer of `words` ([`Tokenizer::word_level`], BERT's special
/// tokens first), a `config.json` and random weights of width `hidden` (one layer, two heads,
/// `max_positions` positions) from `seed`. For tests and smoke runs without a pretrained encoder;
/// [`Tagger::from_pretrained`] reads it as it reads all-MiniLM-L6-v2.
pub fn write_tiny_encoder(
    dir: &Path,
    words: &[&str],
    hidden: usize,
    max_positions: usize,
    seed: u64,
) -> Result<()> {
    let tokenizer = Tokenizer::word_level(words, true)?;
    let mut cfg = BertConfig::tiny(4 + words.len(), hidden, 1, 2, 2);
    cfg.max_position_embeddings = max_positions;
    let store = ParamStore::random(seed, false, DType::F32, &Device::Cpu)?;
    BertForTokenClassification::load(&store.root(), &cfg)?;
    let mut config = serde_json::to_value(&cfg)
        .map_err(|e| Error::Internal(format!("cannot serialize a BERT config: {e}")))?;
    config["model_type"] = "bert".into();
    let tmp = dir.with_extension("tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    tokenizer.save(&tmp.join("tokenizer.json"))?;
    crate::io::write_bytes_atomic(&tmp.join("config.json"), config.to_string().as_bytes())?;
    store.save_safetensors(&tmp.join("model.safetensors"))?;
    std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))
}
