//! The BERT token tagger: imitation learns a tiny NER task, RL on entity F1 improves a weak
//! policy, decoding does not depend on the batch size, and an RL run stopped and resumed equals
//! one that never stopped, bit for bit.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::Device;
use rand::{Rng, SeedableRng};
use rltune::rewards::metrics::bio::{entity_f1, Tagged};
use rltune::tagger::train::{self, Baseline, Decoding, RlArgs, TagExample};
use rltune::tagger::Tagger;
use rltune::train::{Checkpointing, TrainingArgs};

const PERSONS: [&str; 4] = ["alice", "bob", "carol", "dave"];
const PLACES: [&str; 3] = ["paris", "london", "rome"];
const FILLER: [&str; 8] = ["the", "saw", "in", "today", "went", "to", "and", "lol"];

fn tags() -> Vec<String> {
    ["O", "B-loc", "B-person", "I-loc", "I-person"].map(String::from).to_vec()
}

/// Sentences of filler words, people and places; "new york" is a two-word place and a person
/// may come with the surname "smith" (`I-person`).
fn sentences(n: usize, seed: u64) -> Vec<Tagged> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let (mut tokens, mut tags) = (Vec::new(), Vec::new());
            for _ in 0..rng.gen_range(3..9) {
                let mut push = |w: &str, t: &str| {
                    tokens.push(w.to_string());
                    tags.push(t.to_string());
                };
                match rng.gen_range(0..10) {
                    0 | 1 => {
                        push(PERSONS[rng.gen_range(0..4)], "B-person");
                        if rng.gen_bool(0.3) {
                            push("smith", "I-person");
                        }
                    }
                    2 => push(PLACES[rng.gen_range(0..3)], "B-loc"),
                    3 => {
                        push("new", "B-loc");
                        push("york", "I-loc");
                    }
                    _ => push(FILLER[rng.gen_range(0..8)], "O"),
                }
            }
            Tagged { tokens, tags }
        })
        .collect()
}

/// A tiny BERT encoder directory (random weights from `seed`, a word-level tokenizer).
fn encoder_dir(dir: &Path, seed: u64) {
    let words: Vec<&str> =
        PERSONS.iter().chain(&PLACES).chain(&FILLER).chain(&["smith", "new", "york"]).copied().collect();
    rltune::tagger::write_tiny_encoder(dir, &words, 16, 32, seed).unwrap();
}

fn tagger(dir: &Path, seed: u64) -> Tagger {
    Tagger::from_pretrained(dir.to_str().unwrap(), &tags(), seed, &Device::Cpu).unwrap()
}

fn f1(t: &Tagger, ex: &[TagExample], decoding: Decoding) -> f64 {
    let pred = train::predict(t, ex, decoding, 16).unwrap();
    let gold: Vec<Vec<String>> = ex.iter().map(|e| e.gold.clone()).collect();
    entity_f1(&gold, &pred).f1
}

fn args(steps: usize, lr: f64) -> TrainingArgs {
    TrainingArgs {
        learning_rate: lr,
        max_steps: (steps) as i64,
        batch_size: 16,
        eval_fraction: 0.0,
        seed: 5,
        ..Default::default()
    }
}

