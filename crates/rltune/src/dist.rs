//! Data parallelism: the collective this process trains through, and the few operations the
//! trainers need from it.
//!
//! A one-process run installs nothing: every function here is then the identity (world size 1)
//! and the run keeps its bit-for-bit results. A data-parallel run (`mpirun -np N rltune …`, built
//! with the `mpi` feature) installs its engine once, on the thread that trains, with
//! [`install`]; the trainers then
//! - all-reduce the gradients once per optimizer step, in buckets ([`all_reduce_grads`], called
//!   by [`crate::engine::Optimizer::clip`] before the norm);
//! - take their share of each batch ([`shard`]), sampled with seeds that follow the sample, not
//!   the process (`generation::GenerationConfig::row_offset`);
//! - reduce every statistic that normalises across the batch ([`sum_f64`], [`gather_f64`]);
//! - log, report and checkpoint on rank 0 only ([`is_main`]).
//!
//! The collective lives in a thread-local slot: MPI's communicators are not `Send`, and every
//! collective is called by the training thread (the kernels' worker threads never call one).

use std::cell::RefCell;
use std::ops::Range;

pub use rltune_dist::{Collective, Launch, Launcher, ReduceOp, SingleProcess};

use crate::error::{Error, Result};
use crate::optim::Grads;

/// Values per all-reduce of gradients (16 MiB of f32), as DDP's default 25 MB buckets.
pub const BUCKET_LEN: usize = 1 << 22;

