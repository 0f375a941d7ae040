//! `rltune merge --model BASE --adapter DIR --output DIR`: a LoRA adapter folded into its base,
//! as PEFT's `merge_and_unload()` then `save_pretrained`: a full Hugging Face model directory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use rltune::models::load::{copy_side_files, load_lm_adapted, save_pretrained, LoraSpec};

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
