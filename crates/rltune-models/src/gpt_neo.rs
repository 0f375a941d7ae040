//! GPT-Neo (`model_type = "gpt_neo"`), e.g. EleutherAI/gpt-neo-125m … 2.7B.
//!
//! Mirrors transformers' `modeling_gpt_neo.py` (`GPTNeoForCausalLM`): weight names
//! `transformer.h.{i}.attn.attention.{q,k,v,out}_proj`, `transformer.h.{i}.mlp.c_{fc,proj}`
//! (`nn.Linear`, `[out, in]`), learned positions `transformer.wpe`, and a `lm_head` tied to
//! `transformer.wte`.
//!
//! What sets it apart from GPT-2:
//! - **No 1/√D scaling** of the attention scores (`GPTNeoSelfAttention._attn` has none).
//! - **Local attention** on the layers `attention_types` marks `"local"` (alternate layers in the
//!   released models): the query in column `i` of the (cache + new) sequence sees keys
//!   `i − window_size < j ≤ i`, as the `bias` buffer of transformers' local layers
//!   (`tril(ones) ^ tril(ones, −window_size)`). The window is on columns, not on `position_ids`,
//!   also during cached decoding.
//! - q/k/v have no bias; `out_proj` has one.
//!
//! Shape legend: B batch, T new positions, S key positions (cache + new), H heads, D head dim,
//! C hidden size, V vocabulary.
//!
//! Differences from transformers, all deliberate: no dropout, and the forward returns the final
//! (post-`ln_f`) hidden state at every position with an external [`KvCache`].

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::layers::{
    attention, checkpointed, merge_heads, split_heads, Activation, Embedding, GradSlot, KvCache, LayerNorm,
    Linear, MASK_MIN,
};
use crate::error::{ConfigError, Error, Result};
use crate::params::{Init, Params};

/// `config.json` of a GPT-Neo model; defaults are transformers' `GPTNeoConfig` defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GptNeoConfig {
    /// Vocabulary size V.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Maximum sequence length (size of `wpe`).
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// Hidden size C.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Number of blocks.
    #[serde(default = "d_layers")]
    pub num_layers: usize,
    /// Number of attention heads H.
    #[serde(default = "d_heads")]
    pub num_heads: usize,
    /// `[[["global", "local"], 12]]`: each entry's list of kinds repeated that many times.
    #[serde(default = "d_attention_types")]
    pub attention_types: Vec<(Vec<String>, usize)>,
    /// The local layers' window.
    #[serde(default = "d_window")]
    pub window_size: usize,
    /// MLP inner size; `None` means 4·C.
    #[serde(default)]
    pub intermediate_size: Option<usize>,
    /// MLP activation (transformers' `ACT2FN` name).
    #[serde(default = "d_act")]
    pub activation_function: String,
    /// Layer-norm epsilon.
    #[serde(default = "d_eps")]
    pub layer_norm_epsilon: f64,
    /// Init std for random models.
    #[serde(default = "d_init")]
    pub initializer_range: f64,
    /// Beginning-of-sequence token.
    #[serde(default = "d_eos")]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token.
    #[serde(default = "d_eos")]
    pub eos_token_id: Option<u32>,
    /// Padding token (GPT-Neo has none; rltune then pads with EOS).
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Whether `lm_head` shares `wte`'s weights.
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
}

fn d_vocab() -> usize {
    50257
}
fn d_max_pos() -> usize {
    2048
}
fn d_hidden() -> usize {
    2048
}
fn d_layers() -> usize {
    24
}
fn d_heads() -> usize {
    16
}
fn d_attention_types() -> Vec<(Vec<String>, usize)> {
    vec![(vec!["global".into(), "local".into()], 12)]
}
fn d_window() -> usize {
    256
}
fn d_act() -> String {
    "gelu_new".into()
}
fn d_eps() -> f64 {
    1e-5
}
fn d_init() -> f64 {
    0.02
}
fn d_eos() -> Option<u32> {
    Some(50256)
}
fn d_true() -> bool {
    true
}

