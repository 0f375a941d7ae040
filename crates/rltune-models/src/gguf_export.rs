//! `rltune export`: a model (with its LoRA adapter merged, if any) as a GGUF file for llama.cpp.
//!
//! The inverse of [`crate::gguf`], written as llama.cpp's `convert_hf_to_gguf.py` writes the
//! `llama` and `qwen2` architectures (its `LlamaModel` and `Qwen2Model`, `TextModel.
//! set_gguf_parameters` and `ModelBase.prepare_tensors`):
//! - names: [`gguf_name`], the inverse of [`crate::gguf::hf_name`];
//! - Llama's `q_proj`/`k_proj` rows (weights and biases) permuted by `LlamaModel.permute`
//!   ([`crate::gguf::llama_cpp_permute_rows`]), with H and H_kv heads; Qwen2's written as they are;
//! - types: 1-D tensors, `*_norm.weight` and anything not named `*.weight` (biases) stay F32; the
//!   rest take `--type`; a Q8_0 tensor whose rows are not whole blocks of 32 falls back to F16,
//!   as the converter does on gguf-py's `QuantError`;
//! - a tied `lm_head` is not written (llama.cpp reuses `token_embd`), a value head is left out;
//! - metadata: `general.{architecture, type, name, file_type, quantization_version}`, the
//!   `<arch>.*` hyperparameters (`vocab_size` and `rope.dimension_count` for llama only, as the
//!   converter), and the tokenizer ([`crate::gguf_vocab`]).
//!
//! Mistral is written as `llama`, as llama.cpp does; its sliding window is not representable
//! (llama.cpp ignores it too), which a warning says.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::gguf::llama_cpp_permute_rows;
use crate::gguf_write::{write_gguf, GgmlType, TensorOut, Q8_0_BLOCK};
use crate::llama::LlamaConfig;
use crate::load::{load_lm_adapted, locate, read_config_json, LoraSpec};
use crate::CausalLmConfig;

/// `--type`: the file type asked for (gguf-py `LlamaFileType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportType {
    /// Every tensor F32 (`ALL_F32`, 0).
    F32,
    /// Matrices F16, the rest F32 (`MOSTLY_F16`, 1).
    F16,
    /// Matrices Q8_0, the rest F32 (`MOSTLY_Q8_0`, 7).
    Q8_0,
}

impl std::str::FromStr for ExportType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(ExportType::F32),
            "f16" => Ok(ExportType::F16),
            "q8_0" => Ok(ExportType::Q8_0),
            other => Err(Error::Input(format!(
                "--type {other:?} is not a GGUF type rltune writes; use f32 (exact), f16 or q8_0 \
                 (other quantizations: run llama.cpp's llama-quantize on an f16 export)"
            ))),
        }
    }
}

impl ExportType {
    /// `general.file_type`.
    pub fn file_type(self) -> u32 {
        match self {
            ExportType::F32 => 0,
            ExportType::F16 => 1,
            ExportType::Q8_0 => 7,
        }
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    /// `general.architecture`.
    pub architecture: String,
    /// Tensors written, and how many of each type.
    pub tensors: usize,
    /// (F32, F16, Q8_0) tensor counts.
    pub by_type: (usize, usize, usize),
    /// The file's size.
    pub bytes: u64,
    /// LoRA layers merged (0 without an adapter).
    pub merged_layers: usize,
}

/// transformers' name -> llama.cpp's (gguf-py `tensor_mapping.py` for `llama`/`qwen2`); `None`
/// for a tensor the architecture does not have.
pub fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
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
        _ => return None,
    };
    matches!(kind, "weight" | "bias").then(|| format!("blk.{layer}.{m}.{kind}"))
}

/// The type of tensor `name` (llama.cpp's) of transformers shape `shape` in a `want` file, as
/// `ModelBase.prepare_tensors`: 1-D, norms and non-`.weight` tensors F32; Q8_0 needs rows
/// (`shape`'s last axis) of whole blocks, else F16.
pub fn tensor_type(name: &str, shape: &[usize], want: ExportType) -> GgmlType {
    if shape.len() <= 1 || name.ends_with("_norm.weight") || !name.ends_with(".weight") {
        return GgmlType::F32;
    }
    match want {
        ExportType::F32 => GgmlType::F32,
        ExportType::F16 => GgmlType::F16,
        ExportType::Q8_0 if shape.last().is_some_and(|n| n % Q8_0_BLOCK == 0) => GgmlType::Q8_0,
        ExportType::Q8_0 => GgmlType::F16,
    }
}

