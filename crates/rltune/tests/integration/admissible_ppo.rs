//! PPO on admissible actions (`StepInput::allowed`, issue #39): the policy and the reference
//! are scored under the softmax renormalised over each position's allowed tokens, the
//! distribution [`generate_admissible`] samples from.
//!
//! - With every token allowed, the constrained step is the plain step (the renormalisation is
//!   the identity; the head runs through another code path, so this pins its gradients).
//! - The sampler's cached logprobs and values equal the step's recomputation.
//! - A few steps on a three-command task move the policy to the rewarded command.
//! - A response token outside its set is refused, naming the sample.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use rltune::generation::admissible::{generate_admissible, ActionSample, ActionTrie};
use rltune::generation::GenerationConfig;
use rltune::models::CausalLm;
use rltune::ppo::{PpoConfig, PpoTrainer, RolloutCache, Stat, Stats, StepInput};

use crate::common::{max_diff, tiny_gpt2};

/// A trainer whose policy is `tiny_gpt2(seed)` (V = 50) and whose reference is a frozen copy.
fn trainer(seed: u64, config: PpoConfig) -> PpoTrainer {
    let (store, policy) = tiny_gpt2(seed, true, DType::F32);
    let ref_store = store.frozen_copy().unwrap();
    let reference = CausalLm::load(&ref_store.root(), policy.lm.config()).unwrap();
    PpoTrainer::new(config, store, policy, reference).unwrap()
}

fn weights_diff(a: &PpoTrainer, b: &PpoTrainer) -> f64 {
    let (a, b): (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) =
        (a.store.snapshot().unwrap(), b.store.snapshot().unwrap());
    a.iter().map(|(k, x)| max_diff(x, &b[k])).fold(0.0, f64::max)
}

/// Three commands sharing a first token (so the second position has a real choice) and a
/// one-token command; 49 (the tiny model's EOS) ends each, as `"\n"` ends a game command.
fn commands() -> Vec<Vec<u32>> {
    vec![vec![7, 21, 49], vec![7, 33, 49], vec![12, 49]]
}

fn sample(t: &PpoTrainer, prompts: &[Vec<u32>], seed: u64) -> Vec<ActionSample> {
    let trie = ActionTrie::new(&commands()).unwrap();
    let tries = vec![trie; prompts.len()];
    let cfg = GenerationConfig { seed, ..Default::default() };
    generate_admissible(&t.policy.lm, Some(&t.policy.v_head), prompts, &tries, &cfg, &Device::Cpu).unwrap()
}

/// One PPO step on sampled commands: their tokens and allowed sets, with the sampler's
/// logprobs and values as the rollout cache when `cached` (else the step recomputes them).
fn step_on(
    t: &mut PpoTrainer,
    queries: &[Vec<u32>],
    samples: &[ActionSample],
    scores: &[f32],
    cached: bool,
) -> Stats {
    let responses: Vec<Vec<u32>> = samples.iter().map(|s| s.response_ids.clone()).collect();
    let allowed: Vec<Vec<Vec<u32>>> = samples.iter().map(|s| s.allowed.clone()).collect();
    let cache: Vec<RolloutCache> = samples
        .iter()
        .map(|s| RolloutCache { logprobs: s.logprobs.clone(), values: s.values.clone() })
        .collect();
    t.step_with(StepInput {
        queries,
        responses: &responses,
        scores,
        response_masks: None,
        rollout: cached.then_some(&cache[..]),
        bootstrap: None,
        allowed: Some(&allowed),
    })
    .unwrap()
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..1 + i % 4).map(|j| ((i * 7 + j * 3) % 40) as u32).collect()).collect()
}

