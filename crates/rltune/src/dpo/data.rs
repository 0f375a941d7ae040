//! Preference data for DPO: reading `{"prompt", "chosen", "rejected"}` rows (or the tokenized
//! `prompt_ids`, `chosen_ids`, `rejected_ids`) from any dataset [`crate::data::rows`] reads,
//! tokenizing them as TRL 1.16.0's `DPOTrainer._prepare_dataset` does, and the checks that name
//! the row at fault.
//!
//! Rows without `prompt` have it extracted as TRL's `extract_prompt` does (the longest common
//! prefix of `chosen` and `rejected`: shared turns of a conversation, or characters of text).
//! Conversational rows (message lists) are tokenized through the model's chat template: the
//! prompt with `add_generation_prompt=True`, `prompt + chosen` and `prompt + rejected` without;
//! no EOS is added (the template writes the end of turn).
//!
//! TRL's preparation of a text row: append the tokenizer's EOS token (as text) to `chosen` and
//! `rejected` unless they end with it; tokenize `prompt`, `prompt + chosen` and
//! `prompt + rejected` (with the tokenizer's special tokens); the completion starts where the
//! prompt's tokens stop being a prefix of both (`common_prefix_length`). Rows whose prompt alone
//! fills `max_length` are dropped under `keep_start` truncation (no completion token would be
//! left). Tokenized rows are taken as they are: no EOS is added.

use std::path::Path;

use serde_json::Value;

use super::config::{DpoConfig, TruncationMode};
use crate::data::chat::{self, Content};
use crate::data::rows::{read_rows, DataOptions};
use crate::error::{Error, Result};
use crate::models::chat_template::{ChatTemplate, RenderOptions};
use crate::tokenizer::Tokenizer;

/// One preference row as written in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum PreferenceText {
    /// Conversations (lists of messages), rendered with the chat template.
    Chat {
        /// The prompt's messages.
        prompt: Value,
        /// The preferred continuation's messages.
        chosen: Value,
        /// The other continuation's messages.
        rejected: Value,
    },
    /// Text, tokenized by the trainer.
    Text {
        /// The prompt.
        prompt: String,
        /// The preferred completion.
        chosen: String,
        /// The other completion.
        rejected: String,
    },
    /// Token ids, used as they are.
    Ids {
        /// Prompt ids.
        prompt: Vec<u32>,
        /// Chosen completion ids.
        chosen: Vec<u32>,
        /// Rejected completion ids.
        rejected: Vec<u32>,
    },
}

/// A row of a preference file: the pair, its line and optional precomputed reference logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceRecord {
    /// Where the row is, for messages (e.g. `prefs.jsonl line 7`, `data.parquet row 3`).
    pub origin: String,
    /// The pair.
    pub pair: PreferenceText,
    /// `(ref_chosen_logps, ref_rejected_logps)`, TRL's precomputed columns.
    pub ref_logps: Option<(f64, f64)>,
}

/// A tokenized preference pair, ready for a step (untruncated: the step truncates, as TRL's
/// collator does).
#[derive(Debug, Clone, PartialEq)]
pub struct PreferencePair {
    /// Prompt ids.
    pub prompt_ids: Vec<u32>,
    /// Chosen completion ids.
    pub chosen_ids: Vec<u32>,
    /// Rejected completion ids.
    pub rejected_ids: Vec<u32>,
    /// The reference's summed logprobs of (chosen, rejected), when precomputed.
    pub ref_logps: Option<(f64, f64)>,
    /// Where the pair comes from, for messages (e.g. `data.jsonl line 7`, or `row 3`).
    pub origin: String,
}

/// Reads a preference file of JSON lines (or any format [`read_preference_data`] reads); every
/// problem names the file, line and field.
pub fn read_preference_records(path: &Path) -> Result<Vec<PreferenceRecord>> {
    read_preference_data(&path.to_string_lossy(), &DataOptions::default())
}

/// Reads preference rows from a file, directory or hub dataset ([`crate::data::rows::read_rows`]),
/// with the split and column mapping of `opts`.
pub fn read_preference_data(source: &str, opts: &DataOptions) -> Result<Vec<PreferenceRecord>> {
    let rows = read_rows(source, opts)?;
    let mut out = Vec::new();
    for row in rows {
        let at = |msg: String| Error::data(&row.origin, msg);
        let record = parse_record(&row.fields, &row.origin).map_err(at)?;
        out.push(record);
    }
    let kind = |r: &PreferenceRecord| match r.pair {
        PreferenceText::Text { .. } => 0,
        PreferenceText::Ids { .. } => 1,
        PreferenceText::Chat { .. } => 2,
    };
    if let Some(r) = out.iter().find(|r| kind(r) != kind(&out[0])) {
        return Err(Error::data(&r.origin, "mixes text rows (\"prompt\"), tokenized rows (\"prompt_ids\") and conversations (message lists); \
             use one kind per file"));
    }
    Ok(out)
}

