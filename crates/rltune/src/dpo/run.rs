//! A DPO run over a dataset: transformers `Trainer`'s epoch loop around [`DpoTrainer::step`], as
//! an algorithm of the run loop ([`crate::engine::run_loop`]).
//!
//! Each epoch shuffles the pairs (a seeded permutation; transformers draws its own with torch's
//! generator, so the order differs from TRL's but not its distribution), cuts them into
//! micro-batches of `per_device_train_batch_size` (the last one shorter) and groups
//! `gradient_accumulation_steps` micro-batches into an optimizer step (the epoch's last step takes
//! the remainder, as transformers' `_inner_training_loop`). The run stops after
//! [`DpoConfig::total_steps`] optimizer steps.
//!
//! [`train_with`] adds the supervised runs' checkpoints ([`crate::train::checkpoint`]): a
//! `step-N/` every `save_steps` steps and on Ctrl-C, and `--resume` bit for bit.

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::config::DpoConfig;
use super::data::PreferencePair;
use super::trainer::{DpoCounters, DpoTrainer};
use crate::dist::Dist;
use crate::engine::run_loop::Plan;
use crate::engine::Stats;
use crate::error::{ConfigError, Error, Result};
use crate::logging::jsonl::{JsonlWriter, MetricRow};
use crate::train::checkpoint::{self, Checkpointing, LoopCheckpoint, LoopKind, RunShape};

/// The optimizer steps of one epoch: indices into the pairs, grouped into micro-batches.
///
/// On several processes ([`crate::dist`]) every process draws the same permutation, cuts it into
/// global micro-batches of `per_device_train_batch_size` × N pairs, and takes its contiguous
/// share of each (so that N processes train on what one process with N times the batch trains
/// on). A last micro-batch that the processes cannot share evenly is left out, as
/// `dataloader_drop_last` would (logged).
pub fn epoch_plan(
    cfg: &DpoConfig,
    dist: &Dist,
    n_pairs: usize,
    rng: &mut rand::rngs::StdRng,
) -> Vec<Vec<Vec<usize>>> {
    let mut perm: Vec<usize> = (0..n_pairs).collect();
    perm.shuffle(rng);
    let (world, rank) = (dist.world_size(), dist.rank());
    let micro: Vec<Vec<usize>> = perm
        .chunks(cfg.per_device_train_batch_size * world)
        .filter_map(|c| {
            if !c.len().is_multiple_of(world) {
                tracing::warn!(
                    "the epoch's last {} pairs cannot be shared evenly by {world} processes: left out; \
                     make the pair count a multiple of per_device_train_batch_size × processes",
                    c.len()
                );
                return None;
            }
            let per = c.len() / world;
            Some(c[rank * per..(rank + 1) * per].to_vec())
        })
        .collect();
    micro.chunks(cfg.gradient_accumulation_steps).map(<[Vec<usize>]>::to_vec).collect()
}

/// The pairs one process of `dist` counts in its schedule: all of them on one process, a share
/// on N (so that `total_steps` and the epochs count global micro-batches of
/// `per_device_train_batch_size` × N pairs: ⌈⌈n/N⌉/b⌉ = ⌈n/(N·b)⌉).
pub fn pairs_per_process(dist: &Dist, n_pairs: usize) -> usize {
    n_pairs.div_ceil(dist.world_size())
}

/// Trains on `pairs` for the run's optimizer steps; `on_step(step, total, stats)` is called after
/// each (from 1). Returns the steps taken.
pub fn train(
    trainer: &mut DpoTrainer,
    pairs: &[PreferencePair],
    on_step: &mut dyn FnMut(usize, usize, &Stats) -> Result<()>,
) -> Result<usize> {
    Ok(train_with(trainer, pairs, None, None, on_step)?.steps)
}

/// What [`train_with`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoSummary {
    /// Optimizer steps done (those of a resumed run's checkpoint included).
    pub steps: usize,
    /// Optimizer steps planned: more than `steps` when the run was stopped.
    pub total_steps: usize,
    /// The metrics lines of every step done, as `metrics.jsonl` holds them.
    pub metrics: Vec<String>,
}

/// What the DPO loop carries between steps, in `trainer_state.json` beside the step and the run's
/// shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct DpoState {
    /// The `[dpo]` settings of the run, compared with a resumed run's.
    config: serde_json::Value,
    /// The trainer's counters.
    #[serde(flatten)]
    counters: DpoCounters,
}

/// The metrics lines of a checkpoint.
const METRICS: &str = "metrics.jsonl";

