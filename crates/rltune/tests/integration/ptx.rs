//! PPO-ptx (`[ptx]`, [`PpoTrainer::with_ptx`]) on a tiny random GPT-2 (V = 50, EOS = 49): the
//! update's gradient is PPO's plus `coef ×` the supervised cross-entropy's (checked against
//! autograd on each example alone), the examples' position survives a checkpoint, and the
//! config refuses what it cannot run.

use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use rltune::models::layers::causal_bias;
use rltune::models::CausalLm;
use rltune::ppo::{PpoConfig, PpoTrainer, TrainerStreams};
use rltune::run::RunConfig;
use rltune::train::sft::SftExample;

use crate::common::{max_diff, step_on_four_rows, tiny_gpt2};

/// Four examples of different lengths: a masked prompt, then targets.
fn examples() -> Vec<SftExample> {
    let ex = |ids: &[u32], prompt: usize| SftExample {
        input_ids: ids.to_vec(),
        loss_mask: (0..ids.len()).map(|t| u8::from(t >= prompt)).collect(),
    };
    vec![
        ex(&[3, 9, 27, 5, 49], 2),
        ex(&[11, 40, 49], 1),
        ex(&[7, 7, 7, 8, 1, 2, 49], 4),
        ex(&[30, 20, 10, 49], 3),
    ]
}

fn config() -> PpoConfig {
    PpoConfig {
        batch_size: 4,
        mini_batch_size: 4,
        ppo_epochs: 1,
        learning_rate: 1e-3,
        ..PpoConfig::default()
    }
}

fn trainer(config: PpoConfig) -> PpoTrainer {
    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let ref_store = store.frozen_copy().unwrap();
    let reference = CausalLm::load(&ref_store.root(), policy.lm.config()).unwrap();
    PpoTrainer::new(config, store, policy, reference).unwrap()
}

/// The gradients of the first update, by parameter name.
fn first_gradients(mut t: PpoTrainer) -> Vec<(String, Tensor)> {
    t.record_next_gradients();
    step_on_four_rows(&mut t);
    t.take_recorded_gradients().expect("the step ran an update")
}

/// The SFT loss (mean NLL over all targets) of `examples`, each forwarded alone without padding,
/// and its gradient by autograd, by parameter name.
fn sft_gradients(examples: &[SftExample]) -> Vec<(String, Tensor)> {
    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let dev = Device::Cpu;
    let n: usize = examples.iter().map(SftExample::targets).sum();
    let mut total: Option<Tensor> = None;
    for ex in examples {
        let t = ex.input_ids.len();
        let ids = Tensor::new(ex.input_ids.as_slice(), &dev).unwrap().unsqueeze(0).unwrap();
        let pos = Tensor::arange(0u32, t as u32, &dev).unwrap().unsqueeze(0).unwrap();
        let bias = causal_bias(&[vec![1; t]], t, DType::F32, &dev).unwrap();
        let h = policy.lm.forward(&ids, &pos, &bias, None).unwrap();
        let logits = policy.lm.logits(&h).unwrap().squeeze(0).unwrap();
        let logp = candle_nn_log_softmax(&logits);
        for p in 1..t {
            if ex.loss_mask[p] == 1 {
                let term = logp.get(p - 1).unwrap().get(ex.input_ids[p] as usize).unwrap().neg().unwrap();
                total = Some(match total {
                    Some(s) => (s + term).unwrap(),
                    None => term,
                });
            }
        }
    }
    let loss = (total.unwrap() / n as f64).unwrap();
    let grads = loss.backward().unwrap();
    store
        .vars()
        .into_iter()
        .map(|(name, var)| {
            let g = grads.get(&var).cloned().unwrap_or_else(|| var.as_tensor().zeros_like().unwrap());
            (name, g)
        })
        .collect()
}

/// Log-softmax over the last dimension, composed of plain ops (autograd's reference).
fn candle_nn_log_softmax(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).unwrap().detach();
    let shifted = x.broadcast_sub(&max).unwrap();
    let lse = shifted.exp().unwrap().sum_keepdim(D::Minus1).unwrap().log().unwrap();
    shifted.broadcast_sub(&lse).unwrap()
}

