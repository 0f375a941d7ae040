//! What every rollout shares, whichever memory plays the episodes: the turns it returns
//! ([`Transition`], [`Collected`]), its settings ([`RolloutConfig`], [`Shaping`]), the model that
//! plays ([`Actor`]), and the admissible commands' trie and the prompt budget.

use std::time::Duration;

use crate::envs::letters::count_e;
use crate::envs::play::{action_text, Episode, PromptTemplate};
use crate::envs::{EnvStep, Reset, TextEnv};
use crate::error::{ConfigError, Error, Result};
use crate::generation::admissible::ActionTrie;
use crate::generation::GenerationConfig;
use crate::models::{CausalLm, CausalLmWithValueHead, ValueHead};
use crate::tokenizer::Tokenizer;

/// Reward shaping, added to the environment's reward (the score's change); every part 0 by
/// default.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Shaping {
    /// Added on the turn that wins.
    pub win_bonus: f64,
    /// Subtracted on the turn that loses.
    pub loss_penalty: f64,
    /// Subtracted for an action the game did not understand.
    pub invalid_penalty: f64,
    /// Subtracted every turn.
    pub step_cost: f64,
    /// The fork's toy reward: this much per letter "e" in the action (0: off).
    pub per_letter_e: f64,
}

impl Shaping {
    /// The shaped reward of a turn that played `action` and got `step`.
    pub fn reward(&self, action: &str, step: &EnvStep) -> f64 {
        let e = count_e(action) as f64;
        step.reward + self.win_bonus * f64::from(u8::from(step.won))
            - self.loss_penalty * f64::from(u8::from(step.lost))
            - self.invalid_penalty * f64::from(u8::from(step.invalid))
            - self.step_cost
            + self.per_letter_e * e
    }
}

/// How turns are collected.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutConfig {
    /// The prompt.
    pub template: PromptTemplate,
    /// Sampling (its `seed` starts the per-turn seeds).
    pub generation: GenerationConfig,
    /// The discount between turns (the fork's `game_gamma`, 0.6).
    pub game_gamma: f64,
    /// Probability that a turn plays a random admissible command (memory only, no training).
    pub example_turn_prob: f64,
    /// Reward shaping.
    pub shaping: Shaping,
}

/// One turn the policy played.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The environment it was played in.
    pub env: usize,
    /// The prompt's tokens.
    pub query_ids: Vec<u32>,
    /// The action's tokens, cut after the one that ends the action.
    pub response_ids: Vec<u32>,
    /// Their logprobs under the sampling distribution.
    pub logprobs: Vec<f32>,
    /// The value of the state before each of them.
    pub values: Vec<f32>,
    /// The action played.
    pub action: String,
    /// The shaped reward.
    pub reward: f32,
    /// `game_gamma · V(next state)` under the policy's value head, or 0 after the episode
    /// terminated.
    pub bootstrap: f32,
    /// The prompt of the next state, whose value `bootstrap` reads; empty after the episode
    /// terminated. A separate critic recomputes the bootstrap from it (`rebootstrap`).
    pub next_query_ids: Vec<u32>,
    /// With `[agent] actions = "admissible"`: the tokens allowed at each response position
    /// (the action's trie), over which PPO renormalises the policy; empty for free text.
    pub allowed: Vec<Vec<u32>>,
    /// The game state the action was taken from, as a key ([`anchor_state`]): GiGPO groups
    /// the turns of a game's plays by it.
    pub state: u64,
}