/// [`train`] with checkpoints, `--resume` and a stop flag ([`Checkpointing`]), writing each
/// step's metrics line to `metrics` (rewritten at the start: emptied, or on resume the
/// checkpoint's lines) on the first process.
///
/// A checkpoint (`step-N/`, every `save_steps` and when stopped) holds the trainable variables,
/// Adam's moments, the metrics lines so far and `trainer_state.json` (the step, the counters
/// behind `num_tokens`, `epoch` and `rltune/skipped_updates`, the settings); the reference is not
/// saved (it is the initial model, or `--ref-model`). A resumed run replays the epochs' seeded
/// shuffles up to the checkpoint's step and continues bit for bit: weights and metrics lines
/// equal a run's that never stopped. A checkpoint of another number of pairs, processes or other
/// settings (save_steps aside) is refused, naming what differs. Stopped by `checkpoints.stop`, it
/// returns after the step under way and its checkpoint, `steps` short of `total_steps`.
pub fn train_with(
    trainer: &mut DpoTrainer,
    pairs: &[PreferencePair],
    checkpoints: Option<Checkpointing>,
    metrics: Option<&Path>,
    on_step: &mut dyn FnMut(usize, usize, &Stats) -> Result<()>,
) -> Result<DpoSummary> {
    if pairs.is_empty() {
        return Err(Error::argument("pairs", "no preference pair to train on"));
    }
    let cfg = trainer.config.clone();
    let total = cfg.total_steps(pairs_per_process(trainer.dist(), pairs.len()));
    let shape = RunShape {
        total_steps: total,
        train_examples: pairs.len(),
        seed: cfg.seed,
        processes: trainer.dist().world_size(),
    };
    let config = settings(&cfg)?;
    let (start_step, lines) = match checkpoints.filter(|c| c.resume) {
        Some(c) => resume(trainer, c.dir, &shape, &config)?,
        None => (0, Vec::new()),
    };
    let writer = match metrics.filter(|_| trainer.dist().is_main()) {
        Some(path) => {
            crate::io::write_bytes_atomic(path, jsonl(&lines).as_bytes())?;
            Some(JsonlWriter::append(path)?)
        }
        None => None,
    };
    let mut run = DpoRun { trainer, pairs, checkpoints, shape, start_step, config, lines, writer };
    let stop = checkpoint::stop_flag(checkpoints);
    let steps =
        crate::engine::run_loop::run(&mut run, stop, &mut |(step, stats)| on_step(*step, total, stats))?;
    Ok(DpoSummary { steps, total_steps: total, metrics: run.lines })
}

/// A DPO run as an algorithm of the run loop ([`crate::engine::run_loop`]): each step is one
/// optimizer step of the epoch's plan ([`epoch_plan`]).
struct DpoRun<'a> {
    trainer: &'a mut DpoTrainer,
    pairs: &'a [PreferencePair],
    checkpoints: Option<Checkpointing<'a>>,
    shape: RunShape,
    start_step: usize,
    /// The settings a checkpoint records ([`settings`]).
    config: serde_json::Value,
    /// The metrics lines of the steps done.
    lines: Vec<String>,
    writer: Option<JsonlWriter>,
}

