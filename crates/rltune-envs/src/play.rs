//! Playing episodes: the prompt an LM agent reads, the action it writes, and the evaluation
//! loop behind `rltune play` (a random baseline or a model, over B environments at once).
//!
//! The prompt follows the textworld fork: the objective, a memory of the last `memory_turns`
//! (action, observation) turns, the observation, the inventory, "Your possible actions are c1,
//! c2, …, or cN." and an instruction line. When it does not fit the model's context the oldest
//! memory goes first, then the prompt is cut from the left: a long game never crashes.
//! The action is the generated text up to the first newline or sentence punctuation.

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::{EnvStep, Reset, TextEnv};
use crate::error::{Error, Result};

/// The prompt's parts and the memory length (`[agent]` in env configs).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PromptTemplate {
    /// Earlier turns shown, newest last.
    pub memory_turns: usize,
    /// Whether the admissible commands are listed.
    pub show_admissible: bool,
    /// Whether the inventory is shown.
    pub show_inventory: bool,
    /// The last line, after which the model writes its action.
    pub instruction: String,
    /// How a model agent writes its action: free text, or one of the admissible commands.
    pub actions: ActionMode,
    /// What the model reads each turn: a re-rendered window of the last `memory_turns`, or the
    /// whole episode as one growing token sequence (issue #39).
    pub memory: Memory,
}

/// What a model agent reads each turn (`[agent] memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Memory {
    /// The prompt is rendered anew each turn: the objective, the last `memory_turns` turns, the
    /// state (the textworld fork's sliding memory).
    #[default]
    Window,
    /// The episode is one token sequence, token in, token out: the first turn's prompt, then
    /// each action's tokens as sampled and each later state's [`PromptTemplate::render_next`],
    /// never re-tokenized; the sampler carries its KV cache from turn to turn, so a turn only
    /// prefills the new state. Admissible actions only.
    Transcript,
}

impl Default for PromptTemplate {
    fn default() -> Self {
        Self {
            memory_turns: 3,
            show_admissible: true,
            show_inventory: true,
            instruction: "What do you do next?\n>".into(),
            actions: ActionMode::Free,
            memory: Memory::Window,
        }
    }
}

/// How a model agent writes its action (`[agent] actions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActionMode {
    /// Free text, played up to the first line break or sentence punctuation.
    #[default]
    Free,
    /// Sampling constrained to the tokens of the game's admissible commands (each written as
    /// after the prompt: a leading space, then a line break), so the command is always one of
    /// them (issue #39). Needs a game that lists its commands.
    Admissible,
}

/// One turn of an episode, as the agent saw and did it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Turn {
    /// The observation before the action.
    pub observation: String,
    /// The action taken.
    pub action: String,
    /// The reward it earned.
    pub reward: f64,
    /// Whether the game did not understand it.
    pub invalid: bool,
    /// The commands the game listed as admissible before the action ([`play`] records them;
    /// empty elsewhere, and for games that list none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admissible: Vec<String>,
    /// The logprob of the action's tokens under the distribution the agent drew them from
    /// (the constrained one in admissible mode), when the agent reports it
    /// ([`Agent::last_logprobs`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprob: Option<f64>,
}

impl Turn {
    /// The turn that played `action` from `before` and led to `after`, with the action's
    /// logprob when the agent reports one.
    pub fn played(before: EnvStep, action: String, after: &EnvStep, logprob: Option<f64>) -> Self {
        Self {
            observation: before.observation,
            action,
            reward: after.reward,
            invalid: after.invalid,
            admissible: before.admissible_commands,
            logprob,
        }
    }
}

impl PromptTemplate {
    /// The prompt for the state `now`, after the turns `memory` (oldest first), with the last
    /// `keep` of those turns shown (at most `memory_turns`).
    pub fn render(&self, now: &EnvStep, memory: &[Turn], keep: usize) -> String {
        let mut s = String::new();
        if !now.objective.is_empty() {
            s.push_str(&format!("Objective: {}\n", now.objective.trim()));
        }
        let keep = keep.min(self.memory_turns).min(memory.len());
        for t in &memory[memory.len() - keep..] {
            s.push_str(&format!("> {}\n{}\n", t.action, t.observation.trim()));
        }
        s.push_str(&format!("Observation: {}\n", now.observation.trim()));
        self.push_state(&mut s, now);
        s
    }

