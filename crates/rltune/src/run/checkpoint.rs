//! Checkpoints of a PPO, GRPO or RLOO run: `DIR/checkpoints/step-N/`, the policy and value head in Hugging Face
//! layout (loadable by transformers and TRL), plus `trainer_state.json`; with optimizer state
//! also `optimizer.safetensors` (Adam's moments), which `--resume` needs. No reference model is
//! saved: it is the run's `[ref_model]` (or the initial `[model]`). A run with a `[critic]` also
//! saves it in `critic/` (`model.safetensors` with its value head, `config.json`, its tokenizer,
//! and with optimizer state its own `optimizer.safetensors`), and `--resume` loads it from there.
//!
//! Every checkpoint is written to a temporary directory and renamed into place, so a crash
//! (even SIGKILL) leaves the previous checkpoints and at most a `.step-N.tmp-PID` folder, which
//! the next save of that step replaces and [`latest_checkpoint`] ignores.
//!
//! A resumed run continues bit for bit: `trainer_state.json` holds everything the loop carries
//! between steps besides the weights and Adam's moments (the KL controller, the minibatch-shuffle
//! stream's position, the running score moments, the skipped-batch count); the prompt order,
//! query lengths and sampling seeds are functions of the step and are replayed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Device;

use crate::error::{Error, Result};
use crate::io::{read_json, write_bytes_atomic};
use crate::models::load::{copy_side_files, save_dir_atomic, ModelFiles};
use crate::optim::Adam;
use crate::params::ParamStore;
use crate::ppo::{KlController, PpoTrainer, TrainerStreams};
use crate::run::config::AlgorithmKind;

/// The sub-directory of a checkpoint holding the separate critic.
pub const CRITIC_DIR: &str = "critic";

/// `trainer_state.json`
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// PPO steps done.
    pub step: usize,
    /// The KL controller after that step.
    pub kl_controller: KlController,
    /// Adam steps taken.
    pub adam_steps: u64,
    /// Whether `optimizer.safetensors` is present.
    pub optimizer_state: bool,
    /// The shuffle stream and score moments (absent in checkpoints of rltune before 0.1.0's
    /// exact resume: such a run resumes with fresh ones and says so).
    #[serde(default)]
    pub streams: Option<TrainerStreams>,
    /// Batches skipped so far for a non-finite reward (`rltune/skipped_batches`).
    #[serde(default)]
    pub skipped_batches: usize,
    /// Updates skipped so far for a non-finite loss or gradient (`rltune/skipped_updates`).
    #[serde(default)]
    pub skipped_updates: usize,
    /// The critic's Adam steps, for a run with a separate critic (`critic/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_adam_steps: Option<u64>,
    /// The processes of the run that wrote it, and its samples per step over all of them.
    #[serde(default)]
    pub processes: Processes,
}

/// How many processes wrote a checkpoint, and the global batch of a step (samples over every
/// process). A run resumes exactly on another number of processes when the global batch stays
/// the same (up to the order of floating-point sums); otherwise it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Processes {
    /// The number of processes.
    pub world_size: usize,
    /// Samples (PPO responses, GRPO/RLOO completions) per step over every process; 0: not
    /// recorded (a checkpoint of rltune before data parallelism).
    pub global_batch: usize,
}

impl Default for Processes {
    fn default() -> Self {
        Self { world_size: 1, global_batch: 0 }
    }
}

impl Processes {
    /// This run's: the world size of `dist` and `per_process` samples on each.
    pub fn current(dist: &crate::dist::Dist, per_process: usize) -> Self {
        let world_size = dist.world_size();
        Self { world_size, global_batch: per_process * world_size }
    }

    /// Refuses to resume the checkpoint at `path` (written by `self`) in a run of `now`
    /// whose global batch differs; `field` names the per-process batch to change.
    pub fn check_resume(&self, now: &Processes, path: &Path, field: &str) -> Result<()> {
        if self.global_batch == 0 || self.global_batch == now.global_batch {
            return Ok(());
        }
        let fits = self.global_batch.is_multiple_of(now.world_size);
        Err(Error::checkpoint(
            path,
            format!(
                "written by a run of {} process(es) with a global batch of {} per step; this run has {} \
             process(es) × {} = {}. {}, or start a new run with this checkpoint as [model]",
                self.world_size,
                self.global_batch,
                now.world_size,
                now.global_batch / now.world_size.max(1),
                now.global_batch,
                if fits {
                    format!(
                    "Set {field} = {} to keep the global batch (the run then continues as it would have, \
                     up to the order of floating-point sums)",
                    self.global_batch / now.world_size
                )
                } else {
                    format!("Resume on a number of processes that divides {}", self.global_batch)
                }
            ),
        ))
    }
}

