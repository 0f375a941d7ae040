//! `DpoTrainer::step`: one optimizer step of TRL 1.16.0's `DPOTrainer`.
//!
//! One call, top to bottom: check the pairs → per micro-batch: collate as TRL's
//! `DataCollatorForPreference` (each prompt+completion truncated to `max_length`, the chosen rows
//! then the rejected rows, right-padded) → the policy's summed completion logprobs (one forward
//! of chosen and rejected together) → the reference's (a frozen model, or precomputed) → the
//! loss and its gradient in the summed logprobs ([`super::loss`]) → backward of the micro-batch's
//! share → after the last micro-batch, transformers' clipping and AdamW step → the metrics TRL
//! logs, averaged over the micro-batches as TRL's `log` averages them.
//!
//! Layout of a micro-batch of `B` pairs: `2B` rows of length `L`, row `s < B` is pair `s`'s
//! prompt+chosen, row `B + s` its prompt+rejected. The model runs on `ids[:, :L−1]` with positions
//! `0..L−1` (right padding: TRL's default positions); the logprob of token `t + 1` is read at
//! position `t` wherever token `t + 1` is a completion token.
//!
//! Deliberate deviations from TRL 1.16.0: none in the numbers. The loss is computed in f64 from
//! the f32 logprobs (TRL: f32); rltune computes in f32 where TRL defaults to bf16 autocast. A
//! non-finite loss or gradient skips the update (`rltune/skipped_updates`).

use candle_core::{DType, Tensor, D};

use super::config::{DpoConfig, TruncationMode};
use super::data::{truncate, PreferencePair};
use super::loss::{batch_loss, LossParams, PairLogps};
use crate::engine::{Stat, Stats};
use crate::error::{Error, Result};
use crate::grpo::core::Core;
use crate::models::layers::causal_bias;
use crate::models::CausalLm;
use crate::ops;
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide};

/// A collated micro-batch.
struct Collated {
    /// `(2B, L−1)` u32
    input: Tensor,
    /// `(2B, L−1)` u32: `0..L−1` on every row.
    positions: Tensor,
    /// `(2B, 1, L−1, L−1)`
    bias: Tensor,
    /// Flat indices into `(2B·(L−1))` of the positions whose next token is a completion token.
    rows: Vec<usize>,
    /// `(N)` u32: those next tokens.
    targets: Tensor,
    /// The sequence (`0..2B`) of each of the `N` scored tokens.
    seq_of: Vec<usize>,
    /// Completion tokens per sequence after truncation (IPO's length).
    completion_len: Vec<f64>,
    /// Real tokens in the batch (TRL's `num_tokens` counts them).
    n_tokens: f64,
}

/// One micro-batch's loss parts and metrics.
struct MicroOut {
    /// Real tokens in the micro-batch.
    n_tokens: f64,
    /// `(name, value, weight)`: the value is a mean over `weight` tokens or pairs (the weight
    /// makes the mean of several processes that of the whole micro-batch).
    metrics: Vec<(&'static str, f64, f64)>,
}

/// What a DPO trainer carries between steps besides the weights, Adam's moments and the step
/// (a checkpoint's `trainer_state.json` holds it).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct DpoCounters {
    /// Micro-batches consumed (the `epoch` metric).
    pub micro_batches: usize,
    /// Real tokens seen (`num_tokens`).
    pub num_tokens: f64,
    /// Updates skipped for a non-finite loss or gradient (`rltune/skipped_updates`).
    pub skipped_updates: usize,
}

/// TRL's `DPOTrainer`, one optimizer step per [`DpoTrainer::step`].
pub struct DpoTrainer {
    /// Hyper-parameters.
    pub config: DpoConfig,
    core: Core,
    loss: LossParams,
    /// Micro-batches per epoch (`ceil(pairs / per_device_train_batch_size)`), for `epoch`.
    batches_per_epoch: usize,
    /// Micro-batches consumed.
    micro_done: usize,
}

