//! GPT-Neo and GPT-NeoX (Pythia): parity with transformers (logits, values, one step's
//! gradients), cached vs uncached decoding past GPT-Neo's local window, finite differences.

use candle_core::{DType, Device, Tensor};
use rltune::models::gpt_neo::GptNeoConfig;
use rltune::models::gpt_neox::GptNeoXConfig;
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::load::load_policy;
use rltune::models::{CausalLm, CausalLmConfig, CausalLmWithValueHead};
use rltune::params::ParamStore;

use crate::common::{fixture, gradient_check, max_diff, pseudo_random};

/// The fixture's loss (`make_neo_fixtures.py`): next-token CE over unpadded (t, t+1) pairs plus
/// 0.1 × the mean value over unpadded positions. `logits (B, T, V)`, `values (B, T)`.
fn fixture_loss(logits: &Tensor, values: &Tensor, ids: &Tensor, mask: &Tensor) -> Tensor {
    let (_, t, _) = logits.dims3().unwrap();
    let m = mask.to_dtype(logits.dtype()).unwrap();
    let pair = (m.narrow(1, 0, t - 1).unwrap() * m.narrow(1, 1, t - 1).unwrap()).unwrap();
    let logp = rltune::ops::log_softmax_last_dim(&logits.narrow(1, 0, t - 1).unwrap()).unwrap();
    let next = ids.narrow(1, 1, t - 1).unwrap().unsqueeze(2).unwrap().contiguous().unwrap();
    let taken = logp.gather(&next, 2).unwrap().squeeze(2).unwrap();
    let ce = ((taken * &pair).unwrap().sum_all().unwrap()
        / pair.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64)
        .unwrap()
        .neg()
        .unwrap();
    let v = ((values * &m).unwrap().sum_all().unwrap()
        / m.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64)
        .unwrap();
    (ce + (v * 0.1).unwrap()).unwrap()
}

/// Compares logits, hidden states and values at unpadded positions, the loss, and the gradient
/// of every parameter with transformers' (`tools/fixtures/make_neo_fixtures.py`).
fn check_fixture(name: &str) {
    let dir = fixture(&format!("models/{name}"));
    let dev = Device::Cpu;
    let loaded = load_policy(dir.to_str().unwrap(), true, DType::F32, &dev).unwrap();
    assert!(loaded.store.initialized().is_empty(), "{name}: {:?} missing", loaded.store.initialized());
    let exp = candle_core::safetensors::load(dir.join("expected.safetensors"), &dev).unwrap();
    let ids = exp["input_ids"].to_dtype(DType::U32).unwrap();
    let mask_t = exp["attention_mask"].to_dtype(DType::U32).unwrap();
    let mask: Vec<Vec<u8>> = mask_t
        .to_vec2::<u32>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|x| x as u8).collect())
        .collect();
    let t = ids.dim(1).unwrap();
    let pos = position_ids_from_mask(&mask, &dev).unwrap();
    let bias = causal_bias(&mask, t, DType::F32, &dev).unwrap();
    let lm = &loaded.model.lm;
    let hidden = lm.forward(&ids, &pos, &bias, None).unwrap();
    let logits = lm.logits(&hidden).unwrap();
    let values = loaded.model.v_head.forward(&hidden).unwrap();
    let mut worst = [0f64; 3];
    for (b, row) in mask.iter().enumerate() {
        for j in (0..row.len()).filter(|&j| row[j] == 1) {
            let at = |x: &Tensor| x.get(b).unwrap().get(j).unwrap();
            worst[0] = worst[0].max(max_diff(&at(&hidden), &at(&exp["hidden"])));
            worst[1] = worst[1].max(max_diff(&at(&logits), &at(&exp["logits"])));
            worst[2] = worst[2].max(max_diff(&at(&values), &at(&exp["values"])));
        }
    }
    let loss = fixture_loss(&logits, &values, &ids, &mask_t);
    let dloss = (loss.to_scalar::<f32>().unwrap() - exp["loss"].to_scalar::<f32>().unwrap()).abs();
    let grads = loss.backward().unwrap();
    let mut gworst = 0f64;
    let vars = loaded.store.vars();
    for (pname, var) in &vars {
        let want =
            exp.get(&format!("grad.{pname}")).unwrap_or_else(|| panic!("{name}: no grad.{pname} in fixture"));
        let got = grads.get(var).unwrap_or_else(|| panic!("{name}: no gradient for {pname}"));
        let d = max_diff(got, want);
        let scale = max_diff(want, &want.zeros_like().unwrap()).max(1e-3);
        gworst = gworst.max(d / scale);
    }
    let n_grads = exp.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(vars.len(), n_grads, "{name}: every fixture gradient has a parameter");
    println!(
        "{name}: max abs diff hidden {:.2e} logits {:.2e} values {:.2e} loss {dloss:.2e}; \
         gradients max diff / max |grad| {gworst:.2e} over {} tensors",
        worst[0],
        worst[1],
        worst[2],
        vars.len()
    );
    assert!(worst.iter().all(|&d| d < 1e-4), "{name}: max diffs {worst:?} exceed 1e-4");
    assert!(dloss < 1e-5, "{name}: loss differs by {dloss}");
    assert!(gworst < 1e-4, "{name}: gradients differ by {gworst:.2e} of their scale");
}

