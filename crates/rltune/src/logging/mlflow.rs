//! `[logging] mlflow = "DIR"`: an MLflow file store, written without the `mlflow` package, that
//! `mlflow ui --backend-store-uri DIR` and `mlflow.search_runs` read.
//!
//! The layout is `FileStore`'s (`mlflow/store/tracking/file_store.py`, mlflow 3.17):
//! ```text
//! DIR/0/meta.yaml                       the "Default" experiment (made with a new store, as mlflow does)
//! DIR/.trash/                           deleted experiments (made empty, as mlflow does)
//! DIR/<experiment_id>/meta.yaml         name, artifact_location, lifecycle_stage, creation_time…
//! DIR/<experiment_id>/<run_id>/meta.yaml   run_id, run_name, status, start_time, end_time…
//!                    <run_id>/metrics/<key>  one line per step: "<timestamp_ms> <value> <step>"
//!                    <run_id>/params/<key>   the resolved config, flattened (`ppo.batch_size`)
//!                    <run_id>/tags/<key>     mlflow.runName, mlflow.source.name, mlflow.user…
//!                    <run_id>/artifacts/     empty (mlflow requires it)
//! ```
//! A key holding `/` (`ppo/loss/total`) is a nested file (`metrics/ppo/loss/total`), as mlflow
//! writes it. Metric values are written as Python's `str(float)` reads them back (`nan`, `inf`).
//! Run `status` is mlflow's `RunStatus` number: RUNNING 1, FINISHED 3, FAILED 4, KILLED 5.
//!
//! Crash safety: metric lines are appended in one write each (the kernel has them once written;
//! `metrics.jsonl` is the synced record of the run); meta files are written to a temporary file
//! and renamed. Deviation: mlflow refuses to change a param's value; a resumed run rewrites the
//! params with its own resolved config.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::tracker_ids::RunEnd;
use crate::error::{ConfigError, Error, Result};

/// What an MLflow run is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct MlflowOptions {
    /// The store's root (`[logging] mlflow`); relative paths are under the run directory.
    pub store: PathBuf,
    /// The experiment's name (`[logging] mlflow_experiment`); created when absent.
    pub experiment: String,
    /// The run's name (`mlflow.runName`).
    pub run_name: String,
    /// The run's params: the resolved config, flattened.
    pub params: Vec<(String, String)>,
    /// Extra tags (`rltune.run_dir`, …).
    pub tags: Vec<(String, String)>,
    /// Who runs it (`mlflow.user`, `user_id`; [`crate::runtime::Host::user`]).
    pub user: String,
}

/// An open MLflow run in a file store.
#[derive(Debug)]
pub struct MlflowRun {
    run_dir: PathBuf,
    experiment_id: String,
    run_id: String,
    run_name: String,
    user: String,
    start_ms: u64,
    metrics: HashMap<String, File>,
    skipped: Vec<String>,
}

/// mlflow's `RunStatus` numbers (`mlflow/protos/service.proto`).
fn status_code(end: Option<RunEnd>) -> u8 {
    match end {
        None => 1,
        Some(RunEnd::Finished) => 3,
        Some(RunEnd::Failed) => 4,
        Some(RunEnd::Killed) => 5,
    }
}

