//! `rltune play`: episodes of a text environment played by a model or by the random baseline,
//! with win rate, scores, episode length and invalid actions.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use rltune::agent::config::{agent_generation, EnvConfig};
use rltune::agent::model_agent::play_model;
use rltune::envs::play::{play, Episode, PlayReport, RandomAgent};
use rltune::models::load::{load_policy_adapted, LoraSpec};
use rltune::tokenizer::Tokenizer;

/// Arguments of `rltune play`.
#[derive(clap::Args)]
pub struct Args {
    /// Env config: an [env] table (kind, games, max_steps, …), optionally [agent] (the prompt)
    /// and [generation] (how a model samples its actions).
    #[arg(long)]
    env: PathBuf,
    /// A policy directory (Hugging Face layout with tokenizer.json) to play.
    #[arg(long, conflicts_with = "agent", required_unless_present = "agent")]
    model: Option<String>,
    /// A built-in agent instead of a model: `random` (a uniformly random admissible command).
    #[arg(long, value_parser = ["random"])]
    agent: Option<String>,
    /// Episodes to play.
    #[arg(long, default_value_t = 50)]
    episodes: usize,
    /// First seed: generated families play seeds S, S+1, … of their split; also the agent's
    /// sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write every episode (turns, actions, rewards) as JSON lines here.
    #[arg(long)]
    transcripts: Option<PathBuf>,
    /// Print the first N episodes turn by turn: each observation, the admissible commands, the
    /// command played with its logprob (a model's), the reward.
    #[arg(long, value_name = "N", default_value_t = 0)]
    show: usize,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// Override a setting of the env config, e.g. --set env.max_steps=30 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// A LoRA adapter directory (PEFT's format, or an rltune run with [lora]) applied to --model.
    #[arg(long, requires = "model")]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// Runs `rltune play`.
pub fn run(args: Args) -> Result<()> {
    if args.episodes == 0 {
        bail!("--episodes must be at least 1");
    }
    let cfg = EnvConfig::load(&args.env, &args.set)?;
    let mut env = cfg
        .env
        .build()
        .with_context(|| format!("cannot start the environments of {}", args.env.display()))?;
    let games = cfg.env.game_count()?;
    let resets = |i: usize| cfg.env.reset_for(args.seed, i, games);
    let started = std::time::Instant::now();
    let (prefill0, tokens0) = rltune::generation::prefill_counters();
    let (episodes, dropped) = match &args.model {
        None => play(env.as_mut(), &mut RandomAgent::new(args.seed), args.episodes, &resets)?,
        Some(model) => {
            let runtime = args.runtime.resolve(Default::default())?;
            let device = runtime.device();
            let adapter = args.adapter.as_ref().map(LoraSpec::from_dir);
            let policy = load_policy_adapted(model, None, adapter.as_ref(), false, runtime.dtype(), device)
                .with_context(|| format!("cannot load the model {model:?}"))?;
            let tok_path = policy.files.tokenizer.clone().with_context(|| {
                format!("{model}: no tokenizer.json; a model agent needs one to read the game")
            })?;
            let tokenizer = Tokenizer::from_file(&tok_path)?;
            let generation = agent_generation(&cfg, args.seed);
            let lm = &policy.model.lm;
            play_model(env.as_mut(), lm, &tokenizer, &cfg.agent, &generation, args.episodes, &resets, device)?
        }
    };
    let report = PlayReport::of(&episodes, dropped, started.elapsed().as_secs_f64());
    let (prefill1, tokens1) = rltune::generation::prefill_counters();
    let (prefill, prefill_tokens) = (prefill1 - prefill0, tokens1 - tokens0);
    if args.model.is_some() {
        let turns: usize = episodes.iter().map(|e| e.steps).sum();
        eprintln!(
            "prefill: {:.2} s of {:.2} s ({:.0}%), {prefill_tokens} tokens ({:.1} per turn)",
            prefill.as_secs_f64(),
            started.elapsed().as_secs_f64(),
            100.0 * prefill.as_secs_f64() / started.elapsed().as_secs_f64().max(1e-9),
            prefill_tokens as f64 / turns.max(1) as f64
        );
    }
    if let Some(path) = &args.transcripts {
        let mut text = String::new();
        for e in &episodes {
            text.push_str(&serde_json::to_string(e)?);
            text.push('\n');
        }
        rltune::io::write_bytes_atomic(path, text.as_bytes())?;
    }
    for e in episodes.iter().take(args.show) {
        print!("{}", show_episode(e));
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let who = args.model.as_deref().map_or("random agent".to_string(), |m| format!("model {m}"));
        println!(
            "{who}: {} episodes, win rate {:.1}%, mean score {:.2} (normalized {:.3}), mean steps {:.1}, \
             invalid actions {:.1}%, {:.1} episodes/s{}",
            report.episodes,
            100.0 * report.win_rate,
            report.mean_score,
            report.mean_normalized_score,
            report.mean_steps,
            100.0 * report.invalid_action_rate,
            report.episodes_per_second,
            if dropped > 0 {
                format!(", {dropped} dropped (the environment program restarted)")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// One episode, turn by turn, for the terminal.
fn show_episode(e: &Episode) -> String {
    let mut out = format!("=== episode {} (seed {:?}): {}\n", e.episode, e.seed, e.objective.trim());
    for (k, t) in e.turns.iter().enumerate() {
        let obs = t.observation.trim().replace('\n', "\n    ");
        out.push_str(&format!("[{}] {obs}\n", k + 1));
        if !t.admissible.is_empty() {
            out.push_str(&format!("    admissible ({}): {}\n", t.admissible.len(), t.admissible.join(" | ")));
        }
        let lp = t.logprob.map_or(String::new(), |l| format!("  logprob {l:.3} (p {:.3})", l.exp()));
        let invalid = if t.invalid { "  INVALID" } else { "" };
        out.push_str(&format!("  > {}{lp}  reward {}{invalid}\n", t.action, t.reward));
    }
    let end = if e.won {
        "won"
    } else if e.lost {
        "lost"
    } else if e.truncated {
        "out of moves"
    } else {
        "ended"
    };
    out.push_str(&format!("=== {end} in {} moves, score {}/{}\n\n", e.steps, e.score, e.max_score));
    out
}
