//! Partial freezing (`[model] trainable_layers`, issue #38 item 5): the last K blocks, the final
//! norm and the heads train; the embeddings and the blocks below are a frozen trunk whose
//! output is detached and, for a policy and its reference copy, computed once.
//!
//! - The trunk split computes what the whole forward computes, bit for bit, on every family.
//! - A PPO step with a frozen trunk leaves the trunk bitwise unchanged and moves the top blocks
//!   exactly as a full-model step moves them (Adam is per parameter and the detach changes no
//!   gradient above it), with the reference sharing the policy's trunk tensors.
//! - K above the layer count, and K with LoRA, are refused with the fix.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::params::ParamStore;
use rltune::ppo::{PpoConfig, PpoTrainer};

use crate::common::max_diff;

use crate::common::{every_family as configs, left_padded_batch as batch};

#[test]
fn the_trunk_split_is_the_whole_forward_on_every_family() {
    for (name, cfg) in configs() {
        let store = ParamStore::random(4, true, DType::F32, &Device::Cpu).unwrap();
        let lm = CausalLm::load(&store.root(), &cfg).unwrap();
        let (ids, pos, bias) = batch();
        let whole = lm.forward(&ids, &pos, &bias, None).unwrap();
        for k in 0..=4 {
            let split = lm.clone().with_trainable_layers(k).unwrap();
            assert_eq!(split.frozen_layers(), Some(4 - k));
            let h = split.forward(&ids, &pos, &bias, None).unwrap();
            let d = max_diff(&whole, &h);
            assert_eq!(d, 0.0, "{name}, {k} trainable: the split forward differs by {d}");
        }
        let err = lm.with_trainable_layers(5).unwrap_err().to_string();
        assert!(err.contains("trainable_layers = 5") && err.contains("4 layers"), "{name}: {err}");
    }
}

fn trainer(frozen: Option<usize>) -> PpoTrainer {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(50, 16, 3, 4, 64));
    let store = ParamStore::random(9, true, DType::F32, &Device::Cpu).unwrap();
    let mut lm = CausalLm::load(&store.root(), &cfg).unwrap();
    if let Some(k) = frozen {
        lm = lm.freeze_trunk(&store, k).unwrap();
    }
    let policy = CausalLmWithValueHead::load(&store.root(), lm).unwrap();
    let mut reference = CausalLm::load(&store.frozen_copy().unwrap().root(), &cfg).unwrap();
    if let Some(k) = frozen {
        reference = reference.with_trainable_layers(k).unwrap();
        assert!(policy.lm.shares_trunk(&reference), "the reference copy shares the frozen trunk");
    }
    // One optimizer step (one epoch, one minibatch): after it the full model's trunk has moved,
    // so later minibatches would see other inputs above it.
    let ppo = PpoConfig {
        batch_size: 4,
        mini_batch_size: 4,
        ppo_epochs: 1,
        learning_rate: 1e-2,
        ..Default::default()
    };
    PpoTrainer::new(ppo, store, policy, reference).unwrap()
}

fn weights(t: &PpoTrainer) -> BTreeMap<String, Tensor> {
    t.store.snapshot().unwrap()
}

#[test]
fn a_ppo_step_moves_only_the_top_blocks_and_moves_them_as_full_training_does() {
    crate::common::install();
    let (mut full, mut partial) = (trainer(None), trainer(Some(1)));
    let before = weights(&partial);
    let start = weights(&full);
    assert!(before.iter().all(|(k, w)| max_diff(w, &start[k]) == 0.0), "the two trainers start equal");
    for t in [&mut full, &mut partial] {
        crate::common::step_on_four_rows(t);
    }
    let (after_full, after) = (weights(&full), weights(&partial));
    let (mut trunk, mut top, mut worst) = (0, 0, 0f64);
    for (name, w) in &after {
        let is_trunk = CausalLm::is_trunk_param(name, 2);
        if is_trunk {
            trunk += 1;
            assert_eq!(max_diff(w, &before[name]), 0.0, "{name} is in the frozen trunk but moved");
        } else {
            top += 1;
            let moved = max_diff(w, &before[name]);
            let d = max_diff(w, &after_full[name]);
            // The same gradients, the same Adam: equal up to the summation order of the last
            // block's fused backward against the composed one (measured 0).
            assert!(moved > 0.0, "{name} did not move");
            assert!(d < 1e-6, "{name}: partial and full training differ by {d} (moved {moved})");
            worst = worst.max(d);
        }
    }
    assert!(trunk > 0 && top > 0, "{trunk} trunk and {top} top tensors");
    println!("partial freezing: {top} trained tensors within {worst:.2e} of full training's, {trunk} frozen");
    assert!(after.keys().any(|k| k.contains("h.2.")) && after.keys().any(|k| k.contains("v_head")));
    // The optimizer holds only the trainable variables.
    assert!(partial.store.vars().iter().all(|(n, _)| !CausalLm::is_trunk_param(n, 2)));
}

#[test]
fn trunk_names_of_every_family_are_recognised() {
    for (name, frozen) in [
        ("transformer.wte.weight", true),
        ("transformer.h.1.attn.c_attn.weight", true),
        ("transformer.h.2.mlp.c_fc.weight", false),
        ("transformer.ln_f.weight", false),
        ("model.embed_tokens.weight", true),
        ("model.layers.0.self_attn.q_proj.weight", true),
        ("model.layers.12.mlp.up_proj.weight", false),
        ("gpt_neox.embed_in.weight", true),
        ("gpt_neox.layers.1.attention.query_key_value.weight", true),
        ("embed_out.weight", false),
        ("lm_head.weight", false),
        ("v_head.summary.weight", false),
    ] {
        assert_eq!(CausalLm::is_trunk_param(name, 2), frozen, "{name}");
    }
}
