//! A procedurally generated family of text adventures, in the style of TextWorld's
//! "coin collector" and "treasure hunter" games, Rust-native and seeded.
//!
//! Each seed is one game: a few rooms on a grid joined by exits (north, south, east, west),
//! some behind doors (closed, the quest's door perhaps locked with a key lying on the near
//! side), furniture (tables to put things on, chests to put things in) and small items. The
//! quest is to deliver one item to one piece of furniture: "Find the golden coin and put it on
//! the table in the study." Its scored milestones are the last `quest_length` steps of the
//! chain *take the key → unlock the door → open it → enter the target's room → take the
//! target → put it on the goal*; each is worth one point, the reward is the score's change,
//! and the game is won (terminated) when the last one is reached. Episodes that reach
//! `max_steps` moves first end truncated.
//!
//! Commands follow TextWorld: `go north`, `take golden coin`, `take golden coin from chest`,
//! `drop golden coin`, `put golden coin on table` / `in chest`, `open oak door`,
//! `unlock oak door with brass key`, `close …`, `lock … with …`, `examine …`, `look`,
//! `inventory` (and `eat rotten apple` with the trap on, which loses). [`EnvStep`]'s
//! `admissible_commands` lists exactly the commands that do something in the current state,
//! sorted. An action is read with [`sanitize_action`] (first line only), lower-cased, with
//! single spaces; anything not admissible is refused (`invalid`, still a move, no reward).
//!
//! Seeds: [`train_seed`], [`validation_seed`] and [`heldout_seed`] (the test games) map an
//! index into disjoint ranges (below 2^31, from 2^31 + 2^30, and between), so training never
//! sees an evaluation game and settings chosen on validation games are reported on others. A reset without a seed plays seed
//! [`DEFAULT_SEED`]. [`TextEnv::walkthrough`] gives the shortest win from the current state.
//!
//! ```
//! use rltune_envs::adventure::{heldout_seed, Adventure, AdventureConfig};
//! use rltune_envs::{Reset, TextEnv};
//!
//! # fn main() -> rltune_envs::Result<()> {
//! let mut env = Adventure::new(1, AdventureConfig::default())?;
//! let first = env.reset(&[0], &[Reset { seed: Some(heldout_seed(7)), game: None }])?;
//! assert!(first[0].observation.starts_with("-= "));
//! let plan = env.walkthrough(0).expect("generated games are winnable");
//! let mut last = first[0].clone();
//! for command in plan {
//!     last = env.step(&[(0, command)])?.remove(0)?;
//! }
//! assert!(last.won && last.terminated && last.score == last.max_score);
//! # Ok(()) }
//! ```
//!
//! Deviations from TextWorld: containers are always open; there is no carrying limit; the map
//! is a tree (one path between two rooms); scoring counts milestones in order, as TextWorld
//! counts a quest's events.

mod generate;
mod text;
mod world;

#[cfg(test)]
mod tests;

use super::{check_indices, sanitize_action, EnvStep, Reset, TextEnv};
use crate::error::{Error, Result};
use world::{State, World, VERBS};

/// The seed of a reset that names none.
pub const DEFAULT_SEED: u64 = 0;

/// Seeds below this are training games, seeds from it on are held-out games: the test games
/// below [`VALIDATION_START`], the validation games from it on.
pub const HELDOUT_START: u64 = 1 << 31;

/// The first validation game's seed: held-out seeds from here on are for choosing settings,
/// the ones below for reporting.
pub const VALIDATION_START: u64 = HELDOUT_START + (1 << 30);

/// The longest action read, in characters.
const MAX_ACTION_CHARS: usize = 200;

/// The most distractor objects (the word lists run out beyond).
pub const MAX_DISTRACTORS: usize = 8;

/// The `i`-th training game's seed: `i mod 2^31`, always below [`HELDOUT_START`].
pub fn train_seed(i: u64) -> u64 {
    i % HELDOUT_START
}

/// The `i`-th held-out (test) game's seed: `2^31 + (i mod 2^30)`, never a training or a
/// validation seed.
pub fn heldout_seed(i: u64) -> u64 {
    HELDOUT_START + i % (VALIDATION_START - HELDOUT_START)
}

/// The `i`-th validation game's seed: `2^31 + 2^30 + (i mod 2^30)`, never a training or a test
/// seed.
pub fn validation_seed(i: u64) -> u64 {
    VALIDATION_START + i % (VALIDATION_START - HELDOUT_START)
}

