//! The run config with `[algorithm] kind = "grpo"` or `"rloo"`: the `[grpo]` / `[rloo]` table
//! (TRL 1.16.0's `GRPOConfig` / `RLOOConfig` names) and how it meets the loop's other tables.
//!
//! - **Sampling keys follow `[generation]`**, as `[ppo] temperature` does: `temperature`,
//!   `max_completion_length` (= `[generation] max_new_tokens`), `top_p`, `top_k` and `min_p`
//!   (unset = `[generation] min_p = 0`). A key set on one side only is copied to the other; set
//!   on both sides with different values, it is an error naming both keys. `repetition_penalty`
//!   must stay 1.0 (the sampler has none). With top-k, top-p or min-p the step renormalizes
//!   over each token's sampled support unless `[generation] logprob_support = "vocabulary"`.
//! - **Batch**: `per_device_train_batch_size` (TRL's default 8) completions per step, that is
//!   `per_device_train_batch_size / num_generations` prompts with `num_generations` completions
//!   each (TRL with `steps_per_generation = 1` and one process). It must be a multiple of
//!   `num_generations`.
//! - **Length**: `max_steps` optimizer steps; each step of the loop samples one batch and makes
//!   `num_iterations` optimizer steps on it, so the loop runs `max_steps / num_iterations` steps
//!   (`max_steps` must be a multiple). With `max_steps ≤ 0`, TRL's rule:
//!   `ceil(num_train_epochs · ⌊prompts / prompts per step⌋ · num_iterations)`.
//! - **Rewards**: the `[[reward.sources]]`, each one reward function with its `weight` (TRL's
//!   `reward_weights`) and its `name` in the metrics; `reward_weights` and `reward_funcs` must
//!   stay unset here.
//! - **Prompts are used whole** (TRL's GRPO does not cut them): `[data] min_query_tokens` and
//!   `max_query_tokens` must not be set.
//! - **PPO-only tables are errors**: `[ppo]`, `[critic]` and `[rejection]` (and `[grpo]` with
//!   `kind = "rloo"`, or the reverse) would be ignored, so a file or `--set` that has them is
//!   refused, naming the table. The seed of the prompt order is `[grpo] seed`; sampling's is
//!   `[generation] seed`.
//! - **Text games** (`[env]`, [`super::group_loop`]'s `games`): trajectory-level GRPO / RLOO. A
//!   step plays `num_generations` episodes of each of `per_device_train_batch_size /
//!   num_generations` training games; an episode's return (the game's rewards plus
//!   `[episodes.shaping]`) is its reward, and its advantage goes to every turn. `max_steps`
//!   must be set, `[data]`, `[[reward.sources]]`, `[eval]` and `example_turn_prob` must not.

use super::config::{sets_key, sets_table, AlgorithmKind, RunConfig};
use crate::error::ConfigError;

/// The loop's sizes, resolved from `[grpo]` / `[rloo]` and the number of prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    /// Completions per prompt.
    pub num_generations: usize,
    /// Prompts per step.
    pub prompts_per_step: usize,
    /// Steps of the loop (generation batches).
    pub steps: usize,
    /// Optimizer steps per generation batch.
    pub num_iterations: usize,
    /// Optimizer steps per epoch of the prompts (for TRL's `epoch`).
    pub steps_per_epoch: usize,
}

/// Runs `$body` with `$c` bound to the active table (`&$self.grpo` or `&$self.rloo`, with
/// `$m` mutability) and `$t` to its name; both have TRL's shared field names.
macro_rules! with_table {
    ($self:expr, $c:ident, $t:ident, $body:block) => {
        match $self.algorithm.kind {
            AlgorithmKind::Rloo => {
                let $c = &$self.rloo;
                let $t = "rloo";
                $body
            }
            _ => {
                let $c = &$self.grpo;
                let $t = "grpo";
                $body
            }
        }
    };
    (mut $self:expr, $c:ident, $t:ident, $body:block) => {
        match $self.algorithm.kind {
            AlgorithmKind::Rloo => {
                let $c = &mut $self.rloo;
                let $t = "rloo";
                $body
            }
            _ => {
                let $c = &mut $self.grpo;
                let $t = "grpo";
                $body
            }
        }
    };
}

/// TRL's default `per_device_train_batch_size`.
const TRL_BATCH_SIZE: usize = 8;

