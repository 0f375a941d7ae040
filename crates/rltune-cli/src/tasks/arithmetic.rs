//! `rltune quickstart --task arithmetic`: a verifiable-reward task that learns, offline.
//!
//! The stages, each cached in the output directory:
//! 1. **data**: every two-digit addition and subtraction (`37+48=` → `85`, `12-40=` → `-28`),
//!    shuffled; the first `heldout` problems are held out, the next `validation` decide when SFT
//!    stops, the rest train (`data/{heldout,validation,train}.jsonl`, rows `{"prompt",
//!    "answer"}`);
//! 2. **tokenizer**: one token per character (a byte-level BPE with no merges: BPE would merge
//!    digits into chunks that differ from number to number, hiding the digit-by-digit structure
//!    that addition has);
//! 3. **sft**: a fresh GPT-2 trained on (prompt, answer) with the loss on the answer, stopped
//!    on purpose once partly right (greedy validation accuracy ≥ `sft_target_accuracy`, checked
//!    every `sft_check_every` steps): RL needs rewards that differ within a group, and how many
//!    steps that takes varies with the seed (`sft-checks.json`);
//! 4. **grpo** (or **rloo**): `rltune ppo` with `[algorithm] kind = "grpo"` on the training
//!    prompts, the reward an exact match against the row's `answer` column;
//! 5. **eval**: greedy held-out accuracy of the SFT and the RL policy (and, for information,
//!    sampled accuracy at temperature 1 with a fixed seed).
//!
//! GRPO and RLOO share the stages up to SFT: `--algorithm rloo` in the same directory trains
//! from the same SFT policy into `DIR/rloo/`.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::bpe::train_bpe;
use super::pipeline::{
    check_shared, count_parameters, json_err, metric_pairs, new_gpt2, read_stage_jsonl, to_json,
    train_progress, write_file,
};
use super::{Check, Event};
use rltune::error::{Error, Result};
use rltune::generation::{generate, GenerationConfig};
use rltune::grpo::{GrpoConfig, RlooConfig};
use rltune::models::load::load_reference;
use rltune::rewards::exact_match::exact_match_scores;
use rltune::rewards::Extract;
use rltune::run::config::AlgorithmKind;
use rltune::run::{GroupRun, RunConfig, StepReport};
use rltune::runtime::Runtime;
use rltune::tokenizer::Tokenizer;
use rltune::train::data::SftRecord;
use rltune::train::sft::{self, SftConfig};
use rltune::train::{ScheduleKind, TrainingArgs};

/// The settings of the arithmetic quickstart (`DIR/quickstart.json`; `--set key=value`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArithmeticQuickstartConfig {
    /// Seed of every stage.
    pub seed: u64,
    /// Problems held out for evaluation (of 16 200).
    pub heldout: usize,
    /// Problems set aside (from the rest) to decide when SFT stops.
    pub validation: usize,
    /// Policy: GPT-2 width.
    pub policy_dim: usize,
    /// Policy layers.
    pub policy_layers: usize,
    /// Policy attention heads.
    pub policy_heads: usize,
    /// SFT: at most `max_steps` steps, stopped early on purpose (`sft_target_accuracy`).
    pub sft: TrainingArgs,
    /// SFT stops at the first check where greedy accuracy on the validation problems reaches
    /// this: the policy is then partly right, so the groups of RL hold right and wrong answers.
    pub sft_target_accuracy: f64,
    /// SFT steps between two checks (each a fresh Adam on the current weights).
    pub sft_check_every: usize,
    /// Tokens sampled per answer (3 characters and EOS fit in 4).
    pub max_new_tokens: usize,
    /// `grpo` or `rloo` (`--algorithm`).
    pub algorithm: AlgorithmKind,
    /// GRPO (TRL 1.16.0's names); the sampling keys follow `max_new_tokens` and temperature 1.
    pub grpo: GrpoConfig,
    /// RLOO (TRL 1.16.0's names).
    pub rloo: RlooConfig,
}

