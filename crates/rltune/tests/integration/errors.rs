//! Bad inputs: every error names the file, field or tensor at fault and says how to fix it.

use std::path::Path;

use candle_core::{DType, Device};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::load::{load_policy, save_pretrained};
use rltune::models::{CausalLm, CausalLmConfig};
use rltune::params::ParamStore;
use rltune::tokenizer::Tokenizer;

use crate::common::fixture;

/// The error message of loading `dir` as a policy.
fn load_err(dir: &Path) -> String {
    let dir = dir.to_str().expect("temp paths are UTF-8");
    match load_policy(dir, false, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("loading {dir} should fail"),
        Err(e) => e.to_string(),
    }
}

/// A copy of the gpt2 fixture with `config.json` replaced by `config`.
fn gpt2_with_config(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("models/gpt2/model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    dir
}

/// The gpt2 fixture's config.json with `edit` applied.
fn gpt2_config_edited(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let text = std::fs::read_to_string(fixture("models/gpt2/config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(v.as_object_mut().unwrap());
    serde_json::to_string_pretty(&v).unwrap()
}

fn assert_contains_all(msg: &str, parts: &[&str]) {
    println!("{msg}");
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in the error message:\n{msg}");
    }
}

#[test]
fn missing_config_json_names_the_file_and_the_layout() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("models/gpt2/model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let err = load_err(dir.path());
    assert_contains_all(&err, &["config.json", "not found", "model.safetensors", "save_pretrained"]);
}

#[test]
fn invalid_json_in_config_names_the_file_and_line() {
    let dir = gpt2_with_config("{\n  \"model_type\": \"gpt2\",\n  \"n_embd\": 32,,\n}\n");
    let err = load_err(dir.path());
    assert_contains_all(&err, &["config.json", "not valid JSON", "line 3", "fix the syntax"]);
}

#[test]
fn gpt2_n_embd_not_divisible_by_n_head_names_both_fields() {
    let dir = gpt2_with_config(&gpt2_config_edited(|c| {
        c.insert("n_head".into(), 5.into());
    }));
    let err = load_err(dir.path());
    assert_contains_all(&err, &["config.json", "n_embd (32)", "multiple of n_head (5)", "fix config.json"]);
}

#[test]
fn config_field_of_the_wrong_type_is_named() {
    let dir = gpt2_with_config(&gpt2_config_edited(|c| {
        c.insert("n_head".into(), "four".into());
    }));
    let err = load_err(dir.path());
    assert_contains_all(&err, &["config.json", "field \"n_head\"", "invalid type", "fix it in config.json"]);
}

#[test]
fn llama_config_missing_required_vocab_size_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(fixture("models/llama").join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("vocab_size");
    std::fs::write(&path, v.to_string()).unwrap();
    let err = load_err(dir.path());
    assert_contains_all(&err, &["config.json", "invalid llama config", "missing field `vocab_size`"]);
}

#[test]
fn llama_config_missing_hidden_size_takes_the_default_and_the_mismatch_says_so() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(fixture("models/llama").join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // The fixture sets head_dim, so the default hidden_size 4096 passes validation and the
    // weights are what fail.
    assert!(v["head_dim"].is_u64());
    v.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(&path, v.to_string()).unwrap();
    let err = load_err(dir.path());
    assert_contains_all(
        &err,
        &["model.safetensors", "model.embed_tokens.weight", "4096]", "hidden size", "transformers' default"],
    );
}

#[test]
fn unknown_model_type_lists_the_supported_ones() {
    let dir = gpt2_with_config(&gpt2_config_edited(|c| {
        c.insert("model_type".into(), "falcon".into());
    }));
    let err = load_err(dir.path());
    assert_contains_all(
        &err,
        &["config.json", "\"falcon\"", "supported: gpt2, llama, qwen2, mistral, gpt_neo, gpt_neox"],
    );
}

#[test]
fn config_that_does_not_match_the_weights_names_the_tensor_and_both_shapes() {
    let dev = Device::Cpu;
    let cfg = Gpt2Config::tiny(50, 16, 2, 4, 64);
    let store = ParamStore::random(0, false, DType::F32, &dev).unwrap();
    CausalLm::load(&store.root(), &CausalLmConfig::Gpt2(cfg.clone())).unwrap();
    let mut json = serde_json::to_value(&cfg).unwrap();
    json["model_type"] = "gpt2".into();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    save_pretrained(&dir, &store, &json).unwrap();
    assert!(load_policy(dir.to_str().unwrap(), false, DType::F32, &dev).is_ok());

    json["n_embd"] = 32.into();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let err = load_err(&dir);
    assert_contains_all(
        &err,
        &["model.safetensors", "\"transformer.wte.weight\"", "[50, 16]", "[50, 32]", "config.json"],
    );
}

#[test]
fn pickle_only_directory_explains_why_and_how_to_convert() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"not really a pickle").unwrap();
    let err = load_err(dir.path());
    assert_contains_all(
        &err,
        &["pytorch_model.bin", "pickle", "arbitrary code", "safetensors", "safe_serialization=True"],
    );
    // The same with config.json beside it.
    std::fs::copy(fixture("models/gpt2/config.json"), dir.path().join("config.json")).unwrap();
    assert_contains_all(&load_err(dir.path()), &["pytorch_model.bin", "arbitrary code"]);
}

