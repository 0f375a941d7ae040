//! A reward computed by an external program that speaks JSON lines.
//!
//! The program is spawned once and kept running. For each sample rltune writes one line to its
//! stdin, `{"meta": ..., "query": "...", "response": "..."}`, and reads one line from its stdout:
//! a bare number (`0.7`) or an object with a numeric `reward` field (`{"reward": 0.7}`).
//! Answers come in order, one per sample; the program may read ahead. Its stderr is captured
//! (logged at debug level) and its tail is quoted when it fails.
//!
//! Any program can be the reward: a Python script wrapping a model, a test harness, or people
//! rating samples by hand (`crates/rltune/examples/rewards/rate_by_hand.py`, which talks to the
//! terminal through `/dev/tty`; give it a long timeout or none).
//!
//! An answer line longer than 1 MiB is an error (it is not read to its end, so output without
//! newlines cannot exhaust memory), and so is a last line cut off by the program's exit.
//!
//! After any error (a timeout, a bad answer, the program exiting) the program is killed and the
//! reward refuses further batches: later answers could no longer be matched to samples.

use std::time::{Duration, Instant};

use super::{RewardInput, RewardSource};
use crate::envs::process::{quote, LineProcess, Received};
use crate::error::{Error, Result};

/// The longest answer line read, in bytes: a longer one is an error, so a program that writes
/// without newlines cannot exhaust memory.
const ANSWER_LINE_MAX: usize = 1 << 20;

/// A reward from an external process speaking JSON lines (see the module docs).
pub struct CommandReward {
    name: String,
    timeout: Option<Duration>,
    process: LineProcess,
    /// Answer lines read since the program started.
    lines_read: usize,
    /// Why the reward no longer works, after an error.
    broken: Option<String>,
}

impl CommandReward {
    /// The default per-batch timeout: 60 s.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Spawns `argv` (program, then arguments; no shell) with the default timeout.
    pub fn spawn(argv: Vec<String>) -> Result<Self> {
        let process = LineProcess::spawn(&argv, "reward command", ANSWER_LINE_MAX)?;
        Ok(Self {
            name: format!("command({})", process.shown),
            timeout: Some(Self::DEFAULT_TIMEOUT),
            process,
            lines_read: 0,
            broken: None,
        })
    }

    /// Sets the per-batch timeout: the whole batch must be answered within it. `None` waits
    /// forever (for people rating by hand).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// The per-batch timeout.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Sends the batch and collects one answer per sample.
    fn score_batch(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        let n = batch.len();
        for s in batch {
            let line = serde_json::json!({"query": s.query, "response": s.response, "meta": s.meta});
            // A send fails only when the program no longer reads (it closed its stdin or
            // exited); reading below then reports how it ended.
            let _ = self.process.send(format!("{line}\n"));
        }
        let start = Instant::now();
        let deadline = self.timeout.map(|t| start + t);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            match self.process.recv(deadline) {
                Received::Line(line) => {
                    self.lines_read += 1;
                    let answer = parse_answer(&line).map_err(|why| {
                        self.err(format!(
                            "answer line {} (for sample {i} of {n} in this batch) is {}: {why}; each answer \
                             must be a number or {{\"reward\": <number>}} on its own line",
                            self.lines_read,
                            quote(line.trim_end())
                        ))
                    })?;
                    out.push(answer);
                }
                // The program may still be running (an overlong line): wait only briefly.
                Received::Unreadable(why) => {
                    return Err(self.exited_with(why, i, n, Duration::from_millis(200)))
                }
                Received::Timeout => {
                    return Err(self.err(format!(
                        "timed out waiting for the answer to sample {i} of {n} in this batch: the batch \
                         timeout is {:.1?} and {:.1?} have passed ({i} answered); raise the timeout, or \
                         disable it for people rating by hand",
                        self.timeout.unwrap_or_default(),
                        start.elapsed()
                    )))
                }
                Received::Closed => return Err(self.exited(i, n)),
            }
        }
        Ok(out)
    }

    /// An error about the program, naming it.
    fn err(&self, msg: String) -> Error {
        Error::reward(format!("reward {}", self.name), msg)
    }

    /// The error for a program that closed its stdout after answering `i` of `n`: its exit status
    /// (after a short wait for it to exit) and the tail of its stderr.
    fn exited(&mut self, i: usize, n: usize) -> Error {
        let what = "the program closed its stdout: it died or exited".into();
        self.exited_with(what, i, n, Duration::from_secs(2))
    }

    /// The error `what`, after answering `i` of `n`, with the program's exit status (waiting up
    /// to `wait` for it; "still running" if it has not exited) and the tail of its stderr.
    fn exited_with(&mut self, what: String, i: usize, n: usize, wait: Duration) -> Error {
        let (status, stderr) = self.process.ending(wait);
        self.err(format!("{what} ({status}) after answering {i} of {n} samples in this batch; {stderr}"))
    }
}

impl std::fmt::Debug for CommandReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandReward")
            .field("name", &self.name)
            .field("timeout", &self.timeout)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl RewardSource for CommandReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        if let Some(why) = &self.broken {
            return Err(self.err(format!(
                "unusable after an earlier error (the program was stopped): {why}; start a new one"
            )));
        }
        let res = self.score_batch(batch);
        if let Err(e) = &res {
            self.broken = Some(e.to_string());
            self.process.shut_down(Duration::ZERO);
        }
        res
    }
}

