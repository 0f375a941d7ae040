//! What GRPO and RLOO share: the rollout batch and its checks, the padded layout TRL uses, the
//! completion logprobs, transformers' AdamW step (decay groups, clipping, schedule) and the
//! generation-side metrics.
//!
//! Batch layout (TRL 1.16's): prompts left-padded to `P`, completions right-padded to `C`, row
//! `b` is `prompt ++ completion`, `L = P + C`. The model runs on `ids[:, :L−1]`; column `t` of
//! the `(B, C)` completion arrays is the logprob of completion token `t`, read from position
//! `P − 1 + t`. Positions are `0..L−1` for every row: TRL's training forward passes no
//! `position_ids`, so transformers numbers left-padded rows from the first pad (a TRL bug that
//! parity needs; see `docs/trl-deviations.md`).

use candle_core::{DType, Device, Tensor};

use super::gigpo::StepCredit;
use super::math::{nanmean, nanstd};
use crate::dist::Dist;
use crate::engine::constraint::{check_allowed, constrained_logprobs};
use crate::engine::{OptimArgs, Optimizer};
use crate::engine::{Stat, Stats};
use crate::error::{Error, Result};
use crate::models::layers::causal_bias;
use crate::models::CausalLm;
use crate::ops;
use crate::optim::Adam;
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide};

/// The rewards of a batch: one column per reward function, NaN where a function gave none
/// (TRL's `None`).
#[derive(Debug, Clone, PartialEq)]
pub struct RewardTable {
    /// The reward functions' names (TRL logs `rewards/<name>/mean`).
    pub names: Vec<String>,
    /// `values[i][f]`: sample `i`'s reward from function `f`, NaN if missing.
    pub values: Vec<Vec<f64>>,
}

impl RewardTable {
    /// One reward function named `reward`, with one value per sample.
    pub fn single(rewards: &[f32]) -> Self {
        Self { names: vec!["reward".into()], values: rewards.iter().map(|&r| vec![r as f64]).collect() }
    }

    /// Episodes' returns as one reward function named `episode_return` (NaN: a lost episode).
    pub fn episode_returns(returns: &[f64]) -> Self {
        Self { names: vec!["episode_return".into()], values: returns.iter().map(|&r| vec![r]).collect() }
    }
}

/// The input of one GRPO or RLOO step: groups of `num_generations` consecutive rows that share
/// their prompt, in TRL's order.
#[derive(Debug, Clone, Copy)]
pub struct GroupBatch<'a> {
    /// Prompt token ids, one row per completion (repeated within a group).
    pub prompts: &'a [Vec<u32>],
    /// Completion token ids.
    pub completions: &'a [Vec<u32>],
    /// The rewards.
    pub rewards: &'a RewardTable,
    /// Whether each completion was cut at the length limit. `None`: TRL's rule, the last token is
    /// neither EOS nor the padding id.
    pub truncated: Option<&'a [bool]>,
    /// With truncated sampling (top-k / top-p / min-p): each completion token's support, the
    /// ids it was drawn from ([`crate::generation::Sample::support`]); the policy's, the old
    /// policy's and the reference's distributions are renormalized over it. `None`: the whole
    /// vocabulary (TRL).
    pub allowed: Option<&'a [Vec<Vec<u32>>]>,
}

/// The input of one trajectory-level GRPO or RLOO step on text games: the turns of groups of
/// `num_generations` episodes of the same game. A group's episodes are compared by their
/// returns, and an episode's advantage is given to every one of its turns.
#[derive(Debug, Clone, Copy)]
pub struct TurnBatch<'a> {
    /// Each turn's prompt.
    pub prompts: &'a [Vec<u32>],
    /// Each turn's action tokens.
    pub completions: &'a [Vec<u32>],
    /// With admissible actions: each action token's allowed set (see `Core::pad`).
    pub allowed: Option<&'a [Vec<Vec<u32>>]>,
    /// Each turn's episode: an index into `returns`.
    pub episodes: &'a [usize],
    /// Each episode's return, in groups of `num_generations` consecutive episodes; NaN for an
    /// episode that was lost (a failed environment), which the group's statistics skip.
    pub returns: &'a [f64],
    /// Turns per forward and backward pass (0: all at once): the turns, ordered by length, are
    /// cut into micro-batches whose gradients are summed, so memory follows this, not the
    /// number of turns a step played.
    pub micro_batch: usize,
    /// GiGPO's step-level credit (GRPO only; [`super::gigpo`]); `None`: trajectory GRPO. Then
    /// an episode's turns must appear in the order they were played.
    pub step_credit: Option<StepCredit<'a>>,
}

