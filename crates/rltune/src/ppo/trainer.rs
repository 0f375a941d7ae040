//! `PpoTrainer::step(queries, responses, scores)`: TRL 0.11.4's classic PPO step.
//!
//! One call, top to bottom: forward the policy (logprobs, values) and the frozen reference
//! (logprobs) → per-token KL penalty → score on the last response token → GAE and whitened
//! advantages → epochs of shuffled minibatches with the clipped losses and Adam → KL controller
//! update → stats under TRL's names.
//!
//! Batch layout (TRL's): row i is `query_i ++ response_i`, right-padded to L. Per-token arrays
//! are `(B, L−1)`: column t holds the logprob of token t+1 and the value of the state at t. The
//! mask is 1 on columns `[len(q)−1, len(q)−1+len(r))`.
//!
//! Deliberate deviations from TRL 0.11.4 (each where TRL has a bug; see `docs/trl-deviations.md`):
//! - `max_grad_norm` clips every update (TRL only the first: its parameter iterator is consumed).
//! - A minibatch over `ratio_threshold` is skipped (TRL zeroes its loss but still steps Adam).
//! - A non-finite loss or gradient never reaches the weights: that update is skipped, counted in
//!   `rltune/skipped_updates` and logged (TRL steps Adam and spreads the NaN).
//! - `use_score_scaling` works (it crashes in TRL).
//! - `whiten_rewards` keeps padding at zero (TRL leaks it into the advantages).
//! - Position ids come from the attention mask, so left padding does not shift positions.
//! - No dropout anywhere (TRL's value head applies dropout 0.1 unless configured off).
//!
//! Options TRL lacks: an MLP value head (`value_head`), a detached value head
//! (`detach_value_head`), and a separate critic with its own optimizer ([`super::critic`]).

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::config::PpoConfig;
use super::critic::Critic;
use super::kl_control::KlController;
use super::math::{self, scalar, KlPenalty};
use super::optim::{Adam, AdamConfig, FusedStep, Grads};
use super::stats::{mean_std, Stat, Stats};
use crate::error::{Error, Result};
use crate::models::layers::causal_bias;
use crate::models::{CausalLm, CausalLmWithValueHead};
use crate::ops;
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide};

/// What the rollout already computed for one sample: reused instead of a second policy forward.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCache {
    /// Logprob of each response token (under the training temperature).
    pub logprobs: Vec<f32>,
    /// Value of the state before each response token.
    pub values: Vec<f32>,
}

/// The inputs of one PPO step.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// Query token ids, one row per sample.
    pub queries: &'a [Vec<u32>],
    /// Response token ids (non-empty).
    pub responses: &'a [Vec<u32>],
    /// One score per sample.
    pub scores: &'a [f32],
    /// Optional 0/1 mask per response token (e.g. to train only on the agent's turns).
    pub response_masks: Option<&'a [Vec<u8>]>,
    /// Optional logprobs and values from generation (rollout caching).
    pub rollout: Option<&'a [RolloutCache]>,
    /// Optional value of the state after each response, bootstrapped at its last token
    /// ([`math::bootstrap_last`]): for a turn of a multi-turn episode, `game_gamma · V(next
    /// turn)`, or 0 when the episode terminated. `None` (TRL's step) is 0 for every sample.
    pub bootstrap: Option<&'a [f32]>,
}

/// Running mean and variance of scores. TRL `trainer/utils.py::RunningMoments`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunningMoments {
    /// Running mean.
    pub mean: f64,
    /// Running (biased) variance.
    pub var: f64,
    /// Running unbiased standard deviation.
    pub std: f64,
    /// Scores seen (starts at 1e-24, as TRL's).
    pub count: f64,
}

/// The state a trainer carries from one step to the next besides the weights, Adam and the
/// KL controller; a checkpoint saves it so that a resumed run continues bit for bit.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerStreams {
    /// Position (in 32-bit words) of the minibatch-shuffle stream, ChaCha12 seeded with
    /// `[ppo] seed` (the stream of rand's `StdRng`).
    pub shuffle_word_pos: u128,
    /// The running score moments (`use_score_scaling`, `use_score_norm`).
    pub score_moments: RunningMoments,
}

impl RunningMoments {
    fn new() -> Self {
        Self { mean: 0.0, var: 1.0, std: 1.0, count: 1e-24 }
    }

    fn update(&mut self, xs: &[f64]) {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        let delta = mean - self.mean;
        let tot = self.count + n;
        let old_sum = self.var * self.count + delta * delta * self.count * n / tot;
        let new_var = (old_sum + var * n) / tot;
        self.mean += delta * n / tot;
        self.std = (new_var * tot / (tot - 1.0)).sqrt();
        self.var = new_var;
        self.count = tot;
    }
}

/// Why a minibatch ran no backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skip {
    /// It ran one.
    No,
    /// Its mean ratio exceeded `ratio_threshold`.
    Ratio,
    /// Its loss was NaN or infinite.
    NonFinite,
}

/// Whether a minibatch's `loss/total` is finite (a skipped one reports 0).
fn loss_is_finite(stats: &Stats) -> bool {
    stats.get("loss/total").and_then(Stat::as_f64).is_none_or(f64::is_finite)
}

/// The padded batch and the tensors every minibatch slices from.
///
/// The models only ever run on the first `L − 1` tokens: the last position's output would
/// predict a token outside the batch, and causal attention keeps it out of every other
/// position's output, so leaving it out changes no number (TRL runs the whole sequence and
/// drops that output).
pub(super) struct Batch {
    /// `(B, L)` u32: the model's input is `ids[:, :L−1]`, the targets `ids[:, 1:]`.
    pub(super) ids: Tensor,
    /// `(B, L−1)` u32
    pub(super) positions: Tensor,
    /// `(B, 1, L−1, L−1)`
    pub(super) bias: Tensor,
    /// `(B, L−1)` f32
    pub(super) mask: Tensor,
    /// `(B, L−1)` f32: 1 on every response column (the mask before `response_masks`), where
    /// the rollout cache has logprobs.
    pub(super) response: Tensor,
}

