//! The experiment trackers of a run's config (`[logging] mlflow`, `[logging] wandb`): what
//! [`crate::logging::RunLogger::create_with`] opens.

use super::config::RunConfig;
use crate::error::{Error, Result};
use crate::logging::mlflow::MlflowOptions;
use crate::logging::wandb::WandbOptions;
use crate::logging::Trackers;

/// The trackers `config` turns on, with its resolved config as MLflow params (flattened) and as
/// the W&B config (nested).
pub fn trackers(config: &RunConfig) -> Result<Trackers> {
    let logging = &config.logging;
    if logging.mlflow.is_none() && !logging.wandb_offline() {
        return Ok(Trackers::default());
    }
    let resolved: toml::Table = toml::from_str(&config.to_toml()?)
        .map_err(|e| Error::Internal(format!("cannot re-read the resolved config: {e}")))?;
    let name =
        logging.dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "rltune".into());
    let run_dir = std::path::absolute(&logging.dir).unwrap_or_else(|_| logging.dir.clone());
    let mlflow = logging.mlflow.as_ref().map(|store| {
        let mut params = Vec::new();
        flatten("", &toml::Value::Table(resolved.clone()), &mut params);
        MlflowOptions {
            store: store.clone(),
            experiment: logging.mlflow_experiment.clone(),
            run_name: name.clone(),
            params,
            tags: vec![
                ("rltune.run_dir".into(), run_dir.display().to_string()),
                ("rltune.algorithm".into(), format!("{:?}", config.algorithm.kind).to_lowercase()),
            ],
            user: crate::runtime::host().user.unwrap_or_else(|| "unknown".into()),
        }
    });
    let wandb = logging.wandb_offline().then(|| WandbOptions {
        project: logging.wandb_project.clone(),
        entity: logging.wandb_entity.clone(),
        name,
        config: serde_json::to_value(&resolved).unwrap_or_default(),
    });
    Ok(Trackers { mlflow, wandb })
}

/// `table.key = value` pairs of a TOML value: tables nest with `.`; arrays and values are written
/// as TOML writes them inline (strings unquoted).
fn flatten(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        toml::Value::String(s) => out.push((prefix.to_string(), s.clone())),
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const MINIMAL: &str = "[model]\npath = \"m\"\n[data]\nsource = \"p.jsonl\"\n[[reward.sources]]\n\
                           kind = \"command\"\ncommand = [\"cat\"]\n[logging]\ndir = \"runs/x\"\n";

    #[test]
    fn trackers_are_off_unless_asked_and_carry_the_resolved_config() {
        let p = Path::new("run.toml");
        let c = RunConfig::from_toml(MINIMAL, p, &[]).unwrap();
        assert!(!trackers(&c).unwrap().any());
        let set = ["logging.mlflow=mlruns".into(), "logging.wandb=offline".into()];
        let c = RunConfig::from_toml(MINIMAL, p, &set).unwrap();
        let t = trackers(&c).unwrap();
        let m = t.mlflow.unwrap();
        assert_eq!((m.experiment.as_str(), m.run_name.as_str()), ("rltune", "x"));
        let get = |k: &str| m.params.iter().find(|(p, _)| p == k).map(|(_, v)| v.clone());
        assert_eq!(get("ppo.batch_size").as_deref(), Some(c.ppo.batch_size.to_string().as_str()));
        assert_eq!(get("model.path").as_deref(), Some("m"));
        assert!(get("reward.sources").unwrap().contains("cat"));
        let w = t.wandb.unwrap();
        assert_eq!(w.project, "rltune");
        assert_eq!(w.config["ppo"]["batch_size"], c.ppo.batch_size);
        assert!(!trackers(&RunConfig::from_toml(MINIMAL, p, &["logging.wandb=disabled".into()]).unwrap())
            .unwrap()
            .any());
    }

    #[test]
    fn bad_tracker_keys_name_the_key_and_the_fix() {
        let p = Path::new("run.toml");
        let err = |set: &str| RunConfig::from_toml(MINIMAL, p, &[set.into()]).unwrap_err().to_string();
        let e = err("logging.wandb=online");
        assert!(e.contains("logging.wandb = \"online\"") && e.contains("wandb sync"), "{e}");
        let e = err("logging.wandb=ofline");
        assert!(e.contains("logging.wandb = \"ofline\"") && e.contains("\"offline\""), "{e}");
        let e = RunConfig::from_toml(
            MINIMAL,
            p,
            &["logging.wandb=offline".into(), "logging.wandb_project=a/b".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("logging.wandb_project"), "{e}");
        let e = RunConfig::from_toml(
            MINIMAL,
            p,
            &["logging.mlflow=m".into(), "logging.mlflow_experiment= ".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("logging.mlflow_experiment"), "{e}");
        let e = err("logging.mlflw=m");
        assert!(e.contains("did you mean \"mlflow\""), "{e}");
    }

    #[test]
    fn the_trackers_example_config_loads_with_both_trackers() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/trackers.toml");
        let c = RunConfig::load(&p, &[]).unwrap();
        let t = trackers(&c).unwrap();
        assert_eq!(t.mlflow.unwrap().store, std::path::PathBuf::from("../mlruns"));
        assert_eq!(t.wandb.unwrap().project, "rltune");
    }
}
