//! RL on a task's own metric, end to end (issue #41): `quickstart --task essays` and
//! `--task wnut` with the tiny preset, and `rltune play` on both environments.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::rltune;

fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "rltune failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn repo(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
}

/// The tiny essays quickstart runs every stage and writes its numbers: six agents scored on
/// held-out essays, the acceptance checks printed (not enforced at this size).
#[test]
fn essays_quickstart_tiny_runs_every_stage_and_writes_its_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qe");
    let out = ok(rltune(&["quickstart", "--task", "essays", "--preset", "tiny", "--output", s(&dir)]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("held-out essays (6)") && stdout.contains("held-out F-score: PPO"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-essays.json")).unwrap()).unwrap();
    let agents = summary["agents"].as_array().unwrap();
    let names: Vec<&str> = agents.iter().map(|a| a[0].as_str().unwrap()).collect();
    assert_eq!(names, ["random", "heuristic", "BC", "BC (greedy)", "PPO", "PPO (greedy)"]);
    for a in agents {
        let e = &a[1];
        assert_eq!(e["essays"], 6, "{a}");
        let mean = e["mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&mean) && e["se"].as_f64().unwrap() >= 0.0, "{a}");
        assert_eq!(e["scores"].as_array().unwrap().len(), 6);
    }
    assert_eq!(summary["ppo_curve"].as_array().unwrap().len(), 2);
    assert!(dir.join("ppo/checkpoints/step-2/model.safetensors").is_file());
    // A rerun reuses every stage.
    let out = ok(rltune(&["quickstart", "--task", "essays", "--preset", "tiny", "--output", s(&dir)]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[bc] cached") && err.contains("[ppo] cached"), "{err}");
}

/// `rltune play` on the essays: the random agent plays the 15 label commands and scores low.
#[test]
fn play_random_on_essays() {
    let out = ok(rltune(&[
        "play",
        "--env",
        s(&repo("configs/essays.toml")),
        "--agent",
        "random",
        "--episodes",
        "16",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["episodes"], 16);
    assert_eq!(report["invalid_action_rate"], 0.0);
    let score = report["mean_score"].as_f64().unwrap();
    assert!((0.0..0.3).contains(&score), "random F-score {score}");
}

/// The real WNUT-2016 file: `tools/data/fetch_wnut.sh` puts it in target/data/wnut16 (or set
/// RLTUNE_WNUT_FILE). Without it this test says SKIPPED and passes.
fn wnut_file() -> Option<PathBuf> {
    let p = std::env::var_os("RLTUNE_WNUT_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo("target/data/wnut16/ner.txt"));
    if p.is_file() {
        Some(p)
    } else {
        eprintln!("SKIPPED: no WNUT-2016 file at {} (run tools/data/fetch_wnut.sh)", p.display());
        None
    }
}

#[test]
fn wnut_quickstart_tiny_on_the_real_file() {
    let Some(file) = wnut_file() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qw");
    let set = format!("game.file={:?}", s(&file));
    let out =
        ok(rltune(&["quickstart", "--task", "wnut", "--preset", "tiny", "--output", s(&dir), "--set", &set]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("1916 training tweets, 478 held out"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-wnut.json")).unwrap()).unwrap();
    let names: Vec<&str> =
        summary["agents"].as_array().unwrap().iter().map(|a| a[0].as_str().unwrap()).collect();
    assert_eq!(names, ["lexicon", "BC", "BC (longer)", "PPO"]);
    // The lexicon baseline on 6 held-out tweets finds something: WNUT has entities.
    let lexicon = &summary["agents"][0][1];
    assert_eq!(lexicon["sentences"], 6);
    assert!(lexicon["micro"]["f1"].as_f64().unwrap() >= 0.0);
    assert!(dir.join("bc-longer/model.safetensors").is_file());
}

#[test]
fn play_random_on_wnut() {
    let Some(file) = wnut_file() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("wnut.toml");
    let text = std::fs::read_to_string(repo("configs/wnut.toml")).unwrap();
    let text = text.replace("\"../target/data/wnut16/ner.txt\"", &format!("{:?}", s(&file)));
    std::fs::write(&cfg, text).unwrap();
    let out = ok(rltune(&["play", "--env", s(&cfg), "--agent", "random", "--episodes", "10", "--json"]));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["episodes"], 10);
    assert_eq!(report["invalid_action_rate"], 0.0);
}
