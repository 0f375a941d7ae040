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

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::{RewardInput, RewardSource};
use crate::error::{Error, Result};

/// How many of the program's last stderr lines an error quotes.
const STDERR_TAIL_LINES: usize = 20;
/// The longest stderr line kept, in bytes.
const STDERR_LINE_MAX: usize = 500;
/// The longest answer line read, in bytes: a longer one is an error, so a program that writes
/// without newlines cannot exhaust memory.
const ANSWER_LINE_MAX: usize = 1 << 20;
/// How much of a bad answer line an error quotes, in bytes.
const ANSWER_QUOTE_MAX: usize = 200;

/// A reward from an external process speaking JSON lines (see the module docs).
pub struct CommandReward {
    name: String,
    timeout: Option<Duration>,
    child: Child,
    /// Lines for the writer thread; dropping it closes the program's stdin.
    to_child: Option<Sender<String>>,
    /// The program's stdout, line by line, from the reader thread; disconnected at EOF.
    from_child: Receiver<std::io::Result<String>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// Disconnected when the stderr thread has read to EOF.
    stderr_done: Receiver<()>,
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
        let Some(program) = argv.first() else {
            return Err(Error::Input(
                "the reward command is empty; give the program and its arguments".into(),
            ));
        };
        let shown = shell_words(&argv);
        let mut child = Command::new(program)
            .args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Input(format!("cannot start reward command `{shown}`: {e}")))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            return Err(Error::Input(format!(
                "reward command `{shown}`: could not open its stdin/stdout/stderr"
            )));
        };
        let (to_child, from_parent) = mpsc::channel::<String>();
        thread::spawn(move || write_lines(stdin, from_parent));
        let (to_parent, from_child) = mpsc::channel();
        thread::spawn(move || read_lines(stdout, to_parent));
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (done_tx, stderr_done) = mpsc::channel();
        let tail = Arc::clone(&stderr_tail);
        thread::spawn(move || {
            collect_stderr(stderr, &tail);
            drop(done_tx);
        });
        Ok(Self {
            name: format!("command({shown})"),
            timeout: Some(Self::DEFAULT_TIMEOUT),
            child,
            to_child: Some(to_child),
            from_child,
            stderr_tail,
            stderr_done,
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
        let to_child = self.to_child.as_ref().ok_or_else(|| self.err("its stdin is closed".into()))?;
        for s in batch {
            let line = serde_json::json!({"query": s.query, "response": s.response, "meta": s.meta});
            // A send fails only when the writer thread stopped (the program closed its stdin or
            // exited); reading below then reports how the program ended.
            let _ = to_child.send(format!("{line}\n"));
        }
        let start = Instant::now();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let got = match self.timeout {
                Some(t) => self.from_child.recv_timeout(t.saturating_sub(start.elapsed())),
                None => self.from_child.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match got {
                Ok(Ok(line)) => {
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
                Ok(Err(e)) => {
                    // The program may still be running (an overlong line): wait only briefly.
                    let msg = format!("cannot read its stdout: {e}");
                    return Err(self.exited_with(msg, i, n, Duration::from_millis(200)));
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(self.err(format!(
                        "timed out waiting for the answer to sample {i} of {n} in this batch: the batch \
                         timeout is {:.1?} and {:.1?} have passed ({i} answered); raise the timeout, or \
                         disable it for people rating by hand",
                        self.timeout.unwrap_or_default(),
                        start.elapsed()
                    )))
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.exited(i, n)),
            }
        }
        Ok(out)
    }

    /// An error about the program, naming it.
    fn err(&self, msg: String) -> Error {
        Error::Input(format!("reward {}: {msg}", self.name))
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
        let deadline = Instant::now() + wait;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status.to_string(),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                Ok(None) => break "still running".to_string(),
                Err(e) => break format!("status unknown: {e}"),
            }
        };
        // The stderr thread reaches EOF soon after the program exits.
        let _ = self.stderr_done.recv_timeout(wait.min(Duration::from_secs(1)));
        let msg = format!(
            "{what} ({status}) after answering {i} of {n} samples in this batch; {}",
            self.stderr_summary()
        );
        self.err(msg)
    }

    /// `stderr (last lines): ...` or `stderr was empty`.
    fn stderr_summary(&self) -> String {
        let tail = self.stderr_tail.lock().map(|t| t.iter().cloned().collect::<Vec<_>>()).unwrap_or_default();
        if tail.is_empty() {
            "its stderr was empty".into()
        } else {
            format!("its stderr ended with:\n{}", tail.join("\n"))
        }
    }

    /// Closes stdin, then kills the program if it does not exit within `grace`, and reaps it.
    fn shut_down(&mut self, grace: Duration) {
        self.to_child = None;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
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
            self.shut_down(Duration::ZERO);
        }
        res
    }
}