/// The padded batch.
pub(crate) struct Padded {
    /// `(B, L)` u32
    pub ids: Tensor,
    /// `(B, L−1)` u32: `0..L−1` on every row (TRL passes no position ids), or each row's own
    /// (see [`Core::pad`]).
    pub positions: Tensor,
    /// `(B, 1, L−1, L−1)`
    pub bias: Tensor,
    /// `(B, C)` f32: 1 on completion tokens that enter the loss.
    pub mask: Tensor,
    /// Flat indices into `(B·(L−1))` of the positions whose hidden state is read.
    pub rows: Vec<usize>,
    /// Padded prompt length `P`.
    pub p_len: usize,
    /// Padded completion length `C`.
    pub c_len: usize,
    /// Sum of `mask` (loss tokens).
    pub n_tokens: f64,
    /// With admissible actions: the allowed tokens of each loss token.
    pub constraint: Option<RowConstraint>,
}

/// The allowed sets of a padded batch's loss tokens (`[agent] actions = "admissible"` on
/// games): the policy's distribution at each is renormalised over its set
/// ([`crate::engine::constraint`]).
pub(crate) struct RowConstraint {
    /// `(N)` u32: the loss tokens' flat indices into `(B·C)`, in row-major order.
    sel: Tensor,
    /// `(N, K)`: the allowed ids, and the mask of the padding of shorter sets.
    idx: Tensor,
    pad: Tensor,
    /// `B·C`: where the `N` values go back (`index_add` into zeros at `sel`).
    rows: usize,
}

/// Policy, reference, optimizer and the counters a run carries.
pub(crate) struct Core {
    pub store: ParamStore,
    pub policy: CausalLm,
    pub reference: Option<CausalLm>,
    /// AdamW with its decay groups, clipping and schedule.
    opt: Optimizer,
    pub temperature: f64,
    /// Optimizer steps taken.
    pub global_step: usize,
    /// `step()` calls completed (TRL's epochs, a batch being one epoch's data).
    pub calls: usize,
    /// Prompt and completion tokens seen (`num_tokens`).
    pub tokens_seen: f64,
    /// Updates skipped for a non-finite loss or gradient.
    pub skipped_updates: usize,
    pub pad_id: u32,
    pub eos_ids: Vec<u32>,
    pub device: Device,
}

/// The reference a GRPO/RLOO step uses: none when `beta == 0` (TRL loads none), else `reference`
/// or, without one, a frozen copy of the policy's weights in `store` as they are now, as TRL
/// 1.16.0 does when no `ref_model` is given (`create_model_from_path` on the policy's path).
pub(crate) fn reference_or_frozen_policy(
    beta: f64,
    reference: Option<CausalLm>,
    store: &ParamStore,
    policy: &CausalLm,
) -> Result<Option<CausalLm>> {
    if beta == 0.0 {
        return Ok(None);
    }
    match reference {
        Some(r) => Ok(Some(r)),
        None => Ok(Some(CausalLm::load(&store.frozen_copy()?.root(), policy.config())?)),
    }
}

impl Core {
    pub fn new(
        store: ParamStore,
        policy: CausalLm,
        reference: Option<CausalLm>,
        optim: OptimArgs,
        temperature: f64,
    ) -> Result<Self> {
        if !store.trainable() {
            return Err(Error::argument("policy", "its parameters must be trainable"));
        }
        let cfg = policy.config();
        let eos_ids = cfg.eos_token_ids();
        let pad_id = cfg.pad_token_id().or(eos_ids.first().copied()).unwrap_or(0);
        let device = store.device().clone();
        let opt = Optimizer::new(&store, optim)?;
        Ok(Self {
            store,
            policy,
            reference,
            opt,
            temperature,
            global_step: 0,
            calls: 0,
            tokens_seen: 0.0,
            skipped_updates: 0,
            pad_id,
            eos_ids,
            device,
        })
    }

