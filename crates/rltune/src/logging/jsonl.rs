//! `metrics.jsonl` and `samples.jsonl`: one JSON object per step, appended and flushed.
//!
//! A metrics line is `{"step": n, <key>: <value>, ...}` with every scalar stat under its TRL name,
//! the `*_dist` arrays as arrays, text stats (warnings) as strings, and each other array reduced
//! to `<key>_mean` (unless the stats already hold that key). Matrices (`objective/logprobs`) are
//! left out. Non-finite numbers are written as `null` and read back as `NaN`.
//!
//! Reading follows the order of the file: a line whose step is not above the previous lines'
//! steps means the run was restarted from an earlier checkpoint, so the lines it supersedes
//! (steps at or above it) are dropped. A line that does not parse (the tail of a crash) is
//! skipped with a warning.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::SampleRow;
use crate::engine::stats::{Stat, Stats};
use crate::error::{Error, Result};

/// One step's metrics as logged: the flattened form of a [`Stats`] map.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricRow {
    /// The training step.
    pub step: usize,
    /// Scalars by TRL name (`NaN` where the value was not finite).
    pub scalars: BTreeMap<String, f64>,
    /// The `*_dist` arrays by TRL name.
    pub arrays: BTreeMap<String, Vec<f64>>,
    /// Text stats (warnings) by name.
    pub texts: BTreeMap<String, String>,
}

impl MetricRow {
    /// Flattens `stats` as described in the module docs.
    pub fn from_stats(step: usize, stats: &Stats) -> Self {
        let mut row = MetricRow { step, ..Default::default() };
        for (key, stat) in stats {
            match stat {
                Stat::Scalar(v) => {
                    row.scalars.insert(key.clone(), *v);
                }
                Stat::Array(a) if key.ends_with("_dist") => {
                    row.arrays.insert(key.clone(), a.clone());
                }
                Stat::Array(a) => {
                    let mean_key = format!("{key}_mean");
                    if !stats.contains_key(&mean_key) {
                        let finite: Vec<f64> = a.iter().copied().filter(|x| x.is_finite()).collect();
                        let mean = finite.iter().sum::<f64>() / finite.len() as f64;
                        row.scalars.insert(mean_key, mean);
                    }
                }
                Stat::Text(t) => {
                    row.texts.insert(key.clone(), t.clone());
                }
                Stat::Matrix(_) => {}
            }
        }
        row
    }

    /// The scalar `key`, if logged and finite.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.scalars.get(key).copied().filter(|v| v.is_finite())
    }

    /// The JSON line (without the newline), `"step"` first.
    pub fn to_json_line(&self) -> String {
        let mut line = format!("{{\"step\":{}", self.step);
        let mut push = |k: &str, v: Value| {
            line.push(',');
            line.push_str(&Value::String(k.to_string()).to_string());
            line.push(':');
            line.push_str(&v.to_string());
        };
        let num = |x: f64| serde_json::Number::from_f64(x).map(Value::Number).unwrap_or(Value::Null);
        for (k, v) in &self.scalars {
            push(k, num(*v));
        }
        for (k, a) in &self.arrays {
            push(k, Value::Array(a.iter().map(|x| num(*x)).collect()));
        }
        for (k, t) in &self.texts {
            push(k, Value::String(t.clone()));
        }
        line.push('}');
        line
    }

    /// Parses a line written by [`MetricRow::to_json_line`].
    pub fn from_json_line(line: &str) -> std::result::Result<Self, LineError> {
        let Value::Object(map) = serde_json::from_str::<Value>(line)? else {
            return Err(LineError::NotAnObject);
        };
        let step = map.get("step").and_then(Value::as_u64).ok_or(LineError::NoStep)?;
        let mut row = MetricRow { step: step as usize, ..Default::default() };
        let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        for (k, v) in map.iter().filter(|(k, _)| *k != "step") {
            match v {
                Value::Number(_) | Value::Null => {
                    row.scalars.insert(k.clone(), num(v));
                }
                Value::Array(a) => {
                    row.arrays.insert(k.clone(), a.iter().map(num).collect());
                }
                Value::String(s) => {
                    row.texts.insert(k.clone(), s.clone());
                }
                _ => return Err(LineError::Value { key: k.clone(), value: v.to_string() }),
            }
        }
        Ok(row)
    }
}

/// Why a `metrics.jsonl` or `samples.jsonl` line does not parse (a line cut short by a crash,
/// or a file that is not rltune's).
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Not JSON, or JSON of another shape.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A metrics line that is not a JSON object.
    #[error("not a JSON object")]
    NotAnObject,
    /// A metrics line without its step.
    #[error("no integer \"step\"")]
    NoStep,
    /// A metric whose value is neither a number, an array of numbers, nor a string.
    #[error("key {key:?}: unexpected {value}")]
    Value {
        /// The metric's name.
        key: String,
        /// The value found, as JSON.
        value: String,
    },
}

