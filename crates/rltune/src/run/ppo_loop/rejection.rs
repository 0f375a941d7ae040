//! Rejection sampling in the run loop (`[algorithm] kind = "rejection_sampling"`; see
//! [`crate::rejection`]): each step samples, scores, keeps the best and fine-tunes on them.
//! [`RejectionRun`] is its [`Algorithm`]: a [`PpoRun`] (prompts or games, rewards, checkpoints,
//! report) whose step is [`PpoRun::rejection_step`].

use std::time::Instant;

use super::{PpoRun, Source};
use crate::engine::{Stat, Stats};
use crate::error::{Error, Result};
use crate::logging::RunEnd;
use crate::logging::SampleRow;
use crate::rejection::{batch_response_logprobs, returns_to_go, select_top, Per};
use crate::run::episodes::add_episode_stats;
use crate::run::rollout::PromptSampler;
use crate::run::run_loop::{Algorithm, Plan, StepReport};
use crate::train::sft::{train_sft_examples_on, SftExample, SftModel};
use crate::train::{ScheduleKind, TrainingArgs};

/// Rejection sampling as an algorithm of the run loop: the [`PpoRun`]'s data order, checkpoints
/// and report, with the rejection-sampling step.
pub(super) struct RejectionRun<'a>(pub(super) &'a mut PpoRun);

impl Algorithm for RejectionRun<'_> {
    type DataOrder = <PpoRun as Algorithm>::DataOrder;
    type Batch = <PpoRun as Algorithm>::Batch;
    type Report = StepReport;

    fn plan(&self) -> Plan {
        self.0.plan()
    }

    fn dist(&self) -> crate::dist::Dist {
        self.0.trainer.dist().clone()
    }

    fn settings(&self) -> Result<String> {
        self.0.settings()
    }

    fn data_order(&self) -> Result<Self::DataOrder> {
        self.0.data_order()
    }

    fn draw(&self, order: &mut Self::DataOrder) -> Result<Self::Batch> {
        self.0.draw(order)
    }

    fn step(&mut self, step: usize, batch: &Self::Batch) -> Result<StepReport> {
        self.0.rejection_step(step, batch)
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        Algorithm::checkpoint(&*self.0, step)
    }

    fn write_report(&mut self) -> Result<()> {
        self.0.write_report()
    }

    fn finish(&mut self, end: RunEnd) -> Result<()> {
        self.0.finish(end)
    }
}

/// One candidate: the pair to fine-tune on and its score before the KL term.
struct Candidate {
    query: Vec<u32>,
    response: Vec<u32>,
    logprobs: Vec<f32>,
    score: f64,
    /// Candidates ranked together (a prompt's samples, or all turns of a game batch).
    group: usize,
    /// Kept or dropped together (an episode with `per = "episode"`; else itself).
    unit: usize,
    /// The text shown in the report.
    shown: (String, String),
}

