//! Held-out evaluation of a prompt run (`[eval]`): the policy answers every held-out prompt
//! (greedily by default) and the run's own reward sources score the answers, before the first
//! step and after the last (and every `every` steps). What a GRPO user reads as "accuracy
//! before and after", with its standard error.
//!
//! Each evaluation appends one line to `eval.jsonl` in the run directory (the file is rewritten
//! whole and renamed into place; a resumed run drops the lines after its checkpoint's step):
//!
//! ```json
//! {"step": 0, "prompts": 300, "eval_reward": 0.12, "eval_reward_se": 0.019,
//!  "eval_rewards/exact_match/mean": 0.12, "eval_rewards/exact_match/se": 0.019,
//!  "eval_completions/mean_length": 6.1, "eval_completions/clipped_ratio": 0.0}
//! ```
//!
//! The names are TRL's metrics with its `eval_` prefix; `_se` is the standard error of the
//! mean, `std / sqrt(n)` with the sample standard deviation. A NaN score (a missing reward) is
//! left out of its source's mean, as TRL's `nanmean`. In a data-parallel run every process
//! answers its share of the prompts and the scores are gathered; rank 0 writes the file.

use std::path::Path;

use candle_core::Device;

use super::config::RunConfig;
use crate::data::prompts::PromptRow;
use crate::error::{Error, Result};
use crate::generation::{generate, row_seed, GenerationConfig};
use crate::grpo::math::weighted_rewards;
use crate::models::CausalLm;
use crate::rewards::WeightedSum;
use crate::tokenizer::Tokenizer;

pub use super::config::EvalSection;

/// One evaluation's numbers (a line of `eval.jsonl`).
#[derive(Debug, Clone, PartialEq)]
pub struct EvalResult {
    /// Steps done before it.
    pub step: usize,
    /// Prompts answered.
    pub prompts: usize,
    /// The weighted reward: mean and standard error.
    pub reward: (f64, f64),
    /// Each source's mean and standard error, by metric name.
    pub sources: Vec<(String, f64, f64)>,
    /// Mean completion length in tokens.
    pub mean_length: f64,
    /// Share of completions that did not end in EOS.
    pub clipped_ratio: f64,
}

impl EvalResult {
    /// The metrics under TRL's `eval_` names (what a step's metrics line carries).
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let mut m =
            vec![("eval_reward".to_string(), self.reward.0), ("eval_reward_se".to_string(), self.reward.1)];
        for (name, mean, se) in &self.sources {
            m.push((format!("eval_rewards/{name}/mean"), *mean));
            m.push((format!("eval_rewards/{name}/se"), *se));
        }
        m.push(("eval_completions/mean_length".into(), self.mean_length));
        m.push(("eval_completions/clipped_ratio".into(), self.clipped_ratio));
        m
    }

    /// The JSON line: `step`, `prompts` and [`Self::metrics`].
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("step".into(), self.step.into());
        m.insert("prompts".into(), self.prompts.into());
        for (k, v) in self.metrics() {
            m.insert(k, json_f64(v));
        }
        serde_json::Value::Object(m)
    }

    /// One line for the terminal.
    pub fn describe(&self) -> String {
        let parts: Vec<String> =
            self.sources.iter().map(|(n, m, se)| format!("{n} {m:.3} ± {se:.3}")).collect();
        format!(
            "eval after step {}: reward {:.3} ± {:.3} over {} held-out prompts ({}); mean length {:.1}",
            self.step,
            self.reward.0,
            self.reward.1,
            self.prompts,
            parts.join(", "),
            self.mean_length
        )
    }
}