#[test]
fn gpt_neo_matches_transformers_past_the_local_window() {
    check_fixture("gpt_neo");
}

#[test]
fn gpt_neox_parallel_residual_matches_transformers() {
    check_fixture("gpt_neox");
}

#[test]
fn gpt_neox_sequential_residual_matches_transformers() {
    check_fixture("gpt_neox_sequential");
}

/// A left-padded batch: full forward vs a 3-token prefix then one token at a time through the
/// KV cache, compared at real positions. 11 columns > GPT-Neo's window of 4.
fn check_cached(name: &str) {
    let dev = Device::Cpu;
    let loaded =
        load_policy(fixture(&format!("models/{name}")).to_str().unwrap(), false, DType::F32, &dev).unwrap();
    let lm = &loaded.model.lm;
    let mask = vec![vec![1u8; 11], vec![0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]];
    let ids = Tensor::new(
        &[[5u32, 7, 1, 9, 11, 2, 3, 4, 50, 60, 70], [0, 0, 8, 6, 13, 17, 19, 22, 90, 3, 1]],
        &dev,
    )
    .unwrap();
    let pos = position_ids_from_mask(&mask, &dev).unwrap();
    let full = lm.forward(&ids, &pos, &causal_bias(&mask, 11, DType::F32, &dev).unwrap(), None).unwrap();
    let mut cache = lm.new_cache();
    let mut steps = Vec::new();
    let mut start = 0;
    for end in 3..=11 {
        let sub: Vec<Vec<u8>> = mask.iter().map(|r| r[..end].to_vec()).collect();
        let bias = causal_bias(&sub, end - start, DType::F32, &dev).unwrap();
        let (i, p) = (ids.narrow(1, start, end - start).unwrap(), pos.narrow(1, start, end - start).unwrap());
        steps.push(lm.forward(&i, &p, &bias, Some(&mut cache)).unwrap());
        start = end;
    }
    let inc = Tensor::cat(&steps, 1).unwrap();
    let d = max_diff(&full.narrow(0, 0, 1).unwrap(), &inc.narrow(0, 0, 1).unwrap()).max(max_diff(
        &full.get(1).unwrap().narrow(0, 2, 9).unwrap(),
        &inc.get(1).unwrap().narrow(0, 2, 9).unwrap(),
    ));
    println!("{name}: cached vs uncached max diff {d:.2e}");
    assert!(d < 1e-5, "{name}: cached vs uncached max diff {d:.2e}");
}

#[test]
fn gpt_neo_cached_decoding_equals_full_forward_past_the_window() {
    check_cached("gpt_neo");
}

#[test]
fn gpt_neox_cached_decoding_equals_full_forward() {
    check_cached("gpt_neox");
    check_cached("gpt_neox_sequential");
}

