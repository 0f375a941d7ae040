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
//! (`detach_value_head`), a separate critic with its own optimizer ([`super::critic`]), and
//! PPO-ptx, a supervised loss mixed into every minibatch ([`PpoTrainer::with_ptx`]).

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use rand::SeedableRng;

use super::config::{optim_args, PpoConfig};
use super::critic::Critic;
use super::forward::{hidden_states, inputs};
use super::kl_control::KlController;
use super::math::{self, KlPenalty};
use crate::dist::Dist;
use crate::engine::Optimizer;
use crate::engine::{Stat, Stats};
use crate::error::{Error, Result};
use crate::models::layers::causal_bias;
use crate::models::{CausalLm, CausalLmWithValueHead};
use crate::ops;
use crate::optim::{Adam, Grads};
use crate::params::ParamStore;
use crate::tokenizer::{pad, PaddingSide};

mod critic;
mod data_parallel;
mod optimize;
mod ptx;

use crate::engine::constraint::{constrained_logprobs, Constraint};
use optimize::{average_minibatch_stats, negative_kl_guard, TrainData};

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
    /// Optional tokens allowed at each response position (`[agent] actions = "admissible"`):
    /// the policy's and the reference's logprobs are then those of the softmax renormalised
    /// over each set, the distribution the responses were sampled from. `None`: the whole
    /// vocabulary everywhere.
    pub allowed: Option<&'a [Vec<Vec<u32>>]>,
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
    /// PPO-ptx: supervised examples drawn so far ([`PpoTrainer::with_ptx`]; 0 without).
    #[serde(default)]
    pub ptx_cursor: u64,
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
    /// The admissible tokens of each position, with `StepInput::allowed`.
    pub(super) allowed: Option<Constraint>,
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
    /// PPO-ptx's supervised examples ([`Self::with_ptx`]); `None`: plain PPO.
    ptx: Option<ptx::Ptx>,
    optimizer: Optimizer,
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
        config.validate()?;
        if !store.trainable() {
            return Err(Error::argument("policy", "its parameters must be trainable"));
        }
        let var_names: Vec<String> = store.vars().into_iter().map(|(n, _)| n).collect();
        let optimizer = Optimizer::new(&store, optim_args(config.learning_rate, config.max_grad_norm))?;
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
            ptx: None,
            optimizer,
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

    /// This trainer on `dist`'s processes (a data-parallel run): each holds `batch_size` samples,
    /// and together they give the weights one process gives with N × `batch_size`
    /// ([`crate::dist`]). The optimizers (the critic's too) average the gradients over them.
    pub fn with_dist(mut self, dist: Dist) -> Self {
        if let Some(c) = self.critic.as_mut() {
            c.optimizer.set_dist(dist.clone());
        }
        self.optimizer.set_dist(dist);
        self
    }

    /// The processes this trainer trains with (its optimizer's).
    pub fn dist(&self) -> &Dist {
        self.optimizer.dist()
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
        self.optimizer.adam()
    }

    /// Mutable optimizer (to restore a checkpoint).
    pub fn optimizer_mut(&mut self) -> &mut Adam {
        self.optimizer.adam_mut()
    }

    /// The engine's optimizer of the policy (rejection sampling fine-tunes through it).
    pub(crate) fn engine_optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
    }

    /// The shuffle stream's position and the score moments, for a checkpoint.
    pub fn streams(&self) -> TrainerStreams {
        TrainerStreams {
            shuffle_word_pos: self.rng.get_word_pos(),
            score_moments: self.running.clone(),
            ptx_cursor: self.ptx.as_ref().map_or(0, |p| p.cursor),
        }
    }

    /// Restores what [`Self::streams`] saved (the trainer must use the same `[ppo] seed`).
    pub fn restore_streams(&mut self, s: &TrainerStreams) {
        self.rng = rand_chacha::ChaCha12Rng::seed_from_u64(self.config.seed);
        self.rng.set_word_pos(s.shuffle_word_pos);
        self.running = s.score_moments.clone();
        if let Some(p) = self.ptx.as_mut() {
            p.cursor = s.ptx_cursor;
        }
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
            allowed: None,
        })
    }

    /// [`Self::step_with`] on however many samples `input` holds rather than `ppo.batch_size`
    /// (a game step that trains on every turn of a round, `[episodes] train_turns = "round"`):
    /// a positive multiple of `mini_batch_size × gradient_accumulation_steps`, the same on every
    /// process. Everything that TRL sizes by `batch_size` is sized by it for this step: the
    /// forward chunks, the minibatch permutation and the adaptive KL controller's count.
    pub fn step_sized(&mut self, input: StepInput) -> Result<Stats> {
        let n = input.queries.len();
        let unit = self.config.backward_batch_size();
        if n == 0 || !n.is_multiple_of(unit) {
            return Err(Error::batch(format!(
                "a step of {n} samples: it must be a positive multiple of mini_batch_size × \
                 gradient_accumulation_steps ({unit}) so that every minibatch is whole"
            )));
        }
        let configured = std::mem::replace(&mut self.config.batch_size, n);
        let stats = self.step_with(input);
        self.config.batch_size = configured;
        stats
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
        // Whitening takes the statistics of the whole batch, over every process.
        let rewards = if self.config.whiten_rewards {
            data_parallel::whiten_rewards(self.dist(), &(&rewards * &batch.mask)?, &batch.mask)?
        } else {
            rewards
        };
        // A value, not a reward: added after whitening.
        let rewards = match input.bootstrap {
            Some(next) => math::bootstrap_last(&rewards, &batch.mask, next, self.config.gamma)?,
            None => rewards,
        };
        let (values, advantages, returns) = math::compute_advantages_with(
            &rollout.values,
            &rewards,
            &batch.mask,
            self.config.gamma,
            self.config.lam,
            |x, m| data_parallel::masked_whiten(self.dist(), x, m, true),
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
        stats.insert("ppo/learning_rate".into(), Stat::Scalar(self.optimizer.learning_rate()));
        if let Some(c) = &self.critic {
            stats.insert("rltune/critic_learning_rate".into(), Stat::Scalar(c.optimizer.learning_rate()));
        }
        stats.insert("rltune/skipped_updates".into(), Stat::Scalar(self.skipped_updates as f64));
        let mean_kl = stats.get("objective/kl").and_then(Stat::as_f64).unwrap_or(0.0);
        // TRL: the controller counts every process's samples.
        self.kl_ctl.update(mean_kl, self.config.batch_size * self.dist().world_size());
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
        if self.dist().world_size() > 1 {
            stats.insert("time/dist/all_reduce".into(), Stat::Scalar(self.dist().take_all_reduce_seconds()));
        }
        Ok(stats)
    }

    /// Rejects inputs that would give silent garbage, naming the sample.
    fn check_input(&self, input: &StepInput) -> Result<()> {
        self.check_value_head()?;
        let b = self.config.batch_size;
        let n = input.queries.len();
        if n != b || input.responses.len() != b || input.scores.len() != b {
            return Err(Error::batch(format!(
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
                return Err(Error::sample(i, "empty query; every query needs a token (e.g. the BOS token)"));
            }
            if r.is_empty() {
                return Err(Error::sample(i, "empty response; every response needs a token"));
            }
            if let Some(max) = max_positions.filter(|&max| q.len() + r.len() > max) {
                return Err(Error::sample(
                    i,
                    format!(
                        "{} tokens (query {} + response {}) but the model has {max} positions; \
                         truncate the query or lower max_new_tokens",
                        q.len() + r.len(),
                        q.len(),
                        r.len()
                    ),
                ));
            }
            if let Some(&t) = q.iter().chain(r).find(|&&t| t as usize >= vocab) {
                return Err(Error::sample(i, format!("token id {t} is not below vocab_size {vocab}")));
            }
            if !input.scores[i].is_finite() {
                return Err(Error::sample(i, format!("score is {} (must be finite)", input.scores[i])));
            }
            if let Some(next) = input.bootstrap {
                match next.get(i) {
                    Some(v) if v.is_finite() => {}
                    Some(v) => {
                        return Err(Error::sample(i, format!("bootstrap value is {v} (must be finite)")))
                    }
                    None => {
                        return Err(Error::batch(format!(
                            "{} bootstrap values for {b} samples; pass one per sample",
                            next.len()
                        )))
                    }
                }
            }
            if input.allowed.is_some() && self.config.kl_penalty == KlPenalty::Full {
                return Err(Error::Unsupported(
                    "kl_penalty = \"full\" with admissible actions ([agent] actions = \"admissible\"): \
                     the full KL is over the whole vocabulary, the constrained policy's is not; use \
                     kl_penalty = \"kl\" (the default), \"abs\" or \"mse\""
                        .into(),
                ));
            }
            if let Some(m) = input.response_masks {
                if m.get(i).map(Vec::len) != Some(r.len()) {
                    return Err(Error::sample(i, "response mask length differs from the response"));
                }
            }
            if let Some(c) = input.rollout {
                // With a critic the cached values are not read (it computes them): they may be empty.
                let values_ok = |n: usize| n == r.len() || (n == 0 && self.critic.is_some());
                let ok = c.get(i).is_some_and(|c| c.logprobs.len() == r.len() && values_ok(c.values.len()));
                if !ok {
                    return Err(Error::sample(i, "rollout cache length differs from the response"));
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
            // The running moments see every process's scores.
            self.running.update(&self.dist().gather_f64(&scores)?);
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
        let starts: Vec<usize> = input.queries.iter().map(|q| q.len() - 1).collect();
        let allowed = input
            .allowed
            .map(|a| Constraint::new(&ids, &starts, input.responses, a, &self.device))
            .transpose()?;
        Ok(Batch {
            allowed,
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
    /// separate critic, from the critic.
    ///
    /// `select (B, L−1)` limits the LM head to the marked positions (the others read 0 in
    /// logprobs and entropies, and their values are unspecified: the model skips the last
    /// block's work for them, and the losses mask them out); `keep` keeps its probabilities for
    /// a backward.
    ///
    /// With `allowed` (the rows' [`Constraint`]), the logprobs and entropies are those of the
    /// renormalised distributions, and every position is computed.
    fn policy_forward(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        bias: &Tensor,
        select: Option<&Tensor>,
        allowed: Option<&Constraint>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let select = if allowed.is_some() { None } else { select };
        let hidden = hidden_states(&self.policy.lm, ids, pos, bias, select)?;
        let (logp, entropy) = self.head_logprobs(&self.policy.lm, &hidden, ids, select, allowed, true)?;
        let detach = self.config.detach_value_head;
        let values = match &self.critic {
            Some(c) => c.values(ids, pos, bias, select, detach)?,
            None if detach => self.policy.v_head.forward(&hidden.detach())?,
            None => self.policy.v_head.forward(&hidden)?,
        };
        Ok((logp, entropy, values))
    }

    /// Logprobs of the next tokens and the entropies `(B, L−1)` from hidden states `(B, L−1, C)` (or `(B, L, C)`),
    /// through the fused LM head ([`ops::lm_head_logprobs`], at the training temperature), or,
    /// with `allowed` (the rows' constraint; `select` is then ignored), renormalised over the
    /// allowed tokens ([`crate::engine::constraint`]).
    fn head_logprobs(
        &self,
        lm: &CausalLm,
        hidden: &Tensor,
        ids: &Tensor,
        select: Option<&Tensor>,
        allowed: Option<&Constraint>,
        keep: bool,
    ) -> Result<(Tensor, Tensor)> {
        let (b, l) = ids.dims2()?;
        let w = l - 1;
        let h = hidden.narrow(1, 0, w)?.reshape((b * w, hidden.dim(2)?))?;
        let targets = ids.narrow(1, 1, w)?.flatten_all()?;
        let temperature = self.config.temperature;
        let (logp, entropy) = match allowed {
            Some(c) => {
                let k = c.idx.dim(2)?;
                let (idx, pad) = (c.idx.reshape((b * w, k))?, c.pad.reshape((b * w, k))?);
                constrained_logprobs(
                    &h,
                    lm.lm_head_weight(),
                    lm.grad_slot(),
                    &targets,
                    &idx,
                    &pad,
                    temperature,
                )?
            }
            None => {
                let select = select.map(Tensor::flatten_all).transpose()?;
                let w = lm.lm_head_weight();
                ops::lm_head_logprobs_with(
                    &h,
                    w,
                    &targets,
                    select.as_ref(),
                    temperature,
                    keep,
                    lm.grad_slot(),
                )?
            }
        };
        Ok((logp.reshape((b, w))?, entropy.reshape((b, w))?))
    }

    /// Logprobs of the next tokens `(B, L−1)` and, with `full`, the log-distributions
    /// `(B, L−1, V)`, from hidden states `(B, L−1, C)`; no gradient is kept.
    fn next_token_logprobs(
        &self,
        lm: &CausalLm,
        hidden: &Tensor,
        ids: &Tensor,
        allowed: Option<&Constraint>,
        full: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if !full {
            return Ok((self.head_logprobs(lm, hidden, ids, None, allowed, false)?.0.detach(), None));
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
            let allowed = batch.allowed.as_ref().map(|c| c.narrow(start, n)).transpose()?;
            let allowed = allowed.as_ref();
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
                let select = if allowed.is_some() { None } else { Some(&response) };
                let h = hidden_states(&self.reference, &ids, &pos, &bias, select)?;
                rlp.push(self.head_logprobs(&self.reference, &h, &ids, select, allowed, false)?.0.detach());
                continue;
            }
            let input = inputs(&ids)?;
            // Partial freezing: the frozen trunk's output, once for the policy and the reference.
            let trunk = if self.policy.lm.shares_trunk(&self.reference) {
                Some(self.policy.lm.trunk(&input, &pos, &bias)?)
            } else {
                None
            };
            let hidden = match &trunk {
                Some(t) => self.policy.lm.forward_from_trunk(t, &pos, &bias, &[])?,
                None => self.policy.lm.forward(&input, &pos, &bias, None)?,
            };
            let (l, f) = self.next_token_logprobs(&self.policy.lm, &hidden, &ids, allowed, full)?;
            lp.push(l);
            flp.extend(f);
            if self.critic.is_none() {
                vals.push(self.policy.v_head.forward(&hidden)?.detach());
            }
            let h = match &trunk {
                Some(t) => self.reference.forward_from_trunk(t, &pos, &bias, &[])?,
                None => self.reference.forward(&input, &pos, &bias, None)?,
            };
            let (l, f) = self.next_token_logprobs(&self.reference, &h, &ids, allowed, full)?;
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

fn matrix(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(t.to_dtype(DType::F64)?.to_vec2()?)
}
