//! `GrpoTrainer` / `RlooTrainer` against TRL 1.16.0's `GRPOTrainer` / `RLOOTrainer`, recorded by
//! `tools/fixtures/make_grpo_fixture.py`: every logged metric of every optimizer step, and the
//! weights after the last, for each variant in `tools/fixtures/grpo/`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rltune::data::group_rollouts::read_group_rollouts;
use rltune::grpo::{GroupBatch, GrpoConfig, GrpoTrainer, RlooConfig, RlooTrainer};
use rltune::models::{CausalLm, CausalLmConfig};
use rltune::params::ParamStore;
use rltune::ppo::{Stat, Stats};

use crate::common::{fixture, max_diff};

/// Metric tolerance: TRL runs in f32; ours differs in summation order only.
const STAT_TOL: f64 = 1e-5;
/// Weight tolerance per unit of learning rate summed over the steps: 1e-5 after one step at
/// lr 1e-3 (1% of that step). AdamW's first step moves an entry by `lr·g/(|g| + ε)`, whose
/// sensitivity to `g` is `lr·ε/(|g| + ε)²`: on an entry whose gradient is near ε = 1e-8, the f32
/// rounding of `g` (torch and rltune sum in different orders) moves the update by a visible part of
/// lr. The variants at lr 2e-2 and 5e-2 (needed to make the ratios leave the clip range) scale the
/// tolerance with lr. Measured worst: 9.6e-5 in `gspo_masked` (Σ lr = 0.03, an entry of
/// `h.0.mlp.c_fc.weight` whose TRL gradient is 4.4e-8); 4e-7 or less in every one-step variant.
const WEIGHT_TOL_PER_LR: f64 = 1e-2;

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A model directory of the fixture: its store (trainable or not) and model.
pub fn load_lm(dir: &Path, trainable: bool) -> (ParamStore, CausalLm) {
    let cfg = CausalLmConfig::from_json(&json(&dir.join("config.json")), &dir.join("config.json")).unwrap();
    let store =
        ParamStore::load_safetensors(&[dir.join("model.safetensors")], trainable, DType::F32, &Device::Cpu)
            .unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    assert!(store.initialized().is_empty(), "every tensor comes from the file");
    (store, lm)
}

/// Runs one variant; returns (worst metric diff, worst weight diff).
fn run_variant(name: &str) -> (f64, f64) {
    let dir = fixture(&format!("grpo/{name}"));
    let expected = json(&dir.join("expected.json"));
    let (store, policy) = load_lm(&fixture("grpo/init"), true);
    let reference = expected["reference"].as_str().map(|r| load_lm(&fixture(&format!("grpo/{r}")), false).1);
    let rollouts_path = fixture(&format!("grpo/{}", expected["rollouts"].as_str().unwrap()));
    let config_path = dir.join("config.toml");
    let trl_trainer = expected["trainer"].as_str().unwrap();
    let (logs, store_after) = if trl_trainer == "GRPOTrainer" {
        let cfg = GrpoConfig::from_toml_file(&config_path).unwrap();
        let r = read_group_rollouts(&rollouts_path, cfg.reward_funcs.as_deref()).unwrap();
        let truncated: Vec<bool> = r.truncated.iter().map(|t| t.unwrap_or(false)).collect();
        let batch = GroupBatch {
            prompts: &r.prompts,
            completions: &r.completions,
            rewards: &r.rewards,
            truncated: Some(&truncated),
            allowed: None,
        };
        let mut t = GrpoTrainer::new(cfg, store, policy, reference).unwrap();
        let logs = t.step_with(&batch).unwrap();
        (logs, t.store().snapshot().unwrap())
    } else {
        let cfg = RlooConfig::from_toml_file(&config_path).unwrap();
        let r = read_group_rollouts(&rollouts_path, cfg.reward_funcs.as_deref()).unwrap();
        let truncated: Vec<bool> = r.truncated.iter().map(|t| t.unwrap_or(false)).collect();
        let batch = GroupBatch {
            prompts: &r.prompts,
            completions: &r.completions,
            rewards: &r.rewards,
            truncated: Some(&truncated),
            allowed: None,
        };
        let mut t = RlooTrainer::new(cfg, store, policy, reference).unwrap();
        let logs = t.step_with(&batch).unwrap();
        (logs, t.store().snapshot().unwrap())
    };
    let theirs = expected["logs"].as_array().unwrap();
    assert_eq!(logs.len(), theirs.len(), "{name}: optimizer steps");
    let mut ds = 0f64;
    for (k, (ours, want)) in logs.iter().zip(theirs).enumerate() {
        ds = ds.max(compare_logs(name, k, ours, want.as_object().unwrap()));
    }
    let lr_sum: f64 = logs.iter().filter_map(|s| s.get("learning_rate").and_then(Stat::as_f64)).sum();
    let (dw, dk) = compare_weights(
        name,
        store_after,
        &dir.join("weights.safetensors"),
        &fixture("grpo/init/model.safetensors"),
        lr_sum,
    );
    println!(
        "TRL {trl_trainer} {name}: metrics max diff {ds:.2e}, weights max diff {dw:.2e} \
         (attention key bias, zero gradient: {dk:.2e})"
    );
    (ds, dw)
}

