//! PPO-ptx (InstructGPT; OpenRLHF's `--ptx_coef`): every PPO minibatch also takes the
//! cross-entropy of a minibatch of supervised examples, and the update follows
//! `PPO loss + ptx_coef · CE`, one backward, one optimizer step.
//!
//! The examples are the SFT examples `rltune sft` trains on ([`SftExample`]: the loss on the
//! marked targets), drawn in a fixed order (one shuffle with `[ppo] seed`), `mini_batch_size`
//! at a time, cycling. The position in that order is part of [`super::TrainerStreams`], so a
//! resumed run draws the same examples. The CE is the SFT loss: the mean negative log-likelihood
//! of the batch's target tokens at temperature 1, whatever `[ppo] temperature` is.

use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::PpoTrainer;
use crate::error::{Error, Result};
use crate::models::layers::causal_bias;
use crate::ops;
use crate::ppo::forward::hidden_states;
use crate::tokenizer::{pad, PaddingSide};
use crate::train::sft::SftExample;

/// The supervised examples and where the next minibatch starts.
pub(super) struct Ptx {
    examples: Vec<SftExample>,
    /// The weight of the CE in the update (`ptx_coef`).
    pub(super) coef: f64,
    /// The examples' order (one shuffle).
    order: Vec<usize>,
    /// Examples drawn so far (the next minibatch starts at `order[cursor % n]`).
    pub(super) cursor: u64,
}

impl Ptx {
    /// The next `n` examples' indices (cycling through the order).
    pub(super) fn next_rows(&mut self, n: usize) -> Vec<usize> {
        let len = self.order.len() as u64;
        let rows = (0..n as u64).map(|i| self.order[((self.cursor + i) % len) as usize]).collect();
        self.cursor += n as u64;
        rows
    }
}

impl PpoTrainer {
    /// Trains with PPO-ptx: each minibatch adds `coef ×` the cross-entropy of `mini_batch_size`
    /// of `examples` to its loss (see the module). `coef` must be finite and > 0; `examples` must
    /// have a target token each. Not on several processes yet.
    pub fn with_ptx(mut self, examples: Vec<SftExample>, coef: f64) -> Result<Self> {
        if !(coef.is_finite() && coef > 0.0) {
            return Err(Error::argument("ptx coef", format!("is {coef}; use a finite value above 0")));
        }
        if examples.is_empty() {
            return Err(Error::argument(
                "ptx examples",
                "none has a target token; give [ptx] source rows with a completion",
            ));
        }
        if let Some(i) = examples.iter().position(|e| e.targets() == 0) {
            return Err(Error::argument("ptx examples", format!("example {i} has no target token")));
        }
        if self.dist().world_size() > 1 {
            return Err(Error::argument(
                "ptx",
                "PPO-ptx runs on one process only for now; drop [ptx] or run without mpirun",
            ));
        }
        let mut order: Vec<usize> = (0..examples.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(self.config.seed ^ 0x0070_7478));
        self.ptx = Some(Ptx { examples, coef, order, cursor: 0 });
        Ok(self)
    }

    /// The mean negative log-likelihood of the target tokens of examples `rows`, with its graph.
    pub(super) fn ptx_loss(&self, rows: &[usize]) -> Result<Tensor> {
        let ptx = self.ptx.as_ref().ok_or_else(|| Error::Internal("a ptx loss without ptx data".into()))?;
        let seqs: Vec<Vec<u32>> = rows.iter().map(|&r| ptx.examples[r].input_ids.clone()).collect();
        let (ids, mut attn) = pad(&seqs, self.pad_id, PaddingSide::Right);
        let (b, l) = (ids.len(), ids[0].len());
        attn.iter_mut().for_each(|a| a.truncate(l - 1));
        // (B, L−1): 1 where the token at t + 1 is a target.
        let w: Vec<f32> = rows
            .iter()
            .flat_map(|&r| {
                let m = &ptx.examples[r].loss_mask;
                (1..l).map(move |t| f32::from(m.get(t).copied().unwrap_or(0)))
            })
            .collect();
        // The target count, from the host's mask: no read back from the device.
        let n: f64 = w.iter().map(|&x| f64::from(x)).sum();
        let dt = self.store.dtype();
        let mask = Tensor::from_vec(w, (b, l - 1), &self.device)?.to_dtype(dt)?;
        let ids = Tensor::new(ids, &self.device)?;
        let pos = Tensor::arange(0u32, (l - 1) as u32, &self.device)?.unsqueeze(0)?.repeat((b, 1))?;
        let bias = causal_bias(&attn, l - 1, dt, &self.device)?;
        let lm = &self.policy.lm;
        let hidden = hidden_states(lm, &ids, &pos, &bias, Some(&mask))?;
        let h = hidden.reshape((b * (l - 1), hidden.dim(2)?))?;
        let targets = ids.narrow(1, 1, l - 1)?.flatten_all()?;
        let select = mask.flatten_all()?;
        let (logp, _) = ops::lm_head_logprobs_with(
            &h,
            lm.lm_head_weight(),
            &targets,
            Some(&select),
            1.0,
            true,
            lm.grad_slot(),
        )?;
        let logp = logp.reshape((b, l - 1))?;
        Ok(((logp * &mask)?.sum_all()?.neg()? / n)?)
    }
}
