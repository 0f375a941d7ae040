//! SFT and reward-model training on tiny models built in-process, with word-level tokenizers.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use rltune::dist::Dist;
use rltune::generation::{generate, GenerationConfig};
use rltune::models::bert::{BertConfig, SequenceClassifier};
use rltune::models::distilbert::DistilBertConfig;
use rltune::models::gpt2::Gpt2Config;
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::llama::LlamaConfig;
use rltune::models::load::load_policy;
use rltune::params::ParamStore;
use rltune::tokenizer::Tokenizer;

use crate::common::word_tokenizer;
use rltune::train::data::{Label, RewardRecord, SftRecord};
use rltune::train::reward_model::{self, RewardConfig, RewardModel};
use rltune::train::sft::{self, SftConfig, SftModel};
use rltune::train::{ScheduleKind, TrainProgress, TrainingArgs};

/// The cycle the SFT corpus follows: each word is followed by the next one.
const COLORS: [&str; 8] = ["red", "orange", "yellow", "green", "blue", "indigo", "violet", "black"];

/// A tiny random GPT-2 over the color tokenizer (vocabulary 10, `<eos>` = 9).
fn tiny_sft_model(seed: u64, dtype: DType) -> SftModel {
    let cfg = Gpt2Config::tiny(COLORS.len() + 2, 32, 2, 4, 32);
    let mut json = serde_json::to_value(&cfg).unwrap();
    json["model_type"] = "gpt2".into();
    let store = ParamStore::random(seed, true, dtype, &Device::Cpu).unwrap();
    SftModel::new(store, json, word_tokenizer(&COLORS, false)).unwrap()
}

/// `n` lines of 6 consecutive colors, starting at successive offsets of the cycle.
fn color_corpus(n: usize) -> Vec<SftRecord> {
    (0..n)
        .map(|i| SftRecord::Text((0..6).map(|j| COLORS[(i + j) % 8]).collect::<Vec<_>>().join(" ")))
        .collect()
}

/// Fraction of sampled color tokens that follow the cycle (EOS excluded), and their number.
fn pattern_rate(model: &SftModel, seed: u64) -> (f64, usize) {
    let prompts: Vec<Vec<u32>> = (0..32).map(|i| vec![(i % 8) as u32]).collect();
    let gen = GenerationConfig { max_new_tokens: 6, seed, ..Default::default() };
    let samples = generate(&model.lm, None, &prompts, &gen, &Device::Cpu).unwrap();
    let (mut good, mut words) = (0, 0);
    for s in &samples {
        let seq: Vec<u32> = s.query_ids.iter().chain(&s.response_ids).copied().collect();
        for w in seq.windows(2).filter(|w| (w[1] as usize) < COLORS.len()) {
            words += 1;
            good += usize::from((w[0] as usize) < COLORS.len() && w[1] as usize == (w[0] as usize + 1) % 8);
        }
    }
    (good as f64 / words.max(1) as f64, words)
}

#[test]
fn sft_learns_a_repetitive_corpus_then_saves_and_reloads() {
    crate::common::install();
    let model = tiny_sft_model(0, DType::F32);
    let (rate_before, _) = pattern_rate(&model, 1);
    let args = TrainingArgs {
        learning_rate: 1e-2,
        num_train_epochs: 12.0,
        batch_size: 8,
        warmup_steps: 4.0,
        lr_scheduler_type: ScheduleKind::Cosine,
        eval_fraction: 0.125,
        eval_every: 10,
        seed: 5,
        ..Default::default()
    };
    let mut log: Vec<TrainProgress> = Vec::new();
    let t0 = Instant::now();
    let summary =
        sft::train_sft(&model, &color_corpus(64), &sft_config(), &args, &mut |p| log.push(p.clone()))
            .unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let (rate_after, words) = pattern_rate(&model, 1);
    let eval = summary.eval.clone().unwrap();
    println!(
        "sft: {} steps in {secs:.2}s, loss {:.3} -> {:.3}, eval loss {:.4} (ppl {:.3}, token acc {:.3}), \
         pattern rate {rate_before:.3} -> {rate_after:.3} over {words} sampled words",
        summary.steps,
        log[0].loss,
        summary.train_loss,
        eval.loss,
        eval.perplexity.unwrap(),
        eval.accuracy
    );
    // 64 texts, 8 held out: 7 batches of 8 per epoch, 12 epochs.
    assert_eq!((summary.steps, log.len(), summary.eval_examples), (84, 84, 8));
    assert_eq!(log[0].lr, 0.0, "the first warm-up step uses lr·0/4, as transformers");
    assert!(log.iter().filter(|p| p.eval.is_some()).count() == 9, "evals at 10, 20, …, 80 and the last step");
    assert!(log[0].loss > 1.8, "a random model starts near ln(10) = 2.3, got {}", log[0].loss);
    assert!(summary.train_loss < 0.1 && eval.loss < 0.1 && eval.accuracy > 0.95, "{summary:?}");
    assert!(rate_before < 0.3 && rate_after > 0.95 && words > 100, "{rate_before} -> {rate_after} ({words})");
    check_sft_reload(&model);
}

