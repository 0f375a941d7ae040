//! `PpoTrainer` behaviour on a tiny random GPT-2 (V = 50, EOS = 49): it learns a toy task,
//! rollout caching and temperature agree with generation, the KL estimators keep their sign,
//! the options rltune adds work, and each deliberate deviation from TRL 0.11.4 is pinned
//! (see `docs/trl-deviations.md`; the test names below are the ones that document cites).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rltune::generation::{generate, GenerationConfig, Sample};
use rltune::models::CausalLm;
use rltune::ppo::{KlPenalty, PpoConfig, PpoTrainer, RolloutCache, Stat, Stats, StepInput};

use crate::common::{fixture, max_diff, tiny_gpt2};

/// The tiny model's EOS id (`Gpt2Config::tiny` sets it to V − 1).
const EOS: u32 = 49;

/// A trainer whose policy is `tiny_gpt2(seed)` and whose reference is a frozen copy of it.
fn trainer(seed: u64, config: PpoConfig) -> PpoTrainer {
    let (store, policy) = tiny_gpt2(seed, true, DType::F32);
    let ref_store = store.frozen_copy().unwrap();
    let reference = CausalLm::load(&ref_store.root(), policy.lm.config()).unwrap();
    PpoTrainer::new(config, store, policy, reference).unwrap()
}

fn scalar(stats: &Stats, key: &str) -> f64 {
    stats.get(key).and_then(Stat::as_f64).unwrap_or_else(|| panic!("no scalar stat {key}"))
}

fn array<'a>(stats: &'a Stats, key: &str) -> &'a [f64] {
    match stats.get(key) {
        Some(Stat::Array(a)) => a,
        other => panic!("{key}: not an array: {other:?}"),
    }
}

fn matrix<'a>(stats: &'a Stats, key: &str) -> &'a [Vec<f64>] {
    match stats.get(key) {
        Some(Stat::Matrix(m)) => m,
        other => panic!("{key}: not a matrix: {other:?}"),
    }
}

/// Columns of the `(B, L−1)` per-token arrays that hold row i's response: `[q−1, q−1+r)`.
fn response_cols(q: &[u32], r: &[u32]) -> std::ops::Range<usize> {
    q.len() - 1..q.len() - 1 + r.len()
}

/// `batch` prompts of 1 to 5 tokens, ids in [0, EOS).
fn prompts(batch: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..batch).map(|_| (0..rng.gen_range(1..=5)).map(|_| rng.gen_range(0..EOS)).collect()).collect()
}

/// A fixed synthetic batch: queries of 1–5 tokens, responses of 1–6 tokens, scores in [−1, 1).
fn synthetic(batch: usize, seed: u64) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let responses =
        (0..batch).map(|_| (0..rng.gen_range(1..=6)).map(|_| rng.gen_range(0..EOS)).collect()).collect();
    let scores = (0..batch).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    (prompts(batch, seed), responses, scores)
}

/// Samples one response per prompt from the trainer's current policy, with values.
fn rollout(t: &PpoTrainer, prompts: &[Vec<u32>], cfg: &GenerationConfig) -> Vec<Sample> {
    generate(&t.policy.lm, Some(&t.policy.v_head), prompts, cfg, &Device::Cpu).unwrap()
}

fn caches(samples: &[Sample]) -> Vec<RolloutCache> {
    samples
        .iter()
        .map(|s| RolloutCache { logprobs: s.logprobs.clone(), values: s.values.clone().unwrap() })
        .collect()
}

fn responses(samples: &[Sample]) -> Vec<Vec<u32>> {
    samples.iter().map(|s| s.response_ids.clone()).collect()
}

/// The toy task: emit tokens from `TARGETS` (5 of the 50, so 10% under the random policy).
const TARGETS: [u32; 5] = [10, 11, 12, 13, 14];

/// The number of response tokens in `TARGETS`.
fn target_count(r: &[u32]) -> f32 {
    r.iter().filter(|t| TARGETS.contains(t)).count() as f32
}

fn weights(t: &PpoTrainer) -> BTreeMap<String, Tensor> {
    t.store.snapshot().unwrap()
}

/// Largest |a − b| over every tensor of two snapshots with the same names.
fn weights_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().map(|(k, x)| max_diff(x, &b[k])).fold(0.0, f64::max)
}