impl DpoTrainer {
    /// A trainer over a trainable `store` holding `policy`, for a run over `n_train_pairs` pairs
    /// (the schedule's length and `epoch` follow from it). `reference`: the frozen reference; when
    /// `None` and the reference's logprobs are not precomputed, a frozen copy of the policy as it
    /// is now (TRL's default). With `precompute_ref_log_probs`, it is only used by
    /// [`Self::precompute_ref_logps`] (which falls back to the policy before training, as TRL).
    pub fn new(
        config: DpoConfig,
        store: ParamStore,
        policy: CausalLm,
        reference: Option<CausalLm>,
        n_train_pairs: usize,
    ) -> Result<Self> {
        config.validate()?;
        if n_train_pairs == 0 {
            return Err(Error::argument("n_train_pairs", "no preference pair to train on"));
        }
        let reference = match reference {
            Some(r) => Some(r),
            None if config.precompute_ref_log_probs => None,
            None => Some(CausalLm::load(&store.frozen_copy()?.root(), policy.config())?),
        };
        let core = Core::new(store, policy, reference, config.optim_args(n_train_pairs), 1.0)?;
        let loss = LossParams {
            losses: config.losses(),
            beta: config.beta,
            label_smoothing: config.label_smoothing,
            f_divergence: config.f_divergence_type,
            f_alpha: config.f_alpha_divergence_coef,
            discopop_tau: config.discopop_tau,
        };
        let batches_per_epoch = n_train_pairs.div_ceil(config.per_device_train_batch_size);
        Ok(Self { config, core, loss, batches_per_epoch, micro_done: 0 })
    }

    /// This trainer on `dist`'s processes (a data-parallel run): each trains on its share of
    /// every global micro-batch ([`super::run::epoch_plan`]) and the optimizer averages the
    /// gradients over them. `n_train_pairs` of [`Self::new`] is then one process's share
    /// ([`super::run::pairs_per_process`]).
    pub fn with_dist(mut self, dist: crate::dist::Dist) -> Self {
        self.core.set_dist(dist);
        self
    }

    /// The processes this trainer trains with.
    pub fn dist(&self) -> &crate::dist::Dist {
        self.core.dist()
    }

    /// The policy's parameters.
    pub fn store(&self) -> &ParamStore {
        &self.core.store
    }

    /// Optimizer steps taken so far.
    pub fn global_step(&self) -> usize {
        self.core.global_step
    }

    /// The counters a checkpoint saves.
    pub(crate) fn counters(&self) -> DpoCounters {
        DpoCounters {
            micro_batches: self.micro_done,
            num_tokens: self.core.tokens_seen,
            skipped_updates: self.core.skipped_updates,
        }
    }

    /// Restores a checkpoint's counters after `steps` optimizer steps (the schedule resumes
    /// there).
    pub(crate) fn restore_counters(&mut self, steps: usize, c: &DpoCounters) {
        self.core.global_step = steps;
        self.micro_done = c.micro_batches;
        self.core.tokens_seen = c.num_tokens;
        self.core.skipped_updates = c.skipped_updates;
    }

    /// Adam's state (its moments are checkpointed).
    pub(crate) fn adam(&self) -> &crate::optim::Adam {
        self.core.optimizer()
    }

    /// Adam's state, to restore a checkpoint's moments into.
    pub(crate) fn adam_mut(&mut self) -> &mut crate::optim::Adam {
        self.core.optimizer_mut()
    }

    /// TRL `_precompute_ref_logps`: the reference's summed logprobs of every pair, in batches of
    /// `precompute_ref_batch_size` (default `per_device_train_batch_size`), from the reference
    /// model or, without one, the policy before its first step.
    pub fn precompute_ref_logps(&self, pairs: &mut [PreferencePair]) -> Result<()> {
        let lm =
            match &self.core.reference {
                Some(r) => r,
                None if self.core.global_step == 0 => &self.core.policy,
                None => return Err(Error::argument(
                    "reference",
                    "cannot precompute the reference logprobs after training started without a reference \
                     model: precompute them before the first step, or pass a reference",
                )),
            };
        let bs = self.config.precompute_ref_batch_size.unwrap_or(self.config.per_device_train_batch_size);
        for chunk in pairs.chunks_mut(bs) {
            let refs: Vec<&PreferencePair> = chunk.iter().collect();
            self.check(&refs, false)?;
            let batch = collate(&self.config, &self.core, &refs)?;
            let sums = sequence_logps(lm, &batch, false)?.1;
            let b = chunk.len();
            for (i, p) in chunk.iter_mut().enumerate() {
                p.ref_logps = Some((sums[i], sums[b + i]));
            }
        }
        Ok(())
    }

