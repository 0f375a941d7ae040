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

/// The tiny essays quickstart runs every stage and writes its numbers: the agents and the
/// controls (BC at T = 0.5, BC trained longer) scored on test essays, the model agents on
/// validation essays too, the acceptance checks printed (not enforced at this size).
#[test]
fn essays_quickstart_tiny_runs_every_stage_and_writes_its_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qe");
    let out = ok(rltune(&["quickstart", "--task", "essays", "--preset", "tiny", "--output", s(&dir)]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in
        ["test essays (6)", "validation essays (4)", "(both sampled): PPO", "(both greedy): PPO (greedy)"]
    {
        assert!(stdout.contains(want), "{want}: {stdout}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-essays.json")).unwrap()).unwrap();
    let names = |key: &str| -> Vec<String> {
        summary[key].as_array().unwrap().iter().map(|a| a[0].as_str().unwrap().to_string()).collect()
    };
    let models =
        ["BC", "BC (greedy)", "PPO", "PPO (greedy)", "BC (T = 0.5)", "BC longer", "BC longer (greedy)"];
    let mut all = vec!["random", "heuristic"];
    all.extend(models);
    assert_eq!(names("agents"), all);
    assert_eq!(names("validation"), models);
    for (key, n) in [("agents", 6), ("validation", 4)] {
        for a in summary[key].as_array().unwrap() {
            let e = &a[1];
            assert_eq!(e["essays"], n, "{a}");
            let mean = e["mean"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&mean) && e["se"].as_f64().unwrap() >= 0.0, "{a}");
            assert_eq!(e["scores"].as_array().unwrap().len(), n);
        }
    }
    assert_eq!(summary["ppo_curve"].as_array().unwrap().len(), 2);
    assert!(dir.join("ppo/checkpoints/step-2/model.safetensors").is_file());
    // BC trained longer: as many updates as PPO's 2 steps × 1 epoch × 16/8 minibatches.
    let longer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("bc-longer/settings.json")).unwrap()).unwrap();
    assert_eq!(longer["max_steps"], 4);
    // A rerun reuses every stage.
    let out = ok(rltune(&["quickstart", "--task", "essays", "--preset", "tiny", "--output", s(&dir)]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[bc] cached") && err.contains("[ppo] cached") && err.contains("[bc-longer] cached"),
        "{err}"
    );
    // PPO-ptx from the same BC policy: a stage and a summary of its own; BC, its controls and
    // the PPO run are reused, and the supervised loss is logged under `ppo/loss/ptx`.
    let ptx =
        ["quickstart", "--task", "essays", "--preset", "tiny", "--output", s(&dir), "--set", "ptx_coef=0.5"];
    let out = ok(rltune(&ptx));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[bc] cached")
            && err.contains("[bc-longer] cached")
            && err.contains("[ppo-ptx] started"),
        "{err}"
    );
    assert!(dir.join("ppo-ptx/checkpoints/step-2/model.safetensors").is_file());
    let stage = std::fs::read_to_string(dir.join("ppo-ptx.toml")).unwrap();
    assert!(
        stage.contains("[ptx]") && stage.contains("coef = 0.5") && stage.contains("bc-records.jsonl"),
        "{stage}"
    );
    let metrics = std::fs::read_to_string(dir.join("ppo-ptx/metrics.jsonl")).unwrap();
    let ce: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["ppo/loss/ptx"].as_f64())
        .collect();
    assert!(ce.len() == 2 && ce.iter().all(|c| c.is_finite() && *c > 0.0), "{ce:?}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-essays-ppo-ptx.json")).unwrap())
            .unwrap();
    assert_eq!(summary["config"]["ptx_coef"], 0.5);
    // PPO's own summary is left as it was.
    let plain: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-essays.json")).unwrap()).unwrap();
    assert!(plain["config"].get("ptx_coef").is_none());
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

/// The tiny WNUT quickstart on a made-up CoNLL file (a random word-level BERT, a few steps per
/// stage): the splits, every agent scored on test, validation and training tweets, the paired
/// differences, the test predictions; a rerun keeps the stages' models and gives the same numbers.
#[test]
fn wnut_quickstart_tiny_runs_every_stage_and_caches() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("ner.txt");
    let mut text = String::new();
    for i in 0..60 {
        let who = ["alice", "bob", "carol"][i % 3];
        text.push_str(&format!("{who}\tB-person\nsmith\tI-person\nwent\tO\nto\tO\nparis\tB-loc\n{i}\tO\n\n"));
    }
    std::fs::write(&file, text).unwrap();
    let dir = tmp.path().join("qw");
    let set = format!("file={:?}", s(&file));
    let run = || {
        ok(rltune(&["quickstart", "--task", "wnut", "--preset", "tiny", "--output", s(&dir), "--set", &set]))
    };
    let stdout = String::from_utf8_lossy(&run().stdout).into_owned();
    assert!(stdout.contains("44 training tweets, 4 validation, 12 test"), "{stdout}");
    let read = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-wnut.json")).unwrap()).unwrap()
    };
    let summary = read();
    let names: Vec<&str> =
        summary["agents"].as_array().unwrap().iter().map(|a| a["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["lexicon", "BC", "BC (longer)", "RLOO", "BC (O-bias)"]);
    // The lexicon has seen every test word in training: it tags the test tweets perfectly.
    let lexicon = &summary["agents"][0];
    assert_eq!(
        (lexicon["test"]["sentences"].as_u64(), lexicon["test"]["micro"]["f1"].as_f64()),
        (Some(12), Some(1.0))
    );
    assert!(lexicon["test_sampled"].is_null() && summary["agents"][3]["test_sampled"]["sentences"] == 12);
    assert_eq!(
        summary["differences"].as_array().unwrap().len(),
        4,
        "RLOO against BC and BC (longer), greedy and sampled"
    );
    for stage in ["bc", "rl", "bc-longer"] {
        assert!(dir.join(stage).join("model.safetensors").is_file(), "{stage}");
    }
    let rows = std::fs::read_to_string(dir.join("test-predictions.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 3 * 12);
    let again = String::from_utf8_lossy(&run().stdout).into_owned();
    assert!(!again.contains("bc 0 s") && again.contains("stages run: eval"), "{again}");
    assert_eq!(read()["agents"], summary["agents"]);
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