impl PpoRun {
    /// One rejection-sampling step.
    pub(super) fn rejection_step(&mut self, step: usize, batch: &[(usize, usize)]) -> Result<StepReport> {
        let rs = self.config.rejection.clone();
        let t = Instant::now();
        let mut stats = Stats::new();
        let mut episodes = Vec::new();
        let candidates = match &mut self.source {
            Source::Games(games) => {
                let b = self.config.ppo.batch_size;
                let got = games.play_rounds(step, &self.trainer.policy, &self.tokenizer, b, &self.device)?;
                add_episode_stats(self.trainer.dist(), &mut stats, &got)?;
                episodes = got.episodes.clone();
                let gamma = self.config.episodes.game_gamma;
                // Per episode: its turns' shaped rewards, discounted to each turn or summed.
                let n_eps = got.turn_episodes.last().map_or(0, |&e| e + 1);
                let mut rewards: Vec<Vec<f64>> = vec![Vec::new(); n_eps];
                for (t, &e) in got.transitions.iter().zip(&got.turn_episodes) {
                    rewards[e].push(f64::from(t.reward));
                }
                let scores: Vec<Vec<f64>> = rewards
                    .iter()
                    .map(|r| match rs.per {
                        Per::Turn => returns_to_go(r, gamma),
                        Per::Episode => vec![r.iter().sum(); r.len()],
                    })
                    .collect();
                let mut seen = vec![0usize; n_eps];
                let mut out = Vec::with_capacity(got.transitions.len());
                for (i, (t, &e)) in got.transitions.into_iter().zip(&got.turn_episodes).enumerate() {
                    let score = scores[e][seen[e]];
                    seen[e] += 1;
                    let unit = if rs.per == Per::Episode { e } else { i };
                    let shown = (self.tokenizer.decode(&t.query_ids)?, t.action.clone());
                    out.push(Candidate {
                        query: t.query_ids,
                        response: t.response_ids,
                        logprobs: t.logprobs,
                        score,
                        group: 0,
                        unit,
                        shown,
                    });
                }
                out
            }
            Source::Prompts { prompts, reward } => {
                let n = rs.samples_per_prompt;
                let sampler = PromptSampler {
                    lm: &self.trainer.policy.lm,
                    v_head: None,
                    tokenizer: &self.tokenizer,
                    generation: &self.config.generation,
                    text_column: &self.config.data.text_column,
                    dist: self.trainer.dist(),
                    device: &self.device,
                };
                let rollout = sampler.roll_out(prompts, batch, n, step)?;
                let scores = reward.score(&rollout.reward_inputs(prompts))?;
                if scores.len() != rollout.samples.len() {
                    return Err(Error::reward(
                        "[reward]",
                        format!(
                            "the reward sources gave {} scores for {} samples",
                            scores.len(),
                            rollout.samples.len()
                        ),
                    ));
                }
                let grouped = n > 1;
                rollout
                    .samples
                    .into_iter()
                    .zip(scores)
                    .zip(rollout.texts)
                    .enumerate()
                    .map(|(k, ((s, score), shown))| Candidate {
                        query: s.query_ids,
                        response: s.response_ids,
                        logprobs: s.logprobs,
                        score: f64::from(score),
                        group: if grouped { k / n } else { 0 },
                        unit: k,
                        shown,
                    })
                    .collect()
            }
        };
        let time_rollout = t.elapsed().as_secs_f64();
        self.eval_if_due(step, &mut stats)?;
        // One group of every candidate (games, one sample per prompt): on several processes it
        // is ranked over all of them.
        let together = candidates.iter().all(|c| c.group == 0);
        let report = self.rejection_update(step, candidates, together, stats, time_rollout)?;
        let shown = episodes.iter().take(self.config.episodes.transcripts_per_step);
        self.logger.log_transcripts(step + 1, shown)?;
        Ok(report)
    }

