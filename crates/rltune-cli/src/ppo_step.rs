//! `rltune ppo-step`: one PPO update from a file of rollouts produced anywhere.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use rltune::data::rollouts::read_rollouts;
use rltune::models::load::{load_policy, load_reference, save_dir_atomic};
use rltune::models::CausalLm;
use rltune::ppo::{PpoConfig, PpoTrainer};
use rltune::runtime::RuntimeSection;
use rltune::tokenizer::Tokenizer;

/// Arguments of `rltune ppo-step`.
#[derive(clap::Args)]
pub struct Args {
    /// Policy directory (Hugging Face layout, GPT-2 or Llama family); its value head
    /// (`v_head.summary.*`) is initialized when absent.
    #[arg(long)]
    model: String,
    /// Reference model directory; default: a frozen copy of --model.
    #[arg(long)]
    ref_model: Option<String>,
    /// JSON lines: {"query_ids": [..], "response_ids": [..], "score": x} or
    /// {"query": "..", "response": "..", "score": x}.
    #[arg(long)]
    rollouts: PathBuf,
    /// TOML file whose [ppo] table holds PpoConfig fields (TRL's PPOConfig names), and an
    /// optional [runtime] table (device, dtype).
    #[arg(long)]
    config: PathBuf,
    /// Output directory: model.safetensors, config.json, stats.json (and tokenizer.json).
    #[arg(long)]
    output: PathBuf,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// Runs `rltune ppo-step`.
pub fn run(args: Args) -> Result<()> {
    let config = PpoConfig::from_toml_file(&args.config)?;
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read {}", args.config.display()))?;
    let runtime = args.runtime.resolve(RuntimeSection::from_toml_table(&text, &args.config)?)?;
    let (device, dtype) = (runtime.device(), runtime.dtype());
    let policy = load_policy(&args.model, true, dtype, device)
        .with_context(|| format!("cannot load policy {:?}", args.model))?;
    let reference = match &args.ref_model {
        Some(r) => {
            load_reference(r, dtype, device).with_context(|| format!("cannot load reference {r:?}"))?.1
        }
        None => CausalLm::load(&policy.store.frozen_copy()?.root(), &policy.config)?,
    };
    let tokenizer = policy.files.tokenizer.as_deref().map(Tokenizer::from_file).transpose()?;
    let vocab = policy.config.vocab_size();
    let rollouts = read_rollouts(&args.rollouts, tokenizer.as_ref(), vocab)?;
    if rollouts.len() != config.batch_size {
        bail!(
            "{}: has {} rollouts but [ppo] batch_size in {} is {}; they must match",
            args.rollouts.display(),
            rollouts.len(),
            args.config.display(),
            config.batch_size
        );
    }
    let queries: Vec<Vec<u32>> = rollouts.iter().map(|r| r.query_ids.clone()).collect();
    let responses: Vec<Vec<u32>> = rollouts.iter().map(|r| r.response_ids.clone()).collect();
    let scores: Vec<f32> = rollouts.iter().map(|r| r.score).collect();
    let files = policy.files.clone();
    let config_json = policy.config_json.clone();
    let mut trainer = PpoTrainer::new(config, policy.store, policy.model, reference)?;
    let stats = trainer.step(&queries, &responses, &scores)?;
    save_dir_atomic(&args.output, |tmp| {
        trainer.store.save_safetensors(&tmp.join("model.safetensors"))?;
        let write = |name: &str, v: &serde_json::Value| -> rltune::models::Result<()> {
            let text =
                serde_json::to_string_pretty(v).map_err(|e| rltune::models::Error::Input(e.to_string()))?;
            rltune::io::write_bytes_atomic(&tmp.join(name), text.as_bytes())
        };
        write("config.json", &config_json)?;
        write(
            "stats.json",
            &serde_json::to_value(&stats).map_err(|e| rltune::models::Error::Input(e.to_string()))?,
        )?;
        rltune::models::load::copy_side_files(&files, tmp)
    })
    .with_context(|| format!("cannot write {}", args.output.display()))?;
    let get = |k: &str| stats.get(k).and_then(rltune::ppo::Stat::as_f64).unwrap_or(f64::NAN);
    println!(
        "ppo-step: {} rollouts, mean score {:.4}, objective/kl {:.4}, ppo/loss/total {:.4}, {:.2}s -> {}",
        rollouts.len(),
        get("ppo/mean_scores"),
        get("objective/kl"),
        get("ppo/loss/total"),
        get("time/ppo/total"),
        args.output.display()
    );
    Ok(())
}
