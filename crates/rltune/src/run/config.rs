//! The run config: one TOML file with tables `[model]`, `[ref_model]`, `[critic]`, `[reward]`,
//! `[data]`, `[generation]`, `[ppo]`, `[logging]`, `[checkpoint]` and `[runtime]`, plus
//! `--set table.key=value` overrides. Unknown keys are rejected with the closest valid key.
//!
//! To train on text games, `[env]` (as in env configs, `rltune play`), `[agent]` (the prompt) and
//! `[episodes]` (discounting across turns, shaping, evaluation) replace `[data]` and `[reward]`.
//! `[algorithm] kind = "rejection_sampling"` with a `[rejection]` table trains by rejection
//! sampling instead of PPO (on games or prompts; [`crate::rejection`]); `kind = "grpo"` or
//! `"rloo"` with a `[grpo]` / `[rloo]` table (TRL 1.16.0's names) trains by GRPO or RLOO on
//! prompts ([`super::group_config`], [`super::group_loop`]).

use std::path::{Path, PathBuf};

pub use super::logging_config::LoggingSection;
pub use super::reward_config::{RewardSection, RewardSourceConfig};
use crate::agent::config::EnvSection;
use crate::agent::rollout::Shaping;
use crate::config_file::parse_toml;
use crate::envs::play::{Memory, PromptTemplate};
use crate::error::{ConfigError, Error, Result};
use crate::generation::GenerationConfig;
use crate::grpo::{GrpoConfig, RlooConfig};
use crate::models::load::LoraSpec;
pub use crate::models::lora::LoraConfig;
use crate::ppo::PpoConfig;
use crate::rejection::RejectionConfig;

/// `[model]` / `[ref_model]`: where a model comes from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Local directory (Hugging Face layout) or hub id.
    pub path: String,
    /// A LoRA adapter directory (PEFT's `save_pretrained`, or an rltune checkpoint with
    /// `[lora]`) to start from; trains as LoRA even without a `[lora]` table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// Partial freezing (the textworld fork's idea): train only the last K blocks, the final
    /// norm and the heads; the embeddings and the blocks below are frozen, and their output is
    /// computed once per batch for the policy and the reference
    /// ([`crate::models::CausalLm::freeze_trunk`]). Policy only (`[model]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable_layers: Option<usize>,
    /// Gradient checkpointing (TRL's `gradient_checkpointing`; transformers'
    /// `gradient_checkpointing_enable()`): the policy's training forwards keep only each
    /// block's input, and the backward runs the block again. The same gradients, bit for bit on
    /// the CPU, for less memory and about one more forward of time. Policy only (`[model]`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gradient_checkpointing: bool,
}

/// `[critic]`: a separate value model (see [`crate::ppo::critic`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CriticSection {
    /// Local directory (Hugging Face layout) or hub id of a causal LM of the policy's
    /// tokenizer; its value head is loaded, or initialized when absent (`[ppo] value_head`).
    pub path: String,
    /// The critic's Adam learning rate; default: `[ppo] learning_rate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    /// LoRA adapters on the critic (`[critic.lora]`, PEFT's `LoraConfig` names; OpenRLHF's
    /// `--lora_rank` adapts actor and critic alike): its base frozen, the adapters and its value
    /// head train, its checkpoint holds the adapter. Default: the critic trains in full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::models::lora::LoraConfig>,
}

impl CriticSection {
    /// The critic's learning rate: its own, else the policy's.
    pub fn learning_rate(&self, ppo: &PpoConfig) -> f64 {
        self.learning_rate.unwrap_or(ppo.learning_rate)
    }
}

/// `[ptx]`: PPO-ptx (InstructGPT's mix of the PPO loss with a supervised loss; OpenRLHF's
/// `--pretrain_data` and `--ptx_coef`). Every PPO minibatch adds `coef ×` the cross-entropy of
/// `[ppo] mini_batch_size` supervised examples to the policy's loss (see
/// [`crate::ppo::PpoTrainer::with_ptx`]). The examples are read and tokenized as `rltune sft`
/// reads its data.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtxSection {
    /// The supervised data: JSON lines, CSV, Parquet, … (`rltune sft`'s formats: `text`,
    /// `prompt`/`completion`, or `messages`).
    pub source: String,
    /// The supervised loss's weight (OpenRLHF's `ptx_coef`, default 0.05).
    #[serde(default = "PtxSection::default_coef")]
    pub coef: f64,
    /// How the examples are tokenized (`[sft]`'s keys: `max_length`, `completion_only_loss`,
    /// `add_eos`, `assistant_only_loss`; defaults as there).
    #[serde(default)]
    pub sft: crate::train::sft::SftConfig,
}

impl PtxSection {
    fn default_coef() -> f64 {
        0.05
    }

    fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.source.is_empty() {
            return Err(ConfigError::new(
                "ptx",
                "source",
                "is empty; set it to the supervised data (a JSONL file of prompt/completion rows, as `rltune sft` \
                 reads), or remove the [ptx] table",
            ));
        }
        if !(self.coef.is_finite() && self.coef > 0.0) {
            return Err(ConfigError::new(
                "ptx",
                "coef",
                format!("= {}; use a finite value above 0 (OpenRLHF's default is 0.05)", self.coef),
            ));
        }
        self.sft.validate()
    }
}

/// `[data]`: the prompt dataset.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// JSON lines, JSON, CSV, Parquet or Arrow file, a `datasets` `save_to_disk` directory, a
    /// directory of data files, or a hub dataset id.
    pub source: String,
    /// Column holding the prompt: text, or a conversation (a list of messages, rendered with
    /// the chat template and the generation prompt).
    pub text_column: String,
    /// The split of a dataset directory or hub dataset (default: the only one, else `train`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// Column renaming, e.g. `{ answer = "solution" }` (reward sources read `answer`).
    #[serde(skip_serializing_if = "crate::data::rows::ColumnMap::is_empty")]
    pub columns: crate::data::rows::ColumnMap,
    /// PPO cuts each text prompt to a length drawn from `min_query_tokens..max_query_tokens`
    /// (TRL's sentiment example's `LengthSampler`); conversational prompts are used whole.
    /// Shortest prompt in tokens (`LengthSampler`'s `min_value`).
    pub min_query_tokens: usize,
    /// Longest prompt in tokens, exclusive (`LengthSampler`'s `max_value`).
    pub max_query_tokens: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            source: String::new(),
            text_column: "text".into(),
            split: None,
            columns: Default::default(),
            min_query_tokens: 2,
            max_query_tokens: 8,
        }
    }
}

/// `[eval]`: held-out prompts scored by the run's reward sources.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Held-out prompts (JSONL, CSV, Parquet or hub dataset), with the columns the reward
    /// sources read (e.g. `answer`) and `[data] text_column`; empty (default): no evaluation.
    pub source: String,
    /// Also evaluate every this many steps; 0 (default): before the first step and after the
    /// last only.
    pub every: usize,
    /// Greedy decoding (`top_k = 1`, default true); false samples with `[generation]`.
    pub greedy: bool,
    /// Prompts per generation batch (default 32).
    pub batch_size: usize,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self { source: String::new(), every: 0, greedy: true, batch_size: 32 }
    }
}

impl EvalSection {
    /// Whether an evaluation is configured.
    pub fn enabled(&self) -> bool {
        !self.source.is_empty()
    }

    /// Whether to evaluate after `step` of `total` steps.
    pub fn due(&self, step: usize, total: usize) -> bool {
        self.enabled() && (step == total || (self.every > 0 && step.is_multiple_of(self.every)))
    }

    pub(super) fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.enabled() && self.batch_size == 0 {
            return Err(ConfigError::new("eval", "batch_size", "must be at least 1"));
        }
        Ok(())
    }
}

/// `[checkpoint]`
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save every this many steps (0: only at the end).
    pub every: usize,
    /// Also save the optimizer state (needed for `--resume`).
    pub optimizer_state: bool,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self { every: 50, optimizer_state: false }
    }
}

pub use crate::runtime::RuntimeSection;

/// `[episodes]`: how turns of text games become PPO transitions (with `[env]`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EpisodesSection {
    /// The discount between turns: a turn's last token bootstraps from `game_gamma · V(next
    /// turn's prompt)` (the textworld fork's `game_gamma`, 0.6).
    pub game_gamma: f64,
    /// PPO: λ of the returns across turns (0: each turn bootstraps from `game_gamma · V(next
    /// turn's prompt)`, the fork's TD(0); 1: from the discounted sum of the episode's later
    /// shaped rewards, Monte Carlo; between: the λ-return). Within a turn GAE keeps `[ppo] lam`.
    /// See [`crate::agent::rollout::lambda_bootstraps`].
    pub turn_lambda: f64,
    /// Probability that a turn plays a random admissible command instead of the policy's
    /// (the fork's "example turns": memory only, not trained on).
    pub example_turn_prob: f64,
    /// Reward shaping added to the game's reward.
    pub shaping: Shaping,
    /// Evaluate on held-out games every this many steps (0: never), with sampling as in
    /// training; logged as `eval/*`.
    pub eval_every: usize,
    /// Episodes per evaluation.
    pub eval_episodes: usize,
    /// TextWorld/command games to evaluate on (default: the training `games`).
    pub eval_games: Vec<String>,
    /// Episodes per step written to `transcripts.jsonl`.
    pub transcripts_per_step: usize,
    /// GRPO/RLOO on games: turns per forward and backward pass of the update (0: all of a
    /// step's turns at once); the turns are ordered by length and their gradients summed.
    pub micro_batch_turns: usize,
    /// PPO on games: which of the turns a step plays it trains on.
    pub train_turns: TrainTurns,
    /// GRPO on games: GiGPO's step-level credit (`[episodes.gigpo]`; absent: trajectory GRPO).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gigpo: Option<crate::grpo::gigpo::GigpoArgs>,
}