impl Default for ArithmeticQuickstartConfig {
    fn default() -> Self {
        let sft = TrainingArgs {
            learning_rate: 2e-3,
            // A cap: the target accuracy stops it first (seed 0 at 1200 steps: 31.5% held out;
            // 600: 7%, 2000: 66%; the steps it takes vary with the seed).
            max_steps: 3000,
            batch_size: 64,
            lr_scheduler_type: ScheduleKind::ConstantWithWarmup,
            warmup_steps: 20.0,
            eval_fraction: 0.0,
            seed: 1,
            ..TrainingArgs::default()
        };
        let grpo = GrpoConfig {
            learning_rate: 1e-4,
            num_generations: 8,
            per_device_train_batch_size: Some(256),
            // Seed 1: +10.9 points after 500 steps, +15.5 after 1000.
            max_steps: 1000,
            beta: 0.04,
            lr_scheduler_type: rltune::grpo::config::SchedulerType::Constant,
            seed: 3,
            ..GrpoConfig::default()
        };
        let rloo = RlooConfig {
            learning_rate: 1e-4,
            num_generations: 8,
            per_device_train_batch_size: Some(256),
            max_steps: 1000,
            beta: 0.04,
            lr_scheduler_type: rltune::grpo::config::SchedulerType::Constant,
            seed: 3,
            ..RlooConfig::default()
        };
        Self {
            seed: 0,
            heldout: 1000,
            validation: 500,
            policy_dim: 128,
            policy_layers: 3,
            policy_heads: 4,
            sft,
            sft_target_accuracy: 0.3,
            sft_check_every: 200,
            max_new_tokens: 5,
            algorithm: AlgorithmKind::Grpo,
            grpo,
            rloo,
        }
    }
}

impl ArithmeticQuickstartConfig {
    /// A run of seconds for tests: every stage, too small to learn anything.
    pub fn tiny() -> Self {
        let d = Self::default();
        let (grpo, rloo) = (d.grpo.clone(), d.rloo.clone());
        Self {
            heldout: 32,
            validation: 16,
            policy_dim: 32,
            policy_layers: 1,
            policy_heads: 2,
            sft: TrainingArgs { max_steps: 4, batch_size: 16, warmup_steps: 1.0, ..d.sft },
            sft_check_every: 2,
            grpo: GrpoConfig { max_steps: 2, per_device_train_batch_size: Some(16), ..grpo },
            rloo: RlooConfig { max_steps: 2, per_device_train_batch_size: Some(16), ..rloo },
            ..d
        }
    }
}

/// The settings only the RL stage reads: the demonstrations, the tokenizer and the SFT policy
/// depend on the rest (`quickstart.json`).
const RL_KEYS: [&str; 3] = ["algorithm", "grpo", "rloo"];

/// One problem: the prompt (`37+48=`) and its answer (`85`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// The question, ending in `=`.
    pub prompt: String,
    /// The exact answer.
    pub answer: String,
}

/// Every `a+b=` and `a-b=` with two-digit `a` and `b` (16 200 problems), shuffled by `seed`.
pub fn problems(seed: u64) -> Vec<Problem> {
    let mut out = Vec::with_capacity(2 * 90 * 90);
    for a in 10i32..100 {
        for b in 10i32..100 {
            out.push(Problem { prompt: format!("{a}+{b}="), answer: (a + b).to_string() });
            out.push(Problem { prompt: format!("{a}-{b}="), answer: (a - b).to_string() });
        }
    }
    out.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed ^ 0xa1d));
    out
}

/// Held-out accuracy of one policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    /// Greedy decoding: the fraction answered exactly.
    pub greedy: f64,
    /// Sampling at temperature 1 with a fixed seed: the fraction answered exactly.
    pub sampled: f64,
    /// Problems.
    pub n: usize,
    /// The first greedy answers, as `prompt answer` (✓ or ✗).
    pub samples: Vec<String>,
}

/// The arithmetic quickstart's results (`summary-<algorithm>.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArithmeticSummary {
    /// The configuration that produced them.
    pub config: ArithmeticQuickstartConfig,
    /// Policy parameters.
    pub policy_parameters: usize,
    /// Training problems.
    pub train_problems: usize,
    /// SFT: `(steps, greedy validation accuracy)` at each check; the last is where it stopped.
    pub sft_checks: Vec<(usize, f64)>,
    /// The SFT policy on the held-out problems.
    pub sft: Accuracy,
    /// The RL policy on the same problems.
    pub rl: Accuracy,
    /// Per RL step: `(step, reward, kl)`.
    pub curve: Vec<(usize, f64, f64)>,
    /// Wall time per stage in seconds (stages run this time).
    pub stage_seconds: Vec<(String, f64)>,
}

