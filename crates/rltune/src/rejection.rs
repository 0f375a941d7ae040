//! Rejection sampling: sample, score, keep the best, fine-tune on them with cross-entropy, and
//! repeat (the textworld fork's alternative to PPO; with plain prompts and N samples per prompt,
//! best-of-N distillation).
//!
//! Each iteration ([`RejectionConfig`], `[algorithm] kind = "rejection_sampling"` with a
//! `[rejection]` table in `rltune ppo`'s config):
//! 1. sample: on text games, rounds of episodes until `batch_size` turns; on prompts,
//!    `samples_per_prompt` responses to each of `batch_size` prompts;
//! 2. score: a game turn by its discounted return to the end of its episode
//!    ([`returns_to_go`] with `game_gamma`; rejection sampling has no critic, so what a
//!    truncated episode would have earned after its cap counts 0), or whole episodes
//!    (`per = "episode"`: every turn of an episode gets the episode's return); a prompt's
//!    response by its reward. With `kl_coef > 0` the score is
//!    `score − kl_coef · Σ_t (log π(a_t) − log π_ref(a_t))` over the response's tokens;
//! 3. keep: the top `keep_top_n`, or the top `keep_top_fraction` (rounded up), over the batch
//!    (games) or within each prompt's samples (prompts with `samples_per_prompt > 1`);
//!    [`select_top`];
//! 4. fine-tune: `epochs` passes of SFT over the kept (prompt, response) pairs, the loss on the
//!    response tokens only, through the run's optimizer at [`RejectionConfig::optim_args`], whose
//!    Adam state carries from one iteration to the next (the fork fine-tuned each round from the
//!    current weights).

use candle_core::{Device, Tensor, D};

use crate::error::{ConfigError, Error, Result};
use crate::models::layers::causal_bias;
use crate::models::CausalLm;

/// What one score ranks: a turn, or the episode it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Per {
    /// Each turn by its discounted return to the episode's end.
    #[default]
    Turn,
    /// Each episode by its return; all its turns are kept or dropped together.
    Episode,
}

/// `[rejection]`: the rejection-sampling trainer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RejectionConfig {
    /// Keep this many (0: use `keep_top_fraction`).
    pub keep_top_n: usize,
    /// Keep this fraction, rounded up (when `keep_top_n` is 0).
    pub keep_top_fraction: f64,
    /// Text games: rank turns or episodes.
    pub per: Per,
    /// Subtract `kl_coef` × the response's summed logprob gap to the reference from its score.
    pub kl_coef: f64,
    /// Prompts: responses sampled per prompt (ranked within their prompt when > 1).
    pub samples_per_prompt: usize,
    /// SFT passes over the kept pairs per iteration.
    pub epochs: usize,
    /// SFT learning rate (AdamW, constant).
    pub learning_rate: f64,
    /// SFT examples per optimizer step.
    pub batch_size: usize,
}

impl Default for RejectionConfig {
    fn default() -> Self {
        Self {
            keep_top_n: 0,
            keep_top_fraction: 0.25,
            per: Per::Turn,
            kl_coef: 0.0,
            samples_per_prompt: 1,
            epochs: 1,
            learning_rate: 1e-4,
            batch_size: 16,
        }
    }
}

impl RejectionConfig {
    /// The fine-tuning's optimizer: AdamW at the constant `learning_rate`, with `[training]`'s
    /// defaults otherwise (betas (0.9, 0.999), ε 1e-8, no weight decay, clipping at 1.0). It is
    /// the run's policy optimizer, so its state carries from one step to the next and goes into
    /// the checkpoints with it.
    pub fn optim_args(&self) -> crate::engine::OptimArgs {
        let t = crate::train::TrainingArgs::default();
        crate::engine::OptimArgs {
            learning_rate: self.learning_rate,
            betas: (t.adam_beta1, t.adam_beta2),
            eps: t.adam_epsilon,
            weight_decay: 0.0,
            max_grad_norm: t.max_grad_norm,
            schedule: crate::engine::LrSchedule::new(
                crate::engine::ScheduleKind::Constant,
                self.learning_rate,
                0,
                usize::MAX,
            ),
        }
    }