    /// Trains on `dist`'s processes: the optimizer averages the gradients over them and the
    /// statistics are the whole batch's.
    pub fn set_dist(&mut self, dist: Dist) {
        self.opt.set_dist(dist);
    }

    /// The processes this trainer trains with (its optimizer's).
    pub fn dist(&self) -> &Dist {
        self.opt.dist()
    }

    /// The optimizer (its moments are checkpointed).
    pub fn optimizer(&self) -> &Adam {
        self.opt.adam()
    }

    /// The optimizer, to restore its moments.
    pub fn optimizer_mut(&mut self) -> &mut Adam {
        self.opt.adam_mut()
    }

    /// Checks a batch against the config and the model, naming the row at fault; returns the
    /// truncation flags.
    pub fn check(
        &self,
        batch: &GroupBatch,
        g: usize,
        max_completion_length: usize,
        batch_size: Option<usize>,
        weights: Option<&[f64]>,
    ) -> Result<Vec<bool>> {
        let n = batch.prompts.len();
        let bad = |m: String| Err(Error::batch(m));
        let at = |i: usize, m: String| Err(Error::row_of("row", i, m));
        if n == 0 {
            return bad("no rollouts: a step needs at least one group of num_generations completions".into());
        }
        if batch.completions.len() != n || batch.rewards.values.len() != n {
            return bad(format!(
                "{n} prompts, {} completions and {} reward rows; give one of each per completion",
                batch.completions.len(),
                batch.rewards.values.len()
            ));
        }
        if !n.is_multiple_of(g) {
            return bad(format!(
                "{n} rollouts is not a multiple of num_generations = {g}: each prompt needs exactly {g} \
                 consecutive completions"
            ));
        }
        if let Some(bs) = batch_size.filter(|&bs| bs != n) {
            return bad(format!(
                "{n} rollouts but per_device_train_batch_size is {bs}; one step trains on the whole \
                 batch: make them equal (or remove per_device_train_batch_size)"
            ));
        }
        let nf = batch.rewards.names.len();
        if nf == 0 {
            return bad("no reward function: every rollout needs a reward".into());
        }
        if let Some(w) = weights.filter(|w| w.len() != nf) {
            return bad(format!(
                "reward_weights has {} weights but there are {nf} reward functions ({}); give one weight each",
                w.len(),
                batch.rewards.names.join(", ")
            ));
        }
        let vocab = self.policy.vocab_size();
        let (mut p_max, mut c_max) = (0, 0);
        for i in 0..n {
            let (p, c) = (&batch.prompts[i], &batch.completions[i]);
            let first = i - i % g;
            if *p != batch.prompts[first] {
                return at(
                    i,
                    format!(
                        "its prompt differs from row {first}'s, the first of its group (rows {first}..{}); \
                         consecutive rows with the same prompt form a group of num_generations = {g}",
                        first + g - 1
                    ),
                );
            }
            if p.is_empty() {
                return at(i, "empty prompt; every prompt needs at least one token".into());
            }
            if c.is_empty() {
                return at(
                    i,
                    "empty completion; a completion needs at least one token (an immediate stop is the \
                     EOS token; TRL fails on an empty one)"
                        .into(),
                );
            }
            if c.len() > max_completion_length {
                return at(
                    i,
                    format!(
                        "completion of {} tokens but max_completion_length is {max_completion_length}; \
                         raise max_completion_length",
                        c.len()
                    ),
                );
            }
            if let Some(&t) = p.iter().chain(c).find(|&&t| t as usize >= vocab) {
                return at(i, format!("token id {t} is not below the model's vocab_size {vocab}"));
            }
            let row = &batch.rewards.values[i];
            if row.len() != nf {
                return at(i, format!("{} rewards for {nf} reward functions", row.len()));
            }
            if let Some(r) = row.iter().find(|r| r.is_infinite()) {
                return at(i, format!("reward {r} is infinite; rewards must be finite or missing"));
            }
            p_max = p_max.max(p.len());
            c_max = c_max.max(c.len());
        }
        if let Some(max) = self.policy.config().max_positions().filter(|&m| p_max + c_max > m) {
            return bad(format!(
                "the longest prompt ({p_max}) plus the longest completion ({c_max}) is {} tokens but the \
                 model has {max} positions (TRL pads every row to that length); shorten them",
                p_max + c_max
            ));
        }
        match batch.truncated {
            Some(t) if t.len() != n => bad(format!("{} truncation flags for {n} rollouts", t.len())),
            Some(t) => Ok(t.to_vec()),
            None => Ok(batch
                .completions
                .iter()
                .map(|c| c.last().is_some_and(|t| !self.eos_ids.contains(t) && *t != self.pad_id))
                .collect()),
        }
    }