const EXPECTED: &str = "{\"prompt\": \"..\", \"chosen\": \"..\", \"rejected\": \"..\"} or {\"prompt_ids\": [..], \
                        \"chosen_ids\": [..], \"rejected_ids\": [..]}, optionally with \"ref_chosen_logps\" and \
                        \"ref_rejected_logps\"";

fn parse_record(
    obj: &serde_json::Map<String, Value>,
    origin: &str,
) -> std::result::Result<PreferenceRecord, String> {
    let text = obj.contains_key("prompt") || obj.contains_key("chosen") || obj.contains_key("rejected");
    let ids =
        obj.contains_key("prompt_ids") || obj.contains_key("chosen_ids") || obj.contains_key("rejected_ids");
    let pair = match (text, ids) {
        (true, true) => {
            return Err(
                "give either \"prompt\"/\"chosen\"/\"rejected\" or their \"_ids\" forms, not both".into()
            )
        }
        (false, false) => return Err(format!("no preference fields; expected {EXPECTED}")),
        (true, false) => text_or_chat(obj, origin)?,
        (false, true) => {
            let v = |f: &str| -> std::result::Result<Vec<u32>, String> {
                let arr = match obj.get(f) {
                    None => return Err(format!("missing field \"{f}\" (tokenized rows need \"prompt_ids\", \"chosen_ids\" and \"rejected_ids\")")),
                    Some(Value::Array(a)) => a,
                    Some(other) => return Err(format!("field \"{f}\" is {}, not an array of token ids", short(other))),
                };
                arr.iter()
                    .map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| format!("field \"{f}\" holds something other than non-negative token ids"))
            };
            PreferenceText::Ids {
                prompt: v("prompt_ids")?,
                chosen: v("chosen_ids")?,
                rejected: v("rejected_ids")?,
            }
        }
    };
    let num = |f: &str| -> std::result::Result<Option<f64>, String> {
        match obj.get(f) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| format!("field \"{f}\" is not a finite number")),
            Some(other) => Err(format!("field \"{f}\" is {}, not a finite number", short(other))),
        }
    };
    let ref_logps = match (num("ref_chosen_logps")?, num("ref_rejected_logps")?) {
        (Some(c), Some(r)) => Some((c, r)),
        (None, None) => None,
        (Some(_), None) => {
            return Err("\"ref_chosen_logps\" without \"ref_rejected_logps\"; give both or neither".into())
        }
        (None, Some(_)) => {
            return Err("\"ref_rejected_logps\" without \"ref_chosen_logps\"; give both or neither".into())
        }
    };
    let (chosen_empty, rejected_empty) = match &pair {
        PreferenceText::Text { chosen, rejected, .. } => (chosen.is_empty(), rejected.is_empty()),
        PreferenceText::Ids { chosen, rejected, .. } => (chosen.is_empty(), rejected.is_empty()),
        PreferenceText::Chat { .. } => (false, false),
    };
    for (empty, f) in [(chosen_empty, "chosen"), (rejected_empty, "rejected")] {
        if empty {
            return Err(format!(
                "\"{f}\" is empty; each completion needs at least one token (an empty preferred or rejected answer \
                 is almost always a data bug: fix or drop the row)"
            ));
        }
    }
    if let PreferenceText::Chat { chosen, rejected, .. } = &pair {
        for (v, f) in [(chosen, "chosen"), (rejected, "rejected")] {
            if v.as_array().is_some_and(|a| a.is_empty()) {
                return Err(format!(
                    "\"{f}\" has no message once the shared prompt is taken out; each completion needs at least \
                     one message (fix or drop the row)"
                ));
            }
        }
    }
    Ok(PreferenceRecord { origin: origin.to_string(), pair, ref_logps })
}

