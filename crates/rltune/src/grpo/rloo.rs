//! `RlooTrainer::step`: TRL 1.16.0's `RLOOTrainer` on one generation batch.
//!
//! Top to bottom: check the groups → pad (see `super::core`) → old sequence logprobs (always)
//! and the reference's per-token ones (`beta > 0`) → rewards: weighted NaN-skipping sum, clipped
//! to `reward_clip_range`, minus `β · Σ_t (old − ref)` (k1, folded into the reward) → leave-one-out
//! advantages, optionally whitened → per iteration: the sequence ratio
//! `exp(Σ_t logp − Σ_t old)`, `mean_b(−min(ρA, clip(ρ)A))`, one AdamW step → TRL's metrics.
//!
//! Deliberate deviations from TRL 1.16.0: none in the numbers (see [`super::trainer`]).

use candle_core::{Tensor, D};

use super::config::RlooConfig;
use super::core::{
    generation_stats, global_rewards, local_rows, reference_or_frozen_policy, rows, turn_generation_stats,
    weights_or_ones, Core, GroupBatch, Normaliser, Padded, RewardTable, TurnBatch,
};
use super::math::{self, nanmax, nanmean, nanmin};
use crate::engine::{Stat, Stats};
use crate::error::{ConfigError, Error, Result};
use crate::models::CausalLm;
use crate::params::ParamStore;

/// TRL's `RLOOTrainer`, one generation batch per [`RlooTrainer::step`].
pub struct RlooTrainer {
    /// Hyper-parameters.
    pub config: RlooConfig,
    core: Core,
}

impl RlooTrainer {
    /// A trainer over a trainable `store` holding `policy`. The reference is only used when
    /// `beta > 0` (TRL's default 0.05); without one, it is a frozen copy of `store` as it is
    /// now (the initial policy), as TRL 1.16.0's `RLOOTrainer` does.
    pub fn new(
        config: RlooConfig,
        store: ParamStore,
        policy: CausalLm,
        reference: Option<CausalLm>,
    ) -> Result<Self> {
        config.validate()?;
        let reference = reference_or_frozen_policy(config.beta, reference, &store, &policy)?;
        let core = Core::new(store, policy, reference, config.optim_args(), config.temperature)?;
        Ok(Self { config, core })
    }

    /// This trainer on `dist`'s processes (a data-parallel run): each holds its share of the
    /// prompts, the advantages and statistics are the whole batch's, and the optimizer averages
    /// the gradients over them ([`crate::dist`]).
    pub fn with_dist(mut self, dist: crate::dist::Dist) -> Self {
        self.core.set_dist(dist);
        self
    }

    /// The policy's parameters.
    pub fn store(&self) -> &ParamStore {
        &self.core.store
    }

    /// The policy.
    pub fn policy(&self) -> &CausalLm {
        &self.core.policy
    }

    /// What a run carries between steps (optimizer, counters), for checkpoints.
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// [`Self::core`], to restore a checkpoint.
    pub(crate) fn core_mut(&mut self) -> &mut Core {
        &mut self.core
    }

    /// One step with a single reward function named `reward`, truncation by TRL's rule.
    pub fn step(
        &mut self,
        prompts: &[Vec<u32>],
        completions: &[Vec<u32>],
        rewards: &[f32],
    ) -> Result<Vec<Stats>> {
        let table = RewardTable::single(rewards);
        self.step_with(&GroupBatch { prompts, completions, rewards: &table, truncated: None, allowed: None })
    }

    /// One RLOO step: `num_iterations` optimizer steps; returns the metrics TRL logs at each.
    pub fn step_with(&mut self, batch: &GroupBatch) -> Result<Vec<Stats>> {
        let _awake = self.core.device.is_cpu().then(crate::cpu::keep_pool_awake);
        let cfg = self.config.clone();
        let g = cfg.num_generations;
        let weights = weights_or_ones(cfg.reward_weights.as_deref(), batch.rewards.names.len());
        let truncated = self.core.check(
            batch,
            g,
            cfg.max_completion_length,
            cfg.per_device_train_batch_size,
            cfg.reward_weights.as_deref(),
        )?;
        let in_loss: Vec<bool> = truncated.iter().map(|t| !(cfg.mask_truncated_completions && *t)).collect();
        let padded = self.core.pad(batch.prompts, batch.completions, &in_loss, batch.allowed, false)?;
        let (old_seq, kl_seq) = self.old_and_kl(&padded)?;
        // In a data-parallel run: the rewards of every process (as TRL gathers them); the KL term
        // below is folded into this process's rows, then gathered too.
        let b = batch.prompts.len();
        let table = global_rewards(self.core.dist(), batch.rewards)?;
        let mut rewards = math::weighted_rewards(&batch.rewards.values, &weights);
        if let Some((lo, hi)) = cfg.reward_clip_range {
            rewards.iter_mut().for_each(|r| *r = r.clamp(lo, hi));
        }
        let mut kl_metric = None;
        if let Some(kl_seq) = &kl_seq {
            for (r, k) in rewards.iter_mut().zip(kl_seq) {
                *r -= cfg.beta * k;
            }
            kl_metric = Some(self.core.dist().mean_of(kl_seq.iter().sum::<f64>(), padded.n_tokens)?);
        }
        let rewards = self.core.dist().gather_f64(&rewards)?;
        let (adv, group_std) = math::rloo_advantages(&rewards, g, cfg.normalize_advantages);
        let adv = adv[local_rows(self.core.dist(), b)].to_vec();
        let first =
            generation_stats(&mut self.core, batch.prompts, batch.completions, &table, &truncated, &weights)?;
        self.update(vec![(padded, old_seq, adv)], first, &group_std, kl_metric, Normaliser::Local)
    }