    /// The inventory, the command list and the instruction, as [`Self::render`] ends.
    fn push_state(&self, s: &mut String, now: &EnvStep) {
        if self.show_inventory && !now.inventory.is_empty() {
            s.push_str(&format!("Inventory: {}\n", now.inventory.trim()));
        }
        if self.show_admissible && !now.admissible_commands.is_empty() {
            s.push_str(&format!("Your possible actions are {}.\n", or_list(&now.admissible_commands)));
        }
        s.push_str(&self.instruction);
    }

    /// A later turn's part of a transcript ([`Memory::Transcript`]): the state `now` as
    /// [`Self::render`] shows it, without the objective (the first turn showed it) and without
    /// memory (the transcript holds the earlier turns). It follows the previous action's end
    /// token, a line break.
    pub fn render_next(&self, now: &EnvStep) -> String {
        let mut s = format!("Observation: {}\n", now.observation.trim());
        self.push_state(&mut s, now);
        s
    }

    /// Checks that the settings work together; the message names the field.
    pub fn validate(&self) -> crate::Result<()> {
        if self.memory == Memory::Transcript && self.actions != ActionMode::Admissible {
            return Err(crate::Error::Config(
                "[agent] memory = \"transcript\" needs actions = \"admissible\": a free-text \
                 action's sampled tokens run past its end, and the transcript keeps exactly the \
                 tokens sampled; set actions = \"admissible\" or memory = \"window\""
                    .into(),
            ));
        }
        Ok(())
    }

    /// The prompt's token ids, at most `max_tokens` long: memory turns are dropped oldest first
    /// until it fits, then the front is cut.
    pub fn fit<E>(
        &self,
        now: &EnvStep,
        memory: &[Turn],
        max_tokens: usize,
        encode: impl Fn(&str) -> std::result::Result<Vec<u32>, E>,
    ) -> std::result::Result<Vec<u32>, E> {
        let mut keep = self.memory_turns.min(memory.len());
        loop {
            let ids = encode(&self.render(now, memory, keep))?;
            if ids.len() <= max_tokens {
                return Ok(ids);
            }
            if keep == 0 {
                return Ok(ids[ids.len() - max_tokens..].to_vec());
            }
            keep -= 1;
        }
    }
}

/// A command as a model agent writes it after its prompt: a leading space, then a line break
/// that ends it. The demonstrations' completions, the admissible commands' tries and a
/// transcript's actions are all written so, which keeps their tokens the same.
pub fn action_text(command: &str) -> String {
    format!(" {command}\n")
}

/// "a, b, or c" (TextWorld's fork writes the list this way).
fn or_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{}, or {last}", init.join(", ")),
    }
}

/// The characters that end an action in generated text: a line break or sentence punctuation.
pub const ACTION_STOPS: [char; 6] = ['\n', '\r', '.', '!', '?', ';'];

/// The action in generated text: up to the first of [`ACTION_STOPS`], trimmed.
pub fn extract_action(text: &str) -> String {
    let end = text.find(ACTION_STOPS).unwrap_or(text.len());
    text[..end].trim().to_string()
}

/// One environment awaiting its action: the episode it plays, its state and its turns so far
/// (oldest first).
#[derive(Debug, Clone, Copy)]
pub struct Pending<'a> {
    /// The episode's index among the episodes played: with the turn, what keys an agent's
    /// random stream ([`episode_stream`]), so that an action depends on neither the
    /// environment slot nor the batch the episode lands in.
    pub episode: usize,
    /// The state to act on.
    pub state: &'a EnvStep,
    /// The turns played so far.
    pub turns: &'a [Turn],
}

/// The seed of the random stream an agent draws turn `turn` of episode `episode` from: a hash of
/// the run's `seed`, the episode and the turn. Keyed by the episode, not by the environment
/// that plays it, so an evaluation reads the same with any number of environments.
pub fn episode_stream(seed: u64, episode: usize, turn: usize) -> u64 {
    mix_seeds(&[seed, episode as u64, turn as u64])
}

