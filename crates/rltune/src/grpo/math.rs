//! GRPO's and RLOO's math as pure functions: NaN-aware statistics, reward aggregation,
//! group-relative and leave-one-out advantages, the clipped per-token objective with the k3 KL
//! term, and each `loss_type`'s normalization.
//!
//! Per-sample quantities are `f64` slices in batch order (groups of `G` consecutive rows); the
//! loss pieces are tensors: `(B, T)` per token, `(B, 1)` per sequence. Each function cites the TRL
//! 1.16.0 code it follows (`trl/trainer/grpo_trainer.py`, `rloo_trainer.py`, `utils.py`).

use candle_core::{DType, Tensor, D};

use super::config::{Aggregation, ImportanceSamplingLevel, LossType, ScaleRewards};
use crate::error::Result;

/// Mean of the non-NaN entries (NaN when there are none). `torch.nanmean`.
pub fn nanmean(xs: &[f64]) -> f64 {
    let (s, n) = xs.iter().filter(|x| !x.is_nan()).fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

/// Unbiased standard deviation of the non-NaN entries; NaN with fewer than two. TRL `nanstd`.
pub fn nanstd(xs: &[f64]) -> f64 {
    let m = nanmean(xs);
    let vals: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    let n = vals.len();
    if n < 2 {
        return f64::NAN;
    }
    let var = vals.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n as f64;
    (var * n as f64 / (n - 1) as f64).sqrt()
}

/// Smallest non-NaN entry (NaN when there is none). TRL `nanmin`.
pub fn nanmin(xs: &[f64]) -> f64 {
    xs.iter().copied().filter(|x| !x.is_nan()).fold(f64::NAN, f64::min)
}

/// Largest non-NaN entry (NaN when there is none). TRL `nanmax`.
pub fn nanmax(xs: &[f64]) -> f64 {
    xs.iter().copied().filter(|x| !x.is_nan()).fold(f64::NAN, f64::max)
}

/// `torch.isclose(std, 0)`: `|std| ≤ 1e-8` (NaN is not close).
pub fn is_zero_std(std: f64) -> bool {
    std.abs() <= 1e-8
}

/// The weighted sum of each sample's rewards, skipping missing (NaN) ones; a sample that no
/// function scored is NaN (unscorable). `rewards[i][f]`, one weight per function.
/// TRL: `(rewards_per_func * reward_weights).nansum(dim=1)`, then `rewards[unscorable_mask] = nan`.
pub fn weighted_rewards(rewards: &[Vec<f64>], weights: &[f64]) -> Vec<f64> {
    rewards
        .iter()
        .map(|row| {
            if row.iter().all(|r| r.is_nan()) {
                return f64::NAN;
            }
            row.iter().zip(weights).filter(|(r, _)| !r.is_nan()).map(|(r, w)| r * w).sum()
        })
        .collect()
}

/// GRPO advantages and the standard deviations behind them.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupAdvantages {
    /// One per sample; 0 for unscorable samples.
    pub advantages: Vec<f64>,
    /// The std each sample's advantage was (or, for `scale_rewards = "none"`, would have been)
    /// divided by: per sample (group, none) or the batch std repeated (batch). Feeds
    /// `frac_reward_zero_std`.
    pub std: Vec<f64>,
}

impl GroupAdvantages {
    /// `frac_reward_zero_std`: the fraction of `std` entries equal to 0.
    pub fn frac_zero_std(&self) -> f64 {
        self.std.iter().filter(|s| is_zero_std(**s)).count() as f64 / self.std.len() as f64
    }
}