#[test]
fn imitation_learns_to_tag_and_rl_on_f1_improves_a_weak_tagger() {
    crate::common::install();
    let dir = tempfile::tempdir().unwrap();
    encoder_dir(dir.path(), 1);
    let t = tagger(dir.path(), 2);
    let (train_s, test_s) = (sentences(96, 3), sentences(64, 4));
    let train_ex = train::examples(&t, &train_s).unwrap();
    let test_ex = train::examples(&t, &test_s).unwrap();
    let before = f1(&t, &test_ex, Decoding::Greedy);
    // A weak imitation policy: a few steps only.
    train::train_imitation(&t, &train_ex, &args(6, 3e-3), None, &mut |_| {}).unwrap();
    let weak = f1(&t, &test_ex, Decoding::Greedy);
    let sampled = Decoding::Sampled { seed: 7, temperature: 1.0 };
    let weak_sampled = f1(&t, &test_ex, sampled);
    // RL from it, against the frozen weak policy.
    let reference = t.frozen_copy().unwrap();
    let rl =
        RlArgs { samples_per_sentence: 4, kl_coef: 0.01, temperature: 1.0, seed: 11, ..RlArgs::default() };
    let mut rewards = Vec::new();
    train::train_rl(&t, &reference, &train_ex, &args(80, 3e-3), &rl, None, &mut |_, s| {
        rewards.push(s.reward_mean)
    })
    .unwrap();
    let after = f1(&t, &test_ex, Decoding::Greedy);
    let after_sampled = f1(&t, &test_ex, sampled);
    let first: f64 = rewards[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = rewards[rewards.len() - 5..].iter().sum::<f64>() / 5.0;
    println!(
        "greedy F1: random {before:.3}, imitation {weak:.3}, RL {after:.3}; sampled {weak_sampled:.3} → \
         {after_sampled:.3}; RL reward {first:.3} → {last:.3}"
    );
    assert!(after_sampled > weak_sampled + 0.1, "RL: sampled F1 {weak_sampled:.3} → {after_sampled:.3}");
    assert!(after > 0.9, "RL: greedy F1 {weak:.3} → {after:.3}");
    assert!(last > first, "RL reward {first:.3} → {last:.3}");

    // Imitation to convergence on a fresh head learns the task outright.
    let u = tagger(dir.path(), 3);
    let summary = train::train_imitation(&u, &train_ex, &args(60, 3e-3), None, &mut |_| {}).unwrap();
    let learned = f1(&u, &test_ex, Decoding::Greedy);
    println!("imitation: loss {:.4}, greedy F1 {learned:.3}", summary.train_loss);
    assert!(learned > 0.95, "{learned}");
}

#[test]
fn decoding_does_not_depend_on_the_batch_size() {
    crate::common::install();
    let dir = tempfile::tempdir().unwrap();
    encoder_dir(dir.path(), 1);
    let t = tagger(dir.path(), 2);
    let ex = train::examples(&t, &sentences(13, 6)).unwrap();
    let sampled = Decoding::Sampled { seed: 3, temperature: 1.0 };
    let whole = train::predict(&t, &ex, sampled, 13).unwrap();
    for bs in [1, 2, 5] {
        assert_eq!(train::predict(&t, &ex, sampled, bs).unwrap(), whole, "batch size {bs}");
    }
    // Every prediction is BIO-valid: no I- tag without its B-.
    for p in &whole {
        let ids: Vec<u32> = p.iter().map(|x| t.bio().index(x).unwrap() as u32).collect();
        assert_eq!(t.bio().valid_indices(p).unwrap(), ids, "{p:?}");
    }
    assert_ne!(whole, train::predict(&t, &ex, Decoding::Sampled { seed: 4, temperature: 1.0 }, 13).unwrap());
    // A bias off the O logit tags more entities; a huge one tags none O, a zero one is greedy.
    let count = |p: &[Vec<String>]| p.iter().flatten().filter(|x| *x != "O").count();
    let greedy = train::predict(&t, &ex, Decoding::Greedy, 4).unwrap();
    let biased = |b: f32| train::predict(&t, &ex, Decoding::GreedyBiased { o_bias: b }, 4).unwrap();
    assert_eq!(biased(0.0), greedy);
    assert!(count(&biased(1.0)) >= count(&greedy));
    assert_eq!(count(&biased(1e3)), ex.iter().map(|e| e.encoded.words).sum::<usize>());
}

#[test]
fn rl_stopped_and_resumed_equals_one_run_bit_for_bit() {
    crate::common::install();
    let dir = tempfile::tempdir().unwrap();
    encoder_dir(dir.path(), 1);
    let ex = train::examples(&tagger(dir.path(), 2), &sentences(40, 8)).unwrap();
    let rl = RlArgs { seed: 4, ..RlArgs::default() };
    let run = |t: &Tagger, ck: Option<Checkpointing>, stop: Option<&AtomicBool>| {
        let reference = tagger(dir.path(), 2).frozen_copy().unwrap();
        let mut losses = Vec::new();
        train::train_rl(t, &reference, &ex, &args(6, 1e-3), &rl, ck, &mut |p, _| {
            losses.push(p.loss);
            if p.step == 3 {
                if let Some(s) = stop {
                    s.store(true, Ordering::SeqCst);
                }
            }
        })
        .unwrap();
        losses
    };
    let weights = |t: &Tagger| {
        t.store()
            .snapshot()
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect::<Vec<_>>()
    };
    let straight = tagger(dir.path(), 2);
    let whole = run(&straight, None, None);
    let ckdir = tempfile::tempdir().unwrap();
    let stop = AtomicBool::new(false);
    let first = tagger(dir.path(), 2);
    let head =
        run(&first, Some(Checkpointing { dir: ckdir.path(), resume: false, stop: Some(&stop) }), Some(&stop));
    assert_eq!(head, whole[..3]);
    let resumed = tagger(dir.path(), 9);
    let tail = run(&resumed, Some(Checkpointing { dir: ckdir.path(), resume: true, stop: None }), None);
    assert_eq!(tail, whole[3..]);
    assert_eq!(weights(&resumed), weights(&straight));
}

/// Self-critical RL (the greedy tags' reward as the baseline) improves the weak tagger too.
#[test]
fn rl_against_the_greedy_baseline_improves_a_weak_tagger() {
    crate::common::install();
    let dir = tempfile::tempdir().unwrap();
    encoder_dir(dir.path(), 1);
    let t = tagger(dir.path(), 2);
    let train_ex = train::examples(&t, &sentences(96, 3)).unwrap();
    let test_ex = train::examples(&t, &sentences(64, 4)).unwrap();
    train::train_imitation(&t, &train_ex, &args(6, 3e-3), None, &mut |_| {}).unwrap();
    let weak = f1(&t, &test_ex, Decoding::Greedy);
    let reference = t.frozen_copy().unwrap();
    let rl = RlArgs {
        samples_per_sentence: 2,
        kl_coef: 0.01,
        seed: 11,
        baseline: Baseline::Greedy,
        ..RlArgs::default()
    };
    train::train_rl(&t, &reference, &train_ex, &args(80, 3e-3), &rl, None, &mut |_, _| {}).unwrap();
    let after = f1(&t, &test_ex, Decoding::Greedy);
    println!("self-critical: greedy F1 {weak:.3} → {after:.3}");
    assert!(after > weak + 0.3, "{weak:.3} → {after:.3}");
    let bad = RlArgs { samples_per_sentence: 1, ..RlArgs::default() };
    assert!(bad.validate().unwrap_err().to_string().contains("at least 2"));
}
