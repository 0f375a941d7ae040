//! Value-head options and the separate critic (issue #29 item 4) on tiny random GPT-2s
//! (V = 50, EOS = 49): the default head is today's bit for bit, a detached head keeps the value
//! loss out of the LM, the MLP head's gradients and checkpoints are right, and a critic on its
//! own backbone learns a fixed-return task with its own learning rate while the value loss never
//! reaches the policy.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rltune::generation::{generate, GenerationConfig};
use rltune::models::gpt2::Gpt2Config;
use rltune::models::load::{load_policy, load_policy_with, local_files, save_pretrained};
use rltune::models::{
    CausalLm, CausalLmConfig, CausalLmWithValueHead, ValueHead, ValueHeadKind, ValueHeadSpec,
};
use rltune::params::ParamStore;
use rltune::ppo::{Critic, PpoConfig, PpoTrainer, RolloutCache, Stat, Stats, StepInput};

use crate::common::{gradient_check, max_diff, pseudo_random, tiny_gpt2};

const EOS: u32 = 49;
const MLP: ValueHeadSpec = ValueHeadSpec { kind: ValueHeadKind::Mlp, hidden: None };

/// A tiny GPT-2 (V = `vocab`) with the value head `spec`.
fn tiny_with_head(seed: u64, vocab: usize, spec: ValueHeadSpec) -> (ParamStore, CausalLmWithValueHead) {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(vocab, 16, 2, 4, 64));
    let store = ParamStore::random(seed, true, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    let model = CausalLmWithValueHead::load_with(&store.root(), lm, spec).unwrap();
    (store, model)
}

/// The config.json of a tiny GPT-2.
fn config_json(lm: &CausalLm) -> serde_json::Value {
    let CausalLmConfig::Gpt2(c) = lm.config() else { panic!("not a GPT-2") };
    let mut json = serde_json::to_value(c).unwrap();
    json["model_type"] = "gpt2".into();
    json
}

fn as_str(words: &[String]) -> Vec<&str> {
    words.iter().map(String::as_str).collect()
}

fn trainer_from(config: PpoConfig, store: ParamStore, policy: CausalLmWithValueHead) -> PpoTrainer {
    let ref_store = store.frozen_copy().unwrap();
    let reference = CausalLm::load(&ref_store.root(), policy.lm.config()).unwrap();
    PpoTrainer::new(config, store, policy, reference).unwrap()
}

/// A trainer on `tiny_gpt2(1)` with a critic on `tiny_gpt2(2)` (another backbone) at `critic_lr`.
fn critic_trainer(config: PpoConfig, critic_lr: f64) -> PpoTrainer {
    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let (cstore, cmodel) = tiny_with_head(2, 50, config.value_head_spec());
    let critic = Critic::new(cstore, cmodel, critic_lr).unwrap();
    trainer_from(config, store, policy).with_critic(critic).unwrap()
}

/// A fixed batch: queries of 1–5 tokens and responses of 2–6 tokens, ids below EOS.
fn batch(n: usize, seed: u64) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut rows = |lo: usize, hi: usize| -> Vec<Vec<u32>> {
        (0..n).map(|_| (0..rng.gen_range(lo..=hi)).map(|_| rng.gen_range(0..EOS)).collect()).collect()
    };
    (rows(1, 5), rows(2, 6))
}

/// The fixed return of a query: ±1 by its first token's parity.
fn fixed_score(q: &[u32]) -> f32 {
    if q[0].is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

fn scalar(stats: &Stats, key: &str) -> f64 {
    stats.get(key).and_then(Stat::as_f64).unwrap_or_else(|| panic!("no scalar stat {key}"))
}

/// Every scalar stat but the wall-clock times.
fn scalars(stats: &Stats) -> BTreeMap<String, u64> {
    stats
        .iter()
        .filter(|(k, _)| !k.starts_with("time/"))
        .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x.to_bits())))
        .collect()
}

fn snapshot(store: &ParamStore) -> BTreeMap<String, Tensor> {
    store.snapshot().unwrap()
}

