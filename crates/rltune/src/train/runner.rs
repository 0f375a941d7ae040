//! SFT and reward-model training, as one algorithm of the run loop ([`crate::engine::run_loop`]).
//!
//! Top to bottom: seeded eval split → per epoch a seeded shuffle → optimizer steps of
//! `batch_size × gradient_accumulation_steps` examples, each run as micro-batches whose gradients
//! are summed → the engine's optimizer step (`crate::engine::Optimizer`: clip, Adam at the scheduled
//! learning rate; a non-finite gradient changes no weight) → eval every `eval_every` steps and at
//! the end → progress callback.
//!
//! **Loss weighting.** An objective reports, per example, how many loss terms it contributes
//! (target tokens for a language model, one for a classified text or a preference pair), and
//! each micro-batch's summed loss is divided by the number of terms in the *whole* optimizer step
//! (transformers' `num_items_in_batch`). The step's loss is therefore the mean over every term of
//! the step however it is split into micro-batches: 1 micro-batch of 8 and 8 of 1 give the same
//! gradient up to float rounding.
//!
//! **Checkpoints** ([`Checkpointing`], [`super::checkpoint`]): with `save_steps > 0` the loop
//! writes `DIR/step-N/` every `save_steps` optimizer steps, and on Ctrl-C after the step under
//! way: the trainable variables, Adam's moments and `trainer_state.json` (the step, the losses so
//! far, the last evaluation). A run resumed from it replays the epochs' seeded shuffles up to its
//! step and continues bit for bit: its weights and every later step's loss are those of a run
//! that never stopped.
//!
//! Deviations from transformers' `Trainer`: a step count fixed up front as
//! `ceil(epochs · ceil(n / (batch_size · gradient_accumulation_steps)))` (the last step of an
//! epoch takes the remainder) unless `max_steps` is set; no dropout. AdamW's weight decay
//! (`weight_decay`, 0 by default) skips biases and norms, as transformers groups them.

use candle_core::{DType, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

pub use super::checkpoint::Checkpointing;
use super::checkpoint::{self, LoopCheckpoint, LoopKind, RunShape};
use super::data::split_eval;
use crate::dist::Dist;
use crate::engine::schedule::ScheduleKind;
use crate::engine::{OptimArgs, Optimizer};
use crate::error::{ConfigError, Error, Result};
use crate::optim::Grads;
use crate::params::ParamStore;

crate::engine::training_arguments::training_arguments! {
    /// Optimization settings shared by SFT and reward-model training (the `[training]` table):
    /// transformers' `TrainingArguments` fields, declared once for every trainer that takes them
    /// (`engine::training_arguments!`; TRL's `SFTConfig` and `RewardConfig` derive from
    /// `TrainingArguments` too), then the supervised loop's own.
    ///
    /// Defaults follow transformers' `TrainingArguments` (learning rate 5e-5, 3 epochs, batch 8).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct TrainingArgs {
        /// Examples per forward/backward pass (transformers' `per_device_train_batch_size`, which
        /// is accepted as this key's other name: 8).
        #[serde(alias = "per_device_train_batch_size")]
        pub batch_size: usize,
        /// Examples per eval forward pass (`per_device_eval_batch_size`); default `batch_size`.
        #[serde(alias = "per_device_eval_batch_size")]
        pub eval_batch_size: Option<usize>,
        /// Warm-up as a fraction of the total steps, used when `warmup_steps` is 0
        /// (transformers 4's `warmup_ratio`: 0).
        pub warmup_ratio: f64,
        /// Fraction of the examples held out for evaluation, chosen by a seeded shuffle (default
        /// 0.1; 0 disables evaluation).
        pub eval_fraction: f64,
        /// Evaluate every this many optimizer steps (0: only after the last step).
        pub eval_every: usize,
        /// Write a checkpoint every this many optimizer steps (transformers' `save_steps`; 0: only
        /// when stopped by Ctrl-C). Where they go: the command's `--checkpoint-dir`.
        pub save_steps: usize,
    }
}

impl Default for TrainingArgs {
    fn default() -> Self {
        Self {
            learning_rate: 5e-5,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            lr_scheduler_type: ScheduleKind::Linear,
            warmup_steps: 0.0,
            max_steps: -1,
            num_train_epochs: 3.0,
            gradient_accumulation_steps: 1,
            seed: 42,
            batch_size: 8,
            eval_batch_size: None,
            warmup_ratio: 0.0,
            eval_fraction: 0.1,
            eval_every: 0,
            save_steps: 0,
        }
    }
}