/// The GGUF architecture of `cfg` (`llama` for Mistral too) and a warning for what it loses.
fn architecture(cfg: &LlamaConfig, config_path: &Path) -> Result<&'static str> {
    if cfg.hidden_act != "silu" {
        return Err(Error::config(
            config_path,
            format!("hidden_act {:?}: llama.cpp's llama and qwen2 use SiLU; this model cannot be exported to GGUF", cfg.hidden_act),
        ));
    }
    let arch = match cfg.model_type.as_str() {
        "qwen2" => "qwen2",
        _ => "llama",
    };
    if let Some(w) = cfg.window().filter(|&w| w < cfg.max_positions()) {
        tracing::warn!(
            "{}: the sliding window of {w} tokens is not written to the GGUF (llama.cpp's {arch} has \
             none); sequences longer than {w} tokens will attend further back there",
            config_path.display()
        );
    }
    Ok(arch)
}

/// The `<arch>.*` hyperparameters (and the RoPE scaling) of `cfg`.
fn hyperparameters(arch: &str, cfg: &LlamaConfig, config_path: &Path) -> Result<Vec<(String, Value)>> {
    let k = |n: &str| format!("{arch}.{n}");
    let u = |x: usize| Value::U32(x as u32);
    let mut m = vec![
        (k("block_count"), u(cfg.num_hidden_layers)),
        (k("context_length"), u(cfg.max_positions())),
        (k("embedding_length"), u(cfg.hidden_size)),
        (k("feed_forward_length"), u(cfg.intermediate())),
        (k("attention.head_count"), u(cfg.num_attention_heads)),
        (k("attention.head_count_kv"), u(cfg.kv_heads())),
        (k("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)),
    ];
    let scaling = cfg.rope_scaling.as_ref().filter(|v| !v.is_null());
    if let Some(s) = scaling {
        let kind = s.get("type").or_else(|| s.get("rope_type")).and_then(|t| t.as_str()).unwrap_or("default");
        match kind {
            "default" => {}
            "linear" => {
                let factor = s.get("factor").and_then(|f| f.as_f64()).ok_or_else(|| {
                    Error::config(
                        config_path,
                        "rope_scaling.factor (a number) is required for rope_type \"linear\"",
                    )
                })?;
                m.push((k("rope.scaling.type"), Value::String("linear".into())));
                m.push((k("rope.scaling.factor"), Value::F32(factor as f32)));
            }
            other => {
                return Err(Error::config(
                    config_path,
                    format!(
                        "rope_scaling {other:?} cannot be exported: rltune writes and reads GGUF RoPE \
                         scaling \"linear\" only (llama3's needs a rope_freqs tensor rltune does not \
                         load); export the model with llama.cpp's convert_hf_to_gguf.py instead"
                    ),
                ))
            }
        }
    }
    if cfg.head_dim.is_some_and(|d| d != cfg.hidden_size / cfg.num_attention_heads.max(1)) {
        m.push((k("attention.key_length"), u(cfg.head_size())));
        m.push((k("attention.value_length"), u(cfg.head_size())));
    }
    if arch == "llama" {
        m.push((k("vocab_size"), u(cfg.vocab_size)));
        m.push((k("rope.dimension_count"), u(cfg.head_size())));
    }
    Ok(m)
}

/// The tensors of a llama/qwen2 model, named, permuted and typed for llama.cpp, in the
/// converter's order (`token_embd`, the blocks in order, `output_norm`, `output`).
pub fn gguf_tensors(
    arch: &str,
    cfg: &LlamaConfig,
    tensors: &BTreeMap<String, Tensor>,
    want: ExportType,
    source: &Path,
) -> Result<Vec<TensorOut>> {
    let mut out = Vec::new();
    for (hf, t) in tensors {
        if hf.starts_with("v_head.") || hf.ends_with(".rotary_emb.inv_freq") {
            continue;
        }
        if hf == "lm_head.weight" && cfg.tie_word_embeddings {
            continue;
        }
        let name = gguf_name(hf).ok_or_else(|| {
            Error::weights(
                source,
                format!(
                    "tensor {hf:?} has no llama.cpp {arch} counterpart, so the model cannot be exported \
                     to GGUF (rltune exports plain llama/qwen2 models: no extra heads or modules)"
                ),
            )
        })?;
        let mut t = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        if arch == "llama" && (name.contains(".attn_q.") || name.contains(".attn_k.")) {
            let heads = if name.contains(".attn_q.") { cfg.num_attention_heads } else { cfg.kv_heads() };
            t = llama_cpp_permute_rows(&t, heads)
                .map_err(|m| Error::weights(source, format!("{hf}: {m}")))?;
        }
        let ty = tensor_type(&name, t.dims(), want);
        if want == ExportType::Q8_0 && ty == GgmlType::F16 {
            tracing::warn!(
                "{name}: rows of {} values are not whole Q8_0 blocks of 32; written as F16",
                t.dim(t.rank() - 1)?
            );
        }
        out.push(TensorOut { name, data: t, ty });
    }
    let rank = |n: &str| -> (usize, usize, String) {
        match n.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, rest)) => (1, l.parse().unwrap_or(usize::MAX), rest.to_string()),
            None if n.starts_with("token_embd") => (0, 0, n.into()),
            None => (2, 0, n.into()),
        }
    };
    out.sort_by_key(|t| rank(&t.name));
    Ok(out)
}

