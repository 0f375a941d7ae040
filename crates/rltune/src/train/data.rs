//! Training data: SFT texts and prompt/completion pairs, labelled texts and preference pairs,
//! read from files with errors that name the file and line; and the seeded eval split.
//!
//! | file | one example per line |
//! |---|---|
//! | `*.txt` | a line of text (empty lines are skipped) |
//! | `*.jsonl` (SFT) | `{"text": ...}` or `{"prompt": ..., "completion": ...}` |
//! | `*.jsonl` (reward) | `{"text": ..., "label": "POSITIVE" \| 0}` or `{"chosen": ..., "rejected": ...}`, optional `"prompt"` |
//!
//! Other fields in a JSON line are ignored (datasets often carry ids and metadata). A file holds
//! one kind of example: the first line decides, and a line of the other kind is an error.

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Deserialize;

use crate::error::{Error, Result};

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
        matches!(self, RewardRecord::Preference { .. })
    }
}

#[derive(Deserialize)]
struct SftLine {
    text: Option<String>,
    prompt: Option<String>,
    completion: Option<String>,
}

#[derive(Deserialize)]
struct RewardLine {
    text: Option<String>,
    label: Option<serde_json::Value>,
    prompt: Option<String>,
    chosen: Option<String>,
    rejected: Option<String>,
}

/// The non-empty lines of `path` with their 1-based numbers.
fn lines(path: &Path) -> Result<Vec<(usize, String)>> {
    let text = crate::data::read_utf8(path)?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect())
}

fn is_txt(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("txt"))
}

/// Fails unless the file holds at least one example.
fn non_empty<T>(path: &Path, v: Vec<T>) -> Result<Vec<T>> {
    if v.is_empty() {
        return Err(Error::Input(format!(
            "{}: no examples (the file has no non-empty line)",
            path.display()
        )));
    }
    Ok(v)
}

/// Reads SFT examples: a `.txt` file (one example per non-empty line) or JSON lines.
pub fn read_sft_records(path: &Path) -> Result<Vec<SftRecord>> {
    let lines = lines(path)?;
    if is_txt(path) {
        return non_empty(path, lines.into_iter().map(|(_, l)| SftRecord::Text(l)).collect());
    }
    let mut out = Vec::with_capacity(lines.len());
    for (n, raw) in lines {
        let at = |msg: String| Error::Input(format!("{} line {n}: {msg}", path.display()));
        let line: SftLine = serde_json::from_str(&raw).map_err(|e| {
            at(format!(
                "{}; expected {{\"text\": \"..\"}} or {{\"prompt\": \"..\", \"completion\": \"..\"}} (a .txt \
                 file is read as one example per line)",
                not_a_string(&raw, &["text", "prompt", "completion"]).unwrap_or_else(|| e.to_string())
            ))
        })?;
        let rec = match (line.text, line.prompt, line.completion) {
            (Some(t), None, None) => SftRecord::Text(t),
            (None, Some(prompt), Some(completion)) => SftRecord::PromptCompletion { prompt, completion },
            (Some(_), _, _) => {
                return Err(at("give either \"text\" or \"prompt\" + \"completion\", not both".into()))
            }
            (None, Some(_), None) => return Err(at("\"prompt\" without \"completion\"".into())),
            (None, None, Some(_)) => return Err(at("\"completion\" without \"prompt\"".into())),
            (None, None, None) => {
                return Err(at("missing \"text\" (or \"prompt\" and \"completion\")".into()))
            }
        };
        if let Some(prev) = out.last() {
            if std::mem::discriminant(prev) != std::mem::discriminant(&rec) {
                return Err(at(
                    "mixes plain-text and prompt/completion examples; use one kind per file".into()
                ));
            }
        }
        out.push(rec);
    }
    non_empty(path, out)
}

/// Reads reward-model examples from JSON lines: labelled texts or preference pairs.
pub fn read_reward_records(path: &Path) -> Result<Vec<RewardRecord>> {
    let mut out: Vec<RewardRecord> = Vec::new();
    for (n, raw) in lines(path)? {
        let at = |msg: String| Error::Input(format!("{} line {n}: {msg}", path.display()));
        let line: RewardLine = serde_json::from_str(&raw).map_err(|e| {
            at(format!(
                "{}; expected {{\"text\": \"..\", \"label\": \"NAME\" or index}} or \
                 {{\"chosen\": \"..\", \"rejected\": \"..\"}} (optional \"prompt\")",
                not_a_string(&raw, &["text", "prompt", "chosen", "rejected"])
                    .unwrap_or_else(|| e.to_string())
            ))
        })?;
        let rec = reward_record(line).map_err(at)?;
        if out.first().is_some_and(|first| first.is_preference() != rec.is_preference()) {
            return Err(at("mixes labelled texts and preference pairs; use one kind per file".into()));
        }
        out.push(rec);
    }
    non_empty(path, out)
}

/// For a line that is a JSON object but failed to parse: which of the string `fields` holds
/// something else (serde's message gives only the column), e.g. `"text" is 7, not a string`.
fn not_a_string(raw: &str, fields: &[&str]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(raw).ok()?;
    let obj = v.as_object()?;
    fields.iter().find_map(|&f| {
        let x = obj.get(f).filter(|x| !x.is_string() && !x.is_null())?;
        let mut shown = x.to_string();
        if shown.len() > 100 {
            shown = format!("a {}-byte {}", shown.len(), if x.is_array() { "array" } else { "value" });
        }
        Some(format!("field \"{f}\" is {shown}, not a string"))
    })
}

fn reward_record(line: RewardLine) -> std::result::Result<RewardRecord, String> {
    match (line.text, line.label, line.chosen, line.rejected) {
        (Some(text), Some(label), None, None) => {
            if line.prompt.is_some() {
                return Err("\"prompt\" goes with preference pairs; prepend it to \"text\" instead".into());
            }
            let label: Label = serde_json::from_value(label.clone()).map_err(|_| {
                format!("label {label} must be a class name (\"POSITIVE\") or a non-negative integer index")
            })?;
            Ok(RewardRecord::Labelled { text, label })
        }
        (None, None, Some(chosen), Some(rejected)) => {
            Ok(RewardRecord::Preference { prompt: line.prompt, chosen, rejected })
        }
        (Some(_), None, _, _) => Err("\"text\" without \"label\"".into()),
        (None, Some(_), _, _) => Err("\"label\" without \"text\"".into()),
        (None, None, Some(_), None) => Err("\"chosen\" without \"rejected\"".into()),
        (None, None, None, Some(_)) => Err("\"rejected\" without \"chosen\"".into()),
        (None, None, None, None) => Err("missing \"text\" + \"label\" or \"chosen\" + \"rejected\"".into()),
        _ => Err("give either \"text\" + \"label\" or \"chosen\" + \"rejected\", not both".into()),
    }
}

/// Splits `0..n` into (train, eval) indices: a seeded shuffle, then `round(n · fraction)` eval
/// examples (at least one when `fraction > 0`). Both lists come back sorted.
///
/// Fails when the split would leave no training example; the message names
/// `training.eval_fraction`.
pub fn split_eval(n: usize, fraction: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>)> {
    let n_eval = if fraction > 0.0 { ((n as f64 * fraction).round() as usize).max(1) } else { 0 };
    if n_eval >= n {
        return Err(Error::Input(format!(
            "training.eval_fraction = {fraction} leaves no training example out of {n}; lower it (or set it \
             to 0 for no eval split), or add data"
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
        assert!(read_sft_records(&p).unwrap_err().to_string().contains("no examples"));
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