/// Largest difference at response columns between `objective/logprobs` and per-sample logprobs.
fn logprob_diff(stats: &Stats, queries: &[Vec<u32>], samples: &[Sample]) -> f64 {
    let lp = matrix(stats, "objective/logprobs");
    let mut worst = 0f64;
    for (i, s) in samples.iter().enumerate() {
        let cols = response_cols(&queries[i], &s.response_ids);
        for (c, &want) in cols.zip(&s.logprobs) {
            worst = worst.max((lp[i][c] - want as f64).abs());
        }
    }
    worst
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

#[test]
fn ppo_learns_to_emit_target_tokens() {
    crate::common::install();
    let cfg =
        PpoConfig { batch_size: 16, mini_batch_size: 8, learning_rate: 1e-3, seed: 1, ..Default::default() };
    let mut t = trainer(11, cfg);
    let queries = prompts(16, 21);
    let (mut rewards, mut kls) = (Vec::new(), Vec::new());
    for step in 0..30u64 {
        let gen =
            GenerationConfig { max_new_tokens: 6, seed: step, stop_at_eos: false, ..Default::default() };
        let samples = rollout(&t, &queries, &gen);
        let resp = responses(&samples);
        let scores: Vec<f32> = resp.iter().map(|r| target_count(r)).collect();
        let stats = t.step(&queries, &resp, &scores).unwrap();
        rewards.push(mean(&scores.iter().map(|&s| s as f64).collect::<Vec<_>>()));
        let kl = scalar(&stats, "objective/kl");
        kls.push(kl);
        // Rollouts come from the current policy, so E[k1] = KL ≥ 0; the batch mean of 16 sequences
        // is noisy, so the lower bound is three standard errors (at least 0.05).
        let dist = array(&stats, "objective/kl_dist");
        let var = dist.iter().map(|x| (x - kl).powi(2)).sum::<f64>() / (dist.len() - 1) as f64;
        let floor = -(3.0 * (var / dist.len() as f64).sqrt()).max(0.05);
        assert!(kl > floor && kl < 10.0, "step {step}: objective/kl {kl} outside ({floor:.3}, 10)");
        // The guard ignores sampling noise: it fires below −max(1e-3, 3 standard errors).
        let guard = -(3.0 * (var / dist.len() as f64).sqrt()).max(1e-3);
        assert_eq!(stats.contains_key("warnings/negative_kl"), kl < guard, "step {step}: kl {kl}");
    }
    let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" ");
    println!("reward curve: {}", fmt(&rewards));
    println!("kl curve:     {}", fmt(&kls));
    let (first, last) = (mean(&rewards[..5]), mean(&rewards[rewards.len() - 5..]));
    println!("mean reward: first 5 steps {first:.3}, last 5 steps {last:.3}");
    assert!(mean(&kls) > 0.0, "mean kl over the run {}", mean(&kls));
    assert!(last >= first + 2.0, "no learning: first 5 steps {first:.3}, last 5 steps {last:.3}");

    // Responses the trained policy now avoids (no target token) have a negative k1 estimate:
    // the guard says so in the stats.
    let off: Vec<Vec<u32>> = (0..16).map(|i| vec![20 + (i % 10) as u32; 6]).collect();
    let stats = t.step(&queries, &off, &[0.0; 16]).unwrap();
    let kl = scalar(&stats, "objective/kl");
    println!("kl on off-policy responses: {kl:.4}");
    assert!(kl < 0.0, "expected a negative k1 estimate on avoided tokens, got {kl}");
    match stats.get("warnings/negative_kl") {
        Some(Stat::Text(msg)) => assert!(msg.contains("negative"), "{msg}"),
        other => panic!("no warnings/negative_kl for kl {kl}: {other:?}"),
    }
}

#[test]
fn rollout_cache_equals_recomputation() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, learning_rate: 1e-3, ..Default::default() };
    let (mut cached, mut recomputed) = (trainer(3, cfg.clone()), trainer(3, cfg));
    assert_eq!(weights_diff(&weights(&cached), &weights(&recomputed)), 0.0);
    let queries = prompts(8, 4);
    let gen = GenerationConfig { max_new_tokens: 8, seed: 5, ..Default::default() };
    let samples = rollout(&cached, &queries, &gen);
    let resp = responses(&samples);
    let scores: Vec<f32> = (0..8).map(|i| i as f32 / 4.0 - 1.0).collect();
    let cache = caches(&samples);
    let a = cached
        .step_with(StepInput {
            queries: &queries,
            responses: &resp,
            scores: &scores,
            response_masks: None,
            rollout: Some(&cache),
            bootstrap: None,
            allowed: None,
        })
        .unwrap();
    let b = recomputed.step(&queries, &resp, &scores).unwrap();

    // The cached logprobs are generate()'s; the recomputed ones come from a right-padded batch
    // with positions from the mask. Prompts of 1–5 tokens make the left padding of generate()
    // and the right padding of step() differ on every short row.
    let d_lp = logprob_diff(&b, &queries, &samples);
    let mut d_stats = 0f64;
    for key in [
        "objective/kl",
        "objective/entropy",
        "ppo/mean_non_score_reward",
        "ppo/loss/policy",
        "ppo/loss/value",
        "ppo/loss/total",
        "ppo/policy/approxkl",
        "ppo/policy/policykl",
        "ppo/returns/mean",
        "ppo/val/mean",
        "ppo/val/vpred",
        "ppo/val/error",
    ] {
        d_stats = d_stats.max((scalar(&a, key) - scalar(&b, key)).abs());
    }
    // With the cache, the reference runs on the response columns only and reads 0 elsewhere.
    let (ref_a, ref_b) = (matrix(&a, "objective/ref_logprobs"), matrix(&b, "objective/ref_logprobs"));
    let mut d_ref = 0f64;
    for (i, s) in samples.iter().enumerate() {
        let cols: Vec<usize> = response_cols(&queries[i], &s.response_ids).collect();
        for (c, (&x, &y)) in ref_a[i].iter().zip(&ref_b[i]).enumerate() {
            if cols.contains(&c) {
                d_ref = d_ref.max((x - y).abs());
            } else {
                assert_eq!(x, 0.0, "cached step: ref logprob of row {i}, column {c} outside the response");
            }
        }
    }
    let d_w = weights_diff(&weights(&cached), &weights(&recomputed));
    println!(
        "rollout cache vs recomputed: logprobs max diff {d_lp:.2e}, ref logprobs {d_ref:.2e}, stats max \
         diff {d_stats:.2e}, weights after the step max diff {d_w:.2e}"
    );
    assert!(d_lp < 1e-5, "logprobs differ by {d_lp}");
    assert!(d_ref < 1e-5, "reference logprobs differ by {d_ref}");
    assert!(d_stats < 1e-5, "stats differ by {d_stats}");
    assert!(d_w < 1e-5, "weights differ by {d_w}");
}

