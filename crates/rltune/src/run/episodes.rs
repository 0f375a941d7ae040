//! Text games as the data of `rltune ppo` (a run config with `[env]`): each step plays rounds of
//! episodes on the training games until there are `batch_size` turns, picks `batch_size` of them
//! at random (the others are logged as `env/unused_turns`), and every picked turn becomes one
//! PPO transition ([`crate::agent::rollout`]). Every `eval_every` steps the policy plays
//! `eval_episodes` held-out games, as `rltune play` would with the same seed.
//!
//! Which games: generated families play their training seeds in training and their held-out
//! seeds in evaluation (the `[env] split` key is `rltune play`'s); game files are drawn at random
//! from `games` in training and played in turn from `[episodes] eval_games` (default: `games`)
//! in evaluation. A step's games depend only on the run's seed and the step, so `--resume`
//! replays them.

use std::time::Instant;

use candle_core::Device;
use rand::seq::index::sample;
use rand::SeedableRng;

use super::config::{AlgorithmKind, EpisodesSection, RunConfig};
use crate::agent::config::{EnvSection, Split};
use crate::agent::model_agent::play_model;
use crate::agent::rollout::{collect_episodes, Actor, Collected, RolloutConfig, RoundCounts, Transition};
use crate::dist::Dist;
use crate::engine::{Stat, Stats};
use crate::envs::play::{Episode, PlayReport, PromptTemplate};
use crate::envs::{Reset, TextEnv};
use crate::error::{Error, Result};
use crate::generation::GenerationConfig;
use crate::logging::{RunLogger, SampleRow};
use crate::models::CausalLm;
use crate::tokenizer::Tokenizer;

/// The most rounds of episodes one step plays before it gives up (a policy whose every turn is
/// an example turn, or episodes that end before their first turn, yield no transitions).
const MAX_ROUNDS: usize = 64;

/// One step's turns and what else the rounds produced.
#[derive(Debug, Clone, Default)]
pub struct EpisodeBatch {
    /// The turns: exactly `batch_size` from [`EpisodeSource::collect`], all of them from
    /// [`EpisodeSource::play_rounds`].
    pub transitions: Vec<Transition>,
    /// From [`EpisodeSource::play_rounds`]: which episode each turn belongs to (0, 1, …).
    pub turn_episodes: Vec<usize>,
    /// Every finished episode of the step's rounds.
    pub episodes: Vec<Episode>,
    /// Turns played but not picked.
    pub unused_turns: usize,
    /// The rounds' counts and times, summed.
    pub counts: RoundCounts,
}

/// Turns as token rows: the prompts, the actions, and each action token's allowed set.
pub type TurnTokens = (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<Vec<Vec<u32>>>);

impl EpisodeBatch {
    /// Adds a round's counts and times.
    fn count(&mut self, got: &Collected) {
        self.counts += got.counts;
    }

    /// The turns' prompts, actions and (admissible actions) allowed sets, as the trainers take
    /// them.
    pub fn turn_tokens(&self) -> TurnTokens {
        let turns = &self.transitions;
        (
            turns.iter().map(|t| t.query_ids.clone()).collect(),
            turns.iter().map(|t| t.response_ids.clone()).collect(),
            turns.iter().map(|t| t.allowed.clone()).collect(),
        )
    }
}

/// How many of the turns played a game step trains on ([`EpisodeSource::collect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Exactly this many (`[episodes] train_turns = "batch"`: `[ppo] batch_size`), from as many
    /// rounds as it takes to play them.
    Exactly(usize),
    /// All of one round but the remainder modulo this unit (`train_turns = "round"`: the
    /// backward batch), from one round, or more while a round plays fewer than one unit. On
    /// several processes, the least such count of any process, so that each trains as many.
    Multiple(usize),
}