impl GptNeoConfig {
    /// A small config for tests: global and local layers alternating, window `window`.
    pub fn tiny(vocab_size: usize, hidden: usize, layers: usize, heads: usize, window: usize) -> Self {
        let v = serde_json::json!({
            "vocab_size": vocab_size, "hidden_size": hidden, "num_layers": layers, "num_heads": heads,
            "attention_types": [[["global", "local"], layers.div_ceil(2)]], "window_size": window,
            "max_position_embeddings": 64, "eos_token_id": vocab_size.saturating_sub(1),
            "bos_token_id": vocab_size.saturating_sub(1),
        });
        serde_json::from_value(v).unwrap_or_else(|_| unreachable!("every field is valid"))
    }

    /// The kind of every layer, `true` for local: `attention_types` expanded as transformers'
    /// `GPTNeoConfig.expand_attention_types_params`.
    pub fn local_layers(&self) -> Vec<bool> {
        self.attention_types
            .iter()
            .flat_map(|(kinds, n)| (0..*n).flat_map(move |_| kinds.iter().map(|k| k == "local")))
            .collect()
    }

    /// Checks the fields that would otherwise fail deep inside a forward pass.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.num_heads == 0 || !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(ConfigError::new(
                "",
                "hidden_size",
                format!(
                    "({}) must be a positive multiple of num_heads ({})",
                    self.hidden_size, self.num_heads
                ),
            ));
        }
        if self.vocab_size == 0 || self.num_layers == 0 || self.max_position_embeddings == 0 {
            return Err(ConfigError::table(
                "",
                "vocab_size, num_layers and max_position_embeddings must be positive",
            ));
        }
        if let Some(bad) =
            self.attention_types.iter().flat_map(|(k, _)| k).find(|k| *k != "global" && *k != "local")
        {
            return Err(ConfigError::new(
                "",
                "attention_types",
                format!(": unknown kind {bad:?}; use \"global\" or \"local\""),
            ));
        }
        let n = self.local_layers().len();
        if n != self.num_layers {
            return Err(ConfigError::new(
                "",
                "attention_types",
                format!("expands to {n} layers but num_layers is {}; make them agree", self.num_layers),
            ));
        }
        if self.window_size == 0 {
            return Err(ConfigError::new("", "window_size", "must be positive"));
        }
        Activation::parse("activation_function", &self.activation_function).map(|_| ())
    }
}

/// `(1, 1, T, S)` additive bias hiding keys `j ≤ i − window` from the query in column `i` of the
/// (cache + new) sequence, the last `T` of `S`; `None` when it hides nothing.
pub(crate) fn local_window_bias(
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

#[derive(Debug, Clone)]
struct SelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    n_heads: usize,
    local: bool,
}

impl SelfAttention {
    fn load(p: &Params, cfg: &GptNeoConfig, local: bool) -> Result<Self> {
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        Ok(Self {
            q_proj: Linear::load(&p.pp("q_proj"), c, c, false, std)?,
            k_proj: Linear::load(&p.pp("k_proj"), c, c, false, std)?,
            v_proj: Linear::load(&p.pp("v_proj"), c, c, false, std)?,
            out_proj: Linear::load(&p.pp("out_proj"), c, c, true, std)?,
            n_heads: cfg.num_heads,
            local,
        })
    }

    /// `(B, T, C) -> (B, T, C)`; `bias (B, 1, T, S)` already holds the local window when
    /// this is a local layer.
    fn forward(&self, x: &Tensor, bias: &Tensor, cache: Option<(&mut KvCache, usize)>) -> Result<Tensor> {
        let q = split_heads(&self.q_proj.forward(x)?, self.n_heads)?; // (B, H, T, D)
        let k = split_heads(&self.k_proj.forward(x)?, self.n_heads)?;
        let v = split_heads(&self.v_proj.forward(x)?, self.n_heads)?;
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, &k, &v)?,
            None => (k, v),
        };
        // GPT-Neo does not scale the scores by 1/√D.
        let y = attention(&q, &k, &v, bias, 1.0)?;
        self.out_proj.forward(&merge_heads(&y)?)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    c_fc: Linear,
    c_proj: Linear,
    act: Activation,
}

