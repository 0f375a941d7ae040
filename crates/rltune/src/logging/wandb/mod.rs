//! `[logging] wandb = "offline"`: a W&B offline run, written without the `wandb` package, that
//! `wandb sync` uploads later.
//!
//! The run directory gets what `wandb.init(mode="offline")` leaves behind (wandb's
//! `wandb/sdk/wandb_settings.py` names the folders):
//!
//! | path (under `RUN_DIR/wandb/`) | content |
//! |---|---|
//! | `offline-run-<YYYYMMDD_HHMMSS>-<id>/run-<id>.wandb` | the record log ([`log`], [`records`]) |
//! | `offline-run-…/files/config.yaml` | the resolved config, in wandb's `{key: {value: …}}` form (JSON, which YAML reads) |
//! | `offline-run-…/files/wandb-summary.json` | the last value of every metric, written at the end |
//! | `latest-run` | a link to the newest offline run |
//!
//! The `.wandb` file holds, in order: a `HeaderRecord`; a `RunRecord` with the config (one item per
//! top-level table of the resolved config); per step a `HistoryRecord` with every scalar of the
//! step under its TRL name, each `*_dist` array as a wandb histogram
//! (`{"_type": "histogram", "values": counts, "bins": edges}`), and wandb's `_step`, `_runtime`
//! and `_timestamp`; at the end a `SummaryRecord` and a `RunExitRecord` (exit code 0 for a
//! finished run, 1 for a failed one, 255 for one stopped by Ctrl-C). The folder's time stamp is
//! UTC. Every record is flushed and synced as it is written.
//!
//! A resumed rltune run (`--resume`) writes a new offline-run folder with the same run id, from
//! the first step it runs again; `wandb sync` uploads the folders of one run in order of start.

pub mod log;
pub mod records;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::jsonl::MetricRow;
use super::tensorboard::Histogram;
use super::tracker_ids::RunEnd;
use crate::error::{ConfigError, Error, Result};
use records::{json_number, Item, Record, RunInfo};

/// What a W&B offline run is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct WandbOptions {
    /// The W&B project (`[logging] wandb_project`).
    pub project: String,
    /// The W&B entity; empty: the syncing user's default (`[logging] wandb_entity`).
    pub entity: String,
    /// The run's display name.
    pub name: String,
    /// The resolved config as JSON (an object of tables).
    pub config: serde_json::Value,
}

/// An open W&B offline run.
#[derive(Debug)]
pub struct WandbRun {
    dir: PathBuf,
    log: log::LogWriter,
    num: i64,
    start: f64,
    /// The last `value_json` of every key logged.
    summary: std::collections::BTreeMap<String, String>,
}

/// The number of buckets of the histograms written (wandb's default `num_bins` is 64).
pub const HISTOGRAM_BINS: usize = 64;

impl WandbRun {
    /// Creates `run_dir/wandb/offline-run-<time>-<id>/` and starts its record log. With
    /// `resume_from: Some(k)`, the run id recorded by the first process is kept.
    pub fn create(opts: &WandbOptions, run_dir: &Path, id: &str, resume_from: Option<usize>) -> Result<Self> {
        let start = now();
        let root = run_dir.join("wandb");
        // A resume that starts within the second of the run before it (a short run) would name
        // the same folder: the folder takes the next free second, as if it had started then.
        let mut second = start as i64;
        let dir = loop {
            let dir = root.join(format!("offline-run-{}-{id}", utc_stamp(second)));
            if !dir.exists() {
                break dir;
            }
            second += 1;
        };
        let files = dir.join("files");
        std::fs::create_dir_all(&files).map_err(|e| {
            Error::Setting(ConfigError::new(
                "logging",
                "wandb",
                format!(
                    "= \"offline\": cannot create {}: {e}; make [logging] dir writable or remove the \
                     wandb key",
                    files.display()
                ),
            ))
        })?;
        let mut log = log::LogWriter::create(&dir.join(format!("run-{id}.wandb")))?;
        let config = wandb_config(&opts.config);
        let run = RunInfo {
            run_id: id.to_string(),
            project: opts.project.clone(),
            entity: opts.entity.clone(),
            display_name: opts.name.clone(),
            host: super::tensorboard::hostname(),
            config: config.iter().map(|(k, v)| (k.clone(), v["value"].to_string())).collect(),
            start_time: start,
            starting_step: resume_from.map_or(0, |k| k as i64 + 1),
            resumed: resume_from.is_some(),
        };
        let producer = format!("rltune {}", env!("CARGO_PKG_VERSION"));
        // 0.40.0: the oldest wandb-core (versioned apart from the SDK) that reads the records used.
        let header = Record::Header { producer, min_consumer: "0.40.0".into() };
        log.append(&header.encode(1))?;
        log.append(&Record::Run(run).encode(2))?;
        let mut yaml = String::new();
        yaml_json(&serde_json::Value::Object(config), &mut yaml);
        crate::io::write_bytes_atomic(&files.join("config.yaml"), yaml.as_bytes())?;
        link_latest(&root, &dir);
        Ok(WandbRun { dir, log, num: 2, start, summary: Default::default() })
    }

