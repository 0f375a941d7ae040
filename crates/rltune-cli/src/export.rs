//! `rltune export --model M [--adapter DIR] --output FILE.gguf [--type f32|f16|q8_0]`: a model,
//! or a model with its LoRA adapter merged, as a GGUF file that llama.cpp loads.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use rltune::models::gguf_export::{export, ExportType};

/// Arguments of `rltune export`.
#[derive(clap::Args)]
pub struct Args {
    /// The model: a directory (config.json, model.safetensors, tokenizer.json), a hub id or a
    /// GGUF file; llama, mistral (written as llama) or qwen2.
    #[arg(long)]
    model: String,
    /// A LoRA adapter (PEFT's save_pretrained, or an rltune run with [lora]) to merge first.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The GGUF file to write (replaced if it exists; written beside it, then renamed).
    #[arg(long)]
    output: PathBuf,
    /// Tensor type of the matrices: f32 (exact), f16 or q8_0; norms and biases stay f32.
    #[arg(long = "type", default_value = "f16")]
    ty: String,
}

/// Runs `rltune export`.
pub fn run(args: Args) -> Result<()> {
    let ty: ExportType = args.ty.parse()?;
    if !rltune::models::gguf::is_gguf(&args.output) {
        bail!(
            "--output {}: the file to write must end in .gguf (e.g. --output model.gguf)",
            args.output.display()
        );
    }
    let what = match &args.adapter {
        Some(a) => format!("{} with {} merged", args.model, a.display()),
        None => args.model.clone(),
    };
    let s = export(&args.model, args.adapter.as_deref(), &args.output, ty)
        .with_context(|| format!("cannot export {what} to {}", args.output.display()))?;
    let (f32s, f16s, q8s) = s.by_type;
    let merged =
        if s.merged_layers > 0 { format!(", {} LoRA layers merged", s.merged_layers) } else { String::new() };
    println!(
        "wrote {} ({} bytes): {} GGUF v3, {} tensors ({f32s} F32, {f16s} F16, {q8s} Q8_0){merged}",
        args.output.display(),
        s.bytes,
        s.architecture,
        s.tensors
    );
    Ok(())
}
