//! `[logging]`: the run directory, the report, and the experiment trackers (MLflow, W&B; see
//! [`crate::logging::mlflow`], [`crate::logging::wandb`] and [`super::tracking`]).

use crate::error::ConfigError;
use std::path::PathBuf;

/// `[logging]`
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingSection {
    /// The run directory (metrics.jsonl, report.html, tb/, checkpoints/).
    pub dir: PathBuf,
    /// Samples per step shown in the report's table.
    pub samples_per_step: usize,
    /// Rewrite report.html every this many steps (and at the end).
    pub report_every: usize,
    /// `"offline"`: also write a W&B offline run under `dir/wandb/` (upload it with `wandb sync`);
    /// `"disabled"` or absent: none ([`crate::logging::wandb`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wandb: Option<String>,
    /// The W&B project of the offline run (default `"rltune"`).
    pub wandb_project: String,
    /// The W&B entity (user or team); empty (default): the syncing user's default.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub wandb_entity: String,
    /// An MLflow file store to also log to (relative paths are under `dir`); absent: none
    /// ([`crate::logging::mlflow`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow: Option<PathBuf>,
    /// The MLflow experiment's name (default `"rltune"`), created in the store when absent.
    pub mlflow_experiment: String,
}

impl Default for LoggingSection {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/ppo"),
            samples_per_step: 4,
            report_every: 10,
            wandb: None,
            wandb_project: "rltune".into(),
            wandb_entity: String::new(),
            mlflow: None,
            mlflow_experiment: "rltune".into(),
        }
    }
}

impl LoggingSection {
    /// Whether a W&B offline run is written.
    pub fn wandb_offline(&self) -> bool {
        self.wandb.as_deref() == Some("offline")
    }

    /// Checks the tracker keys; messages name the key and the fix.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        match self.wandb.as_deref() {
            None | Some("offline") | Some("disabled") => {}
            Some("online") => {
                return Err(ConfigError::new(
                    "logging",
                    "wandb",
                    "= \"online\": rltune writes W&B runs offline only (no \
                            network while training); set wandb = \"offline\" and upload the run with \
                            `wandb sync DIR/wandb/offline-run-*`",
                ))
            }
            Some(other) => {
                return Err(ConfigError::new(
                    "logging",
                    "wandb",
                    format!(
                        "= {other:?} is not a W&B mode rltune writes; use \"offline\" (a run \
                     for `wandb sync`) or \"disabled\" (none)"
                    ),
                ))
            }
        }
        let bad_project =
            |p: &str| p.is_empty() || p.len() > 128 || p.contains(['/', '\\', '#', '?', '%', ':']);
        if self.wandb_offline() && bad_project(&self.wandb_project) {
            return Err(ConfigError::new(
                "logging",
                "wandb_project",
                format!(
                    "= {:?}: a W&B project name is 1 to 128 characters without \
                 / \\ # ? % or :; set another name",
                    self.wandb_project
                ),
            ));
        }
        if self.mlflow.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(ConfigError::new(
                "logging",
                "mlflow",
                "is empty; set it to the MLflow store's directory (e.g. \
                        \"mlruns\", under [logging] dir) or remove it",
            ));
        }
        if self.mlflow.is_some()
            && (self.mlflow_experiment.trim().is_empty() || self.mlflow_experiment.len() > 500)
        {
            return Err(ConfigError::new(
                "logging",
                "mlflow_experiment",
                format!(
                    "= {:?}: an MLflow experiment name is 1 to 500 characters; \
                 set another name (default \"rltune\")",
                    self.mlflow_experiment
                ),
            ));
        }
        Ok(())
    }
}
