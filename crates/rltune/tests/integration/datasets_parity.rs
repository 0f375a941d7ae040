//! Conversational datasets against TRL 1.16.0, recorded by
//! `tools/fixtures/make_datasets_fixture.py`: the token ids and loss masks of `SFTTrainer`'s
//! dataset preparation and collator, `DPOTrainer`'s and `RewardTrainer`'s tokenized pairs, GRPO's
//! prompt ids, transformers' renderings; and the same rows read back from `datasets`'
//! `save_to_disk` directories and Parquet. Token ids are compared exactly.

use std::path::PathBuf;

use rltune::data::prompts::{encode_prompt, load_prompts};
#[cfg(all(feature = "parquet", feature = "arrow"))]
use rltune::data::rows::read_rows;
use rltune::data::rows::DataOptions;
use rltune::dpo::config::MaxLength;
use rltune::dpo::data::{prepare_pairs_with, read_preference_data};
use rltune::dpo::DpoConfig;
use rltune::models::chat_template::{ChatTemplate, RenderOptions};
use rltune::tokenizer::Tokenizer;
use rltune::train::data::{read_reward_data, read_sft_data, RewardRecord};
use rltune::train::reward_model::tokenize_chat_pair;
use rltune::train::sft::{tokenize_sft_with, SftConfig};
use serde_json::Value;

use crate::common::fixture;

fn dir() -> PathBuf {
    fixture("datasets")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn model() -> (Tokenizer, ChatTemplate) {
    let d = dir().join("model");
    let tok = Tokenizer::from_file(&d.join("tokenizer.json")).unwrap();
    let template = ChatTemplate::for_model_dir(&d).unwrap().expect("the fixture model has a chat template");
    (tok, template)
}

fn rows_of(case: &Value) -> String {
    dir().join(case["rows"].as_str().unwrap()).to_string_lossy().into_owned()
}

fn cases(trainer: &str) -> Vec<(String, Value)> {
    let e = expected();
    let cases: Vec<(String, Value)> = e["cases"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, c)| c["trainer"] == trainer)
        .map(|(k, c)| (k.clone(), c.clone()))
        .collect();
    assert!(!cases.is_empty(), "no {trainer} case in the fixture");
    cases
}

/// SFT: input ids exactly, and the loss mask equal to TRL's `labels != -100` (position 0 is never
/// a target in either: the model predicts token t from tokens before it).
#[test]
fn sft_conversations_match_trl() {
    let (tok, template) = model();
    for (name, case) in cases("sft") {
        let c = &case["config"];
        let cfg = SftConfig {
            max_length: c["max_length"].as_u64().map_or(4096, |m| m as usize),
            completion_only_loss: c["completion_only_loss"].as_bool().unwrap_or(true),
            assistant_only_loss: c["assistant_only_loss"].as_bool().unwrap_or(false),
            add_eos: true,
        };
        let records = read_sft_data(&rows_of(&case), &DataOptions::default()).unwrap();
        let eos = tok.token_to_id("<|endoftext|>");
        let (ours, dropped) = tokenize_sft_with(&records, &tok, Some(&template), eos, &cfg).unwrap();
        let theirs = case["examples"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}: examples kept");
        assert_eq!(dropped, records.len() - theirs.len(), "{name}: examples dropped");
        for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
            assert_eq!(o.input_ids, ids(&t["input_ids"]), "{name} example {i}: input_ids");
            let labels: Vec<bool> =
                t["labels"].as_array().unwrap().iter().map(|l| l.as_i64() != Some(-100)).collect();
            let mask: Vec<bool> = o.loss_mask.iter().map(|&m| m == 1).collect();
            assert_eq!(mask[1..], labels[1..], "{name} example {i}: loss mask vs TRL's labels != -100");
        }
    }
}

#[test]
fn dpo_conversations_and_implicit_prompts_match_trl() {
    let (tok, template) = model();
    let eos = tok.token_to_id("<|endoftext|>");
    let cfg = DpoConfig { max_length: MaxLength::Tokens(4096), ..Default::default() };
    for (name, case) in cases("dpo") {
        let records = read_preference_data(&rows_of(&case), &DataOptions::default()).unwrap();
        let prepared = prepare_pairs_with(&records, Some(&tok), Some(&template), eos, &cfg).unwrap();
        let theirs = case["examples"].as_array().unwrap();
        assert_eq!(prepared.pairs.len(), theirs.len(), "{name}: pairs");
        for (p, t) in prepared.pairs.iter().zip(theirs) {
            assert_eq!(p.prompt_ids, ids(&t["prompt_ids"]), "{name} {}: prompt_ids", p.origin);
            assert_eq!(p.chosen_ids, ids(&t["chosen_ids"]), "{name} {}: chosen_ids", p.origin);
            assert_eq!(p.rejected_ids, ids(&t["rejected_ids"]), "{name} {}: rejected_ids", p.origin);
        }
    }
}

