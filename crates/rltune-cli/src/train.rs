//! `rltune sft` and `rltune reward`: the supervised trainers, saving Hugging Face directories
//! that `rltune ppo` loads (the SFT model as policy and reference, the classifier as reward).
//!
//! Settings come from an optional TOML file with a `[training]` table (learning rate, epochs,
//! batch size, gradient accumulation, warm-up and decay, eval split) and an `[sft]` or `[reward]`
//! table, plus `--set table.key=value` overrides; see configs/sft.toml and configs/reward.toml.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rltune::config_file::parse_toml;
use rltune::data::rows::DataOptions;
use rltune::dist::Dist;
use rltune::models::load::LoraSpec;
use rltune::models::lora::LoraConfig;
use rltune::runtime::RuntimeSection;
use rltune::train::data::{read_reward_data, read_sft_data};
use rltune::train::reward_model::{self, RewardConfig, RewardModel};
use rltune::train::sft::{self, SftConfig, SftModel};
use rltune::train::{Checkpointing, TrainProgress, TrainSummary, TrainingArgs};
use serde::Deserialize;

/// Arguments shared by both trainers.
#[derive(clap::Args)]
pub struct Common {
    /// Starting model: a local Hugging Face directory or a hub id.
    #[arg(long)]
    model: String,
    /// Training data: JSON lines, JSON, CSV, Parquet, text (.txt), a `datasets` save_to_disk
    /// directory or a hub dataset; see the command's help for the fields, and [data] for the
    /// split and column names.
    #[arg(long)]
    data: PathBuf,
    /// Output directory (written atomically: a temp directory renamed at the end).
    #[arg(long)]
    output: PathBuf,
    /// TOML file with [training], the trainer's own table and [runtime].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a setting, e.g. --set training.learning_rate=1e-4 (repeatable).
    #[arg(long = "set", value_name = "TABLE.KEY=VALUE")]
    set: Vec<String>,
    /// Where checkpoints go (`step-N/`, every `[training] save_steps` steps and on Ctrl-C);
    /// default: the output's path with `.checkpoints` appended.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Continue from the latest checkpoint in the checkpoint folder, bit for bit.
    #[arg(long)]
    resume: bool,
    #[command(flatten)]
    runtime: crate::runtime::RuntimeArgs,
}

/// Arguments of `rltune sft`.
#[derive(clap::Args)]
pub struct SftArgs {
    #[command(flatten)]
    common: Common,
    /// A LoRA adapter directory (PEFT's format) to start from: trains it, the base frozen.
    #[arg(long)]
    adapter: Option<PathBuf>,
}