/// The first update of PPO-ptx with coef 0.7 is PPO's plus 0.7 × the SFT gradient of the four
/// examples (one minibatch of 4 draws them all), to float rounding; the value head gets none.
#[test]
fn ptx_adds_coef_times_the_sft_gradient_to_ppo() {
    crate::common::install();
    let coef = 0.7;
    let plain = first_gradients(trainer(config()));
    let mixed = first_gradients(trainer(config()).with_ptx(examples(), coef).unwrap());
    let sft = sft_gradients(&examples());
    assert_eq!(plain.len(), mixed.len());
    let (mut checked, mut moved, mut worst) = (0, 0, 0.0f64);
    for ((name, p), (name2, m)) in plain.iter().zip(&mixed) {
        assert_eq!(name, name2);
        let added = (m - p).unwrap();
        let Some((_, s)) = sft.iter().find(|(n, _)| n == name) else { panic!("{name}: no SFT gradient") };
        let want = (s * coef).unwrap();
        let scale = max_diff(&want, &want.zeros_like().unwrap()).max(1e-3);
        let err = max_diff(&added, &want);
        // f32 sums in another order: a few parts in a million of the largest entry.
        assert!(err <= 2e-5 * scale, "{name}: ptx added {err:.3e} off coef × SFT (scale {scale:.3e})");
        worst = worst.max(err / scale);
        if name.starts_with("v_head") {
            assert_eq!(
                max_diff(&added, &added.zeros_like().unwrap()),
                0.0,
                "{name}: the CE reached the head"
            );
        } else if scale > 1e-3 {
            moved += 1;
        }
        checked += 1;
    }
    println!("ptx gradient: worst relative error {worst:.2e} over {checked} parameters");
    assert!(checked > 10 && moved > 10, "{checked} parameters checked, {moved} moved by the CE");
}

/// Each minibatch draws `mini_batch_size` examples; the position is a stream a checkpoint saves
/// ([`TrainerStreams::ptx_cursor`]) and a restored trainer continues from, and checkpoints of
/// runs without PPO-ptx (no such field) still load.
#[test]
fn ptx_draws_are_part_of_the_trainer_streams() {
    crate::common::install();
    let cfg = PpoConfig { mini_batch_size: 2, ppo_epochs: 2, ..config() };
    let mut a = trainer(cfg.clone()).with_ptx(examples(), 1.0).unwrap();
    step_on_four_rows(&mut a);
    let s = a.streams();
    // 2 epochs × 2 minibatches × 2 examples.
    assert_eq!(s.ptx_cursor, 8);
    step_on_four_rows(&mut a);
    assert_eq!(a.streams().ptx_cursor, 16);
    let mut b = trainer(cfg).with_ptx(examples(), 1.0).unwrap();
    b.restore_streams(&s);
    assert_eq!(b.streams(), s);
    let mut old = serde_json::to_value(&s).unwrap();
    old.as_object_mut().unwrap().remove("ptx_cursor");
    let back: TrainerStreams = serde_json::from_value(old).unwrap();
    assert_eq!(back.ptx_cursor, 0);
    // Without examples with targets, or with a coef of 0, there is nothing to mix.
    let no_target = vec![SftExample { input_ids: vec![1, 2], loss_mask: vec![0, 0] }];
    let err = trainer(config()).with_ptx(no_target, 1.0).err().unwrap().to_string();
    assert!(err.contains("no target token"), "{err}");
    let err = trainer(config()).with_ptx(examples(), 0.0).err().unwrap().to_string();
    assert!(err.contains("above 0"), "{err}");
}

fn load(name: &str, overrides: &[&str]) -> Result<RunConfig, String> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs").join(name);
    let text = std::fs::read_to_string(&p).unwrap();
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    RunConfig::from_toml(&text, &p, &overrides).map_err(|e| e.to_string())
}

/// `[ptx]` reads with OpenRLHF's default weight, and is refused where it would be ignored or
/// meaningless, naming the field.
#[test]
fn ptx_config_is_checked() {
    let c = load("trl-sentiment.toml", &["ptx.source=\"demos.jsonl\""]).unwrap();
    let p = c.ptx.unwrap();
    assert_eq!((p.source.as_str(), p.coef, p.sft.max_length), ("demos.jsonl", 0.05, 1024));
    let err = load("trl-sentiment.toml", &["ptx.source=\"d.jsonl\"", "ptx.coef=-1"]).unwrap_err();
    assert!(err.contains("ptx") && err.contains("coef"), "{err}");
    let err = load("trl-sentiment.toml", &["ptx.source=\"\""]).unwrap_err();
    assert!(err.contains("ptx") && err.contains("source"), "{err}");
    let err = load("arithmetic-grpo.toml", &["ptx.source=\"d.jsonl\""]).unwrap_err();
    assert!(err.contains("[ptx] works with PPO only"), "{err}");
}
