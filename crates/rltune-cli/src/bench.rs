//! `rltune bench ppo`: the PPO iteration benchmark that `bench/trl_ppo.py` mirrors for TRL.
//!
//! One iteration = batched generation (pure sampling, never stopping at EOS, so every response
//! has exactly 24 tokens) + `PpoTrainer::step` on random scores. Models are randomly initialized
//! GPT-2s; the reward model is not part of the timed work.
//!
//! `rltune bench grpo`: one `GrpoTrainer` step on fixed random completions, as
//! `bench/trl_grpo.py` times TRL 1.16.0's `GRPOTrainer` (generation is not part of it).

use std::time::Instant;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rltune::generation::{generate, GenerationConfig};
use rltune::grpo::{GroupBatch, GrpoConfig, GrpoTrainer, RewardTable};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::params::ParamStore;
use rltune::ppo::{PpoConfig, PpoTrainer, RolloutCache, Stat, StepInput};
use rltune::runtime::RuntimeSection;

/// Arguments of `rltune bench ppo`.
#[derive(clap::Args)]
pub struct Args {
    /// `small` (4 layers, d=256, vocab 8192, B=64), `gpt2` (GPT-2 small shape, B=16), both with
    /// 8 query + 24 response tokens, or `qwen2-0.5b` (Qwen2-0.5B's shape, B=64, mini-batch 8,
    /// 128 + 128 tokens; for the GPU, with `--dtype bf16`).
    #[arg(long, default_value = "small")]
    preset: String,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// PPO batch size instead of the preset's.
    #[arg(long)]
    batch: Option<usize>,
    /// PPO mini-batch size (and forward batch) instead of the preset's.
    #[arg(long)]
    mini_batch: Option<usize>,
    /// Recompute old logprobs and values with a second forward pass (as TRL does) instead of
    /// reusing the rollout's.
    #[arg(long)]
    no_rollout_cache: bool,
    /// `f32`, or `bf16`: matrix products on AMX tiles with bf16 inputs and f32 accumulation
    /// (compare with `bench/trl_ppo.py --bf16`, TRL under CPU autocast).
    #[arg(long, default_value = "f32")]
    matmul_precision: rltune::ops::MatmulPrecision,
    /// Run the GPU's code path on the CPU: candle's composed ops instead of the fused CPU
    /// kernels, device-side Adam moments. With the resident memory printed at each phase, it
    /// shows what the GPU path keeps alive, here (use a small `--batch`).
    #[arg(long)]
    composed: bool,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

struct Preset {
    cfg: CausalLmConfig,
    batch: usize,
    mini_batch: usize,
    query_len: usize,
    response_len: usize,
}

impl Preset {
    /// The largest query token id + 1 (the eos id, last in the vocabulary, is never drawn).
    fn eos(&self) -> u32 {
        match &self.cfg {
            CausalLmConfig::Gpt2(c) => c.eos_token_id.unwrap_or(0),
            other => other.vocab_size() as u32 - 1,
        }
    }
}

/// Qwen2-0.5B's shape (494M parameters, tied embeddings), as `bench/trl_ppo.py` builds it.
const QWEN2_05B: &str = r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
  "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
  "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "eos_token_id": 151935}"#;

fn preset(name: &str) -> Result<Preset> {
    let gpt2 = |cfg: Gpt2Config, batch, mini_batch| Preset {
        cfg: CausalLmConfig::Gpt2(cfg),
        batch,
        mini_batch,
        query_len: QUERY_LEN,
        response_len: RESPONSE_LEN,
    };
    Ok(match name {
        "small" => gpt2(Gpt2Config::tiny(8192, 256, 4, 4, 64), 64, 16),
        "gpt2" => gpt2(Gpt2Config::tiny(50257, 768, 12, 12, 1024), 16, 4),
        "qwen2-0.5b" => Preset {
            cfg: CausalLmConfig::from_json(
                &serde_json::from_str(QWEN2_05B)?,
                std::path::Path::new("qwen2-0.5b"),
            )?,
            batch: 64,
            mini_batch: 8,
            query_len: 128,
            response_len: 128,
        },
        other => bail!("unknown preset {other:?}; use small, gpt2 or qwen2-0.5b"),
    })
}

const QUERY_LEN: usize = 8;
const RESPONSE_LEN: usize = 24;

/// Peak resident set size of this process, in MiB (Linux `VmHWM`).
fn peak_rss_mib() -> f64 {
    proc_status_mib("VmHWM:")
}

/// A memory line of `/proc/self/status` in MiB (`VmHWM:` the peak, `VmRSS:` now); NaN elsewhere.
fn proc_status_mib(key: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Runs `rltune bench ppo`.
pub fn run(args: Args) -> Result<()> {
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let mut p = preset(&args.preset)?;
    p.batch = args.batch.unwrap_or(p.batch);
    p.mini_batch = args.mini_batch.unwrap_or(p.mini_batch);
    let section = RuntimeSection { matmul_precision: args.matmul_precision, ..RuntimeSection::default() };
    let runtime = args.runtime.resolve(section)?;
    let dev = runtime.device().clone();
    let _composed = args.composed.then(rltune::ops::composed_scope);
    let cfg = p.cfg.clone();
    let store = ParamStore::random(0, true, runtime.dtype(), &dev)?;
    let lm = CausalLm::load(&store.root(), &cfg)?;
    let n_params = store.vars().iter().map(|(_, v)| v.elem_count()).sum::<usize>();
    let policy = CausalLmWithValueHead::load(&store.root(), lm)?;
    let reference = CausalLm::load(&store.frozen_copy()?.root(), &cfg)?;
    let ppo =
        PpoConfig { batch_size: p.batch, mini_batch_size: p.mini_batch, ppo_epochs: 4, ..Default::default() };
    let mut trainer = PpoTrainer::new(ppo, store, policy, reference)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let eos = p.eos();
    let (mut totals, mut gens, mut steps, mut fwd, mut opt) = (vec![], vec![], vec![], vec![], vec![]);
    for it in 0..=args.iters {
        let queries: Vec<Vec<u32>> =
            (0..p.batch).map(|_| (0..p.query_len).map(|_| rng.gen_range(0..eos)).collect()).collect();
        // Device memory at the phase boundaries (stderr: a run that runs out of memory shows
        // which phase did).
        let mem = |what: &str| match rltune::runtime::device_memory_used_mib(&dev) {
            Some(m) => eprintln!("iteration {it}: {m:.0} MiB of device memory in use {what}"),
            None => eprintln!(
                "iteration {it}: {:.0} MiB resident {what} (peak so far {:.0} MiB)",
                proc_status_mib("VmRSS:"),
                peak_rss_mib()
            ),
        };
        mem("before generation");
        let t0 = Instant::now();
        let gen_cfg = GenerationConfig {
            max_new_tokens: p.response_len,
            stop_at_eos: false,
            seed: it as u64,
            ..Default::default()
        };
        let samples = generate(&trainer.policy.lm, Some(&trainer.policy.v_head), &queries, &gen_cfg, &dev)?;
        let t_gen = t0.elapsed().as_secs_f64();
        let responses: Vec<Vec<u32>> = samples.iter().map(|s| s.response_ids.clone()).collect();
        let scores: Vec<f32> = (0..p.batch).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let caches: Vec<RolloutCache> = samples
            .iter()
            .map(|s| RolloutCache {
                logprobs: s.logprobs.clone(),
                values: s.values.clone().unwrap_or_default(),
            })
            .collect();
        mem("after generation");
        let t1 = Instant::now();
        let stats = trainer.step_with(StepInput {
            queries: &queries,
            responses: &responses,
            scores: &scores,
            response_masks: None,
            rollout: (!args.no_rollout_cache).then_some(caches.as_slice()),
            bootstrap: None,
            allowed: None,
        })?;
        let t_step = t1.elapsed().as_secs_f64();
        mem("after the step");
        let get = |k: &str| stats.get(k).and_then(Stat::as_f64).unwrap_or(f64::NAN);
        if !args.json {
            eprintln!(
                "{} {it}: generation {t_gen:.3}s, step {t_step:.3}s (forward {:.3}s, optimize {:.3}s)",
                if it == 0 { "warm-up" } else { "iteration" },
                get("time/ppo/forward_pass"),
                get("time/ppo/optimize_step"),
            );
        }
        if it > 0 {
            totals.push(t_gen + t_step);
            gens.push(t_gen);
            steps.push(t_step);
            fwd.push(get("time/ppo/forward_pass"));
            opt.push(get("time/ppo/optimize_step"));
        }
    }
    let total = median(&mut totals);
    let out = serde_json::json!({
        "impl": "rltune",
        "preset": args.preset,
        "rollout_cache": !args.no_rollout_cache,
        "composed": args.composed,
        "matmul_precision": runtime.matmul_precision().as_str(),
        "runtime": runtime.to_string(),
        "median_total_s": total,
        "median_generation_s": median(&mut gens),
        "median_step_s": median(&mut steps),
        "median_forward_pass_s": median(&mut fwd),
        "median_optimize_step_s": median(&mut opt),
        "tokens_per_s": (p.batch * p.response_len) as f64 / total,
        "n_params": n_params,
        "train_tokens": p.batch * (p.query_len + p.response_len) * 4,
        "peak_rss_mib": peak_rss_mib(),
        "threads": rayon_threads(),
    });
    print_result(&out, args.json)
}

/// Prints a benchmark's result: one JSON line with `--json`, else indented.
fn print_result(out: &serde_json::Value, json: bool) -> Result<()> {
    if json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(out)?);
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Arguments of `rltune bench grpo`.
#[derive(clap::Args)]
pub struct GrpoArgs {
    /// `small`: the `ppo` preset's GPT-2 (4 layers, d=256, vocab 8192); 64 completions a step,
    /// 8 prompts × `num_generations` 8, 8 prompt + 24 completion tokens. `qwen2-0.5b`:
    /// Qwen2-0.5B's shape; 16 completions, 2 prompts × 8, 128 + 128 tokens (for the GPU, with
    /// `--dtype bf16`).
    #[arg(long, default_value = "small")]
    preset: String,
    /// Timed steps (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// `[grpo] beta`: 0 (TRL's default) loads no reference model; > 0 adds its forward.
    #[arg(long, default_value_t = 0.0)]
    beta: f64,
    /// `[model] gradient_checkpointing` (TRL 1.16.0's default; compare with
    /// `bench/trl_grpo.py --gradient-checkpointing`).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// A model's own weights instead of the preset's random ones: a Hugging Face directory (e.g.
    /// what `rltune convert` writes, which `bench/trl_grpo.py --model` loads too) or a GGUF
    /// file. The preset keeps the batch geometry.
    #[arg(long)]
    model: Option<String>,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs `rltune bench grpo`: TRL 1.16.0's defaults but for the batch geometry (see
/// bench/trl_grpo.py for the workload, which both sides share).
pub fn run_grpo(args: GrpoArgs) -> Result<()> {
    const GENERATIONS: usize = 8;
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let mut p = preset(&args.preset)?;
    match args.preset.as_str() {
        "small" => {}
        // One step of 16 completions: TRL's per-device batch in one forward and backward.
        "qwen2-0.5b" => p.batch = 16,
        _ => bail!("bench grpo has the small and qwen2-0.5b presets (bench/trl_grpo.py's)"),
    }
    let runtime = args.runtime.resolve(RuntimeSection::default())?;
    let dev = runtime.device().clone();
    let (store, lm) = match &args.model {
        Some(model) => {
            let loaded = rltune::models::load::load_lm(model, true, runtime.dtype(), &dev)
                .map_err(|e| anyhow::anyhow!("cannot load --model {model:?}: {e}"))?;
            p.cfg = loaded.config;
            (loaded.store, loaded.lm)
        }
        None => {
            let store = ParamStore::random(0, true, runtime.dtype(), &dev)?;
            let lm = CausalLm::load(&store.root(), &p.cfg)?;
            (store, lm)
        }
    };
    let cfg = p.cfg.clone();
    let lm = lm.with_gradient_checkpointing(args.gradient_checkpointing);
    let n_params = store.vars().iter().map(|(_, v)| v.elem_count()).sum::<usize>();
    let reference =
        (args.beta != 0.0).then(|| CausalLm::load(&store.frozen_copy()?.root(), &cfg)).transpose()?;
    let grpo = GrpoConfig {
        per_device_train_batch_size: Some(p.batch),
        num_generations: GENERATIONS,
        max_completion_length: p.response_len,
        learning_rate: 1e-5,
        beta: args.beta,
        ..GrpoConfig::default()
    };
    let mut trainer = GrpoTrainer::new(grpo, store, lm, reference)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let eos = p.eos();
    let mut ids = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.gen_range(0..eos)).collect() };
    let mut steps = Vec::new();
    for it in 0..=args.iters {
        let prompts: Vec<Vec<u32>> = (0..p.batch / GENERATIONS)
            .flat_map(|_| std::iter::repeat_n(ids(p.query_len), GENERATIONS))
            .collect();
        let completions: Vec<Vec<u32>> = (0..p.batch).map(|_| ids(p.response_len)).collect();
        let rewards: Vec<f32> = (0..p.batch).map(|k| ((k * 7919) % 13) as f32 / 6.0 - 1.0).collect();
        let table = RewardTable::single(&rewards);
        let t = Instant::now();
        trainer.step_with(&GroupBatch {
            prompts: &prompts,
            completions: &completions,
            rewards: &table,
            truncated: None,
            allowed: None,
        })?;
        let secs = t.elapsed().as_secs_f64();
        if !args.json {
            eprintln!("{} {it}: step {secs:.3}s", if it == 0 { "warm-up" } else { "step" });
        }
        if it > 0 {
            steps.push(secs);
        }
    }
    let all = steps.clone();
    let step = median(&mut steps);
    let out = serde_json::json!({
        "impl": "rltune",
        "preset": args.preset,
        "model": args.model,
        "beta": args.beta,
        "gradient_checkpointing": args.gradient_checkpointing,
        "runtime": runtime.to_string(),
        "median_step_s": step,
        "steps_s": all,
        "tokens_per_s": (p.batch * p.response_len) as f64 / step,
        "n_params": n_params,
        "train_tokens": p.batch * (p.query_len + p.response_len),
        "peak_rss_mib": peak_rss_mib(),
        "threads": rayon_threads(),
    });
    print_result(&out, args.json)
}

/// Arguments of `rltune bench generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Model directory (Hugging Face layout), GGUF file or hub id.
    #[arg(long)]
    model: String,
    /// A LoRA adapter directory applied to --model (unmerged, as training samples).
    #[arg(long)]
    adapter: Option<std::path::PathBuf>,
    /// Sequences sampled together.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Prompt tokens per sequence: row i, position j holds `(131 i + 17 j + 1) mod (V − 1)`, as
    /// bench/llamacpp_generate.py builds them.
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Tokens sampled per sequence (EOS does not stop a sequence).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Timed runs (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs `rltune bench generate`: batched pure sampling (temperature 1, no truncation) with the
/// KV cache, as every trainer samples; `bench/llamacpp_generate.py` runs the same workload on
/// llama.cpp.
pub fn run_generate(args: GenerateArgs) -> Result<()> {
    if args.iters == 0 || args.batch == 0 || args.prompt_tokens == 0 || args.new_tokens == 0 {
        bail!("--iters, --batch, --prompt-tokens and --new-tokens must each be at least 1");
    }
    let runtime = args.runtime.resolve(RuntimeSection::default())?;
    let dev = runtime.device().clone();
    let spec = args.adapter.as_ref().map(rltune::models::load::LoraSpec::from_dir);
    let t_load = Instant::now();
    let loaded =
        rltune::models::load::load_lm_adapted(&args.model, spec.as_ref(), false, runtime.dtype(), &dev)
            .map_err(|e| anyhow::anyhow!("cannot load --model {:?}: {e}", args.model))?;
    let load_s = t_load.elapsed().as_secs_f64();
    let vocab = loaded.config.vocab_size();
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|i| (0..args.prompt_tokens).map(|j| ((131 * i + 17 * j + 1) % (vocab - 1)) as u32).collect())
        .collect();
    let (mut totals, mut prefills) = (Vec::new(), Vec::new());
    for it in 0..=args.iters {
        let gen_cfg = GenerationConfig {
            max_new_tokens: args.new_tokens,
            stop_at_eos: false,
            seed: it as u64,
            ..Default::default()
        };
        let (p0, _) = rltune::generation::prefill_counters();
        let t0 = Instant::now();
        let samples = generate(&loaded.lm, None, &prompts, &gen_cfg, &dev)?;
        let total = t0.elapsed().as_secs_f64();
        let prefill = (rltune::generation::prefill_counters().0 - p0).as_secs_f64();
        if samples.iter().any(|s| s.response_ids.len() != args.new_tokens) {
            bail!("a sequence stopped before {} tokens", args.new_tokens);
        }
        if !args.json {
            eprintln!(
                "{} {it}: {total:.3}s (prefill {prefill:.3}s, {:.1} new tokens/s)",
                if it == 0 { "warm-up" } else { "run" },
                (args.batch * args.new_tokens) as f64 / total
            );
        }
        if it > 0 {
            totals.push(total);
            prefills.push(prefill);
        }
    }
    let total = median(&mut totals);
    let prefill = median(&mut prefills);
    let new = (args.batch * args.new_tokens) as f64;
    let out = serde_json::json!({
        "impl": "rltune",
        "bench": "generate",
        "model": args.model,
        "adapter": args.adapter,
        "runtime": runtime.to_string(),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "load_s": load_s,
        "median_total_s": total,
        "median_prefill_s": prefill,
        "prefill_tokens_per_s": (args.batch * args.prompt_tokens) as f64 / prefill,
        "decode_tokens_per_s": (args.batch * (args.new_tokens - 1)) as f64 / (total - prefill),
        "new_tokens_per_s": new / total,
        "peak_rss_mib": peak_rss_mib(),
        "threads": rayon_threads(),
    });
    print_result(&out, args.json)
}
