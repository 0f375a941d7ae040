//! Layers shared by the models: linear maps, embeddings, attention, the KV cache and masks.
//!
//! Shape legend: B batch, T new positions, S key positions (cache + new), H heads, D head dim,
//! C hidden size, V vocabulary.

use candle_core::{Device, Tensor, D};

use crate::error::{ConfigError, Error, Result};
use crate::lora::{LoraLinear, WeightLayout};
use crate::params::{Init, Params};
use rltune_kernels as ops;
pub use rltune_kernels::{causal_bias, padding_bias, GradSlot, MASK_MIN};

/// `nn.Linear`: weight `[out, in]`, optional bias `[out]`, and a LoRA adapter when the store
/// targets this module ([`crate::lora`]).
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`
    pub weight: Tensor,
    /// `[out]`
    pub bias: Option<Tensor>,
    /// The adapter, `y += (x·Aᵀ·Bᵀ)·scaling`.
    pub lora: Option<LoraLinear>,
    /// Where the backward writes the weight's and bias's gradients (the store's slot).
    pub grads: GradSlot,
}

impl Linear {
    /// Whether the layer is its weight alone: no bias, no adapter.
    pub fn weight_only(&self) -> bool {
        self.bias.is_none() && self.lora.is_none()
    }

    /// Loads `weight` (and `bias` when `bias` is true) under `p`, and its adapter.
    pub fn load(p: &Params, d_in: usize, d_out: usize, bias: bool, std: f64) -> Result<Self> {
        let weight = p.get("weight", (d_out, d_in), Init::Normal(std))?;
        let bias = if bias { Some(p.get("bias", d_out, Init::Zeros)?) } else { None };
        let lora = p.lora(d_in, d_out, WeightLayout::OutIn)?;
        Ok(Self { weight, bias, lora, grads: p.grad_slot().clone() })
    }

    /// Folds the adapter into a detached `W + ΔW` (PEFT's `merge`), for inference; whether it
    /// had one.
    pub fn merge_adapter(&mut self) -> Result<bool> {
        let Some(l) = self.lora.take() else { return Ok(false) };
        self.weight = (self.weight.detach() + l.delta_weight(WeightLayout::OutIn)?.detach())?;
        Ok(true)
    }

    /// `(…, in) -> (…, out)`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.lora {
            Some(l) => ops::linear_lora(x, &self.weight, self.bias.as_ref(), &l.a, &l.b, l.scaling)?,
            None => ops::linear_with(x, &self.weight, self.bias.as_ref(), &self.grads)?,
        })
    }
}

/// GPT-2's `Conv1D`: a linear map stored transposed, weight `[in, out]`, bias `[out]`, and a
/// LoRA adapter when the store targets this module (PEFT's `fan_in_fan_out`).
#[derive(Debug, Clone)]
pub struct Conv1D {
    /// `[in, out]`
    pub weight: Tensor,
    /// `[out]`
    pub bias: Tensor,
    /// The adapter, `A (r, in)`, `B (out, r)` as for `nn.Linear`.
    pub lora: Option<LoraLinear>,
    /// Where the backward writes the weight's and bias's gradients (the store's slot).
    pub grads: GradSlot,
}

impl Conv1D {
    /// Loads `weight` and `bias` under `p`, and its adapter.
    pub fn load(p: &Params, d_in: usize, d_out: usize, std: f64) -> Result<Self> {
        Ok(Self {
            weight: p.get("weight", (d_in, d_out), Init::Normal(std))?,
            bias: p.get("bias", d_out, Init::Zeros)?,
            lora: p.lora(d_in, d_out, WeightLayout::InOut)?,
            grads: p.grad_slot().clone(),
        })
    }

    /// [`Linear::merge_adapter`] for the transposed layout.
    pub fn merge_adapter(&mut self) -> Result<bool> {
        let Some(l) = self.lora.take() else { return Ok(false) };
        self.weight = (self.weight.detach() + l.delta_weight(WeightLayout::InOut)?.detach())?;
        Ok(true)
    }

    /// `(…, in) -> (…, out)`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.lora {
            Some(l) => ops::linear_in_out_lora(x, &self.weight, Some(&self.bias), &l.a, &l.b, l.scaling)?,
            None => ops::linear_in_out_with(x, &self.weight, Some(&self.bias), &self.grads)?,
        })
    }
}

/// Token (or position) embedding table `[n, C]`.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// `[n, C]`
    pub weight: Tensor,
    /// Where the backward writes the table's gradient (the store's slot).
    pub grads: GradSlot,
}

impl Embedding {
    /// Loads `weight` under `p`.
    pub fn load(p: &Params, n: usize, dim: usize, std: f64) -> Result<Self> {
        Ok(Self { weight: p.get("weight", (n, dim), Init::Normal(std))?, grads: p.grad_slot().clone() })
    }

    /// A table that is not a parameter (e.g. fixed sinusoidal positions).
    pub fn fixed(weight: Tensor) -> Self {
        Self { weight, grads: GradSlot::new() }
    }

    /// `(B, T)` ids -> `(B, T, C)`
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(ops::embedding_with(&self.weight, ids, &self.grads)?)
    }
}

/// `nn.LayerNorm` with weight and bias.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// `[C]`
    pub weight: Tensor,
    /// `[C]`
    pub bias: Tensor,
    /// Added to the variance.
    pub eps: f64,
    /// Where the backward writes the weight's and bias's gradients (the store's slot).
    pub grads: GradSlot,
}

impl LayerNorm {
    /// Loads `weight` and `bias` under `p`.
    pub fn load(p: &Params, dim: usize, eps: f64) -> Result<Self> {
        let (weight, bias) = (p.get("weight", dim, Init::Ones)?, p.get("bias", dim, Init::Zeros)?);
        Ok(Self { weight, bias, eps, grads: p.grad_slot().clone() })
    }

    /// Normalizes over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::layer_norm_with(x, &self.weight, &self.bias, self.eps, &self.grads)?)
    }
}

/// Activation functions named as in transformers' `ACT2FN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `gelu_new`, `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    /// `gelu`: the exact erf form.
    GeluErf,
    /// `relu`
    Relu,
    /// `silu` / `swish`
    Silu,
}

impl Activation {
    /// Parses a transformers activation name, the value of config.json's `field`; the error names
    /// the field and lists the supported names.
    pub fn parse(field: &str, name: &str) -> std::result::Result<Self, ConfigError> {
        match name {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Self::GeluTanh),
            "gelu" => Ok(Self::GeluErf),
            "relu" => Ok(Self::Relu),
            "silu" | "swish" => Ok(Self::Silu),
            other => Err(ConfigError::new(
                "",
                field,
                format!(": unsupported activation {other:?}; supported: gelu_new, gelu_pytorch_tanh, gelu, relu, silu"),
            )),
        }
    }

    /// Applies the activation.
    pub fn forward(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::GeluTanh => ops::gelu_tanh(x)?,
            Self::GeluErf => x.gelu_erf()?,
            Self::Relu => x.relu()?,
            Self::Silu => x.silu()?,
        })
    }
}

/// Keys and values of every layer for incremental decoding, kept outside the model.
///
/// Layer `l` holds either [`KvTensors`], grown by [`KvCache::append`] (any device and dtype), or
/// an [`ops::KvBlock`] that [`ops::cached_self_attention`] appends to in place (GPT-2 and Llama
/// on the CPU in f32); a model uses one kind throughout.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<KvTensors>>,
    blocks: Vec<ops::KvBlock>,
    /// Positions to allocate room for at the first append ([`Self::reserve`]).
    reserved: usize,
}

/// One layer's keys and values, `(B, H_kv, capacity, D)` each, of which the first `len`
/// positions hold the sequences: an append copies only the new positions in (a concatenation
/// would copy the whole cache each token), and the room grows by half when it runs out. Not
/// `Clone`: a copy would share the buffers that appends write into.
#[derive(Debug)]
pub struct KvTensors {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl KvTensors {
    /// Buffers of `capacity` positions holding `k, v (B, H_kv, S, D)` (contiguous or not).
    fn with_capacity(k: &Tensor, v: &Tensor, capacity: usize) -> Result<Self> {
        let len = k.dim(2)?;
        let room = |t: &Tensor| -> Result<Tensor> {
            let (b, h, _, d) = t.dims4()?;
            let buf = Tensor::zeros((b, h, capacity.max(len), d), t.dtype(), t.device())?;
            buf.slice_set(&t.contiguous()?, 2, 0)?;
            Ok(buf)
        };
        Ok(Self { k: room(k)?, v: room(v)?, len })
    }

    /// The cached keys and values, `(B, H_kv, len, D)` views of the buffers.
    fn views(&self) -> Result<(Tensor, Tensor)> {
        Ok((self.k.narrow(2, 0, self.len)?, self.v.narrow(2, 0, self.len)?))
    }

    /// Room for this many positions.
    fn capacity(&self) -> usize {
        self.k.dim(2).unwrap_or(0)
    }

    /// Appends `k, v (B, H_kv, T, D)` in place, first moving to buffers half as large again when
    /// they are full.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(2)?;
        if self.len + t > self.capacity() {
            let (ok, ov) = self.views()?;
            let grown = (self.len + t).max(self.capacity() + self.capacity() / 2);
            *self = Self::with_capacity(&ok, &ov, grown)?;
        }
        self.k.slice_set(&k.contiguous()?, 2, self.len)?;
        self.v.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len += t;
        Ok(())
    }

    /// Keeps `f(k), f(v)` of the whole buffers (`f` must select cached positions only), in
    /// buffers of the same capacity.
    fn map(&mut self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
        let capacity = self.capacity();
        *self = Self::with_capacity(&f(&self.k)?, &f(&self.v)?, capacity)?;
        Ok(())
    }
}

impl KvCache {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        let layers = (0..n_layers).map(|_| None).collect();
        Self { layers, blocks: vec![ops::KvBlock::default(); n_layers], reserved: 0 }
    }

    /// Allocates room for `positions` positions at the first append (the prompt and every token
    /// to be sampled), so that decoding never moves the cache.
    pub fn reserve(&mut self, positions: usize) {
        self.reserved = positions;
    }

    /// Number of cached positions (0 when empty).
    pub fn seq_len(&self) -> usize {
        let tensors = self.layers.iter().flatten().next().map(|l| l.len);
        tensors.or_else(|| self.blocks.first().map(ops::KvBlock::len)).unwrap_or(0)
    }

    /// The in-place block of `layer`.
    pub fn block_mut(&mut self, layer: usize) -> Result<&mut ops::KvBlock> {
        self.blocks.get_mut(layer).ok_or_else(|| Error::Input(format!("KV cache has no layer {layer}")))
    }

    /// Keeps the sequences `rows` (indices into the cached batch, in the order given), dropping
    /// the others: a batch of growing sequences sheds the finished ones. A row named more than
    /// once is copied: a prompt prefilled once becomes the cache of each of its samples.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<()> {
        for layer in self.layers.iter_mut().flatten() {
            let idx = Tensor::new(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), layer.k.device())?;
            // The whole buffers: the room is kept.
            layer.k = layer.k.index_select(&idx, 0)?;
            layer.v = layer.v.index_select(&idx, 0)?;
        }
        for block in &mut self.blocks {
            block.select_rows(rows)?;
        }
        Ok(())
    }

    /// Keeps the cached positions `keep` (increasing indices) of every sequence: positions that
    /// every sequence masks out can go.
    pub fn select_positions(&mut self, keep: &[usize]) -> Result<()> {
        for layer in self.layers.iter_mut().flatten() {
            let idx = Tensor::new(keep.iter().map(|&p| p as u32).collect::<Vec<_>>(), layer.k.device())?;
            if keep.iter().any(|&p| p >= layer.len) {
                return Err(Error::Internal(format!("KV cache positions {keep:?} kept of {}", layer.len)));
            }
            layer.map(|t| Ok(t.index_select(&idx, 2)?))?;
        }
        for block in &mut self.blocks {
            block.select_positions(keep)?;
        }
        Ok(())
    }

    /// A block's output in a cached (inference) forward, detached: the next block then records
    /// no edge to this one, so each block's activations are freed when it returns instead of
    /// when the whole forward does. (Kept, the 64 × 128-token prefill of Qwen2-0.5B held 49 GB
    /// of activations at once on the GPU.) Without a cache, `x` as it is (training).
    pub fn cut(cache: Option<&KvCache>, x: Tensor) -> Tensor {
        if cache.is_some() {
            x.detach()
        } else {
            x
        }
    }

    /// Appends this step's keys and values for `layer` and returns the full ones.
    ///
    /// The cache is for inference: it keeps the values only, detached from the autograd graph.
    /// (Kept attached, every step's keys would hold the whole forward graph of every earlier
    /// step alive, activations included: 72 GB for 64 sequences of 256 tokens on Qwen2-0.5B.)
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| Error::Input(format!("KV cache has no layer {layer}")))?;
        let (k, v) = (k.detach(), v.detach());
        let cached = match slot {
            Some(cached) => {
                cached.append(&k, &v)?;
                cached
            }
            None => slot.insert(KvTensors::with_capacity(&k, &v, self.reserved)?),
        };
        cached.views()
    }
}

/// Position ids from a key mask, as transformers' generate: `cumsum(mask) − 1`, clamped at 0.
///
/// `mask` is `(B, S)` with 1 for real tokens and 0 for padding; returns `(B, S)` u32.
pub fn position_ids_from_mask(mask: &[Vec<u8>], device: &Device) -> Result<Tensor> {
    let rows: Vec<Vec<u32>> = mask
        .iter()
        .map(|row| {
            let mut c = 0u32;
            row.iter()
                .map(|&m| {
                    c += m as u32;
                    c.saturating_sub(1)
                })
                .collect()
        })
        .collect();
    let (b, s) = (rows.len(), rows.first().map_or(0, Vec::len));
    Ok(Tensor::from_vec(rows.concat(), (b, s), device)?)
}

/// Scaled dot-product attention: `softmax(q kᵀ · scale + bias) v`.
///
/// `q (B, H, T, D)`, `k, v (B, H, S, D)`, `bias` broadcastable to `(B, H, T, S)`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let scores = ops::matmul(&q.contiguous()?, &batched_operand(&k.t()?)?)?;
    let probs = ops::scaled_masked_softmax(&scores, bias, scale)?;
    Ok(ops::matmul(&probs, &batched_operand(v)?)?)
}

/// `x (B, H, R, C)` as the right operand of a batched product: as it is where every matrix is
/// packed row- or column-major and the batches lie one stride apart (the KV cache's views of
/// its buffers, and their transpose: candle's CPU and CUDA products read those in place), else
/// a contiguous copy.
fn batched_operand(x: &Tensor) -> Result<Tensor> {
    let packed = match (x.dims(), x.stride()) {
        (&[b, h, r, c], &[s0, s1, s2, s3]) => {
            let matrix = (s3 == 1 && s2 == c) || (s2 == 1 && s3 == r);
            matrix && (s0 == s1 * h || b == 1) && r > 1 && c > 1
        }
        _ => false,
    };
    Ok(if packed { x.clone() } else { x.contiguous()? })
}

/// Repeats each key/value head `n_rep` times for grouped-query attention: `(B, H_kv, S, D) -> (B, H_kv·n_rep, S, D)`.
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, h_kv, s, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?.broadcast_as((b, h_kv, n_rep, s, d))?.reshape((b, h_kv * n_rep, s, d))?)
}

/// `(B, T, H·D) -> (B, H, T, D)`
pub fn split_heads(x: &Tensor, n_heads: usize) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    Ok(x.reshape((b, t, n_heads, c / n_heads))?.transpose(1, 2)?.contiguous()?)
}

/// `(B, H, T, D) -> (B, T, H·D)`
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    Ok(x.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))?)
}

/// Mean over positions weighted by the mask (sentence-transformers' mean pooling):
/// `(B, T, C), (B, T) -> (B, C)`.
pub fn mean_pool(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let m = mask.to_dtype(hidden.dtype())?.unsqueeze(D::Minus1)?;
    let sum = hidden.broadcast_mul(&m)?.sum(1)?;
    let count = m.sum(1)?.clamp(1e-9, f64::MAX)?;
    Ok(sum.broadcast_div(&count)?)
}

/// `block(x)` under gradient checkpointing ([`ops::checkpoint`]): the backward keeps only `x`
/// and runs `block` again (transformers' `gradient_checkpointing_enable()`, per decoder layer),
/// its weights' gradients going where `grads` (their store's slot) points.
pub(crate) fn checkpointed(
    x: &Tensor,
    grads: &GradSlot,
    block: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    let segment = move |x: &Tensor| {
        block(x).map_err(|e| match e {
            Error::Candle(e) => e,
            e => candle_core::Error::wrap(e),
        })
    };
    Ok(ops::checkpoint(x, std::sync::Arc::new(segment), grads)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_skip_left_padding() {
        let p = position_ids_from_mask(&[vec![0, 0, 1, 1, 1], vec![1, 1, 1, 1, 1]], &Device::Cpu).unwrap();
        assert_eq!(p.to_vec2::<u32>().unwrap(), vec![vec![0, 0, 0, 1, 2], vec![0, 1, 2, 3, 4]]);
    }

    /// Appends in place give what a concatenation gives: from a reserved room, through growth,
    /// after rows are selected (one repeated) and positions dropped.
    #[test]
    fn kv_tensors_grow_and_select_as_a_concatenation() {
        let dev = Device::Cpu;
        let piece = |seed: f64, t: usize, b: usize| {
            let n = b * 2 * t * 3;
            Tensor::arange(0f32, n as f32, &dev)
                .unwrap()
                .affine(0.1, seed)
                .unwrap()
                .reshape((b, 2, t, 3))
                .unwrap()
        };
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for reserved in [0, 4, 64] {
            let mut cache = KvCache::new(2);
            cache.reserve(reserved);
            let (mut want_k, mut want_v) = (piece(0.0, 3, 2), piece(100.0, 3, 2));
            cache.append(1, &want_k, &want_v).unwrap();
            for step in 0..5 {
                let (k, v) = (piece(step as f64, 1, 2), piece(50.0 + step as f64, 1, 2));
                let (ck, cv) = cache.append(1, &k, &v).unwrap();
                want_k = Tensor::cat(&[&want_k, &k], 2).unwrap();
                want_v = Tensor::cat(&[&want_v, &v], 2).unwrap();
                assert_eq!(ck.dims(), want_k.dims(), "reserved {reserved}, step {step}");
                assert_eq!((values(&ck), values(&cv)), (values(&want_k), values(&want_v)));
            }
            assert_eq!(cache.seq_len(), 8);
            cache.select_rows(&[1, 1, 0]).unwrap();
            cache.select_positions(&[0, 2, 7]).unwrap();
            let (ck, cv) = cache.append(1, &piece(9.0, 1, 3), &piece(19.0, 1, 3)).unwrap();
            let pick = |t: &Tensor, extra: f64| {
                let rows = t.index_select(&Tensor::new(&[1u32, 1, 0], &dev).unwrap(), 0).unwrap();
                let kept = rows.index_select(&Tensor::new(&[0u32, 2, 7], &dev).unwrap(), 2).unwrap();
                Tensor::cat(&[&kept, &piece(extra, 1, 3)], 2).unwrap()
            };
            assert_eq!(values(&ck), values(&pick(&want_k, 9.0)), "reserved {reserved}");
            assert_eq!(values(&cv), values(&pick(&want_v, 19.0)), "reserved {reserved}");
            assert_eq!(cache.seq_len(), 4);
        }
    }

    /// Keys and values computed from trainable weights enter the cache without their graph
    /// (which would keep every earlier step's activations alive), with their values intact.
    #[test]
    fn the_kv_cache_holds_no_autograd_graph() {
        let w = candle_core::Var::from_tensor(
            &Tensor::ones((1, 1, 2, 3), candle_core::DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap();
        let k = (w.as_tensor() * 2.0).unwrap();
        assert!(k.track_op(), "the test needs a key with a graph");
        let mut cache = KvCache::new(1);
        for step in 1..=2 {
            let (ck, cv) = cache.append(0, &k, &k).unwrap();
            assert!(!ck.track_op() && !cv.track_op(), "step {step}: the cache kept the graph");
            assert_eq!(ck.dims(), &[1, 1, 2 * step, 3]);
            assert_eq!(ck.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![2.0; 6 * step]);
        }
    }
}
