//! PPO's math as small pure functions on `(B, T)` tensors, each testable alone.
//!
//! Each function names the TRL 0.11.4 function it reproduces (`trl/core.py`,
//! `trl/trainer/ppo_trainer.py`). Masks are f32 tensors of 0/1 with the shape of the data.

use candle_core::{DType, Tensor, D};

use crate::error::{Error, Result};

/// Mean of `x` where `mask` is 1. TRL `core.masked_mean` (no axis).
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok((x * mask)?.sum_all()?.broadcast_div(&mask.sum_all()?)?)
}

/// Variance of `x` where `mask` is 1, unbiased (Bessel-corrected) by default.
///
/// TRL `core.masked_var`: `masked_mean((x − mean)²) · n/(n − 1)`. Fails when the mask is empty,
/// or has one element and `unbiased` is set.
pub fn masked_var(x: &Tensor, mask: &Tensor, unbiased: bool) -> Result<Tensor> {
    let var = biased_masked_var(x, mask)?;
    if !unbiased {
        return Ok(var);
    }
    let n = mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    unbiased_from(var, n)
}

/// [`masked_var`] (unbiased) of a mask whose element count `n` the caller already knows: no
/// read of the mask's sum (a synchronization on a GPU).
pub fn masked_var_of_count(x: &Tensor, mask: &Tensor, n: f64) -> Result<Tensor> {
    unbiased_from(biased_masked_var(x, mask)?, n)
}

/// `masked_mean((x − mean)²)`, the variance before Bessel's correction.
fn biased_masked_var(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mean = masked_mean(x, mask)?;
    masked_mean(&x.broadcast_sub(&mean)?.sqr()?, mask)
}

/// The biased masked variance `var` of `n` elements made unbiased.
fn unbiased_from(var: Tensor, n: f64) -> Result<Tensor> {
    if n == 0.0 {
        return Err(Error::batch("masked_var: the mask is empty (no response tokens)"));
    }
    if n == 1.0 {
        return Err(Error::batch(
            "masked_var: one masked element has no unbiased variance; use batches with more response tokens",
        ));
    }
    Ok((var * (n / (n - 1.0)))?)
}

/// Whitens `x` over the masked elements: `(x − mean)·rsqrt(var + 1e-8)`, adding the mean back
/// unless `shift_mean`. TRL `core.masked_whiten` (unbiased variance).
///
/// Elements outside the mask are transformed too, as in TRL; callers that need them zero must
/// multiply by the mask (see [`whiten_rewards`]).
pub fn masked_whiten(x: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor> {
    let mean = masked_mean(x, mask)?;
    let var = masked_var(x, mask, true)?;
    let w = x.broadcast_sub(&mean)?.broadcast_mul(&(var + 1e-8)?.sqrt()?.recip()?)?;
    if shift_mean {
        Ok(w)
    } else {
        Ok(w.broadcast_add(&mean)?)
    }
}

/// Whitened rewards with padding kept at zero.
///
/// Deviation from TRL 0.11.4: TRL's `masked_whiten(rewards, mask, shift_mean=False)` turns the
/// zero rewards at padding into `mean − mean·rsqrt(var)`, and GAE then carries them into the
/// advantages of the real tokens. We re-apply the mask.
pub fn whiten_rewards(rewards: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok((masked_whiten(rewards, mask, false)? * mask)?)
}

/// The per-token KL penalty: how the policy's logprobs move away from the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlPenalty {
    /// `logp − ref_logp`: TRL's default (k1; unbiased, high variance, can be negative per token).
    Kl,
    /// `|logp − ref_logp|`
    Abs,
    /// `½ (logp − ref_logp)²` (k2)
    Mse,
    /// The exact KL of the two next-token distributions, `Σ_v p_v (log p_v − log q_v)`.
    Full,
    /// `(r − 1) − log r` with `r = exp(ref_logp − logp)`: unbiased and never negative (k3,
    /// Schulman's "Approximating KL divergence"). Not in TRL 0.11.
    K3,
}

/// Per-token KL penalty of sampled tokens: `(B, T), (B, T) -> (B, T)`. TRL
/// `PPOTrainer._kl_penalty` for `kl`, `abs`, `mse`; [`KlPenalty::K3`] is ours. For
/// [`KlPenalty::Full`] use [`full_kl`].
pub fn kl_penalty(kind: KlPenalty, logp: &Tensor, ref_logp: &Tensor) -> Result<Tensor> {
    let d = (logp - ref_logp)?;
    Ok(match kind {
        KlPenalty::Kl => d,
        KlPenalty::Abs => d.abs()?,
        KlPenalty::Mse => (d.sqr()? * 0.5)?,
        KlPenalty::K3 => {
            let log_r = d.neg()?;
            ((log_r.exp()? - 1.0)? - log_r)?
        }
        KlPenalty::Full => {
            return Err(Error::argument(
                "kind",
                "kl_penalty \"full\" needs the full distributions: use full_kl",
            ))
        }
    })
}