impl TrainingArgs {
    /// Checks every field; the message names the field (`training.<name>`) and the fix.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        let positive = [
            ("batch_size", self.batch_size),
            ("eval_batch_size", self.eval_batch_size.unwrap_or(1)),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(ConfigError::new("training", name, "must be at least 1"));
            }
        }
        if self.max_steps <= 0 && !(self.num_train_epochs.is_finite() && self.num_train_epochs > 0.0) {
            return Err(ConfigError::new(
                "training",
                "num_train_epochs",
                format!(
                    "must be a positive number (fractions are allowed) when max_steps is unset, got {}",
                    self.num_train_epochs
                ),
            ));
        }
        for (name, v) in [("warmup_steps", self.warmup_steps), ("weight_decay", self.weight_decay)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::new("training", name, format!("must be ≥ 0, got {v}")));
            }
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(ConfigError::new(
                "training",
                "learning_rate",
                format!("must be a positive number, got {}", self.learning_rate),
            ));
        }
        let unit = [
            ("warmup_ratio", self.warmup_ratio, true),
            ("adam_beta1", self.adam_beta1, false),
            ("adam_beta2", self.adam_beta2, false),
            ("eval_fraction", self.eval_fraction, false),
        ];
        for (name, v, closed) in unit {
            if !(v >= 0.0 && (v < 1.0 || closed && v == 1.0)) {
                let range = if closed { "[0, 1]" } else { "[0, 1)" };
                return Err(ConfigError::new("training", name, format!("must be in {range}, got {v}")));
            }
        }
        if !(self.adam_epsilon.is_finite() && self.adam_epsilon > 0.0) {
            return Err(ConfigError::new(
                "training",
                "adam_epsilon",
                format!("must be a positive number, got {}", self.adam_epsilon),
            ));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(ConfigError::new(
                "training",
                "max_grad_norm",
                format!("must be ≥ 0 (0 disables clipping), got {}", self.max_grad_norm),
            ));
        }
        Ok(())
    }

    /// Examples per optimizer step: `batch_size · gradient_accumulation_steps`.
    pub fn examples_per_step(&self) -> usize {
        self.batch_size * self.gradient_accumulation_steps
    }

    /// Optimizer steps for `n_train` training examples: `max_steps` when positive, else
    /// `ceil(num_train_epochs · ceil(n_train / examples_per_step))` (transformers' count).
    pub fn total_steps(&self, n_train: usize) -> usize {
        if self.max_steps > 0 {
            return self.max_steps as usize;
        }
        let per_epoch = n_train.div_ceil(self.examples_per_step());
        (self.num_train_epochs * per_epoch as f64).ceil() as usize
    }

    /// The optimizer and schedule of a run of `total` optimizer steps. The warm-up is
    /// `warmup_steps` (a fraction of `total` below 1, as the other trainers read it), or, when
    /// that is 0, `ceil(total · warmup_ratio)` steps.
    pub fn optim_args(&self, total: usize) -> OptimArgs {
        // A whole number of steps (≥ 1, or 0) is read as steps by the shared declaration.
        let warmup_steps = if self.warmup_steps == 0.0 {
            (total as f64 * self.warmup_ratio).ceil()
        } else {
            self.warmup_steps
        };
        Self { warmup_steps, ..self.clone() }.optim_args_for(total)
    }
}

/// Metrics on the eval split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalResult {
    /// Mean loss over every loss term of the split (target tokens, texts or pairs).
    pub loss: f64,
    /// `exp(loss)`, for language models.
    pub perplexity: Option<f64>,
    /// Fraction correct: next-token argmax accuracy (SFT), class accuracy (labelled texts), or
    /// the fraction of pairs with `r_chosen > r_rejected` (preferences).
    pub accuracy: f64,
    /// Examples evaluated.
    pub examples: usize,
}

/// What the loop reports after each optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainProgress {
    /// Optimizer steps done (1 after the first).
    pub step: usize,
    /// Optimizer steps planned.
    pub total_steps: usize,
    /// Epoch of this step, counting from 1.
    pub epoch: usize,
    /// Mean loss over the loss terms of this step.
    pub loss: f64,
    /// Learning rate used by this step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Eval metrics, when this step evaluated.
    pub eval: Option<EvalResult>,
}

