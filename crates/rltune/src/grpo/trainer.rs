//! `GrpoTrainer::step`: TRL 1.16.0's `GRPOTrainer` on one generation batch.
//!
//! One call, top to bottom: check the groups → pad (TRL's layout, see `super::core`) → old
//! logprobs (only with `num_iterations > 1`; otherwise the current ones, detached, as TRL) and
//! the reference's (only with `beta > 0`) → rewards to group-relative advantages → per iteration:
//! forward, clipped objective + β·k3, the `loss_type` normalization, one AdamW step → the metrics
//! TRL logs for each optimizer step, under its names.
//!
//! Deliberate deviations from TRL 1.16.0: none in the numbers. A non-finite loss or gradient
//! skips the update (`rltune/skipped_updates`) where TRL would step. rltune computes in f32
//! (TRL defaults to bf16 autocast); generation is not part of a step.

use candle_core::Tensor;

use super::config::GrpoConfig;
use super::config::LossType;
use super::core::{
    generation_stats, global_rewards, local_rows, reference_or_frozen_policy, rows, turn_generation_stats,
    weights_or_ones, Core, GroupBatch, Normaliser, Padded, RewardTable, TurnBatch,
};
use super::gigpo::{self, StepAdvantages};
use super::math::{self, nanmax, nanmin, ObjectiveParams};
use crate::engine::{Stat, Stats};
use crate::error::Result;
use crate::models::CausalLm;
use crate::params::ParamStore;

/// TRL's `GRPOTrainer`, one generation batch per [`GrpoTrainer::step`].
pub struct GrpoTrainer {
    /// Hyper-parameters.
    pub config: GrpoConfig,
    core: Core,
}

