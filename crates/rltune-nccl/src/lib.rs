//! The NCCL backend of `rltune_dist::Collective` (feature `nccl`): the gradients of GPU runs,
//! one GPU per process, over NVLink or the network as NCCL finds them.
//!
//! NCCL needs a launcher and a side channel: the processes are started by MPI (`mpirun`,
//! `srun`), rank 0 creates NCCL's unique id and MPI broadcasts it ([`Nccl::init`]); MPI also
//! carries the small host-side collectives (broadcasts, gathers, barriers). The all-reduces of
//! gradients and batch statistics go through NCCL on the process's GPU: the host buffer is
//! copied to the device, reduced in place, and copied back. (Staging through the host costs two
//! copies per bucket; reducing the device buffers in place is the next step.)
//!
//! Pinning: each process uses the GPU of its local rank (`rltune_dist::Launch::local_rank`).
//!
//! A crate of its own, so that switching NCCL on rebuilds only this crate and the command.
//! Without the `nccl` feature it is empty.
#![cfg(feature = "nccl")]
#![deny(missing_docs)]

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use rltune_dist::{Collective, Error, Result};

/// NCCL's communicator over one GPU per process, with the host collective that launched it.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    host: Box<dyn Collective>,
}

fn engine(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Engine(format!("NCCL {what}: {e:?}"))
}

impl Nccl {
    /// Creates the communicator of every process's `device` (the GPU of its local rank): rank 0
    /// makes NCCL's unique id and `host` (MPI) broadcasts it.
    pub fn init(device: &candle_core::CudaDevice, mut host: Box<dyn Collective>) -> Result<Self> {
        let mut bytes = [0u8; 128];
        if host.rank() == 0 {
            let id = Id::new().map_err(|e| engine("unique id", e))?;
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        host.broadcast_bytes(&mut bytes)?;
        let mut internal = [0 as core::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(bytes) {
            *c = b as core::ffi::c_char;
        }
        let stream = device.cuda_stream();
        let comm = Comm::from_rank(stream.clone(), host.rank(), host.world_size(), Id::uninit(internal))
            .map_err(|e| engine("communicator", e))?;
        Ok(Self { comm, stream, host })
    }

    /// Sums `buf` over the processes through the GPU.
    fn all_reduce<T>(&mut self, buf: &mut [T]) -> Result<()>
    where
        T: cudarc::driver::DeviceRepr + cudarc::nccl::NcclType + Copy,
    {
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.stream.clone_htod(buf).map_err(|e| engine("copy to the GPU", e))?;
        self.comm.all_reduce_in_place(&mut dev, &ReduceOp::Sum).map_err(|e| engine("all-reduce", e))?;
        self.stream.memcpy_dtoh(&dev, buf).map_err(|e| engine("copy to the host", e))?;
        self.stream.synchronize().map_err(|e| engine("synchronize", e))
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce(buf)
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce(buf)
    }

    fn broadcast_bytes(&mut self, buf: &mut [u8]) -> Result<()> {
        self.host.broadcast_bytes(buf)
    }

    fn barrier(&mut self) -> Result<()> {
        self.host.barrier()
    }

    fn all_gather_u64(&mut self, value: u64) -> Result<Vec<u64>> {
        self.host.all_gather_u64(value)
    }
}