/// `model`'s `config.json` parsed as a Llama-family config, or an error naming the file and
/// the architectures that export.
fn llama_config(model: &str) -> Result<(crate::io::ModelFiles, LlamaConfig)> {
    let files = locate(model)?;
    let json = read_config_json(&files.config)?;
    match CausalLmConfig::from_json(&json, &files.config) {
        Ok(CausalLmConfig::Llama(c)) => Ok((files, c)),
        Ok(other) => Err(Error::UnsupportedModel {
            path: files.config.clone(),
            model_type: other.model_type().into(),
            supported: "llama, mistral (written as llama) and qwen2 for `rltune export`; llama.cpp's \
                        convert_hf_to_gguf.py converts other architectures"
                .into(),
        }),
        Err(e) => Err(e),
    }
}

/// Exports `model` (a directory, hub id or GGUF file), with the LoRA adapter in `adapter`
/// merged when given, to the GGUF file `out` (written to a temporary file, then renamed).
pub fn export(model: &str, adapter: Option<&Path>, out: &Path, want: ExportType) -> Result<ExportSummary> {
    let (files, cfg) = llama_config(model)?;
    let arch = architecture(&cfg, &files.config)?;
    let tokenizer =
        crate::gguf_vocab::tokenizer_metadata(&files, &read_config_json(&files.config)?, cfg.vocab_size)?;
    let hyper = hyperparameters(arch, &cfg, &files.config)?;
    let spec = adapter.map(LoraSpec::from_dir);
    let loaded = load_lm_adapted(model, spec.as_ref(), false, DType::F32, &Device::Cpu)?;
    let merged_layers = loaded.store.lora_modules().len();
    let store = if spec.is_some() { loaded.store.merged()? } else { loaded.store };
    let source: PathBuf = adapter.map_or_else(|| files.dir.clone(), Path::to_path_buf);
    let tensors = gguf_tensors(arch, &cfg, &store.snapshot()?, want, &source)?;
    let name =
        Path::new(model).file_stem().map_or_else(|| model.to_string(), |s| s.to_string_lossy().into_owned());
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name)),
    ];
    meta.extend(hyper);
    meta.push(("general.file_type".into(), Value::U32(want.file_type())));
    meta.push(("general.quantization_version".into(), Value::U32(2)));
    meta.extend(tokenizer);
    let bytes = write_gguf(out, &meta, &tensors)?;
    let count = |ty| tensors.iter().filter(|t| t.ty == ty).count();
    Ok(ExportSummary {
        architecture: arch.into(),
        tensors: tensors.len(),
        by_type: (count(GgmlType::F32), count(GgmlType::F16), count(GgmlType::Q8_0)),
        bytes,
        merged_layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::hf_name;

    #[test]
    fn names_invert_the_readers() {
        for hf in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.11.post_attention_layernorm.weight",
            "model.layers.3.self_attn.q_proj.weight",
            "model.layers.3.self_attn.k_proj.bias",
            "model.layers.3.self_attn.v_proj.bias",
            "model.layers.3.self_attn.o_proj.weight",
            "model.layers.3.mlp.gate_proj.weight",
            "model.layers.3.mlp.up_proj.weight",
            "model.layers.3.mlp.down_proj.weight",
        ] {
            let g = gguf_name(hf).unwrap();
            assert_eq!(hf_name(&g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(gguf_name("model.layers.0.self_attn.q_proj.weight").unwrap(), "blk.0.attn_q.weight");
        assert_eq!(gguf_name("v_head.summary.weight"), None);
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
    }

    /// `ModelBase.prepare_tensors`' choices.
    #[test]
    fn norms_biases_and_vectors_stay_f32() {
        use ExportType::*;
        assert_eq!(tensor_type("blk.0.attn_norm.weight", &[64], Q8_0), GgmlType::F32);
        assert_eq!(tensor_type("output_norm.weight", &[64], F16), GgmlType::F32);
        assert_eq!(tensor_type("blk.0.attn_q.bias", &[64], F16), GgmlType::F32);
        assert_eq!(tensor_type("blk.0.attn_q.weight", &[64, 64], F16), GgmlType::F16);
        assert_eq!(tensor_type("token_embd.weight", &[100, 64], Q8_0), GgmlType::Q8_0);
        assert_eq!(tensor_type("blk.0.ffn_down.weight", &[64, 48], Q8_0), GgmlType::F16);
        assert_eq!(tensor_type("blk.0.ffn_down.weight", &[64, 48], F32), GgmlType::F32);
    }

    #[test]
    fn bad_types_name_the_flag_and_the_choices() {
        let e = "q4_k".parse::<ExportType>().unwrap_err().to_string();
        assert!(e.contains("--type") && e.contains("q8_0") && e.contains("llama-quantize"), "{e}");
        assert_eq!("Q8_0".parse::<ExportType>().unwrap(), ExportType::Q8_0);
    }
}
