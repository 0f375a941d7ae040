//! Checkpoints of the supervised runs in the run loop: SFT and the reward model
//! (`train/runner.rs`) and DPO (`dpo/run.rs`).
//!
//! `DIR/step-N/` holds the trainable variables (`trainable.safetensors`; for LoRA the adapter's),
//! Adam's moments (`optimizer.safetensors`), `trainer_state.json` (`LoopCheckpoint`: the step,
//! the run's shape, Adam's step count and what the loop carries between steps) and any files the
//! loop adds (DPO: `metrics.jsonl`, the metrics lines so far). No frozen model is saved: a
//! reference is the initial model, loaded again. Each checkpoint is written to a temporary
//! folder and renamed into place, so a kill leaves the previous checkpoints whole.
//!
//! A run resumed from it replays its epochs' seeded shuffles up to the step and continues bit for
//! bit. A checkpoint of another trainer, or of a run of another shape (step count, examples, seed,
//! processes), is refused with a message naming what differs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use candle_core::Tensor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::optim::Adam;
use crate::params::ParamStore;

/// Where a run checkpoints, whether it resumes, and what stops it (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Checkpointing<'a> {
    /// The folder of the `step-N/` checkpoints.
    pub dir: &'a Path,
    /// Continue from the latest checkpoint in `dir` (none there: an error naming the folder).
    pub resume: bool,
    /// Set (by Ctrl-C) to end the run after the step under way, with a checkpoint.
    pub stop: Option<&'a AtomicBool>,
}

/// The loop that wrote a checkpoint (`trainer` in `trainer_state.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum LoopKind {
    /// `rltune sft` or `rltune reward` (checkpoints written before this field read as it).
    #[default]
    Supervised,
    /// `rltune dpo`.
    Dpo,
}

impl LoopKind {
    fn command(self) -> &'static str {
        match self {
            Self::Supervised => "rltune sft or rltune reward",
            Self::Dpo => "rltune dpo",
        }
    }
}

/// What a resumed run must share with the run that wrote the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RunShape {
    /// Steps the run makes in all.
    pub total_steps: usize,
    /// Training examples (after the eval split) or preference pairs.
    pub train_examples: usize,
    /// The run's seed.
    pub seed: u64,
    /// Processes of the run.
    pub processes: usize,
}

/// `trainer_state.json`: the step, the run's shape, Adam's steps and the loop's own state `T`
/// (its fields sit beside the others in the file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LoopCheckpoint<T> {
    /// The loop that wrote it.
    #[serde(default)]
    pub trainer: LoopKind,
    /// Optimizer steps done.
    pub step: usize,
    /// Checked on resume.
    #[serde(flatten)]
    pub shape: RunShape,
    /// Adam steps taken.
    pub adam_steps: u64,
    /// What the loop carries between steps.
    #[serde(flatten)]
    pub state: T,
}

/// Never set: the stop flag of a run that takes no Ctrl-C.
static NEVER: AtomicBool = AtomicBool::new(false);

/// The flag that stops a run with `checkpoints` (Ctrl-C's), or one never set.
pub(crate) fn stop_flag<'a>(checkpoints: Option<Checkpointing<'a>>) -> &'a AtomicBool {
    checkpoints.and_then(|c| c.stop).unwrap_or(&NEVER)
}

/// The run loop's plan of a supervised or DPO run of `shape` from `start_step`: a checkpoint
/// every `save_steps` when it checkpoints at all (and on Ctrl-C), none at the end (the command
/// saves the model), no report.
pub(crate) fn plan(
    shape: &RunShape,
    start_step: usize,
    save_steps: usize,
    checkpoints: Option<Checkpointing>,
) -> crate::engine::run_loop::Plan {
    crate::engine::run_loop::Plan {
        total_steps: shape.total_steps,
        start_step,
        checkpoint_every: if checkpoints.is_some() { save_steps } else { 0 },
        checkpoint_at_end: false,
        report_every: usize::MAX,
    }
}

