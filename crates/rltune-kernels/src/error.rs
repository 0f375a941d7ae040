//! The kernels' error type.

/// Errors returned by the kernels, the process settings and the optimizer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// What was asked needs hardware this machine lacks; the message names it and the
    /// alternative.
    #[error("{0}")]
    Unsupported(String),

    /// Optimizer state (a checkpoint's moments) does not fit the optimizer's variables: the
    /// checkpoint was written for another model or another set of trained parameters.
    #[error("optimizer state does not fit: {0}")]
    StateMismatch(String),

    /// Gradients were built over other variables than the optimizer's (a caller's bug: build
    /// `Grads` from `Adam::vars`).
    #[error("{0}")]
    GradsMismatch(String),

    /// A broken invariant: a bug in rltune, never the caller's input.
    #[error("internal error (a bug in rltune; please report it): {0}")]
    Internal(String),
}

/// Shorthand for `std::result::Result<T, rltune_kernels::Error>`.
pub type Result<T> = std::result::Result<T, Error>;
