//! The trainer's side of a separate critic ([`crate::ppo::critic`]): attaching it, its
//! rollout values and its update.

use super::{PpoTrainer, StepInput};
use crate::error::{ConfigError, Error, Result};
use crate::optim::Grads;
use crate::ppo::critic::Critic;
use crate::ppo::forward::hidden_states;

impl PpoTrainer {
    /// Gives the trainer a separate critic (see [`crate::ppo::critic`]). Fails, naming the fix,
    /// when its vocabulary differs from the policy's or its value head is not the one
    /// `[ppo] value_head` asks for.
    pub fn with_critic(mut self, critic: Critic) -> Result<Self> {
        let (pv, cv) = (self.policy.lm.vocab_size(), critic.model.lm.vocab_size());
        if pv != cv {
            return Err(Error::Setting(ConfigError::table(
                "critic",
                format!(
                    "[critic]: the critic's vocab_size is {cv} but the policy's is {pv}; the critic \
                     reads the policy's token ids, so it needs the same tokenizer: pick a critic of \
                     the policy's family"
                ),
            )));
        }
        if critic.store.device().location() != self.store.device().location() {
            return Err(Error::argument("critic", "it must be on the policy's device"));
        }
        let mut critic = critic;
        critic.optimizer.set_max_grad_norm(self.config.max_grad_norm.unwrap_or(0.0));
        critic.optimizer.set_dist(self.dist().clone());
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
            return Err(Error::Setting(ConfigError::new(
                "ppo",
                "value_head",
                format!(
                    "= {:?} (value_head_hidden {:?}) but the {whose} value head is {} (width {:?}); \
                     build the model with CausalLmWithValueHead::load_with(.., \
                     config.value_head_spec()) or change ppo.value_head",
                    spec.kind.as_str(),
                    spec.hidden,
                    head.kind().as_str(),
                    head.mlp_width()
                ),
            )));
        }
        Ok(())
    }

    /// The value of the state before each response token, per sample: from the critic when
    /// there is one, else from the policy's value head. What a caller that generated with
    /// `generate(.., None, ..)` needs for the values of a multi-turn bootstrap.
    pub fn values(&self, queries: &[Vec<u32>], responses: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if queries.len() != responses.len() || queries.is_empty() {
            return Err(Error::batch(format!(
                "values: {} queries and {} responses; pass one response per query (at least one)",
                queries.len(),
                responses.len()
            )));
        }
        let vocab = self.policy.lm.vocab_size();
        for (i, (q, r)) in queries.iter().zip(responses).enumerate() {
            if q.is_empty() || r.is_empty() {
                return Err(Error::sample(i, "values: an empty query or response"));
            }
            if let Some(t) = q.iter().chain(r).find(|&&t| t as usize >= vocab) {
                return Err(Error::sample(
                    i,
                    format!("values: token id {t} is not below vocab_size {vocab}"),
                ));
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
        let Some(c) = self.critic.as_mut() else { return Ok(()) };
        // The policy's step (on several processes, the mean of their gradients first).
        let lr = c.optimizer.learning_rate();
        if !c.optimizer.clip_and_step(grads, lr)?.is_finite() {
            self.skip_non_finite_update("critic's gradient");
        }
        Ok(())
    }
}
