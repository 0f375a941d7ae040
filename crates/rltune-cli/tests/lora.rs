//! LoRA through the command line, on the tiny quickstart's models: PPO, SFT and the reward
//! model with `[lora]` save PEFT-format adapters whose optimizer state holds only the adapters
//! (and the value head or classifier head), `--resume` continues bitwise, `rltune merge` gives the adapted model's logprobs, and
//! bad `[lora]` settings are refused naming the file and field.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::rltune;

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fails_with(o: &Output, parts: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "succeeded; stderr:\n{err}");
    for p in parts {
        assert!(err.contains(p), "{p:?} not in:\n{err}");
    }
}

/// The tiny quickstart (SFT model, classifier, prompts, ppo.toml) in `dir`.
fn quickstart(dir: &Path) -> PathBuf {
    ok(&rltune(&["quickstart", "--preset", "tiny", "--output", dir.to_str().unwrap()]));
    dir.join("ppo.toml")
}

const LORA: [&str; 4] = ["--set", "lora.r=4", "--set", "lora.target_modules=[\"c_attn\", \"c_fc\"]"];

fn ppo(config: &Path, log: &Path, steps: usize, resume: bool) -> Output {
    let log = format!("logging.dir={:?}", log.to_str().unwrap());
    let steps = format!("ppo.steps={steps}");
    let mut args = vec!["ppo", "--config", config.to_str().unwrap(), "--set", &log, "--set", &steps];
    args.extend(["--set", "checkpoint.every=2", "--set", "checkpoint.optimizer_state=true"]);
    args.extend(LORA);
    if resume {
        args.push("--resume");
    }
    rltune(&args)
}

