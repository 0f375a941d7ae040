//! The stats map `step()` returns, keyed by TRL 0.11's names (`objective/kl`, `ppo/loss/total`, …).
//!
//! See `docs/metrics.md` for the formula, estimator and healthy range of each.

use std::collections::BTreeMap;

/// One statistic: a number, a vector (per sequence or flattened per token), a matrix, or text.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Stat {
    /// A number.
    Scalar(f64),
    /// A vector.
    Array(Vec<f64>),
    /// A `(B, T)` matrix.
    Matrix(Vec<Vec<f64>>),
    /// A message (e.g. a warning naming a likely cause).
    Text(String),
}

impl Stat {
    /// The number, if this is a scalar.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Stat::Scalar(v) => Some(*v),
            _ => None,
        }
    }
}

/// Statistics by TRL name.
pub type Stats = BTreeMap<String, Stat>;

/// Mean and unbiased standard deviation (torch's `std`), `NaN` std for one element.
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}
