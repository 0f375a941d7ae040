//! `rltune quickstart --task essays`: RL on a task's own metric. An LM agent labels the
//! discourse elements of generated essays ([`rltune::envs::essays`]) one segment per turn, and is
//! scored by the Feedback Prize F-score.
//!
//! The stages ([`super::agent::train_agent`], each cached in the output directory):
//! 1. **demos**: the gold labels of training essays as demonstrations (the environment's
//!    walkthrough is the gold labelling; `demo_noise` plays a random label now and then, so the
//!    demonstrations also show states after a mistake);
//! 2. **tokenizer**, 3. **bc**: behavioural cloning, cross-entropy on the gold label's tokens;
//! 4. **ppo**: PPO on training essays from the BC policy with the KL to it, the reward the
//!    essay's F-score: the quickstart turns on the environment's dense reward (the change of
//!    the prefix F-score, which sums to the essay's F-score) and sets `game_gamma = 0`, so each
//!    label is credited with its own change and no value bootstrap enters the advantage; the
//!    value head is detached from the LM (`detach_value_head`);
//! 5. **bc-longer**: the control for PPO's extra updates, BC trained on for as many
//!    optimizer steps as PPO took ([`super::agent::train_bc_longer`]);
//! 6. **eval**: the random agent, the keyword heuristic, the BC policy and the PPO policy
//!    (each sampled as in training, and greedy), BC sampled at temperature 0.5 and BC trained
//!    longer (sampled and greedy), on the same test essays (sentence combinations training never
//!    shows). Each is scored per essay (mean ± standard error; the reward's rule) and over the set
//!    with the competition's macro F1. The model agents also play `validation_episodes`
//!    validation essays (held-out combinations, seeds disjoint from the test ones): settings are
//!    chosen there, and the docs report the test essays.
//!
//! Acceptance: the PPO policy's mean test F-score beats the BC policy's, both sampled (as
//! trained) and both greedy, by more than two standard errors of the difference,
//! √(SE²_BC + SE²_PPO), and `objective/kl` stays within [−0.05, 10].

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::agent::{train_agent, train_bc_longer, AgentGames, AgentQuickstartConfig, TrainedAgent, KL_NOISE};
use super::pipeline::{count_parameters, metric_pairs, to_json, write_file, Check, Event};
use rltune::agent::config::{EnvKind, EnvSection, Split};
use rltune::agent::model_agent::ModelAgent;
use rltune::envs::adventure::{is_heldout, train_seed};
use rltune::envs::essays::generate::generate;
use rltune::envs::essays::heuristic::HeuristicAgent;
use rltune::envs::essays::{Essays, EssaysConfig, Label, CLASSES, NONE};
use rltune::envs::play::{play, ActionMode, Agent, Episode, PromptTemplate, RandomAgent};
use rltune::envs::{Reset, TextEnv};
use rltune::error::{Error, Result};
use rltune::generation::GenerationConfig;
use rltune::models::load::load_policy;
use rltune::ppo::PpoConfig;
use rltune::rewards::metrics::feedback::{feedback_score, Span};
use rltune::rewards::metrics::mean_se;
use rltune::run::config::EpisodesSection;
use rltune::runtime::Runtime;
use rltune::train::{ScheduleKind, TrainingArgs};

/// The settings of the essays quickstart (`DIR/quickstart.json`; `--set key=value`).
pub type EssaysQuickstartConfig = AgentQuickstartConfig<EssaysConfig>;

impl AgentGames for EssaysConfig {
    fn env_section(&self, split: Split, num_envs: usize, max_steps: usize) -> EnvSection {
        EnvSection {
            kind: EnvKind::Essays,
            num_envs,
            max_steps,
            split,
            essays: self.clone(),
            ..EnvSection::default()
        }
    }

    /// Validation essays: held-out sentence combinations, seeds disjoint from the test ones.
    fn has_validation(&self) -> bool {
        true
    }

    /// Training essays `train_seed(seed · 1000003 + i)`, i < `episodes`.
    fn demo_env(
        &self,
        seed: u64,
        episodes: usize,
        max_steps: usize,
    ) -> Result<(Box<dyn TextEnv>, Vec<Reset>)> {
        let env = Essays::new(1, self.clone(), max_steps)?;
        let resets = (0..episodes as u64)
            .map(|i| Reset {
                seed: Some(train_seed(seed.wrapping_mul(1_000_003).wrapping_add(i))),
                game: None,
            })
            .collect();
        Ok((Box::new(env), resets))
    }
}

