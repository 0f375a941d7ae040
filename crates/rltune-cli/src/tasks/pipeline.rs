//! `rltune quickstart`: the whole RLHF pipeline, offline, on a synthetic task.
//!
//! Stages, each writing under the output directory and skipped when its output exists:
//!
//! | stage | output | what |
//! |---|---|---|
//! | corpus | `data/reviews.jsonl` | synthetic movie reviews labelled POSITIVE / NEGATIVE ([`super::corpus`]) |
//! | tokenizer | `tokenizer/tokenizer.json` | byte-level BPE trained on the corpus ([`super::bpe`]) |
//! | sft | `sft/` | a small GPT-2 trained from scratch on the reviews: the reference policy |
//! | classifier | `classifier/` | a small DistilBERT trained on the labels: the reward model |
//! | ppo | `ppo/` | PPO from the SFT policy toward POSITIVE, the classifier's logit as reward |
//! | eval | `summary.json` | before/after samples from held-out prompts, classified |
//!
//! The PPO stage is an ordinary `rltune ppo` run: its config is written to `ppo.toml` (re-run it
//! with `rltune ppo --config DIR/ppo.toml`), and its run directory holds `metrics.jsonl`,
//! `report.html`, `tb/` and `checkpoints/`. An interrupted PPO stage resumes from its last
//! checkpoint (checkpoints keep the optimizer state here).
//!
//! Everything is seeded; a rerun with the same [`QuickstartConfig`] reproduces every number.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::bpe::{train_bpe, EOS_TOKEN};
use super::corpus::generate_corpus;
use rltune::data::prompts::LengthSampler;
use rltune::engine::stats::mean_std;
use rltune::error::{Error, Result};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::distilbert::DistilBertConfig;
use rltune::models::gpt2::Gpt2Config;
use rltune::models::load::load_policy;
use rltune::params::ParamStore;
use rltune::ppo::PpoConfig;
use rltune::rewards::{
    ClassifierOutput, ClassifierReward, ClassifierRewardConfig, RewardInput, RewardSource,
};
use rltune::run::{self, PpoRun, RunConfig, StepReport};
use rltune::runtime::Runtime;
use rltune::tokenizer::Tokenizer;
use rltune::train::data::{Label, RewardRecord, SftRecord};
use rltune::train::reward_model::{self, RewardConfig, RewardModel};
use rltune::train::sft::{self, SftConfig, SftModel};
use rltune::train::{ScheduleKind, TrainProgress, TrainingArgs};

/// The classifier's special tokens, reserved in the shared BPE vocabulary after EOS.
const CLS: &str = "[CLS]";
const SEP: &str = "[SEP]";
const LABELS: [&str; 2] = ["NEGATIVE", "POSITIVE"];
/// How far below 0 a KL estimate may read and still count as 0 (float noise).
const KL_NOISE: f64 = 1e-3;

/// Sizes and budgets of the quickstart. [`QuickstartConfig::default`] is the README's run;
/// [`QuickstartConfig::tiny`] is a seconds-long version for tests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuickstartConfig {
    /// Seed of every stage.
    pub seed: u64,
    /// Reviews in the corpus (half positive).
    pub reviews: usize,
    /// BPE vocabulary size (EOS, `[CLS]`, `[SEP]` included).
    pub vocab_size: usize,
    /// Policy: GPT-2 width, layers, heads.
    pub policy_dim: usize,
    /// Policy layers.
    pub policy_layers: usize,
    /// Policy attention heads.
    pub policy_heads: usize,
    /// Longest review, in tokens, for SFT and the classifier.
    pub max_length: usize,
    /// SFT optimization.
    pub sft: TrainingArgs,
    /// Classifier: DistilBERT width and layers.
    pub classifier_dim: usize,
    /// Classifier layers.
    pub classifier_layers: usize,
    /// Classifier optimization.
    pub classifier: TrainingArgs,
    /// PPO hyper-parameters (`steps` is the number of PPO steps).
    pub ppo: PpoConfig,
    /// Prompt lengths in tokens: `[min, max)` (TRL's LengthSampler).
    pub query_tokens: (usize, usize),
    /// Tokens sampled per response.
    pub response_tokens: usize,
    /// Held-out prompts sampled before and after PPO for the summary.
    pub eval_samples: usize,
}

