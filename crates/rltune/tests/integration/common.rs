//! Helpers shared by the integration tests.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};
use rltune::models::{gpt2::Gpt2Config, CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::params::ParamStore;
use rltune::tokenizer::Tokenizer;

/// The process-wide settings the `rltune` binary makes once the runtime is resolved (FTZ/DAZ
/// on this thread and rayon's pool, f32 matrix products): no library constructor makes them, so
/// a test that trains or compares numbers with a golden fixture calls this first, on its own
/// thread (FTZ/DAZ is per thread).
pub fn install() {
    rltune::runtime::Runtime::cpu().install().expect("the CPU runtime installs");
}

/// `tools/fixtures/<rel>` in the repository.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures").join(rel)
}

/// Largest absolute difference between two tensors of the same shape.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

/// A tiny random GPT-2 with a value head.
pub fn tiny_gpt2(seed: u64, trainable: bool, dtype: DType) -> (ParamStore, CausalLmWithValueHead) {
    let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(50, 16, 2, 4, 64));
    let store = ParamStore::random(seed, trainable, dtype, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    let model = CausalLmWithValueHead::load(&store.root(), lm).unwrap();
    (store, model)
}

/// Deterministic pseudo-random tensor in [-1, 1).
pub fn pseudo_random(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// Checks a model's gradients: every variable gets a finite, non-zero gradient, and a few entries
/// of each agree with central finite differences (relative error below `tol`).
pub fn gradient_check(vars: &[(String, Var)], loss: impl Fn() -> Tensor, tol: f64) {
    let grads = loss().backward().unwrap();
    let mut checked = 0;
    for (i, (name, var)) in vars.iter().enumerate() {
        let g = grads.get(var).unwrap_or_else(|| panic!("{name}: no gradient"));
        let gv = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert!(gv.iter().all(|x| x.is_finite()), "{name}: non-finite gradient");
        assert!(gv.iter().any(|x| *x != 0.0), "{name}: all-zero gradient");
        // Probe the largest entry and one more.
        let arg = (0..gv.len()).max_by(|&a, &b| gv[a].abs().total_cmp(&gv[b].abs())).unwrap();
        for idx in [arg, (i * 7 + 3) % gv.len()] {
            let orig = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let eps = 1e-5;
            let mut plus = orig.clone();
            plus[idx] += eps;
            var.set(&Tensor::from_vec(plus, var.shape(), &Device::Cpu).unwrap()).unwrap();
            let lp = loss().to_scalar::<f64>().unwrap();
            let mut minus = orig.clone();
            minus[idx] -= eps;
            var.set(&Tensor::from_vec(minus, var.shape(), &Device::Cpu).unwrap()).unwrap();
            let lm = loss().to_scalar::<f64>().unwrap();
            var.set(&Tensor::from_vec(orig, var.shape(), &Device::Cpu).unwrap()).unwrap();
            let fd = (lp - lm) / (2.0 * eps);
            let err = (fd - gv[idx]).abs() / (fd.abs().max(gv[idx].abs()).max(1e-6));
            assert!(
                err < tol,
                "{name}[{idx}]: analytic {} vs finite difference {fd} (rel err {err})",
                gv[idx]
            );
            checked += 1;
        }
    }
    println!("gradient check: {} tensors, {checked} entries", vars.len());
}

/// [`Tokenizer::word_level`], which a test's fixed words always make.
pub fn word_tokenizer(words: &[&str], bert: bool) -> Tokenizer {
    Tokenizer::word_level(words, bert).unwrap()
}

/// The count of recomputed checkpoint segments is the process's: tests that checkpoint, or that
/// count recomputations, hold this while they run.
pub fn checkpoint_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A tiny model of every supported family (4 layers, width 16, vocabulary 50), by name.
pub fn every_family() -> Vec<(&'static str, CausalLmConfig)> {
    use rltune::models::{gpt_neo::GptNeoConfig, gpt_neox::GptNeoXConfig, llama::LlamaConfig};
    vec![
        ("gpt2", CausalLmConfig::Gpt2(Gpt2Config::tiny(50, 16, 4, 4, 64))),
        ("llama", CausalLmConfig::Llama(LlamaConfig::tiny(50, 16, 4, 4, 2))),
        ("gpt_neo", CausalLmConfig::GptNeo(GptNeoConfig::tiny(50, 16, 4, 4, 4))),
        ("gpt_neox", CausalLmConfig::GptNeoX(GptNeoXConfig::tiny(50, 16, 4, 4))),
    ]
}

/// Two left-padded rows of ids with their positions and bias (the second row longer than
/// GPT-Neo's window of 4).
pub fn left_padded_batch() -> (Tensor, Tensor, Tensor) {
    use rltune::models::layers::{causal_bias, position_ids_from_mask};
    let mask = vec![vec![0u8, 0, 1, 1, 1, 1, 1], vec![1u8; 7]];
    let ids = Tensor::from_vec(vec![0u32, 0, 5, 9, 2, 31, 7, 3, 14, 15, 9, 26, 5, 35], (2, 7), &Device::Cpu)
        .unwrap();
    let pos = position_ids_from_mask(&mask, &Device::Cpu).unwrap();
    let bias = causal_bias(&mask, 7, DType::F32, &Device::Cpu).unwrap();
    (ids, pos, bias)
}

/// One PPO step on four fixed rows (queries, responses, scores), for tests that compare what
/// two trainers make of the same step.
pub fn step_on_four_rows(t: &mut rltune::ppo::PpoTrainer) {
    let queries: Vec<Vec<u32>> = vec![vec![3, 8, 1], vec![5], vec![7, 7, 2, 9], vec![11, 4]];
    let responses: Vec<Vec<u32>> = vec![vec![9, 1], vec![4, 4, 2], vec![30], vec![12, 13, 14, 49]];
    let scores = [1.0f32, -0.5, 0.25, 2.0];
    t.step_with(rltune::ppo::StepInput {
        queries: &queries,
        responses: &responses,
        scores: &scores,
        response_masks: None,
        rollout: None,
        bootstrap: None,
        allowed: None,
    })
    .unwrap();
}
