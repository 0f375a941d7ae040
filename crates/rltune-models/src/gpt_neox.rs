//! GPT-NeoX (`model_type = "gpt_neox"`): EleutherAI's Pythia suite and GPT-NeoX-20B.
//!
//! Mirrors transformers' `modeling_gpt_neox.py` (`GPTNeoXForCausalLM`): weight names
//! `gpt_neox.embed_in`, `gpt_neox.layers.{i}.{input,post_attention}_layernorm`,
//! `gpt_neox.layers.{i}.attention.{query_key_value,dense}`,
//! `gpt_neox.layers.{i}.mlp.dense_{h_to_4h,4h_to_h}`, `gpt_neox.final_layer_norm` and an untied
//! `embed_out` (the LM head).
//!
//! What sets it apart:
//! - **Fused per-head QKV**: `query_key_value` maps C to `3·C` laid out head by head,
//!   `[q_0 k_0 v_0 q_1 k_1 v_1 …]` with each piece D wide (transformers views it as
//!   `(B, T, H, 3·D)` and chunks the last axis).
//! - **Partial rotary**: RoPE (`rotate_half` form) rotates only the first
//!   `R = int(D · rotary_pct)` dims of each head; the rest pass through. The fraction is read from
//!   `rotary_pct` (transformers 4), `partial_rotary_factor`, or transformers 5's
//!   `rope_parameters.partial_rotary_factor`; the base from `rotary_emb_base`, `rope_theta` or
//!   `rope_parameters.rope_theta`. Only the default RoPE type is implemented; others are rejected.
//! - **Parallel residual** (`use_parallel_residual = true`, Pythia's setting):
//!   `x + attn(ln1(x)) + mlp(ln2(x))`; with `false`, the sequential `h = x + attn(ln1(x))`,
//!   `h + mlp(ln2(h))`.
//!
//! Shape legend: B batch, T new positions, S key positions (cache + new), H heads, D head dim,
//! R rotary dims, C hidden size, V vocabulary.
//!
//! Differences from transformers, all deliberate: no dropout, and the forward returns the final
//! (post-norm) hidden state at every position with an external [`KvCache`] holding keys after RoPE.

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::layers::{
    attention, checkpointed, merge_heads, Activation, Embedding, GradSlot, KvCache, LayerNorm, Linear,
};
use crate::error::{ConfigError, Error, Result};
use crate::params::{Init, Params};

/// `config.json` of a GPT-NeoX model; defaults are transformers' `GPTNeoXConfig` defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GptNeoXConfig {
    /// Vocabulary size V.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Hidden size C.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Number of layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Number of attention heads H.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// MLP inner size.
    #[serde(default = "d_inner")]
    pub intermediate_size: usize,
    /// MLP activation (transformers' `ACT2FN` name).
    #[serde(default = "d_act")]
    pub hidden_act: String,
    /// Fraction of each head's dims that RoPE rotates (transformers 4's name).
    #[serde(default)]
    pub rotary_pct: Option<f64>,
    /// The same fraction under its newer name.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// RoPE base (transformers 4's name).
    #[serde(default)]
    pub rotary_emb_base: Option<f64>,
    /// RoPE base under its newer name.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// transformers 5: `{"rope_type": "default", "rope_theta": …, "partial_rotary_factor": …}`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// transformers 4's RoPE scaling; only `null` or the default type is supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Maximum positions.
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// Layer-norm epsilon.
    #[serde(default = "d_eps")]
    pub layer_norm_eps: f64,
    /// `x + attn(ln1(x)) + mlp(ln2(x))` when true, sequential residuals when false.
    #[serde(default = "d_true")]
    pub use_parallel_residual: bool,
    /// Biases on `query_key_value` and `dense`.
    #[serde(default = "d_true")]
    pub attention_bias: bool,
    /// Whether `embed_out` shares `embed_in`'s weights (false for Pythia).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Init std for random models.
    #[serde(default = "d_init")]
    pub initializer_range: f64,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// Padding token.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

fn d_vocab() -> usize {
    50432
}
fn d_hidden() -> usize {
    6144
}
fn d_layers() -> usize {
    44
}
fn d_heads() -> usize {
    64
}
fn d_inner() -> usize {
    24576
}
fn d_act() -> String {
    "gelu".into()
}
fn d_max_pos() -> usize {
    2048
}
fn d_eps() -> f64 {
    1e-5
}
fn d_true() -> bool {
    true
}
fn d_init() -> f64 {
    0.02
}

impl GptNeoXConfig {
    /// A small Pythia-like config for tests (rotary 25%, parallel residual, untied head).
    pub fn tiny(vocab_size: usize, hidden: usize, layers: usize, heads: usize) -> Self {
        let v = serde_json::json!({
            "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "intermediate_size": 4 * hidden, "rotary_pct": 0.5,
            "max_position_embeddings": 64, "eos_token_id": vocab_size.saturating_sub(1),
        });
        serde_json::from_value(v).unwrap_or_else(|_| unreachable!("every field is valid"))
    }

