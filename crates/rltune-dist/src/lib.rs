//! Collectives for data-parallel training: the one interface rltune's engine reduces gradients
//! and batch statistics through, with a backend per engine.
//!
//! ```
//! use rltune_dist::{Collective, ReduceOp, SingleProcess};
//!
//! let mut comm = SingleProcess;
//! let mut grads = vec![vec![1.0f32, 2.0], vec![3.0]];
//! let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
//! // One all-reduce per bucket of at most 1M values, never one per tensor.
//! rltune_dist::all_reduce_buckets(&mut comm, &mut views, ReduceOp::Mean, 1 << 20)?;
//! assert_eq!(grads, vec![vec![1.0, 2.0], vec![3.0]]); // one process: unchanged
//! # Ok::<(), rltune_dist::Error>(())
//! ```
//!
//! # Backends
//! - [`SingleProcess`]: world size 1, every collective the identity. A one-process run uses it
//!   and so keeps its bit-for-bit results: no engine is loaded at all.
//! - `rltune_mpi::Mpi` (the `rltune-mpi` crate, feature `mpi`): OpenMPI or MPICH through the
//!   `mpi` crate. It launches processes on one
//!   or many machines (`mpirun -np N`, `--hostfile`, Slurm's `srun`) and carries the collectives
//!   of CPU runs. Every collective runs under a watchdog: one that has not completed within the
//!   timeout (a rank died or hangs) ends the process with an error naming the rank and the
//!   collective, and the launcher then ends the others.
//! - NCCL, for gradients on GPUs, is planned on candle's `nccl` feature (issue #40); its unique
//!   id travels over MPI's [`Collective::broadcast_bytes`].
//!
//! # Launchers
//! [`Launch::from_lookup`] reads the rank, the world size and the local rank (one GPU per rank is
//! picked from it) from OpenMPI (`OMPI_COMM_WORLD_*`), MPICH/Hydra (`PMI_*`), Slurm (`SLURM_*`)
//! or the PyTorch world's `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (torchrun, Kubernetes operators),
//! through the lookup its caller gives: the `rltune` command passes its environment, and the
//! library reads none itself.
//!
//! # Reductions
//! Sums are taken in f32 (bf16 buffers are widened to f32, reduced, and rounded back to nearest
//! even); the order of a sum across ranks is the engine's, so N processes and one process agree
//! up to the order of floating-point sums, not bitwise.
#![deny(missing_docs)]

mod launch;

pub use launch::{Launch, Launcher};

/// An error of a collective or of the launch environment.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A launcher variable is malformed or inconsistent (names the variable and the fix).
    #[error("{var}: {msg}")]
    Env {
        /// The environment variable.
        var: String,
        /// What is wrong and what to do.
        msg: String,
    },
    /// The ranks disagree (e.g. on the configuration): names the first rank that differs.
    #[error("rank {rank} differs from rank 0: {what}")]
    Mismatch {
        /// The first rank that differs.
        rank: usize,
        /// What differs.
        what: String,
    },
    /// A buffer's length differs from what the collective needs.
    #[error("{0}")]
    Shape(String),
    /// The engine failed.
    #[error("{0}")]
    Engine(String),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// How an all-reduce combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over ranks.
    Sum,
    /// The sum over ranks divided by the world size.
    Mean,
}

/// The collectives the engine needs, over host buffers.
pub trait Collective {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn world_size(&self) -> usize;
    /// Sums `buf` elementwise over every rank, in place, on every rank.
    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()>;
    /// Sums `buf` (f64) elementwise over every rank, in place: for batch statistics (counts,
    /// sums of rewards and squares) that must not lose digits.
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<()>;
    /// Replaces `buf` on every rank by rank 0's (same length on every rank).
    fn broadcast_bytes(&mut self, buf: &mut [u8]) -> Result<()>;
    /// Waits until every rank reaches it.
    fn barrier(&mut self) -> Result<()>;
    /// Every rank's `value`, in rank order.
    fn all_gather_u64(&mut self, value: u64) -> Result<Vec<u64>>;

    /// [`Self::all_reduce_sum_f32`], then divided by the world size for [`ReduceOp::Mean`].
    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.all_reduce_sum_f32(buf)?;
        if op == ReduceOp::Mean && self.world_size() > 1 {
            let n = self.world_size() as f32;
            buf.iter_mut().for_each(|x| *x /= n);
        }
        Ok(())
    }

    /// All-reduce of bf16 values (as raw bits): widened to f32, reduced, rounded back.
    fn all_reduce_bf16(&mut self, buf: &mut [u16], op: ReduceOp) -> Result<()> {
        let mut wide: Vec<f32> = buf.iter().map(|&b| bf16_to_f32(b)).collect();
        self.all_reduce_f32(&mut wide, op)?;
        buf.iter_mut().zip(&wide).for_each(|(b, &x)| *b = f32_to_bf16(x));
        Ok(())
    }

    /// Checks that every rank holds the same `fingerprint` (e.g. a hash of its resolved
    /// configuration) as rank 0; the error names the first rank that differs and `what`.
    fn check_same(&mut self, fingerprint: u64, what: &str) -> Result<()> {
        let all = self.all_gather_u64(fingerprint)?;
        match all.iter().position(|&f| f != all[0]) {
            Some(rank) => Err(Error::Mismatch { rank, what: what.to_string() }),
            None => Ok(()),
        }
    }
}

