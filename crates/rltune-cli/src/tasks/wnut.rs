//! `rltune quickstart --task wnut`: RL on entity-level F1 for real data, WNUT-2016 Twitter NER
//! (`tools/data/fetch_wnut.sh` fetches it into `target/data/wnut16/ner.txt`).
//!
//! The LM labels **token by token** ([`rltune::envs::ner`]): one turn per token, the action a
//! BIO tag, the reward the tweet's entity F1 (dense: the change of the prefix F1, which sums to
//! it). Generating the whole tag sequence in one response was the alternative; token by token
//! reuses the agent pipeline unchanged, gives every tag the tweet and the tags so far, and keeps
//! each response a few tokens long.
//!
//! The stages ([`super::agent::train_agent`]): gold tags of the training tweets as
//! demonstrations, BPE, BC (cross-entropy on the gold tag), PPO with the KL to the BC policy;
//! then **bc-longer**: the BC policy trained on the same demonstrations for as many more
//! optimizer steps as PPO took (`ppo.steps · ppo_epochs · batch_size / mini_batch_size`), so
//! that PPO's gain is not only extra training; then the evaluation of a lexicon baseline (each
//! token's most frequent training tag), BC, BC trained longer and PPO on every held-out tweet
//! (every fifth), by micro entity F1 over the held-out set with a bootstrap standard error.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::agent::{fit_prompts, train_agent, AgentGames, AgentQuickstartConfig, TrainedAgent};
use super::pipeline::{read_stage_jsonl, to_json, train_progress, write_file, Check, Event};
use rltune::agent::config::{EnvKind, EnvSection, Split};
use rltune::agent::model_agent::ModelAgent;
use rltune::envs::adventure::{heldout_seed, train_seed};
use rltune::envs::demos::Demonstration;
use rltune::envs::ner::{Ner, NerConfig, NerData};
use rltune::envs::play::{action_text, play, Agent, Episode, Pending, PromptTemplate};
use rltune::envs::{Reset, TextEnv};
use rltune::error::{Error, Result};
use rltune::generation::GenerationConfig;
use rltune::models::load::load_policy;
use rltune::ppo::PpoConfig;
use rltune::rewards::metrics::bio::{sequence_counts, Prf};
use rltune::rewards::metrics::mean_se;
use rltune::run::config::EpisodesSection;
use rltune::runtime::Runtime;
use rltune::train::data::SftRecord;
use rltune::train::sft::{self, SftConfig, SftModel};
use rltune::train::{ScheduleKind, TrainingArgs};

/// The settings of the WNUT quickstart (`DIR/quickstart.json`; `--set key=value`).
pub type WnutQuickstartConfig = AgentQuickstartConfig<NerConfig>;

impl AgentGames for NerConfig {
    fn check(&self) -> Result<()> {
        if Path::new(&self.file).is_file() {
            Ok(())
        } else {
            Err(Error::Input(format!(
                "{}: not found; run tools/data/fetch_wnut.sh (or --set game.file=PATH)",
                self.file
            )))
        }
    }

    fn env_section(&self, split: Split, num_envs: usize, max_steps: usize) -> EnvSection {
        EnvSection {
            kind: EnvKind::Ner,
            num_envs,
            max_steps,
            split,
            ner: self.clone(),
            ..EnvSection::default()
        }
    }

    /// Training tweets in order: seed i tags training tweet i (mod their number).
    fn demo_env(
        &self,
        _seed: u64,
        episodes: usize,
        max_steps: usize,
    ) -> Result<(Box<dyn TextEnv>, Vec<Reset>)> {
        let env = Ner::from_config(1, self, Path::new("."), max_steps)?;
        let resets = (0..episodes as u64).map(|i| Reset { seed: Some(train_seed(i)), game: None }).collect();
        Ok((Box::new(env), resets))
    }
}

impl Default for AgentQuickstartConfig<NerConfig> {
    fn default() -> Self {
        let bc = TrainingArgs {
            learning_rate: 2e-3,
            max_steps: Some(600),
            batch_size: 32,
            lr_scheduler_type: ScheduleKind::Cosine,
            warmup_ratio: 0.05,
            eval_fraction: 0.02,
            seed: 1,
            ..TrainingArgs::default()
        };
        let ppo = PpoConfig {
            steps: 20,
            batch_size: 128,
            mini_batch_size: 32,
            ppo_epochs: 4,
            // The essays quickstart's settings (docs/rl-on-metrics.md): lr 5e-5, the value head
            // detached from the LM, each tag credited with its own change of the prefix F1.
            learning_rate: 5e-5,
            init_kl_coef: 0.05,
            detach_value_head: true,
            seed: 3,
            ..PpoConfig::default()
        };
        let episodes = EpisodesSection { game_gamma: 0.0, eval_every: 0, ..EpisodesSection::default() };
        Self {
            seed: 0,
            game: NerConfig { dense_reward: true, ..NerConfig::default() },
            // 2394 tweets, 478 held out: one pass over the 1916 training tweets.
            demo_games: 1916,
            demo_noise: 0.05,
            vocab_size: 2048,
            policy_dim: 128,
            policy_layers: 4,
            policy_heads: 4,
            context: 256,
            agent: PromptTemplate {
                memory_turns: 0,
                show_admissible: false,
                show_inventory: false,
                instruction: "Tag:\n>".into(),
                ..PromptTemplate::default()
            },
            max_new_tokens: 6,
            max_steps: 128,
            num_envs: 8,
            bc,
            ppo,
            episodes,
            eval_episodes: 478,
            algorithm: Default::default(),
            grpo: super::agent::agent_grpo(),
            rloo: super::agent::agent_rloo(),
        }
    }
}

