//! Rewards computed by Rust code: [`FnReward`] wraps a closure; [`token_f1`] is SQuAD's token F1,
//! ready to use as a task reward against a gold answer ([`token_f1_reward`]).

use std::collections::HashMap;

use super::{RewardInput, RewardSource};
use crate::error::{Error, Result};

/// The closure type [`FnReward`] holds.
type ScoreFn = Box<dyn FnMut(&RewardInput<'_>) -> Result<f32> + Send>;

/// A reward computed per sample by a Rust closure, e.g. a task metric.
///
/// A closure's error is reported with the reward's name and the sample index; a non-finite
/// result passes through (the PPO loop skips that batch with a warning).
pub struct FnReward {
    name: String,
    f: ScoreFn,
}

impl FnReward {
    /// Wraps `f`, which scores one sample; `name` appears in logs and errors.
    pub fn new<F>(name: impl Into<String>, f: F) -> Self
    where
        F: FnMut(&RewardInput<'_>) -> Result<f32> + Send + 'static,
    {
        Self { name: name.into(), f: Box::new(f) }
    }
}

impl std::fmt::Debug for FnReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnReward").field("name", &self.name).finish_non_exhaustive()
    }
}

impl RewardSource for FnReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(batch.len());
        for (i, sample) in batch.iter().enumerate() {
            let s = (self.f)(sample)
                .map_err(|e| Error::reward(format!("reward {}, sample {i}", self.name), e))?;
            out.push(s);
        }
        Ok(out)
    }
}

