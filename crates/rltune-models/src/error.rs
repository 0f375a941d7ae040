//! The models' error type.
//!
//! Every variant carries what a user needs to fix the problem: the file, the field or the row,
//! and (where there is one) the fix. The CLI prints the whole chain with `anyhow`.

use std::path::PathBuf;

/// Errors returned by the models, their loaders, the tokenizer and the sampler.
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

    /// A model's weights do not match what its config describes.
    #[error("{path}: {msg}")]
    Weights {
        /// The weight file (or directory) involved.
        path: PathBuf,
        /// What is wrong, naming the tensor.
        msg: String,
    },

    /// The model type named in config.json is not one rltune implements.
    #[error("{path}: unsupported model_type {model_type:?}; supported: {supported}")]
    UnsupportedModel {
        /// The config.json that named it.
        path: PathBuf,
        /// The `model_type` found.
        model_type: String,
        /// Comma-separated list of supported types.
        supported: String,
    },

    /// Input data (prompts, rollouts, datasets) is invalid; the message names the row or field.
    #[error("{0}")]
    Input(String),

    /// The tokenizer failed or does not fit the model.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A model could not be obtained from the Hugging Face hub.
    #[error("{0}")]
    Hub(String),

    /// What was asked needs hardware or a build feature that this machine or build lacks; the
    /// message names it and the alternative.
    #[error("{0}")]
    Unsupported(String),

    /// A broken invariant: a bug in rltune, never the user's input. The message says what
    /// should have held.
    #[error("internal error (a bug in rltune; please report it): {0}")]
    Internal(String),

    /// A setting cannot be used: a `[generation]` or `[lora]` value given to the library, or a
    /// `config.json` key met while building a model from a config that skipped validation (the
    /// loaders validate first and name the file). Its table and key, what is wrong, the fix.
    #[error(transparent)]
    Setting(#[from] ConfigError),
}

/// A setting that cannot be used: its table (`section`) and key (`field`), what is wrong with it
/// (`problem`), and how to fix it when the problem does not say. Every config's `validate()`
/// returns it. It prints as `section.field problem; fix` (as `--set section.field=…` names the
/// key); a problem of a table as a whole, or of several tables, has no field and prints as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.render())]
pub struct ConfigError {
    /// The table: `ppo`, `training`, `grpo`, `logging`, … (empty for a top-level key).
    pub section: String,
    /// The key in it (empty when the problem is the table's as a whole).
    pub field: String,
    /// What is wrong, e.g. `must be at least 1`.
    pub problem: String,
    /// How to fix it, when the problem does not say.
    pub fix: Option<String>,
}

impl ConfigError {
    /// The error of `section.field`: `message` is the problem, then optionally `"; "` and the
    /// fix.
    pub fn new(section: impl Into<String>, field: impl Into<String>, message: impl AsRef<str>) -> Self {
        let message = message.as_ref();
        let (problem, fix) = match message.split_once("; ") {
            Some((p, f)) => (p.to_string(), Some(f.to_string())),
            None => (message.to_string(), None),
        };
        Self { section: section.into(), field: field.into(), problem, fix }
    }

    /// The error of table `section` as a whole, or of several tables (`message` names them):
    /// it prints as `message`.
    pub fn table(section: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self::new(section, "", message.to_string())
    }

    fn render(&self) -> String {
        let mut out = match (self.section.as_str(), self.field.as_str()) {
            (_, "") => self.problem.clone(),
            (s, f) => {
                let key = if s.is_empty() { f.to_string() } else { format!("{s}.{f}") };
                let gap = if self.problem.starts_with(':') { "" } else { " " };
                format!("{key}{gap}{}", self.problem)
            }
        };
        if let Some(fix) = &self.fix {
            out.push_str("; ");
            out.push_str(fix);
        }
        out
    }
}

impl From<rltune_kernels::Error> for Error {
    fn from(e: rltune_kernels::Error) -> Self {
        match e {
            rltune_kernels::Error::Candle(e) => Error::Candle(e),
            rltune_kernels::Error::Unsupported(msg) => Error::Unsupported(msg),
            rltune_kernels::Error::Internal(msg) => Error::Internal(msg),
            e @ (rltune_kernels::Error::StateMismatch(_) | rltune_kernels::Error::GradsMismatch(_)) => {
                Error::Input(e.to_string())
            }
        }
    }
}

/// Shorthand for `std::result::Result<T, rltune_models::Error>`.
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

    /// An [`Error::Weights`] for `path`.
    pub fn weights(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Weights { path: path.into(), msg: msg.into() }
    }
}