/// The names whose tensors differ at all between two snapshots, and the largest difference.
fn changed(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> (Vec<String>, f64) {
    let diffs: Vec<(String, f64)> = a.iter().map(|(k, x)| (k.clone(), max_diff(x, &b[k]))).collect();
    let worst = diffs.iter().map(|(_, d)| *d).fold(0.0, f64::max);
    (diffs.into_iter().filter(|(_, d)| *d > 0.0).map(|(k, _)| k).collect(), worst)
}

fn small_config() -> PpoConfig {
    PpoConfig { batch_size: 8, mini_batch_size: 4, ppo_epochs: 2, learning_rate: 1e-3, ..Default::default() }
}

/// Two steps on fixed synthetic batches; the scalar stats of each and the final weights.
fn two_steps(t: &mut PpoTrainer) -> (Vec<BTreeMap<String, u64>>, BTreeMap<String, Tensor>) {
    let mut out = Vec::new();
    for step in 0..2 {
        let (q, r) = batch(8, 10 + step);
        let scores: Vec<f32> = q.iter().map(|q| fixed_score(q) * 0.5 + step as f32).collect();
        out.push(scalars(&t.step(&q, &r, &scores).unwrap()));
    }
    (out, snapshot(&t.store))
}

#[test]
fn explicit_linear_attached_head_is_the_default_bit_for_bit() {
    crate::common::install();
    let d = PpoConfig::default();
    assert_eq!(
        (d.value_head, d.value_head_hidden, d.detach_value_head),
        (ValueHeadKind::Linear, None, false)
    );
    let toml = "[ppo]\nbatch_size = 8\nmini_batch_size = 4\nppo_epochs = 2\nlearning_rate = 1e-3\n\
                value_head = \"linear\"\ndetach_value_head = false\n";
    let explicit = PpoConfig::from_toml_str(toml, std::path::Path::new("run.toml")).unwrap();
    assert_eq!(explicit, small_config());

    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let (a_stats, a_weights) = two_steps(&mut trainer_from(small_config(), store, policy));
    let (store, policy) = tiny_with_head(1, 50, explicit.value_head_spec());
    let (b_stats, b_weights) = two_steps(&mut trainer_from(explicit, store, policy));
    assert_eq!(a_stats, b_stats, "the stats differ");
    let (names, worst) = changed(&a_weights, &b_weights);
    assert!(names.is_empty(), "weights differ by up to {worst}: {names:?}");
}

/// One step with `vf_coef` on a fixed batch; the policy's weights after it.
fn one_step_weights(detach: bool, vf_coef: f64) -> BTreeMap<String, Tensor> {
    let config = PpoConfig { detach_value_head: detach, vf_coef, ..small_config() };
    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let mut t = trainer_from(config, store, policy);
    let (q, r) = batch(8, 3);
    let scores: Vec<f32> = q.iter().map(|q| fixed_score(q)).collect();
    t.step(&q, &r, &scores).unwrap();
    snapshot(&t.store)
}

#[test]
fn a_detached_head_keeps_the_value_loss_out_of_the_lm() {
    crate::common::install();
    let head = |names: &[String]| names.iter().all(|n| n.starts_with("v_head."));
    // Detached: the value loss's weight changes only the head.
    let (names, worst) = changed(&one_step_weights(true, 0.0), &one_step_weights(true, 10.0));
    assert!(!names.is_empty() && head(&names), "detached: changed {names:?} (worst {worst})");
    // Attached (TRL): it reaches the LM too.
    let (names, worst) = changed(&one_step_weights(false, 0.0), &one_step_weights(false, 10.0));
    println!("attached: {} tensors changed, worst {worst:.3e}", names.len());
    assert!(!head(&names), "attached: only the head changed");
}

#[test]
fn mlp_head_gradients_match_finite_differences() {
    crate::common::install();
    let store = ParamStore::random(5, true, DType::F64, &Device::Cpu).unwrap();
    let head =
        ValueHead::load_with(&store.root(), 8, ValueHeadSpec { kind: ValueHeadKind::Mlp, hidden: Some(6) })
            .unwrap();
    assert_eq!((head.kind(), head.mlp_width()), (ValueHeadKind::Mlp, Some(6)));
    let names: Vec<String> = store.vars().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "v_head.summary.0.bias",
            "v_head.summary.0.weight",
            "v_head.summary.2.bias",
            "v_head.summary.2.weight"
        ]
    );
    let hidden = pseudo_random(&[2, 3, 8], 7, DType::F64);
    let target = pseudo_random(&[2, 3], 8, DType::F64);
    let loss = || (head.forward(&hidden).unwrap() - &target).unwrap().sqr().unwrap().sum_all().unwrap();
    gradient_check(&store.vars(), loss, 1e-4);
}