/// The least rise of held-out greedy accuracy that passes (10 points).
pub const MIN_ACCURACY_RISE: f64 = 0.10;

/// The largest 95th percentile over the steps of the per-token `kl` to the SFT policy that
/// passes, in nats. Not the maximum: one batch's estimate is heavy-tailed (k3 weighs a sampled
/// token the policy now finds unlikely by `exp(ref − logp)`, so a single token can lift a
/// step's mean): seed 1's GRPO run has a median of 0.09, a 95th percentile under 0.5 and one
/// step of 1000 at 8.3.
pub const MAX_KL: f64 = 1.0;

/// The largest mean of `kl` over the run's steps that passes, in nats per token.
pub const MAX_MEAN_KL: f64 = 0.5;

/// How far below 0 a step's `kl` may read: RLOO's is the k1 estimate `Σ m(old − ref) / Σ m`,
/// which single batches can put slightly below 0 (GRPO's k3 is never negative).
pub const KL_NOISE: f64 = 0.05;

impl ArithmeticSummary {
    /// The standard error of the rise (two independent proportions on `n` problems each; the
    /// same problems make it conservative).
    pub fn rise_std_error(&self) -> f64 {
        let (a, b, n) = (self.sft.greedy, self.rl.greedy, self.sft.n.max(1) as f64);
        ((a * (1.0 - a) + b * (1.0 - b)) / n).sqrt()
    }

    /// The acceptance criteria: greedy held-out accuracy rises by at least
    /// [`MIN_ACCURACY_RISE`] and by more than two standard errors; the per-token KL to the SFT
    /// policy is at least −[`KL_NOISE`] at every step, its 95th percentile over the steps at most
    /// [`MAX_KL`] and its mean at most [`MAX_MEAN_KL`].
    pub fn checks(&self) -> Vec<Check> {
        let (a, b) = (self.sft.greedy, self.rl.greedy);
        let (rise, se) = (b - a, self.rise_std_error());
        let mut kl: Vec<f64> = self.curve.iter().map(|c| c.2).filter(|k| k.is_finite()).collect();
        kl.sort_by(f64::total_cmp);
        let lo = kl.first().copied().unwrap_or(f64::NAN);
        let p95 = kl.get((kl.len() * 95).div_ceil(100).saturating_sub(1)).copied().unwrap_or(f64::NAN);
        let hi = kl.last().copied().unwrap_or(f64::NAN);
        let mean = kl.iter().sum::<f64>() / kl.len().max(1) as f64;
        let alg = self.config.algorithm.name().to_uppercase();
        vec![
            Check {
                what: format!(
                    "held-out greedy accuracy {:.1}% → {:.1}% ({alg}), +{:.1} points on {} problems; needed \
                     ≥ +{:.0} points and > 2 standard errors ({:.1} points)",
                    100.0 * a,
                    100.0 * b,
                    100.0 * rise,
                    self.sft.n,
                    100.0 * MIN_ACCURACY_RISE,
                    200.0 * se
                ),
                ok: rise >= MIN_ACCURACY_RISE && rise > 2.0 * se,
            },
            Check {
                what: format!(
                    "kl per token: min {lo:.4}, 95th percentile {p95:.4}, mean {mean:.4} (max {hi:.3}); \
                     needed min ≥ -{KL_NOISE}, 95th percentile ≤ {MAX_KL}, mean ≤ {MAX_MEAN_KL}"
                ),
                ok: !kl.is_empty() && lo >= -KL_NOISE && p95 <= MAX_KL && mean <= MAX_MEAN_KL,
            },
        ]
    }
}

