//! What the trackers' writers share ([`super::mlflow`], [`super::wandb`]), below
//! [`super::trackers`], which opens them: how a run ended, and the entropy of their run ids.

/// How a run ended, as the trackers record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// Every step ran (MLflow `FINISHED`, W&B exit code 0).
    Finished,
    /// Stopped by an error (MLflow `FAILED`, W&B exit code 1).
    Failed,
    /// Stopped early by Ctrl-C, with a checkpoint (MLflow `KILLED`, W&B exit code 255).
    Killed,
}

/// 64 bits for ids (MLflow run and experiment ids, W&B run ids): the clock and the process id
/// through std's randomly keyed hasher. Not training randomness: a run's seed is not used.
pub(crate) fn entropy() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
}