/// Queries, responses and the stats of one step.
type StepRecord = (Vec<Vec<u32>>, Vec<Vec<u32>>, Stats);

/// A few steps on rollouts from the policy with `kind`; returns each step's record.
fn train_with_estimator(kind: KlPenalty, steps: u64) -> Vec<StepRecord> {
    let cfg = PpoConfig {
        batch_size: 8,
        mini_batch_size: 4,
        learning_rate: 1e-2,
        kl_penalty: kind,
        ..Default::default()
    };
    let mut t = trainer(7, cfg);
    let queries = prompts(8, 8);
    let mut out = Vec::new();
    for step in 0..steps {
        let gen = GenerationConfig { max_new_tokens: 5, seed: 100 + step, ..Default::default() };
        let resp = responses(&rollout(&t, &queries, &gen));
        let scores: Vec<f32> = resp.iter().map(|r| target_count(r)).collect();
        let stats = t.step(&queries, &resp, &scores).unwrap();
        out.push((queries.clone(), resp, stats));
    }
    out
}

#[test]
fn k3_and_full_kl_are_never_negative() {
    crate::common::install();
    for kind in [KlPenalty::K3, KlPenalty::Full] {
        for (step, (queries, resp, stats)) in train_with_estimator(kind, 4).iter().enumerate() {
            let kl = scalar(stats, "objective/kl");
            let dist = array(stats, "objective/kl_dist");
            let (lp, rlp) = (matrix(stats, "objective/logprobs"), matrix(stats, "objective/ref_logprobs"));
            // k1 on the same tokens, for comparison: it can have either sign per sequence.
            let k1: Vec<f64> = (0..queries.len())
                .map(|i| response_cols(&queries[i], &resp[i]).map(|c| lp[i][c] - rlp[i][c]).sum())
                .collect();
            println!(
                "{kind:?} step {step}: kl {kl:.5}, min per sequence {:.2e}; k1 on the same tokens: min {:.2e}",
                dist.iter().copied().fold(f64::INFINITY, f64::min),
                k1.iter().copied().fold(f64::INFINITY, f64::min)
            );
            assert!(dist.iter().all(|&d| d >= -1e-6), "{kind:?} step {step}: negative kl_dist {dist:?}");
            if step == 0 {
                // The policy still equals the reference.
                assert!(kl.abs() < 1e-6, "{kind:?}: step 0 kl {kl}");
            } else {
                assert!(kl > 1e-6, "{kind:?} step {step}: the policy moved but kl is {kl}");
            }
            if kind == KlPenalty::K3 {
                // kl_dist is Σ_t (r − 1) − log r with r = exp(ref_logp − logp) over the response.
                for i in 0..queries.len() {
                    let want: f64 = response_cols(&queries[i], &resp[i])
                        .map(|c| {
                            let log_r = rlp[i][c] - lp[i][c];
                            log_r.exp() - 1.0 - log_r
                        })
                        .sum();
                    assert!((dist[i] - want).abs() < 1e-5, "row {i}: kl_dist {} vs k3 {want}", dist[i]);
                }
            }
        }
    }
}

#[test]
fn training_temperature_matches_sampling_temperature() {
    crate::common::install();
    let queries = prompts(8, 12);
    let base = PpoConfig { batch_size: 8, mini_batch_size: 4, ..Default::default() };
    let mut hot = trainer(13, PpoConfig { temperature: 0.7, ..base.clone() });
    let mut plain = trainer(13, base);
    let gen = GenerationConfig { max_new_tokens: 6, temperature: 0.7, seed: 14, ..Default::default() };
    let samples = rollout(&hot, &queries, &gen);
    let resp = responses(&samples);
    let scores = vec![0.5f32; 8];
    let d_hot = logprob_diff(&hot.step(&queries, &resp, &scores).unwrap(), &queries, &samples);
    let d_plain = logprob_diff(&plain.step(&queries, &resp, &scores).unwrap(), &queries, &samples);
    println!("logprobs vs generate(T = 0.7): trainer T = 0.7 max diff {d_hot:.2e}; T = 1 {d_plain:.2e}");
    assert!(d_hot < 1e-5, "temperature 0.7 logprobs differ from generation by {d_hot}");
    assert!(d_plain > 1e-2, "temperature 1 should not match T = 0.7 sampling ({d_plain})");
}

