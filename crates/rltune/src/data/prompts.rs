//! Prompt datasets: the queries PPO, GRPO and RLOO generate from, with each row kept as metadata
//! for rewards.
//!
//! [`load_prompts`] reads rows through [`super::rows::read_rows`]: a local file — JSON lines
//! (`.jsonl`), JSON (`.json`: an array of objects, or JSON lines), CSV (`.csv`, with a header
//! row), Parquet (`.parquet`) or Arrow (`.arrow`), the last two with the `parquet` cargo feature —
//! a local directory (a `datasets` `save_to_disk` directory, or its files for a split), or a
//! Hugging Face hub dataset: `owner/name:path/in/repo.jsonl` names one file; `owner/name` alone
//! takes the repository's files for the split (see [`select_split_files`]). Hub files come from
//! the hub cache first (`$HF_HOME`, which works offline), then the network.
//!
//! Every row becomes a [`PromptRow`]: the text column, and the whole row as `meta` (so a reward
//! can read e.g. a gold answer, see [`crate::rewards::token_f1_reward`]). CSV values are strings.
//! A conversational prompt (a list of `{"role", "content"}` messages, TRL's conversational
//! format) is rendered with the model's chat template when encoded ([`encode_prompt`]), as TRL
//! 1.16.0's `maybe_apply_chat_template` does.
//!
//! [`LengthSampler`] is TRL's `LengthSampler`: the sentiment example truncates each review to a
//! random 2..8 tokens to make the queries (`tokenizer.encode(review)[: input_size()]`).

use std::path::Path;

use rand::Rng;

use super::rows::{column_list, read_rows, shorten, DataOptions, Row};
use crate::error::{Error, Result};
use crate::models::chat_template::{self, ChatTemplate};
use crate::tokenizer::Tokenizer;

pub use super::files::{select_split_files, SplitFilesError, SUPPORTED_EXTENSIONS};

/// One prompt: its text and the whole row it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRow {
    /// The text column's value.
    pub text: String,
    /// The whole row as a JSON object (including the text column).
    pub meta: serde_json::Value,
}

/// Loads the prompts in `source`, taking each row's text from `text_column`.
///
/// `source` is a file (`.jsonl`, `.json`, `.csv`, `.parquet`, `.arrow`), a directory, or a hub
/// dataset (`owner/name` or `owner/name:path/in/repo`). `split` picks the files of a directory or
/// hub dataset (default: the only data file, else `train`); a single file is one split and
/// `split` is ignored for it.
///
/// Errors name the file and the row (1-based line for JSON lines and CSV): a missing file, a row
/// without the text column (listing the columns present), an empty text, bad JSON, an unknown
/// extension (listing the supported ones), an empty dataset.
pub fn load_prompts(source: &str, text_column: &str, split: Option<&str>) -> Result<Vec<PromptRow>> {
    let opts = DataOptions { split: split.map(str::to_string), ..Default::default() };
    load_prompts_with(source, text_column, &opts)
}

/// [`load_prompts`] with the split and a column mapping (`[data] split`, `[data] columns`).
pub fn load_prompts_with(source: &str, text_column: &str, opts: &DataOptions) -> Result<Vec<PromptRow>> {
    let rows = read_rows(source, opts).map_err(|e| match e {
        Error::Data { at, problem } if problem == "the dataset has no rows" => {
            Error::Data { at, problem: format!("{problem}; nothing to prompt with") }
        }
        other => other,
    })?;
    rows.into_iter().map(|r| to_prompt(r, text_column)).collect()
}

/// Loads one local file, by extension.
pub fn load_file(path: &Path, text_column: &str) -> Result<Vec<PromptRow>> {
    super::rows::read_file(path)?.into_iter().map(|r| to_prompt(r, text_column)).collect()
}