/// Exact per-position KL from full log-distributions: `(B, T, V), (B, T, V) -> (B, T)`.
///
/// TRL: `F.kl_div(ref_logprob, logprob, log_target=True, reduction="none").sum(-1)`.
pub fn full_kl(logp: &Tensor, ref_logp: &Tensor) -> Result<Tensor> {
    Ok((logp.exp()? * (logp - ref_logp)?)?.sum(D::Minus1)?)
}

/// Rewards per token: `−kl_coef · kl` everywhere, plus each score on the last masked column.
///
/// TRL `PPOTrainer.compute_rewards`; returns `(rewards, non_score_rewards)`, both `(B, T)`.
/// Rows with an empty mask are an error (TRL would crash on `mask.nonzero()[-1]`).
pub fn compute_rewards(scores: &[f32], kl: &Tensor, mask: &Tensor, kl_coef: f64) -> Result<(Tensor, Tensor)> {
    let non_score = (kl * -kl_coef)?;
    let bonus = at_last_token(scores, mask, kl.dtype())?;
    Ok(((&non_score + bonus)?, non_score))
}

/// A `(B, T)` tensor holding `x[i]` at row i's last masked column and 0 elsewhere.
fn at_last_token(x: &[f32], mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let (b, t) = mask.dims2()?;
    let mask_rows = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut out = vec![0f32; b * t];
    for (i, row) in mask_rows.iter().enumerate() {
        let last = row
            .iter()
            .rposition(|&m| m != 0.0)
            .ok_or_else(|| Error::sample(i, "no response tokens under the mask; every response needs one"))?;
        out[i * t + last] = x[i];
    }
    Ok(Tensor::from_vec(out, (b, t), mask.device())?.to_dtype(dtype)?)
}

/// Bootstrapping past the response: adds `γ · next_values[i]` to row i's reward at its last
/// masked token, so GAE's delta there is `r + γ·V_next − V` instead of `r − V` (TRL's step ends
/// every response with a next value of 0). For the turns of a multi-turn episode the next value
/// is `game_gamma · V(next turn's state)`, and 0 when the episode terminated (textworld fork).
pub fn bootstrap_last(rewards: &Tensor, mask: &Tensor, next_values: &[f32], gamma: f64) -> Result<Tensor> {
    let scaled: Vec<f32> = next_values.iter().map(|&v| (gamma * v as f64) as f32).collect();
    Ok((rewards + at_last_token(&scaled, mask, rewards.dtype())?)?)
}

/// Generalized advantage estimation over each whole row, right to left.
///
/// TRL `PPOTrainer.compute_advantages`: values and rewards are first multiplied by the mask, so
/// nothing is bootstrapped past the last response token; `returns = advantages + values` uses the
/// unwhitened advantages; advantages are then whitened over the masked batch. Returns
/// `(masked values, whitened advantages, returns)`, each `(B, T)`.
pub fn compute_advantages(
    values: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    gamma: f64,
    lam: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    compute_advantages_with(values, rewards, mask, gamma, lam, |x, m| masked_whiten(x, m, true))
}

/// [`compute_advantages`] with the whitening `whiten(advantages, mask)` given (a data-parallel
/// run whitens over every process's batch).
pub fn compute_advantages_with(
    values: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    gamma: f64,
    lam: f64,
    whiten: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let values = (values * mask)?;
    let rewards = (rewards * mask)?;
    let adv = gae(&values, &rewards, gamma, lam)?;
    let returns = (&adv + &values)?;
    let adv = whiten(&adv, mask)?;
    Ok((values, adv, returns))
}

/// Plain GAE: `δ_t = r_t + γ V_{t+1} − V_t`, `A_t = δ_t + γλ A_{t+1}`, with `V_T = A_T = 0`.
pub fn gae(values: &Tensor, rewards: &Tensor, gamma: f64, lam: f64) -> Result<Tensor> {
    let (b, t) = values.dims2()?;
    let v = values.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let r = rewards.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let (gamma, lam) = (gamma as f32, lam as f32);
    let mut adv = vec![0f32; b * t];
    for i in 0..b {
        let mut last = 0f32;
        for j in (0..t).rev() {
            let next_v = if j + 1 < t { v[i][j + 1] } else { 0.0 };
            let delta = r[i][j] + gamma * next_v - v[i][j];
            last = delta + gamma * lam * last;
            adv[i * t + j] = last;
        }
    }
    Ok(Tensor::from_vec(adv, (b, t), values.device())?.to_dtype(values.dtype())?)
}

