//! Data parallelism: the collective this process trains through, and the few operations the
//! trainers need from it.
//!
//! A one-process run has no engine ([`Dist::default`]): every operation here is then the
//! identity (world size 1) and the run keeps its bit-for-bit results. A data-parallel run
//! (`mpirun -np N rltune …`, built with the `mpi` feature) makes its engine once
//! ([`Dist::new`]); the trainers then
//! - all-reduce the gradients once per optimizer step, in buckets ([`Dist::all_reduce_grads`],
//!   called by the optimizer before the norm);
//! - take their share of each batch ([`Dist::shard`]), sampled with seeds that follow the
//!   sample, not the process (`generation::GenerationConfig::row_offset`);
//! - reduce every statistic that normalises across the batch ([`Dist::sum_f64`],
//!   [`Dist::gather_f64`]);
//! - log, report and checkpoint on rank 0 only ([`Dist::is_main`]).
//!
//! The collective is a [`Dist`] handle, passed explicitly: the command line makes it from the
//! launcher's variables and puts it in the [`crate::runtime::Runtime`] it passes down; each run
//! hands a clone to its trainer and optimizer. Clones share one engine. MPI's communicators are
//! not `Send`, so neither is a `Dist`: every collective is called by the training thread (the
//! kernels' worker threads never call one).

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::rc::Rc;

pub use rltune_dist::{Collective, Launch, Launcher, ReduceOp, SingleProcess};

use crate::error::{Error, Result};
use crate::optim::Grads;

/// Values per all-reduce of gradients (16 MiB of f32), as DDP's default 25 MB buckets.
pub const BUCKET_LEN: usize = 1 << 22;

/// The processes a run trains with, and the engine between them (MPI, NCCL, or one process
/// forced through the collectives). [`Dist::default`] is one process without an engine: every
/// operation is then the identity and the run keeps its bit-for-bit results. Cheap to clone;
/// the engine is finalized when the last clone drops.
#[derive(Clone, Default)]
pub struct Dist {
    engine: Option<Rc<Engine>>,
}

/// The engine of a [`Dist`] and what it measured.
struct Engine {
    comm: RefCell<Box<dyn Collective>>,
    /// Seconds spent in gradient all-reduces since the last [`Dist::take_all_reduce_seconds`].
    all_reduce_s: Cell<f64>,
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.engine {
            None => f.write_str("Dist(one process)"),
            Some(_) => write!(f, "Dist(rank {} of {})", self.rank(), self.world_size()),
        }
    }
}

impl Dist {
    /// A run through `comm` (every data-parallel run; one process forced through the
    /// collectives too).
    pub fn new(comm: Box<dyn Collective>) -> Self {
        Self { engine: Some(Rc::new(Engine { comm: RefCell::new(comm), all_reduce_s: Cell::new(0.0) })) }
    }

    /// Replaces the engine, for every clone of this handle, by what `f` makes of it (e.g. NCCL
    /// over the MPI that launched the run, once the GPU is open). An error without an engine.
    pub fn replace(&self, f: impl FnOnce(Box<dyn Collective>) -> Result<Box<dyn Collective>>) -> Result<()> {
        let engine =
            self.engine.as_ref().ok_or_else(|| Error::Internal("no collective to replace".into()))?;
        let mut slot = engine.comm.borrow_mut();
        let current = std::mem::replace(&mut *slot, Box::new(SingleProcess));
        *slot = f(current)?;
        Ok(())
    }

    /// Runs `f` on the engine (a [`SingleProcess`] without one).
    pub fn with<T>(&self, f: impl FnOnce(&mut dyn Collective) -> rltune_dist::Result<T>) -> Result<T> {
        match &self.engine {
            Some(e) => f(&mut **e.comm.borrow_mut()),
            None => f(&mut SingleProcess),
        }
        .map_err(Error::from)
    }

    /// Whether there is an engine (a data-parallel run, or one process forced through the
    /// collectives with `RLTUNE_DIST`). Without one every operation here is the identity.
    pub fn active(&self) -> bool {
        self.engine.is_some()
    }

    /// The number of processes (1 without an engine).
    pub fn world_size(&self) -> usize {
        self.engine.as_ref().map_or(1, |e| e.comm.borrow().world_size())
    }

    /// This process's rank (0 without an engine).
    pub fn rank(&self) -> usize {
        self.engine.as_ref().map_or(0, |e| e.comm.borrow().rank())
    }

    /// Whether this process logs, reports and checkpoints: rank 0.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// The seconds spent in [`Self::all_reduce_grads`] since the last call (waiting for the
    /// slowest process included): the trainers log it as `time/dist/all_reduce`.
    pub fn take_all_reduce_seconds(&self) -> f64 {
        self.engine.as_ref().map_or(0.0, |e| e.all_reduce_s.replace(0.0))
    }

