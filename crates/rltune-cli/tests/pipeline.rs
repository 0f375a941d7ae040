//! The training commands end to end, as a user runs them: `quickstart` (tiny preset), `sft`,
//! `reward`, `ppo` (classifier and command rewards, resume, faults), and the run directory
//! contract (metrics.jsonl, report.html, tb/, checkpoints/, config.toml).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

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

fn fails(out: Output) -> String {
    assert_eq!(out.status.code(), Some(1), "expected exit code 1:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// One tiny quickstart shared by the tests that reuse its models (built once per test binary).
fn quickstart() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        ok(rltune(&["quickstart", "--preset", "tiny", "--output", dir.to_str().unwrap()]));
        dir
    })
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `configs/<name>` in the repository (the examples the README points to).
fn repo_config(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs").join(name)
}

/// Each tensor of `after/model.safetensors` that `before` also holds, and whether its values
/// changed (bitwise).
fn moved_tensors(before: &Path, after: &Path) -> Vec<(String, bool)> {
    let load = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &candle_core::Device::Cpu).unwrap()
    };
    let (a, b) = (load(before), load(after));
    let values = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let moved: Vec<(String, bool)> =
        b.iter().filter_map(|(k, t)| a.get(k).map(|s| (k.clone(), values(s) != values(t)))).collect();
    assert!(!moved.is_empty(), "{} and {} share no tensor", before.display(), after.display());
    moved
}

/// The first of `keys` that `dir/config.json` holds, as a number.
fn config_usize(dir: &Path, keys: &[&str]) -> usize {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    keys.iter().find_map(|k| cfg[*k].as_u64()).unwrap() as usize
}

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn quickstart_writes_the_run_directory_contract_and_caches_stages() {
    let dir = quickstart();
    let run = dir.join("ppo");
    let lines = metrics(&run);
    assert_eq!(lines.len(), 3, "one metrics line per PPO step");
    for (i, m) in lines.iter().enumerate() {
        assert_eq!(m["step"], i + 1);
        for key in [
            "env/reward_mean",
            "env/reward_std",
            "objective/kl",
            "objective/kl_coef",
            "ppo/policy/clipfrac",
            "time/ppo/total",
        ] {
            assert!(m[key].is_number(), "step {}: {key} missing in {m}", i + 1);
        }
    }
    let report = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(report.contains("<svg") && report.contains("env/reward_mean"), "report.html lacks plots");
    assert!(!report.contains("src=\"http"), "report.html must be self-contained");
    let tb: Vec<_> = std::fs::read_dir(run.join("tb")).unwrap().flatten().collect();
    assert!(tb.iter().any(|e| e.file_name().to_string_lossy().starts_with("events.out.tfevents")));
    let ckpt = run.join("checkpoints/step-3");
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert!(ckpt.join(f).is_file(), "checkpoint lacks {f}");
    }
    assert!(run.join("config.toml").is_file(), "the resolved config is saved");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["ppo_curve"].as_array().unwrap().len(), 3);
    assert!(summary["before"]["positive_fraction"].is_number());

    // A rerun skips every stage and gives the same evaluation.
    let out = ok(rltune(&["quickstart", "--preset", "tiny", "--output", s(dir)]));
    let err = String::from_utf8_lossy(&out.stderr);
    for stage in ["corpus", "tokenizer", "sft", "classifier", "ppo"] {
        assert!(err.contains(&format!("[{stage}] cached")), "{stage} not cached:\n{err}");
    }
    let again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(again["after"], summary["after"], "evaluation is deterministic");

    // Another seed in the same directory is refused instead of mixing stages.
    let err = fails(rltune(&["quickstart", "--preset", "tiny", "--seed", "5", "--output", s(dir)]));
    assert!(err.contains("other settings"), "{err}");
}