impl Default for QuickstartConfig {
    fn default() -> Self {
        let sft = TrainingArgs {
            learning_rate: 2e-3,
            // Half an epoch: the held-out loss stops improving after ~150 steps on this corpus.
            max_steps: 320,
            batch_size: 32,
            lr_scheduler_type: ScheduleKind::Cosine,
            warmup_ratio: 0.05,
            eval_fraction: 0.02,
            seed: 1,
            ..TrainingArgs::default()
        };
        let classifier = TrainingArgs {
            learning_rate: 1e-3,
            // About half an epoch of the 39k texts (reviews and prefixes).
            max_steps: 600,
            batch_size: 32,
            warmup_ratio: 0.05,
            eval_fraction: 0.05,
            seed: 2,
            ..TrainingArgs::default()
        };
        let ppo = PpoConfig {
            steps: 60,
            batch_size: 64,
            mini_batch_size: 16,
            ppo_epochs: 4,
            // 1e-4 reaches the same reward but KL peaks above 10; 5e-5 peaks at 6.6.
            learning_rate: 5e-5,
            seed: 3,
            ..PpoConfig::default()
        };
        Self {
            seed: 0,
            reviews: 20_000,
            vocab_size: 2048,
            policy_dim: 128,
            policy_layers: 4,
            policy_heads: 4,
            max_length: 96,
            sft,
            classifier_dim: 64,
            classifier_layers: 2,
            classifier,
            ppo,
            query_tokens: (2, 8),
            response_tokens: 24,
            eval_samples: 256,
        }
    }
}

impl QuickstartConfig {
    /// A run of a few seconds (tiny corpus and models, 3 PPO steps) for tests: it exercises
    /// every stage, not the acceptance numbers.
    pub fn tiny() -> Self {
        let d = Self::default();
        Self {
            reviews: 400,
            vocab_size: 300,
            policy_dim: 32,
            policy_layers: 1,
            policy_heads: 2,
            max_length: 48,
            sft: TrainingArgs { max_steps: 6, batch_size: 16, eval_fraction: 0.05, ..d.sft },
            classifier_dim: 16,
            classifier_layers: 1,
            classifier: TrainingArgs { max_steps: 6, batch_size: 16, ..d.classifier },
            ppo: PpoConfig { steps: 3, batch_size: 8, mini_batch_size: 4, ppo_epochs: 1, ..d.ppo },
            response_tokens: 6,
            eval_samples: 8,
            ..d
        }
    }
}

/// What the pipeline reports while it runs. `stage` is one of `corpus`, `tokenizer`, `sft`,
/// `classifier`, `ppo`, `eval`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A stage begins.
    Start {
        /// The stage.
        stage: &'static str,
        /// Its number of steps, when it counts steps.
        total: Option<usize>,
    },
    /// A stage's output exists already; the stage is skipped.
    Cached {
        /// The stage.
        stage: &'static str,
        /// Its output.
        path: PathBuf,
    },
    /// Progress within a stage.
    Progress {
        /// The stage.
        stage: &'static str,
        /// Steps done.
        done: usize,
        /// Loss, reward, KL…
        message: String,
    },
    /// A stage ended.
    Done {
        /// The stage.
        stage: &'static str,
        /// Its wall time.
        seconds: f64,
    },
}

/// Reward and sentiment of a batch of samples from held-out prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyEval {
    /// Mean reward (the classifier's POSITIVE logit on query + response).
    pub reward_mean: f64,
    /// Its standard deviation (unbiased).
    pub reward_std: f64,
    /// Fraction of samples the classifier calls POSITIVE (probability > 0.5).
    pub positive_fraction: f64,
    /// The first samples, as `query + response` text.
    pub samples: Vec<String>,
}

/// The quickstart's results (`summary.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The configuration that produced them.
    pub config: QuickstartConfig,
    /// Policy parameters (value head excluded).
    pub policy_parameters: usize,
    /// Classifier parameters.
    pub classifier_parameters: usize,
    /// Held-out next-token loss of the SFT policy.
    pub sft_eval_loss: Option<f64>,
    /// Held-out accuracy of the classifier.
    pub classifier_eval_accuracy: Option<f64>,
    /// One point per PPO step (skipped batches have NaN stats, written as null).
    pub ppo_curve: Vec<CurvePoint>,
    /// The SFT policy on held-out prompts.
    pub before: PolicyEval,
    /// The PPO policy on the same prompts and sampling seed.
    pub after: PolicyEval,
    /// Wall time per stage in seconds, for the stages run this time (cached ones are absent).
    pub stage_seconds: Vec<(String, f64)>,
}

/// The PPO curves at one step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// The step (1-based).
    pub step: usize,
    /// `env/reward_mean`.
    pub reward_mean: f64,
    /// `env/reward_std`.
    pub reward_std: f64,
    /// `objective/kl`.
    pub kl: f64,
    /// `objective/kl_coef`.
    pub kl_coef: f64,
}

