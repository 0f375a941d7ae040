//! Rollout files: JSON lines of `(query, response, score)` produced anywhere (people, other
//! systems), for one PPO update with `rltune ppo-step`.
//!
//! Each line is `{"query_ids": [...], "response_ids": [...], "score": <float>}` or
//! `{"query": "...", "response": "...", "score": <float>}` (text is tokenized with the model's
//! tokenizer). Every problem is reported with the file and line number.

use std::path::Path;

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// One rollout, tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// Query token ids.
    pub query_ids: Vec<u32>,
    /// Response token ids.
    pub response_ids: Vec<u32>,
    /// The score of the response.
    pub score: f32,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    query_ids: Option<Vec<u32>>,
    response_ids: Option<Vec<u32>>,
    query: Option<String>,
    response: Option<String>,
    score: f64,
}

/// Reads and checks a rollouts file: ids below `vocab_size`, non-empty responses, finite scores.
pub fn read_rollouts(path: &Path, tokenizer: Option<&Tokenizer>, vocab_size: usize) -> Result<Vec<Rollout>> {
    let text = super::read_utf8(path)?;
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let at = |msg: String| Error::data(format!("{} line {n}", path.display()), msg);
        if raw.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(raw).map_err(|e| {
            // JSON has no NaN or Infinity, so a bare one fails to parse; a text that merely
            // mentions the word parses, and is not refused here.
            if e.is_syntax() && (raw.contains("NaN") || raw.contains("Infinity")) {
                return at("score is NaN or infinite; every score must be a finite number".into());
            }
            at(format!(
                "{e}; expected {{\"query_ids\": [..], \"response_ids\": [..], \"score\": x}} \
                 or {{\"query\": \"..\", \"response\": \"..\", \"score\": x}}"
            ))
        })?;
        let ids = |ids: Option<Vec<u32>>, text: Option<String>, field: &str| -> Result<Vec<u32>> {
            match (ids, text) {
                (Some(ids), None) => Ok(ids),
                (None, Some(text)) => match tokenizer {
                    Some(t) => Ok(t.encode(&text)?),
                    None => Err(at(format!(
                        "\"{field}\" is text but the model has no tokenizer.json; give \"{field}_ids\" instead"
                    ))),
                },
                (Some(_), Some(_)) => Err(at(format!("give either \"{field}\" or \"{field}_ids\", not both"))),
                (None, None) => Err(at(format!("missing \"{field}_ids\" (or \"{field}\" text)"))),
            }
        };
        let query_ids = ids(line.query_ids, line.query, "query")?;
        let response_ids = ids(line.response_ids, line.response, "response")?;
        if query_ids.is_empty() {
            return Err(at(
                "empty query; every rollout needs the prompt it answered (at least one token)".into()
            ));
        }
        if response_ids.is_empty() {
            return Err(at("empty response; PPO needs at least one response token".into()));
        }
        if let Some(bad) = query_ids.iter().chain(&response_ids).find(|&&t| t as usize >= vocab_size) {
            return Err(at(format!("token id {bad} is not below the model's vocab_size {vocab_size}")));
        }
        if !line.score.is_finite() || line.score.abs() > f32::MAX as f64 {
            return Err(at(format!("score {} is not a finite f32", line.score)));
        }
        out.push(Rollout { query_ids, response_ids, score: line.score as f32 });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Vec<Rollout>> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        std::fs::write(&p, text).unwrap();
        read_rollouts(&p, None, 10)
    }

    #[test]
    fn reads_id_lines_and_names_bad_lines() {
        let ok = read("{\"query_ids\": [1], \"response_ids\": [2, 3], \"score\": 0.5}\n\n").unwrap();
        assert_eq!(ok[0].response_ids, vec![2, 3]);
        let cases = [
            ("{\"query_ids\": [1], \"response_ids\": [], \"score\": 1}", "empty response"),
            ("{\"query_ids\": [1], \"response_ids\": [2], \"score\": NaN}", "NaN"),
            ("{\"query_ids\": [1], \"response_ids\": [12], \"score\": 1}", "vocab_size"),
            ("{\"query\": \"hi\", \"response_ids\": [2], \"score\": 1}", "tokenizer.json"),
            ("{\"query_ids\": [1], \"response_ids\": [2]}", "score"),
        ];
        for (line, want) in cases {
            let text = format!("{{\"query_ids\": [1], \"response_ids\": [2], \"score\": 0}}\n{line}\n");
            let err = read(&text).unwrap_err().to_string();
            assert!(err.contains("line 2") && err.contains(want), "{err}");
        }
    }
}
