//! A scalar value head on any causal LM, with TRL's names and shapes, or trlx's 2-layer MLP.
//!
//! TRL's `AutoModelForCausalLMWithValueHead` stores `v_head.summary.weight` `[1, C]` and
//! `v_head.summary.bias` `[1]` beside the LM's own tensors, and reads the final (post-norm) hidden
//! state. We do the same, so TRL checkpoints load and round-trip.
//!
//! The MLP head ([`ValueHeadKind::Mlp`], `[ppo] value_head = "mlp"`) is trlx's `make_head`
//! (`trlx/utils/modeling.py`): `Linear(C, H) → ReLU → Linear(H, 1)` with `H = 2C` by default. It is
//! stored as an `nn.Sequential` in place of TRL's `summary` Linear would be: `v_head.summary.0.weight`
//! `[H, C]`, `v_head.summary.0.bias` `[H]`, `v_head.summary.2.weight` `[1, H]`,
//! `v_head.summary.2.bias` `[1]` (trlx itself names them `v_head.0.*` and `v_head.2.*`).
//!
//! Deviations from TRL 0.11: no dropout before the head (TRL applies `summary_dropout_prob` = 0.1
//! by default, also during PPO's training forward passes). A missing head is initialized with
//! each weight ~ N(0, 1/(3·fan_in)) — the variance of torch's default `nn.Linear` init — and
//! biases 0.

use candle_core::Tensor;

use super::CausalLm;
use crate::error::{Error, Result};
use crate::params::{Init, Params};

/// The architecture of a value head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueHeadKind {
    /// TRL's `Linear(C, 1)` (the default).
    #[default]
    Linear,
    /// trlx's `Linear(C, H) → ReLU → Linear(H, 1)`.
    Mlp,
}

impl ValueHeadKind {
    /// The name used in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Linear => "linear",
            Self::Mlp => "mlp",
        }
    }
}

/// Which value head to build: `[ppo] value_head` and `value_head_hidden`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ValueHeadSpec {
    /// Linear or MLP.
    pub kind: ValueHeadKind,
    /// The MLP's width H; `None`: the checkpoint's, else trlx's `2·C`.
    pub hidden: Option<usize>,
}

/// The layers of a value head.
#[derive(Debug, Clone)]
enum Layers {
    /// `weight [1, C]`, `bias [1]`
    Linear { weight: Tensor, bias: Tensor },
    /// `w1 [H, C]`, `b1 [H]`, `w2 [1, H]`, `b2 [1]`
    Mlp { w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor },
}

/// A value head on the final hidden state: TRL's `Linear(C, 1)` or trlx's MLP.
#[derive(Debug, Clone)]
pub struct ValueHead {
    layers: Layers,
}

/// `x (N, in) · wᵀ + b`
fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?.broadcast_add(b)?)
}

impl ValueHead {
    /// Loads the head stored under `p` (the checkpoint root): the MLP when the checkpoint holds
    /// `v_head.summary.0.weight`, else TRL's linear head (initialized when absent).
    pub fn load(p: &Params, hidden_size: usize) -> Result<Self> {
        let kind = if p.pp("v_head").pp("summary").pp("0").contains("weight") {
            ValueHeadKind::Mlp
        } else {
            ValueHeadKind::Linear
        };
        Self::load_with(p, hidden_size, ValueHeadSpec { kind, hidden: None })
    }