/// Where a critic came from: its `config.json` (kept so saving preserves every field) and files.
#[derive(Debug, Clone)]
pub struct CriticFiles {
    /// The raw config.json.
    pub config_json: serde_json::Value,
    /// Its files (the tokenizer is copied into checkpoints).
    pub files: ModelFiles,
}

/// Writes `store` and `config_json` into `dir` (model.safetensors, config.json, side files), and
/// Adam's moments into `optimizer.safetensors` when `optimizer` is given.
fn save_model(
    dir: &Path,
    store: &ParamStore,
    config_json: &serde_json::Value,
    files: &ModelFiles,
    optimizer: Option<&Adam>,
) -> Result<()> {
    if store.has_lora() {
        // The adapter in PEFT's format (and the value head); the base stays where it was.
        store.save_adapter(dir, None)?;
    } else {
        store.save_safetensors(&dir.join("model.safetensors"))?;
        let cfg = serde_json::to_string_pretty(config_json)
            .map_err(|e| Error::Internal(format!("a model config does not serialize: {e}")))?;
        write_bytes_atomic(&dir.join("config.json"), cfg.as_bytes())?;
    }
    copy_side_files(files, dir)?;
    if let Some(opt) = optimizer {
        save_moments(&dir.join("optimizer.safetensors"), store, opt)?;
    }
    Ok(())
}

/// Adam's moments of `store`'s variables into `path` (`m.NAME`, `v.NAME`).
pub(crate) fn save_moments(path: &Path, store: &ParamStore, opt: &Adam) -> Result<()> {
    let mut tensors = HashMap::new();
    for (i, (name, var)) in store.vars().iter().enumerate() {
        let (m, v) = opt.moments(i)?;
        debug_assert_eq!(m.shape(), var.shape());
        tensors.insert(format!("m.{name}"), m);
        tensors.insert(format!("v.{name}"), v);
    }
    Ok(crate::io::save_safetensors(path, &tensors)?)
}

/// Adam's first and second moments, one vector per variable.
type Moments = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Adam's moments of `store`'s variables from `dir/optimizer.safetensors`.
pub(crate) fn load_moments(dir: &Path, store: &ParamStore) -> Result<Moments> {
    let path = dir.join("optimizer.safetensors");
    let t = candle_core::safetensors::load(&path, &Device::Cpu)
        .map_err(|e| Error::weights(&path, e.to_string()))?;
    let (mut ms, mut vs) = (Vec::new(), Vec::new());
    for (name, _) in store.vars() {
        let get = |k: String| -> Result<Vec<f32>> {
            let x = t.get(&k).ok_or_else(|| Error::weights(&path, format!("missing {k}")))?;
            Ok(x.flatten_all()?.to_vec1::<f32>()?)
        };
        ms.push(get(format!("m.{name}"))?);
        vs.push(get(format!("v.{name}"))?);
    }
    Ok((ms, vs))
}

/// Saves a checkpoint of `trainer` after `step` steps into `dir`; with a critic (whose
/// `config.json` and files `critic_files` gives), also `dir/critic/`.
#[allow(clippy::too_many_arguments)]
pub fn save_checkpoint(
    dir: &Path,
    trainer: &PpoTrainer,
    config_json: &serde_json::Value,
    files: &ModelFiles,
    critic_files: Option<&CriticFiles>,
    optimizer_state: bool,
    step: usize,
    skipped_batches: usize,
) -> Result<()> {
    save_dir_atomic(dir, |tmp| {
        let opt = trainer.optimizer();
        save_model(tmp, &trainer.store, config_json, files, optimizer_state.then_some(opt))?;
        let critic = match (trainer.critic(), critic_files) {
            (Some(c), Some(f)) => Some((c, f)),
            (None, None) => None,
            _ => return Err(Error::Internal("a critic without its files, or files without a critic".into())),
        };
        if let Some((c, f)) = critic {
            let sub = tmp.join(CRITIC_DIR);
            std::fs::create_dir_all(&sub).map_err(|e| Error::io(&sub, e))?;
            let opt = optimizer_state.then_some(c.optimizer());
            save_model(&sub, &c.store, &f.config_json, &f.files, opt)?;
        }
        let state = TrainerState {
            step,
            kl_controller: trainer.kl_controller().clone(),
            adam_steps: opt.steps(),
            optimizer_state,
            streams: Some(trainer.streams()),
            skipped_batches,
            skipped_updates: trainer.skipped_updates(),
            critic_adam_steps: trainer.critic().map(|c| c.optimizer().steps()),
            processes: Processes::current(trainer.dist(), trainer.config.batch_size),
        };
        let text = serde_json::to_string_pretty(&state)
            .map_err(|e| Error::Internal(format!("a trainer state does not serialize: {e}")))?;
        Ok(write_bytes_atomic(&tmp.join("trainer_state.json"), text.as_bytes())?)
    })
}