#[test]
fn sft_and_reward_commands_train_and_save_loadable_models() {
    let dir = quickstart();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("sft.jsonl");
    let lines: Vec<String> = (0..24)
        .map(|i| {
            serde_json::json!({"prompt": format!("Review {i}:"), "completion": " A wonderful film."})
                .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let out_sft = tmp.path().join("sft-out");
    let (sft_cfg, rm_cfg) = (repo_config("sft.toml"), repo_config("reward.toml"));
    // `rltune sft` from the quickstart's policy on `data` into `out`, 3 steps, with `extra` sets.
    let policy = dir.join("sft");
    let sft = |out: &Path, extra: &[&str]| {
        let mut argv = vec!["sft", "--model", s(&policy), "--data", s(&data), "--output", s(out)];
        argv.extend(["--config", s(&sft_cfg), "--set", "training.max_steps=3", "--set", "sft.max_length=32"]);
        argv.extend(extra.iter().flat_map(|e| ["--set", e]));
        rltune(&argv)
    };
    let out = ok(sft(&out_sft, &["training.batch_size=4"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("3 steps") && err.contains("eval: loss"), "{err}");

    // Partial freezing: `[model] trainable_layers = 1` trains the last block and the final norm;
    // the embeddings (and so the tied head) and the blocks below come out bitwise unchanged.
    let out_partial = tmp.path().join("sft-partial");
    ok(sft(&out_partial, &["model.trainable_layers=1"]));
    let n_layer = config_usize(&dir.join("sft"), &["n_layer"]);
    let top = format!("h.{}.", n_layer - 1);
    for (name, moved) in moved_tensors(&dir.join("sft"), &out_partial) {
        let trainable = name.contains(&top) || name.contains("ln_f");
        assert_eq!(moved, trainable, "{name}: moved {moved}, trainable {trainable}");
    }
    let too_many = format!("model.trainable_layers={}", n_layer + 1);
    let err = fails(sft(&tmp.path().join("bad"), &[&too_many]));
    assert!(err.contains("[model]") && err.contains(&format!("trainable_layers = {}", n_layer + 1)), "{err}");
    ok(rltune(&[
        "generate",
        "--model",
        s(&out_sft),
        "--prompt",
        "Review",
        "--max-new-tokens",
        "4",
        "--json",
    ]));

    let data = tmp.path().join("labels.jsonl");
    let lines: Vec<String> = (0..24)
        .map(|i| {
            let (text, label) =
                if i % 2 == 0 { ("great fun", "POSITIVE") } else { ("dull mess", "NEGATIVE") };
            serde_json::json!({"text": text, "label": label}).to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let out_rm = tmp.path().join("rm-out");
    let classifier = dir.join("classifier");
    // `rltune reward` from the quickstart's classifier on `data` into `out`, 2 steps, `extra` sets.
    let reward = |out: &Path, extra: &[&str]| {
        let mut argv = vec!["reward", "--model", s(&classifier), "--data", s(&data), "--output", s(out)];
        argv.extend(["--config", s(&rm_cfg), "--set", "training.max_steps=2"]);
        argv.extend(extra.iter().flat_map(|e| ["--set", e]));
        rltune(&argv)
    };
    ok(reward(&out_rm, &[]));
    assert!(out_rm.join("model.safetensors").is_file() && out_rm.join("tokenizer.json").is_file());

    // Partial freezing of the reward model: the last encoder layer and the head move, the
    // embeddings and the layers below come out bitwise unchanged.
    let out_frozen = tmp.path().join("rm-frozen");
    ok(reward(&out_frozen, &["model.trainable_layers=1"]));
    let n_layers = config_usize(&classifier, &["n_layers", "num_hidden_layers"]);
    let top = format!("layer.{}.", n_layers - 1);
    for (name, moved) in moved_tensors(&classifier, &out_frozen) {
        let frozen = name.contains("embeddings") || (name.contains("layer.") && !name.contains(&top));
        assert_eq!(moved, !frozen, "{name}: moved {moved}, frozen {frozen}");
    }

    // Preference pairs train a one-logit head (Bradley–Terry).
    let pairs = tmp.path().join("pairs.jsonl");
    let lines: Vec<String> = (0..8)
        .map(|_| serde_json::json!({"chosen": "great fun", "rejected": "dull mess"}).to_string())
        .collect();
    std::fs::write(&pairs, lines.join("\n")).unwrap();
    ok(rltune(&[
        "reward",
        "--model",
        s(&dir.join("classifier")),
        "--data",
        s(&pairs),
        "--output",
        s(&tmp.path().join("bt")),
        "--set",
        "training.max_steps=2",
    ]));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("bt/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["id2label"].as_object().map(|m| m.len()), Some(1), "{cfg}");

    // Settings errors name the key and suggest the closest one.
    let err = fails(rltune(&[
        "sft",
        "--model",
        s(&dir.join("sft")),
        "--data",
        s(&data),
        "--output",
        s(&out_sft),
        "--set",
        "training.learnig_rate=1e-3",
    ]));
    assert!(err.contains("did you mean \"learning_rate\""), "{err}");
}

/// A copy of the tiny quickstart's SFT policy in `dir/chat-model`, to give a chat template.
fn chat_model(dir: &Path) -> PathBuf {
    let model = dir.join("chat-model");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(quickstart().join("sft")).unwrap() {
        let e = e.unwrap();
        if e.path().is_file() {
            std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
        }
    }
    model
}

/// Conversational data from the command line: `rltune sft` on a `DatasetDict.save_to_disk`
/// directory (Arrow) with `assistant_only_loss` and on JSON lines through `[data] columns`, `rltune
/// dpo` on a `Dataset.save_to_disk` directory of implicit-prompt conversations, and the errors for
/// a template without `{% generation %}` and for a mapped column that is missing.
#[test]
fn conversational_datasets_train_from_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    // The quickstart policy with a chat template that marks the assistant's text.
    let model = chat_model(tmp.path());
    let template = |generation: bool| {
        let (open, close) = if generation { ("{% generation %}", "{% endgeneration %}") } else { ("", "") };
        let t = format!(
            "{{% for m in messages %}}{{% if m.role == 'assistant' %}}{open}{{{{ m.content }}}}{close}\n{{% else %}}{{{{ \
             m.content }}}}\n{{% endif %}}{{% endfor %}}"
        );
        serde_json::json!({ "chat_template": t }).to_string()
    };
    std::fs::write(model.join("tokenizer_config.json"), template(true)).unwrap();
    let disk = common::fixture("datasets/disk");
    let sft = |data: &Path, out: &Path, extra: &[&str]| {
        let mut argv = vec!["sft", "--model", s(&model), "--data", s(data), "--output", s(out)];
        argv.extend([
            "--set",
            "training.max_steps=2",
            "--set",
            "training.eval_fraction=0",
            "--set",
            "sft.max_length=48",
        ]);
        argv.extend(extra.iter().flat_map(|e| ["--set", e]));
        rltune(&argv)
    };
    let out = tmp.path().join("sft-arrow");
    let err =
        String::from_utf8_lossy(&ok(sft(&disk.join("dict"), &out, &["sft.assistant_only_loss=true"])).stderr)
            .into_owned();
    assert!(err.contains("2 steps") && err.contains("on 3 examples"), "{err}");
    assert!(out.join("tokenizer_config.json").is_file(), "the chat template is saved with the model");

    let data = tmp.path().join("chat.jsonl");
    let row = serde_json::json!({"conv": [
        {"role": "user", "content": "Review:"}, {"role": "assistant", "content": "A wonderful film."}]});
    std::fs::write(&data, format!("{row}\n{row}\n")).unwrap();
    ok(sft(&data, &tmp.path().join("sft-columns"), &["data.columns.messages=\"conv\""]));
    let err = fails(sft(&data, &tmp.path().join("bad"), &["data.columns.messages=\"dialogue\""]));
    assert!(
        err.contains("chat.jsonl line 1") && err.contains("\"dialogue\"") && err.contains("\"conv\""),
        "{err}"
    );

    std::fs::write(model.join("tokenizer_config.json"), template(false)).unwrap();
    let err = fails(sft(&disk.join("dict"), &tmp.path().join("bad"), &["sft.assistant_only_loss=true"]));
    assert!(err.contains("{% generation %}") && err.contains("assistant_only_loss = false"), "{err}");

    ok(rltune(&[
        "dpo",
        "--model",
        s(&model),
        "--data",
        s(&disk.join("single")),
        "--output",
        s(&tmp.path().join("dpo")),
        "--set",
        "dpo.max_steps=1",
        "--set",
        "dpo.per_device_train_batch_size=2",
        "--set",
        "dpo.max_length=48",
    ]));
}

/// The quickstart's PPO config with the run directory and step count changed.
fn ppo_args<'a>(run: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<String> {
    let cfg = quickstart().join("ppo.toml");
    let mut v: Vec<String> = vec!["ppo".into(), "--config".into(), s(&cfg).into()];
    for o in [format!("logging.dir={run:?}"), format!("ppo.steps={steps}"), "checkpoint.every=1".into()] {
        v.push("--set".into());
        v.push(o);
    }
    v.extend(extra.iter().map(|e| e.to_string()));
    v
}

fn run_ppo(args: &[String]) -> Output {
    rltune(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn ppo_resumes_from_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    ok(run_ppo(&ppo_args(s(&run), "2", &[])));
    assert_eq!(metrics(&run).len(), 2);
    ok(run_ppo(&ppo_args(s(&run), "4", &["--resume"])));
    let lines = metrics(&run);
    assert_eq!(lines.iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert!(run.join("checkpoints/step-4/model.safetensors").is_file());
    assert!(run.join("checkpoints/step-4/optimizer.safetensors").is_file());

    let fresh = tmp.path().join("fresh");
    let err = fails(run_ppo(&ppo_args(s(&fresh), "2", &["--resume"])));
    assert!(err.contains("no checkpoint"), "{err}");
}

/// A PPO config whose reward is the shell command `script`.
fn command_config(dir: &Path, script: &str, timeout_s: f64) -> PathBuf {
    let qs = quickstart();
    let text = format!(
        r#"
[model]
path = {model:?}
[data]
source = {data:?}
[[reward.sources]]
kind = "command"
command = ["sh", "-c", {script:?}]
timeout_s = {timeout_s}
[generation]
max_new_tokens = 4
[ppo]
batch_size = 4
mini_batch_size = 2
steps = 2
[logging]
dir = {run:?}
"#,
        model = s(&qs.join("sft")),
        data = s(&qs.join("data/prompts.jsonl")),
        run = s(&dir.join("run")),
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn command_reward_faults_are_reported_and_nan_batches_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let case = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    // Answers 1 per line: trains.
    let cfg = command_config(&case("ones"), "while read l; do echo 1; done", 10.0);
    ok(rltune(&["ppo", "--config", s(&cfg)]));

    // A program that dies.
    let cfg = command_config(&case("dies"), "echo 'model file missing' >&2; exit 3", 10.0);
    let err = fails(rltune(&["ppo", "--config", s(&cfg)]));
    assert!(err.contains("model file missing"), "the program's stderr is quoted:\n{err}");

    // A program that never answers.
    let cfg = command_config(&case("hangs"), "sleep 30", 0.5);
    let err = fails(rltune(&["ppo", "--config", s(&cfg)]));
    assert!(err.to_lowercase().contains("timed out") || err.contains("timeout"), "{err}");

    // NaN for the first batch (4 samples), then 1: the batch is skipped with a warning, and the
    // skip is counted in the metrics.
    let script = "n=0; while read l; do n=$((n+1)); if [ $n -le 4 ]; then echo NaN; else echo 1; fi; done";
    let dir = case("nan");
    let cfg = command_config(&dir, script, 10.0);
    let run = dir.join("run");
    let out = ok(rltune(&["ppo", "--config", s(&cfg)]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("skipped"), "{err}");
    let lines = metrics(&run);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["rltune/skipped_batches"], 1.0);
    assert!(lines[0].get("objective/kl").is_none(), "a skipped step has no PPO stats");
    assert_eq!(lines[1]["rltune/skipped_batches"], 1.0);
    assert!(lines[1]["objective/kl"].is_number());
}

#[test]
fn config_errors_name_the_key_and_the_row() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = command_config(tmp.path(), "while read l; do echo 1; done", 10.0);
    let text = std::fs::read_to_string(&cfg).unwrap().replace("max_new_tokens", "max_new_tokns");
    std::fs::write(&cfg, text).unwrap();
    let err = fails(rltune(&["ppo", "--config", s(&cfg)]));
    assert!(err.contains("did you mean \"max_new_tokens\"") && err.contains("run.toml"), "{err}");

    let cfg = command_config(tmp.path(), "while read l; do echo 1; done", 10.0);
    let data = tmp.path().join("prompts.jsonl");
    std::fs::write(&data, "{\"text\": \"a fine film\"}\n{\"body\": \"no text here\"}\n").unwrap();
    let err = fails(rltune(&["ppo", "--config", s(&cfg), "--set", &format!("data.source={:?}", s(&data))]));
    assert!(err.contains("line 2") && err.contains("text"), "{err}");

    let err = fails(rltune(&["ppo", "--config", s(&tmp.path().join("missing.toml"))]));
    assert!(err.contains("missing.toml"), "{err}");
}

#[test]
fn ctrl_c_finishes_the_step_writes_a_checkpoint_and_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let args = ppo_args(s(&run), "100000", &["--set", "checkpoint.every=0"]);
    let child = Command::new(env!("CARGO_BIN_EXE_rltune"))
        .args(&args)
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while std::fs::read_to_string(run.join("metrics.jsonl")).map_or(true, |t| t.lines().count() < 2) {
        assert!(started.elapsed().as_secs() < 120, "no PPO step within 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // The shell's status for a command ended by Ctrl-C; the run itself ended cleanly.
    assert_eq!(out.status.code(), Some(130), "exit status {:?}:\n{err}", out.status);
    assert!(err.contains("Ctrl-C") && err.contains("--resume continues it"), "{err}");
    let steps = metrics(&run).len();
    assert!(steps < 100000);
    assert!(
        run.join(format!("checkpoints/step-{steps}/model.safetensors")).is_file(),
        "a checkpoint of the last finished step ({steps})"
    );
    assert!(run.join("report.html").is_file());
}

/// `rltune sft` stopped by Ctrl-C exits 130 with a checkpoint (in `OUTPUT.checkpoints`, every
/// `save_steps`) and writes no output; the same command with `--resume` then writes the model a
/// run that never stopped writes, byte for byte.
#[test]
fn sft_stopped_by_ctrl_c_resumes_to_the_straight_runs_model() {
    let qs = quickstart();
    let tmp = tempfile::tempdir().unwrap();
    let sft = |out: &Path| -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rltune"));
        cmd.args(["sft", "--model", s(&qs.join("sft")), "--data", s(&qs.join("data/reviews.jsonl"))])
            .args(["--output", s(out), "--set", "training.max_steps=300", "--set", "training.save_steps=2"])
            .args(["--set", "training.batch_size=2", "--set", "training.eval_fraction=0"])
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let (straight, stopped) = (tmp.path().join("straight"), tmp.path().join("stopped"));
    let out = sft(&straight).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let child = sft(&stopped).spawn().unwrap();
    let checkpoints = tmp.path().join("stopped.checkpoints");
    let started = std::time::Instant::now();
    while !checkpoints.join("step-2/trainer_state.json").is_file() {
        assert!(started.elapsed().as_secs() < 120, "no checkpoint within 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("--resume continues it") && !stopped.exists(), "{err}");

    let out = sft(&stopped).arg("--resume").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(bytes(&stopped) == bytes(&straight), "the resumed model differs from the straight run's");
}

/// `rltune reward` killed by SIGKILL keeps its `step-N/` checkpoints, and `--resume` from the
/// last of them writes the model of a run that never stopped, byte for byte: the reward model
/// goes through the same run loop, checkpoints and replay as every other trainer.
#[test]
fn reward_model_killed_resumes_to_the_straight_runs_model() {
    let qs = quickstart();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("labels.jsonl");
    let lines: Vec<String> = (0..24)
        .map(|i| {
            let (text, label) =
                if i % 3 == 0 { ("great fun", "POSITIVE") } else { ("dull mess", "NEGATIVE") };
            serde_json::json!({"text": text, "label": label}).to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let reward = |out: &Path| -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rltune"));
        cmd.args(["reward", "--model", s(&qs.join("classifier")), "--data", s(&data), "--output", s(out)])
            .args(["--set", "training.max_steps=1000", "--set", "training.save_steps=2"])
            .args(["--set", "training.batch_size=2", "--set", "training.eval_fraction=0"])
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let (straight, killed) = (tmp.path().join("straight"), tmp.path().join("killed"));
    let out = reward(&straight).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let child = reward(&killed).spawn().unwrap();
    let checkpoints = tmp.path().join("killed.checkpoints");
    let started = std::time::Instant::now();
    while !checkpoints.join("step-4/trainer_state.json").is_file() {
        assert!(started.elapsed().as_secs() < 120, "no checkpoint within 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(Command::new("kill").args(["-KILL", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), None, "killed by a signal");
    assert!(!killed.join("model.safetensors").exists(), "a killed run wrote its model");

    let out = reward(&killed).arg("--resume").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(bytes(&killed) == bytes(&straight), "the resumed model differs from the straight run's");
}

/// The quickstart's PPO config in `dir/run.toml` for a run in `dir/run`: checkpoints with
/// optimizer state every 2 steps, two epochs of two shuffled minibatches, score scaling (the
/// running moments), and a second reward source, a command that answers 0 for each sample
/// (the sum is unchanged); when `RLTUNE_TEST_BLOCK_AFTER` is set it hangs after that many
/// samples, and with `RLTUNE_TEST_BATCH_SLEEP` it sleeps that long at each batch's start.
fn resumable_config(dir: &Path) -> PathBuf {
    let base = std::fs::read_to_string(quickstart().join("ppo.toml")).unwrap();
    let script = "n=0; while read l; do n=$((n+1)); \
                  if [ -n \"$RLTUNE_TEST_BLOCK_AFTER\" ] && [ $n -gt \"$RLTUNE_TEST_BLOCK_AFTER\" ]; then sleep 600; fi; \
                  if [ -n \"$RLTUNE_TEST_BATCH_SLEEP\" ] && [ $((n % 8)) -eq 1 ]; then sleep $RLTUNE_TEST_BATCH_SLEEP; fi; \
                  echo 0; done";
    let text = format!(
        "{base}\n[[reward.sources]]\nkind = \"command\"\ncommand = [\"sh\", \"-c\", {script:?}]\ntimeout_s = 900\n"
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `rltune ppo` on `config` for `steps` steps, with the settings of [`resumable_config`].
fn resumable_ppo(config: &Path, run: &Path, steps: usize, resume: bool) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rltune"));
    cmd.args(["ppo", "--config", s(config)]);
    for o in [
        format!("logging.dir={:?}", s(run)),
        format!("ppo.steps={steps}"),
        "checkpoint.every=2".into(),
        "checkpoint.optimizer_state=true".into(),
        "ppo.ppo_epochs=2".into(),
        "ppo.use_score_scaling=true".into(),
    ] {
        cmd.args(["--set", &o]);
    }
    if resume {
        cmd.arg("--resume");
    }
    cmd.env("HF_HUB_OFFLINE", "1").env("RUST_LOG", "warn");
    cmd
}

/// The metrics lines without the wall-clock `time/*` keys.
fn metrics_without_times(run: &Path) -> Vec<serde_json::Value> {
    metrics(run)
        .into_iter()
        .map(|mut m| {
            m.as_object_mut().unwrap().retain(|k, _| !k.starts_with("time/"));
            m
        })
        .collect()
}

/// Kills `child`'s whole process group (it was started as a group leader) with SIGKILL.
fn kill_group(child: &mut std::process::Child) {
    let pgid = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &pgid]).status();
    let _ = child.wait();
}

/// Regression (issue #28, defect 2): `--resume` restored the weights, Adam and the KL
/// controller but not the minibatch-shuffle stream, so step 3's update differed from an
/// uninterrupted run's. Now 4 steps straight through and 2 steps, SIGKILL in the middle of
/// step 4 (after step 3 was logged), then `--resume` to 4 give the same bits and the same
/// metrics and samples lines; step 3's line from the killed run is dropped.
#[test]
fn ppo_resume_after_sigkill_is_bitwise_identical_to_a_straight_run() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let config = resumable_config(tmp.path());
    let straight = tmp.path().join("straight");
    let out = resumable_ppo(&config, &straight, 4, false).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Hang on the 4th batch's reward (8 samples a batch): steps 1–3 are logged, step 2 saved.
    let resumed = tmp.path().join("resumed");
    let mut child = resumable_ppo(&config, &resumed, 4, false)
        .env("RLTUNE_TEST_BLOCK_AFTER", "24")
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let complete_lines = |run: &Path| {
        std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.matches('\n').count())
    };
    while complete_lines(&resumed) < 3 {
        assert!(std::time::Instant::now() < deadline, "the run did not reach step 3");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    kill_group(&mut child);
    assert!(resumed.join("checkpoints/step-2").is_dir() && !resumed.join("checkpoints/step-4").exists());

    let out = resumable_ppo(&config, &resumed, 4, true).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for file in ["model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        let a = std::fs::read(straight.join("checkpoints/step-4").join(file)).unwrap();
        let b = std::fs::read(resumed.join("checkpoints/step-4").join(file)).unwrap();
        assert!(a == b, "checkpoints/step-4/{file} differs between the straight and the resumed run");
    }
    assert_eq!(metrics_without_times(&straight), metrics_without_times(&resumed));
    let samples = |run: &Path| std::fs::read_to_string(run.join("samples.jsonl")).unwrap();
    assert_eq!(samples(&straight), samples(&resumed));
}

/// Issue #28's checkpoint fault: `rltune ppo` killed with SIGKILL 50 times, at random moments
/// (while it loads, samples, trains or writes its checkpoint of every step) and, every other
/// time, in the middle of a checkpoint write, leaves no unreadable checkpoint, and each time
/// resumes from the latest one; the steps finished are never lost.
#[test]
fn sigkill_at_random_moments_leaves_every_checkpoint_readable() {
    use rand::{Rng, SeedableRng};
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let config = resumable_config(tmp.path());
    let run = tmp.path().join("run");
    // Never reached: every run is killed. A checkpoint each step; each step waits 30 ms for its
    // reward, so the ~50 kills leave a few hundred checkpoints, not tens of thousands.
    let steps = 1_000_000;
    let mut rng = rand::rngs::StdRng::seed_from_u64(28);
    let (mut last_done, mut mid_write) = (0, 0);
    for kill in 0..50 {
        let resume = latest(&run).is_some();
        if !resume {
            // Killed before its first checkpoint: nothing finished to keep; start over.
            let _ = std::fs::remove_dir_all(&run);
        }
        let mut cmd = resumable_ppo(&config, &run, steps, resume);
        cmd.args(["--set", "checkpoint.every=1"]).env("RLTUNE_TEST_BATCH_SLEEP", "0.03");
        let log = tmp.path().join(format!("stderr-{kill}"));
        let mut child = cmd
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        if kill % 2 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(rng.gen_range(100..700)));
        } else {
            // Every other kill lands while a checkpoint is being written: as soon as its
            // temporary folder appears, or after a random delay into the write.
            let start = std::time::Instant::now();
            let delay = std::time::Duration::from_micros(rng.gen_range(0..600));
            while !writing(&run) && start.elapsed() < std::time::Duration::from_secs(5) {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            std::thread::sleep(delay);
        }
        let finished = child.try_wait().unwrap().is_some();
        kill_group(&mut child);
        let stderr = std::fs::read_to_string(&log).unwrap();
        assert!(!finished, "kill {kill}: the run ended before it was killed:\n{stderr}");
        mid_write += usize::from(writing(&run));
        let ckpts = checkpoint_steps(&run);
        for step in &ckpts {
            let dir = run.join("checkpoints").join(format!("step-{step}"));
            check_checkpoint(&dir)
                .unwrap_or_else(|e| panic!("kill {kill}: {} unreadable: {e}", dir.display()));
        }
        let done = ckpts.last().copied().unwrap_or(0);
        assert!(done >= last_done, "kill {kill}: the latest checkpoint went back from {last_done} to {done}");
        last_done = done;
    }
    assert!(last_done > 0, "no checkpoint was ever written");
    println!("50 kills: {mid_write} left an unfinished checkpoint write; latest checkpoint step-{last_done}");
    // Stray temporary folders of killed writes are cleared by the next resume.
    let out = resumable_ppo(&config, &run, last_done + 1, true).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| n.starts_with("step-")), "{names:?}");
    let lines = metrics(&run);
    let logged: Vec<u64> = lines.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(logged, (1..=last_done as u64 + 1).collect::<Vec<_>>(), "every step logged once, in order");
}

/// Whether `run/checkpoints` holds an unfinished write (a `.step-N.tmp-PID` folder).
fn writing(run: &Path) -> bool {
    std::fs::read_dir(run.join("checkpoints"))
        .map(|rd| rd.flatten().any(|e| e.file_name().to_string_lossy().contains(".tmp-")))
        .unwrap_or(false)
}

/// The steps of `run/checkpoints/step-N` folders, sorted.
fn checkpoint_steps(run: &Path) -> Vec<usize> {
    let mut steps: Vec<usize> = std::fs::read_dir(run.join("checkpoints"))
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse().ok()).collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    steps
}

fn latest(run: &Path) -> Option<usize> {
    checkpoint_steps(run).last().copied()
}

/// Reads every file of a checkpoint as `--resume` would.
fn check_checkpoint(dir: &Path) -> Result<(), String> {
    for f in ["model.safetensors", "optimizer.safetensors"] {
        candle_core::safetensors::load(dir.join(f), &candle_core::Device::Cpu)
            .map_err(|e| format!("{f}: {e}"))?;
    }
    for f in ["config.json", "trainer_state.json"] {
        let text = std::fs::read_to_string(dir.join(f)).map_err(|e| format!("{f}: {e}"))?;
        serde_json::from_str::<serde_json::Value>(&text).map_err(|e| format!("{f}: {e}"))?;
    }
    Ok(())
}

/// `rltune play` with the random baseline and with a model, on the generated adventures:
/// `--json` prints the documented keys, `--transcripts` one line per episode.
#[test]
fn play_reports_win_rates_for_the_random_agent_and_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    let env = repo_config("adventure.toml");
    let keys =
        ["episodes", "win_rate", "mean_score", "mean_normalized_score", "mean_steps", "invalid_action_rate"];
    let transcripts = tmp.path().join("t.jsonl");
    let out = ok(rltune(&[
        "play",
        "--env",
        s(&env),
        "--agent",
        "random",
        "--episodes",
        "40",
        "--json",
        "--transcripts",
        s(&transcripts),
    ]));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in keys {
        assert!(report[k].is_number(), "{k} in {report}");
    }
    assert_eq!(report["episodes"], 40);
    let win = report["win_rate"].as_f64().unwrap();
    assert!(win > 0.0 && win < 0.5, "the random agent wins sometimes: {report}");
    assert_eq!(report["invalid_action_rate"], 0.0, "it only plays admissible commands");
    let lines = std::fs::read_to_string(&transcripts).unwrap();
    assert_eq!(lines.lines().count(), 40);
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert!(first["turns"][0]["action"].is_string() && first["objective"].is_string(), "{first}");

    // A (tiny, untrained) model plays too: its prompt is fitted to its 48 positions.
    let model = quickstart().join("sft");
    let out = ok(rltune(&[
        "play",
        "--env",
        s(&env),
        "--model",
        s(&model),
        "--episodes",
        "4",
        "--json",
        "--set",
        "env.max_steps=3",
    ]));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["episodes"].as_u64(), report["mean_steps"].as_f64()),
        (Some(4), Some(3.0)),
        "{report}"
    );

    let err = fails(rltune(&["play", "--env", s(&env), "--agent", "random", "--set", "env.kind=chess"]));
    assert!(err.contains("chess") && err.contains("adventure"), "{err}");
}

/// Issue #28's full-disk fault, injected as a file-size limit (`ulimit -f`, with SIGXFSZ
/// ignored, so writes past it fail with EFBIG as on a full disk): the checkpoint of step 4
/// cannot be written. The run stops with an error naming that checkpoint and saying the earlier
/// one is intact; nothing of the failed write is left; `--resume` without the limit goes on
/// from step 2 and every step is logged once.
#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_and_loses_no_finished_step() {
    let tmp = tempfile::tempdir().unwrap();
    let config = resumable_config(tmp.path());
    let run = tmp.path().join("run");
    let out = resumable_ppo(&config, &run, 2, false).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let model_bytes = std::fs::metadata(run.join("checkpoints/step-2/model.safetensors")).unwrap().len();
    // Room for the logs, not for another model file (dash's `ulimit -f` counts 512-byte blocks).
    let blocks = model_bytes / 2 / 512;
    let inner = resumable_ppo(&config, &run, 6, true);
    let mut argv = vec![inner.get_program().to_string_lossy().into_owned()];
    argv.extend(inner.get_args().map(|a| a.to_string_lossy().into_owned()));
    let quoted: Vec<String> = argv.iter().map(|a| format!("'{}'", a.replace('\'', "'\\''"))).collect();
    let script = format!("trap '' XFSZ; ulimit -f {blocks}; exec {}", quoted.join(" "));
    let out = Command::new("sh").args(["-c", &script]).env("RUST_LOG", "warn").output().unwrap();
    let err = fails(out);
    assert!(err.contains("step-4") && err.contains("could not be written"), "{err}");
    assert!(err.contains("step 2 is intact") && err.contains("--resume"), "{err}");
    assert_eq!(checkpoint_steps(&run), [2], "no partial step-4");
    assert!(!writing(&run), "the failed write's temporary folder was removed");
    check_checkpoint(&run.join("checkpoints/step-2")).unwrap();

    let out = resumable_ppo(&config, &run, 6, true).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let steps: Vec<u64> = metrics(&run).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    assert_eq!(checkpoint_steps(&run), [2, 4, 6]);
}

/// Issue #29: `rltune ppo` with `[env]` plays text games: episode metrics every step, held-out
/// evaluation when due, transcripts, the report's episodes figure; `--resume` goes on.
#[test]
fn ppo_on_text_games_logs_episodes_evaluates_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let config = tmp.path().join("games.toml");
    let model = quickstart().join("sft");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {model:?}\n[env]\nkind = \"adventure\"\nnum_envs = 4\nmax_steps = 3\n\
             [agent]\nmemory_turns = 1\n[generation]\nmax_new_tokens = 4\n\
             [ppo]\nbatch_size = 8\nmini_batch_size = 4\nsteps = 2\n\
             [episodes]\neval_every = 2\neval_episodes = 4\ntranscripts_per_step = 2\n\
             [logging]\ndir = {run:?}\n[checkpoint]\nevery = 1\noptimizer_state = true\n",
            model = s(&model),
            run = s(&run)
        ),
    )
    .unwrap();
    ok(rltune(&["ppo", "--config", s(&config)]));
    let lines = metrics(&run);
    assert_eq!(lines.len(), 2);
    for m in &lines {
        for key in [
            "env/win_rate",
            "env/episodes",
            "env/episode_length_mean",
            "env/invalid_action_rate",
            "env/reward_mean",
            "objective/kl",
            "time/rollout/env",
        ] {
            assert!(m[key].is_number(), "step {}: {key} missing in {m}", m["step"]);
        }
        assert!(m["env/episodes"].as_f64().unwrap() >= 3.0, "8 turns of 3-move episodes: {m}");
    }
    assert!(lines[0].get("eval/win_rate").is_none() && lines[1]["eval/win_rate"].is_number());
    assert_eq!(lines[1]["eval/episodes"], 4.0);
    let transcripts = std::fs::read_to_string(run.join("transcripts.jsonl")).unwrap();
    let t: Vec<serde_json::Value> = transcripts.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(t.iter().map(|x| x["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 1, 2, 2]);
    assert!(t[0]["turns"][0]["action"].is_string() && t[0]["objective"].is_string(), "{}", t[0]);
    // Each training turn shows the game's admissible set and the sampled action's logprob.
    for turn in t.iter().flat_map(|x| x["turns"].as_array().unwrap()) {
        assert!(turn["admissible"].as_array().is_some_and(|a| !a.is_empty()), "{turn}");
        assert!(turn["logprob"].as_f64().is_some_and(|l| l <= 0.0), "{turn}");
    }
    let report = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(report.contains("id=\"plot-episodes\"") && report.contains("eval/win_rate"));

    ok(rltune(&["ppo", "--config", s(&config), "--resume", "--set", "ppo.steps=3"]));
    let steps: Vec<u64> = metrics(&run).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3]);

    // Both data sources, or a reward source with games: clear errors.
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}[data]\nsource = \"p.jsonl\"\n")).unwrap();
    let err = fails(rltune(&["ppo", "--config", s(&config)]));
    assert!(err.contains("[data] source and [env]"), "{err}");
}

