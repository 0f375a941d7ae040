//! The optimization half of [`PpoTrainer::step_with`]: PPO epochs over shuffled minibatches
//! (clipped policy and value losses, Adam, the `ratio_threshold` skip and the non-finite guard),
//! then the step's stats under TRL's names (`step_stats`, TRL 0.11.4 `PPOTrainer.record_step_stats`).

use candle_core::{DType, Tensor};
use rand::seq::SliceRandom;

use super::{data_parallel, matrix, Batch, PpoTrainer, Rollout, StepInput};
use crate::engine::stats::{mean_std, Stat, Stats};
use crate::error::Result;
use crate::optim::{FusedStep, Grads};
use crate::ppo::math::{self, scalar};

/// Why a minibatch ran no backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skip {
    /// It ran one.
    No,
    /// Its mean ratio exceeded `ratio_threshold`.
    Ratio,
    /// Its loss was NaN or infinite.
    NonFinite,
}

/// Whether a minibatch's `loss/total` is finite (a skipped one reports 0).
fn loss_is_finite(stats: &Stats) -> bool {
    stats.get("loss/total").and_then(Stat::as_f64).is_none_or(f64::is_finite)
}

/// Rollout tensors the optimization reads, each `(B, L−1)`.
pub(super) struct TrainData<'a> {
    pub(super) old_logprobs: &'a Tensor,
    pub(super) values: &'a Tensor,
    pub(super) advantages: &'a Tensor,
    pub(super) returns: &'a Tensor,
    /// Compute the policy's LM head on response positions only: the old logprobs came from the
    /// rollout cache and are 0 elsewhere, so nothing outside the responses is compared.
    pub(super) response_only: bool,
}