/// GRPO's advantages from `rewards[i][f]` (NaN: missing) in groups of `g`.
///
/// `sum_then_normalize`: `r = Σ_f w_f r_f` (NaN-skipping); `A = r − mean_group(r)`, divided by
/// `std + 1e-4` with the group's std (`group`) or the batch's (`batch`), not divided (`none`).
/// `normalize_then_sum`: each function normalized within its group, `(r − mean)/(std + 1e-4)`,
/// weighted and summed, then `A = (r − mean(r))/(std(r) + 1e-4)` over the batch. Means and stds
/// skip NaN; a NaN advantage (unscorable sample, a group with one scorable sample) becomes 0.
/// TRL `GRPOTrainer._generate_and_score_completions`.
pub fn grpo_advantages(
    rewards: &[Vec<f64>],
    weights: &[f64],
    g: usize,
    scale: ScaleRewards,
    aggregation: Aggregation,
) -> GroupAdvantages {
    let n = rewards.len();
    let (adv, std) = match aggregation {
        Aggregation::SumThenNormalize => {
            let r = weighted_rewards(rewards, weights);
            let mut adv = vec![0.0; n];
            let mut std = vec![0.0; n];
            let batch_std = nanstd(&r);
            for (k, group) in r.chunks(g).enumerate() {
                let (m, s) = (nanmean(group), nanstd(group));
                for j in 0..group.len() {
                    let i = k * g + j;
                    std[i] = if scale == ScaleRewards::Batch { batch_std } else { s };
                    adv[i] = r[i] - m;
                    if scale != ScaleRewards::None {
                        adv[i] /= std[i] + 1e-4;
                    }
                }
            }
            (adv, std)
        }
        Aggregation::NormalizeThenSum => {
            let f = weights.len();
            let mut normalized = vec![vec![0.0; f]; n];
            for k in 0..n / g {
                for fi in 0..f {
                    let col: Vec<f64> = (0..g).map(|j| rewards[k * g + j][fi]).collect();
                    let (m, s) = (nanmean(&col), nanstd(&col));
                    for j in 0..g {
                        normalized[k * g + j][fi] = (col[j] - m) / (s + 1e-4);
                    }
                }
            }
            let mut r = weighted_rewards(&normalized, weights);
            // A sample whose every function is missing stays unscorable.
            for (ri, row) in r.iter_mut().zip(rewards) {
                if row.iter().all(|x| x.is_nan()) {
                    *ri = f64::NAN;
                }
            }
            let (m, s) = (nanmean(&r), nanstd(&r));
            (r.iter().map(|x| (x - m) / (s + 1e-4)).collect(), vec![s; n])
        }
    };
    let advantages = adv.into_iter().map(|a| if a.is_nan() { 0.0 } else { a }).collect();
    GroupAdvantages { advantages, std }
}

/// RLOO's leave-one-out advantages of (already weighted, clipped and KL-penalized) rewards in
/// groups of `g`: `A_i = r_i − (Σ_{j≠i} r_j)/(n − 1)` over the group's `n` scorable samples, then
/// optionally whitened over the batch, `(A − mean)/(std + 1e-4)`; NaN becomes 0. Returns the
/// advantages and each group's reward std (for `frac_reward_zero_std`).
/// TRL `RLOOTrainer._generate_and_score_completions`.
pub fn rloo_advantages(rewards: &[f64], g: usize, normalize: bool) -> (Vec<f64>, Vec<f64>) {
    let mut adv = vec![0.0; rewards.len()];
    let mut stds = Vec::new();
    for (k, group) in rewards.chunks(g).enumerate() {
        stds.push(nanstd(group));
        let count = group.iter().filter(|x| !x.is_nan()).count() as f64;
        let sum: f64 = group.iter().filter(|x| !x.is_nan()).sum();
        for (j, r) in group.iter().enumerate() {
            adv[k * g + j] = r - (sum - r) / (count - 1.0);
        }
    }
    if normalize {
        let (m, s) = (nanmean(&adv), nanstd(&adv));
        adv.iter_mut().for_each(|a| *a = (*a - m) / (s + 1e-4));
    }
    adv.iter_mut().filter(|a| a.is_nan()).for_each(|a| *a = 0.0);
    (adv, stds)
}

/// `where(a ≤ b, a, b)`: torch's `min` with the gradient going to the smaller side (at a tie,
/// to `a`; torch splits it, which gives the same total where both sides have equal gradients).
pub fn minimum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(a.le(b)?.where_cond(a, b)?)
}

/// `clamp(x, lo, hi)` with torch's gradient: passed where `lo ≤ x ≤ hi`, 0 outside.
pub fn clamp(x: &Tensor, lo: f64, hi: f64) -> Result<Tensor> {
    let lo_t = x.ones_like()?.affine(lo, 0.0)?;
    let hi_t = x.ones_like()?.affine(hi, 0.0)?;
    let below = x.lt(&lo_t)?;
    let above = x.gt(&hi_t)?;
    Ok(above.where_cond(&hi_t, &below.where_cond(&lo_t, x)?)?)
}

