//! `[agent] memory = "transcript"` (issue #39): each episode is one growing token sequence, token
//! in, token out, and the sampler carries its KV cache from turn to turn.
//!
//! An episode's sequence is its first prompt ([`PromptTemplate::render`] with no memory), then
//! for every turn the action's tokens exactly as sampled (an admissible command with its end
//! token) and the next state's [`PromptTemplate::render_next`], each tokenized once, when it
//! arrives: nothing is re-tokenized, so the tokens a turn trains on are bitwise the tokens the
//! policy read and wrote. A turn's transition is (query = the whole sequence before the action,
//! response = the action), so the environment's tokens never enter the loss, and the per-turn
//! credit is the window mode's: `game_gamma` across turns, GAE within a turn.
//!
//! The environments of a round share one [`Carried`] batch: each turn prefills only each
//! episode's new state (after its previous action's last token), then samples the commands; a
//! finished episode's row leaves the batch with its cache, and each row keeps its environment's
//! sampling stream (in an evaluation its episode's, [`Streams::Episodes`]).
//!
//! **A full context ends the episode.** When a state's tokens plus its longest command no
//! longer fit the model's positions, the episode stops there, counted as truncated, and its
//! last turn bootstraps from that state's value read from the sequence's last tokens that fit
//! (one uncached forward). Dropping the oldest turns instead would renumber every position
//! and rebuild the cache, and the sequence trained on would no longer be the one sampled.

use std::time::{Duration, Instant};

use candle_core::Device;

use super::turns::{
    anchor_state, command_trie, drop_episode, start_round, Actor, Collected, RolloutConfig, RoundCounts,
    Transition,
};
use crate::envs::play::{episode_stream, Episode, Turn};
use crate::envs::{EnvStep, Reset, TextEnv};
use crate::error::{ConfigError, Error, Result};
use crate::generation::admissible::{generate_admissible_carried, ActionSample, ActionTrie};
use crate::generation::carried::Carried;
use crate::generation::{generate, GenerationConfig};
use crate::tokenizer::Tokenizer;

/// How the rows of a round draw their samples.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Streams<'a> {
    /// Training: turn `t` seeds `generation.seed + seed + t` and row `e` draws from that seed's
    /// stream `e` (its environment).
    Round(u64),
    /// Evaluation: row `e` plays episode `episodes[e]`, and its turn `t` draws from
    /// [`episode_stream`]`(generation.seed, episodes[e], t)`, whatever the number of
    /// environments.
    Episodes(&'a [usize]),
}