impl crate::engine::run_loop::Algorithm for DpoRun<'_> {
    /// The epoch's plan, how many of its steps were drawn, and the RNG of the shuffles.
    type DataOrder = (rand::rngs::StdRng, Vec<Vec<Vec<usize>>>, usize);
    /// One optimizer step: its micro-batches of pair indices.
    type Batch = Vec<Vec<usize>>;
    /// The steps done and the step's metrics.
    type Report = (usize, Stats);

    fn plan(&self) -> Plan {
        checkpoint::plan(&self.shape, self.start_step, self.trainer.config.save_steps, self.checkpoints)
    }

    fn dist(&self) -> crate::dist::Dist {
        self.trainer.dist().clone()
    }

    fn settings(&self) -> Result<String> {
        Ok(self.config.to_string())
    }

    fn data_order(&self) -> Result<Self::DataOrder> {
        Ok((rand::rngs::StdRng::seed_from_u64(self.trainer.config.seed), Vec::new(), 0))
    }

    fn draw(&self, (rng, plan, drawn): &mut Self::DataOrder) -> Result<Vec<Vec<usize>>> {
        if *drawn == plan.len() {
            *plan = epoch_plan(&self.trainer.config, self.trainer.dist(), self.pairs.len(), rng);
            *drawn = 0;
            if plan.is_empty() {
                let bs = self.trainer.config.per_device_train_batch_size;
                return Err(Error::Setting(ConfigError::new(
                    "dpo",
                    "per_device_train_batch_size",
                    format!(
                        "= {bs}: {} preference pairs give no step of {bs} per process on {} processes; add \
                         pairs or lower per_device_train_batch_size",
                        self.pairs.len(),
                        self.trainer.dist().world_size()
                    ),
                )));
            }
        }
        *drawn += 1;
        Ok(plan[*drawn - 1].clone())
    }

    fn step(&mut self, step: usize, group: &Vec<Vec<usize>>) -> Result<(usize, Stats)> {
        let micro: Vec<Vec<&PreferencePair>> =
            group.iter().map(|mb| mb.iter().map(|&i| &self.pairs[i]).collect()).collect();
        let stats = self.trainer.step(&micro)?;
        let line = MetricRow::from_stats(step + 1, &stats).to_json_line();
        if let Some(w) = self.writer.as_mut() {
            w.write_line(&line)?;
        }
        self.lines.push(line);
        Ok((step + 1, stats))
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        let Some(c) = self.checkpoints else { return Ok(()) };
        let ck = LoopCheckpoint {
            trainer: LoopKind::Dpo,
            step,
            shape: self.shape,
            adam_steps: self.trainer.adam().steps(),
            state: DpoState { config: self.config.clone(), counters: self.trainer.counters() },
        };
        let text = jsonl(&self.lines);
        let files = [(METRICS, text.as_bytes())];
        checkpoint::save(c.dir, self.trainer.store(), self.trainer.adam(), &ck, &files).map(drop)
    }
}

/// Loads the latest checkpoint in `dir` into `trainer` (module docs); returns its step and
/// metrics lines.
fn resume(
    trainer: &mut DpoTrainer,
    dir: &Path,
    shape: &RunShape,
    config: &serde_json::Value,
) -> Result<(usize, Vec<String>)> {
    let store = trainer.store().clone();
    let (saved, path) = checkpoint::load_latest::<DpoState>(
        dir,
        LoopKind::Dpo,
        shape,
        &store,
        trainer.adam_mut(),
        |s, file| same_settings(&s.config, config, file),
    )?;
    trainer.restore_counters(saved.step, &saved.state.counters);
    Ok((saved.step, read_lines(&path.join(METRICS), saved.step)?))
}

/// `lines` as a JSON-lines file's text.
fn jsonl(lines: &[String]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// The settings a checkpoint records: `cfg` as JSON, without `save_steps` (which a resumed run
/// may change).
fn settings(cfg: &DpoConfig) -> Result<serde_json::Value> {
    let mut v = serde_json::to_value(cfg)
        .map_err(|e| Error::Internal(format!("the [dpo] settings do not serialize: {e}")))?;
    if let Some(m) = v.as_object_mut() {
        m.remove("save_steps");
    }
    Ok(v)
}

/// Refuses to resume, naming the first setting that differs, when the checkpoint's settings
/// (`saved`, read from `file`) are not this run's (`now`).
fn same_settings(saved: &serde_json::Value, now: &serde_json::Value, file: &Path) -> Result<()> {
    let Some(now) = now.as_object() else { return Ok(()) };
    for (key, value) in now {
        let was = saved.get(key).unwrap_or(&serde_json::Value::Null);
        if was != value {
            return Err(Error::checkpoint(
                file,
                format!(
                    "saved with dpo.{key} = {was} but this run has {value}; resume with the settings \
                     it was started with (only dpo.save_steps may change)"
                ),
            ));
        }
    }
    Ok(())
}

/// The first `steps` lines of a checkpoint's `metrics.jsonl`, which must hold that many.
fn read_lines(path: &Path, steps: usize) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let lines: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    if lines.len() != steps {
        return Err(Error::checkpoint(
            path,
            format!(
                "{} lines for {steps} steps; the checkpoint is damaged: resume from an earlier one \
                 (remove this step-N folder) or start anew",
                lines.len()
            ),
        ));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_cover_every_pair_once_in_steps_of_micro_batches() {
        let cfg = DpoConfig {
            per_device_train_batch_size: 2,
            gradient_accumulation_steps: 2,
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let plan = epoch_plan(&cfg, &Dist::default(), 5, &mut rng);
        // 3 micro-batches (2, 2, 1): a step of two, then the remainder.
        assert_eq!(plan.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 1]);
        let mut seen: Vec<usize> = plan.iter().flatten().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);
        assert_eq!(cfg.total_steps(5), 3 * plan.len());
    }
}
