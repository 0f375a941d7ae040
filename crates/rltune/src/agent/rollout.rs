//! Multi-turn rollouts: B environments each play one episode with the policy, and every turn
//! the policy played becomes a transition for [`crate::ppo::PpoTrainer::step_with`] (or a row
//! of [`crate::grpo::TurnBatch`])
//! (query = the turn's prompt, response = the action's tokens, score = the shaped turn reward,
//! bootstrap = the next state's value).
//!
//! As in the textworld fork: the action is the generated text up to the first newline or
//! sentence punctuation, and the response is cut after the token that completes it (the policy
//! learns to stop there, and the logprobs and values the sampler returned stay aligned with
//! the kept tokens); with probability `example_turn_prob` a turn plays a random admissible
//! command instead, which enters the memory but not training; across turns the last token's next
//! value is `game_gamma · V(next turn's prompt)`, 0 when the episode terminated, and bootstrapped
//! from the final state when it was truncated (the fork treated the step cap as termination).

use std::time::{Duration, Instant};

use candle_core::Device;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::turns::{anchor_state, command_trie, drop_episode, prompt_budget, start_round};
pub use super::turns::{Actor, Collected, RolloutConfig, RoundCounts, Shaping, Transition};
use crate::envs::play::{ActionMode, Memory, Turn, ACTION_STOPS};
use crate::envs::{EnvStep, Reset, TextEnv};
use crate::error::{ConfigError, Error, Result};
use crate::generation::admissible::{generate_admissible, ActionTrie};
use crate::generation::{generate, GenerationConfig, Sample};
use crate::tokenizer::Tokenizer;

/// Where an action ends in a response: the number of tokens up to and including the one whose
/// text completes the first line or sentence (all of them when none does).
pub fn action_cut(response_ids: &[u32], tokenizer: &Tokenizer) -> Result<usize> {
    for k in 1..=response_ids.len() {
        let text = tokenizer.decode(&response_ids[..k])?;
        if text.contains(ACTION_STOPS) {
            return Ok(k);
        }
    }
    Ok(response_ids.len())
}

/// Plays one episode in each of `env`'s environments (reset with `resets`) with `policy`, and
/// returns every turn it played as a transition, plus the episodes' summaries.
///
/// An environment whose step fails (its own error, e.g. a restarted program) drops its
/// episode, transitions included, and the others carry on; an error of the whole batch is
/// returned.
///
/// With `[agent] memory = "transcript"` each episode is one growing token sequence and the
/// sampler's KV cache is carried from turn to turn (`super::transcript`).
pub fn collect_episodes<'a>(
    env: &mut dyn TextEnv,
    policy: impl Into<Actor<'a>>,
    tokenizer: &Tokenizer,
    cfg: &RolloutConfig,
    resets: &[Reset],
    seed: u64,
    device: &Device,
) -> Result<Collected> {
    let policy: Actor = policy.into();
    let (t0, n0) = crate::generation::prefill_counters();
    let mut got = match cfg.template.memory {
        Memory::Window => collect_windows(env, policy, tokenizer, cfg, resets, seed, device)?,
        Memory::Transcript => {
            cfg.template.validate()?;
            if cfg.example_turn_prob > 0.0 {
                return Err(Error::Setting(ConfigError::new(
                    "agent",
                    "memory",
                    "= \"transcript\" plays no example turns; set example_turn_prob = 0",
                )));
            }
            let streams = super::transcript::Streams::Round(seed);
            super::transcript::collect_transcripts(env, policy, tokenizer, cfg, resets, streams, device)?
        }
    };
    let (t1, n1) = crate::generation::prefill_counters();
    (got.counts.time_prefill, got.counts.prefill_tokens) = (t1 - t0, n1 - n0);
    Ok(got)
}