#[test]
fn missing_eos_penalty_lowers_scores_of_unfinished_responses() {
    crate::common::install();
    let cfg =
        PpoConfig { batch_size: 8, mini_batch_size: 4, missing_eos_penalty: Some(2.0), ..Default::default() };
    let mut t = trainer(15, cfg);
    let queries = prompts(8, 16);
    // Rows 0, 3 and 5 end with EOS; EOS elsewhere in a response does not count.
    let resp: Vec<Vec<u32>> = (0..8)
        .map(|i| match i {
            0 | 3 | 5 => vec![4, 5, EOS],
            6 => vec![EOS, 7],
            _ => vec![8, 9],
        })
        .collect();
    let scores = vec![1.0f32; 8];
    let stats = t.step(&queries, &resp, &scores).unwrap();
    let want: Vec<f64> = resp.iter().map(|r| if r.last() == Some(&EOS) { 1.0 } else { -1.0 }).collect();
    let m = mean(&want);
    let sd = (want.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 7.0).sqrt();
    assert!((scalar(&stats, "ppo/mean_scores") - m).abs() < 1e-6, "{}", scalar(&stats, "ppo/mean_scores"));
    assert!((scalar(&stats, "ppo/std_scores") - sd).abs() < 1e-6);
}

#[test]
fn max_grad_norm_clips_every_update() {
    crate::common::install();
    // 2 epochs × 2 minibatches = 4 Adam updates per step, 8 over two steps.
    let base = PpoConfig {
        batch_size: 8,
        mini_batch_size: 4,
        ppo_epochs: 2,
        learning_rate: 1e-3,
        ..Default::default()
    };
    let (queries, resp, scores) = synthetic(8, 17);
    let run = |max_grad_norm: Option<f64>| {
        let mut t = trainer(18, PpoConfig { max_grad_norm, ..base.clone() });
        let w0 = weights(&t);
        for _ in 0..2 {
            t.step(&queries, &resp, &scores).unwrap();
        }
        assert_eq!(t.optimizer().steps(), 8);
        let w = weights(&t);
        (weights_diff(&w0, &w), w)
    };
    let (moved_free, w_free) = run(None);
    let (_, w_huge) = run(Some(1e9));
    let (moved_tiny, _) = run(Some(1e-12));
    println!("max |Δw| over 8 updates: unclipped {moved_free:.2e}, max_grad_norm 1e-12 {moved_tiny:.2e}");
    // A norm that is never reached changes nothing.
    assert_eq!(weights_diff(&w_free, &w_huge), 0.0);
    assert!(moved_free > 5e-4, "unclipped run barely moved: {moved_free}");
    // Each clipped gradient entry is ≤ 1e-12, so each Adam update is ≤ lr·1e-12/ε = lr·1e-4 (plus
    // f32 rounding). Clipping only the first update (TRL 0.11.4) moves the 2nd–8th by ~lr.
    let bound = 8.0 * (base.learning_rate * 1e-4 + 6e-8);
    assert!(moved_tiny <= bound, "max |Δw| {moved_tiny} > {bound}: some update was not clipped");
}

#[test]
fn ratio_threshold_skips_the_update_entirely() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, learning_rate: 1e-3, ..Default::default() };
    let mut t = trainer(19, cfg);
    let (queries, resp, scores) = synthetic(8, 20);
    // A normal step first, so Adam has momentum that TRL's zeroed-loss step would still apply.
    t.step(&queries, &resp, &scores).unwrap();
    let (w1, steps1) = (weights(&t), t.optimizer().steps());
    assert_eq!(steps1, 8);
    // Every minibatch's mean ratio (≈ 1) exceeds the threshold.
    t.config.ratio_threshold = 1e-3;
    let stats = t.step(&queries, &resp, &scores).unwrap();
    let d = weights_diff(&w1, &weights(&t));
    println!("weights moved by {d:.2e} over a step whose minibatches were all skipped");
    assert_eq!(d, 0.0, "skipped minibatches moved the weights");
    assert_eq!(t.optimizer().steps(), steps1, "skipped minibatches stepped Adam");
    for key in ["ppo/loss/policy", "ppo/loss/value", "ppo/loss/total"] {
        assert_eq!(scalar(&stats, key), 0.0, "{key}");
    }
}

/// Issue #28: a loss that overflows to infinity (a value head scaled to 1e20, so the squared
/// value error exceeds f32) never reaches the weights, on the fused update path (the default)
/// and on the clipped one: every update is skipped, counted and the weights stay.
#[test]
fn a_non_finite_loss_skips_the_update_and_is_counted() {
    crate::common::install();
    for max_grad_norm in [None, Some(1.0)] {
        let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, max_grad_norm, ..Default::default() };
        let mut t = trainer(31, cfg);
        let (queries, resp, scores) = synthetic(8, 32);
        t.step(&queries, &resp, &scores).unwrap();
        let (name, v_head) =
            t.store.vars().into_iter().find(|(n, _)| n == "v_head.summary.weight").expect("a value head");
        v_head.set(&(v_head.as_tensor() * 1e20).unwrap()).unwrap();
        let (before, steps) = (weights(&t), t.optimizer().steps());
        let stats = t.step(&queries, &resp, &scores).unwrap();
        assert!(!scalar(&stats, "ppo/loss/value").is_finite(), "{name}: the loss did not overflow");
        assert_eq!(weights_diff(&before, &weights(&t)), 0.0, "clip {max_grad_norm:?}: weights moved");
        assert_eq!(t.optimizer().steps(), steps, "clip {max_grad_norm:?}: Adam stepped");
        // 2 minibatches × 4 epochs, none applied.
        assert_eq!(scalar(&stats, "rltune/skipped_updates"), 8.0, "clip {max_grad_norm:?}");
        assert_eq!(t.skipped_updates(), 8);
    }
}