impl MlflowRun {
    /// Opens the store `opts.store` (relative to `run_dir` unless absolute), finds or creates the
    /// experiment, and creates a run — or, with `resume: Some((experiment_id, run_id, k))`,
    /// reopens that run with its metric lines cut back to steps ≤ k.
    pub fn open(opts: &MlflowOptions, run_dir: &Path, resume: Option<(&str, &str, usize)>) -> Result<Self> {
        let store = if opts.store.is_absolute() { opts.store.clone() } else { run_dir.join(&opts.store) };
        let store = normalize(&std::path::absolute(&store).unwrap_or(store));
        let unwritable = |path: &Path, e: std::io::Error| {
            Error::Setting(ConfigError::new(
                "logging",
                "mlflow",
                format!(
                    "= {:?}: cannot write the MLflow store at {}: {e}; set [logging] mlflow to a \
                     writable directory (relative paths are under [logging] dir) or remove it",
                    opts.store.display().to_string(),
                    path.display()
                ),
            ))
        };
        let trash = store.join(".trash");
        std::fs::create_dir_all(&trash).map_err(|e| unwritable(&trash, e))?;
        if !store.join("0").exists() {
            write_experiment_meta(&store, "0", "Default").map_err(|e| unwritable(&store, e))?;
        }
        let experiment_id = match find_experiment(&store, &opts.experiment) {
            Some(id) => id,
            None => {
                let id = (super::tracker_ids::entropy() >> 1).to_string();
                write_experiment_meta(&store, &id, &opts.experiment).map_err(|e| unwritable(&store, e))?;
                id
            }
        };
        let reopened =
            resume.filter(|(exp, run, _)| *exp == experiment_id && store.join(exp).join(run).is_dir());
        let (run_id, start_ms) = match reopened {
            Some((_, run, _)) => (run.to_string(), read_start_time(&store.join(&experiment_id).join(run))),
            None => (
                format!("{:016x}{:016x}", super::tracker_ids::entropy(), super::tracker_ids::entropy()),
                now_ms(),
            ),
        };
        let dir = store.join(&experiment_id).join(&run_id);
        for sub in ["metrics", "params", "artifacts", "tags"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(|e| unwritable(&dir, e))?;
        }
        let run = MlflowRun {
            run_dir: dir,
            experiment_id,
            run_id,
            run_name: opts.run_name.clone(),
            user: opts.user.clone(),
            start_ms,
            metrics: HashMap::new(),
            skipped: Vec::new(),
        };
        if let Some((_, _, last)) = reopened {
            run.cut_metrics_after(last)?;
        }
        run.write_meta(None)?;
        let user = opts.user.as_str();
        let base_tags = [
            ("mlflow.runName", opts.run_name.as_str()),
            ("mlflow.source.name", "rltune"),
            ("mlflow.source.type", "LOCAL"),
            ("mlflow.user", user),
        ];
        let tags =
            base_tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).chain(opts.tags.iter().cloned());
        for (k, v) in tags {
            run.write_value("tags", &k, &v)?;
        }
        for (k, v) in &opts.params {
            run.write_value("params", k, v)?;
        }
        Ok(run)
    }

    /// The experiment's id.
    pub fn experiment_id(&self) -> &str {
        &self.experiment_id
    }

    /// The run's id (32 hex digits).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The run's folder in the store.
    pub fn dir(&self) -> &Path {
        &self.run_dir
    }

    /// Appends `step`'s scalars, one line per metric file. A key that mlflow would refuse (see
    /// [`metric_path`]) is skipped with one warning.
    pub fn log(&mut self, step: usize, scalars: &std::collections::BTreeMap<String, f64>) -> Result<()> {
        let ts = now_ms();
        for (key, &v) in scalars {
            if !self.metrics.contains_key(key) {
                let Some(rel) = metric_path(key) else {
                    if !self.skipped.contains(key) {
                        tracing::warn!("MLflow: metric {key:?} is not a valid MLflow name; not logged there");
                        self.skipped.push(key.clone());
                    }
                    continue;
                };
                let path = self.run_dir.join("metrics").join(rel);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
                }
                let file =
                    File::options().create(true).append(true).open(&path).map_err(|e| Error::io(&path, e))?;
                self.metrics.insert(key.clone(), file);
            }
            if let Some(file) = self.metrics.get_mut(key) {
                let line = format!("{ts} {} {step}\n", python_float(v));
                file.write_all(line.as_bytes())
                    .and_then(|_| file.flush())
                    .map_err(|e| Error::io(self.run_dir.join("metrics").join(key), e))?;
            }
        }
        Ok(())
    }

    /// Sets the run's status and `end_time`.
    pub fn finish(&mut self, end: RunEnd) -> Result<()> {
        self.metrics.clear();
        self.write_meta(Some(end))
    }

    fn write_meta(&self, end: Option<RunEnd>) -> Result<()> {
        let end_time = if end.is_some() { now_ms().to_string() } else { "null".into() };
        let meta = format!(
            "artifact_uri: {}\nend_time: {end_time}\nentry_point_name: ''\nexperiment_id: {}\n\
             lifecycle_stage: active\nrun_id: {}\nrun_name: {}\nsource_name: ''\nsource_type: 4\n\
             source_version: ''\nstart_time: {}\nstatus: {}\ntags: []\nuser_id: {}\ndeleted_time: null\n",
            yaml_str(&file_uri(&self.run_dir.join("artifacts"))),
            yaml_str(&self.experiment_id),
            yaml_str(&self.run_id),
            yaml_str(&self.run_name),
            self.start_ms,
            status_code(end),
            yaml_str(&self.user),
        );
        crate::io::write_bytes_atomic(&self.run_dir.join("meta.yaml"), meta.as_bytes())?;
        Ok(())
    }

    /// Writes a param or tag file (no trailing newline, as mlflow's `write_to`).
    fn write_value(&self, folder: &str, key: &str, value: &str) -> Result<()> {
        let Some(rel) = metric_path(key) else {
            tracing::warn!("MLflow: {folder} key {key:?} is not a valid MLflow name; not logged there");
            return Ok(());
        };
        let path = self.run_dir.join(folder).join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        crate::io::write_bytes_atomic(&path, value.as_bytes())?;
        Ok(())
    }

    /// Keeps the metric lines of steps ≤ `last` in every metric file (a resumed run logs the
    /// later steps again).
    fn cut_metrics_after(&self, last: usize) -> Result<()> {
        let mut stack = vec![self.run_dir.join("metrics")];
        while let Some(dir) = stack.pop() {
            let entries = std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))?;
            for entry in entries {
                let path = entry.map_err(|e| Error::io(&dir, e))?.path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                let keep: String = text
                    .lines()
                    .filter(|l| {
                        l.split(' ').nth(2).and_then(|s| s.parse::<usize>().ok()).is_some_and(|s| s <= last)
                    })
                    .map(|l| format!("{l}\n"))
                    .collect();
                if keep.len() != text.len() {
                    crate::io::write_bytes_atomic(&path, keep.as_bytes())?;
                }
            }
        }
        Ok(())
    }
}