/// Runs (or resumes) the arithmetic quickstart in `dir`.
pub fn run_arithmetic_quickstart(
    dir: &Path,
    cfg: &ArithmeticQuickstartConfig,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
) -> Result<ArithmeticSummary> {
    if !cfg.algorithm.is_group() {
        return Err(Error::Input(format!(
            "quickstart algorithm {:?}: the arithmetic task trains with \"grpo\" or \"rloo\"",
            cfg.algorithm.name()
        )));
    }
    cfg.sft.validate().map_err(|m| Error::Input(format!("quickstart sft: {m}")))?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    check_shared(&dir.join("quickstart.json"), cfg, &RL_KEYS)?;
    let mut seconds = Vec::new();
    let mut timed = |stage: &'static str, on: &mut dyn FnMut(Event), t: Instant| {
        let s = t.elapsed().as_secs_f64();
        on(Event::Done { stage, seconds: s });
        seconds.push((stage.to_string(), s));
    };

    // 1. Problems.
    let (train_path, heldout_path) = (dir.join("data/train.jsonl"), dir.join("data/heldout.jsonl"));
    let validation_path = dir.join("data/validation.jsonl");
    if heldout_path.is_file() && train_path.is_file() && validation_path.is_file() {
        on(Event::Cached { stage: "data", path: dir.join("data") });
    } else {
        let t = Instant::now();
        on(Event::Start { stage: "data", total: None });
        let all = problems(cfg.seed);
        let (h, v) = (cfg.heldout, cfg.validation);
        if h == 0 || v == 0 || h + v >= all.len() {
            return Err(Error::Input(format!(
                "quickstart heldout ({h}) and validation ({v}) must be positive and leave training \
                 problems of the {}",
                all.len()
            )));
        }
        write_problems(&heldout_path, &all[..h])?;
        write_problems(&validation_path, &all[h..h + v])?;
        write_problems(&train_path, &all[h + v..])?;
        timed("data", on, t);
    }
    let train: Vec<Problem> = read_stage_jsonl(&train_path)?;
    let heldout: Vec<Problem> = read_stage_jsonl(&heldout_path)?;
    let validation: Vec<Problem> = read_stage_jsonl(&validation_path)?;

    // 2. Tokenizer: one token per character.
    let tok_path = dir.join("tokenizer").join("tokenizer.json");
    if tok_path.is_file() {
        on(Event::Cached { stage: "tokenizer", path: tok_path.clone() });
    } else {
        let t = Instant::now();
        on(Event::Start { stage: "tokenizer", total: None });
        let texts = train.iter().map(|p| format!("{}{}", p.prompt, p.answer));
        // 256 bytes and EOS: no room for a merge.
        let tok = train_bpe(texts.collect::<Vec<_>>().into_iter(), 257, &[])?;
        tok.save(&tok_path)?;
        timed("tokenizer", on, t);
    }
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let probe = "12-40=-28";
    if tokenizer.encode(probe)?.len() != probe.len() {
        return Err(Error::Tokenizer(format!(
            "{}: expected one token per character; delete it to rebuild",
            tok_path.display()
        )));
    }

    // 3. SFT, stopped once partly right.
    let sft_dir = dir.join("sft");
    let checks_path = dir.join("sft-checks.json");
    if sft_dir.join("model.safetensors").is_file() && checks_path.is_file() {
        on(Event::Cached { stage: "sft", path: sft_dir.clone() });
    } else {
        let t = Instant::now();
        let checks = train_sft_partly(&train, &validation, &tokenizer, cfg, runtime, &sft_dir, on)?;
        write_file(&checks_path, to_json(&checks)?.as_bytes())?;
        timed("sft", on, t);
    }
    let sft_checks: Vec<(usize, f64)> = rltune::io::read_json(&checks_path)?;

    // 4. GRPO or RLOO from the SFT policy.
    let stage = cfg.algorithm.name();
    let run_config = rl_config(dir, cfg, runtime)?;
    let toml_path = dir.join(format!("{stage}.toml"));
    let toml = run_config.to_toml()?;
    let previous = std::fs::read_to_string(&toml_path).ok();
    let run_dir = run_config.logging.dir.clone();
    if previous.as_deref().is_some_and(|p| p != toml) && run_dir.exists() {
        return Err(Error::Input(format!(
            "{} holds a {stage} run with other settings ({}); delete {} to train again with these",
            run_dir.display(),
            toml_path.display(),
            run_dir.display()
        )));
    }
    write_file(&toml_path, toml.as_bytes())?;
    let steps = run_config.group_shape(train.len(), 1)?.steps;
    let final_ckpt = run_dir.join("checkpoints").join(format!("step-{steps}"));
    if final_ckpt.join("model.safetensors").is_file() {
        on(Event::Cached { stage, path: run_dir.clone() });
    } else {
        let t = Instant::now();
        let resume = rltune::run::checkpoint::latest_checkpoint(&run_dir)?.is_some();
        let mut run = GroupRun::prepare_on(run_config.clone(), runtime, Vec::new(), resume)?;
        on(Event::Start { stage, total: Some(steps) });
        let done = run.run(stop, &mut |r: &StepReport| {
            let message = format!("reward {:.3}{}", r.reward_mean, r.kl_text(4));
            on(Event::Progress { stage, done: r.step, message });
        })?;
        if done < steps {
            return Err(Error::Input(format!(
                "{stage} stopped after step {done} of {steps}; run the quickstart again to resume"
            )));
        }
        timed(stage, on, t);
    }

    // 5. Held-out accuracy before and after.
    let t = Instant::now();
    on(Event::Start { stage: "eval", total: None });
    let sft_acc = accuracy(&sft_dir, &heldout, &tokenizer, cfg, runtime)?;
    let rl_acc = accuracy(&final_ckpt, &heldout, &tokenizer, cfg, runtime)?;
    timed("eval", on, t);
    let store = rltune::params::ParamStore::load_safetensors(
        &[sft_dir.join("model.safetensors")],
        false,
        runtime.dtype(),
        runtime.device(),
    )?;
    let summary = ArithmeticSummary {
        config: cfg.clone(),
        policy_parameters: count_parameters(&store, |_| true)?,
        train_problems: train.len(),
        sft_checks,
        sft: sft_acc,
        rl: rl_acc,
        curve: metric_pairs(&run_dir.join("metrics.jsonl"), "reward", "kl")?,
        stage_seconds: seconds,
    };
    write_file(&dir.join(format!("summary-{stage}.json")), to_json(&summary)?.as_bytes())?;
    Ok(summary)
}

