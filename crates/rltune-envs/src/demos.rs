//! Demonstrations for behavioural cloning: (prompt, action) pairs from walkthroughs.
//!
//! In each state the expert's action is the first command of the environment's walkthrough
//! from there ([`TextEnv::walkthrough`]), and the pair (the prompt an agent would read, that
//! command) is recorded. With probability `noise` the command actually played is a random
//! admissible one instead (DART-style noise injection, Laskey et al. 2017): the demonstrations
//! then also show how to recover from states off the shortest path, which a policy that cannot
//! see the map will reach.
//!
//! With `[agent] memory = "transcript"` a prompt is the episode's text so far, as the agent reads
//! it then: the first state, then each command played (`" {command}\n"`) and the next state.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::play::{action_text, Memory, PromptTemplate, Turn};
use super::{Reset, TextEnv};
use crate::error::{Error, Result};

/// One demonstrated turn.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Demonstration {
    /// The prompt (rendered with the whole memory the template shows).
    pub prompt: String,
    /// The expert's command.
    pub action: String,
}

/// Plays one episode per reset in `resets` on environment 0 of `env` (at most `max_steps`
/// moves each) and returns every state's demonstration, episode by episode.
pub fn demonstrations(
    env: &mut dyn TextEnv,
    template: &PromptTemplate,
    resets: &[Reset],
    max_steps: usize,
    noise: f64,
    seed: u64,
) -> Result<Vec<Demonstration>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let transcript = template.memory == Memory::Transcript;
    for reset in resets {
        let mut state = env.reset(&[0], std::slice::from_ref(reset))?.remove(0);
        let mut memory: Vec<Turn> = Vec::new();
        // With transcript memory: the episode's text so far, as the agent reads it.
        let mut text = template.render(&state, &[], 0);
        for _ in 0..max_steps {
            let Some(expert) = env.walkthrough(0).and_then(|w| w.into_iter().next()) else { break };
            let prompt = if transcript {
                text.clone()
            } else {
                template.render(&state, &memory, template.memory_turns)
            };
            out.push(Demonstration { prompt, action: expert.clone() });
            let played = if rng.gen::<f64>() < noise {
                state.admissible_commands.choose(&mut rng).cloned().unwrap_or(expert)
            } else {
                expert
            };
            let after = env.step(&[(0, played.clone())])?.remove(0).map_err(|e| {
                Error::Refused(format!("demonstrations: the environment refused {played:?}: {e}"))
            })?;
            memory.push(Turn {
                observation: std::mem::take(&mut state.observation),
                action: played,
                reward: after.reward,
                invalid: after.invalid,
                ..Turn::default()
            });
            if transcript {
                // The command as the agent writes it, then the new state (PromptTemplate's transcript).
                text.push_str(&action_text(memory.last().map_or("", |t| t.action.as_str())));
                text.push_str(&template.render_next(&after));
            }
            let done = after.done();
            state = after;
            if done {
                break;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adventure::{train_seed, Adventure, AdventureConfig};

    #[test]
    fn noiseless_demonstrations_follow_the_walkthrough_and_win() {
        let mut env = Adventure::new(1, AdventureConfig::default()).unwrap();
        let t = PromptTemplate::default();
        let reset = Reset { seed: Some(train_seed(4)), game: None };
        env.reset(&[0], &[reset]).unwrap();
        let plan = env.walkthrough(0).unwrap();
        let demos = demonstrations(&mut env, &t, &[reset], 50, 0.0, 1).unwrap();
        let actions: Vec<&str> = demos.iter().map(|d| d.action.as_str()).collect();
        assert_eq!(actions, plan.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(demos[0].prompt.starts_with("Objective: ") && demos[0].prompt.ends_with(&t.instruction));
        // With noise, every label is still the walkthrough's first command from that state.
        let noisy = demonstrations(&mut env, &t, &[reset], 50, 0.5, 2).unwrap();
        assert!(noisy.len() >= demos.len(), "detours make episodes longer");
    }

    #[test]
    fn transcript_demonstrations_extend_the_episode_text() {
        use crate::play::{ActionMode, Memory};
        let mut env = Adventure::new(1, AdventureConfig::default()).unwrap();
        let t = PromptTemplate {
            actions: ActionMode::Admissible,
            memory: Memory::Transcript,
            ..PromptTemplate::default()
        };
        let reset = Reset { seed: Some(train_seed(3)), game: None };
        let demos = demonstrations(&mut env, &t, &[reset], 50, 0.0, 1).unwrap();
        assert!(demos.len() >= 2);
        for w in demos.windows(2) {
            let head = format!("{} {}\n", w[0].prompt, w[0].action);
            assert!(w[1].prompt.starts_with(&head), "{:?} does not extend {head:?}", w[1].prompt);
            assert!(w[1].prompt[head.len()..].starts_with("Observation: "));
        }
    }
}
