//! The Llama family: `model_type` = `llama`, `qwen2` and `mistral` (transformers 4.46).
//!
//! One decoder covers `LlamaForCausalLM`, `Qwen2ForCausalLM` and `MistralForCausalLM`: RMSNorm
//! pre-norm blocks, rotary position embeddings, grouped-query attention and a SwiGLU MLP. Weight
//! names are transformers' (`model.layers.{i}.self_attn.q_proj.weight`, `lm_head.weight`). The
//! families differ only in their biases, defaults and sliding window:
//!
//! | family | q/k/v bias | o bias | MLP bias | sliding window |
//! |---|---|---|---|---|
//! | `llama` | `attention_bias` | `attention_bias` | `mlp_bias` | none |
//! | `qwen2` | always | never | never | `sliding_window` when `use_sliding_window` |
//! | `mistral` | never | never | never | `sliding_window` (default 4096, `null` = none) |
//!
//! Shape legend: B batch, T new positions, S key positions (cache + new), H query heads, H_kv
//! key/value heads, D head dim, C hidden size, V vocabulary.
//!
//! Differences from transformers, all deliberate:
//! - Dropout is never applied, and the forward returns the final (post-norm) hidden state at every
//!   position with an external [`KvCache`] holding un-repeated keys (after RoPE) and values.
//! - RoPE's cos/sin are computed per call from `position_ids` and a precomputed `inv_freq` (as
//!   transformers' `LlamaRotaryEmbedding.forward` does) instead of a table of every position: no
//!   limit at `max_position_embeddings`, no 2 × 32 MB table for Llama 3.1's 131072 positions.
//! - `rope_scaling` types `default`, `linear`, `dynamic` and `llama3` are implemented; `yarn` and
//!   `longrope` are rejected with an error. `dynamic` is stateless: each call rescales `inv_freq`
//!   for its own largest position, which equals transformers' stateful `_dynamic_frequency_update`
//!   whenever positions only grow (a forward pass, or incremental decoding).
//! - The sliding window follows the eager mask of transformers 4.46
//!   (`_prepare_4d_causal_attention_mask_with_cache_position`): a query in column `i` of the
//!   (cache + new) sequence sees keys `j > i − sliding_window`, in every layer (Qwen2's
//!   `max_window_layers` only affects the flash-attention kernel and is ignored, as eager does).
//! - Mistral in 4.46 ignores `rope_scaling`; here it is honoured for every family.

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Deserializer, Serialize};

use super::layers::{
    attention, checkpointed, merge_heads, repeat_kv, split_heads, Activation, Embedding, GradSlot, KvCache,
    Linear, MASK_MIN,
};
use crate::error::{ConfigError, Error, Result};
use crate::params::{Init, Params};
use rltune_kernels as ops;

/// `config.json` of a Llama-family model.
///
/// Defaults are those of transformers' `LlamaConfig`, `Qwen2Config` and `MistralConfig`; fields
/// whose default depends on the family are `Option`s resolved by the accessor methods.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `qwen2` or `mistral` (empty is read as `llama`).
    #[serde(default)]
    pub model_type: String,
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Hidden size C.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// MLP inner size; see [`LlamaConfig::intermediate`] for the family default.
    #[serde(default)]
    pub intermediate_size: Option<usize>,
    /// Number of decoder layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Number of query heads H.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Number of key/value heads H_kv; see [`LlamaConfig::kv_heads`] for the family default.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head dim D (llama, mistral); `None` means C / H. Qwen2 always uses C / H.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// MLP activation (transformers' `ACT2FN` name).
    #[serde(default = "d_act")]
    pub hidden_act: String,
    /// RMSNorm epsilon.
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    /// RoPE scaling: `null`, or an object with `rope_type` (or legacy `type`) `default`,
    /// `linear`, `dynamic` or `llama3` and that type's parameters.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Maximum positions; see [`LlamaConfig::max_positions`] for the family default.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// Llama only: biases on the q/k/v/o projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Llama only: biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Whether `lm_head` shares `model.embed_tokens`' weights.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mistral, Qwen2: attention window. Absent (outer `None`) means the family default; `null`
    /// means no window. See [`LlamaConfig::window`].
    #[serde(default, deserialize_with = "present_or_null", skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<Option<usize>>,
    /// Qwen2 only: whether `sliding_window` applies.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Init std for random models.
    #[serde(default = "d_init")]
    pub initializer_range: f64,
    /// End-of-sequence token (a number, or a list of them for Llama 3).
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Padding token (negative values, as in some old Llama configs, read as none).
    #[serde(default, deserialize_with = "non_negative_id")]
    pub pad_token_id: Option<u32>,
}

fn d_hidden() -> usize {
    4096
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> usize {
    32
}
fn d_act() -> String {
    "silu".into()
}
fn d_eps() -> f64 {
    1e-6
}
fn d_theta() -> f64 {
    10000.0
}
fn d_init() -> f64 {
    0.02
}

/// Tells an absent field (`None`, via `#[serde(default)]`) from an explicit `null` (`Some(None)`).
fn present_or_null<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<usize>>, D::Error> {
    Option::<usize>::deserialize(d).map(Some)
}

fn non_negative_id<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<u32>, D::Error> {
    Ok(Option::<i64>::deserialize(d)?.and_then(|v| u32::try_from(v).ok()))
}

/// Which transformers class the config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Llama,
    Qwen2,
    Mistral,
}

impl LlamaConfig {
    /// A small Llama config for tests and benchmarks (SwiGLU inner size 2·C, untied head).
    pub fn tiny(
        vocab_size: usize,
        hidden_size: usize,
        num_hidden_layers: usize,
        heads: usize,
        kv_heads: usize,
    ) -> Self {
        let v = serde_json::json!({
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 256,
            "eos_token_id": vocab_size.saturating_sub(1),
        });
        serde_json::from_value(v).unwrap_or_else(|_| unreachable!("every field is valid"))
    }

    fn family(&self) -> std::result::Result<Family, ConfigError> {
        match self.model_type.as_str() {
            "llama" | "" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "mistral" => Ok(Family::Mistral),
            other => Err(ConfigError::new(
                "",
                "model_type",
                format!("{other:?} is not a Llama-family model (llama, qwen2, mistral)"),
            )),
        }
    }

    fn family_or_llama(&self) -> Family {
        self.family().unwrap_or(Family::Llama)
    }