/// Turns one row into a [`PromptRow`].
fn to_prompt(row: Row, text_column: &str) -> Result<PromptRow> {
    let at = &row.origin;
    let text = match row.fields.get(text_column) {
        Some(serde_json::Value::String(s)) => s.clone(),
        // A conversation (TRL's conversational format): rendered with the model's chat template
        // when encoded ([`encode_prompt`]); `text` is its last message.
        Some(serde_json::Value::Array(msgs)) if chat_template::is_conversation(msgs) => {
            let last =
                msgs.last().and_then(|m| m.get("content")).and_then(|c| c.as_str()).unwrap_or_default();
            return Ok(PromptRow { text: last.to_string(), meta: row.to_value() });
        }
        Some(other) => {
            return Err(Error::data(
                at,
                format!(
                    "column {text_column:?} is {}, not a string (nor a list of {{\"role\", \"content\"}} \
                 messages)",
                    shorten(other)
                ),
            ));
        }
        None => {
            return Err(Error::data(
                at,
                format!(
                    "no column {text_column:?} (the prompt text); columns present: {}; choose the text \
                 column with the text column setting (`[data] text_column`)",
                    column_list(&row.fields)
                ),
            ));
        }
    };
    if text.trim().is_empty() {
        return Err(Error::data(at, format!("column {text_column:?} is empty; every prompt needs text")));
    }
    Ok(PromptRow { text, meta: row.to_value() })
}

impl PromptRow {
    /// Whether the row's `column` is a conversation (a list of messages, rendered with the chat
    /// template) rather than text.
    pub fn is_conversation(&self, column: &str) -> bool {
        self.meta.get(column).is_some_and(serde_json::Value::is_array)
    }
}

/// TRL's `LengthSampler(min_value, max_value)`: a length drawn uniformly from `min..max`.
///
/// `max` is **exclusive**, as in TRL (`np.random.choice(range(min_value, max_value))`):
/// `LengthSampler::new(2, 8)` returns 2 to 7.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LengthSampler {
    min: usize,
    max: usize,
}

impl LengthSampler {
    /// A sampler over `min..max` (max exclusive); fails unless `min < max`.
    pub fn new(min: usize, max: usize) -> Result<Self> {
        if min >= max {
            return Err(Error::argument(
                "max",
                format!(
                    "length sampler: min ({min}) must be below max ({max}); max is exclusive, as in \
                     TRL's LengthSampler (e.g. 2..8 samples 2 to 7)"
                ),
            ));
        }
        Ok(Self { min, max })
    }

    /// The smallest length sampled.
    pub fn min(&self) -> usize {
        self.min
    }

    /// One more than the largest length sampled.
    pub fn max(&self) -> usize {
        self.max
    }

    /// A length in `min..max`, uniformly.
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        rng.gen_range(self.min..self.max)
    }
}

/// The first `sampler.sample(rng)` ids of `ids` (all of them when shorter), as TRL's sentiment
/// example makes queries: `tokenizer.encode(review)[: input_size()]`.
pub fn truncate_to_sampled_length<'a>(
    ids: &'a [u32],
    sampler: &LengthSampler,
    rng: &mut impl Rng,
) -> &'a [u32] {
    let n = sampler.sample(rng);
    &ids[..n.min(ids.len())]
}

/// The chat template of the model `model` (a directory, GGUF file or hub id) when some row's
/// `column` is a conversation; `None` when every prompt is text.
pub fn template_if_needed(rows: &[PromptRow], column: &str, model: &str) -> Result<Option<ChatTemplate>> {
    if !rows.iter().any(|r| r.is_conversation(column)) {
        return Ok(None);
    }
    let files = crate::models::load::locate(model)?;
    Ok(ChatTemplate::for_model_dir(&files.dir)?)
}

/// A prompt row's token ids: a conversation rendered with `template` (with the generation prompt)
/// and tokenized without adding special tokens (the template writes them), as TRL's GRPO and RLOO
/// trainers do; a text prompt tokenized as usual.
pub fn encode_prompt(
    row: &PromptRow,
    column: &str,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Vec<u32>> {
    match row.meta.get(column) {
        Some(conv @ serde_json::Value::Array(_)) => {
            Ok(tokenizer.encode_with(&chat_template::prompt_text(conv, template)?, false)?)
        }
        _ => Ok(tokenizer.encode(&row.text)?),
    }
}

#[cfg(test)]
mod tests;
