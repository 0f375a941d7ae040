//! The environments' error type: what went wrong, typed by what a caller can do about it.

use std::path::PathBuf;

/// Errors returned by the environments, the play loop and the task metrics.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// A data file (a CoNLL file, a data set) has a bad line or no content; the message says
    /// what to fix.
    #[error("{}{}: {msg}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Data {
        /// The file.
        path: PathBuf,
        /// The 1-based line, where one is at fault.
        line: Option<usize>,
        /// What is wrong and the fix.
        msg: String,
    },

    /// An environment's setting is out of range or missing; the message names the field
    /// (`adventure.rooms`, `[env.ner] file`) and the fix.
    #[error("{0}")]
    Config(String),

    /// A step was asked of an episode that is not running (never reset, ended, or lost when
    /// the environment program restarted): reset that environment, then step it.
    #[error("{env}: environment {index} {state}; reset it first")]
    NotRunning {
        /// The environment family (`adventure`, `essays`, …).
        env: &'static str,
        /// The environment's index in the batch.
        index: usize,
        /// Why it is not running.
        state: String,
    },

    /// A call's arguments do not fit the batch (an index out of range or listed twice, a count
    /// that differs): a bug of the caller.
    #[error("{0}")]
    Call(String),

    /// An environment program (the JSON-lines protocol) could not be started, answered with
    /// an error, or broke the protocol; the message holds what it said.
    #[error("{0}")]
    Program(String),

    /// The environment refused a step the caller expected it to take (a walkthrough command
    /// the game did not accept).
    #[error("{0}")]
    Refused(String),

    /// An agent failed to choose its actions (for a model agent: its model failed).
    #[error(transparent)]
    Agent(Box<dyn std::error::Error + Send + Sync>),
}

/// Shorthand for `std::result::Result<T, rltune_envs::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    /// An [`Error::NotRunning`] for environment `index` of family `env`.
    pub fn not_running(env: &'static str, index: usize, state: impl Into<String>) -> Self {
        Error::NotRunning { env, index, state: state.into() }
    }
}
