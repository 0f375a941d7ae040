//! The one loop every RL run of `rltune ppo` goes through, whatever its algorithm: draw the step's
//! data, run the algorithm's step, report, checkpoint every `[checkpoint] every` steps, write the
//! report every `[logging] report_every`, stop cleanly on Ctrl-C. In a data-parallel run every
//! process runs it, on its share of each step's data; rank 0 alone checkpoints and reports, and
//! a process whose configuration differs from rank 0's is refused before the first step. A resumed run first replays the
//! data order of the steps already done, so it sees the prompts a straight run would have.
//!
//! PPO and rejection sampling ([`super::PpoRun`]) and GRPO and RLOO ([`super::GroupRun`])
//! implement [`Algorithm`]: what their data order is, what one step does, how a checkpoint is
//! written.

use std::sync::atomic::{AtomicBool, Ordering};

use super::config::RunConfig;
use crate::error::Result;
use crate::logging::{RunEnd, RunLogger};

/// One algorithm inside the run loop.
pub trait Algorithm {
    /// The state the run's data is drawn from (a seeded permutation of the prompts and its RNG).
    type DataOrder;
    /// The data of one step (e.g. prompt indices).
    type Batch;

    /// The run's config (`[checkpoint] every`, `[logging] report_every`).
    fn config(&self) -> &RunConfig;
    /// Steps the run makes in all.
    fn total_steps(&self) -> usize;
    /// The first step this process makes: 0, or the checkpoint's step with `--resume`.
    fn start_step(&self) -> usize;
    /// The data order at the start of the run.
    fn data_order(&self) -> Result<Self::DataOrder>;
    /// Draws the next step's data from `order`.
    fn draw(&self, order: &mut Self::DataOrder) -> Self::Batch;
    /// Runs step `step` (from 0) on `batch`.
    fn step(&mut self, step: usize, batch: &Self::Batch) -> Result<StepReport>;
    /// Writes the checkpoint of the run after `step` steps.
    fn checkpoint(&self, step: usize) -> Result<()>;
    /// The run's logger (its report is rewritten every `report_every` steps).
    fn logger(&mut self) -> &mut RunLogger;
}

/// Runs the remaining steps of `alg`. `stop` (set by Ctrl-C) ends the run after the current step
/// with a checkpoint. Returns the number of steps done in total.
///
/// The experiment trackers' runs end here: finished, killed (stopped by Ctrl-C before the last
/// step) or failed (an error).
pub fn run<A: Algorithm>(
    alg: &mut A,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<usize> {
    let result = run_steps(alg, stop, progress);
    let end = match &result {
        Ok(done) if *done < alg.total_steps() => RunEnd::Killed,
        Ok(_) => RunEnd::Finished,
        Err(_) => RunEnd::Failed,
    };
    let ended = alg.logger().finish(end);
    let done = result?;
    ended?;
    Ok(done)
}

fn run_steps<A: Algorithm>(
    alg: &mut A,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(&StepReport),
) -> Result<usize> {
    let total = alg.total_steps();
    // A data-parallel run: every process must run the same configuration as rank 0.
    let resolved = alg.config().to_toml()?;
    crate::dist::check_same(
        crate::dist::fingerprint(resolved.as_bytes()),
        "the resolved configuration (its --config file and --set overrides): start every process \
         with the same ones",
    )?;
    let mut order = alg.data_order()?;
    // Replay the data order of the steps already done, so a resumed run sees the same data.
    for _ in 0..alg.start_step() {
        alg.draw(&mut order);
    }
    let mut step = alg.start_step();
    while step < total {
        let batch = alg.draw(&mut order);
        let report = alg.step(step, &batch)?;
        step += 1;
        progress(&StepReport { step, ..report });
        let stopping = stop.load(Ordering::SeqCst);
        let every = alg.config().checkpoint.every;
        // Every process holds the same weights: rank 0 alone writes them.
        if crate::dist::is_main() && (stopping || step == total || (every > 0 && step.is_multiple_of(every)))
        {
            alg.checkpoint(step)?;
        }
        if stopping || step == total || step.is_multiple_of(alg.config().logging.report_every.max(1)) {
            alg.logger().write_report()?;
        }
        if stopping {
            tracing::info!("stopped after step {step}; checkpoint written");
            break;
        }
    }
    Ok(step)
}

/// What the loop reports after each step (for progress bars).
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Steps done (1-based).
    pub step: usize,
    /// Steps in the run.
    pub total: usize,
    /// `env/reward_mean`, or NaN for a skipped batch.
    pub reward_mean: f64,
    /// `objective/kl`, or NaN for a skipped batch.
    pub kl: f64,
    /// Whether the batch was skipped (a non-finite reward).
    pub skipped: bool,
    /// Runs on text games: the fraction of the step's episodes won (`env/win_rate`).
    pub win_rate: Option<f64>,
}

impl StepReport {
    /// `"  kl X"` with `digits` decimals for a progress line, or nothing when the step has no
    /// KL (GRPO and RLOO with `beta = 0`).
    pub fn kl_text(&self, digits: usize) -> String {
        if self.kl.is_nan() {
            String::new()
        } else {
            format!("  kl {:.digits$}", self.kl)
        }
    }

    /// The report of step `step` (0-based, as the loop counts) of `total` from its logged
    /// metrics: the mean reward and the KL under the trainer's keys (NaN when absent), and
    /// `env/win_rate` when the step played games.
    pub(crate) fn of(
        step: usize,
        total: usize,
        stats: &crate::engine::Stats,
        reward: &str,
        kl: &str,
    ) -> Self {
        let get = |k: &str| stats.get(k).and_then(crate::engine::Stat::as_f64);
        Self {
            step,
            total,
            reward_mean: get(reward).unwrap_or(f64::NAN),
            kl: get(kl).unwrap_or(f64::NAN),
            skipped: false,
            win_rate: get("env/win_rate"),
        }
    }
}