/// The local layers do see only the window: a token outside it changes a global layer's output only.
#[test]
fn gpt_neo_local_window_changes_the_output() {
    let dev = Device::Cpu;
    let run = |window: usize| {
        let store = ParamStore::random(5, false, DType::F32, &dev).unwrap();
        let mut cfg = GptNeoConfig::tiny(30, 16, 2, 2, window);
        cfg.attention_types = vec![(vec!["local".into()], 2)];
        let lm = CausalLm::load(&store.root(), &CausalLmConfig::GptNeo(cfg)).unwrap();
        let mask = vec![vec![1u8; 6]];
        let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &dev).unwrap();
        lm.forward(
            &ids,
            &position_ids_from_mask(&mask, &dev).unwrap(),
            &causal_bias(&mask, 6, DType::F32, &dev).unwrap(),
            None,
        )
        .unwrap()
    };
    let (wide, narrow) = (run(6), run(2));
    let per_pos: Vec<f64> = (0..6)
        .map(|j| max_diff(&wide.get(0).unwrap().get(j).unwrap(), &narrow.get(0).unwrap().get(j).unwrap()))
        .collect();
    // With two local layers of window 2, positions 0 and 1 see everything either way.
    assert!(per_pos[..2].iter().all(|&d| d == 0.0) && per_pos[2..].iter().all(|&d| d > 0.0), "{per_pos:?}");
}

fn gradients_match(cfg: CausalLmConfig, seed: u64) {
    let dev = Device::Cpu;
    let store = ParamStore::random(seed, true, DType::F64, &dev).unwrap();
    let lm = CausalLm::load(&store.root(), &cfg).unwrap();
    let model = CausalLmWithValueHead::load(&store.root(), lm).unwrap();
    let mask = vec![vec![1u8; 6], vec![0, 0, 1, 1, 1, 1]];
    let ids = Tensor::new(&[[1u32, 4, 9, 16, 3, 7], [0, 0, 5, 7, 2, 11]], &dev).unwrap();
    let pos = position_ids_from_mask(&mask, &dev).unwrap();
    let bias = causal_bias(&mask, 6, DType::F64, &dev).unwrap();
    let real = Tensor::new(&[[1f64; 6], [0., 0., 1., 1., 1., 1.]], &dev).unwrap();
    let v = cfg.vocab_size();
    let proj_v = (pseudo_random(&[2, 6], seed + 1, DType::F64) * &real).unwrap();
    let proj_l =
        pseudo_random(&[2, 6, v], seed + 2, DType::F64).broadcast_mul(&real.unsqueeze(2).unwrap()).unwrap();
    let loss = || {
        let (logits, values) = model.forward(&ids, &pos, &bias).unwrap();
        ((logits * &proj_l).unwrap().sum_all().unwrap() + (values * &proj_v).unwrap().sum_all().unwrap())
            .unwrap()
    };
    gradient_check(&store.vars(), loss, 1e-4);
}

#[test]
fn gpt_neo_gradients_match_finite_differences() {
    let mut cfg = GptNeoConfig::tiny(20, 8, 2, 2, 3);
    cfg.initializer_range = 0.5;
    gradients_match(CausalLmConfig::GptNeo(cfg), 21);
}

#[test]
fn gpt_neox_gradients_match_finite_differences() {
    for parallel in [true, false] {
        let mut cfg = GptNeoXConfig::tiny(20, 8, 2, 2);
        cfg.initializer_range = 0.5;
        cfg.use_parallel_residual = parallel;
        gradients_match(CausalLmConfig::GptNeoX(cfg), 22);
    }
}

/// Config errors name the field.
#[test]
fn gpt_neo_and_neox_config_errors_name_the_field() {
    let path = std::path::Path::new("config.json");
    let err = |v: serde_json::Value| CausalLmConfig::from_json(&v, path).unwrap_err().to_string();
    let e = err(
        serde_json::json!({"model_type": "gpt_neo", "num_layers": 3, "attention_types": [[["global", "local"], 1]]}),
    );
    assert!(e.contains("attention_types") && e.contains("config.json"), "{e}");
    let e = err(serde_json::json!({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
        "rotary_pct": 0.3125}));
    assert!(e.contains("rotary_pct"), "{e}");
}