impl Default for AgentQuickstartConfig<EssaysConfig> {
    fn default() -> Self {
        let bc = TrainingArgs {
            learning_rate: 2e-3,
            max_steps: 300,
            batch_size: 32,
            lr_scheduler_type: ScheduleKind::Cosine,
            warmup_ratio: 0.05,
            eval_fraction: 0.02,
            seed: 1,
            ..TrainingArgs::default()
        };
        // Measured in docs/rl-on-metrics.md: with lr 1e-4, game_gamma 1 and the value loss
        // reaching the LM, PPO ended below BC (−0.038); in free-text mode the settings below at
        // lr 3e-5 beat BC on two seeds of three; with admissible labels at lr 1e-4, on all three.
        let ppo = PpoConfig {
            steps: 30,
            // 16 essays a round play ~235 turns: 192 of them train, few are thrown away.
            batch_size: 192,
            mini_batch_size: 32,
            ppo_epochs: 4,
            // In free-text mode 1e-4 made the invalid labels jump to 36% within 3 steps, and 3e-5
            // failed seed 2 (−0.012). With admissible labels no label is invalid, and 1e-4 passes
            // on seeds 0, 1 and 2 (+0.140, +0.054, +0.053; 2 SE 0.036–0.039):
            // docs/rl-on-metrics.md.
            learning_rate: 1e-4,
            init_kl_coef: 0.05,
            // The value head starts untrained on the BC policy: its loss must not move the LM.
            detach_value_head: true,
            seed: 3,
            ..PpoConfig::default()
        };
        // game_gamma 0: each label is credited with the change of the prefix F-score it causes
        // (the dense reward), not with that plus a bootstrap from a value head that starts
        // untrained; the rewards of an episode still sum to its F-score.
        let episodes = EpisodesSection { game_gamma: 0.0, eval_every: 0, ..EpisodesSection::default() };
        Self {
            seed: 0,
            game: EssaysConfig { dense_reward: true, ..EssaysConfig::default() },
            demo_games: 1000,
            demo_noise: 0.1,
            vocab_size: 1024,
            policy_dim: 128,
            policy_layers: 4,
            policy_heads: 4,
            context: 192,
            agent: PromptTemplate {
                memory_turns: 0,
                show_admissible: false,
                show_inventory: false,
                instruction: "Label:\n>".into(),
                // The label is drawn from the 15 admissible commands (issue #39): never invalid.
                actions: ActionMode::Admissible,
                ..PromptTemplate::default()
            },
            max_new_tokens: 6,
            max_steps: 64,
            num_envs: 16,
            bc,
            ppo,
            episodes,
            eval_episodes: 200,
            validation_episodes: 200,
            algorithm: Default::default(),
            grpo: super::agent::agent_grpo(),
            rloo: super::agent::agent_rloo(),
            gigpo: None,
            // PPO-ptx (#56 item 4): every minibatch also trains on 32 demonstrations, so PPO
            // keeps the imitation that BC trained longer gets. Chosen on the validation essays
            // over plain PPO (0), the only other setting tried: PPO-ptx is above it on every
            // seed, sampled and greedy (docs/rl-on-metrics.md).
            ptx_coef: 1.0,
        }
    }
}

impl AgentQuickstartConfig<EssaysConfig> {
    /// A run of seconds for tests: every stage, too small to learn anything.
    pub fn tiny() -> Self {
        let d = Self::default();
        Self {
            demo_games: 10,
            vocab_size: 300,
            policy_dim: 32,
            policy_layers: 1,
            policy_heads: 2,
            context: 160,
            num_envs: 2,
            bc: TrainingArgs { max_steps: 4, batch_size: 8, ..d.bc },
            ppo: PpoConfig { steps: 2, batch_size: 16, mini_batch_size: 8, ppo_epochs: 1, ..d.ppo },
            eval_episodes: 6,
            validation_episodes: 4,
            // Plain PPO (stage `ppo`); its test runs the default's PPO-ptx with `--set`.
            ptx_coef: 0.0,
            ..d
        }
    }
}

/// One agent's held-out scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EssayEval {
    /// Essays scored.
    pub essays: usize,
    /// Mean per-essay F-score (the reward's rule).
    pub mean: f64,
    /// Its standard error.
    pub se: f64,
    /// The competition's macro F1 over all the essays.
    pub macro_f1: f64,
    /// Per class: (name, competition F1 over the essays).
    pub per_class: Vec<(String, f64)>,
    /// Essays labelled perfectly.
    pub perfect: f64,
    /// Labels that were not a valid command.
    pub invalid_rate: f64,
    /// Every essay's score, in order (for paired comparisons).
    pub scores: Vec<f64>,
}