/// A 64-bit hash of `values`, one splitmix64 step each: what keys the per-episode streams here
/// and a run's draws of training games (`rltune::run::episodes`).
pub fn mix_seeds(values: &[u64]) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for &v in values {
        x = (x ^ v).wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
    }
    x
}

/// An agent that picks one action per environment from their current states.
pub trait Agent {
    /// One action per pending environment, in their order.
    fn act(&mut self, states: &[Pending]) -> Result<Vec<String>>;

    /// The logprob of each action the last [`act`](Self::act) returned, in its order, when the
    /// agent knows them (a model does; the default says nothing).
    fn last_logprobs(&self) -> Option<Vec<f64>> {
        None
    }
}

/// The baseline: a uniformly random admissible command (or "look" when there is none), each
/// turn of each episode drawn from its own stream ([`episode_stream`]).
#[derive(Debug)]
pub struct RandomAgent {
    seed: u64,
}

impl RandomAgent {
    /// A random agent whose streams are keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }
}

impl Agent for RandomAgent {
    fn act(&mut self, states: &[Pending]) -> Result<Vec<String>> {
        Ok(states
            .iter()
            .map(|p| {
                let mut rng =
                    rand::rngs::StdRng::seed_from_u64(episode_stream(self.seed, p.episode, p.turns.len()));
                p.state.admissible_commands.choose(&mut rng).cloned().unwrap_or_else(|| "look".into())
            })
            .collect())
    }
}

/// One finished (or dropped) episode.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Episode {
    /// Its index among the episodes played.
    pub episode: usize,
    /// How it was reset.
    pub seed: Option<u64>,
    /// The game file index, for environments with game files.
    pub game: Option<usize>,
    /// Whether it was won.
    pub won: bool,
    /// Whether it was lost.
    pub lost: bool,
    /// Whether it hit the step cap.
    pub truncated: bool,
    /// The final score.
    pub score: f64,
    /// The game's maximum score.
    pub max_score: f64,
    /// The sum of rewards.
    pub episode_return: f64,
    /// Steps taken.
    pub steps: usize,
    /// Steps whose action the game did not understand.
    pub invalid_actions: usize,
    /// The objective.
    pub objective: String,
    /// Every turn, in order.
    pub turns: Vec<Turn>,
    /// The final observation.
    pub final_observation: String,
}

impl Episode {
    /// Episode `index`, reset with `reset`, starting from `first`.
    pub fn start(index: usize, reset: &Reset, first: &EnvStep) -> Self {
        Self {
            episode: index,
            seed: reset.seed,
            game: reset.game,
            won: false,
            lost: false,
            truncated: false,
            score: 0.0,
            max_score: first.max_score,
            episode_return: 0.0,
            steps: 0,
            invalid_actions: 0,
            objective: first.objective.clone(),
            turns: Vec::new(),
            final_observation: String::new(),
        }
    }

    /// Adds `turn`, which led to `after`.
    pub fn record(&mut self, turn: Turn, after: &EnvStep) {
        self.turns.push(turn);
        self.steps += 1;
        self.invalid_actions += usize::from(after.invalid);
        self.episode_return += after.reward;
        self.score = after.score;
        self.max_score = after.max_score;
        if after.done() {
            self.won = after.won;
            self.lost = after.lost;
            self.truncated = after.truncated;
            self.final_observation = after.observation.clone();
        }
    }
}

/// What `rltune play --json` prints.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlayReport {
    /// Episodes finished.
    pub episodes: usize,
    /// Fraction won.
    pub win_rate: f64,
    /// Mean final score.
    pub mean_score: f64,
    /// Mean of score / max score.
    pub mean_normalized_score: f64,
    /// Mean steps per episode.
    pub mean_steps: f64,
    /// Invalid actions over all actions.
    pub invalid_action_rate: f64,
    /// Episodes lost to a restarted environment program (not in the means).
    pub dropped_episodes: usize,
    /// Episodes per second of wall time.
    pub episodes_per_second: f64,
}