/// The RL stage's run config: `rltune ppo --config DIR/<algorithm>.toml` reruns it.
fn rl_config(dir: &Path, cfg: &ArithmeticQuickstartConfig, runtime: &Runtime) -> Result<RunConfig> {
    let abs = |p: PathBuf| p.to_string_lossy().into_owned();
    let kind = cfg.algorithm.name();
    let text = format!(
        r#"
[model]
path = {model:?}

[algorithm]
kind = "{kind}"

[data]
source = {data:?}
text_column = "prompt"

[[reward.sources]]
kind = "exact_match"
column = "answer"
extract = "first_line"

[generation]
max_new_tokens = {tokens}
seed = {seed}

[logging]
dir = {run:?}
samples_per_step = 4
report_every = 10

[checkpoint]
every = 50
optimizer_state = true
"#,
        model = abs(dir.join("sft")),
        data = abs(dir.join("data").join("train.jsonl")),
        tokens = cfg.max_new_tokens,
        seed = cfg.seed ^ 0x9e4,
        run = abs(dir.join(kind)),
    );
    let mut config = RunConfig::from_toml(&text, &dir.join(format!("{kind}.toml")), &[])?;
    // The active table, its sampling keys those of [generation].
    let g = &config.generation;
    if cfg.algorithm == AlgorithmKind::Rloo {
        config.rloo = RlooConfig {
            temperature: g.temperature,
            max_completion_length: g.max_new_tokens,
            top_p: g.top_p,
            top_k: g.top_k,
            ..cfg.rloo.clone()
        };
    } else {
        config.grpo = GrpoConfig {
            temperature: g.temperature,
            max_completion_length: g.max_new_tokens,
            top_p: g.top_p,
            top_k: g.top_k,
            ..cfg.grpo.clone()
        };
    }
    config.runtime = runtime.section();
    config.validate().map_err(|m| Error::Input(format!("quickstart {kind}: {m}")))?;
    Ok(config)
}

