//! Rollouts for `ppo-step` and `PpoTrainer::step` that PPO cannot train on: each is refused
//! naming the line or sample, before any weight changes.

use candle_core::DType;
use rltune::data::rollouts::read_rollouts;
use rltune::models::CausalLm;
use rltune::ppo::{PpoConfig, PpoTrainer};
use rltune::tokenizer::Tokenizer;

use super::{assert_contains_all, err_msg};
use crate::common::{fixture, tiny_gpt2};

/// The vocabulary size `read_rollouts` checks ids against in these tests.
const V: usize = 10;
/// A good first line, so each bad line is line 2.
const GOOD: &str = r#"{"query_ids": [1, 2], "response_ids": [3], "score": 0.5}"#;

#[test]
fn bad_rollout_lines_are_refused_naming_the_line() {
    crate::common::install();
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("rollouts.jsonl");
    let cases: [(&str, &[u8], &[&str]); 11] = [
        ("empty query", br#"{"query_ids": [], "response_ids": [3], "score": 1}"#, &["empty query"]),
        ("empty response", br#"{"query_ids": [1], "response_ids": [], "score": 1}"#, &["empty response"]),
        (
            "id out of vocabulary",
            br#"{"query_ids": [1], "response_ids": [10], "score": 1}"#,
            &["token id 10", "vocab_size 10"],
        ),
        ("negative id", br#"{"query_ids": [-1], "response_ids": [3], "score": 1}"#, &["invalid value", "-1"]),
        (
            "NaN score",
            br#"{"query_ids": [1], "response_ids": [3], "score": NaN}"#,
            &["NaN or infinite", "finite number"],
        ),
        (
            "Infinity score",
            br#"{"query_ids": [1], "response_ids": [3], "score": -Infinity}"#,
            &["NaN or infinite"],
        ),
        (
            "score beyond f32",
            br#"{"query_ids": [1], "response_ids": [3], "score": 1e39}"#,
            &["not a finite f32"],
        ),
        (
            "score beyond f64",
            br#"{"query_ids": [1], "response_ids": [3], "score": 1e400}"#,
            &["out of range"],
        ),
        (
            "score as a string",
            br#"{"query_ids": [1], "response_ids": [3], "score": "0.5"}"#,
            &["invalid type", "\"0.5\""],
        ),
        ("missing score", br#"{"query_ids": [1], "response_ids": [3]}"#, &["missing field `score`"]),
        (
            "invalid UTF-8",
            b"{\"query\": \"caf\xe9\", \"response_ids\": [3], \"score\": 1}",
            &["UTF-8", "re-encode"],
        ),
    ];
    for (name, line, parts) in cases {
        println!("--- {name}");
        let mut text = format!("{GOOD}\n").into_bytes();
        text.extend_from_slice(line);
        text.push(b'\n');
        std::fs::write(&p, &text).unwrap();
        let err = err_msg(read_rollouts(&p, None, V), name);
        assert_contains_all(&err, &["rollouts.jsonl", "line 2"]);
        assert_contains_all(&err, parts);
    }
}

/// Regression: a text that merely contains "NaN" or "Infinity" was refused as a non-finite score.
#[test]
fn rollout_text_that_mentions_nan_is_not_a_nan_score() {
    crate::common::install();
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("rollouts.jsonl");
    let line = r#"{"query": "Is NaN a number?", "response": "Infinity is not NaN.", "score": 1.0}"#;
    std::fs::write(&p, format!("{line}\n")).unwrap();
    let tok = Tokenizer::from_file(&fixture("ppo/tokenizer.json")).unwrap();
    let rows = read_rollouts(&p, Some(&tok), tok.vocab_size()).expect("a text mentioning NaN loads");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].score, 1.0);
}

#[test]
fn bad_step_inputs_are_refused_naming_the_sample() {
    crate::common::install();
    let (store, policy) = tiny_gpt2(28, true, DType::F32);
    let ref_store = store.frozen_copy().unwrap();
    let reference = CausalLm::load(&ref_store.root(), policy.lm.config()).unwrap();
    let cfg = PpoConfig { batch_size: 2, mini_batch_size: 2, ..Default::default() };
    let mut trainer = PpoTrainer::new(cfg, store.clone(), policy, reference).unwrap();
    let before = store.snapshot().unwrap();
    let q = || vec![vec![1, 2, 3], vec![4, 5]];
    let r = || vec![vec![6, 7], vec![8]];
    // The tiny model: V = 50, 64 positions.
    /// Name, queries, responses, scores, what the message must hold.
    type Case = (&'static str, Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<f32>, Vec<&'static str>);
    let cases: Vec<Case> = vec![
        (
            "one sample for a batch of 2",
            vec![vec![1]],
            vec![vec![2]],
            vec![1.0],
            vec!["1 queries", "batch_size is 2"],
        ),
        ("scores short", q(), r(), vec![1.0], vec!["1 scores", "batch_size is 2"]),
        ("empty query", vec![vec![1], vec![]], r(), vec![1.0, 1.0], vec!["sample 1", "empty query"]),
        ("empty response", q(), vec![vec![], vec![8]], vec![1.0, 1.0], vec!["sample 0", "empty response"]),
        (
            "id out of vocabulary",
            q(),
            vec![vec![6], vec![50]],
            vec![1.0, 1.0],
            vec!["sample 1", "token id 50", "vocab_size 50"],
        ),
        ("NaN score", q(), r(), vec![f32::NAN, 1.0], vec!["sample 0", "NaN", "finite"]),
        ("infinite score", q(), r(), vec![1.0, f32::NEG_INFINITY], vec!["sample 1", "-inf", "finite"]),
    ];
    for (name, queries, responses, scores, parts) in cases {
        println!("--- {name}");
        let err = err_msg(trainer.step(&queries, &responses, &scores), name);
        assert_contains_all(&err, &parts);
    }
    let after = store.snapshot().unwrap();
    for (k, t) in &before {
        assert_eq!(crate::common::max_diff(t, &after[k]), 0.0, "{k} changed after refused steps");
    }
}

/// A trainer on the tiny model (V = 50, 64 positions) with batch size 1.
fn trainer_of_one() -> PpoTrainer {
    let (store, policy) = tiny_gpt2(28, true, DType::F32);
    let ref_store = store.frozen_copy().unwrap();
    let reference = CausalLm::load(&ref_store.root(), policy.lm.config()).unwrap();
    let cfg = PpoConfig { batch_size: 1, mini_batch_size: 1, ..Default::default() };
    PpoTrainer::new(cfg, store, policy, reference).unwrap()
}

/// A query plus response longer than the model's context (64 positions) is an error that names
/// the sample, its length and the context (it said "embedding: id 64 is out of range for a
/// table of 64 rows").
#[test]
fn step_longer_than_the_context_names_the_sample_and_the_limit() {
    crate::common::install();
    let err = err_msg(trainer_of_one().step(&[vec![1; 60]], &[vec![2; 10]], &[1.0]), "a 70-token sample");
    assert_contains_all(&err, &["sample 0", "70 tokens", "64 positions"]);
}