    /// The offline run's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends one step's `HistoryRecord`.
    pub fn log(&mut self, row: &MetricRow) -> Result<()> {
        let now = now();
        let step = row.step as i64;
        let mut items: Vec<Item> = Vec::with_capacity(row.scalars.len() + row.arrays.len() + 3);
        for (k, &v) in &row.scalars {
            items.push((k.clone(), json_number(v)));
        }
        for (k, a) in &row.arrays {
            if let Some(h) = wandb_histogram(a) {
                items.push((k.clone(), h.to_string()));
            }
        }
        items.push(("_step".into(), step.to_string()));
        items.push(("_runtime".into(), json_number(now - self.start)));
        items.push(("_timestamp".into(), json_number(now)));
        self.summary.extend(items.iter().cloned());
        self.append(Record::History { items, step })
    }

    /// Ends the run: a `SummaryRecord` with the last values, the `RunExitRecord`, and
    /// `files/wandb-summary.json`.
    pub fn finish(&mut self, end: RunEnd) -> Result<()> {
        let runtime = (now() - self.start).max(0.0) as i32;
        let items: Vec<Item> = self.summary.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        self.append(Record::Summary(items))?;
        let exit_code = match end {
            RunEnd::Finished => 0,
            RunEnd::Failed => 1,
            RunEnd::Killed => 255,
        };
        self.append(Record::Exit { exit_code, runtime })?;
        // The values as written in the records (`NaN` included, which Python's json reads).
        let mut summary = format!("{{\"_wandb\": {{\"runtime\": {runtime}}}");
        for (k, v) in &self.summary {
            summary.push_str(&format!(", {}: {v}", serde_json::Value::String(k.clone())));
        }
        summary.push('}');
        crate::io::write_bytes_atomic(&self.dir.join("files/wandb-summary.json"), summary.as_bytes())?;
        Ok(())
    }

    fn append(&mut self, record: Record) -> Result<()> {
        self.num += 1;
        self.log.append(&record.encode(self.num))
    }
}

/// wandb's config form: `{key: {"value": v}}` per top-level key, as `files/config.yaml` holds it.
fn wandb_config(config: &serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    if let serde_json::Value::Object(tables) = config {
        for (k, v) in tables {
            out.insert(k.clone(), serde_json::json!({ "value": v }));
        }
    }
    out
}

