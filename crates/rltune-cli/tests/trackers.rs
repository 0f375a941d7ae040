//! Experiment trackers end to end (issue #57, item 4): `rltune ppo` with `[logging] mlflow` and
//! `[logging] wandb = "offline"` on the tiny quickstart, then the real `mlflow` and `wandb`
//! packages read what it wrote (`tools/trackers/check_mlflow.py`, `check_wandb.py`): every metric
//! of `metrics.jsonl` with its steps and values, the params/config, and how the run ended.
//!
//! The checks run with the Python of `tools/trackers/install.sh` (`.venv-trackers/bin/python`, or
//! `RLTUNE_TRACKERS_PYTHON`); without it they say loudly that they were skipped, and fail if
//! `RLTUNE_REQUIRE_TRACKERS` is set (as `.ci/run` sets it after installing the packages). The
//! config errors are checked without Python.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

mod common;
use common::rltune;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(out: Output) -> Output {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "rltune failed:\n{}\n{err}", String::from_utf8_lossy(&out.stdout));
    out
}

/// The tiny quickstart's output (its `ppo.toml` and models), made once per test binary.
fn quickstart() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        ok(rltune(&["quickstart", "--preset", "tiny", "--output", s(&dir)]));
        dir
    })
}

/// The Python with `mlflow` and `wandb`, or `None` (after saying so) when it is not installed.
fn trackers_python() -> Option<PathBuf> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var_os("RLTUNE_TRACKERS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join(".venv-trackers/bin/python"));
    if python.is_file() {
        return Some(python);
    }
    let why = format!(
        "SKIPPED: the tracker checks need a Python with mlflow and wandb ({} not found; run \
         tools/trackers/install.sh or set RLTUNE_TRACKERS_PYTHON)",
        python.display()
    );
    assert!(std::env::var_os("RLTUNE_REQUIRE_TRACKERS").is_none(), "{why}");
    eprintln!("{why}");
    None
}

/// Runs `tools/trackers/<script>` with `args`; fails the test with its output unless it passes.
fn check(python: &Path, script: &str, args: &[&str]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/trackers").join(script);
    let out = Command::new(python).arg(path).args(args).env("WANDB_MODE", "offline").output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{script}: {stdout}");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("OK: every metric"), "{stdout}");
}

/// `rltune ppo` on the quickstart's config in `run`, with the trackers on.
fn ppo(run: &Path, steps: usize, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rltune"));
    cmd.args(["ppo", "--config", s(&quickstart().join("ppo.toml"))]);
    for o in [
        format!("logging.dir={:?}", s(run)),
        format!("ppo.steps={steps}"),
        "logging.mlflow=\"../mlruns\"".into(),
        "logging.wandb=\"offline\"".into(),
    ] {
        cmd.args(["--set", &o]);
    }
    cmd.args(extra).env("HF_HUB_OFFLINE", "1").env("RUST_LOG", "warn").env("WANDB_MODE", "offline");
    cmd
}

/// A finished run, then `--resume` to more steps: MLflow continues the same run (each step once),
/// W&B gets a second offline folder of the same run id; both match `metrics.jsonl` throughout.
#[test]
fn mlflow_and_wandb_hold_every_metric_of_a_run_and_its_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    ok(ppo(&run, 2, &["--set", "checkpoint.every=2"]).output().unwrap());
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("trackers.json")).unwrap()).unwrap();
    let mlflow_run = PathBuf::from(ids["mlflow"]["run_dir"].as_str().unwrap());
    assert!(mlflow_run.starts_with(tmp.path().join("mlruns")), "relative to the run directory: {ids}");
    let meta = std::fs::read_to_string(mlflow_run.join("meta.yaml")).unwrap();
    assert!(meta.contains("status: 3\n"), "FINISHED:\n{meta}");
    let total = std::fs::read_to_string(mlflow_run.join("metrics/ppo/loss/total")).unwrap();
    assert_eq!(total.lines().count(), 2, "a `/` key is a nested file, one line per step:\n{total}");
    let python = trackers_python();
    if let Some(py) = &python {
        check(py, "check_mlflow.py", &["--run-dir", s(&run)]);
        check(py, "check_wandb.py", &["--run-dir", s(&run)]);
    }

    ok(ppo(&run, 3, &["--set", "checkpoint.every=2", "--resume"]).output().unwrap());
    let again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("trackers.json")).unwrap()).unwrap();
    assert_eq!(again["mlflow"]["run_id"], ids["mlflow"]["run_id"], "the resumed run continues");
    assert_eq!(again["wandb"]["run_id"], ids["wandb"]["run_id"]);
    let total = std::fs::read_to_string(mlflow_run.join("metrics/ppo/loss/total")).unwrap();
    let steps: Vec<&str> = total.lines().map(|l| l.rsplit(' ').next().unwrap()).collect();
    assert_eq!(steps, ["1", "2", "3"]);
    if let Some(py) = &python {
        check(py, "check_mlflow.py", &["--run-dir", s(&run)]);
        check(py, "check_wandb.py", &["--run-dir", s(&run)]);
    }
}

/// Ctrl-C ends the run after its step: MLflow `KILLED`, W&B exit code 255.
#[test]
fn ctrl_c_marks_the_tracker_runs_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let child = ppo(&run, 100_000, &["--set", "checkpoint.every=0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while std::fs::read_to_string(run.join("metrics.jsonl")).map_or(true, |t| t.lines().count() < 2) {
        assert!(started.elapsed().as_secs() < 300, "no PPO step within 5 minutes");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("trackers.json")).unwrap()).unwrap();
    let meta =
        std::fs::read_to_string(Path::new(ids["mlflow"]["run_dir"].as_str().unwrap()).join("meta.yaml"))
            .unwrap();
    assert!(meta.contains("status: 5\n"), "KILLED:\n{meta}");
    if let Some(py) = trackers_python() {
        check(&py, "check_mlflow.py", &["--run-dir", s(&run), "--status", "KILLED"]);
        check(&py, "check_wandb.py", &["--run-dir", s(&run), "--exit-code", "255"]);
    }
}

/// Bad tracker settings fail before training, naming the key and the fix.
#[test]
fn bad_tracker_settings_name_the_key_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let fails = |extra: &[&str]| {
        let out = ppo(&run, 1, extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{err}");
        err
    };
    let err = fails(&["--set", "logging.wandb=online"]);
    assert!(err.contains("logging.wandb = \"online\"") && err.contains("wandb sync"), "{err}");
    let err = fails(&["--set", "logging.wandb=offlin"]);
    assert!(err.contains("logging.wandb = \"offlin\"") && err.contains("\"offline\""), "{err}");
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let err = fails(&["--set", &format!("logging.mlflow={:?}", s(&file.join("store")))]);
    assert!(err.contains("[logging] mlflow") && err.contains("writable directory"), "{err}");
    assert!(
        !run.join("metrics.jsonl").exists() || std::fs::read(run.join("metrics.jsonl")).unwrap().is_empty()
    );
}
