//! The one outer loop every trainer runs in: PPO, rejection sampling, GRPO and RLOO
//! ([`crate::run`]), DPO ([`crate::dpo::run`]), SFT and the reward model ([`crate::train`]).
//!
//! Step by step it draws the step's data, runs the algorithm's step, reports it, checkpoints
//! every [`Plan::checkpoint_every`] steps (and after the last one when the plan says so), writes
//! the report every [`Plan::report_every`] steps, and stops cleanly when `stop` is set (Ctrl-C):
//! after the step under way, with a checkpoint. A resumed run first replays the data order of the
//! steps already done, so it sees the data a straight run would have, and continues bit for bit.
//!
//! In a data-parallel run every process runs it on its share of each step's data; rank 0 alone
//! checkpoints and reports, and a process whose settings differ from rank 0's is refused before
//! the first step.
//!
//! An [`Algorithm`] says what its data order is, what one step does and how a checkpoint is
//! written; the loop owns the order in which these happen.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Result;
use crate::logging::RunEnd;

/// The shape of a run, as the loop needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Steps the run makes in all.
    pub total_steps: usize,
    /// The first step this process makes: 0, or the checkpoint's step with `--resume`.
    pub start_step: usize,
    /// Checkpoint every this many steps (0: only when stopped, or at the end).
    pub checkpoint_every: usize,
    /// Also checkpoint after the last step (the RL runs do; the supervised runs save their model
    /// instead).
    pub checkpoint_at_end: bool,
    /// Write the report every this many steps (and after the last one, or when stopped).
    pub report_every: usize,
}

/// One algorithm inside the run loop.
pub trait Algorithm {
    /// The state the run's data is drawn from (a seeded permutation and its RNG).
    type DataOrder;
    /// The data of one step (e.g. prompt indices, or an optimizer step's examples).
    type Batch;
    /// What a step reports to the caller (its progress bar).
    type Report;

    /// The run's shape.
    fn plan(&self) -> Plan;
    /// The processes the run trains with: each checks that the others share its settings, and
    /// rank 0 alone writes checkpoints.
    fn dist(&self) -> crate::dist::Dist;
    /// The resolved settings, which every process of a data-parallel run must share.
    fn settings(&self) -> Result<String>;
    /// The data order at the start of the run.
    fn data_order(&self) -> Result<Self::DataOrder>;
    /// Draws the next step's data from `order`.
    fn draw(&self, order: &mut Self::DataOrder) -> Result<Self::Batch>;
    /// Runs step `step` (from 0) on `batch`.
    fn step(&mut self, step: usize, batch: &Self::Batch) -> Result<Self::Report>;
    /// Writes the checkpoint of the run after `step` steps (called on rank 0 only).
    fn checkpoint(&self, step: usize) -> Result<()>;
    /// Rewrites the run's report (every [`Plan::report_every`] steps).
    fn write_report(&mut self) -> Result<()> {
        Ok(())
    }
    /// Ends the run's experiment trackers: finished, killed (stopped before the last step) or
    /// failed (an error).
    fn finish(&mut self, _end: RunEnd) -> Result<()> {
        Ok(())
    }
}

/// Runs the remaining steps of `alg`, calling `progress` after each. `stop` (set by Ctrl-C) ends
/// the run after the current step with a checkpoint. Returns the number of steps done in total.
pub fn run<A: Algorithm>(
    alg: &mut A,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(&A::Report) -> Result<()>,
) -> Result<usize> {
    let result = run_steps(alg, stop, progress);
    let end = match &result {
        Ok(done) if *done < alg.plan().total_steps => RunEnd::Killed,
        Ok(_) => RunEnd::Finished,
        Err(_) => RunEnd::Failed,
    };
    let ended = alg.finish(end);
    let done = result?;
    ended?;
    Ok(done)
}