/// One acceptance criterion of the quickstart and whether it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// What is checked, with the numbers.
    pub what: String,
    /// Whether it holds.
    pub ok: bool,
}

/// The smallest standardized rise of the mean reward that passes: Cohen's "large" effect.
pub const MIN_EFFECT_SIZE: f64 = 0.8;

impl Summary {
    /// The acceptance criteria:
    /// - the mean reward rose by a large effect: Cohen's d = rise / pooled std ≥ 0.8, where the
    ///   pooled std is √((σ_before² + σ_after²)/2) over the same held-out prompts;
    /// - at least 90% of samples classified positive after PPO;
    /// - `objective/kl` within [0, 10] at every step (−1e-3 counts as 0).
    ///
    /// The first check replaced "a rise of at least one initial std", which was ill-posed: the
    /// classifier's logit saturates (every seed's PPO policy ends near 3.5–4.1), so an SFT policy
    /// that starts mostly positive (seed 3: 60.9%, mean 0.87) has less room to rise than its own
    /// spread, and failed although it learned (60.9% → 96.9% positive). The pooled std also counts
    /// the trained policy's much narrower spread. Seeds 0–9 give d = 1.19–1.65; the SFT policy
    /// against itself gives d = 0 and fails, as do the positive-fraction check (43.8–60.9%).
    pub fn checks(&self) -> Vec<Check> {
        let (b, a) = (&self.before, &self.after);
        let rise = a.reward_mean - b.reward_mean;
        let pooled = ((b.reward_std.powi(2) + a.reward_std.powi(2)) / 2.0).sqrt();
        let d = if pooled > 0.0 { rise / pooled } else { 0.0 };
        let kl: Vec<f64> = self.ppo_curve.iter().map(|c| c.kl).filter(|k| k.is_finite()).collect();
        let (kl_min, kl_max) =
            kl.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &k| (lo.min(k), hi.max(k)));
        vec![
            Check {
                what: format!(
                    "mean reward rose by {rise:.3} ({:.3} → {:.3}), {d:.2} pooled stds ({pooled:.3}); \
                     needed ≥ {MIN_EFFECT_SIZE}",
                    b.reward_mean, a.reward_mean
                ),
                ok: d >= MIN_EFFECT_SIZE,
            },
            Check {
                what: format!(
                    "positive fraction {:.1}% → {:.1}%; needed ≥ 90%",
                    100.0 * b.positive_fraction,
                    100.0 * a.positive_fraction
                ),
                ok: a.positive_fraction >= 0.9,
            },
            Check {
                what: format!("objective/kl within [{kl_min:.4}, {kl_max:.3}]; needed within [0, 10]"),
                // At step 1 the policy is the reference and the estimate is 0 up to float noise
                // (cached rollout logprobs vs a full forward pass: about −3e-6).
                ok: !kl.is_empty() && kl_min >= -KL_NOISE && kl_max <= 10.0,
            },
        ]
    }
}

