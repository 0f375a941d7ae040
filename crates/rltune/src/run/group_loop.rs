//! The GRPO and RLOO loop of `rltune ppo` with `[algorithm] kind = "grpo"` or `"rloo"`.
//!
//! Each step, top to bottom: take `prompts_per_step` prompts (a new permutation each epoch, the
//! last incomplete batch of an epoch dropped, as TRL's `RepeatSampler`), repeat each
//! `num_generations` times (TRL's row order), sample the completions with the KV cache, mark
//! those that did not end in EOS as truncated, score them with every reward source (one column
//! each; NaN is a missing reward), call [`GrpoTrainer::step_with`] /
//! [`RlooTrainer::step_with`] (`num_iterations` optimizer steps), log TRL's metrics, checkpoint.
//!
//! With `[env]` the step plays text games instead (`games`): trajectory-level GRPO / RLOO.
//!
//! The sampler's logprobs are not passed on: with `num_iterations = 1` TRL takes the old
//! logprobs to be the current ones, detached, and with more it recomputes them, as the
//! trainers here do. See [`super::group_config`] for the config and `docs/algorithms.md`.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use candle_core::Device;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::checkpoint::{
    clear_stale_writes, group_state, latest_checkpoint, load_group_state, save_group_checkpoint,
};
use super::config::{AlgorithmKind, RunConfig};
use super::episodes::EpisodeSource;
use super::eval::{encode_eval_prompts, record, EvalResult, Evaluator};
use super::group_config::GroupShape;
use super::ppo_loop::{build_reward_sum, share_trunk};
use super::prompts::encode_prompts;
use super::rollout::PromptSampler;
use super::run_loop::StepReport;
use crate::data::prompts::PromptRow;
use crate::engine::{Stat, Stats};
use crate::error::{ConfigError, Error, Result};
use crate::grpo::core::Core;
use crate::grpo::math::weighted_rewards;
use crate::grpo::{GroupBatch, GrpoTrainer, RewardTable, RlooTrainer};
use crate::logging::{RunEnd, RunLogger, SampleRow};
use crate::models::load::{load_lm_adapted, load_reference, ModelFiles};
use crate::models::CausalLm;
use crate::params::ParamStore;
use crate::rewards::{RewardSource, WeightedSum};
use crate::runtime::Runtime;
use crate::tokenizer::Tokenizer;

mod games;

/// What a group run asks of its trainer: GRPO ([`GrpoTrainer`]) and RLOO ([`RlooTrainer`]) each
/// implement it, so the run holds one without dispatching on the algorithm.
pub(crate) trait GroupTrainer {
    /// The policy's parameters.
    fn store(&self) -> &ParamStore;
    /// The policy.
    fn policy(&self) -> &CausalLm;
    /// One step on completions of prompts.
    fn step_with(&mut self, batch: &GroupBatch) -> Result<Vec<Stats>>;
    /// One step on the turns of a round of games.
    fn step_turns(&mut self, batch: &crate::grpo::TurnBatch) -> Result<Vec<Stats>>;
    /// The shared GRPO/RLOO state (optimizer, counters).
    fn core(&self) -> &Core;
    /// The same, to restore a checkpoint.
    fn core_mut(&mut self) -> &mut Core;
}

macro_rules! group_trainer {
    ($t:ty) => {
        impl GroupTrainer for $t {
            fn store(&self) -> &ParamStore {
                <$t>::store(self)
            }
            fn policy(&self) -> &CausalLm {
                <$t>::policy(self)
            }
            fn step_with(&mut self, batch: &GroupBatch) -> Result<Vec<Stats>> {
                <$t>::step_with(self, batch)
            }
            fn step_turns(&mut self, batch: &crate::grpo::TurnBatch) -> Result<Vec<Stats>> {
                <$t>::step_turns(self, batch)
            }
            fn core(&self) -> &Core {
                <$t>::core(self)
            }
            fn core_mut(&mut self) -> &mut Core {
                <$t>::core_mut(self)
            }
        }
    };
}
group_trainer!(GrpoTrainer);
group_trainer!(RlooTrainer);

