//! A scalar value head on any causal LM, with TRL's names and shapes.
//!
//! TRL's `AutoModelForCausalLMWithValueHead` stores `v_head.summary.weight` `[1, C]` and
//! `v_head.summary.bias` `[1]` beside the LM's own tensors, and reads the final (post-norm) hidden
//! state. We do the same, so TRL checkpoints load and round-trip.
//!
//! Deviations from TRL 0.11: no dropout before the head (TRL applies `summary_dropout_prob` = 0.1
//! by default, also during PPO's training forward passes). A missing head is initialized with
//! weight ~ N(0, 1/(3C)) — the variance of torch's default `nn.Linear` init — and bias 0.

use candle_core::Tensor;

use super::CausalLm;
use crate::error::Result;
use crate::params::{Init, Params};

/// `Linear(C, 1)` on the final hidden state.
#[derive(Debug, Clone)]
pub struct ValueHead {
    /// `[1, C]`
    pub weight: Tensor,
    /// `[1]`
    pub bias: Tensor,
}

impl ValueHead {
    /// Loads `v_head.summary.*` under `p` (the checkpoint root), initializing it when absent.
    pub fn load(p: &Params, hidden_size: usize) -> Result<Self> {
        let s = p.pp("v_head").pp("summary");
        let missing = !s.contains("weight");
        let std = 1.0 / (3.0 * hidden_size as f64).sqrt();
        let head = Self {
            weight: s.get_or_init("weight", (1, hidden_size), Init::Normal(std))?,
            bias: s.get_or_init("bias", 1, Init::Zeros)?,
        };
        if missing {
            tracing::info!(
                "no value head (v_head.summary.*) in {}: initialized a new one",
                p.store().source().display()
            );
        }
        Ok(head)
    }

    /// `(B, T, C) -> (B, T)`
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, c) = hidden.dims3()?;
        let v = hidden.reshape((b * t, c))?.matmul(&self.weight.t()?)?.broadcast_add(&self.bias)?;
        Ok(v.reshape((b, t))?)
    }
}

/// A causal LM with a value head: the PPO policy.
#[derive(Debug, Clone)]
pub struct CausalLmWithValueHead {
    /// The language model.
    pub lm: CausalLm,
    /// The value head.
    pub v_head: ValueHead,
}

impl CausalLmWithValueHead {
    /// Builds both from the checkpoint root.
    pub fn load(p: &Params, lm: CausalLm) -> Result<Self> {
        let v_head = ValueHead::load(p, lm.hidden_size())?;
        Ok(Self { lm, v_head })
    }

    /// Logits `(B, T, V)` and values `(B, T)` at every position.
    pub fn forward(&self, ids: &Tensor, pos: &Tensor, bias: &Tensor) -> Result<(Tensor, Tensor)> {
        let hidden = self.lm.forward(ids, pos, bias, None)?;
        Ok((self.lm.logits(&hidden)?, self.v_head.forward(&hidden)?))
    }
}