    /// A [`TurnBatch`]'s turns as padded micro-batches, each with the indices of its turns: all
    /// of them in their order with `micro_batch = 0` (or not below the number of turns), else
    /// ordered by length (prompt and action) and cut into `micro_batch` turns each, so each pads
    /// to its own longest. Positions are each row's own.
    pub fn turn_chunks(&self, batch: &TurnBatch) -> Result<Vec<(Vec<usize>, Padded)>> {
        let n = batch.prompts.len();
        let m = if batch.micro_batch == 0 { n } else { batch.micro_batch.min(n) };
        let mut order: Vec<usize> = (0..n).collect();
        if m < n {
            order.sort_by_key(|&i| batch.prompts[i].len() + batch.completions[i].len());
        }
        order
            .chunks(m.max(1))
            .map(|idx| {
                let pick = |v: &[Vec<u32>]| idx.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
                let allowed: Option<Vec<Vec<Vec<u32>>>> =
                    batch.allowed.map(|a| idx.iter().map(|&i| a[i].clone()).collect());
                let padded = self.pad(
                    &pick(batch.prompts),
                    &pick(batch.completions),
                    &vec![true; idx.len()],
                    allowed.as_deref(),
                    true,
                )?;
                Ok((idx.to_vec(), padded))
            })
            .collect()
    }

    /// Checks a [`TurnBatch`] against the config and the model, naming the turn at fault.
    pub fn check_turns(&self, batch: &TurnBatch, g: usize, max_completion_length: usize) -> Result<()> {
        let bad = |m: String| Err(Error::batch(m));
        let at = |i: usize, m: String| Err(Error::row_of("turn", i, m));
        let (n, e) = (batch.prompts.len(), batch.returns.len());
        if e == 0 || !e.is_multiple_of(g) {
            return bad(format!(
                "{e} episodes is not a positive multiple of num_generations = {g}: each game needs exactly \
                 {g} consecutive episodes"
            ));
        }
        if batch.completions.len() != n || batch.episodes.len() != n {
            return bad(format!(
                "{n} prompts, {} completions and {} episode indices; give one of each per turn",
                batch.completions.len(),
                batch.episodes.len()
            ));
        }
        if n == 0 {
            return bad("no turns: every episode ended before its first action".into());
        }
        if let Some(c) = &batch.step_credit {
            if c.rewards.len() != n || c.states.len() != n {
                return bad(format!(
                    "GiGPO: {n} turns but {} step rewards and {} anchor states; give one of each per turn",
                    c.rewards.len(),
                    c.states.len()
                ));
            }
            if let Some(i) = c.rewards.iter().position(|r| !r.is_finite()) {
                return at(i, format!("GiGPO: its step reward {} is not finite", c.rewards[i]));
            }
            c.args.validate()?;
        }
        if let Some(r) = batch.returns.iter().find(|r| r.is_infinite()) {
            return bad(format!("episode return {r} is infinite; returns must be finite"));
        }
        let vocab = self.policy.vocab_size();
        for i in 0..n {
            let (p, c, ep) = (&batch.prompts[i], &batch.completions[i], batch.episodes[i]);
            if ep >= e || batch.returns[ep].is_nan() {
                return at(i, format!("episode {ep} has no return (of {e} episodes)"));
            }
            if p.is_empty() || c.is_empty() {
                return at(i, "an empty prompt or action; each needs at least one token".into());
            }
            // An admissible command is as long as the game's command (its trie bounds it).
            if batch.allowed.is_none() && c.len() > max_completion_length {
                return at(
                    i,
                    format!(
                        "an action of {} tokens but max_completion_length is {max_completion_length}",
                        c.len()
                    ),
                );
            }
            if let Some(&t) = p.iter().chain(c).find(|&&t| t as usize >= vocab) {
                return at(i, format!("token id {t} is not below the model's vocab_size {vocab}"));
            }
            if let Some(max) = self.policy.config().max_positions().filter(|&m| p.len() + c.len() > m) {
                return at(
                    i,
                    format!(
                        "its prompt ({} tokens) and action ({}) are longer than the model's {max} \
                         positions; shorten the prompt ([agent] memory_turns) or the actions",
                        p.len(),
                        c.len()
                    ),
                );
            }
        }
        Ok(())
    }