impl AgentQuickstartConfig<NerConfig> {
    /// A run of seconds for tests: every stage, too small to learn anything.
    pub fn tiny() -> Self {
        let d = Self::default();
        Self {
            demo_games: 10,
            vocab_size: 400,
            policy_dim: 32,
            policy_layers: 1,
            policy_heads: 2,
            num_envs: 2,
            bc: TrainingArgs { max_steps: Some(4), batch_size: 8, ..d.bc },
            ppo: PpoConfig { steps: 1, batch_size: 16, mini_batch_size: 8, ppo_epochs: 1, ..d.ppo },
            eval_episodes: 6,
            ..d
        }
    }

    /// The optimizer steps PPO took: what `bc-longer` adds to BC.
    pub fn ppo_optimizer_steps(&self) -> usize {
        self.ppo.steps * self.ppo.ppo_epochs * self.ppo.batch_size.div_ceil(self.ppo.mini_batch_size.max(1))
    }
}

/// One agent's held-out scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NerEval {
    /// Tweets tagged.
    pub sentences: usize,
    /// Micro entity scores over all of them.
    pub micro: Prf,
    /// Bootstrap standard error of the micro F1 (1000 resamples of the tweets).
    pub f1_se: f64,
    /// Mean per-tweet reward (1 for a tweet with no entity and none predicted) and its SE.
    pub mean_reward: (f64, f64),
    /// Tags that were not a valid tag.
    pub invalid_rate: f64,
}

impl NerEval {
    /// The scores of finished episodes on `data`'s held-out tweets.
    pub fn of(episodes: &[Episode], data: &NerData, seed: u64) -> Self {
        let counts: Vec<(usize, usize, usize)> = episodes
            .iter()
            .map(|e| {
                let gold = &data.sentence(e.seed.unwrap_or(0)).tags;
                let mut pred: Vec<String> = e.turns.iter().map(|t| tag_of(&t.action, data)).collect();
                pred.resize(gold.len(), "O".into());
                sequence_counts(gold, &pred)
            })
            .collect();
        let sum = |idx: &[usize]| {
            let (mut a, mut b, mut c) = (0, 0, 0);
            for &i in idx {
                a += counts[i].0;
                b += counts[i].1;
                c += counts[i].2;
            }
            Prf::of(a, b, c)
        };
        let all: Vec<usize> = (0..counts.len()).collect();
        let micro = sum(&all);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let boots: Vec<f64> = (0..1000)
            .map(|_| {
                let idx: Vec<usize> =
                    (0..counts.len()).map(|_| rng.gen_range(0..counts.len().max(1))).collect();
                sum(&idx).f1
            })
            .collect();
        let (_, sd_over_sqrt) = mean_se(&boots);
        // mean_se divides by √1000: the bootstrap SE is the spread of the resampled F1s itself.
        let f1_se = if counts.is_empty() { f64::NAN } else { sd_over_sqrt * (boots.len() as f64).sqrt() };
        let turns: usize = episodes.iter().map(|e| e.steps).sum();
        let invalid: usize = episodes.iter().map(|e| e.invalid_actions).sum();
        Self {
            sentences: episodes.len(),
            micro,
            f1_se,
            mean_reward: mean_se(&episodes.iter().map(|e| e.score).collect::<Vec<_>>()),
            invalid_rate: invalid as f64 / turns.max(1) as f64,
        }
    }
}

/// The tag an action gives (`O` for anything that is not one of `data`'s tags).
fn tag_of(action: &str, data: &NerData) -> String {
    let a = action.trim();
    if data.tags.iter().any(|t| t == a) {
        a.to_string()
    } else {
        "O".into()
    }
}

/// The lexicon baseline: each token's most frequent tag in the training tweets (`O` for unseen
/// tokens), an `I-X` that follows no `B-X`/`I-X` turned into `B-X`.
#[derive(Debug, Clone)]
pub struct LexiconAgent {
    best: std::collections::HashMap<String, String>,
}

