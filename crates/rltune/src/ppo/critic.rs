//! A separate critic: a value model on its own backbone, trained by its own Adam.
//!
//! TRL 0.11's classic trainer has one model: the policy's LM with a value head on top, and one
//! loss `pg_loss + vf_coef · vf_loss` stepping one optimizer. With a [`Critic`]
//! (`PpoTrainer::with_critic`), as in OpenRLHF (`openrlhf/trainer/ppo_trainer.py`: an actor and
//! a critic, each with its own optimizer and learning rate):
//!
//! - the values (rollout values `V_old`, and the training forward's `vpred`) come from the
//!   critic: any supported causal LM (its LM head unused) with a value head (`[ppo] value_head`);
//! - the policy's optimizer steps on `∇θ pg_loss`, the critic's on `∇φ (vf_coef · vf_loss)`:
//!   the gradients TRL's summed loss gives each parameter set, since the two share none. The
//!   critic's own learning rate therefore sets its step size (Adam is invariant to `vf_coef`,
//!   up to its ε);
//! - both update on the same minibatches and are skipped together (a minibatch over
//!   `ratio_threshold`, or a non-finite loss); each clips its own gradient norm to
//!   `max_grad_norm` (OpenRLHF clips each model on its own), and a non-finite critic gradient
//!   skips only the critic's update;
//! - the policy's own value head is neither read nor trained (it stays in its checkpoint).
//!
//! The critic reads the policy's token ids, so it must share the policy's vocabulary
//! (`PpoTrainer::with_critic` checks the sizes; `rltune ppo` also compares the tokenizers).
//! With rollout caching, the cached values are ignored (generation runs the policy only): the
//! critic computes the rollout values in `step`, on the response positions only.
//!
//! The policy keeps the fused CPU update (`Adam::step_fused`); the critic's update runs after its
//! backward (`Adam::step`), which gives the same numbers.

use candle_core::Tensor;

use super::config::optim_args;
use super::forward::hidden_states;
use crate::engine::Optimizer;
use crate::error::{ConfigError, Error, Result};
use crate::models::CausalLmWithValueHead;
use crate::optim::{Adam, Grads};
use crate::params::ParamStore;

/// A value model on its own backbone, with its own parameters and optimizer.
pub struct Critic {
    /// The backbone and its value head.
    pub model: CausalLmWithValueHead,
    /// The critic's trainable parameters.
    pub store: ParamStore,
    pub(super) optimizer: Optimizer,
    /// The gradient buffers, kept between steps (`None` until the first).
    pub(super) grads: Option<Grads>,
}

impl Critic {
    /// A critic over a trainable `store` holding `model`, trained by Adam at `learning_rate`.
    pub fn new(store: ParamStore, model: CausalLmWithValueHead, learning_rate: f64) -> Result<Self> {
        if !store.trainable() {
            return Err(Error::argument("critic", "its parameters must be trainable"));
        }
        if !(learning_rate.is_finite() && learning_rate > 0.0) {
            return Err(Error::Setting(ConfigError::new(
                "critic",
                "learning_rate",
                format!("must be a positive number, got {learning_rate}"),
            )));
        }
        let optimizer = Optimizer::new(&store, optim_args(learning_rate, None))?;
        Ok(Self { model, store, optimizer, grads: None })
    }

    /// The critic's optimizer (its moments go into checkpoints).
    pub fn optimizer(&self) -> &Adam {
        self.optimizer.adam()
    }

    /// Mutable optimizer (to restore a checkpoint, or change the learning rate).
    pub fn optimizer_mut(&mut self) -> &mut Adam {
        self.optimizer.adam_mut()
    }

    /// Values `(B, L−1)` of the states before each next token of `ids (B, L)`: the critic's
    /// hidden states (computed in full at the `select`ed positions only, see
    /// `CausalLm::forward_rows`) through its value head, detached first with `detach`.
    pub(super) fn values(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        bias: &Tensor,
        select: Option<&Tensor>,
        detach: bool,
    ) -> Result<Tensor> {
        let hidden = hidden_states(&self.model.lm, ids, pos, bias, select)?;
        let hidden = if detach { hidden.detach() } else { hidden };
        Ok(self.model.v_head.forward(&hidden)?)
    }
}