impl PpoTrainer {
    /// PPO epochs over shuffled minibatches; returns each minibatch's stats.
    ///
    /// On several processes ([`super::data_parallel`]): one permutation of the whole batch,
    /// drawn alike everywhere, cut into global minibatches of `mini_batch_size` × N rows; each
    /// process trains on its rows of each and the gradients are averaged before the update.
    pub(super) fn optimize(&mut self, batch: &Batch, data: &TrainData) -> Result<Vec<Stats>> {
        let cfg = self.config.clone();
        let world = self.dist().world_size();
        let dp = world > 1;
        // This process's rows are [first, first + batch_size) of the whole batch.
        let first = self.dist().rank() * cfg.batch_size;
        // Each row's response tokens, read once per step: a minibatch's token count (its
        // variances' divisor, its share of a global minibatch) then needs no read of its own.
        let row_tokens: Vec<f64> = batch.mask.sum(1)?.to_dtype(DType::F64)?.to_vec1()?;
        let mut all = Vec::new();
        let mut grads = self.grads.take().unwrap_or_else(|| self.optimizer.new_grads());
        // The slot may point at the optimizer's own buffers (rejection sampling's steps use them).
        self.optimizer.bind(&grads);
        let mut critic_grads = self.critic.as_mut().map(|c| {
            let g = c.grads.take().unwrap_or_else(|| c.optimizer.new_grads());
            c.optimizer.bind(&g);
            g
        });
        for _epoch in 0..cfg.ppo_epochs {
            let perm = match self.forced_permutations.pop_front() {
                Some(p) => p,
                None => {
                    let mut p: Vec<usize> = (0..cfg.batch_size * world).collect();
                    p.shuffle(&mut self.rng);
                    p
                }
            };
            let mut last_policykl = 0.0;
            for backward in perm.chunks(cfg.backward_batch_size() * world) {
                grads.clear();
                if let Some(g) = critic_grads.as_mut() {
                    g.clear();
                }
                // One minibatch per update and no clipping: each weight whose gradient is one
                // product is updated inside that product (`Adam::step_fused`, same results).
                // Not on several processes: the gradients are averaged before any update.
                // PPO-ptx writes each weight's gradient twice (two forwards), so not fused.
                let fused =
                    cfg.gradient_accumulation_steps == 1 && cfg.max_grad_norm.is_none() && self.ptx.is_none();
                if fused && !self.record_grads && !dp {
                    let placeholder = self.optimizer.placeholder()?;
                    let mut optimizer = std::mem::replace(&mut self.optimizer, placeholder);
                    let mut stats = None;
                    let mut ran_backward = false;
                    let ran: Result<FusedStep> = optimizer.adam_mut().step_fused(&mut grads, |grads| {
                        let (s, skip) = self.train_minibatch(
                            batch,
                            data,
                            backward,
                            &row_tokens,
                            grads,
                            critic_grads.as_mut(),
                            None,
                            None,
                        )?;
                        stats = Some(s);
                        ran_backward = skip == Skip::No;
                        Ok(ran_backward)
                    });
                    self.optimizer = optimizer;
                    if ran? == FusedStep::NonFinite {
                        self.skip_non_finite_update("gradient");
                    }
                    if let (Some(g), true) = (critic_grads.as_mut(), ran_backward) {
                        self.step_critic(g)?;
                    }
                    if let Some(stats) = stats {
                        if !loss_is_finite(&stats) {
                            self.skip_non_finite_update("loss");
                        }
                        last_policykl = stats.get("policy/policykl").and_then(Stat::as_f64).unwrap_or(0.0);
                        all.push(stats);
                    }
                    continue;
                }
                let (mut any, mut non_finite) = (false, false);
                for mb in backward.chunks(cfg.mini_batch_size * world) {
                    let (stats, skip) = if dp {
                        let rows: Vec<usize> = mb
                            .iter()
                            .filter(|&&g| (first..first + cfg.batch_size).contains(&g))
                            .map(|&g| g - first)
                            .collect();
                        let share = data_parallel::Share::new(
                            self.dist(),
                            rows.iter().map(|&r| row_tokens[r]).sum(),
                        )?;
                        if rows.is_empty() {
                            self.empty_minibatch(&share)?
                        } else {
                            self.train_minibatch(
                                batch,
                                data,
                                &rows,
                                &row_tokens,
                                &mut grads,
                                critic_grads.as_mut(),
                                Some(&share),
                                None,
                            )?
                        }
                    } else {
                        let ptx_rows = self.ptx.as_mut().map(|p| p.next_rows(cfg.mini_batch_size));
                        self.train_minibatch(
                            batch,
                            data,
                            mb,
                            &row_tokens,
                            &mut grads,
                            critic_grads.as_mut(),
                            None,
                            ptx_rows.as_deref(),
                        )?
                    };
                    last_policykl = stats.get("policy/policykl").and_then(Stat::as_f64).unwrap_or(0.0);
                    any |= skip == Skip::No;
                    non_finite |= skip == Skip::NonFinite;
                    all.push(stats);
                }
                if dp {
                    // The processes agree: a non-finite loss anywhere skips the update everywhere.
                    non_finite = self.dist().sum(f64::from(u8::from(non_finite)))? > 0.0;
                }
                if non_finite {
                    // Part of the accumulated gradient is missing: no update at all.
                    self.skip_non_finite_update("loss");
                    continue;
                }
                if any && self.record_grads {
                    self.record_grads = false;
                    let mut named = Vec::new();
                    for (i, n) in self.var_names.iter().enumerate() {
                        if let Some(g) = grads.get(i)? {
                            named.push((n.clone(), g));
                        }
                    }
                    self.recorded_grads = Some(named);
                }
                if any {
                    let lr = self.optimizer.learning_rate();
                    if !self.optimizer.clip_and_step(&mut grads, lr)?.is_finite() {
                        self.skip_non_finite_update("gradient");
                    }
                    if let Some(g) = critic_grads.as_mut() {
                        self.step_critic(g)?;
                    }
                }
            }
            if cfg.early_stopping && last_policykl > 1.5 * cfg.target_kl {
                tracing::info!("early stopping: policy KL {last_policykl:.4} > 1.5 × target_kl");
                break;
            }
        }
        self.grads = Some(grads);
        if let (Some(c), Some(g)) = (self.critic.as_mut(), critic_grads) {
            c.grads = Some(g);
        }
        Ok(all)
    }

    /// A global minibatch none of whose rows this process holds: it joins the collectives of
    /// [`Self::train_minibatch`] with nothing, and gets the same decision and metrics.
    fn empty_minibatch(&self, share: &data_parallel::Share) -> Result<(Stats, Skip)> {
        let avg_ratio = share.global_mean(0.0)?;
        let skipped = avg_ratio > self.config.ratio_threshold;
        let stats = share.global_stats(None, self.config.vf_coef, skipped)?;
        Ok((stats, if skipped { Skip::Ratio } else { Skip::No }))
    }

    /// Counts and logs an optimizer update skipped for a non-finite `what` (loss or gradient).
    pub(in crate::ppo) fn skip_non_finite_update(&mut self, what: &str) {
        self.skipped_updates += 1;
        tracing::warn!(
            "update skipped: the {what} is not finite (NaN or infinite), so no weight changed \
             ({} updates skipped so far; see rltune/skipped_updates)",
            self.skipped_updates
        );
    }

