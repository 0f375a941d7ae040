//! Metric sinks and the run report: the run directory contract of a PPO training run.
//!
//! A [`RunLogger`] owns a run directory `DIR`:
//!
//! | path | content |
//! |---|---|
//! | `DIR/metrics.jsonl` | one JSON object per step: `"step"`, every scalar stat by its TRL name, the `*_dist` arrays ([`jsonl`]) |
//! | `DIR/samples.jsonl` | per step, the samples (query, response, reward) passed to [`RunLogger::log_step`] |
//! | `DIR/tb/events.out.tfevents.<unix_ts>.<hostname>` | TensorBoard scalars for every scalar stat, histograms for the `*_dist` arrays ([`tensorboard`]) |
//! | `DIR/report.html` | a self-contained page with plots and the samples table ([`report`]) |
//! | `DIR/wandb/offline-run-*/` | with `[logging] wandb = "offline"`: a W&B offline run for `wandb sync` ([`wandb`]) |
//! | `[logging] mlflow` | an MLflow file store (under `DIR` unless absolute) for `mlflow ui` ([`mlflow`]) |
//! | `DIR/trackers.json` | the ids of the tracker runs, so that a resumed run continues them ([`trackers`]) |
//!
//! Every line and event is flushed as it is written, so a crash loses at most the step being
//! written. With `resume`, the logger appends to the existing files (TensorBoard gets a new event
//! file beside the old ones) and re-reads them, so the report covers the whole run; a step at or
//! below an earlier one (a restart from an older checkpoint) supersedes the lines it repeats.
//!
//! The PPO loop is expected to add `env/reward_mean`, `env/reward_std` and `env/reward_dist`
//! (as TRL's `log_stats` does) and `rltune/logprobs_mean`, `rltune/ref_logprobs_mean` to the
//! stats before logging them; the report notes the plots whose keys are missing.
//!
//! ```
//! use rltune::logging::{RunLogger, SampleRow};
//! use rltune::engine::{Stat, Stats};
//!
//! # fn main() -> rltune::Result<()> {
//! let dir = tempfile::tempdir().expect("tempdir");
//! let mut log = RunLogger::create(dir.path(), None)?;
//! let mut stats = Stats::new();
//! stats.insert("env/reward_mean".into(), Stat::Scalar(0.5));
//! stats.insert("env/reward_dist".into(), Stat::Array(vec![0.0, 1.0]));
//! let sample = SampleRow { query: "Hello".into(), response: " world".into(), reward: 1.0 };
//! log.log_step(0, &stats, &[sample])?;
//! let report = log.write_report()?;
//! assert!(std::fs::read_to_string(report).expect("report").contains("plot-reward"));
//! # Ok(()) }
//! ```

pub mod jsonl;
pub mod mlflow;
pub mod plots;
pub mod report;
pub mod tensorboard;
pub mod tfrecord;
mod tracker_ids;
pub mod trackers;
pub mod wandb;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::engine::stats::Stats;
use crate::error::{Error, Result};
use jsonl::{JsonlWriter, MetricRow};
use tensorboard::{EventWriter, Histogram, SummaryValue};
pub use trackers::{RunEnd, Trackers};

/// One sample shown in the report: the query, the response and its reward.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRow {
    /// The query text.
    pub query: String,
    /// The response text.
    pub response: String,
    /// The reward (score) the response got.
    pub reward: f32,
}

/// Writes a run directory: metrics, samples, TensorBoard events and the HTML report.
#[derive(Debug)]
pub struct RunLogger {
    dir: PathBuf,
    /// `None` on the other ranks of a data-parallel run, which log nothing (rank 0 logs).
    files: Option<(JsonlWriter, JsonlWriter)>,
    /// `transcripts.jsonl` (runs on text games), opened at the first transcript.
    transcripts: Option<JsonlWriter>,
    /// Opened at the first logged step, so that re-reading a run adds no empty event file.
    tb: Option<EventWriter>,
    /// MLflow and W&B, when configured (rank 0 only).
    trackers: Option<trackers::TrackerRuns>,
    rows: Vec<MetricRow>,
    samples: Vec<(usize, Vec<SampleRow>)>,
    max_samples: usize,
}

