//! Generation: rollout logprobs equal a recomputation, EOS handling, seeding.

use candle_core::{DType, Device, Tensor};
use rltune::generation::{generate, generate_with, GenerationConfig, SamplingPath};
use rltune::models::layers::{causal_bias, position_ids_from_mask};

use crate::common::tiny_gpt2;

/// Also through the GPU's sampling path (issue #30: on the device, only ids and logprobs come
/// back), run here on the CPU.
#[test]
fn rollout_logprobs_and_values_equal_recomputation_alone() {
    for path in [SamplingPath::Host, SamplingPath::Device] {
        rollout_equals_recomputation(path);
    }
}

fn rollout_equals_recomputation(path: SamplingPath) {
    let (_, model) = tiny_gpt2(5, false, DType::F32);
    let dev = Device::Cpu;
    let prompts = vec![vec![1u32, 2, 3, 4, 5], vec![6], vec![7, 8, 9]];
    let cfg = GenerationConfig { max_new_tokens: 12, temperature: 0.8, seed: 3, ..Default::default() };
    let samples = generate_with(&model.lm, Some(&model.v_head), &prompts, &cfg, &dev, path).unwrap();
    if path == SamplingPath::Host {
        let auto = generate(&model.lm, Some(&model.v_head), &prompts, &cfg, &dev).unwrap();
        assert_eq!(auto, samples, "the CPU samples on the host by default");
    }
    let vocab = model.lm.vocab_size() as u32;
    assert!(samples.iter().all(|s| !s.response_ids.is_empty() && s.response_ids.iter().all(|&t| t < vocab)));
    let mut worst = (0f64, 0f64);
    for s in &samples {
        let seq: Vec<u32> = s.query_ids.iter().chain(&s.response_ids).copied().collect();
        let n = seq.len();
        let m = vec![vec![1u8; n]];
        let ids = Tensor::new(seq.as_slice(), &dev).unwrap().unsqueeze(0).unwrap();
        let (logits, values) = model
            .forward(
                &ids,
                &position_ids_from_mask(&m, &dev).unwrap(),
                &causal_bias(&m, n, DType::F32, &dev).unwrap(),
            )
            .unwrap();
        let logits = (logits / cfg.temperature).unwrap();
        let logp = rltune::ops::log_softmax_last_dim(&logits).unwrap().get(0).unwrap();
        let values = values.get(0).unwrap().to_vec1::<f32>().unwrap();
        let q = s.query_ids.len();
        for (i, (&tok, &lp)) in s.response_ids.iter().zip(&s.logprobs).enumerate() {
            let want = logp.get(q + i - 1).unwrap().get(tok as usize).unwrap().to_scalar::<f32>().unwrap();
            worst.0 = worst.0.max((want - lp).abs() as f64);
            let v = s.values.as_ref().unwrap()[i];
            worst.1 = worst.1.max((values[q + i - 1] - v).abs() as f64);
        }
    }
    println!(
        "{path:?}: rollout vs recomputed: logprob max diff {:.2e}, value max diff {:.2e}",
        worst.0, worst.1
    );
    assert!(worst.0 < 1e-5 && worst.1 < 1e-5, "{worst:?}");
}

#[test]
fn eos_stops_each_sequence_and_is_kept() {
    let (_, model) = tiny_gpt2(6, false, DType::F32);
    // With every token an EOS, each sequence ends after exactly one token.
    let cfg = GenerationConfig { max_new_tokens: 8, eos_token_ids: (0..50).collect(), ..Default::default() };
    let out = generate(&model.lm, None, &[vec![1, 2], vec![3]], &cfg, &Device::Cpu).unwrap();
    assert!(out.iter().all(|s| s.response_ids.len() == 1));
    let cfg = GenerationConfig { max_new_tokens: 8, stop_at_eos: false, ..cfg };
    let out = generate(&model.lm, None, &[vec![1, 2], vec![3]], &cfg, &Device::Cpu).unwrap();
    assert!(out.iter().all(|s| s.response_ids.len() == 8));
}