    /// transformers' family defaults: (H_kv, `intermediate_size`, `max_position_embeddings`).
    fn family_defaults(&self) -> (usize, usize, usize) {
        match self.family_or_llama() {
            Family::Llama => (self.num_attention_heads, 11008, 2048),
            Family::Qwen2 => (32, 22016, 32768),
            Family::Mistral => (8, 14336, 4096 * 32),
        }
    }

    /// Key/value heads H_kv; when absent: H (llama), 32 (qwen2), 8 (mistral), as transformers.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.family_defaults().0)
    }

    /// Head dim D: `head_dim` when given (llama, mistral), else C / H.
    pub fn head_size(&self) -> usize {
        match (self.family_or_llama(), self.head_dim) {
            (Family::Llama | Family::Mistral, Some(d)) => d,
            _ => self.hidden_size / self.num_attention_heads.max(1),
        }
    }

    /// MLP inner size; when absent: 11008 (llama), 22016 (qwen2), 14336 (mistral).
    pub fn intermediate(&self) -> usize {
        self.intermediate_size.unwrap_or(self.family_defaults().1)
    }

    /// Maximum positions; when absent: 2048 (llama), 32768 (qwen2), 131072 (mistral).
    pub fn max_positions(&self) -> usize {
        self.max_position_embeddings.unwrap_or(self.family_defaults().2)
    }

    /// The attention window in effect, if any (see the module docs).
    pub fn window(&self) -> Option<usize> {
        match self.family_or_llama() {
            Family::Llama => None,
            Family::Qwen2 if !self.use_sliding_window => None,
            Family::Qwen2 | Family::Mistral => self.sliding_window.unwrap_or(Some(4096)),
        }
    }

    /// Biases of (q/k/v, o, MLP) projections for this family.
    fn biases(&self) -> (bool, bool, bool) {
        match self.family_or_llama() {
            Family::Llama => (self.attention_bias, self.attention_bias, self.mlp_bias),
            Family::Qwen2 => (true, false, false),
            Family::Mistral => (false, false, false),
        }
    }

    /// Checks the fields that would otherwise fail deep inside a forward pass; the message names
    /// the field.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        let family = self.family()?;
        let (h, h_kv) = (self.num_attention_heads, self.kv_heads());
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return Err(ConfigError::table(
                "",
                "vocab_size, hidden_size and num_hidden_layers must be positive",
            ));
        }
        if h == 0 || h_kv == 0 || h % h_kv != 0 {
            return Err(ConfigError::new(
                "",
                "num_attention_heads",
                format!("({h}) must be a positive multiple of num_key_value_heads ({h_kv})"),
            ));
        }
        if (self.head_dim.is_none() || family == Family::Qwen2) && !self.hidden_size.is_multiple_of(h) {
            return Err(ConfigError::new(
                "",
                "hidden_size",
                format!(
                    "({}) must be divisible by num_attention_heads ({h}), or set head_dim",
                    self.hidden_size
                ),
            ));
        }
        let d = self.head_size();
        if d == 0 || !d.is_multiple_of(2) {
            return Err(ConfigError::new(
                "",
                "head_dim",
                format!("({d}) must be even and positive for rotary embeddings"),
            ));
        }
        let not_positive = |x: f64| x.is_nan() || x <= 0.0;
        if self.intermediate() == 0 || not_positive(self.rms_norm_eps) || not_positive(self.rope_theta) {
            return Err(ConfigError::table(
                "",
                "intermediate_size, rms_norm_eps and rope_theta must be positive",
            ));
        }
        if self.window() == Some(0) {
            return Err(ConfigError::new("", "sliding_window", "must be positive (or null for none)"));
        }
        RopeScaling::parse(self.rope_scaling.as_ref())?;
        Activation::parse("hidden_act", &self.hidden_act).map(|_| ())
    }
}

/// The `rope_scaling` variants rltune implements (transformers' `ROPE_INIT_FUNCTIONS`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum RopeScaling {
    Default,
    /// `_compute_linear_scaling_rope_parameters`: `inv_freq / factor`.
    Linear {
        factor: f64,
    },
    /// `_compute_dynamic_ntk_parameters`: base rescaled once positions pass the maximum.
    Dynamic {
        factor: f64,
    },
    /// `_compute_llama3_parameters`.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_positions: f64,
    },
}

impl RopeScaling {
    /// Parses `rope_scaling`; the legacy key `type` wins over `rope_type`, as in `LlamaConfig`.
    fn parse(v: Option<&serde_json::Value>) -> std::result::Result<Self, ConfigError> {
        let bad = |problem: String| ConfigError::new("", "rope_scaling", problem);
        let key_bad =
            |key: &str, problem: String| ConfigError::new("", format!("rope_scaling.{key}"), problem);
        let obj = match v {
            None | Some(serde_json::Value::Null) => return Ok(Self::Default),
            Some(serde_json::Value::Object(o)) => o,
            Some(other) => return Err(bad(format!("must be null or an object, got {other}"))),
        };
        let kind =
            obj.get("type").or_else(|| obj.get("rope_type")).and_then(|t| t.as_str()).unwrap_or("default");
        let num = |key: &str| {
            obj.get(key)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| key_bad(key, format!("(a number) is required for rope_type {kind:?}")))
        };
        let positive = |key: &str| {
            num(key).and_then(|x| {
                if x > 0.0 {
                    Ok(x)
                } else {
                    Err(key_bad(key, format!("must be positive, got {x}")))
                }
            })
        };
        match kind {
            "default" => Ok(Self::Default),
            "linear" => Ok(Self::Linear { factor: positive("factor")? }),
            "dynamic" => Ok(Self::Dynamic { factor: positive("factor")? }),
            "llama3" => {
                let (low, high) = (positive("low_freq_factor")?, positive("high_freq_factor")?);
                if high <= low {
                    return Err(key_bad(
                        "high_freq_factor",
                        format!("({high}) must exceed low_freq_factor ({low})"),
                    ));
                }
                Ok(Self::Llama3 {
                    factor: positive("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_positions: positive("original_max_position_embeddings")?,
                })
            }
            other => Err(bad(format!(
                ": unsupported rope_type {other:?}; supported: default, linear, dynamic, llama3"
            ))),
        }
    }
}

/// `modeling_rope_utils._compute_default_rope_parameters`: `1 / base^(2i / dim)`, `[D/2]`.
fn default_inv_freq(base: f64, dim: usize) -> Vec<f64> {
    (0..dim).step_by(2).map(|i| 1.0 / base.powf(i as f64 / dim as f64)).collect()
}

