//! `rltune ppo --config FILE.toml`: the training loop (PPO, rejection sampling, GRPO or RLOO, by
//! `[algorithm] kind`) with progress and Ctrl-C handling.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use rltune::dist::Dist;
use rltune::run::{GroupRun, PpoRun, RunConfig, StepReport};

/// Arguments of `rltune ppo`.
#[derive(clap::Args)]
pub struct Args {
    /// Run config (TOML with [model], [ref_model], [reward], [data], [generation], [ppo],
    /// [logging], [checkpoint], [runtime]; or [env], [agent], [episodes] instead of [data] and
    /// [reward] to play text games); see configs/.
    #[arg(long)]
    config: PathBuf,
    /// Override a config value, e.g. --set ppo.learning_rate=1e-5 (repeatable).
    #[arg(long = "set", value_name = "TABLE.KEY=VALUE")]
    set: Vec<String>,
    /// Continue from the latest checkpoint in the run directory (needs optimizer state).
    #[arg(long)]
    resume: bool,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// Sets a flag on Ctrl-C (the loop finishes its step, checkpoints and exits); a second Ctrl-C
/// exits at once.
pub fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    ctrlc::set_handler(move || {
        if s.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted twice: exiting without a checkpoint");
            std::process::exit(130);
        }
        eprintln!("\nCtrl-C: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)");
    })
    .context("cannot install the Ctrl-C handler")?;
    Ok(stop)
}

/// A progress bar on a terminal, plain lines otherwise; nothing on the other ranks of a
/// data-parallel run.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    main: bool,
}

impl Progress {
    /// A progress display for `total` steps, shown when `main` (one bar per run: rank 0's).
    pub fn new(total: usize, done: usize, what: &str, main: bool) -> Self {
        use std::io::IsTerminal;
        let bar = (std::io::stderr().is_terminal() && main).then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            let style = indicatif::ProgressStyle::with_template(&format!(
                "{what} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}} < {{eta_precise}}] {{msg}}"
            ))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(done as u64);
            bar
        });
        Self { bar, main }
    }

    /// Shows one step's report.
    pub fn step(&self, r: &StepReport) {
        let msg = if r.skipped {
            "batch skipped (non-finite reward)".to_string()
        } else {
            let wins = r.win_rate.map(|w| format!("  wins {:.0}%", 100.0 * w)).unwrap_or_default();
            format!("reward {:.3}{}{wins}", r.reward_mean, r.kl_text(3))
        };
        match &self.bar {
            Some(bar) => {
                bar.set_position(r.step as u64);
                bar.set_message(msg);
            }
            None if self.main => eprintln!("step {}/{}: {msg}", r.step, r.total),
            None => {}
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// Runs `rltune ppo`.
pub fn run(args: Args, dist: &Dist) -> Result<()> {
    let mut config = RunConfig::load(&args.config, &args.set)?;
    config.runtime = args.runtime.apply(config.runtime);
    let runtime = args.runtime.resolve_with(config.runtime.clone(), dist)?;
    let main = dist.is_main();
    let dir = config.logging.dir.clone();
    let stop = stop_flag()?;
    let (done, total) = if config.algorithm.kind.is_group() {
        // GRPO / RLOO: the same command, config and run directory layout.
        let what = config.algorithm.kind.name();
        let mut run = GroupRun::prepare_on(config, &runtime, Vec::new(), args.resume)?;
        let progress = Progress::new(run.shape().steps, run.start_step(), what, main);
        let done = run.run(&stop, &mut |r| progress.step(r))?;
        progress.finish();
        (done, run.shape().steps)
    } else {
        let steps = config.ppo.steps;
        let mut run = PpoRun::prepare_on(config, &runtime, Vec::new(), args.resume)?;
        // A resumed run's bar starts at its checkpoint's step.
        let progress = Progress::new(steps, run.start_step(), "ppo", main);
        let done = run.run(&stop, &mut |r| progress.step(r))?;
        progress.finish();
        (done, steps)
    };
    if main {
        eprintln!("{done} steps; metrics: {0}/metrics.jsonl, report: {0}/report.html", dir.display());
    }
    if done < total {
        // Stopped by Ctrl-C after a checkpoint: the shell's status for an interrupted command.
        if main {
            eprintln!("stopped before step {total}; the same command with --resume continues it");
        }
        std::process::exit(130);
    }
    Ok(())
}