/// `v` as JSON that YAML 1.1 readers (PyYAML, which wandb uses) read back with the same types:
/// a float with an exponent gets a fraction and a signed exponent (`1.0e-5`, `1.0e+21`; YAML 1.1
/// reads `1e-5` and `1.0e21` as strings).
fn yaml_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            let t = n.to_string();
            match t.find('e') {
                Some(i) => {
                    let (mantissa, exp) = (&t[..i], &t[i + 1..]);
                    let dot = if mantissa.contains('.') { "" } else { ".0" };
                    let sign = if exp.starts_with(['-', '+']) { "" } else { "+" };
                    out.push_str(&format!("{mantissa}{dot}e{sign}{exp}"));
                }
                None => out.push_str(&t),
            }
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                out.push_str(if i > 0 { ", " } else { "" });
                yaml_json(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                out.push_str(if i > 0 { ", " } else { "" });
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                yaml_json(x, out);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A wandb histogram of the finite values of `values` (`wandb.Histogram`'s JSON:
/// `wandb/sdk/data_types/histogram.py`, `to_json`), or `None` when there are none.
fn wandb_histogram(values: &[f64]) -> Option<serde_json::Value> {
    let h = Histogram::from_values(values, HISTOGRAM_BINS)?;
    let n = h.bucket.len();
    let width = if n > 0 { (h.max - h.min) / n as f64 } else { 0.0 };
    let mut bins: Vec<f64> = (0..n).map(|i| h.min + width * i as f64).collect();
    bins.push(h.max);
    Some(serde_json::json!({ "_type": "histogram", "values": h.bucket, "bins": bins }))
}

/// Points `root/latest-run` at `dir` (as wandb does; best effort, Unix only).
#[cfg(unix)]
fn link_latest(root: &Path, dir: &Path) {
    if let Some(name) = dir.file_name() {
        let link = root.join("latest-run");
        let _ = std::fs::remove_file(&link);
        let _ = std::os::unix::fs::symlink(name, &link);
    }
}

#[cfg(not(unix))]
fn link_latest(_root: &Path, _dir: &Path) {}

/// A new run id: 8 characters of `[a-z0-9]` (wandb's `generate_id`), from the clock and the
/// process id (an id, not training randomness: the run's seed is not used).
pub fn new_run_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut x = super::tracker_ids::entropy();
    (0..8)
        .map(|_| {
            let c = ALPHABET[(x % 36) as usize] as char;
            x /= 36;
            c
        })
        .collect()
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// `YYYYMMDD_HHMMSS` (UTC) of Unix time `secs`.
pub fn utc_stamp(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}_{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps_match_the_calendar() {
        assert_eq!(utc_stamp(0), "19700101_000000");
        assert_eq!(utc_stamp(951_782_400), "20000229_000000");
        assert_eq!(utc_stamp(1_795_894_095), "20261128_192815");
    }

    #[test]
    fn an_offline_run_holds_header_run_history_summary_and_exit() {
        let dir = tempfile::tempdir().unwrap();
        let opts = WandbOptions {
            project: "p".into(),
            entity: String::new(),
            name: "run".into(),
            config: serde_json::json!({"ppo": {"batch_size": 8}}),
        };
        let mut run = WandbRun::create(&opts, dir.path(), "abcd1234", None).unwrap();
        let mut row = MetricRow { step: 1, ..Default::default() };
        row.scalars.insert("env/reward_mean".into(), 0.5);
        row.scalars.insert("objective/kl".into(), f64::NAN);
        row.arrays.insert("env/reward_dist".into(), vec![0.0, 1.0, 1.0]);
        run.log(&row).unwrap();
        run.finish(RunEnd::Finished).unwrap();
        let name = run.dir().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("offline-run-") && name.ends_with("-abcd1234"), "{name}");
        // A resume within the same second gets a folder of its own (the next free second).
        let resumed = WandbRun::create(&opts, dir.path(), "abcd1234", Some(1)).unwrap();
        assert_ne!(resumed.dir(), run.dir());
        assert!(resumed.dir().join("run-abcd1234.wandb").is_file());
        let bytes = std::fs::read(run.dir().join("run-abcd1234.wandb")).unwrap();
        let payloads = log::read_payloads(&bytes).unwrap();
        assert_eq!(payloads.len(), 5, "header, run, history, summary, exit");
        let text = String::from_utf8_lossy(&payloads[2]);
        assert!(text.contains("env/reward_mean") && text.contains("NaN") && text.contains("histogram"));
        let text = std::fs::read_to_string(run.dir().join("files/wandb-summary.json")).unwrap();
        assert!(text.contains("\"objective/kl\": NaN"), "{text}");
        let summary: serde_json::Value = serde_json::from_str(&text.replace("NaN", "null")).unwrap();
        assert_eq!(summary["env/reward_mean"], 0.5);
        assert_eq!(summary["_step"], 1);
        let config = std::fs::read_to_string(run.dir().join("files/config.yaml")).unwrap();
        assert!(config.contains("\"batch_size\": 8"), "{config}");
        let mut y = String::new();
        let v = serde_json::json!({"lr": 1e-7, "big": 1e21, "n": [1.5, 2]});
        yaml_json(&v, &mut y);
        assert!(y.contains("1.0e+21") && y.contains("1.0e-7"), "{y}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&y).unwrap(), v);
        assert!(dir.path().join("wandb/latest-run").exists());
    }
}