#[test]
fn mlp_head_round_trips_through_a_checkpoint_and_a_mismatch_names_the_setting() {
    crate::common::install();
    let (store, model) = tiny_with_head(3, 50, MLP);
    assert_eq!(model.v_head.mlp_width(), Some(32), "trlx's width: 2 × n_embd");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mlp");
    save_pretrained(&dir, &store, &config_json(&model.lm)).unwrap();
    let path = dir.to_str().unwrap();
    let loaded = load_policy(path, false, DType::F32, &Device::Cpu).unwrap();
    assert!(loaded.store.initialized().is_empty(), "{:?}", loaded.store.initialized());
    assert_eq!((loaded.model.v_head.kind(), loaded.model.v_head.mlp_width()), (ValueHeadKind::Mlp, Some(32)));
    let hidden = pseudo_random(&[2, 4, 16], 1, DType::F32);
    let (a, b) = (model.v_head.forward(&hidden).unwrap(), loaded.model.v_head.forward(&hidden).unwrap());
    assert_eq!(max_diff(&a, &b), 0.0);

    let err =
        |spec| load_policy_with(path, Some(spec), false, DType::F32, &Device::Cpu).unwrap_err().to_string();
    let e = err(ValueHeadSpec::default());
    assert!(e.contains("v_head.summary.0.weight") && e.contains("value_head = \"mlp\""), "{e}");
    let e = err(ValueHeadSpec { kind: ValueHeadKind::Mlp, hidden: Some(8) });
    assert!(e.contains("value_head_hidden = 8") && e.contains("32"), "{e}");
    // A trainer whose [ppo] value_head does not describe the policy's head says so.
    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let mut t = trainer_from(PpoConfig { value_head: ValueHeadKind::Mlp, ..small_config() }, store, policy);
    let (q, r) = batch(8, 1);
    let e = t.step(&q, &r, &[0.0; 8]).unwrap_err().to_string();
    assert!(e.contains("ppo.value_head = \"mlp\"") && e.contains("policy's value head is linear"), "{e}");
}

/// `steps` PPO steps on one fixed batch whose return is `fixed_score(query)` (no KL penalty, so
/// every response token's return is the score); `ppo/val/error` of each step.
fn fixed_return_errors(t: &mut PpoTrainer, steps: u64) -> Vec<f64> {
    let (q, r) = batch(8, 42);
    let scores: Vec<f32> = q.iter().map(|q| fixed_score(q)).collect();
    (0..steps).map(|_| scalar(&t.step(&q, &r, &scores).unwrap(), "ppo/val/error")).collect()
}

fn fixed_return_config(value_head: ValueHeadKind) -> PpoConfig {
    PpoConfig {
        init_kl_coef: 0.0,
        adap_kl_ctrl: false,
        learning_rate: 1e-5,
        ppo_epochs: 4,
        value_head,
        cliprange_value: 10.0,
        ..small_config()
    }
}

#[test]
fn a_separate_critic_learns_a_fixed_return_task() {
    crate::common::install();
    let mut t = critic_trainer(fixed_return_config(ValueHeadKind::Linear), 3e-3);
    let before = snapshot(&t.critic().unwrap().store);
    let errors = fixed_return_errors(&mut t, 12);
    println!("critic ppo/val/error by step: {errors:.4?}");
    let (first, last) = (errors[0], errors[errors.len() - 1]);
    assert!(last < 0.1 * first, "the critic's value error went from {first:.4} to {last:.4}");
    let (names, _) = changed(&before, &snapshot(&t.critic().unwrap().store));
    assert!(names.iter().any(|n| n.starts_with("transformer.")), "the critic's backbone trains: {names:?}");
    // PpoTrainer::values reads the critic: it now predicts the returns.
    let (q, r) = batch(8, 42);
    let values = t.values(&q, &r).unwrap();
    let err: f64 = q
        .iter()
        .zip(&values)
        .flat_map(|(q, v)| v.iter().map(move |&v| (v as f64 - fixed_score(q) as f64).powi(2)))
        .sum::<f64>()
        / values.iter().map(Vec::len).sum::<usize>() as f64;
    println!("values() squared error after training: {err:.5}");
    assert!(err < 0.1 * first, "{err}");
}

