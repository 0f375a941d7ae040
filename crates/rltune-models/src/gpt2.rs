//! GPT-2 (`model_type = "gpt2"`), which also covers distilgpt2.
//!
//! Mirrors transformers' `modeling_gpt2.py`: weight names as in `GPT2LMHeadModel`
//! (`transformer.h.{i}.attn.c_attn.weight`, Conv1D `[in, out]` layout), a `lm_head` tied to
//! `transformer.wte`, `gelu_new`. Checkpoints saved without the `transformer.` prefix (the original
//! `gpt2` on the hub) load too.
//!
//! Differences from transformers, all deliberate: dropout is never applied (rltune never trains
//! with dropout, see the crate docs), and the forward returns hidden states at every position
//! with an external [`KvCache`].

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::layers::{
    attention, checkpointed, merge_heads, split_heads, Activation, Conv1D, Embedding, GradSlot, KvCache,
    LayerNorm,
};
use crate::error::{ConfigError, Error, Result};
use crate::params::Params;
use rltune_kernels as ops;

/// `config.json` of a GPT-2 model; defaults are transformers' `GPT2Config` defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// Vocabulary size V.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Maximum sequence length.
    #[serde(default = "d_n_positions")]
    pub n_positions: usize,
    /// Hidden size C.
    #[serde(default = "d_n_embd")]
    pub n_embd: usize,
    /// Number of blocks.
    #[serde(default = "d_n_layer")]
    pub n_layer: usize,
    /// Number of attention heads.
    #[serde(default = "d_n_head")]
    pub n_head: usize,
    /// MLP inner size; `None` means 4·C.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// MLP activation.
    #[serde(default = "d_act")]
    pub activation_function: String,
    /// Layer-norm epsilon.
    #[serde(default = "d_eps")]
    pub layer_norm_epsilon: f64,
    /// Scale attention scores by 1/sqrt(D).
    #[serde(default = "d_true")]
    pub scale_attn_weights: bool,
    /// Also scale attention scores by 1/(layer index + 1).
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Beginning-of-sequence token.
    #[serde(default = "d_eos")]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token.
    #[serde(default = "d_eos")]
    pub eos_token_id: Option<u32>,
    /// Padding token (GPT-2 has none; rltune then pads with EOS).
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Whether `lm_head` shares `wte`'s weights.
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
    /// Init std for random models.
    #[serde(default = "d_init")]
    pub initializer_range: f64,
}

fn d_vocab() -> usize {
    50257
}
fn d_n_positions() -> usize {
    1024
}
fn d_n_embd() -> usize {
    768
}
fn d_n_layer() -> usize {
    12
}
fn d_n_head() -> usize {
    12
}
fn d_act() -> String {
    "gelu_new".into()
}
fn d_eps() -> f64 {
    1e-5
}
fn d_true() -> bool {
    true
}
fn d_eos() -> Option<u32> {
    Some(50256)
}
fn d_init() -> f64 {
    0.02
}

impl Gpt2Config {
    /// A small config for tests and benchmarks.
    pub fn tiny(vocab_size: usize, n_embd: usize, n_layer: usize, n_head: usize, n_positions: usize) -> Self {
        let mut c: Self =
            serde_json::from_str("{}").unwrap_or_else(|_| unreachable!("all fields have defaults"));
        c.vocab_size = vocab_size;
        c.n_embd = n_embd;
        c.n_layer = n_layer;
        c.n_head = n_head;
        c.n_positions = n_positions;
        c.eos_token_id = Some(vocab_size as u32 - 1);
        c.bos_token_id = c.eos_token_id;
        c
    }

    /// Checks the fields that would otherwise fail deep inside a forward pass.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(ConfigError::new(
                "",
                "n_embd",
                format!("({}) must be a positive multiple of n_head ({})", self.n_embd, self.n_head),
            ));
        }
        if self.vocab_size == 0 || self.n_layer == 0 || self.n_positions == 0 {
            return Err(ConfigError::table("", "vocab_size, n_layer and n_positions must be positive"));
        }
        Activation::parse("activation_function", &self.activation_function).map(|_| ())
    }
}

#[derive(Debug, Clone)]
struct Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    n_head: usize,
    scale: f64,
}