/// Arguments of `rltune reward`.
#[derive(clap::Args)]
pub struct RewardArgs {
    #[command(flatten)]
    common: Common,
    /// A LoRA adapter directory of this classifier (PEFT's `SEQ_CLS` format, or an earlier
    /// `rltune reward` run with [lora]) to start from: trains it, the encoder frozen.
    #[arg(long)]
    adapter: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct SftFile {
    training: TrainingArgs,
    sft: SftConfig,
    /// `split` and `columns` of the data.
    data: DataOptions,
    runtime: RuntimeSection,
    /// LoRA adapters (PEFT's `LoraConfig` names): the base frozen, the adapter saved.
    lora: Option<LoraConfig>,
    /// `trainable_layers`: partial freezing; `gradient_checkpointing`.
    model: FreezeSection,
}

/// `[model]` of the SFT, DPO and reward settings files.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FreezeSection {
    /// Partial freezing: train the last K blocks, the final norm and the head; the embeddings
    /// and the blocks below stay frozen (`rltune::models::CausalLm::freeze_trunk`).
    pub(crate) trainable_layers: Option<usize>,
    /// Gradient checkpointing of the policy's blocks (TRL's `gradient_checkpointing`; causal
    /// LMs: `rltune::models::CausalLm::with_gradient_checkpointing`).
    pub(crate) gradient_checkpointing: bool,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct RewardFile {
    training: TrainingArgs,
    reward: RewardConfig,
    /// `split` and `columns` of the data.
    data: DataOptions,
    runtime: RuntimeSection,
    /// LoRA adapters (PEFT's `LoraConfig` names, `task_type = "SEQ_CLS"`): the encoder frozen,
    /// the adapters and the classifier head train, the adapter saved.
    lora: Option<LoraConfig>,
    /// `trainable_layers`: partial freezing of the encoder.
    model: FreezeSection,
}

/// The settings file (or an empty one) with the overrides applied.
fn settings<T: serde::de::DeserializeOwned>(c: &Common) -> Result<T> {
    let (text, path) = match &c.config {
        Some(p) => {
            (std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?, p.clone())
        }
        None => (String::new(), PathBuf::from("--set")),
    };
    Ok(parse_toml(&text, &path, &c.set)?)
}

/// The LoRA of a run: new adapters from `[lora]`, or `--adapter`'s (which wins), or none.
fn lora_spec(
    config: &Option<LoraConfig>,
    adapter: &Option<PathBuf>,
    c: &Common,
    seed: u64,
) -> Result<Option<LoraSpec>> {
    if config.is_none() && adapter.is_none() {
        return Ok(None);
    }
    if let Some(l) = config {
        check(l.validate("lora"), c)?;
    }
    let origin = c.config.as_ref().map_or("--set".to_string(), |p| p.display().to_string());
    let origin = format!("{origin}: [lora]");
    Ok(Some(LoraSpec { config: config.clone(), adapter: adapter.clone(), origin, seed }))
}

fn check(result: std::result::Result<(), rltune::ConfigError>, c: &Common) -> Result<()> {
    let source = c.config.as_ref().map_or("--set".to_string(), |p| p.display().to_string());
    result.map_err(|m| anyhow::anyhow!("{source}: {m}"))
}

/// The checkpoint folder of `sft`, `reward` and `dpo`: `--checkpoint-dir`, or `OUTPUT.checkpoints`.
pub(crate) fn checkpoint_dir(explicit: &Option<PathBuf>, output: &Path) -> PathBuf {
    explicit.clone().unwrap_or_else(|| {
        let mut name = output.to_path_buf().into_os_string();
        name.push(".checkpoints");
        PathBuf::from(name)
    })
}

impl Common {
    /// The checkpoint folder: `--checkpoint-dir`, or `OUTPUT.checkpoints`.
    fn checkpoint_dir(&self) -> PathBuf {
        checkpoint_dir(&self.checkpoint_dir, &self.output)
    }
}

/// After a run of `steps` of `total`: true when it finished; when Ctrl-C stopped it, says where
/// its checkpoint is and how to resume, and gives false (the command then exits with status 130,
/// its output unsaved).
pub(crate) fn finished(steps: usize, total: usize, dir: &Path, main: bool) -> bool {
    if steps >= total {
        return true;
    }
    if main {
        eprintln!(
            "stopped after step {steps} of {total}; checkpoint in {}; the same command with --resume \
             continues it",
            dir.display()
        );
    }
    false
}

/// Runs `rltune sft`.
pub fn run_sft(args: SftArgs, dist: &Dist) -> Result<()> {
    let c = &args.common;
    let file: SftFile = settings(c)?;
    check(file.training.validate(), c)?;
    check(file.sft.validate(), c)?;
    let runtime = c.runtime.resolve_with(file.runtime.clone(), dist)?;
    let records = read_sft_data(&c.data.to_string_lossy(), &file.data)?;
    let origin = c.config.as_ref().map_or("--set".to_string(), |p| p.display().to_string());
    let lora = lora_spec(&file.lora, &args.adapter, c, file.training.seed)?;
    let mut model =
        SftModel::from_pretrained_adapted(&c.model, lora.as_ref(), runtime.dtype(), runtime.device())?;
    if let Some(k) = file.model.trainable_layers {
        model.lm = model.lm.freeze_trunk(&model.store, k).with_context(|| format!("{origin}: [model]"))?;
    }
    model.lm = model.lm.with_gradient_checkpointing(file.model.gradient_checkpointing);
    let mut cfg = file.sft;
    if let Some(max) = model.lm.config().max_positions() {
        fit_default(&mut cfg.max_length, SftConfig::default().max_length, max, "sft.max_length");
    }
    let progress = Bar::new("sft", dist.is_main());
    let (stop, dir) = (crate::ppo::stop_flag()?, c.checkpoint_dir());
    let ckpt = Checkpointing { dir: &dir, resume: c.resume, stop: Some(&stop) };
    let summary = sft::train_sft_with(&model, &records, &cfg, &file.training, dist, Some(ckpt), &mut |p| {
        progress.update(p)
    })?;
    progress.finish();
    if !finished(summary.steps, summary.total_steps, &dir, dist.is_main()) {
        std::process::exit(130);
    }
    // On several processes every one holds the same weights: rank 0 writes them.
    if dist.is_main() {
        model.save(&c.output)?;
        report(&summary, &c.output, true);
    }
    Ok(())
}

/// Runs `rltune reward`.
pub fn run_reward(args: RewardArgs, dist: &Dist) -> Result<()> {
    let c = &args.common;
    let file: RewardFile = settings(c)?;
    check(file.training.validate(), c)?;
    check(file.reward.validate(), c)?;
    let lora = lora_spec(&file.lora, &args.adapter, c, file.training.seed)?;
    if file.model.gradient_checkpointing {
        check(
            Err(rltune::ConfigError::new(
                "model",
                "gradient_checkpointing",
                "is not built for reward models (encoders and sequence classifiers); leave it out \
                 of `rltune reward`'s settings",
            )),
            c,
        )?;
    }
    if lora.is_some() && file.model.trainable_layers.is_some() {
        check(
            Err(rltune::ConfigError::new(
                "model",
                "trainable_layers",
                "with LoRA: the adapters already leave the encoder frozen; use one of [lora] (or \
                 --adapter) and trainable_layers",
            )),
            c,
        )?;
    }
    let runtime = c.runtime.resolve_with(file.runtime.clone(), dist)?;
    let records = read_reward_data(&c.data.to_string_lossy(), &file.data)?;
    let mut model = RewardModel::from_pretrained_for(
        &c.model,
        &records,
        file.training.seed,
        lora.as_ref(),
        runtime.dtype(),
        runtime.device(),
    )?;
    if let Some(k) = file.model.trainable_layers {
        let origin = c.config.as_ref().map_or("--set".to_string(), |p| p.display().to_string());
        model.model =
            model.model.freeze_trunk(&model.store, k).with_context(|| format!("{origin}: [model]"))?;
    }
    let mut cfg = file.reward;
    fit_default(
        &mut cfg.max_length,
        RewardConfig::default().max_length,
        model.max_positions(),
        "reward.max_length",
    );
    let progress = Bar::new("reward", dist.is_main());
    let (stop, dir) = (crate::ppo::stop_flag()?, c.checkpoint_dir());
    let ckpt = Checkpointing { dir: &dir, resume: c.resume, stop: Some(&stop) };
    let summary = reward_model::train_reward_model_with(
        &model,
        &records,
        &cfg,
        &file.training,
        dist,
        Some(ckpt),
        &mut |p| progress.update(p),
    )?;
    progress.finish();
    if !finished(summary.steps, summary.total_steps, &dir, dist.is_main()) {
        std::process::exit(130);
    }
    if dist.is_main() {
        model.save(&c.output)?;
        report(&summary, &c.output, false);
    }
    Ok(())
}

/// Lowers a length left at its default to what the model accepts (an explicit value that is too
/// large stays, and the trainer rejects it with a message).
fn fit_default(value: &mut usize, default: usize, model_max: usize, name: &str) {
    if *value == default && default > model_max {
        tracing::info!(
            "{name}: the default {default} exceeds the model's {model_max} positions; using {model_max}"
        );
        *value = model_max;
    }
}

fn report(s: &TrainSummary, out: &Path, perplexity: bool) {
    eprintln!(
        "{} steps on {} examples ({} held out, {} skipped); final train loss {:.4}",
        s.steps, s.train_examples, s.eval_examples, s.skipped_examples, s.train_loss
    );
    if let Some(e) = &s.eval {
        let ppl = match (perplexity, e.perplexity) {
            (true, Some(p)) => format!(", perplexity {p:.3}"),
            _ => String::new(),
        };
        eprintln!("eval: loss {:.4}{ppl}, accuracy {:.4} ({} examples)", e.loss, e.accuracy, e.examples);
    }
    eprintln!("saved {}", out.display());
}

/// A progress bar on a terminal, a line every 10% otherwise; nothing on the other ranks of a
/// data-parallel run.
pub struct Bar {
    what: &'static str,
    bar: Option<indicatif::ProgressBar>,
    main: bool,
}

impl Bar {
    /// A bar for a trainer, shown when `main` (one per run: rank 0's); its length is set by the
    /// first update.
    pub fn new(what: &'static str, main: bool) -> Self {
        use std::io::IsTerminal;
        let bar = (std::io::stderr().is_terminal() && main).then(|| {
            let bar = indicatif::ProgressBar::new(0);
            let template = format!(
                "{what:>10} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}} < {{eta_precise}}] {{msg}}"
            );
            bar.set_style(
                indicatif::ProgressStyle::with_template(&template)
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        Self { what, bar, main }
    }

    /// Shows `done` of `total` with a message.
    pub fn show(&self, done: usize, total: usize, msg: String) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(msg);
            }
            // One progress report per run: rank 0's, on several processes.
            None if !self.main => {}
            None => {
                let tenth = (total / 10).max(1);
                if done == total || done.is_multiple_of(tenth) {
                    eprintln!("{} step {done}/{total}: {msg}", self.what);
                }
            }
        }
    }

    fn update(&self, p: &TrainProgress) {
        let mut msg = format!("loss {:.4} lr {:.2e}", p.loss, p.lr);
        if let Some(e) = &p.eval {
            msg.push_str(&format!(" eval loss {:.4} acc {:.3}", e.loss, e.accuracy));
        }
        self.show(p.step, p.total_steps, msg);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