impl GrpoTrainer {
    /// A trainer over a trainable `store` holding `policy`. The reference is only used when
    /// `beta > 0`; without one, it is a frozen copy of `store` as it is
    /// now (the initial policy), as TRL 1.16.0's `GRPOTrainer` does.
    pub fn new(
        config: GrpoConfig,
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

    /// Optimizer steps taken so far.
    pub fn global_step(&self) -> usize {
        self.core.global_step
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

    /// One GRPO step on a generation batch: `num_iterations` optimizer steps. Returns the
    /// metrics TRL logs at each (the first also has the generation-side ones).
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

        // The advantages over the whole batch (every process's rewards, as TRL gathers them),
        // then this process's rows.
        let b = batch.prompts.len();
        let table = global_rewards(self.core.dist(), batch.rewards)?;
        let adv = math::grpo_advantages(
            &table.values,
            &weights,
            g,
            cfg.scale_rewards,
            cfg.multi_objective_aggregation,
        );
        let mut first =
            generation_stats(&mut self.core, batch.prompts, batch.completions, &table, &truncated, &weights)?;
        first.insert("frac_reward_zero_std".into(), Stat::Scalar(adv.frac_zero_std()));
        let advantages = adv.advantages[local_rows(self.core.dist(), b)].to_vec();
        self.update(padded, advantages, first)
    }

    /// One trajectory-level GRPO step on the turns of groups of episodes (text games): each
    /// episode's advantage is its return's, group-relative as [`math::grpo_advantages`] makes
    /// it, and every turn of the episode gets it; then the update of [`Self::step_with`], over
    /// every turn's tokens. With `allowed`, the policy's distributions are renormalised over
    /// the admissible actions' tokens.
    ///
    /// Data-parallel: every process holds whole groups (the same number of episodes); the
    /// advantages are computed over every process's returns, and the loss is normalised over
    /// every process's turns (rows or tokens, by `loss_type`), so the averaged gradient is the
    /// global batch's whatever each process's share of the turns.
    pub fn step_turns(&mut self, batch: &TurnBatch) -> Result<Vec<Stats>> {
        let _awake = self.core.device.is_cpu().then(crate::cpu::keep_pool_awake);
        let cfg = self.config.clone();
        self.core.check_turns(batch, cfg.num_generations, cfg.max_completion_length)?;
        let table = RewardTable::episode_returns(&self.core.dist().gather_f64(batch.returns)?);
        let first_episode = local_rows(self.core.dist(), batch.returns.len()).start;
        let adv = math::grpo_advantages(
            &table.values,
            &[1.0],
            cfg.num_generations,
            cfg.scale_rewards,
            cfg.multi_objective_aggregation,
        );
        let mut first = turn_generation_stats(&mut self.core, batch, &table)?;
        first.insert("frac_reward_zero_std".into(), Stat::Scalar(adv.frac_zero_std()));
        // Each turn's advantage: its episode's, plus GiGPO's step advantage when asked for.
        let mut turn_adv: Vec<f64> =
            batch.episodes.iter().map(|&e| adv.advantages[first_episode + e]).collect();
        if let Some(credit) = &batch.step_credit {
            let lost: Vec<bool> = batch.returns.iter().map(|r| r.is_nan()).collect();
            let step = gigpo::step_advantages(batch.episodes, cfg.num_generations, &lost, credit);
            let w = credit.args.step_advantage_w;
            for (a, s) in turn_adv.iter_mut().zip(&step.advantages) {
                *a += w * s;
            }
            gigpo_stats(self.core.dist(), &mut first, &step)?;
        }
        let chunks = self
            .core
            .turn_chunks(batch)?
            .into_iter()
            .map(|(idx, padded)| (padded, idx.iter().map(|&i| turn_adv[i]).collect()))
            .collect();
        self.update_chunks(chunks, first, Normaliser::Global)
    }

    /// The logprobs [`Self::step_turns`] computes for each turn's action tokens under the current
    /// policy (renormalised over `allowed` when given): what the sampler's must equal.
    pub fn turn_logprobs(
        &self,
        prompts: &[Vec<u32>],
        completions: &[Vec<u32>],
        allowed: Option<&[Vec<Vec<u32>>]>,
    ) -> Result<Vec<Vec<f32>>> {
        let padded = self.core.pad(prompts, completions, &vec![true; prompts.len()], allowed, true)?;
        let lp = self.core.logprobs_no_grad(&self.core.policy, &padded)?.to_dtype(candle_core::DType::F32)?;
        let rows: Vec<Vec<f32>> = lp.to_vec2()?;
        Ok(rows.into_iter().zip(completions).map(|(r, c)| r[..c.len()].to_vec()).collect())
    }

    /// `num_iterations` optimizer steps of the clipped objective on a padded batch whose rows
    /// have `advantages`; `first` (the generation-side metrics) joins the first step's.
    fn update(&mut self, padded: Padded, advantages: Vec<f64>, first: Stats) -> Result<Vec<Stats>> {
        self.update_chunks(vec![(padded, advantages)], first, Normaliser::Local)
    }

    /// [`Self::update`] on a batch split into micro-batches (`chunks`, each padded on its own),
    /// whose gradients are summed: each chunk's loss is weighted by its share of the batch's
    /// normaliser (`loss_type`'s rows or tokens), so the sum is the whole batch's loss. One chunk
    /// is exactly [`Self::update`]'s single batch. `norm` says whose rows or tokens the
    /// normaliser counts in a data-parallel run.
    fn update_chunks(
        &mut self,
        chunks: Vec<(Padded, Vec<f64>)>,
        mut first: Stats,
        norm: Normaliser,
    ) -> Result<Vec<Stats>> {
        let cfg = self.config.clone();
        let own_rows: usize = chunks.iter().map(|(_, a)| a.len()).sum();
        let own_tokens: f64 = chunks.iter().map(|(p, _)| p.n_tokens).sum();
        let (total_rows, total_tokens) = norm.totals(self.core.dist(), own_rows, own_tokens)?;
        // dapo's normalizer: TRL's num_items_in_batch (the batch's loss tokens over every
        // process) over the number of processes; the gradients' mean then divides by the total.
        let num_items = self.core.dist().sum(own_tokens)? / self.core.dist().world_size() as f64;
        let mut prepared = Vec::with_capacity(chunks.len());
        for (padded, adv) in chunks {
            // TRL computes old logprobs only when the batch is reused (num_iterations > 1).
            let old = if cfg.num_iterations > 1 {
                Some(self.core.logprobs_no_grad(&self.core.policy, &padded)?)
            } else {
                None
            };
            let reference = match &self.core.reference {
                Some(r) => Some(self.core.logprobs_no_grad(r, &padded)?),
                None => None,
            };
            let adv_t = self.core.column(&adv)?;
            // The chunk's share of the normaliser (1 for a single chunk).
            let weight = match cfg.loss_type {
                LossType::Grpo | LossType::DrGrpo => adv.len() as f64 / total_rows,
                LossType::Bnpo => padded.n_tokens.max(1.0) / total_tokens.max(1.0),
                _ => 1.0,
            };
            prepared.push((padded, adv, adv_t, old, reference, weight));
        }
        let params = ObjectiveParams {
            epsilon_low: cfg.epsilon,
            epsilon_high: cfg.epsilon_high(),
            delta: cfg.delta,
            level: cfg.importance_sampling_level,
            beta: cfg.beta,
            bias_correction_kl: cfg.use_bias_correction_kl,
        };

        let mut logs = Vec::new();
        for k in 0..cfg.num_iterations {
            let (parts, loss, grad_norm, lr) =
                self.core.optimizer_step_accum(prepared.len(), |core, i| {
                    let (padded, _, adv_t, old, reference, weight) = &prepared[i];
                    let (logp, entropy) = core.logprobs(&core.policy, padded, true)?;
                    let old = match old {
                        Some(o) => o.clone(),
                        None => logp.detach(),
                    };
                    let obj =
                        math::grpo_objective(&logp, &old, reference.as_ref(), adv_t, &padded.mask, &params)?;
                    let loss = math::aggregate_loss(
                        &obj.per_token_loss,
                        &padded.mask,
                        cfg.loss_type,
                        cfg.max_completion_length,
                        num_items,
                    )?;
                    let loss = if *weight == 1.0 { loss } else { (loss * *weight)? };
                    Ok((loss, (obj, entropy)))
                })?;
            let mut s = if k == 0 { std::mem::take(&mut first) } else { Stats::new() };
            s.insert("loss".into(), Stat::Scalar(self.core.dist().mean(loss)?));
            s.insert("grad_norm".into(), Stat::Scalar(grad_norm));
            s.insert("learning_rate".into(), Stat::Scalar(lr));
            let chunk_rows = |f: &dyn Fn(usize) -> Option<Tensor>| -> Result<Option<Vec<Vec<f64>>>> {
                let mut out = Vec::new();
                for i in 0..parts.len() {
                    match f(i) {
                        Some(t) => out.push(rows(&t)?),
                        None => return Ok(None),
                    }
                }
                Ok(Some(cat_rows(out)))
            };
            let kl = chunk_rows(&|i| parts[i].0.kl.clone())?;
            let entropy = chunk_rows(&|i| Some(parts[i].1.clone()))?.unwrap_or_default();
            let ratio = chunk_rows(&|i| Some(parts[i].0.ratio.clone()))?.unwrap_or_default();
            let mask = chunk_rows(&|i| Some(prepared[i].0.mask.clone()))?.unwrap_or_default();
            let adv: Vec<f64> = prepared.iter().flat_map(|p| p.1.iter().copied()).collect();
            self.loss_stats(&mut s, kl.as_deref(), &entropy, &ratio, &mask, &adv)?;
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

    /// `kl`, `entropy` and `clip_ratio/*` as TRL's `_compute_loss` logs them, over the whole
    /// batch (in a data-parallel run, masked means of every process's tokens, where TRL takes
    /// the mean of the processes' means: the same when they hold as many tokens). The rows are
    /// `(B, T)` per token or `(B, 1)` per sequence.
    fn loss_stats(
        &self,
        s: &mut Stats,
        kl: Option<&[Vec<f64>]>,
        entropy: &[Vec<f64>],
        ratio: &[Vec<f64>],
        m: &[Vec<f64>],
        adv: &[f64],
    ) -> Result<()> {
        let n_mask: f64 = m.iter().flatten().sum();
        // global_masked_mean: Σ x·m / max(1, Σ m); TRL takes any (B, 1) value (sequence-level
        // ratios, or one-token completions) as one per sequence: the plain mean over rows.
        let masked_mean = |x: &[Vec<f64>]| -> Result<f64> {
            if x[0].len() == 1 {
                self.core.dist().mean_of(x.iter().map(|r| r[0]).sum::<f64>(), x.len() as f64)
            } else {
                let s: f64 = x.iter().zip(m).flat_map(|(r, mr)| r.iter().zip(mr).map(|(a, b)| a * b)).sum();
                self.core.dist().mean_of(s, n_mask)
            }
        };
        // masked_seq_mean: per row Σ x·m / Σ m (NaN for an empty row); (B, 1) values as they are.
        let seq_mean = |x: &[Vec<f64>]| -> Vec<f64> {
            x.iter()
                .zip(m)
                .map(|(r, mr)| {
                    if r.len() == 1 {
                        r[0]
                    } else {
                        r.iter().zip(mr).map(|(a, b)| a * b).sum::<f64>() / mr.iter().sum::<f64>()
                    }
                })
                .collect()
        };
        if let Some(kl) = kl {
            s.insert("kl".into(), Stat::Scalar(masked_mean(kl)?));
        }
        s.insert("entropy".into(), Stat::Scalar(masked_mean(entropy)?));
        let (lo, hi) = (1.0 - self.config.epsilon, 1.0 + self.config.epsilon_high());
        let flag = |f: &dyn Fn(f64, f64) -> bool| -> Vec<Vec<f64>> {
            ratio
                .iter()
                .zip(adv)
                .map(|(r, &a)| r.iter().map(|&x| f64::from(u8::from(f(x, a)))).collect())
                .collect()
        };
        let low = flag(&|x, a| x < lo && a < 0.0);
        let high = flag(&|x, a| x > hi && a > 0.0);
        let region = flag(&|x, a| (x < lo && a < 0.0) || (x > hi && a > 0.0));
        s.insert("clip_ratio/low_mean".into(), Stat::Scalar(masked_mean(&low)?));
        s.insert("clip_ratio/high_mean".into(), Stat::Scalar(masked_mean(&high)?));
        s.insert("clip_ratio/region_mean".into(), Stat::Scalar(masked_mean(&region)?));
        let low_seq = self.core.dist().gather_var_f64(&seq_mean(&low))?.0;
        let high_seq = self.core.dist().gather_var_f64(&seq_mean(&high))?.0;
        s.insert("clip_ratio/low_min".into(), Stat::Scalar(nanmin(&low_seq)));
        s.insert("clip_ratio/high_max".into(), Stat::Scalar(nanmax(&high_seq)));
        Ok(())
    }
}

/// The rows of several chunks as one batch: each row padded with zeros to the widest chunk's
/// width (a mask's padding is then 0, so masked sums are unchanged).
fn cat_rows(parts: Vec<Vec<Vec<f64>>>) -> Vec<Vec<f64>> {
    let width = parts.iter().flatten().map(Vec::len).max().unwrap_or(0);
    parts
        .into_iter()
        .flatten()
        .map(|mut r| {
            r.resize(width, 0.0);
            r
        })
        .collect()
}

/// GiGPO's metrics, averaged over the processes: `gigpo/step_group_size` (turns per anchor
/// group, per turn), `gigpo/frac_singleton_turns` (turns alone in their state, whose step
/// advantage is 0), `gigpo/step_advantage_abs` (mean |A^S|) and `gigpo/step_return` (mean R_t).
fn gigpo_stats(dist: &crate::dist::Dist, stats: &mut Stats, step: &StepAdvantages) -> Result<()> {
    let n = step.advantages.len() as f64;
    let abs: f64 = step.advantages.iter().map(|a| a.abs()).sum();
    let ret: f64 = step.returns.iter().sum();
    let metrics = [
        ("gigpo/step_group_size", step.mean_group_size * n),
        ("gigpo/frac_singleton_turns", step.frac_singleton * n),
        ("gigpo/step_advantage_abs", abs),
        ("gigpo/step_return", ret),
    ];
    for (name, sum) in metrics {
        stats.insert(name.into(), Stat::Scalar(dist.mean_of(sum, n)?));
    }
    Ok(())
}