    /// Forward, losses and backward of one minibatch; gradients are added to `grads` (and,
    /// with a separate critic, the value loss's to `critic_grads`).
    /// Returns the minibatch stats (TRL `PPOTrainer.loss`) and whether (and why) its backward
    /// was skipped: a non-finite loss runs no backward, so it never reaches a gradient.
    ///
    /// With `share` (several processes), the ratio test, the loss's normalisation and the stats
    /// are of the whole global minibatch ([`super::data_parallel`]).
    ///
    /// It reads from the device twice: the mean ratio and the loss before the backward (whether
    /// to run it), then every statistic at once (on a GPU each read is a synchronization; one
    /// per value was about 26 a minibatch). `row_tokens[r]` is row `r`'s response token count.
    ///
    /// With `ptx_rows` (PPO-ptx, [`PpoTrainer::with_ptx`]), `ptx_coef ×` those supervised
    /// examples' cross-entropy joins the policy's loss in the backward and in the finiteness
    /// test; `loss/total` stays PPO's, and the cross-entropy is reported as `loss/ptx`.
    #[allow(clippy::too_many_arguments)]
    fn train_minibatch(
        &self,
        batch: &Batch,
        data: &TrainData,
        rows: &[usize],
        row_tokens: &[f64],
        grads: &mut Grads,
        critic_grads: Option<&mut Grads>,
        share: Option<&data_parallel::Share>,
        ptx_rows: Option<&[usize]>,
    ) -> Result<(Stats, Skip)> {
        let cfg = &self.config;
        let idx =
            Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &self.device)?;
        let sel = |t: &Tensor| t.index_select(&idx, 0);
        let (ids, pos, bias, mask) =
            (sel(&batch.ids)?, sel(&batch.positions)?, sel(&batch.bias)?, sel(&batch.mask)?);
        let (old_lp, old_v, adv, ret) =
            (sel(data.old_logprobs)?, sel(data.values)?, sel(data.advantages)?, sel(data.returns)?);
        let select = if data.response_only { Some(&mask) } else { None };
        let allowed = batch.allowed.as_ref().map(|c| c.select(&idx)).transpose()?;
        let (logp, entropy, vpreds) = self.policy_forward(&ids, &pos, &bias, select, allowed.as_ref())?;
        let l = math::ppo_losses(
            &old_lp,
            &old_v,
            &logp,
            &vpreds,
            &mask,
            &adv,
            &ret,
            cfg.cliprange,
            cfg.cliprange_value,
        )?;
        let loss = (&l.pg_loss + (&l.vf_loss * cfg.vf_coef)?)?;
        // PPO-ptx: the supervised term, added to the policy's side of the loss.
        let ptx = match (ptx_rows, self.ptx.as_ref()) {
            (Some(r), Some(p)) => Some((self.ptx_loss(r)?, p.coef)),
            _ => None,
        };
        let with_ptx = |t: &Tensor| -> Result<Tensor> {
            Ok(match &ptx {
                Some((ce, coef)) => (t + (ce * *coef)?)?,
                None => t.clone(),
            })
        };
        let decide = math::read_f64(&[math::masked_mean(&l.ratio, &mask)?, with_ptx(&loss)?])?;
        let (local_ratio, loss_value) = (decide[0][0], decide[1][0]);
        let avg_ratio = match share {
            None => local_ratio,
            Some(sh) => sh.global_mean(local_ratio)?,
        };
        let skipped = avg_ratio > cfg.ratio_threshold;
        let finite = loss_value.is_finite();
        let skip = match (skipped, finite) {
            (true, _) => Skip::Ratio,
            (false, false) => Skip::NonFinite,
            (false, true) => Skip::No,
        };
        if skipped {
            tracing::warn!(
                "minibatch skipped: mean ratio {avg_ratio:.2} > ratio_threshold {}; the policy moved too far",
                cfg.ratio_threshold
            );
        } else if finite {
            let gas = cfg.gradient_accumulation_steps as f64;
            // On several processes each loss is this process's part of the global minibatch's.
            let part = |t: &Tensor| -> Result<Tensor> {
                let t = (t / gas)?;
                Ok(match share {
                    Some(sh) => (t * sh.loss_scale())?,
                    None => t,
                })
            };
            match critic_grads {
                // Separate models: each loss term steps its own model (see `ppo::critic`).
                Some(cg) => {
                    grads.backward(&part(&with_ptx(&l.pg_loss)?)?)?;
                    cg.backward(&part(&(&l.vf_loss * cfg.vf_coef)?)?)?;
                }
                None => grads.backward(&part(&with_ptx(&loss)?)?)?,
            }
        }
        let entropy = math::masked_mean(&entropy, &mask)?;
        let logp = logp.detach();
        let d = (&logp - &old_lp)?;
        let vpreds = vpreds.detach();
        let n_tokens: f64 = rows.iter().map(|&r| row_tokens[r]).sum();
        // Every statistic, as TRL's `loss` names them, in one read: rank-0 tensors are scalars,
        // the others arrays. The losses read 0 for a skipped minibatch.
        let mut named: Vec<(&str, Tensor)> = vec![
            ("loss/policy", l.pg_loss.clone()),
            ("loss/value", l.vf_loss.clone()),
            ("loss/total", loss),
            ("policy/entropy", entropy),
            ("policy/approxkl", (math::masked_mean(&d.sqr()?, &mask)? * 0.5)?),
            ("policy/policykl", math::masked_mean(&d.neg()?, &mask)?),
            ("policy/clipfrac", l.pg_clipfrac.clone()),
            ("policy/advantages", adv.clone()),
            ("policy/advantages_mean", math::masked_mean(&adv, &mask)?),
            ("policy/ratio", l.ratio.clone()),
            ("returns/mean", math::masked_mean(&ret, &mask)?),
            ("val/vpred", math::masked_mean(&vpreds, &mask)?),
            ("val/error", math::masked_mean(&(&vpreds - &ret)?.sqr()?, &mask)?),
            ("val/clipfrac", l.vf_clipfrac.clone()),
            ("val/mean", math::masked_mean(&old_v, &mask)?),
        ];
        if let Some((ce, _)) = &ptx {
            named.push(("loss/ptx", ce.detach()));
        }
        // One process: the unbiased variances, where there are two response tokens or more (TRL
        // divides by zero on one and reports NaN; such a minibatch leaves both out of the step's
        // averages). Several processes: the local means of ret² and old_v², read after the
        // statistics, for the global variances.
        if share.is_none() && n_tokens >= 2.0 {
            named.push(("returns/var", math::masked_var_of_count(&ret, &mask, n_tokens)?));
            named.push(("val/var", math::masked_var_of_count(&old_v, &mask, n_tokens)?));
        }
        let mut tensors: Vec<Tensor> = named.iter().map(|(_, t)| t.clone()).collect();
        if share.is_some() {
            tensors.push(math::masked_mean(&ret.sqr()?, &mask)?);
            tensors.push(math::masked_mean(&old_v.sqr()?, &mask)?);
        }
        let mut values = math::read_f64(&tensors)?;
        let squares: Vec<f64> = values.split_off(named.len()).into_iter().map(|v| v[0]).collect();
        let mut s = Stats::new();
        for ((name, t), v) in named.iter().zip(values) {
            let zero = skipped && name.starts_with("loss/");
            let stat =
                if t.rank() == 0 { Stat::Scalar(if zero { 0.0 } else { v[0] }) } else { Stat::Array(v) };
            s.insert((*name).into(), stat);
        }
        if let Some(sh) = share {
            return Ok((sh.global_stats(Some((&s, squares[0], squares[1])), cfg.vf_coef, skipped)?, skip));
        }
        Ok((s, skip))
    }

    /// The step-level stats of TRL `record_step_stats`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step_stats(
        &self,
        input: &StepInput,
        scores: &[f32],
        kl: &Tensor,
        non_score: &Tensor,
        rollout: &Rollout,
        batch: &Batch,
        kl_coef: f64,
    ) -> Result<Stats> {
        let mask = &batch.mask;
        // Per-sample values of every process (one process: its own).
        let kl_dist = (kl * mask)?.sum(1)?;
        let kl_list: Vec<f64> = self.dist().gather_f64(&kl_dist.to_dtype(DType::F64)?.to_vec1()?)?;
        let nll: Vec<f64> = self
            .dist()
            .gather_f64(&(rollout.logprobs.neg()? * mask)?.sum(1)?.to_dtype(DType::F64)?.to_vec1()?)?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let mut s = Stats::new();
        s.insert("objective/kl".into(), Stat::Scalar(mean(&kl_list)));
        s.insert("objective/kl_dist".into(), Stat::Array(kl_list));
        s.insert("objective/logprobs".into(), Stat::Matrix(matrix(&rollout.logprobs)?));
        s.insert("objective/ref_logprobs".into(), Stat::Matrix(matrix(&rollout.ref_logprobs)?));
        s.insert("objective/kl_coef".into(), Stat::Scalar(kl_coef));
        s.insert("objective/entropy".into(), Stat::Scalar(mean(&nll)));
        let non_score_mean = if self.dist().world_size() == 1 {
            scalar(&math::masked_mean(non_score, mask)?)?
        } else {
            self.dist().mean_of(scalar(&(non_score * mask)?.sum_all()?)?, scalar(&mask.sum_all()?)?)?
        };
        s.insert("ppo/mean_non_score_reward".into(), Stat::Scalar(non_score_mean));
        let sc: Vec<f64> = self.dist().gather_f64(&scores.iter().map(|&x| x as f64).collect::<Vec<_>>())?;
        let (m, sd) = mean_std(&sc);
        s.insert("ppo/mean_scores".into(), Stat::Scalar(m));
        s.insert("ppo/std_scores".into(), Stat::Scalar(sd));
        for (name, rows) in [("queries", input.queries), ("responses", input.responses)] {
            let lens: Vec<f64> =
                self.dist().gather_f64(&rows.iter().map(|r| r.len() as f64).collect::<Vec<_>>())?;
            let (m, sd) = mean_std(&lens);
            s.insert(format!("tokens/{name}_len_mean"), Stat::Scalar(m));
            s.insert(format!("tokens/{name}_len_std"), Stat::Scalar(sd));
            s.insert(format!("tokens/{name}_dist"), Stat::Array(lens));
        }
        Ok(s)
    }
}

