//! The PPO training loop of `rltune ppo`: rollout → evaluation → optimization, logged.
//!
//! Each step, top to bottom: take `batch_size` prompts (shuffled each epoch), cut each to a sampled
//! length (TRL's `LengthSampler`), sample responses with the KV cache (their logprobs and values
//! come along), score them with the reward sources, call [`PpoTrainer::step_with`], add the `env/*`
//! stats TRL's `log_stats` adds, log, and checkpoint. With a `[critic]`, sampling runs the policy
//! alone and the critic computes the values inside the step; on text games it also gives each
//! turn's bootstrap, the value of the next state.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use candle_core::Device;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::checkpoint::{
    clear_stale_writes, latest_checkpoint, load_trainer_state, save_checkpoint, CriticFiles,
};
use super::config::{AlgorithmKind, RewardSourceConfig, RunConfig, TrainTurns};
use super::episodes::{add_episode_stats, log_game_step, EpisodeSource, Pick};
use super::prompts::encode_prompts;
use super::rollout::PromptSampler;
use super::run_loop::StepReport;
use crate::agent::rollout::{lambda_bootstraps, rebootstrap, Transition};
use crate::data::prompts::{LengthSampler, PromptRow};
use crate::engine::stats::mean_std;
use crate::error::{ConfigError, Error, Result};
use crate::logging::{RunEnd, RunLogger, SampleRow};
use crate::models::load::{load_policy_adapted, load_reference, LoadedPolicy};
use crate::models::CausalLm;
use crate::ppo::{PpoTrainer, RolloutCache, Stat, StepInput};
use crate::rewards::{
    exact_match_reward, ClassifierReward, ClassifierRewardConfig, CommandReward, RewardSource, WeightedSum,
};
use crate::runtime::Runtime;
use crate::tokenizer::Tokenizer;

mod rejection;

/// Where a run's samples come from.
enum Source {
    /// Prompts, scored by reward sources.
    Prompts { prompts: Vec<(Vec<u32>, PromptRow)>, reward: Box<dyn RewardSource> },
    /// Text games (`[env]`).
    Games(Box<EpisodeSource>),
}

/// A prepared PPO run.
pub struct PpoRun {
    config: RunConfig,
    /// The trainer (policy, reference, optimizer, KL controller).
    pub trainer: PpoTrainer,
    policy_files: crate::models::load::ModelFiles,
    config_json: serde_json::Value,
    critic_files: Option<CriticFiles>,
    tokenizer: Tokenizer,
    source: Source,
    logger: RunLogger,
    start_step: usize,
    skipped: usize,
    device: Device,
}

/// Builds the reward sources of `[reward]`, plus `extra` ones from code (e.g. closures).
pub fn build_rewards(
    cfg: &RunConfig,
    extra: Vec<(f32, Box<dyn RewardSource>)>,
    runtime: &Runtime,
) -> Result<Box<dyn RewardSource>> {
    Ok(Box::new(build_reward_sum(cfg, extra, runtime)?))
}

/// [`build_rewards`] as the [`WeightedSum`] itself, whose parts can be scored one by one
/// (GRPO and RLOO log each): the `[reward]` sources in order, then `extra`.
pub fn build_reward_sum(
    cfg: &RunConfig,
    extra: Vec<(f32, Box<dyn RewardSource>)>,
    runtime: &Runtime,
) -> Result<WeightedSum> {
    let mut parts: Vec<(f32, Box<dyn RewardSource>)> = Vec::new();
    for s in &cfg.reward.sources {
        match s {
            RewardSourceConfig::Classifier { model, label, output, text, batch_size, weight, .. } => {
                let c = ClassifierRewardConfig {
                    label: label.clone(),
                    output: *output,
                    text: *text,
                    batch_size: *batch_size,
                };
                parts.push((
                    *weight,
                    Box::new(ClassifierReward::from_pretrained(model, c, runtime.dtype(), runtime.device())?),
                ));
            }
            RewardSourceConfig::Command { command, timeout_s, weight, .. } => {
                let timeout = std::time::Duration::from_secs_f64(*timeout_s);
                parts.push((
                    *weight,
                    Box::new(CommandReward::spawn(command.clone())?.with_timeout(Some(timeout))),
                ));
            }
            RewardSourceConfig::Http { .. } | RewardSourceConfig::LlmJudge { .. } => {
                parts.push((s.weight(), super::reward_config::build_http(s)?));
            }
            RewardSourceConfig::ExactMatch { column, extract, weight, .. } => {
                let name = s.metric_name();
                parts.push((*weight, Box::new(exact_match_reward(&name, column, *extract))));
            }
        }
    }
    parts.extend(extra);
    WeightedSum::new(parts)
}

