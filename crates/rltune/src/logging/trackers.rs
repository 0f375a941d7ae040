//! Experiment trackers beside TensorBoard: an MLflow file store ([`super::mlflow`]) and a W&B
//! offline run ([`super::wandb`]), both written in Rust as the run goes, under the metric names
//! of `metrics.jsonl` (TRL's).
//!
//! `RUN_DIR/trackers.json` records the ids of the runs opened (`{"mlflow": {"experiment_id",
//! "run_id"}, "wandb": {"run_id"}}`), so that a resumed rltune run continues the same tracker runs.
//! A run ends with [`RunEnd`]: the run loop sets it; trackers dropped without it (an error or a
//! panic on the way out) are marked failed.

use std::path::{Path, PathBuf};

use super::jsonl::MetricRow;
use super::mlflow::{MlflowOptions, MlflowRun};
pub use super::tracker_ids::RunEnd;
use super::wandb::{WandbOptions, WandbRun};
use crate::error::{Error, Result};

/// The trackers a run logs to, besides `metrics.jsonl` and TensorBoard.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trackers {
    /// `[logging] mlflow`.
    pub mlflow: Option<MlflowOptions>,
    /// `[logging] wandb = "offline"`.
    pub wandb: Option<WandbOptions>,
}

impl Trackers {
    /// Whether any tracker is on.
    pub fn any(&self) -> bool {
        self.mlflow.is_some() || self.wandb.is_some()
    }
}

/// The file that records the trackers' run ids in a run directory.
pub const TRACKERS_FILE: &str = "trackers.json";

/// The open tracker runs of a [`super::RunLogger`].
#[derive(Debug)]
pub struct TrackerRuns {
    mlflow: Option<MlflowRun>,
    wandb: Option<WandbRun>,
    ended: bool,
}

impl TrackerRuns {
    /// Opens the trackers of `trackers` for the run directory `dir`; `resume_from` as
    /// [`super::RunLogger::create`].
    pub fn open(dir: &Path, resume_from: Option<usize>, trackers: &Trackers) -> Result<Self> {
        let ids_path = dir.join(TRACKERS_FILE);
        let old: serde_json::Value = match resume_from {
            Some(_) => std::fs::read_to_string(&ids_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default(),
            None => serde_json::Value::Null,
        };
        let mut ids = serde_json::Map::new();
        let mlflow = match &trackers.mlflow {
            Some(opts) => {
                let (exp, run) = (old["mlflow"]["experiment_id"].as_str(), old["mlflow"]["run_id"].as_str());
                let resume = match (exp, run, resume_from) {
                    (Some(e), Some(r), Some(k)) => Some((e, r, k)),
                    _ => None,
                };
                let run = MlflowRun::open(opts, dir, resume)?;
                ids.insert(
                    "mlflow".into(),
                    serde_json::json!({"experiment_id": run.experiment_id(), "run_id": run.run_id(), "run_dir": run.dir()}),
                );
                Some(run)
            }
            None => None,
        };
        let wandb = match &trackers.wandb {
            Some(opts) => {
                let id = old["wandb"]["run_id"]
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(super::wandb::new_run_id);
                let run = WandbRun::create(opts, dir, &id, resume_from)?;
                ids.insert("wandb".into(), serde_json::json!({"run_id": id, "dir": run.dir()}));
                Some(run)
            }
            None => None,
        };
        if !ids.is_empty() {
            let text = serde_json::to_string_pretty(&serde_json::Value::Object(ids))
                .map_err(|e| Error::Internal(format!("cannot serialize {}: {e}", ids_path.display())))?;
            crate::io::write_bytes_atomic(&ids_path, text.as_bytes())?;
        }
        Ok(TrackerRuns { mlflow, wandb, ended: false })
    }

    /// Logs one step: its scalars to MLflow; its scalars and `*_dist` histograms to W&B.
    pub fn log(&mut self, row: &MetricRow) -> Result<()> {
        if let Some(m) = &mut self.mlflow {
            m.log(row.step, &row.scalars)?;
        }
        if let Some(w) = &mut self.wandb {
            w.log(row)?;
        }
        Ok(())
    }

    /// Ends the tracker runs with `end` (once; later calls do nothing).
    pub fn finish(&mut self, end: RunEnd) -> Result<()> {
        if std::mem::replace(&mut self.ended, true) {
            return Ok(());
        }
        let a = self.mlflow.as_mut().map_or(Ok(()), |m| m.finish(end));
        let b = self.wandb.as_mut().map_or(Ok(()), |w| w.finish(end));
        a.and(b)
    }

    /// The MLflow run's folder in its store, if MLflow is on.
    pub fn mlflow_dir(&self) -> Option<PathBuf> {
        self.mlflow.as_ref().map(|m| m.dir().to_path_buf())
    }

    /// The W&B offline run's folder, if W&B is on.
    pub fn wandb_dir(&self) -> Option<PathBuf> {
        self.wandb.as_ref().map(|w| w.dir().to_path_buf())
    }
}

impl Drop for TrackerRuns {
    fn drop(&mut self) {
        if !self.ended {
            if let Err(e) = self.finish(RunEnd::Failed) {
                tracing::warn!("could not mark the tracker runs failed: {e}");
            }
        }
    }
}