/// One PPO step on the letter toy (8 episodes of 3 turns a round) from the quickstart's SFT
/// policy, in `dir/NAME`, with `ppo` and `episodes` as the bodies of those tables (`steps = 1`
/// is added). Returns the config file and the step's metrics.
fn letters_first_step(dir: &Path, name: &str, ppo: &str, episodes: &str) -> (PathBuf, serde_json::Value) {
    let model = quickstart().join("sft");
    let run = dir.join(name);
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {model:?}\n[env]\nkind = \"letters\"\nnum_envs = 8\nturns = 3\n\
             [agent]\nmemory_turns = 1\n[generation]\nmax_new_tokens = 4\n\
             [ppo]\n{ppo}\nsteps = 1\n[episodes]\n{episodes}\n[logging]\ndir = {run:?}\n",
            model = s(&model),
            run = s(&run)
        ),
    )
    .unwrap();
    ok(rltune(&["ppo", "--config", s(&config)]));
    (config, metrics(&run).remove(0))
}

/// `[episodes] turn_lambda` changes the credit across turns and nothing else: the same first
/// step on the letter toy (3-turn episodes) plays the same turns with the same logprobs, and
/// its returns differ (with `game_gamma` ½, λ = 1 discounts the final state's value once per
/// later turn, where λ = 0 reads each next state's value once; the tiny model's head gives
/// every state about the same value, so the two differ wherever a turn has a successor). A value
/// outside [0, 1] is refused, naming the key.
#[test]
fn turn_lambda_changes_the_returns_not_the_rollout() {
    let tmp = tempfile::tempdir().unwrap();
    let first_step = |lambda: &str| {
        let episodes = format!("game_gamma = 0.5\nturn_lambda = {lambda}");
        letters_first_step(
            tmp.path(),
            &format!("lambda-{lambda}"),
            "batch_size = 8\nmini_batch_size = 4",
            &episodes,
        )
    };
    let ((bad, td0), (_, mc)) = (first_step("0.0"), first_step("1.0"));
    for key in ["rltune/logprobs_mean", "env/reward_mean", "tokens/responses_len_mean"] {
        assert_eq!(td0[key], mc[key], "{key}: the rollout must not change");
    }
    assert_ne!(td0["ppo/returns/mean"], mc["ppo/returns/mean"], "the returns must change");

    let err = fails(rltune(&["ppo", "--config", s(&bad), "--set", "episodes.turn_lambda=1.5"]));
    assert!(err.contains("turn_lambda") && err.contains("[0, 1]"), "{err}");
}