/// The samples of one step, as a `samples.jsonl` line.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct SampleLine {
    step: usize,
    samples: Vec<SampleRecord>,
}

/// A [`SampleRow`] as stored: `null` for a non-finite reward.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct SampleRecord {
    query: String,
    response: String,
    reward: Option<f32>,
}

/// The JSON line (without the newline) of `samples` at `step`.
pub fn samples_to_json_line(step: usize, samples: &[SampleRow]) -> String {
    let samples = samples
        .iter()
        .map(|s| SampleRecord {
            query: s.query.clone(),
            response: s.response.clone(),
            reward: Some(s.reward).filter(|r| r.is_finite()),
        })
        .collect();
    // Serializing strings and optional floats cannot fail.
    serde_json::to_string(&SampleLine { step, samples }).unwrap_or_default()
}

/// Parses a line written by [`samples_to_json_line`].
pub fn samples_from_json_line(line: &str) -> std::result::Result<(usize, Vec<SampleRow>), LineError> {
    let parsed: SampleLine = serde_json::from_str(line)?;
    let rows = parsed
        .samples
        .into_iter()
        .map(|s| SampleRow { query: s.query, response: s.response, reward: s.reward.unwrap_or(f32::NAN) })
        .collect();
    Ok((parsed.step, rows))
}

/// Reads a JSON-lines file of per-step records with `parse`, applying the restart rule of the
/// module docs. A missing file reads as empty.
pub fn read_steps<T>(path: &Path, parse: impl Fn(&str) -> std::result::Result<T, LineError>) -> Result<Vec<T>>
where
    T: HasStep,
{
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(path, e)),
    };
    let mut out: Vec<T> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match parse(line) {
            Ok(rec) => push_step(&mut out, rec),
            Err(e) => tracing::warn!("{}:{}: skipping unreadable line: {e}", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// Rewrites `path` (atomically) without the lines of steps after `last`, and without lines
/// that do not parse (a line cut short by a crash); every kept line stays byte for byte. A
/// missing file is left missing.
pub fn truncate_after(path: &Path, last: usize) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(path, e)),
    };
    let step_of = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line).ok()?.get("step")?.as_u64().map(|s| s as usize)
    };
    let mut kept = String::with_capacity(text.len());
    let mut dropped = 0usize;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match step_of(line) {
            Some(step) if step <= last => {
                kept.push_str(line);
                kept.push('\n');
            }
            _ => dropped += 1,
        }
    }
    if dropped > 0 {
        tracing::info!(
            "{}: {dropped} lines after step {last} dropped (those steps run again)",
            path.display()
        );
        crate::io::write_bytes_atomic(path, kept.as_bytes())?;
    }
    Ok(())
}

/// Something logged at a step.
pub trait HasStep {
    /// The training step.
    fn step(&self) -> usize;
}

impl HasStep for MetricRow {
    fn step(&self) -> usize {
        self.step
    }
}

impl HasStep for (usize, Vec<SampleRow>) {
    fn step(&self) -> usize {
        self.0
    }
}

/// Appends `rec`, first dropping the records it supersedes (steps at or above its own).
pub fn push_step<T: HasStep>(out: &mut Vec<T>, rec: T) {
    let step = rec.step();
    out.retain(|r| r.step() < step);
    out.push(rec);
}

/// An append-only JSON-lines file; every line is written whole, flushed and synced.
#[derive(Debug)]
pub struct JsonlWriter {
    path: PathBuf,
    file: File,
}

