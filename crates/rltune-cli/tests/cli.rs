//! The `rltune` binary, run as a user runs it: output format, exit codes, messages.

use std::process::{Command, Output};

mod common;
use common::fixture;

/// Runs `rltune generate --model MODEL ARGS…` with a hub cache that cannot reach the network.
fn generate(model: &str, args: &[&str]) -> Output {
    let hf_home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rltune"))
        .args(["generate", "--model", model])
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", hf_home.path())
        .env("RUST_LOG", "info")
        .output()
        .expect("run rltune");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "rltune panicked:\n{stderr}");
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Each stdout line parsed as a JSON object.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "rltune failed:\n{}", stderr(out));
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Checks one sample object: integer `response_ids`, float `logprobs` (each ≤ 0), same length.
fn check_sample(obj: &serde_json::Value, vocab_size: u64) -> usize {
    let ids = obj["response_ids"].as_array().expect("response_ids is an array");
    let lps = obj["logprobs"].as_array().expect("logprobs is an array");
    assert_eq!(ids.len(), lps.len(), "{obj}");
    assert!(!ids.is_empty(), "{obj}");
    assert!(ids.iter().all(|v| v.as_u64().is_some_and(|id| id < vocab_size)), "{obj}");
    assert!(lps.iter().all(|v| v.is_f64() && v.as_f64().unwrap() <= 0.0), "{obj}");
    ids.len()
}

#[test]
fn json_prints_one_line_per_sample_with_ids_and_logprobs() {
    let model = fixture("models/gpt2_value_head");
    let out = generate(
        model.to_str().unwrap(),
        &["--prompt-ids", "1,2,3", "--num-samples", "3", "--max-new-tokens", "5", "--json"],
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 3, "{}", stdout(&out));
    for (i, obj) in lines.iter().enumerate() {
        assert_eq!(obj["sample"], i);
        assert_eq!(obj["query_ids"], serde_json::json!([1, 2, 3]));
        assert!(check_sample(obj, 101) <= 5);
        assert!(obj.get("text").is_none(), "no tokenizer, so no text: {obj}");
    }
}

