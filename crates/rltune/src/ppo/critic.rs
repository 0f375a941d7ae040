//! A separate critic: a value model on its own backbone, trained by its own Adam.
//!
//! TRL 0.11's classic trainer has one model: the policy's LM with a value head on top, and one
//! loss `pg_loss + vf_coef · vf_loss` stepping one optimizer. With a [`Critic`]
//! ([`PpoTrainer::with_critic`]), as in OpenRLHF (`openrlhf/trainer/ppo_trainer.py`: an actor and
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
//! ([`PpoTrainer::with_critic`] checks the sizes; `rltune ppo` also compares the tokenizers).
//! With rollout caching, the cached values are ignored (generation runs the policy only): the
//! critic computes the rollout values in `step`, on the response positions only.
//!
//! The policy keeps the fused CPU update (`Adam::step_fused`); the critic's update runs after its
//! backward (`Adam::step`), which gives the same numbers.

use candle_core::Tensor;

use super::trainer::{hidden_states, PpoTrainer, StepInput};
use crate::error::{Error, Result};
use crate::models::CausalLmWithValueHead;
use crate::optim::{Adam, AdamConfig, Grads};
use crate::params::ParamStore;

/// A value model on its own backbone, with its own parameters and optimizer.
pub struct Critic {
    /// The backbone and its value head.
    pub model: CausalLmWithValueHead,
    /// The critic's trainable parameters.
    pub store: ParamStore,
    pub(super) optimizer: Adam,
    /// The gradient buffers, kept between steps (`None` until the first).
    pub(super) grads: Option<Grads>,
}

impl Critic {
    /// A critic over a trainable `store` holding `model`, trained by Adam at `learning_rate`.
    pub fn new(store: ParamStore, model: CausalLmWithValueHead, learning_rate: f64) -> Result<Self> {
        if !store.trainable() {
            return Err(Error::Input("the critic's parameters must be trainable".into()));
        }
        if !(learning_rate.is_finite() && learning_rate > 0.0) {
            return Err(Error::Input(format!(
                "critic learning_rate must be a positive number, got {learning_rate}"
            )));
        }
        let vars = store.vars().into_iter().map(|(_, v)| v).collect();
        let optimizer = Adam::new(vars, AdamConfig { lr: learning_rate, ..Default::default() });
        Ok(Self { model, store, optimizer: optimizer?, grads: None })
    }

    /// The critic's optimizer (its moments go into checkpoints).
    pub fn optimizer(&self) -> &Adam {
        &self.optimizer
    }

