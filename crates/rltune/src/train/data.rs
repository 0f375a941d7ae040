//! Training data: SFT texts, prompt/completion pairs and conversations, labelled texts and
//! preference pairs, read through [`crate::data::rows`] (JSON lines, JSON, CSV, Parquet, Arrow,
//! `datasets` `save_to_disk` directories, hub datasets; `.txt` is one text per line) with errors
//! that name the file and row; and the seeded eval split.
//!
//! | data | one example per row |
//! |---|---|
//! | `*.txt` | a line of text (empty lines are skipped) |
//! | SFT | `{"text": ...}`, `{"prompt": ..., "completion": ...}`, `{"messages": [...]}` (or ShareGPT `{"conversations": [{"from", "value"}]}`), or `{"prompt": [...], "completion": [...]}` as message lists |
//! | reward | `{"text": ..., "label": "POSITIVE" \| 0}` or `{"chosen": ..., "rejected": ...}`, optional `"prompt"`; chosen/rejected (and prompt) may be message lists |
//!
//! Other fields in a row are ignored (datasets often carry ids and metadata). A dataset holds
//! one kind of example: the first row decides, and a row of another kind is an error. Columns
//! with other names are mapped with `[data] columns` ([`crate::data::rows::ColumnMap`]).

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::data::chat;
use crate::data::rows::{column_list, read_rows, DataOptions};
use crate::error::{ConfigError, Error, Result};

/// One supervised fine-tuning example, before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SftRecord {
    /// Plain text: every token is a target.
    Text(String),
    /// A prompt and its completion; with `completion_only_loss` only the completion is a target.
    PromptCompletion {
        /// The prompt (context).
        prompt: String,
        /// The completion the model learns to produce.
        completion: String,
    },
    /// A conversation (`messages`), rendered with the chat template; with `assistant_only_loss`
    /// only the assistant's `{% generation %}` blocks are targets.
    Messages(serde_json::Value),
    /// A conversational prompt and completion (message lists): the prompt rendered with the
    /// generation prompt, the completion after it.
    ChatPromptCompletion {
        /// The prompt's messages.
        prompt: serde_json::Value,
        /// The completion's messages.
        completion: serde_json::Value,
    },
}

impl SftRecord {
    /// Whether the record is a conversation (rendered with the chat template).
    pub fn is_conversational(&self) -> bool {
        matches!(self, SftRecord::Messages(_) | SftRecord::ChatPromptCompletion { .. })
    }
}

/// A class label as written in the data: a class name (`"POSITIVE"`) or an index (`0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(untagged)]
pub enum Label {
    /// An index into the model's `id2label`.
    Index(usize),
    /// A class name from the model's `id2label`.
    Name(String),
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Label::Index(i) => write!(f, "{i}"),
            Label::Name(n) => write!(f, "{n}"),
        }
    }
}

/// One reward-model example, before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewardRecord {
    /// A text and its class (cross-entropy training).
    Labelled {
        /// The text.
        text: String,
        /// Its class.
        label: Label,
    },
    /// A preferred and a dispreferred conversation, each whole (prompt messages first), rendered
    /// with the chat template (Bradley–Terry training).
    ChatPreference {
        /// The preferred conversation.
        chosen: serde_json::Value,
        /// The dispreferred conversation.
        rejected: serde_json::Value,
    },
    /// A preferred and a dispreferred response (Bradley–Terry training).
    Preference {
        /// Optional prompt, prepended verbatim to both responses.
        prompt: Option<String>,
        /// The preferred response.
        chosen: String,
        /// The dispreferred response.
        rejected: String,
    },
}

impl RewardRecord {
    /// Whether this is a preference pair.
    pub fn is_preference(&self) -> bool {
        matches!(self, RewardRecord::Preference { .. } | RewardRecord::ChatPreference { .. })
    }
}

/// Reads SFT examples from a file: `.txt` (one example per non-empty line), JSON lines, or any
/// format [`read_sft_data`] reads.
pub fn read_sft_records(path: &Path) -> Result<Vec<SftRecord>> {
    read_sft_data(&path.to_string_lossy(), &DataOptions::default())
}

/// Reads SFT examples from a file, directory or hub dataset, with the split and column mapping
/// of `opts`.
pub fn read_sft_data(source: &str, opts: &DataOptions) -> Result<Vec<SftRecord>> {
    let rows = read_rows(source, opts).map_err(|e| with_hint(e, SFT_EXPECTED))?;
    let mut out: Vec<SftRecord> = Vec::with_capacity(rows.len());
    for row in rows {
        let at = |msg: String| Error::data(&row.origin, msg);
        let rec = sft_record(row.fields, &row.origin).map_err(at)?;
        if let Some(prev) = out.last() {
            if std::mem::discriminant(prev) != std::mem::discriminant(&rec) {
                return Err(at(format!(
                    "mixes {} and {} examples; use one kind per dataset",
                    sft_kind(prev),
                    sft_kind(&rec)
                )));
            }
        }
        out.push(rec);
    }
    Ok(out)
}

