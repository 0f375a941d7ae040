//! Bitwise resume on the tiny quickstart's PPO config, as `tools/cuda/verify.sh` checks it on a
//! GPU: 2 steps then `--resume` to 4 against a straight 4-step run.

use std::path::Path;

mod common;
use common::rltune;

fn ppo(config: &Path, dir: &Path, steps: usize, resume: bool) {
    ppo_with(config, dir, steps, resume, &[]);
}

fn ppo_with(config: &Path, dir: &Path, steps: usize, resume: bool, extra: &[&str]) {
    let (config, log_dir, steps) = (
        config.to_str().unwrap(),
        format!("logging.dir={:?}", dir.to_str().unwrap()),
        format!("ppo.steps={steps}"),
    );
    let mut args = vec!["ppo", "--config", config, "--set", &log_dir, "--set", &steps];
    args.extend(["--set", "checkpoint.every=2", "--set", "checkpoint.optimizer_state=true"]);
    for e in extra {
        args.extend(["--set", e]);
    }
    if resume {
        args.push("--resume");
    }
    let o = rltune(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Regression: without score scaling, `trainer_state.json` keeps TRL's running-moments count of
/// 1e-24, which serde_json's default (fast, inexact) float parser read back as
/// 1.0000000000000001e-24, so the resumed checkpoint differed from the straight one in that file.
/// Found by the GPU kit's rehearsal; fixed with serde_json's `float_roundtrip`.
#[test]
fn resume_is_bitwise_without_score_scaling_float_roundtrip() {
    let tmp = tempfile::tempdir().unwrap();
    let qs = tmp.path().join("qs");
    let o = rltune(&["quickstart", "--preset", "tiny", "--output", qs.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let config = qs.join("ppo.toml");
    let (straight, resumed) = (tmp.path().join("straight"), tmp.path().join("resumed"));
    ppo(&config, &straight, 4, false);
    ppo(&config, &resumed, 2, false);
    ppo(&config, &resumed, 4, true);
    same_checkpoints(&straight, &resumed);

    // Rejection sampling fine-tunes through the run's optimizer, whose Adam state carries from
    // step to step: the checkpoint keeps it, and the resumed run continues it bit for bit.
    let rs = [
        "algorithm.kind=rejection_sampling",
        "rejection.keep_top_fraction=0.5",
        "rejection.learning_rate=1e-3",
    ];
    let (straight, resumed) = (tmp.path().join("rs-straight"), tmp.path().join("rs-resumed"));
    ppo_with(&config, &straight, 4, false, &rs);
    ppo_with(&config, &resumed, 2, false, &rs);
    ppo_with(&config, &resumed, 4, true, &rs);
    same_checkpoints(&straight, &resumed);
}

/// Every file of the step-4 checkpoints of `straight` and `resumed` is the same, byte for byte.
fn same_checkpoints(straight: &Path, resumed: &Path) {
    let ck = Path::new("checkpoints/step-4");
    let mut files: Vec<_> =
        std::fs::read_dir(straight.join(ck)).unwrap().map(|e| e.unwrap().file_name()).collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for f in &files {
        let (a, b) = (
            std::fs::read(straight.join(ck).join(f)).unwrap(),
            std::fs::read(resumed.join(ck).join(f)).unwrap(),
        );
        assert!(a == b, "checkpoints/step-4/{f:?} differs between the straight and the resumed run");
    }
}
