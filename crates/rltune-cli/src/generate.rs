//! `rltune generate`: sample from a causal LM.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::load::{load_lm_adapted, LoraSpec};
use rltune::tokenizer::Tokenizer;

/// Arguments of `rltune generate`.
#[derive(clap::Args)]
pub struct Args {
    /// Model directory (Hugging Face layout), GGUF file or hub id.
    #[arg(long)]
    model: String,
    /// Prompt text (needs tokenizer.json in the model directory).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Render --prompt as a user message through the model's chat template (with the
    /// assistant's generation prompt), as transformers' apply_chat_template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens to sample at most.
    #[arg(long, default_value_t = 20)]
    max_new_tokens: usize,
    /// Number of samples of the prompt (one batch).
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Keep the k most likely tokens (0: off); logprobs over the truncated support.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (1.0: off); logprobs over the truncated support.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Keep tokens at least this fraction as likely as the best (0: off), after top-k and top-p.
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object per sample, one per line.
    #[arg(long)]
    json: bool,
    /// A LoRA adapter directory (PEFT's format, or an rltune run with [lora]) applied to --model.
    #[arg(long)]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// Runs `rltune generate`.
pub fn run(args: Args) -> Result<()> {
    let runtime = args.runtime.resolve(Default::default())?;
    let device = runtime.device();
    let adapter = args.adapter.as_ref().map(LoraSpec::from_dir);
    let policy = load_lm_adapted(&args.model, adapter.as_ref(), false, runtime.dtype(), device)
        .with_context(|| format!("cannot load model {:?}", args.model))?;
    let tokenizer = match &policy.files.tokenizer {
        Some(path) => {
            let t = Tokenizer::from_file(path)?;
            t.check_fits(policy.config.vocab_size())?;
            Some(t)
        }
        None => None,
    };
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) if args.chat => {
            let template = rltune::models::chat_template::ChatTemplate::for_model_dir(&policy.files.dir)?
                .with_context(|| {
                    format!(
                        "--chat: {} has no chat_template in tokenizer_config.json",
                        policy.files.dir.display()
                    )
                })?;
            let rendered = template.render(&rltune::models::chat_template::user_message(text), true)?;
            match &tokenizer {
                Some(t) => t.encode_with(&rendered, false)?,
                None => bail!(
                    "{} has no tokenizer.json, so --chat cannot tokenize the prompt",
                    policy.files.dir.display()
                ),
            }
        }
        (Some(text), None) => match &tokenizer {
            Some(t) => t.encode(text)?,
            None => bail!(
                "{} has no tokenizer.json, so --prompt text cannot be tokenized; pass --prompt-ids instead",
                policy.files.dir.display()
            ),
        },
        (None, None) => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if args.num_samples == 0 {
        bail!("--num-samples must be at least 1");
    }
    let cfg = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        ..Default::default()
    };
    let prompts = vec![prompt; args.num_samples];
    let samples = generate(&policy.lm, None, &prompts, &cfg, device)?;
    for (i, s) in samples.iter().enumerate() {
        let text = match &tokenizer {
            Some(t) => Some(t.decode(&s.response_ids)?),
            None => None,
        };
        if args.json {
            let mut obj = serde_json::json!({
                "sample": i,
                "query_ids": s.query_ids,
                "response_ids": s.response_ids,
                "logprobs": s.logprobs,
            });
            if let Some(text) = text {
                obj["text"] = text.into();
            }
            println!("{obj}");
        } else {
            let sum: f32 = s.logprobs.iter().sum();
            match text {
                Some(text) => println!("[{i}] (logprob {sum:.3}) {text}"),
                None => println!("[{i}] (logprob {sum:.3}) {:?}", s.response_ids),
            }
        }
    }
    Ok(())
}