    /// Head dim D = C / H.
    pub fn head_size(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    fn rope_param(&self, key: &str) -> Option<f64> {
        self.rope_parameters.as_ref().and_then(|p| p.get(key)).and_then(serde_json::Value::as_f64)
    }

    /// The fraction of D that RoPE rotates (default 0.25, transformers' default).
    pub fn rotary_fraction(&self) -> f64 {
        self.rope_param("partial_rotary_factor")
            .or(self.partial_rotary_factor)
            .or(self.rotary_pct)
            .unwrap_or(0.25)
    }

    /// Rotary dims R = `int(D · fraction)`, as transformers.
    pub fn rotary_dims(&self) -> usize {
        (self.head_size() as f64 * self.rotary_fraction()) as usize
    }

    /// RoPE base (default 10000).
    pub fn rope_base(&self) -> f64 {
        self.rope_param("rope_theta").or(self.rope_theta).or(self.rotary_emb_base).unwrap_or(10000.0)
    }

    /// Checks the fields that would otherwise fail deep inside a forward pass.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        let h = self.num_attention_heads;
        if h == 0 || !self.hidden_size.is_multiple_of(h) {
            return Err(ConfigError::new(
                "",
                "hidden_size",
                format!("({}) must be a positive multiple of num_attention_heads ({h})", self.hidden_size),
            ));
        }
        if self.vocab_size == 0 || self.num_hidden_layers == 0 || self.intermediate_size == 0 {
            return Err(ConfigError::table(
                "",
                "vocab_size, num_hidden_layers and intermediate_size must be positive",
            ));
        }
        let f = self.rotary_fraction();
        if !(0.0..=1.0).contains(&f) {
            return Err(ConfigError::table(
                "",
                format!("rotary_pct / partial_rotary_factor ({f}) must be in [0, 1]"),
            ));
        }
        if !self.rotary_dims().is_multiple_of(2) {
            return Err(ConfigError::new(
                "",
                "rotary_pct",
                format!(
                    ": rotary dims int(head_dim {} × {f}) = {} must be even; fix rotary_pct",
                    self.head_size(),
                    self.rotary_dims()
                ),
            ));
        }
        if self.rope_base().is_nan() || self.rope_base() <= 0.0 {
            return Err(ConfigError::table("", "rotary_emb_base / rope_theta must be positive"));
        }
        for (field, v) in [("rope_parameters", &self.rope_parameters), ("rope_scaling", &self.rope_scaling)] {
            let kind = v
                .as_ref()
                .and_then(|v| v.get("rope_type").or_else(|| v.get("type")))
                .and_then(|t| t.as_str());
            if let Some(k) = kind.filter(|k| *k != "default") {
                return Err(ConfigError::new(
                    "",
                    field,
                    format!(": rope_type {k:?} is not supported for gpt_neox; only \"default\""),
                ));
            }
        }
        Activation::parse("hidden_act", &self.hidden_act).map(|_| ())
    }
}

/// Partial RoPE: `inv_freq [R/2]` in f32 (f64 for f64 models).
#[derive(Debug, Clone)]
struct Rope {
    inv_freq: Tensor,
    dims: usize,
}

impl Rope {
    fn new(cfg: &GptNeoXConfig, dtype: DType, device: &Device) -> Result<Self> {
        let (base, dims) = (cfg.rope_base(), cfg.rotary_dims());
        let inv: Vec<f64> = (0..dims).step_by(2).map(|i| 1.0 / base.powf(i as f64 / dims as f64)).collect();
        let n = inv.len();
        let compute = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        Ok(Self { inv_freq: Tensor::from_vec(inv, n, device)?.to_dtype(compute)?, dims })
    }

    /// `position_ids (B, T)` -> `(cos, sin)`, each `(B, 1, T, R/2)` in `dtype`.
    fn cos_sin(&self, position_ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let pos = position_ids.to_dtype(self.inv_freq.dtype())?.unsqueeze(2)?;
        let freqs = pos.broadcast_mul(&self.inv_freq.reshape((1, 1, ()))?)?;
        Ok((freqs.cos()?.to_dtype(dtype)?.unsqueeze(1)?, freqs.sin()?.to_dtype(dtype)?.unsqueeze(1)?))
    }

    /// Rotates the first R dims of `x (B, H, T, D)` (`rotate_half` on them) and keeps the rest.
    fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        if self.dims == 0 {
            return Ok(x.clone());
        }
        let d = x.dim(3)?;
        let half = self.dims / 2;
        let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let lo = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
        let hi = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
        if self.dims == d {
            return Ok(Tensor::cat(&[lo, hi], 3)?);
        }
        Ok(Tensor::cat(&[lo, hi, x.narrow(3, self.dims, d - self.dims)?], 3)?)
    }
}

