//! Multi-step text environments, batched: Gymnasium's vector API for text games. No model, no
//! tensor: this crate is the environments, their JSON-lines protocol, the play loop that runs
//! any [`play::Agent`] on them, and the task metrics their rewards are made of ([`metrics`]).
//!
//! An environment holds B independent episodes, indexed `0..B`. [`TextEnv::reset`] starts new
//! episodes in some of them, [`TextEnv::step`] plays one action in each of some of them. Every
//! result keeps `terminated` (the episode ended: won or lost) and `truncated` (the step cap was
//! hit first) apart, as Gymnasium does: a truncated episode still bootstraps from the value of
//! where it stopped, a terminated one does not (cleanrl's `ppo.py`, `next_done`).
//!
//! The environments:
//! - [`letters::Letters`]: the textworld fork's toy, 0.1 reward per letter "e" in the action;
//! - [`adventure`]: a procedurally generated family of text adventures (rooms, doors, keys,
//!   objects, a quest of k steps, admissible commands, a walkthrough), Rust-native and seeded;
//! - [`essays`]: labelling generated essays' discourse elements, scored by the Feedback Prize
//!   F-score (RL on a task's own metric);
//! - [`ner::Ner`]: BIO tagging of a CoNLL-style file (WNUT-2016), scored by entity-level F1;
//! - [`command::CommandEnv`]: any program speaking the JSON-lines protocol of
//!   `docs/env-protocol.md`, such as the TextWorld bridge `tools/textworld/bridge.py`.
//!
//! ```
//! use rltune_envs::{letters::Letters, Reset, TextEnv};
//!
//! # fn main() -> rltune_envs::Result<()> {
//! let mut env = Letters::new(2, 3);
//! let first = env.reset(&[0, 1], &[Reset::default(), Reset::default()])?;
//! assert!(!first[0].terminated);
//! let out = env.step(&[(0, "see a tree".into()), (1, "no".into())])?;
//! assert_eq!(out[0].as_ref().unwrap().reward, 0.4); // four letters "e"
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

pub mod adventure;
pub mod command;
pub mod demos;
pub mod error;
pub mod essays;
pub mod letters;
pub mod metrics;
pub mod ner;
pub mod play;
pub mod process;

pub use error::{Error, Result};

/// What an environment returns for one episode after a reset or a step.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct EnvStep {
    /// The text the agent reads (room description, feedback), without status lines.
    pub observation: String,
    /// This step's reward (the score's change; 0 after a reset).
    pub reward: f64,
    /// The episode ended inside the game (won or lost): no bootstrap from here.
    pub terminated: bool,
    /// The step cap was hit before the game ended: bootstrap from here.
    pub truncated: bool,
    /// The game was won.
    pub won: bool,
    /// The game was lost.
    pub lost: bool,
    /// The score so far.
    pub score: f64,
    /// The highest score the game allows (0 when the game does not say).
    pub max_score: f64,
    /// Steps taken in this episode.
    pub moves: usize,
    /// The commands the game understands now (empty for free-text environments).
    pub admissible_commands: Vec<String>,
    /// What the game asks the player to do.
    pub objective: String,
    /// What the player carries, as text.
    pub inventory: String,
    /// The action was not one the game understands (not admissible, or refused).
    pub invalid: bool,
    /// Anything else the environment reports.
    pub infos: serde_json::Map<String, serde_json::Value>,
}

impl EnvStep {
    /// Whether the episode is over, for either reason.
    pub fn done(&self) -> bool {
        self.terminated || self.truncated
    }

    /// The score as a fraction of the maximum (0 when there is none).
    pub fn normalized_score(&self) -> f64 {
        if self.max_score > 0.0 {
            self.score / self.max_score
        } else {
            0.0
        }
    }
}

/// How one episode starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reset {
    /// The seed: which game of a generated family, or the game's random stream.
    pub seed: Option<u64>,
    /// Which of the environment's game files to play (`None`: keep the current one).
    pub game: Option<usize>,
}

/// A batch of text environments (see the module docs).
pub trait TextEnv: Send {
    /// The number of environments, B.
    fn num_envs(&self) -> usize;

    /// Starts a new episode in each of `envs` (with `resets[i]` for `envs[i]`); returns the
    /// first observation of each, in the same order.
    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> Result<Vec<EnvStep>>;

    /// Plays one action in each listed environment; returns each one's result in the same
    /// order, or that environment's own error (the others carry on). An environment whose
    /// episode ended must be reset first.
    fn step(&mut self, actions: &[(usize, String)]) -> Result<Vec<Result<EnvStep>>>;

    /// The shortest known winning sequence of commands from the current state of `env`, when
    /// the environment knows one (generated games do; for demonstrations and tests).
    fn walkthrough(&self, _env: usize) -> Option<Vec<String>> {
        None
    }
}

/// Checks that `envs` are distinct indices below `n` and that `m` matches their count; the
/// message names the method.
pub(crate) fn check_indices(method: &str, envs: &[usize], n: usize, m: usize) -> Result<()> {
    use crate::error::Error;
    if envs.len() != m {
        return Err(Error::Call(format!("{method}: {} environments but {m} arguments", envs.len())));
    }
    let mut seen = vec![false; n];
    for &e in envs {
        match seen.get_mut(e) {
            None => {
                return Err(Error::Call(format!("{method}: environment {e} does not exist (there are {n})")))
            }
            Some(true) => return Err(Error::Call(format!("{method}: environment {e} listed twice"))),
            Some(s) => *s = true,
        }
    }
    Ok(())
}

/// The action as the games see it: the first line, control characters removed, trimmed, at
/// most `max_chars` characters. A command with a newline would run its first line and queue
/// the rest in a Z-machine game, shifting every later observation by one step.
pub fn sanitize_action(action: &str, max_chars: usize) -> String {
    let line = action.lines().next().unwrap_or("");
    let clean: String = line.chars().filter(|c| !c.is_control()).take(max_chars).collect();
    clean.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_keep_their_first_line_without_control_characters() {
        assert_eq!(sanitize_action("  take key\ngo north", 200), "take key");
        assert_eq!(sanitize_action("open\tdoor\u{7}", 200), "opendoor");
        assert_eq!(sanitize_action("abcdef", 3), "abc");
        assert_eq!(sanitize_action("", 10), "");
    }

    #[test]
    fn indices_are_checked() {
        assert!(check_indices("step", &[0, 1], 2, 2).is_ok());
        let e = check_indices("step", &[0, 0], 2, 2).unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
        let e = check_indices("reset", &[3], 2, 1).unwrap_err().to_string();
        assert!(e.contains("environment 3 does not exist"), "{e}");
    }
}