/// Per-token rollout quantities of a batch, each `(B, L−1)`.
struct Rollout {
    logprobs: Tensor,
    ref_logprobs: Tensor,
    values: Tensor,
    /// Full log-distributions `(B, L−1, V)`, only for `kl_penalty = "full"`.
    full: Option<(Tensor, Tensor)>,
    /// Whether `logprobs` came from the rollout cache (0 outside the responses).
    cached: bool,
}

/// TRL's classic PPO trainer.
pub struct PpoTrainer {
    /// Hyper-parameters.
    pub config: PpoConfig,
    /// The policy: LM and value head.
    pub policy: CausalLmWithValueHead,
    /// The policy's trainable parameters.
    pub store: ParamStore,
    /// The frozen reference model.
    pub reference: CausalLm,
    /// A separate critic ([`Self::with_critic`]); `None`: the policy's value head (TRL).
    pub(super) critic: Option<Critic>,
    optimizer: Adam,
    /// The gradient buffers, kept between steps (`None` until the first, or after an error).
    grads: Option<Grads>,
    kl_ctl: KlController,
    /// The minibatch shuffles: `StdRng`'s generator, used directly so that its position can be
    /// saved and restored ([`TrainerStreams`]).
    rng: rand_chacha::ChaCha12Rng,
    running: RunningMoments,
    /// Optimizer updates skipped for a non-finite loss or gradient, over the trainer's life.
    skipped_updates: usize,
    pad_id: u32,
    eos_ids: Vec<u32>,
    /// Minibatch orders to use instead of the seeded shuffle (for parity with recorded runs).
    forced_permutations: VecDeque<Vec<usize>>,
    /// When set, the gradients of the next optimizer step are kept (for parity tests).
    record_grads: bool,
    recorded_grads: Option<Vec<(String, Tensor)>>,
    var_names: Vec<String>,
    device: Device,
}

impl PpoTrainer {
    /// A trainer over a trainable `store` holding the policy (and its value head) and a frozen
    /// `reference` model.
    pub fn new(
        config: PpoConfig,
        store: ParamStore,
        policy: CausalLmWithValueHead,
        reference: CausalLm,
    ) -> Result<Self> {
        config.validate().map_err(Error::Input)?;
        if store.device().is_cpu() {
            crate::cpu::flush_denormals();
        }
        if !store.trainable() {
            return Err(Error::Input("the policy's parameters must be trainable".into()));
        }
        let (var_names, vars): (Vec<_>, Vec<_>) = store.vars().into_iter().unzip();
        let adam = AdamConfig { lr: config.learning_rate, ..Default::default() };
        let kl_ctl = if config.adap_kl_ctrl {
            KlController::Adaptive {
                value: config.init_kl_coef,
                target: config.target,
                horizon: config.horizon,
            }
        } else {
            KlController::Fixed { value: config.init_kl_coef }
        };
        let lm_cfg = policy.lm.config();
        let eos_ids = lm_cfg.eos_token_ids();
        let pad_id = lm_cfg.pad_token_id().or(eos_ids.first().copied()).unwrap_or(0);
        let device = store.device().clone();
        Ok(Self {
            rng: rand_chacha::ChaCha12Rng::seed_from_u64(config.seed),
            config,
            policy,
            store,
            reference,
            critic: None,
            optimizer: Adam::new(vars, adam)?,
            grads: None,
            kl_ctl,
            running: RunningMoments::new(),
            skipped_updates: 0,
            pad_id,
            eos_ids,
            forced_permutations: VecDeque::new(),
            record_grads: false,
            recorded_grads: None,
            var_names,
            device,
        })
    }

    /// The current KL controller.
    pub fn kl_controller(&self) -> &KlController {
        &self.kl_ctl
    }

    /// The KL controller, to restore it from a checkpoint.
    pub fn kl_controller_mut(&mut self) -> &mut KlController {
        &mut self.kl_ctl
    }

    /// The optimizer (its moments go into checkpoints).
    pub fn optimizer(&self) -> &Adam {
        &self.optimizer
    }

    /// Mutable optimizer (to restore a checkpoint).
    pub fn optimizer_mut(&mut self) -> &mut Adam {
        &mut self.optimizer
    }

    /// The shuffle stream's position and the score moments, for a checkpoint.
    pub fn streams(&self) -> TrainerStreams {
        TrainerStreams { shuffle_word_pos: self.rng.get_word_pos(), score_moments: self.running.clone() }
    }

    /// Restores what [`Self::streams`] saved (the trainer must use the same `[ppo] seed`).
    pub fn restore_streams(&mut self, s: &TrainerStreams) {
        self.rng = rand_chacha::ChaCha12Rng::seed_from_u64(self.config.seed);
        self.rng.set_word_pos(s.shuffle_word_pos);
        self.running = s.score_moments.clone();
    }

    /// Optimizer updates skipped so far for a non-finite loss or gradient.
    pub fn skipped_updates(&self) -> usize {
        self.skipped_updates
    }

    /// Restores the count of skipped updates (from a checkpoint).
    pub fn set_skipped_updates(&mut self, n: usize) {
        self.skipped_updates = n;
    }

    /// The id used for padding.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Uses these minibatch orders (one per epoch, consumed in order) instead of shuffling.
    pub fn force_permutations(&mut self, perms: impl IntoIterator<Item = Vec<usize>>) {
        self.forced_permutations.extend(perms);
    }

