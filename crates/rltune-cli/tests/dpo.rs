//! `rltune dpo`, run as a user runs it: the output directory against TRL 1.16.0's fixture
//! (`tools/fixtures/dpo/`), bad input, and checkpoints with `--resume` and Ctrl-C.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use candle_core::{Device, Tensor};

mod common;
use common::{fixture, rltune};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `rltune dpo --model init --ref-model ref --data DATA --config C --output OUT`.
fn dpo(data: &Path, config: &Path, out: &Path, extra: &[&str]) -> Output {
    let (init, reference) = (fixture("dpo/init"), fixture("dpo/ref"));
    let mut args = vec![
        "dpo",
        "--model",
        init.to_str().unwrap(),
        "--ref-model",
        reference.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    rltune(&args)
}

/// One step over one batch of every row: the shuffle changes only the order of the batch, so
/// the saved weights and the logged metrics are TRL's (`hinge` variant: weight decay, lr 1e-3).
#[test]
fn dpo_one_full_batch_step_reproduces_trl_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = dpo(&fixture("dpo/rows.jsonl"), &fixture("dpo/hinge/config.toml"), &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The fixture's line 5 has identical chosen and rejected: a warning names it.
    assert!(stderr(&o).contains("rows.jsonl line 5") && stderr(&o).contains("identical"), "{}", stderr(&o));
    for f in ["model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let want =
        candle_core::safetensors::load(fixture("dpo/hinge/weights.safetensors"), &Device::Cpu).unwrap();
    let got = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut worst = 0f32;
    for (name, w) in &want {
        let g = &got[name];
        // The attention key bias has an exactly-zero gradient (tests/integration/grpo_parity.rs).
        let part = |t: &Tensor| -> Tensor {
            if !name.ends_with("attn.c_attn.bias") {
                return t.clone();
            }
            let c = t.dim(0).unwrap() / 3;
            Tensor::cat(&[t.narrow(0, 0, c).unwrap(), t.narrow(0, 2 * c, c).unwrap()], 0).unwrap()
        };
        let d = (part(g) - part(w)).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        worst = worst.max(d.to_scalar::<f32>().unwrap());
    }
    assert!(worst < 1e-5, "weights differ from TRL's by {worst}");
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let ours: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("dpo/hinge/expected.json")).unwrap()).unwrap();
    for (k, v) in expected["logs"][0].as_object().unwrap() {
        let (a, b) = (ours[k].as_f64().unwrap(), v.as_f64().unwrap());
        assert!((a - b).abs() < 1e-5, "{k}: ours {a}, TRL {b}");
    }
    println!("rltune dpo vs TRL hinge: weights max diff {worst:.2e}");
}

/// Bad rows fail with the file, line and field; bad settings with the field.
#[test]
fn dpo_bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = "{\"prompt\": \"t5 t9\", \"chosen\": \" t12\", \"rejected\": \" t3\"}";
    let cases = [
        ("{\"prompt\": \"t5\", \"chosen\": \" t1\"}", "line 2: missing field \"rejected\""),
        ("{\"prompt\": \"t5\", \"chosen\": \"\", \"rejected\": \" t3\"}", "line 2: \"chosen\" is empty"),
        (
            "{\"prompt\": \"t5\", \"chosen\": \" t1\", \"rejected\": \" t3\", \"ref_chosen_logps\": NaN, \
             \"ref_rejected_logps\": -2.0}",
            "line 2: invalid JSON: a value is NaN or Infinity",
        ),
    ];
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[dpo]\nmax_steps = 1\n").unwrap();
    for (i, (line, want)) in cases.iter().enumerate() {
        let data = dir.path().join(format!("d{i}.jsonl"));
        std::fs::write(&data, format!("{good}\n{line}\n")).unwrap();
        let o = dpo(&data, &config, &dir.path().join("out"), &[]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(&format!("d{i}.jsonl")) && stderr(&o).contains(want), "{}", stderr(&o));
    }
    let data = dir.path().join("ok.jsonl");
    std::fs::write(&data, format!("{good}\n")).unwrap();
    let o = dpo(&data, &config, &dir.path().join("out"), &["--set", "dpo.loss_type=\"aot\""]);
    assert!(!o.status.success() && stderr(&o).contains("dpo.loss_type"), "{}", stderr(&o));
    let o = dpo(&data, &config, &dir.path().join("out"), &["--set", "dpo.betta=0.3"]);
    assert!(!o.status.success() && stderr(&o).contains("beta"), "{}", stderr(&o));
}

/// A row longer than max_length is cut (TRL's keep_start truncation); a row whose prompt fills
/// max_length is dropped with a warning naming it.
#[test]
fn dpo_truncates_long_rows_and_drops_full_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"t5 t9\", \"chosen\": \" t12 t13 t14 t15 t16 t17\", \"rejected\": \" t3\"}\n\
         {\"prompt\": \"t1 t2 t3 t4 t5\", \"chosen\": \" t12\", \"rejected\": \" t3\"}\n",
    )
    .unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[dpo]\nmax_steps = 2\nmax_length = 5\nper_device_train_batch_size = 1\n")
        .unwrap();
    let out = dir.path().join("out");
    let o = dpo(&data, &config, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("d.jsonl line 2") && stderr(&o).contains("dropped"), "{}", stderr(&o));
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2);
    // Each step: the one kept pair, chosen cut to 3 completion tokens: 5 + 4 real tokens.
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["num_tokens"].as_f64(), Some(9.0));
    assert_eq!(first["epoch"].as_f64(), Some(1.0));
}

