//! Tests of the adventure family: determinism, the seed split, walkthroughs, parsing,
//! episode ends, batching, and a random agent's win rate.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn seeded(seed: u64) -> Reset {
    Reset { seed: Some(seed), game: None }
}

fn one(env: &mut Adventure, e: usize, action: &str) -> EnvStep {
    env.step(&[(e, action.to_string())]).unwrap().remove(0).unwrap()
}

/// Plays the walkthrough from the current state; returns the last step and the plan's length.
fn play_walkthrough(env: &mut Adventure, e: usize) -> (EnvStep, usize) {
    let plan = env.walkthrough(e).expect("a winnable game");
    let mut last = None;
    for command in &plan {
        let out = one(env, e, command);
        assert!(!out.invalid, "walkthrough command {command:?} refused: {}", out.observation);
        last = Some(out);
    }
    (last.expect("a non-empty walkthrough"), plan.len())
}

#[test]
fn the_same_seed_gives_the_same_game_and_observations() {
    let config =
        AdventureConfig { doors: true, locked_doors: true, quest_length: 5, ..AdventureConfig::default() };
    assert_eq!(describe(42, &config).unwrap(), describe(42, &config).unwrap());
    let mut env = Adventure::new(2, config).unwrap();
    let first = env.reset(&[0, 1], &[seeded(42), seeded(42)]).unwrap();
    assert_eq!(first[0], first[1]);
    let plan = env.walkthrough(0).unwrap();
    for command in plan.iter().chain(&["look".to_string()]).take(4) {
        let out = env.step(&[(0, command.clone()), (1, command.clone())]).unwrap();
        assert_eq!(out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
    }
    // a reset without a seed plays DEFAULT_SEED
    let a = env.reset(&[0], &[Reset::default()]).unwrap().remove(0);
    let b = env.reset(&[1], &[seeded(DEFAULT_SEED)]).unwrap().remove(0);
    assert_eq!(a, b);
}

#[test]
fn different_seeds_give_different_games() {
    let config = AdventureConfig::default();
    let mut games: Vec<String> = (0..100).map(|i| describe(train_seed(i), &config).unwrap()).collect();
    // the description starts with the seed; compare the games themselves
    games.iter_mut().for_each(|g| *g = g.split_once('\n').map(|(_, rest)| rest.to_string()).unwrap());
    games.sort();
    games.dedup();
    assert!(games.len() >= 95, "only {} distinct games in 100 seeds", games.len());
}

#[test]
fn training_and_heldout_seeds_are_disjoint() {
    for i in [0, 1, 7, HELDOUT_START - 1, HELDOUT_START, u64::MAX] {
        assert!(!is_heldout(train_seed(i)), "train_seed({i})");
        assert!(is_heldout(heldout_seed(i)), "heldout_seed({i})");
    }
    assert_eq!(train_seed(5), 5);
    assert_eq!(heldout_seed(5), HELDOUT_START + 5);
    // Validation seeds are held out, and never a test seed.
    for i in [0, 1, 7, VALIDATION_START - HELDOUT_START - 1, HELDOUT_START, u64::MAX] {
        let (test, validation) = (heldout_seed(i), validation_seed(i));
        assert!(is_heldout(validation) && validation >= VALIDATION_START, "validation_seed({i})");
        assert!(test < VALIDATION_START, "heldout_seed({i})");
    }
    assert_eq!(validation_seed(5), VALIDATION_START + 5);
}

#[test]
fn walkthroughs_from_reset_win_with_the_full_score_on_both_splits() {
    let config = AdventureConfig::default();
    let mut env = Adventure::new(1, config.clone()).unwrap();
    for (split, seed_of) in [("train", train_seed as fn(u64) -> u64), ("heldout", heldout_seed)] {
        let mut total = 0;
        for i in 0..200 {
            let first = env.reset(&[0], &[seeded(seed_of(i))]).unwrap().remove(0);
            assert_eq!((first.score, first.max_score), (0.0, config.quest_length as f64));
            let (last, len) = play_walkthrough(&mut env, 0);
            assert!(last.won && last.terminated && !last.truncated, "seed {}", seed_of(i));
            assert_eq!(last.score, last.max_score);
            assert!(len >= config.quest_length, "a milestone per command at most");
            assert!(len <= config.max_steps, "winnable within max_steps: {len}");
            total += len;
        }
        println!("{split}: mean walkthrough length {:.2} over 200 seeds", total as f64 / 200.0);
    }
}

#[test]
fn the_longest_quests_with_locked_doors_are_won_by_their_walkthroughs() {
    let config = AdventureConfig {
        rooms: 5,
        quest_length: 6,
        doors: true,
        locked_doors: true,
        distractors: 4,
        trap: true,
        ..AdventureConfig::default()
    };
    let mut env = Adventure::new(1, config).unwrap();
    for i in 0..100 {
        let first = env.reset(&[0], &[seeded(heldout_seed(i))]).unwrap().remove(0);
        assert_eq!(first.max_score, 6.0);
        let (last, len) = play_walkthrough(&mut env, 0);
        assert!(last.won && last.score == 6.0 && len >= 6, "seed {}", heldout_seed(i));
    }
}

#[test]
fn walkthroughs_from_the_middle_of_an_episode_still_win() {
    let config =
        AdventureConfig { doors: true, locked_doors: true, quest_length: 5, ..AdventureConfig::default() };
    let mut env = Adventure::new(1, config).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for i in 0..100 {
        let mut out = env.reset(&[0], &[seeded(train_seed(i))]).unwrap().remove(0);
        for _ in 0..4 {
            let pick = rng.gen_range(0..out.admissible_commands.len());
            out = one(&mut env, 0, &out.admissible_commands[pick].clone());
            if out.done() {
                break;
            }
        }
        if out.done() {
            continue;
        }
        let score = out.score;
        let (last, _) = play_walkthrough(&mut env, 0);
        assert!(last.won && last.score == last.max_score && last.score >= score, "seed {i}");
    }
}

#[test]
fn invalid_and_empty_commands_are_refused_and_count_a_move() {
    let mut env = Adventure::new(1, AdventureConfig::default()).unwrap();
    env.reset(&[0], &[seeded(1)]).unwrap();
    let out = one(&mut env, 0, "dance wildly");
    assert!(out.invalid && out.reward == 0.0 && out.moves == 1);
    assert_eq!(out.observation, "That's not a verb I recognise.");
    let out = one(&mut env, 0, "take the moon");
    assert!(out.invalid && out.moves == 2);
    assert_eq!(out.observation, "You can't do that.");
    let out = one(&mut env, 0, "");
    assert!(out.invalid && out.moves == 3 && !out.admissible_commands.is_empty());
    // case and spacing do not matter
    let out = one(&mut env, 0, "  LOOK  ");
    assert!(!out.invalid && out.observation.starts_with("-= "), "{}", out.observation);
    let out = one(&mut env, 0, "Inventory");
    assert_eq!(out.observation, "You are carrying nothing.");
}

#[test]
fn an_action_with_a_newline_runs_only_its_first_line() {
    let mut env = Adventure::new(2, AdventureConfig::default()).unwrap();
    env.reset(&[0, 1], &[seeded(9), seeded(9)]).unwrap();
    let plan = env.walkthrough(0).unwrap();
    let out = env.step(&[(0, format!("{}\n{}", plan[0], plan[1])), (1, plan[0].clone())]).unwrap();
    let (a, b) = (out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
    assert_eq!(a, b);
    assert_eq!(a.moves, 1);
}

#[test]
fn episodes_truncate_at_max_steps_without_terminating() {
    let config = AdventureConfig { max_steps: 3, ..AdventureConfig::default() };
    let mut env = Adventure::new(1, config).unwrap();
    env.reset(&[0], &[seeded(4)]).unwrap();
    assert!(!one(&mut env, 0, "look").done());
    assert!(!one(&mut env, 0, "xyzzy").done());
    let out = one(&mut env, 0, "inventory");
    assert!(out.truncated && !out.terminated && !out.won && out.moves == 3);
    assert!(out.admissible_commands.is_empty());
}

#[test]
fn stepping_an_ended_or_unstarted_episode_is_that_environments_error() {
    let mut env = Adventure::new(2, AdventureConfig::default()).unwrap();
    let out = env.step(&[(0, "look".into())]).unwrap();
    assert!(out[0].as_ref().unwrap_err().to_string().contains("reset it first"));
    env.reset(&[0, 1], &[seeded(2), seeded(3)]).unwrap();
    play_walkthrough(&mut env, 0);
    assert_eq!(env.walkthrough(0), None, "no walkthrough after the end");
    let out = env.step(&[(0, "look".into()), (1, "look".into())]).unwrap();
    let err = out[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("has ended") && err.contains("reset it first"), "{err}");
    assert!(out[1].is_ok(), "the other environment carries on");
    assert!(env.step(&[(2, "look".into())]).is_err(), "index out of range");
    assert!(env.step(&[(1, "look".into()), (1, "look".into())]).is_err(), "listed twice");
}

#[test]
fn batched_environments_play_independently() {
    let seeds = [heldout_seed(0), heldout_seed(1), heldout_seed(2)];
    let mut batch = Adventure::new(3, AdventureConfig::default()).unwrap();
    let mut alone = Adventure::new(1, AdventureConfig::default()).unwrap();
    let resets: Vec<Reset> = seeds.iter().map(|&s| seeded(s)).collect();
    let firsts = batch.reset(&[2, 0, 1], &[resets[2], resets[0], resets[1]]).unwrap();
    let plans: Vec<Vec<String>> = (0..3).map(|e| batch.walkthrough(e).unwrap()).collect();
    let mut batched: Vec<Vec<EnvStep>> =
        vec![vec![firsts[1].clone()], vec![firsts[2].clone()], vec![firsts[0].clone()]];
    for t in 0..plans.iter().map(Vec::len).max().unwrap() {
        let actions: Vec<(usize, String)> =
            (0..3).filter_map(|e| plans[e].get(t).map(|c| (e, c.clone()))).rev().collect();
        let out = batch.step(&actions).unwrap();
        for ((e, _), r) in actions.iter().zip(out) {
            batched[*e].push(r.unwrap());
        }
    }
    for e in 0..3 {
        let mut solo = vec![alone.reset(&[0], &[resets[e]]).unwrap().remove(0)];
        solo.extend(plans[e].iter().map(|c| one(&mut alone, 0, c)));
        assert_eq!(batched[e], solo, "environment {e}");
        assert!(solo.last().unwrap().won);
    }
}

#[test]
fn the_trap_loses_the_game() {
    let config = AdventureConfig { trap: true, ..AdventureConfig::default() };
    let mut env = Adventure::new(1, config).unwrap();
    let mut found = 0;
    for i in 0..50 {
        let out = env.reset(&[0], &[seeded(i)]).unwrap().remove(0);
        let Some(take) = out.admissible_commands.iter().find(|c| c.starts_with("take rotten")) else {
            continue;
        };
        let food = take.trim_start_matches("take ").split(" from ").next().unwrap().to_string();
        assert!(!one(&mut env, 0, take).done());
        let out = one(&mut env, 0, &format!("eat {food}"));
        assert!(out.lost && out.terminated && !out.won && out.reward == 0.0, "{}", out.observation);
        found += 1;
    }
    assert!(found > 0, "no rotten food in the start room of 50 games");
}

#[test]
fn configs_are_validated_naming_the_field() {
    let bad = |c: AdventureConfig| Adventure::new(1, c).unwrap_err().to_string();
    let d = AdventureConfig::default;
    assert!(bad(AdventureConfig { rooms: 0, ..d() }).contains("adventure.rooms"));
    assert!(bad(AdventureConfig { rooms: 13, ..d() }).contains("adventure.rooms"));
    assert!(bad(AdventureConfig { quest_length: 5, ..d() }).contains("adventure.quest_length"));
    assert!(bad(AdventureConfig { quest_length: 0, ..d() }).contains("adventure.quest_length"));
    assert!(bad(AdventureConfig { doors: true, quest_length: 5, ..d() }).contains("adventure.quest_length"));
    assert!(bad(AdventureConfig { distractors: 9, ..d() }).contains("adventure.distractors"));
    assert!(bad(AdventureConfig { rooms: 1, doors: true, ..d() }).contains("adventure.doors"));
    assert!(
        bad(AdventureConfig { doors: false, locked_doors: true, ..d() }).contains("adventure.locked_doors")
    );
    assert!(bad(AdventureConfig { max_steps: 0, ..d() }).contains("adventure.max_steps"));
    let c: AdventureConfig = toml::from_str("rooms = 4\ndoors = true\nlocked_doors = true").unwrap();
    assert_eq!((c.rooms, c.quest_length, c.locked_doors), (4, 3, true));
    assert!(toml::from_str::<AdventureConfig>("room = 4").is_err(), "unknown fields are refused");
    // the smallest game: one room, take and put
    let one_room = AdventureConfig { rooms: 1, doors: false, quest_length: 2, ..d() };
    let mut env = Adventure::new(1, one_room).unwrap();
    env.reset(&[0], &[seeded(0)]).unwrap();
    assert!(play_walkthrough(&mut env, 0).0.won);
}

#[test]
fn texts_look_like_textworld() {
    let mut env = Adventure::new(1, AdventureConfig::default()).unwrap();
    let out = env.reset(&[0], &[seeded(11)]).unwrap().remove(0);
    assert!(out.observation.starts_with("-= ") && out.observation.contains(" =-\nYou are in the "));
    assert!(out.objective.starts_with("Find the ") && out.objective.ends_with('.'));
    assert_eq!(out.inventory, "You are carrying nothing.");
    let mut sorted = out.admissible_commands.clone();
    sorted.sort();
    assert_eq!(sorted, out.admissible_commands);
    assert!(out.admissible_commands.contains(&"look".to_string()));
    assert!(out.admissible_commands.contains(&"inventory".to_string()));
    println!("{}\n{}\n{:?}", out.observation, out.objective, out.admissible_commands);
}

/// A uniformly random agent over the admissible commands, 200 held-out games, 20 moves each.
#[test]
fn a_random_agent_wins_sometimes_but_not_always() {
    let config = AdventureConfig { max_steps: 20, ..AdventureConfig::default() };
    let mut env = Adventure::new(1, config).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let (mut wins, mut score, episodes) = (0, 0.0, 200);
    for i in 0..episodes {
        let mut out = env.reset(&[0], &[seeded(heldout_seed(i))]).unwrap().remove(0);
        while !out.done() {
            let pick = rng.gen_range(0..out.admissible_commands.len());
            out = one(&mut env, 0, &out.admissible_commands[pick].clone());
            assert!(!out.invalid);
        }
        wins += usize::from(out.won);
        score += out.normalized_score();
    }
    let rate = wins as f64 / episodes as f64;
    println!("random agent: win rate {rate:.3}, mean normalized score {:.3}", score / episodes as f64);
    assert!(rate > 0.0 && rate < 1.0, "win rate {rate}");
    // the defaults are tuned so that learning is measurable (see AdventureConfig)
    assert!((0.03..=0.35).contains(&rate), "the defaults drifted: random win rate {rate}");
}