    /// One trajectory-level RLOO step on the turns of groups of episodes (text games): an
    /// episode's reward is its return (clipped to `reward_clip_range`) minus `β ·` the k1 KL of
    /// all its turns' tokens, its advantage the leave-one-out one within its group, and every
    /// turn of the episode gets it; each turn is one sequence of the update of
    /// [`Self::step_with`]. With `allowed`, the policy's distributions are renormalised over
    /// the admissible actions' tokens.
    ///
    /// Data-parallel: every process holds whole groups (the same number of episodes); each
    /// folds the KL of its own episodes into their rewards, the advantages are computed over
    /// every process's, and the loss is normalised over every process's turns.
    pub fn step_turns(&mut self, batch: &TurnBatch) -> Result<Vec<Stats>> {
        let _awake = self.core.device.is_cpu().then(crate::cpu::keep_pool_awake);
        let cfg = self.config.clone();
        let g = cfg.num_generations;
        self.core.check_turns(batch, g, cfg.max_completion_length)?;
        if batch.step_credit.is_some() {
            return Err(Error::Setting(ConfigError::table(
                "episodes.gigpo",
                "GiGPO's step credit is for GRPO: use [algorithm] kind = \"grpo\" with [episodes.gigpo]",
            )));
        }
        let mut rewards = batch.returns.to_vec();
        if let Some((lo, hi)) = cfg.reward_clip_range {
            rewards.iter_mut().for_each(|r| *r = r.clamp(lo, hi));
        }
        let (mut chunks, mut kl_sum, mut tokens) = (Vec::new(), 0.0, 0.0);
        for (idx, padded) in self.core.turn_chunks(batch)? {
            let (old_seq, kl_seq) = self.old_and_kl(&padded)?;
            if let Some(kl_seq) = &kl_seq {
                for (&i, k) in idx.iter().zip(kl_seq) {
                    rewards[batch.episodes[i]] -= cfg.beta * k;
                    kl_sum += k;
                }
            }
            tokens += padded.n_tokens;
            chunks.push((idx, padded, old_seq));
        }
        let kl_metric = match self.core.reference {
            Some(_) => Some(self.core.dist().mean_of(kl_sum, tokens)?),
            None => None,
        };
        let rewards = self.core.dist().gather_f64(&rewards)?;
        let first_episode = local_rows(self.core.dist(), batch.returns.len()).start;
        let (adv, group_std) = math::rloo_advantages(&rewards, g, cfg.normalize_advantages);
        let chunks = chunks
            .into_iter()
            .map(|(idx, padded, old)| {
                (padded, old, idx.iter().map(|&i| adv[first_episode + batch.episodes[i]]).collect())
            })
            .collect();
        let returns = RewardTable::episode_returns(&self.core.dist().gather_f64(batch.returns)?);
        let first = turn_generation_stats(&mut self.core, batch, &returns)?;
        self.update(chunks, first, &group_std, kl_metric, Normaliser::Global)
    }

    /// The old sequence logprobs `(B, 1)` and, with a reference, each row's k1 KL `Σ_t (old − ref)`.
    fn old_and_kl(&self, padded: &Padded) -> Result<(Tensor, Option<Vec<f64>>)> {
        let mask = &padded.mask;
        let old_tok = self.core.logprobs_no_grad(&self.core.policy, padded)?;
        let old_seq = (&old_tok * mask)?.sum_keepdim(D::Minus1)?;
        let kl_seq = match &self.core.reference {
            Some(r) => {
                let ref_tok = self.core.logprobs_no_grad(r, padded)?;
                let kl_tok = ((&old_tok - &ref_tok)? * mask)?;
                Some(rows(&kl_tok.sum_keepdim(D::Minus1)?)?.into_iter().map(|r| r[0]).collect())
            }
            None => None,
        };
        Ok((old_seq, kl_seq))
    }

