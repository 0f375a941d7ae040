//! A verifiable reward: 1 when the answer extracted from the completion equals the gold answer
//! in a column of the dataset row, else 0; missing (NaN, TRL's `None`) when the row has no gold
//! answer, so GRPO and RLOO leave this function out for that sample (TRL's `nansum`).
//!
//! Two extraction rules ([`Extract`]):
//! - `first_line` (default): the completion up to its first line break, surrounding whitespace
//!   trimmed, compared as a string with the gold answer (a string, trimmed; or a JSON number,
//!   written as JSON writes it: `85`, `-3`, `2.5`);
//! - `last_number`: the last number in the completion (`-?digits[.digits]`, thousands commas
//!   removed), compared numerically with the gold answer (a number or a numeric string), as
//!   GSM8K graders do; a completion without a number scores 0.
//!
//! The completion is the decoded response, special tokens (EOS) left out.

use super::{FnReward, RewardInput};
use crate::error::{Error, Result};

/// How the answer is read from a completion (`extract` in `[[reward.sources]]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Extract {
    /// The first line, trimmed; compared as a string.
    #[default]
    FirstLine,
    /// The last number; compared numerically.
    LastNumber,
}

/// The answer in `completion` by `rule`: `None` when there is none (`last_number` without a
/// number).
pub fn extract_answer(completion: &str, rule: Extract) -> Option<String> {
    match rule {
        Extract::FirstLine => Some(completion.split(['\n', '\r']).next().unwrap_or("").trim().to_string()),
        Extract::LastNumber => last_number(completion),
    }
}

/// The last `-?\d+(\.\d+)?` in `text` after removing commas between digits.
fn last_number(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut clean = String::with_capacity(text.len());
    for (i, &c) in chars.iter().enumerate() {
        let between_digits =
            i > 0 && chars[i - 1].is_ascii_digit() && chars.get(i + 1).is_some_and(char::is_ascii_digit);
        if !(c == ',' && between_digits) {
            clean.push(c);
        }
    }
    let b = clean.as_bytes();
    let mut last = None;
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = if i > 0 && b[i - 1] == b'-' { i - 1 } else { i };
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
        }
        last = Some(clean[start..i].to_string());
    }
    last
}

/// The gold answer of a row as text: a string (trimmed) or a number as JSON writes it. `None`
/// for an absent or `null` column.
fn gold(meta: &serde_json::Value, column: &str) -> std::result::Result<Option<String>, String> {
    match meta.get(column) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.trim().to_string())),
        Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
        Some(other) => {
            Err(format!("column {column:?} holds {other}; the gold answer must be a string or a number"))
        }
    }
}

/// Whether `answer` matches `gold` under `rule`.
pub fn matches(answer: Option<&str>, gold: &str, rule: Extract) -> bool {
    let Some(answer) = answer else { return false };
    match rule {
        Extract::FirstLine => answer == gold,
        Extract::LastNumber => match (answer.parse::<f64>(), gold.replace(',', "").parse::<f64>()) {
            (Ok(a), Ok(g)) => a == g,
            _ => false,
        },
    }
}

/// The exact-match reward on the gold answer in `column`, named `name` (see the module docs).
/// A row without the column scores NaN (missing); a gold answer that is neither a string nor a
/// number is an error naming the column.
pub fn exact_match_reward(name: &str, column: &str, rule: Extract) -> FnReward {
    let column = column.to_string();
    FnReward::new(name, move |s: &RewardInput| {
        let Some(gold) = gold(s.meta, &column).map_err(|m| Error::data("meta", m))? else {
            return Ok(f32::NAN);
        };
        if rule == Extract::LastNumber && gold.replace(',', "").parse::<f64>().is_err() {
            return Err(Error::data(
                "meta",
                format!(
                    "column {column:?} holds {gold:?}, not a number; extract = \"last_number\" compares \
                     numbers (use extract = \"first_line\" to compare text)"
                ),
            ));
        }
        let answer = extract_answer(s.response, rule);
        Ok(f32::from(u8::from(matches(answer.as_deref(), &gold, rule))))
    })
}

