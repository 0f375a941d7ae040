//! GGUF files (llama.cpp's format) as Hugging Face models: `--model FILE.gguf`, `rltune convert`.
//!
//! A GGUF holds the config, the tokenizer and the chat template as metadata, and the weights,
//! often quantized, under llama.cpp's names. [`model_files`] reads the metadata and writes the
//! small files a Hugging Face directory would have (`config.json`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`) into a cache directory; [`load_tensors`]
//! dequantizes every tensor (candle's `quantized::gguf_file`) to f32 under its transformers name.
//! [`crate::params::ParamStore::load_safetensors`] calls it for a `.gguf` weight file, so a GGUF
//! loads wherever a model does, then is cast to the run's dtype.
//!
//! Supported:
//! - architectures `llama` (also Mistral and SmolLM, which llama.cpp writes as `llama`) and `qwen2`;
//! - every tensor type candle dequantizes: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
//!   Q2_K … Q8_K;
//! - byte-level BPE tokenizers (`tokenizer.ggml.model = "gpt2"`), with the pre-tokenizer named by
//!   `tokenizer.ggml.pre` (`smollm`, `qwen2`, `llama-bpe`, `gpt-2`/`default`), and sentencepiece
//!   BPE tokenizers (`"llama"`: Llama 2, Mistral, TinyLlama), as transformers 5 builds both.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of
//! Llama's `q_proj` and `k_proj` from the rotate-half RoPE layout to the interleaved one: per head,
//! rows `(2, D/2)` become `(D/2, 2)`. [`unpermute_rows`] undoes it, as transformers'
//! `LlamaTensorProcessor._reverse_permute_weights`. Qwen2 is written unpermuted.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};
use serde_json::json;

use crate::error::{Error, Result};
use crate::io::{write_bytes_atomic, ModelFiles};

/// `general.architecture` values rltune loads.
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2"];

/// Whether `path` names a GGUF file (by extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A GGUF file's parsed header.
pub struct Gguf {
    /// The file.
    pub path: PathBuf,
    /// Metadata and tensor infos.
    pub content: Content,
}

impl Gguf {
    /// Reads the header (metadata and tensor list) of `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| header_error(path, &e.to_string()))?;
        let g = Self { path: path.to_path_buf(), content };
        g.architecture()?;
        Ok(g)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn missing(&self, key: &str) -> Error {
        Error::config(
            &self.path,
            format!("GGUF metadata key {key:?} is missing or has the wrong type; the file is incomplete: re-export it with llama.cpp's convert_hf_to_gguf.py"),
        )
    }