#[test]
fn sharded_index_with_a_missing_shard_names_the_shard() {
    let dir = gpt2_with_config(&std::fs::read_to_string(fixture("models/gpt2/config.json")).unwrap());
    let d = dir.path();
    std::fs::rename(d.join("model.safetensors"), d.join("model-00001-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({
        "metadata": {"total_size": 0},
        "weight_map": {
            "transformer.wte.weight": "model-00001-of-00002.safetensors",
            "transformer.h.1.mlp.c_proj.weight": "model-00002-of-00002.safetensors",
        }
    });
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let err = load_err(d);
    assert_contains_all(
        &err,
        &[
            "model.safetensors.index.json",
            "model-00002-of-00002.safetensors",
            "transformer.h.1.mlp.c_proj.weight",
            "does not exist",
            "copy every shard",
        ],
    );
}

/// Installs process-wide hub options (an empty cache, offline): the only test here that loads
/// a hub id, so tests running beside it are unaffected. The variables are given, not read from
/// the process environment: the library reads none.
#[test]
fn hub_id_when_offline_says_to_pass_a_local_directory() {
    let home = tempfile::tempdir().unwrap();
    let home_dir = home.path().to_string_lossy().into_owned();
    let vars = |k: &str| match k {
        "HF_HOME" => Some(home_dir.clone()),
        "HF_HUB_OFFLINE" => Some("1".to_string()),
        _ => None,
    };
    rltune::runtime::install_host(rltune::runtime::Host::from_vars(vars));
    assert_eq!(rltune::models::hub::current().cache_dir, Some(home.path().join("hub")));
    let err = match load_policy("rltune-test/no-such-model", false, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("an uncached hub id offline should fail"),
        Err(e) => e.to_string(),
    };
    assert_contains_all(
        &err,
        &["\"rltune-test/no-such-model\"", "config.json", "offline", "local directory"],
    );
}

#[test]
fn tokenizer_of_another_model_does_not_fit() {
    let path = fixture("ppo/tokenizer.json");
    let tok = Tokenizer::from_file(&path).unwrap();
    assert!(tok.vocab_size() > 101, "the fixture tokenizer should be larger than the gpt2 fixture");
    let err = tok.check_fits(101).unwrap_err().to_string();
    assert_contains_all(&err, &["tokenizer.json", "vocab_size is 101", "use the tokenizer.json saved with"]);
    tok.check_fits(tok.vocab_size()).unwrap();
}

#[test]
fn prompt_ids_at_or_above_the_vocabulary_are_rejected() {
    let dir = fixture("models/gpt2");
    let policy = load_policy(dir.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    let v = policy.config.vocab_size() as u32;
    let cfg = GenerationConfig { max_new_tokens: 2, ..Default::default() };
    let run = |prompts: &[Vec<u32>]| generate(&policy.model.lm, None, prompts, &cfg, &Device::Cpu);
    let err = run(&[vec![1, 2], vec![3, v]]).unwrap_err().to_string();
    assert_contains_all(&err, &["prompt 1", &format!("token id {v}"), &format!("vocab_size {v}")]);
    assert!(run(&[vec![1, 2], vec![3, v - 1]]).is_ok());
}
