//! `rltune convert FILE.gguf --output DIR`: a GGUF file as a Hugging Face model directory.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::DType;

/// Arguments of `rltune convert`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file (llama or qwen2 architecture; F32, F16, BF16, Q4_0 … Q8_0 and K-quant tensors).
    input: PathBuf,
    /// The directory to write: config.json, model.safetensors, tokenizer.json,
    /// tokenizer_config.json (with the chat template) and generation_config.json. Replaced if it exists.
    #[arg(long)]
    output: PathBuf,
    /// dtype of model.safetensors: f32, bf16 or f16 (the weights are dequantized to it).
    #[arg(long, default_value = "f32")]
    dtype: String,
}

/// Runs `rltune convert`.
pub fn run(args: Args) -> Result<()> {
    if !rltune::models::gguf::is_gguf(&args.input) {
        bail!(
            "{}: rltune convert reads GGUF files (*.gguf); a Hugging Face directory needs no conversion",
            args.input.display()
        );
    }
    let dtype = match args.dtype.as_str() {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" => DType::F16,
        other => bail!("--dtype {other:?}: use f32, bf16 or f16"),
    };
    let n = rltune::models::gguf::convert(&args.input, &args.output, dtype)
        .with_context(|| format!("cannot convert {}", args.input.display()))?;
    println!("wrote {} ({n} tensors, {dtype:?}): config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json", args.output.display());
    Ok(())
}