    /// Checks the fields; messages name the key.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.keep_top_n == 0 && !(self.keep_top_fraction > 0.0 && self.keep_top_fraction <= 1.0) {
            return Err(ConfigError::new(
                "rejection",
                "keep_top_fraction",
                format!("must be in (0, 1] (or set keep_top_n), got {}", self.keep_top_fraction),
            ));
        }
        if self.samples_per_prompt == 0 || self.epochs == 0 || self.batch_size == 0 {
            return Err(ConfigError::new(
                "rejection",
                "",
                "[rejection] samples_per_prompt, epochs and batch_size must be at least 1",
            ));
        }
        if !(self.learning_rate > 0.0 && self.learning_rate.is_finite()) {
            return Err(ConfigError::new(
                "rejection",
                "learning_rate",
                format!("must be positive, got {}", self.learning_rate),
            ));
        }
        if !(self.kl_coef >= 0.0 && self.kl_coef.is_finite()) {
            return Err(ConfigError::new(
                "rejection",
                "kl_coef",
                format!("must be ≥ 0, got {}", self.kl_coef),
            ));
        }
        Ok(())
    }

    /// How many of `n` candidates are kept.
    pub fn kept_of(&self, n: usize) -> usize {
        if self.keep_top_n > 0 {
            self.keep_top_n.min(n)
        } else {
            ((n as f64 * self.keep_top_fraction).ceil() as usize).clamp(usize::from(n > 0), n)
        }
    }
}

/// The discounted return from each turn to the episode's end: `G_t = r_t + γ·G_{t+1}`.
pub fn returns_to_go(rewards: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; rewards.len()];
    let mut g = 0.0;
    for t in (0..rewards.len()).rev() {
        g = rewards[t] + gamma * g;
        out[t] = g;
    }
    out
}

/// The indices of the `k` highest scores, ascending; ties go to the earlier index, and a NaN is
/// never kept.
pub fn select_top(scores: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).filter(|&i| !scores[i].is_nan()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    order
}

/// The logprob of each response token given the query and the tokens before it, under `lm`
/// at `temperature`; no gradient. One sequence per forward pass (see [`batch_response_logprobs`]).
pub fn response_logprobs(
    lm: &CausalLm,
    query: &[u32],
    response: &[u32],
    temperature: f64,
    device: &Device,
) -> Result<Vec<f32>> {
    let mut out = batch_response_logprobs(lm, &[(query, response)], temperature, device)?;
    out.pop().ok_or_else(|| Error::Internal("response_logprobs: no result for its one pair".into()))
}