#[test]
fn an_mlp_head_learns_a_fixed_return_task() {
    crate::common::install();
    let (store, policy) = tiny_with_head(1, 50, MLP);
    let mut t = trainer_from(
        PpoConfig { learning_rate: 1e-3, ..fixed_return_config(ValueHeadKind::Mlp) },
        store,
        policy,
    );
    let errors = fixed_return_errors(&mut t, 12);
    println!("shared MLP head ppo/val/error by step: {errors:.4?}");
    assert!(errors[11] < 0.25 * errors[0], "{errors:?}");
}

#[test]
fn the_value_loss_never_reaches_the_policy_and_the_critic_has_its_own_lr() {
    crate::common::install();
    let config = PpoConfig { ppo_epochs: 1, mini_batch_size: 8, learning_rate: 1e-5, ..small_config() };
    let (q, r) = batch(8, 5);
    let scores: Vec<f32> = q.iter().map(|q| fixed_score(q)).collect();
    let run = |vf_coef: f64, critic_lr: f64| {
        let mut t = critic_trainer(PpoConfig { vf_coef, ..config.clone() }, critic_lr);
        let (p0, c0) = (snapshot(&t.store), snapshot(&t.critic().unwrap().store));
        let stats = t.step(&q, &r, &scores).unwrap();
        assert_eq!(scalar(&stats, "rltune/critic_learning_rate"), critic_lr);
        (p0, snapshot(&t.store), c0, snapshot(&t.critic().unwrap().store))
    };
    let (p0, p_small, c0, c_small) = run(0.1, 1e-3);
    let (_, p_large, _, c_large) = run(10.0, 1e-3);
    let (names, worst) = changed(&p_small, &p_large);
    assert!(names.is_empty(), "vf_coef changed the policy: {names:?} (worst {worst})");
    // One Adam step moves each weight by at most lr (by about lr where the gradient is not
    // tiny), up to the f32 rounding of weights near 1 (norm gains): 2% of lr.
    let (_, policy_step) = changed(&p0, &p_small);
    let (_, critic_step) = changed(&c0, &c_small);
    println!("largest update: policy {policy_step:.3e} (lr 1e-5), critic {critic_step:.3e} (lr 1e-3)");
    assert!(policy_step > 0.0 && policy_step <= 1.02e-5, "{policy_step}");
    assert!(critic_step > 0.9e-3 && critic_step <= 1.02e-3, "{critic_step}");
    // The policy's own value head is never read, so never trained.
    assert!(changed(&p0, &p_small).0.iter().all(|n| !n.starts_with("v_head.")));
    // The critic's loss is vf_coef · vf_loss: the coefficient reaches it (Adam's ε makes the
    // first step depend on the gradient's scale where it is tiny).
    assert!(!changed(&c_small, &c_large).0.is_empty());
    // The critic's learning rate scales its step and leaves the policy alone.
    let (_, p_fast, _, c_fast) = run(0.1, 2e-3);
    assert!(changed(&p_small, &p_fast).0.is_empty());
    let (_, critic_fast) = changed(&c0, &c_fast);
    assert!(critic_fast > 1.8e-3 && critic_fast <= 2.04e-3, "{critic_fast}");
}

#[test]
fn critic_values_with_the_rollout_cache_equal_recomputation() {
    crate::common::install();
    let config = PpoConfig { ppo_epochs: 1, ..small_config() };
    let (q, _) = batch(8, 9);
    let gen = GenerationConfig { max_new_tokens: 6, seed: 4, ..Default::default() };
    let mut a = critic_trainer(config.clone(), 1e-3);
    let mut b = critic_trainer(config, 1e-3);
    let samples = generate(&a.policy.lm, None, &q, &gen, &Device::Cpu).unwrap();
    assert!(samples.iter().all(|s| s.values.is_none()));
    let r: Vec<Vec<u32>> = samples.iter().map(|s| s.response_ids.clone()).collect();
    let caches: Vec<RolloutCache> =
        samples.iter().map(|s| RolloutCache { logprobs: s.logprobs.clone(), values: Vec::new() }).collect();
    let scores: Vec<f32> = q.iter().map(|q| fixed_score(q)).collect();
    let cached = a
        .step_with(StepInput {
            queries: &q,
            responses: &r,
            scores: &scores,
            response_masks: None,
            rollout: Some(&caches),
            bootstrap: None,
            allowed: None,
        })
        .unwrap();
    let plain = b.step(&q, &r, &scores).unwrap();
    for key in ["ppo/val/mean", "ppo/val/vpred", "ppo/val/error", "ppo/loss/value", "ppo/returns/mean"] {
        let (x, y) = (scalar(&cached, key), scalar(&plain, key));
        assert!((x - y).abs() < 1e-5, "{key}: cached {x} vs recomputed {y}");
    }
}