impl EssayEval {
    /// The scores of finished episodes (their essays are regenerated from their seeds).
    pub fn of(episodes: &[Episode]) -> Self {
        let scores: Vec<f64> = episodes.iter().map(|e| e.score).collect();
        let (mean, se) = mean_se(&scores);
        let pairs: Vec<(Vec<Span>, Vec<Span>)> = episodes
            .iter()
            .map(|e| {
                let seed = e.seed.unwrap_or(0);
                let essay = generate(seed, is_heldout(seed));
                let labels: Vec<Label> = e
                    .turns
                    .iter()
                    .map(|t| Label::parse(&t.action).unwrap_or(Label { class: NONE, begin: false }))
                    .collect();
                (essay.spans(&labels), essay.gold_spans())
            })
            .collect();
        let ds = feedback_score(&pairs);
        let turns: usize = episodes.iter().map(|e| e.steps).sum();
        let invalid: usize = episodes.iter().map(|e| e.invalid_actions).sum();
        Self {
            essays: episodes.len(),
            mean,
            se,
            macro_f1: ds.macro_f1,
            per_class: ds.per_class.iter().map(|(c, _, f)| (CLASSES[*c].to_string(), *f)).collect(),
            perfect: scores.iter().filter(|&&s| s >= 1.0).count() as f64 / scores.len().max(1) as f64,
            invalid_rate: invalid as f64 / turns.max(1) as f64,
            scores,
        }
    }
}

/// The essays quickstart's results (`summary-essays.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EssaysSummary {
    /// The configuration that produced them.
    pub config: EssaysQuickstartConfig,
    /// Policy parameters (value head excluded).
    pub policy_parameters: usize,
    /// Demonstrated turns.
    pub demonstrations: usize,
    /// Test scores per agent: [`AGENTS`], then the [`CONTROLS`].
    pub agents: Vec<(String, EssayEval)>,
    /// Validation scores of the model agents (with `validation_episodes`).
    #[serde(default)]
    pub validation: Vec<(String, EssayEval)>,
    /// Per PPO step: `(step, env/episode_return_mean, objective/kl)`.
    pub ppo_curve: Vec<(usize, f64, f64)>,
    /// Wall time per stage in seconds (stages run this time).
    pub stage_seconds: Vec<(String, f64)>,
}

/// The summary's file for RL stage `stage`: `summary-essays.json` for PPO, else
/// `summary-essays-STAGE.json` (PPO-ptx shares the folder's BC, controls and evaluation essays).
pub fn essays_summary_file(stage: &str) -> String {
    match stage {
        "ppo" => "summary-essays.json".into(),
        s => format!("summary-essays-{s}.json"),
    }
}

/// The names of the agents in [`EssaysSummary::agents`].
pub const AGENTS: [&str; 6] = ["random", "heuristic", "BC", "BC (greedy)", "PPO", "PPO (greedy)"];

/// The controls after them: BC sampled at a lower temperature (sharper, as RL makes it), and
/// BC trained longer (as many more updates as PPO's).
pub const CONTROLS: [&str; 3] = ["BC (T = 0.5)", "BC longer", "BC longer (greedy)"];

/// BC's temperature in the `BC (T = 0.5)` control.
pub const COLD_TEMPERATURE: f64 = 0.5;

impl EssaysSummary {
    /// The scores of the agent `name`.
    pub fn agent(&self, name: &str) -> Option<&EssayEval> {
        self.agents.iter().find(|(n, _)| n == name).map(|(_, e)| e)
    }

    /// The acceptance criteria (module docs).
    pub fn checks(&self) -> Vec<Check> {
        let kl: Vec<f64> = self.ppo_curve.iter().map(|c| c.2).filter(|k| k.is_finite()).collect();
        let kl_max = kl.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let kl_min = kl.iter().copied().fold(f64::INFINITY, f64::min);
        vec![
            self.beats("PPO", "BC", "both sampled"),
            self.beats("PPO (greedy)", "BC (greedy)", "both greedy"),
            Check {
                what: format!(
                    "objective/kl within [{kl_min:.4}, {kl_max:.3}]; needed within [-{KL_NOISE}, 10]"
                ),
                ok: !kl.is_empty() && kl_min >= -KL_NOISE && kl_max <= 10.0,
            },
        ]
    }