#[test]
fn score_scaling_and_norm_use_running_moments() {
    crate::common::install();
    let (queries, resp, s1) = synthetic(8, 22);
    let s2: Vec<f32> = s1.iter().enumerate().map(|(i, s)| 3.0 * s + i as f32).collect();
    let all: Vec<f64> = s1.iter().chain(&s2).map(|&s| s as f64).collect();
    let std_unbiased = |xs: &[f64]| {
        let m = mean(xs);
        (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
    };
    for norm in [false, true] {
        let cfg = PpoConfig {
            batch_size: 8,
            mini_batch_size: 4,
            use_score_scaling: true,
            use_score_norm: norm,
            ..Default::default()
        };
        let mut t = trainer(23, cfg);
        for (k, scores) in [&s1, &s2].into_iter().enumerate() {
            let stats = t.step(&queries, &resp, scores).unwrap();
            // After k+1 batches the running moments are those of all scores so far.
            let seen = &all[..8 * (k + 1)];
            let (m, sd) = (mean(seen), std_unbiased(seen));
            let shift = if norm { m } else { 0.0 };
            let want: Vec<f64> =
                scores.iter().map(|&s| (s as f64 - shift) / (sd + f32::EPSILON as f64)).collect();
            let (got_m, got_sd) = (scalar(&stats, "ppo/mean_scores"), scalar(&stats, "ppo/std_scores"));
            println!(
                "norm {norm} step {k}: mean_scores {got_m:.5} (want {:.5}), std {got_sd:.5}",
                mean(&want)
            );
            assert!((got_m - mean(&want)).abs() < 1e-5, "norm {norm} step {k}: {got_m} vs {}", mean(&want));
            assert!((got_sd - std_unbiased(&want)).abs() < 1e-5, "norm {norm} step {k}: std {got_sd}");
            assert!(stats.values().filter_map(Stat::as_f64).all(f64::is_finite));
        }
    }
}

#[test]
fn whiten_rewards_ignores_padding_after_the_response() {
    crate::common::install();
    // Batch `a` has no padding: every query has 3 tokens and every response 4. Batch `b` appends
    // 5 tokens to each response but masks them out with `response_masks`: the model is causal, so
    // everything at the real tokens is unchanged, and the extra columns act as padding. TRL's
    // `masked_whiten(rewards, mask, shift_mean=False)` gives those columns a non-zero reward that
    // GAE carries into the real tokens' advantages; rltune keeps them at zero.
    let cfg = PpoConfig {
        batch_size: 8,
        mini_batch_size: 4,
        learning_rate: 1e-3,
        whiten_rewards: true,
        ..Default::default()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(24);
    let mut ids = |n: usize| (0..n).map(|_| rng.gen_range(0..EOS)).collect::<Vec<u32>>();
    let queries: Vec<Vec<u32>> = (0..8).map(|_| ids(3)).collect();
    let short: Vec<Vec<u32>> = (0..8).map(|_| ids(4)).collect();
    let long: Vec<Vec<u32>> = short.iter().map(|r| r.iter().copied().chain(ids(5)).collect()).collect();
    let masks: Vec<Vec<u8>> = (0..8).map(|_| [1, 1, 1, 1, 0, 0, 0, 0, 0].to_vec()).collect();
    // A non-zero mean reward: TRL's padding value is μ·(1 − 1/σ).
    let scores: Vec<f32> = (0..8).map(|i| i as f32 / 2.0).collect();

    let (mut ta, mut tb) = (trainer(25, cfg.clone()), trainer(25, cfg));
    let a = ta.step(&queries, &short, &scores).unwrap();
    let b = tb
        .step_with(StepInput {
            queries: &queries,
            responses: &long,
            scores: &scores,
            response_masks: Some(&masks),
            rollout: None,
            bootstrap: None,
            allowed: None,
        })
        .unwrap();
    let mut d_stats = 0f64;
    for key in ["ppo/returns/mean", "ppo/returns/var", "ppo/loss/policy", "ppo/loss/value", "ppo/val/error"] {
        let (x, y) = (scalar(&a, key), scalar(&b, key));
        assert!(x.is_finite() && y.is_finite(), "{key}: {x} {y}");
        d_stats = d_stats.max((x - y).abs());
    }
    let d_w = weights_diff(&weights(&ta), &weights(&tb));
    println!("whiten_rewards, masked tail vs none: stats max diff {d_stats:.2e}, weights max diff {d_w:.2e}");
    assert!(d_stats < 1e-5, "padding changed the stats by {d_stats}");
    assert!(d_w < 1e-5, "padding changed the weights by {d_w}");
    assert!(a.values().filter_map(Stat::as_f64).all(f64::is_finite));
}

#[test]
fn minibatch_order_follows_the_seed() {
    crate::common::install();
    // TRL draws minibatch orders from numpy's global RNG; rltune from a StdRng seeded by
    // `ppo.seed`, so a run is reproducible and another seed gives another order.
    let base = PpoConfig { batch_size: 8, mini_batch_size: 2, learning_rate: 1e-3, ..Default::default() };
    let (queries, resp, scores) = synthetic(8, 30);
    let run = |seed: u64| {
        let mut t = trainer(31, PpoConfig { seed, ..base.clone() });
        t.step(&queries, &resp, &scores).unwrap();
        weights(&t)
    };
    let (a, b, c) = (run(0), run(0), run(1));
    assert_eq!(weights_diff(&a, &b), 0.0, "same seed, different weights");
    let d = weights_diff(&a, &c);
    println!("weights after one step, seed 0 vs seed 1: max diff {d:.2e}");
    assert!(d > 1e-6, "another seed gave the same minibatch order");
}

/// `step_sized` (a game step on every turn of a round) is `step_with` with `batch_size` set to
/// the input's size: 12 samples through a trainer configured for 8 give bitwise the weights and
/// the KL coefficient of a trainer configured for 12, the configured size comes back after the
/// step, and a size that is not a multiple of the minibatch is refused.
#[test]
fn step_sized_is_a_step_of_the_inputs_size() {
    crate::common::install();
    let base = PpoConfig { batch_size: 8, mini_batch_size: 2, learning_rate: 1e-3, ..Default::default() };
    let (queries, resp, scores) = synthetic(12, 40);
    let input = || StepInput {
        queries: &queries,
        responses: &resp,
        scores: &scores,
        response_masks: None,
        rollout: None,
        bootstrap: None,
        allowed: None,
    };
    let mut sized = trainer(41, base.clone());
    let a = sized.step_sized(input()).unwrap();
    assert_eq!(sized.config.batch_size, 8, "the configured batch size must come back");
    let mut fixed = trainer(41, PpoConfig { batch_size: 12, ..base.clone() });
    let b = fixed.step_with(input()).unwrap();
    assert_eq!(weights_diff(&weights(&sized), &weights(&fixed)), 0.0);
    assert_eq!(scalar(&a, "objective/kl_coef"), scalar(&b, "objective/kl_coef"));
    assert_eq!(sized.kl_controller().value(), fixed.kl_controller().value());
    assert_eq!(scalar(&a, "ppo/loss/total"), scalar(&b, "ppo/loss/total"));

    let seven = StepInput { queries: &queries[..7], responses: &resp[..7], scores: &scores[..7], ..input() };
    let err = sized.step_sized(seven).unwrap_err().to_string();
    assert!(err.contains("7 samples") && err.contains("multiple") && err.contains("(2)"), "{err}");
}

#[test]
fn bad_input_is_rejected_naming_the_sample() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 4, mini_batch_size: 2, ..Default::default() };
    let mut t = trainer(26, cfg);
    let (q, r, s) = synthetic(4, 27);
    let w0 = weights(&t);
    let err = |t: &mut PpoTrainer, q: &[Vec<u32>], r: &[Vec<u32>], s: &[f32]| {
        t.step(q, r, s).unwrap_err().to_string()
    };

    let e = err(&mut t, &q[..3], &r[..3], &s[..3]);
    assert!(e.contains("batch_size is 4") && e.contains("got 3"), "{e}");
    // The batch as a whole is at fault: no row.
    let typed = t.step(&q[..3], &r[..3], &s[..3]).unwrap_err();
    assert!(matches!(typed, rltune::Error::Batch { sample: None, .. }), "{typed:?}");
    let e = err(&mut t, &q, &r, &s[..3]);
    assert!(e.contains("3 scores"), "{e}");

    let mut empty = r.clone();
    empty[2].clear();
    let e = err(&mut t, &q, &empty, &s);
    assert!(e.contains("sample 2") && e.contains("empty response"), "{e}");
    // A program finds the row without parsing the message.
    let typed = t.step(&q, &empty, &s).unwrap_err();
    assert!(matches!(typed, rltune::Error::Batch { sample: Some(2), .. }), "{typed:?}");
    assert!(typed.to_string().starts_with("sample 2: empty response; "), "{typed}");

    let mut empty_q = q.clone();
    empty_q[1].clear();
    let e = err(&mut t, &empty_q, &r, &s);
    assert!(e.contains("sample 1") && e.contains("empty query"), "{e}");

    let mut nan = s.clone();
    nan[3] = f32::NAN;
    let e = err(&mut t, &q, &r, &nan);
    assert!(e.contains("sample 3") && e.contains("NaN"), "{e}");

    let mut oov = r.clone();
    oov[1].push(50);
    let e = err(&mut t, &q, &oov, &s);
    assert!(e.contains("sample 1") && e.contains("50") && e.contains("vocab_size 50"), "{e}");

    let short_cache = vec![RolloutCache { logprobs: vec![0.0], values: vec![0.0] }; 4];
    let e = t
        .step_with(StepInput {
            queries: &q,
            responses: &r,
            scores: &s,
            response_masks: None,
            rollout: Some(&short_cache),
            bootstrap: None,
            allowed: None,
        })
        .unwrap_err()
        .to_string();
    let first_long = r.iter().position(|x| x.len() != 1).unwrap();
    assert!(e.contains(&format!("sample {first_long}")) && e.contains("rollout cache"), "{e}");

    // Nothing moved, and the trainer still works.
    assert_eq!(weights_diff(&w0, &weights(&t)), 0.0);
    assert_eq!(t.optimizer().steps(), 0);
    t.step(&q, &r, &s).unwrap();
}

