//! `rltune dpo`: DPO (TRL 1.16.0's `DPOTrainer`) on a file of preference pairs, saving a Hugging
//! Face directory with the trained policy, its tokenizer and `metrics.jsonl` (one line per
//! optimizer step, TRL's metric names).
//!
//! Settings come from an optional TOML file with a `[dpo]` table (TRL's `DPOConfig` fields) and
//! `[runtime]`, plus `--set dpo.key=value` overrides; see configs/dpo.toml.
//!
//! Checkpoints go to `--checkpoint-dir` (default `OUTPUT.checkpoints`) every `dpo.save_steps`
//! steps and on Ctrl-C (the command then exits with status 130); `--resume` continues from the
//! latest one bit for bit, `metrics.jsonl` included.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rltune::config_file::parse_toml;
use rltune::data::rows::DataOptions;
use rltune::dpo::data::{prepare_pairs_with, read_preference_data, PreferencePair};
use rltune::dpo::run::{pairs_per_process, train_with};
use rltune::dpo::{DpoConfig, DpoTrainer};
use rltune::models::chat_template::ChatTemplate;
use rltune::models::load::{copy_side_files, load_lm_adapted, save_dir_atomic, LoadedLm, LoraSpec};
use rltune::models::lora::LoraConfig;
use rltune::models::CausalLm;
use rltune::params::ParamStore;
use rltune::ppo::Stat;
use rltune::runtime::{Runtime, RuntimeSection};
use rltune::tokenizer::Tokenizer;
use rltune::train::Checkpointing;
use serde::Deserialize;

use crate::train::Bar;