/// `modeling_rope_utils._compute_llama3_parameters`: keep high frequencies, divide low ones by
/// `factor`, interpolate smoothly between.
fn llama3_inv_freq(inv_freq: &[f64], factor: f64, low: f64, high: f64, old_context: f64) -> Vec<f64> {
    let (low_freq_wavelen, high_freq_wavelen) = (old_context / low, old_context / high);
    inv_freq
        .iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_freq_wavelen {
                f
            } else if wavelen > low_freq_wavelen {
                f / factor
            } else {
                let smooth = (old_context / wavelen - low) / (high - low);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// Rotary position embeddings (transformers' `LlamaRotaryEmbedding`), with no trainable state.
#[derive(Debug, Clone)]
struct Rope {
    /// `[D/2]` in [`Rope::compute_dtype`], on the model's device.
    inv_freq: Tensor,
    scaling: RopeScaling,
    base: f64,
    dim: usize,
    max_positions: usize,
}

impl Rope {
    fn new(cfg: &LlamaConfig, dtype: DType, device: &Device) -> Result<Self> {
        let scaling = RopeScaling::parse(cfg.rope_scaling.as_ref())?;
        let (base, dim) = (cfg.rope_theta, cfg.head_size());
        let inv = default_inv_freq(base, dim);
        let inv = match scaling {
            RopeScaling::Default | RopeScaling::Dynamic { .. } => inv,
            RopeScaling::Linear { factor } => inv.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_positions } => {
                llama3_inv_freq(&inv, factor, low_freq_factor, high_freq_factor, original_max_positions)
            }
        };
        let inv_freq = Self::to_tensor(inv, dtype, device)?;
        Ok(Self { inv_freq, scaling, base, dim, max_positions: cfg.max_positions() })
    }

    /// cos/sin are computed in f32 (as transformers does) or in f64 for f64 models.
    fn compute_dtype(dtype: DType) -> DType {
        if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    fn to_tensor(inv: Vec<f64>, dtype: DType, device: &Device) -> Result<Tensor> {
        let n = inv.len();
        Ok(Tensor::from_vec(inv, n, device)?.to_dtype(Self::compute_dtype(dtype))?)
    }

    /// `inv_freq` for this call; only `dynamic` scaling depends on the positions.
    fn inv_freq_for(&self, position_ids: &Tensor) -> Result<Tensor> {
        let RopeScaling::Dynamic { factor } = self.scaling else {
            return Ok(self.inv_freq.clone());
        };
        let max_pos = position_ids.flatten_all()?.to_dtype(DType::F64)?.max(0)?.to_scalar::<f64>()?;
        let seq_len = max_pos + 1.0;
        let max = self.max_positions as f64;
        if seq_len <= max {
            return Ok(self.inv_freq.clone());
        }
        // `_compute_dynamic_ntk_parameters`
        let d = self.dim as f64;
        let base = self.base * ((factor * seq_len / max) - (factor - 1.0)).powf(d / (d - 2.0));
        Self::to_tensor(default_inv_freq(base, self.dim), self.inv_freq.dtype(), self.inv_freq.device())
    }

    /// `position_ids (B, T)` -> `(cos, sin)`, each `(B, 1, T, D/2)` in `dtype`.
    fn cos_sin(&self, position_ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let inv_freq = self.inv_freq_for(position_ids)?;
        // (B, T, 1) * (1, 1, D/2) -> (B, T, D/2)
        let pos = position_ids.to_dtype(inv_freq.dtype())?.unsqueeze(2)?;
        let freqs = pos.broadcast_mul(&inv_freq.reshape((1, 1, ()))?)?;
        let cos = freqs.cos()?.to_dtype(dtype)?.unsqueeze(1)?;
        let sin = freqs.sin()?.to_dtype(dtype)?.unsqueeze(1)?;
        Ok((cos, sin))
    }
}

/// `(1, 1, T, S)` additive bias hiding keys `j <= i − window` from the query in column `i`
/// (transformers' `sliding_attend_mask`); `None` when it hides nothing.
fn sliding_window_bias(
    q_len: usize,
    s: usize,
    window: usize,
    dtype: DType,
    device: &Device,
) -> Result<Option<Tensor>> {
    if s <= window {
        return Ok(None);
    }
    let past = s.saturating_sub(q_len);
    let mut data = vec![0f32; q_len * s];
    for t in 0..q_len {
        for j in 0..s {
            if j + window <= past + t {
                data[t * s + j] = MASK_MIN as f32;
            }
        }
    }
    Ok(Some(Tensor::from_vec(data, (1, 1, q_len, s), device)?.to_dtype(dtype)?))
}

/// `LlamaRMSNorm`, through the differentiable [`ops::rms_norm`].
#[derive(Debug, Clone)]
struct RmsNorm {
    /// `[C]`
    weight: Tensor,
    eps: f64,
    /// Where the backward writes the weight's gradient (the store's slot).
    grads: GradSlot,
}

impl RmsNorm {
    fn load(p: &Params, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: p.get("weight", dim, Init::Ones)?, eps, grads: p.grad_slot().clone() })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::rms_norm_with(x, &self.weight, self.eps, &self.grads)?)
    }
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    n_heads: usize,
    n_kv_heads: usize,
    scale: f64,
}