    /// Pads the batch as TRL does; `in_loss[i]` false drops row `i` from the loss and from
    /// attention (`mask_truncated_completions`). `allowed[i][t]`: the tokens allowed at
    /// completion token `t` of row `i` (admissible actions), which must contain it.
    ///
    /// `own_positions`: number each row's tokens from its first real one (the left padding at
    /// 0, the right padding at the row's last), so a row fits the model when its own prompt and
    /// completion do; without, every row is numbered `0..L−1` as TRL's training forward does.
    pub fn pad(
        &self,
        prompts: &[Vec<u32>],
        completions: &[Vec<u32>],
        in_loss: &[bool],
        allowed: Option<&[Vec<Vec<u32>>]>,
        own_positions: bool,
    ) -> Result<Padded> {
        let (p_ids, p_mask) = pad(prompts, self.pad_id, PaddingSide::Left);
        let (c_ids, mut c_mask) = pad(completions, self.pad_id, PaddingSide::Right);
        for (m, keep) in c_mask.iter_mut().zip(in_loss) {
            if !keep {
                m.iter_mut().for_each(|x| *x = 0);
            }
        }
        let (b, p_len, c_len) = (prompts.len(), p_ids[0].len(), c_ids[0].len());
        let l = p_len + c_len;
        let ids: Vec<Vec<u32>> = p_ids.iter().zip(&c_ids).map(|(p, c)| [p.as_slice(), c].concat()).collect();
        let attn: Vec<Vec<u8>> = p_mask
            .iter()
            .zip(&c_mask)
            .map(|(p, c)| p.iter().chain(c).copied().take(l - 1).collect())
            .collect();
        let mut rows = Vec::new();
        let mut mask = vec![0f32; b * c_len];
        for (i, m) in c_mask.iter().enumerate() {
            for (t, &x) in m.iter().enumerate() {
                if x == 1 {
                    mask[i * c_len + t] = 1.0;
                    rows.push(i * (l - 1) + p_len - 1 + t);
                }
            }
        }
        let dt = self.store.dtype();
        let constraint = match allowed {
            Some(sets) => Some(self.row_constraint(completions, &mask, c_len, sets)?),
            None => None,
        };
        Ok(Padded {
            constraint,
            ids: Tensor::new(ids, &self.device)?,
            positions: if own_positions {
                // Right padding repeats the row's last position (it is masked out).
                let pos: Vec<u32> = prompts
                    .iter()
                    .zip(completions)
                    .flat_map(|(p, c)| {
                        let last = (p.len() + c.len()).saturating_sub(1);
                        (0..l - 1).map(move |t| t.saturating_sub(p_len - p.len()).min(last) as u32)
                    })
                    .collect();
                Tensor::from_vec(pos, (b, l - 1), &self.device)?
            } else {
                Tensor::arange(0u32, (l - 1) as u32, &self.device)?.unsqueeze(0)?.repeat((b, 1))?
            },
            bias: causal_bias(&attn, l - 1, dt, &self.device)?,
            n_tokens: mask.iter().map(|&x| x as f64).sum(),
            mask: Tensor::from_vec(mask, (b, c_len), &self.device)?.to_dtype(dt)?,
            rows,
            p_len,
            c_len,
        })
    }