#[derive(Debug, Clone)]
struct Attention {
    query_key_value: Linear,
    dense: Linear,
    n_heads: usize,
    scale: f64,
}

impl Attention {
    fn load(p: &Params, cfg: &GptNeoXConfig) -> Result<Self> {
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        Ok(Self {
            query_key_value: Linear::load(&p.pp("query_key_value"), c, 3 * c, cfg.attention_bias, std)?,
            dense: Linear::load(&p.pp("dense"), c, c, cfg.attention_bias, std)?,
            n_heads: cfg.num_attention_heads,
            scale: 1.0 / (cfg.head_size() as f64).sqrt(),
        })
    }

    /// `(B, T, C) -> (B, T, C)`
    fn forward(
        &self,
        x: &Tensor,
        rope: (&Rope, &Tensor, &Tensor),
        bias: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len, c) = x.dims3()?;
        let (h, d) = (self.n_heads, c / self.n_heads);
        // (B, T, 3C) -> (B, H, T, 3D): per head [q k v].
        let qkv = self.query_key_value.forward(x)?.reshape((b_sz, seq_len, h, 3 * d))?.transpose(1, 2)?;
        let (rope, cos, sin) = rope;
        let q = rope.apply(&qkv.narrow(3, 0, d)?.contiguous()?, cos, sin)?;
        let k = rope.apply(&qkv.narrow(3, d, d)?.contiguous()?, cos, sin)?;
        let v = qkv.narrow(3, 2 * d, d)?.contiguous()?;
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, &k, &v)?,
            None => (k, v),
        };
        let y = attention(&q, &k, &v, bias, self.scale)?;
        self.dense.forward(&merge_heads(&y)?)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    dense_h_to_4h: Linear,
    dense_4h_to_h: Linear,
    act: Activation,
}