/// A minibatch with a single response token (`mini_batch_size = 1` and a one-token response,
/// e.g. an immediate EOS) has no unbiased `ppo/returns/var`. TRL reports NaN for it and trains on.
/// A step must either succeed or fail before it changes anything. A one-token minibatch has no
/// unbiased variance (TRL reports NaN; rltune used to fail here after three Adam steps): the step
/// succeeds, and that minibatch's variances are left out of the step's averages.
#[test]
fn one_token_minibatch_does_not_abort_the_step_half_done() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 4, mini_batch_size: 1, ..Default::default() };
    let mut t = trainer(32, cfg);
    let queries = prompts(4, 33);
    let resp = vec![vec![EOS], vec![3, 4], vec![5, 6, 7], vec![8, 9]];
    let w0 = weights(&t);
    // The one-token sample comes last in the first epoch, after three updates.
    t.force_permutations([vec![1, 2, 3, 0]]);
    let stats = match t.step(&queries, &resp, &[1.0, 0.0, 0.5, -0.5]) {
        Ok(stats) => stats,
        Err(e) => {
            let (moved, steps) = (weights_diff(&w0, &weights(&t)), t.optimizer().steps());
            panic!("step failed ({e}) after {steps} Adam steps moved the weights by {moved}")
        }
    };
    assert_eq!(t.optimizer().steps(), 16, "every minibatch of the 4 epochs stepped");
    for key in ["ppo/returns/var", "ppo/val/var", "ppo/val/var_explained", "ppo/loss/total"] {
        assert!(scalar(&stats, key).is_finite(), "{key} = {}", scalar(&stats, key));
    }
}

