//! The CUDA twins of the fused CPU kernels: `.cu` sources in `src/cuda/`, compiled to PTX for
//! compute 9.0 by this crate's build script (`--fmad=false`, IEEE division and square root) and
//! embedded, loaded once per device through candle's `get_or_load_custom_func`. Each twin is
//! checked against its CPU kernel on the device by `rltune selftest --device cuda` (the checks
//! named `kernels/<op>`).
//!
//! | kernel | CPU twin | launches |
//! |---|---|---|
//! | [`adam_inplace`] (`adam.cu`) | `optim::adam_rows` | one per tensor, in place: parameter and both moments in one pass, no allocation (candle's ops: 13 kernels, 13 allocations and a copy) |

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Storage, Tensor, Var};

use crate::error::Result;

/// `adam.cu`, as PTX.
const ADAM_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adam.ptx"));

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;

/// One Adam update of the f32 CUDA variable `p`, in place, from its gradient `g`, with the
/// moments `m` and `v` (f32, contiguous, `p`'s size, owned by the caller and written in place).
/// `k = [step_size, β₁, β₂, ε, √(1−β₂ᵗ)]`, as the CPU kernel takes them. Returns false, having
/// done nothing, when a tensor is not of that kind (the caller then takes candle's ops).
pub fn adam_inplace(p: &Var, g: &Tensor, m: &Tensor, v: &Tensor, k: [f32; 5]) -> Result<bool> {
    let fits = |t: &Tensor| {
        t.dtype() == DType::F32
            && t.is_contiguous()
            && t.elem_count() == p.elem_count()
            && t.device().same_device(p.device())
    };
    let candle_core::Device::Cuda(dev) = p.device() else { return Ok(false) };
    if !(fits(p.as_tensor()) && fits(g) && fits(m) && fits(v)) {
        return Ok(false);
    }
    // The addresses are taken before the parameter's storage is locked for writing (reading a
    // tensor's storage under that lock would wait on itself, were it the same storage).
    let stream = dev.cuda_stream();
    let op = AdamOp { g: address(g, &stream)?, m: address(m, &stream)?, v: address(v, &stream)?, k };
    p.as_tensor().inplace_op1(&op)?;
    Ok(true)
}

/// The update's operands other than the parameter: device addresses of `n` f32 values each.
struct AdamOp {
    g: u64,
    m: u64,
    v: u64,
    k: [f32; 5],
}

/// The device address of a contiguous f32 CUDA tensor's first element.
fn address(t: &Tensor, stream: &CudaStream) -> candle_core::Result<u64> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(c) = &*s else { candle_core::bail!("adam on CUDA: a tensor off the GPU") };
    let Some((start, _)) = l.contiguous_offsets() else {
        candle_core::bail!("adam on CUDA: a strided tensor")
    };
    let slice = c.as_cuda_slice::<f32>()?;
    let (ptr, _sync) = slice.device_ptr(stream);
    Ok(ptr + (start * std::mem::size_of::<f32>()) as u64)
}

/// Whether any two of the ranges of `len` bytes at `starts` overlap.
fn overlapping(starts: &[u64], len: u64) -> bool {
    let mut s = starts.to_vec();
    s.sort_unstable();
    s.windows(2).any(|w| w[1] < w[0] + len)
}

impl InplaceOp1 for AdamOp {
    fn name(&self) -> &'static str {
        "rltune-adam-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("rltune-adam-cuda: a CUDA op given a CPU tensor")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let Some((p0, p1)) = l.contiguous_offsets() else {
            candle_core::bail!("adam on CUDA: a strided parameter")
        };
        let n = p1 - p0;
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let (g, m, v) = (self.g, self.m, self.v);
        let p = s.as_cuda_slice_mut::<f32>()?;
        let mut p = p.slice_mut(p0..p1);
        // The kernel writes m and v through addresses taken from shared borrows: they must be
        // the optimizer's own memory, apart from the parameter and the gradient. The one stream
        // orders this launch after every earlier use of the four.
        let (at, _sync) = p.device_ptr(&stream);
        if overlapping(&[at, g, m, v], (n * std::mem::size_of::<f32>()) as u64) {
            candle_core::bail!("adam on CUDA: parameter, gradient and moments overlap in memory (a bug)");
        }
        drop(_sync);
        let func = dev.get_or_load_custom_func("rltune_adam_f32", "rltune_adam", ADAM_PTX)?;
        let blocks = (n as u32).div_ceil(THREADS).clamp(1, 132 * 16);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let [step_size, b1, b2, eps, bc2s] = self.k;
        let mut b = func.builder();
        b.arg(&mut p);
        b.arg(&g);
        b.arg(&m);
        b.arg(&v);
        b.arg(&n);
        b.arg(&step_size);
        b.arg(&b1);
        b.arg(&b2);
        b.arg(&eps);
        b.arg(&bc2s);
        // SAFETY: the arguments match `rltune_adam_f32`'s parameters in order and type; every
        // address covers n f32 values (sizes checked by `adam_inplace`).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}