/// Parses one answer line: a number, or an object with a numeric `reward`. `NaN`, `inf` and
/// numbers beyond f32 parse (as NaN and ±inf): a non-finite score makes the PPO loop skip the
/// batch with a warning, while a line that is not a number is an error.
fn parse_answer(line: &str) -> std::result::Result<f32, String> {
    let t = line.trim();
    if t.is_empty() {
        return Err("an empty line".into());
    }
    let v = match serde_json::from_str::<serde_json::Value>(t) {
        Ok(serde_json::Value::Number(n)) => n.as_f64().ok_or("not representable as a float")?,
        Ok(serde_json::Value::Object(o)) => match o.get("reward") {
            Some(r) => r.as_f64().ok_or_else(|| format!("its \"reward\" is {r}, not a number"))?,
            None => return Err("an object without a \"reward\" field".into()),
        },
        Ok(other) => return Err(format!("JSON {}, not a number", json_kind(&other))),
        // Not JSON: accept what Rust parses as a float, `nan` and `inf` included.
        Err(_) => t.parse::<f64>().map_err(|_| "not a number".to_string())?,
    };
    Ok(v as f32)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Number(_) | serde_json::Value::Object(_) => "a value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> CommandReward {
        CommandReward::spawn(vec!["sh".into(), "-c".into(), script.into()]).unwrap()
    }

    fn batch(n: usize) -> Vec<RewardInput<'static>> {
        let responses = ["good", "bad", "good again", "meh"];
        (0..n).map(|i| RewardInput::text("q", responses[i % 4])).collect()
    }

    #[test]
    fn parse_answer_accepts_numbers_and_reward_objects() {
        assert_eq!(parse_answer("0.5\n"), Ok(0.5));
        assert_eq!(parse_answer(" -2 "), Ok(-2.0));
        assert_eq!(parse_answer("{\"reward\": 1.5, \"why\": \"ok\"}"), Ok(1.5));
        assert_eq!(parse_answer("+1.0"), Ok(1.0));
        assert!(parse_answer("NaN").unwrap().is_nan());
        assert_eq!(parse_answer("inf"), Ok(f32::INFINITY));
        assert_eq!(parse_answer("1e39"), Ok(f32::INFINITY), "beyond f32: infinite, so the batch is skipped");
        for (bad, want) in [
            ("", "empty"),
            ("\"1\"", "a string"),
            ("{\"score\": 1}", "without a \"reward\""),
            ("{\"reward\": \"high\"}", "not a number"),
            ("hello", "not a number"),
        ] {
            let err = parse_answer(bad).unwrap_err();
            assert!(err.contains(want), "{bad:?}: {err}");
        }
    }

    #[test]
    fn command_reward_scores_batches_with_one_process() {
        // Reads each JSON line; answers by the response text, in both answer forms, and counts
        // samples across batches (so one process served both).
        let script = r#"n=0; while IFS= read -r l; do n=$((n+1));
            case "$l" in *'"response":"good'*) echo "$n";; *) echo "{\"reward\": -$n}";; esac; done"#;
        let mut r = sh(script);
        assert!(r.name().starts_with("command(sh -c 'n=0;"), "{}", r.name());
        assert_eq!(r.score(&batch(3)).unwrap(), vec![1.0, -2.0, 3.0]);
        assert_eq!(r.score(&batch(2)).unwrap(), vec![4.0, -5.0]);
        assert_eq!(r.score(&[]).unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn command_reward_sends_query_response_and_meta() {
        // Echo back the length of the line received, to check what was sent (ASCII only: the
        // shell may count bytes or characters).
        let mut r = sh(r#"while IFS= read -r l; do echo "${#l}"; done"#);
        let meta = serde_json::json!({"answer": "x"});
        let sample = RewardInput { meta: &meta, ..RewardInput::text("a \"q\"", "two\nlines") };
        let sent = serde_json::json!({"query": "a \"q\"", "response": "two\nlines", "meta": {"answer": "x"}});
        assert_eq!(r.score(&[sample]).unwrap(), vec![sent.to_string().len() as f32]);
    }

    #[test]
    fn command_reward_reports_crash_with_exit_status_and_stderr() {
        let mut r = sh("read l; echo 1; echo 'boom: model not found' >&2; exit 3");
        let err = r.score(&batch(2)).unwrap_err().to_string();
        assert!(err.contains("exit status: 3"), "{err}");
        assert!(err.contains("boom: model not found"), "{err}");
        assert!(err.contains("after answering 1 of 2"), "{err}");
        let again = r.score(&batch(1)).unwrap_err().to_string();
        assert!(again.contains("unusable after an earlier error"), "{again}");
    }

    #[test]
    fn command_reward_times_out_naming_the_sample() {
        let mut r = sh("read l; echo 1; sleep 5").with_timeout(Some(Duration::from_millis(300)));
        let start = Instant::now();
        let err = r.score(&batch(2)).unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
        assert!(err.contains("timed out") && err.contains("sample 1 of 2"), "{err}");
        assert!(err.contains("300.0ms"), "{err}");
    }

    #[test]
    fn command_reward_rejects_garbage_naming_the_line_and_passes_nan() {
        let mut r = sh("read l; echo 0.5; read l; echo hello");
        let err = r.score(&batch(2)).unwrap_err().to_string();
        assert!(
            err.contains("answer line 2") && err.contains("\"hello\"") && err.contains("sample 1"),
            "{err}"
        );
        let mut r = sh("while read l; do echo NaN; done");
        assert!(r.score(&batch(1)).unwrap()[0].is_nan(), "NaN is a score; the PPO loop skips its batch");
    }

    #[test]
    fn command_reward_spawn_errors_name_the_program() {
        let err =
            CommandReward::spawn(vec!["/nonexistent/reward-program".into(), "--x".into()]).err().unwrap();
        assert!(err.to_string().contains("/nonexistent/reward-program --x"), "{err}");
        assert!(CommandReward::spawn(vec![]).err().unwrap().to_string().contains("empty"));
    }
}