    /// Loads the head `spec` asks for under `p`, initializing it when absent. A checkpoint that
    /// holds the other kind of head, or an MLP of another width, is an error naming the setting.
    pub fn load_with(p: &Params, hidden_size: usize, spec: ValueHeadSpec) -> Result<Self> {
        let s = p.pp("v_head").pp("summary");
        let (has_linear, has_mlp) = (s.contains("weight"), s.pp("0").contains("weight"));
        let source = p.store().source().display().to_string();
        let other = match spec.kind {
            ValueHeadKind::Linear if has_mlp => Some(("an MLP", "v_head.summary.0.weight", "mlp")),
            ValueHeadKind::Mlp if has_linear => Some(("a linear", "v_head.summary.weight", "linear")),
            _ => None,
        };
        if let Some((what, name, fix)) = other {
            return Err(Error::weights(
                p.store().source(),
                format!(
                    "the checkpoint holds {what} value head ({name}) but [ppo] value_head = {:?}; set \
                     value_head = {fix:?}, or start from a checkpoint without a value head",
                    spec.kind.as_str()
                ),
            ));
        }
        let std = |fan_in: usize| 1.0 / (3.0 * fan_in as f64).sqrt();
        let missing = !(has_linear || has_mlp);
        let layers = match spec.kind {
            ValueHeadKind::Linear => Layers::Linear {
                weight: s.get_or_init("weight", (1, hidden_size), Init::Normal(std(hidden_size)))?,
                bias: s.get_or_init("bias", 1, Init::Zeros)?,
            },
            ValueHeadKind::Mlp => {
                let stored = p.store().shape_of(&s.pp("0").full_name("weight")).map(|d| d[0]);
                let width = match (spec.hidden, stored) {
                    (Some(h), Some(k)) if h != k => {
                        return Err(Error::weights(
                            p.store().source(),
                            format!(
                                "the checkpoint's MLP value head is {k} wide (v_head.summary.0.weight) \
                                 but [ppo] value_head_hidden = {h}; set value_head_hidden = {k} or \
                                 leave it out"
                            ),
                        ))
                    }
                    (_, Some(k)) => k,
                    (Some(h), None) => h,
                    (None, None) => 2 * hidden_size,
                };
                let (l0, l2) = (s.pp("0"), s.pp("2"));
                Layers::Mlp {
                    w1: l0.get_or_init("weight", (width, hidden_size), Init::Normal(std(hidden_size)))?,
                    b1: l0.get_or_init("bias", width, Init::Zeros)?,
                    w2: l2.get_or_init("weight", (1, width), Init::Normal(std(width)))?,
                    b2: l2.get_or_init("bias", 1, Init::Zeros)?,
                }
            }
        };
        if missing {
            tracing::info!(
                "no value head (v_head.summary.*) in {source}: initialized a new {} one",
                spec.kind.as_str()
            );
        }
        Ok(Self { layers })
    }

    /// Linear or MLP.
    pub fn kind(&self) -> ValueHeadKind {
        match self.layers {
            Layers::Linear { .. } => ValueHeadKind::Linear,
            Layers::Mlp { .. } => ValueHeadKind::Mlp,
        }
    }

    /// The MLP's width H (`None` for the linear head).
    pub fn mlp_width(&self) -> Option<usize> {
        match &self.layers {
            Layers::Linear { .. } => None,
            Layers::Mlp { b1, .. } => Some(b1.elem_count()),
        }
    }

    /// `(B, T, C) -> (B, T)`
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, c) = hidden.dims3()?;
        let x = hidden.reshape((b * t, c))?;
        let v = match &self.layers {
            Layers::Linear { weight, bias } => linear(&x, weight, bias)?,
            Layers::Mlp { w1, b1, w2, b2 } => linear(&linear(&x, w1, b1)?.relu()?, w2, b2)?,
        };
        Ok(v.reshape((b, t))?)
    }
}

/// A causal LM with a value head: the PPO policy, or a separate critic.
#[derive(Debug, Clone)]
pub struct CausalLmWithValueHead {
    /// The language model.
    pub lm: CausalLm,
    /// The value head.
    pub v_head: ValueHead,
}

impl CausalLmWithValueHead {
    /// Builds both from the checkpoint root (the head the checkpoint holds; see [`ValueHead::load`]).
    pub fn load(p: &Params, lm: CausalLm) -> Result<Self> {
        let v_head = ValueHead::load(p, lm.hidden_size())?;
        Ok(Self { lm, v_head })
    }

    /// Builds both from the checkpoint root, with the value head `spec` asks for.
    pub fn load_with(p: &Params, lm: CausalLm, spec: ValueHeadSpec) -> Result<Self> {
        let v_head = ValueHead::load_with(p, lm.hidden_size(), spec)?;
        Ok(Self { lm, v_head })
    }

    /// Logits `(B, T, V)` and values `(B, T)` at every position.
    pub fn forward(&self, ids: &Tensor, pos: &Tensor, bias: &Tensor) -> Result<(Tensor, Tensor)> {
        let hidden = self.lm.forward(ids, pos, bias, None)?;
        Ok((self.lm.logits(&hidden)?, self.v_head.forward(&hidden)?))
    }
}