    /// One optimizer step over `micro_batches` (transformers' gradient accumulation: each
    /// micro-batch's loss divided by their number). Returns the metrics TRL logs for the step.
    pub fn step(&mut self, micro_batches: &[Vec<&PreferencePair>]) -> Result<Stats> {
        let _awake = self.core.device.is_cpu().then(crate::cpu::keep_pool_awake);
        if micro_batches.is_empty() || micro_batches.iter().any(Vec::is_empty) {
            return Err(Error::batch("a DPO step needs at least one micro-batch of at least one pair"));
        }
        for mb in micro_batches {
            self.check(mb, self.config.precompute_ref_log_probs)?;
        }
        let n = micro_batches.len();
        let (cfg, loss_params) = (self.config.clone(), self.loss.clone());
        let (outs, loss, grad_norm, lr) = self
            .core
            .optimizer_step_accum(n, |core, k| micro_step(core, &cfg, &micro_batches[k], n, &loss_params))?;
        self.micro_done += n;
        self.core.tokens_seen += outs.iter().map(|o| o.n_tokens).sum::<f64>();
        let mut s = Stats::new();
        s.insert("loss".into(), Stat::Scalar(loss));
        s.insert("grad_norm".into(), Stat::Scalar(grad_norm));
        s.insert("learning_rate".into(), Stat::Scalar(lr));
        s.insert("num_tokens".into(), Stat::Scalar(self.core.tokens_seen));
        s.insert("epoch".into(), Stat::Scalar(self.micro_done as f64 / self.batches_per_epoch as f64));
        s.insert("rltune/skipped_updates".into(), Stat::Scalar(self.core.skipped_updates as f64));
        // On several processes: the loss is the mean over them, the tokens their sum.
        crate::engine::stats::reduce_over(self.core.dist(), &mut s, &["num_tokens"])?;
        // Each micro-batch's metrics of the whole global micro-batch: weighted by its tokens or
        // pairs over the processes (the same values on one).
        let mut values: Vec<Vec<f64>> =
            outs.iter().map(|o| o.metrics.iter().map(|m| m.1).collect()).collect();
        if self.core.dist().world_size() > 1 {
            let mut sums: Vec<f64> =
                outs.iter().flat_map(|o| o.metrics.iter().flat_map(|&(_, v, w)| [v * w, w])).collect();
            self.core.dist().sum_f64(&mut sums)?;
            let mut it = sums.chunks(2).map(|c| if c[1] > 0.0 { c[0] / c[1] } else { 0.0 });
            values.iter_mut().flatten().for_each(|v| *v = it.next().unwrap_or(*v));
        }
        // TRL's `log`: each metric averaged over the micro-batches of the step.
        for (i, (name, _, _)) in outs[0].metrics.iter().enumerate() {
            let mean = values.iter().map(|v| v[i]).sum::<f64>() / outs.len() as f64;
            s.insert((*name).into(), Stat::Scalar(mean));
        }
        Ok(s)
    }

