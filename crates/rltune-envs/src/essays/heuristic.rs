//! The heuristic baseline, standing in for the source's "naive NER": a keyword rule a person
//! would write in a minute, with no training.
//!
//! A segment that starts with a common cue phrase ("for example" → Evidence, "however" →
//! Rebuttal, …; [`CUES`]) begins an element of that class; the first segment begins a Lead
//! unless it has a cue; any other segment continues the element before it (or is `none` when
//! there is none). The cue list is generic on purpose: it knows a few openers of each class,
//! not the generator's.

use super::{Label, CLASSES, NONE};
use crate::error::Result;
use crate::play::{Agent, Pending};

/// Cue phrases (lower case, at the start of a segment) and their classes.
pub const CUES: [(&str, usize); 16] = [
    ("i believe", 1),
    ("in my opinion", 1),
    ("i think", 1),
    ("first,", 2),
    ("another reason", 2),
    ("also,", 2),
    ("finally,", 2),
    ("some people", 3),
    ("others ", 3),
    ("critics", 3),
    ("however,", 4),
    ("but ", 4),
    ("for example", 5),
    ("for instance", 5),
    ("in conclusion", 6),
    ("to sum up", 6),
];

/// The heuristic's label for `segment`, the `index`-th, after the label `previous`.
pub fn heuristic_label(segment: &str, index: usize, previous: Option<Label>) -> Label {
    let lower = segment.trim().to_lowercase();
    if let Some(&(_, class)) = CUES.iter().find(|(cue, _)| lower.starts_with(cue)) {
        return Label { class, begin: true };
    }
    if index == 0 {
        return Label { class: 0, begin: true };
    }
    match previous {
        Some(p) if p.class != NONE => Label { class: p.class, begin: false },
        _ => Label { class: NONE, begin: false },
    }
}

/// The heuristic's labels for a whole essay's segments.
pub fn heuristic_labels<S: AsRef<str>>(segments: &[S]) -> Vec<Label> {
    let mut out: Vec<Label> = Vec::with_capacity(segments.len());
    for (k, s) in segments.iter().enumerate() {
        let l = heuristic_label(s.as_ref(), k, out.last().copied());
        out.push(l);
    }
    out
}

/// The heuristic as an [`Agent`] for [`crate::play::play`]: it reads the segment and the
/// last label from the observation.
#[derive(Debug, Default)]
pub struct HeuristicAgent;

impl Agent for HeuristicAgent {
    fn act(&mut self, states: &[Pending]) -> Result<Vec<String>> {
        Ok(states
            .iter()
            .map(|&Pending { state: s, turns: memory, .. }| {
                let segment = s.observation.lines().find_map(|l| l.strip_prefix("Segment: ")).unwrap_or("");
                let previous = memory.last().and_then(|t| Label::parse(&t.action));
                heuristic_label(segment, memory.len(), previous).command()
            })
            .collect())
    }
}

/// The class names, for messages.
pub fn class_name(class: usize) -> &'static str {
    CLASSES.get(class).copied().unwrap_or("none")
}
