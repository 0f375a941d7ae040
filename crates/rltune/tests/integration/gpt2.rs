//! GPT-2: parity with transformers, cache equivalence, padding equivalence, gradients, round trips.

use candle_core::{DType, Device, Tensor};
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::load::{load_policy, save_pretrained};

use crate::common::{fixture, gradient_check, max_diff, pseudo_random, tiny_gpt2};

/// Runs the transformers fixture in `dir` through our model and compares hidden states, logits
/// and (when recorded) values at the unmasked positions.
fn check_fixture(dir: &str, tol: f64) {
    let dir = fixture(dir);
    let loaded = load_policy(dir.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    let exp = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu).unwrap();
    let ids = exp["input_ids"].to_dtype(DType::U32).unwrap();
    let mask: Vec<Vec<u8>> = exp["attention_mask"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec2::<u32>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|x| x as u8).collect())
        .collect();
    let t = ids.dim(1).unwrap();
    let pos = position_ids_from_mask(&mask, &Device::Cpu).unwrap();
    let bias = causal_bias(&mask, t, DType::F32, &Device::Cpu).unwrap();
    let lm = &loaded.model.lm;
    let hidden = lm.forward(&ids, &pos, &bias, None).unwrap();
    let logits = lm.logits(&hidden).unwrap();
    let values = loaded.model.v_head.forward(&hidden).unwrap();
    let mut worst = [0f64; 3];
    for (b, row) in mask.iter().enumerate() {
        for (j, &m) in row.iter().enumerate() {
            if m == 0 {
                continue;
            }
            let at = |x: &Tensor| x.get(b).unwrap().get(j).unwrap();
            worst[0] = worst[0].max(max_diff(&at(&hidden), &at(&exp["hidden"])));
            worst[1] = worst[1].max(max_diff(&at(&logits), &at(&exp["logits"])));
            if let Some(v) = exp.get("values") {
                worst[2] = worst[2].max(max_diff(&at(&values), &at(v)));
            }
        }
    }
    println!(
        "{}: max diff hidden {:.2e} logits {:.2e} values {:.2e}",
        dir.display(),
        worst[0],
        worst[1],
        worst[2]
    );
    assert!(worst.iter().all(|&d| d < tol), "max diffs {worst:?} exceed {tol}");
}

#[test]
fn gpt2_matches_transformers() {
    check_fixture("models/gpt2", 1e-4);
}

#[test]
fn gpt2_with_trl_value_head_matches_trl() {
    check_fixture("models/gpt2_value_head", 1e-4);
}

#[test]
fn cached_decoding_equals_full_forward() {
    let (_, model) = tiny_gpt2(1, false, DType::F32);
    let lm = &model.lm;
    let ids: Vec<u32> = vec![3, 14, 15, 9, 26, 5, 35, 8];
    let n = ids.len();
    let dev = Device::Cpu;
    let full_mask = vec![vec![1u8; n]];
    let full = lm
        .forward(
            &Tensor::new(ids.as_slice(), &dev).unwrap().unsqueeze(0).unwrap(),
            &position_ids_from_mask(&full_mask, &dev).unwrap(),
            &causal_bias(&full_mask, n, DType::F32, &dev).unwrap(),
            None,
        )
        .unwrap();
    let mut cache = lm.new_cache();
    let prefix = 3;
    let mut parts = Vec::new();
    for (start, len) in std::iter::once((0, prefix)).chain((prefix..n).map(|s| (s, 1))) {
        let mask = vec![vec![1u8; start + len]];
        let pos: Vec<u32> = (start as u32..(start + len) as u32).collect();
        let h = lm
            .forward(
                &Tensor::new(&ids[start..start + len], &dev).unwrap().unsqueeze(0).unwrap(),
                &Tensor::new(pos.as_slice(), &dev).unwrap().unsqueeze(0).unwrap(),
                &causal_bias(&mask, len, DType::F32, &dev).unwrap(),
                Some(&mut cache),
            )
            .unwrap();
        parts.push(h);
    }
    let cached = Tensor::cat(&parts, 1).unwrap();
    let d = max_diff(&full, &cached);
    println!("cached vs uncached max diff {d:.2e}");
    assert!(d < 1e-5, "{d}");
}

