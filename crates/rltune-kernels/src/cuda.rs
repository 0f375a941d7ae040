//! The CUDA twins of the fused CPU kernels: `.cu` sources in `src/cuda/`, compiled to PTX for
//! compute 9.0 by this crate's build script (`--fmad=false`, IEEE division and square root) and
//! embedded, loaded once per device through candle's `get_or_load_custom_func`. Each twin is
//! checked against its CPU kernel on the device by `rltune selftest --device cuda` (the checks
//! named `kernels/<op>`).
//!
//! | kernel | CPU twin | launches |
//! |---|---|---|
//! | [`adam_inplace`] (`adam.cu`) | `optim::adam_rows` | one per tensor, in place: parameter and both moments in one pass, no allocation (candle's ops: 13 kernels, 13 allocations and a copy) |
//! | layer norm, RMS norm (`norms.cu`) | `norm.rs` | forward 1 (composed: 9); backward 3 (dx and row statistics, per-chunk weight gradients, their sum) |
//! | GELU, tanh form (`gelu.cu`) | `activation.rs` | forward 1; backward 1 (candle's `gelu` backward: about 12) |
//! | SwiGLU, `silu(gate)·up` (`swiglu.cu`), f32 and bf16 | `swiglu.rs` (bf16: the f32 kernel, each value rounded once) | forward 1 (composed: 2, keeping `silu(gate)`); backward 1 for both gradients |
//! | the self-attention core from packed `qkv` rows, GPT-2's or grouped (`attention.cu`) | `attention.rs` | forward 1, one block per query row, keeping the probabilities; backward 2 (the query side with `dS`, then the key side), deterministic, no atomics |
//! | rotary embedding while splitting the heads (`rope.cu`); its bf16 side, f32 in and bf16 heads out, for bf16 attention | `rope.rs` (bf16: the f32 loop, each value rounded once) | forward 1 (composed: a copy, two narrows, six products and sums, a concatenation); backward 1 |
//! | Llama's attention from its three projections: rotation, grouped-query attention, merged heads (`rope.cu`'s pack and unpack, `attention.cu`) | `rope_attention.rs` | forward 2 (pack, then the attention forward with the grouped geometry), keeping the inputs and the probabilities; backward 4 (pack again, the two attention kernels, unpack with the rotation's transpose) |
//! | softmax, log-softmax, the logprob of a target, entropy, attention's scaled masked softmax (`softmax.cu`); the last also on bf16 scores, for bf16 attention | `softmax.rs` (bf16: the f32 kernels between conversions) | 1 per op and per backward, one block per row; the logprob keeps no `(rows, V)` log-softmax (composed: a log-softmax, a gather, and ~10 ops backward) |
//! | [`sums_of_squares`] (`sumsq.cu`) | the gradient norm's f64 sums (`Grads::global_norm`) | one per tensor and one for all, one read back (candle's ops: 4 per tensor) |
//!
//! All take contiguous f32 tensors, and the bf16 sides named above bf16 ones (each value computed
//! in f32 and rounded once); the ops fall back to candle's composed ops for others.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, Layout, Shape, Storage, Tensor, Var,
};

use crate::error::Result;

/// `adam.cu`, as PTX.
const ADAM_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adam.ptx"));
/// `norms.cu`, as PTX.
const NORMS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/norms.ptx"));
/// `sumsq.cu`, as PTX.
const SUMSQ_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sumsq.ptx"));
/// `softmax.cu`, as PTX.
const SOFTMAX_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/softmax.ptx"));
/// `gelu.cu`, as PTX.
const GELU_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gelu.ptx"));
/// `swiglu.cu`, as PTX.
const SWIGLU_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/swiglu.ptx"));
/// `attention.cu`, as PTX.
const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// `rope.cu`, as PTX.
const ROPE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope.ptx"));

type CResult<T> = candle_core::Result<T>;

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
        let cfg = elementwise(n);
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

// ---------------------------------------------------------------------------------------------
// Row-wise and element-wise ops: called from the CPU ops' `cuda_fwd`.

/// The contiguous f32 values a layout views, or an error naming the op.
fn input<'a>(s: &'a CudaStorage, l: &Layout, op: &str) -> CResult<CudaView<'a, f32>> {
    input_as::<f32>(s, l, op)
}

/// [`input`] for values of type `T` (an error naming the op for a storage of another dtype).
fn input_as<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, op: &str) -> CResult<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("{op}: input must be contiguous") };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Rows of length `n` in a layout whose last dimension must be `n`.
fn rows_of(l: &Layout, n: usize, op: &str) -> CResult<usize> {
    let last = l.dims().last().copied().unwrap_or(1);
    if last != n || n == 0 {
        candle_core::bail!("{op}: parameter length {n} differs from the last dimension {last}");
    }
    Ok(l.shape().elem_count() / n)
}