#[test]
fn a_critic_of_another_vocabulary_is_refused_naming_the_table() {
    crate::common::install();
    let (store, policy) = tiny_gpt2(1, true, DType::F32);
    let (cstore, cmodel) = tiny_with_head(2, 40, ValueHeadSpec::default());
    let critic = Critic::new(cstore, cmodel, 1e-3).unwrap();
    let err = match trainer_from(small_config(), store, policy).with_critic(critic) {
        Ok(_) => panic!("a critic with V = 40 for a policy with V = 50 was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("[critic]") && err.contains("vocab_size is 40") && err.contains("50"), "{err}");
}

/// A checkpoint with the critic and both optimizers, restored into a fresh trainer, continues
/// exactly as the trainer that saved it.
#[test]
fn a_checkpoint_restores_the_critic_and_its_optimizer() {
    crate::common::install();
    use rltune::run::checkpoint::{load_trainer_state, save_checkpoint, CriticFiles, CRITIC_DIR};
    let config = PpoConfig { ppo_epochs: 1, ..small_config() };
    let mut t = critic_trainer(config.clone(), 3e-3);
    let (q, r) = batch(8, 6);
    let scores: Vec<f32> = q.iter().map(|q| fixed_score(q)).collect();
    t.step(&q, &r, &scores).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let json = config_json(&t.policy.lm);
    let src = tmp.path().join("src");
    save_pretrained(&src, &t.store, &json).unwrap();
    let files = local_files(&src).unwrap();
    let critic_files = CriticFiles { config_json: json.clone(), files: files.clone() };
    let ckpt = tmp.path().join("step-1");
    save_checkpoint(&ckpt, &t, &json, &files, Some(&critic_files), true, 1, 0).unwrap();
    assert!(ckpt.join(CRITIC_DIR).join("model.safetensors").is_file());
    assert!(ckpt.join(CRITIC_DIR).join("optimizer.safetensors").is_file());

    let dev = Device::Cpu;
    let policy = load_policy(ckpt.to_str().unwrap(), true, DType::F32, &dev).unwrap();
    let critic = load_policy(ckpt.join(CRITIC_DIR).to_str().unwrap(), true, DType::F32, &dev).unwrap();
    let critic = Critic::new(critic.store, critic.model, 3e-3).unwrap();
    // The reference stays the run's initial model.
    let restored = PpoTrainer::new(config, policy.store, policy.model, t.reference.clone()).unwrap();
    let mut restored = restored.with_critic(critic).unwrap();
    load_trainer_state(&ckpt, &mut restored).unwrap();
    assert_eq!(restored.critic().unwrap().optimizer().steps(), t.critic().unwrap().optimizer().steps());

    let (q, r) = batch(8, 7);
    let a = scalars(&t.step(&q, &r, &scores).unwrap());
    let b = scalars(&restored.step(&q, &r, &scores).unwrap());
    assert_eq!(a, b, "the resumed step differs");
    let (names, worst) =
        changed(&snapshot(&t.critic().unwrap().store), &snapshot(&restored.critic().unwrap().store));
    assert!(names.is_empty(), "critic weights differ by {worst}: {names:?}");
}

/// `rltune ppo`'s critic loading: a tokenizer or vocabulary other than the policy's, and a
/// checkpoint that does not match the config's `[critic]`, are errors naming the table.
#[test]
fn run_critic_loading_checks_the_tokenizer_and_the_checkpoint() {
    crate::common::install();
    use rltune::run::critic::load_critic;
    use rltune::run::RunConfig;
    let tmp = tempfile::tempdir().unwrap();
    let words: Vec<String> = (0..48).map(|i| format!("w{i}")).collect();
    let mut swapped = words.clone();
    swapped.swap(3, 4);
    let policy_tok = crate::common::word_tokenizer(&as_str(&words), false);
    let save = |name: &str, vocab: usize, tok: &[String]| {
        let (store, model) = tiny_with_head(2, vocab, ValueHeadSpec::default());
        let dir = tmp.path().join(name);
        save_pretrained(&dir, &store, &config_json(&model.lm)).unwrap();
        let t = crate::common::word_tokenizer(&as_str(tok), false);
        t.inner().save(dir.join("tokenizer.json"), false).unwrap();
        dir
    };
    let config = |dir: &std::path::Path| {
        let text = format!(
            "[model]\npath = \"p\"\n[data]\nsource = \"d.jsonl\"\n[[reward.sources]]\nkind = \"command\"\n\
             command = [\"cat\"]\n[critic]\npath = {:?}\nlearning_rate = 1e-4\n",
            dir.to_str().unwrap()
        );
        RunConfig::from_toml(&text, std::path::Path::new("run.toml"), &[]).unwrap()
    };
    let load = |cfg: &RunConfig, ckpt: Option<&std::path::Path>| {
        load_critic(cfg, ckpt, &policy_tok, 50, DType::F32, &Device::Cpu)
            .map(|c| c.map(|(c, _)| c.optimizer().cfg.lr))
    };
    let good = save("good", 50, &words);
    assert_eq!(load(&config(&good), None).unwrap(), Some(1e-4));

    let err = load(&config(&save("swapped", 50, &swapped)), None).unwrap_err().to_string();
    assert!(
        err.contains("[critic] path") && err.contains("tokenizer differs") && err.contains("\"w4\" is id 3"),
        "{err}"
    );
    let err = load(&config(&save("small", 40, &words[..38])), None).unwrap_err().to_string();
    assert!(err.contains("[critic] path") && err.contains("vocab_size is 40"), "{err}");

    // A checkpoint without critic/ for a config with [critic], and the reverse.
    let ckpt = tmp.path().join("step-1");
    std::fs::create_dir_all(&ckpt).unwrap();
    let err = load(&config(&good), Some(&ckpt)).unwrap_err().to_string();
    assert!(err.contains("has no critic/") && err.contains("remove the [critic] table"), "{err}");
    std::fs::create_dir_all(ckpt.join("critic")).unwrap();
    let mut without = config(&good);
    without.critic = None;
    let err = load(&without, Some(&ckpt)).unwrap_err().to_string();
    assert!(err.contains("holds a critic") && err.contains("add [critic]"), "{err}");
}

/// `rltune ppo` with `[critic]`, through `PpoRun`: the critic trains, is checkpointed in
/// `critic/` with its optimizer, and a run resumed from step 2 ends with the weights and
/// metrics of a straight 3-step run.
#[test]
fn a_run_with_a_critic_checkpoints_it_and_resumes_exactly() {
    crate::common::install();
    critic_run_resumes_exactly(false, false);
}

/// The same with `[critic.lora]`: the critic's base stays bitwise, its checkpoint holds the
/// adapter and value head (PEFT's files) with their Adam moments, and the resumed run is exact.
#[test]
fn a_run_with_a_lora_critic_checkpoints_the_adapter_and_resumes_exactly() {
    crate::common::install();
    critic_run_resumes_exactly(false, true);
}

/// The same on text games (`[env]`, the letter toy): the turns bootstrap from the critic.
#[test]
fn a_run_on_text_games_with_a_critic_checkpoints_it_and_resumes_exactly() {
    crate::common::install();
    critic_run_resumes_exactly(true, false);
}

fn critic_run_resumes_exactly(games: bool, lora: bool) {
    use rltune::run::{PpoRun, RunConfig};
    use std::sync::atomic::AtomicBool;
    let tmp = tempfile::tempdir().unwrap();
    let words: Vec<String> = (0..48).map(|i| format!("w{i}")).collect();
    let tok = crate::common::word_tokenizer(&as_str(&words), false);
    let save = |name: &str, seed: u64| {
        let (store, model) = tiny_with_head(seed, 50, ValueHeadSpec::default());
        let dir = tmp.path().join(name);
        save_pretrained(&dir, &store, &config_json(&model.lm)).unwrap();
        tok.inner().save(dir.join("tokenizer.json"), false).unwrap();
        dir
    };
    let (policy, critic) = (save("policy", 1), save("critic", 2));
    let prompts = tmp.path().join("prompts.jsonl");
    let lines: Vec<String> =
        (0..12).map(|i| format!("{{\"text\": \"w{} w{} w{}\"}}", i, (i * 7) % 48, (i * 5) % 48)).collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let config = |run: &str, steps: usize| {
        let source = if games {
            "[env]\nkind = \"letters\"\nnum_envs = 2\nturns = 2\n[agent]\nmemory_turns = 1\n".to_string()
        } else {
            format!(
                "[data]\nsource = {:?}\nmin_query_tokens = 1\nmax_query_tokens = 4\n[[reward.sources]]\n\
                 kind = \"command\"\ncommand = [\"sh\", \"-c\", \"while read l; do echo 1; done\"]\n",
                prompts.to_str().unwrap()
            )
        };
        let critic_lora = if lora { "[critic.lora]\nr = 2\nlora_alpha = 4\n" } else { "" };
        let text = format!(
            "[model]\npath = {:?}\n[critic]\npath = {:?}\nlearning_rate = 1e-3\n{critic_lora}{source}\
             [generation]\nmax_new_tokens = 4\n\
             [ppo]\nbatch_size = 4\nmini_batch_size = 2\nppo_epochs = 2\nlearning_rate = 1e-4\nsteps = {steps}\n\
             [logging]\ndir = {:?}\n[checkpoint]\nevery = 2\noptimizer_state = true\n",
            policy.to_str().unwrap(),
            critic.to_str().unwrap(),
            tmp.path().join(run).to_str().unwrap()
        );
        RunConfig::from_toml(&text, std::path::Path::new("run.toml"), &[]).unwrap()
    };
    let stop = AtomicBool::new(false);
    let run = |cfg: RunConfig, resume: bool| {
        let mut r = PpoRun::prepare(cfg, Vec::new(), resume).unwrap();
        r.run(&stop, &mut |_| {}).unwrap();
        r
    };
    let straight = run(config("straight", 3), false);
    run(config("resumed", 2), false);
    let ckpt = tmp.path().join("resumed/checkpoints/step-2/critic");
    let files: &[&str] = if lora {
        &[
            "adapter_config.json",
            "adapter_model.safetensors",
            "value_head.safetensors",
            "optimizer.safetensors",
        ]
    } else {
        &["model.safetensors", "config.json", "tokenizer.json", "optimizer.safetensors"]
    };
    for f in files {
        assert!(ckpt.join(f).is_file(), "no critic/{f} in the checkpoint");
    }
    let resumed = run(config("resumed", 3), true);
    let metrics = |run: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(tmp.path().join(run).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                v.as_object_mut().unwrap().retain(|k, _| !k.starts_with("time/"));
                v
            })
            .collect()
    };
    let (a, b) = (metrics("straight"), metrics("resumed"));
    assert_eq!(a.len(), 3);
    assert_eq!(a[2]["rltune/critic_learning_rate"], 1e-3);
    assert_eq!(a, b, "the resumed run's metrics differ");
    // With LoRA the value head in the store's tensors is where the critic was loaded from (a
    // resumed run's, the checkpoint's); the trained one is among the variables, compared below.
    let critic_of = |r: &PpoRun| {
        let mut s = snapshot(&r.trainer.critic().unwrap().store);
        s.retain(|k, _| !(lora && k.starts_with("v_head.")));
        s
    };
    let (names, worst) = changed(&critic_of(&straight), &critic_of(&resumed));
    assert!(names.is_empty(), "the critics differ by {worst}: {names:?}");
    let trained = |r: &PpoRun| -> BTreeMap<String, Tensor> {
        let vars = r.trainer.critic().unwrap().store.vars();
        vars.into_iter().map(|(k, v)| (k, v.as_tensor().copy().unwrap())).collect()
    };
    let (names, worst) = changed(&trained(&straight), &trained(&resumed));
    assert!(names.is_empty(), "the critics' trained variables differ by {worst}: {names:?}");
    if lora {
        // The base is `[critic] path`'s, bitwise; the variables are the adapters and the head.
        let (base, _) = tiny_with_head(2, 50, ValueHeadSpec::default());
        let mut base = snapshot(&base);
        base.retain(|k, _| !k.starts_with("v_head."));
        let (moved, _) = changed(&base, &critic_of(&straight));
        assert!(moved.is_empty(), "the LoRA critic's base moved: {moved:?}");
        let vars = trained(&straight);
        assert!(vars.keys().all(|k| k.contains(".lora_") || k.starts_with("v_head.")), "{vars:?}");
        assert!(vars.keys().any(|k| k.contains(".lora_B.")), "{:?}", vars.keys());
    }
    let (names, _) = changed(&snapshot(&straight.trainer.store), &snapshot(&resumed.trainer.store));
    assert!(names.is_empty(), "the policies differ: {names:?}");
}