    /// Scores with the KL term, keeps the best of each group, fine-tunes on them, logs.
    ///
    /// On several processes each holds its own candidates: one group spanning them all
    /// (`together`) is ranked over every process's units, per-prompt groups locally; the kept
    /// examples of every process are gathered, so that the fine-tuning (itself data-parallel)
    /// trains on what one process would keep.
    fn rejection_update(
        &mut self,
        step: usize,
        candidates: Vec<Candidate>,
        together: bool,
        mut stats: Stats,
        time_rollout: f64,
    ) -> Result<StepReport> {
        let rs = self.config.rejection.clone();
        let t = Instant::now();
        // The KL to the reference over each response: Σ_t log π(a_t) − log π_ref(a_t).
        // Batched by `[ppo] mini_batch_size` pairs; an empty response has KL 0.
        let mut kls = vec![0.0; candidates.len()];
        let live: Vec<usize> =
            (0..candidates.len()).filter(|&i| !candidates[i].response.is_empty()).collect();
        for chunk in live.chunks(self.config.ppo.mini_batch_size.max(1)) {
            let pairs: Vec<(&[u32], &[u32])> =
                chunk.iter().map(|&i| (&candidates[i].query[..], &candidates[i].response[..])).collect();
            let temperature = self.config.generation.temperature;
            let refs = batch_response_logprobs(&self.trainer.reference, &pairs, temperature, &self.device)?;
            for (&i, r) in chunk.iter().zip(&refs) {
                kls[i] = candidates[i].logprobs.iter().zip(r).map(|(&p, &q)| f64::from(p - q)).sum::<f64>();
            }
        }
        let time_ref = t.elapsed().as_secs_f64();
        let scores: Vec<f64> = candidates.iter().zip(&kls).map(|(c, k)| c.score - rs.kl_coef * k).collect();
        // Rank units (a turn, an episode, a sample) within each group; a unit's score is its
        // first candidate's (all of an episode's turns share its return).
        let mut kept = vec![false; candidates.len()];
        let groups = candidates.iter().map(|c| c.group).max().map_or(0, |g| g + 1);
        for g in 0..groups {
            let mut units: Vec<(usize, f64)> = Vec::new();
            for (i, c) in candidates.iter().enumerate().filter(|(_, c)| c.group == g) {
                if units.last().is_none_or(|&(u, _)| candidates[u].unit != c.unit) {
                    units.push((i, scores[i]));
                }
            }
            let unit_scores: Vec<f64> = units.iter().map(|u| u.1).collect();
            // One group of everything is ranked over every process's units (a per-prompt
            // group is held by one process).
            let (all, start) =
                if together { self.trainer.dist().gather_var_f64(&unit_scores)? } else { (unit_scores, 0) };
            let local = start..start + units.len();
            let chosen: Vec<usize> = select_top(&all, rs.kept_of(all.len()))
                .into_iter()
                .filter(|k| local.contains(k))
                .map(|k| k - start)
                .collect();
            for k in chosen {
                let unit = candidates[units[k].0].unit;
                for (i, c) in candidates.iter().enumerate() {
                    if c.group == g && c.unit == unit {
                        kept[i] = true;
                    }
                }
            }
        }
        let own: Vec<(Vec<u32>, Vec<u8>)> = candidates
            .iter()
            .zip(&kept)
            .filter(|(c, &k)| k && !c.response.is_empty())
            .map(|(c, _)| {
                (
                    c.query.iter().chain(&c.response).copied().collect(),
                    [vec![0u8; c.query.len()], vec![1u8; c.response.len()]].concat(),
                )
            })
            .collect();
        // Every process's kept examples, in rank order (one process: its own).
        let examples: Vec<SftExample> = self
            .trainer
            .dist()
            .gather_sequences(&own)?
            .into_iter()
            .map(|(input_ids, loss_mask)| SftExample { input_ids, loss_mask })
            .collect();
        let t = Instant::now();
        let model = SftModel {
            store: self.trainer.store.clone(),
            lm: self.trainer.policy.lm.clone(),
            config_json: self.config_json.clone(),
            tokenizer: self.tokenizer.clone(),
            generation_config: None,
            chat_template: None,
            tokenizer_config: None,
        };
        // The data order and passes; the optimizer is the run's (`RejectionConfig::optim_args`).
        let args = TrainingArgs {
            learning_rate: rs.learning_rate,
            num_train_epochs: rs.epochs as f64,
            batch_size: rs.batch_size,
            lr_scheduler_type: ScheduleKind::Constant,
            eval_fraction: 0.0,
            seed: self.config.ppo.seed.wrapping_add(step as u64),
            ..TrainingArgs::default()
        };
        let sft = if examples.is_empty() {
            None
        } else {
            let opt = self.trainer.engine_optimizer_mut();
            Some(train_sft_examples_on(&model, &examples, &args, opt, &mut |_| {})?)
        };
        let time_sft = t.elapsed().as_secs_f64();

        let raw: Vec<f32> = candidates.iter().map(|c| c.score as f32).collect();
        let queries: Vec<Vec<u32>> = candidates.iter().map(|c| c.query.clone()).collect();
        let logprobs: Vec<&[f32]> = candidates.iter().map(|c| c.logprobs.as_slice()).collect();
        self.add_env_stats(&mut stats, &logprobs, &raw, &queries, time_rollout, 0.0)?;
        let kept_scores: Vec<f64> = scores.iter().zip(&kept).filter(|(_, &k)| k).map(|(&s, _)| s).collect();
        // Of every process's candidates.
        let (kept_scores, scores, kls) = (
            self.trainer.dist().gather_var_f64(&kept_scores)?.0,
            self.trainer.dist().gather_var_f64(&scores)?.0,
            self.trainer.dist().gather_var_f64(&kls)?.0,
        );
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        for (k, v) in [
            ("rejection/candidates", scores.len() as f64),
            ("rejection/kept", kept_scores.len() as f64),
            ("rejection/score_mean", mean(&scores)),
            ("rejection/kept_score_mean", mean(&kept_scores)),
            ("rejection/threshold", kept_scores.iter().copied().fold(f64::INFINITY, f64::min)),
            ("rejection/sft_loss", sft.as_ref().map_or(f64::NAN, |s| s.mean_train_loss)),
            ("objective/kl", mean(&kls)),
            ("time/rejection/reference", time_ref),
            ("time/rejection/sft", time_sft),
        ] {
            stats.insert(k.into(), Stat::Scalar(v));
        }
        let rows: Vec<SampleRow> = candidates
            .iter()
            .zip(&kept)
            .filter(|(_, &k)| k)
            .take(self.config.logging.samples_per_step)
            .map(|(c, _)| SampleRow {
                query: c.shown.0.clone(),
                response: c.shown.1.clone(),
                reward: c.score as f32,
            })
            .collect();
        self.logger.log_step(step + 1, &stats, &rows)?;
        Ok(StepReport::of(step, self.config.ppo.steps, &stats, "env/reward_mean", "objective/kl"))
    }
}