/// `[episodes] train_turns = "round"`: a step trains on every turn of one round less the
/// remainder modulo the minibatch. On the letter toy (8 episodes of 3 turns: 24 turns a round)
/// with minibatches of 5, it trains on 20 turns and leaves 4, where `"batch"` takes exactly
/// `batch_size` = 10 and leaves 14; both play one round.
#[test]
fn round_train_turns_trains_on_every_turn_of_a_round() {
    let tmp = tempfile::tempdir().unwrap();
    let counts = |turns: &str| {
        let episodes = format!("train_turns = \"{turns}\"");
        let (_, m) = letters_first_step(
            tmp.path(),
            &format!("turns-{turns}"),
            "batch_size = 10\nmini_batch_size = 5",
            &episodes,
        );
        ["env/episodes", "env/trained_turns", "env/unused_turns"].map(|k| m[k].as_f64().unwrap())
    };
    assert_eq!(counts("batch"), [8.0, 10.0, 14.0]);
    assert_eq!(counts("round"), [8.0, 20.0, 4.0]);
}

/// Issue #29: rejection sampling as a trainer of its own (`[algorithm] kind =
/// "rejection_sampling"`). On the letter toy, keeping the best quarter of the turns by return
/// and fine-tuning on them raises the reward (measured: 0.025 over the first 4 of 20 steps,
/// 0.242 over the last 4, with one Adam state for the run; 0.020 → 0.182 when each step's
/// fine-tuning started a fresh AdamW). On prompts with 4 samples each, the best of each prompt's 4 is kept.
#[test]
fn rejection_sampling_learns_the_letter_toy_and_distils_the_best_of_n() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("letters");
    let config = tmp.path().join("rs.toml");
    let model = quickstart().join("sft");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {model:?}\n[algorithm]\nkind = \"rejection_sampling\"\n\
             [rejection]\nkeep_top_fraction = 0.25\nlearning_rate = 3e-3\nepochs = 2\nbatch_size = 8\n\
             [env]\nkind = \"letters\"\nnum_envs = 16\nturns = 2\n[agent]\nmemory_turns = 1\n\
             [generation]\nmax_new_tokens = 6\n[ppo]\nbatch_size = 32\nmini_batch_size = 8\nsteps = 20\n\
             [logging]\ndir = {run:?}\n",
            model = s(&model),
            run = s(&run)
        ),
    )
    .unwrap();
    ok(rltune(&["ppo", "--config", s(&config)]));
    let lines = metrics(&run);
    let reward: Vec<f64> = lines.iter().map(|m| m["env/reward_mean"].as_f64().unwrap()).collect();
    for m in &lines {
        assert_eq!(m["rejection/kept"], 8.0, "a quarter of 32 turns: {m}");
        assert!(m["rejection/sft_loss"].is_number() && m["objective/kl"].is_number(), "{m}");
    }
    let (first, last) = (reward[..4].iter().sum::<f64>() / 4.0, reward[16..].iter().sum::<f64>() / 4.0);
    println!("rejection sampling on letters: reward {first:.3} -> {last:.3}; {reward:.3?}");
    assert!(last > first + 0.05, "no learning: {reward:?}");

    // Best-of-4 on prompts, scored by a command (the length of each request line).
    let base = std::fs::read_to_string(quickstart().join("ppo.toml")).unwrap();
    let prompts = tmp.path().join("prompts.toml");
    let script = "while read l; do echo ${#l}; done";
    std::fs::write(
        &prompts,
        format!("{base}\n[[reward.sources]]\nkind = \"command\"\ncommand = [\"sh\", \"-c\", {script:?}]\n"),
    )
    .unwrap();
    let run = tmp.path().join("prompts");
    let sets = [
        format!("logging.dir={:?}", s(&run)),
        "algorithm.kind=rejection_sampling".into(),
        "rejection.samples_per_prompt=4".into(),
        "rejection.keep_top_n=1".into(),
        "ppo.steps=2".into(),
    ];
    let mut args = vec!["ppo", "--config", s(&prompts)];
    for o in &sets {
        args.extend(["--set", o.as_str()]);
    }
    ok(rltune(&args));
    for m in metrics(&run) {
        let b = m["rejection/candidates"].as_f64().unwrap() / 4.0;
        assert_eq!(m["rejection/kept"].as_f64(), Some(b), "one of each prompt's 4: {m}");
        assert!(m["rejection/kept_score_mean"].as_f64() >= m["rejection/score_mean"].as_f64(), "{m}");
    }
}