#[test]
fn every_token_allowed_is_the_plain_step() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, learning_rate: 1e-3, ..Default::default() };
    let (mut plain, mut constrained) = (trainer(5, cfg.clone()), trainer(5, cfg));
    let queries = prompts(8);
    let responses: Vec<Vec<u32>> =
        (0..8).map(|i| (0..1 + i % 5).map(|j| ((i * 11 + j * 5) % 49) as u32).collect()).collect();
    let scores: Vec<f32> = (0..8).map(|i| i as f32 / 4.0 - 1.0).collect();
    let all: Vec<u32> = (0..50).collect();
    let allowed: Vec<Vec<Vec<u32>>> = responses.iter().map(|r| vec![all.clone(); r.len()]).collect();
    let step = |t: &mut PpoTrainer, allowed: Option<&[Vec<Vec<u32>>]>| {
        t.step_with(StepInput {
            queries: &queries,
            responses: &responses,
            scores: &scores,
            response_masks: None,
            rollout: None,
            bootstrap: None,
            allowed,
        })
        .unwrap()
    };
    let a = step(&mut plain, None);
    let b = step(&mut constrained, Some(&allowed));
    let d = weights_diff(&plain, &constrained);
    let get = |s: &rltune::ppo::Stats, k: &str| s.get(k).and_then(Stat::as_f64).unwrap();
    let d_stats =
        ["objective/kl", "objective/entropy", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl"]
            .iter()
            .map(|k| (get(&a, k) - get(&b, k)).abs())
            .fold(0.0, f64::max);
    println!("every token allowed: weights differ by {d:.2e}, stats by {d_stats:.2e}");
    // f32 sums over 50 logits in another order (the gathered set against the fused head);
    // Adam divides each gradient by its own scale, so 1e-5 is 1% of one step at lr 1e-3 (the
    // tolerance of ppo_behaviour's rollout-cache test).
    assert!(d < 1e-5, "weights differ by {d}");
    assert!(d_stats < 1e-5, "stats differ by {d_stats}");
}

#[test]
fn cached_admissible_logprobs_and_values_equal_the_recomputation() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, learning_rate: 1e-3, ..Default::default() };
    let (mut cached, mut recomputed) = (trainer(3, cfg.clone()), trainer(3, cfg));
    let queries = prompts(8);
    let samples = sample(&cached, &queries, 9);
    assert!(samples.iter().all(|s| s.values.len() == s.response_ids.len()));
    assert!(samples.iter().flat_map(|s| &s.allowed).any(|set| set.len() > 1), "no position had a choice");
    let scores: Vec<f32> = (0..8).map(|i| i as f32 / 4.0 - 1.0).collect();
    let a = step_on(&mut cached, &queries, &samples, &scores, true);
    step_on(&mut recomputed, &queries, &samples, &scores, false);
    // The recomputed constrained logprobs, at the response columns, against the sampler's.
    let Some(Stat::Matrix(lp)) = a.get("objective/logprobs") else { panic!("no objective/logprobs") };
    let mut worst = 0f64;
    for (i, s) in samples.iter().enumerate() {
        let start = queries[i].len() - 1;
        for (j, &want) in s.logprobs.iter().enumerate() {
            worst = worst.max((lp[i][start + j] - want as f64).abs());
        }
    }
    let d = weights_diff(&cached, &recomputed);
    println!("admissible rollout cache: logprobs differ by {worst:.2e}, weights by {d:.2e}");
    assert!(worst < 1e-5, "cached and recomputed logprobs differ by {worst}");
    assert!(d < 1e-5, "weights differ by {d}");
}

#[test]
fn ppo_moves_the_constrained_policy_to_the_rewarded_command() {
    crate::common::install();
    let cfg = PpoConfig {
        batch_size: 16,
        mini_batch_size: 8,
        learning_rate: 3e-3,
        init_kl_coef: 0.0,
        adap_kl_ctrl: false,
        ..Default::default()
    };
    let mut t = trainer(11, cfg);
    let queries = prompts(16);
    let rewarded = vec![7u32, 33, 49];
    let share = |samples: &[ActionSample]| {
        samples.iter().filter(|s| s.response_ids == rewarded).count() as f64 / samples.len() as f64
    };
    let before = share(&sample(&t, &queries, 100));
    for step in 0..12u64 {
        let samples = sample(&t, &queries, step);
        let scores: Vec<f32> =
            samples.iter().map(|s| if s.response_ids == rewarded { 1.0 } else { -1.0 }).collect();
        step_on(&mut t, &queries, &samples, &scores, true);
    }
    let after = share(&sample(&t, &queries, 100));
    println!("rewarded command: {:.0}% of samples before, {:.0}% after", before * 100.0, after * 100.0);
    assert!(before < 0.6, "the task is too easy to show learning: {before}");
    assert!(after > 0.9 && after > before + 0.3, "no learning: {before} -> {after}");
}

#[test]
fn a_token_outside_its_allowed_set_is_refused() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 2, mini_batch_size: 2, ..Default::default() };
    let mut t = trainer(1, cfg);
    let queries = vec![vec![1u32, 2], vec![3]];
    let responses = vec![vec![7u32, 21], vec![12, 49]];
    let allowed = vec![vec![vec![7u32, 12], vec![21, 33]], vec![vec![7, 12], vec![33]]];
    let e = t
        .step_with(StepInput {
            queries: &queries,
            responses: &responses,
            scores: &[1.0, 0.0],
            response_masks: None,
            rollout: None,
            bootstrap: None,
            allowed: Some(&allowed),
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("sample 1") && e.contains("response token 1") && e.contains("49"), "{e}");
}
