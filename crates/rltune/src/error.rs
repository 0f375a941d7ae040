//! The library's error type.
//!
//! Every variant carries what a user needs to fix the problem: the file, the field or the row,
//! and (where there is one) the fix. The CLI prints the whole chain with `anyhow`.

use std::path::PathBuf;

pub use rltune_models::ConfigError;

/// Errors returned by rltune.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// A JSON or TOML file could not be parsed, or a field in it is missing or invalid.
    #[error("{path}: {msg}")]
    Config {
        /// The file that holds the bad field.
        path: PathBuf,
        /// What is wrong, naming the field, and how to fix it.
        msg: String,
    },

    /// A data file (prompts, rollouts, datasets) or one of its rows is invalid.
    #[error("{at}: {problem}")]
    Data {
        /// Where: the file, with the row or line where there is one (`data.jsonl line 3`).
        at: String,
        /// What is wrong, naming the field, and the fix.
        problem: String,
    },

    /// A checkpoint cannot be written or resumed.
    #[error("{path}: {problem}")]
    Checkpoint {
        /// The checkpoint's folder or file.
        path: PathBuf,
        /// What is wrong (e.g. a setting that differs from the run's) and the fix.
        problem: String,
    },

    /// A reward source failed or answered what cannot be used (an HTTP endpoint, a judge, a
    /// command, a function).
    #[error("{source_name}: {problem}")]
    Reward {
        /// The source: `reward NAME`, or the config table that defines it.
        source_name: String,
        /// What went wrong, and the fix where there is one.
        problem: String,
    },

    /// A trainer step's in-memory inputs (queries, responses, scores, masks, rewards, pairs) do
    /// not fit together or with the model.
    #[error("{}", at_sample(.unit, *.sample, .problem))]
    Batch {
        /// The row at fault, when one row is; `None` when the batch as a whole is (its size, a
        /// count that differs between two inputs).
        sample: Option<usize>,
        /// What the trainer calls a row, for the message: `sample`, `row`, `turn`, `pair`.
        unit: &'static str,
        /// What is wrong and the fix.
        problem: String,
    },

    /// An argument of a library function that no config key holds (a model, a tag set, a
    /// weight) cannot be used.
    #[error("{name}: {problem}")]
    Argument {
        /// The argument: `policy`, `critic`, `reference`, …
        name: &'static str,
        /// What is wrong and the fix.
        problem: String,
    },

    /// Input that an application built on the library (the CLI's tasks) rejects; the message
    /// names the row or field. The library itself returns the typed variants above.
    #[error("{0}")]
    Input(String),

    /// The tokenizer failed or does not fit the model.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A model could not be obtained from the Hugging Face hub.
    #[error("{0}")]
    Hub(String),

    /// A fused op, the optimizer or the process settings failed (`rltune_kernels::Error`: e.g.
    /// an optimizer state or gradients that do not fit its variables, a checkpoint written for
    /// another model).
    #[error(transparent)]
    Kernels(#[from] rltune_kernels::Error),

    /// A model, its weights, its tokenizer or its hub download failed (`rltune_models::Error`:
    /// names the file and the tensor or field).
    #[error(transparent)]
    Model(#[from] rltune_models::Error),

    /// An environment, the play loop or a task metric failed (`rltune_envs::Error`).
    #[error(transparent)]
    Env(#[from] rltune_envs::Error),

    /// A collective of a data-parallel run failed, or the processes disagree (names the rank).
    #[error("data-parallel run: {0}")]
    Dist(#[from] rltune_dist::Error),

    /// A setting cannot be used: its table and key, what is wrong, and the fix.
    #[error(transparent)]
    Setting(#[from] ConfigError),

    /// What was asked needs hardware or a build feature that this machine or build lacks; the
    /// message names it and the alternative.
    #[error("{0}")]
    Unsupported(String),
    /// A broken invariant: a bug in rltune, never the user's input. The message says what
    /// should have held.
    #[error("internal error (a bug in rltune; please report it): {0}")]
    Internal(String),
}

/// How [`Error::Batch`] prints: `sample 3: {problem}` (or `row 3`, `turn 3`), or the problem
/// alone.
fn at_sample(unit: &str, sample: Option<usize>, problem: &str) -> String {
    match sample {
        Some(i) => format!("{unit} {i}: {problem}"),
        None => problem.to_string(),
    }
}

/// Shorthand for `std::result::Result<T, rltune::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    /// An [`Error::Config`] for `path`.
    pub fn config(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::Config { path: path.into(), msg: msg.to_string() }
    }

    /// An [`Error::Data`] at `at` (a file, or a file's row).
    pub fn data(at: impl std::fmt::Display, problem: impl std::fmt::Display) -> Self {
        Error::Data { at: at.to_string(), problem: problem.to_string() }
    }

    /// An [`Error::Reward`] from the source named `source_name`.
    pub fn reward(source_name: impl std::fmt::Display, problem: impl std::fmt::Display) -> Self {
        Error::Reward { source_name: source_name.to_string(), problem: problem.to_string() }
    }

    /// An [`Error::Batch`] at sample `i`.
    pub fn sample(i: usize, problem: impl std::fmt::Display) -> Self {
        Self::row_of("sample", i, problem)
    }

    /// An [`Error::Batch`] at row `i`, where the trainer calls a row `unit` (`row`, `turn`).
    pub fn row_of(unit: &'static str, i: usize, problem: impl std::fmt::Display) -> Self {
        Error::Batch { sample: Some(i), unit, problem: problem.to_string() }
    }

    /// An [`Error::Batch`] of the batch as a whole.
    pub fn batch(problem: impl std::fmt::Display) -> Self {
        Error::Batch { sample: None, unit: "sample", problem: problem.to_string() }
    }

    /// An [`Error::Argument`] for the argument `name`.
    pub fn argument(name: &'static str, problem: impl std::fmt::Display) -> Self {
        Error::Argument { name, problem: problem.to_string() }
    }

    /// An [`Error::Checkpoint`] for the checkpoint at `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, problem: impl std::fmt::Display) -> Self {
        Error::Checkpoint { path: path.into(), problem: problem.to_string() }
    }

    /// A weight file that does not hold what it should ([`rltune_models::Error::Weights`]).
    pub fn weights(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Model(rltune_models::Error::Weights { path: path.into(), msg: msg.into() })
    }
}
