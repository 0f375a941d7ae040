//! `DpoTrainer` against TRL 1.16.0's `DPOTrainer`, recorded by
//! `tools/fixtures/make_dpo_fixture.py`: the tokenization of the text rows, the precomputed
//! reference logprobs, every logged metric of every optimizer step, and the weights after the
//! last, for each variant in `tools/fixtures/dpo/`.

use std::path::Path;

use rltune::dpo::data::{prepare_pairs, read_preference_records};
use rltune::dpo::{DpoConfig, DpoTrainer, PreferencePair};
use rltune::ppo::Stat;
use rltune::tokenizer::Tokenizer;

use crate::common::fixture;
use crate::grpo_parity::{compare_logs, compare_weights, load_lm};

/// Reference-logprob tolerance (sums of up to 9 f32 logprobs of magnitude ~4).
const LOGP_TOL: f64 = 1e-5;

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The fixture's rows, tokenized by rltune, checked against TRL's tokenization.
fn pairs(cfg: &DpoConfig, expected: &serde_json::Value) -> Vec<PreferencePair> {
    let rows = fixture("dpo/rows.jsonl");
    let records = read_preference_records(&rows).unwrap();
    let tok = Tokenizer::from_file(&fixture("dpo/init/tokenizer.json")).unwrap();
    let prepared = prepare_pairs(&records, Some(&tok), Some(0), cfg, &rows).unwrap();
    let theirs = expected["tokenized"].as_array().unwrap();
    assert_eq!(prepared.pairs.len(), theirs.len(), "rows kept");
    for (p, t) in prepared.pairs.iter().zip(theirs) {
        assert_eq!(p.prompt_ids, ids(&t["prompt_ids"]), "{}: prompt_ids", p.origin);
        assert_eq!(p.chosen_ids, ids(&t["chosen_ids"]), "{}: chosen_ids", p.origin);
        assert_eq!(p.rejected_ids, ids(&t["rejected_ids"]), "{}: rejected_ids", p.origin);
    }
    // Row 5's chosen and rejected are the same text.
    assert_eq!(prepared.identical, vec![format!("{} line 5", rows.display())]);
    prepared.pairs
}

/// Runs one variant; returns (worst metric diff, worst weight diff).
fn run_variant(name: &str) -> (f64, f64) {
    let dir = fixture(&format!("dpo/{name}"));
    let expected = json(&dir.join("expected.json"));
    let cfg = DpoConfig::from_toml_file(&dir.join("config.toml")).unwrap();
    let mut pairs = pairs(&cfg, &expected);
    let (store, policy) = load_lm(&fixture("dpo/init"), true);
    let reference = expected["reference"].as_str().map(|r| load_lm(&fixture(&format!("dpo/{r}")), false).1);
    let mut trainer = DpoTrainer::new(cfg.clone(), store, policy, reference, pairs.len()).unwrap();
    let mut dref = 0f64;
    if cfg.precompute_ref_log_probs {
        trainer.precompute_ref_logps(&mut pairs).unwrap();
        for (p, t) in pairs.iter().zip(expected["tokenized"].as_array().unwrap()) {
            let (c, r) = p.ref_logps.unwrap();
            let (tc, tr) =
                (t["ref_chosen_logps"].as_f64().unwrap(), t["ref_rejected_logps"].as_f64().unwrap());
            dref = dref.max((c - tc).abs()).max((r - tr).abs());
        }
        assert!(dref < LOGP_TOL, "{name}: precomputed reference logprobs differ by {dref}");
    }
    // TRL's micro-batches (indices into rows.jsonl), `gradient_accumulation_steps` per step.
    let kept: Vec<usize> =
        expected["kept_rows"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    let pair_of = |row: usize| &pairs[kept.iter().position(|&k| k == row).unwrap()];
    let micro: Vec<Vec<&PreferencePair>> = expected["micro_batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_array().unwrap().iter().map(|r| pair_of(r.as_u64().unwrap() as usize)).collect())
        .collect();
    let theirs = expected["logs"].as_array().unwrap();
    assert_eq!(micro.len(), theirs.len() * cfg.gradient_accumulation_steps, "{name}: micro-batches");
    let mut ds = 0f64;
    let mut lr_sum = 0.0;
    for (k, (step, want)) in micro.chunks(cfg.gradient_accumulation_steps).zip(theirs).enumerate() {
        let stats = trainer.step(step).unwrap();
        lr_sum += stats["learning_rate"].as_f64().unwrap();
        ds = ds.max(compare_logs(name, k, &stats, want.as_object().unwrap()));
        assert_eq!(stats["rltune/skipped_updates"], Stat::Scalar(0.0));
    }
    let after = trainer.store().snapshot().unwrap();
    let (dw, dk) = compare_weights(
        name,
        after,
        &dir.join("weights.safetensors"),
        &fixture("dpo/init/model.safetensors"),
        lr_sum,
    );
    println!(
        "TRL DPOTrainer {name}: metrics max diff {ds:.2e}, weights max diff {dw:.2e} (attention key bias, zero \
         gradient: {dk:.2e}), precomputed reference logprobs {dref:.2e}"
    );
    (ds, dw)
}

#[test]
fn dpo_default_sigmoid_two_steps_reproduces_trl() {
    crate::common::install();
    run_variant("default");
}

#[test]
fn dpo_ipo_reproduces_trl() {
    crate::common::install();
    run_variant("ipo");
}

#[test]
fn dpo_hinge_with_weight_decay_reproduces_trl() {
    crate::common::install();
    run_variant("hinge");
}

#[test]
fn dpo_robust_label_smoothing_reproduces_trl() {
    crate::common::install();
    run_variant("robust");
}

#[test]
fn dpo_precomputed_reference_reproduces_trl() {
    crate::common::install();
    run_variant("precompute");
}

#[test]
fn dpo_truncation_and_gradient_accumulation_reproduce_trl() {
    crate::common::install();
    run_variant("truncate_accumulate");
}

#[test]
fn dpo_keep_end_truncation_reproduces_trl() {
    crate::common::install();
    run_variant("keep_end");
}

#[test]
fn dpo_mpo_weighted_losses_reproduce_trl() {
    crate::common::install();
    run_variant("mpo");
}

#[test]
fn dpo_other_losses_reproduce_trl() {
    crate::common::install();
    run_variant("other_losses");
}

#[test]
fn dpo_f_divergences_reproduce_trl() {
    crate::common::install();
    for name in ["js_divergence", "alpha_divergence", "forward_kl"] {
        run_variant(name);
    }
}