impl LexiconAgent {
    /// Counts the training tweets of `data`.
    pub fn new(data: &NerData) -> Self {
        let mut counts: std::collections::HashMap<String, std::collections::BTreeMap<String, usize>> =
            Default::default();
        for s in &data.train {
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
}

impl Agent for LexiconAgent {
    fn act(&mut self, states: &[Pending]) -> rltune::envs::Result<Vec<String>> {
        Ok(states
            .iter()
            .map(|&Pending { state: s, turns: memory, .. }| {
                let token = s.observation.lines().find_map(|l| l.strip_prefix("Token: ")).unwrap_or("");
                let tag = self.best.get(token).cloned().unwrap_or_else(|| "O".into());
                match tag.strip_prefix("I-") {
                    Some(kind) => {
                        let prev = memory.last().map(|t| t.action.as_str()).unwrap_or("O");
                        if prev.get(2..) == Some(kind) && prev != "O" {
                            tag
                        } else {
                            format!("B-{kind}")
                        }
                    }
                    None => tag,
                }
            })
            .collect())
    }
}

/// The WNUT quickstart's results (`summary-wnut.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WnutSummary {
    /// The configuration that produced them.
    pub config: WnutQuickstartConfig,
    /// Training and held-out tweets.
    pub tweets: (usize, usize),
    /// Held-out scores: lexicon, BC, BC trained longer, PPO.
    pub agents: Vec<(String, NerEval)>,
    /// Optimizer steps added to BC for `BC (longer)`.
    pub bc_extra_steps: usize,
    /// Wall time per stage in seconds (stages run this time).
    pub stage_seconds: Vec<(String, f64)>,
}

impl WnutSummary {
    /// Informational checks: PPO's held-out micro F1 against BC's and BC trained longer's, by
    /// more than two standard errors (not enforced: the issue asks for the numbers).
    pub fn checks(&self) -> Vec<Check> {
        let get = |n: &str| self.agents.iter().find(|(a, _)| a == n).map(|(_, e)| e.clone());
        let (Some(ppo), Some(bc), Some(longer)) = (get("PPO"), get("BC"), get("BC (longer)")) else {
            return Vec::new();
        };
        [("BC", bc), ("BC (longer)", longer)]
            .into_iter()
            .map(|(name, other)| {
                let se = (ppo.f1_se.powi(2) + other.f1_se.powi(2)).sqrt();
                let d = ppo.micro.f1 - other.micro.f1;
                Check {
                    what: format!(
                        "held-out entity F1: PPO {:.3} vs {name} {:.3}, difference {d:+.3}; > 2 SE = {:.3}",
                        ppo.micro.f1,
                        other.micro.f1,
                        2.0 * se
                    ),
                    ok: d > 2.0 * se,
                }
            })
            .collect()
    }
}

/// Runs (or resumes) the WNUT quickstart in `dir`.
pub fn run_wnut_quickstart(
    dir: &Path,
    cfg: &WnutQuickstartConfig,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
) -> Result<WnutSummary> {
    cfg.game.check()?;
    // An absolute path, so that DIR/ppo.toml reruns from anywhere.
    let mut cfg = cfg.clone();
    let file = Path::new(&cfg.game.file);
    cfg.game.file = file.canonicalize().map_err(|e| Error::io(file, e))?.to_string_lossy().into_owned();
    let cfg = &cfg;
    let data = Arc::new(NerData::load(Path::new(&cfg.game.file), cfg.game.heldout_every)?);
    let TrainedAgent { tokenizer, bc_dir, ppo_dir, run_config, mut seconds, .. } =
        train_agent(dir, cfg, runtime, stop, on)?;
    let (dtype, device) = (runtime.dtype(), runtime.device());

    // BC trained longer: as many more optimizer steps as PPO took, from the BC policy.
    let extra = cfg.ppo_optimizer_steps();
    let longer_dir = dir.join("bc-longer");
    if longer_dir.join("model.safetensors").is_file() {
        on(Event::Cached { stage: "bc-longer", path: longer_dir.clone() });
    } else {
        let t = Instant::now();
        on(Event::Start { stage: "bc-longer", total: Some(extra) });
        let demos: Vec<Demonstration> = read_stage_jsonl(&dir.join("data").join("demonstrations.jsonl"))?;
        let records: Vec<SftRecord> = demos
            .iter()
            .map(|d| SftRecord::PromptCompletion {
                prompt: d.prompt.clone(),
                completion: action_text(&d.action),
            })
            .collect();
        let records = fit_prompts(records, &tokenizer, cfg.context - cfg.max_new_tokens)?;
        let model = SftModel::from_pretrained(&bc_dir.to_string_lossy(), dtype, device)?;
        let args = TrainingArgs { max_steps: Some(extra), seed: cfg.bc.seed + 1, ..cfg.bc.clone() };
        let sft_cfg = SftConfig {
            max_length: cfg.context,
            completion_only_loss: true,
            add_eos: true,
            assistant_only_loss: false,
        };
        sft::train_sft(&model, &records, &sft_cfg, &args, &mut train_progress("bc-longer", on))?;
        model.save(&longer_dir)?;
        let s = t.elapsed().as_secs_f64();
        on(Event::Done { stage: "bc-longer", seconds: s });
        seconds.push(("bc-longer".into(), s));
    }

    let t = Instant::now();
    on(Event::Start { stage: "eval", total: None });
    let n = cfg.eval_episodes.min(data.heldout.len());
    let eval_seed = cfg.seed ^ 0xe7a1;
    let run = |agent: &mut dyn Agent| -> Result<NerEval> {
        let mut env = Ner::new(cfg.num_envs, cfg.game.clone(), data.clone(), cfg.max_steps)?;
        // held-out tweet i, each once
        let (eps, _) =
            play(&mut env, agent, n, &|i| Reset { seed: Some(heldout_seed(i as u64)), game: None })?;
        Ok(NerEval::of(&eps, &data, eval_seed))
    };
    let mut agents = vec![("lexicon".to_string(), run(&mut LexiconAgent::new(&data))?)];
    let sampled = GenerationConfig { seed: eval_seed, ..run_config.generation.clone() };
    for (name, path) in [("BC", &bc_dir), ("BC (longer)", &longer_dir), ("PPO", &ppo_dir)] {
        let policy = load_policy(&path.to_string_lossy(), false, dtype, device)?;
        let mut agent =
            ModelAgent::new(&policy.model.lm, &tokenizer, cfg.agent.clone(), sampled.clone(), device)?;
        agents.push((name.to_string(), run(&mut agent)?));
    }
    let s = t.elapsed().as_secs_f64();
    on(Event::Done { stage: "eval", seconds: s });
    seconds.push(("eval".into(), s));

    let summary = WnutSummary {
        config: cfg.clone(),
        tweets: (data.train.len(), data.heldout.len()),
        agents,
        bc_extra_steps: extra,
        stage_seconds: seconds,
    };
    write_file(&dir.join("summary-wnut.json"), to_json(&summary)?.as_bytes())?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rltune::envs::play::Turn;
    use rltune::envs::EnvStep;

    #[test]
    fn the_lexicon_agent_tags_known_tokens_and_fixes_orphan_i_tags() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ner.txt");
        let mut text = String::new();
        for _ in 0..4 {
            text.push_str("Empire\tB-facility\nState\tI-facility\nis\tO\n\n");
        }
        text.push_str("State\tI-facility\n\n");
        std::fs::write(&p, text).unwrap();
        let data = NerData::load(&p, 5).unwrap();
        let mut agent = LexiconAgent::new(&data);
        let obs = |tok: &str| EnvStep {
            observation: format!("Sentence: x\nToken: {tok}\nNext: y"),
            ..Default::default()
        };
        let turn = |a: &str| Turn { action: a.into(), ..Turn::default() };
        let after_b = [turn("B-facility")];
        let (s1, s2, s3) = (obs("Empire"), obs("State"), obs("unseen"));
        let p = |state, turns| Pending { episode: 0, state, turns };
        let got = agent.act(&[p(&s1, &[]), p(&s2, &after_b), p(&s2, &[]), p(&s3, &[])]).unwrap();
        assert_eq!(got, vec!["B-facility", "I-facility", "B-facility", "O"]);
    }

    #[test]
    fn bootstrap_se_is_zero_for_identical_tweets_and_counts_are_micro() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ner.txt");
        std::fs::write(&p, "A\tB-x\nb\tO\n\n".repeat(10)).unwrap();
        let data = NerData::load(&p, 5).unwrap();
        let ep = |i: u64, action: &str| {
            let mut e =
                Episode::start(0, &Reset { seed: Some(heldout_seed(i)), game: None }, &Default::default());
            e.turns.push(Turn {
                observation: String::new(),
                action: action.into(),
                reward: 0.0,
                invalid: false,
                ..Turn::default()
            });
            e.steps = 1;
            e
        };
        let all_right = NerEval::of(&[ep(0, "B-x"), ep(1, "B-x")], &data, 1);
        assert_eq!((all_right.micro.tp, all_right.micro.f1, all_right.f1_se), (2, 1.0, 0.0));
        let half = NerEval::of(&[ep(0, "B-x"), ep(1, "O")], &data, 1);
        assert_eq!((half.micro.tp, half.micro.fn_), (1, 1));
        assert!(half.f1_se > 0.0);
    }
}