/// The clipped PPO losses of one minibatch, and their statistics.
#[derive(Debug)]
pub struct Losses {
    /// Clipped surrogate policy loss (scalar, with gradient).
    pub pg_loss: Tensor,
    /// Clipped value loss `½·masked_mean(max(…))` (scalar, with gradient, before `vf_coef`).
    pub vf_loss: Tensor,
    /// `masked_mean(pg_losses2 > pg_losses)` (scalar; [`scalar`] reads it)
    pub pg_clipfrac: Tensor,
    /// `masked_mean(vf_losses2 > vf_losses1)` (scalar)
    pub vf_clipfrac: Tensor,
    /// `exp(logp − old_logp)`, `(B, T)`, detached.
    pub ratio: Tensor,
}

/// Clipped policy and value losses. TRL `PPOTrainer.loss`.
///
/// `old_values` are the masked rollout values; `vpreds` the new ones.
#[allow(clippy::too_many_arguments)]
pub fn ppo_losses(
    old_logp: &Tensor,
    old_values: &Tensor,
    logp: &Tensor,
    vpreds: &Tensor,
    mask: &Tensor,
    advantages: &Tensor,
    returns: &Tensor,
    cliprange: f64,
    cliprange_value: f64,
) -> Result<Losses> {
    // Value loss, clipped around the old values.
    let lo = (old_values - cliprange_value)?;
    let hi = (old_values + cliprange_value)?;
    let vpred_clipped = vpreds.maximum(&lo)?.minimum(&hi)?;
    let vf1 = (vpreds - returns)?.sqr()?;
    let vf2 = (&vpred_clipped - returns)?.sqr()?;
    let vf_loss = (masked_mean(&vf1.maximum(&vf2)?, mask)? * 0.5)?;
    let vf_clipfrac = masked_mean(&vf2.gt(&vf1)?.to_dtype(mask.dtype())?, mask)?;

    let ratio = (logp - old_logp)?.exp()?;
    let neg_adv = advantages.neg()?;
    let pg1 = (&neg_adv * &ratio)?;
    let pg2 = (&neg_adv * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)?)?;
    let pg_loss = masked_mean(&pg1.maximum(&pg2)?, mask)?;
    let pg_clipfrac = masked_mean(&pg2.gt(&pg1)?.to_dtype(mask.dtype())?, mask)?;
    Ok(Losses { pg_loss, vf_loss, pg_clipfrac, vf_clipfrac, ratio: ratio.detach() })
}