impl Attention {
    fn load(p: &Params, cfg: &LlamaConfig) -> Result<Self> {
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        let (h, h_kv, d) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_size());
        let (qkv_bias, o_bias, _) = cfg.biases();
        Ok(Self {
            q_proj: Linear::load(&p.pp("q_proj"), c, h * d, qkv_bias, std)?,
            k_proj: Linear::load(&p.pp("k_proj"), c, h_kv * d, qkv_bias, std)?,
            v_proj: Linear::load(&p.pp("v_proj"), c, h_kv * d, qkv_bias, std)?,
            o_proj: Linear::load(&p.pp("o_proj"), h * d, c, o_bias, std)?,
            n_heads: h,
            n_kv_heads: h_kv,
            scale: 1.0 / (d as f64).sqrt(),
        })
    }

    /// `(B, T, C) -> (B, T, C)`; `cos, sin (B, 1, T, D/2)`, `bias (B, 1, T, S)`.
    fn forward(
        &self,
        x: &Tensor,
        rope: (&Tensor, &Tensor),
        bias: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        let (cos, sin) = rope;
        let (q, k) = (self.q_proj.forward(x)?, self.k_proj.forward(x)?); // (B, T, H·D), (B, T, H_kv·D)
        let full = q.dims().get(1).is_some_and(|&t| bias.dims().last() == Some(&t));
        if cache.is_none() && full && ops::bf16_attention(&q) {
            // Training and scoring under autocast with `[runtime] attention = "bf16"`: the two
            // products in bf16 on the tensor cores; the bf16 result goes on to the output
            // product where bf16 activations are on and it is its weight alone.
            let heads = (self.n_heads, self.n_kv_heads);
            let y = ops::rope_attention_bf16(
                &q,
                &k,
                &self.v_proj.forward(x)?,
                cos,
                sin,
                bias,
                heads,
                self.scale,
            )?;
            let y = if self.o_proj.weight_only() && ops::bf16_activations(x) {
                y
            } else {
                y.to_dtype(x.dtype())?
            };
            return Ok(self.o_proj.forward(&y)?.to_dtype(x.dtype())?);
        }
        if cache.is_none() && ops::rope_attention_takes(&q, &k, cos, bias) {
            // Training and scoring (CPU; CUDA in f32): rotation, grouped-query attention and the
            // merge as one node, which keeps its inputs and the probabilities only.
            let heads = (self.n_heads, self.n_kv_heads);
            let y = ops::rope_attention(&q, &k, &self.v_proj.forward(x)?, cos, sin, bias, heads, self.scale)?;
            return self.o_proj.forward(&y);
        }
        let q = ops::rope_heads(&q, cos, sin, self.n_heads)?; // (B, H, T, D)
        let k = ops::rope_heads(&k, cos, sin, self.n_kv_heads)?; // (B, H_kv, T, D)
        if let Some((cache, layer)) = cache {
            if ops::cached_attention_takes(x, bias) {
                // Generation on the CPU: keys and values appended in place, the H_kv heads shared
                // by their query heads, not repeated (no per-step copy of the cache).
                let qkv = Tensor::cat(&[&merge_heads(&q)?, &merge_heads(&k)?, &self.v_proj.forward(x)?], 2)?;
                let y = ops::cached_attention(
                    &qkv,
                    bias,
                    cache.block_mut(layer)?,
                    self.n_heads,
                    self.n_kv_heads,
                    self.scale,
                )?;
                return self.o_proj.forward(&y);
            }
            let v = split_heads(&self.v_proj.forward(x)?, self.n_kv_heads)?;
            let (k, v) = cache.append(layer, &k, &v)?;
            return self.attend(&q, &k, &v, bias);
        }
        let v = split_heads(&self.v_proj.forward(x)?, self.n_kv_heads)?;
        self.attend(&q, &k, &v, bias)
    }

    /// Attention of `q (B, H, T, D)` over `k, v (B, H_kv, S, D)`, then the output projection.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Result<Tensor> {
        // The cache keeps the un-repeated (B, H_kv, S, D) keys and values.
        let n_rep = self.n_heads / self.n_kv_heads;
        let (b, h, t, d) = q.dims4()?;
        let y = if n_rep > 1 && t == 1 && bias.dim(1)? == 1 {
            // A decoding step: query head h reads key head h / n_rep, so the n_rep query heads of
            // a key head are n_rep rows against its keys, `(B, H_kv, n_rep, D)`; a bias of one
            // head, `(B, 1, 1, S)`, broadcasts over them. No copy of the keys and values per head.
            let grouped = q.reshape((b, self.n_kv_heads, n_rep, d))?;
            attention(&grouped, k, v, bias, self.scale)?.reshape((b, h, 1, d))?
        } else {
            attention(q, &repeat_kv(k, n_rep)?, &repeat_kv(v, n_rep)?, bias, self.scale)?
        };
        self.o_proj.forward(&merge_heads(&y)?)
    }
}

/// `LlamaMLP`: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Activation,
}

impl Mlp {
    fn load(p: &Params, cfg: &LlamaConfig) -> Result<Self> {
        let (c, inner, std) = (cfg.hidden_size, cfg.intermediate(), cfg.initializer_range);
        let (_, _, bias) = cfg.biases();
        Ok(Self {
            gate_proj: Linear::load(&p.pp("gate_proj"), c, inner, bias, std)?,
            up_proj: Linear::load(&p.pp("up_proj"), c, inner, bias, std)?,
            down_proj: Linear::load(&p.pp("down_proj"), inner, c, bias, std)?,
            act: Activation::parse("hidden_act", &cfg.hidden_act)?,
        })
    }

    /// `(B, T, C) -> (B, T, C)`
    ///
    /// Under autocast with bf16 activations ([`ops::bf16_activations`]), `gate`, `up` and the
    /// SwiGLU stay bf16 between the three products, as under `torch.autocast`: `x` is cast
    /// once for each of the two products (so that their gradients meet in f32, as before), and
    /// only the down product's result comes back to f32. Projections with a bias or a LoRA
    /// adapter keep the f32 path, whose sums (bias, adapter) are f32: there bf16 activations
    /// would change the values.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let plain = [&self.gate_proj, &self.up_proj, &self.down_proj].iter().all(|l| l.weight_only());
        if self.act == Activation::Silu && plain && ops::bf16_activations(x) {
            let (xg, xu) = (x.to_dtype(DType::BF16)?, x.to_dtype(DType::BF16)?);
            let h = ops::swiglu(&self.gate_proj.forward(&xg)?, &self.up_proj.forward(&xu)?)?;
            return Ok(self.down_proj.forward(&h)?.to_dtype(x.dtype())?);
        }
        let (gate, up) = (self.gate_proj.forward(x)?, self.up_proj.forward(x)?);
        let h = match self.act {
            Activation::Silu => ops::swiglu(&gate, &up)?,
            _ => (self.act.forward(&gate)? * up)?,
        };
        self.down_proj.forward(&h)
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(p: &Params, cfg: &LlamaConfig) -> Result<Self> {
        let (c, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: RmsNorm::load(&p.pp("input_layernorm"), c, eps)?,
            self_attn: Attention::load(&p.pp("self_attn"), cfg)?,
            post_attention_layernorm: RmsNorm::load(&p.pp("post_attention_layernorm"), c, eps)?,
            mlp: Mlp::load(&p.pp("mlp"), cfg)?,
        })
    }

    /// `(B, T, C) -> (B, T, C)`
    fn forward(
        &self,
        x: &Tensor,
        rope: (&Tensor, &Tensor),
        bias: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        let h = (x + self.self_attn.forward(&self.input_layernorm.forward(x)?, rope, bias, cache)?)?;
        Ok((&h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?)
    }
}