    /// The [`RowConstraint`] of the loss tokens (`mask (B·C)`), checking each set holds its token.
    fn row_constraint(
        &self,
        completions: &[Vec<u32>],
        mask: &[f32],
        c_len: usize,
        sets: &[Vec<Vec<u32>>],
    ) -> Result<RowConstraint> {
        check_allowed(completions, sets, "allowed", "row", "completion")?;
        let mut sel = Vec::new();
        let mut picked: Vec<&[u32]> = Vec::new();
        for (i, a) in sets.iter().enumerate() {
            for (t, set) in a.iter().enumerate() {
                if mask[i * c_len + t] == 1.0 {
                    sel.push((i * c_len + t) as u32);
                    picked.push(set);
                }
            }
        }
        let (idx, pad) = crate::engine::constraint::row_sets(&picked, &self.device)?;
        let n = sel.len();
        Ok(RowConstraint {
            sel: Tensor::from_vec(sel, n, &self.device)?,
            idx,
            pad,
            rows: completions.len() * c_len,
        })
    }

    /// Logprobs of the completion tokens and the entropies, each `(B, C)`, 0 outside the mask;
    /// logits divided by the temperature. TRL `_get_per_token_logps_and_entropies` (its fused
    /// LM head scores only labels ≠ −100). `keep`: a backward follows.
    pub fn logprobs(&self, lm: &CausalLm, batch: &Padded, keep: bool) -> Result<(Tensor, Tensor)> {
        let l = batch.ids.dim(1)?;
        let (b, c) = (batch.ids.dim(0)?, batch.c_len);
        let input = batch.ids.narrow(1, 0, l - 1)?;
        let hidden = lm.forward_rows(&input, &batch.positions, &batch.bias, &batch.rows)?;
        let h = hidden.narrow(1, batch.p_len - 1, c)?.reshape((b * c, hidden.dim(2)?))?;
        let targets = batch.ids.narrow(1, batch.p_len, c)?.flatten_all()?;
        let (logp, entropy) = match &batch.constraint {
            // The loss tokens' hidden states only (the others may be unspecified), renormalised
            // over their sets, then put back in place.
            Some(rc) => {
                let (lp, ent) = constrained_logprobs(
                    &h.index_select(&rc.sel, 0)?,
                    lm.lm_head_weight(),
                    lm.grad_slot(),
                    &targets.index_select(&rc.sel, 0)?,
                    &rc.idx,
                    &rc.pad,
                    self.temperature,
                )?;
                let back = |x: Tensor| {
                    let x = x.to_dtype(self.store.dtype())?;
                    Tensor::zeros(rc.rows, x.dtype(), x.device())?.index_add(&rc.sel, &x, 0)
                };
                (back(lp)?, back(ent.detach())?)
            }
            None => {
                let select = batch.mask.flatten_all()?;
                ops::lm_head_logprobs_with(
                    &h,
                    lm.lm_head_weight(),
                    &targets,
                    Some(&select),
                    self.temperature,
                    keep,
                    lm.grad_slot(),
                )?
            }
        };
        Ok((logp.reshape((b, c))?, entropy.reshape((b, c))?.detach()))
    }

    /// `xs` (the rows' advantages) as a `(N, 1)` column in the store's dtype.
    pub fn column(&self, xs: &[f64]) -> Result<Tensor> {
        let v: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
        Ok(Tensor::from_vec(v, (xs.len(), 1), &self.device)?.to_dtype(self.store.dtype())?)
    }

    /// Logprobs `(B, C)` of `lm` with no gradient.
    pub fn logprobs_no_grad(&self, lm: &CausalLm, batch: &Padded) -> Result<Tensor> {
        Ok(self.logprobs(lm, batch, false)?.0.detach())
    }