/// The key of the game state `step` reports, for GiGPO's anchor-state groups: the environment's
/// exact state when it reports one (`infos["state"]`, as the adventure family does; or a list of
/// world facts, `infos["facts"]`, in any order, as the TextWorld bridge reports when its `init`
/// asks for `request_infos: ["facts"]`), else its observation, inventory and admissible commands
/// together (the text a player sees; verl-agent keys on the observation alone).
pub fn anchor_state(step: &crate::envs::EnvStep) -> u64 {
    let key = |text: &str| crate::dist::fingerprint(text.as_bytes());
    let facts = step.infos.get("facts").and_then(|v| v.as_array()).map(|facts| {
        let mut each: Vec<String> = facts.iter().map(|f| f.to_string()).collect();
        each.sort_unstable();
        each.join("\n")
    });
    match (step.infos.get("state").and_then(|v| v.as_str()), facts) {
        (Some(exact), _) => key(exact),
        (None, Some(facts)) => key(&facts),
        (None, None) => {
            let commands = step.admissible_commands.join("\n");
            key(&format!("{}\u{1f}{}\u{1f}{commands}", step.observation, step.inventory))
        }
    }
}

/// The model that plays: a language model and, for PPO, the value head whose values the turns
/// carry (without one, `values` are empty and every `bootstrap` is 0: GRPO and RLOO on games).
#[derive(Clone, Copy)]
pub struct Actor<'a> {
    /// The policy.
    pub lm: &'a CausalLm,
    /// The value head.
    pub v_head: Option<&'a ValueHead>,
}

impl<'a> From<&'a CausalLmWithValueHead> for Actor<'a> {
    fn from(p: &'a CausalLmWithValueHead) -> Self {
        Self { lm: &p.lm, v_head: Some(&p.v_head) }
    }
}

impl<'a> From<&'a CausalLm> for Actor<'a> {
    fn from(lm: &'a CausalLm) -> Self {
        Self { lm, v_head: None }
    }
}

/// What one round of [`super::rollout::collect_episodes`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    /// Every turn the policy played, episode by episode, in turn order.
    pub transitions: Vec<Transition>,
    /// The finished episodes (the env's rewards, not the shaped ones), by environment.
    pub episodes: Vec<Episode>,
    /// The round's counts and times.
    pub counts: RoundCounts,
}

/// What a round of episodes counted and took (summed over a step's rounds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoundCounts {
    /// Turns that played a random admissible command (memory only).
    pub example_turns: usize,
    /// Episodes dropped because their environment failed (a restarted program); their turns
    /// are not among the transitions.
    pub dropped: usize,
    /// Time spent sampling actions (and values).
    pub time_generation: Duration,
    /// Time spent in the environments (resets and steps).
    pub time_env: Duration,
    /// Of `time_generation`, the time spent prefilling prompts (the new states' tokens with
    /// transcript memory).
    pub time_prefill: Duration,
    /// Real tokens prefilled: every turn's whole prompt with window memory, only each turn's
    /// new tokens with transcript memory.
    pub prefill_tokens: usize,
}

impl std::ops::AddAssign for RoundCounts {
    fn add_assign(&mut self, o: Self) {
        self.example_turns += o.example_turns;
        self.dropped += o.dropped;
        self.time_generation += o.time_generation;
        self.time_env += o.time_env;
        self.time_prefill += o.time_prefill;
        self.prefill_tokens += o.prefill_tokens;
    }
}

/// Drops environment `e`'s episode after its step failed: its transitions, its waiting
/// bootstrap and its summary go (the caller counts it).
pub(crate) fn drop_episode(
    e: usize,
    err: &dyn std::fmt::Display,
    out: &mut [Vec<Transition>],
    waiting: &mut [Option<usize>],
    episodes: &mut [Option<Episode>],
) {
    tracing::warn!("environment {e}: episode dropped ({err})");
    out[e].clear();
    waiting[e] = None;
    episodes[e] = None;
}