/// The number of turns every process trains on: the least of the processes' `own` (itself on
/// one process). Each process's count is a multiple of the same unit, and so is the least.
fn common_size(dist: &Dist, own: usize) -> Result<usize> {
    if !dist.active() {
        return Ok(own);
    }
    let all = dist.gather_f64(&[own as f64])?;
    Ok(all.into_iter().fold(own as f64, f64::min) as usize)
}

/// The training games, their environments and the evaluation settings of a run.
pub struct EpisodeSource {
    env: Box<dyn TextEnv>,
    section: EnvSection,
    episodes: EpisodesSection,
    rollout: RolloutConfig,
    games: usize,
    seed: u64,
    /// The processes: rank r plays the environments `r·num_envs..` of each round and samples
    /// from its own stream, and each trains on the least of their turn counts.
    dist: Dist,
}

impl EpisodeSource {
    /// Starts the training environments of `cfg` (which must have `[env]`), for this process of
    /// `dist`.
    pub fn new(cfg: &RunConfig, dist: &Dist) -> Result<Self> {
        let mut section =
            cfg.env.clone().ok_or_else(|| Error::Internal("EpisodeSource needs an [env] table".into()))?;
        section.split = Split::Train;
        let games = section.game_count()?;
        let env = section.build()?;
        let rollout = RolloutConfig {
            template: cfg.agent.clone(),
            generation: cfg.generation.clone(),
            game_gamma: cfg.episodes.game_gamma,
            example_turn_prob: cfg.episodes.example_turn_prob,
            shaping: cfg.episodes.shaping.clone(),
        };
        let seed = match cfg.algorithm.kind {
            AlgorithmKind::Grpo => cfg.grpo.seed,
            AlgorithmKind::Rloo => cfg.rloo.seed,
            _ => cfg.ppo.seed,
        };
        Ok(Self { env, section, episodes: cfg.episodes.clone(), rollout, games, seed, dist: dist.clone() })
    }

    /// How many training games there are ([`training_games`]).
    pub fn game_count(&self) -> usize {
        training_games(self.games)
    }