/// The result of a training run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainSummary {
    /// Optimizer steps done (those of a resumed run's checkpoint included).
    pub steps: usize,
    /// Optimizer steps planned: more than `steps` when the run was stopped.
    pub total_steps: usize,
    /// Loss of the last step.
    pub train_loss: f64,
    /// Mean of the step losses over the run (transformers' `training_loss`).
    pub mean_train_loss: f64,
    /// Eval metrics after the last step (none without an eval split).
    pub eval: Option<EvalResult>,
    /// Training examples.
    pub train_examples: usize,
    /// Eval examples.
    pub eval_examples: usize,
    /// Examples dropped before training (nothing left to learn after truncation).
    pub skipped_examples: usize,
}

/// The summed loss of a micro-batch.
pub(crate) struct BatchLoss {
    /// Sum of the loss terms, a differentiable scalar.
    pub loss_sum: Tensor,
    /// Correct predictions among the terms (counted only when asked).
    pub correct: usize,
}

/// What a task plugs into the loop.
pub(crate) trait Objective {
    /// One tokenized example.
    type Example;
    /// Whether eval reports perplexity (language models).
    const PERPLEXITY: bool;
    /// Loss terms `ex` contributes (target tokens, or 1).
    fn terms(&self, ex: &Self::Example) -> usize;
    /// Summed loss over `batch`; counts correct predictions when `count_correct`.
    fn batch_loss(&self, batch: &[&Self::Example], count_correct: bool) -> Result<BatchLoss>;
    /// Called before optimizer step `step` (from 0), a resumed run's included: an on-policy
    /// objective keys its samples' random streams by it, so that a resumed run draws what the
    /// uninterrupted one drew.
    fn begin_step(&self, _step: usize) {}
}

fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// Evaluates `examples` in batches of `batch_size` (no update).
pub(crate) fn evaluate<O: Objective>(
    obj: &O,
    examples: &[&O::Example],
    batch_size: usize,
) -> Result<EvalResult> {
    let (mut loss, mut terms, mut correct) = (0f64, 0usize, 0usize);
    for batch in examples.chunks(batch_size.max(1)) {
        let out = obj.batch_loss(batch, true)?;
        loss += scalar(&out.loss_sum.detach())?;
        correct += out.correct;
        terms += batch.iter().map(|e| obj.terms(e)).sum::<usize>();
    }
    let mean = loss / terms.max(1) as f64;
    Ok(EvalResult {
        loss: mean,
        perplexity: O::PERPLEXITY.then(|| mean.exp()),
        accuracy: correct as f64 / terms.max(1) as f64,
        examples: examples.len(),
    })
}

/// Forward and backward of one optimizer step's examples in micro-batches of `batch_size`;
/// returns the step loss, with the summed gradients in `grads`.
fn accumulate<O: Objective>(
    obj: &O,
    dist: &Dist,
    grads: &mut Grads,
    group: &[&O::Example],
    batch_size: usize,
) -> Result<f64> {
    // On several processes `group` is this process's share: the terms are counted over every
    // process, divided by their number, so that the gradients' mean is the whole step's.
    let world = dist.world_size() as f64;
    let terms = dist.sum(group.iter().map(|e| obj.terms(e)).sum::<usize>() as f64)? / world;
    grads.clear();
    let mut loss = 0f64;
    for mb in group.chunks(batch_size) {
        // Divided by the step's terms, not the micro-batch's: see the module docs.
        let scaled = (obj.batch_loss(mb, false)?.loss_sum / terms.max(1.0 / world))?;
        loss += scalar(&scaled.detach())?;
        grads.backward(&scaled)?;
    }
    // The step's loss: the mean of the processes' parts.
    Ok(dist.sum(loss)? / world)
}

/// What the supervised loop carries between steps, in `trainer_state.json` beside the step and
/// the run's shape ([`super::checkpoint::LoopCheckpoint`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SupervisedState {
    /// Loss of the last step (`None`: not finite).
    last_loss: Option<f64>,
    /// Sum of the step losses so far (`None`: not finite).
    loss_sum: Option<f64>,
    /// The last evaluation.
    last_eval: Option<EvalResult>,
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// Trains the variables of `store` on `examples` (split into train and eval by `args`) in the
/// run loop ([`crate::engine::run_loop`]), on `dist`'s processes (each a share of every step),
/// announcing the plan in the log only with `announce` (a
/// trainer that calls this every step, such as rejection sampling, passes false), and with
/// checkpoints when given. Stopped by `checkpoints.stop`, it returns after the step under way and
/// its checkpoint, with `steps` short of the run's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_with<O: Objective>(
    obj: &O,
    store: &ParamStore,
    examples: &[O::Example],
    args: &TrainingArgs,
    dist: &Dist,
    progress: &mut dyn FnMut(&TrainProgress),
    announce: bool,
    checkpoints: Option<Checkpointing>,
) -> Result<TrainSummary> {
    run_supervised(obj, store, examples, args, progress, announce, checkpoints, Lend::Own(dist.clone()))
}