/// What the GRPO objective needs besides the logprobs.
#[derive(Debug, Clone, Copy)]
pub struct ObjectiveParams {
    /// Lower and upper clip ε.
    pub epsilon_low: f64,
    /// Upper clip ε.
    pub epsilon_high: f64,
    /// Two-sided clipping cap on the ratio.
    pub delta: Option<f64>,
    /// Token or sequence ratios.
    pub level: ImportanceSamplingLevel,
    /// KL coefficient β (0: no KL term).
    pub beta: f64,
    /// Multiply the KL term by the ratio.
    pub bias_correction_kl: bool,
}

/// The per-token GRPO objective and what its metrics need.
#[derive(Debug)]
pub struct Objective {
    /// `(B, T)`: `−min(ρ·A, clip(ρ)·A) + β·KL` (before masking).
    pub per_token_loss: Tensor,
    /// The ratio ρ after the `delta` cap (what TRL's clip metrics read): `(B, T)` (token) or
    /// `(B, 1)` (sequence).
    pub ratio: Tensor,
    /// `(B, T)` k3 KL (times ρ with bias correction), when β > 0.
    pub kl: Option<Tensor>,
}

/// The GRPO per-token objective. `logp, old_logp, ref_logp, mask: (B, T)`, `adv: (B, 1)`.
///
/// Token level: `log ρ = logp − old_logp`. Sequence level (GSPO): `log ρ = Σ_t (logp − old)·m /
/// max(1, Σ_t m)`, `(B, 1)`. `ρ₂ = clamp(ρ, 1−ε_low, 1+ε_high)`; with `delta`, `ρ = min(ρ, δ)`;
/// loss `−min(ρ·A, ρ₂·A)`. KL (k3): `exp(ref − logp) − (ref − logp) − 1`, times ρ with
/// `use_bias_correction_kl`, added as `β·KL`. TRL `GRPOTrainer._compute_loss`.
pub fn grpo_objective(
    logp: &Tensor,
    old_logp: &Tensor,
    ref_logp: Option<&Tensor>,
    adv: &Tensor,
    mask: &Tensor,
    p: &ObjectiveParams,
) -> Result<Objective> {
    let log_ratio = (logp - old_logp)?;
    let log_w = match p.level {
        ImportanceSamplingLevel::Token => log_ratio,
        ImportanceSamplingLevel::Sequence => {
            let len = mask.sum_keepdim(D::Minus1)?.clamp(1.0, f64::INFINITY)?;
            (&log_ratio * mask)?.sum_keepdim(D::Minus1)?.div(&len)?
        }
    };
    let ratio = log_w.exp()?;
    let kl = match ref_logp.filter(|_| p.beta != 0.0) {
        Some(r) => {
            let d = (r - logp)?;
            let k3 = ((d.exp()? - &d)? - 1.0)?;
            Some(if p.bias_correction_kl { k3.broadcast_mul(&ratio)? } else { k3 })
        }
        None => None,
    };
    let clipped = clamp(&ratio, 1.0 - p.epsilon_low, 1.0 + p.epsilon_high)?;
    let capped = match p.delta {
        Some(d) => minimum(&ratio, &ratio.ones_like()?.affine(d, 0.0)?)?,
        None => ratio.clone(),
    };
    let obj = minimum(&capped.broadcast_mul(adv)?, &clipped.broadcast_mul(adv)?)?.neg()?;
    let mut per_token_loss = obj.broadcast_as(mask.shape())?.contiguous()?;
    if let Some(kl) = &kl {
        per_token_loss = (per_token_loss + (kl * p.beta)?)?;
    }
    Ok(Objective { per_token_loss, ratio: capped, kl })
}