/// A scalar tensor as f64.
pub fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// Every tensor's values as f64, flattened, in order, read to the host in one transfer: on a
/// GPU one synchronization where a read per value costs one each. The values are those of
/// [`scalar`] and of a flattened `to_vec1` of each tensor.
pub fn read_f64(ts: &[Tensor]) -> Result<Vec<Vec<f64>>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let flat: Vec<Tensor> = ts
        .iter()
        .map(|t| t.detach().flatten_all()?.to_dtype(DType::F64))
        .collect::<candle_core::Result<_>>()?;
    let all = Tensor::cat(&flat, 0)?.to_vec1::<f64>()?;
    let mut out = Vec::with_capacity(flat.len());
    let mut at = 0;
    for t in &flat {
        out.push(all[at..at + t.elem_count()].to_vec());
        at += t.elem_count();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(rows: &[&[f32]]) -> Tensor {
        let v: Vec<Vec<f32>> = rows.iter().map(|r| r.to_vec()).collect();
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-5
    }

    #[test]
    fn masked_ops_equal_plain_ops_on_the_slice() {
        let x = t(&[&[1.0, 2.0, 3.0, 9.0], &[4.0, 5.0, -7.0, 0.5]]);
        let m = t(&[&[0.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0]]);
        let slice = [2.0f64, 3.0, 4.0, 5.0];
        let mean = slice.iter().sum::<f64>() / 4.0;
        let var_u = slice.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 3.0;
        assert!(close(scalar(&masked_mean(&x, &m).unwrap()).unwrap(), mean));
        assert!(close(scalar(&masked_var(&x, &m, true).unwrap()).unwrap(), var_u));
        assert!(close(scalar(&masked_var(&x, &m, false).unwrap()).unwrap(), var_u * 3.0 / 4.0));
        let w = masked_whiten(&x, &m, true).unwrap();
        let wm = scalar(&masked_mean(&w, &m).unwrap()).unwrap();
        let wv = scalar(&masked_var(&w, &m, true).unwrap()).unwrap();
        assert!(wm.abs() < 1e-6 && (wv - 1.0).abs() < 1e-5, "{wm} {wv}");
    }

    #[test]
    fn whiten_rewards_keeps_padding_zero() {
        let r = t(&[&[0.0, 1.0, 3.0, 0.0]]);
        let m = t(&[&[0.0, 1.0, 1.0, 0.0]]);
        let w = whiten_rewards(&r, &m).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(w[0][0], 0.0);
        assert_eq!(w[0][3], 0.0);
        // TRL's version leaks the mean into padding.
        let leaky = masked_whiten(&r, &m, false).unwrap().to_vec2::<f32>().unwrap();
        assert!(leaky[0][3] != 0.0);
    }

    #[test]
    fn every_kl_estimator_is_zero_when_logp_equals_ref() {
        let lp = t(&[&[-1.0, -2.5, -0.1]]);
        for k in [KlPenalty::Kl, KlPenalty::Abs, KlPenalty::Mse, KlPenalty::K3] {
            let kl = kl_penalty(k, &lp, &lp).unwrap();
            assert!(kl.to_vec2::<f32>().unwrap()[0].iter().all(|v| *v == 0.0), "{k:?}");
        }
        let full =
            crate::ops::log_softmax_last_dim(&Tensor::new(&[[[1f32, 2.0, 0.5]]], &Device::Cpu).unwrap())
                .unwrap();
        assert!(scalar(&full_kl(&full, &full).unwrap().sum_all().unwrap()).unwrap().abs() < 1e-7);
    }

    #[test]
    fn k3_is_nonnegative_and_kl_values_match_formulas() {
        let lp = t(&[&[-1.0, -2.0]]);
        let rp = t(&[&[-1.5, -1.0]]);
        let k3 = kl_penalty(KlPenalty::K3, &lp, &rp).unwrap().to_vec2::<f32>().unwrap();
        for (i, d) in [0.5f64, -1.0].iter().enumerate() {
            let want = (-d).exp() - 1.0 + d;
            assert!((k3[0][i] as f64 - want).abs() < 1e-6 && k3[0][i] >= 0.0);
        }
        let mse = kl_penalty(KlPenalty::Mse, &lp, &rp).unwrap().to_vec2::<f32>().unwrap();
        assert!((mse[0][1] - 0.5).abs() < 1e-6);
        let abs = kl_penalty(KlPenalty::Abs, &lp, &rp).unwrap().to_vec2::<f32>().unwrap();
        assert!((abs[0][1] - 1.0).abs() < 1e-6);
    }

    /// Issue #29: a turn's GAE with a bootstrap, by hand: rewards (0, 0, 1), values (0.5, 0.4,
    /// 0.3), γ = 1, λ = 0.95, next value 2 → δ = (−0.1, −0.1, 2.7), A = (2.24175, 2.465, 2.7);
    /// terminated (next value 0) → A = (0.43675, 0.565, 0.7). Padding after the response stays 0.
    #[test]
    fn bootstrapped_gae_matches_a_hand_computation() {
        let v = t(&[&[0.5, 0.4, 0.3, 0.0]]);
        let r = t(&[&[0.0, 0.0, 1.0, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0, 0.0]]);
        for (next, want) in [(2.0f32, [2.24175f32, 2.465, 2.7, 0.0]), (0.0, [0.43675, 0.565, 0.7, 0.0])] {
            let rb = bootstrap_last(&r, &mask, &[next], 1.0).unwrap();
            let a = gae(&v, &rb, 1.0, 0.95).unwrap().to_vec2::<f32>().unwrap();
            for (x, w) in a[0].iter().zip(want) {
                assert!((x - w).abs() < 1e-6, "next {next}: {:?} vs {want:?}", a[0]);
            }
        }
        // γ scales the bootstrap: δ_2 = 1 + 0.5·2 − 0.3.
        let rb = bootstrap_last(&r, &mask, &[2.0], 0.5).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(rb[0], [0.0, 0.0, 2.0, 0.0]);
    }

    #[test]
    fn gae_with_gamma_lambda_one_is_reward_to_go_minus_value() {
        let v = t(&[&[0.5, -0.25, 1.0, 0.0]]);
        let r = t(&[&[1.0, 2.0, -1.0, 0.5]]);
        let adv = gae(&v, &r, 1.0, 1.0).unwrap().to_vec2::<f32>().unwrap();
        let rtg = [2.5f32, 1.5, -0.5, 0.5];
        let vv = [0.5f32, -0.25, 1.0, 0.0];
        for j in 0..4 {
            assert!((adv[0][j] - (rtg[j] - vv[j])).abs() < 1e-6, "{j}: {}", adv[0][j]);
        }
    }

    #[test]
    fn gae_with_lambda_zero_is_one_step_td() {
        let v = t(&[&[0.5, -0.25, 1.0]]);
        let r = t(&[&[1.0, 2.0, -1.0]]);
        let adv = gae(&v, &r, 0.9, 0.0).unwrap().to_vec2::<f32>().unwrap();
        assert!((adv[0][0] - (1.0 + 0.9 * -0.25 - 0.5)).abs() < 1e-6);
        assert!((adv[0][2] - (-1.0 - 1.0)).abs() < 1e-6);
    }

    #[test]
    fn score_lands_on_last_masked_column() {
        let kl = t(&[&[0.1, 0.2, 0.3, 0.4], &[0.0, 0.0, 0.0, 0.0]]);
        let m = t(&[&[0.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 1.0, 1.0]]);
        let (r, ns) = compute_rewards(&[5.0, -1.0], &kl, &m, 0.5).unwrap();
        let r = r.to_vec2::<f32>().unwrap();
        let ns = ns.to_vec2::<f32>().unwrap();
        assert!((r[0][2] - (5.0 - 0.15)).abs() < 1e-6);
        assert!((r[0][3] - -0.2).abs() < 1e-6 && (ns[0][3] - -0.2).abs() < 1e-6);
        assert_eq!(r[1][3], -1.0);
        let empty = t(&[&[0.0, 0.0]]);
        assert!(compute_rewards(&[1.0], &t(&[&[0.0, 0.0]]), &empty, 0.1).is_err());
    }

    #[test]
    fn losses_clip_as_trl() {
        // Ratio e^{0.5} ≈ 1.65 > 1.2 with positive advantage: clipped.
        let old = t(&[&[-1.0, -1.0]]);
        let new = t(&[&[-0.5, -1.0]]);
        let adv = t(&[&[1.0, -1.0]]);
        let m = t(&[&[1.0, 1.0]]);
        let vals = t(&[&[0.0, 0.0]]);
        let vpred = t(&[&[1.0, 0.1]]);
        let ret = t(&[&[1.0, 1.0]]);
        let l = ppo_losses(&old, &vals, &new, &vpred, &m, &adv, &ret, 0.2, 0.2).unwrap();
        // pg: max(-1.65, -1.2) = -1.2 ; max(1*1, 1*1) = 1 → mean -0.1
        assert!((scalar(&l.pg_loss).unwrap() - (-0.1)).abs() < 1e-6);
        assert!((scalar(&l.pg_clipfrac).unwrap() - 0.5).abs() < 1e-9);
        // vf: vpred 1.0 clipped to 0.2: max(0, 0.64) = 0.64; 0.1 in range: 0.81 → ½·mean = 0.3625
        assert!((scalar(&l.vf_loss).unwrap() - 0.3625).abs() < 1e-6);
        assert!((scalar(&l.vf_clipfrac).unwrap() - 0.5).abs() < 1e-9);
    }

    /// One read gives each tensor's values as `scalar` and a flattened `to_vec1` give them, and
    /// the unbiased variance of a known count is `masked_var`'s, bit for bit.
    #[test]
    fn one_read_gives_every_value_and_the_counted_variance_is_the_same() {
        let x = t(&[&[0.3, -1.7, 2.1], &[0.9, 1.1, -0.2]]);
        let m = t(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 1.0]]);
        let mean = masked_mean(&x, &m).unwrap();
        let got = read_f64(&[mean.clone(), x.clone(), m.sum_all().unwrap()]).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], [scalar(&mean).unwrap()]);
        assert_eq!(got[1], x.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap());
        assert_eq!(got[2], [4.0]);
        assert!(read_f64(&[]).unwrap().is_empty());
        let a = scalar(&masked_var(&x, &m, true).unwrap()).unwrap();
        let b = scalar(&masked_var_of_count(&x, &m, 4.0).unwrap()).unwrap();
        assert_eq!(a.to_bits(), b.to_bits());
        assert!(masked_var_of_count(&x, &m, 1.0).is_err());
    }
}
