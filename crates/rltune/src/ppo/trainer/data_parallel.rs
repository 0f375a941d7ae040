//! What a PPO step does differently on several processes ([`crate::dist`]), so that N processes
//! with `batch_size` samples each give the weights of one process with N × `batch_size`.
//!
//! - Whitening (advantages, `whiten_rewards`) takes the mean and variance of the whole batch.
//! - A minibatch is a share of one permutation of the whole batch, drawn alike on every process
//!   (the same seeded stream): each process trains on the rows of the global minibatch it holds,
//!   which may be none.
//! - Losses and their metrics are masked means over the global minibatch's tokens: a process
//!   scales its local mean by `n_local · N / n_global`, so the gradients' mean over processes is
//!   the one-process gradient. (TRL normalises by each process's tokens, which depends on the
//!   split.)
//! - The `ratio_threshold` test reads the global mean ratio, so every process skips alike.
//!
//! On one process none of this runs: the step keeps its bit-for-bit results.

use candle_core::Tensor;

use crate::dist::Dist;
use crate::engine::{Stat, Stats};
use crate::error::Result;
use crate::ppo::math::{self, scalar};

/// The minibatch metrics that are masked means of a per-token quantity, reduced as sums.
pub(super) const MEAN_KEYS: [&str; 12] = [
    "loss/policy",
    "loss/value",
    "policy/entropy",
    "policy/approxkl",
    "policy/policykl",
    "policy/clipfrac",
    "policy/advantages_mean",
    "returns/mean",
    "val/vpred",
    "val/error",
    "val/clipfrac",
    "val/mean",
];

/// `masked_whiten` over the masked elements of every process's `x`. TRL `core.masked_whiten`
/// (unbiased variance), its mean and variance taken over the whole batch.
pub(super) fn masked_whiten(dist: &Dist, x: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor> {
    if dist.world_size() == 1 {
        return math::masked_whiten(x, mask, shift_mean);
    }
    let mut s = [scalar(&(x * mask)?.sum_all()?)?, scalar(&mask.sum_all()?)?];
    dist.sum_f64(&mut s)?;
    let n = s[1];
    let mean = s[0] / n;
    let centered = (x - mean)?;
    let mut sq = [scalar(&(centered.sqr()? * mask)?.sum_all()?)?];
    dist.sum_f64(&mut sq)?;
    if n < 2.0 {
        return Err(crate::Error::batch(format!(
            "whitening needs at least 2 response tokens in the whole batch, got {n}"
        )));
    }
    let var = sq[0] / (n - 1.0);
    let w = (centered * (1.0 / (var + 1e-8).sqrt()))?;
    Ok(if shift_mean { w } else { (w + mean)? })
}

/// [`math::whiten_rewards`] with the statistics of the whole batch.
pub(super) fn whiten_rewards(dist: &Dist, rewards: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok((masked_whiten(dist, rewards, mask, false)? * mask)?)
}

/// A process's part of one global minibatch: its response tokens and the global count.
#[derive(Debug, Clone)]
pub(super) struct Share {
    /// Response tokens of this process's rows of the minibatch.
    pub n_local: f64,
    /// Response tokens of the whole minibatch, over every process.
    pub n_global: f64,
    /// The processes.
    dist: Dist,
}

impl Share {
    /// Agrees on the global token count (every process calls it, also with no rows).
    pub fn new(dist: &Dist, n_local: f64) -> Result<Self> {
        Ok(Self { n_local, n_global: dist.sum(n_local)?, dist: dist.clone() })
    }

    /// The factor that turns this process's masked mean into its part of the global mean's
    /// gradient, averaged over the processes: `n_local · N / n_global`.
    pub fn loss_scale(&self) -> f64 {
        self.n_local * self.dist.world_size() as f64 / self.n_global.max(1.0)
    }

    /// The global masked mean of a quantity whose local masked mean is `local_mean` (0 with no
    /// rows here).
    pub fn global_mean(&self, local_mean: f64) -> Result<f64> {
        let part = if self.n_local > 0.0 { local_mean * self.n_local } else { 0.0 };
        Ok(self.dist.sum(part)? / self.n_global.max(1.0))
    }

    /// The minibatch metrics of the whole minibatch, from this process's `local` ones (none
    /// when it holds no row) and the local means of `ret²` and `old_v²` (for the variances).
    /// `vf_coef` rebuilds `loss/total`; `skipped` zeroes the losses, as one process does.
    pub fn global_stats(
        &self,
        local: Option<(&Stats, f64, f64)>,
        vf_coef: f64,
        skipped: bool,
    ) -> Result<Stats> {
        let get = |s: &Stats, k: &str| s.get(k).and_then(Stat::as_f64).unwrap_or(0.0);
        let mut sums: Vec<f64> = match local {
            Some((s, ret2, v2)) if self.n_local > 0.0 => {
                MEAN_KEYS.iter().map(|k| get(s, k)).chain([ret2, v2]).map(|m| m * self.n_local).collect()
            }
            _ => vec![0.0; MEAN_KEYS.len() + 2],
        };
        self.dist.sum_f64(&mut sums)?;
        let n = self.n_global.max(1.0);
        let means: Vec<f64> = sums[..MEAN_KEYS.len()].iter().map(|s| s / n).collect();
        let mean = |k: &str| MEAN_KEYS.iter().position(|x| *x == k).map_or(0.0, |i| means[i]);
        let mut out = Stats::new();
        for (k, m) in MEAN_KEYS.iter().zip(&means) {
            out.insert((*k).into(), Stat::Scalar(*m));
        }
        let (ret_mean, val_mean) = (mean("returns/mean"), mean("val/mean"));
        let zero = |x: f64| if skipped { 0.0 } else { x };
        let total = zero(mean("loss/policy") + vf_coef * mean("loss/value"));
        for k in ["loss/policy", "loss/value"] {
            let v = zero(mean(k));
            out.insert(k.into(), Stat::Scalar(v));
        }
        out.insert("loss/total".into(), Stat::Scalar(total));
        if self.n_global >= 2.0 {
            let m = MEAN_KEYS.len();
            // Unbiased: (Σx² − n·mean²) / (n − 1).
            let var = |sq: f64, mean: f64| (sq - n * mean * mean) / (n - 1.0);
            out.insert("returns/var".into(), Stat::Scalar(var(sums[m], ret_mean)));
            out.insert("val/var".into(), Stat::Scalar(var(sums[m + 1], val_mean)));
        }
        // The per-token arrays stay this process's (rank 0 logs its share).
        if let Some((s, _, _)) = local {
            for k in ["policy/advantages", "policy/ratio"] {
                if let Some(v) = s.get(k) {
                    out.insert(k.into(), v.clone());
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn one_process_whitens_as_trl() {
        let x = Tensor::new(&[[1f32, 2.0, 3.0], [4.0, 5.0, 9.0]], &Device::Cpu).unwrap();
        let m = Tensor::new(&[[1f32, 1.0, 0.0], [1.0, 1.0, 1.0]], &Device::Cpu).unwrap();
        let a = masked_whiten(&Dist::default(), &x, &m, true).unwrap().to_vec2::<f32>().unwrap();
        let b = math::masked_whiten(&x, &m, true).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(a, b, "one process runs TRL's function itself");
        let s = Share::new(&Dist::default(), 5.0).unwrap();
        assert_eq!((s.n_global, s.loss_scale()), (5.0, 1.0));
        assert_eq!(s.global_mean(0.25).unwrap(), 0.25);
    }
}
