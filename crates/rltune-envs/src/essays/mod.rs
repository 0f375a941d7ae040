//! Essay discourse labelling as a text game: the agent labels an essay's candidate segments one
//! per turn, and the reward is the essay's Feedback Prize F-score (issue #41; the source task
//! is Kaggle's "Feedback Prize – Evaluating Student Writing").
//!
//! - **Essays** come from templates ([`generate`]): seven discourse classes
//!   ([`CLASSES`]), held-out essays built from sentence combinations training never shows.
//! - **Segments** over-split the elements (about two per element); element boundaries are
//!   always segment boundaries.
//! - **A turn** labels the next segment with one command: `begin CLASS` (a new element of that
//!   class starts here), `continue CLASS` (the segment extends the element before it, which
//!   must have that class, or else it starts one, as conlleval reads an `I-` tag after another
//!   type) or `none` (outside every element). These 15 commands are the admissible commands;
//!   anything else is refused (`invalid`) and labels the segment `none`.
//! - **The observation** shows the segment's place in the essay, the last labels given, the
//!   segment before it (with its label), the segment and the one after it.
//! - **The reward** is 0 on every turn but the last, which gets the essay's F-score
//!   ([`crate::metrics::feedback::essay_score`]): the episode's return is the metric.
//!   With `dense_reward = true` every turn instead gets the change of a potential, the F-score
//!   of the labelled prefix against the gold elements cut to that prefix (Φ₀ = 0); the
//!   potential telescopes, so the undiscounted return is the same F-score (Ng et al. 1999).
//! - `score` is the F-score so far (the final one at the end), `max_score` 1, `won` a perfect
//!   essay. The episode ends `terminated` after the last segment, or `truncated` at `max_steps`
//!   (then the rest is labelled `none` for the score).
//! - [`TextEnv::walkthrough`] returns the gold labels of the remaining segments, which makes
//!   the agent pipeline's demonstrations the gold labels (behavioural cloning).
//!
//! ```
//! use rltune_envs::essays::{Essays, EssaysConfig};
//! use rltune_envs::{Reset, TextEnv};
//!
//! # fn main() -> rltune_envs::Result<()> {
//! let mut env = Essays::new(1, EssaysConfig::default(), 64)?;
//! let first = env.reset(&[0], &[Reset { seed: Some(3), game: None }])?.remove(0);
//! assert_eq!(first.admissible_commands.len(), 15);
//! let mut last = first;
//! for label in env.walkthrough(0).unwrap() {
//!     last = env.step(&[(0, label)])?.remove(0)?;
//! }
//! assert!(last.terminated && last.won && last.reward == 1.0);
//! # Ok(()) }
//! ```

pub mod generate;
pub mod heuristic;

use super::adventure::is_heldout;
use super::{check_indices, sanitize_action, EnvStep, Reset, TextEnv};
use crate::error::{Error, Result};
use crate::metrics::feedback::{essay_score, Span};

pub use crate::metrics::feedback::CLASSES;

/// The class of a segment outside every element.
pub const NONE: usize = usize::MAX;

/// One candidate segment and its gold label.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// Its class (an index into [`CLASSES`]), or [`NONE`].
    pub class: usize,
    /// Whether a gold element begins here.
    pub begin: bool,
}

/// A label: a class (or [`NONE`]) and whether an element begins there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Label {
    /// The class, or [`NONE`].
    pub class: usize,
    /// `begin` (true) or `continue` (false); ignored for [`NONE`].
    pub begin: bool,
}

impl Label {
    /// The command that gives this label: `begin Claim`, `continue Evidence`, `none`.
    pub fn command(&self) -> String {
        match CLASSES.get(self.class) {
            None => "none".into(),
            Some(c) => format!("{} {c}", if self.begin { "begin" } else { "continue" }),
        }
    }

    /// The label a command gives (case and spacing ignored); `None` for anything else.
    pub fn parse(command: &str) -> Option<Label> {
        let c = sanitize_action(command, 200).to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ");
        if c == "none" {
            return Some(Label { class: NONE, begin: false });
        }
        let (verb, class) = c.split_once(' ')?;
        let begin = match verb {
            "begin" => true,
            "continue" => false,
            _ => return None,
        };
        let class = CLASSES.iter().position(|k| k.to_lowercase() == class)?;
        Some(Label { class, begin })
    }
}

/// Every admissible command: `begin X` and `continue X` for the seven classes, then `none`.
pub fn commands() -> Vec<String> {
    let mut out = Vec::new();
    for class in 0..CLASSES.len() {
        for begin in [true, false] {
            out.push(Label { class, begin }.command());
        }
    }
    out.push("none".into());
    out
}