impl Mlp {
    fn load(p: &Params, cfg: &GptNeoConfig) -> Result<Self> {
        let c = cfg.hidden_size;
        let inner = cfg.intermediate_size.unwrap_or(4 * c);
        let std = cfg.initializer_range;
        Ok(Self {
            c_fc: Linear::load(&p.pp("c_fc"), c, inner, true, std)?,
            c_proj: Linear::load(&p.pp("c_proj"), inner, c, true, std)?,
            act: Activation::parse("activation_function", &cfg.activation_function)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.c_proj.forward(&self.act.forward(&self.c_fc.forward(x)?)?)
    }
}

#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: SelfAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn load(p: &Params, cfg: &GptNeoConfig, local: bool) -> Result<Self> {
        let (c, eps) = (cfg.hidden_size, cfg.layer_norm_epsilon);
        Ok(Self {
            ln_1: LayerNorm::load(&p.pp("ln_1"), c, eps)?,
            attn: SelfAttention::load(&p.pp("attn").pp("attention"), cfg, local)?,
            ln_2: LayerNorm::load(&p.pp("ln_2"), c, eps)?,
            mlp: Mlp::load(&p.pp("mlp"), cfg)?,
        })
    }

    fn forward(&self, x: &Tensor, bias: &Tensor, cache: Option<(&mut KvCache, usize)>) -> Result<Tensor> {
        let h = (x + self.attn.forward(&self.ln_1.forward(x)?, bias, cache)?)?;
        Ok((&h + self.mlp.forward(&self.ln_2.forward(&h)?)?)?)
    }
}

/// GPT-Neo with its language-model head (`GPTNeoForCausalLM`).
#[derive(Debug, Clone)]
pub struct GptNeo {
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Block>,
    ln_f: LayerNorm,
    /// `[V, C]`; the same tensor as `wte` when tied.
    lm_head: Tensor,
    /// Gradient checkpointing of every block in training forwards (no cache).
    checkpointing: bool,
    /// The store's gradient slot, where the backward writes the weights' gradients.
    grads: GradSlot,
    cfg: Box<GptNeoConfig>,
}