/// `generate --json` logprobs of one sample (seed 0; the full distribution's logprobs, where
/// `--top-k 1` would report the truncated one's zeros).
fn greedy_logprobs(model: &Path, adapter: Option<&Path>) -> Vec<f64> {
    let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,2,3"];
    args.extend(["--max-new-tokens", "6", "--seed", "0", "--json"]);
    if let Some(a) = adapter {
        args.extend(["--adapter", a.to_str().unwrap()]);
    }
    let out = ok(&rltune(&args));
    let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    v["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn ppo_with_lora_saves_an_adapter_that_resumes_bitwise_and_merges() {
    let tmp = tempfile::tempdir().unwrap();
    let config = quickstart(&tmp.path().join("qs"));
    let (straight, resumed) = (tmp.path().join("straight"), tmp.path().join("resumed"));
    ok(&ppo(&config, &straight, 4, false));
    ok(&ppo(&config, &resumed, 2, false));
    ok(&ppo(&config, &resumed, 4, true));
    let ck = straight.join("checkpoints/step-4");
    let mut files: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert!(
        files.contains(&"adapter_config.json".to_string())
            && files.contains(&"value_head.safetensors".into())
    );
    assert!(
        !files.contains(&"model.safetensors".to_string()),
        "a LoRA checkpoint holds no full model: {files:?}"
    );
    for f in &files {
        let (a, b) = (
            std::fs::read(ck.join(f)).unwrap(),
            std::fs::read(resumed.join("checkpoints/step-4").join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs between the straight and the resumed run");
    }
    // The optimizer was given the adapters and the value head only.
    let opt =
        candle_core::safetensors::load(ck.join("optimizer.safetensors"), &candle_core::Device::Cpu).unwrap();
    let names: Vec<&String> = opt.keys().collect();
    assert!(
        names.iter().all(|k| k.contains(".lora_A.") || k.contains(".lora_B.") || k.contains("v_head.")),
        "{names:?}"
    );
    let w = candle_core::safetensors::load(ck.join("adapter_model.safetensors"), &candle_core::Device::Cpu)
        .unwrap();
    assert_eq!(names.len(), 2 * (w.len() + 2), "m and v of every adapter tensor and of the head's two");
    // B moved from zero: the adapter changes the model.
    let b = &w["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"];
    assert!(b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);

    let base = tmp.path().join("qs/sft");
    let merged = tmp.path().join("merged");
    ok(&rltune(&[
        "merge",
        "--model",
        base.to_str().unwrap(),
        "--adapter",
        ck.to_str().unwrap(),
        "--output",
        merged.to_str().unwrap(),
    ]));
    let (adapted, folded) = (greedy_logprobs(&base, Some(&ck)), greedy_logprobs(&merged, None));
    let d = adapted.iter().zip(&folded).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    println!("merged vs adapted sampled logprobs: max diff {d:.2e}");
    assert!(adapted.len() == folded.len() && d < 1e-5, "{adapted:?} vs {folded:?}");
    let plain = greedy_logprobs(&base, None);
    assert!(plain != adapted, "the adapter changes nothing");
}

#[test]
fn sft_with_lora_writes_an_adapter_that_generate_applies() {
    let tmp = tempfile::tempdir().unwrap();
    quickstart(&tmp.path().join("qs"));
    let (base, out) = (tmp.path().join("qs/sft"), tmp.path().join("sft-lora"));
    let data = tmp.path().join("qs/data/reviews.jsonl");
    ok(&rltune(&[
        "sft",
        "--model",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--set",
        "lora.r=2",
        "--set",
        "training.num_train_epochs=1",
    ]));
    assert!(out.join("adapter_model.safetensors").is_file() && !out.join("model.safetensors").exists());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["base_model_name_or_path"], base.to_str().unwrap());
    assert_eq!(cfg["target_modules"], serde_json::json!(["c_attn"]), "PEFT's default for gpt2");
    assert!(greedy_logprobs(&base, Some(&out)) != greedy_logprobs(&base, None));
}

/// `rltune reward` with `[lora]` writes PEFT's `SEQ_CLS` adapter (the head inside), which PPO
/// takes as its reward model directly and `rltune merge` folds into a full classifier.
#[test]
fn reward_with_lora_writes_a_classifier_adapter_that_ppo_and_merge_take() {
    let tmp = tempfile::tempdir().unwrap();
    let config = quickstart(&tmp.path().join("qs"));
    let qs = tmp.path().join("qs");
    let (base, out, merged) =
        (qs.join("classifier"), tmp.path().join("rm-lora"), tmp.path().join("rm-merged"));
    ok(&rltune(&[
        "reward",
        "--model",
        base.to_str().unwrap(),
        "--data",
        qs.join("data/reviews.jsonl").to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--set",
        "lora.r=2",
        "--set",
        "training.num_train_epochs=1",
    ]));
    assert!(out.join("adapter_model.safetensors").is_file() && !out.join("model.safetensors").exists());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["task_type"], "SEQ_CLS");
    assert_eq!(cfg["target_modules"], serde_json::json!(["q_lin", "v_lin"]), "PEFT's default for distilbert");
    assert_eq!(cfg["base_model_name_or_path"], base.to_str().unwrap());
    let printed = ok(&rltune(&[
        "merge",
        "--model",
        base.to_str().unwrap(),
        "--adapter",
        out.to_str().unwrap(),
        "--output",
        merged.to_str().unwrap(),
    ]));
    assert!(printed.contains("the classifier") && merged.join("model.safetensors").is_file(), "{printed}");
    // PPO scores with the adapter directory as its classifier: one step runs.
    let text =
        std::fs::read_to_string(&config).unwrap().replace(base.to_str().unwrap(), out.to_str().unwrap());
    let adapted = tmp.path().join("ppo-lora-reward.toml");
    std::fs::write(&adapted, text).unwrap();
    let log = format!("logging.dir={:?}", tmp.path().join("run").to_str().unwrap());
    ok(&rltune(&["ppo", "--config", adapted.to_str().unwrap(), "--set", &log, "--set", "ppo.steps=1"]));
}

#[test]
fn bad_lora_settings_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let config = quickstart(&tmp.path().join("qs"));
    let c = config.to_str().unwrap();
    let log = format!("logging.dir={:?}", tmp.path().join("run").to_str().unwrap());
    let o = rltune(&["ppo", "--config", c, "--set", &log, "--set", "lora.bias=\"all\""]);
    fails_with(&o, &["ppo.toml", "[lora]", "bias = \"all\"", "\"none\""]);
    let o = rltune(&["ppo", "--config", c, "--set", &log, "--set", "lora.target_modules=[\"q_proj\"]"]);
    fails_with(&o, &["target_modules = [\"q_proj\"]", "matches none", "c_attn", "c_fc", "c_proj"]);
    let o = rltune(&["ppo", "--config", c, "--set", &log, "--set", "lora.rank=4"]);
    fails_with(&o, &["rank"]);
    let qs = tmp.path().join("qs");
    let o = rltune(&[
        "reward",
        "--model",
        qs.join("classifier").to_str().unwrap(),
        "--data",
        qs.join("data/reviews.jsonl").to_str().unwrap(),
        "--output",
        tmp.path().join("rm").to_str().unwrap(),
        "--set",
        "lora.r=4",
        "--set",
        "model.trainable_layers=1",
    ]);
    fails_with(&o, &["--set", "trainable_layers with LoRA", "use one of"]);
    // An adapter of another base: the GPT-2 fixture's adapter on the quickstart's model.
    let adapter = common::fixture("lora/gpt2/peft_adapter");
    let o = rltune(&[
        "generate",
        "--model",
        qs.join("sft").to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
    ]);
    fails_with(
        &o,
        &["adapter_model.safetensors", "has shape", "another base model", "tools/fixtures/lora/gpt2/base"],
    );
}