/// SFT of a fresh GPT-2 in rounds of `sft_check_every` steps, each followed by greedy accuracy
/// on `validation`; stops at `sft_target_accuracy` or `sft.max_steps` and saves the model in
/// `out`. Returns `(steps, accuracy)` per check.
fn train_sft_partly(
    train: &[Problem],
    validation: &[Problem],
    tokenizer: &Tokenizer,
    cfg: &ArithmeticQuickstartConfig,
    runtime: &Runtime,
    out: &Path,
    on: &mut dyn FnMut(Event),
) -> Result<Vec<(usize, f64)>> {
    let positions = 8 + cfg.max_new_tokens;
    let shape = (cfg.policy_dim, cfg.policy_layers, cfg.policy_heads, positions);
    let model = new_gpt2(tokenizer, shape, cfg.seed ^ 0xa7, runtime)?;
    let records: Vec<SftRecord> = train
        .iter()
        .map(|p| SftRecord::PromptCompletion { prompt: p.prompt.clone(), completion: p.answer.clone() })
        .collect();
    let max = cfg.sft.total_steps(records.len());
    let every = cfg.sft_check_every.max(1);
    on(Event::Start { stage: "sft", total: Some(max) });
    let sft_cfg = SftConfig {
        max_length: positions,
        completion_only_loss: true,
        add_eos: true,
        assistant_only_loss: false,
    };
    let (mut done, mut checks) = (0, Vec::new());
    while done < max {
        let steps = every.min(max - done);
        let args = TrainingArgs {
            max_steps: (steps) as i64,
            // Warm-up once; each round reshuffles with its own seed.
            warmup_steps: if done == 0 { cfg.sft.warmup_steps } else { 0.0 },
            seed: cfg.sft.seed.wrapping_add(done as u64),
            ..cfg.sft.clone()
        };
        {
            let mut progress = train_progress("sft", on);
            let offset = done;
            sft::train_sft(&model, &records, &sft_cfg, &args, &mut |p| {
                progress(&rltune::train::TrainProgress {
                    step: p.step + offset,
                    total_steps: max,
                    ..p.clone()
                })
            })?;
        }
        done += steps;
        let acc = accuracy_of(&model.lm, validation, tokenizer, cfg, runtime.device(), false)?.greedy;
        on(Event::Progress {
            stage: "sft",
            done,
            message: format!("validation accuracy {:.1}%", 100.0 * acc),
        });
        checks.push((done, acc));
        if acc >= cfg.sft_target_accuracy {
            break;
        }
    }
    model.save(out)?;
    Ok(checks)
}

/// Greedy and sampled held-out accuracy of the policy in `model`.
fn accuracy(
    model: &Path,
    problems: &[Problem],
    tokenizer: &Tokenizer,
    cfg: &ArithmeticQuickstartConfig,
    runtime: &Runtime,
) -> Result<Accuracy> {
    let device = runtime.device();
    let (_, lm) = load_reference(&model.to_string_lossy(), runtime.dtype(), device)?;
    accuracy_of(&lm, problems, tokenizer, cfg, device, true)
}

/// Greedy accuracy of `lm` on `problems`, and with `sampled` also at temperature 1 (fixed seed).
fn accuracy_of(
    lm: &rltune::models::CausalLm,
    problems: &[Problem],
    tokenizer: &Tokenizer,
    cfg: &ArithmeticQuickstartConfig,
    device: &candle_core::Device,
    sampled: bool,
) -> Result<Accuracy> {
    let prompts: Vec<Vec<u32>> =
        problems.iter().map(|p| tokenizer.encode(&p.prompt)).collect::<rltune::models::Result<_>>()?;
    let golds: Vec<&str> = problems.iter().map(|p| p.answer.as_str()).collect();
    let run = |top_k: usize| -> Result<(f64, Vec<String>)> {
        // top_k = 1 is greedy decoding.
        let gen = GenerationConfig {
            max_new_tokens: cfg.max_new_tokens,
            top_k,
            seed: cfg.seed ^ 0xe7a1,
            ..GenerationConfig::default()
        };
        let samples = generate(lm, None, &prompts, &gen, device)?;
        let answers: Vec<String> = samples
            .iter()
            .map(|s| tokenizer.decode(&s.response_ids))
            .collect::<rltune::models::Result<_>>()?;
        let refs: Vec<&str> = answers.iter().map(String::as_str).collect();
        let scores = exact_match_scores(&refs, &golds, Extract::FirstLine)?;
        let shown = problems
            .iter()
            .zip(&answers)
            .zip(&scores)
            .take(6)
            .map(|((p, a), &s)| format!("{}{} {}", p.prompt, a, if s == 1.0 { "✓" } else { "✗" }))
            .collect();
        Ok((scores.iter().map(|&s| f64::from(s)).sum::<f64>() / scores.len().max(1) as f64, shown))
    };
    let (greedy, samples) = run(1)?;
    let sampled = if sampled { run(0)?.0 } else { f64::NAN };
    Ok(Accuracy { greedy, sampled, n: problems.len(), samples })
}