/// A prepared GRPO or RLOO run.
pub struct GroupRun {
    config: RunConfig,
    /// The trainer (policy, reference, optimizer).
    trainer: Box<dyn GroupTrainer>,
    shape: GroupShape,
    policy_files: ModelFiles,
    config_json: serde_json::Value,
    tokenizer: Tokenizer,
    source: Source,
    eos_ids: Vec<u32>,
    logger: RunLogger,
    start_step: usize,
    device: Device,
}

/// Where a group run's samples and rewards come from.
enum Source {
    /// `[data]` prompts scored by reward functions (TRL's GRPO and RLOO).
    Prompts {
        prompts: Vec<(Vec<u32>, PromptRow)>,
        reward: WeightedSum,
        reward_names: Vec<String>,
        /// `[eval] source`, encoded (empty without `[eval]`).
        eval_prompts: Vec<(Vec<u32>, PromptRow)>,
    },
    /// `[env]` text games: the episodes' returns are the rewards (trajectory-level GRPO and
    /// RLOO, [`games`]).
    Games(Box<EpisodeSource>),
}

impl GroupRun {
    /// Loads the policy, data and rewards on the runtime of `config.runtime`; with `resume`,
    /// continues from the latest checkpoint in the run directory (which must hold optimizer
    /// state). `extra_rewards` (from code) follow the `[reward]` sources, named by their
    /// [`RewardSource::name`].
    pub fn prepare(
        config: RunConfig,
        extra_rewards: Vec<(f32, Box<dyn RewardSource>)>,
        resume: bool,
    ) -> Result<Self> {
        let runtime = Runtime::resolve(&config.runtime)?;
        Self::prepare_on(config, &runtime, extra_rewards, resume)
    }