impl PpoRun {
    /// Loads models, data and rewards; with `resume`, continues from the latest checkpoint in the
    /// run directory (which must hold optimizer state).
    ///
    /// The device and precision come from `config.runtime`, resolved here once (see
    /// [`Self::prepare_on`] to pass a resolved [`Runtime`]).
    pub fn prepare(
        config: RunConfig,
        extra_rewards: Vec<(f32, Box<dyn RewardSource>)>,
        resume: bool,
    ) -> Result<Self> {
        let runtime = Runtime::resolve(&config.runtime)?;
        Self::prepare_on(config, &runtime, extra_rewards, resume)
    }

    /// [`Self::prepare`] on a resolved runtime; `config.runtime` is only recorded in the run
    /// directory. Changes no process-wide setting: the caller makes [`Runtime::install`].
    pub fn prepare_on(
        config: RunConfig,
        runtime: &Runtime,
        extra_rewards: Vec<(f32, Box<dyn RewardSource>)>,
        resume: bool,
    ) -> Result<Self> {
        if config.algorithm.kind.is_group() {
            return Err(Error::Setting(ConfigError::new(
                "algorithm",
                "kind",
                format!(
                    "= \"{}\" runs in GroupRun (rltune::run::GroupRun), not PpoRun",
                    config.algorithm.kind.name()
                ),
            )));
        }
        tracing::info!("runtime: {runtime}");
        let dist = runtime.dist();
        let world = dist.world_size();
        if world > 1 {
            let b = config.ppo.batch_size;
            tracing::info!(
                "data-parallel: {world} processes × {b} samples ([ppo] batch_size) = {} per step, in \
                 minibatches of {world} × {}",
                world * b,
                config.ppo.mini_batch_size
            );
        }
        let (device, dtype) = (runtime.device().clone(), runtime.dtype());
        if resume {
            clear_stale_writes(&config.logging.dir)?;
        }
        let ckpt = if resume { latest_checkpoint(&config.logging.dir)? } else { None };
        if resume && ckpt.is_none() {
            return Err(Error::checkpoint(
                config.logging.dir.join("checkpoints"),
                format!(
                    "no checkpoint to --resume from; run without --resume to start (if {dir} holds a \
                     run stopped before its first checkpoint, delete it first)",
                    dir = config.logging.dir.display()
                ),
            ));
        }
        // With LoRA the base is always `[model] path`, and a checkpoint holds the adapter.
        let lora = config.lora_spec(ckpt.as_ref().map(|(_, d)| d.as_path()), "the run config");
        let policy_src = match &ckpt {
            Some((_, p)) if lora.is_none() => p.display().to_string(),
            _ => config.model.path.clone(),
        };
        // Without a critic, `[ppo] value_head` describes the policy's head; with one, the critic's.
        let head = config.critic.is_none().then(|| config.ppo.value_head_spec());
        let LoadedPolicy { files, config_json, config: lm_cfg, store, mut model } =
            load_policy_adapted(&policy_src, head, lora.as_ref(), true, dtype, &device)?;
        let trainable = config.model.trainable_layers;
        if let Some(k) = trainable {
            model.lm = model.lm.freeze_trunk(&store, k)?;
        }
        model.lm = model.lm.with_gradient_checkpointing(config.model.gradient_checkpointing);
        let reference = match &config.ref_model {
            Some(r) => load_reference(&r.path, dtype, &device)?.1,
            // The base with the adapters off, sharing its weights.
            None if lora.is_some() => CausalLm::load(&store.frozen_copy()?.root(), &lm_cfg)?,
            None if ckpt.is_some() => load_reference(&config.model.path, dtype, &device)?.1,
            // A copy of the policy; with partial freezing it shares the frozen trunk.
            None => share_trunk(CausalLm::load(&store.frozen_copy()?.root(), &lm_cfg)?, trainable)?,
        };
        let tok_path = files.tokenizer.clone().ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.json; `rltune ppo` needs one to encode prompts",
                files.dir.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        tokenizer.check_fits(lm_cfg.vocab_size())?;
        let mut trainer =
            PpoTrainer::new(config.ppo.clone(), store, model, reference)?.with_dist(dist.clone());
        if config.algorithm.kind == AlgorithmKind::RejectionSampling {
            // The fine-tuning steps the policy's optimizer at its own settings (one Adam state
            // for the run, restored from a checkpoint with the rest).
            trainer.engine_optimizer_mut().set_args(config.rejection.optim_args());
        }
        let ckpt_dir = ckpt.as_ref().map(|(_, d)| d.as_path());
        let critic =
            super::critic::load_critic(&config, ckpt_dir, &tokenizer, lm_cfg.vocab_size(), dtype, &device)?;
        let critic_files = match critic {
            Some((critic, files)) => {
                trainer = trainer.with_critic(critic)?;
                Some(files)
            }
            None => None,
        };
        if let Some(p) = &config.ptx {
            trainer = trainer.with_ptx(ptx_examples(p, &tokenizer, &files.dir, &lm_cfg)?, p.coef)?;
        }
        let (mut start_step, mut skipped) = (0, 0);
        if let Some((step, dir)) = &ckpt {
            let state = load_trainer_state(dir, &mut trainer)?;
            (start_step, skipped) = (*step, state.skipped_batches);
        }
        let source = match &config.env {
            Some(_) => {
                if !extra_rewards.is_empty() {
                    return Err(Error::argument(
                        "extra_rewards",
                        "reward functions from code are not used with [env]: the game scores the turns",
                    ));
                }
                Source::Games(Box::new(EpisodeSource::new(&config, dist)?))
            }
            None => Source::Prompts {
                prompts: load_encoded_prompts(&config, &tokenizer)?,
                reward: build_rewards(&config, extra_rewards, runtime)?,
            },
        };
        // Lines logged after the checkpoint (a run killed between two checkpoints) are dropped:
        // those steps run again.
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
            policy_files: files,
            config_json,
            critic_files,
            tokenizer,
            source,
            logger,
            start_step,
            skipped,
            device,
        })
    }

    /// Runs the remaining steps. `stop` (set by Ctrl-C) ends the run after the current step with a
    /// checkpoint. Returns the number of steps done in total.
    ///
    /// PPO runs as this run's own [`super::Algorithm`]; rejection sampling as
    /// `RejectionRun` (`ppo_loop/rejection.rs`), which shares its data order, checkpoints and
    /// report.
    pub fn run(&mut self, stop: &AtomicBool, progress: &mut dyn FnMut(&StepReport)) -> Result<usize> {
        let progress = &mut |r: &StepReport| {
            progress(r);
            Ok(())
        };
        match self.config.algorithm.kind {
            AlgorithmKind::RejectionSampling => {
                crate::engine::run_loop::run(&mut rejection::RejectionRun(self), stop, progress)
            }
            _ => crate::engine::run_loop::run(self, stop, progress),
        }
    }

    /// Steps done before this run started (from a checkpoint).
    pub fn start_step(&self) -> usize {
        self.start_step
    }

    /// The next `b` prompts (reshuffled each epoch) as `(prompt index, query length)`.
    fn next_batch(
        &self,
        order: &mut Vec<usize>,
        rng: &mut rand::rngs::StdRng,
        sampler: &LengthSampler,
        b: usize,
    ) -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(b);
        let Source::Prompts { prompts, .. } = &self.source else { return out };
        while out.len() < b {
            if order.is_empty() {
                *order = (0..prompts.len()).collect();
                order.shuffle(rng);
                order.reverse();
            }
            if let Some(i) = order.pop() {
                // The length is drawn here, so a resumed run replays it with the order.
                out.push((i, sampler.sample(rng)));
            }
        }
        out
    }

    fn one_step(&mut self, step: usize, batch: &[(usize, usize)]) -> Result<StepReport> {
        let Source::Prompts { prompts, reward } = &mut self.source else {
            return Err(Error::Internal("a prompt step without prompts".into()));
        };
        let policy = &self.trainer.policy;
        let sampler = PromptSampler {
            lm: &policy.lm,
            // With a critic, the step computes the values (the policy's head is not read).
            v_head: self.trainer.critic().is_none().then_some(&policy.v_head),
            tokenizer: &self.tokenizer,
            generation: &self.config.generation,
            text_column: &self.config.data.text_column,
            dist: self.trainer.dist(),
            device: &self.device,
        };
        let rollout = sampler.roll_out(prompts, batch, 1, step)?;
        let time_gen = rollout.time_gen;

        let t = Instant::now();
        let scores = reward.score(&rollout.reward_inputs(prompts))?;
        let time_reward = rollout.time_decode + t.elapsed().as_secs_f64();
        if scores.len() != rollout.samples.len() || scores.iter().any(|s| !s.is_finite()) {
            self.skipped += 1;
            let bad = scores.iter().position(|s| !s.is_finite());
            tracing::warn!(
                "step {}: reward {} of sample {} is not finite; batch skipped ({} skipped so far)",
                step + 1,
                bad.map_or("missing".to_string(), |i| scores[i].to_string()),
                bad.map_or(scores.len(), |i| i),
                self.skipped
            );
            // The step still gets a metrics line, holding the skip count and the rollout times.
            let mut stats = crate::engine::Stats::new();
            stats.insert("rltune/skipped_batches".into(), Stat::Scalar(self.skipped as f64));
            stats.insert("time/rollout/generation".into(), Stat::Scalar(time_gen));
            stats.insert("time/rollout/reward".into(), Stat::Scalar(time_reward));
            self.logger.log_step(step + 1, &stats, &[])?;
            return Ok(StepReport {
                step: step + 1,
                total: self.config.ppo.steps,
                reward_mean: f64::NAN,
                kl: f64::NAN,
                skipped: true,
                win_rate: None,
            });
        }
        let responses = rollout.responses();
        // Truncated sampling: the policy and the reference are renormalized over each token's
        // support, the distribution it was drawn from.
        let supports = rollout.supports();
        let caches: Vec<RolloutCache> = rollout
            .samples
            .iter()
            .map(|s| RolloutCache {
                logprobs: s.logprobs.clone(),
                values: s.values.clone().unwrap_or_default(),
            })
            .collect();
        let mut stats = self.trainer.step_with(StepInput {
            queries: &rollout.queries,
            responses: &responses,
            scores: &scores,
            response_masks: None,
            rollout: self.config.ppo.rollout_cache.then_some(caches.as_slice()),
            bootstrap: None,
            allowed: supports.as_deref(),
        })?;
        let logprobs: Vec<&[f32]> = rollout.samples.iter().map(|s| s.logprobs.as_slice()).collect();
        self.add_env_stats(&mut stats, &logprobs, &scores, &rollout.queries, time_gen, time_reward)?;
        let rows: Vec<SampleRow> = rollout
            .texts
            .iter()
            .zip(&scores)
            .take(self.config.logging.samples_per_step)
            .map(|((q, r), &reward)| SampleRow { query: q.clone(), response: r.clone(), reward })
            .collect();
        self.logger.log_step(step + 1, &stats, &rows)?;
        Ok(StepReport::of(step, self.config.ppo.steps, &stats, "env/reward_mean", "objective/kl"))
    }

    /// TRL `log_stats`'s `env/*` keys, plus rltune's: mean logprobs of policy and reference
    /// over the response tokens (`logprobs[i]` holds sample i's), rollout phase times, skipped
    /// batches; of every process's samples.
    fn add_env_stats(
        &self,
        stats: &mut crate::engine::Stats,
        logprobs: &[&[f32]],
        scores: &[f32],
        queries: &[Vec<u32>],
        time_gen: f64,
        time_reward: f64,
    ) -> Result<()> {
        let dist = self.trainer.dist();
        let r: Vec<f64> = dist.gather_f64(&scores.iter().map(|&s| s as f64).collect::<Vec<_>>())?;
        let (mean, std) = mean_std(&r);
        stats.insert("env/reward_mean".into(), Stat::Scalar(mean));
        stats.insert("env/reward_std".into(), Stat::Scalar(std));
        stats.insert("env/reward_dist".into(), Stat::Array(r));
        let lp: Vec<f64> = logprobs.iter().flat_map(|s| s.iter().map(|&x| x as f64)).collect();
        let lp_mean = dist.mean_of(lp.iter().sum::<f64>(), lp.len() as f64)?;
        stats.insert("rltune/logprobs_mean".into(), Stat::Scalar(lp_mean));
        if let Some(Stat::Matrix(refs)) = stats.get("objective/ref_logprobs") {
            let mut sum = 0.0;
            let mut n = 0usize;
            for ((row, q), s) in refs.iter().zip(queries).zip(logprobs) {
                for j in 0..s.len() {
                    if let Some(v) = row.get(q.len() - 1 + j) {
                        sum += v;
                        n += 1;
                    }
                }
            }
            stats.insert("rltune/ref_logprobs_mean".into(), Stat::Scalar(dist.mean_of(sum, n as f64)?));
        }
        stats.insert("time/rollout/generation".into(), Stat::Scalar(time_gen));
        stats.insert("time/rollout/reward".into(), Stat::Scalar(time_reward));
        stats.insert("rltune/skipped_batches".into(), Stat::Scalar(self.skipped as f64));
        Ok(())
    }

    /// On text games, after `step` (from 0) when `eval_every` says so: the policy on held-out
    /// games (`eval/*`).
    fn eval_if_due(&self, step: usize, stats: &mut crate::engine::Stats) -> Result<()> {
        let Source::Games(games) = &self.source else { return Ok(()) };
        let (lm, gen, seed) = (&self.trainer.policy.lm, &self.config.generation, self.config.ppo.seed);
        games.evaluate_if_due(step + 1, lm, &self.tokenizer, gen, seed, &self.device, stats)
    }

    /// One step on text games: play, step on the turns, log episodes, evaluate when due.
    fn game_step(&mut self, step: usize) -> Result<StepReport> {
        let Source::Games(games) = &mut self.source else {
            return Err(Error::Internal("a game step without games".into()));
        };
        let b = self.config.ppo.batch_size;
        let t = Instant::now();
        let trainer = &self.trainer;
        let (gamma, lambda) = (self.config.episodes.game_gamma, self.config.episodes.turn_lambda);
        // With a separate critic, the turns bootstrap from its value of the next state, not
        // the policy head's: of the picked turns only, unless λ-returns chain every turn played
        // (then before the pick, and before the chain).
        let critic = trainer.critic().is_some();
        let critic_bootstraps = |turns: &mut [Transition]| -> Result<()> {
            if critic {
                rebootstrap(turns, gamma, trainer.pad_id(), |q, r| trainer.values(q, r))?;
            }
            Ok(())
        };
        let round = self.config.episodes.train_turns == TrainTurns::Round;
        let pick =
            if round { Pick::Multiple(self.config.ppo.backward_batch_size()) } else { Pick::Exactly(b) };
        let mut batch =
            games.collect(step, &trainer.policy, &self.tokenizer, pick, &self.device, |turns| {
                if lambda > 0.0 {
                    critic_bootstraps(turns)?;
                    lambda_bootstraps(turns, gamma, lambda);
                }
                Ok(())
            })?;
        if lambda == 0.0 {
            critic_bootstraps(&mut batch.transitions)?;
        }
        let time_rollout = t.elapsed().as_secs_f64();
        let turns = &batch.transitions;
        let (queries, responses, allowed) = batch.turn_tokens();
        let scores: Vec<f32> = turns.iter().map(|t| t.reward).collect();
        let bootstrap: Vec<f32> = turns.iter().map(|t| t.bootstrap).collect();
        // Admissible commands, or truncated sampling (every turn then has its supports).
        let admissible = self.config.agent.actions == crate::envs::play::ActionMode::Admissible
            || (!turns.is_empty() && turns.iter().all(|t| !t.allowed.is_empty()));
        let caches: Vec<RolloutCache> = turns
            .iter()
            .map(|t| RolloutCache { logprobs: t.logprobs.clone(), values: t.values.clone() })
            .collect();
        let input = StepInput {
            queries: &queries,
            responses: &responses,
            scores: &scores,
            response_masks: None,
            rollout: self.config.ppo.rollout_cache.then_some(caches.as_slice()),
            bootstrap: Some(&bootstrap),
            allowed: admissible.then_some(allowed.as_slice()),
        };
        let mut stats =
            if round { self.trainer.step_sized(input)? } else { self.trainer.step_with(input)? };
        stats.insert("env/trained_turns".into(), Stat::Scalar(turns.len() as f64));
        let logprobs: Vec<&[f32]> = turns.iter().map(|t| t.logprobs.as_slice()).collect();
        let time_gen = batch.counts.time_generation.as_secs_f64();
        self.add_env_stats(&mut stats, &logprobs, &scores, &queries, time_gen, 0.0)?;
        stats.insert("time/rollout/total".into(), Stat::Scalar(time_rollout));
        add_episode_stats(self.trainer.dist(), &mut stats, &batch)?;
        self.eval_if_due(step, &mut stats)?;
        log_game_step(&mut self.logger, &self.tokenizer, &self.config, step, &stats, &batch)?;
        Ok(StepReport::of(step, self.config.ppo.steps, &stats, "env/reward_mean", "objective/kl"))
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        let dir = self.config.logging.dir.join("checkpoints").join(format!("step-{step}"));
        save_checkpoint(
            &dir,
            &self.trainer,
            &self.config_json,
            &self.policy_files,
            self.critic_files.as_ref(),
            self.config.checkpoint.optimizer_state,
            step,
            self.skipped,
        )
        .map_err(|e| {
            let previous = latest_checkpoint(&self.config.logging.dir).ok().flatten();
            Error::checkpoint(
                &dir,
                format!(
                    "could not be written ({e}); nothing of it was kept (a full disk?). {} Free some \
                     room, then continue with --resume",
                    match previous {
                        Some((k, _)) => format!("The checkpoint of step {k} is intact."),
                        None => "No earlier checkpoint exists.".into(),
                    }
                ),
            )
        })
    }
}