/// Runs (or resumes) the quickstart in `dir`. `stop` (Ctrl-C) ends the PPO stage after its
/// current step with a checkpoint, and the pipeline returns an error saying how to resume.
///
/// Every stage computes on `runtime` (the PPO stage's `ppo.toml` records its `[runtime]`).
pub fn run_quickstart(
    dir: &Path,
    cfg: &QuickstartConfig,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
) -> Result<Summary> {
    cfg.sft.validate().map_err(|m| Error::Input(format!("quickstart sft: {m}")))?;
    cfg.classifier.validate().map_err(|m| Error::Input(format!("quickstart classifier: {m}")))?;
    cfg.ppo.validate().map_err(|m| Error::Input(format!("quickstart ppo: {m}")))?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let config_path = dir.join("quickstart.json");
    check_same_config(&config_path, cfg)?;
    rltune::io::write_bytes_atomic(&config_path, to_json(cfg)?.as_bytes())?;
    let mut seconds = Vec::new();
    let mut timed = |stage: &'static str, on: &mut dyn FnMut(Event), t: Instant| {
        let s = t.elapsed().as_secs_f64();
        on(Event::Done { stage, seconds: s });
        seconds.push((stage.to_string(), s));
    };

    // 1. Corpus.
    let corpus_path = dir.join("data").join("reviews.jsonl");
    if corpus_path.is_file() {
        on(Event::Cached { stage: "corpus", path: corpus_path.clone() });
    } else {
        let t = Instant::now();
        on(Event::Start { stage: "corpus", total: None });
        let mut text = String::new();
        for r in generate_corpus(cfg.reviews, cfg.seed) {
            let label = LABELS[usize::from(r.positive)];
            text.push_str(&serde_json::json!({"text": r.text, "label": label}).to_string());
            text.push('\n');
        }
        write_file(&corpus_path, text.as_bytes())?;
        timed("corpus", on, t);
    }
    let reviews = read_reviews(&corpus_path)?;
    // The last `eval_samples` reviews give the held-out prompts of the before/after comparison.
    let n_eval = cfg.eval_samples.min(reviews.len() / 10).max(1);
    let (train, held_out) = reviews.split_at(reviews.len() - n_eval);

    // 2. Tokenizer.
    let tok_path = dir.join("tokenizer").join("tokenizer.json");
    if tok_path.is_file() {
        on(Event::Cached { stage: "tokenizer", path: tok_path.clone() });
    } else {
        let t = Instant::now();
        on(Event::Start { stage: "tokenizer", total: None });
        let tok = train_bpe(train.iter().map(|(text, _)| text.as_str()), cfg.vocab_size, &[CLS, SEP])?;
        tok.save(&tok_path)?;
        timed("tokenizer", on, t);
    }
    let tokenizer = Tokenizer::from_file(&tok_path)?;

    // 3. SFT: the reference policy.
    let sft_dir = dir.join("sft");
    let mut sft_eval_loss = None;
    if sft_dir.join("model.safetensors").is_file() {
        on(Event::Cached { stage: "sft", path: sft_dir.clone() });
    } else {
        let t = Instant::now();
        let model = new_policy(cfg, &tokenizer, runtime)?;
        let records: Vec<SftRecord> = train.iter().map(|(text, _)| SftRecord::Text(text.clone())).collect();
        let total =
            cfg.sft.total_steps(records.len() - (records.len() as f64 * cfg.sft.eval_fraction) as usize);
        on(Event::Start { stage: "sft", total: Some(total) });
        let sft_cfg = SftConfig {
            max_length: cfg.max_length,
            completion_only_loss: false,
            add_eos: true,
            assistant_only_loss: false,
        };
        let summary = sft::train_sft(&model, &records, &sft_cfg, &cfg.sft, &mut train_progress("sft", on))?;
        sft_eval_loss = summary.eval.as_ref().map(|e| e.loss);
        model.save(&sft_dir)?;
        timed("sft", on, t);
    }

    // 4. The classifier: the reward model.
    let cls_dir = dir.join("classifier");
    let mut classifier_eval_accuracy = None;
    if cls_dir.join("model.safetensors").is_file() {
        on(Event::Cached { stage: "classifier", path: cls_dir.clone() });
    } else {
        let t = Instant::now();
        let model = new_classifier(cfg, &tokenizer, runtime)?;
        let records = classifier_records(train, cfg.seed);
        let n_train = records.len() - (records.len() as f64 * cfg.classifier.eval_fraction) as usize;
        on(Event::Start { stage: "classifier", total: Some(cfg.classifier.total_steps(n_train)) });
        let rm_cfg = RewardConfig { max_length: cfg.max_length, ..RewardConfig::default() };
        let summary = reward_model::train_reward_model(
            &model,
            &records,
            &rm_cfg,
            &cfg.classifier,
            &mut train_progress("classifier", on),
        )?;
        classifier_eval_accuracy = summary.eval.as_ref().map(|e| e.accuracy);
        model.save(&cls_dir)?;
        timed("classifier", on, t);
    }

    // 5. PPO.
    let prompts_path = dir.join("data").join("prompts.jsonl");
    if !prompts_path.is_file() {
        let mut text = String::new();
        for (review, _) in train {
            text.push_str(&serde_json::json!({ "text": review }).to_string());
            text.push('\n');
        }
        write_file(&prompts_path, text.as_bytes())?;
    }
    let run_config = ppo_config(dir, cfg, runtime)?;
    let ppo_toml = dir.join("ppo.toml");
    write_file(&ppo_toml, run_config.to_toml()?.as_bytes())?;
    let final_ckpt = run_config.logging.dir.join("checkpoints").join(format!("step-{}", cfg.ppo.steps));
    if final_ckpt.join("model.safetensors").is_file() {
        on(Event::Cached { stage: "ppo", path: run_config.logging.dir.clone() });
    } else {
        let t = Instant::now();
        let resume = run::checkpoint::latest_checkpoint(&run_config.logging.dir)?.is_some();
        let mut ppo = PpoRun::prepare_on(run_config.clone(), runtime, Vec::new(), resume)?;
        on(Event::Start { stage: "ppo", total: Some(cfg.ppo.steps) });
        let done = ppo.run(stop, &mut |r: &StepReport| {
            let message = if r.skipped {
                "batch skipped (non-finite reward)".to_string()
            } else {
                format!("reward {:.3}  kl {:.3}", r.reward_mean, r.kl)
            };
            on(Event::Progress { stage: "ppo", done: r.step, message });
        })?;
        if done < cfg.ppo.steps {
            return Err(Error::Input(format!(
                "PPO stopped after step {done} of {}; run the quickstart again to resume from {}",
                cfg.ppo.steps,
                run_config.logging.dir.join("checkpoints").display()
            )));
        }
        timed("ppo", on, t);
    }

    // 6. Before/after evaluation.
    let t = Instant::now();
    on(Event::Start { stage: "eval", total: None });
    let prompts = eval_prompts(held_out, &tokenizer, cfg)?;
    let sft_dir_s = sft_dir.to_string_lossy().into_owned();
    let before = evaluate_policy(&sft_dir_s, &cls_dir, &prompts, &tokenizer, cfg, runtime)?;
    let after = evaluate_policy(&final_ckpt.to_string_lossy(), &cls_dir, &prompts, &tokenizer, cfg, runtime)?;
    timed("eval", on, t);

    let policy = load_policy(&sft_dir_s, false, runtime.dtype(), runtime.device())?;
    let policy_parameters = count_parameters(&policy.store, |n| !n.starts_with("v_head"))?;
    let classifier =
        RewardModel::from_pretrained(&cls_dir.to_string_lossy(), None, 0, runtime.dtype(), runtime.device())?;
    let classifier_parameters = count_parameters(&classifier.store, |_| true)?;
    let previous = read_previous_summary(&dir.join("summary.json"));
    let summary = Summary {
        config: cfg.clone(),
        policy_parameters,
        classifier_parameters,
        sft_eval_loss: sft_eval_loss.or(previous.as_ref().and_then(|p| p.sft_eval_loss)),
        classifier_eval_accuracy: classifier_eval_accuracy
            .or(previous.as_ref().and_then(|p| p.classifier_eval_accuracy)),
        ppo_curve: read_curve(&run_config.logging.dir.join("metrics.jsonl"))?,
        before,
        after,
        stage_seconds: seconds,
    };
    write_file(&dir.join("summary.json"), to_json(&summary)?.as_bytes())?;
    Ok(summary)
}

