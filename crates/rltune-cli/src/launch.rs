//! Data-parallel launches: which engine this process trains through, from its launcher's
//! variables (`mpirun`, MPICH's Hydra, Slurm's `srun`; see `rltune_dist::Launch`).
//!
//! One process (no launcher) has no engine ([`Dist::default`]) and keeps its bit-for-bit results. Several need
//! the `mpi` feature (`cargo build --release -p rltune-cli --features mpi`, with OpenMPI or
//! MPICH and `libclang-dev` installed); without it the run is refused with that command.

use std::time::Duration;

use anyhow::{bail, Context};
use rltune::dist::{Dist, Launch, Launcher};

/// How long a collective may wait for the other processes before this one gives up (a rank
/// died or hangs), unless `RLTUNE_DIST_TIMEOUT_S` says otherwise.
const DEFAULT_TIMEOUT_S: u64 = 300;

/// The processes and engine that the launcher's variables call for ([`Dist::default`] for one
/// process). The engine is finalized when the last clone of the handle drops.
pub fn init(command: &str, data_parallel: bool) -> anyhow::Result<Dist> {
    let launch =
        Launch::from_lookup(|k| std::env::var(k).ok()).context("reading the launcher's variables")?;
    let forced = forced()?;
    if launch.world_size == 1 {
        // One process through the collectives (`RLTUNE_DIST=single`: the identity, a check of
        // the data-parallel code paths; `nccl`: NCCL on one GPU, the GPU kit's check).
        return match forced {
            Some(mode) if data_parallel => {
                tracing::info!("RLTUNE_DIST={mode}: one process through the collectives");
                Ok(Dist::new(Box::new(rltune::dist::SingleProcess)))
            }
            _ => Ok(Dist::default()),
        };
    }
    if !data_parallel {
        bail!(
            "`rltune {command}` was started as rank {} of {} by {:?}, but it is not data-parallel: only \
             the trainers `rltune ppo` (PPO, GRPO, RLOO, rejection sampling), `dpo`, `sft` and `reward` are. \
             Run it as one process",
            launch.rank,
            launch.world_size,
            launch.launcher
        );
    }
    if launch.launcher == Launcher::Torchrun {
        bail!(
            "RANK / WORLD_SIZE (torchrun-style) launches need a rendezvous over MASTER_ADDR, which \
             rltune's engines do not provide yet: launch with `mpirun -np {}` or Slurm's `srun` (MPI)",
            launch.world_size
        );
    }
    let timeout = match std::env::var("RLTUNE_DIST_TIMEOUT_S") {
        Ok(v) => v.trim().parse::<u64>().ok().filter(|&s| s > 0).with_context(|| {
            format!("RLTUNE_DIST_TIMEOUT_S={v:?} is not a positive whole number of seconds")
        })?,
        Err(_) => DEFAULT_TIMEOUT_S,
    };
    let dist = engine(&launch, Duration::from_secs(timeout))?;
    // Every process must run the same command line (`rltune ppo` also compares the resolved
    // configuration before its first step).
    let argv: Vec<String> = std::env::args().skip(1).collect();
    dist.check_same(
        rltune::dist::fingerprint(argv.join("\0").as_bytes()),
        "the command line: start every process with the same arguments",
    )?;
    Ok(dist)
}

#[cfg(feature = "mpi")]
fn engine(launch: &Launch, timeout: Duration) -> anyhow::Result<Dist> {
    use rltune::dist::Collective;
    let mpi = rltune_mpi::Mpi::init(timeout).context("starting MPI")?;
    if mpi.world_size() != launch.world_size || mpi.rank() != launch.rank {
        bail!(
            "the launcher says rank {} of {}, MPI says rank {} of {}: start rltune with the MPI it was \
             built against (`mpirun --version`)",
            launch.rank,
            launch.world_size,
            mpi.rank(),
            mpi.world_size()
        );
    }
    tracing::info!(
        "data-parallel: rank {} of {} (MPI, {:?})",
        launch.rank,
        launch.world_size,
        launch.launcher
    );
    Ok(Dist::new(Box::new(mpi)))
}

#[cfg(not(feature = "mpi"))]
fn engine(launch: &Launch, _timeout: Duration) -> anyhow::Result<Dist> {
    bail!(
        "started as rank {} of {} by {:?}, but this rltune was built without MPI: rebuild it with \
         `cargo build --release -p rltune-cli --features mpi` (needs OpenMPI or MPICH, and libclang-dev)",
        launch.rank,
        launch.world_size,
        launch.launcher
    )
}

/// `RLTUNE_DIST`: unset, `single` or `nccl` (one process forced through the collectives).
fn forced() -> anyhow::Result<Option<&'static str>> {
    match std::env::var("RLTUNE_DIST").ok().as_deref() {
        None | Some("") => Ok(None),
        Some("single") => Ok(Some("single")),
        Some("nccl") => Ok(Some("nccl")),
        Some(other) => bail!(
            "RLTUNE_DIST={other:?}: expected \"single\" (one process through the collectives) or \
             \"nccl\" (one GPU through NCCL); unset it for a plain run"
        ),
    }
}

/// Once the run's device is open: on a GPU of a data-parallel run built with `nccl`, the
/// collectives go through NCCL (over the MPI that launched the run, or alone on one GPU with
/// `RLTUNE_DIST=nccl`). Without `nccl` they stay on MPI, which reduces host copies of the
/// gradients (correct, slower).
pub fn on_device(dist: &Dist, device: &candle_core::Device) -> anyhow::Result<()> {
    if !dist.active() {
        return Ok(());
    }
    let nccl = forced()? == Some("nccl");
    if device.is_cpu() {
        if nccl {
            bail!("RLTUNE_DIST=nccl needs the run on a GPU (--device cuda)");
        }
        return Ok(());
    }
    if dist.world_size() == 1 && !nccl {
        return Ok(());
    }
    gpu_engine(dist, device)
}

#[cfg(feature = "nccl")]
fn gpu_engine(dist: &Dist, device: &candle_core::Device) -> anyhow::Result<()> {
    let candle_core::Device::Cuda(cuda) = device else { return Ok(()) };
    dist.replace(|host| Ok(Box::new(rltune_nccl::Nccl::init(cuda, host)?)))?;
    tracing::info!("data-parallel: gradients through NCCL");
    Ok(())
}

#[cfg(not(feature = "nccl"))]
fn gpu_engine(_dist: &Dist, _device: &candle_core::Device) -> anyhow::Result<()> {
    if forced()? == Some("nccl") {
        bail!("RLTUNE_DIST=nccl: this rltune was built without NCCL; rebuild with --features nccl");
    }
    tracing::warn!(
        "data-parallel on GPUs without NCCL: the gradients are reduced by MPI through host copies; \
         build with --features nccl for NCCL"
    );
    Ok(())
}

/// Whether this process is a rank other than 0 of a launch (its logs are kept to warnings).
pub fn is_secondary_rank() -> bool {
    Launch::from_lookup(|k| std::env::var(k).ok()).is_ok_and(|l| l.rank > 0)
}