/// A row of text or conversations: `prompt`, `chosen`, `rejected` all strings, or all message
/// lists; without `prompt`, TRL's `extract_prompt` takes it from `chosen` and `rejected`.
fn text_or_chat(
    obj: &serde_json::Map<String, Value>,
    origin: &str,
) -> std::result::Result<PreferenceText, String> {
    let field = |f: &str| -> std::result::Result<Content, String> {
        match obj.get(f) {
            None => Err(format!(
                "missing field \"{f}\" (rows need \"chosen\" and \"rejected\", and \"prompt\" \
                                 unless it is the start of both)"
            )),
            Some(Value::String(s)) => Ok(Content::Text(s.clone())),
            Some(v @ Value::Array(_)) => {
                chat::check_messages(v, origin, f)
                    .map_err(|e| e.to_string().replace(&format!("{origin}: "), ""))?;
                Ok(Content::Chat(v.clone()))
            }
            Some(other) => {
                Err(format!("field \"{f}\" is {}, not a string (nor a list of messages)", short(other)))
            }
        }
    };
    let (chosen, rejected) = (field("chosen")?, field("rejected")?);
    let (prompt, chosen, rejected) = match obj.get("prompt") {
        Some(_) => (field("prompt")?, chosen, rejected),
        None => chat::extract_prompt(&chosen, &rejected).map_err(|e| e.to_string())?,
    };
    match (prompt, chosen, rejected) {
        (Content::Text(prompt), Content::Text(chosen), Content::Text(rejected)) => {
            Ok(PreferenceText::Text { prompt, chosen, rejected })
        }
        (Content::Chat(prompt), Content::Chat(chosen), Content::Chat(rejected)) => {
            Ok(PreferenceText::Chat { prompt, chosen, rejected })
        }
        _ => {
            Err("\"prompt\", \"chosen\" and \"rejected\" must all be text or all be lists of messages".into())
        }
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("a {}-byte value", s.len())
    } else {
        s
    }
}

/// The pairs a run trains on, and what preparing them found.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedPairs {
    /// The pairs kept.
    pub pairs: Vec<PreferencePair>,
    /// Origins of the rows dropped because their prompt fills `max_length` (TRL drops them too).
    pub dropped: Vec<String>,
    /// Origins of the pairs whose chosen and rejected sequences are identical after truncation:
    /// TRL trains on them, but they give no gradient and lower `rewards/accuracies`.
    pub identical: Vec<String>,
}

/// Tokenizes `records` as TRL does (see the module docs), drops the rows TRL drops and reports
/// identical pairs. `eos` is the token appended to text completions (the model's EOS).
pub fn prepare_pairs(
    records: &[PreferenceRecord],
    tokenizer: Option<&Tokenizer>,
    eos: Option<u32>,
    cfg: &DpoConfig,
    _source: &Path,
) -> Result<PreparedPairs> {
    prepare_pairs_with(records, tokenizer, None, eos, cfg)
}

/// [`prepare_pairs`] with the model's chat template, which conversational rows need.
pub fn prepare_pairs_with(
    records: &[PreferenceRecord],
    tokenizer: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    eos: Option<u32>,
    cfg: &DpoConfig,
) -> Result<PreparedPairs> {
    let mut out = PreparedPairs { pairs: Vec::new(), dropped: Vec::new(), identical: Vec::new() };
    for rec in records {
        let origin = rec.origin.clone();
        let (prompt_ids, chosen_ids, rejected_ids) = match &rec.pair {
            PreferenceText::Ids { prompt, chosen, rejected } => {
                (prompt.clone(), chosen.clone(), rejected.clone())
            }
            PreferenceText::Text { prompt, chosen, rejected } => {
                let tok = tokenizer.ok_or_else(|| {
                    Error::data(&origin, "a text row needs a tokenizer, but the model has no tokenizer.json; add one, or give \
                         tokenized rows (\"prompt_ids\", \"chosen_ids\", \"rejected_ids\")")
                })?;
                tokenize_text(tok, eos, prompt, chosen, rejected).map_err(|e| Error::data(&origin, e))?
            }
            PreferenceText::Chat { prompt, chosen, rejected } => {
                let tok = tokenizer.ok_or_else(|| {
                    Error::data(
                        &origin,
                        "a conversational row needs a tokenizer, but the model has no tokenizer.json",
                    )
                })?;
                let template = template.ok_or_else(|| chat::no_template(&origin))?;
                tokenize_chat(tok, template, prompt, chosen, rejected).map_err(|e| Error::data(&origin, e))?
            }
        };
        let pair = PreferencePair { prompt_ids, chosen_ids, rejected_ids, ref_logps: rec.ref_logps, origin };
        if cfg.truncation_mode == TruncationMode::KeepStart
            && cfg.max_len().is_some_and(|m| pair.prompt_ids.len() >= m)
        {
            out.dropped.push(pair.origin);
            continue;
        }
        if truncated_sequences_equal(&pair, cfg) {
            out.identical.push(pair.origin.clone());
        }
        out.pairs.push(pair);
    }
    Ok(out)
}