impl PlayReport {
    /// The summary of `episodes`, played in `seconds`.
    pub fn of(episodes: &[Episode], dropped: usize, seconds: f64) -> Self {
        let n = episodes.len().max(1) as f64;
        let mean = |f: &dyn Fn(&Episode) -> f64| episodes.iter().map(f).sum::<f64>() / n;
        let actions: usize = episodes.iter().map(|e| e.steps).sum();
        let invalid: usize = episodes.iter().map(|e| e.invalid_actions).sum();
        Self {
            episodes: episodes.len(),
            win_rate: mean(&|e| f64::from(u8::from(e.won))),
            mean_score: mean(&|e| e.score),
            mean_normalized_score: mean(&|e| if e.max_score > 0.0 { e.score / e.max_score } else { 0.0 }),
            mean_steps: mean(&|e| e.steps as f64),
            invalid_action_rate: invalid as f64 / actions.max(1) as f64,
            dropped_episodes: dropped,
            episodes_per_second: episodes.len() as f64 / seconds.max(1e-9),
        }
    }
}

/// How much more often one agent won than another on the same episodes: the mean of the
/// per-episode differences of `won`, and its standard error, as `tools/compare_transcripts.py`
/// prints it. Pairing removes the games' own difficulty from the error, so it is smaller than
/// the two win rates' unpaired errors combined.
///
/// Episodes that replay one game (the same reset seed and game file: TextWorld's `i mod games`)
/// are not independent, so the error is clustered by game: with `G` games, `n` episodes and
/// `S_g` the sum of game `g`'s differences less the mean, `se² = G/(G − 1) · Σ_g S_g² / n²`.
/// With one episode a game (the adventure family, the essays) it is the plain error: the
/// sample variance (n − 1) over n. The plain error is kept beside it (`se_plain`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PairedDifference {
    /// Episodes that both agents finished (one dropped by either is left out).
    pub episodes: usize,
    /// The distinct games among them (the clusters of the error; 0 in summaries written before
    /// the error was clustered, 2026-12-01).
    #[serde(default)]
    pub games: usize,
    /// `other`'s win rate minus `base`'s, over those episodes.
    pub delta: f64,
    /// The standard error of `delta`, clustered by game.
    pub se: f64,
    /// The standard error of `delta` were every episode independent (the plain one; equal to
    /// `se` with one episode a game). Beside `se`, it shows how much the games' own variance
    /// adds. `None` in summaries written before it was kept (2026-12-01).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub se_plain: Option<f64>,
}

/// The game an episode played: its reset seed, its game file, and its index where it has
/// neither (then it is a cluster of its own).
type GameKey = (Option<u64>, Option<usize>, Option<usize>);

impl PairedDifference {
    /// The difference `other − base`, pairing the episodes by their index. Refuses episodes of
    /// the same index that were not the same game (another reset seed or game file): those
    /// were not played with the same `--seed` and episode plan.
    pub fn win_rate(base: &[Episode], other: &[Episode]) -> Result<Self> {
        let by_index: std::collections::HashMap<usize, &Episode> =
            base.iter().map(|e| (e.episode, e)).collect();
        // Each difference with its game: the reset seed and game file, or the episode alone
        // when it has neither.
        let mut diffs: Vec<(f64, GameKey)> = Vec::with_capacity(other.len());
        for o in other {
            let Some(b) = by_index.get(&o.episode) else { continue };
            if (b.seed, b.game) != (o.seed, o.game) {
                return Err(Error::Call(format!(
                    "episode {}: one agent played seed {:?} (game {:?}), the other seed {:?} (game {:?}); \
                     a paired comparison needs the same games: play both with the same seed and episodes",
                    o.episode, b.seed, b.game, o.seed, o.game
                )));
            }
            let alone = (o.seed.is_none() && o.game.is_none()).then_some(o.episode);
            diffs.push((f64::from(u8::from(o.won)) - f64::from(u8::from(b.won)), (o.seed, o.game, alone)));
        }
        let n = diffs.len();
        let delta = diffs.iter().map(|(d, _)| d).sum::<f64>() / n.max(1) as f64;
        // A BTreeMap, so the sum runs in one order and reruns agree to the bit.
        let mut sums: std::collections::BTreeMap<GameKey, f64> = std::collections::BTreeMap::new();
        for (d, g) in &diffs {
            *sums.entry(*g).or_default() += d - delta;
        }
        let games = sums.len();
        let se = clustered_se(sums.values().copied(), n);
        // Every episode its own cluster: the error were the episodes independent.
        let se_plain = clustered_se(diffs.iter().map(|(d, _)| d - delta), n);
        Ok(Self { episodes: n, games, delta, se, se_plain: Some(se_plain) })
    }