/// [`exact_match_reward`] scores of a batch, for code that has no [`RewardInput`]s.
pub fn exact_match_scores(responses: &[&str], golds: &[&str], rule: Extract) -> Result<Vec<f32>> {
    if responses.len() != golds.len() {
        return Err(Error::argument(
            "golds",
            format!("{} responses but {} gold answers", responses.len(), golds.len()),
        ));
    }
    Ok(responses
        .iter()
        .zip(golds)
        .map(|(r, g)| f32::from(u8::from(matches(extract_answer(r, rule).as_deref(), g.trim(), rule))))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewards::RewardSource;

    #[test]
    fn first_line_is_trimmed_and_compared_as_text() {
        assert_eq!(extract_answer(" 85 \nmore", Extract::FirstLine).as_deref(), Some("85"));
        assert_eq!(extract_answer("", Extract::FirstLine).as_deref(), Some(""));
        assert!(matches(Some("85"), "85", Extract::FirstLine));
        assert!(!matches(Some("85.0"), "85", Extract::FirstLine));
        assert!(!matches(Some("851"), "85", Extract::FirstLine));
        assert!(!matches(Some("-85"), "85", Extract::FirstLine));
    }

    #[test]
    fn last_number_reads_signs_decimals_and_thousands() {
        let got = |t: &str| extract_answer(t, Extract::LastNumber);
        assert_eq!(got("so 3 + 4 = 7.").as_deref(), Some("7"));
        assert_eq!(got("The answer is -12.5 apples").as_deref(), Some("-12.5"));
        assert_eq!(got("total: 1,234 and 5,6").as_deref(), Some("56"));
        assert_eq!(got("1,234").as_deref(), Some("1234"));
        assert_eq!(got("no number here"), None);
        assert_eq!(got("x-3").as_deref(), Some("-3"));
        assert_eq!(got("7.").as_deref(), Some("7"));
        assert!(matches(Some("85.0"), "85", Extract::LastNumber));
        assert!(matches(Some("1234"), "1,234", Extract::LastNumber));
        assert!(!matches(None, "85", Extract::LastNumber));
    }

    #[test]
    fn reward_reads_the_row_and_a_missing_answer_is_nan() {
        let rows = [
            serde_json::json!({"prompt": "37+48=", "answer": "85"}),
            serde_json::json!({"prompt": "37+48=", "answer": 85}),
            serde_json::json!({"prompt": "12-40=", "answer": -28}),
            serde_json::json!({"prompt": "no gold"}),
            serde_json::json!({"prompt": "null gold", "answer": null}),
        ];
        let responses = ["85", "85\n", "-28", "1", "1"];
        let batch: Vec<RewardInput> = rows
            .iter()
            .zip(responses)
            .map(|(m, r)| RewardInput { meta: m, ..RewardInput::text("q", r) })
            .collect();
        let mut reward = exact_match_reward("exact_match", "answer", Extract::FirstLine);
        let s = reward.score(&batch).unwrap();
        assert_eq!(&s[..3], &[1.0, 1.0, 1.0]);
        assert!(s[3].is_nan() && s[4].is_nan(), "{s:?}");
        let wrong = [RewardInput { meta: &rows[0], ..RewardInput::text("q", "84") }];
        assert_eq!(reward.score(&wrong).unwrap(), vec![0.0]);
        let bad = serde_json::json!({"answer": [1, 2]});
        let one = [RewardInput { meta: &bad, ..RewardInput::text("q", "1") }];
        let err = reward.score(&one).unwrap_err().to_string();
        assert!(err.contains("exact_match, sample 0") && err.contains("\"answer\""), "{err}");
        let text = serde_json::json!({"answer": "Paris"});
        let one = [RewardInput { meta: &text, ..RewardInput::text("q", "1") }];
        let err = exact_match_reward("m", "answer", Extract::LastNumber).score(&one).unwrap_err().to_string();
        assert!(err.contains("not a number") && err.contains("first_line"), "{err}");
        assert_eq!(
            exact_match_scores(&["85", "8"], &["85", "85"], Extract::FirstLine).unwrap(),
            vec![1.0, 0.0]
        );
    }
}