/// `ppo/*` = the mean over minibatches of each minibatch stat; the per-token arrays
/// (`policy/advantages`, `policy/ratio`) are concatenated. Then `ppo/val/var_explained`.
pub(super) fn average_minibatch_stats(stats: &mut Stats, mbs: &[Stats]) -> Result<()> {
    // Every key any minibatch has, with the first value seen (for its kind); a scalar is
    // averaged over the minibatches that have it (a one-token minibatch has no variances).
    let mut kinds: std::collections::BTreeMap<&String, &Stat> = std::collections::BTreeMap::new();
    for mb in mbs {
        for (k, v) in mb.iter() {
            kinds.entry(k).or_insert(v);
        }
    }
    for (key, kind) in kinds {
        let value = match kind {
            Stat::Scalar(_) => {
                let xs: Vec<f64> = mbs.iter().filter_map(|s| s.get(key).and_then(Stat::as_f64)).collect();
                Stat::Scalar(xs.iter().sum::<f64>() / xs.len() as f64)
            }
            _ => Stat::Array(
                mbs.iter()
                    .filter_map(|s| match s.get(key) {
                        Some(Stat::Array(a)) => Some(a.clone()),
                        _ => None,
                    })
                    .flatten()
                    .collect(),
            ),
        };
        stats.insert(format!("ppo/{key}"), value);
    }
    let get = |k: &str| stats.get(k).and_then(Stat::as_f64).unwrap_or(f64::NAN);
    let ve = 1.0 - get("ppo/val/error") / get("ppo/returns/var");
    stats.insert("ppo/val/var_explained".into(), Stat::Scalar(ve));
    Ok(())
}