impl RunConfig {
    /// The tables the active trainer does not read (left out of [`Self::to_toml`]).
    pub(super) fn unused_tables(&self) -> &'static [&'static str] {
        match self.algorithm.kind {
            AlgorithmKind::Ppo | AlgorithmKind::RejectionSampling => &["grpo", "rloo", "eval"],
            AlgorithmKind::Grpo => &["ppo", "rejection", "rloo"],
            AlgorithmKind::Rloo => &["ppo", "rejection", "grpo"],
        }
    }

    /// Refuses tables (in the file or `--set`) that the active trainer would ignore.
    pub(super) fn check_tables(
        &self,
        text: &str,
        overrides: &[String],
    ) -> std::result::Result<(), ConfigError> {
        let kind = self.algorithm.kind.name();
        for table in self.unused_tables() {
            if sets_table(text, overrides, table) {
                let why = if *table == "eval" {
                    "[eval] is read by GRPO and RLOO runs; PPO on games evaluates with [episodes] \
                     eval_every"
                        .to_string()
                } else if self.algorithm.kind.is_group() {
                    format!("the {kind} settings are in [{kind}] (TRL's names)")
                } else {
                    format!("[{table}] is read with [algorithm] kind = \"{table}\"")
                };
                return Err(ConfigError::new(*table, "", format!("[{table}] is set but [algorithm] kind = \"{kind}\", which does not read it ({why}); \
                     remove [{table}] or change [algorithm] kind"
                )));
            }
        }
        if self.algorithm.kind.is_group() {
            for key in ["min_query_tokens", "max_query_tokens"] {
                if sets_key(text, overrides, "data", key) {
                    return Err(ConfigError::new(
                        "data",
                        key,
                        format!(
                            "is set but [algorithm] kind = \"{kind}\" uses each prompt whole \
                         (as TRL's trainer); remove it"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Copies each sampling key set on one side only (`[grpo]`/`[rloo]` or `[generation]`) to
    /// the other; keys set on neither side take `[generation]`'s defaults.
    pub(super) fn follow_generation(&mut self, text: &str, overrides: &[String]) {
        if !self.algorithm.kind.is_group() {
            return;
        }
        let gen_sets = |k: &str| sets_key(text, overrides, "generation", k);
        let gen = &mut self.generation;
        with_table!(mut self, c, t, {
            let sets = |k: &str| sets_key(text, overrides, t, k);
            if !sets("temperature") {
                c.temperature = gen.temperature;
            } else if !gen_sets("temperature") {
                gen.temperature = c.temperature;
            }
            if !sets("max_completion_length") {
                c.max_completion_length = gen.max_new_tokens;
            } else if !gen_sets("max_new_tokens") {
                gen.max_new_tokens = c.max_completion_length;
            }
            if !sets("top_p") {
                c.top_p = gen.top_p;
            } else if !gen_sets("top_p") {
                gen.top_p = c.top_p;
            }
            if !sets("top_k") {
                c.top_k = gen.top_k;
            } else if !gen_sets("top_k") {
                gen.top_k = c.top_k;
            }
            // TRL's unset min_p is 0 here (both keep every token).
            if !sets("min_p") {
                c.min_p = (gen.min_p > 0.0).then_some(gen.min_p);
            } else if !gen_sets("min_p") {
                gen.min_p = c.min_p.unwrap_or(0.0);
            }
        });
    }

    /// Names of the reward sources in the metrics must differ.
    pub(super) fn validate_reward_names(&self) -> std::result::Result<(), ConfigError> {
        let names: Vec<String> = self.reward.sources.iter().map(|s| s.metric_name()).collect();
        for (i, n) in names.iter().enumerate() {
            if n.is_empty() || n.contains(char::is_whitespace) {
                return Err(ConfigError::new(
                    "reward.sources",
                    "",
                    format!(
                        "[[reward.sources]] {}: name {n:?} must be a non-empty word (it names the metrics \
                     rewards/<name>/mean and /std)",
                        i + 1
                    ),
                ));
            }
            if let Some(j) = names[..i].iter().position(|m| m == n) {
                return Err(ConfigError::new(
                    "reward.sources",
                    "",
                    format!(
                        "[[reward.sources]] {} and {} are both named {n:?} in the metrics; give one a \
                     name = \"...\"",
                        j + 1,
                        i + 1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The checks of a GRPO / RLOO run; messages name the field.
    pub(super) fn validate_group(&self) -> std::result::Result<(), ConfigError> {
        let kind = self.algorithm.kind.name();
        self.generation.validate()?;
        self.eval.validate()?;
        if self.model.path.is_empty() {
            return Err(ConfigError::new("model", "path", "is empty; set it to a model directory or hub id"));
        }
        if self.critic.is_some() {
            return Err(ConfigError::new(
                "critic",
                "",
                format!(
                    "[critic] is set but [algorithm] kind = \"{kind}\" has no value model (advantages \
                 compare the completions of a prompt); remove [critic]"
                ),
            ));
        }
        if let Some(env) = &self.env {
            self.validate_group_games(env)?;
        } else if self.data.source.is_empty() {
            return Err(ConfigError::new(
                "data",
                "source",
                "is empty; set it to a JSONL/CSV/Parquet file or hub dataset",
            ));
        }
        if self.reward.sources.is_empty() && self.env.is_none() {
            return Err(ConfigError::new(
                "reward",
                "",
                "[reward] has no sources; add a [[reward.sources]] table (kind = \
                        \"exact_match\", \"classifier\", \"command\", \"http\" or \"llm_judge\")",
            ));
        }
        let gen = &self.generation;
        with_table!(self, c, t, {
            c.validate()?;
            let min_p = c.min_p.unwrap_or(0.0);
            let pairs: [(&str, String, &str, String); 5] = [
                ("temperature", c.temperature.to_string(), "temperature", gen.temperature.to_string()),
                (
                    "max_completion_length",
                    c.max_completion_length.to_string(),
                    "max_new_tokens",
                    gen.max_new_tokens.to_string(),
                ),
                ("top_p", c.top_p.to_string(), "top_p", gen.top_p.to_string()),
                ("top_k", c.top_k.to_string(), "top_k", gen.top_k.to_string()),
                ("min_p", min_p.to_string(), "min_p", gen.min_p.to_string()),
            ];
            for (key, a, gen_key, b) in pairs {
                if a != b {
                    return Err(ConfigError::new(
                        t,
                        key,
                        format!(
                            "= {a} but [generation] {gen_key} = {b}: completions are sampled with \
                         [generation] and scored with [{t}], so the two must agree; leave one out (it \
                         follows the other) or set both to the same value"
                        ),
                    ));
                }
            }
            if c.repetition_penalty != 1.0 {
                return Err(ConfigError::new(
                    t,
                    "repetition_penalty",
                    format!("= {}; rltune's sampler has none: leave it at 1.0", c.repetition_penalty),
                ));
            }
            if c.reward_weights.is_some() || c.reward_funcs.is_some() {
                return Err(ConfigError::new(
                    t,
                    "reward_weights",
                    format!(
                        "/ reward_funcs are set; in a run the reward functions are the \
                     [[reward.sources]], each with its weight = ... and name = ...: remove them from [{t}]"
                    ),
                ));
            }
            let bs = c.per_device_train_batch_size.unwrap_or(TRL_BATCH_SIZE);
            if bs == 0 || !bs.is_multiple_of(c.num_generations) {
                return Err(ConfigError::new(
                    t,
                    "per_device_train_batch_size",
                    format!(
                        "= {bs} is not a positive multiple of num_generations \
                     = {}: a step samples num_generations completions for each of \
                     per_device_train_batch_size / num_generations prompts",
                        c.num_generations
                    ),
                ));
            }
            if let Some(g) = c.generation_batch_size.filter(|&g| g != bs) {
                return Err(ConfigError::new(
                    t,
                    "generation_batch_size",
                    format!(
                        "= {g} but per_device_train_batch_size = {bs}; rltune \
                     samples one batch per step: remove generation_batch_size"
                    ),
                ));
            }
            if c.max_steps > 0 && !(c.max_steps as usize).is_multiple_of(c.num_iterations) {
                return Err(ConfigError::new(
                    t,
                    "max_steps",
                    format!(
                        "= {} is not a multiple of num_iterations = {}: each batch gives \
                     num_iterations optimizer steps",
                        c.max_steps, c.num_iterations
                    ),
                ));
            }
            Ok(())
        })
    }

    /// The checks of trajectory-level GRPO / RLOO on text games (`[env]`).
    fn validate_group_games(
        &self,
        env: &crate::agent::config::EnvSection,
    ) -> std::result::Result<(), ConfigError> {
        let kind = self.algorithm.kind.name();
        self.validate_games(env)?;
        if self.eval.enabled() {
            return Err(ConfigError::new(
                "eval",
                "",
                format!(
                    "[eval] is set with [env]; a {kind} run on games evaluates on held-out games with \
                 [episodes] eval_every and eval_episodes: remove [eval]"
                ),
            ));
        }
        if self.episodes.example_turn_prob > 0.0 {
            return Err(ConfigError::new(
                "episodes",
                "example_turn_prob",
                format!(
                    "= {} with [algorithm] kind = \"{kind}\": an episode's return \
                 scores the policy's own play, so example turns would credit it with random commands; \
                 set it to 0",
                    self.episodes.example_turn_prob
                ),
            ));
        }
        if self.episodes.train_turns == super::config::TrainTurns::Round {
            return Err(ConfigError::new(
                "episodes",
                "train_turns",
                format!(
                    "= \"round\" with [algorithm] kind = \"{kind}\": it chooses the \
                 turns of a PPO step; a {kind} step trains on every episode of its groups already. \
                 Remove train_turns"
                ),
            ));
        }
        with_table!(self, c, t, {
            if c.max_steps <= 0 {
                return Err(ConfigError::new(
                    t,
                    "max_steps",
                    "is not set; with [env] there is no epoch of prompts to count: set \
                     max_steps (optimizer steps)",
                ));
            }
        });
        Ok(())
    }

    /// The loop's sizes for `n_prompts` prompts on `world` processes (TRL's meaning: each process
    /// trains on `per_device_train_batch_size` completions, so a step takes `world` times as many
    /// prompts); an error when they make no step.
    pub fn group_shape(
        &self,
        n_prompts: usize,
        world: usize,
    ) -> std::result::Result<GroupShape, ConfigError> {
        with_table!(self, c, t, {
            let bs = c.per_device_train_batch_size.unwrap_or(TRL_BATCH_SIZE);
            if world > 1 && !bs.is_multiple_of(c.num_generations.max(1)) {
                return Err(ConfigError::new(
                    t,
                    "per_device_train_batch_size",
                    format!(
                        "{bs} is not a multiple of num_generations {} in a \
                     data-parallel run: each process samples whole groups; make it a multiple",
                        c.num_generations
                    ),
                ));
            }
            let prompts_per_step = bs * world.max(1) / c.num_generations.max(1);
            let per_epoch = n_prompts / prompts_per_step.max(1);
            if per_epoch == 0 {
                return Err(ConfigError::new(t, "", format!("{n_prompts} prompts but a step takes {prompts_per_step} ([{t}] per_device_train_batch_size \
                     {bs} / num_generations {}); add prompts or lower the batch",
                    c.num_generations
                )));
            }
            let mu = c.num_iterations;
            let optimizer_steps = if c.max_steps > 0 {
                c.max_steps as usize
            } else {
                // transformers: max_steps = ceil(num_train_epochs · num_update_steps_per_epoch).
                (c.num_train_epochs * (per_epoch * mu) as f64).ceil() as usize
            };
            let steps = optimizer_steps.div_ceil(mu);
            if steps == 0 {
                return Err(ConfigError::new(t, "max_steps", "/ num_train_epochs give no step; raise them"));
            }
            Ok(GroupShape {
                num_generations: c.num_generations,
                prompts_per_step,
                steps,
                num_iterations: mu,
                steps_per_epoch: per_epoch * mu,
            })
        })
    }

    /// The completions per step (`per_device_train_batch_size`, TRL's default 8).
    pub fn group_batch_size(&self) -> usize {
        with_table!(self, c, _t, { c.per_device_train_batch_size.unwrap_or(TRL_BATCH_SIZE) })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const GRPO: &str = r#"
[model]
path = "m"
[algorithm]
kind = "grpo"
[data]
source = "prompts.jsonl"
[[reward.sources]]
kind = "exact_match"
column = "answer"
"#;

    fn load(text: &str, set: &[&str]) -> Result<RunConfig, String> {
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        RunConfig::from_toml(text, Path::new("run.toml"), &set).map_err(|e| e.to_string())
    }

    #[test]
    fn sampling_keys_follow_generation_either_way_and_a_mismatch_names_both() {
        let c = load(GRPO, &[]).unwrap();
        assert_eq!((c.grpo.max_completion_length, c.grpo.temperature), (20, 1.0));
        let c = load(GRPO, &["generation.max_new_tokens=6", "generation.temperature=0.7"]).unwrap();
        assert_eq!((c.grpo.max_completion_length, c.grpo.temperature), (6, 0.7));
        let c = load(GRPO, &["grpo.max_completion_length=9", "grpo.top_k=5"]).unwrap();
        assert_eq!((c.generation.max_new_tokens, c.generation.top_k), (9, 5));
        let c = load(GRPO, &["grpo.temperature=0.9", "generation.temperature=0.9"]).unwrap();
        assert_eq!(c.generation.temperature, 0.9);
        let err = load(GRPO, &["grpo.temperature=0.9", "generation.temperature=0.8"]).unwrap_err();
        assert!(
            err.contains("grpo.temperature = 0.9") && err.contains("[generation] temperature = 0.8"),
            "{err}"
        );
        let err = load(GRPO, &["grpo.max_completion_length=9", "generation.max_new_tokens=8"]).unwrap_err();
        assert!(
            err.contains("grpo.max_completion_length") && err.contains("[generation] max_new_tokens"),
            "{err}"
        );
        // RLOO: the same, under [rloo].
        let rloo = GRPO.replace("kind = \"grpo\"", "kind = \"rloo\"");
        let c = load(&rloo, &["generation.max_new_tokens=6"]).unwrap();
        assert_eq!(c.rloo.max_completion_length, 6);
        let err = load(&rloo, &["rloo.top_p=0.5", "generation.top_p=0.9"]).unwrap_err();
        assert!(err.contains("rloo.top_p") && err.contains("[generation] top_p"), "{err}");
    }

    #[test]
    fn tables_of_other_trainers_and_loop_fields_are_errors_naming_the_field() {
        let err = load(GRPO, &["ppo.learning_rate=1e-5"]).unwrap_err();
        assert!(err.contains("[ppo] is set but [algorithm] kind = \"grpo\""), "{err}");
        let err = load(&format!("{GRPO}[rloo]\nbeta = 0.1\n"), &[]).unwrap_err();
        assert!(err.contains("[rloo] is set"), "{err}");
        let err = load(GRPO, &["data.max_query_tokens=9"]).unwrap_err();
        assert!(err.contains("data.max_query_tokens") && err.contains("whole"), "{err}");
        let err = load(GRPO, &["critic.path=c"]).unwrap_err();
        assert!(err.contains("[critic]") && err.contains("no value model"), "{err}");
        let err = load(GRPO, &["grpo.per_device_train_batch_size=12"]).unwrap_err();
        assert!(
            err.contains("per_device_train_batch_size = 12") && err.contains("num_generations = 8"),
            "{err}"
        );
        let err = load(GRPO, &["grpo.reward_weights=[1.0]"]).unwrap_err();
        assert!(err.contains("reward_weights") && err.contains("weight = "), "{err}");
        let err = load(GRPO, &["grpo.max_steps=5", "grpo.num_iterations=2"]).unwrap_err();
        assert!(err.contains("max_steps = 5") && err.contains("num_iterations = 2"), "{err}");
        let c = load(GRPO, &["grpo.min_p=0.1"]).unwrap();
        assert_eq!((c.generation.min_p, c.grpo.min_p), (0.1, Some(0.1)));
        let c = load(GRPO, &["generation.min_p=0.2"]).unwrap();
        assert_eq!(c.grpo.min_p, Some(0.2));
        let err = load(GRPO, &["grpo.min_p=0.1", "generation.min_p=0.2"]).unwrap_err();
        assert!(err.contains("grpo.min_p") && err.contains("[generation] min_p"), "{err}");
        let err = load(GRPO, &["grpo.epsilon_hgh=0.3"]).unwrap_err();
        assert!(err.contains("did you mean \"epsilon_high\""), "{err}");
        let err = load(GRPO, &["grpo.loss_type=sapo"]).unwrap_err();
        assert!(err.contains("grpo.loss_type") && err.contains("not implemented"), "{err}");
        // A [grpo] table in a PPO run would be ignored.
        let ppo = GRPO.replace("kind = \"grpo\"", "kind = \"ppo\"");
        let err = load(&ppo, &["grpo.beta=0.1"]).unwrap_err();
        assert!(err.contains("[grpo] is set but [algorithm] kind = \"ppo\""), "{err}");
        let two = format!("{GRPO}[[reward.sources]]\nkind = \"exact_match\"\ncolumn = \"gold\"\n");
        let err = load(&two, &[]).unwrap_err();
        assert!(err.contains("both named \"exact_match\"") && err.contains("name = "), "{err}");
        let named =
            format!("{GRPO}[[reward.sources]]\nkind = \"exact_match\"\ncolumn = \"gold\"\nname = \"gold\"\n");
        load(&named, &[]).unwrap();
    }

    /// Trajectory GRPO/RLOO on games: `[env]` instead of `[data]` and rewards, `max_steps` set;
    /// what would mean nothing there is refused, naming it.
    #[test]
    fn games_replace_data_and_rewards_and_need_max_steps() {
        let games = "[model]\npath = \"m\"\n[algorithm]\nkind = \"grpo\"\n[env]\nkind = \"letters\"\n";
        let c = load(games, &["grpo.max_steps=4", "grpo.num_generations=4"]).unwrap();
        assert_eq!(c.group_shape(1 << 20, 1).unwrap().prompts_per_step, 2);
        let err = load(games, &[]).unwrap_err();
        assert!(err.contains("grpo.max_steps is not set"), "{err}");
        let rloo = games.replace("\"grpo\"", "\"rloo\"");
        let err = load(&rloo, &[]).unwrap_err();
        assert!(err.contains("rloo.max_steps is not set"), "{err}");
        let set = |extra: &str| load(games, &["grpo.max_steps=4", extra]).unwrap_err();
        let err = set("episodes.example_turn_prob=0.2");
        assert!(err.contains("example_turn_prob") && err.contains("set it to 0"), "{err}");
        let err = set("data.source=\"p.jsonl\"");
        assert!(err.contains("[data] source and [env]"), "{err}");
        let err = set("eval.source=\"p.jsonl\"");
        assert!(err.contains("[eval] is set with [env]") && err.contains("eval_every"), "{err}");
        let with_reward = format!("{games}[[reward.sources]]\nkind = \"exact_match\"\ncolumn = \"a\"\n");
        let err = load(&with_reward, &["grpo.max_steps=4"]).unwrap_err();
        assert!(err.contains("reward.sources are set with [env]"), "{err}");
    }

    #[test]
    fn resolved_config_saves_and_loads_again() {
        let c = load(GRPO, &["grpo.num_generations=4", "generation.max_new_tokens=6"]).unwrap();
        let text = c.to_toml().unwrap();
        assert!(!text.contains("[ppo]") && !text.contains("min_query_tokens"), "{text}");
        assert_eq!(load(&text, &[]).unwrap(), c);
        let ppo = load(&GRPO.replace("kind = \"grpo\"", "kind = \"ppo\""), &[]).unwrap();
        assert!(!ppo.to_toml().unwrap().contains("[grpo]"));
    }

    #[test]
    fn shape_follows_trl_batch_and_length_rules() {
        let c = load(GRPO, &["grpo.num_generations=4", "grpo.per_device_train_batch_size=16"]).unwrap();
        // No max_steps: ceil(3 epochs · ⌊10 / 4⌋ batches) = 6 steps.
        let s = c.group_shape(10, 1).unwrap();
        assert_eq!((s.prompts_per_step, s.steps, s.steps_per_epoch), (4, 6, 2));
        let c = load(GRPO, &["grpo.max_steps=12", "grpo.num_iterations=3"]).unwrap();
        let s = c.group_shape(10, 1).unwrap();
        assert_eq!((s.prompts_per_step, s.steps, s.num_iterations), (1, 4, 3));
        let err =
            load(GRPO, &["grpo.per_device_train_batch_size=64"]).unwrap().group_shape(7, 1).unwrap_err();
        let shown = err.to_string();
        assert!(shown.contains("7 prompts") && shown.contains("takes 8") && err.section == "grpo", "{shown}");
    }
}