    /// [`Self::prepare`] on a resolved runtime. Changes no process-wide setting: the caller
    /// makes [`Runtime::install`].
    pub fn prepare_on(
        config: RunConfig,
        runtime: &Runtime,
        extra_rewards: Vec<(f32, Box<dyn RewardSource>)>,
        resume: bool,
    ) -> Result<Self> {
        let kind = config.algorithm.kind;
        if !kind.is_group() {
            return Err(Error::Internal(format!(
                "a GRPO/RLOO run with [algorithm] kind = \"{}\"",
                kind.name()
            )));
        }
        config.validate()?;
        tracing::info!("runtime: {runtime}");
        if resume {
            clear_stale_writes(&config.logging.dir)?;
        }
        let ckpt = if resume { latest_checkpoint(&config.logging.dir)? } else { None };
        if resume && ckpt.is_none() {
            return Err(Error::checkpoint(
                config.logging.dir.join("checkpoints"),
                "no checkpoint to --resume from; run without --resume to start",
            ));
        }
        // With LoRA the base is always `[model] path`, and a checkpoint holds the adapter.
        let lora = config.lora_spec(ckpt.as_ref().map(|(_, d)| d.as_path()), "the run config");
        let src = match &ckpt {
            Some((_, p)) if lora.is_none() => p.display().to_string(),
            _ => config.model.path.clone(),
        };
        let mut policy = load_lm_adapted(&src, lora.as_ref(), true, runtime.dtype(), runtime.device())?;
        let trainable = config.model.trainable_layers;
        if let Some(k) = trainable {
            policy.lm = policy.lm.freeze_trunk(&policy.store, k)?;
        }
        policy.lm = policy.lm.with_gradient_checkpointing(config.model.gradient_checkpointing);
        let tok_path = policy.files.tokenizer.clone().ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.json; `rltune ppo` needs one to encode prompts",
                policy.files.dir.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        tokenizer.check_fits(policy.config.vocab_size())?;
        let dist = runtime.dist();
        let world = dist.world_size();
        let source = match &config.env {
            Some(_) if !extra_rewards.is_empty() => {
                return Err(Error::argument(
                    "extra_rewards",
                    "reward functions were given with [env]: episodes are scored by the game",
                ))
            }
            Some(_) => Source::Games(Box::new(EpisodeSource::new(&config, dist)?)),
            None => {
                let mut reward_names: Vec<String> =
                    config.reward.sources.iter().map(|s| s.metric_name()).collect();
                reward_names.extend(extra_rewards.iter().map(|(_, r)| r.name().to_string()));
                if let Some(i) =
                    (1..reward_names.len()).find(|&i| reward_names[..i].contains(&reward_names[i]))
                {
                    return Err(Error::Setting(ConfigError::table(
                        "reward",
                        format!(
                            "two reward functions are named {:?}; the metrics rewards/<name>/mean need distinct \
                             names",
                            reward_names[i]
                        ),
                    )));
                }
                Source::Prompts {
                    prompts: encode_prompts(&config, &tokenizer)?,
                    reward: build_reward_sum(&config, extra_rewards, runtime)?,
                    reward_names,
                    eval_prompts: if config.eval.enabled() {
                        encode_eval_prompts(&config, &tokenizer)?
                    } else {
                        Vec::new()
                    },
                }
            }
        };
        let n_data = match &source {
            Source::Prompts { prompts, .. } => prompts.len(),
            Source::Games(g) => g.game_count(),
        };
        let shape = config.group_shape(n_data, world)?;
        if world > 1 {
            let bs = config.group_batch_size();
            tracing::info!(
                "data-parallel: {world} processes × {bs} completions (per_device_train_batch_size) = {} \
                 completions of {} prompts per step",
                world * bs,
                shape.prompts_per_step
            );
        }
        // On games the one reward is the episode's return.
        let weights: Option<Vec<f64>> = match &source {
            Source::Prompts { reward, .. } => Some(reward.parts().map(|(w, _)| f64::from(w)).collect()),
            Source::Games(_) => None,
        };
        let optimizer_steps = (shape.steps * shape.num_iterations) as i64;
        let bs = Some(config.group_batch_size());
        let beta = match kind {
            AlgorithmKind::Rloo => config.rloo.beta,
            _ => config.grpo.beta,
        };
        let reference = if beta == 0.0 {
            None
        } else {
            let (dtype, device) = (runtime.dtype(), runtime.device());
            Some(match &config.ref_model {
                Some(r) => load_reference(&r.path, dtype, device)?.1,
                // The base with the adapters off, sharing its weights.
                None if lora.is_some() => {
                    CausalLm::load(&policy.store.frozen_copy()?.root(), &policy.config)?
                }
                None if ckpt.is_some() => load_reference(&config.model.path, dtype, device)?.1,
                None => share_trunk(
                    CausalLm::load(&policy.store.frozen_copy()?.root(), &policy.config)?,
                    trainable,
                )?,
            })
        };
        let (store, lm) = (policy.store.clone(), policy.lm.clone());
        let mut trainer = match kind {
            AlgorithmKind::Rloo => {
                let c = crate::grpo::RlooConfig {
                    max_steps: optimizer_steps,
                    per_device_train_batch_size: bs,
                    reward_weights: weights,
                    ..config.rloo.clone()
                };
                Box::new(RlooTrainer::new(c, store, lm, reference)?.with_dist(dist.clone()))
                    as Box<dyn GroupTrainer>
            }
            _ => {
                let c = crate::grpo::GrpoConfig {
                    max_steps: optimizer_steps,
                    per_device_train_batch_size: bs,
                    reward_weights: weights,
                    ..config.grpo.clone()
                };
                Box::new(GrpoTrainer::new(c, store, lm, reference)?.with_dist(dist.clone()))
            }
        };
        let mut start_step = 0;
        if let Some((step, dir)) = &ckpt {
            load_group_state(dir, trainer.core_mut(), kind, config.group_batch_size())?;
            start_step = *step;
        }
        let eos_ids = if config.generation.eos_token_ids.is_empty() {
            policy.config.eos_token_ids()
        } else {
            config.generation.eos_token_ids.clone()
        };
        let resume_from = ckpt.as_ref().map(|(step, _)| *step);
        let trackers = super::tracking::trackers(&config)?;
        let logger = RunLogger::create_with(&config.logging.dir, resume_from, &trackers, dist)?;
        if dist.is_main() {
            let resolved = config.to_toml()?;
            crate::io::write_bytes_atomic(&config.logging.dir.join("config.toml"), resolved.as_bytes())?;
        }
        Ok(Self {
            config,
            trainer,
            shape,
            policy_files: policy.files,
            config_json: policy.config_json,
            tokenizer,
            source,
            eos_ids,
            logger,
            start_step,
            device: runtime.device().clone(),
        })
    }