    fn string(&self, key: &str) -> Option<String> {
        match self.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn uint(&self, key: &str) -> Option<u64> {
        match self.get(key)? {
            Value::U8(v) => Some(*v as u64),
            Value::U16(v) => Some(*v as u64),
            Value::U32(v) => Some(*v as u64),
            Value::U64(v) => Some(*v),
            Value::I8(v) => u64::try_from(*v).ok(),
            Value::I16(v) => u64::try_from(*v).ok(),
            Value::I32(v) => u64::try_from(*v).ok(),
            Value::I64(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    fn float(&self, key: &str) -> Option<f64> {
        match self.get(key)? {
            Value::F32(v) => Some(*v as f64),
            Value::F64(v) => Some(*v),
            _ => self.uint(key).map(|v| v as f64),
        }
    }

    fn req_uint(&self, key: &str) -> Result<usize> {
        self.uint(key).map(|v| v as usize).ok_or_else(|| self.missing(key))
    }

    fn strings(&self, key: &str) -> Option<Vec<String>> {
        match self.get(key)? {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    fn ints(&self, key: &str) -> Option<Vec<i64>> {
        match self.get(key)? {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Some(*x as i64),
                    Value::U32(x) => Some(*x as i64),
                    Value::I8(x) => Some(*x as i64),
                    Value::U8(x) => Some(*x as i64),
                    Value::I64(x) => Some(*x),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    fn floats(&self, key: &str) -> Option<Vec<f64>> {
        match self.get(key)? {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::F32(x) => Some(f64::from(*x)),
                    Value::F64(x) => Some(*x),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    /// `general.architecture`, checked to be one rltune loads.
    pub fn architecture(&self) -> Result<String> {
        let arch = self.string("general.architecture").ok_or_else(|| self.missing("general.architecture"))?;
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(Error::UnsupportedModel {
                path: self.path.clone(),
                model_type: format!("{arch} (GGUF general.architecture)"),
                supported: format!(
                    "{} in GGUF files; convert the original Hugging Face checkpoint to safetensors instead \
                     (save_pretrained(DIR, safe_serialization=True)) and pass DIR",
                    ARCHITECTURES.join(", ")
                ),
            });
        }
        Ok(arch)
    }

    fn tokens(&self) -> Result<Vec<String>> {
        self.strings("tokenizer.ggml.tokens").ok_or_else(|| self.missing("tokenizer.ggml.tokens"))
    }

    /// The transformers `config.json` the metadata describes.
    pub fn hf_config(&self) -> Result<serde_json::Value> {
        let arch = self.architecture()?;
        let k = |name: &str| format!("{arch}.{name}");
        let heads = self.req_uint(&k("attention.head_count"))?;
        let hidden = self.req_uint(&k("embedding_length"))?;
        let vocab = match self.uint(&k("vocab_size")) {
            Some(v) => v as usize,
            None => self.tokens()?.len(),
        };
        let tied = !self.content.tensor_infos.contains_key("output.weight");
        let (class, model_type) = match arch.as_str() {
            "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
            _ => ("LlamaForCausalLM", "llama"),
        };
        let mut c = json!({
            "architectures": [class],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self.req_uint(&k("feed_forward_length"))?,
            "num_hidden_layers": self.req_uint(&k("block_count"))?,
            "num_attention_heads": heads,
            "num_key_value_heads": self.uint(&k("attention.head_count_kv")).map_or(heads, |v| v as usize),
            "max_position_embeddings": self.req_uint(&k("context_length"))?,
            "rms_norm_eps": self.float(&k("attention.layer_norm_rms_epsilon")).ok_or_else(|| self.missing(&k("attention.layer_norm_rms_epsilon")))?,
            "rope_theta": self.float(&k("rope.freq_base")).unwrap_or(10000.0),
            "hidden_act": "silu",
            "tie_word_embeddings": tied,
            "torch_dtype": "float32",
            "bos_token_id": self.uint("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.uint("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.uint("tokenizer.ggml.padding_token_id"),
        });
        if arch == "llama" {
            let head_dim = self.uint(&k("attention.key_length")).or(self.uint(&k("rope.dimension_count")));
            if let Some(d) = head_dim.filter(|&d| d as usize != hidden / heads.max(1)) {
                c["head_dim"] = d.into();
            }
            c["attention_bias"] = self.content.tensor_infos.contains_key("blk.0.attn_q.bias").into();
        } else {
            c["use_sliding_window"] = false.into();
        }
        match self.string(&k("rope.scaling.type")).as_deref() {
            None | Some("none") => {}
            Some("linear") => {
                let factor = self.float(&k("rope.scaling.factor")).ok_or_else(|| self.missing(&k("rope.scaling.factor")))?;
                c["rope_scaling"] = json!({"rope_type": "linear", "factor": factor});
            }
            Some(other) => {
                return Err(Error::config(
                    &self.path,
                    format!("{}: rope scaling {other:?} is not supported for GGUF files (only linear); convert the original checkpoint instead", k("rope.scaling.type")),
                ))
            }
        }
        if self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Err(Error::config(
                &self.path,
                "tensor rope_freqs.weight (Llama 3.1-style RoPE scaling) is not supported in GGUF files; \
                 load the original Hugging Face checkpoint (its config.json names rope_scaling) instead",
            ));
        }
        Ok(c)
    }

    /// The token string of the metadata id `key`, if any.
    fn special(&self, key: &str, tokens: &[String]) -> Option<String> {
        self.uint(key).and_then(|i| tokens.get(i as usize).cloned())
    }

    /// `tokenizer.json` (tokenizers' serialization) for the tokenizer in the metadata: byte-level
    /// BPE (`"gpt2"`) or sentencepiece BPE (`"llama"`).
    pub fn tokenizer_json(&self) -> Result<serde_json::Value> {
        let model = self.string("tokenizer.ggml.model").unwrap_or_default();
        match model.as_str() {
            "gpt2" => self.byte_level_tokenizer(),
            "llama" => self.sentencepiece_tokenizer(),
            _ => Err(Error::Tokenizer(format!(
                "{}: GGUF tokenizer.ggml.model {model:?} is not supported; rltune builds byte-level BPE \
                 (\"gpt2\": Llama 3, Qwen2, SmolLM) and sentencepiece BPE (\"llama\": Llama 2, Mistral, \
                 TinyLlama) tokenizers. Put the model's tokenizer.json beside a converted copy instead \
                 (rltune convert FILE.gguf --output DIR, then copy it into DIR)",
                self.path.display()
            ))),
        }
    }

    /// The added tokens of the metadata: type 3 (CONTROL) special, 4 (USER_DEFINED) not; each
    /// matched whole.
    fn added_tokens(&self, tokens: &[String]) -> Vec<serde_json::Value> {
        let types = self.ints("tokenizer.ggml.token_type").unwrap_or_default();
        tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &t))| t == 3 || t == 4)
            .map(|(i, (tok, &t))| {
                json!({"id": i, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": t == 3})
            })
            .collect()
    }

    /// BOS before each sequence when `add_bos` (a `TemplateProcessing`), else `otherwise`.
    fn bos_processor(
        &self,
        tokens: &[String],
        add_bos: bool,
        otherwise: serde_json::Value,
    ) -> serde_json::Value {
        match self.special("tokenizer.ggml.bos_token_id", tokens).filter(|_| add_bos) {
            Some(bos) => {
                let id = self.uint("tokenizer.ggml.bos_token_id").unwrap_or(0);
                json!({"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {bos.clone(): {"id": bos, "ids": [id], "tokens": [bos]}}})
            }
            None => otherwise,
        }
    }

    /// Whether a sequence starts with BOS: the metadata's flag, which sentencepiece (`"llama"`)
    /// vocabularies default to true (llama.cpp and transformers add BOS when a file says nothing).
    fn add_bos(&self) -> bool {
        match self.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            _ => self.string("tokenizer.ggml.model").as_deref() == Some("llama"),
        }
    }

    /// Sentencepiece BPE (`tokenizer.ggml.model = "llama"`), as transformers 5's GGUF loader
    /// builds it (`LlamaTokenizer` over the file's vocabulary): BPE with byte fallback and fused
    /// unknowns, the merges the file lists or else the ones its vocabulary and scores imply
    /// ([`spm_merges`], transformers' `generate_merges`), `Metaspace` (`▁`, prepended to the first
    /// word only), and a decoder that maps `▁` back to spaces, bytes back to text and strips the
    /// one leading space. `tokenizer.ggml.add_space_prefix` is not read, as transformers does not.
    fn sentencepiece_tokenizer(&self) -> Result<serde_json::Value> {
        let tokens = self.tokens()?;
        let merges: Vec<(String, String)> = match self.strings("tokenizer.ggml.merges") {
            Some(m) => {
                m.iter().filter_map(|x| x.split_once(' ').map(|(a, b)| (a.into(), b.into()))).collect()
            }
            None => {
                let scores = self
                    .floats("tokenizer.ggml.scores")
                    .ok_or_else(|| self.missing("tokenizer.ggml.scores"))?;
                if scores.len() != tokens.len() {
                    return Err(Error::Tokenizer(format!(
                        "{}: {} tokenizer.ggml.scores for {} tokens; the file is damaged",
                        self.path.display(),
                        scores.len(),
                        tokens.len()
                    )));
                }
                spm_merges(&tokens, &scores)
            }
        };
        // {token: index}: a repeated token keeps its last index, as in transformers.
        let vocab: serde_json::Map<String, serde_json::Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        let merges: Vec<serde_json::Value> = merges.into_iter().map(|(a, b)| json!([a, b])).collect();
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": self.added_tokens(&tokens),
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false},
            "post_processor": self.bos_processor(&tokens, self.add_bos(), serde_json::Value::Null),
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                      "ignore_merges": false, "vocab": vocab, "merges": merges},
        }))
    }

    /// Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with the pre-tokenizer named by
    /// `tokenizer.ggml.pre`.
    fn byte_level_tokenizer(&self) -> Result<serde_json::Value> {
        let tokens = self.tokens()?;
        let merges =
            self.strings("tokenizer.ggml.merges").ok_or_else(|| self.missing("tokenizer.ggml.merges"))?;
        let vocab: serde_json::Map<String, serde_json::Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        let added = self.added_tokens(&tokens);
        let pre = self.string("tokenizer.ggml.pre").unwrap_or_else(|| "default".into());
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |regex: &str| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                byte_level(false)]})
        };
        let pre_tokenizer = match pre.as_str() {
            // SmolLM's tokenizer.json: digits one by one, then GPT-2's split (llama.cpp's SMOLLM).
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            "qwen2" | "deepseek-r1-qwen" => split(QWEN2_SPLIT),
            "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "dbrx" => split(LLAMA3_SPLIT),
            "gpt-2" | "gpt2" | "default" => byte_level(true),
            other => {
                tracing::warn!(
                    "{}: GGUF tokenizer.ggml.pre {other:?} is not known to rltune; splitting text as GPT-2 does, \
                     which may tokenize some text differently from llama.cpp",
                    self.path.display()
                );
                byte_level(true)
            }
        };
        let post_processor = self.bos_processor(
            &tokens,
            self.add_bos(),
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
        );
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": merges},
        }))
    }

    /// `tokenizer_config.json`: special tokens, BOS/EOS flags, the chat template.
    pub fn tokenizer_config(&self) -> Result<serde_json::Value> {
        let tokens = self.tokens()?;
        let mut c = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": false,
            "add_bos_token": self.add_bos(),
            "add_eos_token": matches!(self.get("tokenizer.ggml.add_eos_token"), Some(Value::Bool(true))),
        });
        for (name, key) in [
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        ] {
            if let Some(t) = self.special(key, &tokens) {
                c[name] = t.into();
            }
        }
        if let Some(n) = self.uint(&format!("{}.context_length", self.architecture()?)) {
            c["model_max_length"] = n.into();
        }
        if let Some(t) = self.string("tokenizer.chat_template") {
            c["chat_template"] = t.into();
        }
        Ok(c)
    }

    /// `generation_config.json`: the BOS, EOS and pad ids.
    pub fn generation_config(&self) -> serde_json::Value {
        json!({
            "bos_token_id": self.uint("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.uint("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.uint("tokenizer.ggml.padding_token_id"),
        })
    }

    /// Every tensor dequantized to f32 on the CPU, under its transformers name, with Llama's
    /// q/k rows un-permuted.
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>> {
        let arch = self.architecture()?;
        let cfg = self.hf_config()?;
        let heads = cfg["num_attention_heads"].as_u64().unwrap_or(1) as usize;
        let kv_heads = cfg["num_key_value_heads"].as_u64().unwrap_or(heads as u64) as usize;
        let file = File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        let mut reader = BufReader::new(file);
        let mut out = HashMap::new();
        let mut names: Vec<&String> = self.content.tensor_infos.keys().collect();
        names.sort();
        for name in names {
            let info = &self.content.tensor_infos[name];
            let hf = hf_name(name).ok_or_else(|| {
                Error::weights(
                    &self.path,
                    format!("tensor {name:?} has no transformers {arch} counterpart; rltune loads plain {arch} GGUF files (no adapters, vision towers or extra heads)"),
                )
            })?;
            let q = info.read(&mut reader, self.content.tensor_data_offset, &Device::Cpu).map_err(|e| {
                let e = e.to_string();
                let fix = if e.contains("remaining") {
                    "the file is truncated: download it again (tools/models/fetch_smollm2.sh re-fetches SmolLM2)"
                } else {
                    "the file is corrupt: download it again, or re-quantize it with llama.cpp"
                };
                Error::weights(&self.path, format!("cannot read tensor {name:?} ({:?}): {e}; {fix}", info.ggml_dtype))
            })?;
            let mut t = q.dequantize(&Device::Cpu)?;
            if arch == "llama" && (name.contains(".attn_q.") || name.contains(".attn_k.")) {
                let h = if name.contains(".attn_q.") { heads } else { kv_heads };
                t = unpermute_rows(&t, h).map_err(|m| Error::weights(&self.path, format!("{name}: {m}")))?;
            }
            out.insert(hf, t);
        }
        Ok(out)
    }
}

