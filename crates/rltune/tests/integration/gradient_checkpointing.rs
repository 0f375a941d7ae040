//! Gradient checkpointing (`[model] gradient_checkpointing`, TRL's `gradient_checkpointing`):
//! each block keeps only its input for the backward and runs again there. It must change the
//! memory only, never a gradient:
//!
//! - on every family, with a left-padded batch, the gradients of every weight equal the plain
//!   forward's bit for bit on the CPU (the recomputation runs the same ops on the same values,
//!   and each block input's gradient has one contribution outside the block, so nothing is
//!   summed in another order; a weight whose gradient were lost or counted twice would be off
//!   by its whole size);
//! - with LoRA, where the first block's input is untracked and only the adapters train;
//! - through a PPO step (two epochs of two minibatches), whose weights after the update equal
//!   the plain step's bit for bit.

use candle_core::{DType, Device, Tensor, Var};
use rltune::models::llama::LlamaConfig;
use rltune::models::load::{load_lm_adapted, LoraSpec};
use rltune::models::lora::LoraConfig;
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::ops::checkpoint_recomputations;
use rltune::optim::Grads;
use rltune::params::ParamStore;
use rltune::ppo::{PpoConfig, PpoTrainer};

use crate::common::{checkpoint_serial as serial, fixture, install, max_diff, pseudo_random};

use crate::common::{every_family as configs, left_padded_batch as batch};

/// Every variable's gradient of `Σ h ⊙ R` (h: the final hidden states, R fixed), collected by
/// [`Grads`] as the trainers collect them, and how many blocks the backward recomputed.
fn gradients(lm: &CausalLm, vars: &[(String, Var)]) -> (Vec<(String, Option<Tensor>)>, usize) {
    let (ids, pos, bias) = batch();
    let plain: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
    let mut grads = Grads::new(&plain);
    grads.bind(lm.grad_slot());
    let h = lm.forward(&ids, &pos, &bias, None).unwrap();
    let r = pseudo_random(h.dims(), 7, DType::F32);
    let loss = (h * r).unwrap().sum_all().unwrap();
    let before = checkpoint_recomputations();
    grads.backward(&loss).unwrap();
    let recomputed = checkpoint_recomputations() - before;
    let out = vars.iter().enumerate().map(|(i, (n, _))| (n.clone(), grads.get(i).unwrap())).collect();
    (out, recomputed)
}

/// The largest difference between two gradient lists, relative to the largest entry; every
/// variable must have a gradient in both or in neither.
fn compare(what: &str, a: &[(String, Option<Tensor>)], b: &[(String, Option<Tensor>)]) -> f64 {
    let (mut worst, mut scale, mut with) = (0f64, 0f64, 0);
    for ((name, x), (_, y)) in a.iter().zip(b) {
        match (x, y) {
            (Some(x), Some(y)) => {
                worst = worst.max(max_diff(x, y));
                scale = scale.max(max_diff(x, &x.zeros_like().unwrap()));
                with += 1;
            }
            (None, None) => {}
            _ => panic!("{what}: {name} has a gradient in one run only"),
        }
    }
    assert!(with > 0 && scale > 1e-4, "{what}: no gradients to compare ({with}, largest {scale:.2e})");
    println!(
        "{what}: {with} gradients, checkpointed vs plain max diff {worst:.2e} (largest entry {scale:.2e})"
    );
    worst / scale
}

#[test]
fn checkpointed_gradients_equal_the_plain_ones_on_every_family() {
    install();
    let _one = serial();
    for (name, cfg) in configs() {
        let store = ParamStore::random(4, true, DType::F32, &Device::Cpu).unwrap();
        let lm = CausalLm::load(&store.root(), &cfg).unwrap();
        let vars = store.vars();
        let (plain, none) = gradients(&lm, &vars);
        assert_eq!(none, 0, "{name}: nothing is recomputed without checkpointing");
        let (ckpt, recomputed) = gradients(&lm.clone().with_gradient_checkpointing(true), &vars);
        assert_eq!(recomputed, 4, "{name}: each of the 4 blocks is recomputed once");
        let rel = compare(name, &plain, &ckpt);
        assert_eq!(rel, 0.0, "{name}: checkpointed gradients off by {rel:.2e} of the largest");
    }
}

#[test]
fn with_lora_only_the_adapters_get_gradients_and_they_equal_the_plain_ones() {
    install();
    let _one = serial();
    let path = fixture("lora/llama/base");
    let cfg = LoraConfig { r: 4, lora_alpha: 8.0, ..Default::default() };
    let spec = LoraSpec::new(cfg, "test", 3);
    let lora = load_lm_adapted(path.to_str().unwrap(), Some(&spec), true, DType::F32, &Device::Cpu).unwrap();
    let vars = lora.store.vars();
    assert!(vars.iter().all(|(n, _)| n.contains(".lora_")), "only adapters are variables");
    let (plain, _) = gradients(&lora.lm, &vars);
    let layers = lora.lm.n_layers();
    let (ckpt, recomputed) = gradients(&lora.lm.clone().with_gradient_checkpointing(true), &vars);
    // The embeddings are frozen: the first block's input is untracked, and its adapters still
    // get their gradients through the checkpoint.
    assert_eq!(recomputed, layers);
    let rel = compare("llama + LoRA", &plain, &ckpt);
    assert_eq!(rel, 0.0, "LoRA: checkpointed gradients off by {rel:.2e} of the largest");
}

fn trainer(checkpointing: bool) -> PpoTrainer {
    let cfg = CausalLmConfig::Llama(LlamaConfig::tiny(50, 16, 3, 4, 2));
    let store = ParamStore::random(9, true, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap().with_gradient_checkpointing(checkpointing);
    let policy = CausalLmWithValueHead::load(&store.root(), lm).unwrap();
    let reference = CausalLm::load(&store.frozen_copy().unwrap().root(), &cfg).unwrap();
    let ppo = PpoConfig {
        batch_size: 4,
        mini_batch_size: 2,
        ppo_epochs: 2,
        learning_rate: 1e-2,
        ..Default::default()
    };
    PpoTrainer::new(ppo, store, policy, reference).unwrap()
}

#[test]
fn a_ppo_step_with_checkpointing_is_the_plain_step() {
    install();
    let _one = serial();
    let mut after = Vec::new();
    for checkpointing in [false, true] {
        let mut t = trainer(checkpointing);
        let before = checkpoint_recomputations();
        crate::common::step_on_four_rows(&mut t);
        let recomputed = checkpoint_recomputations() - before;
        // 2 epochs × 2 minibatches × 3 blocks (the reference and the rollout's forward keep no
        // graph to recompute).
        assert_eq!(recomputed >= 12, checkpointing, "{recomputed} blocks recomputed");
        after.push(t.store.snapshot().unwrap());
    }
    let mut worst = 0f64;
    for (k, w) in &after[0] {
        worst = worst.max(max_diff(w, &after[1][k]));
    }
    println!("PPO step (4 updates at lr 1e-2): weights checkpointed vs plain max diff {worst:.2e}");
    assert_eq!(worst, 0.0, "the checkpointed step moved the weights {worst:.2e} apart");
}
