//! `rltune grpo-step` and `rltune rloo-step`: one GRPO / RLOO optimizer step from a file of
//! grouped rollouts produced anywhere, for exact checking against TRL 1.16.0.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use rltune::data::group_rollouts::{read_group_rollouts, GroupRollouts};
use rltune::grpo::{GroupBatch, GrpoConfig, GrpoTrainer, RlooConfig, RlooTrainer};
use rltune::models::load::{load_lm, save_dir_atomic, LoadedLm as Loaded};
use rltune::models::CausalLm;
use rltune::params::ParamStore;
use rltune::ppo::{Stat, Stats};

/// Arguments of `rltune grpo-step` / `rloo-step`.
#[derive(clap::Args)]
pub struct Args {
    /// Policy directory (Hugging Face layout, GPT-2 or Llama family).
    #[arg(long)]
    model: String,
    /// Reference model directory, used when beta > 0 (RLOO's default beta is 0.05); default: a
    /// frozen copy of --model, as TRL does.
    #[arg(long)]
    ref_model: Option<String>,
    /// JSON lines: {"prompt_ids": [..], "completion_ids": [..], "reward": x} (x a number or null),
    /// or "rewards": {"name": x, ..}; optionally "truncated": true. Consecutive lines with the
    /// same prompt form one group of num_generations.
    #[arg(long)]
    rollouts: PathBuf,
    /// TOML file whose [grpo] (or [rloo]) table holds TRL 1.16.0's config fields.
    #[arg(long)]
    config: PathBuf,
    /// Output directory: model.safetensors, config.json, stats.json.
    #[arg(long)]
    output: PathBuf,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// A causal LM, its files and raw config.
fn load(model: &str, trainable: bool, device: &Device) -> Result<Loaded> {
    Ok(load_lm(model, trainable, DType::F32, device)?)
}

/// The policy, the reference (when given) and the rollouts with every truncation flag resolved:
/// an absent `"truncated"` follows TRL's rule (the last token is neither EOS nor padding).
fn inputs(
    args: &Args,
    reward_funcs: Option<&[String]>,
) -> Result<(Loaded, Option<CausalLm>, GroupRollouts, Vec<bool>)> {
    let runtime = args.runtime.resolve(Default::default())?;
    let device = runtime.device();
    let policy =
        load(&args.model, true, device).with_context(|| format!("cannot load policy {:?}", args.model))?;
    let reference = match &args.ref_model {
        Some(r) => Some(load(r, false, device).with_context(|| format!("cannot load reference {r:?}"))?.lm),
        None => None,
    };
    let rollouts = read_group_rollouts(&args.rollouts, reward_funcs)?;
    let eos = policy.config.eos_token_ids();
    let pad = policy.config.pad_token_id().or(eos.first().copied());
    let truncated = rollouts
        .truncated
        .iter()
        .zip(&rollouts.completions)
        .map(|(t, c)| t.unwrap_or_else(|| c.last().is_some_and(|x| !eos.contains(x) && Some(*x) != pad)))
        .collect();
    Ok((policy, reference, rollouts, truncated))
}

fn one_iteration(table: &str, num_iterations: usize, config: &Path) -> Result<()> {
    if num_iterations != 1 {
        bail!(
            "{}: [{table}] num_iterations is {num_iterations}; {table}-step makes exactly one optimizer step: \
             set num_iterations = 1 (the library's trainer runs several)",
            config.display()
        );
    }
    Ok(())
}

/// Writes the output directory and prints a summary line.
fn finish(
    cmd: &str,
    args: &Args,
    policy: &Loaded,
    store: &ParamStore,
    mut logs: Vec<Stats>,
    n: usize,
) -> Result<()> {
    let stats = logs.pop().context("the trainer returned no metrics")?;
    save_dir_atomic(&args.output, |tmp| {
        store.save_safetensors(&tmp.join("model.safetensors"))?;
        let write = |name: &str, v: &serde_json::Value| -> rltune::models::Result<()> {
            let text =
                serde_json::to_string_pretty(v).map_err(|e| rltune::models::Error::Input(e.to_string()))?;
            rltune::io::write_bytes_atomic(&tmp.join(name), text.as_bytes())
        };
        write("config.json", &policy.config_json)?;
        write(
            "stats.json",
            &serde_json::to_value(&stats).map_err(|e| rltune::models::Error::Input(e.to_string()))?,
        )?;
        rltune::models::load::copy_side_files(&policy.files, tmp)
    })
    .with_context(|| format!("cannot write {}", args.output.display()))?;
    let get = |k: &str| stats.get(k).and_then(Stat::as_f64).unwrap_or(f64::NAN);
    println!(
        "{cmd}: {n} completions, reward {:.4}, loss {:.6}, grad_norm {:.4}, entropy {:.4} -> {}",
        get("reward"),
        get("loss"),
        get("grad_norm"),
        get("entropy"),
        args.output.display()
    );
    Ok(())
}

/// Runs `rltune grpo-step`.
pub fn run_grpo(args: Args) -> Result<()> {
    let config = GrpoConfig::from_toml_file(&args.config)?;
    one_iteration("grpo", config.num_iterations, &args.config)?;
    let (policy, reference, r, truncated) = inputs(&args, config.reward_funcs.as_deref())?;
    let batch = GroupBatch {
        prompts: &r.prompts,
        completions: &r.completions,
        rewards: &r.rewards,
        truncated: Some(&truncated),
        allowed: None,
    };
    let mut trainer = GrpoTrainer::new(config, policy.store.clone(), policy.lm.clone(), reference)
        .with_context(|| format!("cannot set up GRPO from {}", args.config.display()))?;
    let logs = trainer.step_with(&batch).with_context(|| format!("{}", args.rollouts.display()))?;
    finish("grpo-step", &args, &policy, trainer.store(), logs, r.prompts.len())
}

/// Runs `rltune rloo-step`.
pub fn run_rloo(args: Args) -> Result<()> {
    let config = RlooConfig::from_toml_file(&args.config)?;
    one_iteration("rloo", config.num_iterations, &args.config)?;
    let (policy, reference, r, truncated) = inputs(&args, config.reward_funcs.as_deref())?;
    let batch = GroupBatch {
        prompts: &r.prompts,
        completions: &r.completions,
        rewards: &r.rewards,
        truncated: Some(&truncated),
        allowed: None,
    };
    let mut trainer = RlooTrainer::new(config, policy.store.clone(), policy.lm.clone(), reference)
        .with_context(|| format!("cannot set up RLOO from {}", args.config.display()))?;
    let logs = trainer.step_with(&batch).with_context(|| format!("{}", args.rollouts.display()))?;
    finish("rloo-step", &args, &policy, trainer.store(), logs, r.prompts.len())
}
