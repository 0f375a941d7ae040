//! Prompt datasets: the queries PPO generates from, with each row kept as metadata for rewards.
//!
//! [`load_prompts`] reads a local file by extension — JSON lines (`.jsonl`), JSON (`.json`: an
//! array of objects, or JSON lines), CSV (`.csv`, with a header row) or Parquet (`.parquet`,
//! with the `parquet` cargo feature) — a local directory (its files for a split), or a Hugging
//! Face hub dataset: `owner/name:path/in/repo.jsonl` names one file; `owner/name` alone takes the
//! repository's files for the split (see [`select_split_files`]). Hub files come from the hub
//! cache first (`$HF_HOME`, which works offline), then the network.
//!
//! Every row becomes a [`PromptRow`]: the text column, and the whole row as `meta` (so a reward
//! can read e.g. a gold answer, see [`crate::rewards::token_f1_reward`]). CSV values are strings.
//!
//! [`LengthSampler`] is TRL's `LengthSampler`: the sentiment example truncates each review to a
//! random 2..8 tokens to make the queries (`tokenizer.encode(review)[: input_size()]`).

mod hub;

use std::path::{Path, PathBuf};

use rand::Rng;

use crate::error::{Error, Result};
use crate::models::chat_template::{self, ChatTemplate};
use crate::tokenizer::Tokenizer;

pub use hub::select_split_files;

/// The file extensions [`load_prompts`] reads.
pub const SUPPORTED_EXTENSIONS: &[&str] = &["jsonl", "json", "csv", "parquet"];

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
/// `source` is a file (`.jsonl`, `.json`, `.csv`, `.parquet`), a directory, or a hub dataset
/// (`owner/name` or `owner/name:path/in/repo`). `split` picks the files of a directory or hub
/// dataset (default: the only data file, else `train`); a single file is one split and `split`
/// is ignored for it.
///
/// Errors name the file and the row (1-based line for JSON lines and CSV): a missing file, a row
/// without the text column (listing the columns present), an empty text, bad JSON, an unknown
/// extension (listing the supported ones), an empty dataset.
pub fn load_prompts(source: &str, text_column: &str, split: Option<&str>) -> Result<Vec<PromptRow>> {
    let path = Path::new(source);
    let rows = if path.is_file() {
        load_file(path, text_column)?
    } else if path.is_dir() {
        load_dir(path, text_column, split)?
    } else if let Some((id, file)) = hub::parse_hub_id(source) {
        hub::load_hub(id, file, text_column, split)?
    } else {
        return Err(Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such prompts file or directory (nor a hub dataset id `owner/name`)",
            ),
        ));
    };
    if rows.is_empty() {
        return Err(Error::Input(format!("{source}: the dataset has no rows; nothing to prompt with")));
    }
    Ok(rows)
}

/// Loads one local file, by extension.
pub fn load_file(path: &Path, text_column: &str) -> Result<Vec<PromptRow>> {
    let ext = extension(path);
    let text = |p: &Path| super::read_utf8(p);
    match ext.as_str() {
        "jsonl" => read_json_lines(path, &text(path)?, text_column),
        "json" => {
            let s = text(path)?;
            if s.trim_start().starts_with('[') {
                read_json_array(path, &s, text_column)
            } else {
                read_json_lines(path, &s, text_column)
            }
        }
        "csv" => read_csv(path, text_column),
        "parquet" => read_parquet(path, text_column),
        _ => Err(Error::Input(format!(
            "{}: unknown prompts file type {:?}; supported extensions: {}",
            path.display(),
            ext,
            SUPPORTED_EXTENSIONS.iter().map(|e| format!(".{e}")).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// The lowercased extension of `path` (`""` when none).
fn extension(path: &Path) -> String {
    path.extension().map(|e| e.to_string_lossy().to_lowercase()).unwrap_or_default()
}

/// The files of a local directory for `split` (see [`select_split_files`]), concatenated.
fn load_dir(dir: &Path, text_column: &str, split: Option<&str>) -> Result<Vec<PromptRow>> {
    let mut files = Vec::new();
    list_files(dir, dir, &mut files)?;
    let chosen =
        select_split_files(&files, split).map_err(|m| Error::Input(format!("{}: {m}", dir.display())))?;
    let mut rows = Vec::new();
    for f in chosen {
        rows.extend(load_file(&dir.join(&f), text_column)?);
    }
    Ok(rows)
}

/// Every file under `dir`, as `/`-separated paths relative to `root`, skipping hidden entries.
fn list_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let path: PathBuf = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
            continue;
        }
        if path.is_dir() {
            list_files(root, &path, out)?;
        } else if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/"));
        }
    }
    Ok(())
}

/// Turns one row (a JSON object) into a [`PromptRow`]; `at` is e.g. `"file line 3"`.
fn to_prompt(row: serde_json::Value, text_column: &str, at: &dyn Fn() -> String) -> Result<PromptRow> {
    let obj = row.as_object().ok_or_else(|| {
        Error::Input(format!(
            "{}: a row must be a JSON object with a {text_column:?} field, got {}",
            at(),
            shorten(&row)
        ))
    })?;
    let text = match obj.get(text_column) {
        Some(serde_json::Value::String(s)) => s.clone(),
        // A conversation (TRL's conversational format): rendered with the model's chat template
        // when encoded ([`encode_prompt`]); `text` is its last message.
        Some(serde_json::Value::Array(msgs)) if chat_template::is_conversation(msgs) => {
            let last =
                msgs.last().and_then(|m| m.get("content")).and_then(|c| c.as_str()).unwrap_or_default();
            return Ok(PromptRow { text: last.to_string(), meta: row });
        }
        Some(other) => {
            return Err(Error::Input(format!(
                "{}: column {text_column:?} is {}, not a string",
                at(),
                shorten(other)
            )));
        }
        None => {
            let cols = obj.keys().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", ");
            return Err(Error::Input(format!(
                "{}: no column {text_column:?} (the prompt text); columns present: {cols}; choose the text \
                 column with the text column setting",
                at()
            )));
        }
    };
    if text.trim().is_empty() {
        return Err(Error::Input(format!(
            "{}: column {text_column:?} is empty; every prompt needs text",
            at()
        )));
    }
    Ok(PromptRow { text, meta: row })
}