    /// One transformers `Trainer` optimizer step over `micro_batches` forward/backward passes
    /// (run with the gradient buffers installed) whose gradients are summed (transformers'
    /// gradient accumulation: each `forward(core, k)` returns its part of the loss, already
    /// weighted): backward, `clip_grad_norm_(max_grad_norm)`, AdamW at the schedule's learning
    /// rate (decay `p ← p·(1 − lr·wd)` on the decay group first, as torch's AdamW), then the
    /// schedule advances. Returns each pass's extra, the summed loss, the pre-clip gradient norm
    /// and the learning rate. The passes stop at the first non-finite loss, and the update is
    /// skipped: no weight changes and `skipped_updates` counts it.
    pub fn optimizer_step_accum<T>(
        &mut self,
        micro_batches: usize,
        mut forward: impl FnMut(&Self, usize) -> Result<(Tensor, T)>,
    ) -> Result<(Vec<T>, f64, f64, f64)> {
        let (mut grads, lr) = self.opt.begin(self.global_step);
        let result: Result<(Vec<T>, f64, f64)> = (|| {
            let (mut extras, mut loss_sum) = (Vec::with_capacity(micro_batches), 0f64);
            for k in 0..micro_batches {
                let (loss, extra) = forward(self, k)?;
                extras.push(extra);
                let loss_value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                loss_sum += loss_value;
                if !loss_value.is_finite() {
                    break;
                }
                grads.backward(&loss)?;
            }
            // In a data-parallel run the processes agree first: a non-finite loss on any of them
            // skips the update on all (none waits in an all-reduce another never joins).
            if self.dist().sum(f64::from(u8::from(!loss_sum.is_finite())))? > 0.0 {
                return Ok((extras, loss_sum, f64::NAN));
            }
            let norm = self.opt.clip(&mut grads)?;
            Ok((extras, loss_sum, norm))
        })();
        let (extras, loss_value, norm) = result?;
        if !self.opt.finish(grads, lr, norm)? {
            self.skipped_updates += 1;
            tracing::warn!(
                "update skipped: the loss or gradient is not finite, so no weight changed ({} so far)",
                self.skipped_updates
            );
        }
        self.global_step += 1;
        Ok((extras, loss_value, norm, lr))
    }
}

/// Whose rows and tokens normalise the loss of a data-parallel step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Normaliser {
    /// This process's own, as TRL normalises each process's batch (on prompts the processes
    /// hold equal numbers of rows).
    Local,
    /// Every process's, over the number of processes: the averaged gradient is the global
    /// batch's even when the processes hold different numbers of rows (the turns of games).
    Global,
}

impl Normaliser {
    /// The rows and loss tokens the normaliser counts, given this process's.
    pub(crate) fn totals(self, dist: &Dist, rows: usize, tokens: f64) -> Result<(f64, f64)> {
        match self {
            Self::Local => Ok((rows as f64, tokens)),
            Self::Global => {
                let world = dist.world_size() as f64;
                let mut sums = [rows as f64, tokens];
                dist.sum_f64(&mut sums)?;
                Ok((sums[0] / world, sums[1] / world))
            }
        }
    }
}

/// The rewards of the whole batch, over every process in rank order (as TRL gathers them before
/// the advantages): on one process, `table` itself.
pub(crate) fn global_rewards(dist: &Dist, table: &RewardTable) -> Result<RewardTable> {
    let nf = table.names.len();
    let flat: Vec<f64> = table.values.iter().flatten().copied().collect();
    let all = dist.gather_f64(&flat)?;
    Ok(RewardTable {
        names: table.names.clone(),
        values: all.chunks(nf.max(1)).map(<[f64]>::to_vec).collect(),
    })
}

/// This process's rows within the global batch, each process holding `n`.
pub(crate) fn local_rows(dist: &Dist, n: usize) -> std::ops::Range<usize> {
    let r = dist.rank();
    r * n..(r + 1) * n
}