/// Clears what killed checkpoint writes left under `run_dir/checkpoints`: a `.step-N.tmp-PID`
/// folder (an unfinished write) is removed; a `.step-N.old-PID` folder (the previous copy of a
/// checkpoint being replaced) is put back as `step-N` if that is missing, else removed.
pub fn clear_stale_writes(run_dir: &Path) -> Result<()> {
    let dir = run_dir.join("checkpoints");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(()) };
    for entry in entries {
        let path = entry.map_err(|e| Error::io(&dir, e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix('.')) else {
            continue;
        };
        if let Some((step, _pid)) = name.rsplit_once(".old-") {
            let target = dir.join(step);
            if !target.exists() {
                tracing::warn!("{}: restored from an interrupted replacement", target.display());
                std::fs::rename(&path, &target).map_err(|e| Error::io(&target, e))?;
                continue;
            }
        } else if !name.contains(".tmp-") {
            continue;
        }
        std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
    }
    Ok(())
}

/// The checkpoint with the most steps under `run_dir/checkpoints`, if any.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<(usize, PathBuf)>> {
    latest_checkpoint_in(&run_dir.join("checkpoints"))
}

/// The `step-N` folder with the largest N in `dir`, if any.
pub fn latest_checkpoint_in(dir: &Path) -> Result<Option<(usize, PathBuf)>> {
    if !dir.exists() {
        return Ok(None);
    }
    let mut best: Option<(usize, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let step = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-"));
        if let Some(step) = step.and_then(|s| s.parse::<usize>().ok()) {
            if best.as_ref().is_none_or(|(b, _)| step > *b) {
                best = Some((step, path));
            }
        }
    }
    Ok(best)
}

/// Restores the KL controller and Adam's moments from a checkpoint (the weights were loaded
/// from it already). Fails if it was saved without optimizer state.
pub fn load_trainer_state(dir: &Path, trainer: &mut PpoTrainer) -> Result<TrainerState> {
    let path = dir.join("trainer_state.json");
    let state: TrainerState = read_json(&path)?;
    state.processes.check_resume(
        &Processes::current(trainer.dist(), trainer.config.batch_size),
        &path,
        "[ppo] batch_size",
    )?;
    if !state.optimizer_state {
        return Err(Error::checkpoint(
            dir,
            "saved without optimizer state, so the run cannot resume exactly; set \
             [checkpoint] optimizer_state = true (or start a new run from this directory as [model])",
        ));
    }
    let (ms, vs) = load_moments(dir, &trainer.store)?;
    trainer.optimizer_mut().restore(ms, vs, state.adam_steps)?;
    if let Some(c) = trainer.critic_mut() {
        let sub = dir.join(CRITIC_DIR);
        let steps = state.critic_adam_steps.ok_or_else(|| {
            Error::checkpoint(
                dir.join("trainer_state.json"),
                "no critic_adam_steps although the run has a [critic]; this checkpoint was \
                 saved by a run without one: remove [critic] to resume it",
            )
        })?;
        let (ms, vs) = load_moments(&sub, &c.store)?;
        c.optimizer_mut().restore(ms, vs, steps)?;
    }
    *trainer.kl_controller_mut() = state.kl_controller.clone();
    match &state.streams {
        Some(streams) => trainer.restore_streams(streams),
        None => tracing::warn!(
            "{}: no shuffle-stream state (an older checkpoint); the resumed run's minibatch order \
             differs from an uninterrupted run's",
            dir.display()
        ),
    }
    trainer.set_skipped_updates(state.skipped_updates);
    Ok(state)
}