/// The trie of a state's admissible commands, each tokenized as `" {command}\n"` (what the
/// policy writes after its prompt), and the longest command's token count.
pub(crate) fn command_trie(tokenizer: &Tokenizer, commands: &[String]) -> Result<(ActionTrie, usize)> {
    if commands.is_empty() {
        return Err(Error::Setting(ConfigError::new(
            "agent",
            "actions",
            "= \"admissible\": the game lists no admissible command for this state; use actions = \
             \"free\" with environments that do not list their commands",
        )));
    }
    let tokens = commands
        .iter()
        .map(|c| {
            let ids = tokenizer.encode(&action_text(c))?;
            if ids.is_empty() {
                return Err(Error::Setting(ConfigError::new(
                    "agent",
                    "actions",
                    format!("= \"admissible\": admissible command {c:?} encodes to no token"),
                )));
            }
            Ok(ids)
        })
        .collect::<Result<Vec<_>>>()?;
    let longest = tokens.iter().map(Vec::len).max().unwrap_or(0);
    let trie = ActionTrie::new(&tokens).map_err(|e| {
        Error::Setting(ConfigError::new(
            "agent",
            "actions",
            format!("= \"admissible\": the commands {commands:?}: {e}"),
        ))
    })?;
    Ok((trie, longest))
}

/// The longest prompt a model can read when it samples `max_new_tokens` after it: its context
/// less those tokens; an error when nothing is left.
pub fn prompt_budget(lm: &CausalLm, max_new_tokens: usize) -> Result<usize> {
    let context = lm.config().max_positions().unwrap_or(usize::MAX);
    context.checked_sub(max_new_tokens).filter(|&n| n > 0).ok_or_else(|| {
        Error::Setting(ConfigError::new(
            "generation",
            "max_new_tokens",
            format!("= {max_new_tokens} leaves no room for a prompt in the model's {context} positions"),
        ))
    })
}

/// A round's start: every environment reset with `resets` (one each), their first states, each
/// one's episode record, and the time the resets took.
pub(crate) fn start_round(
    env: &mut dyn TextEnv,
    resets: &[Reset],
) -> Result<(Vec<EnvStep>, Vec<Option<Episode>>, Duration)> {
    let b = env.num_envs();
    if resets.len() != b {
        return Err(Error::argument(
            "resets",
            format!("collect_episodes: {} resets for {b} environments", resets.len()),
        ));
    }
    let envs: Vec<usize> = (0..b).collect();
    let t = std::time::Instant::now();
    let firsts = env.reset(&envs, resets)?;
    let took = t.elapsed();
    let episodes =
        firsts.iter().zip(resets).enumerate().map(|(e, (s, r))| Some(Episode::start(e, r, s))).collect();
    Ok((firsts, episodes, took))
}

#[cfg(test)]
mod anchor_tests {
    use super::anchor_state;
    use crate::envs::EnvStep;

    fn step(observation: &str, infos: serde_json::Value) -> EnvStep {
        EnvStep {
            observation: observation.into(),
            admissible_commands: vec!["go north".into(), "look".into()],
            infos: infos.as_object().cloned().unwrap_or_default(),
            ..EnvStep::default()
        }
    }

    /// An exact state wins over the text; facts count in any order; without either, the text a
    /// player sees (observation, inventory, commands) is the state.
    #[test]
    fn anchors_prefer_the_exact_state_then_facts_then_the_text() {
        let none = serde_json::json!({});
        let exact = |s: &str| serde_json::json!({"state": s});
        assert_eq!(anchor_state(&step("a", exact("s1"))), anchor_state(&step("b", exact("s1"))));
        assert_ne!(anchor_state(&step("a", exact("s1"))), anchor_state(&step("a", exact("s2"))));
        let facts = |f: &[&str]| serde_json::json!({"facts": f});
        assert_eq!(
            anchor_state(&step("a", facts(&["at(P,r)", "in(k,I)"]))),
            anchor_state(&step("b", facts(&["in(k,I)", "at(P,r)"])))
        );
        assert_ne!(
            anchor_state(&step("a", facts(&["at(P,r)"]))),
            anchor_state(&step("a", facts(&["at(P,s)"])))
        );
        assert_eq!(
            anchor_state(&step("You can't.", none.clone())),
            anchor_state(&step("You can't.", none.clone()))
        );
        let mut other = step("You can't.", none.clone());
        other.admissible_commands.push("open door".into());
        assert_ne!(anchor_state(&step("You can't.", none)), anchor_state(&other));
    }
}