/// A grid of whole blocks of [`THREADS`] over `n` elements (grid-stride kernels), at most 16
/// blocks per multiprocessor of an H100.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = (n as u32).div_ceil(THREADS).clamp(1, 132 * 16);
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.max(1) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Layer norm (`k = 2`, with bias `b`) or RMS norm (`k = 1`) of `x` `(…, n)` with weight `w`.
pub(crate) fn norm_fwd(
    eps: f64,
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
) -> CResult<(CudaStorage, Shape)> {
    let op = if b.is_some() { "layer-norm" } else { "rms-norm" };
    let dev = xs.device().clone();
    let (x, w) = (input(xs, xl, op)?, input(ws, wl, op)?);
    let n = w.len();
    let rows = rows_of(xl, n, op)?;
    // SAFETY: every element is written by the kernel (one block per row, each row in full).
    let mut out = unsafe { dev.alloc::<f32>(rows * n)? };
    if rows > 0 {
        let eps = eps as f32;
        match b {
            Some((bs, bl)) => {
                let b = input(bs, bl, op)?;
                let func = dev.get_or_load_custom_func("rltune_layer_norm_f32", "rltune_norms", NORMS_PTX)?;
                let mut l = func.builder();
                l.arg(&mut out).arg(&x).arg(&w).arg(&b).arg(&rows).arg(&n).arg(&eps);
                // SAFETY: the arguments match the kernel's parameters; sizes checked above.
                unsafe { l.launch(per_row(rows)) }.w()?;
            }
            None => {
                let func = dev.get_or_load_custom_func("rltune_rms_norm_f32", "rltune_norms", NORMS_PTX)?;
                let mut l = func.builder();
                l.arg(&mut out).arg(&x).arg(&w).arg(&rows).arg(&n).arg(&eps);
                // SAFETY: as above.
                unsafe { l.launch(per_row(rows)) }.w()?;
            }
        }
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
}

/// Rows per chunk of the weight gradients' partial sums.
const CHUNK_ROWS: usize = 64;

/// The backward of [`norm_fwd`]: one `(rows + k, n)` tensor, `dx` rows then `dw` (and `db`),
/// as the CPU op returns it.
pub(crate) fn norm_bwd(
    eps: f64,
    k: usize,
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let op = if k == 2 { "layer-norm-bwd" } else { "rms-norm-bwd" };
    let dev: CudaDevice = xs.device().clone();
    let (x, w, g) = (input(xs, xl, op)?, input(ws, wl, op)?, input(gs, gl, op)?);
    let n = w.len();
    let rows = rows_of(xl, n, op)?;
    if g.len() != x.len() {
        candle_core::bail!("{op}: {} gradients for {} inputs", g.len(), x.len());
    }
    let mut out = dev.alloc_zeros::<f32>((rows + k) * n)?;
    if rows > 0 {
        let eps = eps as f32;
        // SAFETY: both scratch buffers are written in full before they are read: stats by the
        // dx kernel (thread 0 of every row), partial by the chunk kernel (every column of
        // every chunk and of each of the k sums).
        let mut stats = unsafe { dev.alloc::<f32>(2 * rows)? };
        let chunks = rows.div_ceil(CHUNK_ROWS);
        let mut partial = unsafe { dev.alloc::<f32>(chunks * k * n)? };
        {
            let name = if k == 2 { "rltune_layer_norm_bwd_dx_f32" } else { "rltune_rms_norm_bwd_dx_f32" };
            let func = dev.get_or_load_custom_func(name, "rltune_norms", NORMS_PTX)?;
            let mut dx = out.slice_mut(0..rows * n);
            let mut l = func.builder();
            l.arg(&mut dx).arg(&mut stats).arg(&x).arg(&w).arg(&g).arg(&rows).arg(&n).arg(&eps);
            // SAFETY: the arguments match the kernel's parameters; sizes checked above.
            unsafe { l.launch(per_row(rows)) }.w()?;
        }
        {
            let func =
                dev.get_or_load_custom_func("rltune_norm_bwd_params_f32", "rltune_norms", NORMS_PTX)?;
            let cfg = LaunchConfig {
                grid_dim: ((n as u32).div_ceil(THREADS), chunks as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let k32 = k as i32;
            let mut l = func.builder();
            l.arg(&mut partial).arg(&stats).arg(&x).arg(&g).arg(&rows).arg(&n).arg(&CHUNK_ROWS).arg(&k32);
            // SAFETY: as above; partial holds chunks × k × n values.
            unsafe { l.launch(cfg) }.w()?;
        }
        {
            let func = dev.get_or_load_custom_func("rltune_sum_chunks_f32", "rltune_norms", NORMS_PTX)?;
            let len = k * n;
            let mut params = out.slice_mut(rows * n..(rows + k) * n);
            let cfg = LaunchConfig {
                grid_dim: ((len as u32).div_ceil(THREADS), 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut l = func.builder();
            l.arg(&mut params).arg(&partial).arg(&chunks).arg(&len);
            // SAFETY: as above; params holds k × n values.
            unsafe { l.launch(cfg) }.w()?;
        }
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), (rows + k, n).into()))
}

/// GELU (tanh form) of `x`.
pub(crate) fn gelu_fwd(xs: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
    let dev = xs.device().clone();
    let x = input(xs, xl, "gelu")?;
    let n = x.len();
    // SAFETY: every element is written (grid-stride loop over n).
    let mut out = unsafe { dev.alloc::<f32>(n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func("rltune_gelu_f32", "rltune_gelu", GELU_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&n);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
}

/// `g · gelu'(x)`.
pub(crate) fn gelu_bwd(
    (xs, xl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let dev = xs.device().clone();
    let (x, g) = (input(xs, xl, "gelu-bwd")?, input(gs, gl, "gelu-bwd")?);
    let n = x.len();
    if g.len() != n {
        candle_core::bail!("gelu-bwd: {} gradients for {n} inputs", g.len());
    }
    // SAFETY: every element is written (grid-stride loop over n).
    let mut out = unsafe { dev.alloc::<f32>(n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func("rltune_gelu_bwd_f32", "rltune_gelu", GELU_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&g).arg(&n);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
}

/// SwiGLU, `silu(gate) · up`, of two tensors of one shape and dtype: f32, or bf16 (computed in
/// f32, each value rounded once; autocast's bf16 activations).
pub(crate) fn swiglu_fwd(
    (gs, gl): (&CudaStorage, &Layout),
    (us, ul): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    match gs.dtype() {
        DType::BF16 => swiglu_fwd_as::<half::bf16>((gs, gl), (us, ul), "rltune_swiglu_bf16"),
        _ => swiglu_fwd_as::<f32>((gs, gl), (us, ul), "rltune_swiglu_f32"),
    }
}

fn swiglu_fwd_as<T: CudaDType + DeviceRepr>(
    (gs, gl): (&CudaStorage, &Layout),
    (us, ul): (&CudaStorage, &Layout),
    kernel: &str,
) -> CResult<(CudaStorage, Shape)> {
    let dev = gs.device().clone();
    let (g, u) = (input_as::<T>(gs, gl, "swiglu")?, input_as::<T>(us, ul, "swiglu")?);
    let n = g.len();
    if u.len() != n {
        candle_core::bail!("swiglu: {} up values for {n} gate values", u.len());
    }
    // SAFETY: every element is written (grid-stride loop over n).
    let mut out = unsafe { dev.alloc::<T>(n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func(kernel, "rltune_swiglu", SWIGLU_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&g).arg(&u).arg(&n);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), gl.shape().clone()))
}

/// SwiGLU's backward: `[d gate; d up]`, stacked along the first dimension (the CPU twin's
/// layout), in the inputs' dtype (f32 or bf16, as [`swiglu_fwd`]).
pub(crate) fn swiglu_bwd(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    match g.0.dtype() {
        DType::BF16 => swiglu_bwd_as::<half::bf16>(g, u, dy, "rltune_swiglu_bwd_bf16"),
        _ => swiglu_bwd_as::<f32>(g, u, dy, "rltune_swiglu_bwd_f32"),
    }
}

fn swiglu_bwd_as<T: CudaDType + DeviceRepr>(
    (gs, gl): (&CudaStorage, &Layout),
    (us, ul): (&CudaStorage, &Layout),
    (ds, dl): (&CudaStorage, &Layout),
    kernel: &str,
) -> CResult<(CudaStorage, Shape)> {
    let dev = gs.device().clone();
    let op = "swiglu-bwd";
    let (g, u, dy) = (input_as::<T>(gs, gl, op)?, input_as::<T>(us, ul, op)?, input_as::<T>(ds, dl, op)?);
    let n = g.len();
    if u.len() != n || dy.len() != n {
        candle_core::bail!("{op}: {n} gate, {} up and {} gradient values", u.len(), dy.len());
    }
    // SAFETY: every element of both halves is written (grid-stride loop over n).
    let mut out = unsafe { dev.alloc::<T>(2 * n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func(kernel, "rltune_swiglu", SWIGLU_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&g).arg(&u).arg(&dy).arg(&n);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n)) }.w()?;
    }
    let mut dims = gl.dims().to_vec();
    if let Some(first) = dims.first_mut() {
        *first *= 2;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), dims.into()))
}

/// The rotary embedding of `x` by `cos`, `sin` `(B, 1, T, D/2)` for `[b, t, h, d]`: forward
/// (`inverse = false`) from `(B, T, H·D)` to `(B, H, T, D)`, or its transpose, the backward,
/// from `(B, H, T, D)` to `(B, T, H·D)` (`crate::rope`, which checks the shapes).
pub(crate) fn rope(
    (xs, xl): (&CudaStorage, &Layout),
    (cs, cl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
    [b, t, h, d]: [usize; 4],
    inverse: bool,
    bf16: bool,
) -> CResult<CudaStorage> {
    match (bf16, inverse) {
        (false, _) => {
            rope_as::<f32, f32>((xs, xl), (cs, cl), (ss, sl), [b, t, h, d], inverse, "rltune_rope_f32")
        }
        (true, false) => rope_as::<f32, half::bf16>(
            (xs, xl),
            (cs, cl),
            (ss, sl),
            [b, t, h, d],
            false,
            "rltune_rope_f32_bf16",
        ),
        (true, true) => rope_as::<half::bf16, f32>(
            (xs, xl),
            (cs, cl),
            (ss, sl),
            [b, t, h, d],
            true,
            "rltune_rope_bf16_f32",
        ),
    }
}

/// [`rope`] reading `I` and writing `O` (f32 throughout, or the bf16 side's f32 → bf16 forward
/// and bf16 → f32 backward), with `kernel`.
fn rope_as<I: CudaDType, O: CudaDType + DeviceRepr>(
    (xs, xl): (&CudaStorage, &Layout),
    (cs, cl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
    [b, t, h, d]: [usize; 4],
    inverse: bool,
    kernel: &str,
) -> CResult<CudaStorage> {
    let dev = xs.device().clone();
    let op = if inverse { "rope backward" } else { "rope" };
    let (x, c, s) = (input_as::<I>(xs, xl, op)?, input(cs, cl, op)?, input(ss, sl, op)?);
    let n = b * t * h * d;
    if x.len() != n || c.len() != b * t * d / 2 || s.len() != c.len() {
        candle_core::bail!(
            "{op}: {} values, {} cos and {} sin for {b}×{t}×{h}×{d}",
            x.len(),
            c.len(),
            s.len()
        );
    }
    // SAFETY: every element is written (each thread writes both halves of its pair).
    let mut out = unsafe { dev.alloc::<O>(n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func(kernel, "rltune_rope", ROPE_PTX)?;
        let mut l = func.builder();
        let inv = i32::from(inverse);
        l.arg(&mut out).arg(&x).arg(&c).arg(&s).arg(&b).arg(&t).arg(&h).arg(&d).arg(&inv);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n / 2)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The longest `D + T` (floats of dynamic shared memory per block, within the default 48 KiB)
/// that [`attention_fwd`] and [`attention_bwd`] take; `crate::attention` uses the composed op
/// beyond it.
pub(crate) const ATTENTION_MAX_ROW: usize = 12 * 1024 - 64;

/// One block of [`THREADS`] per query (or key) row, with `D + T` floats of shared memory.
fn attention_rows(rows: usize, shared: usize) -> CResult<LaunchConfig> {
    if shared > ATTENTION_MAX_ROW {
        candle_core::bail!(
            "self-attention: a head of {shared} (D + T) values is past the CUDA kernel's {ATTENTION_MAX_ROW}"
        );
    }
    Ok(LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (shared * std::mem::size_of::<f32>()) as u32,
    })
}

/// The f32 values of shared memory a block may use without opting in (48 KiB).
const SHARED_FLOATS: usize = 48 * 1024 / 4;
/// attention.cu's `RLTUNE_ATT_TK` (the keys or values of one shared tile) and `RLTUNE_ATT_ACC`
/// (outputs per thread), and the tallest tile it is given.
const ATT_TILE_KEYS: usize = 32;
const ATT_OUTPUTS_PER_THREAD: usize = 16;
const ATT_MAX_TILE: usize = 32;
/// Blocks a tiled attention launch aims for at least (about two per SM of an H100 or H200, 132
/// SMs): where the rows are few (the `gpt2` preset's 4 × 12 heads of 32 tokens), lower tiles
/// keep the GPU busy rather than a few blocks doing all the work.
const ATT_MIN_BLOCKS: usize = 256;

/// The query rows per block of the tiled forward and query-side backward for `rows` query rows
/// (all heads of all sequences) of heads of `d` and sequences of `t`, and the block's shared
/// memory in bytes; `None` where not even one row's tiles fit (the per-row kernels then).
fn attention_query_tile(rows: usize, d: usize, t: usize) -> Option<(usize, u32)> {
    let ld = d + 1;
    let room = SHARED_FLOATS.checked_sub(ATT_TILE_KEYS * ld)?;
    let tq = ATT_MAX_TILE
        .min(ATT_OUTPUTS_PER_THREAD * THREADS as usize / d)
        .min(room / (ld + t))
        .min(rows.div_ceil(ATT_MIN_BLOCKS).max(1));
    let floats = tq * ld + ATT_TILE_KEYS * ld + tq * t;
    (tq > 0).then(|| (tq, (floats * std::mem::size_of::<f32>()) as u32))
}

/// The key rows per block of the tiled key-side backward for `key_rows` key rows (all key heads
/// of all sequences), the query rows of its tiles, and its shared memory in bytes, for heads of
/// `d` (`None` past any tile: the per-row kernel then).
fn attention_key_tile(key_rows: usize, d: usize) -> Option<(usize, usize, u32)> {
    let tj = ATT_MAX_TILE
        .min(ATT_OUTPUTS_PER_THREAD * THREADS as usize / d)
        .min(key_rows.div_ceil(ATT_MIN_BLOCKS).max(1));
    let ti = ATT_MAX_TILE.min(SHARED_FLOATS / (2 * (d + 1) + 2 * (tj + 1)));
    let floats = 2 * ti * (d + 1) + 2 * ti * (tj + 1);
    (tj > 0 && ti > 0).then(|| (tj, ti, (floats * std::mem::size_of::<f32>()) as u32))
}

/// The launch of a tiled attention kernel: `blocks` of [`THREADS`].
fn tiled(blocks: usize, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes }
}

/// The self-attention core (`crate::attention`, which checks the shapes): `y (B, T, C)` and the
/// probabilities `P (B, H, T, T)` from the packed rows `qkv (B, T, W)` (`W = C + 2·KV·C/H`: `H`
/// query heads, `KV` key heads, `KV` value heads; GPT-2's `qkv` has `KV = H`) and `bias`
/// (`[bB, bH, bT]` rows of `T`, each 1 or the full size), for `[b, t, c, h, kv]`.
pub(crate) fn attention_fwd(
    (qs, ql): (&CudaStorage, &Layout),
    (bs, bl): (&CudaStorage, &Layout),
    [b, t, c, h, kv]: [usize; 5],
    [bb, bh, bt]: [usize; 3],
    scale: f32,
) -> CResult<(CudaStorage, CudaStorage)> {
    let dev = qs.device().clone();
    let (x, bias) = (input(qs, ql, "self-attention")?, input(bs, bl, "self-attention")?);
    let w = packed_width([c, h, kv], "self-attention")?;
    if x.len() != b * t * w || bias.len() != bb * bh * bt * t {
        candle_core::bail!("self-attention: {} qkv and {} bias values for {b}×{t}×{w}", x.len(), bias.len());
    }
    let rows = b * h * t;
    if rows == 0 || c == 0 {
        return Ok((
            CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(b * t * c)?, dev.clone()),
            CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(rows * t)?, dev),
        ));
    }
    // Tiles of `tq` query rows sharing each tile of keys and values, or one block per row.
    let tile = attention_query_tile(rows, c / h, t);
    let (name, cfg) = match tile {
        Some((tq, shared)) => ("rltune_attention_tiled_f32", tiled(b * h * t.div_ceil(tq), shared)),
        None => ("rltune_attention_f32", attention_rows(rows, c / h + t)?),
    };
    // SAFETY: every row's output head and probabilities are written by its block.
    let (mut y, mut p) = unsafe { (dev.alloc::<f32>(b * t * c)?, dev.alloc::<f32>(rows * t)?) };
    let func = dev.get_or_load_custom_func(name, "rltune_attention", ATTENTION_PTX)?;
    let mut l = func.builder();
    l.arg(&mut y).arg(&mut p).arg(&x).arg(&bias);
    l.arg(&b).arg(&t).arg(&c).arg(&h).arg(&kv).arg(&bb).arg(&bh).arg(&bt).arg(&scale);
    if let Some((tq, _)) = &tile {
        l.arg(tq);
    }
    // SAFETY: the arguments match the kernel's parameters.
    unsafe { l.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), CudaStorage::wrap_cuda_slice(p, dev)))
}

/// The packed row's width `C + 2·KV·D` for `[c, h, kv]`, or `op`'s error when the heads do not
/// split evenly.
fn packed_width([c, h, kv]: [usize; 3], op: &str) -> CResult<usize> {
    if h == 0 || kv == 0 || !h.is_multiple_of(kv) || !c.is_multiple_of(h) {
        candle_core::bail!("{op}: {c} query values in {h} heads with {kv} key heads do not split evenly");
    }
    Ok(c + 2 * kv * (c / h))
}

/// `dqkv (B, T, W)` of [`attention_fwd`] for the upstream gradient `g (B, T, C)`, from the
/// probabilities `p` it kept.
pub(crate) fn attention_bwd(
    (qs, ql): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
    p: &CudaStorage,
    [b, t, c, h, kv]: [usize; 5],
    scale: f32,
) -> CResult<CudaStorage> {
    let dev = qs.device().clone();
    let op = "self-attention backward";
    let (x, g) = (input(qs, ql, op)?, input(gs, gl, op)?);
    let w = packed_width([c, h, kv], op)?;
    let rows = b * h * t;
    let p = p.as_cuda_slice::<f32>()?.slice(0..);
    if x.len() != b * t * w || g.len() != b * t * c || p.len() != rows * t {
        candle_core::bail!(
            "{op}: {} qkv, {} gradient and {} probability values for {b}×{t}×{w}",
            x.len(),
            g.len(),
            p.len()
        );
    }
    if rows == 0 || c == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(b * t * w)?, dev));
    }
    let d = c / h;
    let q_tile = attention_query_tile(rows, d, t);
    let (q_name, cfg) = match q_tile {
        Some((tq, shared)) => ("rltune_attention_tiled_bwd_q_f32", tiled(b * h * t.div_ceil(tq), shared)),
        None => ("rltune_attention_bwd_q_f32", attention_rows(rows, d + t)?),
    };
    // SAFETY: the query side writes every dq and every row of dS, the key side every dk and dv.
    let (mut dqkv, mut ds) = unsafe { (dev.alloc::<f32>(b * t * w)?, dev.alloc::<f32>(rows * t)?) };
    let q_side = dev.get_or_load_custom_func(q_name, "rltune_attention", ATTENTION_PTX)?;
    let mut l = q_side.builder();
    l.arg(&mut dqkv)
        .arg(&mut ds)
        .arg(&g)
        .arg(&p)
        .arg(&x)
        .arg(&b)
        .arg(&t)
        .arg(&c)
        .arg(&h)
        .arg(&kv)
        .arg(&scale);
    if let Some((tq, _)) = &q_tile {
        l.arg(tq);
    }
    // SAFETY: the arguments match the kernel's parameters.
    unsafe { l.launch(cfg) }.w()?;
    // The key side. With grouped query heads (Qwen2: 7 per key head), split per query head:
    // one block per query head's tile of keys writes its share into `part`, and a sum adds each
    // key head's shares (the grouped kernel's `b·kv` heads of blocks left most of the GPU idle).
    // Otherwise tiles of `tj` key rows reading tiles of `ti` query rows, or one block per key row
    // of each key head with one thread per column of a head.
    let split = if h > kv { attention_key_tile(b * h * t, d) } else { None };
    let key_tile = split.or_else(|| attention_key_tile(b * kv * t, d));
    let (kv_name, cfg) = match (split, key_tile) {
        (Some((tj, _, shared)), _) => {
            ("rltune_attention_tiled_bwd_kv_part_f32", tiled(b * h * t.div_ceil(tj), shared))
        }
        (None, Some((tj, _, shared))) => {
            ("rltune_attention_tiled_bwd_kv_f32", tiled(b * kv * t.div_ceil(tj), shared))
        }
        (None, None) => {
            let threads = (d.div_ceil(32) * 32).min(THREADS as usize) as u32;
            let key_rows = (b * kv * t) as u32;
            let cfg =
                LaunchConfig { grid_dim: (key_rows, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
            ("rltune_attention_bwd_kv_f32", cfg)
        }
    };
    // SAFETY: the share kernel writes every (head, key row, column) of `part` (its blocks cover
    // every head and key tile), and the sum every key and value column of dqkv from it.
    let mut part = match split {
        Some(_) => Some(unsafe { dev.alloc::<f32>(b * h * t * 2 * d)? }),
        None => None,
    };
    let kv_side = dev.get_or_load_custom_func(kv_name, "rltune_attention", ATTENTION_PTX)?;
    let mut l = kv_side.builder();
    match &mut part {
        Some(part) => l.arg(part),
        None => l.arg(&mut dqkv),
    };
    l.arg(&ds).arg(&g).arg(&p).arg(&x).arg(&b).arg(&t).arg(&c).arg(&h).arg(&kv);
    if let Some((tj, ti, _)) = &key_tile {
        l.arg(tj).arg(ti);
    }
    // SAFETY: the arguments match the kernel's parameters.
    unsafe { l.launch(cfg) }.w()?;
    if let Some(part) = &part {
        let sum =
            dev.get_or_load_custom_func("rltune_attention_kv_sum_f32", "rltune_attention", ATTENTION_PTX)?;
        let mut l = sum.builder();
        l.arg(&mut dqkv).arg(part).arg(&b).arg(&t).arg(&c).arg(&h).arg(&kv);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(b * t * kv * 2 * d)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dqkv, dev))
}