/// [`collect_episodes`] with window memory: each turn's prompt rendered anew.
fn collect_windows(
    env: &mut dyn TextEnv,
    policy: Actor,
    tokenizer: &Tokenizer,
    cfg: &RolloutConfig,
    resets: &[Reset],
    seed: u64,
    device: &Device,
) -> Result<Collected> {
    let b = env.num_envs();
    let max_prompt = prompt_budget(policy.lm, cfg.generation.max_new_tokens)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xe4a3);
    let (firsts, mut episodes, mut time_env) = start_round(env, resets)?;
    let mut time_generation = Duration::ZERO;
    // Per env: its state and memory while the episode runs; its transitions; the index of its
    // last transition, whose bootstrap waits for the next state's value.
    let mut live: Vec<Option<(EnvStep, Vec<Turn>)>> =
        firsts.into_iter().map(|s| Some((s, Vec::new()))).collect();
    let mut out: Vec<Vec<Transition>> = vec![Vec::new(); b];
    let mut waiting: Vec<Option<usize>> = vec![None; b];
    // The final state of a truncated episode whose last transition still needs its bootstrap.
    let mut truncated: Vec<Option<(EnvStep, Vec<Turn>)>> = vec![None; b];
    let (mut example_turns, mut dropped) = (0usize, 0usize);
    let mut turn = 0u64;
    loop {
        let active: Vec<usize> = (0..b).filter(|&e| live[e].is_some()).collect();
        let finals: Vec<usize> = (0..b).filter(|&e| truncated[e].is_some()).collect();
        if active.is_empty() && finals.is_empty() {
            break;
        }
        // The prompts of the running episodes, then of the truncated ones (only their value).
        // With admissible actions, each running episode's command trie, and a prompt that
        // leaves room for its longest command.
        let admissible = cfg.template.actions == ActionMode::Admissible;
        let mut prompts = Vec::with_capacity(active.len() + finals.len());
        let mut tries = Vec::new();
        for (k, &e) in active.iter().chain(&finals).enumerate() {
            let state = live[e].as_ref().or(truncated[e].as_ref());
            let (s, m) = state.ok_or_else(|| Error::Internal(format!("environment {e} has no state")))?;
            let mut budget = max_prompt;
            if admissible && k < active.len() {
                let (trie, longest) = command_trie(tokenizer, &s.admissible_commands)?;
                budget = budget.min(prompt_budget(policy.lm, longest)?);
                tries.push(trie);
            }
            prompts.push(cfg.template.fit(s, m, budget, |t| tokenizer.encode(t))?);
        }
        let seed_k = cfg.generation.seed.wrapping_add(seed).wrapping_add(turn);
        turn += 1;
        let gen = GenerationConfig { seed: seed_k, ..cfg.generation.clone() };
        let t = Instant::now();
        let (samples, allowed) = if admissible {
            sample_admissible(policy, &tries, prompts, &gen, device)?
        } else {
            (generate(policy.lm, policy.v_head, &prompts, &gen, device)?, Vec::new())
        };
        time_generation += t.elapsed();
        // V(prompt): the value of the state before the first sampled token.
        let bootstrap = |t: &mut Transition, k: usize| {
            let v = samples[k].values.as_ref().and_then(|v| v.first().copied()).unwrap_or(0.0);
            t.bootstrap = (cfg.game_gamma * f64::from(v)) as f32;
            t.next_query_ids.clone_from(&samples[k].query_ids);
        };
        for (k, &e) in finals.iter().enumerate() {
            if let (Some(i), Some(_)) = (waiting[e].take(), truncated[e].take()) {
                bootstrap(&mut out[e][i], active.len() + k);
            }
        }
        if active.is_empty() {
            break;
        }
        let mut actions = Vec::with_capacity(active.len());
        let mut cuts = Vec::with_capacity(active.len());
        for (k, &e) in active.iter().enumerate() {
            // The episode's previous transition bootstraps from this state's value.
            if let Some(i) = waiting[e].take() {
                bootstrap(&mut out[e][i], k);
            }
            let (s, _) =
                live[e].as_ref().ok_or_else(|| Error::Internal(format!("environment {e} has no state")))?;
            if cfg.example_turn_prob > 0.0 && rng.gen::<f64>() < cfg.example_turn_prob {
                let cmd = s.admissible_commands.choose(&mut rng).cloned().unwrap_or_else(|| "look".into());
                actions.push(cmd);
                cuts.push(None);
                example_turns += 1;
            } else if !allowed.is_empty() {
                // An admissible command: the whole trie path, its end token included.
                let text = tokenizer.decode(&samples[k].response_ids)?;
                actions.push(crate::envs::play::extract_action(&text));
                cuts.push(Some(samples[k].response_ids.len()));
            } else {
                let cut = action_cut(&samples[k].response_ids, tokenizer)?;
                let text = tokenizer.decode(&samples[k].response_ids[..cut])?;
                actions.push(crate::envs::play::extract_action(&text));
                cuts.push(Some(cut));
            }
        }
        let sent: Vec<(usize, String)> = active.iter().copied().zip(actions.iter().cloned()).collect();
        let t = Instant::now();
        let results = env.step(&sent)?;
        time_env += t.elapsed();
        for (k, ((&e, action), result)) in active.iter().zip(&actions).zip(results).enumerate() {
            let Some((before, mut memory)) = live[e].take() else { continue };
            let after = match result {
                Ok(after) => after,
                Err(err) => {
                    drop_episode(e, &err, &mut out, &mut waiting, &mut episodes);
                    dropped += 1;
                    continue;
                }
            };
            if let Some(cut) = cuts[k] {
                let s = &samples[k];
                out[e].push(Transition {
                    env: e,
                    query_ids: s.query_ids.clone(),
                    response_ids: s.response_ids[..cut].to_vec(),
                    logprobs: s.logprobs[..cut].to_vec(),
                    values: s
                        .values
                        .as_ref()
                        .and_then(|v| v.get(..cut))
                        .map(<[f32]>::to_vec)
                        .unwrap_or_default(),
                    action: action.clone(),
                    reward: cfg.shaping.reward(action, &after) as f32,
                    bootstrap: 0.0,
                    next_query_ids: Vec::new(),
                    state: anchor_state(&before),
                    // The admissible sets, or with truncated sampling the supports.
                    allowed: allowed
                        .get(k)
                        .or(s.support.as_ref())
                        .map(|a| a[..cut].to_vec())
                        .unwrap_or_default(),
                });
                // Terminated: no bootstrap. Going on or truncated: the next state's value.
                if !after.terminated {
                    waiting[e] = Some(out[e].len() - 1);
                }
            }
            // The transcript's turn: the admissible set and, for a sampled action, its logprob
            // (None for an example turn).
            let logprob = cuts[k].map(|cut| samples[k].logprobs[..cut].iter().map(|&l| f64::from(l)).sum());
            let turn = Turn::played(before, action.clone(), &after, logprob);
            if let Some(ep) = episodes[e].as_mut() {
                ep.record(turn.clone(), &after);
            }
            memory.push(Turn { admissible: Vec::new(), ..turn });
            if !after.done() {
                live[e] = Some((after, memory));
            } else if after.truncated && waiting[e].is_some() {
                truncated[e] = Some((after, memory));
            } else {
                waiting[e] = None;
            }
        }
    }
    let counts = RoundCounts { example_turns, dropped, time_generation, time_env, ..RoundCounts::default() };
    Ok(Collected {
        transitions: out.into_iter().flatten().collect(),
        episodes: episodes.into_iter().flatten().collect(),
        counts,
    })
}

