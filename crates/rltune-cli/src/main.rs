//! The `rltune` command: generation, PPO and the RLHF pipeline from the command line.
//!
//! Errors are printed with their whole chain (`error: … caused by: …`) and exit code 1; nothing
//! a user types can make it panic.

mod generate;

use clap::{Parser, Subcommand};

/// Reinforcement-learning fine-tuning of transformer language models (PPO, RLHF).
#[derive(Parser)]
#[command(name = "rltune", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sample continuations of a prompt, with each token's logprob.
    Generate(generate::Args),
}

fn main() {
    init_tracing();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {err}");
        for cause in err.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        std::process::exit(1);
    }
}

/// Logs to stderr; `RUST_LOG` overrides the default `info` level.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
}