impl RunLogger {
    /// Creates `dir` and `dir/tb/` and opens the run's files for appending.
    ///
    /// With `resume_from: None` (a new run), a directory that already holds logged steps is an
    /// error (nothing is overwritten). With `Some(k)` (a run resumed from its step-k checkpoint),
    /// `metrics.jsonl` and `samples.jsonl` are first cut back to the lines of steps ≤ k (rewritten
    /// atomically; the later steps run again and are logged anew), then read back for the report.
    /// TensorBoard's event files are append-only: the resumed steps are written again to a new
    /// event file, and TensorBoard shows each step's latest value (its `purge_orphaned_data`,
    /// on by default, drops the earlier ones).
    ///
    /// One process's logger; see [`RunLogger::create_with`] for a data-parallel run's.
    pub fn create(dir: &Path, resume_from: Option<usize>) -> Result<Self> {
        Self::create_with(dir, resume_from, &Trackers::default(), &crate::dist::Dist::default())
    }

    /// [`RunLogger::create`], also logging to the experiment trackers of `trackers` (MLflow, W&B),
    /// for this process of `dist`: on a rank other than 0 of a data-parallel run
    /// ([`crate::dist::Dist::is_main`]) it touches no file and logs nothing, as rank 0 writes the
    /// run directory. End the run with [`RunLogger::finish`]; a logger dropped without it marks
    /// the tracker runs failed.
    pub fn create_with(
        dir: &Path,
        resume_from: Option<usize>,
        trackers: &Trackers,
        dist: &crate::dist::Dist,
    ) -> Result<Self> {
        if !dist.is_main() {
            return Ok(RunLogger {
                dir: dir.to_path_buf(),
                files: None,
                transcripts: None,
                tb: None,
                trackers: None,
                rows: Vec::new(),
                samples: Vec::new(),
                max_samples: 0,
            });
        }
        let resume = resume_from.is_some();
        let tb_dir = dir.join("tb");
        std::fs::create_dir_all(&tb_dir).map_err(|e| Error::io(&tb_dir, e))?;
        let metrics_path = dir.join("metrics.jsonl");
        let samples_path = dir.join("samples.jsonl");
        let nonempty = |p: &Path| std::fs::metadata(p).map(|m| m.len() > 0).unwrap_or(false);
        if !resume && (nonempty(&metrics_path) || nonempty(&samples_path)) {
            return Err(Error::checkpoint(
                &metrics_path,
                "the directory already holds a run's metrics; resume that run or choose a new directory",
            ));
        }
        let (mut rows, mut samples) = (Vec::new(), Vec::new());
        if let Some(last) = resume_from {
            jsonl::truncate_after(&metrics_path, last)?;
            jsonl::truncate_after(&samples_path, last)?;
            jsonl::truncate_after(&dir.join(TRANSCRIPTS), last)?;
            rows = jsonl::read_steps(&metrics_path, MetricRow::from_json_line)?;
            samples = jsonl::read_steps(&samples_path, jsonl::samples_from_json_line)?;
            // Samples of steps without a metrics line (written by an older rltune before a
            // restart) are stale.
            let steps: BTreeSet<usize> = rows.iter().map(|r| r.step).collect();
            samples.retain(|(step, _)| steps.contains(step));
            samples.drain(..samples.len().saturating_sub(REPORT_SAMPLE_STEPS));
            rows = rows.into_iter().map(report_row).collect();
            while rows.len() > REPORT_ROWS_MAX {
                thin(&mut rows);
            }
        }
        let files = (JsonlWriter::append(&metrics_path)?, JsonlWriter::append(&samples_path)?);
        let runs = match trackers.any() {
            true => Some(trackers::TrackerRuns::open(dir, resume_from, trackers)?),
            false => None,
        };
        Ok(RunLogger {
            dir: dir.to_path_buf(),
            files: Some(files),
            transcripts: None,
            tb: None,
            trackers: runs,
            rows,
            samples,
            max_samples: usize::MAX,
        })
    }

