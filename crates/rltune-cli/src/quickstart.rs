//! `rltune quickstart`: the offline RLHF pipeline (corpus → BPE → SFT → classifier → PPO →
//! report) on an embedded synthetic task; see `rltune::quickstart`.

use std::path::PathBuf;

use std::path::Path;

use anyhow::{Context, Result};
use rltune::quickstart::{run_quickstart, Event, QuickstartConfig, Summary};
use rltune::run::config::parse_toml;

use crate::train::Bar;

/// Arguments of `rltune quickstart`.
#[derive(clap::Args)]
pub struct Args {
    /// Where every stage writes (cached stages are skipped on a rerun).
    #[arg(long, default_value = "runs/quickstart")]
    output: PathBuf,
    /// Seed of every stage.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// `default` (the README's run, ~10 minutes on 2 cores) or `tiny` (seconds; a smoke test
    /// of every stage, too small to learn anything).
    #[arg(long, default_value = "default", value_parser = ["default", "tiny"])]
    preset: String,
    /// Override a setting of the preset, e.g. --set ppo.learning_rate=3e-5 or
    /// --set sft.max_steps=100 (repeatable; the keys are those of DIR/quickstart.json).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// Runs `rltune quickstart`.
pub fn run(args: Args) -> Result<()> {
    let mut cfg = if args.preset == "tiny" { QuickstartConfig::tiny() } else { QuickstartConfig::default() };
    cfg.seed = args.seed;
    if !args.set.is_empty() {
        let text = toml::to_string(&cfg).context("cannot serialize the quickstart settings")?;
        cfg = parse_toml(&text, Path::new("quickstart settings"), &args.set)?;
    }
    let runtime = args.runtime.resolve(Default::default())?;
    let stop = crate::ppo::stop_flag()?;
    let started = std::time::Instant::now();
    let mut bar: Option<(Bar, usize)> = None;
    let summary = run_quickstart(&args.output, &cfg, &runtime, &stop, &mut |e| match e {
        Event::Start { stage, total } => {
            eprintln!("[{stage}] started");
            bar = total.map(|t| (Bar::new(stage), t));
        }
        Event::Cached { stage, path } => eprintln!("[{stage}] cached: {}", path.display()),
        Event::Progress { done, message, .. } => {
            if let Some((b, total)) = &bar {
                b.show(done, *total, message);
            }
        }
        Event::Done { stage, seconds } => {
            if let Some((b, _)) = bar.take() {
                b.finish();
            }
            eprintln!("[{stage}] done in {seconds:.1} s");
        }
    })?;
    let tiny = args.preset == "tiny";
    print_summary(&summary, &args.output, started.elapsed().as_secs_f64(), tiny);
    let failed = summary.checks().iter().filter(|c| !c.ok).count();
    if failed > 0 && !tiny {
        anyhow::bail!("{failed} acceptance check(s) failed (see FAIL above)");
    }
    Ok(())
}

/// Prints the results and the acceptance checks (with `tiny`, failures are not enforced).
fn print_summary(s: &Summary, out: &std::path::Path, wall: f64, tiny: bool) {
    println!();
    println!(
        "policy: GPT-2, {:.2}M parameters; reward: DistilBERT classifier, {:.2}M parameters",
        s.policy_parameters as f64 / 1e6,
        s.classifier_parameters as f64 / 1e6
    );
    if let (Some(first), Some(last)) = (s.ppo_curve.first(), s.ppo_curve.last()) {
        println!(
            "PPO: reward {:.3} → {:.3}, KL {:.3} → {:.3}, KL coefficient {:.3} → {:.3} (steps {} → {})",
            first.reward_mean,
            last.reward_mean,
            first.kl,
            last.kl,
            first.kl_coef,
            last.kl_coef,
            first.step,
            last.step
        );
    }
    for (name, e) in [("before PPO (SFT policy)", &s.before), ("after PPO", &s.after)] {
        println!(
            "{name}: reward {:.3} ± {:.3}, {:.1}% classified positive",
            e.reward_mean,
            e.reward_std,
            100.0 * e.positive_fraction
        );
        for sample in e.samples.iter().take(2) {
            println!("    {sample}");
        }
    }
    for c in s.checks() {
        let verdict = match (c.ok, tiny) {
            (true, _) => "PASS",
            (false, false) => "FAIL",
            (false, true) => "FAIL (not enforced: the tiny preset is too small to learn)",
        };
        println!("{verdict} {}", c.what);
    }
    println!("wall time {wall:.0} s; report: {}", out.join("ppo").join("report.html").display());
    println!(
        "summary: {}; rerun PPO alone: rltune ppo --config {}",
        out.join("summary.json").display(),
        out.join("ppo.toml").display()
    );
}