    /// How the error was clustered, to follow its value in parentheses: empty with one episode
    /// a game, else the games and the plain error ("; clustered by 64 games, 1.4 were the
    /// episodes independent", in points).
    pub fn clustering(&self) -> String {
        if self.games == 0 || self.games >= self.episodes {
            return String::new();
        }
        match self.se_plain {
            Some(p) => {
                format!("; clustered by {} games, {:.1} were the episodes independent", self.games, 100.0 * p)
            }
            None => format!("; clustered by {} games", self.games),
        }
    }
}

/// The cluster-robust standard error of a mean over `n` observations, from each cluster's sum
/// of deviations from that mean: `√(G/(G − 1) · Σ_g S_g² / n²)` with `G` clusters, 0 with
/// fewer than two. With one observation a cluster it is the plain standard error.
fn clustered_se(sums: impl Iterator<Item = f64>, n: usize) -> f64 {
    let (clusters, squares) = sums.fold((0usize, 0.0), |(g, q), s| (g + 1, q + s * s));
    if clusters > 1 {
        (clusters as f64 / (clusters - 1) as f64 * squares / (n * n) as f64).sqrt()
    } else {
        0.0
    }
}

/// How the episodes of a run are reset: episode `i` gets `resets(i)`.
pub type ResetPlan<'a> = &'a dyn Fn(usize) -> Reset;