#[test]
fn left_padded_batch_equals_each_sequence_alone() {
    let (_, model) = tiny_gpt2(2, false, DType::F32);
    let lm = &model.lm;
    let dev = Device::Cpu;
    let seqs: Vec<Vec<u32>> = vec![vec![1, 2, 3, 4, 5, 6], vec![7, 8], vec![9, 10, 11, 12]];
    let (ids, mask) = rltune::tokenizer::pad(&seqs, 0, rltune::tokenizer::PaddingSide::Left);
    let t = ids[0].len();
    let batch = lm
        .forward(
            &Tensor::new(ids, &dev).unwrap(),
            &position_ids_from_mask(&mask, &dev).unwrap(),
            &causal_bias(&mask, t, DType::F32, &dev).unwrap(),
            None,
        )
        .unwrap();
    let batch_logits = lm.logits(&batch).unwrap();
    let mut worst = 0f64;
    for (i, s) in seqs.iter().enumerate() {
        let m = vec![vec![1u8; s.len()]];
        let h = lm
            .forward(
                &Tensor::new(s.as_slice(), &dev).unwrap().unsqueeze(0).unwrap(),
                &position_ids_from_mask(&m, &dev).unwrap(),
                &causal_bias(&m, s.len(), DType::F32, &dev).unwrap(),
                None,
            )
            .unwrap();
        let alone = rltune::ops::log_softmax_last_dim(&lm.logits(&h).unwrap()).unwrap().get(0).unwrap();
        let padded = rltune::ops::log_softmax_last_dim(
            &batch_logits.get(i).unwrap().narrow(0, t - s.len(), s.len()).unwrap(),
        )
        .unwrap();
        worst = worst.max(max_diff(&alone, &padded));
    }
    println!("left-padded vs alone: max logprob diff {worst:.2e}");
    assert!(worst < 1e-5, "{worst}");
}

#[test]
fn gpt2_gradients_match_finite_differences() {
    let (store, model) = tiny_gpt2(3, true, DType::F64);
    let dev = Device::Cpu;
    let seqs = vec![vec![1u32, 2, 3, 4, 5], vec![6, 7, 8]];
    let (ids, mask) = rltune::tokenizer::pad(&seqs, 0, rltune::tokenizer::PaddingSide::Left);
    let ids = Tensor::new(ids, &dev).unwrap();
    let pos = position_ids_from_mask(&mask, &dev).unwrap();
    let bias = causal_bias(&mask, 5, DType::F64, &dev).unwrap();
    // Pad queries attend to nothing (a fully masked row); like PPO's mask, the loss ignores them.
    let real = Tensor::new(&[[1f64, 1., 1., 1., 1.], [0., 0., 1., 1., 1.]], &dev).unwrap();
    let proj_v = (pseudo_random(&[2, 5], 12, DType::F64) * &real).unwrap();
    let proj_l =
        pseudo_random(&[2, 5, 50], 11, DType::F64).broadcast_mul(&real.unsqueeze(2).unwrap()).unwrap();
    let loss = || {
        let (logits, values) = model.forward(&ids, &pos, &bias).unwrap();
        ((logits * &proj_l).unwrap().sum_all().unwrap() + (values * &proj_v).unwrap().sum_all().unwrap())
            .unwrap()
    };
    let vars = store.vars();
    assert!(vars.len() >= 2 * 12 + 5, "expected every GPT-2 tensor as a variable, got {}", vars.len());
    gradient_check(&vars, loss, 1e-4);
}

#[test]
fn save_and_reload_round_trips_names_and_outputs() {
    let (store, model) = tiny_gpt2(4, true, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let cfg = serde_json::to_value(match model.lm.config() {
        rltune::models::CausalLmConfig::Gpt2(c) => c,
        _ => unreachable!(),
    })
    .unwrap();
    let mut cfg = cfg;
    cfg["model_type"] = "gpt2".into();
    save_pretrained(&out, &store, &cfg).unwrap();
    let loaded = load_policy(out.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.store.names(), store.names());
    assert!(loaded.store.names().contains(&"v_head.summary.weight".to_string()));
    assert!(loaded.store.initialized().is_empty());
    let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap();
    let mask = vec![vec![1u8; 3]];
    let pos = position_ids_from_mask(&mask, &Device::Cpu).unwrap();
    let bias = causal_bias(&mask, 3, DType::F32, &Device::Cpu).unwrap();
    let (a, va) = model.forward(&ids, &pos, &bias).unwrap();
    let (b, vb) = loaded.model.forward(&ids, &pos, &bias).unwrap();
    assert_eq!(max_diff(&a, &b), 0.0);
    assert_eq!(max_diff(&va, &vb), 0.0);
}
