//! `rltune merge --model BASE --adapter DIR --output DIR`: a LoRA adapter folded into its base,
//! as PEFT's `merge_and_unload()` then `save_pretrained`: a full Hugging Face model directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use rltune::models::io::read_json;
use rltune::models::load::{copy_side_files, load_lm_adapted, save_pretrained, LoraSpec};
use rltune::models::lora::{LoraConfig, ADAPTER_CONFIG};
use rltune::train::reward_model::RewardModel;

/// Arguments of `rltune merge`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model the adapter was trained on (a directory or hub id).
    #[arg(long)]
    model: String,
    /// The adapter: a directory with adapter_config.json and adapter_model.safetensors (PEFT's
    /// save_pretrained, or an rltune run with [lora]).
    #[arg(long)]
    adapter: PathBuf,
    /// The directory to write: config.json, model.safetensors (W + B·A·scaling in every adapted
    /// layer, the modules_to_save and value head trained), and the base's tokenizer files.
    #[arg(long)]
    output: PathBuf,
}

/// Runs `rltune merge`.
pub fn run(args: Args) -> Result<()> {
    if RewardModel::is_adapter_dir(&args.adapter) && is_classifier(&args.adapter)? {
        return merge_classifier(&args);
    }
    let spec = LoraSpec::from_dir(&args.adapter);
    let loaded = load_lm_adapted(&args.model, Some(&spec), false, DType::F32, &Device::Cpu)
        .with_context(|| format!("cannot apply {} to {}", args.adapter.display(), args.model))?;
    let modules = loaded.store.lora_modules().len();
    let merged = loaded.store.merged()?;
    save_pretrained(&args.output, &merged, &loaded.config_json)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    copy_side_files(&loaded.files, &args.output)?;
    println!(
        "wrote {}: {} with {} merged into {modules} layers (config.json, model.safetensors)",
        args.output.display(),
        args.model,
        args.adapter.display()
    );
    Ok(())
}

/// Whether the adapter belongs to a sequence classifier (PEFT's `task_type = "SEQ_CLS"`: a
/// reward model from `rltune reward` with [lora], or PEFT's own).
fn is_classifier(adapter: &Path) -> Result<bool> {
    let path = adapter.join(ADAPTER_CONFIG);
    let (_, meta) = LoraConfig::from_adapter_json(&read_json(&path)?, &path)?;
    Ok(meta.task_type.as_deref() == Some("SEQ_CLS"))
}

/// A reward model's adapter merged into its base: a full classifier directory (config.json with
/// the trained labels, model.safetensors, tokenizer.json) that `[reward] model` and
/// transformers' `AutoModelForSequenceClassification` load.
fn merge_classifier(args: &Args) -> Result<()> {
    let model = RewardModel::from_adapter(&args.adapter, Some(&args.model), DType::F32, &Device::Cpu)
        .with_context(|| format!("cannot apply {} to {}", args.adapter.display(), args.model))?;
    let modules = model.store.lora_modules().len();
    let merged = RewardModel { store: model.store.merged()?, ..model };
    merged.save(&args.output).with_context(|| format!("cannot write {}", args.output.display()))?;
    println!(
        "wrote {}: the classifier {} with {} merged into {modules} layers (config.json, \
         model.safetensors, tokenizer.json)",
        args.output.display(),
        args.model,
        args.adapter.display()
    );
    Ok(())
}