/// Refuses to mix stages made with another configuration in one directory.
pub(crate) fn check_same_config<T: serde::de::DeserializeOwned + PartialEq>(
    path: &Path,
    cfg: &T,
) -> Result<()> {
    if !path.is_file() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    match serde_json::from_str::<T>(&text) {
        Ok(old) if old == *cfg => Ok(()),
        _ => Err(Error::Input(format!(
            "{} was written by a quickstart with other settings; its cached stages would not match. \
             Use another --output directory, or delete this one",
            path.display()
        ))),
    }
}

/// Refuses to mix stages made with other settings in one directory: `path` (a quickstart's
/// `quickstart.json`) must hold `settings` but for `rl_keys`, or is written with them.
///
/// `rl_keys` are the settings only the RL stages read (the algorithms and their tables); each RL
/// stage checks them against its own saved config, so runs of several RL settings can share one
/// folder's demonstrations, tokenizer and supervised policy. A file written when some of them
/// were still kept here is read without them.
pub(crate) fn check_shared(path: &Path, settings: &impl Serialize, rl_keys: &[&str]) -> Result<()> {
    let strip = |mut v: serde_json::Value| {
        if let Some(o) = v.as_object_mut() {
            rl_keys.iter().for_each(|k| drop(o.remove(*k)));
        }
        v
    };
    let shared = strip(serde_json::to_value(settings).map_err(json_err)?);
    if path.is_file() {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        if serde_json::from_str::<serde_json::Value>(&text).ok().map(strip).as_ref() != Some(&shared) {
            return Err(Error::Input(format!(
                "{} was written by a quickstart with other settings; its cached stages would not match. \
                 Use another --output directory, or delete this one",
                path.display()
            )));
        }
        return Ok(());
    }
    write_file(path, to_json(&shared)?.as_bytes())
}

pub(crate) fn json_err(e: serde_json::Error) -> Error {
    Error::Input(format!("cannot serialize to JSON: {e}"))
}

pub(crate) fn to_json<T: Serialize>(value: &T) -> Result<String> {
    serde_json::to_string_pretty(value).map_err(json_err)
}

/// `rows` as JSON lines, written atomically.
pub(crate) fn write_jsonl<T: Serialize>(path: &Path, rows: &[T]) -> Result<()> {
    let mut text = String::new();
    for r in rows {
        text.push_str(&serde_json::to_string(r).map_err(json_err)?);
        text.push('\n');
    }
    write_file(path, text.as_bytes())
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    Ok(rltune::io::write_bytes_atomic(path, bytes)?)
}