    /// Keeps at most `n` samples per step (the first `n` passed to [`RunLogger::log_step`]);
    /// by default every sample passed is kept.
    pub fn with_max_samples(mut self, n: usize) -> Self {
        self.max_samples = n;
        self
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The report's history, in step order: the steps logged so far (including those read back
    /// on resume), thinned past [`REPORT_ROWS_MAX`], each with the keys the report draws.
    pub fn rows(&self) -> &[MetricRow] {
        &self.rows
    }

    /// The samples of the last [`REPORT_SAMPLE_STEPS`] steps that logged some, by step.
    pub fn samples(&self) -> &[(usize, Vec<SampleRow>)] {
        &self.samples
    }

    /// Logs one PPO step: a `metrics.jsonl` line, its samples, and TensorBoard scalars and
    /// histograms. Each file is flushed before this returns.
    pub fn log_step(&mut self, step: usize, stats: &Stats, samples: &[SampleRow]) -> Result<()> {
        let Some((metrics, samples_file)) = &mut self.files else { return Ok(()) };
        let row = MetricRow::from_stats(step, stats);
        metrics.write_line(&row.to_json_line())?;
        let kept: Vec<SampleRow> = samples.iter().take(self.max_samples).cloned().collect();
        self.samples.retain(|(s, _)| *s < step);
        if !kept.is_empty() {
            samples_file.write_line(&jsonl::samples_to_json_line(step, &kept))?;
            self.samples.push((step, kept));
            let excess = self.samples.len().saturating_sub(REPORT_SAMPLE_STEPS);
            self.samples.drain(..excess);
        }
        let tb = match &mut self.tb {
            Some(tb) => tb,
            None => self.tb.insert(EventWriter::create(&self.dir.join("tb"))?),
        };
        tb.write_summary(step, summary_values(&row))?;
        if let Some(t) = &mut self.trackers {
            t.log(&row)?;
        }
        jsonl::push_step(&mut self.rows, report_row(row));
        if self.rows.len() > REPORT_ROWS_MAX {
            thin(&mut self.rows);
        }
        Ok(())
    }

    /// Ends the experiment trackers' runs (MLflow status, W&B exit record); nothing to do without
    /// trackers. Once: later calls do nothing.
    pub fn finish(&mut self, end: RunEnd) -> Result<()> {
        self.trackers.as_mut().map_or(Ok(()), |t| t.finish(end))
    }

    /// The open tracker runs (rank 0, when configured).
    pub fn trackers(&self) -> Option<&trackers::TrackerRuns> {
        self.trackers.as_ref()
    }

    /// Appends episodes played at `step` to `transcripts.jsonl`, one line each:
    /// `{"step": step, …the episode's fields}`.
    pub fn log_transcripts<'a, T: serde::Serialize + 'a>(
        &mut self,
        step: usize,
        episodes: impl IntoIterator<Item = &'a T>,
    ) -> Result<()> {
        if self.files.is_none() {
            return Ok(());
        }
        for ep in episodes {
            let mut v = serde_json::to_value(ep)
                .map_err(|e| Error::Internal(format!("cannot serialize a transcript: {e}")))?;
            if let serde_json::Value::Object(m) = &mut v {
                m.insert("step".into(), step.into());
            }
            let w = match &mut self.transcripts {
                Some(w) => w,
                None => self.transcripts.insert(JsonlWriter::append(&self.dir.join(TRANSCRIPTS))?),
            };
            w.write_line(&v.to_string())?;
        }
        Ok(())
    }

    /// Writes `DIR/report.html` atomically and returns its path.
    pub fn write_report(&self) -> Result<PathBuf> {
        let path = self.dir.join("report.html");
        if self.files.is_none() {
            return Ok(path);
        }
        let name = self.dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let title = if name.is_empty() { "rltune run".to_string() } else { format!("rltune run: {name}") };
        let html = report::render_report(&title, &self.rows, &self.samples);
        crate::io::write_bytes_atomic(&path, html.as_bytes())?;
        Ok(path)
    }
}

/// The TensorBoard values of a step: every scalar, and a histogram of every `*_dist` array.
/// The transcripts file of a run on text games.
pub const TRANSCRIPTS: &str = "transcripts.jsonl";

/// The most steps the report's history holds in memory: past it, every other one is dropped
/// (the newest is kept), so a run of any length plots at most this many points per curve and
/// the logger's memory stays flat (the files keep every step).
pub const REPORT_ROWS_MAX: usize = 256;

/// The steps whose samples the report shows (the newest).
pub const REPORT_SAMPLE_STEPS: usize = 20;

/// What the report draws of a metrics row: the scalars of its plots and cards, the reward
/// distribution, the warnings. (A full row holds ~80 scalars and every `*_dist`: about 9 KB.)
fn report_row(mut row: MetricRow) -> MetricRow {
    const SCALARS: [&str; 12] = [
        "env/reward_mean",
        "env/reward_std",
        "ppo/mean_scores",
        "ppo/std_scores",
        "objective/kl",
        "objective/kl_coef",
        "rltune/logprobs_mean",
        "rltune/ref_logprobs_mean",
        "rltune/skipped_batches",
        "reward",
        "reward_std",
        "kl",
    ];
    row.scalars.retain(|k, _| {
        let k = k.as_str();
        SCALARS.contains(&k)
            || k.starts_with("time/")
            || report::EPISODE_KEYS.contains(&k)
            || report::GROUP_KEYS.contains(&k)
    });
    row.arrays.retain(|k, _| k == "env/reward_dist");
    row
}

/// Drops every other row, keeping the newest.
fn thin(rows: &mut Vec<MetricRow>) {
    let last = rows.len() - 1;
    let mut i = 0;
    rows.retain(|_| {
        let keep = i % 2 == 0 || i == last;
        i += 1;
        keep
    });
}

fn summary_values(row: &MetricRow) -> Vec<SummaryValue> {
    let scalars = row.scalars.iter().map(|(k, &v)| SummaryValue::Scalar(k.clone(), v as f32));
    let histos = row.arrays.iter().filter_map(|(k, a)| {
        Histogram::from_values(a, tensorboard::HISTOGRAM_BUCKETS)
            .map(|h| SummaryValue::Histogram(k.clone(), h))
    });
    scalars.chain(histos).collect()
}

#[cfg(test)]
mod history_tests {
    use super::*;