    /// Whether agent `a`'s mean test F-score beats `b`'s by more than two standard errors of the
    /// difference (unpaired; the paired SE, smaller, is printed for the record).
    fn beats(&self, a: &str, b: &str, how: &str) -> Check {
        let nan = EssayEval::of(&[]);
        let (x, y) = (self.agent(a).unwrap_or(&nan), self.agent(b).unwrap_or(&nan));
        let se = (x.se.powi(2) + y.se.powi(2)).sqrt();
        let paired = if x.scores.len() == y.scores.len() && !x.scores.is_empty() {
            let d: Vec<f64> = x.scores.iter().zip(&y.scores).map(|(p, q)| p - q).collect();
            format!(", paired SE {:.3}", mean_se(&d).1)
        } else {
            String::new()
        };
        Check {
            what: format!(
                "test F-score ({how}): {a} {:.3} vs {b} {:.3}, difference {:+.3}{paired}; needed > 2 SE = {:.3}",
                x.mean,
                y.mean,
                x.mean - y.mean,
                2.0 * se
            ),
            ok: x.mean - y.mean > 2.0 * se,
        }
    }
}

/// Plays `n` held-out essays with `agent` (episode i: held-out essay `eval_seed + i`).
fn eval_agent(section: &EnvSection, agent: &mut dyn Agent, n: usize, eval_seed: u64) -> Result<EssayEval> {
    let mut env = section.build()?;
    let (episodes, _) = play(env.as_mut(), agent, n, &|i| section.reset_for(eval_seed, i, 0))?;
    Ok(EssayEval::of(&episodes))
}