/// Which of the turns a PPO game step plays it trains on (`[episodes] train_turns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainTurns {
    /// `[ppo] batch_size` turns, picked at random from as many rounds of `num_envs` episodes as
    /// it takes to play that many: TRL's step, always `batch_size` samples. The rest of the
    /// last round is not trained on (`env/unused_turns`).
    #[default]
    Batch,
    /// Every turn of one round of `num_envs` episodes, less fewer than `mini_batch_size ×
    /// gradient_accumulation_steps` of them dropped at random so that the minibatches are
    /// whole: the step's size follows what the games played, and `[ppo] batch_size` is not
    /// used. (A round with fewer turns than one minibatch is followed by another.) On several
    /// processes each trains on as many turns as the process that played the fewest.
    Round,
}

impl Default for EpisodesSection {
    fn default() -> Self {
        Self {
            game_gamma: 0.6,
            turn_lambda: 0.0,
            example_turn_prob: 0.0,
            shaping: Shaping::default(),
            eval_every: 0,
            eval_episodes: 32,
            eval_games: Vec::new(),
            transcripts_per_step: 1,
            micro_batch_turns: 64,
            train_turns: TrainTurns::Batch,
            gigpo: None,
        }
    }
}

impl EpisodesSection {
    pub(super) fn validate(&self) -> std::result::Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.game_gamma) {
            return Err(ConfigError::new(
                "episodes",
                "game_gamma",
                format!("must be in [0, 1], got {}", self.game_gamma),
            ));
        }
        if !(0.0..=1.0).contains(&self.turn_lambda) {
            return Err(ConfigError::new(
                "episodes",
                "turn_lambda",
                format!("must be in [0, 1], got {}", self.turn_lambda),
            ));
        }
        if !(0.0..1.0).contains(&self.example_turn_prob) {
            return Err(ConfigError::new(
                "episodes",
                "example_turn_prob",
                format!("must be in [0, 1), got {} (1 would never train)", self.example_turn_prob),
            ));
        }
        if self.eval_every > 0 && self.eval_episodes == 0 {
            return Err(ConfigError::new("episodes", "eval_every", "is set but eval_episodes = 0"));
        }
        if let Some(g) = &self.gigpo {
            g.validate()?;
        }
        Ok(())
    }
}

/// Which trainer a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmKind {
    /// TRL's PPO (`[ppo]`).
    #[default]
    Ppo,
    /// Sample, keep the best, fine-tune on them (`[rejection]`; [`crate::rejection`]).
    RejectionSampling,
    /// TRL's GRPO (`[grpo]`; [`crate::grpo::GrpoTrainer`], the loop in [`super::group_loop`]).
    Grpo,
    /// TRL's RLOO (`[rloo]`; [`crate::grpo::RlooTrainer`]).
    Rloo,
}

impl AlgorithmKind {
    /// GRPO or RLOO: groups of completions per prompt, no value model.
    pub fn is_group(self) -> bool {
        matches!(self, Self::Grpo | Self::Rloo)
    }

    /// The name in configs (`"ppo"`, `"rejection_sampling"`, `"grpo"`, `"rloo"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Ppo => "ppo",
            Self::RejectionSampling => "rejection_sampling",
            Self::Grpo => "grpo",
            Self::Rloo => "rloo",
        }
    }
}

/// `[algorithm]`
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmSection {
    /// The trainer.
    pub kind: AlgorithmKind,
}

/// The whole run config.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The policy to train.
    pub model: ModelSection,
    /// The trainer: PPO (default) or rejection sampling.
    #[serde(default)]
    pub algorithm: AlgorithmSection,
    /// Rejection sampling's settings (with `[algorithm] kind = "rejection_sampling"`).
    #[serde(default)]
    pub rejection: RejectionConfig,
    /// GRPO's settings, TRL 1.16.0's `GRPOConfig` names (with `[algorithm] kind = "grpo"`).
    #[serde(default)]
    pub grpo: GrpoConfig,
    /// RLOO's settings, TRL 1.16.0's `RLOOConfig` names (with `[algorithm] kind = "rloo"`).
    #[serde(default)]
    pub rloo: RlooConfig,
    /// The reference model; default: a frozen copy of the policy.
    #[serde(default)]
    pub ref_model: Option<ModelSection>,
    /// A separate critic; default: the policy's own value head (TRL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic: Option<CriticSection>,
    /// PPO-ptx: a supervised loss mixed into every PPO minibatch; default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ptx: Option<PtxSection>,
    /// Reward sources.
    #[serde(default)]
    pub reward: RewardSection,
    /// Prompts (or `[env]`).
    #[serde(default)]
    pub data: DataSection,
    /// Text games to play instead of prompts.
    #[serde(default)]
    pub env: Option<EnvSection>,
    /// With `[env]`: the prompt the policy reads each turn.
    #[serde(default)]
    pub agent: PromptTemplate,
    /// With `[env]`: turns as transitions, shaping, evaluation.
    #[serde(default)]
    pub episodes: EpisodesSection,
    /// Sampling.
    #[serde(default)]
    pub generation: GenerationConfig,
    /// Held-out prompts scored before and after training (GRPO and RLOO runs).
    #[serde(default)]
    pub eval: EvalSection,
    /// PPO hyper-parameters and the number of steps.
    #[serde(default)]
    pub ppo: PpoConfig,
    /// Where metrics, report and checkpoints go.
    #[serde(default)]
    pub logging: LoggingSection,
    /// Checkpointing.
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// Device and precision (see [`crate::runtime`]).
    #[serde(default)]
    pub runtime: RuntimeSection,
    /// LoRA adapters on the policy, PEFT's `LoraConfig` names ([`crate::models::lora`]); the
    /// base is frozen and the reference is the base with the adapters off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
}