/// Qwen2's pre-tokenizer split (its tokenizer.json).
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pre-tokenizer split (its tokenizer.json).
pub(crate) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The error for a header candle cannot read, with the fix.
/// The merges a sentencepiece vocabulary implies (transformers' `generate_merges` with scores):
/// every split of every token into two tokens, ranked by the whole token's score (best first),
/// then the left and right parts' lengths (longer first); a token's own splits in the order of
/// their parts' ids. Lengths count characters, as Python's do.
pub fn spm_merges(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    // Python's dict(zip(tokens, scores)): a repeated token keeps its first place, its last score.
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    let mut score: HashMap<&str, f64> = HashMap::with_capacity(tokens.len());
    for (t, &s) in tokens.iter().zip(scores) {
        if score.insert(t.as_str(), s).is_none() {
            order.push(t);
        }
    }
    // {token: index}: a repeated token keeps its last index.
    let id: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for t in order {
        let s = score[t];
        let mut local: Vec<(&str, &str, f64)> = t
            .char_indices()
            .skip(1)
            .map(|(i, _)| (&t[..i], &t[i..]))
            .filter(|(l, r)| id.contains_key(l) && id.contains_key(r))
            .map(|(l, r)| (l, r, s))
            .collect();
        local.sort_by_key(|(l, r, _)| (id[l], id[r]));
        merges.extend(local);
    }
    let chars = |x: &str| x.chars().count();
    // Python's sorted(..., reverse=True) is stable: equal keys keep their order.
    merges.sort_by(|a, b| {
        b.2.partial_cmp(&a.2)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| chars(b.0).cmp(&chars(a.0)))
            .then_with(|| chars(b.1).cmp(&chars(a.1)))
    });
    merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect()
}