#[test]
fn sampling_is_seeded() {
    let (_, model) = tiny_gpt2(7, false, DType::F32);
    let cfg = GenerationConfig { max_new_tokens: 10, seed: 42, ..Default::default() };
    let a = generate(&model.lm, None, &[vec![1, 2]], &cfg, &Device::Cpu).unwrap();
    let b = generate(&model.lm, None, &[vec![1, 2]], &cfg, &Device::Cpu).unwrap();
    assert_eq!(a, b);
    let c = generate(&model.lm, None, &[vec![1, 2]], &GenerationConfig { seed: 43, ..cfg }, &Device::Cpu)
        .unwrap();
    assert_ne!(a[0].response_ids, c[0].response_ids);
}

#[test]
fn out_of_vocabulary_prompt_is_rejected_with_its_index() {
    let (_, model) = tiny_gpt2(8, false, DType::F32);
    let err = generate(&model.lm, None, &[vec![1], vec![2, 50]], &GenerationConfig::default(), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompt 1") && err.contains("50"), "{err}");
}

/// Issue #40: each row draws from its own stream, keyed by its global index, so the processes of
/// a data-parallel run, each sampling its share, draw what one process sampling all draws.
#[test]
fn a_row_samples_the_same_tokens_in_any_batch() {
    let (_, model) = tiny_gpt2(8, false, DType::F32);
    let cfg = GenerationConfig { max_new_tokens: 12, seed: 5, ..Default::default() };
    // Equal-length prompts: the padded shapes, and so every sum, are the same in each batch.
    let prompts = vec![vec![1u32, 2], vec![3, 4], vec![5, 6], vec![7, 8]];
    let all = generate(&model.lm, None, &prompts, &cfg, &Device::Cpu).unwrap();
    let mut shards = Vec::new();
    for (k, part) in prompts.chunks(2).enumerate() {
        let cfg = GenerationConfig { row_offset: 2 * k as u64, ..cfg.clone() };
        shards.extend(generate(&model.lm, None, part, &cfg, &Device::Cpu).unwrap());
    }
    assert_eq!(all, shards);
    // Another offset is another stream.
    let moved =
        generate(&model.lm, None, &prompts[..2], &GenerationConfig { row_offset: 1, ..cfg }, &Device::Cpu)
            .unwrap();
    assert_ne!(moved[0].response_ids, all[0].response_ids);
}

/// `row_seeds` gives each row its own stream (a server batching unrelated requests): a row draws
/// what it draws alone with its seed, and the default seeds are `row_seed(seed, row)`.
#[test]
fn row_seeds_give_each_row_its_own_stream() {
    use rltune::generation::row_seed;
    let (_, model) = tiny_gpt2(8, false, DType::F32);
    let cfg = GenerationConfig { max_new_tokens: 10, seed: 5, ..Default::default() };
    let prompts = vec![vec![1u32, 2], vec![3, 4], vec![1, 2]];
    let seeded = |seeds: Vec<u64>, p: &[Vec<u32>]| {
        let cfg = GenerationConfig { row_seeds: seeds, ..cfg.clone() };
        generate_with(&model.lm, None, p, &cfg, &Device::Cpu, SamplingPath::Host).unwrap()
    };
    let batch = seeded(vec![11, 22, 11], &prompts);
    assert_eq!(batch[0], seeded(vec![11], &prompts[..1])[0]);
    assert_eq!(batch[1], seeded(vec![22], &prompts[1..2])[0]);
    assert_eq!(batch[2], batch[0], "the same prompt and seed draw the same tokens");
    let defaults = (0..3).map(|i| row_seed(5, i)).collect();
    assert_eq!(seeded(defaults, &prompts), generate(&model.lm, None, &prompts, &cfg, &Device::Cpu).unwrap());
    let cfg = GenerationConfig { row_seeds: vec![1], ..cfg };
    let err = generate(&model.lm, None, &prompts, &cfg, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("1 row_seeds given for 3 prompts"), "{err}");
}