    /// Keeps the gradients of the next optimizer step (after accumulation, before clipping);
    /// [`Self::take_recorded_gradients`] returns them by parameter name.
    pub fn record_next_gradients(&mut self) {
        self.record_grads = true;
    }

    /// The gradients kept by [`Self::record_next_gradients`], if a step has run since.
    pub fn take_recorded_gradients(&mut self) -> Option<Vec<(String, Tensor)>> {
        self.recorded_grads.take()
    }

    /// One PPO step on `(query, response, score)` triplets. TRL `PPOTrainer.step`.
    pub fn step(&mut self, queries: &[Vec<u32>], responses: &[Vec<u32>], scores: &[f32]) -> Result<Stats> {
        self.step_with(StepInput {
            queries,
            responses,
            scores,
            response_masks: None,
            rollout: None,
            bootstrap: None,
        })
    }

    /// One PPO step with optional response masks and rollout caches.
    pub fn step_with(&mut self, input: StepInput) -> Result<Stats> {
        let t0 = Instant::now();
        let _awake = self.device.is_cpu().then(crate::cpu::keep_pool_awake);
        self.check_input(&input)?;
        let scores = self.process_scores(&input)?;
        let batch = self.build_batch(&input)?;

        let t = Instant::now();
        let rollout = self.rollout_forward(&input, &batch)?;
        let time_forward = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let kl_coef = self.kl_ctl.value();
        let kl = match (self.config.kl_penalty, &rollout.full) {
            (KlPenalty::Full, Some((lp, rp))) => math::full_kl(lp, rp)?,
            (kind, _) => math::kl_penalty(kind, &rollout.logprobs, &rollout.ref_logprobs)?,
        };
        let (rewards, non_score) = math::compute_rewards(&scores, &kl, &batch.mask, kl_coef)?;
        let time_rewards = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let rewards = if self.config.whiten_rewards {
            math::whiten_rewards(&(&rewards * &batch.mask)?, &batch.mask)?
        } else {
            rewards
        };
        // A value, not a reward: added after whitening.
        let rewards = match input.bootstrap {
            Some(next) => math::bootstrap_last(&rewards, &batch.mask, next, self.config.gamma)?,
            None => rewards,
        };
        let (values, advantages, returns) = math::compute_advantages(
            &rollout.values,
            &rewards,
            &batch.mask,
            self.config.gamma,
            self.config.lam,
        )?;
        let time_adv = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let train = TrainData {
            old_logprobs: &rollout.logprobs,
            values: &values,
            advantages: &advantages,
            returns: &returns,
            response_only: rollout.cached,
        };
        let mb_stats = self.optimize(&batch, &train)?;
        let time_opt = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut stats = self.step_stats(&input, &scores, &kl, &non_score, &rollout, &batch, kl_coef)?;
        average_minibatch_stats(&mut stats, &mb_stats)?;
        stats.insert("ppo/learning_rate".into(), Stat::Scalar(self.optimizer.cfg.lr));
        if let Some(c) = &self.critic {
            stats.insert("rltune/critic_learning_rate".into(), Stat::Scalar(c.optimizer.cfg.lr));
        }
        stats.insert("rltune/skipped_updates".into(), Stat::Scalar(self.skipped_updates as f64));
        let mean_kl = stats.get("objective/kl").and_then(Stat::as_f64).unwrap_or(0.0);
        self.kl_ctl.update(mean_kl, self.config.batch_size);
        negative_kl_guard(&mut stats, mean_kl);
        let time_stats = t.elapsed().as_secs_f64();

        for (k, v) in [
            ("forward_pass", time_forward),
            ("compute_rewards", time_rewards),
            ("compute_advantages", time_adv),
            ("optimize_step", time_opt),
            ("calc_stats", time_stats),
            ("total", t0.elapsed().as_secs_f64()),
        ] {
            stats.insert(format!("time/ppo/{k}"), Stat::Scalar(v));
        }
        Ok(stats)
    }

