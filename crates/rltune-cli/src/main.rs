//! The `rltune` command: generation, PPO and the RLHF pipeline from the command line.
//!
//! Errors are printed with their whole chain (`error: … caused by: …`) and exit code 1; nothing
//! a user types can make it panic.

// The doc comments of the command-line arguments are also their `--help` text, where
// `[runtime]` and `[lora]` name TOML tables, not items to link.
#![allow(rustdoc::broken_intra_doc_links)]

mod bench;
mod convert;
mod dpo;
mod export;
mod generate;
mod grpo_step;
mod launch;
mod merge;
mod play;
mod ppo;
mod ppo_step;
mod quickstart;
mod runtime;
mod selftest;
mod serve;
mod train;

use clap::{Parser, Subcommand};

/// Large buffers (weights, optimizer state, packed copies) in transparent huge pages.
#[global_allocator]
static ALLOC: rltune::cpu::HugePages = rltune::cpu::HugePages;

/// Reinforcement-learning fine-tuning of transformer language models (PPO, RLHF).
#[derive(Parser)]
#[command(name = "rltune", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The whole RLHF pipeline offline on a synthetic review task: corpus, BPE tokenizer, SFT,
    /// sentiment classifier, PPO toward positive reviews, report.
    Quickstart(quickstart::Args),
    /// Sample continuations of a prompt, with each token's logprob.
    Generate(generate::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (completions, chat, models), batching
    /// concurrent requests; token ids and logprobs in every answer.
    Serve(serve::Args),
    /// Train with PPO: rollout, reward, update, in a loop (see configs/).
    Ppo(ppo::Args),
    /// One PPO update from a rollouts file (query, response, score per line).
    PpoStep(ppo_step::Args),
    /// One GRPO update (TRL 1.16.0) from grouped rollouts (prompt, completion, reward per line).
    GrpoStep(grpo_step::Args),
    /// One RLOO update (TRL 1.16.0) from grouped rollouts (prompt, completion, reward per line).
    RlooStep(grpo_step::Args),
    /// DPO (TRL 1.16.0's DPOTrainer) on preference pairs: JSONL with "prompt", "chosen" and
    /// "rejected" (or their tokenized "_ids" forms).
    Dpo(dpo::Args),
    /// Supervised fine-tuning (behavioural cloning) of a causal LM: JSONL with "text", or
    /// "prompt" and "completion"; produces the reference policy for `ppo`.
    Sft(train::SftArgs),
    /// Train a sequence-classification reward model: JSONL with "text" and "label"
    /// (cross-entropy), or "chosen" and "rejected" [and "prompt"] (Bradley–Terry).
    Reward(train::RewardArgs),
    /// Play episodes of a text environment (TextWorld, generated adventures, the letter toy,
    /// any program speaking docs/env-protocol.md) with a model or a random agent.
    Play(play::Args),
    /// Check that this build computes what the references compute, on the device it is given:
    /// models, the sampler, PPO, GRPO, RLOO and DPO against their golden fixtures.
    Selftest(selftest::Args),
    /// Convert a GGUF file (llama, qwen2) to a Hugging Face directory that transformers loads.
    Convert(convert::Args),
    /// Merge a LoRA adapter into its base model and write a Hugging Face directory.
    Merge(merge::Args),
    /// Write a model (llama, qwen2), optionally with a LoRA adapter merged, as a GGUF file
    /// for llama.cpp: f32, f16 or q8_0.
    Export(export::Args),
    /// Benchmarks (see bench/README.md).
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// One PPO iteration (generation + step) on a random GPT-2, as bench/trl_ppo.py runs TRL.
    Ppo(bench::Args),
    /// One GRPO step on fixed random completions, as bench/trl_grpo.py runs TRL 1.16.0.
    Grpo(bench::GrpoArgs),
    /// Batched sampling throughput of a model (tokens/s), as bench/llamacpp_generate.py runs
    /// llama.cpp.
    Generate(bench::GenerateArgs),
}