/// A Llama-family causal LM (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`).
#[derive(Debug, Clone)]
pub struct Llama {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `[V, C]`; the same tensor as `embed_tokens` when tied.
    lm_head: Tensor,
    rope: Rope,
    window: Option<usize>,
    /// Gradient checkpointing of every block in training forwards (no cache).
    checkpointing: bool,
    /// The store's gradient slot, where the backward writes the weights' gradients.
    grads: GradSlot,
    /// Boxed to keep [`super::CausalLm`]'s variants of similar size.
    cfg: Box<LlamaConfig>,
}

impl Llama {
    /// Builds the model from `p`, the checkpoint root (names `model.*`, `lm_head.weight`).
    pub fn load(p: &Params, cfg: &LlamaConfig) -> Result<Self> {
        cfg.validate().map_err(|m| Error::config(p.store().source(), m))?;
        let body = p.pp("model");
        let (v, c, std) = (cfg.vocab_size, cfg.hidden_size, cfg.initializer_range);
        let embed_tokens = Embedding::load(&body.pp("embed_tokens"), v, c, std)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(&body.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&body.pp("norm"), c, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            p.tie("lm_head.weight", &body.pp("embed_tokens").full_name("weight"));
            embed_tokens.weight.clone()
        } else {
            p.get("lm_head.weight", (v, c), Init::Normal(std))?
        };
        let store = p.store();
        let rope = Rope::new(cfg, store.dtype(), store.device())?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            window: cfg.window(),
            checkpointing: false,
            grads: p.grad_slot().clone(),
            cfg: Box::new(cfg.clone()),
        })
    }

    /// Gradient checkpointing of every block in training forwards ([`super::layers::checkpointed`]).
    pub(crate) fn set_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }

    /// The store's gradient slot (see [`GradSlot`]).
    pub(crate) fn grad_slot(&self) -> &GradSlot {
        &self.grads
    }

    /// The config this model was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Final hidden states (after `model.norm`) at every new position: `(B, T)` ids -> `(B, T, C)`.
    ///
    /// `position_ids (B, T)`; `bias (B, 1, T, S)` from [`super::layers::causal_bias`], where
    /// `S` = cached positions + T; with a cache, the new keys and values are appended to it.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len) = input_ids.dims2()?;
        let (_, _, q_len, s) = bias.dims4()?;
        let past = cache.as_deref().map_or(0, KvCache::seq_len);
        if position_ids.dims() != [b_sz, seq_len] || q_len != seq_len || s != past + seq_len {
            return Err(Error::Input(format!(
                "llama forward: input_ids {:?}, position_ids {:?}, bias {:?} and {past} cached positions \
                 do not agree; expected bias (B, 1, T, cached + T)",
                input_ids.dims(),
                position_ids.dims(),
                bias.dims()
            )));
        }
        let x = self.embed_tokens.forward(input_ids)?; // (B, T, C)
        let x = self.blocks(x, position_ids, bias, 0..self.layers.len(), cache)?;
        self.norm.forward(&x)
    }

    /// Layers `range` on `x` (with a cache, each appends to its own slot).
    fn blocks(
        &self,
        mut x: Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        range: std::ops::Range<usize>,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (cos, sin) = self.rope.cos_sin(position_ids, x.dtype())?;
        let bias = self.window_bias(bias)?;
        for i in range {
            x = match cache.as_deref_mut() {
                None if self.checkpointing => {
                    let (layer, cos, sin, bias) =
                        (self.layers[i].clone(), cos.clone(), sin.clone(), bias.clone());
                    checkpointed(&x, &self.grads, move |x| layer.forward(x, (&cos, &sin), &bias, None))?
                }
                c => self.layers[i].forward(&x, (&cos, &sin), &bias, c.map(|c| (c, i)))?,
            };
            x = KvCache::cut(cache.as_deref(), x);
        }
        Ok(x)
    }

    /// `bias` with the sliding window added, when the model has one.
    fn window_bias(&self, bias: &Tensor) -> Result<Tensor> {
        let (_, _, q_len, s) = bias.dims4()?;
        Ok(match self.window {
            Some(w) => match sliding_window_bias(q_len, s, w, bias.dtype(), bias.device())? {
                Some(sw) => bias.broadcast_add(&sw)?,
                None => bias.clone(),
            },
            None => bias.clone(),
        })
    }

    /// The hidden states entering layer `end`: the embeddings, then layers `..end` (no cache).
    pub fn trunk(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        end: usize,
    ) -> Result<Tensor> {
        let x = self.embed_tokens.forward(input_ids)?;
        self.blocks(x, position_ids, bias, 0..end.min(self.layers.len()), None)
    }

    /// Layers `start..` and the final norm on `x`, the hidden states entering layer `start`.
    pub fn top(&self, x: &Tensor, position_ids: &Tensor, bias: &Tensor, start: usize) -> Result<Tensor> {
        let x = self.blocks(x.clone(), position_ids, bias, start..self.layers.len(), None)?;
        self.norm.forward(&x)
    }

    /// The LM head's weight `(V, C)` (`embed_tokens`' when tied).
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// Folds every LoRA adapter into its weight ([`Linear::merge_adapter`]); whether any was.
    pub fn merge_adapters(&mut self) -> Result<bool> {
        let mut any = false;
        for l in &mut self.layers {
            let (a, m) = (&mut l.self_attn, &mut l.mlp);
            for lin in [
                &mut a.q_proj,
                &mut a.k_proj,
                &mut a.v_proj,
                &mut a.o_proj,
                &mut m.gate_proj,
                &mut m.up_proj,
                &mut m.down_proj,
            ] {
                any |= lin.merge_adapter()?;
            }
        }
        Ok(any)
    }

    /// The weight matrices of the linear layers and the LM head.
    pub fn weight_matrices(&self) -> Vec<Tensor> {
        let mut w: Vec<Tensor> = self
            .layers
            .iter()
            .flat_map(|l| {
                let (a, m) = (&l.self_attn, &l.mlp);
                [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &m.gate_proj, &m.up_proj, &m.down_proj]
                    .map(|lin| lin.weight.clone())
            })
            .collect();
        w.push(self.lm_head.clone());
        w
    }

    /// `(B, T, C) -> (B, T, V)`
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b_sz, seq_len, c) = hidden.dims3()?;
        let v = self.lm_head.dim(0)?;
        let h = hidden.reshape((b_sz * seq_len, c))?;
        Ok(rltune_kernels::matmul_weight_t(&h, &self.lm_head)?.reshape((b_sz, seq_len, v))?)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use candle_core::{DType, Device, Tensor};
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::layers::{causal_bias, position_ids_from_mask};
    use crate::params::ParamStore;
    use crate::{CausalLm, CausalLmConfig};

    fn fixture_dir(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/fixtures/models")).join(name)
    }

    fn to_u32(t: &Tensor) -> Tensor {
        t.to_dtype(DType::U32).unwrap()
    }

    /// Max |a − b| over the positions where `mask (B, T)` is 1; `a, b (B, T, X)`.
    fn masked_max_diff(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
        let m = mask.to_dtype(DType::F64).unwrap().unsqueeze(2).unwrap();
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap().abs().unwrap();
        d.broadcast_mul(&m).unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    /// Runs the transformers fixture `name` (tools/fixtures/make_model_fixtures.py) and compares
    /// hidden states and logits at non-padding positions.
    fn check_fixture(name: &str) {
        let dir = fixture_dir(name);
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).expect("fixture config.json");
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cfg = CausalLmConfig::from_json(&value, &cfg_path).unwrap();
        let dev = Device::Cpu;
        let store =
            ParamStore::load_safetensors(&[dir.join("model.safetensors")], false, DType::F32, &dev).unwrap();
        let model = CausalLm::load(&store.root(), &cfg).unwrap();
        let exp = candle_core::safetensors::load(dir.join("expected.safetensors"), &dev).unwrap();
        let mask = &exp["attention_mask"];
        let rows: Vec<Vec<u8>> = mask
            .to_vec2::<i64>()
            .unwrap()
            .into_iter()
            .map(|r| r.into_iter().map(|m| m as u8).collect())
            .collect();
        let (_, seq_len) = mask.dims2().unwrap();
        let bias = causal_bias(&rows, seq_len, DType::F32, &dev).unwrap();
        let ids = to_u32(&exp["input_ids"]);
        let pos = to_u32(&exp["position_ids"]);
        let hidden = model.forward(&ids, &pos, &bias, None).unwrap();
        let logits = model.logits(&hidden).unwrap();
        let dh = masked_max_diff(&hidden, &exp["hidden"], mask);
        let dl = masked_max_diff(&logits, &exp["logits"], mask);
        println!("{name}: hidden maxdiff {dh:.3e}, logits maxdiff {dl:.3e}");
        assert!(dh < 1e-4 && dl < 1e-4, "{name}: hidden maxdiff {dh:.3e}, logits maxdiff {dl:.3e}");
    }

    #[test]
    fn matches_transformers_llama_llama3_rope() {
        check_fixture("llama");
    }

    #[test]
    fn matches_transformers_qwen2_tied_qkv_bias() {
        check_fixture("qwen2");
    }

    #[test]
    fn matches_transformers_mistral() {
        check_fixture("mistral");
    }

    fn tiny(model_type: &str, extra: serde_json::Value) -> LlamaConfig {
        let mut v = serde_json::to_value(LlamaConfig::tiny(23, 16, 2, 4, 2)).unwrap();
        v["model_type"] = model_type.into();
        v["initializer_range"] = 0.2.into();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    /// Full-sequence forward vs a prefix then one token at a time through the KV cache, on a
    /// left-padded batch; compared at real tokens.
    fn check_cached_matches_uncached(cfg: &LlamaConfig) {
        let dev = Device::Cpu;
        let store = ParamStore::random(3, true, DType::F32, &dev).unwrap();
        let model = Llama::load(&store.root(), cfg).unwrap();
        let mask: Vec<Vec<u8>> = vec![vec![1; 8], vec![0, 0, 1, 1, 1, 1, 1, 1]];
        let ids = Tensor::new(&[[5u32, 7, 1, 9, 11, 2, 3, 4], [0, 0, 8, 6, 13, 17, 19, 22]], &dev).unwrap();
        let pos = position_ids_from_mask(&mask, &dev).unwrap();
        let full =
            model.forward(&ids, &pos, &causal_bias(&mask, 8, DType::F32, &dev).unwrap(), None).unwrap();

        let mut cache = KvCache::new(cfg.num_hidden_layers);
        let mut steps = Vec::new();
        let mut start = 0;
        for end in [5, 6, 7, 8] {
            let sub: Vec<Vec<u8>> = mask.iter().map(|r| r[..end].to_vec()).collect();
            let bias = causal_bias(&sub, end - start, DType::F32, &dev).unwrap();
            let (i, p) =
                (ids.narrow(1, start, end - start).unwrap(), pos.narrow(1, start, end - start).unwrap());
            steps.push(model.forward(&i, &p, &bias, Some(&mut cache)).unwrap());
            start = end;
        }
        assert_eq!(cache.seq_len(), 8);
        let inc = Tensor::cat(&steps, 1).unwrap();
        let m = Tensor::new(&[[1u8; 8], [0, 0, 1, 1, 1, 1, 1, 1]], &dev).unwrap();
        let d = masked_max_diff(&full, &inc, &m);
        println!("{}: cached vs uncached maxdiff {d:.3e}", cfg.model_type);
        assert!(d < 1e-5, "cached vs uncached maxdiff {d:.3e}");

        // A cached forward is inference: each block's output is cut from the graph
        // (`KvCache::cut`), so no block's weights are reached from it; the full forward's are.
        let reached = |out: &Tensor| -> Vec<String> {
            let grads = out.sum_all().unwrap().backward().unwrap();
            store
                .vars()
                .into_iter()
                .filter(|(_, v)| grads.get(v.as_tensor()).is_some())
                .map(|(n, _)| n)
                .collect()
        };
        let cached = reached(steps.last().unwrap());
        assert!(!cached.is_empty() && cached.iter().all(|n| !n.contains("layers.")), "{cached:?}");
        assert!(reached(&full).iter().any(|n| n.contains("layers.0.")));
    }

    #[test]
    fn cached_forward_matches_full_forward_gqa() {
        let scaling = serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 4.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}});
        check_cached_matches_uncached(&tiny("llama", scaling));
        check_cached_matches_uncached(&tiny("qwen2", serde_json::json!({"tie_word_embeddings": true})));
    }

    #[test]
    fn cached_forward_matches_full_forward_with_sliding_window() {
        check_cached_matches_uncached(&tiny("mistral", serde_json::json!({"sliding_window": 3})));
    }

    /// The tensor path, which every family decodes through on a GPU (composed ops on the CPU):
    /// a grouped-query decoding step reads the cached keys and values un-repeated, against the
    /// full forward's repeated ones.
    #[test]
    fn cached_forward_matches_full_forward_on_the_tensor_path() {
        let _composed = ops::composed_scope();
        check_cached_matches_uncached(&tiny("qwen2", serde_json::json!({})));
        check_cached_matches_uncached(&tiny("mistral", serde_json::json!({"sliding_window": 3})));
    }

    /// A window wider than the sequence changes nothing; a narrow one changes the late positions only.
    #[test]
    fn sliding_window_masks_only_distant_keys() {
        let dev = Device::Cpu;
        let run = |window: serde_json::Value| {
            let store = ParamStore::random(5, false, DType::F32, &dev).unwrap();
            let cfg = tiny("mistral", serde_json::json!({ "sliding_window": window }));
            let model = Llama::load(&store.root(), &cfg).unwrap();
            let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &dev).unwrap();
            let pos = position_ids_from_mask(&[vec![1; 6]], &dev).unwrap();
            let bias = causal_bias(&[vec![1; 6]], 6, DType::F32, &dev).unwrap();
            model.forward(&ids, &pos, &bias, None).unwrap()
        };
        let (none, wide, narrow) = (run(serde_json::Value::Null), run(6.into()), run(3.into()));
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_keepdim(2)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert!(diff(&none, &wide).iter().all(|&d| d == 0.0));
        let d = diff(&none, &narrow);
        // Positions 0..=2 see at most 3 keys, so the window hides nothing from them.
        assert!(d[..3].iter().all(|&x| x == 0.0) && d[3..].iter().all(|&x| x > 0.0), "{d:?}");
    }

    /// The tests that set the process-wide autocast switches, one at a time.
    static AUTOCAST_SWITCHES: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A tiny model of `cfg` under the CPU's emulation of the GPU's bf16 autocast, once with
    /// `switch(false)` and once with `switch(true)`: each time its loss (`Σ sin(logits)` over a
    /// left-padded batch of two) and every weight's gradient (checked f32), as f32 values.
    fn autocast_runs(cfg: &LlamaConfig, switch: fn(bool) -> bool) -> [Vec<Vec<f32>>; 2] {
        let dev = Device::Cpu;
        let store = ParamStore::random(3, true, DType::F32, &dev).unwrap();
        let model = Llama::load(&store.root(), cfg).unwrap();
        let mask = vec![vec![1u8; 5], vec![0, 1, 1, 1, 1]];
        let ids = Tensor::new(&[[1u32, 4, 9, 16, 3], [0, 5, 7, 2, 11]], &dev).unwrap();
        let pos = position_ids_from_mask(&mask, &dev).unwrap();
        let bias = causal_bias(&mask, 5, DType::F32, &dev).unwrap();
        let was = switch(false);
        let runs = [false, true].map(|on| {
            switch(on);
            let _autocast = ops::autocast_composed_scope();
            let h = model.forward(&ids, &pos, &bias, None).unwrap();
            let loss = model.logits(&h).unwrap().sin().unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let mut out = vec![vec![loss.to_scalar::<f32>().unwrap()]];
            for (name, var) in store.vars() {
                let g = grads.get(&var).unwrap_or_else(|| panic!("no gradient for {name}"));
                assert_eq!(g.dtype(), DType::F32, "{name}");
                out.push(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
            out
        });
        switch(was);
        runs
    }

    /// Under autocast (the GPU's bf16 path, run here on the CPU), bf16 activations through the
    /// MLP compute the same loss and the same gradients, bit for bit, as casting each product's
    /// result back to f32: each SwiGLU value is rounded to bf16 once either way, and the two
    /// products' input gradients still meet in f32. With biases in the MLP (`mlp_bias`) the f32
    /// path is kept, and so are the values.
    #[test]
    fn bf16_activations_change_no_value_under_autocast() {
        let _one = AUTOCAST_SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
        for (model_type, extra) in [
            ("qwen2", serde_json::json!({"intermediate_size": 24})),
            ("llama", serde_json::json!({"intermediate_size": 24, "mlp_bias": true})),
        ] {
            let [f32_acts, bf16_acts] = autocast_runs(&tiny(model_type, extra), ops::set_bf16_activations);
            for (a, b) in f32_acts.iter().zip(&bf16_acts) {
                assert!(a.iter().any(|&x| x != 0.0));
                let differ = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                assert_eq!(differ, 0, "{model_type}: {differ} of {} values differ", a.len());
            }
        }
        // The switch applies under autocast only.
        let x = Tensor::ones((1, 2, 16), DType::F32, &Device::Cpu).unwrap();
        assert!(!ops::bf16_activations(&x));
        let _autocast = ops::autocast_composed_scope();
        assert!(ops::bf16_activations(&x));
    }

    /// autocast's bf16 attention (`[runtime] attention = "bf16"`; on the CPU the GPU's composed
    /// path): the loss and every gradient within bf16's precision of the f32 attention's, and
    /// not equal to them (the path is taken).
    #[test]
    fn bf16_attention_is_close_to_f32_attention_under_autocast() {
        let _one = AUTOCAST_SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = tiny("qwen2", serde_json::json!({"intermediate_size": 24}));
        let [f32_att, bf16_att] = autocast_runs(&cfg, ops::set_bf16_attention);
        let mut moved = 0;
        for (a, b) in bf16_att.iter().zip(&f32_att) {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
            let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(worst / scale < 5e-2, "relative {}", worst / scale);
            moved += usize::from(worst > 0.0);
        }
        assert!(moved > bf16_att.len() / 2, "{moved} of {} tensors moved", bf16_att.len());
    }

    /// Gradients reach every parameter and match central finite differences (f64).
    #[test]
    fn gradients_match_finite_differences() {
        let dev = Device::Cpu;
        let extra = serde_json::json!({"hidden_size": 8, "intermediate_size": 12, "num_attention_heads": 2,
            "num_key_value_heads": 1, "attention_bias": true, "mlp_bias": true, "initializer_range": 0.5,
            "rope_scaling": {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
            "high_freq_factor": 2.0, "original_max_position_embeddings": 4}});
        let cfg = tiny("llama", extra);
        let store = ParamStore::random(11, true, DType::F64, &dev).unwrap();
        let model = Llama::load(&store.root(), &cfg).unwrap();
        let mask = vec![vec![1u8; 5], vec![0, 1, 1, 1, 1]];
        let ids = Tensor::new(&[[1u32, 4, 9, 16, 3], [0, 5, 7, 2, 11]], &dev).unwrap();
        let pos = position_ids_from_mask(&mask, &dev).unwrap();
        let bias = causal_bias(&mask, 5, DType::F64, &dev).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        // Zero at the padding position: its fully masked attention row sums scores of ~1e9, where
        // f64 keeps only ~1e-7 absolute precision, too coarse for finite differences.
        let v = cfg.vocab_size;
        let proj: Vec<f64> =
            (0..2 * 5 * v).map(|i| if i / v == 5 { 0.0 } else { rng.gen_range(-1.0..1.0) }).collect();
        let proj = Tensor::from_vec(proj, (2, 5, v), &dev).unwrap();
        let loss = || {
            let h = model.forward(&ids, &pos, &bias, None).unwrap();
            (model.logits(&h).unwrap() * &proj).unwrap().sum_all().unwrap()
        };
        let grads = loss().backward().unwrap();
        let vars = store.vars();
        assert!(vars.len() > 20, "{} vars", vars.len());
        for (name, var) in &vars {
            let g = grads.get(var).unwrap_or_else(|| panic!("no gradient for {name}"));
            let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            assert!(
                g.iter().all(|x| x.is_finite()) && g.iter().any(|&x| x != 0.0),
                "bad gradient for {name}"
            );
        }
        let mut worst = 0f64;
        for (name, var) in vars.iter().filter(|(n, _)| {
            n.contains("layers.0.self_attn.q_proj.weight")
                || n.contains("layers.1.self_attn.k_proj")
                || n.contains("layers.0.mlp.up_proj.weight")
                || n.contains("input_layernorm")
                || n.starts_with("model.embed_tokens")
                || n.starts_with("lm_head")
        }) {
            let g = grads.get(var).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let orig = var.as_tensor().detach().copy().unwrap();
            let flat = orig.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            for _ in 0..3 {
                let i = rng.gen_range(0..flat.len());
                let eval = |delta: f64| {
                    let mut f = flat.clone();
                    f[i] += delta;
                    var.set(&Tensor::from_vec(f, orig.shape(), &dev).unwrap()).unwrap();
                    loss().to_scalar::<f64>().unwrap()
                };
                let eps = 1e-5;
                let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
                var.set(&orig).unwrap();
                let rel = (numeric - g[i]).abs() / numeric.abs().max(g[i].abs()).max(1e-6);
                assert!(rel < 1e-4, "{name}[{i}]: analytic {} vs numeric {numeric} (rel {rel:.2e})", g[i]);
                worst = worst.max(rel);
            }
        }
        println!("finite differences: max relative error {worst:.2e}");
    }

    #[test]
    fn validate_names_the_field() {
        let err = |extra: serde_json::Value| tiny("llama", extra).validate().unwrap_err();
        let e = err(serde_json::json!({"num_key_value_heads": 3}));
        assert_eq!(e.field, "num_attention_heads");
        assert!(e.to_string().contains("num_key_value_heads (3)"), "{e}");
        let e = err(serde_json::json!({"num_attention_heads": 3, "num_key_value_heads": 1}));
        assert_eq!(e.field, "hidden_size", "{e}");
        let yarn = serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}});
        assert_eq!(
            err(yarn).to_string(),
            "rope_scaling: unsupported rope_type \"yarn\"; supported: default, linear, dynamic, llama3"
        );
        let no_factor = serde_json::json!({"rope_scaling": {"type": "linear"}});
        assert_eq!(err(no_factor).field, "rope_scaling.factor");
        let store = ParamStore::random(0, false, DType::F32, &Device::Cpu).unwrap();
        let e = Llama::load(&store.root(), &tiny("gemma", serde_json::json!({}))).unwrap_err().to_string();
        assert!(e.contains("<random init>") && e.contains("model_type"), "{e}");
    }

    #[test]
    fn family_defaults_follow_transformers() {
        let parse = |v: serde_json::Value| serde_json::from_value::<LlamaConfig>(v).unwrap();
        let m = parse(serde_json::json!({"model_type": "mistral", "vocab_size": 10, "pad_token_id": -1}));
        assert_eq!((m.kv_heads(), m.window(), m.pad_token_id), (8, Some(4096), None));
        let m = parse(serde_json::json!({"model_type": "mistral", "vocab_size": 10, "sliding_window": null}));
        assert_eq!(m.window(), None);
        let q = parse(serde_json::json!({"model_type": "qwen2", "vocab_size": 10, "sliding_window": 64}));
        assert_eq!((q.window(), q.biases()), (None, (true, false, false)));
        let l = parse(serde_json::json!({"model_type": "llama", "vocab_size": 10, "num_attention_heads": 8}));
        assert_eq!((l.kv_heads(), l.head_size(), l.intermediate(), l.rms_norm_eps), (8, 512, 11008, 1e-6));
    }

    /// The three branches of `_compute_llama3_parameters`.
    #[test]
    fn llama3_inv_freq_branches() {
        // old context 16, low 1, high 4: wavelen < 4 kept, > 16 divided by 8, between smoothed.
        let inv = [2.0, 1.0, 0.1];
        let out = llama3_inv_freq(&inv, 8.0, 1.0, 4.0, 16.0);
        let smooth = (16.0 / (2.0 * std::f64::consts::PI) - 1.0) / 3.0;
        assert_eq!(out[0], 2.0);
        assert!((out[1] - ((1.0 - smooth) / 8.0 + smooth)).abs() < 1e-15);
        assert!((out[2] - 0.1 / 8.0).abs() < 1e-15);
        let linear =
            RopeScaling::parse(Some(&serde_json::json!({"type": "linear", "rope_type": "x", "factor": 2})));
        assert_eq!(linear, Ok(RopeScaling::Linear { factor: 2.0 }));
    }

    /// Dynamic NTK scaling leaves positions within `max_position_embeddings` untouched.
    #[test]
    fn dynamic_rope_rescales_only_past_the_maximum() {
        let dev = Device::Cpu;
        let cfg = tiny(
            "llama",
            serde_json::json!({"max_position_embeddings": 8,
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
        );
        let rope = Rope::new(&cfg, DType::F32, &dev).unwrap();
        let short = Tensor::new(&[[0u32, 3, 7]], &dev).unwrap();
        let long = Tensor::new(&[[0u32, 3, 15]], &dev).unwrap();
        let base = rope.inv_freq.to_vec1::<f32>().unwrap();
        assert_eq!(rope.inv_freq_for(&short).unwrap().to_vec1::<f32>().unwrap(), base);
        let scaled = rope.inv_freq_for(&long).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(scaled[0], base[0]);
        assert!(scaled[1..].iter().zip(&base[1..]).all(|(s, b)| s < b));
    }
}