    /// Issue #28's soak: the logger kept every full metrics row for the report (~9 KB a step),
    /// so its memory grew with the run. The history is now bounded.
    #[test]
    fn the_report_history_stays_bounded_and_keeps_the_newest_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = RunLogger::create(dir.path(), None).unwrap();
        let mut stats = Stats::new();
        stats.insert("env/reward_mean".into(), crate::engine::Stat::Scalar(1.0));
        stats.insert("ppo/loss/total".into(), crate::engine::Stat::Scalar(2.0));
        let sample = SampleRow { query: "q".into(), response: "r".into(), reward: 1.0 };
        for step in 1..=3 * REPORT_ROWS_MAX {
            log.log_step(step, &stats, std::slice::from_ref(&sample)).unwrap();
            assert!(log.rows().len() <= REPORT_ROWS_MAX, "step {step}: {} rows", log.rows().len());
        }
        assert_eq!(log.rows().last().unwrap().step, 3 * REPORT_ROWS_MAX);
        assert_eq!(log.rows()[0].step, 1);
        assert!(!log.rows()[0].scalars.contains_key("ppo/loss/total"), "only what the report draws");
        assert_eq!(log.samples().len(), REPORT_SAMPLE_STEPS);
        let lines = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 3 * REPORT_ROWS_MAX, "the file keeps every step");
    }
}