#[test]
fn stats_have_every_trl_key() {
    crate::common::install();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("ppo/expected.json")).unwrap()).unwrap();
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, ..Default::default() };
    let mut t = trainer(28, cfg);
    let (queries, resp, scores) = synthetic(8, 29);
    let stats = t.step(&queries, &resp, &scores).unwrap();
    let mut n = 0;
    for step in expected["steps"].as_array().unwrap() {
        for key in step["stat_keys"].as_array().unwrap() {
            let key = key.as_str().unwrap();
            assert!(stats.contains_key(key), "missing TRL stat {key}");
            n += 1;
        }
    }
    assert!(n >= 40, "{n} keys checked");
    assert!(
        stats.iter().filter_map(|(k, v)| v.as_f64().map(|x| (k, x))).all(|(_, x)| x.is_finite()),
        "non-finite scalar stat"
    );
}

/// Issue #29: a turn whose episode goes on bootstraps from the next state's value. With every
/// bootstrap 0 (every turn ends its episode) the step is TRL's, bit for bit; a positive
/// bootstrap raises the returns by γ·value at the last token and changes the update.
#[test]
fn bootstrap_zero_is_the_plain_step_and_a_value_raises_the_returns() {
    crate::common::install();
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, ..Default::default() };
    let (queries, resp, scores) = synthetic(8, 41);
    let run = |bootstrap: Option<&[f32]>| {
        let mut t = trainer(42, cfg.clone());
        let input = StepInput {
            queries: &queries,
            responses: &resp,
            scores: &scores,
            response_masks: None,
            rollout: None,
            bootstrap,
            allowed: None,
        };
        let stats = t.step_with(input).unwrap();
        (stats, weights(&t))
    };
    let (plain, w_plain) = run(None);
    let (zero, w_zero) = run(Some(&[0.0; 8]));
    assert_eq!(weights_diff(&w_plain, &w_zero), 0.0);
    for key in ["ppo/loss/total", "ppo/returns/mean", "objective/kl"] {
        assert_eq!(scalar(&plain, key).to_bits(), scalar(&zero, key).to_bits(), "{key}");
    }
    let (boot, w_boot) = run(Some(&[5.0; 8]));
    assert!(weights_diff(&w_plain, &w_boot) > 0.0);
    assert!(scalar(&boot, "ppo/returns/mean") > scalar(&plain, "ppo/returns/mean") + 0.5);
    let mut t = trainer(42, cfg);
    let bad = StepInput {
        queries: &queries,
        responses: &resp,
        scores: &scores,
        response_masks: None,
        rollout: None,
        bootstrap: Some(&[f32::NAN; 8]),
        allowed: None,
    };
    let e = t.step_with(bad).unwrap_err().to_string();
    assert!(e.contains("sample 0") && e.contains("bootstrap"), "{e}");
}