#[test]
fn model_directory_without_tokenizer_works_with_prompt_ids() {
    let model = fixture("models/gpt2");
    assert!(!model.join("tokenizer.json").exists());
    let args = ["--prompt-ids", "5,6", "--num-samples", "2", "--max-new-tokens", "4", "--seed", "7"];
    let lines = json_lines(&generate(model.to_str().unwrap(), &[&args[..], &["--json"]].concat()));
    assert_eq!(lines.len(), 2);
    for obj in &lines {
        check_sample(obj, 101);
    }
    // Plain output: one line per sample.
    let out = generate(model.to_str().unwrap(), &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(text.starts_with("[0] (logprob "), "{text}");
}

#[test]
fn prompt_text_is_tokenized_and_responses_decoded_with_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    for (src, name) in
        [("ppo/init/config.json", "config.json"), ("ppo/init/model.safetensors", "model.safetensors")]
    {
        std::fs::copy(fixture(src), dir.path().join(name)).unwrap();
    }
    std::fs::copy(fixture("ppo/tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    let tok = rltune::tokenizer::Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let out = generate(
        dir.path().to_str().unwrap(),
        &["--prompt", "hello", "--num-samples", "2", "--max-new-tokens", "6", "--json"],
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2);
    let want: Vec<u32> = tok.encode("hello").unwrap();
    for obj in &lines {
        check_sample(obj, tok.vocab_size() as u64);
        assert_eq!(obj["query_ids"], serde_json::json!(want));
        let ids: Vec<u32> =
            obj["response_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(obj["text"].as_str(), Some(tok.decode(&ids).unwrap().as_str()), "{obj}");
    }
}

#[test]
fn prompt_text_without_tokenizer_fails_and_suggests_prompt_ids() {
    let model = fixture("models/gpt2");
    let out = generate(model.to_str().unwrap(), &["--prompt", "hello"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("tokenizer.json") && err.contains("--prompt-ids"), "{err}");
    assert!(stdout(&out).is_empty());
}

#[test]
fn hub_id_offline_fails_cleanly_and_says_to_pass_a_local_directory() {
    let out = generate("rltune-test/no-such-model", &["--prompt-ids", "1,2"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("error: cannot load model \"rltune-test/no-such-model\""), "{err}");
    assert!(err.contains("local directory"), "{err}");
}

#[test]
fn prompt_ids_outside_the_vocabulary_fail_with_exit_code_1() {
    let model = fixture("models/gpt2");
    let out = generate(model.to_str().unwrap(), &["--prompt-ids", "1,101"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("token id 101") && err.contains("vocab_size 101"), "{err}");
}

/// Truncated sampling is exact by default (`[generation] logprob_support = "truncated"`): the
/// logprobs are the truncated distribution's, so `--top-k` no longer warns that it biases the
/// KL estimate, as it did when they were the whole vocabulary's (the sampler's own tests check
/// the values; `min_new_tokens` and `logprob_support = "vocabulary"` still warn).
#[test]
fn top_k_samples_exactly_and_does_not_warn() {
    let model = fixture("models/gpt2_value_head");
    let out = generate(model.to_str().unwrap(), &["--prompt-ids", "1,2,3", "--top-k", "5", "--json"]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1);
    let err = stderr(&out);
    assert!(!err.contains("KL estimate"), "{err}");
    let lps: Vec<f64> =
        lines[0]["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert!(!lps.is_empty() && lps.iter().all(|&l| l.is_finite() && l <= 0.0), "{lps:?}");
}

/// Regression (issue #28, defect 1): TRL's value-head checkpoints of GPT-2 hold both
/// `transformer.wte.weight` and the tied `lm_head.weight`; `ppo-step` wrote the trained `wte`
/// and the stale `lm_head` (2.0e-3 apart after one step at lr 1e-3). Every saved tensor must
/// hold the trained value, under the input's names.
#[test]
fn ppo_step_saves_a_tied_lm_head_with_the_trained_embedding() {
    use candle_core::{Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(fixture("ppo/init/config.json"), model.join("config.json")).unwrap();
    let mut tensors =
        candle_core::safetensors::load(fixture("ppo/init/model.safetensors"), &Device::Cpu).unwrap();
    let wte = tensors["transformer.wte.weight"].clone();
    tensors.insert("lm_head.weight".into(), wte.clone());
    candle_core::safetensors::save(&tensors, model.join("model.safetensors")).unwrap();
    let vocab = wte.dim(0).unwrap() as u32;
    let rollouts: String = (0..4u32)
        .map(|i| {
            let q: Vec<u32> = (0..3).map(|j| (i * 5 + j) % vocab).collect();
            let r: Vec<u32> = (0..4).map(|j| (i * 7 + j + 1) % vocab).collect();
            format!("{}\n", serde_json::json!({"query_ids": q, "response_ids": r, "score": i as f32 - 1.5}))
        })
        .collect();
    std::fs::write(dir.path().join("rollouts.jsonl"), rollouts).unwrap();
    std::fs::write(
        dir.path().join("ppo.toml"),
        "[ppo]\nbatch_size = 4\nmini_batch_size = 2\nlearning_rate = 1e-3\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let out = Command::new(env!("CARGO_BIN_EXE_rltune"))
        .args(["ppo-step", "--model", model.to_str().unwrap(), "--config"])
        .arg(dir.path().join("ppo.toml"))
        .arg("--rollouts")
        .arg(dir.path().join("rollouts.jsonl"))
        .arg("--output")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let saved = candle_core::safetensors::load(out_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let diff = |a: &Tensor, b: &Tensor| {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    };
    let (new_wte, new_head) = (&saved["transformer.wte.weight"], &saved["lm_head.weight"]);
    assert!(diff(new_wte, &wte) > 1e-4, "the step trained the embedding");
    assert_eq!(diff(new_head, new_wte), 0.0, "lm_head.weight holds the trained (tied) embedding");
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    let mut want: Vec<&String> = tensors.keys().collect();
    want.sort();
    assert!(want.iter().all(|n| names.contains(n)), "the input's names are kept: {names:?}");
}

/// Regression (issue #28, defect 8): the binary was built without Parquet, so
/// configs/trl-sentiment.toml (IMDB's Parquet file) could not run. A `.parquet` prompt source
/// now reaches the Parquet reader (this file is not Parquet: "invalid Parquet"), instead of
/// "needs the `parquet` cargo feature".
#[test]
fn the_binary_reads_parquet_prompt_datasets() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for (src, dst) in [
        ("ppo/init/config.json", "config.json"),
        ("ppo/init/model.safetensors", "model.safetensors"),
        ("ppo/tokenizer.json", "tokenizer.json"),
    ] {
        std::fs::copy(fixture(src), model.join(dst)).unwrap();
    }
    let data = dir.path().join("train-00000-of-00001.parquet");
    std::fs::write(&data, b"PAR1 not really parquet PAR1").unwrap();
    let config = dir.path().join("run.toml");
    let text = format!(
        "[model]\npath = {:?}\n[data]\nsource = {:?}\n[[reward.sources]]\nkind = \"command\"\ncommand = [\"cat\"]\n\
         [logging]\ndir = {:?}\n",
        model.to_str().unwrap(),
        data.to_str().unwrap(),
        dir.path().join("run").to_str().unwrap()
    );
    std::fs::write(&config, text).unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_rltune")).args(["ppo", "--config"]).arg(&config).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("invalid Parquet") && !err.contains("cargo feature"), "{err}");
}

/// Issue #30: `--device cpu` computes what the default computed (bit for bit on this CPU
/// build, where `auto` is the CPU).
#[test]
fn device_cpu_gives_the_same_samples_as_the_default() {
    let model = fixture("models/gpt2_value_head");
    let args =
        ["--prompt-ids", "1,2,3", "--num-samples", "2", "--max-new-tokens", "6", "--json", "--seed", "4"];
    let plain = stdout(&generate(model.to_str().unwrap(), &args));
    for flags in [&["--device", "cpu"][..], &["--device", "auto", "--dtype", "f32"]] {
        let out = generate(model.to_str().unwrap(), &[&args[..], flags].concat());
        assert!(out.status.success(), "{flags:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), plain, "{flags:?}");
    }
}

/// Issue #30: asking a build without the `cuda` feature for CUDA fails on every command, before
/// any work, with the command that builds it.
#[cfg(not(feature = "cuda"))]
#[test]
fn device_cuda_without_the_feature_says_how_to_build_it() {
    let model = fixture("models/gpt2_value_head");
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let data = dir.path().join("sft.jsonl");
    std::fs::write(&data, "{\"text\": \"a b\"}\n").unwrap();
    let data = data.to_str().unwrap();
    let config = dir.path().join("ppo.toml");
    std::fs::write(&config, "[ppo]\nbatch_size = 1\nmini_batch_size = 1\n[runtime]\ndevice = \"cuda:1\"\n")
        .unwrap();
    let c = config.to_str().unwrap();
    let commands: Vec<Vec<&str>> = vec![
        vec!["generate", "--model", m, "--prompt-ids", "1", "--device", "cuda"],
        vec!["sft", "--model", m, "--data", data, "--output", d, "--device", "cuda:0"],
        vec!["reward", "--model", m, "--data", data, "--output", d, "--device", "cuda"],
        vec!["quickstart", "--output", d, "--preset", "tiny", "--device", "cuda"],
        vec!["bench", "ppo", "--device", "cuda"],
        vec!["ppo-step", "--model", m, "--rollouts", data, "--config", c, "--output", d],
    ];
    for args in commands {
        let out = common::rltune(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("device = \"cuda"), "{args:?}: {err}");
        assert!(err.contains("cargo build --release --features cuda"), "{args:?}: {err}");
        assert!(err.contains("tools/cuda/build.sh"), "{args:?}: {err}");
    }
    // The config's [runtime] device, and the flag that overrides it.
    let out = common::rltune(&["ppo-step", "--model", m, "--rollouts", data, "--config", c, "--output", d]);
    assert!(stderr(&out).contains("device = \"cuda:1\""), "{}", stderr(&out));
}

#[test]
fn a_bad_device_or_dtype_names_the_choices() {
    let model = fixture("models/gpt2_value_head");
    let out = generate(model.to_str().unwrap(), &["--prompt-ids", "1", "--device", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("\"cuda:N\""), "{}", stderr(&out));
    let out = generate(model.to_str().unwrap(), &["--prompt-ids", "1", "--dtype", "fp16"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("\"bf16\""), "{}", stderr(&out));
}

/// `bench ppo --composed` runs the GPU's code path (composed ops, device-side Adam) on the CPU
/// and reports the resident memory at each phase boundary, so the GPU path's memory can be
/// studied without a GPU.
#[test]
fn bench_composed_runs_the_gpu_path_and_reports_memory_by_phase() {
    let out = common::rltune(&[
        "bench",
        "ppo",
        "--preset",
        "small",
        "--composed",
        "--iters",
        "1",
        "--batch",
        "4",
        "--mini-batch",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = json_lines(&out);
    let result = lines.last().unwrap();
    assert_eq!(result["composed"], true, "{result}");
    assert!(result["median_optimize_step_s"].as_f64().is_some_and(|s| s > 0.0), "{result}");
    let err = stderr(&out);
    for phase in ["before generation", "after generation", "after the step"] {
        assert!(err.contains(&format!("MiB resident {phase}")), "{phase}: {err}");
    }
}

/// A GPT-2-style byte-level tokenizer.json of `v` tokens ("<eos>", special, last).
fn byte_level_tokenizer(v: usize) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..v - 1)
        .map(|i| (format!("t{i}"), i.into()))
        .chain([("<eos>".to_string(), (v - 1).into())])
        .collect();
    let bl = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "added_tokens": [{"id": v - 1, "content": "<eos>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "pre_tokenizer": bl, "post_processor": bl, "decoder": bl,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    })
}

/// `rltune export` with an adapter writes a GGUF that `convert` and `generate` read; bad input
/// (type, output name, architecture, missing tokenizer) is refused naming the flag or file.
#[test]
fn export_writes_a_gguf_that_loads_and_refuses_bad_input() {
    use common::rltune;
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    std::fs::create_dir_all(&base).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("lora/llama/base").join(f), base.join(f)).unwrap();
    }
    std::fs::write(base.join("tokenizer.json"), byte_level_tokenizer(64).to_string()).unwrap();
    let (b, out) = (base.to_str().unwrap(), tmp.path().join("m.gguf"));
    let adapter = fixture("lora/llama/rltune_adapter");
    let o = rltune(&[
        "export",
        "--model",
        b,
        "--adapter",
        adapter.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stdout(&o);
    assert!(
        said.contains("llama GGUF v3") && said.contains("Q8_0") && said.contains("LoRA layers merged"),
        "{said}"
    );
    let hf = tmp.path().join("hf");
    let o = rltune(&["convert", out.to_str().unwrap(), "--output", hf.to_str().unwrap()]);
    assert!(o.status.success() && hf.join("model.safetensors").exists(), "{}", stderr(&o));
    let samples = json_lines(&generate(
        out.to_str().unwrap(),
        &["--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"],
    ));
    check_sample(&samples[0], 64);

    let fails = |args: &[&str], parts: &[&str]| {
        let o = rltune(args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        for p in parts {
            assert!(err.contains(p), "{p:?} not in:\n{err}");
        }
    };
    let o = out.to_str().unwrap();
    fails(&["export", "--model", b, "--output", o, "--type", "q4_0"], &["--type", "\"q4_0\"", "f32", "q8_0"]);
    fails(&["export", "--model", b, "--output", "model.bin"], &["model.bin", ".gguf"]);
    let gpt2 = fixture("models/gpt2");
    fails(
        &["export", "--model", gpt2.to_str().unwrap(), "--output", o],
        &["config.json", "\"gpt2\"", "llama"],
    );
    std::fs::remove_file(base.join("tokenizer.json")).unwrap();
    fails(&["export", "--model", b, "--output", o], &["base", "no tokenizer.json", "copy"]);
}