impl Drop for CommandReward {
    fn drop(&mut self) {
        self.shut_down(Duration::from_millis(500));
    }
}

/// Writer thread: writes each line to the program's stdin until the channel closes or a write
/// fails (the program exited).
fn write_lines(mut stdin: std::process::ChildStdin, lines: Receiver<String>) {
    for line in lines {
        if stdin.write_all(line.as_bytes()).and_then(|()| stdin.flush()).is_err() {
            return;
        }
    }
}

/// Reader thread: sends each stdout line (lossy UTF-8); returns at EOF, which disconnects.
/// A line longer than [`ANSWER_LINE_MAX`], or one cut off by EOF, is sent as an error.
fn read_lines(stdout: impl Read, to_parent: Sender<std::io::Result<String>>) {
    let mut reader = BufReader::new(stdout);
    loop {
        let mut buf = Vec::new();
        match reader.by_ref().take(ANSWER_LINE_MAX as u64 + 1).read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) if !buf.ends_with(b"\n") => {
                let why = if buf.len() > ANSWER_LINE_MAX {
                    let head = String::from_utf8_lossy(&buf[..ANSWER_QUOTE_MAX]);
                    format!(
                        "an answer line longer than {ANSWER_LINE_MAX} bytes, starting {head:?}; each \
                         answer must be one short line"
                    )
                } else {
                    format!(
                        "its output ended in the middle of a line, {}, without the newline that ends an \
                         answer",
                        quote(&String::from_utf8_lossy(&buf))
                    )
                };
                let _ = to_parent.send(Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why)));
                return;
            }
            Ok(_) => {
                if to_parent.send(Ok(String::from_utf8_lossy(&buf).into_owned())).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = to_parent.send(Err(e));
                return;
            }
        }
    }
}

/// Stderr thread: keeps the last [`STDERR_TAIL_LINES`] lines and logs each at debug level. A
/// line past 64 KiB is split there, so output without newlines cannot exhaust memory.
fn collect_stderr(stderr: impl Read, tail: &Mutex<VecDeque<String>>) {
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    while matches!(reader.by_ref().take(64 << 10).read_until(b'\n', &mut buf), Ok(n) if n > 0) {
        let mut line = String::from_utf8_lossy(&buf).trim_end().to_string();
        buf.clear();
        tracing::debug!(target: "rltune::rewards::command", "stderr: {line}");
        if line.len() > STDERR_LINE_MAX {
            let cut = (0..=STDERR_LINE_MAX).rev().find(|&i| line.is_char_boundary(i)).unwrap_or(0);
            line.truncate(cut);
            line.push('…');
        }
        if let Ok(mut t) = tail.lock() {
            if t.len() == STDERR_TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
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

/// `s` quoted (Rust debug syntax), cut to [`ANSWER_QUOTE_MAX`] bytes with the length noted.
fn quote(s: &str) -> String {
    if s.len() <= ANSWER_QUOTE_MAX {
        return format!("{s:?}");
    }
    let cut = (0..=ANSWER_QUOTE_MAX).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    format!("{:?}… ({} bytes)", &s[..cut], s.len())
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

/// `argv` for messages, quoting arguments that hold spaces or quotes.
fn shell_words(argv: &[String]) -> String {
    let quote = |a: &String| {
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"') {
            format!("'{}'", a.replace('\'', "'\\''"))
        } else {
            a.clone()
        }
    };
    argv.iter().map(quote).collect::<Vec<_>>().join(" ")
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
