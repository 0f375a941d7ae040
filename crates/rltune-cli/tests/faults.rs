//! Faults and bad inputs end to end (issue #28; the library cases are in
//! `crates/rltune/tests/integration/faults.rs`): the binary exits with code 1 and a message that
//! names the file and the fix, never a panic. Cases:
//!
//! - `generate` with a tokenizer.json whose ids exceed the model's `vocab_size`;
//! - `generate` with a truncated model.safetensors;
//! - `ppo-step` with a policy holding a NaN weight;
//! - `ppo-step` with more rollouts than `[ppo] batch_size`, with a rollouts file of invalid
//!   UTF-8, and with a rollouts line whose score is NaN.

use std::path::Path;
use std::process::Output;

mod common;
use common::{fixture, rltune};

/// The stderr of a run that must exit with code 1, checked for each of `parts`.
fn fails_with(out: Output, parts: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert_eq!(out.status.code(), Some(1), "expected exit code 1:\n{err}");
    for p in parts {
        assert!(err.contains(p), "expected {p:?} in:\n{err}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of the gpt2 fixture (V = 101) in a temp directory.
fn gpt2_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("models/gpt2").join(f), dir.path().join(f)).unwrap();
    }
    dir
}

#[test]
fn generate_with_a_tokenizer_of_another_model_fails() {
    let dir = gpt2_copy();
    // The PPO fixture's tokenizer produces ids past the gpt2 fixture's 101.
    std::fs::copy(fixture("ppo/tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    let out = rltune(&["generate", "--model", s(dir.path()), "--prompt", "hello", "--max-new-tokens", "2"]);
    fails_with(out, &["tokenizer.json", "vocab_size is 101", "use the tokenizer.json saved with"]);
}

#[test]
fn generate_with_a_truncated_checkpoint_fails() {
    let dir = gpt2_copy();
    let w = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() / 3]).unwrap();
    let out = rltune(&["generate", "--model", s(dir.path()), "--prompt-ids", "1,2", "--max-new-tokens", "2"]);
    fails_with(out, &["model.safetensors", "cannot read safetensors", "save_pretrained"]);
}

/// `ppo-step` on the gpt2 copy in `dir` with `rollouts` (one line each) and batch size 2.
fn ppo_step(dir: &Path, rollouts: &[u8]) -> Output {
    let config = dir.join("ppo.toml");
    std::fs::write(&config, "[ppo]\nbatch_size = 2\nmini_batch_size = 2\n").unwrap();
    let file = dir.join("rollouts.jsonl");
    std::fs::write(&file, rollouts).unwrap();
    let out = dir.join("out");
    rltune(&[
        "ppo-step",
        "--model",
        s(dir),
        "--rollouts",
        s(&file),
        "--config",
        s(&config),
        "--output",
        s(&out),
    ])
}

const LINE: &str = r#"{"query_ids": [1, 2], "response_ids": [3, 4], "score": 0.5}"#;

#[test]
fn ppo_step_with_bad_rollouts_fails_naming_the_file() {
    let dir = gpt2_copy();
    let three = format!("{LINE}\n{LINE}\n{LINE}\n");
    fails_with(
        ppo_step(dir.path(), three.as_bytes()),
        &["rollouts.jsonl", "has 3 rollouts", "batch_size", "is 2"],
    );

    let mut latin1 = format!("{LINE}\n").into_bytes();
    latin1.extend_from_slice(b"{\"query\": \"caf\xe9\", \"response_ids\": [3], \"score\": 1}\n");
    fails_with(ppo_step(dir.path(), &latin1), &["rollouts.jsonl", "line 2", "UTF-8", "re-encode"]);

    let nan = format!("{LINE}\n{}\n", LINE.replace("0.5", "NaN"));
    fails_with(ppo_step(dir.path(), nan.as_bytes()), &["rollouts.jsonl", "line 2", "NaN or infinite"]);
    assert!(!dir.path().join("out").exists(), "a refused step writes no output");
}

#[test]
fn ppo_step_with_a_nan_weight_fails_naming_the_tensor() {
    let dir = gpt2_copy();
    let w = dir.path().join("model.safetensors");
    let mut ts = candle_core::safetensors::load(&w, &candle_core::Device::Cpu).unwrap();
    let t = &ts["transformer.wte.weight"];
    let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v[5] = f32::NAN;
    let bad = candle_core::Tensor::from_vec(v, t.shape(), &candle_core::Device::Cpu).unwrap();
    ts.insert("transformer.wte.weight".into(), bad);
    candle_core::safetensors::save(&ts, &w).unwrap();
    let rollouts = format!("{LINE}\n{LINE}\n");
    fails_with(
        ppo_step(dir.path(), rollouts.as_bytes()),
        &["cannot load policy", "\"transformer.wte.weight\"", "NaN at element 5", "earlier checkpoint"],
    );
}