fn sft_kind(r: &SftRecord) -> &'static str {
    match r {
        SftRecord::Text(_) => "plain-text",
        SftRecord::PromptCompletion { .. } => "prompt/completion",
        SftRecord::Messages(_) => "conversational (messages)",
        SftRecord::ChatPromptCompletion { .. } => "conversational prompt/completion",
    }
}

const SFT_EXPECTED: &str = "expected {\"text\": \"..\"}, {\"prompt\": \"..\", \"completion\": \"..\"}, \
                            {\"messages\": [{\"role\": .., \"content\": ..}, ..]} or prompt/completion message lists \
                            (a .txt file is read as one example per line; other column names are mapped with \
                            `[data] columns`)";

/// One SFT row: TRL's dataset types (language modeling or prompt-completion, each standard or
/// conversational). ShareGPT's `conversations` of `{"from", "value"}` become `messages` of
/// `{"role", "content"}` (TRL's `maybe_convert_to_chatml`).
fn sft_record(mut row: Map<String, Value>, origin: &str) -> std::result::Result<SftRecord, String> {
    if let Some(Value::Array(conv)) = row.remove("conversations") {
        let msgs = conv
            .into_iter()
            .map(|m| match m {
                Value::Object(mut o) => {
                    if let Some(v) = o.remove("from") {
                        o.insert("role".into(), v);
                    }
                    if let Some(v) = o.remove("value") {
                        o.insert("content".into(), v);
                    }
                    Value::Object(o)
                }
                other => other,
            })
            .collect();
        row.insert("messages".into(), Value::Array(msgs));
    }
    let check = |v: &Value, f: &str| {
        chat::check_messages(v, origin, f).map_err(|e| e.to_string().replacen(&format!("{origin}: "), "", 1))
    };
    let text = |f: &str, v: Value| match v {
        Value::String(s) => Ok(s),
        other => Err(format!("field \"{f}\" is {}, not a string; {SFT_EXPECTED}", short(&other))),
    };
    match (row.remove("text"), row.remove("prompt"), row.remove("completion"), row.remove("messages")) {
        (None, None, None, Some(m)) => {
            check(&m, "messages")?;
            Ok(SftRecord::Messages(m))
        }
        (Some(t), None, None, None) => Ok(SftRecord::Text(text("text", t)?)),
        (None, Some(p @ Value::Array(_)), Some(c @ Value::Array(_)), None) => {
            check(&p, "prompt")?;
            check(&c, "completion")?;
            Ok(SftRecord::ChatPromptCompletion { prompt: p, completion: c })
        }
        (None, Some(p), Some(c), None) => {
            Ok(SftRecord::PromptCompletion { prompt: text("prompt", p)?, completion: text("completion", c)? })
        }
        (None, Some(_), None, None) => Err("\"prompt\" without \"completion\"".into()),
        (None, None, Some(_), None) => Err("\"completion\" without \"prompt\"".into()),
        (None, None, None, None) => Err(format!(
            "missing \"text\" (or \"prompt\" and \"completion\", or \"messages\"); columns present: {}; {SFT_EXPECTED}",
            column_list(&row)
        )),
        _ => Err("give one of \"text\", \"prompt\" + \"completion\" or \"messages\", not both".into()),
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 100 {
        format!("a {}-byte {}", s.len(), if v.is_array() { "array" } else { "value" })
    } else {
        s
    }
}

/// Reads reward-model examples from a file: labelled texts or preference pairs.
pub fn read_reward_records(path: &Path) -> Result<Vec<RewardRecord>> {
    read_reward_data(&path.to_string_lossy(), &DataOptions::default())
}

/// Reads reward-model examples from a file, directory or hub dataset, with the split and column
/// mapping of `opts`.
pub fn read_reward_data(source: &str, opts: &DataOptions) -> Result<Vec<RewardRecord>> {
    let mut out: Vec<RewardRecord> = Vec::new();
    for row in read_rows(source, opts).map_err(|e| with_hint(e, REWARD_EXPECTED))? {
        let at = |msg: String| Error::data(&row.origin, msg);
        let rec = reward_record(row.fields, &row.origin).map_err(at)?;
        if out.first().is_some_and(|first| first.is_preference() != rec.is_preference()) {
            return Err(at("mixes labelled texts and preference pairs; use one kind per file".into()));
        }
        if out.first().is_some_and(|first| {
            matches!(first, RewardRecord::ChatPreference { .. })
                != matches!(rec, RewardRecord::ChatPreference { .. })
        }) {
            return Err(at("mixes text and conversational preference pairs; use one kind per file".into()));
        }
        out.push(rec);
    }
    Ok(out)
}

const REWARD_EXPECTED: &str = "expected {\"text\": \"..\", \"label\": \"NAME\" or index} or \
                               {\"chosen\": \"..\", \"rejected\": \"..\"} (optional \"prompt\"; all three may be \
                               message lists)";

fn reward_record(mut row: Map<String, Value>, origin: &str) -> std::result::Result<RewardRecord, String> {
    let (text, label, prompt) = (row.remove("text"), row.remove("label"), row.remove("prompt"));
    let (chosen, rejected) = (row.remove("chosen"), row.remove("rejected"));
    let string = |f: &str, v: Value| match v {
        Value::String(s) => Ok(s),
        other => Err(format!("field \"{f}\" is {}, not a string; {REWARD_EXPECTED}", short(&other))),
    };
    let conversational =
        [&prompt, &chosen, &rejected].iter().any(|v| v.as_ref().is_some_and(Value::is_array));
    match (text, label, chosen, rejected) {
        (Some(text), Some(label), None, None) => {
            if prompt.is_some() {
                return Err("\"prompt\" goes with preference pairs; prepend it to \"text\" instead".into());
            }
            let text = string("text", text)?;
            let label: Label = serde_json::from_value(label.clone()).map_err(|_| {
                format!("label {label} must be a class name (\"POSITIVE\") or a non-negative integer index")
            })?;
            Ok(RewardRecord::Labelled { text, label })
        }
        (None, None, Some(chosen), Some(rejected)) if conversational => {
            // TRL's reward `tokenize_fn`: an explicit prompt is prepended to both conversations.
            let whole = |f: &str, v: Value| -> std::result::Result<Value, String> {
                let mut msgs = match &prompt {
                    Some(p @ Value::Array(_)) => {
                        chat::check_messages(p, origin, "prompt").map_err(|e| strip(e, origin))?;
                        p.as_array().cloned().unwrap_or_default()
                    }
                    Some(other) => {
                        return Err(format!(
                            "field \"prompt\" is {}, but \"chosen\"/\"rejected\" are message lists; give the \
                             prompt as messages too",
                            short(other)
                        ))
                    }
                    None => Vec::new(),
                };
                chat::check_messages(&v, origin, f).map_err(|e| strip(e, origin))?;
                msgs.extend(v.as_array().cloned().unwrap_or_default());
                Ok(Value::Array(msgs))
            };
            Ok(RewardRecord::ChatPreference { chosen: whole("chosen", chosen)?, rejected: whole("rejected", rejected)? })
        }
        (None, None, Some(chosen), Some(rejected)) => Ok(RewardRecord::Preference {
            prompt: prompt.map(|p| string("prompt", p)).transpose()?,
            chosen: string("chosen", chosen)?,
            rejected: string("rejected", rejected)?,
        }),
        (Some(_), None, _, _) => Err("\"text\" without \"label\"".into()),
        (None, Some(_), _, _) => Err("\"label\" without \"text\"".into()),
        (None, None, Some(_), None) => Err("\"chosen\" without \"rejected\"".into()),
        (None, None, None, Some(_)) => Err("\"rejected\" without \"chosen\"".into()),
        (None, None, None, None) => Err(format!(
            "missing \"text\" + \"label\" or \"chosen\" + \"rejected\"; columns present: {}; {REWARD_EXPECTED}",
            column_list(&row)
        )),
        _ => Err("give either \"text\" + \"label\" or \"chosen\" + \"rejected\", not both".into()),
    }
}

/// A JSON syntax error, with the rows the trainer expects.
fn with_hint(e: Error, expected: &str) -> Error {
    match e {
        Error::Data { at, problem } if problem.contains("invalid JSON") => {
            Error::Data { at, problem: format!("{problem}; {expected}") }
        }
        other => other,
    }
}

/// An error's message without its `origin: ` prefix (the caller adds it back).
fn strip(e: Error, origin: &str) -> String {
    e.to_string().replacen(&format!("{origin}: "), "", 1)
}

/// Splits `0..n` into (train, eval) indices: a seeded shuffle, then `round(n · fraction)` eval
/// examples (at least one when `fraction > 0`). Both lists come back sorted.
///
/// Fails when the split would leave no training example; the message names
/// `training.eval_fraction`.
pub fn split_eval(n: usize, fraction: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>)> {
    let n_eval = if fraction > 0.0 { ((n as f64 * fraction).round() as usize).max(1) } else { 0 };
    if n_eval >= n {
        return Err(Error::Setting(ConfigError::new(
            "training",
            "eval_fraction",
            format!(
                "= {fraction} leaves no training example out of {n}; lower it (or set it to 0 for no \
                 eval split), or add data"
            ),
        )));
    }
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let mut eval = idx.split_off(n - n_eval);
    idx.sort_unstable();
    eval.sort_unstable();
    Ok((idx, eval))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }

    #[test]
    fn sft_txt_and_jsonl() {
        let (_d, p) = write("a.txt", "one two\n\nthree\n");
        let r = read_sft_records(&p).unwrap();
        assert_eq!(r, vec![SftRecord::Text("one two".into()), SftRecord::Text("three".into())]);
        let (_d, p) = write("a.jsonl", "{\"prompt\": \"p\", \"completion\": \"c\", \"id\": 3}\n");
        let r = read_sft_records(&p).unwrap();
        assert_eq!(r, vec![SftRecord::PromptCompletion { prompt: "p".into(), completion: "c".into() }]);
    }

    #[test]
    fn sft_errors_name_the_line() {
        let cases = [
            ("{\"text\": \"a\"}\n{\"prompt\": \"p\"}\n", "without \"completion\""),
            ("{\"text\": \"a\"}\n{\"prompt\": \"p\", \"completion\": \"c\"}\n", "mixes"),
            ("{\"text\": \"a\"}\nnot json\n", "expected"),
            ("{\"text\": \"a\"}\n{\"text\": \"a\", \"prompt\": \"p\"}\n", "not both"),
        ];
        for (text, want) in cases {
            let (_d, p) = write("a.jsonl", text);
            let err = read_sft_records(&p).unwrap_err().to_string();
            assert!(err.contains("line 2") && err.contains(want), "{err}");
        }
        let (_d, p) = write("a.txt", "\n\n");
        assert!(read_sft_records(&p).unwrap_err().to_string().contains("no rows"));
    }

    #[test]
    fn reward_records_both_modes_and_errors() {
        let (_d, p) =
            write("r.jsonl", "{\"text\": \"a\", \"label\": \"POS\"}\n{\"text\": \"b\", \"label\": 0}\n");
        let r = read_reward_records(&p).unwrap();
        assert_eq!(r[0], RewardRecord::Labelled { text: "a".into(), label: Label::Name("POS".into()) });
        assert_eq!(r[1], RewardRecord::Labelled { text: "b".into(), label: Label::Index(0) });
        let (_d, p) = write("r.jsonl", "{\"prompt\": \"q \", \"chosen\": \"a\", \"rejected\": \"b\"}\n");
        assert!(read_reward_records(&p).unwrap()[0].is_preference());
        let cases = [
            ("{\"text\": \"b\", \"label\": -1}", "non-negative integer"),
            ("{\"text\": \"b\", \"label\": 1.5}", "non-negative integer"),
            ("{\"chosen\": \"a\"}", "without \"rejected\""),
            ("{\"chosen\": \"a\", \"rejected\": \"b\"}", "mixes"),
            ("{\"text\": \"a\", \"label\": 0, \"chosen\": \"a\"}", "not both"),
        ];
        for (line, want) in cases {
            let (_d, p) = write("r.jsonl", &format!("{{\"text\": \"a\", \"label\": 1}}\n{line}\n"));
            let err = read_reward_records(&p).unwrap_err().to_string();
            assert!(err.contains("line 2") && err.contains(want), "{err}");
        }
    }

    #[test]
    fn eval_split_is_seeded_disjoint_and_checked() {
        let (train, eval) = split_eval(10, 0.2, 7).unwrap();
        assert_eq!((train.len(), eval.len()), (8, 2));
        assert!(eval.iter().all(|i| !train.contains(i)));
        assert_eq!(split_eval(10, 0.2, 7).unwrap().1, eval);
        assert_ne!(split_eval(10, 0.5, 8).unwrap().1, split_eval(10, 0.5, 9).unwrap().1);
        assert_eq!(split_eval(3, 0.01, 0).unwrap().1.len(), 1);
        assert_eq!(split_eval(3, 0.0, 0).unwrap().0, vec![0, 1, 2]);
        let err = split_eval(1, 0.1, 0).unwrap_err().to_string();
        assert!(err.contains("training.eval_fraction"), "{err}");
    }
}