fn header_error(path: &Path, e: &str) -> Error {
    let fix = if e.contains("unknown dtype") {
        "a tensor uses a quantization type candle cannot dequantize (supported: F32, F16, BF16, Q4_0, \
         Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K; not the IQ* or TQ* types): \
         re-quantize the model with llama.cpp's llama-quantize to e.g. Q8_0 or Q4_K_M"
    } else if e.contains("magic") {
        "this is not a GGUF file (wrong magic number)"
    } else {
        "the file is truncated or corrupt: download it again"
    };
    Error::weights(path, format!("cannot read the GGUF header: {e}; {fix}"))
}

/// llama.cpp's tensor name -> transformers' (Llama and Qwen2 share them).
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    let m = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    matches!(kind, "weight" | "bias").then(|| format!("model.layers.{layer}.{m}.{kind}"))
}

/// Undoes llama.cpp's `permute` of q/k rows: `(H, D/2, 2, …) -> (H, 2, D/2, …)` over the first
/// axis of `t` (`[H·D, in]` weights or `[H·D]` biases), as transformers' `_reverse_permute_weights`.
pub fn unpermute_rows(t: &Tensor, n_heads: usize) -> Result<Tensor> {
    permute_rows(t, n_heads, true)
}

/// llama.cpp's `LlamaModel.permute` (the inverse of [`unpermute_rows`]): `(H, 2, D/2, …) -> (H, D/2, 2, …)`.
pub fn llama_cpp_permute_rows(t: &Tensor, n_heads: usize) -> Result<Tensor> {
    permute_rows(t, n_heads, false)
}