/// The relative path of a metric, param or tag file, or `None` for a name mlflow refuses
/// (`mlflow/utils/validation.py`: `^[/\w.\- :]*$`, and a name that normalizes to itself:
/// no empty, `.` or `..` segment, no leading or trailing `/`).
pub fn metric_path(key: &str) -> Option<PathBuf> {
    let ok_chars = key.chars().all(|c| c.is_alphanumeric() || matches!(c, '_' | '/' | '.' | '-' | ' ' | ':'));
    let ok_segments = key.split('/').all(|s| !s.is_empty() && s != "." && s != "..");
    (ok_chars && ok_segments && key.len() <= 250).then(|| key.split('/').collect())
}

/// `str(v)` of a Python float for the values `float()` reads back: shortest round-trip digits,
/// `nan`, `inf`, `-inf`.
pub fn python_float(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        (if v > 0.0 { "inf" } else { "-inf" }).into()
    } else {
        format!("{v:?}")
    }
}

/// A YAML single-quoted string (`'` doubled), which PyYAML's `safe_load` reads back verbatim.
fn yaml_str(s: &str) -> String {
    let clean: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    format!("'{}'", clean.replace('\'', "''"))
}

/// `file://` URI of an absolute path, as mlflow's `path_to_local_file_uri` (percent-encoded).
fn file_uri(path: &Path) -> String {
    let mut out = String::from("file://");
    for b in path.to_string_lossy().bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `path` with its `.` and `..` components resolved lexically (`run/../mlruns` → `mlruns`).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

fn write_experiment_meta(store: &Path, id: &str, name: &str) -> std::io::Result<()> {
    let dir = store.join(id);
    std::fs::create_dir_all(&dir)?;
    let now = now_ms();
    let meta = format!(
        "artifact_location: {}\ncreation_time: {now}\nexperiment_id: {}\nlast_update_time: {now}\n\
         lifecycle_stage: active\nname: {}\n",
        yaml_str(&file_uri(&dir)),
        yaml_str(id),
        yaml_str(name)
    );
    crate::io::write_bytes_atomic(&dir.join("meta.yaml"), meta.as_bytes())
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// The id of the active experiment named `name` in `store`, if any (reads each experiment's
/// `meta.yaml`: the single-line `name:` and `experiment_id:` that mlflow and this writer write).
fn find_experiment(store: &Path, name: &str) -> Option<String> {
    let entries = std::fs::read_dir(store).ok()?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        let Ok(text) = std::fs::read_to_string(dir.join("meta.yaml")) else { continue };
        let field = |k: &str| text.lines().find_map(|l| l.strip_prefix(k).map(yaml_scalar));
        if field("name:").as_deref() == Some(name) && field("lifecycle_stage:").as_deref() != Some("deleted")
        {
            found.extend(field("experiment_id:").filter(|id| dir.ends_with(id)));
        }
    }
    found.sort();
    found.into_iter().next()
}

/// A one-line YAML scalar: plain, `'single'` (with `''`) or `"double"` quoted.
fn yaml_scalar(raw: &str) -> String {
    let s = raw.trim();
    if let Some(inner) = s.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')) {
        inner.replace("''", "'")
    } else if s.starts_with('"') {
        serde_json::from_str(s).unwrap_or_else(|_| s.to_string())
    } else {
        s.to_string()
    }
}

