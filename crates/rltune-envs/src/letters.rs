//! The textworld fork's toy environment: every turn the agent says something and earns 0.1 per
//! letter "e" in it. An episode lasts `turns` turns and ends truncated (there is nothing to win),
//! so it tests the multi-turn machinery (memory, discounting across turns, bootstrapping) with
//! a reward any policy can learn.

use super::{check_indices, sanitize_action, EnvStep, Reset, TextEnv};
use crate::error::{Error, Result};

/// Reward per letter "e" (either case), as in the textworld fork.
pub const REWARD_PER_E: f64 = 0.1;

/// The longest action read, in characters.
const MAX_ACTION_CHARS: usize = 200;

/// The letters "e" and "E" in `text`.
pub fn count_e(text: &str) -> usize {
    text.chars().filter(|c| c.eq_ignore_ascii_case(&'e')).count()
}

/// The letter toy (see the module docs).
#[derive(Debug, Clone)]
pub struct Letters {
    turns: usize,
    /// Moves of each environment's episode; `None` before a reset and after the end.
    moves: Vec<Option<usize>>,
    score: Vec<f64>,
}

impl Letters {
    /// `n` environments whose episodes last `turns` turns.
    pub fn new(n: usize, turns: usize) -> Self {
        Self { turns: turns.max(1), moves: vec![None; n], score: vec![0.0; n] }
    }

    fn observation(&self, moves: usize) -> EnvStep {
        EnvStep {
            observation: format!("Turn {} of {}. Say something with many letters e.", moves + 1, self.turns),
            objective: "Use the letter e as often as you can.".into(),
            ..EnvStep::default()
        }
    }
}

impl TextEnv for Letters {
    fn num_envs(&self) -> usize {
        self.moves.len()
    }

    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> Result<Vec<EnvStep>> {
        check_indices("reset", envs, self.moves.len(), resets.len())?;
        Ok(envs
            .iter()
            .map(|&e| {
                self.moves[e] = Some(0);
                self.score[e] = 0.0;
                self.observation(0)
            })
            .collect())
    }

    fn step(&mut self, actions: &[(usize, String)]) -> Result<Vec<Result<EnvStep>>> {
        let envs: Vec<usize> = actions.iter().map(|(e, _)| *e).collect();
        check_indices("step", &envs, self.moves.len(), actions.len())?;
        Ok(actions
            .iter()
            .map(|(e, action)| {
                let Some(moves) = self.moves[*e] else {
                    return Err(Error::not_running("letters", *e, "has no episode"));
                };
                let action = sanitize_action(action, MAX_ACTION_CHARS);
                let reward = REWARD_PER_E * count_e(&action) as f64;
                let moves = moves + 1;
                self.score[*e] += reward;
                let truncated = moves >= self.turns;
                self.moves[*e] = (!truncated).then_some(moves);
                Ok(EnvStep { reward, truncated, score: self.score[*e], moves, ..self.observation(moves) })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewards_count_the_letter_e_and_episodes_truncate_after_their_turns() {
        let mut env = Letters::new(2, 2);
        env.reset(&[0, 1], &[Reset::default(); 2]).unwrap();
        let r = env.step(&[(1, "Eee\nmore e".into()), (0, "abc".into())]).unwrap();
        let (a, b) = (r[0].as_ref().unwrap(), r[1].as_ref().unwrap());
        assert!((a.reward - 0.3).abs() < 1e-12, "only the first line counts: {}", a.reward);
        assert_eq!((b.reward, b.truncated, b.terminated), (0.0, false, false));
        let r = env.step(&[(0, "e".into())]).unwrap();
        let a = r[0].as_ref().unwrap();
        assert!(a.truncated && !a.terminated && a.moves == 2);
        assert!(env.step(&[(0, "e".into())]).unwrap()[0].is_err(), "stepping an ended episode");
    }
}