    /// The loop's sizes.
    pub fn shape(&self) -> GroupShape {
        self.shape
    }

    /// Steps done before this run started (from a checkpoint).
    pub fn start_step(&self) -> usize {
        self.start_step
    }

    /// The policy's parameters.
    pub fn store(&self) -> &ParamStore {
        self.trainer.store()
    }

    /// The policy.
    pub fn policy(&self) -> &CausalLm {
        self.trainer.policy()
    }

    fn seed(&self) -> u64 {
        match self.config.algorithm.kind {
            AlgorithmKind::Rloo => self.config.rloo.seed,
            _ => self.config.grpo.seed,
        }
    }

    /// Runs the remaining steps. `stop` (set by Ctrl-C) ends the run after the current step with
    /// a checkpoint. Returns the number of steps done in total.
    pub fn run(&mut self, stop: &AtomicBool, progress: &mut dyn FnMut(&StepReport)) -> Result<usize> {
        if self.start_step == 0 && self.config.eval.enabled() {
            self.evaluate(0)?;
        }
        crate::engine::run_loop::run(self, stop, &mut |r| {
            progress(r);
            Ok(())
        })
    }

    /// Scores the policy on `[eval] source` after `step` steps ([`super::eval`]): logged, and
    /// appended to `eval.jsonl` by rank 0.
    pub fn evaluate(&mut self, step: usize) -> Result<EvalResult> {
        let Source::Prompts { reward, reward_names, eval_prompts, .. } = &mut self.source else {
            return Err(Error::Setting(ConfigError::table(
                "eval",
                "[eval] scores prompts; a run on games evaluates with [episodes]",
            )));
        };
        let evaluator = Evaluator {
            section: &self.config.eval,
            prompts: eval_prompts,
            tokenizer: &self.tokenizer,
            generation: &self.config.generation,
            eos_ids: &self.eos_ids,
            device: &self.device,
            dist: self.trainer.core().dist(),
        };
        let result = evaluator.run(step, self.trainer.policy(), reward, reward_names)?;
        tracing::info!("{}", result.describe());
        if self.trainer.core().dist().is_main() {
            record(&self.config.logging.dir, &result, step)?;
        }
        Ok(result)
    }

    /// The next `prompts_per_step` prompt indices: a new permutation each epoch, whose last
    /// incomplete batch is dropped (TRL's `RepeatSampler` with `drop_last`).
    fn next_prompts(&self, order: &mut Vec<usize>, rng: &mut rand::rngs::StdRng) -> Vec<usize> {
        let Source::Prompts { prompts, .. } = &self.source else {
            return Vec::new(); // each step draws its games from the seed and the step
        };
        let k = self.shape.prompts_per_step;
        if order.len() < k {
            *order = (0..prompts.len()).collect();
            order.shuffle(rng);
            order.reverse();
        }
        (0..k).filter_map(|_| order.pop()).collect()
    }