/// Compares the weights after training with the fixture's, within [`WEIGHT_TOL_PER_LR`] times
/// the summed learning rates; returns (worst diff, worst diff on the attention key bias).
pub fn compare_weights(
    name: &str,
    store_after: std::collections::BTreeMap<String, Tensor>,
    want_path: &Path,
    init_path: &Path,
    lr_sum: f64,
) -> (f64, f64) {
    let want = candle_core::safetensors::load(want_path, &Device::Cpu).unwrap();
    let ours: HashMap<String, Tensor> = store_after.into_iter().collect();
    assert_eq!(ours.len(), want.len(), "{name}: tensor count");
    // The key bias of attention gets an exactly-zero gradient (adding `q·b_k` to every score of
    // a row leaves the softmax unchanged), so both sides' updates there are AdamW normalizing
    // float noise: up to the learning rate, of any sign. Only their size is checked: at most the
    // sum of the step sizes. Every other entry must match.
    let init = candle_core::safetensors::load(init_path, &Device::Cpu).unwrap();
    let (mut dw, mut dk) = (0f64, 0f64);
    for (tensor, w) in &want {
        let got = &ours[tensor];
        let d = if tensor.ends_with("attn.c_attn.bias") {
            let c = w.dim(0).unwrap() / 3;
            let part = |t: &Tensor, i: usize| t.narrow(0, i * c, c).unwrap();
            for t in [got, w] {
                let moved = max_diff(&part(t, 1), &part(&init[tensor], 1));
                assert!(moved <= lr_sum * 1.001, "{name}: {tensor}: key bias moved {moved} > Σ lr {lr_sum}");
            }
            dk = dk.max(max_diff(&part(got, 1), &part(w, 1)));
            max_diff(&part(got, 0), &part(w, 0)).max(max_diff(&part(got, 2), &part(w, 2)))
        } else {
            max_diff(got, w)
        };
        if d >= WEIGHT_TOL_PER_LR * lr_sum {
            let diff = (got - w).unwrap().abs().unwrap().flatten_all().unwrap();
            let at = diff.argmax(0).unwrap().to_scalar::<u32>().unwrap() as usize;
            let f = |t: &Tensor| t.flatten_all().unwrap().get(at).unwrap().to_scalar::<f32>().unwrap();
            println!(
                "{tensor}[{at}] (shape {:?}): ours {} TRL {} init {}",
                w.dims(),
                f(got),
                f(w),
                f(&init[tensor])
            );
        }
        assert!(d < WEIGHT_TOL_PER_LR * lr_sum, "{name}: {tensor}: weights max diff {d}");
        dw = dw.max(d);
    }
    (dw, dk)
}

/// Every metric TRL logged must be ours, within [`STAT_TOL`] (TRL logs a NaN metric as null).
pub fn compare_logs(
    name: &str,
    k: usize,
    ours: &Stats,
    theirs: &serde_json::Map<String, serde_json::Value>,
) -> f64 {
    let mut worst = 0f64;
    for (key, want) in theirs {
        let got = match ours.get(key) {
            Some(Stat::Scalar(v)) => *v,
            other => panic!("{name} step {k}: metric {key}: ours {other:?}, TRL {want}"),
        };
        match want.as_f64() {
            Some(w) => {
                let d = (got - w).abs();
                assert!(d < STAT_TOL, "{name} step {k}: {key}: ours {got} vs TRL {w}");
                worst = worst.max(d);
            }
            None => assert!(got.is_nan(), "{name} step {k}: {key}: ours {got} vs TRL null"),
        }
    }
    worst
}

#[test]
fn grpo_default_reproduces_trl() {
    crate::common::install();
    run_variant("default");
}

#[test]
fn grpo_kl_with_reference_reproduces_trl() {
    crate::common::install();
    run_variant("kl");
}

#[test]
fn grpo_loss_type_grpo_reproduces_trl() {
    crate::common::install();
    run_variant("loss_grpo");
}

#[test]
fn grpo_epsilon_high_two_iterations_reproduces_trl() {
    crate::common::install();
    run_variant("epsilon_high");
}

#[test]
fn grpo_scale_rewards_batch_with_weight_decay_reproduces_trl() {
    crate::common::install();
    run_variant("scale_batch");
}

#[test]
fn grpo_temperature_reproduces_trl() {
    crate::common::install();
    run_variant("temperature");
}

#[test]
fn grpo_gspo_masked_truncation_bnpo_reproduces_trl() {
    crate::common::install();
    run_variant("gspo_masked");
}

#[test]
fn grpo_multi_reward_with_missing_values_dr_grpo_reproduces_trl() {
    crate::common::install();
    run_variant("multi_reward");
}

#[test]
fn rloo_default_reproduces_trl() {
    crate::common::install();
    run_variant("rloo_default");
}

#[test]
fn rloo_normalized_clipped_two_iterations_reproduces_trl() {
    crate::common::install();
    run_variant("rloo_normalized");
}