/// Whether `seed` is a held-out game's (see [`heldout_seed`]).
pub fn is_heldout(seed: u64) -> bool {
    seed >= HELDOUT_START
}

/// The game family's settings (a TOML table; every field optional).
///
/// The defaults make games a uniformly random agent over the admissible commands wins 9% of
/// the time within 20 moves (200 held-out seeds), while the walkthrough wins all of them in
/// 4.1 commands on average: enough room to measure learning. Doors make it harder (3% with
/// `doors = true`), as do distractors; see the test `a_random_agent_wins_sometimes_but_not_always`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdventureConfig {
    /// Rooms per game, 1 to 12 (default 3).
    pub rooms: usize,
    /// Scored milestones, 1 up to what the other settings allow: 2, plus 1 with two rooms or
    /// more, plus 1 with `doors`, plus 2 with `locked_doors` (default 3: enter the target's
    /// room, take the target, put it on the goal).
    pub quest_length: usize,
    /// Extra objects that play no part in the quest, 0 to 8 (default 1): items, or now and
    /// then furniture.
    pub distractors: usize,
    /// Closed doors: one on the way to the target, and on a quarter of the other exits
    /// (default false; needs `rooms >= 2`).
    pub doors: bool,
    /// The door on the way to the target is locked; its key lies on the near side (default
    /// false; needs `doors`).
    pub locked_doors: bool,
    /// A rotten food lies somewhere; eating it loses the game (default false).
    pub trap: bool,
    /// Moves before an episode ends truncated (default 20).
    pub max_steps: usize,
}

impl Default for AdventureConfig {
    fn default() -> Self {
        Self {
            rooms: 3,
            quest_length: 3,
            distractors: 1,
            doors: false,
            locked_doors: false,
            trap: false,
            max_steps: 20,
        }
    }
}

impl AdventureConfig {
    /// Checks ranges and combinations; errors name the field and the fix.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(format!("adventure.{msg}")));
        let max_rooms = text::ROOMS.len();
        if !(1..=max_rooms).contains(&self.rooms) {
            return bad(format!("rooms must be between 1 and {max_rooms}, got {}", self.rooms));
        }
        if self.distractors > MAX_DISTRACTORS {
            return bad(format!("distractors must be at most {MAX_DISTRACTORS}, got {}", self.distractors));
        }
        if self.doors && self.rooms < 2 {
            return bad("doors needs rooms >= 2; set doors = false or add rooms".into());
        }
        if self.locked_doors && !self.doors {
            return bad("locked_doors needs doors = true".into());
        }
        if self.max_steps == 0 {
            return bad("max_steps must be at least 1".into());
        }
        let max = generate::max_quest_length(self);
        if !(1..=max).contains(&self.quest_length) {
            return bad(format!(
                "quest_length must be between 1 and {max} with these settings, got {} (more rooms, \
                 doors and locked_doors allow longer quests, up to 6)",
                self.quest_length
            ));
        }
        Ok(())
    }
}

/// A description of the game `seed` generates under `config`: map, objects, doors, quest,
/// first view and walkthrough (for debugging).
pub fn describe(seed: u64, config: &AdventureConfig) -> Result<String> {
    config.validate()?;
    let world = generate::generate(seed, config);
    let plan = world.walkthrough(&world.start).map_or("none".into(), |p| p.join(", "));
    Ok(format!(
        "seed {seed}\n{}objective: {}\nwalkthrough: {plan}\n",
        world.describe(),
        generate::objective(&world)
    ))
}

/// One environment's game in progress.
#[derive(Debug, Clone)]
struct Episode {
    seed: u64,
    world: World,
    objective: String,
    state: State,
    moves: usize,
    max_steps: usize,
    /// Won, lost or truncated: stepping needs a reset.
    ended: bool,
}

/// A batch of generated text adventures (see the module docs).
#[derive(Debug, Clone)]
pub struct Adventure {
    config: AdventureConfig,
    episodes: Vec<Option<Episode>>,
}

impl Adventure {
    /// `num_envs` environments playing games of `config`'s family; reset them before stepping.
    pub fn new(num_envs: usize, config: AdventureConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config, episodes: vec![None; num_envs] })
    }

    /// The family's settings.
    pub fn config(&self) -> &AdventureConfig {
        &self.config
    }

    /// The seed of the game environment `env` plays (`None` before its first reset).
    pub fn seed(&self, env: usize) -> Option<u64> {
        self.episodes.get(env)?.as_ref().map(|e| e.seed)
    }
}