/// The saved directory reloads as a policy (with a new value head) giving the same logits, and
/// as an SFT model with the same tokenizer.
fn check_sft_reload(model: &SftModel) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sft");
    model.save(&out).unwrap();
    let policy = load_policy(out.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    assert!(policy.store.initialized().contains(&"v_head.summary.weight".to_string()));
    let ids = Tensor::new(&[[0u32, 1, 2, 3]], &Device::Cpu).unwrap();
    let mask = vec![vec![1u8; 4]];
    let pos = position_ids_from_mask(&mask, &Device::Cpu).unwrap();
    let bias = causal_bias(&mask, 4, DType::F32, &Device::Cpu).unwrap();
    let logits =
        |lm: &rltune::models::CausalLm| lm.logits(&lm.forward(&ids, &pos, &bias, None).unwrap()).unwrap();
    let d = max_diff(&logits(&model.lm), &logits(&policy.model.lm));
    assert!(d == 0.0, "reloaded logits differ by {d:e}");
    let again = SftModel::from_pretrained(out.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let text = "red orange black";
    assert_eq!(again.tokenizer.encode(text).unwrap(), model.tokenizer.encode(text).unwrap());
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
    d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

/// One optimizer step on 8 examples of different lengths: 1 micro-batch of 8, 8 of 1 and 2 of 4
/// give the same weights. Adam's ε is set to 1 so the first update is proportional to the
/// gradient (with the default ε it is ≈ lr·sign(g), blind to how examples are weighted): a
/// per-micro-batch mean instead of a token-weighted one moves weights by ~1e-3 here.
#[test]
fn sft_gradient_accumulation_1x8_equals_8x1() {
    crate::common::install();
    let records: Vec<SftRecord> = (0..8)
        .map(|i| {
            SftRecord::Text((0..2 + i).map(|j| COLORS[(3 * i + j * j) % 8]).collect::<Vec<_>>().join(" "))
        })
        .collect();
    let run = |batch_size: usize, accum: usize| {
        let model = tiny_sft_model(3, DType::F64);
        let args = TrainingArgs {
            learning_rate: 0.1,
            max_steps: 1,
            batch_size,
            gradient_accumulation_steps: accum,
            max_grad_norm: 0.0,
            adam_epsilon: 1.0,
            eval_fraction: 0.0,
            ..Default::default()
        };
        let mut loss = 0.0;
        sft::train_sft(&model, &records, &sft_config(), &args, &mut |p| loss = p.loss).unwrap();
        (loss, model.store.snapshot().unwrap())
    };
    let (loss_a, a) = run(8, 1);
    let initial = tiny_sft_model(3, DType::F64).store;
    let moved = a.iter().map(|(k, t)| max_diff(t, &initial.snapshot().unwrap()[k])).fold(0.0, f64::max);
    assert!(moved > 1e-3, "the step must move the weights, moved {moved:e}");
    for (bs, accum) in [(1, 8), (4, 2)] {
        let (loss_b, b) = run(bs, accum);
        let d = a.iter().map(|(k, t)| max_diff(t, &b[k])).fold(0.0, f64::max);
        println!(
            "accumulation 8x1 vs {bs}x{accum}: loss {loss_a:.12} vs {loss_b:.12}, weights max diff {d:e}"
        );
        assert!((loss_a - loss_b).abs() < 1e-12 && d < 1e-6, "loss {loss_a} vs {loss_b}, weights {d:e}");
    }
}

/// The library's loss equals the NLL averaged over exactly the completion (+ EOS) targets,
/// computed here one sequence at a time; and differs from the loss over every token, so a mask
/// that let prompt targets in would fail.
#[test]
fn completion_only_loss_counts_only_completion_tokens() {
    crate::common::install();
    let model = tiny_sft_model(11, DType::F64);
    let records = vec![
        SftRecord::PromptCompletion {
            prompt: "red orange yellow green".into(),
            completion: "blue indigo".into(),
        },
        SftRecord::PromptCompletion { prompt: "black".into(), completion: "red red violet".into() },
    ];
    let (only, _) = sft::tokenize_sft(&records, &model.tokenizer, model.eos_id(), &sft_config()).unwrap();
    assert_eq!(only[0].input_ids, vec![0, 1, 2, 3, 4, 5, 9]);
    assert_eq!(only[0].loss_mask, vec![0, 0, 0, 0, 1, 1, 1]);
    assert_eq!(only[1].loss_mask, vec![0, 1, 1, 1, 1]);
    let cfg = SftConfig { completion_only_loss: false, ..sft_config() };
    let (all, _) = sft::tokenize_sft(&records, &model.tokenizer, model.eos_id(), &cfg).unwrap();
    assert_eq!(all[0].loss_mask, vec![0, 1, 1, 1, 1, 1, 1]);
    for (examples, name) in [(&only, "completion only"), (&all, "all tokens")] {
        let lib = sft::evaluate_sft(&model, examples, 2).unwrap().loss;
        let manual = manual_nll(&model, examples);
        println!("{name}: library {lib:.12}, manual {manual:.12}");
        assert!((lib - manual).abs() < 1e-10, "{name}: {lib} vs {manual}");
    }
    let (l_only, l_all) = (manual_nll(&model, &only), manual_nll(&model, &all));
    assert!((l_only - l_all).abs() > 1e-3, "masks must matter: {l_only} vs {l_all}");
}

/// Mean NLL over the targets of `examples`, each run alone, from the full log-softmax.
fn manual_nll(model: &SftModel, examples: &[sft::SftExample]) -> f64 {
    let (mut sum, mut n) = (0.0, 0);
    for ex in examples {
        let t = ex.input_ids.len();
        let ids = Tensor::new(ex.input_ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let bias = causal_bias(&[vec![1; t]], t, DType::F64, &Device::Cpu).unwrap();
        let h = model.lm.forward(&ids, &pos, &bias, None).unwrap();
        let logits = model.lm.logits(&h).unwrap().squeeze(0).unwrap();
        let lse = logits.exp().unwrap().sum(D::Minus1).unwrap().log().unwrap().to_vec1::<f64>().unwrap();
        let logits = logits.to_vec2::<f64>().unwrap();
        for p in 1..t {
            if ex.loss_mask[p] == 1 {
                sum += lse[p - 1] - logits[p - 1][ex.input_ids[p] as usize];
                n += 1;
            }
        }
    }
    sum / n as f64
}

#[test]
fn sft_trains_a_llama_model() {
    crate::common::install();
    let cfg = LlamaConfig::tiny(COLORS.len() + 2, 16, 1, 2, 1);
    let json = serde_json::to_value(&cfg).unwrap();
    let store = ParamStore::random(1, true, DType::F32, &Device::Cpu).unwrap();
    let model = SftModel::new(store, json, word_tokenizer(&COLORS, false)).unwrap();
    let args = TrainingArgs { learning_rate: 1e-2, max_steps: 40, eval_fraction: 0.0, ..Default::default() };
    let mut losses = Vec::new();
    sft::train_sft(&model, &color_corpus(16), &sft_config(), &args, &mut |p| losses.push(p.loss)).unwrap();
    println!("llama sft: loss {:.3} -> {:.3}", losses[0], losses[39]);
    assert!(losses[39] < 0.5 * losses[0], "{losses:?}");
}

/// SFT settings within the tiny models' 32 positions (TRL's default `max_length` is 1024,
/// which `train_sft` rejects for a model with fewer positions).
fn sft_config() -> SftConfig {
    SftConfig { max_length: 32, ..Default::default() }
}

const FILLER: [&str; 6] = ["the", "a", "movie", "plot", "was", "very"];

/// A text of 4 filler words with `key` inserted at position `i % 5`.
fn filler_text(i: usize, key: &str) -> String {
    let mut words: Vec<&str> = (0..4).map(|j| FILLER[(i * 7 + j * 3) % 6]).collect();
    words.insert(i % 5, key);
    words.join(" ")
}

fn rm_words() -> Vec<&'static str> {
    FILLER.iter().copied().chain(["good", "bad", "q"]).collect()
}

/// A random reward model over the filler tokenizer, from a config value without `model_type`.
fn tiny_rm(mut json: serde_json::Value, model_type: &str, labels: &[&str]) -> RewardModel {
    json["model_type"] = model_type.into();
    let labels: Vec<String> = labels.iter().map(|s| s.to_string()).collect();
    let json = reward_model::with_labels(json, &labels).unwrap();
    let store = ParamStore::random(2, true, DType::F32, &Device::Cpu).unwrap();
    RewardModel::new(store, json, word_tokenizer(&rm_words(), true)).unwrap()
}

fn rm_args() -> TrainingArgs {
    TrainingArgs {
        learning_rate: 3e-3,
        // 8 epochs (48 steps) left the BERT classifier on its initial plateau (loss 0.6931);
        // it leaves it after ~60 steps and reaches 0.01 by 180.
        num_train_epochs: 30.0,
        batch_size: 8,
        eval_fraction: 0.25,
        seed: 3,
        ..Default::default()
    }
}

#[test]
fn reward_model_cross_entropy_separates_labelled_texts() {
    crate::common::install();
    let vocab = 4 + rm_words().len();
    let model = tiny_rm(
        serde_json::to_value(BertConfig::tiny(vocab, 16, 1, 2, 2)).unwrap(),
        "bert",
        &["NEGATIVE", "POSITIVE"],
    );
    let records: Vec<RewardRecord> = (0..64)
        .map(|i| {
            let (key, label) =
                if i % 2 == 0 { ("good", Label::Name("POSITIVE".into())) } else { ("bad", Label::Index(0)) };
            RewardRecord::Labelled { text: filler_text(i, key), label }
        })
        .collect();
    let cfg = RewardConfig { max_length: 32, ..Default::default() };
    let before = reward_model::evaluate_reward_model(&model, &records, &cfg, 16).unwrap();
    let t0 = Instant::now();
    let summary = reward_model::train_reward_model(&model, &records, &cfg, &rm_args(), &mut |_| {}).unwrap();
    let eval = summary.eval.clone().unwrap();
    println!(
        "reward CE: {} steps in {:.2}s, loss {:.3} (acc {:.2}) -> train {:.4}, eval {:.4} (acc {:.3} on {})",
        summary.steps,
        t0.elapsed().as_secs_f64(),
        before.loss,
        before.accuracy,
        summary.train_loss,
        eval.loss,
        eval.accuracy,
        eval.examples
    );
    assert!(eval.examples == 16 && eval.accuracy >= 0.95 && eval.loss < 0.2, "{eval:?}");
    check_rm_reload(&model, &records);
}

/// The saved classifier reloads with the same logits and labels; reloaded for preference
/// training, it keeps the encoder and gets a new one-logit head.
fn check_rm_reload(model: &RewardModel, records: &[RewardRecord]) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rm");
    model.save(&out).unwrap();
    let out_s = out.to_str().unwrap();
    let loaded = SequenceClassifier::from_pretrained(out_s, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.id2label(), ["NEGATIVE", "POSITIVE"]);
    let tok = Tokenizer::from_file(&out.join("tokenizer.json")).unwrap();
    let RewardRecord::Labelled { text, .. } = &records[0] else { unreachable!() };
    let ids = tok.encode_with(text, true).unwrap();
    assert_eq!((ids[0], *ids.last().unwrap()), (2, 3), "[CLS] … [SEP]");
    let x = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let mask = vec![vec![1u8; ids.len()]];
    let d = max_diff(&model.model.forward(&x, &mask).unwrap(), &loaded.forward(&x, &mask).unwrap());
    assert!(d == 0.0, "reloaded logits differ by {d:e}");
    let pairs =
        vec![RewardRecord::Preference { prompt: None, chosen: "good".into(), rejected: "bad".into() }];
    let bt = RewardModel::from_pretrained_for(out_s, &pairs, 0, None, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(bt.model.num_labels(), 1);
    assert_eq!(bt.initialized, ["classifier.bias", "classifier.weight"]);
    let name = "bert.encoder.layer.0.attention.self.query.weight";
    let (old, new) = (&model.store.snapshot().unwrap()[name], &bt.store.snapshot().unwrap()[name]);
    assert_eq!(max_diff(old, new), 0.0);
}

#[test]
fn reward_model_bradley_terry_prefers_chosen() {
    crate::common::install();
    let vocab = 4 + rm_words().len();
    let json = serde_json::to_value(DistilBertConfig::tiny(vocab, 16, 1, 2, 1)).unwrap();
    let model = tiny_rm(json, "distilbert", &["LABEL_0"]);
    let records: Vec<RewardRecord> = (0..64)
        .map(|i| RewardRecord::Preference {
            prompt: Some(format!("q {} ", FILLER[i % 6])),
            chosen: filler_text(i, "good"),
            rejected: filler_text(i, "bad"),
        })
        .collect();
    let cfg = RewardConfig { max_length: 32, center_rewards_coefficient: 0.01 };
    let t0 = Instant::now();
    let summary = reward_model::train_reward_model(&model, &records, &cfg, &rm_args(), &mut |_| {}).unwrap();
    let eval = summary.eval.clone().unwrap();
    println!(
        "reward BT: {} steps in {:.2}s, train loss {:.4}, eval loss {:.4}, eval accuracy {:.3} on {} pairs",
        summary.steps,
        t0.elapsed().as_secs_f64(),
        summary.train_loss,
        eval.loss,
        eval.accuracy,
        eval.examples
    );
    assert!(eval.accuracy >= 0.95 && eval.loss < 0.2, "{eval:?}");
    let dir = tempfile::tempdir().unwrap();
    model.save(&dir.path().join("bt")).unwrap();
    let loaded = SequenceClassifier::from_pretrained(
        dir.path().join("bt").to_str().unwrap(),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let score = |m: &SequenceClassifier, text: &str| {
        let ids = model.tokenizer.encode_with(text, true).unwrap();
        let x = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        m.forward(&x, &[vec![1; ids.len()]]).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0]
    };
    let (good, bad) = (score(&loaded, "q a the movie good plot"), score(&loaded, "q a the movie bad plot"));
    println!("reloaded rewards: good {good:.3}, bad {bad:.3}");
    assert!(good > bad + 1.0 && score(&model.model, "q good") == score(&loaded, "q good"));
}

/// Every trainable variable's values, by name.
pub(crate) fn weights(store: &ParamStore) -> Vec<(String, Vec<f32>)> {
    store
        .vars()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

/// SFT (2 epochs, warm-up and decay, an eval every 3 steps, accumulation) stopped by the stop
/// flag after step 5, then resumed from its checkpoint, equals the run that never stopped: every
/// weight and every later step's loss, bit for bit; the learning rate resumes on its schedule.
/// Steps before the checkpoint were written at `save_steps`.
#[test]
fn sft_stopped_and_resumed_equals_one_run_bit_for_bit() {
    use rltune::train::Checkpointing;
    use std::sync::atomic::{AtomicBool, Ordering};
    crate::common::install();
    let records = color_corpus(40);
    let args = TrainingArgs {
        learning_rate: 3e-3,
        num_train_epochs: 2.0,
        batch_size: 4,
        gradient_accumulation_steps: 2,
        warmup_steps: 2.0,
        eval_fraction: 0.2,
        eval_every: 3,
        save_steps: 2,
        ..Default::default()
    };
    let train = |model: &SftModel, ckpt: Option<Checkpointing>, stop_at: Option<&AtomicBool>| {
        let mut log: Vec<TrainProgress> = Vec::new();
        let s =
            sft::train_sft_with(model, &records, &sft_config(), &args, &Dist::default(), ckpt, &mut |p| {
                log.push(p.clone());
                if let Some(flag) = stop_at.filter(|_| p.step == 5) {
                    flag.store(true, Ordering::SeqCst);
                }
            })
            .unwrap();
        (s, log)
    };
    let straight = tiny_sft_model(4, DType::F32);
    let (whole, whole_log) = train(&straight, None, None);
    assert_eq!(whole.steps, 8);

    let dir = tempfile::tempdir().unwrap();
    let stop = AtomicBool::new(false);
    let first = tiny_sft_model(4, DType::F32);
    let ckpt = Checkpointing { dir: dir.path(), resume: false, stop: Some(&stop) };
    let (cut, _) = train(&first, Some(ckpt), Some(&stop));
    assert_eq!((cut.steps, cut.total_steps), (5, 8), "stopped after the step under way");
    for step in [2, 4, 5] {
        assert!(dir.path().join(format!("step-{step}/trainer_state.json")).exists(), "step-{step}");
    }
    // A fresh model (other random weights) resumes from the checkpoint.
    let resumed_model = tiny_sft_model(9, DType::F32);
    let ckpt = Checkpointing { dir: dir.path(), resume: true, stop: None };
    let (resumed, log) = train(&resumed_model, Some(ckpt), None);
    assert_eq!(resumed.steps, 8);
    assert_eq!(log.first().map(|p| p.step), Some(6), "the resumed run starts after its checkpoint");
    assert_eq!(
        log.iter().map(|p| (p.step, p.loss, p.lr)).collect::<Vec<_>>(),
        whole_log[5..].iter().map(|p| (p.step, p.loss, p.lr)).collect::<Vec<_>>()
    );
    assert_eq!(weights(&resumed_model.store), weights(&straight.store));
    assert_eq!((resumed.mean_train_loss, resumed.eval.clone()), (whole.mean_train_loss, whole.eval.clone()));

    // Resuming under other settings is refused, naming the setting.
    let other = TrainingArgs { num_train_epochs: 3.0, ..args.clone() };
    let ckpt = Checkpointing { dir: dir.path(), resume: true, stop: None };
    let err = sft::train_sft_with(
        &tiny_sft_model(4, DType::F32),
        &records,
        &sft_config(),
        &other,
        &Dist::default(),
        Some(ckpt),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("total_steps") && err.contains("step-8/trainer_state.json"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    let ckpt = Checkpointing { dir: empty.path(), resume: true, stop: None };
    let err = sft::train_sft_with(
        &tiny_sft_model(4, DType::F32),
        &records,
        &sft_config(),
        &args,
        &Dist::default(),
        Some(ckpt),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no checkpoint") && err.contains("without --resume"), "{err}");
}

/// The reward model (Bradley–Terry on preference pairs) resumes bit for bit too.
#[test]
fn reward_model_stopped_and_resumed_equals_one_run_bit_for_bit() {
    use rltune::train::Checkpointing;
    use std::sync::atomic::{AtomicBool, Ordering};
    crate::common::install();
    let vocab = 4 + rm_words().len();
    let json = || serde_json::to_value(BertConfig::tiny(vocab, 16, 1, 2, 2)).unwrap();
    let records: Vec<RewardRecord> = (0..24)
        .map(|i| RewardRecord::Preference {
            prompt: None,
            chosen: filler_text(i, "good"),
            rejected: filler_text(i + 1, "bad"),
        })
        .collect();
    let cfg = RewardConfig { max_length: 32, ..Default::default() };
    let args = TrainingArgs { num_train_epochs: 3.0, batch_size: 4, save_steps: 0, ..rm_args() };
    let run = |model: &RewardModel, ckpt: Option<Checkpointing>, stop_at: Option<&AtomicBool>| {
        reward_model::train_reward_model_with(
            model,
            &records,
            &cfg,
            &args,
            &Dist::default(),
            ckpt,
            &mut |p| {
                if let Some(flag) = stop_at.filter(|_| p.step == 7) {
                    flag.store(true, Ordering::SeqCst);
                }
            },
        )
        .unwrap()
    };
    let straight = tiny_rm(json(), "bert", &["LABEL_0"]);
    let whole = run(&straight, None, None);
    let dir = tempfile::tempdir().unwrap();
    let stop = AtomicBool::new(false);
    let first = tiny_rm(json(), "bert", &["LABEL_0"]);
    let cut =
        run(&first, Some(Checkpointing { dir: dir.path(), resume: false, stop: Some(&stop) }), Some(&stop));
    assert_eq!(cut.steps, 7);
    let again = tiny_rm(json(), "bert", &["LABEL_0"]);
    let resumed = run(&again, Some(Checkpointing { dir: dir.path(), resume: true, stop: None }), None);
    assert_eq!((resumed.steps, resumed.mean_train_loss), (whole.steps, whole.mean_train_loss));
    assert_eq!(weights(&again.store), weights(&straight.store));
}