/// An essay: its segments, in order, with their gold labels.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Essay {
    /// The seed it was generated from.
    pub seed: u64,
    /// The segments.
    pub segments: Vec<Segment>,
    /// Where each segment's words start (word indices of the whole essay), and the total last.
    pub word_starts: Vec<usize>,
}

impl Essay {
    /// An essay of `segments` (word indices follow from their whitespace-split words).
    pub fn new(seed: u64, segments: Vec<Segment>) -> Self {
        let mut word_starts = vec![0];
        for s in &segments {
            word_starts.push(word_starts.last().copied().unwrap_or(0) + s.text.split_whitespace().count());
        }
        Self { seed, segments, word_starts }
    }

    /// The gold labels.
    pub fn gold_labels(&self) -> Vec<Label> {
        self.segments.iter().map(|s| Label { class: s.class, begin: s.begin }).collect()
    }

    /// The elements `labels` (one per segment, from the first; fewer are fine) make, as spans
    /// of word indices: `begin X` opens one, `continue X` extends the open element of class X
    /// or else opens one, `none` closes it.
    pub fn spans(&self, labels: &[Label]) -> Vec<Span> {
        let mut out: Vec<Span> = Vec::new();
        let mut open = false;
        for (k, label) in labels.iter().enumerate().take(self.segments.len()) {
            let words = self.word_starts[k]..self.word_starts[k + 1];
            if label.class == NONE {
                open = false;
                continue;
            }
            let extend = open && !label.begin && out.last().is_some_and(|s| s.class == label.class);
            match out.last_mut() {
                Some(last) if extend => last.words.extend(words),
                _ => out.push(Span::new(label.class, words)),
            }
            open = true;
        }
        out
    }

    /// The gold elements.
    pub fn gold_spans(&self) -> Vec<Span> {
        self.spans(&self.gold_labels())
    }

    /// The F-score of `labels` (segments past them count as `none`).
    pub fn score(&self, labels: &[Label]) -> f64 {
        essay_score(&self.spans(labels), &self.gold_spans())
    }

    /// The potential of the dense reward: the F-score of the first `labels.len()` segments'
    /// labels against the gold elements cut to those segments' words; 0 before any label.
    pub fn prefix_score(&self, labels: &[Label]) -> f64 {
        if labels.is_empty() {
            return 0.0;
        }
        let end = self.word_starts[labels.len().min(self.segments.len())];
        let gold: Vec<Span> = self
            .gold_spans()
            .into_iter()
            .map(|s| Span { class: s.class, words: s.words.into_iter().filter(|&w| w < end).collect() })
            .filter(|s| !s.words.is_empty())
            .collect();
        essay_score(&self.spans(labels), &gold)
    }

    /// The essay's text (segments joined by spaces).
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect::<Vec<_>>().join(" ")
    }
}

/// The environment's settings (`[env.essays]`; every field optional).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EssaysConfig {
    /// Reward every turn with the change of the prefix F-score (the return is unchanged).
    pub dense_reward: bool,
    /// The last labels shown in the observation.
    pub labels_shown: usize,
}

impl Default for EssaysConfig {
    fn default() -> Self {
        Self { dense_reward: false, labels_shown: 3 }
    }
}

/// The objective every observation carries.
pub const OBJECTIVE: &str = "Label each essay segment: begin X, continue X, or none.";

/// One environment's essay in progress.
#[derive(Debug, Clone)]
struct Episode {
    essay: Essay,
    labels: Vec<Label>,
    max_steps: usize,
    ended: bool,
}

/// A batch of essay-labelling environments (see the module docs).
#[derive(Debug, Clone)]
pub struct Essays {
    config: EssaysConfig,
    max_steps: usize,
    commands: Vec<String>,
    episodes: Vec<Option<Episode>>,
}

impl Essays {
    /// `num_envs` environments; an episode is cut (truncated) after `max_steps` segments.
    pub fn new(num_envs: usize, config: EssaysConfig, max_steps: usize) -> Result<Self> {
        if max_steps == 0 {
            return Err(Error::Config("essays: max_steps must be at least 1".into()));
        }
        Ok(Self { config, max_steps, commands: commands(), episodes: vec![None; num_envs] })
    }

    /// The essay environment `env` labels (`None` before its first reset).
    pub fn essay(&self, env: usize) -> Option<&Essay> {
        self.episodes.get(env)?.as_ref().map(|e| &e.essay)
    }