/// [`super::rollout::collect_episodes`] with transcript memory (see the module docs).
pub(crate) fn collect_transcripts(
    env: &mut dyn TextEnv,
    policy: Actor,
    tokenizer: &Tokenizer,
    cfg: &RolloutConfig,
    resets: &[Reset],
    streams: Streams,
    device: &Device,
) -> Result<Collected> {
    let b = env.num_envs();
    let context = policy.lm.config().max_positions().unwrap_or(usize::MAX);
    let (firsts, mut episodes, mut time_env) = start_round(env, resets)?;
    let mut time_generation = Duration::ZERO;
    // Per env: the state awaiting an action; a truncated episode's final state awaiting its
    // value; the sequence so far; its transitions; the one whose bootstrap waits.
    let mut live: Vec<Option<EnvStep>> = firsts.into_iter().map(Some).collect();
    let mut finals: Vec<Option<EnvStep>> = vec![None; b];
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); b];
    let mut out: Vec<Vec<Transition>> = vec![Vec::new(); b];
    let mut waiting: Vec<Option<usize>> = vec![None; b];
    let mut carried = Carried::new(policy.lm, b);
    // The environment of each row of the carried batch: finished episodes leave it.
    let mut rows: Vec<usize> = (0..b).collect();
    let mut dropped = 0usize;
    let mut turn = 0u64;
    loop {
        let mut chunks: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut tries: Vec<Option<ActionTrie>> = vec![None; b];
        // Episodes whose sequence is full: the last tokens that fit, for their final value.
        let mut full: Vec<(usize, Vec<u32>)> = Vec::new();
        for e in 0..b {
            let (state, sampling) = match (&live[e], &finals[e]) {
                (Some(s), _) => (s, true),
                (None, Some(s)) => (s, false),
                _ => continue,
            };
            let text = if ids[e].is_empty() {
                cfg.template.render(state, &[], 0)
            } else {
                cfg.template.render_next(state)
            };
            let chunk = tokenizer.encode(&text)?;
            let (trie, longest) = match sampling {
                true => {
                    let (trie, longest) = command_trie(tokenizer, &state.admissible_commands)?;
                    (Some(trie), longest)
                }
                false => (None, 0),
            };
            if ids[e].len() + chunk.len() + longest.max(1) > context {
                if ids[e].is_empty() {
                    return Err(Error::Setting(ConfigError::new(
                        "agent",
                        "memory",
                        format!(
                            "= \"transcript\": the first prompt ({} tokens) and its longest command \
                             ({longest}) do not fit the model's {context} positions; shorten the \
                             instruction, hide the admissible list, or use memory = \"window\"",
                            chunk.len()
                        ),
                    )));
                }
                let mut whole = std::mem::take(&mut ids[e]);
                whole.extend(&chunk);
                let keep = (context - 1).min(whole.len());
                full.push((e, whole[whole.len() - keep..].to_vec()));
                if let (Some(s), Some(ep)) = (live[e].take(), episodes[e].as_mut()) {
                    ep.truncated = true;
                    ep.final_observation = s.observation;
                }
                finals[e] = None;
                continue;
            }
            ids[e].extend(&chunk);
            chunks[e] = chunk;
            tries[e] = trie;
        }
        if full.is_empty() && (0..b).all(|e| live[e].is_none() && finals[e].is_none()) {
            break;
        }
        let gen = match streams {
            Streams::Round(seed) => GenerationConfig {
                seed: cfg.generation.seed.wrapping_add(seed).wrapping_add(turn),
                ..cfg.generation.clone()
            },
            Streams::Episodes(episodes) => GenerationConfig {
                row_seeds: episodes
                    .iter()
                    .map(|&i| episode_stream(cfg.generation.seed, i, turn as usize))
                    .collect(),
                ..cfg.generation.clone()
            },
        };
        turn += 1;
        let t = Instant::now();
        // Shed the rows of finished episodes (their cache too) before this turn's forward.
        let need: Vec<usize> =
            rows.iter().copied().filter(|&e| live[e].is_some() || finals[e].is_some()).collect();
        if need.len() < rows.len() {
            let keep: Vec<usize> = (0..rows.len()).filter(|&k| need.contains(&rows[k])).collect();
            carried.retain(&keep)?;
            rows = need;
        }
        let row_chunks: Vec<Vec<u32>> = rows.iter().map(|&e| std::mem::take(&mut chunks[e])).collect();
        let row_tries: Vec<Option<&ActionTrie>> = rows.iter().map(|&e| tries[e].as_ref()).collect();
        let got = generate_admissible_carried(
            policy.lm,
            policy.v_head,
            &mut carried,
            &row_chunks,
            &row_tries,
            &gen,
            device,
        )?;
        let mut samples: Vec<Option<ActionSample>> = vec![None; b];
        for (&e, s) in rows.iter().zip(got) {
            samples[e] = s;
        }
        let full_values: Vec<f32> = if full.is_empty() || policy.v_head.is_none() {
            vec![0.0; full.len()]
        } else {
            let prompts: Vec<Vec<u32>> = full.iter().map(|(_, p)| p.clone()).collect();
            let one = GenerationConfig {
                max_new_tokens: 1,
                min_new_tokens: 0,
                top_k: 0,
                row_seeds: Vec::new(),
                ..gen.clone()
            };
            generate(policy.lm, policy.v_head, &prompts, &one, device)?
                .iter()
                .map(|s| s.values.as_ref().and_then(|v| v.first().copied()).unwrap_or(0.0))
                .collect()
        };
        time_generation += t.elapsed();
        // The previous turn of each episode bootstraps from this state's value.
        let mut bootstrap = |e: usize, v: f32, next: &[u32]| {
            if let Some(i) = waiting[e].take() {
                out[e][i].bootstrap = (cfg.game_gamma * f64::from(v)) as f32;
                out[e][i].next_query_ids = next.to_vec();
            }
        };
        for ((e, prompt), v) in full.iter().zip(&full_values) {
            bootstrap(*e, *v, prompt);
        }
        let mut sent: Vec<(usize, String)> = Vec::new();
        for e in 0..b {
            let Some(s) = &samples[e] else { continue };
            let v = s.values.first().copied().unwrap_or(0.0);
            bootstrap(e, v, &ids[e]);
            if finals[e].take().is_some() {
                continue; // a final state: only its value was read
            }
            let Some(state) = &live[e] else { continue };
            let command = state.admissible_commands.get(s.action).cloned().ok_or_else(|| {
                Error::Internal(format!(
                    "env {e} sampled command {} of {}",
                    s.action,
                    state.admissible_commands.len()
                ))
            })?;
            sent.push((e, command));
        }
        if sent.is_empty() {
            continue;
        }
        let t = Instant::now();
        let results = env.step(&sent)?;
        time_env += t.elapsed();
        for ((e, action), result) in sent.into_iter().zip(results) {
            let Some(before) = live[e].take() else { continue };
            let s = samples[e].as_ref().ok_or_else(|| Error::Internal(format!("env {e} sampled nothing")))?;
            let after = match result {
                Ok(after) => after,
                Err(err) => {
                    drop_episode(e, &err, &mut out, &mut waiting, &mut episodes);
                    dropped += 1;
                    continue;
                }
            };
            out[e].push(Transition {
                env: e,
                query_ids: ids[e].clone(),
                response_ids: s.response_ids.clone(),
                logprobs: s.logprobs.clone(),
                values: if policy.v_head.is_some() { s.values.clone() } else { Vec::new() },
                action: action.clone(),
                reward: cfg.shaping.reward(&action, &after) as f32,
                bootstrap: 0.0,
                next_query_ids: Vec::new(),
                allowed: s.allowed.clone(),
                state: anchor_state(&before),
            });
            ids[e].extend(&s.response_ids);
            // Terminated: no bootstrap. Going on or truncated: the next state's value.
            if !after.terminated {
                waiting[e] = Some(out[e].len() - 1);
            }
            let logprob = Some(s.logprobs.iter().map(|&l| f64::from(l)).sum());
            if let Some(ep) = episodes[e].as_mut() {
                ep.record(Turn::played(before, action, &after, logprob), &after);
            }
            if !after.done() {
                live[e] = Some(after);
            } else if after.truncated && waiting[e].is_some() {
                finals[e] = Some(after);
            } else {
                waiting[e] = None;
            }
        }
    }
    let counts = RoundCounts { dropped, time_generation, time_env, ..RoundCounts::default() };
    Ok(Collected {
        transitions: out.into_iter().flatten().collect(),
        episodes: episodes.into_iter().flatten().collect(),
        counts,
    })
}