/// [`encode_prompts`], at least `[ppo] batch_size` of them.
fn load_encoded_prompts(config: &RunConfig, tokenizer: &Tokenizer) -> Result<Vec<(Vec<u32>, PromptRow)>> {
    let prompts = encode_prompts(config, tokenizer)?;
    if prompts.len() < config.ppo.batch_size {
        return Err(Error::data(
            &config.data.source,
            format!("{} usable prompts but [ppo] batch_size is {}", prompts.len(), config.ppo.batch_size),
        ));
    }
    Ok(prompts)
}

/// The data order of a PPO run: the prompt permutation, its RNG, and the query-length sampler.
pub struct PromptOrder {
    rng: rand::rngs::StdRng,
    order: Vec<usize>,
    sampler: LengthSampler,
}

impl super::run_loop::Algorithm for PpoRun {
    type DataOrder = PromptOrder;
    type Batch = Vec<(usize, usize)>;
    type Report = StepReport;

    fn plan(&self) -> super::run_loop::Plan {
        self.config.plan(self.config.ppo.steps, self.start_step)
    }

    fn dist(&self) -> crate::dist::Dist {
        self.trainer.dist().clone()
    }

    fn settings(&self) -> Result<String> {
        self.config.to_toml()
    }

    fn data_order(&self) -> Result<PromptOrder> {
        Ok(PromptOrder {
            rng: rand::rngs::StdRng::seed_from_u64(self.config.ppo.seed ^ 0x5eed),
            order: Vec::new(),
            sampler: LengthSampler::new(
                self.config.data.min_query_tokens,
                self.config.data.max_query_tokens,
            )?,
        })
    }

