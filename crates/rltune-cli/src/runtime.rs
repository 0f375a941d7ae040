//! `--device` and `--dtype`, shared by every command: they override the config's `[runtime]`
//! table (where the command has one) and resolve to the one [`Runtime`] the command passes down.

use anyhow::{Context, Result};
use rltune::dist::Dist;
use rltune::runtime::{
    Activations, AttentionProducts, CudaHost, DeviceChoice, Precision, Runtime, RuntimeSection,
};

/// The runtime flags of a command.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct RuntimeArgs {
    /// Where to compute: auto (a CUDA GPU when this build has the `cuda` feature and the machine
    /// a GPU, else the CPU), cpu, cuda or cuda:N. Overrides [runtime] device.
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<DeviceChoice>,
    /// f32, or bf16 (bf16 matrix products, f32 weights; on the CPU it needs AMX). Overrides
    /// [runtime] dtype.
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<Precision>,
    /// CUDA only: tuned (default: no per-allocation events, the memory pool kept), events,
    /// trim or candle (candle's defaults), to measure the host settings. Overrides [runtime]
    /// cuda_host.
    #[arg(long, value_name = "MODE")]
    pub cuda_host: Option<CudaHost>,
    /// CUDA with bf16 only: bf16 (default: a product's bf16 result goes on in bf16 where the op
    /// after it has a bf16 kernel, as under torch.autocast) or f32 (cast back to f32 after every
    /// product), to measure it. Overrides [runtime] activations.
    #[arg(long, value_name = "DTYPE")]
    pub activations: Option<Activations>,
    /// CUDA with bf16 only: f32 (default: rltune's fused attention kernels, f32 products) or
    /// bf16 (attention's two products in bf16 on the tensor cores, as torch.autocast). Overrides
    /// [runtime] attention.
    #[arg(long, value_name = "DTYPE")]
    pub attention: Option<AttentionProducts>,
}

impl RuntimeArgs {
    /// `section` with these flags in place of its values.
    pub fn apply(&self, section: RuntimeSection) -> RuntimeSection {
        section
            .with_overrides(self.device, self.dtype)
            .with_cuda_host(self.cuda_host)
            .with_activations(self.activations)
            .with_attention(self.attention)
    }

    /// Resolves `section` with the flags applied, for one process, and installs its
    /// process-wide settings.
    pub fn resolve(&self, section: RuntimeSection) -> Result<Runtime> {
        self.resolve_with(section, &Dist::default())
    }

    /// [`Self::resolve`] for this process of `dist` (the data-parallel trainers): on a GPU, the
    /// collectives then go through NCCL where the build has it ([`crate::launch::on_device`]).
    pub fn resolve_with(&self, section: RuntimeSection, dist: &Dist) -> Result<Runtime> {
        let runtime = Runtime::resolve(&self.apply(section))
            .context("cannot set up the runtime")?
            .with_dist(dist.clone());
        runtime.install()?;
        tracing::debug!("runtime: {runtime}");
        crate::launch::on_device(dist, runtime.device())?;
        Ok(runtime)
    }
}