fn main() {
    // The process-wide settings, first (see rltune::cpu): the library's constructors make none.
    let settings = rltune::cpu::ProcessSettings {
        spin_wait: std::env::var_os("RLTUNE_SPIN_WAIT").is_none_or(|v| v != "0"),
        ..Default::default()
    };
    let installed = settings.install();
    // What the library would otherwise read from the environment: the hub's options
    // (HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT, RLTUNE_CACHE) and the user's name.
    rltune::runtime::install_host(
        rltune::runtime::Host::from_vars(|k| std::env::var(k).ok()).with_secrets(|k| std::env::var(k).ok()),
    );
    init_tracing();
    let cli = Cli::parse();
    let result = match installed {
        Err(e) => Err(anyhow::Error::new(e).context("cannot set up the process")),
        Ok(()) => {
            let name = cli.command.name();
            let data_parallel = matches!(
                cli.command,
                Command::Ppo(_) | Command::Dpo(_) | Command::Sft(_) | Command::Reward(_)
            );
            match launch::init(name, data_parallel) {
                // The engine is finalized when `dist` (and every clone of it) drops.
                Ok(dist) => run(cli.command, &dist),
                Err(e) => Err(e),
            }
        }
    };
    if let Err(err) = result {
        eprintln!("error: {err}");
        for cause in err.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        std::process::exit(1);
    }
}

impl Command {
    /// The subcommand's name, as typed.
    fn name(&self) -> &'static str {
        match self {
            Command::Quickstart(_) => "quickstart",
            Command::Generate(_) => "generate",
            Command::Serve(_) => "serve",
            Command::Ppo(_) => "ppo",
            Command::PpoStep(_) => "ppo-step",
            Command::GrpoStep(_) => "grpo-step",
            Command::RlooStep(_) => "rloo-step",
            Command::Dpo(_) => "dpo",
            Command::Sft(_) => "sft",
            Command::Reward(_) => "reward",
            Command::Play(_) => "play",
            Command::Selftest(_) => "selftest",
            Command::Convert(_) => "convert",
            Command::Merge(_) => "merge",
            Command::Export(_) => "export",
            Command::Bench(_) => "bench",
        }
    }
}

/// Runs one command; the data-parallel trainers on `dist`'s processes.
fn run(command: Command, dist: &rltune::dist::Dist) -> anyhow::Result<()> {
    match command {
        Command::Quickstart(args) => quickstart::run(args),
        Command::Sft(args) => train::run_sft(args, dist),
        Command::Dpo(args) => dpo::run(args, dist),
        Command::Reward(args) => train::run_reward(args, dist),
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Play(args) => play::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Merge(args) => merge::run(args),
        Command::Export(args) => export::run(args),
        Command::Ppo(args) => ppo::run(args, dist),
        Command::PpoStep(args) => ppo_step::run(args),
        Command::GrpoStep(args) => grpo_step::run_grpo(args),
        Command::RlooStep(args) => grpo_step::run_rloo(args),
        Command::Selftest(args) => selftest::run(args),
        Command::Bench(BenchCommand::Ppo(args)) => bench::run(args),
        Command::Bench(BenchCommand::Grpo(args)) => bench::run_grpo(args),
        Command::Bench(BenchCommand::Generate(args)) => bench::run_generate(args),
    }
}

/// Logs to stderr; `RUST_LOG` overrides the default `info` level. Colours only on a terminal,
/// and never with `NO_COLOR` set (<https://no-color.org>).
fn init_tracing() {
    // The other ranks of a data-parallel run say only what goes wrong: rank 0 reports.
    let default = if launch::is_secondary_rank() { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let colour =
        use_colour(std::io::IsTerminal::is_terminal(&std::io::stderr()), std::env::var_os("NO_COLOR"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(colour)
        .init();
}

/// Whether to colour the logs: stderr is a terminal and `NO_COLOR` is unset or empty.
fn use_colour(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::use_colour;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some("".into())));
        assert!(!use_colour(true, Some("1".into())));
        assert!(!use_colour(false, None));
    }
}