/// Rows that do not split into `n_heads` heads of even size are an [`Error::Input`] naming the
/// counts; the callers add the file and the tensor.
fn permute_rows(t: &Tensor, n_heads: usize, undo: bool) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if n_heads == 0 || !rows.is_multiple_of(2 * n_heads) {
        return Err(Error::Input(format!("{rows} rows do not split into {n_heads} heads of even size")));
    }
    let half = rows / n_heads / 2;
    let rest: usize = dims[1..].iter().product();
    let (a, b) = if undo { (half, 2) } else { (2, half) };
    Ok(t.reshape((n_heads, a, b, rest))?.transpose(1, 2)?.contiguous()?.reshape(dims.as_slice())?)
}

/// The dequantized tensors of `path` under transformers' names (f32, CPU).
pub fn load_tensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    Gguf::open(path)?.tensors()
}

/// Writes `config.json`, `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`
/// for `g` into `dir`.
fn write_side_files(g: &Gguf, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let write = |name: &str, v: &serde_json::Value| {
        let text =
            serde_json::to_string_pretty(v).map_err(|e| Error::config(dir.join(name), e.to_string()))?;
        write_bytes_atomic(&dir.join(name), text.as_bytes())
    };
    write("config.json", &g.hf_config()?)?;
    let tok = g.tokenizer_json()?;
    // Check it builds before anything relies on it.
    let text = serde_json::to_string(&tok).map_err(|e| Error::Tokenizer(e.to_string()))?;
    text.parse::<tokenizers::Tokenizer>().map_err(|e| {
        Error::Tokenizer(format!("{}: the tokenizer in its metadata does not build: {e}", g.path.display()))
    })?;
    write("tokenizer.json", &tok)?;
    write("tokenizer_config.json", &g.tokenizer_config()?)?;
    write("generation_config.json", &g.generation_config())
}