impl JsonlWriter {
    /// Opens `path` for appending (creating it). If the file ends in a partial line (a crash
    /// mid-write), a newline is added first so that the next line stands alone.
    pub fn append(path: &Path) -> Result<Self> {
        let io = |e| Error::io(path, e);
        let mut file = File::options().create(true).append(true).open(path).map_err(io)?;
        if file.metadata().map_err(io)?.len() > 0 {
            let mut last = [0u8; 1];
            let mut reader = File::open(path).map_err(io)?;
            reader.seek(SeekFrom::End(-1)).and_then(|_| reader.read_exact(&mut last)).map_err(io)?;
            if last[0] != b'\n' {
                file.write_all(b"\n").map_err(io)?;
            }
        }
        Ok(JsonlWriter { path: path.to_path_buf(), file })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `line` and a newline in one write, then flushes and syncs the file.
    pub fn write_line(&mut self, line: &str) -> Result<()> {
        let mut buf = String::with_capacity(line.len() + 1);
        buf.push_str(line);
        buf.push('\n');
        let path = &self.path;
        self.file.write_all(buf.as_bytes()).map_err(|e| Error::io(path, e))?;
        self.file.flush().map_err(|e| Error::io(path, e))?;
        self.file.sync_data().map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats() -> Stats {
        let mut s = Stats::new();
        s.insert("objective/kl".into(), Stat::Scalar(0.5));
        s.insert("objective/kl_dist".into(), Stat::Array(vec![0.25, 0.75]));
        s.insert("objective/logprobs".into(), Stat::Matrix(vec![vec![-1.0]]));
        s.insert("ppo/policy/ratio".into(), Stat::Array(vec![1.0, 3.0]));
        s.insert("ppo/policy/advantages".into(), Stat::Array(vec![1.0, 3.0]));
        s.insert("ppo/policy/advantages_mean".into(), Stat::Scalar(0.0));
        s.insert("ppo/val/var_explained".into(), Stat::Scalar(f64::NAN));
        s.insert("warnings/negative_kl".into(), Stat::Text("a \"quoted\"\nwarning".into()));
        s
    }

    #[test]
    fn flattening_keeps_scalars_dists_texts_and_summarizes_other_arrays() {
        let row = MetricRow::from_stats(3, &stats());
        assert_eq!(row.get("objective/kl"), Some(0.5));
        assert_eq!(row.arrays["objective/kl_dist"], vec![0.25, 0.75]);
        assert_eq!(row.get("ppo/policy/ratio_mean"), Some(2.0));
        // The trainer's own masked mean is kept, not overwritten by the array mean.
        assert_eq!(row.get("ppo/policy/advantages_mean"), Some(0.0));
        assert!(!row.scalars.contains_key("objective/logprobs"));
        assert!(!row.arrays.contains_key("ppo/policy/ratio"));
        assert!(row.scalars["ppo/val/var_explained"].is_nan());
    }

    #[test]
    fn json_line_round_trip() {
        let row = MetricRow::from_stats(3, &stats());
        let line = row.to_json_line();
        assert!(line.starts_with("{\"step\":3,"), "{line}");
        assert!(!line.contains('\n'));
        assert!(line.contains("\"ppo/val/var_explained\":null"), "{line}");
        let back = MetricRow::from_json_line(&line).unwrap();
        assert_eq!(back.step, 3);
        assert_eq!(back.arrays, row.arrays);
        assert_eq!(back.texts, row.texts);
        assert_eq!(back.scalars.len(), row.scalars.len());
        for (k, v) in &row.scalars {
            assert!(
                v.to_bits() == back.scalars[k].to_bits() || (v.is_nan() && back.scalars[k].is_nan()),
                "{k}"
            );
        }
        assert!(MetricRow::from_json_line("[1]").is_err());
        assert!(MetricRow::from_json_line("{\"x\":1}").is_err());
    }

    #[test]
    fn sample_line_round_trip() {
        let rows = vec![
            SampleRow { query: "q <b>".into(), response: "r\n\"x\"".into(), reward: 1.5 },
            SampleRow { query: String::new(), response: "é".into(), reward: f32::NAN },
        ];
        let (step, back) = samples_from_json_line(&samples_to_json_line(4, &rows)).unwrap();
        assert_eq!(step, 4);
        assert_eq!(back[0], rows[0]);
        assert!(back[1].reward.is_nan());
    }

    #[test]
    fn file_round_trip_with_restart_and_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let mut w = JsonlWriter::append(&path).unwrap();
        for step in 0..4 {
            let mut s = Stats::new();
            s.insert("x".into(), Stat::Scalar(step as f64));
            w.write_line(&MetricRow::from_stats(step, &s).to_json_line()).unwrap();
        }
        drop(w);
        // A crash mid-write leaves a partial line; a restart from the step-2 checkpoint follows.
        let mut f = File::options().append(true).open(&path).unwrap();
        f.write_all(b"{\"step\":4,\"x\":").unwrap();
        let mut w = JsonlWriter::append(&path).unwrap();
        let mut s = Stats::new();
        s.insert("x".into(), Stat::Scalar(20.0));
        w.write_line(&MetricRow::from_stats(2, &s).to_json_line()).unwrap();
        let rows = read_steps(&path, MetricRow::from_json_line).unwrap();
        let got: Vec<(usize, f64)> = rows.iter().map(|r| (r.step, r.scalars["x"])).collect();
        assert_eq!(got, vec![(0, 0.0), (1, 1.0), (2, 20.0)]);
        assert!(read_steps(&dir.path().join("none.jsonl"), MetricRow::from_json_line).unwrap().is_empty());
    }
}