/// The generation-side metrics TRL logs for every batch: `num_tokens` (running), `completions/*`,
/// `rewards/<name>/{mean,std}`, `reward` and `reward_std` (the weighted sum over scorable samples).
/// TRL `_generate` and `_generate_and_score_completions`.
///
/// Over the whole batch: in a data-parallel run `table` holds every process's rewards
/// ([`global_rewards`]) and the lengths are gathered here (every process must call it).
pub(crate) fn generation_stats(
    core: &mut Core,
    prompts: &[Vec<u32>],
    completions: &[Vec<u32>],
    table: &RewardTable,
    truncated: &[bool],
    weights: &[f64],
) -> Result<Stats> {
    let mut s = Stats::new();
    let plen = core.dist().sum(prompts.iter().map(|p| p.len() as f64).sum())?;
    let lens: Vec<f64> = completions.iter().map(|c| c.len() as f64).collect();
    // Per row: the processes hold different numbers of turns on games.
    let lens = core.dist().gather_var_f64(&lens)?.0;
    let truncated: Vec<bool> = core
        .dist()
        .gather_var_f64(&truncated.iter().map(|&t| f64::from(u8::from(t))).collect::<Vec<_>>())?
        .0
        .into_iter()
        .map(|t| t != 0.0)
        .collect();
    core.tokens_seen += plen + lens.iter().sum::<f64>();
    s.insert("num_tokens".into(), Stat::Scalar(core.tokens_seen));
    let stats3 = |xs: &[f64]| {
        let xs = if xs.is_empty() { vec![0.0] } else { xs.to_vec() };
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        (
            mean,
            xs.iter().copied().fold(f64::INFINITY, f64::min),
            xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    let (mean, min, max) = stats3(&lens);
    s.insert("completions/mean_length".into(), Stat::Scalar(mean));
    s.insert("completions/min_length".into(), Stat::Scalar(min));
    s.insert("completions/max_length".into(), Stat::Scalar(max));
    let clipped = truncated.iter().filter(|t| **t).count() as f64 / truncated.len() as f64;
    s.insert("completions/clipped_ratio".into(), Stat::Scalar(clipped));
    let term: Vec<f64> = lens.iter().zip(&truncated).filter(|(_, t)| !**t).map(|(l, _)| *l).collect();
    let (mean, min, max) = stats3(&term);
    s.insert("completions/mean_terminated_length".into(), Stat::Scalar(mean));
    s.insert("completions/min_terminated_length".into(), Stat::Scalar(min));
    s.insert("completions/max_terminated_length".into(), Stat::Scalar(max));
    for (f, name) in table.names.iter().enumerate() {
        let col: Vec<f64> = table.values.iter().map(|r| r[f]).collect();
        s.insert(format!("rewards/{name}/mean"), Stat::Scalar(nanmean(&col)));
        s.insert(format!("rewards/{name}/std"), Stat::Scalar(nanstd(&col)));
    }
    let r = super::math::weighted_rewards(&table.values, weights);
    s.insert("reward".into(), Stat::Scalar(nanmean(&r)));
    s.insert("reward_std".into(), Stat::Scalar(nanstd(&r)));
    Ok(s)
}

/// [`generation_stats`] of a [`TurnBatch`]: its turns' lengths, and the episodes' returns as the
/// one reward function (`rewards/episode_return/*`, `reward`; `returns`: every process's, from
/// [`RewardTable::episode_returns`] of the gathered returns); no action counts as cut.
pub(crate) fn turn_generation_stats(
    core: &mut Core,
    batch: &TurnBatch,
    returns: &RewardTable,
) -> Result<Stats> {
    let no_cut = vec![false; batch.prompts.len()];
    generation_stats(core, batch.prompts, batch.completions, returns, &no_cut, &[1.0])
}

/// The reward weights: the configured ones, else 1 per function.
pub(crate) fn weights_or_ones(weights: Option<&[f64]>, n: usize) -> Vec<f64> {
    weights.map(<[f64]>::to_vec).unwrap_or_else(|| vec![1.0; n])
}

/// `(B, T)` or `(B, 1)` tensor to rows of f64.
pub(crate) fn rows(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(t.to_dtype(DType::F64)?.to_vec2()?)
}