fn read_start_time(run: &Path) -> u64 {
    let text = std::fs::read_to_string(run.join("meta.yaml")).unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix("start_time:")?.trim().parse().ok()).unwrap_or_else(now_ms)
}

fn now_ms() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(store: &Path) -> MlflowOptions {
        MlflowOptions {
            store: store.to_path_buf(),
            experiment: "it's rltune".into(),
            run_name: "ppo".into(),
            params: vec![("ppo.batch_size".into(), "8".into())],
            tags: vec![],
            user: "ada".into(),
        }
    }

    #[test]
    fn names_and_values_follow_mlflows_rules() {
        assert_eq!(metric_path("ppo/loss/total"), Some(PathBuf::from("ppo/loss/total")));
        for bad in ["a//b", "/a", "a/", "a/../b", "a?b", "."] {
            assert_eq!(metric_path(bad), None, "{bad}");
        }
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(1e-24), "1e-24");
        assert_eq!(python_float(f64::NAN), "nan");
        assert_eq!(python_float(f64::NEG_INFINITY), "-inf");
        assert_eq!(yaml_scalar(&yaml_str("it's")), "it's");
        assert_eq!(file_uri(Path::new("/a b/c")), "file:///a%20b/c");
        assert_eq!(normalize(Path::new("/r/run/../mlruns/./x")), PathBuf::from("/r/mlruns/x"));
    }

    #[test]
    fn a_run_writes_the_file_store_layout_and_its_status() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("mlruns");
        let mut run = MlflowRun::open(&opts(&store), dir.path(), None).unwrap();
        let mut scalars = std::collections::BTreeMap::new();
        scalars.insert("ppo/loss/total".to_string(), 0.25);
        scalars.insert("bad?key".to_string(), 1.0);
        run.log(1, &scalars).unwrap();
        scalars.insert("ppo/loss/total".to_string(), f64::NAN);
        run.log(2, &scalars).unwrap();
        run.finish(RunEnd::Killed).unwrap();
        let m = std::fs::read_to_string(run.dir().join("metrics/ppo/loss/total")).unwrap();
        let lines: Vec<Vec<&str>> = m.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(lines.iter().map(|l| (l[1], l[2])).collect::<Vec<_>>(), [("0.25", "1"), ("nan", "2")]);
        let meta = std::fs::read_to_string(run.dir().join("meta.yaml")).unwrap();
        assert!(meta.contains("status: 5\n") && !meta.contains("end_time: null"), "{meta}");
        assert_eq!(std::fs::read_to_string(run.dir().join("params/ppo.batch_size")).unwrap(), "8");
        assert_eq!(std::fs::read_to_string(run.dir().join("tags/mlflow.runName")).unwrap(), "ppo");
        assert!(store.join("0/meta.yaml").is_file() && store.join(".trash").is_dir());
        // A second run finds the experiment by name; a resumed one reopens its run, cut back.
        let (exp, id) = (run.experiment_id().to_string(), run.run_id().to_string());
        let again = MlflowRun::open(&opts(&store), dir.path(), None).unwrap();
        assert_eq!(again.experiment_id(), exp);
        assert_ne!(again.run_id(), id);
        let resumed = MlflowRun::open(&opts(&store), dir.path(), Some((&exp, &id, 1))).unwrap();
        assert_eq!(resumed.run_id(), id);
        let m = std::fs::read_to_string(resumed.dir().join("metrics/ppo/loss/total")).unwrap();
        assert_eq!(m.lines().count(), 1);
        let meta = std::fs::read_to_string(resumed.dir().join("meta.yaml")).unwrap();
        assert!(meta.contains("status: 1\n") && meta.contains("end_time: null"), "{meta}");
    }

    #[cfg(unix)]
    #[test]
    fn an_unwritable_store_names_the_key_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, "x").unwrap();
        let err = MlflowRun::open(&opts(&file.join("store")), dir.path(), None).unwrap_err();
        assert!(
            matches!(&err, Error::Setting(ConfigError { section, field, .. }) if section == "logging" && field == "mlflow"),
            "{err:?}"
        );
        let err = err.to_string();
        assert!(err.contains("[logging] mlflow") && err.contains("writable directory"), "{err}");
    }
}