/// TRL `_prepare_dataset`'s `add_eos` and `tokenize_fn` for a non-conversational row.
fn tokenize_text(
    tok: &Tokenizer,
    eos: Option<u32>,
    prompt: &str,
    chosen: &str,
    rejected: &str,
) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let eos_text = match eos {
        Some(id) => Some(tok.inner().id_to_token(id).ok_or_else(|| {
            Error::Tokenizer(format!("the model's eos_token_id {id} is not in the tokenizer's vocabulary"))
        })?),
        None => None,
    };
    let with_eos = |s: &str| match &eos_text {
        Some(e) if !s.ends_with(e.as_str()) => format!("{s}{e}"),
        _ => s.to_string(),
    };
    let (chosen, rejected) = (with_eos(chosen), with_eos(rejected));
    let p = tok.encode_with(prompt, true)?;
    let pc = tok.encode_with(&format!("{prompt}{chosen}"), true)?;
    let pr = tok.encode_with(&format!("{prompt}{rejected}"), true)?;
    let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let n = common(&p, &pc).min(common(&p, &pr));
    Ok((p[..n].to_vec(), pc[n..].to_vec(), pr[n..].to_vec()))
}

/// TRL `_prepare_dataset`'s `tokenize_fn` for a conversational row: the prompt rendered with
/// the generation prompt, prompt + chosen and prompt + rejected without; the completion starts
/// where the prompt's ids stop being a prefix of both.
fn tokenize_chat(
    tok: &Tokenizer,
    template: &ChatTemplate,
    prompt: &Value,
    chosen: &Value,
    rejected: &Value,
) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let join = |a: &Value, b: &Value| {
        Value::Array(a.as_array().into_iter().chain(b.as_array()).flatten().cloned().collect())
    };
    let gen = RenderOptions { add_generation_prompt: true, continue_final_message: false };
    let p = chat::encode_chat(tok, template, prompt, gen, false)?.ids;
    let pc = chat::encode_chat(tok, template, &join(prompt, chosen), RenderOptions::default(), false)?.ids;
    let pr = chat::encode_chat(tok, template, &join(prompt, rejected), RenderOptions::default(), false)?.ids;
    let n = chat::common_prefix_length(&p, &pc).min(chat::common_prefix_length(&p, &pr));
    Ok((p[..n].to_vec(), pc[n..].to_vec(), pr[n..].to_vec()))
}

/// Prompt+completion as TRL's collator truncates it: the sequence and its completion mask.
pub(crate) fn truncate(prompt: &[u32], completion: &[u32], cfg: &DpoConfig) -> (Vec<u32>, Vec<u8>) {
    let ids = [prompt, completion].concat();
    let mask: Vec<u8> =
        std::iter::repeat_n(0, prompt.len()).chain(std::iter::repeat_n(1, completion.len())).collect();
    match cfg.max_len() {
        Some(m) if ids.len() > m => match cfg.truncation_mode {
            TruncationMode::KeepStart => (ids[..m].to_vec(), mask[..m].to_vec()),
            TruncationMode::KeepEnd => (ids[ids.len() - m..].to_vec(), mask[mask.len() - m..].to_vec()),
        },
        _ => (ids, mask),
    }
}

