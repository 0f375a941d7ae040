//! Sampled rows as OpenAI responses: text, stop strings, `finish_reason`, `logprobs`, token ids
//! and `usage`.
//!
//! A choice's text is its ids decoded without special tokens (EOS is not in the text; it is in
//! `token_ids`, with its logprob). A stop string ends the text before it; `token_ids` and the
//! logprobs then run to the token that completed it. Token strings in `logprobs` are each id
//! decoded alone with special tokens kept (a byte-level token that is part of a UTF-8 character
//! decodes to U+FFFD); `bytes` are that string's UTF-8 bytes.

use rltune::tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::error::ApiError;
use super::worker::RowOut;

/// One finished choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The text (stop string and special tokens not included).
    pub text: String,
    /// The row, cut after the token that completed a stop string.
    pub row: RowOut,
    /// `"stop"` (EOS or a stop string) or `"length"` (`max_tokens` reached).
    pub finish: &'static str,
}

/// Decodes `row`, applies the stop strings and says why it ended.
pub fn finish_row(
    tok: &Tokenizer,
    eos: &[u32],
    stop: &[String],
    max_tokens: usize,
    mut row: RowOut,
) -> Result<Choice, ApiError> {
    let decode = |ids: &[u32]| tok.decode(ids).map_err(|e| ApiError::internal(e.to_string()));
    let text = decode(&row.ids)?;
    let first_stop = stop.iter().filter_map(|s| text.find(s.as_str()).map(|p| (p, s))).min();
    if let Some((at, _)) = first_stop {
        // The first prefix of the ids whose text holds a stop string.
        let mut k = row.ids.len();
        for n in 1..=row.ids.len() {
            let prefix = decode(&row.ids[..n])?;
            if stop.iter().any(|s| prefix.contains(s.as_str())) {
                k = n;
                break;
            }
        }
        row.ids.truncate(k);
        row.logprobs.truncate(k);
        row.top.truncate(k);
        return Ok(Choice { text: text[..at].to_string(), row, finish: "stop" });
    }
    let finish = match row.ids.last() {
        Some(last) if eos.contains(last) => "stop",
        _ if row.ids.len() >= max_tokens => "length",
        _ => "stop",
    };
    Ok(Choice { text, row, finish })
}

/// `usage`: each prompt counted once, every choice's tokens.
pub fn usage(prompt_lens: &[usize], choices: &[Choice]) -> Value {
    let prompt: usize = prompt_lens.iter().sum();
    let completion: usize = choices.iter().map(|c| c.row.ids.len()).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// One id as a string: decoded alone, special tokens kept.
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.inner().decode(&[id], false).unwrap_or_default()
}

/// The legacy completions `logprobs` object: `tokens`, `token_logprobs`, `top_logprobs` (a
/// `{token: logprob}` map per position, or null when no alternatives were asked for) and
/// `text_offset` (each token's start, in characters of the token strings before it).
pub fn completion_logprobs(tok: &Tokenizer, c: &Choice, k: usize) -> Value {
    let tokens: Vec<String> = c.row.ids.iter().map(|&id| token_text(tok, id)).collect();
    let mut offset = 0usize;
    let text_offset: Vec<usize> = tokens
        .iter()
        .map(|t| {
            let at = offset;
            offset += t.chars().count();
            at
        })
        .collect();
    let top = (k > 0).then(|| {
        c.row
            .top
            .iter()
            .map(|alts| {
                let map: serde_json::Map<String, Value> =
                    alts.iter().map(|&(id, lp)| (token_text(tok, id), json!(lp))).collect();
                Value::Object(map)
            })
            .collect::<Vec<_>>()
    });
    json!({"tokens": tokens, "token_logprobs": c.row.logprobs, "top_logprobs": top, "text_offset": text_offset})
}

/// The chat `logprobs` object: `content`, one `{token, logprob, bytes, top_logprobs}` per token.
pub fn chat_logprobs(tok: &Tokenizer, c: &Choice) -> Value {
    let entry = |id: u32, lp: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = c
        .row
        .ids
        .iter()
        .zip(&c.row.logprobs)
        .enumerate()
        .map(|(i, (&id, &lp))| {
            let mut e = entry(id, lp);
            let alts = c.row.top.get(i).map_or(&[][..], Vec::as_slice);
            e["top_logprobs"] = alts.iter().map(|&(a, alp)| entry(a, alp)).collect::<Vec<_>>().into();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer over a few words, with `<eos>` special.
    fn tokenizer() -> Tokenizer {
        let json = json!({
            "version": "1.0",
            "added_tokens": [{"id": 0, "content": "<eos>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "pre_tokenizer": {"type": "Whitespace"},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
            "model": {"type": "WordLevel", "vocab": {"<eos>": 0, "a": 1, "b": 2, "STOP": 3, "c": 4},
                      "unk_token": "<eos>"}
        });
        let inner = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
        Tokenizer::from_inner(inner)
    }

    fn row(ids: &[u32]) -> RowOut {
        RowOut { ids: ids.to_vec(), logprobs: ids.iter().map(|&i| -(i as f32)).collect(), top: Vec::new() }
    }

    #[test]
    fn finish_reasons_eos_length_and_stop_strings() {
        let tok = tokenizer();
        let c = finish_row(&tok, &[0], &[], 5, row(&[1, 2, 0])).unwrap();
        assert_eq!((c.text.as_str(), c.finish, c.row.ids.len()), ("a b", "stop", 3), "EOS kept in the ids");
        let c = finish_row(&tok, &[0], &[], 3, row(&[1, 2, 4])).unwrap();
        assert_eq!((c.text.as_str(), c.finish), ("a b c", "length"));
        let c = finish_row(&tok, &[0], &["STOP".into(), "c".into()], 9, row(&[1, 3, 2, 4])).unwrap();
        assert_eq!((c.text.as_str(), c.finish), ("a ", "stop"));
        assert_eq!((c.row.ids.clone(), c.row.logprobs.clone()), (vec![1, 3], vec![-1.0, -3.0]));
    }

    #[test]
    fn logprobs_objects() {
        let tok = tokenizer();
        let mut r = row(&[1, 2]);
        r.top = vec![vec![(1, -0.1), (4, -2.0)], vec![(2, -0.2), (1, -1.5)]];
        let c = finish_row(&tok, &[0], &[], 2, r).unwrap();
        let v = completion_logprobs(&tok, &c, 2);
        assert_eq!(v["tokens"], json!(["a", "b"]));
        assert_eq!(v["text_offset"], json!([0, 1]));
        assert_eq!(v["top_logprobs"][0], json!({"a": -0.1f32, "c": -2.0f32}));
        assert_eq!(completion_logprobs(&tok, &c, 0)["top_logprobs"], Value::Null);
        let v = chat_logprobs(&tok, &c);
        assert_eq!(v["content"][1]["token"], "b");
        assert_eq!(v["content"][1]["bytes"], json!([98]));
        assert_eq!(v["content"][1]["top_logprobs"][1]["token"], "a");
        let u = usage(&[4], std::slice::from_ref(&c));
        assert_eq!(u, json!({"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}));
    }
}