/// The files of a GGUF model: its weights are the GGUF itself; `config.json`, `tokenizer.json`,
/// `tokenizer_config.json` and `generation_config.json` are derived from its metadata into a
/// cache directory ([`super::hub::HubOptions::derived_root_for`]: `$RLTUNE_CACHE` for the
/// command; else the model's own folder when that is inside the system temp dir, so that a
/// scratch model's derived files go with it; else the system temp dir;
/// `rltune-gguf-<stem>-<hash of path, size, mtime>`).
pub fn model_files(path: &Path) -> Result<ModelFiles> {
    let g = Gguf::open(path)?;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let abs = std::fs::canonicalize(path).map_err(|e| Error::io(path, e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let key = format!("{}|{}|{mtime}", abs.display(), meta.len());
    // FNV-1a: stable across runs and platforms.
    let hash = key.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let root = super::hub::current().derived_root_for(&abs);
    let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let dir = root.join(format!("rltune-gguf-{stem}-{hash:016x}"));
    write_side_files(&g, &dir)?;
    Ok(ModelFiles {
        dir: dir.clone(),
        config: dir.join("config.json"),
        weights: vec![abs],
        tokenizer: Some(dir.join("tokenizer.json")),
        generation_config: Some(dir.join("generation_config.json")),
    })
}

/// `rltune convert`: writes a Hugging Face directory (`config.json`, `model.safetensors` in
/// `dtype`, `tokenizer.json`, `tokenizer_config.json` with the chat template,
/// `generation_config.json`) that transformers' `from_pretrained` loads. Returns the number of
/// tensors written.
pub fn convert(path: &Path, out: &Path, dtype: candle_core::DType) -> Result<usize> {
    let g = Gguf::open(path)?;
    let tensors = g.tensors()?;
    let n = tensors.len();
    crate::io::save_dir_atomic(out, |tmp| {
        write_side_files(&g, tmp)?;
        let mut cast: HashMap<String, Tensor> = HashMap::new();
        for (k, t) in tensors {
            cast.insert(k, t.to_dtype(dtype)?);
        }
        let file = tmp.join("model.safetensors");
        candle_core::safetensors::save(&cast, &file).map_err(|e| Error::weights(&file, e.to_string()))
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_transformers() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(hf_name("blk.0.attn_k.bias").as_deref(), Some("model.layers.0.self_attn.k_proj.bias"));
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight").as_deref(),
            Some("model.layers.3.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.0.ffn_gate_exps.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    /// transformers' `_reverse_permute_weights` on 1 head of D = 4: llama.cpp's rows
    /// `[0, 2, 1, 3]` (interleaved) come back as `[0, 1, 2, 3]`, and permute ∘ unpermute = id.
    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let hf = Tensor::arange(0f32, 8.0, &Device::Cpu).unwrap().reshape((4, 2)).unwrap();
        let cpp = llama_cpp_permute_rows(&hf, 1).unwrap();
        assert_eq!(
            cpp.to_vec2::<f32>().unwrap(),
            vec![vec![0., 1.], vec![4., 5.], vec![2., 3.], vec![6., 7.]]
        );
        assert_eq!(unpermute_rows(&cpp, 1).unwrap().to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
        let two = Tensor::arange(0f32, 16.0, &Device::Cpu).unwrap().reshape((2, 8)).unwrap().t().unwrap();
        let back = unpermute_rows(&llama_cpp_permute_rows(&two, 2).unwrap(), 2).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), two.to_vec2::<f32>().unwrap());
        assert!(unpermute_rows(&hf, 3).is_err());
    }
}