    fn one_step(&mut self, step: usize, batch: &[usize]) -> Result<StepReport> {
        let Source::Prompts { prompts, reward, reward_names, .. } = &mut self.source else {
            return Err(Error::Internal("a prompt step on games".into()));
        };
        let sampler = PromptSampler {
            lm: self.trainer.policy(),
            v_head: None,
            tokenizer: &self.tokenizer,
            generation: &self.config.generation,
            text_column: &self.config.data.text_column,
            dist: self.trainer.core().dist(),
            device: &self.device,
        };
        // (B·G) rows: each prompt repeated G times, consecutively, and used whole.
        let picks: Vec<(usize, usize)> = batch.iter().map(|&i| (i, usize::MAX)).collect();
        let rollout = sampler.roll_out(prompts, &picks, self.shape.num_generations, step)?;
        let time_gen = rollout.time_gen;

        let t = Instant::now();
        // [part][sample] → values[sample][part]; NaN stays: a missing reward.
        let parts = reward.score_parts(&rollout.reward_inputs(prompts))?;
        let weights: Vec<f64> = reward.parts().map(|(w, _)| f64::from(w)).collect();
        let values: Vec<Vec<f64>> =
            (0..rollout.samples.len()).map(|i| parts.iter().map(|p| f64::from(p[i])).collect()).collect();
        let time_reward = rollout.time_decode + t.elapsed().as_secs_f64();
        let table = RewardTable { names: reward_names.clone(), values };

        let t = Instant::now();
        let completions = rollout.responses();
        // Truncated sampling: the policy, old and reference logprobs are renormalized over each
        // token's support, the distribution it was drawn from.
        let supports = rollout.supports();
        // Truncated: no EOS within max_new_tokens.
        let truncated: Vec<bool> =
            completions.iter().map(|c| !c.last().is_some_and(|t| self.eos_ids.contains(t))).collect();
        let logs = self.trainer.step_with(&GroupBatch {
            prompts: &rollout.queries,
            completions: &completions,
            rewards: &table,
            truncated: Some(&truncated),
            allowed: supports.as_deref(),
        })?;
        let mut stats = merge_iterations(logs);
        let core = self.trainer.core();
        // TRL's epoch: optimizer steps over the optimizer steps of one pass over the prompts.
        let epoch = core.global_step as f64 / self.shape.steps_per_epoch as f64;
        stats.insert("epoch".into(), Stat::Scalar(epoch));
        let kind = self.config.algorithm.kind.name();
        stats.insert(format!("time/{kind}/step"), Stat::Scalar(t.elapsed().as_secs_f64()));
        stats.insert("time/rollout/generation".into(), Stat::Scalar(time_gen));
        stats.insert("time/rollout/reward".into(), Stat::Scalar(time_reward));
        if self.trainer.core().dist().world_size() > 1 {
            stats.insert(
                "time/dist/all_reduce".into(),
                Stat::Scalar(self.trainer.core().dist().take_all_reduce_seconds()),
            );
        }

        let total = weighted_rewards(&table.values, &weights);
        let shown: Vec<SampleRow> = rollout
            .texts
            .iter()
            .zip(&total)
            .take(self.config.logging.samples_per_step)
            .map(|((q, r), &reward)| SampleRow {
                query: q.clone(),
                response: r.clone(),
                reward: reward as f32,
            })
            .collect();
        if self.config.eval.due(step + 1, self.shape.steps) {
            let result = self.evaluate(step + 1)?;
            for (k, v) in result.metrics() {
                stats.insert(k, Stat::Scalar(v));
            }
        }
        self.logger.log_step(step + 1, &stats, &shown)?;
        Ok(StepReport::of(step, self.shape.steps, &stats, "reward", "kl"))
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        let dir = self.config.logging.dir.join("checkpoints").join(format!("step-{step}"));
        let kind = self.config.algorithm.kind;
        let state = group_state(
            self.trainer.core(),
            kind,
            step,
            self.config.checkpoint.optimizer_state,
            self.config.group_batch_size(),
        );
        save_group_checkpoint(&dir, self.trainer.core(), &self.config_json, &self.policy_files, &state)
            .map_err(|e| {
                Error::checkpoint(
                    &dir,
                    format!(
                        "could not be written ({e}); nothing of it was kept (a full disk?). Free some \
                         room, then continue with --resume"
                    ),
                )
            })
    }
}