/// `quickstart --task arithmetic --preset tiny`: data, tokenizer, SFT, GRPO and evaluation run;
/// `--algorithm rloo` in the same directory reuses the SFT policy; the RL stage's config reruns
/// with `rltune ppo` (GRPO in the training loop), and resumes.
#[test]
fn arithmetic_quickstart_runs_grpo_and_rloo_from_one_sft_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qa");
    let out = ok(rltune(&["quickstart", "--task", "arithmetic", "--preset", "tiny", "--output", s(&dir)]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("held-out accuracy: greedy") && stdout.contains("GRPO policy"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary-grpo.json")).unwrap()).unwrap();
    assert_eq!(summary["curve"].as_array().unwrap().len(), 2);
    assert_eq!(summary["sft"]["n"], 32);
    let grpo = metrics(&dir.join("grpo"));
    for key in
        ["reward", "reward_std", "kl", "entropy", "completions/mean_length", "rewards/exact_match/mean"]
    {
        assert!(grpo[0][key].is_number(), "{key} missing in {}", grpo[0]);
    }
    let report = std::fs::read_to_string(dir.join("grpo/report.html")).unwrap();
    assert!(report.contains("plot-group") && report.contains("completions/mean_length"), "no GRPO figure");

    let out = ok(rltune(&[
        "quickstart",
        "--task",
        "arithmetic",
        "--preset",
        "tiny",
        "--algorithm",
        "rloo",
        "--output",
        s(&dir),
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[sft] cached") && err.contains("[rloo] started"), "{err}");
    assert!(dir.join("summary-rloo.json").is_file() && dir.join("rloo/checkpoints/step-2").is_dir());

    // The GRPO stage as an ordinary `rltune ppo` run, resumed to 4 steps.
    let run = tmp.path().join("again");
    let cfg = dir.join("grpo.toml");
    let set = |steps: &str| {
        vec![
            "--set".to_string(),
            format!("logging.dir={:?}", s(&run)),
            "--set".into(),
            format!("grpo.max_steps={steps}"),
        ]
    };
    let mut args: Vec<String> = vec!["ppo".into(), "--config".into(), s(&cfg).into()];
    ok(run_ppo(&[args.clone(), set("2")].concat()));
    args.push("--resume".into());
    ok(run_ppo(&[args, set("4")].concat()));
    let lines = metrics(&run);
    assert_eq!(lines.iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert!(run.join("checkpoints/step-4/optimizer.safetensors").is_file());
    let err = fails(rltune(&["ppo", "--config", s(&cfg), "--set", "ppo.steps=3"]));
    assert!(err.contains("[ppo] is set but [algorithm] kind = \"grpo\""), "{err}");
    let err =
        fails(rltune(&["quickstart", "--task", "sentiment", "--algorithm", "rloo", "--output", s(&dir)]));
    assert!(err.contains("--algorithm is for --task arithmetic"), "{err}");
}

/// Issue #39: `[agent] actions = "admissible"` makes a model agent write only the game's
/// admissible commands (the tiny adventure BC policy writes none of them freely: it is barely
/// trained), so `rltune play` reports no invalid action, and PPO trains in that mode with no
/// invalid turn, as does trajectory GRPO; a game without a command list is refused in that
/// mode with the fix.
#[test]
fn admissible_actions_are_always_valid_in_play() {
    let tmp = tempfile::tempdir().unwrap();
    let qs = tmp.path().join("qs");
    ok(rltune(&["quickstart", "--task", "adventure", "--preset", "tiny", "--output", s(&qs)]));
    // `--algorithm grpo` in the same folder trains trajectory GRPO from the cached BC policy and
    // writes its own run, config and summary beside PPO's.
    let out = ok(rltune(&[
        "quickstart",
        "--task",
        "adventure",
        "--preset",
        "tiny",
        "--output",
        s(&qs),
        "--algorithm",
        "grpo",
    ]));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("stages run: grpo") && shown.contains("GRPO policy"), "{shown}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(qs.join("summary-grpo.json")).unwrap()).unwrap();
    assert_eq!(summary["config"]["algorithm"], "grpo");
    assert_eq!(summary["ppo"]["episodes"], 8);
    // Validation games (disjoint from the test ones) for both policies.
    assert_eq!(summary["validation"]["rl"]["episodes"], 4);
    assert_eq!(summary["validation"]["bc"]["episodes"], 4);
    assert!(
        qs.join("grpo/checkpoints/step-2/model.safetensors").is_file() && qs.join("summary.json").is_file()
    );
    // The cached GRPO stage is not reported under other settings: a changed seed is refused,
    // naming the table; the same settings on another device are not a change.
    let mut args = vec!["quickstart", "--task", "adventure", "--preset", "tiny", "--output", s(&qs)];
    args.extend(["--algorithm", "grpo", "--set", "grpo.seed=7"]);
    let err = fails(rltune(&args));
    assert!(err.contains("trained with other settings") && err.contains("[grpo]"), "{err}");
    // PPO's settings are the PPO stage's alone: a new PPO seed is refused by that stage, naming
    // its table, not by the demonstrations and the BC policy every RL stage shares.
    let mut args = vec!["quickstart", "--task", "adventure", "--preset", "tiny", "--output", s(&qs)];
    args.extend(["--set", "ppo.seed=7"]);
    let err = fails(rltune(&args));
    assert!(err.contains("trained with other settings") && err.contains("[ppo]"), "{err}");
    let rerun =
        ["quickstart", "--task", "adventure", "--preset", "tiny", "--output", s(&qs), "--algorithm", "grpo"];
    let shown = String::from_utf8_lossy(&ok(rltune(&[&rerun[..], &["--device", "cpu"]].concat())).stdout)
        .into_owned();
    assert!(shown.contains("stages run: eval") && !shown.contains("stages run: grpo"), "{shown}");
    // More test episodes evaluate the cached policies again; nothing is retrained.
    let shown =
        String::from_utf8_lossy(&ok(rltune(&[&rerun[..], &["--set", "eval_episodes=12"]].concat())).stdout)
            .into_owned();
    assert!(shown.contains("stages run: eval") && !shown.contains("stages run: grpo"), "{shown}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(qs.join("summary-grpo.json")).unwrap()).unwrap();
    assert_eq!(
        (summary["ppo"]["episodes"].as_u64(), summary["ppo_vs_bc"]["episodes"].as_u64()),
        (Some(12), Some(12))
    );
    // Every evaluated episode is kept, and re-reads the summary's rates and paired difference.
    let records: Vec<serde_json::Value> = std::fs::read_to_string(qs.join("episodes-grpo.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let won = |split: &str, agent: &str| -> Vec<f64> {
        records
            .iter()
            .filter(|r| r["split"] == split && r["agent"] == agent)
            .map(|r| f64::from(u8::from(r["won"].as_bool().unwrap())))
            .collect()
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    for (split, agent, report) in [
        ("test", "random", &summary["random"]),
        ("test", "bc", &summary["bc"]),
        ("test", "grpo", &summary["ppo"]),
        ("validation", "bc", &summary["validation"]["bc"]),
        ("validation", "grpo", &summary["validation"]["rl"]),
    ] {
        let w = won(split, agent);
        assert_eq!(w.len() as u64, report["episodes"].as_u64().unwrap(), "{split} {agent}");
        assert!((mean(&w) - report["win_rate"].as_f64().unwrap()).abs() < 1e-12, "{split} {agent}");
    }
    let delta = mean(&won("test", "grpo")) - mean(&won("test", "bc"));
    assert!((delta - summary["ppo_vs_bc"]["delta"].as_f64().unwrap()).abs() < 1e-12);
    // One adventure game an episode: the clustered error is the plain one.
    assert_eq!(summary["ppo_vs_bc"]["se"], summary["ppo_vs_bc"]["se_plain"]);
    // bench/paired_by_game.py recomputes both errors from the records and checks them against
    // the summary beside them (it exits non-zero on a disagreement).
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/paired_by_game.py");
    let records_file = qs.join("episodes-grpo.jsonl");
    for split in ["test", "validation"] {
        let args = [s(&script), s(&records_file), "--split", split];
        match std::process::Command::new("python3").args(args).output() {
            Ok(out) => {
                let shown =
                    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
                assert!(out.status.success() && shown.contains("agrees with"), "{split}: {shown}");
            }
            Err(e) => eprintln!("python3 not found ({e}): bench/paired_by_game.py not checked"),
        }
    }
    // `--algorithm gigpo`: GRPO with GiGPO's step credit, in its own folder, with its metrics.
    let args =
        ["quickstart", "--task", "adventure", "--preset", "tiny", "--output", s(&qs), "--algorithm", "gigpo"];
    let shown = String::from_utf8_lossy(&ok(rltune(&args)).stdout).into_owned();
    assert!(shown.contains("stages run: gigpo") && shown.contains("GIGPO policy"), "{shown}");
    let config = std::fs::read_to_string(qs.join("gigpo.toml")).unwrap();
    assert!(config.contains("[episodes.gigpo]") && config.contains("kind = \"grpo\""), "{config}");
    let logged = metrics(&qs.join("gigpo"));
    assert!(logged.iter().all(|m| m["gigpo/step_group_size"].as_f64().unwrap() >= 1.0), "{logged:?}");
    assert!(qs.join("summary-gigpo.json").is_file());
    let err = fails(rltune(&["quickstart", "--task", "essays", "--preset", "tiny", "--algorithm", "grpo"]));
    assert!(err.contains("--algorithm is for --task arithmetic, adventure or textworld"), "{err}");
    let env = repo_config("adventure.toml");
    let bc = qs.join("bc");
    let play = |mode: &str| {
        let out = ok(rltune(&[
            "play",
            "--env",
            s(&env),
            "--model",
            s(&bc),
            "--episodes",
            "16",
            "--json",
            "--set",
            &format!("agent.actions=\"{mode}\""),
        ]));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (free, admissible) = (play("free"), play("admissible"));
    println!("tiny adventure BC: free {free}\nadmissible {admissible}");
    assert_eq!(admissible["invalid_action_rate"].as_f64(), Some(0.0), "{admissible}");
    assert!(free["invalid_action_rate"].as_f64().unwrap() > 0.0, "the test needs a policy that errs: {free}");

    // The transcripts show each turn's admissible set and the chosen command's logprob under the
    // constrained distribution (a probability, below 1 where there was a choice); --show prints them.
    let transcripts = tmp.path().join("t.jsonl");
    let out = ok(rltune(&[
        "play",
        "--env",
        s(&env),
        "--model",
        s(&bc),
        "--episodes",
        "4",
        "--show",
        "1",
        "--transcripts",
        s(&transcripts),
        "--set",
        "agent.actions=\"admissible\"",
    ]));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("=== episode 0") && shown.contains("admissible (") && shown.contains("logprob"),
        "{shown}"
    );
    let turns: Vec<serde_json::Value> = std::fs::read_to_string(&transcripts)
        .unwrap()
        .lines()
        .flat_map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["turns"].as_array().unwrap().clone()
        })
        .collect();
    let mut choices = 0;
    for t in &turns {
        let set: Vec<&str> =
            t["admissible"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
        let lp = t["logprob"].as_f64().unwrap();
        assert!(set.contains(&t["action"].as_str().unwrap()), "{t}");
        assert!(lp <= 1e-6 && lp.is_finite(), "{t}");
        assert!(set.len() > 1 || lp.abs() < 1e-6, "one command has probability 1: {t}");
        choices += usize::from(set.len() > 1 && lp < -1e-6);
    }
    assert!(choices > 0, "no turn had a choice: {turns:?}");

    // PPO trains in the same mode: every training turn is a valid command.
    let run = tmp.path().join("run");
    ok(rltune(&[
        "ppo",
        "--config",
        s(&qs.join("ppo.toml")),
        "--set",
        "agent.actions=\"admissible\"",
        "--set",
        &format!("logging.dir={:?}", s(&run)),
    ]));
    let rows = metrics(&run);
    assert!(!rows.is_empty());
    for r in &rows {
        assert_eq!(r["env/invalid_action_rate"].as_f64(), Some(0.0), "{r}");
        assert!(r["objective/kl"].as_f64().is_some_and(f64::is_finite), "{r}");
    }

    // Trajectory GRPO on the same games (issue #39 item 3): groups of 4 plays of 2 games a step,
    // every turn valid, TRL's GRPO metrics beside the episode ones, transcripts; resumes.
    let grpo_run = tmp.path().join("grpo");
    let grpo = tmp.path().join("grpo.toml");
    std::fs::write(
        &grpo,
        format!(
            "[model]\npath = {bc:?}\n[algorithm]\nkind = \"grpo\"\n\
             [env]\nkind = \"adventure\"\nnum_envs = 3\nmax_steps = 4\n\
             [agent]\nactions = \"admissible\"\nmemory_turns = 1\n[generation]\nmax_new_tokens = 8\n\
             [grpo]\nnum_generations = 4\nper_device_train_batch_size = 8\nmax_steps = 2\nbeta = 0.04\n\
             learning_rate = 1e-3\n\
             [episodes]\neval_every = 2\neval_episodes = 4\ntranscripts_per_step = 1\n\
             [logging]\ndir = {run:?}\n[checkpoint]\nevery = 1\noptimizer_state = true\n",
            bc = s(&bc),
            run = s(&grpo_run)
        ),
    )
    .unwrap();
    ok(rltune(&["ppo", "--config", s(&grpo)]));
    let rows = metrics(&grpo_run);
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["env/invalid_action_rate"].as_f64(), Some(0.0), "{r}");
        assert_eq!(r["env/episodes"].as_f64(), Some(8.0), "{r}");
        for key in ["reward", "reward_std", "frac_reward_zero_std", "kl", "loss", "entropy", "env/win_rate"] {
            assert!(r[key].as_f64().is_some_and(f64::is_finite), "{key} in {r}");
        }
        assert!(r["rewards/episode_return/mean"].is_number(), "{r}");
    }
    assert!(rows[0].get("eval/win_rate").is_none() && rows[1]["eval/win_rate"].is_number());
    let transcripts = std::fs::read_to_string(grpo_run.join("transcripts.jsonl")).unwrap();
    assert_eq!(transcripts.lines().count(), 2);
    ok(rltune(&["ppo", "--config", s(&grpo), "--resume", "--set", "grpo.max_steps=3"]));
    let steps: Vec<u64> = metrics(&grpo_run).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3]);

    let letters = tmp.path().join("letters.toml");
    std::fs::write(&letters, "[env]\nkind = \"letters\"\n[agent]\nactions = \"admissible\"\n").unwrap();
    let err = fails(rltune(&["play", "--env", s(&letters), "--model", s(&bc), "--episodes", "2"]));
    assert!(err.contains("lists no admissible command") && err.contains("actions = \"free\""), "{err}");
}

/// `rltune quickstart --task rlhf --preset tiny` end to end on the tiny quickstart's models: a
/// chat policy (its GPT-2 with a chat template), a proxy started from its DistilBERT, and a gold
/// judge speaking the reward-command protocol. Every method leaves its points; the initial
/// policy's KL is 0, best-of-N's is the analytic bound; `heldout.jsonl` holds every final
/// policy's completions; a rerun is cached and gives the same numbers.
#[test]
fn rlhf_quickstart_runs_every_method_and_caches() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path());
    // The prompt's first 16 characters: the tiny policy has 48 positions.
    let template = "{% for m in messages %}{{ m.content[:16] }}\n{% endfor %}";
    std::fs::write(
        model.join("tokenizer_config.json"),
        serde_json::json!({ "chat_template": template }).to_string(),
    )
    .unwrap();
    // The judge: the share of the letter e among the completion's characters.
    let judge = r#"import json,sys
for line in sys.stdin:
    r = json.loads(line)["response"]
    print(json.dumps({"reward": r.count("e") / max(len(r), 1)}), flush=True)"#;
    let out = tmp.path().join("rlhf");
    let (model_set, proxy_set) =
        (format!("model={:?}", s(&model)), format!("proxy_base={:?}", s(&quickstart().join("classifier"))));
    let judge_set = format!("judge=[\"python3\", \"-c\", {judge:?}]");
    let run_with = |extra: &[&str]| {
        let mut argv = vec!["quickstart", "--task", "rlhf", "--preset", "tiny", "--output", s(&out)];
        argv.extend(["--set", &model_set, "--set", &proxy_set, "--set", &judge_set]);
        argv.extend(extra);
        rltune(&argv)
    };
    let run = || run_with(&[]);
    let first = String::from_utf8_lossy(&ok(run()).stdout).into_owned();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let points = summary["points"].as_array().unwrap();
    let of = |m: &str| points.iter().filter(|p| p["method"] == m).collect::<Vec<_>>();
    assert_eq!(of("initial").len(), 1, "{first}");
    assert_eq!(of("initial")[0]["kl"], 0.0);
    let bon = of("best_of_n");
    assert_eq!(bon.len(), 1);
    let bound = 2f64.ln() - 0.5;
    assert!((bon[0]["kl"].as_f64().unwrap() - bound).abs() < 1e-12, "{}", bon[0]["kl"]);
    // Best-of-2 by the proxy scores at least the proxy of the initial policy's first sample.
    assert!(bon[0]["proxy"].as_f64().unwrap() >= of("initial")[0]["proxy"].as_f64().unwrap() - 1e-9);
    // PPO (8 samples in batches of 4: 2 steps), GRPO and RLOO (2 steps), all checkpointed each step.
    for m in ["ppo", "ppo_gold", "grpo", "rloo"] {
        let steps: Vec<u64> = of(m).iter().map(|p| p["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, vec![1, 2], "{m}: {first}");
        assert!(of(m).iter().all(|p| p["kl"].as_f64().unwrap().is_finite()), "{m}");
    }
    assert_eq!(of("dpo").len(), 1, "{first}");
    // DPO's point is labelled with its steps, one metrics line each.
    let dpo_steps = std::fs::read_to_string(out.join("dpo").join("metrics.jsonl")).unwrap().lines().count();
    assert!(dpo_steps > 0);
    assert_eq!(of("dpo")[0]["step"].as_u64(), Some(dpo_steps as u64));
    // PPO's queries are the whole rendered conversation (16 characters and the newline), not a
    // prefix cut to TRL's 2..8 tokens, which would leave the template's header.
    let logged = std::fs::read_to_string(out.join("ppo").join("samples.jsonl")).unwrap();
    for line in logged.lines() {
        for sample in serde_json::from_str::<serde_json::Value>(line).unwrap()["samples"].as_array().unwrap()
        {
            let q = sample["query"].as_str().unwrap();
            assert!(q.ends_with('\n') && q.chars().count() == 17, "cut query {q:?}");
        }
    }
    let heldout = std::fs::read_to_string(out.join("heldout.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = heldout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for m in ["initial", "best_of_2", "ppo", "ppo_gold", "grpo", "rloo", "dpo"] {
        assert_eq!(rows.iter().filter(|r| r["method"] == m).count(), 6, "{m}");
    }
    let report = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(report.contains("<svg") && report.contains("KL (nats per completion)"));
    // A rerun trains nothing and reads the same points.
    let second = String::from_utf8_lossy(&ok(run()).stdout).into_owned();
    assert!(!second.contains("stages run: labels"), "{second}");
    let again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(again["points"], summary["points"]);
    // The validation prompts, to choose settings on, beside the held-out numbers.
    let validation = run_with(&["--set", "evaluate_on=\"validation\""]);
    let text = String::from_utf8_lossy(&ok(validation).stdout).into_owned();
    assert!(text.contains("validation prompts (4)"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary-validation.json")).unwrap()).unwrap();
    assert_eq!(v["points"][0]["completions"].as_array().unwrap().len(), 4);
    assert_eq!(std::fs::read_to_string(out.join("validation.jsonl")).unwrap().lines().count(), 7 * 4);
    let still: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(still["points"], summary["points"]);
    // A cached DPO adapter is not reported under settings it was not trained with.
    let err = fails(run_with(&["--set", "dpo.learning_rate=0.5"]));
    assert!(err.contains("trained with other [dpo] or [lora] settings") && err.contains("delete"), "{err}");
}