impl RunConfig {
    /// Reads a TOML file, applies `overrides` (`table.key=value`, value parsed as TOML, else
    /// as a string), then validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut cfg = Self::from_toml(&text, path, overrides)?;
        // Game files and the interpreter are found from the config's folder, as in env configs.
        if let Some(env) = cfg.env.as_mut() {
            let base = path.parent().unwrap_or(Path::new("."));
            env.resolve_paths(base);
            cfg.episodes.eval_games =
                cfg.episodes.eval_games.iter().map(|g| crate::agent::config::resolve(base, g)).collect();
        }
        Ok(cfg)
    }

    /// Parses TOML text (see [`Self::load`]); `path` names the source in errors.
    ///
    /// `[ppo] temperature`, when absent, is `[generation] temperature`: the training logprobs
    /// must come from the distribution the responses were sampled from.
    ///
    /// With `[algorithm] kind = "grpo"` or `"rloo"`, the sampling keys of `[grpo]` / `[rloo]`
    /// and of `[generation]` follow each other the same way (see [`super::group_config`]).
    pub fn from_toml(text: &str, path: &Path, overrides: &[String]) -> Result<Self> {
        let mut cfg: Self = parse_toml(text, path, overrides)?;
        if !sets_key(text, overrides, "ppo", "temperature") {
            cfg.ppo.temperature = cfg.generation.temperature;
        }
        cfg.check_tables(text, overrides).map_err(|m| Error::config(path, m))?;
        cfg.follow_generation(text, overrides);
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// The LoRA adapters to put on the policy (`[lora]`, `[model] adapter`), if any; with
    /// `checkpoint`, resuming: the adapter saved there. `origin` names the config file.
    pub fn lora_spec(&self, checkpoint: Option<&Path>, origin: &str) -> Option<LoraSpec> {
        if self.lora.is_none() && self.model.adapter.is_none() {
            return None;
        }
        let seed = match self.algorithm.kind {
            AlgorithmKind::Grpo => self.grpo.seed,
            AlgorithmKind::Rloo => self.rloo.seed,
            _ => self.ppo.seed,
        };
        Some(LoraSpec {
            config: self.lora.clone(),
            adapter: checkpoint
                .map(Path::to_path_buf)
                .or_else(|| self.model.adapter.as_ref().map(PathBuf::from)),
            origin: format!("{origin}: [lora]"),
            seed,
        })
    }

    fn validate_lora(&self) -> std::result::Result<(), ConfigError> {
        if self.ref_model.as_ref().is_some_and(|r| r.gradient_checkpointing) {
            return Err(ConfigError::new(
                "ref_model",
                "gradient_checkpointing",
                ": the reference does not train; set gradient_checkpointing under [model]",
            ));
        }
        if self.ref_model.as_ref().is_some_and(|r| r.trainable_layers.is_some()) {
            return Err(ConfigError::new(
                "ref_model",
                "trainable_layers",
                ": the reference does not train; set \
                        trainable_layers under [model]",
            ));
        }
        if self.lora.is_some() && self.model.trainable_layers.is_some() {
            return Err(ConfigError::new(
                "model",
                "trainable_layers",
                "with [lora]: the adapters already leave the base \
                        frozen; use one of them",
            ));
        }
        if let Some(l) = &self.lora {
            l.validate("lora")?;
            if self.ref_model.is_some() {
                return Err(ConfigError::new(
                    "lora",
                    "",
                    "[lora] with [ref_model]: with LoRA the reference is the base model with the \
                            adapters off; remove [ref_model]",
                ));
            }
        }
        Ok(())
    }

    /// The checks of a run on text games (`[env]`), whatever its trainer.
    pub(super) fn validate_games(&self, env: &EnvSection) -> std::result::Result<(), ConfigError> {
        env.validate()?;
        self.episodes.validate()?;
        if self.episodes.gigpo.is_some() && self.algorithm.kind != AlgorithmKind::Grpo {
            return Err(ConfigError::new("episodes.gigpo", "", format!("[episodes.gigpo] with [algorithm] kind = \"{}\": GiGPO's step credit builds on GRPO; set \
                 kind = \"grpo\" or remove [episodes.gigpo]",
                self.algorithm.kind.name()
            )));
        }
        self.agent.validate().map_err(|e| ConfigError::table("agent", e))?;
        if self.agent.memory == Memory::Transcript && self.episodes.example_turn_prob > 0.0 {
            return Err(ConfigError::new(
                "episodes",
                "example_turn_prob",
                format!(
                    "= {} with [agent] memory = \"transcript\": an example \
                 command is not sampled, so the transcript would hold tokens the policy never wrote; \
                 set it to 0 or use memory = \"window\"",
                    self.episodes.example_turn_prob
                ),
            ));
        }
        if !self.data.source.is_empty() {
            return Err(ConfigError::new(
                "data",
                "",
                "both [data] source and [env] are set; a run trains on prompts or on text \
                        games, not both: remove one",
            ));
        }
        if !self.reward.sources.is_empty() {
            return Err(ConfigError::new(
                "reward",
                "sources",
                "are set with [env]: turns are scored by the game (plus \
                        [episodes.shaping]); remove [[reward.sources]]",
            ));
        }
        Ok(())
    }

    /// Checks the sections; messages name the field.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        self.logging.validate()?;
        self.ppo.validate()?;
        self.validate_lora()?;
        self.validate_reward_names()?;
        if let Some(p) = &self.ptx {
            p.validate()?;
            if self.algorithm.kind != AlgorithmKind::Ppo {
                return Err(ConfigError::new(
                    "ptx",
                    "",
                    "[ptx] works with PPO only for now (it mixes a supervised loss into PPO's \
                     minibatches); remove the [ptx] table or set [algorithm] kind = \"ppo\"",
                ));
            }
        }
        if self.env.is_none() && self.episodes.gigpo.is_some() {
            return Err(ConfigError::new(
                "episodes.gigpo",
                "",
                "[episodes.gigpo] without [env]: GiGPO groups the turns of text games by their \
                        state; remove it, or train on games",
            ));
        }
        if self.algorithm.kind.is_group() {
            return self.validate_group();
        }
        if self.algorithm.kind == AlgorithmKind::RejectionSampling {
            self.rejection.validate()?;
            if self.env.is_some() && self.episodes.train_turns == TrainTurns::Round {
                return Err(ConfigError::new(
                    "episodes",
                    "train_turns",
                    "= \"round\" is for PPO steps; rejection sampling \
                            keeps its best turns of [ppo] batch_size: remove train_turns",
                ));
            }
        }
        self.generation.validate()?;
        if self.ppo.temperature != self.generation.temperature {
            return Err(ConfigError::new(
                "ppo",
                "temperature",
                format!(
                    "= {} but [generation] temperature = {}: the PPO ratio would compare \
                 logprobs of two different distributions (with the rollout cache on, it is not 1 on \
                 the first minibatch); leave [ppo] temperature out (it follows [generation]) or set \
                 both to the same value",
                    self.ppo.temperature, self.generation.temperature
                ),
            ));
        }
        if self.generation.records_support() && self.ppo.kl_penalty == crate::ppo::math::KlPenalty::Full {
            return Err(ConfigError::new(
                "ppo",
                "kl_penalty",
                "= \"full\" with top_k / top_p / min_p in [generation]: the full \
                        KL sums over the whole vocabulary, the truncated policy's support is smaller; use \
                        kl_penalty = \"kl\", \"k3\", \"abs\" or \"mse\", or [generation] logprob_support = \
                        \"vocabulary\" (TRL's biased logprobs)",
            ));
        }
        if self.model.path.is_empty() {
            return Err(ConfigError::new("model", "path", "is empty; set it to a model directory or hub id"));
        }
        if let Some(c) = &self.critic {
            if c.path.is_empty() {
                return Err(ConfigError::new(
                    "critic",
                    "path",
                    "is empty; set it to a model directory or hub id (a causal LM \
                            with the policy's tokenizer), or remove the [critic] table",
                ));
            }
            if let Some(lr) = c.learning_rate.filter(|lr| !(lr.is_finite() && *lr > 0.0)) {
                return Err(ConfigError::new(
                    "critic",
                    "learning_rate",
                    format!("must be a positive number, got {lr}"),
                ));
            }
        }
        if let Some(l) = self.critic.as_ref().and_then(|c| c.lora.as_ref()) {
            l.validate("critic.lora")?;
        }
        if self.critic.is_some() && self.algorithm.kind != AlgorithmKind::Ppo {
            return Err(ConfigError::new(
                "critic",
                "",
                "[critic] works with PPO only (rejection sampling, GRPO and RLOO learn no \
                        values); remove the [critic] table or set [algorithm] kind = \"ppo\"",
            ));
        }
        if let Some(env) = &self.env {
            return self.validate_games(env);
        }
        if self.data.source.is_empty() {
            return Err(ConfigError::new(
                "data",
                "source",
                "is empty; set it to a JSONL/CSV/Parquet file or hub dataset (or \
                        add an [env] table to train on text games)",
            ));
        }
        if self.data.min_query_tokens == 0 || self.data.max_query_tokens <= self.data.min_query_tokens {
            return Err(ConfigError::new(
                "data",
                "",
                format!(
                    "[data] needs 0 < min_query_tokens < max_query_tokens (got {} and {}; max is exclusive)",
                    self.data.min_query_tokens, self.data.max_query_tokens
                ),
            ));
        }
        if self.reward.sources.is_empty() {
            return Err(ConfigError::new("reward", "", "[reward] has no sources; add a [[reward.sources]] table (kind = \"classifier\", \"command\", \"http\", \"llm_judge\" or \"exact_match\")"));
        }
        Ok(())
    }

    /// The run loop's plan for a run of `total_steps` from `start_step`: a checkpoint every
    /// `[checkpoint] every` steps and after the last, the report every `[logging] report_every`.
    pub fn plan(&self, total_steps: usize, start_step: usize) -> crate::engine::run_loop::Plan {
        crate::engine::run_loop::Plan {
            total_steps,
            start_step,
            checkpoint_every: self.checkpoint.every,
            checkpoint_at_end: true,
            report_every: self.logging.report_every,
        }
    }

    /// The resolved config as TOML (saved in the run directory), without the tables of the
    /// other trainers (so it loads again: see `Self::check_tables`).
    pub fn to_toml(&self) -> Result<String> {
        let err = |e: &dyn std::fmt::Display| Error::Internal(format!("cannot serialize the config: {e}"));
        let mut doc = toml::Table::try_from(self).map_err(|e| err(&e))?;
        for table in self.unused_tables() {
            doc.remove(*table);
        }
        if self.algorithm.kind.is_group() {
            if let Some(toml::Value::Table(data)) = doc.get_mut("data") {
                data.remove("min_query_tokens");
                data.remove("max_query_tokens");
            }
        }
        toml::to_string_pretty(&doc).map_err(|e| err(&e))
    }
}

