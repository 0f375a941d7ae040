//! Reward sources: what turns a (query, response) pair into PPO's scalar score.
//!
//! TRL's `PPOTrainer.step(queries, responses, scores)` takes one score per sample and does not
//! care where it comes from. In TRL v0.11's `examples/scripts/ppo.py` it is the raw `POSITIVE`
//! logit of a sentiment classifier (`lvwerra/distilbert-imdb`) on `query + response`. Here a
//! [`RewardSource`] produces those scores for a batch:
//!
//! - [`ClassifierReward`]: a BERT/DistilBERT sequence classifier; one label's logit or
//!   probability (TRL's sentiment example).
//! - [`CommandReward`]: any external program speaking JSON lines on stdin/stdout, spawned once;
//!   a script where people rate samples by hand is one (`examples/rewards/rate_by_hand.py`).
//! - [`HttpReward`]: an HTTP service scoring batches (`POST {"samples": [...]}` → `{"scores": [...]}`),
//!   with timeouts and retries ([`http`]).
//! - [`LlmJudgeReward`]: an LLM judge behind an OpenAI-compatible API (`rltune serve`, vLLM), its
//!   answer's score read with a regular expression ([`judge`]).
//! - [`FnReward`]: a Rust closure, e.g. a task metric such as [`token_f1`] against a gold answer
//!   in the prompt row's metadata ([`token_f1_reward`]).
//! - [`exact_match_reward`]: a verifiable reward, 1 when the completion's answer equals the gold
//!   answer in a dataset column, else 0, missing (NaN) when the row has none.
//! - [`WeightedSum`]: several sources combined with weights.
//!
//! ```
//! use rltune::rewards::{score_checked, token_f1_reward, FnReward, RewardInput, RewardSource, WeightedSum};
//!
//! # fn main() -> rltune::Result<()> {
//! let meta = serde_json::json!({"question": "Capital of France?", "answer": "Paris"});
//! let batch = [
//!     RewardInput { meta: &meta, ..RewardInput::text("Capital of France?", " The Paris.") },
//!     RewardInput { meta: &meta, ..RewardInput::text("Capital of France?", " Lyon") },
//! ];
//! let brevity = FnReward::new("brevity", |s: &RewardInput| Ok(-(s.response.len() as f32) / 100.0));
//! let mut reward = WeightedSum::new(vec![
//!     (1.0, Box::new(token_f1_reward("answer")) as Box<dyn RewardSource>),
//!     (0.5, Box::new(brevity)),
//! ])?;
//! let scores = score_checked(&mut reward, &batch)?;
//! assert!((scores[0] - (1.0 - 0.5 * 0.11)).abs() < 1e-6);
//! assert_eq!(reward.name(), "1*token_f1(answer) + 0.5*brevity");
//! # Ok(()) }
//! ```

pub mod classifier;
pub mod command;
pub mod exact_match;
pub mod function;
pub mod http;
pub mod judge;
pub use rltune_envs::metrics;
#[cfg(test)]
mod test_server;

pub use classifier::{ClassifierOutput, ClassifierReward, ClassifierRewardConfig, ScoredText};
pub use command::CommandReward;
pub use exact_match::{exact_match_reward, extract_answer, Extract};
pub use function::{normalize_answer, token_f1, token_f1_reward, FnReward};
pub use http::{HttpReward, RetryPolicy};
pub use judge::{JudgeConfig, LlmJudgeReward};

use crate::error::{Error, Result};

/// One sample to score: the decoded texts, their token ids, and the prompt row's metadata.
///
/// `meta` is the whole prompt row (see [`crate::data::prompts::PromptRow`]), so a reward can read
/// e.g. a gold answer; it is `null` when there is none.
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    /// The query (prompt) text.
    pub query: &'a str,
    /// The generated response text (without the query).
    pub response: &'a str,
    /// The query's token ids (policy tokenizer).
    pub query_ids: &'a [u32],
    /// The response's token ids (policy tokenizer).
    pub response_ids: &'a [u32],
    /// The prompt row's metadata (`null` when none).
    pub meta: &'a serde_json::Value,
}

/// `null`, the metadata of a sample without any.
static NULL: serde_json::Value = serde_json::Value::Null;

impl<'a> RewardInput<'a> {
    /// A sample with texts only: no token ids, `null` metadata.
    pub fn text(query: &'a str, response: &'a str) -> Self {
        Self { query, response, query_ids: &[], response_ids: &[], meta: &NULL }
    }
}

/// Something that scores a batch of samples: one score per sample, higher is better.
pub trait RewardSource: Send {
    /// A short name for logs (e.g. `classifier(POSITIVE logit)`).
    fn name(&self) -> &str;

    /// Scores `batch`, returning exactly `batch.len()` scores in order.
    ///
    /// A score may be non-finite (a classifier overflow, a program answering `NaN`, a metric
    /// dividing by zero): the PPO loop then skips the batch with a warning and counts the skip
    /// in `rltune/skipped_batches`. Failures that leave no score (a program that died, an answer
    /// that does not parse) are errors.
    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>>;
}

impl<R: RewardSource + ?Sized> RewardSource for Box<R> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        (**self).score(batch)
    }
}