fn write_problems(path: &Path, problems: &[Problem]) -> Result<()> {
    let mut text = String::new();
    for p in problems {
        text.push_str(&serde_json::to_string(p).map_err(json_err)?);
        text.push('\n');
    }
    write_file(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_every_two_digit_sum_and_difference_with_exact_answers() {
        rltune::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let p = problems(0);
        assert_eq!(p.len(), 16_200);
        assert_eq!(p, problems(0));
        assert_ne!(p, problems(1));
        for q in &p {
            let (lhs, _) = q.prompt.split_once('=').unwrap();
            let (a, b, sub) = match lhs.split_once('+') {
                Some((a, b)) => (a, b, false),
                None => {
                    let (a, b) = lhs.split_once('-').unwrap();
                    (a, b, true)
                }
            };
            let (a, b): (i32, i32) = (a.parse().unwrap(), b.parse().unwrap());
            assert_eq!(q.answer, if sub { a - b } else { a + b }.to_string(), "{q:?}");
            assert_eq!(q.prompt.len(), 6);
        }
    }

    /// `configs/arithmetic-{grpo,rloo}.toml` are the quickstart's RL stages (seed 0).
    #[test]
    fn the_example_configs_are_the_quickstart_rl_stages() {
        rltune::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let runtime = Runtime::resolve(&Default::default()).unwrap();
        for kind in [AlgorithmKind::Grpo, AlgorithmKind::Rloo] {
            let name = format!("../../configs/arithmetic-{}.toml", kind.name());
            let example = RunConfig::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join(name), &[]).unwrap();
            let cfg = ArithmeticQuickstartConfig { algorithm: kind, ..Default::default() };
            let ours = rl_config(Path::new("runs/quickstart-arithmetic"), &cfg, &runtime).unwrap();
            assert_eq!(example.algorithm, ours.algorithm);
            assert_eq!((&example.grpo, &example.rloo), (&ours.grpo, &ours.rloo), "{}", kind.name());
            assert_eq!((&example.generation, &example.reward), (&ours.generation, &ours.reward));
            assert_eq!(example.checkpoint, ours.checkpoint);
        }
    }

    fn summary(before: f64, after: f64, kl: &[f64]) -> ArithmeticSummary {
        let acc = |greedy| Accuracy { greedy, sampled: greedy, n: 1000, samples: Vec::new() };
        ArithmeticSummary {
            config: ArithmeticQuickstartConfig::tiny(),
            policy_parameters: 0,
            train_problems: 0,
            sft_checks: Vec::new(),
            sft: acc(before),
            rl: acc(after),
            curve: kl.iter().enumerate().map(|(i, &k)| (i + 1, 0.5, k)).collect(),
            stage_seconds: Vec::new(),
        }
    }

    #[test]
    fn acceptance_needs_ten_points_beyond_noise_and_a_bounded_kl() {
        rltune::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let ok = summary(0.30, 0.45, &[0.0, 0.02, 0.05]);
        assert!(ok.checks().iter().all(|c| c.ok), "{:?}", ok.checks());
        let flat = summary(0.30, 0.35, &[0.0, 0.02]);
        assert!(!flat.checks()[0].ok, "{:?}", flat.checks());
        // One spike in 20 steps passes (a heavy-tailed estimate); a drift does not.
        let mut kl = vec![0.1; 20];
        kl[7] = 8.0;
        let spike = summary(0.30, 0.50, &kl);
        assert!(spike.checks()[1].ok, "{:?}", spike.checks());
        kl[8] = 1.5;
        assert!(!summary(0.30, 0.50, &kl).checks()[1].ok, "two spikes in 20 steps");
        for kl in [[0.6, 0.6, 0.6, 0.6], [-0.1, 0.1, 0.1, 0.1]] {
            let drift = summary(0.30, 0.50, &kl);
            assert!(!drift.checks()[1].ok, "{:?}", drift.checks());
        }
        assert!(!summary(0.3, 0.5, &[]).checks()[1].ok);
    }
}
