//! Evaluations independent of batching (issue #56): each episode's turns draw from streams keyed
//! by the episode's index and the seed, never by the environment slot that plays it, so the
//! same policy on the same games reads the same with any number of environments.

use candle_core::Device;
use rltune::agent::model_agent::play_model;
use rltune::envs::play::{play, ActionMode, Episode, Memory, PromptTemplate, RandomAgent};
use rltune::envs::{EnvStep, Reset, TextEnv};
use rltune::generation::GenerationConfig;

use crate::transcript::{byte_tokenizer, policy};

/// Episodes of different lengths (2 to 4 turns, from the reset's seed), so that with a few
/// environments the slots take up the episodes in an order that depends on their number; the
/// commands on offer change with the seed and the turn; "go" earns 1.
struct Maze {
    at: Vec<(u64, usize)>,
}

impl Maze {
    fn new(n: usize) -> Self {
        Self { at: vec![(0, 0); n] }
    }
    fn state(seed: u64, k: usize) -> EnvStep {
        let mut commands = vec!["go".to_string(), "look".into(), "wait".into(), "open door".into()];
        commands.rotate_left((seed as usize + k) % 4);
        commands.truncate(2 + (seed as usize + k) % 3);
        EnvStep {
            observation: format!("Room {k} of maze {seed}."),
            admissible_commands: commands,
            ..EnvStep::default()
        }
    }
}

impl TextEnv for Maze {
    fn num_envs(&self) -> usize {
        self.at.len()
    }
    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> rltune::envs::Result<Vec<EnvStep>> {
        Ok(envs
            .iter()
            .zip(resets)
            .map(|(&e, r)| {
                let seed = r.seed.unwrap_or(0);
                self.at[e] = (seed, 0);
                Self::state(seed, 0)
            })
            .collect())
    }
    fn step(
        &mut self,
        actions: &[(usize, String)],
    ) -> rltune::envs::Result<Vec<rltune::envs::Result<EnvStep>>> {
        Ok(actions
            .iter()
            .map(|(e, a)| {
                let (seed, k) = &mut self.at[*e];
                *k += 1;
                Ok(EnvStep {
                    reward: f64::from(u8::from(a == "go")),
                    truncated: *k == 2 + (*seed as usize) % 3,
                    ..Self::state(*seed, *k)
                })
            })
            .collect())
    }
}

fn resets(i: usize) -> Reset {
    Reset { seed: Some(1000 + i as u64), game: None }
}

/// What an episode played: its index, game, actions and return.
fn played(eps: &[Episode]) -> Vec<(usize, Option<u64>, Vec<String>, i64)> {
    eps.iter()
        .map(|e| {
            let actions = e.turns.iter().map(|t| t.action.clone()).collect();
            (e.episode, e.seed, actions, (e.episode_return * 1000.0).round() as i64)
        })
        .collect()
}

fn model_eval(template: &PromptTemplate, envs: usize, episodes: usize) -> Vec<Episode> {
    crate::common::install();
    let model = policy(512);
    let gen = GenerationConfig { seed: 17, max_new_tokens: 6, ..GenerationConfig::default() };
    let mut env = Maze::new(envs);
    let (eps, dropped) =
        play_model(&mut env, &model.lm, &byte_tokenizer(), template, &gen, episodes, &resets, &Device::Cpu)
            .unwrap();
    assert_eq!((eps.len(), dropped), (episodes, 0));
    eps
}

fn template(actions: ActionMode, memory: Memory) -> PromptTemplate {
    PromptTemplate { instruction: ">".into(), actions, memory, ..PromptTemplate::default() }
}

/// The model agent with window memory, admissible and free-text actions, and with transcript
/// memory: the same 7 episodes with 1, 2, 3 and 7 environments. The actions must vary between
/// episodes (else the check would hold for any seeding).
#[test]
fn a_model_evaluation_does_not_depend_on_the_number_of_environments() {
    for t in [
        template(ActionMode::Admissible, Memory::Window),
        template(ActionMode::Free, Memory::Window),
        template(ActionMode::Admissible, Memory::Transcript),
    ] {
        let one = played(&model_eval(&t, 1, 7));
        let distinct: std::collections::BTreeSet<&Vec<String>> = one.iter().map(|p| &p.2).collect();
        assert!(
            distinct.len() > 2,
            "{:?}: too few distinct plays to tell seedings apart: {one:?}",
            t.actions
        );
        for envs in [2, 3, 7] {
            assert_eq!(
                played(&model_eval(&t, envs, 7)),
                one,
                "{:?}/{:?} with {envs} environments",
                t.actions,
                t.memory
            );
        }
    }
}

/// The random baseline too.
#[test]
fn a_random_evaluation_does_not_depend_on_the_number_of_environments() {
    let run = |envs: usize| {
        let mut env = Maze::new(envs);
        let (eps, _) = play(&mut env, &mut RandomAgent::new(4), 9, &resets).unwrap();
        played(&eps)
    };
    let one = run(1);
    assert!(one.iter().map(|p| &p.2).collect::<std::collections::BTreeSet<_>>().len() > 3, "{one:?}");
    for envs in [2, 4, 9] {
        assert_eq!(run(envs), one, "{envs} environments");
    }
}