/// Calls `source.score(batch)` and checks the contract: one score per sample.
///
/// The error names the source. Non-finite scores pass (see [`RewardSource::score`]); a
/// [`WeightedSum`] keeps them non-finite.
pub fn score_checked<R: RewardSource + ?Sized>(
    source: &mut R,
    batch: &[RewardInput<'_>],
) -> Result<Vec<f32>> {
    let scores = source.score(batch)?;
    if scores.len() != batch.len() {
        return Err(Error::reward(
            format!("reward {}", source.name()),
            format!("returned {} scores for a batch of {} samples", scores.len(), batch.len()),
        ));
    }
    Ok(scores)
}

/// A weighted sum of reward sources: `Σ_k w_k · score_k`.
///
/// Its name lists the parts, `"1*token_f1(answer) + 0.5*brevity"`.
pub struct WeightedSum {
    parts: Vec<(f32, Box<dyn RewardSource>)>,
    name: String,
}

impl WeightedSum {
    /// Combines `parts` (weight, source). Fails when there are none or a weight is not finite.
    pub fn new(parts: Vec<(f32, Box<dyn RewardSource>)>) -> Result<Self> {
        if parts.is_empty() {
            return Err(Error::argument("parts", "a weighted sum of rewards needs at least one part"));
        }
        if let Some((w, r)) = parts.iter().find(|(w, _)| !w.is_finite()) {
            return Err(Error::argument(
                "parts",
                format!("the weight of reward {} is {w}; weights must be finite", r.name()),
            ));
        }
        let name = parts.iter().map(|(w, r)| format!("{w}*{}", r.name())).collect::<Vec<_>>().join(" + ");
        Ok(Self { parts, name })
    }

    /// The parts: (weight, name).
    pub fn parts(&self) -> impl Iterator<Item = (f32, &str)> {
        self.parts.iter().map(|(w, r)| (*w, r.name()))
    }

    /// Each part's unweighted scores (checked with [`score_checked`]), in the order of
    /// [`parts`](Self::parts): `[part][sample]`. Useful to log each part separately.
    pub fn score_parts(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<Vec<f32>>> {
        self.parts.iter_mut().map(|(_, r)| score_checked(r, batch)).collect()
    }
}

impl std::fmt::Debug for WeightedSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightedSum").field("name", &self.name).finish_non_exhaustive()
    }
}

impl RewardSource for WeightedSum {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        let parts = self.score_parts(batch)?;
        let mut total = vec![0f32; batch.len()];
        for ((w, _), scores) in self.parts.iter().zip(&parts) {
            for (t, s) in total.iter_mut().zip(scores) {
                *t += w * s;
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source returning fixed scores.
    struct Fixed(Vec<f32>);

    impl RewardSource for Fixed {
        fn name(&self) -> &str {
            "fixed"
        }
        fn score(&mut self, _batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
            Ok(self.0.clone())
        }
    }

    #[test]
    fn weighted_sum_combines_parts_and_names_them() {
        let batch = [RewardInput::text("q", "a"), RewardInput::text("q", "b")];
        let mut sum = WeightedSum::new(vec![
            (2.0, Box::new(Fixed(vec![1.0, -1.0])) as Box<dyn RewardSource>),
            (-0.5, Box::new(FnReward::new("len", |s: &RewardInput| Ok(s.response.len() as f32)))),
        ])
        .unwrap();
        assert_eq!(sum.name(), "2*fixed + -0.5*len");
        assert_eq!(sum.score(&batch).unwrap(), vec![1.5, -2.5]);
        assert_eq!(sum.score_parts(&batch).unwrap(), vec![vec![1.0, -1.0], vec![1.0, 1.0]]);
        assert_eq!(sum.parts().map(|(w, _)| w).collect::<Vec<_>>(), vec![2.0, -0.5]);
    }

    #[test]
    fn weighted_sum_rejects_empty_and_bad_weights() {
        assert!(WeightedSum::new(vec![]).unwrap_err().to_string().contains("at least one"));
        assert!(matches!(WeightedSum::new(vec![]), Err(Error::Argument { name: "parts", .. })));
        let err = WeightedSum::new(vec![(f32::NAN, Box::new(Fixed(vec![])) as Box<dyn RewardSource>)]);
        assert!(err.unwrap_err().to_string().contains("fixed"));
    }

    #[test]
    fn score_checked_names_wrong_lengths_and_passes_non_finite_scores() {
        let batch = [RewardInput::text("q", "a"), RewardInput::text("q", "b")];
        let err = score_checked(&mut Fixed(vec![1.0]), &batch).unwrap_err().to_string();
        assert!(err.contains("fixed") && err.contains("1 scores") && err.contains("2 samples"), "{err}");
        let scores = score_checked(&mut Fixed(vec![1.0, f32::INFINITY]), &batch).unwrap();
        assert!(scores[1].is_infinite(), "the PPO loop skips such a batch; the source does not fail");
        // A part's bad output fails the sum, naming the part.
        let mut sum =
            WeightedSum::new(vec![(1.0, Box::new(Fixed(vec![0.0])) as Box<dyn RewardSource>)]).unwrap();
        assert!(sum.score(&batch).unwrap_err().to_string().contains("reward fixed"));
    }
}