/// Whether the pair's chosen and rejected sequences are the same after the collator's truncation.
fn truncated_sequences_equal(pair: &PreferencePair, cfg: &DpoConfig) -> bool {
    let c = truncate(&pair.prompt_ids, &pair.chosen_ids, cfg);
    let r = truncate(&pair.prompt_ids, &pair.rejected_ids, cfg);
    c == r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("prefs.jsonl");
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }

    #[test]
    fn reads_text_and_ids_rows() {
        let (_d, p) = write(
            "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\", \"id\": 4}\n\n\
             {\"prompt\": \"x\", \"chosen\": \"y\", \"rejected\": \"z\", \"ref_chosen_logps\": -1.5, \"ref_rejected_logps\": -2}\n",
        );
        let r = read_preference_records(&p).unwrap();
        assert_eq!((r.len(), r[1].ref_logps), (2, Some((-1.5, -2.0))));
        assert!(r[1].origin.ends_with("prefs.jsonl line 3"), "{}", r[1].origin);
        let (_d, p) = write("{\"prompt_ids\": [1, 2], \"chosen_ids\": [3], \"rejected_ids\": [4, 0]}\n");
        let r = read_preference_records(&p).unwrap();
        assert_eq!(
            r[0].pair,
            PreferenceText::Ids { prompt: vec![1, 2], chosen: vec![3], rejected: vec![4, 0] }
        );
    }

    /// Missing fields, wrong types, empty completions, NaN reference logprobs: the error names the
    /// file, the line and the field.
    #[test]
    fn bad_rows_name_file_line_and_field() {
        let good = "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}";
        let cases = [
            ("{\"prompt\": \"a\", \"chosen\": \"b\"}", "missing field \"rejected\""),
            ("{\"prompt\": \"a\", \"chosen\": 3, \"rejected\": \"c\"}", "field \"chosen\" is 3"),
            ("{\"prompt\": \"a\", \"chosen\": \"\", \"rejected\": \"c\"}", "\"chosen\" is empty"),
            ("{\"prompt_ids\": [1], \"chosen_ids\": [2], \"rejected_ids\": []}", "\"rejected\" is empty"),
            ("{\"prompt_ids\": [1], \"chosen_ids\": [-2], \"rejected_ids\": [3]}", "field \"chosen_ids\""),
            ("{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\", \"ref_chosen_logps\": NaN, \"ref_rejected_logps\": 1}", "NaN"),
            ("{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\", \"ref_chosen_logps\": null, \"ref_rejected_logps\": 1}", "\"ref_chosen_logps\""),
            ("{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\", \"ref_chosen_logps\": 1}", "without \"ref_rejected_logps\""),
            ("{\"prompt\": [{\"role\": \"user\"}], \"chosen\": \"b\", \"rejected\": \"c\"}", "all be text or all be lists"),
            ("{\"prompt\": \"a\", \"chosen\": [{\"content\": \"b\"}], \"rejected\": \"c\"}", "string \"role\""),
            ("[1, 2]", "must be a JSON object"),
        ];
        for (line, want) in cases {
            let (_d, p) = write(&format!("{good}\n{line}\n"));
            let err = read_preference_records(&p).unwrap_err().to_string();
            assert!(err.contains("prefs.jsonl line 2") && err.contains(want), "{line}: {err}");
        }
        // Without "prompt": TRL's implicit prompt, the shared start of chosen and rejected.
        let (_d, p) = write("{\"chosen\": \"Sky: blue\", \"rejected\": \"Sky: red\"}\n");
        let r = read_preference_records(&p).unwrap();
        let want =
            PreferenceText::Text { prompt: "Sky:".into(), chosen: " blue".into(), rejected: " red".into() };
        assert_eq!(r[0].pair, want);
        let (_d, p) =
            write(&format!("{good}\n{{\"prompt_ids\": [1], \"chosen_ids\": [2], \"rejected_ids\": [3]}}\n"));
        assert!(read_preference_records(&p).unwrap_err().to_string().contains("mixes"));
    }

    #[test]
    fn prompts_that_fill_max_length_are_dropped_and_identical_pairs_reported() {
        let rec = |line, prompt: Vec<u32>, chosen: Vec<u32>, rejected: Vec<u32>| PreferenceRecord {
            origin: format!("d.jsonl line {line}"),
            pair: PreferenceText::Ids { prompt, chosen, rejected },
            ref_logps: None,
        };
        let records = vec![
            rec(1, vec![1, 2, 3, 4], vec![5], vec![6]),
            rec(2, vec![1], vec![5, 5], vec![5, 5]),
            // Equal only after truncation to 4 tokens.
            rec(3, vec![1, 2], vec![7, 8, 9], vec![7, 8, 1]),
            rec(4, vec![1, 2], vec![7], vec![8]),
        ];
        let cfg = DpoConfig { max_length: super::super::config::MaxLength::Tokens(4), ..Default::default() };
        let p = prepare_pairs(&records, None, None, &cfg, Path::new("d.jsonl")).unwrap();
        assert_eq!(p.dropped, vec!["d.jsonl line 1"]);
        assert_eq!(p.identical, vec!["d.jsonl line 2", "d.jsonl line 3"]);
        assert_eq!(p.pairs.len(), 3);
        // keep_end keeps every row.
        let cfg = DpoConfig { truncation_mode: TruncationMode::KeepEnd, ..cfg };
        assert_eq!(prepare_pairs(&records, None, None, &cfg, Path::new("d.jsonl")).unwrap().pairs.len(), 4);
    }
}