/// Arguments of `rltune dpo`.
#[derive(clap::Args)]
pub struct Args {
    /// Starting policy: a local Hugging Face directory or a hub id (GPT-2 or Llama family).
    #[arg(long)]
    model: String,
    /// Frozen reference model (default: a frozen copy of --model, as TRL).
    #[arg(long)]
    ref_model: Option<String>,
    /// A LoRA adapter directory (PEFT's format) to start from: trains it, the base frozen.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Preference rows {"prompt": "..", "chosen": "..", "rejected": ".."} (needs the model's
    /// tokenizer.json; message lists use its chat template; without "prompt" it is the shared
    /// start of chosen and rejected), or tokenized {"prompt_ids": [..], "chosen_ids": [..],
    /// "rejected_ids": [..]}; optionally "ref_chosen_logps" and "ref_rejected_logps". JSON lines,
    /// JSON, CSV, Parquet, a `datasets` save_to_disk directory or a hub dataset; see [data].
    #[arg(long)]
    data: PathBuf,
    /// Output directory: model.safetensors, config.json, tokenizer.json, metrics.jsonl.
    #[arg(long)]
    output: PathBuf,
    /// TOML file with [dpo] (TRL's DPOConfig fields) and [runtime].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a setting, e.g. --set dpo.beta=0.05 (repeatable).
    #[arg(long = "set", value_name = "TABLE.KEY=VALUE")]
    set: Vec<String>,
    /// Where checkpoints go (`step-N/`, every `dpo.save_steps` steps and on Ctrl-C); default:
    /// the output's path with `.checkpoints` appended.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Continue from the latest checkpoint in the checkpoint folder, bit for bit.
    #[arg(long)]
    resume: bool,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct DpoFile {
    dpo: DpoConfig,
    /// `split` and `columns` of the data.
    data: DataOptions,
    runtime: RuntimeSection,
    /// LoRA adapters on the policy (PEFT's `LoraConfig` names); the reference is then the base
    /// with the adapters off.
    lora: Option<LoraConfig>,
    /// `trainable_layers`: partial freezing of the policy.
    model: crate::train::FreezeSection,
}

/// The policy's files, raw config, parameters and model, and its tokenizer when it has one.
struct Policy {
    files: rltune::models::load::ModelFiles,
    config_json: serde_json::Value,
    store: ParamStore,
    lm: CausalLm,
    tokenizer: Option<Tokenizer>,
}

fn load(model: &str, trainable: bool, lora: Option<&LoraSpec>, rt: &Runtime) -> Result<Policy> {
    let LoadedLm { files, config_json, config, store, lm } =
        load_lm_adapted(model, lora, trainable, rt.dtype(), rt.device())?;
    let tokenizer = match &files.tokenizer {
        Some(p) => {
            let t = Tokenizer::from_file(p)?;
            t.check_fits(config.vocab_size())?;
            Some(t)
        }
        None => None,
    };
    Ok(Policy { files, config_json, store, lm, tokenizer })
}

/// Names up to five rows of `origins` after `what`.
fn warn_rows(origins: &[String], what: &str) {
    if origins.is_empty() {
        return;
    }
    let shown: Vec<&str> = origins.iter().take(5).map(String::as_str).collect();
    let more = if origins.len() > 5 { format!(" and {} more", origins.len() - 5) } else { String::new() };
    tracing::warn!("{} pair(s) {what}: {}{more}", origins.len(), shown.join(", "));
}

/// Runs `rltune dpo`.
pub fn run(args: Args, dist: &rltune::dist::Dist) -> Result<()> {
    let (text, source) = match &args.config {
        Some(p) => {
            (std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?, p.clone())
        }
        None => (String::new(), PathBuf::from("--set")),
    };
    let file: DpoFile = parse_toml(&text, &source, &args.set)?;
    let cfg = file.dpo;
    cfg.validate().map_err(|m| anyhow::anyhow!("{}: {m}", source.display()))?;
    let rt = args.runtime.resolve_with(file.runtime, dist)?;
    let lora = match (&file.lora, &args.adapter) {
        (None, None) => None,
        (lc, adapter) => {
            if let Some(c) = lc {
                c.validate("lora").map_err(|e| anyhow::anyhow!("{}: {e}", source.display()))?;
            }
            if args.ref_model.is_some() {
                anyhow::bail!(
                    "--ref-model with LoRA: the reference is the base model with the adapters off; \
                     leave --ref-model out"
                );
            }
            Some(LoraSpec {
                config: lc.clone(),
                adapter: adapter.clone(),
                origin: format!("{}: [lora]", source.display()),
                seed: cfg.seed,
            })
        }
    };
    let mut policy = load(&args.model, true, lora.as_ref(), &rt)
        .with_context(|| format!("cannot load policy {:?}", args.model))?;
    if let Some(k) = file.model.trainable_layers {
        policy.lm = policy
            .lm
            .freeze_trunk(&policy.store, k)
            .with_context(|| format!("{}: [model]", source.display()))?;
    }
    policy.lm = policy.lm.with_gradient_checkpointing(file.model.gradient_checkpointing);
    let reference = match &args.ref_model {
        Some(r) => {
            Some(load(r, false, None, &rt).with_context(|| format!("cannot load reference {r:?}"))?.lm)
        }
        None => None,
    };
    let records = read_preference_data(&args.data.to_string_lossy(), &file.data)?;
    let eos = policy.lm.config().eos_token_ids().first().copied();
    let template = ChatTemplate::for_model_dir(&policy.files.dir)?;
    let prepared = prepare_pairs_with(&records, policy.tokenizer.as_ref(), template.as_ref(), eos, &cfg)?;
    warn_rows(&prepared.dropped, "dropped: the prompt fills dpo.max_length (TRL drops them too)");
    warn_rows(
        &prepared.identical,
        "have identical chosen and rejected sequences: they give no gradient and count as wrong in \
         rewards/accuracies (TRL trains on them the same way); fix or drop them",
    );
    let mut pairs = prepared.pairs;
    if pairs.is_empty() {
        anyhow::bail!("{}: no preference pair left to train on", args.data.display());
    }
    let given = pairs.iter().filter(|p| p.ref_logps.is_some()).count();
    if given > 0 && !cfg.precompute_ref_log_probs {
        tracing::warn!(
            "{given} pair(s) carry ref_chosen_logps/ref_rejected_logps, but dpo.precompute_ref_log_probs is \
             false: the reference model's logprobs are used instead (as TRL); set it to true to use the file's"
        );
    }
    let mut trainer = DpoTrainer::new(
        cfg.clone(),
        policy.store.clone(),
        policy.lm.clone(),
        reference,
        pairs_per_process(dist, pairs.len()),
    )
    .with_context(|| format!("cannot set up DPO from {}", source.display()))?
    .with_dist(dist.clone());
    if cfg.precompute_ref_log_probs && given < pairs.len() {
        let mut missing: Vec<PreferencePair> =
            pairs.iter().filter(|p| p.ref_logps.is_none()).cloned().collect();
        tracing::info!("precomputing the reference logprobs of {} pairs", missing.len());
        trainer.precompute_ref_logps(&mut missing)?;
        let mut it = missing.into_iter();
        for p in pairs.iter_mut().filter(|p| p.ref_logps.is_none()) {
            p.ref_logps = it.next().and_then(|m| m.ref_logps);
        }
    }
    train_and_save(&args, &policy, &mut trainer, &pairs)
}

fn train_and_save(
    args: &Args,
    policy: &Policy,
    trainer: &mut DpoTrainer,
    pairs: &[PreferencePair],
) -> Result<()> {
    // On several processes, rank 0 alone writes (every process holds the same weights).
    let main = trainer.dist().is_main();
    let metrics_path = args.output.join("metrics.jsonl");
    if main {
        std::fs::create_dir_all(&args.output)
            .with_context(|| format!("cannot create {}", args.output.display()))?;
    }
    let bar = Bar::new("dpo", main);
    let world = trainer.dist().world_size();
    tracing::info!(
        "DPO on {} pairs: {} optimizer steps of {} × {} pairs{}",
        pairs.len(),
        trainer.config.total_steps(pairs_per_process(trainer.dist(), pairs.len())),
        trainer.config.per_device_train_batch_size,
        trainer.config.gradient_accumulation_steps,
        if world > 1 { format!(" on each of {world} processes") } else { String::new() }
    );
    let (stop, dir) =
        (crate::ppo::stop_flag()?, crate::train::checkpoint_dir(&args.checkpoint_dir, &args.output));
    let ckpt = Checkpointing { dir: &dir, resume: args.resume, stop: Some(&stop) };
    let mut last = None;
    let summary = train_with(trainer, pairs, Some(ckpt), Some(&metrics_path), &mut |step, total, stats| {
        let get = |k: &str| stats.get(k).and_then(Stat::as_f64).unwrap_or(f64::NAN);
        bar.show(
            step,
            total,
            format!(
                "loss {:.4} margin {:.4} acc {:.2}",
                get("loss"),
                get("rewards/margins"),
                get("rewards/accuracies")
            ),
        );
        last = Some((get("loss"), get("rewards/accuracies")));
        Ok(())
    })?;
    bar.finish();
    if !crate::train::finished(summary.steps, summary.total_steps, &dir, main) {
        std::process::exit(130);
    }
    if !main {
        return Ok(());
    }
    save(&args.output, policy, trainer.store(), &metrics_path)?;
    if let Some((loss, acc)) = last {
        eprintln!("final loss {loss:.4}, rewards/accuracies {acc:.3}; saved {}", args.output.display());
    }
    Ok(())
}

/// Replaces `dir` atomically with the model, its config, side files and the metrics so far.
fn save(dir: &Path, policy: &Policy, store: &ParamStore, metrics: &Path) -> Result<()> {
    let metrics_text =
        std::fs::read(metrics).with_context(|| format!("cannot read {}", metrics.display()))?;
    save_dir_atomic(dir, |tmp| {
        if store.has_lora() {
            store.save_adapter(tmp, None)?;
        } else {
            store.save_safetensors(&tmp.join("model.safetensors"))?;
            let text = serde_json::to_string_pretty(&policy.config_json)
                .map_err(|e| rltune::models::Error::Input(e.to_string()))?;
            rltune::io::write_bytes_atomic(&tmp.join("config.json"), text.as_bytes())?;
        }
        rltune::io::write_bytes_atomic(&tmp.join("metrics.jsonl"), &metrics_text)?;
        copy_side_files(&policy.files, tmp)
    })
    .with_context(|| format!("cannot write {}", dir.display()))
}