/// Whether `[table] key` is given in `text` or by an override (`table.key=…`).
pub(super) fn sets_key(text: &str, overrides: &[String], table: &str, key: &str) -> bool {
    let in_text = toml::from_str::<toml::Table>(text)
        .ok()
        .and_then(|t| t.get(table).and_then(|p| p.as_table()).map(|p| p.contains_key(key)))
        .unwrap_or(false);
    let dotted = format!("{table}.{key}");
    in_text || overrides.iter().any(|o| o.split('=').next().is_some_and(|k| k.trim() == dotted))
}

/// Whether `[table]` is given in `text` or by an override (`table.…=…`).
pub(super) fn sets_table(text: &str, overrides: &[String], table: &str) -> bool {
    let in_text = toml::from_str::<toml::Table>(text).ok().is_some_and(|t| t.contains_key(table));
    let prefix = format!("{table}.");
    in_text || overrides.iter().any(|o| o.trim_start().starts_with(&prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[model]
path = "m"
[data]
source = "prompts.jsonl"
[[reward.sources]]
kind = "command"
command = ["cat"]
"#;

    #[test]
    fn minimal_config_loads_with_defaults_and_overrides() {
        let p = Path::new("run.toml");
        let c =
            RunConfig::from_toml(MINIMAL, p, &["ppo.batch_size=8".into(), "ppo.mini_batch_size=4".into()])
                .unwrap();
        assert_eq!((c.ppo.batch_size, c.ppo.mini_batch_size), (8, 4));
        assert_eq!(c.data.text_column, "text");
        let again = RunConfig::from_toml(&c.to_toml().unwrap(), p, &[]).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn typo_gets_the_closest_key() {
        let p = Path::new("run.toml");
        let text = MINIMAL.replace("source = ", "sourse = ");
        let err = RunConfig::from_toml(&text, p, &[]).unwrap_err().to_string();
        assert!(err.contains("\"sourse\"") && err.contains("did you mean \"source\""), "{err}");
        assert!(err.contains("line 5"), "{err}");
        let err =
            RunConfig::from_toml(MINIMAL, p, &["generation.max_new_tokns=3".into()]).unwrap_err().to_string();
        assert!(err.contains("did you mean \"max_new_tokens\""), "{err}");
    }

    /// Regression (issue #28, defect 4): the two temperatures could differ silently, so the
    /// rollout-cached logprobs and the training logprobs came from different distributions.
    #[test]
    fn ppo_temperature_follows_generation_and_a_mismatch_names_both_keys() {
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &["generation.temperature=0.7".into()]).unwrap();
        assert_eq!((c.generation.temperature, c.ppo.temperature), (0.7, 0.7));
        let text = format!("{MINIMAL}[generation]\ntemperature = 0.5\n");
        assert_eq!(RunConfig::from_toml(&text, p, &[]).unwrap().ppo.temperature, 0.5);
        let same = ["generation.temperature=0.7".into(), "ppo.temperature=0.7".into()];
        assert_eq!(RunConfig::from_toml(MINIMAL, p, &same).unwrap().ppo.temperature, 0.7);
        for set in [
            vec!["ppo.temperature=0.7".to_string()],
            vec!["generation.temperature=0.7".into(), "ppo.temperature=1.0".into()],
        ] {
            let err = RunConfig::from_toml(MINIMAL, p, &set).unwrap_err().to_string();
            assert!(err.contains("ppo.temperature") && err.contains("[generation] temperature"), "{err}");
        }
        let text = format!("{MINIMAL}[ppo]\ntemperature = 2.0\n");
        let err = RunConfig::from_toml(&text, p, &[]).unwrap_err().to_string();
        assert!(err.contains("ppo.temperature = 2"), "{err}");
    }

    #[test]
    fn critic_table_parses_and_bad_input_names_the_field() {
        let p = Path::new("run.toml");
        assert_eq!(RunConfig::from_toml(MINIMAL, p, &[]).unwrap().critic, None);
        let text = format!("{MINIMAL}[critic]\npath = \"critic-model\"\nlearning_rate = 5e-6\n");
        let c = RunConfig::from_toml(&text, p, &[]).unwrap();
        let critic = c.critic.clone().unwrap();
        assert_eq!((critic.path.as_str(), critic.learning_rate(&c.ppo)), ("critic-model", 5e-6));
        assert_eq!(RunConfig::from_toml(&c.to_toml().unwrap(), p, &[]).unwrap(), c);
        // The learning rate defaults to the policy's.
        let c = RunConfig::from_toml(MINIMAL, p, &["critic.path=m2".into(), "ppo.learning_rate=2e-5".into()])
            .unwrap();
        assert_eq!(c.critic.unwrap().learning_rate(&c.ppo), 2e-5);
        let bad = |extra: &str| {
            let text = format!("{MINIMAL}[critic]\n{extra}\n");
            RunConfig::from_toml(&text, p, &[]).unwrap_err().to_string()
        };
        let err = bad("learning_rate = 1e-5");
        assert!(err.contains("run.toml") && err.contains("critic") && err.contains("`path`"), "{err}");
        let err = bad("path = \"\"");
        assert!(err.contains("critic.path is empty"), "{err}");
        let err = bad("path = \"m\"\nlearning_rate = -1.0");
        assert!(err.contains("critic.learning_rate must be a positive number"), "{err}");
        let err = bad("path = \"m\"\nlearning_rat = 1e-5");
        assert!(err.contains("did you mean \"learning_rate\""), "{err}");
        let err = bad("path = \"m\"\nvalue_head = \"mlp\"");
        assert!(err.contains("\"value_head\""), "{err}");
        let err = bad("path = \"m\"\n[algorithm]\nkind = \"rejection_sampling\"");
        assert!(err.contains("[critic] works with PPO only"), "{err}");
        // With text games the critic gives the turns' bootstraps (issue #29).
        let games = "[model]\npath = \"m\"\n[env]\nkind = \"letters\"\n[critic]\npath = \"c\"\n";
        assert!(RunConfig::from_toml(games, p, &[]).unwrap().critic.is_some());
        let err = RunConfig::from_toml(MINIMAL, p, &["ppo.value_head=mlp2".into()]).unwrap_err().to_string();
        assert!(err.contains("mlp2") && err.contains("linear"), "{err}");
        let err =
            RunConfig::from_toml(MINIMAL, p, &["ppo.value_head_hidden=8".into()]).unwrap_err().to_string();
        assert!(err.contains("ppo.value_head_hidden") && err.contains("value_head = \"mlp\""), "{err}");
    }

    #[test]
    fn matmul_precision_is_f32_unless_set_and_names_bad_values() {
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &[]).unwrap();
        assert_eq!(c.runtime.matmul_precision, crate::ops::MatmulPrecision::F32);
        let c = RunConfig::from_toml(MINIMAL, p, &["runtime.matmul_precision=bf16".into()]).unwrap();
        assert_eq!(c.runtime.matmul_precision, crate::ops::MatmulPrecision::Bf16);
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.matmul_precision=fp8".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("fp8") && err.contains("bf16") && err.contains("f32"), "{err}");
        let err = "fp8".parse::<crate::ops::MatmulPrecision>().unwrap_err();
        assert!(err.contains("\"fp8\"") && err.contains("\"bf16\""), "{err}");
    }

    #[test]
    fn the_adventure_ppo_example_config_loads_with_its_games_and_shaping() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/adventure-ppo.toml");
        let c = RunConfig::load(&p, &[]).unwrap();
        assert_eq!(c.env.as_ref().map(|e| e.kind), Some(crate::agent::config::EnvKind::Adventure));
        assert_eq!((c.episodes.shaping.invalid_penalty, c.episodes.game_gamma), (0.1, 0.6));
        // The quickstart's family and PPO settings (its BC policy is trained on that family).
        let e = c.env.as_ref().unwrap();
        assert_eq!(
            (e.adventure.rooms, e.adventure.doors, e.adventure.distractors, e.adventure.quest_length),
            (5, true, 3, 4)
        );
        assert_eq!(c.agent.actions, crate::envs::play::ActionMode::Admissible);
        assert_eq!((c.ppo.batch_size, c.ppo.mini_batch_size, c.ppo.ppo_epochs), (256, 16, 1));
        let rs = RunConfig::load(&p, &["algorithm.kind=rejection_sampling".into()]).unwrap();
        assert_eq!(rs.algorithm.kind, AlgorithmKind::RejectionSampling);
        let e = RunConfig::load(&p, &["algorithm.kind=dpo".into()]).unwrap_err().to_string();
        assert!(e.contains("rejection_sampling"), "{e}");
    }

    /// `[episodes] train_turns = "round"` sizes PPO steps; GRPO/RLOO and rejection sampling,
    /// which choose their turns otherwise, refuse it naming the key.
    #[test]
    fn round_train_turns_is_for_ppo_steps() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let round = "episodes.train_turns=round".to_string();
        let c = RunConfig::load(&dir.join("adventure-ppo.toml"), std::slice::from_ref(&round)).unwrap();
        assert_eq!(c.episodes.train_turns, TrainTurns::Round);
        let rs = ["algorithm.kind=rejection_sampling".to_string(), round.clone()];
        let err = RunConfig::load(&dir.join("adventure-ppo.toml"), &rs).unwrap_err().to_string();
        assert!(err.contains("train_turns") && err.contains("rejection sampling"), "{err}");
        let err = RunConfig::load(&dir.join("adventure-grpo.toml"), &[round]).unwrap_err().to_string();
        assert!(err.contains("train_turns") && err.contains("grpo"), "{err}");
        let err = RunConfig::load(&dir.join("adventure-ppo.toml"), &["episodes.train_turns=all".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("all") && err.contains("round"), "{err}");
    }

    #[test]
    fn the_adventure_grpo_example_config_loads_with_its_groups() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/adventure-grpo.toml");
        let c = RunConfig::load(&p, &[]).unwrap();
        assert_eq!(c.algorithm.kind, AlgorithmKind::Grpo);
        assert_eq!(c.agent.actions, crate::envs::play::ActionMode::Admissible);
        let shape = c.group_shape(crate::run::episodes::training_games(0), 1).unwrap();
        assert_eq!((shape.prompts_per_step, shape.num_generations, shape.steps), (4, 8, 40));
        assert_eq!(c.episodes.gigpo, None);
        // GiGPO as its comment says: one key, the rest at verl-agent's defaults.
        let c = RunConfig::load(&p, &["episodes.gigpo.step_advantage_w=1.0".into()]).unwrap();
        assert_eq!(c.episodes.gigpo, Some(crate::grpo::gigpo::GigpoArgs::default()));
        let bad = ["episodes.gigpo.gamma=2".into()];
        let err = RunConfig::load(&p, &bad).unwrap_err().to_string();
        assert!(err.contains("episodes.gigpo.gamma"), "{err}");
    }

    #[test]
    fn runtime_is_auto_f32_unless_set_and_names_bad_values() {
        use crate::runtime::{DeviceChoice, Precision};
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &[]).unwrap();
        assert_eq!((c.runtime.device, c.runtime.dtype), (DeviceChoice::Auto, Precision::F32));
        let set = ["runtime.device=cuda:1".into(), "runtime.dtype=bf16".into()];
        let c = RunConfig::from_toml(MINIMAL, p, &set).unwrap();
        assert_eq!((c.runtime.device, c.runtime.dtype), (DeviceChoice::Cuda(1), Precision::Bf16));
        assert_eq!(RunConfig::from_toml(&c.to_toml().unwrap(), p, &[]).unwrap(), c);
        let text = format!("{MINIMAL}[runtime]\ndevice = \"cpu\"\n");
        assert_eq!(RunConfig::from_toml(&text, p, &[]).unwrap().runtime.device, DeviceChoice::Cpu);
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.device=tpu".into()]).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains("\"tpu\"") && err.contains("\"cuda:N\""), "{err}");
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.dtype=f16".into()]).unwrap_err().to_string();
        assert!(err.contains("\"f16\"") && err.contains("\"bf16\""), "{err}");
        let err = RunConfig::from_toml(MINIMAL, p, &["runtime.devices=cpu".into()]).unwrap_err().to_string();
        assert!(err.contains("did you mean \"device\""), "{err}");
    }
}