/// The result reported for `ep` after a reset or a step.
fn report(ep: &Episode, observation: String, reward: f64, invalid: bool) -> EnvStep {
    let (world, state) = (&ep.world, &ep.state);
    let won = world.won(state);
    let terminated = won || state.lost;
    let mut infos = serde_json::Map::new();
    infos.insert("seed".into(), ep.seed.into());
    // The exact state (for step-level credit that groups identical states, such as GiGPO).
    infos.insert("state".into(), format!("{state:?}").into());
    EnvStep {
        observation,
        reward,
        terminated,
        truncated: !terminated && ep.moves >= ep.max_steps,
        won,
        lost: state.lost,
        score: state.progress as f64,
        max_score: world.quest.len() as f64,
        moves: ep.moves,
        admissible_commands: if ep.ended {
            Vec::new()
        } else {
            world.commands(state).into_iter().map(|(text, _)| text).collect()
        },
        objective: ep.objective.clone(),
        inventory: text::inventory(world, state),
        invalid,
        infos,
    }
}

/// The action as a command: [`sanitize_action`], lower case, single spaces.
fn normalize(action: &str) -> String {
    sanitize_action(action, MAX_ACTION_CHARS).to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Plays `action` in `ep`, which has not ended.
fn play(ep: &mut Episode, action: &str) -> EnvStep {
    let command = normalize(action);
    let found = ep.world.commands(&ep.state).into_iter().find(|(text, _)| *text == command);
    ep.moves += 1;
    let (observation, gain, invalid) = match found {
        Some((_, cmd)) => {
            let gain = ep.world.effect(&mut ep.state, cmd);
            let mut observation = text::feedback(&ep.world, &ep.state, cmd);
            if gain > 0 {
                let points = if gain == 1 { "one point".to_string() } else { format!("{gain} points") };
                observation += &format!(" Your score has just gone up by {points}.");
            }
            if ep.world.won(&ep.state) {
                observation += " *** You won! ***";
            } else if ep.state.lost {
                observation += " *** You lost! ***";
            }
            (observation, gain, false)
        }
        None => {
            let verb = command.split(' ').next().unwrap_or("");
            let known = VERBS.contains(&verb);
            let observation = if known { "You can't do that." } else { "That's not a verb I recognise." };
            (observation.to_string(), 0, true)
        }
    };
    ep.ended = ep.world.won(&ep.state) || ep.state.lost || ep.moves >= ep.max_steps;
    report(ep, observation, gain as f64, invalid)
}

impl TextEnv for Adventure {
    fn num_envs(&self) -> usize {
        self.episodes.len()
    }

    /// Starts the game `reset.seed` (default [`DEFAULT_SEED`]) in each environment listed;
    /// `reset.game` does not apply to generated games and is ignored.
    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> Result<Vec<EnvStep>> {
        check_indices("reset", envs, self.episodes.len(), resets.len())?;
        Ok(envs
            .iter()
            .zip(resets)
            .map(|(&e, reset)| {
                let seed = reset.seed.unwrap_or(DEFAULT_SEED);
                let world = generate::generate(seed, &self.config);
                let ep = Episode {
                    seed,
                    objective: generate::objective(&world),
                    state: world.start.clone(),
                    world,
                    moves: 0,
                    max_steps: self.config.max_steps,
                    ended: false,
                };
                let observation = text::describe_room(&ep.world, &ep.state);
                let first = report(&ep, observation, 0.0, false);
                self.episodes[e] = Some(ep);
                first
            })
            .collect())
    }

    fn step(&mut self, actions: &[(usize, String)]) -> Result<Vec<Result<EnvStep>>> {
        let envs: Vec<usize> = actions.iter().map(|(e, _)| *e).collect();
        check_indices("step", &envs, self.episodes.len(), actions.len())?;
        Ok(actions
            .iter()
            .map(|(e, action)| match &mut self.episodes[*e] {
                None => Err(Error::not_running("adventure", *e, "has no episode")),
                Some(ep) if ep.ended => Err(Error::not_running(
                    "adventure",
                    *e,
                    format!("has ended its episode (seed {}) after {} moves", ep.seed, ep.moves),
                )),
                Some(ep) => Ok(play(ep, action)),
            })
            .collect())
    }

    /// The shortest win from the current state; `None` before a reset and after the end.
    fn walkthrough(&self, env: usize) -> Option<Vec<String>> {
        let ep = self.episodes.get(env)?.as_ref()?;
        if ep.ended {
            return None;
        }
        ep.world.walkthrough(&ep.state)
    }
}