thread_local! {
    static COMM: RefCell<Option<Box<dyn Collective>>> = const { RefCell::new(None) };
    /// Seconds spent in gradient all-reduces since the last [`take_all_reduce_seconds`].
    static ALL_REDUCE_S: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// The seconds this thread spent in [`all_reduce_grads`] since the last call (waiting for the
/// slowest process included): the trainers log it as `time/dist/all_reduce`.
pub fn take_all_reduce_seconds() -> f64 {
    ALL_REDUCE_S.with(|c| c.replace(0.0))
}

/// The installed collective; dropping it uninstalls it (and, for MPI, finalizes the engine).
#[must_use = "the collective is uninstalled when this guard drops"]
pub struct Installed(());

impl Drop for Installed {
    fn drop(&mut self) {
        let comm = COMM.with(|c| c.borrow_mut().take());
        drop(comm);
    }
}

/// Makes `comm` the collective of this thread's training until the guard drops.
pub fn install(comm: Box<dyn Collective>) -> Result<Installed> {
    COMM.with(|c| {
        let mut slot = c.borrow_mut();
        if slot.is_some() {
            return Err(Error::Internal("a collective is already installed on this thread".into()));
        }
        *slot = Some(comm);
        Ok(Installed(()))
    })
}

/// Replaces the installed collective by what `f` makes of it (e.g. NCCL over the MPI that
/// launched the run, once the GPU is open). An error when none is installed.
pub fn replace(f: impl FnOnce(Box<dyn Collective>) -> Result<Box<dyn Collective>>) -> Result<()> {
    let current = COMM
        .with(|c| c.borrow_mut().take())
        .ok_or_else(|| Error::Internal("no collective is installed to replace".into()))?;
    let next = f(current)?;
    COMM.with(|c| *c.borrow_mut() = Some(next));
    Ok(())
}

/// Runs `f` on the installed collective (a [`SingleProcess`] when none is).
pub fn with<T>(f: impl FnOnce(&mut dyn Collective) -> rltune_dist::Result<T>) -> Result<T> {
    COMM.with(|c| match c.borrow_mut().as_deref_mut() {
        Some(comm) => f(comm),
        None => f(&mut SingleProcess),
    })
    .map_err(Error::from)
}

/// Whether a collective is installed (a data-parallel run, or a one-process run forced through
/// the collectives with `RLTUNE_DIST`). Without one every function here is the identity.
pub fn active() -> bool {
    COMM.with(|c| c.borrow().is_some())
}

/// The number of processes (1 without an installed collective).
pub fn world_size() -> usize {
    COMM.with(|c| c.borrow().as_ref().map_or(1, |c| c.world_size()))
}

/// This process's rank (0 without an installed collective).
pub fn rank() -> usize {
    COMM.with(|c| c.borrow().as_ref().map_or(0, |c| c.rank()))
}

/// Whether this process logs, reports and checkpoints: rank 0.
pub fn is_main() -> bool {
    rank() == 0
}

/// This rank's share of `n` items split evenly in rank order (all of them on one process).
/// `what` names the batch and its config field in the error when `n` does not split evenly.
pub fn shard(n: usize, what: &str) -> Result<Range<usize>> {
    let world = world_size();
    if !n.is_multiple_of(world) {
        return Err(Error::Input(format!(
            "{what} is {n}, which {world} processes cannot share evenly: make it a multiple of {world} \
             (the global batch is split by rank, so that N processes give the results of one)"
        )));
    }
    let per = n / world;
    let r = rank();
    Ok(r * per..(r + 1) * per)
}

/// Averages the gradients over the processes, once, in buckets of [`BUCKET_LEN`] values; a
/// no-op without an installed collective.
pub fn all_reduce_grads(grads: &mut Grads) -> Result<()> {
    if !active() {
        return Ok(());
    }
    let t = std::time::Instant::now();
    let mut failed = None;
    let out = grads.reduce_flat(|slices| {
        if let Err(e) = with(|c| rltune_dist::all_reduce_buckets(c, slices, ReduceOp::Mean, BUCKET_LEN)) {
            failed = Some(e);
            return Err(candle_core::Error::Msg("the all-reduce of the gradients failed".into()).into());
        }
        Ok(())
    });
    ALL_REDUCE_S.with(|c| c.set(c.get() + t.elapsed().as_secs_f64()));
    match failed {
        Some(e) => Err(e),
        None => out.map_err(Error::from),
    }
}

/// Sums `buf` over the processes, in place (f64: counts and sums of a batch statistic).
pub fn sum_f64(buf: &mut [f64]) -> Result<()> {
    if !active() {
        return Ok(());
    }
    with(|c| c.all_reduce_sum_f64(buf))
}

/// The sum of `x` over the processes.
pub fn sum(x: f64) -> Result<f64> {
    let mut b = [x];
    sum_f64(&mut b)?;
    Ok(b[0])
}

/// `Σ sum / max(1, Σ count)` over the processes: a mean over the whole batch from each
/// process's sum and count (e.g. a masked mean: the masked sum and the mask's sum).
pub fn mean_of(sum: f64, count: f64) -> Result<f64> {
    let mut b = [sum, count];
    sum_f64(&mut b)?;
    Ok(b[0] / b[1].max(1.0))
}

/// The mean of `x` over the processes (`x` itself on one).
pub fn mean(x: f64) -> Result<f64> {
    Ok(sum(x)? / world_size() as f64)
}

/// Every process's `local` values, concatenated in rank order; each process must pass as many
/// (the error names the first that does not). Exact, as [`gather_var_f64`].
pub fn gather_f64(local: &[f64]) -> Result<Vec<f64>> {
    let (all, lens) = gather_parts(local)?;
    match lens.iter().position(|&n| n != lens[0]) {
        Some(rank) => {
            Err(rltune_dist::Error::Mismatch { rank, what: "the number of values in a gather".into() }.into())
        }
        None => Ok(all),
    }
}

/// Makes every scalar of `stats` the one of the whole batch, from each process's value: the mean
/// over the processes, or for the keys in `summed` (counts, e.g. `num_tokens`) the sum. As TRL's
/// `gather(...).mean()`: exact when every process holds as many samples. Every process must hold
/// the same keys. A no-op on one process.
pub fn reduce_stats(stats: &mut crate::engine::Stats, summed: &[&str]) -> Result<()> {
    let world = world_size();
    if !active() {
        return Ok(());
    }
    use crate::engine::Stat;
    let keys: Vec<String> =
        stats.iter().filter(|(_, v)| v.as_f64().is_some()).map(|(k, _)| k.clone()).collect();
    let names = keys.join("\n");
    check_same(fingerprint(names.as_bytes()), "the metric names of a step")?;
    let mut values: Vec<f64> = keys.iter().map(|k| stats[k].as_f64().unwrap_or(0.0)).collect();
    sum_f64(&mut values)?;
    for (k, v) in keys.into_iter().zip(values) {
        let v = if summed.contains(&k.as_str()) { v } else { v / world as f64 };
        stats.insert(k, Stat::Scalar(v));
    }
    Ok(())
}

/// Every process's `local` values, concatenated in rank order, where the processes may hold
/// different numbers of values; also returns where this process's values start. Exact, as
/// [`gather_f64`].
pub fn gather_var_f64(local: &[f64]) -> Result<(Vec<f64>, usize)> {
    let (all, lens) = gather_parts(local)?;
    Ok((all, lens[..rank()].iter().sum()))
}

/// Every process's `local` values in rank order, and how many each gave. Exact: each slot is
/// one process's value plus zeros (a `-0.0` comes back as `0.0`).
fn gather_parts(local: &[f64]) -> Result<(Vec<f64>, Vec<usize>)> {
    if !active() {
        return Ok((local.to_vec(), vec![local.len()]));
    }
    let lens: Vec<usize> =
        with(|c| c.all_gather_u64(local.len() as u64))?.into_iter().map(|n| n as usize).collect();
    let start: usize = lens[..rank()].iter().sum();
    let mut all = vec![0.0; lens.iter().sum()];
    all[start..start + local.len()].copy_from_slice(local);
    sum_f64(&mut all)?;
    Ok((all, lens))
}

/// Every process's token sequences (with a mask of the same length each), in rank order: what
/// one process would hold. Token ids and mask values travel as f64 (exact below 2^53).
pub fn gather_sequences(local: &[(Vec<u32>, Vec<u8>)]) -> Result<Vec<(Vec<u32>, Vec<u8>)>> {
    if !active() {
        return Ok(local.to_vec());
    }
    let mut flat = Vec::new();
    for (ids, mask) in local {
        flat.push(ids.len() as f64);
        flat.extend(ids.iter().map(|&t| f64::from(t)));
        flat.extend(mask.iter().map(|&m| f64::from(m)));
    }
    let (all, _) = gather_var_f64(&flat)?;
    let mut out = Vec::new();
    let mut at = 0;
    while at < all.len() {
        let n = all[at] as usize;
        let ids = all[at + 1..at + 1 + n].iter().map(|&t| t as u32).collect();
        let mask = all[at + 1 + n..at + 1 + 2 * n].iter().map(|&m| m as u8).collect();
        out.push((ids, mask));
        at += 1 + 2 * n;
    }
    Ok(out)
}

/// Refuses to go on unless every process holds the same `fingerprint` of `what` as rank 0 (a
/// hash of its resolved configuration); the error names the first rank that differs.
pub fn check_same(fingerprint: u64, what: &str) -> Result<()> {
    if !active() {
        return Ok(());
    }
    with(|c| c.check_same(fingerprint, what))
}

/// A stable 64-bit hash of `bytes` (FNV-1a): the same on every machine and build.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_is_the_identity() {
        assert_eq!((world_size(), rank(), is_main()), (1, 0, true));
        assert_eq!(shard(6, "x").unwrap(), 0..6);
        assert_eq!(gather_f64(&[1.0, -0.0]).unwrap(), vec![1.0, -0.0]);
        assert_eq!(sum(2.5).unwrap(), 2.5);
        check_same(7, "x").unwrap();
        let seqs = vec![(vec![1u32, 2], vec![0u8, 1]), (vec![], vec![])];
        assert_eq!(gather_sequences(&seqs).unwrap(), seqs);
        assert_ne!(fingerprint(b"a"), fingerprint(b"b"));
        assert_eq!(fingerprint(b""), 0xcbf2_9ce4_8422_2325);
        // FNV-1a's published value for "a" (GiGPO's anchor states are keyed by it too).
        assert_eq!(fingerprint(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(fingerprint(b"room 1"), fingerprint(b"room 2"));
    }

    /// Rank `rank` of a world of `world` whose other ranks hold the same values as this one.
    struct Mirror {
        rank: usize,
        world: usize,
    }

    impl Collective for Mirror {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> rltune_dist::Result<()> {
            buf.iter_mut().for_each(|x| *x *= self.world as f32);
            Ok(())
        }
        fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> rltune_dist::Result<()> {
            buf.iter_mut().for_each(|x| *x *= self.world as f64);
            Ok(())
        }
        fn broadcast_bytes(&mut self, _: &mut [u8]) -> rltune_dist::Result<()> {
            Ok(())
        }
        fn barrier(&mut self) -> rltune_dist::Result<()> {
            Ok(())
        }
        fn all_gather_u64(&mut self, value: u64) -> rltune_dist::Result<Vec<u64>> {
            Ok(vec![value; self.world])
        }
    }

    #[test]
    fn shards_follow_the_rank_and_uneven_batches_are_refused() {
        let _g = install(Box::new(Mirror { rank: 1, world: 2 })).unwrap();
        assert_eq!((world_size(), rank(), is_main()), (2, 1, false));
        assert_eq!(shard(6, "x").unwrap(), 3..6);
        let err = shard(5, "[grpo] prompts_per_step").unwrap_err().to_string();
        assert!(err.starts_with("[grpo] prompts_per_step is 5, which 2 processes"), "{err}");
        // Rank 1's values land in the second half; the mirror's rank 0 sent the same.
        assert_eq!(
            gather_f64(&[1.0, 2.0]).unwrap(),
            [0.0, 0.0, 1.0, 2.0].iter().map(|x| x * 2.0).collect::<Vec<_>>()
        );
        assert!(install(Box::new(SingleProcess)).is_err(), "one collective per thread");
        // The mirror's rank 0 holds as many values as this rank 1: its part comes first.
        let (all, start) = gather_var_f64(&[3.0]).unwrap();
        assert_eq!((all, start), (vec![0.0, 6.0], 1));
    }

    #[test]
    fn gradients_are_averaged_and_missing_ones_count_as_zero() {
        use candle_core::{Device, Tensor, Var};
        let _g = install(Box::new(Mirror { rank: 0, world: 2 })).unwrap();
        let a = Var::from_tensor(&Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[3f32], &Device::Cpu).unwrap()).unwrap();
        let mut grads = Grads::new(&[a.clone(), b.clone()]);
        grads.backward(&(a.as_tensor() * 3.0).unwrap().sum_all().unwrap()).unwrap();
        assert!(grads.has(0) && !grads.has(1));
        all_reduce_grads(&mut grads).unwrap();
        // The mirror's other rank gave the same gradient: the mean is the gradient.
        assert_eq!(grads.get(0).unwrap().unwrap().to_vec1::<f32>().unwrap(), vec![3.0, 3.0]);
        assert!(!grads.has(1), "no rank had one: still none");
    }
}
