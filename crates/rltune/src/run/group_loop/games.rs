//! Trajectory-level GRPO and RLOO on text games (`[algorithm] kind = "grpo"` or `"rloo"` with
//! `[env]`), as the agentic RL frameworks do it.
//!
//! Each step, top to bottom: draw `per_device_train_batch_size / num_generations` training games
//! from the run's seed and the step, play each `num_generations` times (one group;
//! [`EpisodeSource::play_groups`]), take each episode's return (the sum of its turns' shaped
//! rewards: the game's plus `[episodes.shaping]`) as its reward, and make one
//! [`GrpoTrainer::step_turns`](crate::grpo::GrpoTrainer::step_turns) /
//! [`RlooTrainer::step_turns`](crate::grpo::RlooTrainer::step_turns) on every turn of every
//! episode, each turn carrying its episode's advantage. With `[episodes.gigpo]` each turn also
//! gets GiGPO's step advantage among the turns played from the same state
//! ([`crate::grpo::gigpo`]). With `[agent] actions = "admissible"` the update renormalises the
//! policy over each token's allowed set, as the sampler did.
//!
//! Data-parallel (`mpirun`): process r plays its contiguous share of the step's games (the
//! games themselves do not depend on the number of processes; the samples do, each process
//! drawing from its own stream), the advantages are computed over every process's returns, and
//! the loss is normalised over every process's turns, so the averaged gradient is that of the
//! global batch.
//!
//! Against per-turn PPO on the same games: no value model and no `game_gamma` (a turn is credited
//! with its whole episode's outcome, compared with the other plays of the same game), and every
//! played turn trains (PPO picks `batch_size` of them). The metrics are TRL's GRPO/RLOO ones
//! (`reward` is the mean episode return) plus the `env/*` and `eval/*` ones of PPO on games.

use std::time::Instant;

use super::{merge_iterations, GroupRun};
use crate::engine::Stat;
use crate::envs::play::ActionMode;
use crate::error::{Error, Result};
use crate::grpo::gigpo::StepCredit;
use crate::grpo::TurnBatch;
use crate::run::episodes::{add_episode_stats, log_game_step};
use crate::run::run_loop::StepReport;

impl GroupRun {
    /// One step on text games: play the groups, step on their turns, log, evaluate when due.
    pub(super) fn game_step(&mut self, step: usize) -> Result<StepReport> {
        let seed = self.seed();
        let super::Source::Games(games) = &mut self.source else {
            return Err(Error::Internal("a game step without [env]".into()));
        };
        // This process's share of the step's games (all of them on one process).
        let g = self.shape.num_generations;
        let share = self.trainer.core().dist().shard(self.shape.prompts_per_step, "the games of a step")?;
        let n_games = share.len();
        let t = Instant::now();
        let policy = self.trainer.policy();
        let batch = games.play_groups(step, policy, &self.tokenizer, share, g, &self.device)?;
        let time_rollout = t.elapsed().as_secs_f64();

        // Each episode's return; NaN for an episode lost to a failing environment.
        let mut returns = vec![f64::NAN; n_games * g];
        for ep in &batch.episodes {
            returns[ep.episode] = 0.0;
        }
        for (turn, &k) in batch.transitions.iter().zip(&batch.turn_episodes) {
            returns[k] += f64::from(turn.reward);
        }
        let (prompts, actions, allowed) = batch.turn_tokens();
        // Admissible commands, or truncated sampling (every turn then has its supports).
        let admissible = self.config.agent.actions == ActionMode::Admissible
            || (!allowed.is_empty() && allowed.iter().all(|a| !a.is_empty()));
        // GiGPO: each turn's reward and state.
        let rewards: Vec<f64> = batch.transitions.iter().map(|t| f64::from(t.reward)).collect();
        let states: Vec<u64> = batch.transitions.iter().map(|t| t.state).collect();
        let input = TurnBatch {
            prompts: &prompts,
            completions: &actions,
            allowed: admissible.then_some(allowed.as_slice()),
            episodes: &batch.turn_episodes,
            returns: &returns,
            micro_batch: self.config.episodes.micro_batch_turns,
            step_credit: self.config.episodes.gigpo.as_ref().map(|args| StepCredit {
                rewards: &rewards,
                states: &states,
                args,
            }),
        };
        let t = Instant::now();
        let logs = self.trainer.step_turns(&input)?;
        let mut stats = merge_iterations(logs);
        // TRL's epoch: optimizer steps over those of one pass over the games (about 0 for a
        // generated family, whose games do not run out).
        let epoch = self.trainer.core().global_step as f64 / self.shape.steps_per_epoch as f64;
        stats.insert("epoch".into(), Stat::Scalar(epoch));
        let kind = self.config.algorithm.kind.name();
        stats.insert(format!("time/{kind}/step"), Stat::Scalar(t.elapsed().as_secs_f64()));
        stats.insert("time/rollout/total".into(), Stat::Scalar(time_rollout));
        stats.insert(
            "time/rollout/generation".into(),
            Stat::Scalar(batch.counts.time_generation.as_secs_f64()),
        );
        stats.insert("env/turns".into(), Stat::Scalar(self.trainer.core().dist().sum(prompts.len() as f64)?));
        add_episode_stats(self.trainer.core().dist(), &mut stats, &batch)?;
        let (lm, gen) = (self.trainer.policy(), &self.config.generation);
        games.evaluate_if_due(step + 1, lm, &self.tokenizer, gen, seed, &self.device, &mut stats)?;
        log_game_step(&mut self.logger, &self.tokenizer, &self.config, step, &stats, &batch)?;
        Ok(StepReport::of(step, self.shape.steps, &stats, "reward", "kl"))
    }
}