    /// `num_iterations` optimizer steps of the sequence-level clipped objective on a batch of
    /// padded micro-batches (`chunks`: each with its old sequence logprobs and its rows'
    /// advantages; their gradients are summed, each chunk's loss being its rows' sum over the
    /// batch's rows — `norm`'s — so one chunk is the plain mean); `first` (the generation-side
    /// metrics) joins the first step's, with `frac_reward_zero_std` from the groups' `group_std` and `kl`.
    fn update(
        &mut self,
        chunks: Vec<(Padded, Tensor, Vec<f64>)>,
        mut first: Stats,
        group_std: &[f64],
        kl_metric: Option<f64>,
        norm: Normaliser,
    ) -> Result<Vec<Stats>> {
        let cfg = self.config.clone();
        let total_rows: usize = chunks.iter().map(|c| c.2.len()).sum();
        let total_tokens: f64 = chunks.iter().map(|c| c.0.n_tokens).sum();
        // The rows the loss is the mean over: this process's, or (turns) every process's share.
        let (norm_rows, _) = norm.totals(self.core.dist(), total_rows, total_tokens)?;
        let single = chunks.len() == 1 && norm_rows == total_rows as f64;
        let zero =
            group_std.iter().filter(|s| math::is_zero_std(**s)).count() as f64 / group_std.len() as f64;
        first.insert("frac_reward_zero_std".into(), Stat::Scalar(zero));
        if let Some(kl) = kl_metric {
            first.insert("kl".into(), Stat::Scalar(kl));
        }
        let adv_ts = chunks.iter().map(|c| self.core.column(&c.2)).collect::<Result<Vec<_>>>()?;
        let adv: Vec<f64> = chunks.iter().flat_map(|c| c.2.iter().copied()).collect();
        let (lo, hi) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high());

        let mut logs = Vec::new();
        for k in 0..cfg.num_iterations {
            let (parts, loss, grad_norm, lr) = self.core.optimizer_step_accum(chunks.len(), |core, i| {
                let (padded, old_seq, _) = &chunks[i];
                let mask = &padded.mask;
                let adv_t = &adv_ts[i];
                let (logp, entropy) = core.logprobs(&core.policy, padded, true)?;
                let seq = (&logp * mask)?.sum_keepdim(D::Minus1)?;
                let ratio = (seq - old_seq)?.exp()?; // (B, 1)
                let clipped = math::clamp(&ratio, lo, hi)?;
                let obj = math::minimum(&(&ratio * adv_t)?, &(&clipped * adv_t)?)?.neg()?;
                let loss = if single { obj.mean_all()? } else { (obj.sum_all()? / norm_rows)? };
                let ent: f64 = rows(&(&entropy * mask)?)?.iter().flatten().sum();
                Ok((loss, (ratio.detach(), ent)))
            })?;
            let mut s = if k == 0 { std::mem::take(&mut first) } else { Stats::new() };
            s.insert("loss".into(), Stat::Scalar(self.core.dist().mean(loss)?));
            s.insert("grad_norm".into(), Stat::Scalar(grad_norm));
            s.insert("learning_rate".into(), Stat::Scalar(lr));
            let ent: f64 = parts.iter().map(|p| p.1).sum();
            s.insert("entropy".into(), Stat::Scalar(self.core.dist().mean_of(ent, total_tokens)?));
            let mut ratio: Vec<f64> = Vec::with_capacity(total_rows);
            for p in &parts {
                ratio.extend(rows(&p.0)?.into_iter().map(|r| r[0]));
            }
            let flag = |f: &dyn Fn(f64, f64) -> bool| -> Result<Vec<f64>> {
                let own: Vec<f64> =
                    ratio.iter().zip(&adv).map(|(&x, &a)| f64::from(u8::from(f(x, a)))).collect();
                Ok(self.core.dist().gather_var_f64(&own)?.0)
            };
            let low = flag(&|x, a| x < lo && a < 0.0)?;
            let high = flag(&|x, a| x > hi && a > 0.0)?;
            let region = flag(&|x, a| (x < lo && a < 0.0) || (x > hi && a > 0.0))?;
            s.insert("clip_ratio/low_mean".into(), Stat::Scalar(nanmean(&low)));
            s.insert("clip_ratio/low_min".into(), Stat::Scalar(nanmin(&low)));
            s.insert("clip_ratio/high_mean".into(), Stat::Scalar(nanmean(&high)));
            s.insert("clip_ratio/high_max".into(), Stat::Scalar(nanmax(&high)));
            s.insert("clip_ratio/region_mean".into(), Stat::Scalar(nanmean(&region)));
            s.insert(
                "epoch".into(),
                Stat::Scalar(self.core.calls as f64 + (k + 1) as f64 / cfg.num_iterations as f64),
            );
            s.insert("rltune/skipped_updates".into(), Stat::Scalar(self.core.skipped_updates as f64));
            logs.push(s);
        }
        self.core.calls += 1;
        Ok(logs)
    }
}