    /// The next `batch_size` prompts and query lengths per process (none when the run plays
    /// games): every process draws the whole batch and keeps its share.
    fn draw(&self, o: &mut PromptOrder) -> Result<Vec<(usize, usize)>> {
        let n = self.config.ppo.batch_size * self.trainer.dist().world_size();
        Ok(self.next_batch(&mut o.order, &mut o.rng, &o.sampler, n))
    }

    /// A PPO step on the run's prompts, or on a round of games.
    fn step(&mut self, step: usize, batch: &Vec<(usize, usize)>) -> Result<StepReport> {
        match self.source {
            Source::Games(_) => self.game_step(step),
            Source::Prompts { .. } => self.one_step(step, batch),
        }
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        PpoRun::checkpoint(self, step)
    }

    fn write_report(&mut self) -> Result<()> {
        self.logger.write_report().map(drop)
    }

    fn finish(&mut self, end: RunEnd) -> Result<()> {
        self.logger.finish(end)
    }
}

/// The reference copy of a partially frozen policy: the same trunk split, so that it shares
/// the policy's trunk tensors and output ([`CausalLm::shares_trunk`]).
pub(super) fn share_trunk(reference: CausalLm, trainable_layers: Option<usize>) -> Result<CausalLm> {
    Ok(match trainable_layers {
        Some(k) => reference.with_trainable_layers(k)?,
        None => reference,
    })
}