/// configs/dpo.toml is a valid settings file (one step on the fixture's rows).
#[test]
fn dpo_example_config_runs() {
    let dir = tempfile::tempdir().unwrap();
    let config = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs/dpo.toml");
    let o = dpo(&fixture("dpo/rows.jsonl"), &config, &dir.path().join("out"), &["--set", "dpo.max_steps=1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.path().join("out/metrics.jsonl").exists());
}

/// `rltune dpo` on the fixture's rows with the fixture's initial policy (and its frozen copy as
/// the reference), writing to `out`: 200 steps of 2 pairs, warm-up and linear decay, a checkpoint
/// every 2 steps.
fn resumable(dir: &Path, out: &Path) -> Command {
    let config = dir.join("resumable.toml");
    std::fs::write(
        &config,
        "[dpo]\nmax_steps = 200\nper_device_train_batch_size = 2\nlearning_rate = 1e-3\nwarmup_steps = 3\n\
         save_steps = 2\n",
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rltune"));
    cmd.args(["dpo", "--model", s(&fixture("dpo/init")), "--data", s(&fixture("dpo/rows.jsonl"))])
        .args(["--config", s(&config), "--output", s(out)])
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_LOG", "warn")
        .stderr(Stdio::piped());
    cmd
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Waits for `file`, then sends `signal` to `child`; returns its exit status and stderr.
fn signal_after(child: std::process::Child, file: &Path, signal: &str) -> (Option<i32>, String) {
    let started = std::time::Instant::now();
    while !file.is_file() {
        assert!(started.elapsed().as_secs() < 120, "no {} within 2 minutes", file.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    (out.status.code(), stderr(&out))
}

/// `rltune dpo` stopped by Ctrl-C exits 130 after writing a checkpoint (in `OUTPUT.checkpoints`)
/// and keeps `metrics.jsonl` up to its step; killed by SIGKILL it leaves its checkpoints (and
/// perhaps metrics lines past the last). Either way the same command with `--resume` writes the
/// model and `metrics.jsonl` of a run that never stopped, byte for byte. Resuming with other
/// settings, or with no checkpoint, is refused naming the setting or the folder.
#[test]
fn dpo_stopped_by_ctrl_c_or_killed_resumes_to_the_straight_runs_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let straight = dir.join("straight");
    let out = resumable(dir, &straight).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let bytes = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
    assert_eq!(String::from_utf8(bytes(&straight, "metrics.jsonl")).unwrap().lines().count(), 200);

    let stopped = dir.join("stopped");
    let child = resumable(dir, &stopped).spawn().unwrap();
    let checkpoints = dir.join("stopped.checkpoints");
    let (code, err) = signal_after(child, &checkpoints.join("step-2/trainer_state.json"), "-INT");
    assert_eq!(code, Some(130), "{err}");
    assert!(err.contains("--resume continues it") && !stopped.join("model.safetensors").exists(), "{err}");
    // The checkpoint of the step under way, and the metrics lines up to it.
    let last = rltune::run::checkpoint::latest_checkpoint_in(&checkpoints).unwrap().unwrap().0;
    let lines = String::from_utf8(bytes(&stopped, "metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), last, "{err}");
    assert!(last < 200, "stopped before the end");
    println!("Ctrl-C: checkpoint after step {last} of 200");

    let out = resumable(dir, &stopped).args(["--resume", "--set", "dpo.beta=0.2"]).output().unwrap();
    assert!(!out.status.success() && stderr(&out).contains("dpo.beta = 0.1"), "{}", stderr(&out));
    let out = resumable(dir, &stopped).arg("--resume").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    for f in ["model.safetensors", "metrics.jsonl"] {
        assert!(
            bytes(&stopped, f) == bytes(&straight, f),
            "{f}: the resumed run's differs from the straight run's"
        );
    }

    let killed = dir.join("killed");
    let child = resumable(dir, &killed).spawn().unwrap();
    let (code, err) = signal_after(child, &dir.join("killed.checkpoints/step-4/trainer_state.json"), "-KILL");
    assert_eq!(code, None, "{err}");
    let (last, lines) = (
        rltune::run::checkpoint::latest_checkpoint_in(&dir.join("killed.checkpoints")).unwrap().unwrap().0,
        String::from_utf8(bytes(&killed, "metrics.jsonl")).unwrap().lines().count(),
    );
    println!("SIGKILL: last checkpoint after step {last}, {lines} metrics lines");
    let out = resumable(dir, &killed).arg("--resume").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    for f in ["model.safetensors", "metrics.jsonl"] {
        assert!(
            bytes(&killed, f) == bytes(&straight, f),
            "{f}: the resumed run's differs from the straight run's"
        );
    }

    let out = resumable(dir, &dir.join("fresh")).arg("--resume").output().unwrap();
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("fresh.checkpoints") && err.contains("without --resume"),
        "{err}"
    );
}