    /// This rank's share of `n` items split evenly in rank order (all of them on one process).
    /// `what` names the batch and its config field in the error when `n` does not split evenly.
    pub fn shard(&self, n: usize, what: &str) -> Result<Range<usize>> {
        let world = self.world_size();
        if !n.is_multiple_of(world) {
            return Err(Error::batch(format!(
                "{what} is {n}, which {world} processes cannot share evenly: make it a multiple of {world} \
                 (the global batch is split by rank, so that N processes give the results of one)"
            )));
        }
        let per = n / world;
        let r = self.rank();
        Ok(r * per..(r + 1) * per)
    }

    /// Averages the gradients over the processes, once, in buckets of [`BUCKET_LEN`] values; a
    /// no-op without an engine.
    pub fn all_reduce_grads(&self, grads: &mut Grads) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let mut failed = None;
        let out = grads.reduce_flat(|slices| {
            if let Err(e) =
                self.with(|c| rltune_dist::all_reduce_buckets(c, slices, ReduceOp::Mean, BUCKET_LEN))
            {
                failed = Some(e);
                return Err(candle_core::Error::Msg("the all-reduce of the gradients failed".into()).into());
            }
            Ok(())
        });
        if let Some(e) = &self.engine {
            e.all_reduce_s.set(e.all_reduce_s.get() + t.elapsed().as_secs_f64());
        }
        match failed {
            Some(e) => Err(e),
            None => out.map_err(Error::from),
        }
    }

    /// Sums `buf` over the processes, in place (f64: counts and sums of a batch statistic).
    pub fn sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        self.with(|c| c.all_reduce_sum_f64(buf))
    }

    /// The sum of `x` over the processes.
    pub fn sum(&self, x: f64) -> Result<f64> {
        let mut b = [x];
        self.sum_f64(&mut b)?;
        Ok(b[0])
    }

    /// `Σ sum / max(1, Σ count)` over the processes: a mean over the whole batch from each
    /// process's sum and count (e.g. a masked mean: the masked sum and the mask's sum).
    pub fn mean_of(&self, sum: f64, count: f64) -> Result<f64> {
        let mut b = [sum, count];
        self.sum_f64(&mut b)?;
        Ok(b[0] / b[1].max(1.0))
    }

    /// The mean of `x` over the processes (`x` itself on one).
    pub fn mean(&self, x: f64) -> Result<f64> {
        Ok(self.sum(x)? / self.world_size() as f64)
    }

    /// Every process's `local` values, concatenated in rank order; each process must pass as many
    /// (the error names the first that does not). Exact, as [`Self::gather_var_f64`].
    pub fn gather_f64(&self, local: &[f64]) -> Result<Vec<f64>> {
        let (all, lens) = self.gather_parts(local)?;
        match lens.iter().position(|&n| n != lens[0]) {
            Some(rank) => {
                Err(rltune_dist::Error::Mismatch { rank, what: "the number of values in a gather".into() }
                    .into())
            }
            None => Ok(all),
        }
    }

    /// Every process's `local` values, concatenated in rank order, where the processes may hold
    /// different numbers of values; also returns where this process's values start. Exact, as
    /// [`Self::gather_f64`].
    pub fn gather_var_f64(&self, local: &[f64]) -> Result<(Vec<f64>, usize)> {
        let (all, lens) = self.gather_parts(local)?;
        Ok((all, lens[..self.rank()].iter().sum()))
    }

    /// Every process's `local` values in rank order, and how many each gave. Exact: each slot is
    /// one process's value plus zeros (a `-0.0` comes back as `0.0`).
    fn gather_parts(&self, local: &[f64]) -> Result<(Vec<f64>, Vec<usize>)> {
        if !self.active() {
            return Ok((local.to_vec(), vec![local.len()]));
        }
        let lens: Vec<usize> =
            self.with(|c| c.all_gather_u64(local.len() as u64))?.into_iter().map(|n| n as usize).collect();
        let start: usize = lens[..self.rank()].iter().sum();
        let mut all = vec![0.0; lens.iter().sum()];
        all[start..start + local.len()].copy_from_slice(local);
        self.sum_f64(&mut all)?;
        Ok((all, lens))
    }

    /// Every process's token sequences (with a mask of the same length each), in rank order: what
    /// one process would hold. Token ids and mask values travel as f64 (exact below 2^53).
    pub fn gather_sequences(&self, local: &[(Vec<u32>, Vec<u8>)]) -> Result<Vec<(Vec<u32>, Vec<u8>)>> {
        if !self.active() {
            return Ok(local.to_vec());
        }
        let mut flat = Vec::new();
        for (ids, mask) in local {
            flat.push(ids.len() as f64);
            flat.extend(ids.iter().map(|&t| f64::from(t)));
            flat.extend(mask.iter().map(|&m| f64::from(m)));
        }
        let (all, _) = self.gather_var_f64(&flat)?;
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
    pub fn check_same(&self, fingerprint: u64, what: &str) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        self.with(|c| c.check_same(fingerprint, what))
    }
}