/// `trainer_state.json` of a GRPO or RLOO run: what the loop carries between steps besides the
/// weights and Adam's moments (the prompt order and sampling seeds are replayed from the step).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupTrainerState {
    /// `"grpo"` or `"rloo"`.
    pub algorithm: AlgorithmKind,
    /// Steps of the loop done (generation batches).
    pub step: usize,
    /// Adam steps taken.
    pub adam_steps: u64,
    /// Whether `optimizer.safetensors` is present.
    pub optimizer_state: bool,
    /// Optimizer steps taken (the learning-rate schedule's position).
    pub global_step: usize,
    /// Batches trained on.
    pub calls: usize,
    /// Prompt and completion tokens seen (`num_tokens`).
    pub num_tokens: f64,
    /// Updates skipped for a non-finite loss or gradient (`rltune/skipped_updates`).
    pub skipped_updates: usize,
    /// The processes of the run that wrote it, and its completions per step over all of them.
    #[serde(default)]
    pub processes: Processes,
}

/// The GRPO/RLOO trainer's state: its optimizer and counters; `per_process` completions per
/// step on each process.
pub(crate) fn group_state(
    core: &crate::grpo::core::Core,
    algorithm: AlgorithmKind,
    step: usize,
    optimizer_state: bool,
    per_process: usize,
) -> GroupTrainerState {
    GroupTrainerState {
        processes: Processes::current(core.dist(), per_process),
        algorithm,
        step,
        adam_steps: core.optimizer().steps(),
        optimizer_state,
        global_step: core.global_step,
        calls: core.calls,
        num_tokens: core.tokens_seen,
        skipped_updates: core.skipped_updates,
    }
}

/// Saves a checkpoint of a GRPO/RLOO run into `dir`: the policy in Hugging Face layout,
/// `trainer_state.json`, and with `state.optimizer_state` Adam's moments.
pub(crate) fn save_group_checkpoint(
    dir: &Path,
    core: &crate::grpo::core::Core,
    config_json: &serde_json::Value,
    files: &ModelFiles,
    state: &GroupTrainerState,
) -> Result<()> {
    save_dir_atomic(dir, |tmp: &Path| -> Result<()> {
        save_model(tmp, &core.store, config_json, files, state.optimizer_state.then_some(core.optimizer()))?;
        let text = serde_json::to_string_pretty(state)
            .map_err(|e| Error::Internal(format!("a trainer state does not serialize: {e}")))?;
        Ok(write_bytes_atomic(&tmp.join("trainer_state.json"), text.as_bytes())?)
    })
}

/// Restores a GRPO/RLOO trainer's optimizer and counters from a checkpoint (the weights were
/// loaded from it already). Fails, naming the fix, for a checkpoint without optimizer state
/// or of another trainer.
pub(crate) fn load_group_state(
    dir: &Path,
    core: &mut crate::grpo::core::Core,
    algorithm: AlgorithmKind,
    per_process: usize,
) -> Result<GroupTrainerState> {
    let path = dir.join("trainer_state.json");
    let value: serde_json::Value = read_json(&path)?;
    let state: GroupTrainerState = serde_json::from_value(value.clone()).map_err(|e| {
        let by = if value.get("kl_controller").is_some() { "a PPO run" } else { "another trainer" };
        Error::checkpoint(
            &path,
            format!(
                "not a GRPO/RLOO checkpoint ({e}); it was written by {by}: resume it with its own \
             [algorithm] kind, or start a new run with this checkpoint as [model]"
            ),
        )
    })?;
    if state.algorithm != algorithm {
        return Err(Error::checkpoint(
            &path,
            format!(
                "written by a {} run but [algorithm] kind = \"{}\"; resume with kind = \"{}\", or start \
             a new run with this checkpoint as [model]",
                state.algorithm.name(),
                algorithm.name(),
                state.algorithm.name()
            ),
        ));
    }
    if !state.optimizer_state {
        return Err(Error::checkpoint(
            dir,
            "saved without optimizer state, so the run cannot resume exactly; set \
             [checkpoint] optimizer_state = true (or start a new run from this directory as [model])",
        ));
    }
    let field = format!("[{}] per_device_train_batch_size", algorithm.name());
    state.processes.check_resume(&Processes::current(core.dist(), per_process), &path, &field)?;
    let (ms, vs) = load_moments(dir, &core.store)?;
    core.optimizer_mut().restore(ms, vs, state.adam_steps)?;
    core.global_step = state.global_step;
    core.calls = state.calls;
    core.tokens_seen = state.num_tokens;
    core.skipped_updates = state.skipped_updates;
    Ok(state)
}