/// The tokens allowed at each position of one sampled command.
type AllowedSets = Vec<Vec<u32>>;

/// One admissible command for each of the first `tries.len()` prompts (the running episodes),
/// then the values of the remaining prompts (truncated episodes, whose prompt's value is all
/// that is read) by a one-token free sample. Returns the samples in prompt order and the
/// allowed sets of the running ones.
fn sample_admissible(
    policy: Actor,
    tries: &[ActionTrie],
    mut prompts: Vec<Vec<u32>>,
    gen: &GenerationConfig,
    device: &Device,
) -> Result<(Vec<Sample>, Vec<AllowedSets>)> {
    let rest = prompts.split_off(tries.len());
    let picked = if tries.is_empty() {
        Vec::new() // every episode left is truncated: only their values are read
    } else {
        generate_admissible(policy.lm, policy.v_head, &prompts, tries, gen, device)?
    };
    let mut allowed = Vec::with_capacity(picked.len());
    let mut samples: Vec<Sample> = picked
        .into_iter()
        .map(|a| {
            allowed.push(a.allowed);
            Sample {
                query_ids: a.query_ids,
                response_ids: a.response_ids,
                logprobs: a.logprobs,
                support: None,
                values: Some(a.values),
            }
        })
        .collect();
    if !rest.is_empty() {
        let one = GenerationConfig {
            max_new_tokens: 1,
            min_new_tokens: 0,
            row_offset: gen.row_offset + tries.len() as u64,
            ..gen.clone()
        };
        samples.extend(generate(policy.lm, policy.v_head, &rest, &one, device)?);
    }
    Ok((samples, allowed))
}