#[test]
fn reward_conversations_match_trl() {
    let (tok, template) = model();
    for (name, case) in cases("reward") {
        let records = read_reward_data(&rows_of(&case), &DataOptions::default()).unwrap();
        let theirs = case["examples"].as_array().unwrap();
        assert_eq!(records.len(), theirs.len(), "{name}: pairs");
        for (i, (r, t)) in records.iter().zip(theirs).enumerate() {
            let RewardRecord::ChatPreference { chosen, rejected } = r else {
                panic!("{name} row {i}: not read as a conversational pair: {r:?}")
            };
            let ex = tokenize_chat_pair(&tok, &template, chosen, rejected, 4096).unwrap();
            assert_eq!(ex.chosen, ids(&t["chosen_ids"]), "{name} row {i}: chosen_ids");
            assert_eq!(ex.rejected, ids(&t["rejected_ids"]), "{name} row {i}: rejected_ids");
        }
    }
}

/// GRPO and RLOO: a conversational prompt is rendered with the generation prompt.
#[test]
fn grpo_conversational_prompts_match_trl() {
    let (tok, template) = model();
    let case = &expected()["cases"]["grpo_prompts"];
    let rows = load_prompts(&rows_of(case), "prompt", None).unwrap();
    let theirs = case["prompt_ids"].as_array().unwrap();
    assert_eq!(rows.len(), theirs.len());
    for (r, t) in rows.iter().zip(theirs) {
        assert_eq!(encode_prompt(r, "prompt", &tok, Some(&template)).unwrap(), ids(t), "{}", r.meta);
    }
}

#[test]
fn renderings_match_transformers() {
    let (_, template) = model();
    for r in expected()["renders"].as_array().unwrap() {
        let opts = RenderOptions {
            add_generation_prompt: r["add_generation_prompt"].as_bool().unwrap(),
            continue_final_message: r["continue_final_message"].as_bool().unwrap(),
        };
        let ours = template.render_full(&r["messages"], opts, &Default::default()).unwrap();
        assert_eq!(ours.text, r["text"].as_str().unwrap(), "{r}");
    }
}

/// The JSON lines rows, as JSON objects.
#[cfg(all(feature = "parquet", feature = "arrow"))]
fn jsonl_rows(name: &str) -> Vec<Value> {
    let src = dir().join("rows").join(name);
    read_rows(&src.to_string_lossy(), &DataOptions::default()).unwrap().iter().map(|r| r.to_value()).collect()
}

/// The rows of a `save_to_disk` directory or a Parquet file, as JSON objects.
#[cfg(all(feature = "parquet", feature = "arrow"))]
fn disk_rows(path: &str, split: Option<&str>) -> Vec<Value> {
    let src = dir().join("disk").join(path);
    let opts = DataOptions { split: split.map(str::to_string), ..Default::default() };
    read_rows(&src.to_string_lossy(), &opts).unwrap().iter().map(|r| r.to_value()).collect()
}

/// `DatasetDict.save_to_disk` (default split `train`, and `test`), `Dataset.save_to_disk` and
/// `to_parquet` give back the rows they were made from.
#[cfg(all(feature = "parquet", feature = "arrow"))]
#[test]
fn save_to_disk_and_parquet_read_back_the_rows() {
    assert_eq!(disk_rows("dict", None), jsonl_rows("sft_messages.jsonl"));
    assert_eq!(disk_rows("dict", Some("test")), jsonl_rows("sft_prompt_completion.jsonl"));
    assert_eq!(disk_rows("single", None), jsonl_rows("dpo_chat_implicit.jsonl"));
    assert_eq!(disk_rows("sft_messages.parquet", None), jsonl_rows("sft_messages.jsonl"));
    let e = read_rows(
        &dir().join("disk/dict").to_string_lossy(),
        &DataOptions { split: Some("validation".into()), ..Default::default() },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no split \"validation\"") && e.contains("\"test\"") && e.contains("[data] split"),
        "{e}"
    );
    // The trainers read the directories too.
    let sft = read_sft_data(&dir().join("disk/dict").to_string_lossy(), &DataOptions::default()).unwrap();
    assert_eq!(sft.len(), 3);
    let prefs =
        read_preference_data(&dir().join("disk/single").to_string_lossy(), &DataOptions::default()).unwrap();
    assert_eq!(prefs.len(), 2);
}