    /// Checks the pairs of a micro-batch, naming the pair at fault; `need_ref`: each must carry
    /// finite reference logprobs.
    fn check(&self, pairs: &[&PreferencePair], need_ref: bool) -> Result<()> {
        let vocab = self.core.policy.vocab_size();
        let max_pos = self.core.policy.config().max_positions();
        for p in pairs {
            let bad = |m: String| Err(Error::data(&p.origin, m));
            if p.chosen_ids.is_empty() || p.rejected_ids.is_empty() {
                return bad("empty chosen or rejected completion; each needs at least one token".into());
            }
            if let Some(&t) = p
                .prompt_ids
                .iter()
                .chain(&p.chosen_ids)
                .chain(&p.rejected_ids)
                .find(|&&t| t as usize >= vocab)
            {
                return bad(format!("token id {t} is not below the model's vocab_size {vocab}"));
            }
            if self.config.truncation_mode == TruncationMode::KeepStart
                && self.config.max_len().is_some_and(|m| p.prompt_ids.len() >= m)
            {
                return bad(format!(
                    "the prompt's {} tokens fill max_length = {:?}, leaving no completion token; TRL drops such \
                     rows before training (`prepare_pairs` does): drop it or raise max_length",
                    p.prompt_ids.len(),
                    self.config.max_length
                ));
            }
            for (which, c) in [("chosen", &p.chosen_ids), ("rejected", &p.rejected_ids)] {
                let (ids, mask) = truncate(&p.prompt_ids, c, &self.config);
                if let Some(m) = max_pos.filter(|&m| ids.len() > m) {
                    return bad(format!(
                        "prompt+{which} is {} tokens after truncation but the model has {m} positions; set \
                         max_length ≤ {m}",
                        ids.len()
                    ));
                }
                if mask.iter().skip(1).all(|&x| x == 0) {
                    return bad(format!(
                        "prompt+{which} has no completion token with a logprob (an empty prompt and a one-token \
                         completion); give the prompt at least one token"
                    ));
                }
            }
            if need_ref {
                match p.ref_logps {
                    None => {
                        return bad(
                            "precompute_ref_log_probs is set but the pair has no reference logprobs; \
                                        call precompute_ref_logps first (or give ref_chosen_logps and \
                                        ref_rejected_logps)"
                                .into(),
                        )
                    }
                    Some((c, r)) if !(c.is_finite() && r.is_finite()) => {
                        return bad(format!("reference logprobs ({c}, {r}) are not finite numbers"))
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// TRL's `DataCollatorForPreference` on `pairs` (see the module docs for the layout).
fn collate(cfg: &DpoConfig, core: &Core, pairs: &[&PreferencePair]) -> Result<Collated> {
    let seqs: Vec<(Vec<u32>, Vec<u8>)> = pairs
        .iter()
        .map(|p| truncate(&p.prompt_ids, &p.chosen_ids, cfg))
        .chain(pairs.iter().map(|p| truncate(&p.prompt_ids, &p.rejected_ids, cfg)))
        .collect();
    let rows: Vec<Vec<u32>> = seqs.iter().map(|(ids, _)| ids.clone()).collect();
    let (ids, attn) = pad(&rows, core.pad_id, PaddingSide::Right);
    let (n_seq, l) = (ids.len(), ids[0].len());
    let t = l - 1;
    let (mut flat, mut targets, mut seq_of) = (Vec::new(), Vec::new(), Vec::new());
    for (s, (seq, mask)) in seqs.iter().enumerate() {
        for pos in 0..seq.len().saturating_sub(1) {
            if mask[pos + 1] == 1 {
                flat.push(s * t + pos);
                targets.push(seq[pos + 1]);
                seq_of.push(s);
            }
        }
    }
    let dev = &core.device;
    let input: Vec<Vec<u32>> = ids.iter().map(|r| r[..t].to_vec()).collect();
    let key_mask: Vec<Vec<u8>> = attn.iter().map(|r| r[..t].to_vec()).collect();
    Ok(Collated {
        input: Tensor::new(input, dev)?,
        positions: Tensor::arange(0u32, t as u32, dev)?.unsqueeze(0)?.repeat((n_seq, 1))?,
        bias: causal_bias(&key_mask, t, core.store.dtype(), dev)?,
        targets: Tensor::new(targets, dev)?,
        rows: flat,
        seq_of,
        completion_len: seqs.iter().map(|(_, m)| m.iter().map(|&x| f64::from(x)).sum()).collect(),
        n_tokens: attn.iter().flatten().map(|&x| f64::from(x)).sum(),
    })
}

/// The scored tokens' logprobs `(N)`, hidden states `(N, C)` and entropies `(N)`.
struct TokenOut {
    logp: Tensor,
    hidden: Tensor,
    entropy: Tensor,
}

fn sequence_logps(lm: &CausalLm, batch: &Collated, keep: bool) -> Result<(TokenOut, Vec<f64>)> {
    let (n_seq, t) = batch.input.dims2()?;
    let hidden = lm.forward_rows(&batch.input, &batch.positions, &batch.bias, &batch.rows)?;
    let c = hidden.dim(2)?;
    let idx = Tensor::from_vec(
        batch.rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
        batch.rows.len(),
        hidden.device(),
    )?;
    let h = hidden.reshape((n_seq * t, c))?.index_select(&idx, 0)?;
    let w = lm.lm_head_weight();
    let (logp, entropy) = ops::lm_head_logprobs_with(&h, w, &batch.targets, None, 1.0, keep, lm.grad_slot())?;
    let values = logp.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let mut sums = vec![0f64; n_seq];
    for (v, &s) in values.iter().zip(&batch.seq_of) {
        sums[s] += v;
    }
    let (logp, entropy) = if keep { (logp, entropy) } else { (logp.detach(), entropy.detach()) };
    Ok((TokenOut { logp, hidden: h, entropy: entropy.detach() }, sums))
}

/// Forward, loss and metrics of one micro-batch of `n_micro`; returns the tensor to backpropagate
/// (value: this micro-batch's loss / `n_micro`; gradient: the loss's).
fn micro_step(
    core: &Core,
    cfg: &DpoConfig,
    pairs: &[&PreferencePair],
    n_micro: usize,
    loss_params: &LossParams,
) -> Result<(Tensor, MicroOut)> {
    let batch = collate(cfg, core, pairs)?;
    let b = pairs.len();
    let (tok, sums) = sequence_logps(&core.policy, &batch, true)?;
    let refs: Vec<(f64, f64)> = if cfg.precompute_ref_log_probs {
        pairs.iter().map(|p| p.ref_logps.unwrap_or((f64::NAN, f64::NAN))).collect()
    } else {
        let r = core.reference.as_ref().ok_or_else(|| {
            Error::Internal("no reference model, though the reference logprobs are not precomputed".into())
        })?;
        let rs = sequence_logps(r, &batch, false)?.1;
        (0..b).map(|i| (rs[i], rs[b + i])).collect()
    };
    let mut scored = vec![0f64; 2 * b];
    for &s in &batch.seq_of {
        scored[s] += 1.0;
    }
    let inputs: Vec<PairLogps> = (0..b)
        .map(|i| PairLogps {
            chosen: sums[i],
            rejected: sums[b + i],
            ref_chosen: refs[i].0,
            ref_rejected: refs[i].1,
            chosen_len: batch.completion_len[i],
            rejected_len: batch.completion_len[b + i],
            chosen_scored: scored[i],
        })
        .collect();
    let g = batch_loss(&inputs, loss_params);
    // Surrogate Σ_n w_n · logp_n with w_n = ∂L/∂(its sequence's sum) / n_micro; its value is
    // replaced by the loss's share.
    let w: Vec<f32> = batch
        .seq_of
        .iter()
        .map(|&s| (if s < b { g.d_chosen[s] } else { g.d_rejected[s - b] } / n_micro as f64) as f32)
        .collect();
    let w = Tensor::from_vec(w, batch.seq_of.len(), tok.logp.device())?.to_dtype(tok.logp.dtype())?;
    let surrogate = (&tok.logp * &w)?.sum_all()?;
    let share = g.loss / n_micro as f64;
    let loss_t = (&surrogate - surrogate.detach())?.affine(1.0, share)?;
    let metrics = micro_metrics(core, &batch, &tok, &inputs, cfg.beta)?;
    Ok((loss_t, MicroOut { n_tokens: batch.n_tokens, metrics }))
}

/// The metrics TRL's `_compute_loss` appends for one micro-batch, in its order.
fn micro_metrics(
    core: &Core,
    batch: &Collated,
    tok: &TokenOut,
    pairs: &[PairLogps],
    beta: f64,
) -> Result<Vec<(&'static str, f64, f64)>> {
    let b = pairs.len();
    let entropy = tok.entropy.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let n_tok = entropy.len() as f64;
    let ent = if n_tok > 0.0 { entropy.iter().sum::<f64>() / n_tok } else { 0.0 };
    // Mean logit over the vocabulary: h·mean_v(W_v) (GPT-2 and Llama heads have no bias).
    let w = core.policy.lm_head_weight().detach();
    let h = tok.hidden.detach();
    let w_mean = w.mean(0)?.unsqueeze(1)?; // (C, 1)
    let mean_logits = h.matmul(&w_mean)?.squeeze(1)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let chosen: Vec<usize> = (0..batch.seq_of.len()).filter(|&n| batch.seq_of[n] < b).collect();
    let rejected_n = batch.seq_of.len() - chosen.len();
    let sum_where = |pred: &dyn Fn(usize) -> bool| -> f64 {
        mean_logits.iter().enumerate().filter(|(n, _)| pred(*n)).map(|(_, v)| v).sum()
    };
    let logits_c =
        if chosen.is_empty() { 0.0 } else { sum_where(&|n| batch.seq_of[n] < b) / chosen.len() as f64 };
    let logits_r =
        if rejected_n == 0 { 0.0 } else { sum_where(&|n| batch.seq_of[n] >= b) / rejected_n as f64 };
    let correct = top1_hits(&h, &w, &batch.targets, &chosen)?;
    let accuracy = if chosen.is_empty() { 0.0 } else { correct as f64 / chosen.len() as f64 };
    let nb = b as f64;
    let rc: Vec<f64> = pairs.iter().map(|p| beta * (p.chosen - p.ref_chosen)).collect();
    let rr: Vec<f64> = pairs.iter().map(|p| beta * (p.rejected - p.ref_rejected)).collect();
    let mean = |x: &[f64]| x.iter().sum::<f64>() / nb;
    let (n_c, n_r) = (chosen.len() as f64, rejected_n as f64);
    Ok(vec![
        ("entropy", ent, n_tok),
        ("logits/chosen", logits_c, n_c),
        ("logits/rejected", logits_r, n_r),
        ("mean_token_accuracy", accuracy, n_c),
        ("rewards/chosen", mean(&rc), nb),
        ("rewards/rejected", mean(&rr), nb),
        ("rewards/accuracies", rc.iter().zip(&rr).filter(|(c, r)| c > r).count() as f64 / nb, nb),
        ("rewards/margins", rc.iter().zip(&rr).map(|(c, r)| c - r).sum::<f64>() / nb, nb),
        ("logps/chosen", pairs.iter().map(|p| p.chosen).sum::<f64>() / nb, nb),
        ("logps/rejected", pairs.iter().map(|p| p.rejected).sum::<f64>() / nb, nb),
    ])
}

/// How many of the `rows` of `hidden (N, C)` predict their target as the most likely token
/// (the first maximum, as TRL's `is_top1`); the `(rows, V)` logits are built 256 rows at a time.
fn top1_hits(hidden: &Tensor, weight: &Tensor, targets: &Tensor, rows: &[usize]) -> Result<usize> {
    if rows.is_empty() {
        return Ok(0);
    }
    let targets = targets.to_vec1::<u32>()?;
    let mut hits = 0;
    for chunk in rows.chunks(256) {
        let idx = Tensor::from_vec(
            chunk.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            chunk.len(),
            hidden.device(),
        )?;
        let logits = ops::linear(&hidden.index_select(&idx, 0)?, weight, None)?;
        let best = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        hits += chunk.iter().zip(best).filter(|(&r, b)| targets[r] == *b).count();
    }
    Ok(hits)
}