    /// Mutable optimizer (to restore a checkpoint, or change the learning rate).
    pub fn optimizer_mut(&mut self) -> &mut Adam {
        &mut self.optimizer
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

impl PpoTrainer {
    /// Gives the trainer a separate critic (see the module docs). Fails, naming the fix, when its
    /// vocabulary differs from the policy's or its value head is not the one `[ppo] value_head`
    /// asks for.
    pub fn with_critic(mut self, critic: Critic) -> Result<Self> {
        let (pv, cv) = (self.policy.lm.vocab_size(), critic.model.lm.vocab_size());
        if pv != cv {
            return Err(Error::Input(format!(
                "[critic]: the critic's vocab_size is {cv} but the policy's is {pv}; the critic reads \
                 the policy's token ids, so it needs the same tokenizer: pick a critic of the \
                 policy's family"
            )));
        }
        if critic.store.device().location() != self.store.device().location() {
            return Err(Error::Input("[critic]: the critic must be on the policy's device".into()));
        }
        self.critic = Some(critic);
        self.check_value_head()?;
        Ok(self)
    }

    /// The separate critic, if any.
    pub fn critic(&self) -> Option<&Critic> {
        self.critic.as_ref()
    }

    /// The separate critic, mutably (to restore a checkpoint).
    pub fn critic_mut(&mut self) -> Option<&mut Critic> {
        self.critic.as_mut()
    }

    /// Checks that the value head in use (the critic's, else the policy's) is the one
    /// `[ppo] value_head` and `value_head_hidden` describe.
    pub(super) fn check_value_head(&self) -> Result<()> {
        let (head, whose) = match &self.critic {
            Some(c) => (&c.model.v_head, "critic's"),
            None => (&self.policy.v_head, "policy's"),
        };
        let spec = self.config.value_head_spec();
        let width_differs = matches!((spec.hidden, head.mlp_width()), (Some(a), Some(b)) if a != b);
        if head.kind() != spec.kind || width_differs {
            return Err(Error::Input(format!(
                "ppo.value_head = {:?} (value_head_hidden {:?}) but the {whose} value head is {} \
                 (width {:?}); build the model with CausalLmWithValueHead::load_with(.., \
                 config.value_head_spec()) or change ppo.value_head",
                spec.kind.as_str(),
                spec.hidden,
                head.kind().as_str(),
                head.mlp_width()
            )));
        }
        Ok(())
    }

    /// The value of the state before each response token, per sample: from the critic when
    /// there is one, else from the policy's value head. What a caller that generated with
    /// `generate(.., None, ..)` needs for the values of a multi-turn bootstrap.
    pub fn values(&self, queries: &[Vec<u32>], responses: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if queries.len() != responses.len() || queries.is_empty() {
            return Err(Error::Input(format!(
                "values: {} queries and {} responses; pass one response per query (at least one)",
                queries.len(),
                responses.len()
            )));
        }
        let vocab = self.policy.lm.vocab_size();
        for (i, (q, r)) in queries.iter().zip(responses).enumerate() {
            if q.is_empty() || r.is_empty() {
                return Err(Error::Input(format!("values: sample {i} has an empty query or response")));
            }
            if let Some(t) = q.iter().chain(r).find(|&&t| t as usize >= vocab) {
                return Err(Error::Input(format!(
                    "values: sample {i}: token id {t} is not below vocab_size {vocab}"
                )));
            }
        }
        let input = StepInput {
            queries,
            responses,
            scores: &[],
            response_masks: None,
            rollout: None,
            bootstrap: None,
            allowed: None,
        };
        let batch = self.build_batch(&input)?;
        let mut out = Vec::with_capacity(queries.len());
        let chunk = self.config.mini_batch_size;
        for start in (0..queries.len()).step_by(chunk) {
            let n = chunk.min(queries.len() - start);
            let ids = batch.ids.narrow(0, start, n)?;
            let pos = batch.positions.narrow(0, start, n)?;
            let bias = batch.bias.narrow(0, start, n)?;
            let sel = batch.response.narrow(0, start, n)?;
            let v = match &self.critic {
                Some(c) => c.values(&ids, &pos, &bias, Some(&sel), false)?,
                None => {
                    let h = hidden_states(&self.policy.lm, &ids, &pos, &bias, Some(&sel))?;
                    self.policy.v_head.forward(&h)?
                }
            };
            let v: Vec<Vec<f32>> = v.detach().to_dtype(candle_core::DType::F32)?.to_vec2()?;
            for (k, row) in v.into_iter().enumerate() {
                let (q, r) = (&queries[start + k], &responses[start + k]);
                out.push(row[q.len() - 1..q.len() - 1 + r.len()].to_vec());
            }
        }
        Ok(out)
    }

    /// One update of the critic from `grads` (after a minibatch group that ran a backward):
    /// clipped to `max_grad_norm` when set; skipped, counted and logged when not finite.
    pub(super) fn step_critic(&mut self, grads: &mut Grads) -> Result<()> {
        let max = self.config.max_grad_norm;
        let Some(c) = self.critic.as_mut() else { return Ok(()) };
        // On several processes: the mean of their gradients first, as the policy's.
        crate::dist::all_reduce_grads(grads)?;
        let norm = match max {
            Some(max) => grads.clip_norm(max)?,
            None => grads.global_norm()?,
        };
        if norm.is_finite() {
            Ok(c.optimizer.step(grads)?)
        } else {
            self.skip_non_finite_update("critic's gradient");
            Ok(())
        }
    }
}