    /// Rejects inputs that would give silent garbage, naming the sample.
    fn check_input(&self, input: &StepInput) -> Result<()> {
        self.check_value_head()?;
        let b = self.config.batch_size;
        let n = input.queries.len();
        if n != b || input.responses.len() != b || input.scores.len() != b {
            return Err(Error::Input(format!(
                "got {n} queries, {} responses and {} scores but ppo.batch_size is {b}; pass exactly batch_size samples",
                input.responses.len(),
                input.scores.len()
            )));
        }
        let vocab = self.policy.lm.vocab_size();
        let max_positions = self.policy.lm.config().max_positions();
        for i in 0..b {
            let (q, r) = (&input.queries[i], &input.responses[i]);
            if q.is_empty() {
                return Err(Error::Input(format!(
                    "sample {i}: empty query; every query needs a token (e.g. the BOS token)"
                )));
            }
            if r.is_empty() {
                return Err(Error::Input(format!(
                    "sample {i}: empty response; every response needs a token"
                )));
            }
            if let Some(max) = max_positions.filter(|&max| q.len() + r.len() > max) {
                return Err(Error::Input(format!(
                    "sample {i}: {} tokens (query {} + response {}) but the model has {max} positions; \
                     truncate the query or lower max_new_tokens",
                    q.len() + r.len(),
                    q.len(),
                    r.len()
                )));
            }
            if let Some(&t) = q.iter().chain(r).find(|&&t| t as usize >= vocab) {
                return Err(Error::Input(format!(
                    "sample {i}: token id {t} is not below vocab_size {vocab}"
                )));
            }
            if !input.scores[i].is_finite() {
                return Err(Error::Input(format!(
                    "sample {i}: score is {} (must be finite)",
                    input.scores[i]
                )));
            }
            if let Some(next) = input.bootstrap {
                match next.get(i) {
                    Some(v) if v.is_finite() => {}
                    Some(v) => {
                        return Err(Error::Input(format!(
                            "sample {i}: bootstrap value is {v} (must be finite)"
                        )))
                    }
                    None => {
                        return Err(Error::Input(format!(
                            "{} bootstrap values for {b} samples; pass one per sample",
                            next.len()
                        )))
                    }
                }
            }
            if let Some(m) = input.response_masks {
                if m.get(i).map(Vec::len) != Some(r.len()) {
                    return Err(Error::Input(format!(
                        "sample {i}: response mask length differs from the response"
                    )));
                }
            }
            if let Some(c) = input.rollout {
                // With a critic the cached values are not read (it computes them): they may be empty.
                let values_ok = |n: usize| n == r.len() || (n == 0 && self.critic.is_some());
                let ok = c.get(i).is_some_and(|c| c.logprobs.len() == r.len() && values_ok(c.values.len()));
                if !ok {
                    return Err(Error::Input(format!(
                        "sample {i}: rollout cache length differs from the response"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Missing-EOS penalty, then score scaling and clipping (TRL `step`, first lines).
    fn process_scores(&mut self, input: &StepInput) -> Result<Vec<f32>> {
        let mut scores: Vec<f64> = input.scores.iter().map(|&s| s as f64).collect();
        if let Some(p) = self.config.missing_eos_penalty {
            for (s, r) in scores.iter_mut().zip(input.responses) {
                if !r.last().is_some_and(|t| self.eos_ids.contains(t)) {
                    *s -= p;
                }
            }
        }
        if self.config.use_score_scaling {
            self.running.update(&scores);
            let scale = self.running.std + f32::EPSILON as f64;
            let shift = if self.config.use_score_norm { self.running.mean } else { 0.0 };
            scores.iter_mut().for_each(|s| *s = (*s - shift) / scale);
        }
        if let Some(c) = self.config.score_clip {
            scores.iter_mut().for_each(|s| *s = s.clamp(-c, c));
        }
        Ok(scores.into_iter().map(|s| s as f32).collect())
    }

    /// Right-pads `query ++ response` rows and builds the response mask.
    pub(super) fn build_batch(&self, input: &StepInput) -> Result<Batch> {
        let rows: Vec<Vec<u32>> = input
            .queries
            .iter()
            .zip(input.responses)
            .map(|(q, r)| q.iter().chain(r).copied().collect())
            .collect();
        let (ids, mut attn) = pad(&rows, self.pad_id, PaddingSide::Right);
        let l = ids[0].len();
        attn.iter_mut().for_each(|a| a.truncate(l - 1));
        let b = rows.len();
        let (mut mask, mut response) = (vec![0f32; b * (l - 1)], vec![0f32; b * (l - 1)]);
        for i in 0..b {
            let start = input.queries[i].len() - 1;
            for j in 0..input.responses[i].len() {
                let keep = input.response_masks.map_or(1, |m| m[i][j]);
                mask[i * (l - 1) + start + j] = f32::from(keep);
                response[i * (l - 1) + start + j] = 1.0;
            }
        }
        let dt = self.store.dtype();
        Ok(Batch {
            ids: Tensor::new(ids, &self.device)?,
            // Right padding: `arange(L)` equals `cumsum(mask) − 1` on every real token, and gives
            // padding the positions TRL gives it (its logprobs appear in `objective/logprobs`).
            positions: Tensor::arange(0u32, (l - 1) as u32, &self.device)?.unsqueeze(0)?.repeat((b, 1))?,
            bias: causal_bias(&attn, l - 1, dt, &self.device)?,
            mask: Tensor::from_vec(mask, (b, l - 1), &self.device)?.to_dtype(dt)?,
            response: Tensor::from_vec(response, (b, l - 1), &self.device)?.to_dtype(dt)?,
        })
    }

    /// The policy's next-token logprobs, their entropies and the values, each `(B, L−1)` (every
    /// position but the last, whose logits predict a token outside the batch). The values come
    /// from the policy's value head (its input detached with `detach_value_head`), or, with a
    /// separate critic, from the critic (whose forward runs inside `critic_grads`' scope).
    ///
    /// `select (B, L−1)` limits the LM head to the marked positions (the others read 0 in
    /// logprobs and entropies, and their values are unspecified: the model skips the last
    /// block's work for them, and the losses mask them out); `keep` keeps its probabilities for
    /// a backward.
    fn policy_forward(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        bias: &Tensor,
        select: Option<&Tensor>,
        critic_grads: Option<&Grads>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let hidden = hidden_states(&self.policy.lm, ids, pos, bias, select)?;
        let (logp, entropy) = self.head_logprobs(&self.policy.lm, &hidden, ids, select, true)?;
        let detach = self.config.detach_value_head;
        let values = match (&self.critic, critic_grads) {
            (Some(c), Some(g)) => {
                let _sinks = g.scope();
                c.values(ids, pos, bias, select, detach)?
            }
            (Some(c), None) => c.values(ids, pos, bias, select, detach)?,
            (None, _) if detach => self.policy.v_head.forward(&hidden.detach())?,
            (None, _) => self.policy.v_head.forward(&hidden)?,
        };
        Ok((logp, entropy, values))
    }

    /// Logprobs of the next tokens and the entropies `(B, L−1)` from hidden states `(B, L−1, C)` (or `(B, L, C)`),
    /// through the fused LM head ([`ops::lm_head_logprobs`], at the training temperature).
    fn head_logprobs(
        &self,
        lm: &CausalLm,
        hidden: &Tensor,
        ids: &Tensor,
        select: Option<&Tensor>,
        keep: bool,
    ) -> Result<(Tensor, Tensor)> {
        let (b, l) = ids.dims2()?;
        let w = l - 1;
        let h = hidden.narrow(1, 0, w)?.reshape((b * w, hidden.dim(2)?))?;
        let targets = ids.narrow(1, 1, w)?.flatten_all()?;
        let select = select.map(Tensor::flatten_all).transpose()?;
        let temperature = self.config.temperature;
        let (logp, entropy) =
            ops::lm_head_logprobs(&h, lm.lm_head_weight(), &targets, select.as_ref(), temperature, keep)?;
        Ok((logp.reshape((b, w))?, entropy.reshape((b, w))?))
    }

    /// Logprobs of the next tokens `(B, L−1)` and, with `full`, the log-distributions
    /// `(B, L−1, V)`, from hidden states `(B, L−1, C)`; no gradient is kept.
    fn next_token_logprobs(
        &self,
        lm: &CausalLm,
        hidden: &Tensor,
        ids: &Tensor,
        full: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if !full {
            return Ok((self.head_logprobs(lm, hidden, ids, None, false)?.0.detach(), None));
        }
        let l = ids.dim(1)?;
        let logits = lm.logits(&hidden.narrow(1, 0, l - 1)?)?.detach();
        let logits =
            if self.config.temperature != 1.0 { (logits / self.config.temperature)? } else { logits };
        let targets = ids.narrow(1, 1, l - 1)?;
        let logp = ops::log_softmax_last_dim(&logits)?;
        let tok = logp.gather(&targets.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?.squeeze(D::Minus1)?;
        Ok((tok, Some(logp)))
    }

    /// The no-gradient forward passes of policy and reference, in minibatch-sized chunks.
    fn rollout_forward(&self, input: &StepInput, batch: &Batch) -> Result<Rollout> {
        let b = self.config.batch_size;
        let chunk = self.config.mini_batch_size;
        let full = self.config.kl_penalty == KlPenalty::Full;
        let use_cache = input.rollout.is_some() && !full;
        let (mut lp, mut vals, mut rlp, mut flp, mut frlp) = (vec![], vec![], vec![], vec![], vec![]);
        let mut critic_vals = vec![];
        for start in (0..b).step_by(chunk) {
            let n = chunk.min(b - start);
            let ids = batch.ids.narrow(0, start, n)?;
            let pos = batch.positions.narrow(0, start, n)?;
            let bias = batch.bias.narrow(0, start, n)?;
            if let Some(c) = &self.critic {
                // The critic's values, on the response positions only when the cache decides
                // which positions are compared (the others are masked out everywhere).
                let response = batch.response.narrow(0, start, n)?;
                let v = c.values(&ids, &pos, &bias, use_cache.then_some(&response), false)?.detach();
                // 0 where not computed, as the cached policy logprobs.
                critic_vals.push(if use_cache { (v * &response)? } else { v });
            }
            if use_cache {
                // The cached policy logprobs exist on response columns only (0 elsewhere), so
                // the reference's are computed there only: the LM head and the last block skip
                // the query rows.
                let response = batch.response.narrow(0, start, n)?;
                let h = hidden_states(&self.reference, &ids, &pos, &bias, Some(&response))?;
                rlp.push(self.head_logprobs(&self.reference, &h, &ids, Some(&response), false)?.0.detach());
                continue;
            }
            let input = inputs(&ids)?;
            let hidden = self.policy.lm.forward(&input, &pos, &bias, None)?;
            let (l, f) = self.next_token_logprobs(&self.policy.lm, &hidden, &ids, full)?;
            lp.push(l);
            flp.extend(f);
            if self.critic.is_none() {
                vals.push(self.policy.v_head.forward(&hidden)?.detach());
            }
            let h = self.reference.forward(&input, &pos, &bias, None)?;
            let (l, f) = self.next_token_logprobs(&self.reference, &h, &ids, full)?;
            rlp.push(l);
            frlp.extend(f);
        }
        let ref_logprobs = Tensor::cat(&rlp, 0)?;
        let (logprobs, values) = match input.rollout {
            Some(cache) if use_cache => self.cached_rollout(input, cache, ref_logprobs.dims2()?)?,
            _ if self.critic.is_some() => (Tensor::cat(&lp, 0)?, Tensor::cat(&critic_vals, 0)?),
            _ => (Tensor::cat(&lp, 0)?, Tensor::cat(&vals, 0)?),
        };
        let values = if use_cache && self.critic.is_some() { Tensor::cat(&critic_vals, 0)? } else { values };
        let full = if full { Some((Tensor::cat(&flp, 0)?, Tensor::cat(&frlp, 0)?)) } else { None };
        Ok(Rollout { logprobs, ref_logprobs, values, full, cached: use_cache })
    }

    /// Places cached per-token logprobs and values into `(B, L−1)` matrices.
    fn cached_rollout(
        &self,
        input: &StepInput,
        cache: &[RolloutCache],
        (b, w): (usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let (mut lp, mut v) = (vec![0f32; b * w], vec![0f32; b * w]);
        for (i, c) in cache.iter().enumerate() {
            let start = i * w + input.queries[i].len() - 1;
            lp[start..start + c.logprobs.len()].copy_from_slice(&c.logprobs);
            v[start..start + c.values.len()].copy_from_slice(&c.values);
        }
        let dt = self.store.dtype();
        Ok((
            Tensor::from_vec(lp, (b, w), &self.device)?.to_dtype(dt)?,
            Tensor::from_vec(v, (b, w), &self.device)?.to_dtype(dt)?,
        ))
    }
}

/// Rollout tensors the optimization reads, each `(B, L−1)`.
struct TrainData<'a> {
    old_logprobs: &'a Tensor,
    values: &'a Tensor,
    advantages: &'a Tensor,
    returns: &'a Tensor,
    /// Compute the policy's LM head on response positions only: the old logprobs came from the
    /// rollout cache and are 0 elsewhere, so nothing outside the responses is compared.
    response_only: bool,
}

impl PpoTrainer {
    /// PPO epochs over shuffled minibatches; returns each minibatch's stats.
    fn optimize(&mut self, batch: &Batch, data: &TrainData) -> Result<Vec<Stats>> {
        let cfg = self.config.clone();
        let mut all = Vec::new();
        let mut grads = self.grads.take().unwrap_or_else(|| Grads::new(self.optimizer.vars()));
        let mut critic_grads =
            self.critic.as_mut().map(|c| c.grads.take().unwrap_or_else(|| Grads::new(c.optimizer.vars())));
        for _epoch in 0..cfg.ppo_epochs {
            let perm = match self.forced_permutations.pop_front() {
                Some(p) => p,
                None => {
                    let mut p: Vec<usize> = (0..cfg.batch_size).collect();
                    p.shuffle(&mut self.rng);
                    p
                }
            };
            let mut last_policykl = 0.0;
            for backward in perm.chunks(cfg.backward_batch_size()) {
                grads.clear();
                if let Some(g) = critic_grads.as_mut() {
                    g.clear();
                }
                // One minibatch per update and no clipping: each weight whose gradient is one
                // product is updated inside that product (`Adam::step_fused`, same results).
                if cfg.gradient_accumulation_steps == 1 && cfg.max_grad_norm.is_none() && !self.record_grads {
                    let placeholder = Adam::new(Vec::new(), self.optimizer.cfg)?;
                    let mut optimizer = std::mem::replace(&mut self.optimizer, placeholder);
                    let mut stats = None;
                    let mut ran_backward = false;
                    let ran = optimizer.step_fused(&mut grads, |grads| {
                        let (s, skip) =
                            self.train_minibatch(batch, data, backward, grads, critic_grads.as_mut())?;
                        stats = Some(s);
                        ran_backward = skip == Skip::No;
                        Ok(ran_backward)
                    });
                    self.optimizer = optimizer;
                    if ran? == FusedStep::NonFinite {
                        self.skip_non_finite_update("gradient");
                    }
                    if let (Some(g), true) = (critic_grads.as_mut(), ran_backward) {
                        self.step_critic(g)?;
                    }
                    if let Some(stats) = stats {
                        if !loss_is_finite(&stats) {
                            self.skip_non_finite_update("loss");
                        }
                        last_policykl = stats.get("policy/policykl").and_then(Stat::as_f64).unwrap_or(0.0);
                        all.push(stats);
                    }
                    continue;
                }
                let (mut any, mut non_finite) = (false, false);
                for mb in backward.chunks(cfg.mini_batch_size) {
                    let (stats, skip) =
                        self.train_minibatch(batch, data, mb, &mut grads, critic_grads.as_mut())?;
                    last_policykl = stats.get("policy/policykl").and_then(Stat::as_f64).unwrap_or(0.0);
                    any |= skip == Skip::No;
                    non_finite |= skip == Skip::NonFinite;
                    all.push(stats);
                }
                if non_finite {
                    // Part of the accumulated gradient is missing: no update at all.
                    self.skip_non_finite_update("loss");
                    continue;
                }
                if any && self.record_grads {
                    self.record_grads = false;
                    let mut named = Vec::new();
                    for (i, n) in self.var_names.iter().enumerate() {
                        if let Some(g) = grads.get(i)? {
                            named.push((n.clone(), g));
                        }
                    }
                    self.recorded_grads = Some(named);
                }
                if any {
                    let norm = match cfg.max_grad_norm {
                        Some(max) => grads.clip_norm(max)?,
                        None => grads.global_norm()?,
                    };
                    if norm.is_finite() {
                        self.optimizer.step(&grads)?;
                    } else {
                        self.skip_non_finite_update("gradient");
                    }
                    if let Some(g) = critic_grads.as_mut() {
                        self.step_critic(g)?;
                    }
                }
            }
            if cfg.early_stopping && last_policykl > 1.5 * cfg.target_kl {
                tracing::info!("early stopping: policy KL {last_policykl:.4} > 1.5 × target_kl");
                break;
            }
        }
        self.grads = Some(grads);
        if let (Some(c), Some(g)) = (self.critic.as_mut(), critic_grads) {
            c.grads = Some(g);
        }
        Ok(all)
    }

    /// Counts and logs an optimizer update skipped for a non-finite `what` (loss or gradient).
    pub(super) fn skip_non_finite_update(&mut self, what: &str) {
        self.skipped_updates += 1;
        tracing::warn!(
            "update skipped: the {what} is not finite (NaN or infinite), so no weight changed \
             ({} updates skipped so far; see rltune/skipped_updates)",
            self.skipped_updates
        );
    }

    /// Forward, losses and backward of one minibatch; gradients are added to `grads` (and,
    /// with a separate critic, the value loss's to `critic_grads`).
    /// Returns the minibatch stats (TRL `PPOTrainer.loss`) and whether (and why) its backward
    /// was skipped: a non-finite loss runs no backward, so it never reaches a gradient.
    fn train_minibatch(
        &self,
        batch: &Batch,
        data: &TrainData,
        rows: &[usize],
        grads: &mut Grads,
        critic_grads: Option<&mut Grads>,
    ) -> Result<(Stats, Skip)> {
        let cfg = &self.config;
        let idx =
            Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &self.device)?;
        let sel = |t: &Tensor| t.index_select(&idx, 0);
        let (ids, pos, bias, mask) =
            (sel(&batch.ids)?, sel(&batch.positions)?, sel(&batch.bias)?, sel(&batch.mask)?);
        let (old_lp, old_v, adv, ret) =
            (sel(data.old_logprobs)?, sel(data.values)?, sel(data.advantages)?, sel(data.returns)?);
        let select = if data.response_only { Some(&mask) } else { None };
        // Sinks installed for the forward: the fused GPT-2 blocks write weight gradients into them.
        let _sinks = grads.scope();
        let (logp, entropy, vpreds) =
            self.policy_forward(&ids, &pos, &bias, select, critic_grads.as_deref())?;
        let l = math::ppo_losses(
            &old_lp,
            &old_v,
            &logp,
            &vpreds,
            &mask,
            &adv,
            &ret,
            cfg.cliprange,
            cfg.cliprange_value,
        )?;
        let avg_ratio = scalar(&math::masked_mean(&l.ratio, &mask)?)?;
        let skipped = avg_ratio > cfg.ratio_threshold;
        let loss = (&l.pg_loss + (&l.vf_loss * cfg.vf_coef)?)?;
        let finite = scalar(&loss)?.is_finite();
        let skip = match (skipped, finite) {
            (true, _) => Skip::Ratio,
            (false, false) => Skip::NonFinite,
            (false, true) => Skip::No,
        };
        if skipped {
            tracing::warn!(
                "minibatch skipped: mean ratio {avg_ratio:.2} > ratio_threshold {}; the policy moved too far",
                cfg.ratio_threshold
            );
        } else if finite {
            let gas = cfg.gradient_accumulation_steps as f64;
            match critic_grads {
                // Separate models: each loss term steps its own model (see `ppo::critic`).
                Some(cg) => {
                    grads.backward(&(&l.pg_loss / gas)?)?;
                    cg.backward(&((&l.vf_loss * cfg.vf_coef)? / gas)?)?;
                }
                None => grads.backward(&(&loss / gas)?)?,
            }
        }
        let entropy = math::masked_mean(&entropy, &mask)?;
        let logp = logp.detach();
        let d = (&logp - &old_lp)?;
        let vpreds = vpreds.detach();
        let mut s = Stats::new();
        let zero = |x: f64| if skipped { 0.0 } else { x };
        let sc = |t: &Tensor| scalar(t);
        s.insert("loss/policy".into(), Stat::Scalar(zero(sc(&l.pg_loss)?)));
        s.insert("loss/value".into(), Stat::Scalar(zero(sc(&l.vf_loss)?)));
        s.insert("loss/total".into(), Stat::Scalar(zero(sc(&loss)?)));
        s.insert("policy/entropy".into(), Stat::Scalar(sc(&entropy)?));
        s.insert("policy/approxkl".into(), Stat::Scalar(sc(&(math::masked_mean(&d.sqr()?, &mask)? * 0.5)?)?));
        s.insert("policy/policykl".into(), Stat::Scalar(sc(&math::masked_mean(&d.neg()?, &mask)?)?));
        s.insert("policy/clipfrac".into(), Stat::Scalar(l.pg_clipfrac));
        s.insert("policy/advantages".into(), Stat::Array(flat(&adv)?));
        s.insert("policy/advantages_mean".into(), Stat::Scalar(sc(&math::masked_mean(&adv, &mask)?)?));
        s.insert("policy/ratio".into(), Stat::Array(flat(&l.ratio)?));
        s.insert("returns/mean".into(), Stat::Scalar(sc(&math::masked_mean(&ret, &mask)?)?));
        s.insert("val/vpred".into(), Stat::Scalar(sc(&math::masked_mean(&vpreds, &mask)?)?));
        let err = math::masked_mean(&(&vpreds - &ret)?.sqr()?, &mask)?;
        s.insert("val/error".into(), Stat::Scalar(sc(&err)?));
        s.insert("val/clipfrac".into(), Stat::Scalar(l.vf_clipfrac));
        s.insert("val/mean".into(), Stat::Scalar(sc(&math::masked_mean(&old_v, &mask)?)?));
        // One response token has no unbiased variance (TRL divides by zero and reports NaN):
        // such a minibatch leaves both variances out of the step's averages.
        if scalar(&mask.sum_all()?)? >= 2.0 {
            s.insert("returns/var".into(), Stat::Scalar(sc(&math::masked_var(&ret, &mask, true)?)?));
            s.insert("val/var".into(), Stat::Scalar(sc(&math::masked_var(&old_v, &mask, true)?)?));
        }
        Ok((s, skip))
    }

    /// The step-level stats of TRL `record_step_stats`.
    #[allow(clippy::too_many_arguments)]
    fn step_stats(
        &self,
        input: &StepInput,
        scores: &[f32],
        kl: &Tensor,
        non_score: &Tensor,
        rollout: &Rollout,
        batch: &Batch,
        kl_coef: f64,
    ) -> Result<Stats> {
        let mask = &batch.mask;
        let kl_dist = (kl * mask)?.sum(1)?;
        let kl_list: Vec<f64> = kl_dist.to_dtype(DType::F64)?.to_vec1()?;
        let nll: Vec<f64> = (rollout.logprobs.neg()? * mask)?.sum(1)?.to_dtype(DType::F64)?.to_vec1()?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let mut s = Stats::new();
        s.insert("objective/kl".into(), Stat::Scalar(mean(&kl_list)));
        s.insert("objective/kl_dist".into(), Stat::Array(kl_list));
        s.insert("objective/logprobs".into(), Stat::Matrix(matrix(&rollout.logprobs)?));
        s.insert("objective/ref_logprobs".into(), Stat::Matrix(matrix(&rollout.ref_logprobs)?));
        s.insert("objective/kl_coef".into(), Stat::Scalar(kl_coef));
        s.insert("objective/entropy".into(), Stat::Scalar(mean(&nll)));
        s.insert(
            "ppo/mean_non_score_reward".into(),
            Stat::Scalar(scalar(&math::masked_mean(non_score, mask)?)?),
        );
        let sc: Vec<f64> = scores.iter().map(|&x| x as f64).collect();
        let (m, sd) = mean_std(&sc);
        s.insert("ppo/mean_scores".into(), Stat::Scalar(m));
        s.insert("ppo/std_scores".into(), Stat::Scalar(sd));
        for (name, rows) in [("queries", input.queries), ("responses", input.responses)] {
            let lens: Vec<f64> = rows.iter().map(|r| r.len() as f64).collect();
            let (m, sd) = mean_std(&lens);
            s.insert(format!("tokens/{name}_len_mean"), Stat::Scalar(m));
            s.insert(format!("tokens/{name}_len_std"), Stat::Scalar(sd));
            s.insert(format!("tokens/{name}_dist"), Stat::Array(lens));
        }
        Ok(s)
    }
}

/// `ppo/*` = the mean over minibatches of each minibatch stat; the per-token arrays
/// (`policy/advantages`, `policy/ratio`) are concatenated. Then `ppo/val/var_explained`.
fn average_minibatch_stats(stats: &mut Stats, mbs: &[Stats]) -> Result<()> {
    // Every key any minibatch has, with the first value seen (for its kind); a scalar is
    // averaged over the minibatches that have it (a one-token minibatch has no variances).
    let mut kinds: std::collections::BTreeMap<&String, &Stat> = std::collections::BTreeMap::new();
    for mb in mbs {
        for (k, v) in mb.iter() {
            kinds.entry(k).or_insert(v);
        }
    }
    for (key, kind) in kinds {
        let value = match kind {
            Stat::Scalar(_) => {
                let xs: Vec<f64> = mbs.iter().filter_map(|s| s.get(key).and_then(Stat::as_f64)).collect();
                Stat::Scalar(xs.iter().sum::<f64>() / xs.len() as f64)
            }
            _ => Stat::Array(
                mbs.iter()
                    .filter_map(|s| match s.get(key) {
                        Some(Stat::Array(a)) => Some(a.clone()),
                        _ => None,
                    })
                    .flatten()
                    .collect(),
            ),
        };
        stats.insert(format!("ppo/{key}"), value);
    }
    let get = |k: &str| stats.get(k).and_then(Stat::as_f64).unwrap_or(f64::NAN);
    let ve = 1.0 - get("ppo/val/error") / get("ppo/returns/var");
    stats.insert("ppo/val/var_explained".into(), Stat::Scalar(ve));
    Ok(())
}

/// Warns, in the log and the stats, when the KL estimate is negative beyond sampling noise.
///
/// On responses sampled from the current policy, every sequence's k1 estimate has expectation
/// KL ≥ 0, but a batch mean is noisy (a few dozen sequences read −0.01 often). The guard fires
/// when `objective/kl` is below three standard errors of that mean (and below −1e-4, float
/// noise of a rollout-cached logprob vs its recomputation): then the responses were not sampled
/// as the policy now samples. TRL 0.11 warns only below −1.
fn negative_kl_guard(stats: &mut Stats, mean_kl: f64) {
    if mean_kl < negative_kl_floor(stats, mean_kl) {
        let msg = format!(
            "objective/kl is negative ({mean_kl:.4}) beyond sampling noise: the responses were likely not \
             sampled from the policy as it is now (top-k, top-p, min-length or a different temperature, or \
             responses from elsewhere); PPO can exploit a negative KL estimate"
        );
        tracing::warn!("{msg}");
        stats.insert("warnings/negative_kl".into(), Stat::Text(msg));
    }
}

/// The threshold of [`negative_kl_guard`]: `−max(1e-4, 3 · standard error)` of the per-sequence
/// KL estimates in `objective/kl_dist`.
fn negative_kl_floor(stats: &Stats, mean_kl: f64) -> f64 {
    let se = match stats.get("objective/kl_dist") {
        Some(Stat::Array(d)) if d.len() > 1 => {
            let var = d.iter().map(|x| (x - mean_kl).powi(2)).sum::<f64>() / (d.len() - 1) as f64;
            (var / d.len() as f64).sqrt()
        }
        _ => 0.0,
    };
    -(3.0 * se).max(1e-4)
}

/// Hidden states `(B, L−1, C)` of the model's inputs (`ids[:, :L−1]`); with `select (B, L−1)`,
/// only the marked positions are computed in full (the others are unspecified, see
/// [`CausalLm::forward_rows`]).
pub(super) fn hidden_states(
    lm: &CausalLm,
    ids: &Tensor,
    pos: &Tensor,
    bias: &Tensor,
    select: Option<&Tensor>,
) -> Result<Tensor> {
    match select {
        Some(sel) => {
            let flat = sel.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let rows: Vec<usize> = (0..flat.len()).filter(|&r| flat[r] != 0.0).collect();
            lm.forward_rows(&inputs(ids)?, pos, bias, &rows)
        }
        None => lm.forward(&inputs(ids)?, pos, bias, None),
    }
}

/// The models' input `ids[:, :L−1]` (see [`Batch`]).
fn inputs(ids: &Tensor) -> Result<Tensor> {
    Ok(ids.narrow(1, 0, ids.dim(1)? - 1)?)
}

fn flat(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1()?)
}

fn matrix(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(t.to_dtype(DType::F64)?.to_vec2()?)
}