/// One metrics line from the `num_iterations` optimizer steps of a batch, as TRL logs them with
/// `logging_steps = num_iterations`: the mean of each metric over the steps that logged it
/// (TRL's `_metrics` lists), but the last `grad_norm`, `learning_rate`, `num_tokens` and
/// `rltune/skipped_updates`.
fn merge_iterations(mut logs: Vec<Stats>) -> Stats {
    if logs.len() <= 1 {
        return logs.pop().unwrap_or_default();
    }
    let last_only = ["grad_norm", "learning_rate", "num_tokens", "rltune/skipped_updates"];
    let mut out = Stats::new();
    let keys: std::collections::BTreeSet<String> = logs.iter().flat_map(|s| s.keys().cloned()).collect();
    for k in keys {
        let vals: Vec<f64> = logs.iter().filter_map(|s| s.get(&k).and_then(Stat::as_f64)).collect();
        let stat = if vals.is_empty() {
            // Not a number (a message): the last one.
            logs.iter().rev().find_map(|s| s.get(&k).cloned()).unwrap_or(Stat::Scalar(f64::NAN))
        } else if last_only.contains(&k.as_str()) {
            Stat::Scalar(vals[vals.len() - 1])
        } else {
            Stat::Scalar(vals.iter().sum::<f64>() / vals.len() as f64)
        };
        out.insert(k, stat);
    }
    out
}

impl super::run_loop::Algorithm for GroupRun {
    /// The prompt permutation and its RNG.
    type DataOrder = (rand::rngs::StdRng, Vec<usize>);
    type Batch = Vec<usize>;
    type Report = StepReport;

    fn plan(&self) -> super::run_loop::Plan {
        self.config.plan(self.shape.steps, self.start_step)
    }

    fn dist(&self) -> crate::dist::Dist {
        self.trainer.core().dist().clone()
    }

    fn settings(&self) -> Result<String> {
        self.config.to_toml()
    }

    fn data_order(&self) -> Result<Self::DataOrder> {
        Ok((rand::rngs::StdRng::seed_from_u64(self.seed() ^ 0x5eed), Vec::new()))
    }

    fn draw(&self, (rng, order): &mut Self::DataOrder) -> Result<Vec<usize>> {
        Ok(self.next_prompts(order, rng))
    }

    fn step(&mut self, step: usize, batch: &Vec<usize>) -> Result<StepReport> {
        match self.source {
            Source::Games(_) => self.game_step(step),
            Source::Prompts { .. } => self.one_step(step, batch),
        }
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        GroupRun::checkpoint(self, step)
    }

    fn write_report(&mut self) -> Result<()> {
        self.logger.write_report().map(drop)
    }

    fn finish(&mut self, end: RunEnd) -> Result<()> {
        self.logger.finish(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iterations_merge_as_trl_logs_them() {
        crate::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let s = |loss: f64, lr: f64| {
            let mut s = Stats::new();
            s.insert("loss".into(), Stat::Scalar(loss));
            s.insert("learning_rate".into(), Stat::Scalar(lr));
            s
        };
        let mut first = s(1.0, 0.1);
        first.insert("reward".into(), Stat::Scalar(0.5));
        let m = merge_iterations(vec![first, s(3.0, 0.2)]);
        let get = |k: &str| m.get(k).and_then(Stat::as_f64).unwrap();
        assert_eq!((get("loss"), get("learning_rate"), get("reward")), (2.0, 0.2, 0.5));
        assert_eq!(merge_iterations(vec![s(1.0, 0.1)]), s(1.0, 0.1));
    }
}