/// One process: world size 1, every collective the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum_f32(&mut self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f64(&mut self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn broadcast_bytes(&mut self, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
    fn all_gather_u64(&mut self, value: u64) -> Result<Vec<u64>> {
        Ok(vec![value])
    }
}

/// All-reduces many tensors' values (gradients) in buckets of at most `bucket_len` values:
/// each bucket is flattened into one buffer and reduced with one collective, as PyTorch's DDP
/// does, never one collective per tensor. A tensor larger than a bucket is reduced alone.
pub fn all_reduce_buckets<C: Collective + ?Sized>(
    comm: &mut C,
    tensors: &mut [&mut [f32]],
    op: ReduceOp,
    bucket_len: usize,
) -> Result<()> {
    // One process goes through the collective too (the identity, or a one-GPU NCCL check).
    let bucket_len = bucket_len.max(1);
    let mut flat: Vec<f32> = Vec::with_capacity(bucket_len);
    let mut start = 0;
    while start < tensors.len() {
        // Tensors start..end fill one bucket (at least one tensor).
        let mut end = start;
        let mut len = 0;
        while end < tensors.len() && (end == start || len + tensors[end].len() <= bucket_len) {
            len += tensors[end].len();
            end += 1;
        }
        flat.clear();
        for t in &tensors[start..end] {
            flat.extend_from_slice(t);
        }
        comm.all_reduce_f32(&mut flat, op)?;
        let mut at = 0;
        for t in &mut tensors[start..end] {
            let n = t.len();
            t.copy_from_slice(&flat[at..at + n]);
            at += n;
        }
        start = end;
    }
    Ok(())
}

/// A bf16 value (its bits) as f32: exact.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// An f32 rounded to the nearest bf16 (ties to even); NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x40;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake world of `n` ranks in one process: rank 0's view, where every other rank holds
    /// `others[r]` times rank 0's values (enough to test bucketing and means).
    struct Fake {
        n: usize,
        calls: usize,
    }

    impl Collective for Fake {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            self.n
        }
        fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
            self.calls += 1;
            buf.iter_mut().for_each(|x| *x *= self.n as f32);
            Ok(())
        }
        fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<()> {
            buf.iter_mut().for_each(|x| *x *= self.n as f64);
            Ok(())
        }
        fn broadcast_bytes(&mut self, _: &mut [u8]) -> Result<()> {
            Ok(())
        }
        fn barrier(&mut self) -> Result<()> {
            Ok(())
        }
        fn all_gather_u64(&mut self, value: u64) -> Result<Vec<u64>> {
            Ok((0..self.n as u64).map(|r| value + r / 2).collect())
        }
    }

    #[test]
    fn buckets_reduce_every_tensor_once_in_few_collectives() {
        let mut a: Vec<Vec<f32>> = vec![vec![1.0; 3], vec![2.0; 4], vec![3.0; 10], vec![4.0; 2]];
        let mut comm = Fake { n: 4, calls: 0 };
        let mut views: Vec<&mut [f32]> = a.iter_mut().map(|t| t.as_mut_slice()).collect();
        all_reduce_buckets(&mut comm, &mut views, ReduceOp::Sum, 8).unwrap();
        // Buckets: [3 + 4], [10] (larger than a bucket, alone), [2].
        assert_eq!(comm.calls, 3);
        assert_eq!(a, vec![vec![4.0; 3], vec![8.0; 4], vec![12.0; 10], vec![16.0; 2]]);
        let mut views: Vec<&mut [f32]> = a.iter_mut().map(|t| t.as_mut_slice()).collect();
        all_reduce_buckets(&mut comm, &mut views, ReduceOp::Mean, 1 << 20).unwrap();
        assert_eq!(comm.calls, 4, "everything fits one bucket");
        assert_eq!(a[0], vec![4.0; 3], "the mean of equal values is the value");
    }

    #[test]
    fn one_process_changes_nothing() {
        let mut g = vec![0.1f32, -2.5, 3e-8];
        let before = g.clone();
        SingleProcess.all_reduce_f32(&mut g, ReduceOp::Mean).unwrap();
        assert_eq!(g, before);
        let mut views = vec![g.as_mut_slice()];
        all_reduce_buckets(&mut SingleProcess, &mut views, ReduceOp::Sum, 1).unwrap();
        assert_eq!(g, before);
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_round_trips() {
        for x in [0.0f32, 1.0, -2.5, 3.140625, 2f32.powi(-100), 65280.0] {
            assert_eq!(bf16_to_f32(f32_to_bf16(x)), x, "{x} is a bf16 value");
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 2f32.powi(-8))), 1.0);
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        let mut b = vec![f32_to_bf16(1.5), f32_to_bf16(-0.25)];
        Fake { n: 2, calls: 0 }.all_reduce_bf16(&mut b, ReduceOp::Mean).unwrap();
        assert_eq!((bf16_to_f32(b[0]), bf16_to_f32(b[1])), (1.5, -0.25));
    }

    #[test]
    fn a_differing_rank_is_named() {
        let mut comm = Fake { n: 4, calls: 0 };
        let err = comm.check_same(7, "the resolved configuration").unwrap_err().to_string();
        assert_eq!(err, "rank 2 differs from rank 0: the resolved configuration");
        SingleProcess.check_same(7, "x").unwrap();
    }
}