impl Attention {
    fn load(p: &Params, cfg: &Gpt2Config, layer_idx: usize) -> Result<Self> {
        let c = cfg.n_embd;
        let std = cfg.initializer_range;
        let proj_std = std / (2.0 * cfg.n_layer as f64).sqrt();
        let mut scale = 1.0;
        if cfg.scale_attn_weights {
            scale /= ((c / cfg.n_head) as f64).sqrt();
        }
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer_idx + 1) as f64;
        }
        Ok(Self {
            c_attn: Conv1D::load(&p.pp("c_attn"), c, 3 * c, std)?,
            c_proj: Conv1D::load(&p.pp("c_proj"), c, c, proj_std)?,
            n_head: cfg.n_head,
            scale,
        })
    }

    /// `(B, T, C) -> (B, T, C)`
    fn forward(&self, x: &Tensor, bias: &Tensor, cache: Option<(&mut KvCache, usize)>) -> Result<Tensor> {
        let qkv = self.c_attn.forward(x)?;
        let Some((cache, layer)) = cache else {
            // Training and scoring: one fused op (no per-head copies in the graph).
            return self.c_proj.forward(&ops::self_attention(&qkv, bias, self.n_head, self.scale)?);
        };
        if ops::cached_attention_takes(&qkv, bias) {
            // Generation: keys and values appended in place, no concatenation or head copies.
            let y = ops::cached_self_attention(&qkv, bias, cache.block_mut(layer)?, self.n_head, self.scale)?;
            return self.c_proj.forward(&y);
        }
        let c = x.dim(2)?;
        let q = split_heads(&qkv.narrow(2, 0, c)?, self.n_head)?;
        let k = split_heads(&qkv.narrow(2, c, c)?, self.n_head)?;
        let v = split_heads(&qkv.narrow(2, 2 * c, c)?, self.n_head)?;
        let (k, v) = cache.append(layer, &k, &v)?;
        let y = attention(&q, &k, &v, bias, self.scale)?;
        self.c_proj.forward(&merge_heads(&y)?)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
    act: Activation,
}

impl Mlp {
    fn load(p: &Params, cfg: &Gpt2Config) -> Result<Self> {
        let c = cfg.n_embd;
        let inner = cfg.n_inner.unwrap_or(4 * c);
        let std = cfg.initializer_range;
        let proj_std = std / (2.0 * cfg.n_layer as f64).sqrt();
        let act = Activation::parse("activation_function", &cfg.activation_function)?;
        Ok(Self {
            c_fc: Conv1D::load(&p.pp("c_fc"), c, inner, std)?,
            c_proj: Conv1D::load(&p.pp("c_proj"), inner, c, proj_std)?,
            act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.c_proj.forward(&self.act.forward(&self.c_fc.forward(x)?)?)
    }
}

#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn params(&self) -> ops::block::Gpt2BlockParams {
        let pair = |c: &Conv1D| (c.weight.clone(), c.bias.clone());
        ops::block::Gpt2BlockParams {
            ln_1: (self.ln_1.weight.clone(), self.ln_1.bias.clone()),
            c_attn: pair(&self.attn.c_attn),
            c_proj: pair(&self.attn.c_proj),
            ln_2: (self.ln_2.weight.clone(), self.ln_2.bias.clone()),
            c_fc: pair(&self.mlp.c_fc),
            mlp_proj: pair(&self.mlp.c_proj),
            eps: self.ln_1.eps,
            n_head: self.attn.n_head,
            scale: self.attn.scale,
        }
    }

    fn load(p: &Params, cfg: &Gpt2Config, layer_idx: usize) -> Result<Self> {
        let (c, eps) = (cfg.n_embd, cfg.layer_norm_epsilon);
        Ok(Self {
            ln_1: LayerNorm::load(&p.pp("ln_1"), c, eps)?,
            attn: Attention::load(&p.pp("attn"), cfg, layer_idx)?,
            ln_2: LayerNorm::load(&p.pp("ln_2"), c, eps)?,
            mlp: Mlp::load(&p.pp("mlp"), cfg)?,
        })
    }

    /// `rows`: only these rows of `(B·T)` are read from the output (see [`Gpt2::forward_rows`]).
    fn forward(
        &self,
        x: &Tensor,
        bias: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
        rows: Option<&ops::block::Rows>,
    ) -> Result<Tensor> {
        let adapted = [&self.attn.c_attn, &self.attn.c_proj, &self.mlp.c_fc, &self.mlp.c_proj]
            .iter()
            .any(|c| c.lora.is_some());
        if cache.is_none() && self.mlp.act == Activation::GeluTanh && !adapted {
            // One graph node with a hand-written backward, where its weights' gradients can go to
            // gradient sinks (`ops::block`); else the composed block below.
            // Its layers' slot is the store's: the block writes every weight's gradient there.
            if let Some(z) = ops::block::gpt2_block(x, bias, &self.params(), rows, &self.ln_1.grads)? {
                return Ok(z);
            }
        }
        let h = (x + self.attn.forward(&self.ln_1.forward(x)?, bias, cache)?)?;
        Ok((&h + self.mlp.forward(&self.ln_2.forward(&h)?)?)?)
    }
}

