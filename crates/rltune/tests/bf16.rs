//! `MatmulPrecision::Bf16`. The setting is process-wide, so it has a test binary of its own.
//! Where the CPU has AMX-BF16: logits move by bf16 rounding only (and do move, so the AMX path
//! ran), and PPO still learns a toy task. Elsewhere: asking for it is an error naming AMX.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::ops::{matmul_precision, set_matmul_precision, MatmulPrecision};
use rltune::params::ParamStore;
use rltune::ppo::{PpoConfig, PpoTrainer};

/// V = 64 (EOS = 63), d = 64, 2 layers: every product has sides of at least 32, so all of
/// them run on AMX (the shared tiny model, d = 16, would stay in f32).
fn model(seed: u64) -> (ParamStore, CausalLmWithValueHead) {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(64, 64, 2, 4, 64));
    let store = ParamStore::random(seed, true, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    (store.clone(), CausalLmWithValueHead::load(&store.root(), lm).unwrap())
}

fn logits(lm: &CausalLm, ids: &Tensor) -> Vec<f32> {
    let (b, t) = ids.dims2().unwrap();
    let mask = vec![vec![1u8; t]; b];
    let pos = position_ids_from_mask(&mask, &Device::Cpu).unwrap();
    let bias = causal_bias(&mask, t, DType::F32, &Device::Cpu).unwrap();
    let hidden = lm.forward(ids, &pos, &bias, None).unwrap();
    lm.logits(&hidden).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn bf16_changes_numbers_by_rounding_only_and_ppo_still_learns() {
    if let Err(e) = set_matmul_precision(MatmulPrecision::Bf16) {
        let msg = e.to_string();
        assert!(msg.contains("AMX") && msg.contains("f32"), "{msg}");
        assert_eq!(matmul_precision(), MatmulPrecision::F32);
        eprintln!("no AMX-BF16 here ({msg}); the numerics were not checked");
        return;
    }
    set_matmul_precision(MatmulPrecision::F32).unwrap();

    // 8 sequences × 16 tokens: 128 rows.
    let (_, policy) = model(3);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let ids: Vec<u32> = (0..8 * 16).map(|_| rng.gen_range(0..63)).collect();
    let ids = Tensor::from_vec(ids, (8, 16), &Device::Cpu).unwrap();
    let exact = logits(&policy.lm, &ids);
    set_matmul_precision(MatmulPrecision::Bf16).unwrap();
    assert_eq!(matmul_precision(), MatmulPrecision::Bf16);
    let rounded = logits(&policy.lm, &ids);
    let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = exact.iter().zip(&rounded).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("max |logit| {scale:.3}, max |f32 − bf16| {diff:.2e}");
    // bf16 keeps 8 bits of mantissa: a few times 2⁻⁸ of the scale after 2 layers.
    assert!(diff > 0.0, "bf16 logits equal the f32 ones: the AMX path did not run");
    assert!(diff < 0.03 * scale, "bf16 moved the logits by {diff} (scale {scale})");

    // The toy task of ppo_behaviour (emit 5 given tokens of the vocabulary), in both precisions
    // from the same seeds: bf16 learns, and its curves follow the f32 ones.
    let (r32, kl32) = learn(MatmulPrecision::F32);
    let (r16, kl16) = learn(MatmulPrecision::Bf16);
    let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ");
    println!("reward f32:  {}\nreward bf16: {}", fmt(&r32), fmt(&r16));
    println!("kl f32:      {}\nkl bf16:     {}", fmt(&kl32), fmt(&kl16));
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&r16[..4]), mean(&r16[r16.len() - 4..]));
    assert!(last >= first + 2.0, "no learning under bf16: first 4 steps {first:.3}, last 4 steps {last:.3}");
    // Samples differ once probabilities do, so single steps are compared loosely (a batch of
    // 32 has a standard error of about 0.3 in reward); the KL curve over the run tightly.
    for (step, (a, b)) in r32.iter().zip(&r16).enumerate() {
        assert!((a - b).abs() <= 0.5, "step {step}: mean reward f32 {a:.3}, bf16 {b:.3}");
    }
    let (k32, k16) = (mean(&kl32), mean(&kl16));
    assert!((k16 - k32).abs() <= 0.25 * k32, "mean objective/kl over the run: f32 {k32:.3}, bf16 {k16:.3}");
}

/// Mean reward and `objective/kl` per step of 16 PPO steps on the toy task at precision `p`.
fn learn(p: MatmulPrecision) -> (Vec<f64>, Vec<f64>) {
    set_matmul_precision(p).unwrap();
    let targets = [10u32, 11, 12, 13, 14];
    let (store, policy) = model(11);
    let reference = CausalLm::load(&store.frozen_copy().unwrap().root(), policy.lm.config()).unwrap();
    let cfg =
        PpoConfig { batch_size: 32, mini_batch_size: 32, learning_rate: 1e-3, seed: 1, ..Default::default() };
    let mut t = PpoTrainer::new(cfg, store, policy, reference).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let queries: Vec<Vec<u32>> = (0..32).map(|_| (0..4).map(|_| rng.gen_range(0..63)).collect()).collect();
    let (mut rewards, mut kls) = (Vec::new(), Vec::new());
    for step in 0..16u64 {
        let gen =
            GenerationConfig { max_new_tokens: 6, seed: step, stop_at_eos: false, ..Default::default() };
        let samples = generate(&t.policy.lm, Some(&t.policy.v_head), &queries, &gen, &Device::Cpu).unwrap();
        let resp: Vec<Vec<u32>> = samples.iter().map(|s| s.response_ids.clone()).collect();
        let scores: Vec<f32> =
            resp.iter().map(|r| r.iter().filter(|x| targets.contains(x)).count() as f32).collect();
        let stats = t.step(&queries, &resp, &scores).unwrap();
        kls.push(stats.get("objective/kl").and_then(|s| s.as_f64()).unwrap());
        rewards.push(scores.iter().map(|&s| s as f64).sum::<f64>() / scores.len() as f64);
    }
    (rewards, kls)
}