/// [`run_with`] through `opt`, the caller's optimizer, whose learning rate, clipping and
/// schedule are used in place of `args`' (its Adam state carries on from the caller's last run
/// and into the next), on its processes: rejection sampling's fine-tuning. No checkpoints,
/// nothing announced.
pub(crate) fn run_on<O: Objective>(
    obj: &O,
    store: &ParamStore,
    examples: &[O::Example],
    args: &TrainingArgs,
    opt: &mut Optimizer,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    run_supervised(obj, store, examples, args, progress, false, None, Lend::Lent(opt))
}

/// The optimizer of a supervised run: its own, made from `[training]`, on these processes, or
/// a caller's ([`run_on`]).
enum Lend<'a> {
    Own(Dist),
    Lent(&'a mut Optimizer),
}

/// [`run_with`] and [`run_on`]: the run's own optimizer from `args`, or `lent`.
#[allow(clippy::too_many_arguments)]
fn run_supervised<O: Objective>(
    obj: &O,
    store: &ParamStore,
    examples: &[O::Example],
    args: &TrainingArgs,
    progress: &mut dyn FnMut(&TrainProgress),
    announce: bool,
    checkpoints: Option<Checkpointing>,
    lent: Lend,
) -> Result<TrainSummary> {
    args.validate()?;
    if !store.trainable() {
        return Err(Error::argument("model", "its parameters must be trainable (load them trainable)"));
    }
    let _awake = store.device().is_cpu().then(crate::cpu::keep_pool_awake);
    let mut run = Supervised::new(obj, store, examples, args, checkpoints, lent)?;
    if announce {
        let world = run.opt.get().dist().world_size();
        tracing::info!(
            "training on {} examples ({} held out for eval): {} optimizer steps of {} examples{}, {} warm-up",
            run.train_idx.len(),
            run.eval.len(),
            run.shape.total_steps,
            args.examples_per_step() * world,
            if world > 1 {
                format!(" ({world} processes × {})", args.examples_per_step())
            } else {
                String::new()
            },
            run.opt.get().args().schedule.warmup_steps
        );
    }
    let steps = crate::engine::run_loop::run(&mut run, checkpoint::stop_flag(checkpoints), &mut |p| {
        progress(p);
        Ok(())
    })?;
    Ok(run.summary(steps))
}

/// SFT or reward-model training as an algorithm of the run loop: each step is one optimizer
/// step over `batch_size × gradient_accumulation_steps` examples (per process) of the epoch's
/// seeded shuffle.
struct Supervised<'a, O: Objective> {
    obj: &'a O,
    store: &'a ParamStore,
    examples: &'a [O::Example],
    args: &'a TrainingArgs,
    checkpoints: Option<Checkpointing<'a>>,
    opt: Opt<'a>,
    train_idx: Vec<usize>,
    eval: Vec<&'a O::Example>,
    shape: RunShape,
    start_step: usize,
    last_loss: f64,
    loss_sum: f64,
    last_eval: Option<EvalResult>,
}

/// The run's optimizer: its own, made from `[training]`, or a caller's whose state outlives the
/// run ([`run_on`]).
enum Opt<'a> {
    Own(Box<Optimizer>),
    Lent(&'a mut Optimizer),
}

impl Opt<'_> {
    fn get(&self) -> &Optimizer {
        match self {
            Opt::Own(o) => o,
            Opt::Lent(o) => o,
        }
    }

    fn get_mut(&mut self) -> &mut Optimizer {
        match self {
            Opt::Own(o) => o,
            Opt::Lent(o) => o,
        }
    }
}

/// The supervised data order: the epoch's seeded shuffle of the training examples and how many
/// of its steps were drawn.
struct EpochOrder {
    rng: rand::rngs::StdRng,
    epoch: usize,
    perm: Vec<usize>,
    drawn: usize,
}