/// `rows` (indices into `n` flattened positions) as the last block's row selection, or `None`
/// (every row) for an empty, unsorted, out-of-range or all-covering list.
fn usable_rows(rows: &[usize], n: usize, device: &candle_core::Device) -> Result<Option<ops::block::Rows>> {
    let unusable = rows.is_empty() || rows.len() >= n || rows.windows(2).any(|w| w[0] >= w[1]);
    if unusable || rows.last().is_some_and(|&r| r >= n) {
        return Ok(None);
    }
    Ok(Some(ops::block::Rows::new(rows.to_vec(), device)?))
}

/// GPT-2 with its language-model head.
#[derive(Debug, Clone)]
pub struct Gpt2 {
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
    cfg: Gpt2Config,
}

impl Gpt2 {
    /// Builds the model from `p`, which is the checkpoint root (names `transformer.*`, `lm_head.*`).
    pub fn load(p: &Params, cfg: &Gpt2Config) -> Result<Self> {
        cfg.validate().map_err(|m| Error::config(p.store().source(), m))?;
        // HF's GPT2LMHeadModel prefixes the body with `transformer.`; the original checkpoint does not.
        let body = if p.contains("wte.weight") { p.clone() } else { p.pp("transformer") };
        let (c, std) = (cfg.n_embd, cfg.initializer_range);
        let wte = Embedding::load(&body.pp("wte"), cfg.vocab_size, c, std)?;
        let wpe = Embedding::load(&body.pp("wpe"), cfg.n_positions, c, std)?;
        let h =
            (0..cfg.n_layer).map(|i| Block::load(&body.pp("h").pp(i), cfg, i)).collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::load(&body.pp("ln_f"), c, cfg.layer_norm_epsilon)?;
        let lm_head = if cfg.tie_word_embeddings {
            // A checkpoint may also hold the tied copy (TRL's value-head models do).
            p.tie("lm_head.weight", &body.pp("wte").full_name("weight"));
            wte.weight.clone()
        } else {
            p.get("lm_head.weight", (cfg.vocab_size, c), crate::params::Init::Normal(std))?
        };
        Ok(Self {
            wte,
            wpe,
            h,
            ln_f,
            lm_head,
            checkpointing: false,
            grads: p.grad_slot().clone(),
            cfg: cfg.clone(),
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
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// Final hidden states (after `ln_f`) at every new position: `(B, T) ids -> (B, T, C)`.
    ///
    /// `position_ids (B, T)`; `bias (B, 1, T, S)` from [`super::layers::causal_bias`]; with a
    /// cache, the new keys and values are appended to it. The cached path is for generation:
    /// on the CPU in f32 its attention ([`ops::cached_self_attention`]) builds no backward graph.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.run(input_ids, position_ids, bias, cache, None)
    }

    /// [`Self::forward`] (no cache) where only the hidden states of `rows` (indices into the
    /// flattened `(B·T)` positions, ascending) will be read: the last block computes its
    /// attention output's projection and its MLP for those rows only; the other rows of the
    /// result are unspecified. Where the fused block does not apply (and for an empty, unsorted
    /// or out-of-range list), every row is computed.
    pub fn forward_rows(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        rows: &[usize],
    ) -> Result<Tensor> {
        let rows = usable_rows(rows, input_ids.elem_count(), input_ids.device())?;
        self.run(input_ids, position_ids, bias, None, rows.as_ref())
    }

    fn run(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        cache: Option<&mut KvCache>,
        rows: Option<&ops::block::Rows>,
    ) -> Result<Tensor> {
        let x = self.embed(input_ids, position_ids)?;
        let x = self.blocks(x, bias, 0..self.h.len(), cache, rows)?;
        self.ln_f.forward(&x)
    }

    fn embed(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        Ok((self.wte.forward(input_ids)? + self.wpe.forward(position_ids)?)?)
    }

    /// Blocks `range` on `x`; `rows` apply to the model's last block (see [`Self::forward_rows`]).
    fn blocks(
        &self,
        mut x: Tensor,
        bias: &Tensor,
        range: std::ops::Range<usize>,
        mut cache: Option<&mut KvCache>,
        rows: Option<&ops::block::Rows>,
    ) -> Result<Tensor> {
        let last = self.h.len().saturating_sub(1);
        for i in range {
            let rows = rows.filter(|_| i == last);
            x = match cache.as_deref_mut() {
                None if self.checkpointing => {
                    let (block, bias, rows) = (self.h[i].clone(), bias.clone(), rows.cloned());
                    checkpointed(&x, &self.grads, move |x| block.forward(x, &bias, None, rows.as_ref()))?
                }
                c => self.h[i].forward(&x, bias, c.map(|c| (c, i)), rows)?,
            };
            x = KvCache::cut(cache.as_deref(), x);
        }
        Ok(x)
    }

    /// The hidden states entering block `end`: the embeddings, then blocks `..end` (no cache).
    pub fn trunk(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        bias: &Tensor,
        end: usize,
    ) -> Result<Tensor> {
        let x = self.embed(input_ids, position_ids)?;
        self.blocks(x, bias, 0..end.min(self.h.len()), None, None)
    }

    /// Blocks `start..` and `ln_f` on `x`, the hidden states entering block `start` (no cache);
    /// `rows` as [`Self::forward_rows`] (empty: every row).
    pub fn top(&self, x: &Tensor, bias: &Tensor, start: usize, rows: &[usize]) -> Result<Tensor> {
        let rows = usable_rows(rows, x.dim(0)? * x.dim(1)?, x.device())?;
        let x = self.blocks(x.clone(), bias, start..self.h.len(), None, rows.as_ref())?;
        self.ln_f.forward(&x)
    }

    /// The LM head's weight `(V, C)` (`wte`'s when tied).
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// Folds every LoRA adapter into its weight ([`Conv1D::merge_adapter`]); whether any was.
    pub fn merge_adapters(&mut self) -> Result<bool> {
        let mut any = false;
        for b in &mut self.h {
            for c in [&mut b.attn.c_attn, &mut b.attn.c_proj, &mut b.mlp.c_fc, &mut b.mlp.c_proj] {
                any |= c.merge_adapter()?;
            }
        }
        Ok(any)
    }

    /// The weight matrices of the blocks' Conv1D layers and the LM head.
    pub fn weight_matrices(&self) -> Vec<Tensor> {
        let mut w: Vec<Tensor> = self
            .h
            .iter()
            .flat_map(|b| {
                [&b.attn.c_attn, &b.attn.c_proj, &b.mlp.c_fc, &b.mlp.c_proj].map(|c| c.weight.clone())
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
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::layers::{causal_bias, position_ids_from_mask};
    use crate::params::ParamStore;
    use rltune_kernels::optim::Grads;

    /// Ids, positions and bias for two rows, the second right-padded by two.
    fn inputs(dev: &Device) -> (Tensor, Tensor, Tensor) {
        let mask = vec![vec![1u8; 7], vec![1, 1, 1, 1, 1, 0, 0]];
        let ids = Tensor::new(&[[3u32, 9, 1, 40, 22, 7, 5], [11, 2, 2, 30, 8, 0, 0]], dev).unwrap();
        let pos = position_ids_from_mask(&mask, dev).unwrap();
        (ids, pos, causal_bias(&mask, 7, DType::F32, dev).unwrap())
    }

    fn model(trainable: bool) -> (ParamStore, Gpt2) {
        let store = ParamStore::random(17, trainable, DType::F32, &Device::Cpu).unwrap();
        let model = Gpt2::load(&store.root(), &Gpt2Config::tiny(50, 32, 2, 4, 16)).unwrap();
        (store, model)
    }

    fn loss(h: &Tensor) -> Tensor {
        let proj =
            Tensor::arange(0f32, h.elem_count() as f32, h.device()).unwrap().reshape(h.shape()).unwrap();
        (h * (proj * 0.37).unwrap().sin().unwrap()).unwrap().sum_all().unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn fused_blocks_match_the_composed_blocks_values_and_gradients() {
        if !ops::gemm::fast_available() {
            return;
        }
        let (store, model) = model(true);
        let (ids, pos, bias) = inputs(&Device::Cpu);
        let vars: Vec<Var> = store.vars().into_iter().map(|(_, v)| v).collect();
        let mut grads = Grads::new(&vars);
        let block = &model.h[0];
        let x = (model.wte.forward(&ids).unwrap() + model.wpe.forward(&pos).unwrap()).unwrap();
        // Without sinks for its weights the block cannot be fused (the model composes it); with
        // the store's slot bound to the gradients it is.
        let slot = store.grad_slot();
        assert!(ops::block::gpt2_block(&x, &bias, &block.params(), None, slot).unwrap().is_none());
        let composed = model.forward(&ids, &pos, &bias, None).unwrap();
        let want = loss(&composed).backward().unwrap();
        grads.bind(slot);
        assert!(ops::block::gpt2_block(&x, &bias, &block.params(), None, slot).unwrap().is_some());

        let fused = model.forward(&ids, &pos, &bias, None).unwrap();
        grads.backward(&loss(&fused)).unwrap();
        let close =
            |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 * (1.0 + y.abs()));
        assert!(close(&values(&fused), &values(&composed)), "hidden states differ");
        for (i, (name, var)) in store.vars().iter().enumerate() {
            let (got, want) = (grads.get(i).unwrap(), want.get(var));
            let (got, want) = (got.unwrap_or_else(|| panic!("{name}: no gradient")), want.unwrap());
            assert!(close(&values(&got), &values(want)), "{name}: gradients differ");
            assert!(values(&got).iter().any(|&g| g != 0.0), "{name}: zero gradient");
        }
    }

    #[test]
    fn selected_rows_match_the_full_forward_values_and_gradients() {
        let (store, lm) = model(true);
        let (ids, pos, bias) = inputs(&Device::Cpu);
        let rows = [3usize, 4, 5, 6, 8, 10, 11];
        let idx = Tensor::new(&[3u32, 4, 5, 6, 8, 10, 11], &Device::Cpu).unwrap();
        let pick = |h: &Tensor| h.reshape((14, 32)).unwrap().index_select(&idx, 0).unwrap();
        let vars: Vec<Var> = store.vars().into_iter().map(|(_, v)| v).collect();
        let run = |selected: bool| {
            let mut grads = Grads::new(&vars);
            grads.bind(store.grad_slot());
            let h = match selected {
                true => lm.forward_rows(&ids, &pos, &bias, &rows).unwrap(),
                false => lm.forward(&ids, &pos, &bias, None).unwrap(),
            };
            let h = pick(&h);
            grads.backward(&loss(&h)).unwrap();
            let g: Vec<Vec<f32>> = (0..vars.len()).map(|i| values(&grads.get(i).unwrap().unwrap())).collect();
            (values(&h), g)
        };
        let ((h_all, g_all), (h_sel, g_sel)) = (run(false), run(true));
        let close =
            |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()));
        assert!(close(&h_sel, &h_all), "selected hidden states differ");
        for ((name, _), (a, b)) in store.vars().iter().zip(g_sel.iter().zip(&g_all)) {
            assert!(close(a, b), "{name}: gradients differ");
        }
        // Frozen weights: the same rows without a graph.
        let (_, frozen) = model(false);
        let h = pick(&frozen.forward_rows(&ids, &pos, &bias, &rows).unwrap());
        assert!(close(&values(&h), &h_all));
    }

    #[test]
    fn frozen_blocks_run_fused_and_a_plain_backward_fills_the_bound_gradients() {
        let (_, frozen) = model(false);
        let (store, trainable) = model(true);
        let (ids, pos, bias) = inputs(&Device::Cpu);
        let a = values(&frozen.forward(&ids, &pos, &bias, None).unwrap());
        let b = values(&trainable.forward(&ids, &pos, &bias, None).unwrap());
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-6 * (1.0 + y.abs())));
        if !ops::gemm::fast_available() {
            return;
        }
        let vars: Vec<Var> = store.vars().into_iter().map(|(_, v)| v).collect();
        let grads = Grads::new(&vars);
        grads.bind(store.grad_slot());
        let h = trainable.forward(&ids, &pos, &bias, None).unwrap();
        // torch's `loss.backward()` into `param.grad`: the fused blocks' weights get theirs in
        // the bound buffers, the rest comes back in candle's store.
        let store_grads = loss(&h).backward().unwrap();
        let c_attn = store.vars().iter().position(|(n, _)| n.ends_with("h.0.attn.c_attn.weight")).unwrap();
        assert!(grads.has(c_attn), "the fused block's weight gradient is in the buffers");
        assert!(store_grads.get(&vars[c_attn]).is_none());
    }
}
