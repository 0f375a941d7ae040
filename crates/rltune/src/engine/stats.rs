//! The stats map `step()` returns, keyed by TRL 0.11's names (`objective/kl`, `ppo/loss/total`, …).
//!
//! See `docs/metrics.md` for the formula, estimator and healthy range of each.

use std::collections::BTreeMap;

use crate::dist::Dist;
use crate::error::Result;

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

/// Makes every scalar of `stats` the one of the whole batch of `dist`'s processes, from each
/// process's value: the mean over the processes, or for the keys in `summed` (counts, e.g.
/// `num_tokens`) the sum. As TRL's `gather(...).mean()`: exact when every process holds as many
/// samples. Every process must hold the same keys. A no-op on one process.
pub fn reduce_over(dist: &Dist, stats: &mut Stats, summed: &[&str]) -> Result<()> {
    let world = dist.world_size();
    if !dist.active() {
        return Ok(());
    }
    let keys: Vec<String> =
        stats.iter().filter(|(_, v)| v.as_f64().is_some()).map(|(k, _)| k.clone()).collect();
    let names = keys.join("\n");
    dist.check_same(crate::dist::fingerprint(names.as_bytes()), "the metric names of a step")?;
    let mut values: Vec<f64> = keys.iter().map(|k| stats[k].as_f64().unwrap_or(0.0)).collect();
    dist.sum_f64(&mut values)?;
    for (k, v) in keys.into_iter().zip(values) {
        let v = if summed.contains(&k.as_str()) { v } else { v / world as f64 };
        stats.insert(k, Stat::Scalar(v));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Mirror;

    #[test]
    fn reduce_over_means_scalars_sums_counts_and_leaves_one_process_alone() {
        let mut stats = Stats::new();
        stats.insert("loss".into(), Stat::Scalar(1.0));
        stats.insert("num_tokens".into(), Stat::Scalar(10.0));
        stats.insert("dist".into(), Stat::Array(vec![5.0]));
        let before = stats.clone();
        reduce_over(&Dist::default(), &mut stats, &["num_tokens"]).unwrap();
        assert_eq!(stats, before, "one process: unchanged");
        // Keys in order: loss, num_tokens (the array is not reduced); the other rank has 3 and 30.
        let dist = Dist::new(Box::new(Mirror { rank: 1, world: 2, others: Some(vec![3.0, 30.0]) }));
        reduce_over(&dist, &mut stats, &["num_tokens"]).unwrap();
        assert_eq!(stats["loss"], Stat::Scalar(2.0), "the mean over the processes");
        assert_eq!(stats["num_tokens"], Stat::Scalar(40.0), "a count is summed");
        assert_eq!(stats["dist"], Stat::Array(vec![5.0]));
    }
}