impl Mlp {
    fn load(p: &Params, cfg: &GptNeoXConfig) -> Result<Self> {
        let (c, inner, std) = (cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range);
        Ok(Self {
            dense_h_to_4h: Linear::load(&p.pp("dense_h_to_4h"), c, inner, true, std)?,
            dense_4h_to_h: Linear::load(&p.pp("dense_4h_to_h"), inner, c, true, std)?,
            act: Activation::parse("hidden_act", &cfg.hidden_act)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.dense_4h_to_h.forward(&self.act.forward(&self.dense_h_to_4h.forward(x)?)?)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    input_layernorm: LayerNorm,
    post_attention_layernorm: LayerNorm,
    attention: Attention,
    mlp: Mlp,
    parallel: bool,
}

impl Layer {
    fn load(p: &Params, cfg: &GptNeoXConfig) -> Result<Self> {
        let (c, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        Ok(Self {
            input_layernorm: LayerNorm::load(&p.pp("input_layernorm"), c, eps)?,
            post_attention_layernorm: LayerNorm::load(&p.pp("post_attention_layernorm"), c, eps)?,
            attention: Attention::load(&p.pp("attention"), cfg)?,
            mlp: Mlp::load(&p.pp("mlp"), cfg)?,
            parallel: cfg.use_parallel_residual,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: (&Rope, &Tensor, &Tensor),
        bias: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        let attn = self.attention.forward(&self.input_layernorm.forward(x)?, rope, bias, cache)?;
        if self.parallel {
            // GPTNeoXLayer: x = x + attn(ln1(x)) + mlp(ln2(x))
            let mlp = self.mlp.forward(&self.post_attention_layernorm.forward(x)?)?;
            return Ok(((mlp + attn)? + x)?);
        }
        let h = (attn + x)?;
        Ok((self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)? + &h)?)
    }
}

/// GPT-NeoX with its LM head (`GPTNeoXForCausalLM`).
#[derive(Debug, Clone)]
pub struct GptNeoX {
    embed_in: Embedding,
    layers: Vec<Layer>,
    final_layer_norm: LayerNorm,
    /// `[V, C]`; `embed_in`'s tensor when tied.
    embed_out: Tensor,
    rope: Rope,
    /// Gradient checkpointing of every block in training forwards (no cache).
    checkpointing: bool,
    /// The store's gradient slot, where the backward writes the weights' gradients.
    grads: GradSlot,
    cfg: Box<GptNeoXConfig>,
}

impl GptNeoX {
    /// Builds the model from `p`, the checkpoint root (names `gpt_neox.*`, `embed_out.weight`).
    pub fn load(p: &Params, cfg: &GptNeoXConfig) -> Result<Self> {
        cfg.validate().map_err(|m| Error::config(p.store().source(), m))?;
        let body = p.pp("gpt_neox");
        let (v, c, std) = (cfg.vocab_size, cfg.hidden_size, cfg.initializer_range);
        let embed_in = Embedding::load(&body.pp("embed_in"), v, c, std)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(&body.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let final_layer_norm = LayerNorm::load(&body.pp("final_layer_norm"), c, cfg.layer_norm_eps)?;
        let embed_out = if cfg.tie_word_embeddings {
            p.tie("embed_out.weight", &body.pp("embed_in").full_name("weight"));
            embed_in.weight.clone()
        } else {
            p.get("embed_out.weight", (v, c), Init::Normal(std))?
        };
        let store = p.store();
        let rope = Rope::new(cfg, store.dtype(), store.device())?;
        Ok(Self {
            embed_in,
            layers,
            final_layer_norm,
            embed_out,
            rope,
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
    pub fn config(&self) -> &GptNeoXConfig {
        &self.cfg
    }

    /// Final hidden states (after `final_layer_norm`) at every new position: `(B, T) -> (B, T, C)`.
    ///
    /// `position_ids (B, T)`; `bias (B, 1, T, S)` from [`super::layers::causal_bias`]; with a
    /// cache, the new keys (after RoPE) and values are appended to it.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let x = self.embed_in.forward(input_ids)?; // (B, T, C)
        let x = self.blocks(x, position_ids, bias, 0..self.layers.len(), cache)?;
        self.final_layer_norm.forward(&x)
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
        for i in range {
            x = match cache.as_deref_mut() {
                None if self.checkpointing => {
                    let (layer, rope, cos, sin, bias) =
                        (self.layers[i].clone(), self.rope.clone(), cos.clone(), sin.clone(), bias.clone());
                    checkpointed(&x, &self.grads, move |x| {
                        layer.forward(x, (&rope, &cos, &sin), &bias, None)
                    })?
                }
                c => self.layers[i].forward(&x, (&self.rope, &cos, &sin), bias, c.map(|c| (c, i)))?,
            };
            x = KvCache::cut(cache.as_deref(), x);
        }
        Ok(x)
    }

    /// The hidden states entering layer `end`: the embeddings, then layers `..end` (no cache).
    pub fn trunk(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        end: usize,
    ) -> Result<Tensor> {
        let x = self.embed_in.forward(input_ids)?;
        self.blocks(x, position_ids, bias, 0..end.min(self.layers.len()), None)
    }

    /// Layers `start..` and the final norm on `x`, the hidden states entering layer `start`.
    pub fn top(&self, x: &Tensor, position_ids: &Tensor, bias: &Tensor, start: usize) -> Result<Tensor> {
        let x = self.blocks(x.clone(), position_ids, bias, start..self.layers.len(), None)?;
        self.final_layer_norm.forward(&x)
    }

    /// The LM head's weight `(V, C)`.
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.embed_out
    }

    /// Folds every LoRA adapter into its weight ([`Linear::merge_adapter`]); whether any was.
    pub fn merge_adapters(&mut self) -> Result<bool> {
        let mut any = false;
        for l in &mut self.layers {
            let (a, m) = (&mut l.attention, &mut l.mlp);
            for lin in [&mut a.query_key_value, &mut a.dense, &mut m.dense_h_to_4h, &mut m.dense_4h_to_h] {
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
                [&l.attention.query_key_value, &l.attention.dense, &l.mlp.dense_h_to_4h, &l.mlp.dense_4h_to_h]
                    .map(|lin| lin.weight.clone())
            })
            .collect();
        w.push(self.embed_out.clone());
        w
    }

    /// `(B, T, C) -> (B, T, V)`
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        hidden.dims3()?;
        Ok(rltune_kernels::linear_with(hidden, &self.embed_out, None, &self.grads)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_fraction_and_base_read_every_spelling() {
        let parse = |v: serde_json::Value| serde_json::from_value::<GptNeoXConfig>(v).unwrap();
        let c = parse(serde_json::json!({"hidden_size": 64, "num_attention_heads": 4}));
        assert_eq!((c.rotary_dims(), c.rope_base()), (4, 10000.0));
        let c = parse(serde_json::json!({"hidden_size": 64, "num_attention_heads": 4, "rotary_pct": 0.5,
            "rotary_emb_base": 500.0}));
        assert_eq!((c.rotary_dims(), c.rope_base()), (8, 500.0));
        let c = parse(serde_json::json!({"hidden_size": 64, "num_attention_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 77.0, "partial_rotary_factor": 1.0}}));
        assert_eq!((c.rotary_dims(), c.rope_base()), (16, 77.0));
        let c = parse(serde_json::json!({"hidden_size": 64, "num_attention_heads": 4,
            "rope_scaling": {"type": "linear", "factor": 2.0}}));
        assert_eq!(c.validate().unwrap_err().field, "rope_scaling");
    }
}