impl<'a, O: Objective> Supervised<'a, O> {
    /// The run's split, schedule and optimizer; with `--resume`, the latest checkpoint's weights,
    /// Adam's moments and the loop's state.
    fn new(
        obj: &'a O,
        store: &'a ParamStore,
        examples: &'a [O::Example],
        args: &'a TrainingArgs,
        checkpoints: Option<Checkpointing<'a>>,
        lent: Lend<'a>,
    ) -> Result<Self> {
        let (train_idx, eval_idx) = split_eval(examples.len(), args.eval_fraction, args.seed)?;
        let eval = eval_idx.iter().map(|&i| &examples[i]).collect();
        // On N processes a step takes N times the examples, each process a share (module docs).
        let world = match &lent {
            Lend::Own(dist) => dist.world_size(),
            Lend::Lent(o) => o.dist().world_size(),
        };
        let total = args.total_steps(train_idx.len().div_ceil(world));
        let opt = match lent {
            Lend::Lent(o) => Opt::Lent(o),
            Lend::Own(dist) => {
                Opt::Own(Box::new(Optimizer::new(store, args.optim_args(total))?.with_dist(dist)))
            }
        };
        let shape = RunShape {
            total_steps: total,
            train_examples: train_idx.len(),
            seed: args.seed,
            processes: world,
        };
        let mut run = Self {
            obj,
            store,
            examples,
            args,
            checkpoints,
            opt,
            train_idx,
            eval,
            shape,
            start_step: 0,
            last_loss: f64::NAN,
            loss_sum: 0.0,
            last_eval: None,
        };
        if let Some(c) = checkpoints.filter(|c| c.resume) {
            let (saved, _) = checkpoint::load_latest::<SupervisedState>(
                c.dir,
                LoopKind::Supervised,
                &shape,
                store,
                run.opt.get_mut().adam_mut(),
                |_, _| Ok(()),
            )?;
            run.start_step = saved.step;
            let s = saved.state;
            (run.last_loss, run.loss_sum) = (s.last_loss.unwrap_or(f64::NAN), s.loss_sum.unwrap_or(f64::NAN));
            run.last_eval = s.last_eval;
        }
        Ok(run)
    }

    /// What the run did after `steps` steps.
    fn summary(&self, steps: usize) -> TrainSummary {
        TrainSummary {
            steps,
            total_steps: self.shape.total_steps,
            train_loss: self.last_loss,
            mean_train_loss: self.loss_sum / steps.max(1) as f64,
            eval: self.last_eval.clone(),
            train_examples: self.train_idx.len(),
            eval_examples: self.eval.len(),
            skipped_examples: 0,
        }
    }

    /// Examples per step over every process.
    fn global_step_examples(&self) -> usize {
        self.args.examples_per_step() * self.opt.get().dist().world_size()
    }
}