    /// Plays rounds of episodes with `policy` until `pick` has enough turns, runs `prepare` on
    /// every turn played (whole episodes, in turn order: what needs an episode's later turns,
    /// such as λ-returns across turns), then picks the step's turns at random, kept in play
    /// order ([`Pick`]).
    pub fn collect<'a>(
        &mut self,
        step: usize,
        policy: impl Into<Actor<'a>>,
        tokenizer: &Tokenizer,
        pick: Pick,
        device: &Device,
        prepare: impl FnOnce(&mut [Transition]) -> Result<()>,
    ) -> Result<EpisodeBatch> {
        let min_turns = match pick {
            Pick::Exactly(n) | Pick::Multiple(n) => n,
        };
        let mut batch = self.play_rounds(step, policy, tokenizer, min_turns, device)?;
        let mut turns: Vec<Transition> = std::mem::take(&mut batch.transitions);
        prepare(&mut turns)?;
        let size = match pick {
            Pick::Exactly(n) => n,
            Pick::Multiple(unit) => common_size(&self.dist, turns.len() / unit * unit)?,
        };
        let mut rng =
            rand::rngs::StdRng::seed_from_u64(mix(self.seed, step as u64, self.dist.rank() as u64, 0x7e4d));
        let mut picked = sample(&mut rng, turns.len(), size).into_vec();
        picked.sort_unstable();
        batch.unused_turns = turns.len() - size;
        let mut slots: Vec<Option<Transition>> = turns.into_iter().map(Some).collect();
        batch.transitions = picked.into_iter().filter_map(|i| slots[i].take()).collect();
        Ok(batch)
    }

    /// Plays rounds of episodes with `policy` until at least `min_turns` turns are played;
    /// returns them all, episode by episode (`turn_episodes[i]`: the episode of turn i).
    pub fn play_rounds<'a>(
        &mut self,
        step: usize,
        policy: impl Into<Actor<'a>>,
        tokenizer: &Tokenizer,
        min_turns: usize,
        device: &Device,
    ) -> Result<EpisodeBatch> {
        let policy: Actor = policy.into();
        let b = self.env.num_envs();
        let mut out = EpisodeBatch::default();
        let mut round = 0;
        let mut groups = 0;
        while out.transitions.len() < min_turns {
            if round == MAX_ROUNDS {
                return Err(Error::batch(format!(
                    "step {}: {MAX_ROUNDS} rounds of {b} episodes gave {} trainable turns, fewer than \
                     {min_turns} (is [episodes] example_turn_prob too high, or [env] max_steps too low?)",
                    step + 1,
                    out.transitions.len()
                )));
            }
            let resets: Vec<Reset> = (0..b).map(|e| self.train_reset(step, round, e)).collect();
            let seed = self.round_seed(step, round);
            let got =
                collect_episodes(self.env.as_mut(), policy, tokenizer, &self.rollout, &resets, seed, device)?;
            out.count(&got);
            // A round's turns come episode by episode: a new environment index starts a new one.
            let mut last_env = None;
            for t in got.transitions {
                if last_env != Some(t.env) {
                    groups += 1;
                    last_env = Some(t.env);
                }
                out.turn_episodes.push(groups - 1);
                out.transitions.push(t);
            }
            let first = out.episodes.len();
            out.episodes.extend(got.episodes);
            for (k, ep) in out.episodes[first..].iter_mut().enumerate() {
                ep.episode = first + k;
            }
            round += 1;
        }
        Ok(out)
    }

    /// Plays `num_generations` episodes of each of the step's training games `games` (global
    /// indices: a data-parallel process plays its share; trajectory GRPO and RLOO): episode `k`
    /// (0-based, local) plays game `games.start + k / num_generations`, in rounds of
    /// the environments (a last round's extra environments play and are discarded). Returns the
    /// turns and the episodes, each episode's `episode` field being its index `k`, so
    /// `turn_episodes[i]` is turn `i`'s episode index; an episode lost to a failing environment
    /// has no entry (counted in `dropped`). The games depend only on the run's seed and the
    /// step, so `--resume` replays them.
    pub fn play_groups(
        &mut self,
        step: usize,
        lm: &CausalLm,
        tokenizer: &Tokenizer,
        games: std::ops::Range<usize>,
        num_generations: usize,
        device: &Device,
    ) -> Result<EpisodeBatch> {
        let b = self.env.num_envs();
        let (first_game, games) = (games.start, games.len());
        let total = games * num_generations;
        // When this process's episodes start on a round boundary of the whole step's, its rounds
        // are those rounds of one process playing every game, seeds included: then N processes
        // sample what one does. Otherwise each process samples from its own stream.
        let first_slot = first_game * num_generations;
        let global_round = first_slot.is_multiple_of(b).then_some(first_slot / b);
        let mut out = EpisodeBatch::default();
        for round in 0..total.div_ceil(b) {
            let slot = |e: usize| round * b + e;
            let resets: Vec<Reset> = (0..b)
                .map(|e| {
                    let game = first_game + (slot(e) % total) / num_generations;
                    let i = mix(self.seed, step as u64, game as u64, 0x6a3e);
                    self.section.reset_for(0, i as usize, self.games)
                })
                .collect();
            let seed = match global_round {
                Some(r0) => mix(self.seed, step as u64, (r0 + round) as u64, u64::MAX),
                None => self.round_seed(step, round),
            };
            let got =
                collect_episodes(self.env.as_mut(), lm, tokenizer, &self.rollout, &resets, seed, device)?;
            out.count(&got);
            for t in got.transitions.into_iter().filter(|t| slot(t.env) < total) {
                out.turn_episodes.push(slot(t.env));
                out.transitions.push(t);
            }
            for mut ep in got.episodes.into_iter() {
                let k = slot(ep.episode);
                if k < total {
                    ep.episode = k;
                    out.episodes.push(ep);
                }
            }
        }
        Ok(out)
    }

    /// The sampling seed of round `round` of `step` (this process's own).
    fn round_seed(&self, step: usize, round: usize) -> u64 {
        mix(self.seed, step as u64, round as u64, u64::MAX - self.dist.rank() as u64)
    }

    /// How environment `e` starts in round `round` of `step`: a training game drawn from the
    /// run's seed, the step, the round and the environment.
    fn train_reset(&self, step: usize, round: usize, e: usize) -> Reset {
        let e = self.dist.rank() * self.env.num_envs() + e;
        let i = mix(self.seed, step as u64, round as u64, e as u64);
        self.section.reset_for(0, i as usize, self.games)
    }

    /// Whether evaluation is due after `step` steps.
    pub fn eval_due(&self, step: usize) -> bool {
        self.episodes.eval_every > 0 && step.is_multiple_of(self.episodes.eval_every)
    }

    /// After `step` steps, when `eval_every` says so: plays the held-out games with `policy`
    /// ([`Self::evaluate`]) and adds the `eval/*` metrics to `stats`.
    #[allow(clippy::too_many_arguments)]
    pub fn evaluate_if_due(
        &self,
        step: usize,
        policy: &CausalLm,
        tokenizer: &Tokenizer,
        generation: &GenerationConfig,
        seed: u64,
        device: &Device,
        stats: &mut Stats,
    ) -> Result<()> {
        if self.eval_due(step) {
            let t = Instant::now();
            let r = self.evaluate(policy, tokenizer, generation, seed, device)?;
            add_eval_stats(stats, &r, t.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// Plays `eval_episodes` held-out games with `policy`'s LM (sampling as in training, seed
    /// `seed`), as `rltune play --seed SEED` does.
    pub fn evaluate(
        &self,
        policy: &CausalLm,
        tokenizer: &Tokenizer,
        generation: &GenerationConfig,
        seed: u64,
        device: &Device,
    ) -> Result<PlayReport> {
        let section = self.eval_section();
        evaluate(
            &section,
            policy,
            tokenizer,
            &self.rollout.template,
            generation,
            self.episodes.eval_episodes,
            seed,
            device,
        )
        .map(|(report, _)| report)
    }

    /// The evaluation games during training: a generated family's validation split (so that
    /// settings read off `eval/*` are not chosen on the test games), or `eval_games`.
    pub fn eval_section(&self) -> EnvSection {
        let mut s = self.section.clone();
        s.split = Split::Validation;
        if !self.episodes.eval_games.is_empty() {
            s.games = self.episodes.eval_games.clone();
        }
        s
    }
}

/// How many training games a run has, from [`EnvSection::game_count`] (`files`): the game
/// files, or for a generated family (0 files) as many as a run can use (its seeds).
pub fn training_games(files: usize) -> usize {
    if files > 0 {
        files
    } else {
        usize::MAX >> 16
    }
}

/// Plays `episodes` episodes of `section` with `policy`'s LM and summarizes them (the
/// evaluation of `rltune play --model … --seed SEED`); the episodes come back too, in index
/// order, for paired comparisons ([`crate::envs::play::PairedDifference`]).
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    section: &EnvSection,
    policy: &CausalLm,
    tokenizer: &Tokenizer,
    template: &PromptTemplate,
    generation: &GenerationConfig,
    episodes: usize,
    seed: u64,
    device: &Device,
) -> Result<(PlayReport, Vec<Episode>)> {
    let games = section.game_count()?;
    let mut env = section.build()?;
    let gen = GenerationConfig { seed, ..generation.clone() };
    let t = Instant::now();
    let resets = |i| section.reset_for(seed, i, games);
    let (done, dropped) =
        play_model(env.as_mut(), policy, tokenizer, template, &gen, episodes, &resets, device)?;
    Ok((PlayReport::of(&done, dropped, t.elapsed().as_secs_f64()), done))
}

/// A 64-bit hash of four numbers ([`crate::envs::play::mix_seeds`]).
fn mix(a: u64, b: u64, c: u64, d: u64) -> u64 {
    crate::envs::play::mix_seeds(&[a, b, c, d])
}

/// The episode metrics of a step: `env/episodes`, `env/win_rate`, `env/episode_return_mean`,
/// `env/normalized_score_mean`, `env/episode_length_mean`, `env/invalid_action_rate`,
/// `env/unused_turns`, `env/example_turns`, `env/dropped_episodes`, and the rollout's times.
/// In a data-parallel run the counts are summed over the processes and the rates and means are
/// the mean of the processes' (each plays whole rounds of its own games).
pub fn add_episode_stats(dist: &Dist, stats: &mut Stats, batch: &EpisodeBatch) -> Result<()> {
    let mut own = Stats::new();
    add_own_episode_stats(&mut own, batch);
    let counts = [
        "env/episodes",
        "env/unused_turns",
        "env/example_turns",
        "env/dropped_episodes",
        "env/prefill_tokens",
    ];
    crate::engine::stats::reduce_over(dist, &mut own, &counts)?;
    stats.extend(own);
    Ok(())
}

fn add_own_episode_stats(stats: &mut Stats, batch: &EpisodeBatch) {
    let r = PlayReport::of(&batch.episodes, batch.counts.dropped, 1.0);
    let n = batch.episodes.len().max(1) as f64;
    let mean_return = batch.episodes.iter().map(|e| e.episode_return).sum::<f64>() / n;
    for (k, v) in [
        ("env/episodes", r.episodes as f64),
        ("env/win_rate", r.win_rate),
        ("env/episode_return_mean", mean_return),
        ("env/normalized_score_mean", r.mean_normalized_score),
        ("env/episode_length_mean", r.mean_steps),
        ("env/invalid_action_rate", r.invalid_action_rate),
        ("env/unused_turns", batch.unused_turns as f64),
        ("env/example_turns", batch.counts.example_turns as f64),
        ("env/dropped_episodes", batch.counts.dropped as f64),
        ("time/rollout/env", batch.counts.time_env.as_secs_f64()),
        ("time/rollout/prefill", batch.counts.time_prefill.as_secs_f64()),
        ("env/prefill_tokens", batch.counts.prefill_tokens as f64),
    ] {
        stats.insert(k.into(), Stat::Scalar(v));
    }
}

/// Logs a step on games: its metrics with its first `[logging] samples_per_step` turns as sample
/// rows (prompt, action, shaped reward), and its first `[episodes] transcripts_per_step`
/// episodes' transcripts.
pub fn log_game_step(
    logger: &mut RunLogger,
    tokenizer: &Tokenizer,
    config: &RunConfig,
    step: usize,
    stats: &Stats,
    batch: &EpisodeBatch,
) -> Result<()> {
    let rows = batch
        .transitions
        .iter()
        .take(config.logging.samples_per_step)
        .map(|t| {
            Ok(SampleRow {
                query: tokenizer.decode(&t.query_ids)?,
                response: t.action.clone(),
                reward: t.reward,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    logger.log_step(step + 1, stats, &rows)?;
    logger.log_transcripts(step + 1, batch.episodes.iter().take(config.episodes.transcripts_per_step))
}

/// The `eval/*` metrics of an evaluation.
pub fn add_eval_stats(stats: &mut Stats, r: &PlayReport, seconds: f64) {
    for (k, v) in [
        ("eval/episodes", r.episodes as f64),
        ("eval/win_rate", r.win_rate),
        ("eval/normalized_score_mean", r.mean_normalized_score),
        ("eval/episode_length_mean", r.mean_steps),
        ("eval/invalid_action_rate", r.invalid_action_rate),
        ("time/eval", seconds),
    ] {
        stats.insert(k.into(), Stat::Scalar(v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixing_separates_steps_rounds_and_environments() {
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..20 {
            for r in 0..5 {
                for e in 0..8 {
                    assert!(seen.insert(mix(3, s, r, e)));
                }
            }
        }
        assert_ne!(mix(0, 1, 0, 0), mix(1, 0, 0, 0));
    }
}