/// `(text, label)` per line of `reviews.jsonl`.
fn read_reviews(path: &Path) -> Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            #[derive(Deserialize)]
            struct Row {
                text: String,
                label: String,
            }
            let row: Row = serde_json::from_str(line).map_err(|e| {
                Error::Input(format!(
                    "{} line {}: {e}; delete the file to regenerate it",
                    path.display(),
                    i + 1
                ))
            })?;
            Ok((row.text, row.label))
        })
        .collect()
}

/// A fresh GPT-2 over the BPE vocabulary, EOS = id 0.
fn new_policy(cfg: &QuickstartConfig, tokenizer: &Tokenizer, runtime: &Runtime) -> Result<SftModel> {
    let positions = cfg.max_length.max(cfg.query_tokens.1 + cfg.response_tokens);
    let shape = (cfg.policy_dim, cfg.policy_layers, cfg.policy_heads, positions);
    new_gpt2(tokenizer, shape, cfg.seed ^ 0x5f7, runtime)
}

/// A fresh GPT-2 of `(width, layers, heads, positions)` over a quickstart tokenizer, with EOS
/// (id 0) as its BOS and EOS, initialized from `seed`.
pub(crate) fn new_gpt2(
    tokenizer: &Tokenizer,
    (dim, layers, heads, positions): (usize, usize, usize, usize),
    seed: u64,
    runtime: &Runtime,
) -> Result<SftModel> {
    let mut g = Gpt2Config::tiny(tokenizer.vocab_size(), dim, layers, heads, positions);
    let eos = tokenizer
        .token_to_id(EOS_TOKEN)
        .ok_or_else(|| Error::Tokenizer(format!("the quickstart tokenizer has no {EOS_TOKEN}")))?;
    g.eos_token_id = Some(eos);
    g.bos_token_id = Some(eos);
    let mut json = serde_json::to_value(&g).map_err(json_err)?;
    json["model_type"] = "gpt2".into();
    json["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    let store = ParamStore::random(seed, true, runtime.dtype(), runtime.device())?;
    SftModel::new(store, json, tokenizer.clone())
}

/// A fresh DistilBERT classifier (NEGATIVE, POSITIVE) over the same BPE vocabulary; its
/// tokenizer wraps texts as `[CLS] … [SEP]`.
fn new_classifier(cfg: &QuickstartConfig, tokenizer: &Tokenizer, runtime: &Runtime) -> Result<RewardModel> {
    let mut d =
        DistilBertConfig::tiny(tokenizer.vocab_size(), cfg.classifier_dim, cfg.classifier_layers, 2, 2);
    d.max_position_embeddings = cfg.max_length + 2;
    let mut json = serde_json::to_value(&d).map_err(json_err)?;
    json["model_type"] = "distilbert".into();
    json["architectures"] = serde_json::json!(["DistilBertForSequenceClassification"]);
    json["pad_token_id"] = 0.into();
    let labels: Vec<String> = LABELS.iter().map(|s| s.to_string()).collect();
    let json = reward_model::with_labels(json, &labels)?;
    let store = ParamStore::random(cfg.seed ^ 0xc1a55, true, runtime.dtype(), runtime.device())?;
    RewardModel::new(store, json, classifier_tokenizer(tokenizer)?)
}

/// The classifier's training texts: every review, and a prefix of it (4 to 19 words) with the
/// same label. PPO scores prompts plus 24 sampled tokens, usually a review's opening without
/// its verdict; trained on whole reviews only, the classifier calls every opening with one
/// sentiment word ±4.5 (its loss reaches 0 on the verdicts), which leaves PPO no signal
/// beyond "one positive word". Prefixes, whose label is often not yet visible, teach it a
/// graded score: more and stronger evidence, a larger logit.
fn classifier_records(train: &[(String, String)], seed: u64) -> Vec<RewardRecord> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x9ef1);
    let mut out = Vec::with_capacity(2 * train.len());
    for (text, label) in train {
        out.push(RewardRecord::Labelled { text: text.clone(), label: Label::Name(label.clone()) });
        let words: Vec<&str> = text.split_whitespace().collect();
        let k = rng.gen_range(4..20).min(words.len());
        out.push(RewardRecord::Labelled { text: words[..k].join(" "), label: Label::Name(label.clone()) });
    }
    out
}