/// Warns, in the log and the stats, when the KL estimate is negative beyond sampling noise.
///
/// On responses sampled from the current policy, every sequence's k1 estimate has expectation
/// KL ≥ 0, but a batch mean is noisy (a few dozen sequences read −0.01 often). The guard fires
/// when `objective/kl` is below three standard errors of that mean (and below −1e-3, float
/// noise of a rollout-cached logprob vs its recomputation, summed over a response: the first
/// step of a LoRA run, where policy and reference are one model, read −1e-4): then the
/// responses were not sampled as the policy now samples. TRL 0.11 warns only below −1.
pub(super) fn negative_kl_guard(stats: &mut Stats, mean_kl: f64) {
    if mean_kl < negative_kl_floor(stats, mean_kl) {
        let msg = format!(
            "objective/kl is negative ({mean_kl:.4}) beyond sampling noise: the responses were likely not \
             sampled from the policy as it is now (top-k, top-p, min-length or a different temperature, or \
             responses from elsewhere); PPO can exploit a negative KL estimate"
        );
        tracing::warn!("{msg}");
        stats.insert("warnings/negative_kl".into(), Stat::Text(msg));
    }
}

/// The threshold of [`negative_kl_guard`]: `−max(1e-3, 3 · standard error)` of the per-sequence
/// KL estimates in `objective/kl_dist`.
fn negative_kl_floor(stats: &Stats, mean_kl: f64) -> f64 {
    let se = match stats.get("objective/kl_dist") {
        Some(Stat::Array(d)) if d.len() > 1 => {
            let var = d.iter().map(|x| (x - mean_kl).powi(2)).sum::<f64>() / (d.len() - 1) as f64;
            (var / d.len() as f64).sqrt()
        }
        _ => 0.0,
    };
    -(3.0 * se).max(1e-3)
}
