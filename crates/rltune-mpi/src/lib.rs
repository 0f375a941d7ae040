//! The MPI backend of `rltune_dist::Collective` (feature `mpi`), with a watchdog on every
//! collective. It launches processes on one or many machines (`mpirun -np N`, `--hostfile`,
//! Slurm's `srun`) and carries the collectives of CPU runs.
//!
//! A crate of its own, so that switching MPI on rebuilds only this crate and the command, not
//! the library (which depends on the interface in `rltune-dist` alone). Without the `mpi`
//! feature it is empty.
#![cfg(feature = "mpi")]
#![deny(missing_docs)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

use rltune_dist::{Collective, Error, Result};

/// What the watchdog watches: the collective in flight and since when.
type InFlight = Arc<Mutex<Option<(&'static str, Instant)>>>;

/// MPI's world communicator. Created once per process ([`Mpi::init`]); MPI is finalized when it
/// is dropped.
pub struct Mpi {
    // Field order: the world before the universe, which finalizes MPI when dropped.
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
    in_flight: InFlight,
}

impl Mpi {
    /// Initializes MPI. A collective that has not completed within `timeout` (a rank died or
    /// hangs) ends this process with exit code 3 and an error naming this rank and the
    /// collective; `mpirun` (or `srun`) then ends every other rank. Never a hang forever.
    pub fn init(timeout: Duration) -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| {
            Error::Engine(
                "MPI is already initialized in this process: create one Mpi and pass it around".into(),
            )
        })?;
        let world = universe.world();
        let in_flight: InFlight = Arc::new(Mutex::new(None));
        let watched = Arc::clone(&in_flight);
        let rank = world.rank();
        std::thread::Builder::new()
            .name("rltune-mpi-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                let stuck = watched.lock().ok().and_then(|g| *g).filter(|(_, since)| since.elapsed() > timeout);
                if let Some((what, since)) = stuck {
                    eprintln!(
                        "error: rank {rank}: MPI {what} did not complete in {:.0} s: another rank died or hangs \
                         (see the other ranks' errors above); ending this rank",
                        since.elapsed().as_secs_f64()
                    );
                    std::process::exit(3);
                }
            })
            .map_err(|e| Error::Engine(format!("cannot start the MPI watchdog thread: {e}")))?;
        Ok(Self { world, _universe: universe, in_flight })
    }

    /// Runs `f` as the collective `what` under the watchdog.
    fn watched<T>(&self, what: &'static str, f: impl FnOnce(&SimpleCommunicator) -> T) -> T {
        if let Ok(mut g) = self.in_flight.lock() {
            *g = Some((what, Instant::now()));
        }
        let out = f(&self.world);
        if let Ok(mut g) = self.in_flight.lock() {
            *g = None;
        }
        out
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        let send = buf.to_vec();
        self.watched("all-reduce", |w| w.all_reduce_into(&send[..], buf, SystemOperation::sum()));
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<()> {
        let send = buf.to_vec();
        self.watched("all-reduce", |w| w.all_reduce_into(&send[..], buf, SystemOperation::sum()));
        Ok(())
    }

    fn broadcast_bytes(&mut self, buf: &mut [u8]) -> Result<()> {
        // Every rank must pass the same length: check it first, naming the rank that differs.
        self.check_same(buf.len() as u64, "the length of a broadcast buffer")?;
        self.watched("broadcast", |w| w.process_at_rank(0).broadcast_into(buf));
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.watched("barrier", |w| w.barrier());
        Ok(())
    }

    fn all_gather_u64(&mut self, value: u64) -> Result<Vec<u64>> {
        let mut out = vec![0u64; self.world_size()];
        self.watched("all-gather", |w| w.all_gather_into(&value, &mut out[..]));
        Ok(out)
    }
}