fn json_f64(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

/// The mean and standard error of the finite-or-not values, NaN left out (NaN when none).
pub fn mean_se(xs: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = xs.filter(|x| !x.is_nan()).collect();
    let n = v.len() as f64;
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// What one evaluation needs besides the policy.
pub struct Evaluator<'a> {
    /// The `[eval]` table.
    pub section: &'a EvalSection,
    /// The held-out prompts, encoded.
    pub prompts: &'a [(Vec<u32>, PromptRow)],
    /// The run's tokenizer (completions are decoded for the reward sources).
    pub tokenizer: &'a Tokenizer,
    /// The run's sampling settings (`greedy` overrides `top_k`).
    pub generation: &'a GenerationConfig,
    /// Ids that end a completion.
    pub eos_ids: &'a [u32],
    /// Where to compute.
    pub device: &'a Device,
    /// The processes, each answering its share of the prompts.
    pub dist: &'a crate::dist::Dist,
}

impl Evaluator<'_> {
    /// Answers this process's share of the prompts with `lm`, scores them with `reward`
    /// (names in `names`), and gathers every process's scores.
    pub fn run(
        &self,
        step: usize,
        lm: &CausalLm,
        reward: &mut WeightedSum,
        names: &[String],
    ) -> Result<EvalResult> {
        let n = self.prompts.len();
        let world = self.dist.world_size();
        let per = n.div_ceil(world);
        let start = (self.dist.rank() * per).min(n);
        let end = (start + per).min(n);
        let k = names.len();
        // One row per prompt slot: [present, length, clipped, source scores…], padded to `per`.
        let width = 3 + k;
        let mut local = vec![0f64; per * width];
        let gen = GenerationConfig {
            top_k: if self.section.greedy { 1 } else { self.generation.top_k },
            seed: self.generation.seed ^ 0xe7a1,
            ..self.generation.clone()
        };
        let mut slot = 0;
        for chunk in (start..end).collect::<Vec<_>>().chunks(self.section.batch_size) {
            let queries: Vec<Vec<u32>> = chunk.iter().map(|&i| self.prompts[i].0.clone()).collect();
            // Prompt i draws from its own stream on every device: the numbers depend on neither
            // `batch_size` nor the number of processes.
            let cfg = GenerationConfig {
                row_seeds: chunk.iter().map(|&i| row_seed(gen.seed, i as u64)).collect(),
                ..gen.clone()
            };
            let samples = generate(lm, None, &queries, &cfg, self.device)?;
            let texts = super::prompts::decode(self.tokenizer, &samples)?;
            let metas: Vec<&serde_json::Value> = chunk.iter().map(|&i| &self.prompts[i].1.meta).collect();
            let parts = reward.score_parts(&super::prompts::reward_inputs(&samples, &texts, &metas))?;
            for (j, s) in samples.iter().enumerate() {
                let row = &mut local[slot * width..(slot + 1) * width];
                row[0] = 1.0;
                row[1] = s.response_ids.len() as f64;
                row[2] =
                    f64::from(u8::from(!s.response_ids.last().is_some_and(|t| self.eos_ids.contains(t))));
                for (p, part) in parts.iter().enumerate() {
                    row[3 + p] = f64::from(part[j]);
                }
                slot += 1;
            }
        }
        let all = self.dist.gather_f64(&local)?;
        let rows: Vec<&[f64]> = all.chunks(width).filter(|r| r[0] == 1.0).collect();
        if rows.len() != n {
            return Err(Error::Internal(format!("{} evaluation rows for {n} prompts", rows.len())));
        }
        let scores: Vec<Vec<f64>> = rows.iter().map(|r| r[3..].to_vec()).collect();
        let weights: Vec<f64> = reward.parts().map(|(w, _)| f64::from(w)).collect();
        let total = weighted_rewards(&scores, &weights);
        let sources = names
            .iter()
            .enumerate()
            .map(|(p, name)| {
                let (m, se) = mean_se(scores.iter().map(|r| r[p]));
                (name.clone(), m, se)
            })
            .collect();
        Ok(EvalResult {
            step,
            prompts: n,
            reward: mean_se(total.into_iter()),
            sources,
            mean_length: rows.iter().map(|r| r[1]).sum::<f64>() / n.max(1) as f64,
            clipped_ratio: rows.iter().map(|r| r[2]).sum::<f64>() / n.max(1) as f64,
        })
    }
}

/// Appends `result` to `dir/eval.jsonl`, first dropping the lines of steps after
/// `keep_through` (those of a run resumed from an earlier checkpoint); rewritten whole and
/// renamed into place.
pub fn record(dir: &Path, result: &EvalResult, keep_through: usize) -> Result<()> {
    let path = dir.join("eval.jsonl");
    let mut text = String::new();
    if let Ok(old) = std::fs::read_to_string(&path) {
        for line in old.lines().filter(|l| !l.trim().is_empty()) {
            let step = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64));
            if step.is_some_and(|s| s as usize <= keep_through && s as usize != result.step) {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    text.push_str(&result.to_json().to_string());
    text.push('\n');
    Ok(crate::io::write_bytes_atomic(&path, text.as_bytes())?)
}

/// The held-out prompts of `[eval] source`, encoded as the training prompts are.
pub(super) fn encode_eval_prompts(
    config: &RunConfig,
    tokenizer: &Tokenizer,
) -> Result<Vec<(Vec<u32>, PromptRow)>> {
    let prompts = super::prompts::encode_from(config, &config.eval.source, tokenizer)?;
    if prompts.is_empty() {
        return Err(Error::data(format!("[eval] source {}", config.eval.source), "no usable prompt"));
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error_leave_nan_out() {
        let (m, se) = mean_se([1.0, 0.0, 1.0, 0.0, f64::NAN].into_iter());
        assert!((m - 0.5).abs() < 1e-12);
        // Sample variance 1/3 over n = 4.
        assert!((se - (1.0f64 / 3.0 / 4.0).sqrt()).abs() < 1e-12, "{se}");
        assert!(mean_se(std::iter::empty()).0.is_nan());
        assert!(mean_se([2.0].into_iter()).1.is_nan());
    }

    #[test]
    fn due_before_and_after_or_every() {
        let e = EvalSection { source: "h.jsonl".into(), ..Default::default() };
        assert!(e.due(10, 10) && !e.due(5, 10));
        let e = EvalSection { every: 4, ..e };
        assert!(e.due(4, 10) && e.due(8, 10) && e.due(10, 10) && !e.due(5, 10));
        assert!(!EvalSection::default().due(10, 10));
    }

    #[test]
    fn a_resumed_run_drops_the_lines_after_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let r = |step| EvalResult {
            step,
            prompts: 2,
            reward: (0.5, 0.5),
            sources: vec![("exact_match".into(), 0.5, 0.5)],
            mean_length: 3.0,
            clipped_ratio: 0.0,
        };
        for s in [0, 5, 10] {
            record(dir.path(), &r(s), s).unwrap();
        }
        // Resumed from step 5: the step-10 line goes, the new step-10 line comes.
        record(dir.path(), &r(10), 5).unwrap();
        let text = std::fs::read_to_string(dir.path().join("eval.jsonl")).unwrap();
        let steps: Vec<u64> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, vec![0, 5, 10]);
        assert!(text.contains("\"eval_rewards/exact_match/mean\":0.5"), "{text}");
    }
}