/// Recomputes every bootstrap as `game_gamma · V(next_query_ids)` under `values` (a separate
/// critic's: [`crate::ppo::PpoTrainer::values`]), in one batched call; a transition whose
/// episode terminated keeps 0.
///
/// `values(queries, responses)` returns the value of the state before each response token;
/// the first is the state after the whole query. The response is one `filler` token, which a
/// causal model's first value does not read.
pub fn rebootstrap(
    turns: &mut [Transition],
    game_gamma: f64,
    filler: u32,
    values: impl FnOnce(&[Vec<u32>], &[Vec<u32>]) -> Result<Vec<Vec<f32>>>,
) -> Result<()> {
    let open: Vec<usize> = (0..turns.len()).filter(|&i| !turns[i].next_query_ids.is_empty()).collect();
    if open.is_empty() {
        return Ok(());
    }
    let queries: Vec<Vec<u32>> = open.iter().map(|&i| turns[i].next_query_ids.clone()).collect();
    let v = values(&queries, &vec![vec![filler]; open.len()])?;
    if v.len() != open.len() {
        return Err(Error::argument(
            "values",
            format!("rebootstrap: {} values for {} states", v.len(), open.len()),
        ));
    }
    for (&i, row) in open.iter().zip(&v) {
        let first = row
            .first()
            .copied()
            .ok_or_else(|| Error::argument("values", "rebootstrap: an empty value row"))?;
        turns[i].bootstrap = (game_gamma * f64::from(first)) as f32;
    }
    Ok(())
}