    fn observe(&self, ep: &Episode) -> String {
        let k = ep.labels.len();
        let segs = &ep.essay.segments;
        let n = segs.len();
        if ep.ended || k >= n {
            return format!("All {n} segments labelled.");
        }
        let shown = ep.labels.len().saturating_sub(self.config.labels_shown);
        let recent: Vec<String> = ep.labels[shown..].iter().map(Label::command).collect();
        let mut s = format!("Segment {} of {n}.", k + 1);
        if !recent.is_empty() {
            s.push_str(&format!(" Last labels: {}.", recent.join(", ")));
        }
        if k > 0 {
            s.push_str(&format!("\nBefore: {}", segs[k - 1].text));
        }
        s.push_str(&format!("\nSegment: {}", segs[k].text));
        s.push_str(&format!("\nAfter: {}", segs.get(k + 1).map_or("(end of essay)", |x| x.text.as_str())));
        s
    }

    fn report(&self, ep: &Episode, reward: f64, invalid: bool) -> EnvStep {
        let n = ep.essay.segments.len();
        let finished = ep.labels.len() >= n;
        let score = if ep.ended { ep.essay.score(&ep.labels) } else { ep.essay.prefix_score(&ep.labels) };
        let mut infos = serde_json::Map::new();
        infos.insert("seed".into(), ep.essay.seed.into());
        infos.insert("segments".into(), n.into());
        EnvStep {
            observation: self.observe(ep),
            reward,
            terminated: ep.ended && finished,
            truncated: ep.ended && !finished,
            won: ep.ended && score >= 1.0,
            lost: false,
            score,
            max_score: 1.0,
            moves: ep.labels.len(),
            admissible_commands: if ep.ended { Vec::new() } else { self.commands.clone() },
            objective: OBJECTIVE.into(),
            inventory: String::new(),
            invalid,
            infos,
        }
    }
}

impl TextEnv for Essays {
    fn num_envs(&self) -> usize {
        self.episodes.len()
    }

    /// Starts the essay `reset.seed` (default 0; seeds from [`super::adventure::HELDOUT_START`]
    /// are held-out essays); `reset.game` is ignored.
    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> Result<Vec<EnvStep>> {
        check_indices("reset", envs, self.episodes.len(), resets.len())?;
        let mut out = Vec::with_capacity(envs.len());
        for (&e, reset) in envs.iter().zip(resets) {
            let seed = reset.seed.unwrap_or(0);
            let essay = generate::generate(seed, is_heldout(seed));
            let ep = Episode { essay, labels: Vec::new(), max_steps: self.max_steps, ended: false };
            out.push(self.report(&ep, 0.0, false));
            self.episodes[e] = Some(ep);
        }
        Ok(out)
    }

    fn step(&mut self, actions: &[(usize, String)]) -> Result<Vec<Result<EnvStep>>> {
        let envs: Vec<usize> = actions.iter().map(|(e, _)| *e).collect();
        check_indices("step", &envs, self.episodes.len(), actions.len())?;
        let mut out = Vec::with_capacity(actions.len());
        for (e, action) in actions {
            let Some(mut ep) = self.episodes[*e].take() else {
                out.push(Err(Error::not_running("essays", *e, "has no essay")));
                continue;
            };
            if ep.ended {
                let seed = ep.essay.seed;
                self.episodes[*e] = Some(ep);
                out.push(Err(Error::not_running(
                    "essays",
                    *e,
                    format!("has labelled all of its essay (seed {seed})"),
                )));
                continue;
            }
            let parsed = Label::parse(action);
            let before = ep.essay.prefix_score(&ep.labels);
            ep.labels.push(parsed.unwrap_or(Label { class: NONE, begin: false }));
            ep.ended = ep.labels.len() >= ep.essay.segments.len() || ep.labels.len() >= ep.max_steps;
            let reward = match (self.config.dense_reward, ep.ended) {
                (true, true) => ep.essay.score(&ep.labels) - before,
                (true, false) => ep.essay.prefix_score(&ep.labels) - before,
                (false, true) => ep.essay.score(&ep.labels),
                (false, false) => 0.0,
            };
            out.push(Ok(self.report(&ep, reward, parsed.is_none())));
            self.episodes[*e] = Some(ep);
        }
        Ok(out)
    }

    /// The gold labels of the segments not yet labelled.
    fn walkthrough(&self, env: usize) -> Option<Vec<String>> {
        let ep = self.episodes.get(env)?.as_ref()?;
        if ep.ended {
            return None;
        }
        Some(ep.essay.gold_labels()[ep.labels.len()..].iter().map(Label::command).collect())
    }
}

#[cfg(test)]
mod tests;