/// SQuAD's answer normalization (`normalize_answer` in the official v1.1/v2.0 evaluation
/// scripts): lowercase, remove ASCII punctuation, remove the articles `a`, `an`, `the` (whole
/// words), and split on whitespace. Returns the tokens.
pub fn normalize_answer(s: &str) -> Vec<String> {
    let lower: String = s.to_lowercase().chars().filter(|c| !c.is_ascii_punctuation()).collect();
    // re.sub(r"\b(a|an|the)\b", " ", text): a word is a maximal run of \w characters.
    let mut out = String::with_capacity(lower.len());
    let mut word = String::new();
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in lower.chars() {
        if is_word(c) {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out.split_whitespace().map(str::to_string).collect()
}

/// SQuAD token F1 between a prediction and a gold answer, in `[0, 1]`.
///
/// Follows the official SQuAD v2.0 script (`compute_f1`): both sides are normalized with
/// [`normalize_answer`]; the overlap counts tokens with multiplicity; when either side has no
/// tokens the F1 is 1 if both are empty, else 0.
pub fn token_f1(prediction: &str, gold: &str) -> f32 {
    let pred = normalize_answer(prediction);
    let gold = normalize_answer(gold);
    if pred.is_empty() || gold.is_empty() {
        return f32::from(u8::from(pred == gold));
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for t in &gold {
        *counts.entry(t).or_default() += 1;
    }
    let mut same = 0usize;
    for t in &pred {
        if let Some(c) = counts.get_mut(t.as_str()).filter(|c| **c > 0) {
            *c -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f32 / pred.len() as f32;
    let recall = same as f32 / gold.len() as f32;
    2.0 * precision * recall / (precision + recall)
}

/// The gold answers in `value`: a string, an array of strings, or an object with a `text` field
/// holding either (SQuAD's `answers: {"text": [...], "answer_start": [...]}`).
fn gold_answers(value: &serde_json::Value) -> Option<Vec<&str>> {
    match value {
        serde_json::Value::String(s) => Some(vec![s.as_str()]),
        serde_json::Value::Array(a) => a.iter().map(|v| v.as_str()).collect(),
        serde_json::Value::Object(o) => o.get("text").and_then(gold_answers),
        _ => None,
    }
}

/// A reward: the [`token_f1`] of the response against the gold answer in `meta[answer_key]` (a
/// string, a list of strings, or SQuAD's `{"text": [...]}`; with several answers, the best F1,
/// as SQuAD scores). Named `token_f1(<answer_key>)`.
///
/// A sample whose metadata lacks the key fails, naming the fields present.
pub fn token_f1_reward(answer_key: &str) -> FnReward {
    let key = answer_key.to_string();
    FnReward::new(format!("token_f1({answer_key})"), move |s: &RewardInput| {
        let Some(value) = s.meta.get(&key) else {
            let fields = match s.meta.as_object() {
                Some(o) => o.keys().cloned().collect::<Vec<_>>().join(", "),
                None => format!("none: meta is {}", s.meta),
            };
            return Err(Error::data(
                "meta",
                format!("no field {key:?} holding the gold answer; fields: {fields}"),
            ));
        };
        let answers = gold_answers(value).ok_or_else(|| {
            Error::data("meta", format!("field {key:?} is {value}; expected a string or a list of strings"))
        })?;
        Ok(answers.iter().map(|a| token_f1(s.response, a)).fold(0.0, f32::max))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_answer_matches_squad() {
        // Values from the SQuAD script's definition (lower, remove_punc, remove_articles, split).
        assert_eq!(normalize_answer("The  Eiffel-Tower, in PARIS!"), ["eiffeltower", "in", "paris"]);
        assert_eq!(normalize_answer("a an the theater"), ["theater"]);
        // `_` is in Python's string.punctuation, so it is removed too.
        assert_eq!(normalize_answer("an_apple a_b"), ["anapple", "ab"]);
        assert_eq!(normalize_answer("Café  ünd the’s"), ["café", "ünd", "’s"]);
        assert!(normalize_answer(" the . ").is_empty());
    }

    #[test]
    fn token_f1_matches_squad_values() {
        assert_eq!(token_f1("Paris", "paris."), 1.0);
        assert_eq!(token_f1("the Paris", "Paris"), 1.0);
        assert_eq!(token_f1("London", "Paris"), 0.0);
        // pred {in, paris, france}, gold {paris}: P = 1/3, R = 1, F1 = 0.5.
        assert!((token_f1("in Paris France", "Paris") - 0.5).abs() < 1e-6);
        // Multiplicity: pred [a1, a1], gold [a1]: common 1, P = 1/2, R = 1 -> 2/3.
        assert!((token_f1("x x", "x") - 2.0 / 3.0).abs() < 1e-6);
        assert_eq!(token_f1("", ""), 1.0);
        assert_eq!(token_f1("the", "an"), 1.0);
        assert_eq!(token_f1("", "Paris"), 0.0);
    }

    #[test]
    fn fn_reward_reads_gold_answers_from_meta() {
        let meta = serde_json::json!({"question": "q", "answer": "Blue whale"});
        let squad =
            serde_json::json!({"answers": {"text": ["Denver Broncos", "Broncos"], "answer_start": [1, 2]}});
        let batch = [
            RewardInput { meta: &meta, ..RewardInput::text("q", "the blue whale") },
            RewardInput { meta: &meta, ..RewardInput::text("q", "a whale shark") },
        ];
        let scores = token_f1_reward("answer").score(&batch).unwrap();
        assert_eq!(scores[0], 1.0);
        assert!((scores[1] - 0.5).abs() < 1e-6, "{scores:?}");
        let one = [RewardInput { meta: &squad, ..RewardInput::text("q", "Broncos") }];
        assert_eq!(token_f1_reward("answers").score(&one).unwrap(), vec![1.0]);
    }

    #[test]
    fn fn_reward_errors_name_sample_and_fields() {
        let meta = serde_json::json!({"question": "q", "gold": 3});
        let batch = [RewardInput::text("q", "r"), RewardInput { meta: &meta, ..RewardInput::text("q", "r") }];
        let err = token_f1_reward("answer").score(&batch[1..]).unwrap_err().to_string();
        assert!(
            err.contains("token_f1(answer), sample 0") && err.contains("fields: gold, question"),
            "{err}"
        );
        let err = token_f1_reward("gold").score(&batch[1..]).unwrap_err().to_string();
        assert!(err.contains("expected a string"), "{err}");
        let err = token_f1_reward("answer").score(&batch).unwrap_err().to_string();
        assert!(err.contains("meta is null"), "{err}");
        let mut nan = FnReward::new("nan", |_: &RewardInput| Ok(f32::NAN));
        assert!(
            nan.score(&batch).unwrap().iter().all(|s| s.is_nan()),
            "NaN passes; the PPO loop skips the batch"
        );
    }
}