/// Writes `ck` with `store`'s trainable variables, `adam`'s moments and the `files` (name,
/// bytes) into `dir/step-N/`, atomically, and logs it; returns its path.
pub(crate) fn save<T: Serialize>(
    dir: &Path,
    store: &ParamStore,
    adam: &Adam,
    ck: &LoopCheckpoint<T>,
    files: &[(&str, &[u8])],
) -> Result<PathBuf> {
    let path = dir.join(format!("step-{}", ck.step));
    crate::models::load::save_dir_atomic(&path, |tmp: &Path| -> Result<()> {
        let vars: HashMap<String, Tensor> =
            store.vars().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
        crate::io::save_safetensors(&tmp.join("trainable.safetensors"), &vars)?;
        crate::run::checkpoint::save_moments(&tmp.join("optimizer.safetensors"), store, adam)?;
        for (name, bytes) in files {
            crate::io::write_bytes_atomic(&tmp.join(name), bytes)?;
        }
        let text = serde_json::to_string_pretty(ck)
            .map_err(|e| Error::Internal(format!("a checkpoint state does not serialize: {e}")))?;
        Ok(crate::io::write_bytes_atomic(&tmp.join("trainer_state.json"), text.as_bytes())?)
    })?;
    tracing::info!("checkpoint after step {}: {}", ck.step, path.display());
    Ok(path)
}

/// Loads the latest checkpoint under `dir` into `store` and `adam`, after checking that a `kind`
/// loop of shape `expect` wrote it and that `check(state, trainer_state.json)` accepts its
/// state. Returns it and its folder.
pub(crate) fn load_latest<T: DeserializeOwned>(
    dir: &Path,
    kind: LoopKind,
    expect: &RunShape,
    store: &ParamStore,
    adam: &mut Adam,
    check: impl FnOnce(&T, &Path) -> Result<()>,
) -> Result<(LoopCheckpoint<T>, PathBuf)> {
    let Some((_, path)) = crate::run::checkpoint::latest_checkpoint_in(dir)? else {
        return Err(Error::checkpoint(
            dir,
            "no checkpoint (step-N folder) to --resume from; run without --resume to start anew, or \
             give the folder the run wrote them to with --checkpoint-dir",
        ));
    };
    let file = path.join("trainer_state.json");
    let value = crate::io::read_json::<serde_json::Value>(&file)?;
    let written_by: LoopKind = value
        .get("trainer")
        .map(|t| serde_json::from_value(t.clone()))
        .transpose()
        .map_err(|e| Error::checkpoint(&file, format!("trainer: {e}")))?
        .unwrap_or_default();
    if written_by != kind {
        return Err(Error::checkpoint(
            &file,
            format!(
                "a checkpoint of {}, not of {}; resume it with the command that wrote it, or give \
             this run its own --checkpoint-dir",
                written_by.command(),
                kind.command()
            ),
        ));
    }
    let ck: LoopCheckpoint<T> = serde_json::from_value(value)
        .map_err(|e| Error::checkpoint(&file, format!("not a checkpoint of {} ({e})", kind.command())))?;
    let (saved, now) = (ck.shape, expect);
    let differs = [
        ("total_steps (epochs, max_steps, batch sizes)", saved.total_steps, now.total_steps),
        ("train_examples (the data, eval_fraction)", saved.train_examples, now.train_examples),
        ("seed", saved.seed as usize, now.seed as usize),
        ("processes", saved.processes, now.processes),
    ];
    for (what, saved, now) in differs {
        if saved != now {
            return Err(Error::checkpoint(
                &file,
                format!(
                    "saved with {what} = {saved} but this run has {now}; resume with the settings, \
                 data and processes it was started with"
                ),
            ));
        }
    }
    check(&ck.state, &file)?;
    load_weights(&path.join("trainable.safetensors"), store)?;
    let (ms, vs) = crate::run::checkpoint::load_moments(&path, store)?;
    adam.restore(ms, vs, ck.adam_steps)?;
    tracing::info!("resuming from {} (step {} of {})", path.display(), ck.step, ck.shape.total_steps);
    Ok((ck, path))
}

/// Sets every trainable variable of `store` from `weights`, which must hold each, of its shape.
fn load_weights(weights: &Path, store: &ParamStore) -> Result<()> {
    let saved =
        candle_core::safetensors::load(weights, store.device()).map_err(|e| Error::checkpoint(weights, e))?;
    for (name, var) in store.vars() {
        let t = saved.get(&name).ok_or_else(|| {
            Error::checkpoint(weights, format!("no tensor {name}; it is another model's checkpoint"))
        })?;
        if t.dims() != var.dims() {
            return Err(Error::checkpoint(
                weights,
                format!("{name} has shape {:?}, the model {:?}", t.dims(), var.dims()),
            ));
        }
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    Ok(())
}