/// Reduces `per_token_loss (B, T)` over `mask` as `loss_type` says.
///
/// - `grpo`: `mean_b(Σ_t ℓ·m / max(1, Σ_t m))`
/// - `bnpo`: `Σ ℓ·m / max(1, Σ m)`
/// - `dr_grpo`: `Σ ℓ·m / (B · max_completion_length)`
/// - `dapo`: `Σ ℓ·m / max(1, num_items)`, `num_items` the loss tokens of the generation batch
///   (with one process and no accumulation, `Σ m`).
///
/// TRL `GRPOTrainer._compute_loss`.
pub fn aggregate_loss(
    per_token_loss: &Tensor,
    mask: &Tensor,
    loss_type: LossType,
    max_completion_length: usize,
    num_items: f64,
) -> Result<Tensor> {
    let masked = (per_token_loss * mask)?;
    let b = mask.dim(0)?;
    Ok(match loss_type {
        LossType::Grpo => {
            let len = mask.sum(D::Minus1)?.clamp(1.0, f64::INFINITY)?;
            masked.sum(D::Minus1)?.div(&len)?.mean_all()?
        }
        LossType::Bnpo => {
            let n = mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            (masked.sum_all()? / n.max(1.0))?
        }
        LossType::DrGrpo => (masked.sum_all()? / (b * max_completion_length) as f64)?,
        LossType::Dapo => (masked.sum_all()? / num_items.max(1.0))?,
        other => {
            return Err(crate::Error::Setting(crate::error::ConfigError::new(
                "grpo",
                "loss_type",
                format!(
                    "{other:?} is not implemented in rltune; use \"dapo\", \"grpo\", \"dr_grpo\" or \"bnpo\""
                ),
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn nan_statistics_skip_nan() {
        let xs = [1.0, f64::NAN, 3.0];
        assert_eq!(nanmean(&xs), 2.0);
        assert!(close(nanstd(&xs), 2f64.sqrt()));
        assert!(nanstd(&[1.0, f64::NAN]).is_nan(), "one value has no unbiased std");
        assert_eq!((nanmin(&xs), nanmax(&xs)), (1.0, 3.0));
        assert!(nanmean(&[f64::NAN]).is_nan() && nanmin(&[]).is_nan());
    }

    #[test]
    fn weighted_rewards_nansum_and_unscorable() {
        let r = vec![vec![1.0, 2.0], vec![f64::NAN, 2.0], vec![f64::NAN, f64::NAN]];
        let w = weighted_rewards(&r, &[1.0, 0.5]);
        assert_eq!(&w[..2], &[2.0, 1.0]);
        assert!(w[2].is_nan());
    }

    #[test]
    fn group_advantages_are_standardized_within_groups() {
        let r: Vec<Vec<f64>> = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0].iter().map(|&x| vec![x]).collect();
        let a = grpo_advantages(&r, &[1.0], 4, ScaleRewards::Group, Aggregation::SumThenNormalize);
        let s = nanstd(&[1.0, 2.0, 3.0, 4.0]);
        assert!(close(a.advantages[0], -1.5 / (s + 1e-4)));
        assert!(close(a.advantages.iter().take(4).sum::<f64>(), 0.0));
        // The all-equal group has zero advantages and counts in frac_reward_zero_std.
        assert_eq!(&a.advantages[4..], &[0.0; 4]);
        assert_eq!(a.frac_zero_std(), 0.5);
        let none = grpo_advantages(&r, &[1.0], 4, ScaleRewards::None, Aggregation::SumThenNormalize);
        assert_eq!(&none.advantages[..4], &[-1.5, -0.5, 0.5, 1.5]);
        let batch = grpo_advantages(&r, &[1.0], 4, ScaleRewards::Batch, Aggregation::SumThenNormalize);
        let bs = nanstd(&[1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0]);
        assert!(close(batch.advantages[3], 1.5 / (bs + 1e-4)));
        assert_eq!(batch.frac_zero_std(), 0.0);
    }

    #[test]
    fn unscorable_samples_get_zero_advantage_and_leave_the_baseline() {
        let r = vec![vec![1.0], vec![f64::NAN], vec![3.0], vec![5.0]];
        let a = grpo_advantages(&r, &[1.0], 4, ScaleRewards::None, Aggregation::SumThenNormalize);
        assert_eq!(a.advantages, vec![-2.0, 0.0, 0.0, 2.0]);
    }

    #[test]
    fn rloo_baseline_leaves_one_out() {
        let (a, stds) = rloo_advantages(&[1.0, 2.0, 6.0, 3.0, 3.0, f64::NAN], 3, false);
        assert_eq!(&a[..3], &[1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5]);
        assert_eq!(&a[3..], &[0.0, 0.0, 0.0], "two scorable: 3 − 3; unscorable: 0");
        assert!(is_zero_std(stds[1]) && !is_zero_std(stds[0]));
        let (n, _) = rloo_advantages(&[1.0, 2.0, 6.0, 3.0, 3.0, 4.0], 3, true);
        assert!(close(nanmean(&n), 0.0));
    }

    fn t(v: &[f32], shape: (usize, usize)) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn objective_at_ratio_one_is_minus_advantage_and_kl_vanishes_at_ref() {
        let logp = t(&[-1.0, -2.0, -0.5, -3.0], (2, 2));
        let mask = t(&[1.0, 1.0, 1.0, 0.0], (2, 2));
        let adv = t(&[2.0, -1.0], (2, 1));
        let p = ObjectiveParams {
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            delta: None,
            level: ImportanceSamplingLevel::Token,
            beta: 0.1,
            bias_correction_kl: true,
        };
        let o = grpo_objective(&logp, &logp, Some(&logp), &adv, &mask, &p).unwrap();
        assert_eq!(o.per_token_loss.to_vec2::<f32>().unwrap(), vec![vec![-2.0, -2.0], vec![1.0, 1.0]]);
        assert_eq!(o.kl.unwrap().to_vec2::<f32>().unwrap(), vec![vec![0.0; 2]; 2]);
        // Loss normalizations on that objective.
        let l = |k| aggregate_loss(&o.per_token_loss, &mask, k, 4, 3.0).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(l(LossType::Grpo), (-2.0 + 1.0) / 2.0);
        assert_eq!(l(LossType::Bnpo), -3.0 / 3.0);
        assert_eq!(l(LossType::Dapo), -3.0 / 3.0);
        assert_eq!(l(LossType::DrGrpo), -3.0 / 8.0);
    }

    #[test]
    fn clipping_uses_the_asymmetric_bounds() {
        // ratio 1.25 with A > 0: inside [0.8, 1.28] (not clipped); with ε_high = 0.2 clipped to 1.2.
        let old = t(&[0.0, 0.0], (1, 2));
        let logp = t(&[1.25f32.ln(), 0.5f32.ln()], (1, 2));
        let mask = t(&[1.0, 1.0], (1, 2));
        let adv = t(&[1.0], (1, 1));
        let mut p = ObjectiveParams {
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            delta: None,
            level: ImportanceSamplingLevel::Token,
            beta: 0.0,
            bias_correction_kl: true,
        };
        let l = |p: &ObjectiveParams| {
            grpo_objective(&logp, &old, None, &adv, &mask, p)
                .unwrap()
                .per_token_loss
                .to_vec2::<f32>()
                .unwrap()
        };
        let a = l(&p);
        assert!((a[0][0] + 1.25).abs() < 1e-6 && (a[0][1] + 0.5).abs() < 1e-6, "{a:?}");
        p.epsilon_high = 0.2;
        assert!((l(&p)[0][0] + 1.2).abs() < 1e-6);
        // Sequence level: one ratio, exp(mean log ratio), for the whole row.
        p.level = ImportanceSamplingLevel::Sequence;
        let o = grpo_objective(&logp, &old, None, &adv, &mask, &p).unwrap();
        let want = ((1.25f64.ln() + 0.5f64.ln()) / 2.0).exp();
        assert!((o.ratio.to_vec2::<f32>().unwrap()[0][0] as f64 - want).abs() < 1e-6);
    }

    #[test]
    fn clamp_and_minimum_pass_gradients_like_torch() {
        let x = candle_core::Var::new(&[0.5f32, 1.0, 2.0], &Device::Cpu).unwrap();
        let y = clamp(x.as_tensor(), 0.8, 1.2).unwrap().sum_all().unwrap();
        let g = y.backward().unwrap().get(&x).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, vec![0.0, 1.0, 0.0]);
        let m = minimum(x.as_tensor(), x.as_tensor()).unwrap().sum_all().unwrap();
        let g = m.backward().unwrap().get(&x).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, vec![1.0, 1.0, 1.0], "a tie sends the whole gradient once");
    }
}