/// Issue #30: the PPO step a GPU runs (every op through candle's composed ops, no gradient
/// buffers, no fused Adam, moments as tensors), run on the CPU, against the fused CPU kernels:
/// two steps (so Adam's moments matter) give the same weights and stats to float rounding.
#[test]
fn two_steps_through_the_composed_ops_match_the_fused_cpu_kernels() {
    crate::common::install();
    let (queries, responses, scores) = synthetic(8, 21);
    let config = PpoConfig { batch_size: 8, mini_batch_size: 4, learning_rate: 1e-3, ..PpoConfig::default() };
    let run = |composed: bool| {
        let _scope = composed.then(rltune::ops::composed_scope);
        let mut t = trainer(13, config.clone());
        let mut stats = Vec::new();
        for _ in 0..2 {
            stats.push(t.step(&queries, &responses, &scores).unwrap());
        }
        (weights(&t), stats)
    };
    let (fused, fused_stats) = run(false);
    let (composed, composed_stats) = run(true);
    let before = weights(&trainer(13, config.clone()));
    let diff = weights_diff(&fused, &composed);
    let moved = weights_diff(&fused, &before);
    println!("composed vs fused: weights max diff {diff:.2e} (the steps moved them {moved:.2e})");
    assert!(moved > 1e-3, "the steps trained ({moved})");
    assert!(diff < 1e-5, "weights differ by {diff}");
    for (f, c) in fused_stats.iter().zip(&composed_stats) {
        for key in
            ["ppo/loss/total", "ppo/loss/value", "ppo/policy/approxkl", "objective/kl", "ppo/val/vpred"]
        {
            let (a, b) = (scalar(f, key), scalar(c, key));
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{key}: fused {a} vs composed {b}");
        }
    }
}

/// Issue #57: with top-k / top-p / min-p, the step's logprobs over each token's sampled support
/// are the sampler's (so the first ratio is 1), and the reference's are taken over the same
/// supports (the same weights: KL 0); over the whole vocabulary they are not. With
/// `logprob_support = "vocabulary"` (TRL's), the sampler's logprobs are the untruncated ones
/// that an unconstrained step computes.
#[test]
fn truncated_sampling_trains_on_its_supports() {
    crate::common::install();
    let t = 0.9;
    let cfg = PpoConfig { batch_size: 8, mini_batch_size: 4, temperature: t, ..Default::default() };
    let queries = prompts(8, 6);
    let gen = GenerationConfig {
        max_new_tokens: 6,
        seed: 3,
        temperature: t,
        top_k: 20,
        top_p: 0.8,
        min_p: 0.05,
        ..Default::default()
    };
    let mut exact = trainer(4, cfg.clone());
    let samples = rollout(&exact, &queries, &gen);
    let supports: Vec<Vec<Vec<u32>>> = samples.iter().map(|s| s.support.clone().unwrap()).collect();
    let sizes: Vec<usize> = supports.iter().flatten().map(Vec::len).collect();
    let resp = responses(&samples);
    let scores: Vec<f32> = (0..8).map(|i| i as f32 / 4.0 - 1.0).collect();
    let input = StepInput {
        queries: &queries,
        responses: &resp,
        scores: &scores,
        response_masks: None,
        rollout: None,
        bootstrap: None,
        allowed: Some(&supports),
    };
    let a = exact.step_with(input).unwrap();
    let d_exact = logprob_diff(&a, &queries, &samples);
    let kl = scalar(&a, "objective/kl");
    let d_vocab = logprob_diff(
        &trainer(4, cfg.clone()).step_with(StepInput { allowed: None, ..input }).unwrap(),
        &queries,
        &samples,
    );
    let trl_gen = GenerationConfig { logprob_support: rltune::generation::LogprobSupport::Vocabulary, ..gen };
    let trl_samples = rollout(&trainer(4, cfg.clone()), &queries, &trl_gen);
    assert_eq!(responses(&trl_samples), resp, "the same draws");
    let trl = trainer(4, cfg).step(&queries, &resp, &scores).unwrap();
    let d_trl = logprob_diff(&trl, &queries, &trl_samples);
    println!(
        "supports of {}..{} ids (of 50): step vs sampler logprobs {d_exact:.2e} on the supports, \
         {d_vocab:.2e} over the vocabulary; vocabulary sampler vs step {d_trl:.2e}; KL {kl:.2e}",
        sizes.iter().min().unwrap(),
        sizes.iter().max().unwrap()
    );
    assert!(sizes.iter().any(|&n| n > 1) && sizes.iter().all(|&n| n < 50));
    assert!(d_exact < 1e-5, "truncated step logprobs vs the sampler's: {d_exact:e}");
    assert!(kl.abs() < 1e-6, "the reference over the same supports: KL {kl:e}");
    assert!(d_vocab > 0.05, "over the vocabulary the logprobs should differ: {d_vocab:e}");
    assert!(d_trl < 1e-5, "vocabulary logprobs vs an unconstrained step: {d_trl:e}");
}