impl GptNeo {
    /// Builds the model from `p`, the checkpoint root (names `transformer.*`, `lm_head.weight`).
    pub fn load(p: &Params, cfg: &GptNeoConfig) -> Result<Self> {
        cfg.validate().map_err(|m| Error::config(p.store().source(), m))?;
        let body = p.pp("transformer");
        let (c, std) = (cfg.hidden_size, cfg.initializer_range);
        let wte = Embedding::load(&body.pp("wte"), cfg.vocab_size, c, std)?;
        let wpe = Embedding::load(&body.pp("wpe"), cfg.max_position_embeddings, c, std)?;
        let h = cfg
            .local_layers()
            .into_iter()
            .enumerate()
            .map(|(i, local)| Block::load(&body.pp("h").pp(i), cfg, local))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::load(&body.pp("ln_f"), c, cfg.layer_norm_epsilon)?;
        let lm_head = if cfg.tie_word_embeddings {
            p.tie("lm_head.weight", &body.pp("wte").full_name("weight"));
            wte.weight.clone()
        } else {
            p.get("lm_head.weight", (cfg.vocab_size, c), Init::Normal(std))?
        };
        Ok(Self {
            wte,
            wpe,
            h,
            ln_f,
            lm_head,
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
    pub fn config(&self) -> &GptNeoConfig {
        &self.cfg
    }

    /// Final hidden states (after `ln_f`) at every new position: `(B, T)` ids -> `(B, T, C)`.
    ///
    /// `position_ids (B, T)`; `bias (B, 1, T, S)` from [`super::layers::causal_bias`]; with a
    /// cache, the new keys and values are appended to it.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let (_, _, q_len, _) = bias.dims4()?;
        if q_len != seq_len {
            return Err(Error::Input(format!(
                "gpt_neo forward: input_ids {:?} and bias {:?} disagree; expected bias (B, 1, T, S)",
                input_ids.dims(),
                bias.dims()
            )));
        }
        let x = (self.wte.forward(input_ids)? + self.wpe.forward(position_ids)?)?;
        let x = self.blocks(x, bias, 0..self.h.len(), cache)?;
        self.ln_f.forward(&x)
    }

    /// Blocks `range` on `x` (with a cache, each appends to its own slot).
    fn blocks(
        &self,
        mut x: Tensor,
        bias: &Tensor,
        range: std::ops::Range<usize>,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let local_bias = self.local_bias(bias)?;
        for i in range {
            let block = &self.h[i];
            let b = if block.attn.local { &local_bias } else { bias };
            x = match cache.as_deref_mut() {
                None if self.checkpointing => {
                    let (block, b) = (block.clone(), b.clone());
                    checkpointed(&x, &self.grads, move |x| block.forward(x, &b, None))?
                }
                c => block.forward(&x, b, c.map(|c| (c, i)))?,
            };
            x = KvCache::cut(cache.as_deref(), x);
        }
        Ok(x)
    }

    /// `bias` with the local layers' window added.
    fn local_bias(&self, bias: &Tensor) -> Result<Tensor> {
        let (_, _, q_len, s) = bias.dims4()?;
        Ok(match local_window_bias(q_len, s, self.cfg.window_size, bias.dtype(), bias.device())? {
            Some(w) => bias.broadcast_add(&w)?,
            None => bias.clone(),
        })
    }

    /// The hidden states entering block `end`: the embeddings, then blocks `..end` (no cache).
    pub fn trunk(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        end: usize,
    ) -> Result<Tensor> {
        let x = (self.wte.forward(input_ids)? + self.wpe.forward(position_ids)?)?;
        self.blocks(x, bias, 0..end.min(self.h.len()), None)
    }

    /// Blocks `start..` and `ln_f` on `x`, the hidden states entering block `start` (no cache).
    pub fn top(&self, x: &Tensor, bias: &Tensor, start: usize) -> Result<Tensor> {
        let x = self.blocks(x.clone(), bias, start..self.h.len(), None)?;
        self.ln_f.forward(&x)
    }

    /// The LM head's weight `(V, C)` (`wte`'s when tied).
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// Folds every LoRA adapter into its weight ([`Linear::merge_adapter`]); whether any was.
    pub fn merge_adapters(&mut self) -> Result<bool> {
        let mut any = false;
        for b in &mut self.h {
            let (a, m) = (&mut b.attn, &mut b.mlp);
            for lin in
                [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.out_proj, &mut m.c_fc, &mut m.c_proj]
            {
                any |= lin.merge_adapter()?;
            }
        }
        Ok(any)
    }

    /// The weight matrices of the linear layers and the LM head.
    pub fn weight_matrices(&self) -> Vec<Tensor> {
        let mut w: Vec<Tensor> = self
            .h
            .iter()
            .flat_map(|b| {
                let (a, m) = (&b.attn, &b.mlp);
                [&a.q_proj, &a.k_proj, &a.v_proj, &a.out_proj, &m.c_fc, &m.c_proj].map(|l| l.weight.clone())
            })
            .collect();
        w.push(self.lm_head.clone());
        w
    }

    /// `(B, T, C) -> (B, T, V)`
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        hidden.dims3()?;
        Ok(rltune_kernels::linear_with(hidden, &self.lm_head, None, &self.grads)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_types_expand_like_transformers() {
        let mut c = GptNeoConfig::tiny(10, 8, 4, 2, 3);
        assert_eq!(c.local_layers(), vec![false, true, false, true]);
        c.attention_types = vec![(vec!["local".into()], 1), (vec!["global".into()], 2)];
        c.num_layers = 3;
        assert_eq!(c.local_layers(), vec![true, false, false]);
        c.num_layers = 4;
        assert_eq!(c.validate().unwrap_err().field, "attention_types");
        c.attention_types = vec![(vec!["sparse".into()], 4)];
        assert!(c.validate().unwrap_err().to_string().contains("sparse"));
    }

    #[test]
    fn local_window_hides_keys_at_or_past_the_window() {
        let b = local_window_bias(2, 5, 3, DType::F32, &Device::Cpu).unwrap().unwrap();
        let v = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let m = MASK_MIN as f32;
        // Queries in columns 3 and 4 see columns > 0 and > 1.
        assert_eq!(v, vec![m, 0.0, 0.0, 0.0, 0.0, m, m, 0.0, 0.0, 0.0]);
        assert!(local_window_bias(2, 3, 3, DType::F32, &Device::Cpu).unwrap().is_none());
    }
}