/// A stable 64-bit hash of `bytes` (FNV-1a): the same on every machine and build.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// For tests: rank `rank` of a world of `world` whose other ranks hold the same values as this
/// one, or, where `others` is given, whose other ranks' f64 values sum to `others`.
#[cfg(test)]
pub(crate) struct Mirror {
    pub rank: usize,
    pub world: usize,
    pub others: Option<Vec<f64>>,
}

#[cfg(test)]
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
        match &self.others {
            Some(others) => buf.iter_mut().zip(others).for_each(|(x, o)| *x += o),
            None => buf.iter_mut().for_each(|x| *x *= self.world as f64),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_is_the_identity() {
        let d = Dist::default();
        assert_eq!((d.world_size(), d.rank(), d.is_main(), d.active()), (1, 0, true, false));
        assert_eq!(d.shard(6, "x").unwrap(), 0..6);
        assert_eq!(d.gather_f64(&[1.0, -0.0]).unwrap(), vec![1.0, -0.0]);
        assert_eq!(d.sum(2.5).unwrap(), 2.5);
        d.check_same(7, "x").unwrap();
        let seqs = vec![(vec![1u32, 2], vec![0u8, 1]), (vec![], vec![])];
        assert_eq!(d.gather_sequences(&seqs).unwrap(), seqs);
        assert!(d.replace(Ok).is_err(), "nothing to replace");
        assert_ne!(fingerprint(b"a"), fingerprint(b"b"));
        assert_eq!(fingerprint(b""), 0xcbf2_9ce4_8422_2325);
        // FNV-1a's published value for "a" (GiGPO's anchor states are keyed by it too).
        assert_eq!(fingerprint(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(fingerprint(b"room 1"), fingerprint(b"room 2"));
    }

    #[test]
    fn shards_follow_the_rank_and_uneven_batches_are_refused() {
        let d = Dist::new(Box::new(Mirror { rank: 1, world: 2, others: None }));
        assert_eq!((d.world_size(), d.rank(), d.is_main()), (2, 1, false));
        assert_eq!(d.shard(6, "x").unwrap(), 3..6);
        let err = d.shard(5, "[grpo] prompts_per_step").unwrap_err().to_string();
        assert!(err.starts_with("[grpo] prompts_per_step is 5, which 2 processes"), "{err}");
        // Rank 1's values land in the second half; the mirror's rank 0 sent the same.
        assert_eq!(
            d.gather_f64(&[1.0, 2.0]).unwrap(),
            [0.0, 0.0, 1.0, 2.0].iter().map(|x| x * 2.0).collect::<Vec<_>>()
        );
        // A replaced engine is every clone's.
        let clone = d.clone();
        d.replace(|_| Ok(Box::new(Mirror { rank: 0, world: 3, others: None }))).unwrap();
        assert_eq!((clone.world_size(), clone.rank()), (3, 0));
        clone.replace(|_| Ok(Box::new(Mirror { rank: 1, world: 2, others: None }))).unwrap();
        // The mirror's rank 0 holds as many values as this rank 1: its part comes first.
        let (all, start) = d.gather_var_f64(&[3.0]).unwrap();
        assert_eq!((all, start), (vec![0.0, 6.0], 1));
    }

    #[test]
    fn gradients_are_averaged_and_missing_ones_count_as_zero() {
        use candle_core::{Device, Tensor, Var};
        let d = Dist::new(Box::new(Mirror { rank: 0, world: 2, others: None }));
        let a = Var::from_tensor(&Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[3f32], &Device::Cpu).unwrap()).unwrap();
        let mut grads = Grads::new(&[a.clone(), b.clone()]);
        grads.backward(&(a.as_tensor() * 3.0).unwrap().sum_all().unwrap()).unwrap();
        assert!(grads.has(0) && !grads.has(1));
        d.all_reduce_grads(&mut grads).unwrap();
        assert!(d.take_all_reduce_seconds() >= 0.0 && d.take_all_reduce_seconds() == 0.0);
        // The mirror's other rank gave the same gradient: the mean is the gradient.
        assert_eq!(grads.get(0).unwrap().unwrap().to_vec1::<f32>().unwrap(), vec![3.0, 3.0]);
        assert!(!grads.has(1), "no rank had one: still none");
    }
}