/// The BPE tokenizer with BERT's `[CLS] $A [SEP]` template.
fn classifier_tokenizer(tokenizer: &Tokenizer) -> Result<Tokenizer> {
    use tokenizers::processors::template::TemplateProcessing;
    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .ok_or_else(|| Error::Tokenizer(format!("the quickstart tokenizer has no {t}")))
    };
    let template = TemplateProcessing::builder()
        .try_single(format!("{CLS} $A {SEP}"))
        .and_then(|b| b.try_pair(format!("{CLS} $A {SEP} $B:1 {SEP}:1")))
        .map_err(|e| Error::Tokenizer(format!("classifier template: {e}")))?
        .special_tokens(vec![(CLS, id(CLS)?), (SEP, id(SEP)?)])
        .build()
        .map_err(|e| Error::Tokenizer(format!("classifier template: {e}")))?;
    let mut inner = tokenizer.inner().clone();
    inner.with_post_processor(Some(template));
    Ok(Tokenizer::from_inner(inner))
}

/// `rltune ppo`'s config for the PPO stage.
fn ppo_config(dir: &Path, cfg: &QuickstartConfig, runtime: &Runtime) -> Result<RunConfig> {
    let abs = |p: PathBuf| p.to_string_lossy().into_owned();
    let text = format!(
        r#"
[model]
path = {model:?}

[data]
source = {data:?}
min_query_tokens = {qmin}
max_query_tokens = {qmax}

[[reward.sources]]
kind = "classifier"
model = {classifier:?}
label = "POSITIVE"
output = "logit"
batch_size = 64

[generation]
max_new_tokens = {resp}
seed = {seed}

[logging]
dir = {run:?}
samples_per_step = 4
report_every = 10

[checkpoint]
every = 10
optimizer_state = true
"#,
        model = abs(dir.join("sft")),
        data = abs(dir.join("data").join("prompts.jsonl")),
        qmin = cfg.query_tokens.0,
        qmax = cfg.query_tokens.1,
        classifier = abs(dir.join("classifier")),
        resp = cfg.response_tokens,
        seed = cfg.seed ^ 0x9e4,
        run = abs(dir.join("ppo")),
    );
    let mut config = RunConfig::from_toml(&text, &dir.join("ppo.toml"), &[])?;
    config.ppo = cfg.ppo.clone();
    config.runtime = runtime.section();
    config.validate().map_err(|m| Error::Input(format!("quickstart ppo: {m}")))?;
    Ok(config)
}

/// One query per held-out review: its first tokens, lengths drawn as in PPO.
fn eval_prompts(
    held_out: &[(String, String)],
    tokenizer: &Tokenizer,
    cfg: &QuickstartConfig,
) -> Result<Vec<Vec<u32>>> {
    use rand::SeedableRng;
    let sampler = LengthSampler::new(cfg.query_tokens.0, cfg.query_tokens.1)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed ^ 0xe7a1);
    held_out
        .iter()
        .map(|(text, _)| {
            let ids = tokenizer.encode(text)?;
            Ok(ids[..ids.len().min(sampler.sample(&mut rng))].to_vec())
        })
        .collect()
}

/// Samples from the policy in `model` on `prompts` (fixed seed) and classifies query + response.
fn evaluate_policy(
    model: &str,
    classifier: &Path,
    prompts: &[Vec<u32>],
    tokenizer: &Tokenizer,
    cfg: &QuickstartConfig,
    runtime: &Runtime,
) -> Result<PolicyEval> {
    let device = runtime.device();
    let policy = load_policy(model, false, runtime.dtype(), device)?;
    let gen = GenerationConfig {
        max_new_tokens: cfg.response_tokens,
        seed: cfg.seed ^ 0xe7a1,
        ..GenerationConfig::default()
    };
    let samples = generate(&policy.model.lm, None, prompts, &gen, device)?;
    let texts: Vec<(String, String)> = samples
        .iter()
        .map(|s| Ok((tokenizer.decode(&s.query_ids)?, tokenizer.decode(&s.response_ids)?)))
        .collect::<Result<_>>()?;
    let inputs: Vec<RewardInput> = texts.iter().map(|(q, r)| RewardInput::text(q, r)).collect();
    let classifier = classifier.to_string_lossy();
    let score = |output| -> Result<Vec<f32>> {
        let c = ClassifierRewardConfig { output, batch_size: 64, ..ClassifierRewardConfig::default() };
        ClassifierReward::from_pretrained(&classifier, c, runtime.dtype(), device)?.score(&inputs)
    };
    let logits: Vec<f64> = score(ClassifierOutput::Logit)?.into_iter().map(f64::from).collect();
    let probs = score(ClassifierOutput::Probability)?;
    let (reward_mean, reward_std) = mean_std(&logits);
    Ok(PolicyEval {
        reward_mean,
        reward_std,
        positive_fraction: probs.iter().filter(|&&p| p > 0.5).count() as f64 / probs.len().max(1) as f64,
        samples: texts.iter().take(4).map(|(q, r)| format!("{q}{r}")).collect(),
    })
}