/// Plays `episodes` episodes with `lm` and transcript memory, in rounds of the environments
/// (episode `i` reset with `resets(i)`; a last round's extra environments play and are
/// discarded), sampling with `generation`: each episode's turns from its own streams
/// ([`Streams::Episodes`]), so the episodes do not depend on the number of environments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn play_transcripts(
    env: &mut dyn TextEnv,
    lm: &crate::models::CausalLm,
    tokenizer: &Tokenizer,
    template: &crate::envs::play::PromptTemplate,
    generation: &GenerationConfig,
    episodes: usize,
    resets: crate::envs::play::ResetPlan,
    device: &Device,
) -> Result<(Vec<Episode>, usize)> {
    let b = env.num_envs();
    let cfg = RolloutConfig {
        template: template.clone(),
        generation: generation.clone(),
        game_gamma: 0.0,
        example_turn_prob: 0.0,
        shaping: Default::default(),
    };
    let (mut done, mut dropped) = (Vec::with_capacity(episodes), 0usize);
    for round in 0..episodes.div_ceil(b) {
        let first = round * b;
        let plan: Vec<Reset> = (0..b).map(|e| resets((first + e).min(episodes - 1))).collect();
        let episodes_of: Vec<usize> = (first..first + b).collect();
        let streams = Streams::Episodes(&episodes_of);
        let got = collect_transcripts(env, lm.into(), tokenizer, &cfg, &plan, streams, device)?;
        dropped += got.counts.dropped;
        for mut ep in got.episodes {
            if first + ep.episode < episodes {
                ep.episode += first;
                done.push(ep);
            }
        }
    }
    Ok((done, dropped))
}