/// Llama's attention operands packed for [`attention_fwd`] (`crate::rope_attention`, which
/// checks the shapes): `q (B, T, H·D)`, `k`, `v (B, T, KV·D)` and `cos`, `sin (B, 1, T, D/2)`
/// → `(B, T, W)` rows of the rotated query heads, the rotated key heads and the values, for
/// `[b, t, h, kv, d]`.
pub(crate) fn rope_pack(
    [q, k, v]: [(&CudaStorage, &Layout); 3],
    [cos, sin]: [(&CudaStorage, &Layout); 2],
    [b, t, h, kv, d]: [usize; 5],
) -> CResult<CudaStorage> {
    let op = "rope attention";
    let dev = q.0.device().clone();
    let (qv, kv_, vv) = (input(q.0, q.1, op)?, input(k.0, k.1, op)?, input(v.0, v.1, op)?);
    let (cv, sv) = (input(cos.0, cos.1, op)?, input(sin.0, sin.1, op)?);
    let (c, ckv) = (h * d, kv * d);
    let n = b * t * (c + 2 * ckv);
    if qv.len() != b * t * c || kv_.len() != b * t * ckv || vv.len() != kv_.len() || cv.len() != b * t * d / 2
    {
        candle_core::bail!("{op}: the operands do not hold {b}×{t} rows of {h} and {kv} heads of {d}");
    }
    if sv.len() != cv.len() {
        candle_core::bail!("{op}: {} sin values for {} cos values", sv.len(), cv.len());
    }
    // SAFETY: every value is written (grid-stride loop over n).
    let mut out = unsafe { dev.alloc::<f32>(n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func("rltune_rope_pack_f32", "rltune_rope", ROPE_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&qv).arg(&kv_).arg(&vv).arg(&cv).arg(&sv);
        l.arg(&b).arg(&t).arg(&h).arg(&kv).arg(&d);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The backward of [`rope_pack`]: the packed rows' gradient `(B, T, W)` → one buffer `[dq | dk
/// | dv]` of `B·T·H·D`, `B·T·KV·D` and `B·T·KV·D` values.
pub(crate) fn rope_unpack(
    (rs, rl): (&CudaStorage, &Layout),
    [cos, sin]: [(&CudaStorage, &Layout); 2],
    [b, t, h, kv, d]: [usize; 5],
) -> CResult<CudaStorage> {
    let op = "rope attention backward";
    let dev = rs.device().clone();
    let (rows, cv, sv) = (input(rs, rl, op)?, input(cos.0, cos.1, op)?, input(sin.0, sin.1, op)?);
    let n = b * t * (h + 2 * kv) * d;
    if rows.len() != n || cv.len() != b * t * d / 2 || sv.len() != cv.len() {
        candle_core::bail!("{op}: the operands do not hold {b}×{t} rows of {h} and {kv} heads of {d}");
    }
    // SAFETY: every value is written once (grid-stride loop over n, one output per input).
    let mut out = unsafe { dev.alloc::<f32>(n)? };
    if n > 0 {
        let func = dev.get_or_load_custom_func("rltune_rope_unpack_f32", "rltune_rope", ROPE_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&rows).arg(&cv).arg(&sv).arg(&b).arg(&t).arg(&h).arg(&kv).arg(&d);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(elementwise(n)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Blocks per tensor of [`sums_of_squares`]: about 8 values a thread, at most two waves of an
/// H100's 132 multiprocessors.
fn sumsq_blocks(n: usize) -> usize {
    n.div_ceil(THREADS as usize * 8).clamp(1, 264)
}

/// The sum of squares of each tensor's values, in f64, read back in one transfer: for the
/// global gradient norm. `None` (nothing launched) unless every tensor is a contiguous f32
/// tensor on one CUDA device. Deterministic: each tensor is split among a fixed number of
/// blocks and their partial sums are added in order.
pub fn sums_of_squares(ts: &[Tensor]) -> Result<Option<Vec<f64>>> {
    let Some(first) = ts.first() else { return Ok(Some(Vec::new())) };
    let candle_core::Device::Cuda(dev) = first.device() else { return Ok(None) };
    if !ts
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.is_contiguous() && t.device().same_device(first.device()))
    {
        return Ok(None);
    }
    let mut offsets = vec![0u64];
    for t in ts {
        offsets.push(offsets[offsets.len() - 1] + sumsq_blocks(t.elem_count()) as u64);
    }
    let total = offsets[ts.len()] as usize;
    // SAFETY: every slot is written: each tensor's kernel runs exactly its share of blocks,
    // and each block writes its slot (zero for an empty tensor).
    let mut partial = unsafe { dev.alloc::<f64>(total)? };
    let func = dev.get_or_load_custom_func("rltune_sumsq_partial_f32", "rltune_sumsq", SUMSQ_PTX)?;
    for (i, t) in ts.iter().enumerate() {
        let (s, l) = t.storage_and_layout();
        let Storage::Cuda(c) = &*s else { return Ok(None) };
        let g = input(c, l, "sum of squares")?;
        let n = g.len();
        let (a, b) = (offsets[i] as usize, offsets[i + 1] as usize);
        let mut slots = partial.slice_mut(a..b);
        let cfg = LaunchConfig {
            grid_dim: ((b - a) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch.arg(&mut slots).arg(&g).arg(&n);
        // SAFETY: the arguments match the kernel's parameters; one slot per block.
        unsafe { launch.launch(cfg) }.w()?;
    }
    let stream = dev.cuda_stream();
    let offsets_dev = stream.clone_htod(&offsets).w()?;
    // SAFETY: one thread per tensor writes its sum.
    let mut out = unsafe { dev.alloc::<f64>(ts.len())? };
    let finish = dev.get_or_load_custom_func("rltune_sumsq_finish", "rltune_sumsq", SUMSQ_PTX)?;
    let len = ts.len();
    let cfg = LaunchConfig {
        grid_dim: ((len as u32).div_ceil(THREADS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = finish.builder();
    launch.arg(&mut out).arg(&partial).arg(&offsets_dev).arg(&len);
    // SAFETY: the arguments match the kernel's parameters.
    unsafe { launch.launch(cfg) }.w()?;
    Ok(Some(stream.clone_dtoh(&out).w()?))
}

// ---------------------------------------------------------------------------------------------
// The softmax family (`softmax.cu`), one block per row of the last dimension.

/// `(rows, n)` of a layout over its last dimension.
fn rows_n(l: &Layout) -> (usize, usize) {
    let n = l.dims().last().copied().unwrap_or(1);
    (if n == 0 { 0 } else { l.shape().elem_count() / n }, n)
}

/// Target ids: contiguous u32 values (the op falls back to candle's ops for other dtypes).
fn targets<'a>(s: &'a CudaStorage, l: &Layout, rows: usize) -> CResult<CudaView<'a, u32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("logprobs-of: targets must be contiguous")
    };
    if b - a != rows {
        candle_core::bail!("logprobs-of: {} targets for {rows} rows", b - a);
    }
    Ok(s.as_cuda_slice::<u32>()?.slice(a..b))
}

/// `x[r, t_r] − logsumexp(x[r])`, shaped as the targets; NaN where a target is not below V.
pub(crate) fn logprobs_of_fwd(
    (xs, xl): (&CudaStorage, &Layout),
    (ts, tl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let dev = xs.device().clone();
    let x = input(xs, xl, "logprobs-of")?;
    let (rows, n) = rows_n(xl);
    let t = targets(ts, tl, rows)?;
    // SAFETY: thread 0 of each row's block writes its value.
    let mut out = unsafe { dev.alloc::<f32>(rows)? };
    if rows > 0 {
        let func = dev.get_or_load_custom_func("rltune_logprobs_of_f32", "rltune_softmax", SOFTMAX_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&t).arg(&rows).arg(&n);
        // SAFETY: the arguments match the kernel's parameters; sizes checked above.
        unsafe { l.launch(per_row(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), tl.shape().clone()))
}

/// `g[r] · (onehot(t_r) − softmax(x[r]))`, shaped as `x`.
pub(crate) fn logprobs_of_bwd(
    (xs, xl): (&CudaStorage, &Layout),
    (ts, tl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    let dev = xs.device().clone();
    let (x, g) = (input(xs, xl, "logprobs-of-bwd")?, input(gs, gl, "logprobs-of-bwd")?);
    let (rows, n) = rows_n(xl);
    let t = targets(ts, tl, rows)?;
    if g.len() != rows {
        candle_core::bail!("logprobs-of-bwd: {} gradients for {rows} rows", g.len());
    }
    // SAFETY: every element of every row is written.
    let mut out = unsafe { dev.alloc::<f32>(rows * n)? };
    if rows > 0 {
        let func =
            dev.get_or_load_custom_func("rltune_logprobs_of_bwd_f32", "rltune_softmax", SOFTMAX_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&t).arg(&g).arg(&rows).arg(&n);
        // SAFETY: as above.
        unsafe { l.launch(per_row(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
}

/// The entropy of each row's softmax, shaped as `x` without its last dimension.
pub(crate) fn entropy_fwd(xs: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
    let dev = xs.device().clone();
    let x = input(xs, xl, "entropy")?;
    let (rows, n) = rows_n(xl);
    // SAFETY: thread 0 of each row's block writes its value.
    let mut out = unsafe { dev.alloc::<f32>(rows)? };
    if rows > 0 {
        let func = dev.get_or_load_custom_func("rltune_entropy_f32", "rltune_softmax", SOFTMAX_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&rows).arg(&n);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(per_row(rows)) }.w()?;
    }
    let dims = xl.dims();
    Ok((CudaStorage::wrap_cuda_slice(out, dev), dims[..dims.len().saturating_sub(1)].to_vec().into()))
}

/// Softmax (`log = false`) or log-softmax of each row.
pub(crate) fn softmax_fwd(log: bool, xs: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
    let op = if log { "log-softmax" } else { "softmax" };
    let dev = xs.device().clone();
    let x = input(xs, xl, op)?;
    let (rows, n) = rows_n(xl);
    // SAFETY: every element of every row is written.
    let mut out = unsafe { dev.alloc::<f32>(rows * n)? };
    if rows > 0 {
        let name = if log { "rltune_log_softmax_f32" } else { "rltune_softmax_f32" };
        let func = dev.get_or_load_custom_func(name, "rltune_softmax", SOFTMAX_PTX)?;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&rows).arg(&n);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(per_row(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
}

/// `softmax(x · scale + bias)` of `(B, H, T, S)` attention scores, the bias `(bB, bH, bT, S)`
/// broadcast (`crate::softmax::scaled_masked_softmax`, which checks the shapes). Its backward is
/// [`softmax_bwd`] with the scale.
pub(crate) fn scaled_masked_softmax_fwd(
    scale: f64,
    (xs, xl): (&CudaStorage, &Layout),
    (bs, bl): (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    match xs.dtype() {
        DType::BF16 => scaled_masked_softmax_as::<half::bf16>(
            scale,
            (xs, xl),
            (bs, bl),
            "rltune_scaled_masked_softmax_bf16",
        ),
        _ => scaled_masked_softmax_as::<f32>(scale, (xs, xl), (bs, bl), "rltune_scaled_masked_softmax_f32"),
    }
}

/// [`scaled_masked_softmax_fwd`] for scores and probabilities of type `T` (the bias is f32).
fn scaled_masked_softmax_as<T: CudaDType + DeviceRepr>(
    scale: f64,
    (xs, xl): (&CudaStorage, &Layout),
    (bs, bl): (&CudaStorage, &Layout),
    kernel: &str,
) -> CResult<(CudaStorage, Shape)> {
    let op = "scaled-masked-softmax";
    let dev = xs.device().clone();
    let (x, bias) = (input_as::<T>(xs, xl, op)?, input(bs, bl, op)?);
    let ([b, h, t, n], [bb, bh, bt, bn]) = match (xl.dims(), bl.dims()) {
        (&[a, b, c, d], &[e, f, g, k]) => ([a, b, c, d], [e, f, g, k]),
        _ => candle_core::bail!("{op}: scores and bias must be 4-D"),
    };
    if bn != n || x.len() != b * h * t * n || bias.len() != bb * bh * bt * n {
        candle_core::bail!("{op}: bias {:?} does not broadcast to {:?}", bl.dims(), xl.dims());
    }
    let rows = b * h * t;
    // SAFETY: every element of every row is written.
    let mut out = unsafe { dev.alloc::<T>(rows * n)? };
    if rows > 0 && n > 0 {
        let func = dev.get_or_load_custom_func(kernel, "rltune_softmax", SOFTMAX_PTX)?;
        let scale = scale as f32;
        let mut l = func.builder();
        l.arg(&mut out).arg(&x).arg(&bias).arg(&rows).arg(&n).arg(&h).arg(&t).arg(&bb).arg(&bh).arg(&bt);
        l.arg(&scale);
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(per_row(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
}

/// The backward of [`softmax_fwd`] from its output `y` and upstream `g`: softmax's scaled by
/// `scale` (`Some`; f32, or bf16 for bf16 attention, each value computed in f32 and rounded
/// once), or log-softmax's (`None`, f32).
pub(crate) fn softmax_bwd(
    scale: Option<f64>,
    y: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Shape)> {
    match (y.0.dtype(), scale) {
        (DType::BF16, Some(_)) => softmax_bwd_as::<half::bf16>(scale, y, g, "rltune_softmax_bwd_bf16"),
        (_, Some(_)) => softmax_bwd_as::<f32>(scale, y, g, "rltune_softmax_bwd_f32"),
        (_, None) => softmax_bwd_as::<f32>(None, y, g, "rltune_log_softmax_bwd_f32"),
    }
}

/// [`softmax_bwd`] for values of type `T` with `kernel`, which takes `scale` as its last
/// argument when there is one.
fn softmax_bwd_as<T: CudaDType + DeviceRepr>(
    scale: Option<f64>,
    (ys, yl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
    kernel: &str,
) -> CResult<(CudaStorage, Shape)> {
    let op = if scale.is_some() { "softmax-bwd" } else { "log-softmax-bwd" };
    let dev = ys.device().clone();
    let (y, g) = (input_as::<T>(ys, yl, op)?, input_as::<T>(gs, gl, op)?);
    let (rows, n) = rows_n(yl);
    if g.len() != y.len() {
        candle_core::bail!("{op}: {} gradients for {} outputs", g.len(), y.len());
    }
    // SAFETY: every element of every row is written.
    let mut out = unsafe { dev.alloc::<T>(rows * n)? };
    if rows > 0 {
        let func = dev.get_or_load_custom_func(kernel, "rltune_softmax", SOFTMAX_PTX)?;
        let scale = scale.map(|s| s as f32);
        let mut l = func.builder();
        l.arg(&mut out).arg(&y).arg(&g).arg(&rows).arg(&n);
        if let Some(scale) = &scale {
            l.arg(scale);
        }
        // SAFETY: the arguments match the kernel's parameters.
        unsafe { l.launch(per_row(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), yl.shape().clone()))
}
