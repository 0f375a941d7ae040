//! A child process that speaks JSON lines on stdin/stdout: the machinery shared by reward
//! commands (`rltune::rewards::CommandReward`) and environment commands
//! ([`crate::command::CommandEnv`]).
//!
//! Three threads serve the child: a writer (lines to its stdin, so a slow reader never blocks
//! the caller), a reader (its stdout, line by line, each at most a given length, so a program
//! writing without newlines cannot exhaust memory) and a stderr collector (the last lines are
//! kept for error messages, and logged at debug level). Dropping the process closes its stdin,
//! waits briefly, then kills and reaps it.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How many of the program's last stderr lines an error quotes.
const STDERR_TAIL_LINES: usize = 20;
/// The longest stderr line kept, in bytes.
const STDERR_LINE_MAX: usize = 500;
/// How much of a bad line an error quotes, in bytes.
pub const QUOTE_MAX: usize = 200;

/// What [`LineProcess::recv`] got.
#[derive(Debug)]
pub enum Received {
    /// A whole line (lossy UTF-8, with its newline).
    Line(String),
    /// The output could not be read: an overlong line, a line cut off by EOF, an I/O error.
    Unreadable(String),
    /// Nothing came before the deadline.
    Timeout,
    /// The program closed its stdout (it exited, or died).
    Closed,
}

/// A running child process speaking lines (see the module docs).
pub struct LineProcess {
    /// The command as a shell would show it.
    pub shown: String,
    child: Child,
    /// Lines for the writer thread; dropping it closes the program's stdin.
    to_child: Option<Sender<String>>,
    /// The program's stdout, line by line, from the reader thread; disconnected at EOF.
    from_child: Receiver<std::result::Result<String, String>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// Disconnected when the stderr thread has read to EOF.
    stderr_done: Receiver<()>,
}

impl LineProcess {
    /// Spawns `argv` (program, then arguments; no shell); `what` names it in errors ("reward
    /// command"), `line_max` caps the length of one stdout line in bytes.
    pub fn spawn(argv: &[String], what: &str, line_max: usize) -> Result<Self> {
        let Some(program) = argv.first() else {
            return Err(Error::Program(format!("the {what} is empty; give the program and its arguments")));
        };
        let shown = shell_words(argv);
        let mut child = Command::new(program)
            .args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Program(format!("cannot start {what} `{shown}`: {e}")))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            return Err(Error::Program(format!("{what} `{shown}`: could not open its stdin/stdout/stderr")));
        };
        let (to_child, from_parent) = mpsc::channel::<String>();
        thread::spawn(move || write_lines(stdin, from_parent));
        let (to_parent, from_child) = mpsc::channel();
        thread::spawn(move || read_lines(stdout, line_max, to_parent));
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (done_tx, stderr_done) = mpsc::channel();
        let tail = Arc::clone(&stderr_tail);
        thread::spawn(move || {
            collect_stderr(stderr, &tail);
            drop(done_tx);
        });
        Ok(Self { shown, child, to_child: Some(to_child), from_child, stderr_tail, stderr_done })
    }

    /// Queues `line` (with its newline) for the program's stdin. Returns false when the
    /// program no longer reads (its stdin is closed); reading then reports how it ended.
    pub fn send(&self, line: String) -> bool {
        self.to_child.as_ref().is_some_and(|tx| tx.send(line).is_ok())
    }

    /// The next stdout line, waiting until `deadline` (`None`: forever).
    pub fn recv(&self, deadline: Option<Instant>) -> Received {
        let got = match deadline {
            Some(d) => self.from_child.recv_timeout(d.saturating_duration_since(Instant::now())),
            None => self.from_child.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match got {
            Ok(Ok(line)) => Received::Line(line),
            Ok(Err(why)) => Received::Unreadable(why),
            Err(RecvTimeoutError::Timeout) => Received::Timeout,
            Err(RecvTimeoutError::Disconnected) => Received::Closed,
        }
    }

    /// The program's exit status, waiting up to `wait` for it to exit ("still running" if it
    /// has not), and the tail of its stderr ([`Self::stderr_summary`]).
    pub fn ending(&mut self, wait: Duration) -> (String, String) {
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
        (status, self.stderr_summary())
    }

    /// `its stderr ended with: …` or `its stderr was empty`.
    pub fn stderr_summary(&self) -> String {
        let tail = self.stderr_tail.lock().map(|t| t.iter().cloned().collect::<Vec<_>>()).unwrap_or_default();
        if tail.is_empty() {
            "its stderr was empty".into()
        } else {
            format!("its stderr ended with:\n{}", tail.join("\n"))
        }
    }

    /// Closes stdin, then kills the program if it does not exit within `grace`, and reaps it.
    pub fn shut_down(&mut self, grace: Duration) {
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

impl Drop for LineProcess {
    fn drop(&mut self) {
        self.shut_down(Duration::from_millis(500));
    }
}

/// Writer thread: writes each line to the program's stdin until the channel closes or a write
/// fails (the program exited).
fn write_lines(mut stdin: ChildStdin, lines: Receiver<String>) {
    for line in lines {
        if stdin.write_all(line.as_bytes()).and_then(|()| stdin.flush()).is_err() {
            return;
        }
    }
}

/// Reader thread: sends each stdout line (lossy UTF-8); returns at EOF, which disconnects.
/// A line longer than `line_max`, or one cut off by EOF, is sent as an error.
fn read_lines(stdout: impl Read, line_max: usize, to_parent: Sender<std::result::Result<String, String>>) {
    let mut reader = BufReader::new(stdout);
    loop {
        let mut buf = Vec::new();
        match reader.by_ref().take(line_max as u64 + 1).read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) if !buf.ends_with(b"\n") => {
                let why = if buf.len() > line_max {
                    let head = String::from_utf8_lossy(&buf[..QUOTE_MAX.min(buf.len())]);
                    format!("a line longer than {line_max} bytes, starting {head:?}; each message must be one short line")
                } else {
                    format!(
                        "its output ended in the middle of a line, {}, without the newline that ends a message",
                        quote(&String::from_utf8_lossy(&buf))
                    )
                };
                let _ = to_parent.send(Err(why));
                return;
            }
            Ok(_) => {
                if to_parent.send(Ok(String::from_utf8_lossy(&buf).into_owned())).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = to_parent.send(Err(format!("cannot read its stdout: {e}")));
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
        tracing::debug!(target: "rltune::process", "stderr: {line}");
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

/// `s` quoted for an error message, cut to [`QUOTE_MAX`] bytes.
pub fn quote(s: &str) -> String {
    if s.len() <= QUOTE_MAX {
        return format!("{s:?}");
    }
    let cut = (0..=QUOTE_MAX).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    format!("{:?}… ({} bytes)", &s[..cut], s.len())
}

/// `argv` for messages, quoting arguments that hold spaces or quotes (shell style).
pub fn shell_words(argv: &[String]) -> String {
    let quote = |a: &String| {
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"') {
            format!("'{}'", a.replace('\'', "'\\''"))
        } else {
            a.clone()
        }
    };
    argv.iter().map(quote).collect::<Vec<_>>().join(" ")
}