/// `v` as JSON, cut to about 200 bytes: error messages quote rows, and a row can be megabytes.
fn shorten(v: &serde_json::Value) -> String {
    const MAX: usize = 200;
    let s = v.to_string();
    if s.len() <= MAX {
        return s;
    }
    let cut = (0..=MAX).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    format!("{}… ({} bytes)", &s[..cut], s.len())
}

/// JSON lines: one object per non-blank line.
fn read_json_lines(path: &Path, text: &str, text_column: &str) -> Result<Vec<PromptRow>> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let row: serde_json::Value =
            serde_json::from_str(line).map_err(|e| Error::Input(format!("{}: invalid JSON: {e}", at())))?;
        rows.push(to_prompt(row, text_column, &at)?);
    }
    Ok(rows)
}

/// A JSON array of objects.
fn read_json_array(path: &Path, text: &str, text_column: &str) -> Result<Vec<PromptRow>> {
    let items: Vec<serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| Error::Input(format!("{}: invalid JSON array of rows: {e}", path.display())))?;
    items
        .into_iter()
        .enumerate()
        .map(|(i, row)| to_prompt(row, text_column, &|| format!("{} row {}", path.display(), i + 1)))
        .collect()
}

/// CSV with a header row; every value is a string.
fn read_csv(path: &Path, text_column: &str) -> Result<Vec<PromptRow>> {
    // Read as UTF-8 first: invalid bytes then get the line and the fix.
    let text = super::read_utf8(path)?;
    let mut reader = csv::ReaderBuilder::new().has_headers(true).from_reader(text.as_bytes());
    let bad = |e: csv::Error| Error::Input(format!("{}: invalid CSV: {e}", path.display()));
    let headers = reader.headers().map_err(bad)?.clone();
    if !headers.iter().any(|h| h == text_column) {
        let cols = headers.iter().map(|h| format!("{h:?}")).collect::<Vec<_>>().join(", ");
        return Err(Error::Input(format!(
            "{} line 1 (header): no column {text_column:?} (the prompt text); columns present: {cols}",
            path.display()
        )));
    }
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(bad)?;
        let line = record.position().map_or(0, |p| p.line());
        let obj: serde_json::Map<String, serde_json::Value> =
            headers.iter().zip(record.iter()).map(|(h, v)| (h.to_string(), v.into())).collect();
        rows.push(to_prompt(obj.into(), text_column, &|| format!("{} line {line}", path.display()))?);
    }
    Ok(rows)
}

/// Parquet, through the `parquet` crate's row API (values converted to JSON).
#[cfg(feature = "parquet")]
fn read_parquet(path: &Path, text_column: &str) -> Result<Vec<PromptRow>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let bad =
        |e: parquet::errors::ParquetError| Error::Input(format!("{}: invalid Parquet: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    let mut rows = Vec::new();
    for (i, row) in reader.get_row_iter(None).map_err(bad)?.enumerate() {
        let row = row.map_err(bad)?.to_json_value();
        rows.push(to_prompt(row, text_column, &|| format!("{} row {}", path.display(), i + 1))?);
    }
    Ok(rows)
}

/// Without the `parquet` feature: an error that says how to get it.
#[cfg(not(feature = "parquet"))]
fn read_parquet(path: &Path, _text_column: &str) -> Result<Vec<PromptRow>> {
    Err(Error::Input(format!(
        "{}: reading Parquet needs the `parquet` cargo feature, which this build was made without: \
         the `rltune` binary has it by default (`cargo build --release -p rltune-cli`, without \
         `--no-default-features`); a program using the library adds `features = [\"parquet\"]` to its \
         `rltune` dependency. Or convert the file to JSON lines, e.g. `python -c \"import pandas as \
         pd; pd.read_parquet('IN.parquet').to_json('OUT.jsonl', orient='records', lines=True)\"`",
        path.display()
    )))
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
            return Err(Error::Input(format!(
                "length sampler: min ({min}) must be below max ({max}); max is exclusive, as in TRL's \
                 LengthSampler (e.g. 2..8 samples 2 to 7)"
            )));
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
    if !rows.iter().any(|r| r.meta.get(column).is_some_and(|v| v.is_array())) {
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