fn run_steps<A: Algorithm>(
    alg: &mut A,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(&A::Report) -> Result<()>,
) -> Result<usize> {
    let plan = alg.plan();
    // A data-parallel run: every process must run the same settings as rank 0.
    let dist = alg.dist();
    dist.check_same(
        crate::dist::fingerprint(alg.settings()?.as_bytes()),
        "the resolved configuration (its --config file and --set overrides): start every process \
         with the same ones",
    )?;
    let mut order = alg.data_order()?;
    // Replay the data order of the steps already done, so a resumed run sees the same data.
    for _ in 0..plan.start_step {
        alg.draw(&mut order)?;
    }
    let total = plan.total_steps;
    let mut step = plan.start_step;
    while step < total {
        let batch = alg.draw(&mut order)?;
        let report = alg.step(step, &batch)?;
        step += 1;
        progress(&report)?;
        let stopping = stop.load(Ordering::SeqCst);
        let scheduled = plan.checkpoint_every > 0 && step.is_multiple_of(plan.checkpoint_every);
        // Every process holds the same weights: rank 0 alone writes them.
        if dist.is_main() && (stopping || scheduled || (step == total && plan.checkpoint_at_end)) {
            alg.checkpoint(step)?;
        }
        if stopping || step == total || step.is_multiple_of(plan.report_every.max(1)) {
            alg.write_report()?;
        }
        if stopping {
            if step < total {
                tracing::info!("stopped after step {step}; checkpoint written");
            }
            break;
        }
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts its steps over a data order of 0, 1, 2, … and records what the loop asked of it.
    struct Counter {
        plan: Plan,
        seen: Vec<usize>,
        checkpoints: std::cell::RefCell<Vec<usize>>,
        reports: usize,
        end: Option<RunEnd>,
        fail_at: Option<usize>,
    }

    impl Counter {
        fn new(total_steps: usize, start_step: usize, checkpoint_every: usize, at_end: bool) -> Self {
            let plan = Plan {
                total_steps,
                start_step,
                checkpoint_every,
                checkpoint_at_end: at_end,
                report_every: 2,
            };
            Self { plan, seen: vec![], checkpoints: Default::default(), reports: 0, end: None, fail_at: None }
        }
    }

    impl Algorithm for Counter {
        type DataOrder = usize;
        type Batch = usize;
        type Report = usize;

        fn plan(&self) -> Plan {
            self.plan
        }
        fn dist(&self) -> crate::dist::Dist {
            crate::dist::Dist::default()
        }

        fn settings(&self) -> Result<String> {
            Ok("counter".into())
        }
        fn data_order(&self) -> Result<usize> {
            Ok(0)
        }
        fn draw(&self, order: &mut usize) -> Result<usize> {
            *order += 1;
            Ok(*order - 1)
        }
        fn step(&mut self, step: usize, batch: &usize) -> Result<usize> {
            if self.fail_at == Some(step) {
                return Err(crate::Error::batch("failed"));
            }
            self.seen.push(*batch);
            Ok(step + 1)
        }
        fn checkpoint(&self, step: usize) -> Result<()> {
            self.checkpoints.borrow_mut().push(step);
            Ok(())
        }
        fn write_report(&mut self) -> Result<()> {
            self.reports += 1;
            Ok(())
        }
        fn finish(&mut self, end: RunEnd) -> Result<()> {
            self.end = Some(end);
            Ok(())
        }
    }

    #[test]
    fn a_resumed_run_replays_the_data_order_and_checkpoints_on_schedule() {
        let stop = AtomicBool::new(false);
        let mut straight = Counter::new(5, 0, 2, true);
        let mut steps = vec![];
        let done = run(&mut straight, &stop, &mut |s| {
            steps.push(*s);
            Ok(())
        });
        assert_eq!(done.unwrap(), 5);
        assert_eq!((straight.seen.clone(), steps), (vec![0, 1, 2, 3, 4], vec![1, 2, 3, 4, 5]));
        assert_eq!(*straight.checkpoints.borrow(), vec![2, 4, 5]);
        assert_eq!((straight.reports, straight.end), (3, Some(RunEnd::Finished)));
        // From step 3 of 5 it draws what the straight run drew for steps 4 and 5.
        let mut resumed = Counter::new(5, 3, 0, false);
        run(&mut resumed, &stop, &mut |_| Ok(())).unwrap();
        assert_eq!(resumed.seen, vec![3, 4]);
        assert!(resumed.checkpoints.borrow().is_empty());
    }

    #[test]
    fn a_stop_checkpoints_after_the_step_under_way_and_an_error_fails_the_run() {
        let stop = AtomicBool::new(false);
        let mut alg = Counter::new(10, 0, 0, false);
        let done = run(&mut alg, &stop, &mut |s| {
            if *s == 3 {
                stop.store(true, Ordering::SeqCst);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!((done, alg.checkpoints.borrow().clone(), alg.end), (3, vec![3], Some(RunEnd::Killed)));
        let mut failing = Counter { fail_at: Some(1), ..Counter::new(4, 0, 1, true) };
        assert!(run(&mut failing, &AtomicBool::new(false), &mut |_| Ok(())).is_err());
        assert_eq!((failing.checkpoints.borrow().clone(), failing.end), (vec![1], Some(RunEnd::Failed)));
    }
}