pub(crate) fn count_parameters(store: &ParamStore, keep: impl Fn(&str) -> bool) -> Result<usize> {
    Ok(store.snapshot()?.iter().filter(|(n, _)| keep(n)).map(|(_, t)| t.elem_count()).sum())
}

fn read_previous_summary(path: &Path) -> Option<Summary> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// The curve points of metrics.jsonl.
fn read_curve(path: &Path) -> Result<Vec<CurvePoint>> {
    Ok(metric_lines(path)?
        .into_iter()
        .map(|(step, v)| {
            let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
            CurvePoint {
                step,
                reward_mean: f("env/reward_mean"),
                reward_std: f("env/reward_std"),
                kl: f("objective/kl"),
                kl_coef: f("objective/kl_coef"),
            }
        })
        .collect())
}

/// Each line of a run's metrics.jsonl with its step (the line's `step`, else its line number).
pub(crate) fn metric_lines(path: &Path) -> Result<Vec<(usize, serde_json::Value)>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Error::Input(format!("{} line {}: {e}", path.display(), i + 1)))?;
        let step = v.get("step").and_then(serde_json::Value::as_u64).unwrap_or(i as u64 + 1) as usize;
        out.push((step, v));
    }
    Ok(out)
}

/// The rows of a JSON-lines file that a stage wrote (blank lines skipped); a bad line is an error
/// naming it, with the fix (delete the file so the stage writes it again).
pub(crate) fn read_stage_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                Error::Input(format!(
                    "{} line {}: {e}; delete the file to regenerate it",
                    path.display(),
                    i + 1
                ))
            })
        })
        .collect()
}

/// `(step, v[a], v[b])` per line of a metrics.jsonl (NaN where a key is missing).
pub(crate) fn metric_pairs(path: &Path, a: &str, b: &str) -> Result<Vec<(usize, f64, f64)>> {
    Ok(metric_lines(path)?
        .into_iter()
        .map(|(step, v)| {
            let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
            (step, f(a), f(b))
        })
        .collect())
}

/// A progress callback for the supervised trainers.
pub(crate) fn train_progress<'a>(
    stage: &'static str,
    on: &'a mut dyn FnMut(Event),
) -> impl FnMut(&TrainProgress) + 'a {
    move |p: &TrainProgress| {
        let mut message = format!("loss {:.3}", p.loss);
        if let Some(e) = &p.eval {
            message.push_str(&format!("  eval loss {:.3}  acc {:.3}", e.loss, e.accuracy));
        }
        on(Event::Progress { stage, done: p.step, message });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(reward_mean: f64, reward_std: f64, positive_fraction: f64) -> PolicyEval {
        PolicyEval { reward_mean, reward_std, positive_fraction, samples: Vec::new() }
    }

    fn summary(before: PolicyEval, after: PolicyEval) -> Summary {
        let kl = [0.0, 2.0, 4.0];
        Summary {
            config: QuickstartConfig::tiny(),
            policy_parameters: 0,
            classifier_parameters: 0,
            sft_eval_loss: None,
            classifier_eval_accuracy: None,
            ppo_curve: kl
                .iter()
                .enumerate()
                .map(|(i, &kl)| CurvePoint {
                    step: i + 1,
                    reward_mean: 0.0,
                    reward_std: 1.0,
                    kl,
                    kl_coef: 0.2,
                })
                .collect(),
            before,
            after,
            stage_seconds: Vec::new(),
        }
    }

    /// Regression (issue #28, defect 9): seed 3 learned (60.9% → 96.9% positive) but failed
    /// "rise ≥ one initial std"; the pooled-std effect size passes it, and fails the SFT policy
    /// measured against itself.
    #[test]
    fn acceptance_passes_seed_3_and_fails_a_policy_that_did_not_learn() {
        rltune::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
        let seed3 = summary(eval(0.866, 3.358, 0.609), eval(3.879, 1.246, 0.969));
        assert!(seed3.checks().iter().all(|c| c.ok), "{:?}", seed3.checks());
        let sft = eval(0.866, 3.358, 0.609);
        let unlearned = summary(sft.clone(), sft);
        let failed: Vec<bool> = unlearned.checks().iter().map(|c| !c.ok).collect();
        assert_eq!(failed, [true, true, false], "{:?}", unlearned.checks());
        // A small rise with the SFT policy's spread is no large effect either.
        let small = summary(eval(0.0, 3.0, 0.5), eval(2.0, 3.0, 0.95));
        assert!(!small.checks()[0].ok, "{:?}", small.checks());
    }
}