/// PPO-ptx's supervised examples: `[ptx] source` read and tokenized as `rltune sft` does (with
/// the policy's chat template where rows are conversations, and its EOS).
fn ptx_examples(
    p: &super::config::PtxSection,
    tokenizer: &Tokenizer,
    model_dir: &std::path::Path,
    lm_cfg: &crate::models::CausalLmConfig,
) -> Result<Vec<crate::train::sft::SftExample>> {
    let records = crate::train::data::read_sft_data(&p.source, &Default::default())?;
    let template = if records.iter().any(|r| r.is_conversational()) {
        crate::models::chat_template::ChatTemplate::for_model_dir(model_dir)?
    } else {
        None
    };
    let eos = lm_cfg.eos_token_ids().first().copied();
    let (examples, dropped) =
        crate::train::sft::tokenize_sft_with(&records, tokenizer, template.as_ref(), eos, &p.sft)?;
    if dropped > 0 {
        tracing::warn!(
            "[ptx] {}: {dropped} of {} rows have no target token within [ptx.sft] max_length = {} and are left out",
            p.source,
            records.len(),
            p.sft.max_length
        );
    }
    if examples.is_empty() {
        return Err(Error::Input(format!(
            "[ptx] source {}: no row has a target token within [ptx.sft] max_length = {}; raise it or \
             check the rows' completions",
            p.source, p.sft.max_length
        )));
    }
    tracing::info!("PPO-ptx: {} supervised examples from {}, coef {}", examples.len(), p.source, p.coef);
    Ok(examples)
}