/// Plays `episodes` episodes on all of `env`'s environments at once with `agent`: each
/// environment starts the next episode as soon as its last one ends. An environment whose step
/// fails (a per-env error, e.g. a restarted program) drops its episode and starts the next.
/// Returns the finished episodes, ordered by index, and the number dropped.
pub fn play(
    env: &mut dyn TextEnv,
    agent: &mut dyn Agent,
    episodes: usize,
    resets: ResetPlan,
) -> Result<(Vec<Episode>, usize)> {
    let b = env.num_envs().min(episodes.max(1));
    let mut next = 0usize;
    let mut dropped = 0usize;
    let mut done: Vec<Episode> = Vec::new();
    // Per env: the episode it plays, its current state, its turns.
    let mut slots: Vec<Option<(Episode, EnvStep)>> = vec![None; b];
    let start = |env: &mut dyn TextEnv,
                 slots: &mut Vec<Option<(Episode, EnvStep)>>,
                 ids: &[usize],
                 next: &mut usize|
     -> Result<()> {
        let mut envs = Vec::new();
        let mut plan = Vec::new();
        for &e in ids {
            if *next < episodes {
                envs.push(e);
                plan.push((*next, resets(*next)));
                *next += 1;
            }
        }
        if envs.is_empty() {
            return Ok(());
        }
        let firsts = env.reset(&envs, &plan.iter().map(|(_, r)| *r).collect::<Vec<_>>())?;
        for ((e, (i, r)), first) in envs.into_iter().zip(plan).zip(firsts) {
            let ep = Episode::start(i, &r, &first);
            slots[e] = Some((ep, first));
        }
        Ok(())
    };
    let all: Vec<usize> = (0..b).collect();
    start(env, &mut slots, &all, &mut next)?;
    while slots.iter().any(Option::is_some) {
        let active: Vec<usize> = (0..b).filter(|&e| slots[e].is_some()).collect();
        let actions = {
            let states: Vec<Pending> = active
                .iter()
                .filter_map(|&e| {
                    slots[e].as_ref().map(|(ep, s)| Pending {
                        episode: ep.episode,
                        state: s,
                        turns: &ep.turns,
                    })
                })
                .collect();
            agent.act(&states)?
        };
        let logprobs = agent.last_logprobs().filter(|l| l.len() == actions.len());
        if actions.len() != active.len() {
            return Err(Error::Call(format!(
                "the agent gave {} actions for {} states",
                actions.len(),
                active.len()
            )));
        }
        let sent: Vec<(usize, String)> = active.iter().copied().zip(actions.iter().cloned()).collect();
        let results = env.step(&sent)?;
        let mut finished = Vec::new();
        for (k, ((&e, action), result)) in active.iter().zip(actions).zip(results).enumerate() {
            let Some((mut ep, before)) = slots[e].take() else { continue };
            match result {
                Err(err) => {
                    tracing::warn!("episode {} dropped: {err}", ep.episode);
                    dropped += 1;
                    finished.push(e);
                }
                Ok(after) => {
                    ep.record(Turn::played(before, action, &after, logprobs.as_ref().map(|l| l[k])), &after);
                    if after.done() {
                        done.push(ep);
                        finished.push(e);
                    } else {
                        slots[e] = Some((ep, after));
                    }
                }
            }
        }
        if !finished.is_empty() {
            start(env, &mut slots, &finished, &mut next)?;
        }
    }
    done.sort_by_key(|e| e.episode);
    Ok((done, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::letters::Letters;

    #[test]
    fn actions_end_at_the_first_line_or_sentence_end() {
        assert_eq!(extract_action(" take key. then go"), "take key");
        assert_eq!(extract_action("go north\nopen door"), "go north");
        assert_eq!(extract_action("look"), "look");
        assert_eq!(extract_action("\nlook"), "");
    }

    fn state(obs: &str, commands: &[&str]) -> EnvStep {
        EnvStep {
            observation: obs.into(),
            objective: "Win.".into(),
            inventory: "You are carrying nothing.".into(),
            admissible_commands: commands.iter().map(|c| c.to_string()).collect(),
            ..EnvStep::default()
        }
    }

    #[test]
    fn prompts_hold_the_parts_and_drop_the_oldest_memory_first() {
        let t = PromptTemplate::default();
        let memory: Vec<Turn> = (0..5)
            .map(|i| Turn { observation: format!("room {i}"), action: format!("go {i}"), ..Turn::default() })
            .collect();
        let now = state("A hall.", &["go east", "look", "take key"]);
        let p = t.render(&now, &memory, 3);
        assert_eq!(
            p,
            "Objective: Win.\n> go 2\nroom 2\n> go 3\nroom 3\n> go 4\nroom 4\nObservation: A hall.\n\
             Inventory: You are carrying nothing.\nYour possible actions are go east, look, or take key.\n\
             What do you do next?\n>"
        );
        // One token per character: the budget forces memory out, oldest first, then a cut.
        let chars = |s: &str| Ok::<_, Error>(s.chars().map(|c| c as u32).collect::<Vec<u32>>());
        let full = t.fit(&now, &memory, 10_000, chars).unwrap();
        assert_eq!(full.len(), p.chars().count());
        let fewer = t.fit(&now, &memory, p.chars().count() - 5, chars).unwrap();
        let text: String = fewer.iter().map(|&c| char::from_u32(c).unwrap()).collect();
        assert!(!text.contains("go 2") && text.contains("go 3"), "{text}");
        let tiny = t.fit(&now, &memory, 12, chars).unwrap();
        assert_eq!(tiny.len(), 12, "cut from the left, never an error");
    }

    #[test]
    fn play_runs_episodes_over_a_batch_and_reports() {
        struct Es;
        impl Agent for Es {
            fn act(&mut self, states: &[Pending]) -> Result<Vec<String>> {
                Ok(states.iter().map(|p| "e".repeat(p.turns.len() + 1)).collect())
            }
        }
        let mut env = Letters::new(3, 2);
        let (eps, dropped) =
            play(&mut env, &mut Es, 5, &|i| Reset { seed: Some(i as u64), game: None }).unwrap();
        assert_eq!((eps.len(), dropped), (5, 0));
        assert!(eps.iter().all(|e| e.steps == 2 && e.truncated && (e.episode_return - 0.3).abs() < 1e-9));
        assert_eq!(eps.iter().map(|e| e.seed).collect::<Vec<_>>(), (0..5).map(Some).collect::<Vec<_>>());
        let r = PlayReport::of(&eps, dropped, 1.0);
        assert_eq!((r.episodes, r.win_rate, r.mean_steps, r.invalid_action_rate), (5, 0.0, 2.0, 0.0));
    }

    fn outcome(episode: usize, won: bool) -> Episode {
        let reset = Reset { seed: Some(100 + episode as u64), game: None };
        Episode { won, ..Episode::start(episode, &reset, &EnvStep::default()) }
    }

    /// By hand: 4 shared episodes, differences (0, 1, 1, 0): mean ½, sample variance
    /// 4·(½)²/3 = ⅓, so the error is √(⅓/4) = √(1/12). An episode only one agent finished is
    /// left out; another game under the same index is refused.
    #[test]
    fn paired_difference_matches_hand_values_and_refuses_other_games() {
        let base =
            [outcome(0, true), outcome(1, false), outcome(2, false), outcome(3, true), outcome(4, true)];
        let other = [outcome(0, true), outcome(1, true), outcome(2, true), outcome(3, true)];
        let d = PairedDifference::win_rate(&base, &other).unwrap();
        assert_eq!(d.episodes, 4);
        assert!((d.delta - 0.5).abs() < 1e-12 && (d.se - (1.0f64 / 12.0).sqrt()).abs() < 1e-12, "{d:?}");
        assert_eq!((d.games, d.se_plain), (4, Some(d.se)), "one episode a game: the plain error");
        let same = PairedDifference::win_rate(&base, &base).unwrap();
        assert_eq!((same.delta, same.se), (0.0, 0.0));
        let mut moved = other.clone();
        moved[2].seed = Some(7);
        let err = PairedDifference::win_rate(&base, &moved).unwrap_err().to_string();
        assert!(err.contains("episode 2") && err.contains("same games"), "{err}");
    }

    /// Episodes replaying one game are one cluster. By hand: 2 games × 2 episodes, differences
    /// (1, 1) on game 0 and (0, 0) on game 1: mean ½, game sums of the deviations +1 and −1, so
    /// se² = 2/1 · (1 + 1)/4² = ¼, se = ½, where the plain error would be √(⅓/4) ≈ 0.29. Spread
    /// the same differences over the games, (1, 0) on each, and the games' sums vanish: se = 0.
    #[test]
    fn the_paired_error_is_clustered_by_game() {
        let on = |episode: usize, game: usize, won: bool| {
            let reset = Reset { seed: None, game: Some(game) };
            Episode { won, ..Episode::start(episode, &reset, &EnvStep::default()) }
        };
        let base = [on(0, 0, false), on(1, 1, false), on(2, 0, false), on(3, 1, false)];
        let other = [on(0, 0, true), on(1, 1, false), on(2, 0, true), on(3, 1, false)];
        let d = PairedDifference::win_rate(&base, &other).unwrap();
        assert_eq!((d.episodes, d.games), (4, 2));
        assert!((d.delta - 0.5).abs() < 1e-12 && (d.se - 0.5).abs() < 1e-12, "{d:?}");
        let plain = d.se_plain.unwrap();
        assert!((plain - (1.0f64 / 12.0).sqrt()).abs() < 1e-12, "{d:?}");
        assert_eq!(d.clustering(), "; clustered by 2 games, 28.9 were the episodes independent");
        let old = PairedDifference { se_plain: None, ..d };
        assert_eq!(old.clustering(), "; clustered by 2 games", "a summary from before se_plain");
        let spread = [on(0, 0, true), on(1, 1, true), on(2, 0, false), on(3, 1, false)];
        let d = PairedDifference::win_rate(&base, &spread).unwrap();
        assert!((d.delta - 0.5).abs() < 1e-12 && d.se.abs() < 1e-12, "{d:?}");
        assert!((d.se_plain.unwrap() - plain).abs() < 1e-12, "the plain error ignores the games: {d:?}");
        // Neither a seed nor a game: each episode alone, the plain error.
        let bare = |episode: usize, won: bool| Episode {
            won,
            ..Episode::start(episode, &Reset::default(), &EnvStep::default())
        };
        let d = PairedDifference::win_rate(
            &[bare(0, false), bare(1, false), bare(2, false), bare(3, false)],
            &[bare(0, false), bare(1, true), bare(2, true), bare(3, false)],
        )
        .unwrap();
        assert_eq!((d.games, d.clustering().as_str()), (4, ""));
        assert!((d.se - (1.0f64 / 12.0).sqrt()).abs() < 1e-12, "{d:?}");
    }
}