impl<O: Objective> crate::engine::run_loop::Algorithm for Supervised<'_, O> {
    type DataOrder = EpochOrder;
    /// The epoch (from 1) and the step's examples over every process.
    type Batch = (usize, Vec<usize>);
    type Report = TrainProgress;

    fn plan(&self) -> crate::engine::run_loop::Plan {
        checkpoint::plan(&self.shape, self.start_step, self.args.save_steps, self.checkpoints)
    }

    fn dist(&self) -> crate::dist::Dist {
        self.opt.get().dist().clone()
    }

    fn settings(&self) -> Result<String> {
        serde_json::to_string(self.args)
            .map_err(|e| Error::Internal(format!("cannot serialize [training]: {e}")))
    }

    fn data_order(&self) -> Result<EpochOrder> {
        let rng = rand::rngs::StdRng::seed_from_u64(self.args.seed.wrapping_add(1));
        Ok(EpochOrder { rng, epoch: 0, perm: Vec::new(), drawn: 0 })
    }

    /// The next step's examples: the epoch's shuffle cut into steps (the last one takes the
    /// remainder); a new epoch shuffles again.
    fn draw(&self, o: &mut EpochOrder) -> Result<(usize, Vec<usize>)> {
        let per_step = self.global_step_examples();
        if o.drawn * per_step >= o.perm.len() {
            o.epoch += 1;
            o.perm.clone_from(&self.train_idx);
            o.perm.shuffle(&mut o.rng);
            o.drawn = 0;
        }
        let start = o.drawn * per_step;
        o.drawn += 1;
        Ok((o.epoch, o.perm[start..(start + per_step).min(o.perm.len())].to_vec()))
    }

    fn step(&mut self, step: usize, (epoch, group): &(usize, Vec<usize>)) -> Result<TrainProgress> {
        // This process's share of the step's examples (balanced; exact however they split, as
        // the loss is divided by the terms of every process).
        let dist = self.opt.get().dist();
        let (world, rank) = (dist.world_size(), dist.rank());
        let share = &group[rank * group.len() / world..(rank + 1) * group.len() / world];
        let group: Vec<&O::Example> = share.iter().map(|&i| &self.examples[i]).collect();
        let opt = self.opt.get_mut();
        let (mut grads, lr) = opt.begin(step);
        self.obj.begin_step(step);
        let loss = accumulate(self.obj, opt.dist(), &mut grads, &group, self.args.batch_size)?;
        let grad_norm = opt.clip(&mut grads)?;
        if !opt.finish(grads, lr, grad_norm)? {
            tracing::warn!("step {}: the gradient is not finite, so no weight changed", step + 1);
        }
        let (done, total) = (step + 1, self.shape.total_steps);
        (self.last_loss, self.loss_sum) = (loss, self.loss_sum + loss);
        let due = (self.args.eval_every > 0 && done % self.args.eval_every == 0) || done == total;
        let eval_bs = self.args.eval_batch_size.unwrap_or(self.args.batch_size);
        let eval =
            if due && !self.eval.is_empty() { Some(evaluate(self.obj, &self.eval, eval_bs)?) } else { None };
        if eval.is_some() {
            self.last_eval.clone_from(&eval);
        }
        Ok(TrainProgress { step: done, total_steps: total, epoch: *epoch, loss, lr, grad_norm, eval })
    }

    fn checkpoint(&self, step: usize) -> Result<()> {
        let Some(c) = self.checkpoints else { return Ok(()) };
        let ck = LoopCheckpoint {
            trainer: LoopKind::Supervised,
            step,
            shape: self.shape,
            adam_steps: self.opt.get().adam().steps(),
            state: SupervisedState {
                last_loss: finite(self.last_loss),
                loss_sum: finite(self.loss_sum),
                last_eval: self.last_eval.clone(),
            },
        };
        checkpoint::save(c.dir, self.store, self.opt.get().adam(), &ck, &[]).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[training]` reads transformers' names and whole numbers where it holds floats, and the
    /// warm-up and step counts are transformers'.
    #[test]
    fn training_table_reads_transformers_names_and_counts_steps_as_transformers() {
        let text = "num_train_epochs = 2\nwarmup_steps = 3\nper_device_train_batch_size = 4\n\
                    per_device_eval_batch_size = 2\nweight_decay = 0.01\n";
        let a: TrainingArgs = toml::from_str(text).unwrap();
        assert_eq!((a.num_train_epochs, a.warmup_steps, a.batch_size), (2.0, 3.0, 4));
        assert_eq!((a.eval_batch_size, a.weight_decay, a.max_steps), (Some(2), 0.01, -1));
        a.validate().unwrap();
        // 10 examples in steps of 4: 3 per epoch, 2 epochs; 1.5 epochs round up.
        assert_eq!(a.total_steps(10), 6);
        assert_eq!(TrainingArgs { num_train_epochs: 1.5, ..a.clone() }.total_steps(10), 5);
        assert_eq!(TrainingArgs { max_steps: 4, ..a.clone() }.total_steps(10), 4);
        assert_eq!(a.optim_args(6).schedule.warmup_steps, 3);
        // Warm-up as a fraction: warmup_steps below 1, or warmup_ratio when warmup_steps is 0.
        assert_eq!(TrainingArgs { warmup_steps: 0.5, ..a.clone() }.optim_args(6).schedule.warmup_steps, 3);
        let ratio = TrainingArgs { warmup_steps: 0.0, warmup_ratio: 0.15, ..a.clone() };
        assert_eq!(ratio.optim_args(10).schedule.warmup_steps, 2);
        let whole = TrainingArgs { warmup_steps: 0.0, warmup_ratio: 1.0, ..a.clone() };
        assert_eq!(whole.optim_args(10).schedule.warmup_steps, 10);
        assert_eq!(a.optim_args(6).weight_decay, 0.01);
        let err = TrainingArgs { num_train_epochs: 0.0, ..a.clone() }.validate().unwrap_err().to_string();
        assert!(err.contains("num_train_epochs"), "{err}");
        assert!(toml::from_str::<TrainingArgs>("batch_sise = 4").is_err(), "unknown keys are refused");
    }
}