/// [`response_logprobs`] of several (query, response) pairs in one forward pass: the rows
/// `query ++ response` right-padded to one length `L` (positions `0..L−1` are then every real
/// token's own; padding is masked out of attention and never read), `(B, L−1, V)` logits.
pub fn batch_response_logprobs(
    lm: &CausalLm,
    pairs: &[(&[u32], &[u32])],
    temperature: f64,
    device: &Device,
) -> Result<Vec<Vec<f32>>> {
    if let Some(i) = pairs.iter().position(|(q, r)| q.is_empty() || r.is_empty()) {
        return Err(Error::argument(
            "pairs",
            format!("response_logprobs: pair {i} has an empty query or response"),
        ));
    }
    let Some(l) = pairs.iter().map(|(q, r)| q.len() + r.len() - 1).max() else { return Ok(Vec::new()) };
    let b = pairs.len();
    let (mut ids, mut targets, mut mask) = (vec![0u32; b * l], vec![0u32; b * l], vec![vec![0u8; l]; b]);
    for (i, (q, r)) in pairs.iter().enumerate() {
        let row: Vec<u32> = q.iter().chain(r.iter()).copied().collect();
        let n = row.len() - 1;
        ids[i * l..i * l + n].copy_from_slice(&row[..n]);
        targets[i * l..i * l + n].copy_from_slice(&row[1..]);
        mask[i][..n].fill(1);
    }
    let input = Tensor::from_vec(ids, (b, l), device)?;
    let pos = Tensor::arange(0u32, l as u32, device)?.unsqueeze(0)?.repeat((b, 1))?;
    let bias = causal_bias(&mask, l, lm.lm_head_weight().dtype(), device)?;
    let hidden = lm.forward(&input, &pos, &bias, None)?;
    let logits = lm.logits(&hidden)?.detach();
    let logits = if temperature != 1.0 { (logits / temperature)? } else { logits };
    let logp = crate::ops::log_softmax_last_dim(&logits)?;
    let targets = Tensor::from_vec(targets, (b, l), device)?.unsqueeze(D::Minus1)?;
    // (B, L): the logprob of each next token.
    let all: Vec<Vec<f32>> =
        logp.gather(&targets, D::Minus1)?.squeeze(D::Minus1)?.to_dtype(candle_core::DType::F32)?.to_vec2()?;
    Ok(all
        .into_iter()
        .zip(pairs)
        .map(|(row, (q, r))| row[q.len() - 1..q.len() - 1 + r.len()].to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched reference forward (right-padded rows of different lengths) gives each pair
    /// the logprobs of its own unpadded forward, at temperature 1 and 0.7.
    #[test]
    fn batched_response_logprobs_equal_one_pair_at_a_time() {
        crate::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        use crate::models::{gpt2::Gpt2Config, CausalLmConfig};
        let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(23, 16, 2, 2, 32));
        let store =
            crate::params::ParamStore::random(7, false, candle_core::DType::F32, &Device::Cpu).unwrap();
        let lm = CausalLm::load(&store.root(), &cfg).unwrap();
        let rows: Vec<(Vec<u32>, Vec<u32>)> = vec![
            (vec![3, 9, 1], vec![4, 4, 17, 2, 8]),
            (vec![12], vec![5]),
            (vec![1, 2, 3, 4, 5, 6, 7], vec![22, 0]),
        ];
        let pairs: Vec<(&[u32], &[u32])> = rows.iter().map(|(q, r)| (&q[..], &r[..])).collect();
        for temperature in [1.0, 0.7] {
            let batch = batch_response_logprobs(&lm, &pairs, temperature, &Device::Cpu).unwrap();
            let mut worst = 0f32;
            for ((q, r), got) in pairs.iter().zip(&batch) {
                let one = response_logprobs(&lm, q, r, temperature, &Device::Cpu).unwrap();
                assert_eq!(one.len(), r.len());
                worst = one.iter().zip(got).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
            }
            assert!(worst < 1e-5, "temperature {temperature}: max diff {worst}");
        }
        let err = batch_response_logprobs(&lm, &[(&[1][..], &[][..])], 1.0, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("pair 0 has an empty"), "{err}");
    }

    #[test]
    fn returns_to_go_discount_later_rewards() {
        crate::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let g = returns_to_go(&[0.0, 1.0, 2.0], 0.5);
        assert_eq!(g, vec![0.0 + 0.5 * (1.0 + 0.5 * 2.0), 1.0 + 0.5 * 2.0, 2.0]);
        assert!(returns_to_go(&[], 0.9).is_empty());
    }

    #[test]
    fn the_top_scores_are_kept_in_order_ties_to_the_earlier_and_never_nan() {
        crate::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        assert_eq!(select_top(&[0.1, 0.9, f64::NAN, 0.5, 0.9], 2), vec![1, 4]);
        assert_eq!(select_top(&[0.1, 0.9, f64::NAN, 0.5, 0.9], 3), vec![1, 3, 4]);
        assert_eq!(select_top(&[f64::NAN, 1.0], 2), vec![1]);
        let c = RejectionConfig { keep_top_fraction: 0.25, ..RejectionConfig::default() };
        assert_eq!((c.kept_of(10), c.kept_of(1), c.kept_of(0)), (3, 1, 0));
        let c = RejectionConfig { keep_top_n: 4, ..RejectionConfig::default() };
        assert_eq!((c.kept_of(10), c.kept_of(2)), (4, 2));
        assert!(RejectionConfig { keep_top_fraction: 0.0, ..c }.validate().is_ok(), "keep_top_n wins");
        let e =
            RejectionConfig { keep_top_fraction: 1.5, ..RejectionConfig::default() }.validate().unwrap_err();
        assert_eq!((e.section.as_str(), e.field.as_str()), ("rejection", "keep_top_fraction"), "{e}");
    }
}