/// Runs (or resumes) the essays quickstart in `dir`.
pub fn run_essays_quickstart(
    dir: &Path,
    cfg: &EssaysQuickstartConfig,
    runtime: &Runtime,
    stop: &AtomicBool,
    on: &mut dyn FnMut(Event),
) -> Result<EssaysSummary> {
    let TrainedAgent { tokenizer, bc_dir, ppo_dir, run_config, demonstrations, mut seconds } =
        train_agent(dir, cfg, runtime, stop, on)?;

    let longer = train_bc_longer(dir, cfg, runtime, on)?;
    if let Some((_, s)) = longer.as_ref().filter(|(_, s)| *s > 0.0) {
        seconds.push(("bc-longer".into(), *s));
    }

    let t = Instant::now();
    on(Event::Start { stage: "eval", total: None });
    let heldout = cfg.game.env_section(Split::Heldout, cfg.num_envs, cfg.max_steps);
    let validation = cfg.game.env_section(Split::Validation, cfg.num_envs, cfg.max_steps);
    let eval_seed = cfg.seed ^ 0xe7a1;
    let n = cfg.eval_episodes;
    let mut agents = vec![
        (AGENTS[0].to_string(), eval_agent(&heldout, &mut RandomAgent::new(eval_seed), n, eval_seed)?),
        (AGENTS[1].to_string(), eval_agent(&heldout, &mut HeuristicAgent, n, eval_seed)?),
    ];
    let sampled = GenerationConfig { seed: eval_seed, ..run_config.generation.clone() };
    let greedy = GenerationConfig { top_k: 1, ..sampled.clone() };
    let cold = GenerationConfig { temperature: COLD_TEMPERATURE, ..sampled.clone() };
    let mut models = vec![
        (AGENTS[2], &bc_dir, &sampled),
        (AGENTS[3], &bc_dir, &greedy),
        (AGENTS[4], &ppo_dir, &sampled),
        (AGENTS[5], &ppo_dir, &greedy),
        (CONTROLS[0], &bc_dir, &cold),
    ];
    if let Some((longer_dir, _)) = &longer {
        models.extend([(CONTROLS[1], longer_dir, &sampled), (CONTROLS[2], longer_dir, &greedy)]);
    }
    let (dtype, device) = (runtime.dtype(), runtime.device());
    // Each policy loaded once (BC plays three of the agents).
    let mut policies = Vec::new();
    for (_, path, _) in &models {
        if !policies.iter().any(|(p, _)| p == path) {
            policies.push((*path, load_policy(&path.to_string_lossy(), false, dtype, device)?));
        }
    }
    let mut on_validation = Vec::new();
    for (name, path, generation) in models {
        let (_, policy) = policies
            .iter()
            .find(|(p, _)| *p == path)
            .ok_or_else(|| Error::Internal(format!("{}: its policy was not loaded", path.display())))?;
        let lm = &policy.model.lm;
        let agent = || ModelAgent::new(lm, &tokenizer, cfg.agent.clone(), generation.clone(), device);
        agents.push((name.to_string(), eval_agent(&heldout, &mut agent()?, n, eval_seed)?));
        if cfg.validation_episodes > 0 {
            let e = eval_agent(&validation, &mut agent()?, cfg.validation_episodes, eval_seed)?;
            on_validation.push((name.to_string(), e));
        }
    }
    drop(policies);
    let s = t.elapsed().as_secs_f64();
    on(Event::Done { stage: "eval", seconds: s });
    seconds.push(("eval".into(), s));

    let policy = load_policy(&bc_dir.to_string_lossy(), false, dtype, device)?;
    let summary = EssaysSummary {
        config: cfg.clone(),
        policy_parameters: count_parameters(&policy.store, |n| !n.starts_with("v_head"))?,
        demonstrations,
        agents,
        validation: on_validation,
        ppo_curve: metric_pairs(
            &run_config.logging.dir.join("metrics.jsonl"),
            "env/episode_return_mean",
            "objective/kl",
        )?,
        stage_seconds: seconds,
    };
    write_file(&dir.join(essays_summary_file(cfg.rl_stage())), to_json(&summary)?.as_bytes())?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(mean: f64, se: f64) -> EssayEval {
        EssayEval { mean, se, ..EssayEval::of(&[]) }
    }

    #[test]
    fn acceptance_needs_two_standard_errors_of_the_difference() {
        let mut s = EssaysSummary {
            config: EssaysQuickstartConfig::tiny(),
            policy_parameters: 0,
            demonstrations: 0,
            agents: vec![
                ("BC".into(), eval(0.70, 0.02)),
                ("PPO".into(), eval(0.75, 0.02)),
                ("BC (greedy)".into(), eval(0.80, 0.01)),
                ("PPO (greedy)".into(), eval(0.83, 0.01)),
            ],
            validation: vec![],
            ppo_curve: vec![(1, 0.5, 0.0), (2, 0.6, 0.3)],
            stage_seconds: vec![],
        };
        // 2 SE of the difference = 2 · √(0.02² + 0.02²) = 0.0566 > 0.05: fails.
        assert!(!s.checks()[0].ok, "{}", s.checks()[0].what);
        s.agents[1].1.mean = 0.76;
        // Greedy: 2 · √(0.01² + 0.01²) = 0.028 < 0.03: passes, and fails when PPO greedy is lower.
        assert!(s.checks().iter().all(|c| c.ok));
        s.agents[3].1.mean = 0.79;
        assert!(!s.checks()[1].ok, "{}", s.checks()[1].what);
        s.ppo_curve.push((3, 0.6, 12.0));
        assert!(!s.checks()[2].ok);
    }

    /// A PPO step plays rounds of `num_envs` essays until it has `batch_size` turns: the
    /// default batch should fit one round (no second round most steps) and use most of it.
    #[test]
    fn the_default_batch_fits_one_round_of_essays() {
        let cfg = EssaysQuickstartConfig::default();
        let n = 2000;
        let turns: Vec<usize> = (0..n).map(|i| generate(train_seed(i), false).segments.len()).collect();
        let mean = turns.iter().sum::<usize>() as f64 / n as f64;
        let sd = (turns.iter().map(|&t| (t as f64 - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        let (round, round_sd) = (cfg.num_envs as f64 * mean, (cfg.num_envs as f64).sqrt() * sd);
        let b = cfg.ppo.batch_size as f64;
        assert!(b <= round - 2.0 * round_sd, "batch {b} vs a round of {round:.0} ± {round_sd:.0} turns");
        assert!(b >= 0.75 * round, "batch {b} throws away most of a round of {round:.0} turns");
        assert!(cfg.max_steps as f64 >= mean + 4.0 * sd, "essays cut at {} turns", cfg.max_steps);
    }

    #[test]
    fn scores_come_from_the_labels_played() {
        use rltune::envs::adventure::heldout_seed;
        use rltune::envs::play::Turn;
        let seed = heldout_seed(3);
        let essay = generate(seed, true);
        let gold = essay.gold_labels();
        let mut ep = Episode::start(0, &Reset { seed: Some(seed), game: None }, &Default::default());
        for (k, l) in gold.iter().enumerate() {
            // the last label wrong
            let action = if k + 1 == gold.len() { "none".to_string() } else { l.command() };
            ep.turns.push(Turn { action, ..Turn::default() });
            ep.steps += 1;
        }
        ep.score =
            essay.score(&ep.turns.iter().map(|t| Label::parse(&t.action).unwrap()).collect::<Vec<_>>());
        let e = EssayEval::of(&[ep]);
        assert!(e.macro_f1 > 0.5 && e.macro_f1 <= 1.0 && e.mean == e.scores[0]);
        assert_eq!(e.perfect, if e.mean >= 1.0 { 1.0 } else { 0.0 });
    }
}