/// λ-returns across turns (`[episodes] turn_lambda`): turns `bootstrap` from
/// `game_gamma · V(next state)` (TD(0) between turns, the fork's) into
/// `game_gamma · G^λ(next state)`, where `G^λ(s_{t+1}) = (1 − λ)·V(s_{t+1}) + λ·(r_{t+1} +
/// G^λ(s_{t+2}))` with `G^λ` of a turn's end read from its own bootstrap. With λ = 1 a turn's
/// last token sees the discounted sum of the episode's later shaped rewards (Monte Carlo, no
/// critic bias); within a turn GAE is unchanged. The chain runs backwards over each episode's
/// consecutive turns: turn `i + 1` continues turn `i` when it was played in the same
/// environment from the state turn `i` bootstraps from (`next_query_ids`); an example turn in
/// between, an episode split between batches, or the episode's end cuts it, and that turn keeps
/// its own bootstrap (0 after termination, the value of the final state after truncation).
/// The turns' KL penalties stay in their own turn: the chain adds the shaped rewards only.
///
/// Must run after the bootstraps are final (after [`rebootstrap`] with a separate critic).
pub fn lambda_bootstraps(turns: &mut [Transition], game_gamma: f64, turn_lambda: f64) {
    if turn_lambda == 0.0 {
        return;
    }
    for i in (0..turns.len().saturating_sub(1)).rev() {
        let (head, tail) = turns.split_at_mut(i + 1);
        let (t, next) = (&mut head[i], &tail[0]);
        let continues =
            next.env == t.env && !t.next_query_ids.is_empty() && next.query_ids == t.next_query_ids;
        if continues {
            let ahead = f64::from(next.reward) + f64::from(next.bootstrap);
            let b = (1.0 - turn_lambda) * f64::from(t.bootstrap) + turn_lambda * game_gamma * ahead;
            t.bootstrap = b as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shaping_adds_its_parts() {
        let step = EnvStep { reward: 1.0, won: true, invalid: true, ..EnvStep::default() };
        let s = Shaping {
            win_bonus: 10.0,
            invalid_penalty: 0.5,
            step_cost: 0.1,
            per_letter_e: 0.1,
            ..Shaping::default()
        };
        assert!((s.reward("see", &step) - (1.0 + 10.0 - 0.5 - 0.1 + 0.2)).abs() < 1e-12);
        assert_eq!(Shaping::default().reward("eee", &step), 1.0);
    }

    /// A turn of environment `env` from state `state` to `next` (empty: terminated).
    fn turn(env: usize, state: u32, next: Option<u32>, reward: f32, bootstrap: f32) -> Transition {
        Transition {
            env,
            query_ids: vec![state],
            response_ids: vec![1],
            logprobs: vec![0.0],
            values: vec![0.0],
            action: String::new(),
            reward,
            bootstrap,
            next_query_ids: next.map(|n| vec![n]).unwrap_or_default(),
            allowed: Vec::new(),
            state: u64::from(state),
        }
    }

    #[test]
    fn lambda_bootstraps_chain_consecutive_turns_only() {
        let g: f32 = 0.9;
        let gd = f64::from(g);
        // Environment 0: states 10 → 11 → 12 → terminal; V(11) = 2, V(12) = 4 (bootstraps are
        // γ·V). Environment 1: state 20 → 21, truncated there with V(21) = 5. Environment 2:
        // state 30 → 31, then a turn from 32 (an example turn played 31 → 32 in between).
        let turns = vec![
            turn(0, 10, Some(11), 0.0, g * 2.0),
            turn(0, 11, Some(12), 1.0, g * 4.0),
            turn(0, 12, None, 3.0, 0.0),
            turn(1, 20, Some(21), 0.5, g * 5.0),
            turn(2, 30, Some(31), 0.0, g * 7.0),
            turn(2, 32, None, 1.0, 0.0),
        ];
        let run = |lambda: f64| {
            let mut t = turns.clone();
            lambda_bootstraps(&mut t, gd, lambda);
            t.iter().map(|t| f64::from(t.bootstrap)).collect::<Vec<_>>()
        };
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        // λ = 0: the fork's TD(0), unchanged.
        let td0: Vec<f64> = turns.iter().map(|t| f64::from(t.bootstrap)).collect();
        assert_eq!(run(0.0), td0);
        // λ = 1: the discounted sum of the later rewards; the last turn keeps its own bootstrap,
        // and so does a turn whose successor is not in the list (the example turn's cut).
        let mc = [gd * (1.0 + gd * 3.0), gd * 3.0, 0.0, gd * 5.0, gd * 7.0, 0.0];
        assert!(close(&run(1.0), &mc), "{:?}", run(1.0));
        // λ = ½: each step mixes the value and the return ahead.
        let b1 = 0.5 * gd * 4.0 + 0.5 * gd * 3.0;
        let b0 = 0.5 * gd * 2.0 + 0.5 * gd * (1.0 + b1);
        assert!(close(&run(0.5), &[b0, b1, 0.0, gd * 5.0, gd * 7.0, 0.0]), "{:?}", run(0.5));
    }
}
