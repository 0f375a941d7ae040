//! rltune's kernels: differentiable building blocks with hand-written backward passes, the
//! SGEMM under them, the CPU process settings they run under ([`cpu`]), and the gradient buffers
//! with their fused Adam update ([`optim`]).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//!
//! # fn main() -> candle_core::Result<()> {
//! let logits = Var::from_vec(vec![1f32, 2.0, 3.0, 0.5, 0.5, 0.5], (1, 2, 3), &Device::Cpu)?;
//! let targets = Tensor::from_vec(vec![2u32, 0], (1, 2), &Device::Cpu)?;
//! // log p(target) per position, without materializing the log-softmax for the backward.
//! let lp = rltune_kernels::logprobs_of(logits.as_tensor(), &targets)?;
//! let grads = lp.sum_all()?.backward()?;
//! assert!(grads.get(logits.as_tensor()).is_some()); // candle's fused ops would drop it
//! # Ok(()) }
//! ```
//!
//! This crate knows nothing of models, tokenizers or training: the `rltune` crate builds them on
//! it (as `rltune::ops`).
//!
//! # The ops
//!
//! candle's own fused kernels (`softmax_last_dim`, `layer_norm`, `rms_norm`) build no backward
//! graph: `backward()` succeeds and the gradients behind them are silently missing. The composed
//! versions are differentiable but slow: softmax backward costs 14× its forward, layer norm 16×,
//! candle's GELU backward is a dozen element-wise ops with `powf`, and every composed op adds a
//! zero-filled gradient buffer and an add to the backward pass. The ops here are candle custom
//! ops: a fused CPU forward and a fused CPU backward, in f32 and f64. On other devices they fall
//! back to composed, differentiable candle ops, so the same model code runs on CUDA.
//!
//! | op | replaces |
//! |---|---|
//! | [`softmax_last_dim`], [`log_softmax_last_dim`] | max, sub, exp, sum, div / log |
//! | [`scaled_masked_softmax`] | attention's `scores · scale + bias` then softmax |
//! | [`self_attention`] | GPT-2's split of `qkv` into heads, `q·kᵀ`, masked softmax, `·v`, merge of the heads (no `(B, H, T, D)` copies in the graph) |
//! | [`cached_self_attention`] | the same in generation, with the KV cache appended in place (no `Tensor::cat` of the cache per step; no gradient) |
//! | [`cached_attention`] | [`cached_self_attention`] with grouped-query attention (Llama, Qwen2, Mistral): key/value heads shared, not repeated |
//! | [`logprobs_of`] | log-softmax over the vocabulary, then gather (no `(B, T, V)` log-softmax kept) |
//! | [`entropy_from_logits`] | log-softmax, exp, mul, sum (one pass per row) |
//! | [`lm_head_logprobs`] | the LM head's product, then logprobs and entropy, on selected rows only (no `(N, V)` tensor in the graph) |
//! | [`rope_attention`] | Llama's attention from its projections: [`rope_heads`] on queries and keys, `repeat_kv`, a transposed copy of the keys, `q·kᵀ`, masked softmax, `·v`, merge of the heads (keeps its three inputs and the probabilities; about 870 MiB less in a SmolLM2-135M GRPO step) |
//! | [`rope_heads`] | Llama's head split and rotary embedding: a contiguous copy, two narrows, four products, a difference, a sum and a concatenation (about four input-sized tensors kept for the backward) |
//! | [`swiglu`] | Llama's `silu(gate) * up` (three `(rows, inner)` tensors kept for the backward instead of two) |
//! | [`gelu_tanh`] | candle's `gelu` (its backward: ~12 ops with `powf` and `tanh`) |
//! | [`layer_norm`], [`rms_norm`] | mean, sub, sqr, mean, add, sqrt, div, mul, add |
//! | [`embedding()`] | `index_select` (its backward: a table-sized zero fill and add, twice) |
//! | [`linear()`], [`linear_in_out`], [`matmul`] | candle's matmul (AVX2 only), broadcast add of the bias, `contiguous()` copies of transposed operands in the backward |
//! | [`linear_lora`], [`linear_in_out_lora`] | a LoRA layer's `x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ` from five ops (three `(rows, out)` tensors kept for the backward) |
//! | [`block::gpt2_block`] (used by the GPT-2 model) | the ten graph nodes of a GPT-2 block, when every trained weight has a gradient sink |
//! | [`checkpoint`] | a block's saved activations: the backward runs the block again from its input (torch's `checkpoint`) |
//!
//! f32 kernels use a vectorizable `exp` (within 2 ulp of libm's) and are compiled three times,
//! for baseline x86-64, AVX2 + FMA and AVX-512, the widest the CPU has running.
//!
//! Matrix products run on rltune's SGEMM (`ops::gemm`: a 14 × 32 AVX-512 or a 6 × 16 AVX2 + FMA
//! microkernel, whichever the CPU has; AMX tiles under [`MatmulPrecision::Bf16`]), else (f64,
//! CPUs with neither) on candle's.
//!
//! The ops that take weights have a `_with` form taking a [`GradSlot`], their store's: where a
//! [`Grads`] has bound the slot ([`Grads::bind`]), the backward writes the weights' gradients into
//! its persistent buffers instead of candle's gradient store (see `ops::grad_sink`).
//!
//! Every op has a test against its composed twin (values and gradients) and a finite-difference
//! gradient check in f64.

/// Runs the typed f32/f64 body of a CPU op, `f::<T>(args)` or `recv.f::<T>(args)`, or names the
/// unsupported dtype of `s`.
macro_rules! by_dtype {
    ($s:expr, $op:literal, $($f:ident).+($($arg:expr),* $(,)?)) => {
        match $s.dtype() {
            candle_core::DType::F32 => $($f).+::<f32>($($arg),*),
            candle_core::DType::F64 => $($f).+::<f64>($($arg),*),
            dt => Err($crate::unsupported($op, dt)),
        }
    };
}

mod activation;
mod amx;
mod attention;
pub mod block;
mod checkpoint;
mod embedding;
pub mod gemm;
mod grad_sink;
mod linear;
mod lm_head;
mod norm;
mod rope;
mod rope_attention;
pub(crate) mod simd;
mod softmax;
mod swiglu;
pub use softmax::exp_row_f32;

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
mod mask;
pub mod optim;

pub use checkpoint::{checkpoint, checkpoint_recomputations, Segment};
pub use error::{Error, Result};
pub use grad_sink::GradSlot;
pub use mask::{causal_bias, padding_bias, MASK_MIN};
pub use optim::{Adam, AdamConfig, Grads};

pub use activation::{gelu_tanh, gelu_tanh_composed};
pub use attention::{
    cached_attention, cached_attention_takes, cached_self_attention, self_attention, self_attention_composed,
    KvBlock,
};
pub use embedding::{embedding, embedding_with};
pub use gemm::{
    check_matmul_precision, device_matmul_precision, matmul_precision, set_device_matmul_precision,
    set_matmul_precision, MatmulPrecision,
};
pub use linear::{
    autocast_composed_scope, bf16_activations, bf16_attention, set_bf16_activations, set_bf16_attention,
    AutocastComposedScope,
};
pub use linear::{
    linear, linear_composed, linear_in_out, linear_in_out_composed, linear_in_out_lora, linear_in_out_with,
    linear_lora, linear_with, matmul, matmul_weight_t, weight_cast_scope, WeightCastScope,
};
pub use lm_head::{lm_head_logprobs, lm_head_logprobs_with};
pub use norm::{
    layer_norm, layer_norm_composed, layer_norm_with, rms_norm, rms_norm_composed, rms_norm_with,
};
pub use rope::{rope_heads, rope_heads_bf16, rope_heads_composed};
pub use rope_attention::{
    rope_attention, rope_attention_bf16, rope_attention_composed, rope_attention_takes,
};
pub use softmax::{
    entropy_from_logits, entropy_from_logits_composed, log_softmax_composed, log_softmax_last_dim,
    logprobs_of, logprobs_of_composed, scaled_masked_softmax, scaled_masked_softmax_composed,
    softmax_composed, softmax_last_dim,
};
pub use swiglu::{swiglu, swiglu_composed};

use candle_core::{CpuStorage, DType, Layout, Tensor};
use num_traits::Float;
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// The element types the fused ops run on (f32 and f64).
trait Elem:
    Float
    + candle_core::WithDType
    + Send
    + Sync
    + std::ops::AddAssign
    + std::ops::MulAssign
    + std::ops::DivAssign
    + 'static
{
    /// `e^x`: the vectorizable [`simd::exp_f32`] for f32, libm for f64.
    fn exp_fast(self) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        simd::exp_f32(self)
    }
}

impl Elem for f64 {
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }
}

/// A poisoned lock's value (the ops keep only buffers behind their locks).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `n` zeros, written by the thread pool: an op's output buffer of activation size is then
/// filled on every core, not by a serial `memset` on the calling thread while the workers wait.
/// Kernels that write every value still start from it: a `Vec<f32>` over uninitialized memory
/// is undefined behaviour in Rust even when nothing reads a value before it is written.
fn zeros_par<T: Elem>(n: usize) -> Vec<T> {
    if n < 1 << 15 {
        return vec![T::zero(); n];
    }
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(T::zero(), n));
    v
}

/// `a + b` element-wise, in parallel for activation-sized slices (candle's add runs on the
/// calling thread while the matmul workers wait); collected straight into the output.
fn add_par(a: &[f32], b: &[f32]) -> Vec<f32> {
    const CHUNK: usize = 1 << 14;
    if a.len().min(b.len()) >= 2 * CHUNK {
        a.par_iter().zip(b).with_min_len(CHUNK).map(|(&a, &b)| a + b).collect()
    } else {
        a.iter().zip(b).map(|(&a, &b)| a + b).collect()
    }
}

/// Runs `f` on the values of a contiguous f32 CPU tensor, read in place; `what` names the
/// caller in the error for any other tensor.
pub fn with_f32<R>(t: &Tensor, what: &str, f: impl FnOnce(&[f32]) -> R) -> CResult<R> {
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(f(&v[a..b])),
        _ => candle_core::bail!("{what}: expected a contiguous f32 CPU tensor"),
    }
}

thread_local! {
    static COMPOSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, every op of this module called on this thread takes its composed candle path
/// (the one CUDA tensors take), and new [`Grads`] / [`Adam`] use no
/// gradient buffers and keep their moments as tensors: the GPU's code path, run on the CPU.
/// For tests that compare it with the fused CPU kernels (issue #30); see [`composed_scope`].
#[doc(hidden)]
pub struct ComposedScope(bool);

impl Drop for ComposedScope {
    fn drop(&mut self) {
        COMPOSED.with(|c| c.set(self.0));
    }
}

/// Starts a [`ComposedScope`] on this thread.
#[doc(hidden)]
pub fn composed_scope() -> ComposedScope {
    ComposedScope(COMPOSED.with(|c| c.replace(true)))
}

/// Whether tensors on `device` run the fused CPU kernels: the CPU, outside a [`ComposedScope`].
pub fn cpu_kernels(device: &candle_core::Device) -> bool {
    device.is_cpu() && !COMPOSED.with(|c| c.get())
}

/// Whether tensors on `device` run the CUDA twins of the fused kernels (`cuda`): a CUDA
/// device, in a build with the `cuda` feature, outside a [`ComposedScope`] (which keeps the
/// composed candle ops, to measure the kernels against them).
pub fn cuda_kernels(device: &candle_core::Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && !COMPOSED.with(|c| c.get())
}

/// Whether every tensor is f32 on a device where the CUDA twins run ([`cuda_kernels`]).
pub(crate) fn cuda_f32(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.dtype() == DType::F32 && cuda_kernels(t.device()))
}

/// Whether the fused CPU ops take these operands: all on the CPU (kernels not disabled), one
/// dtype, f32 or f64.
pub(crate) fn fused_cpu(ts: &[&Tensor]) -> bool {
    let dt = ts.first().map_or(DType::F32, |t| t.dtype());
    ts.iter().all(|t| cpu_kernels(t.device()) && t.dtype() == dt) && matches!(dt, DType::F32 | DType::F64)
}

/// Whether `t` is an f32 tensor on the CPU (what the fused f32 kernels take).
pub(crate) fn f32_cpu(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && cpu_kernels(t.device())
}

/// Rows per rayon task: small rows are batched so a task does real work.
fn rows_per_task(row_len: usize) -> usize {
    (16384 / row_len.max(1)).max(1)
}

/// The contiguous slice a layout views, or an error naming the op.
fn contiguous<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &'static str,
) -> CResult<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

fn unsupported(op: &'static str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: unsupported dtype {dtype:?} (use f32 or f64)"))
}

/// Length of the last dimension (1 for a scalar).
fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

/// Calls `f(first_row, out_rows, [in_rows…])` on chunks of whole rows of length `n`, in
/// parallel; the `inputs` have the same row layout as `out`.
fn par_rows<T: Send + Sync + Copy, F>(out: &mut [T], n: usize, inputs: &[&[T]], f: F)
where
    F: Fn(usize, &mut [T], &[&[T]]) + Sync + Send,
{
    let rows = rows_per_task(n);
    let per = rows * n.max(1);
    out.par_chunks_mut(per).enumerate().for_each(|(chunk, o)| {
        let start = chunk * per;
        let mut ins: [&[T]; 4] = [&[]; 4];
        for (slot, x) in ins.iter_mut().zip(inputs) {
            *slot = &x[start..start + o.len()];
        }
        f(chunk * rows, o, &ins[..inputs.len()]);
    });
}

#[cfg(test)]
pub(crate) mod testutil {
    use candle_core::{Device, Tensor, Var};

    pub fn randn(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a.to_dtype(candle_core::DType::F64).unwrap() - b.to_dtype(candle_core::DType::F64).unwrap())
            .unwrap();
        d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    fn vars(shapes: &[&[usize]]) -> Vec<Var> {
        shapes.iter().enumerate().map(|(i, s)| Var::from_tensor(&randn(s, i as u64)).unwrap()).collect()
    }

    /// Checks values and gradients of `fused` against `composed` for random inputs, in f64, to `tol`.
    pub fn check_tol<F, G>(shapes: &[&[usize]], tol: f64, fused: F, composed: G)
    where
        F: Fn(&[Tensor]) -> Tensor,
        G: Fn(&[Tensor]) -> Tensor,
    {
        let vars = vars(shapes);
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let yf = fused(&ts);
        let yc = composed(&ts);
        let d = max_diff(&yf, &yc);
        assert!(d < tol, "forward max diff {d}");
        // A random projection makes the upstream gradient non-uniform.
        let proj = randn(yf.dims(), 99);
        let gf = (yf * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = (yc * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let a = gf.get(v).expect("fused op dropped a gradient");
            let b = gc.get(v).unwrap();
            let d = max_diff(a, b);
            assert!(d < tol, "grad {i} max diff {d}");
        }
    }

    /// [`check_tol`] at 1e-10.
    pub fn check<F, G>(shapes: &[&[usize]], fused: F, composed: G)
    where
        F: Fn(&[Tensor]) -> Tensor,
        G: Fn(&[Tensor]) -> Tensor,
    {
        check_tol(shapes, 1e-10, fused, composed)
    }

    /// Central finite differences (f64, h = 1e-5) of `Σ proj · f(inputs)` against the gradients
    /// from `backward()`, on every input element; `tol` is relative to max(1, |gradient|).
    pub fn fd_check<F>(shapes: &[&[usize]], f: F)
    where
        F: Fn(&[Tensor]) -> Tensor,
    {
        let vars = vars(shapes);
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts);
        let proj = randn(y.dims(), 77);
        let loss = |ts: &[Tensor]| (f(ts) * &proj).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let grads = (y * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        let h = 1e-5;
        let mut worst = 0f64;
        for (i, v) in vars.iter().enumerate() {
            let g = grads.get(v).expect("no gradient").flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let base = v.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            for j in 0..base.len() {
                let at = |delta: f64| {
                    let mut x = base.clone();
                    x[j] += delta;
                    let mut inputs = ts.clone();
                    inputs[i] = Tensor::from_vec(x, v.shape(), v.device()).unwrap();
                    loss(&inputs)
                };
                let num = (at(h) - at(-h)) / (2.0 * h);
                let err = (num - g[j]).abs() / g[j].abs().max(1.0);
                worst = worst.max(err);
                assert!(err < 1e-6, "input {i} element {j}: finite difference {num} vs backward {}", g[j]);
            }
        }
        assert!(worst.is_finite());
    }
}

#[cfg(test)]
mod candle_patch_tests {
    use candle_core::{Device, Var};

    /// The workspace builds candle-core with `vendor/candle-core.patch`: a backward stores a
    /// tensor's first gradient as it is, not as `0 + g`. Seen in the sign of a zero: `x`'s
    /// gradient through `−x · 0` is `−(+0) = −0`, which an addition to zeroes turns into `+0`.
    /// (Fails if the patch is lost, e.g. the `[patch.crates-io]` entry dropped.)
    #[test]
    fn backward_stores_the_first_gradient_without_adding_zeros() {
        let x = Var::new(&[1.5f32, -2.0], &Device::Cpu).unwrap();
        let zeros = x.as_tensor().zeros_like().unwrap();
        let y = (x.as_tensor().neg().unwrap() * zeros).unwrap().sum_all().unwrap();
        let g = y.backward().unwrap().get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, [0.0, 0.0]);
        assert!(g.iter().all(|v| v.is_sign_negative()), "{g:?}: the first gradient was added to zeros");
        // A second contribution is still added: `x + x` has gradient 2.
        let y = (x.as_tensor() + x.as_tensor()).unwrap().sum_all().unwrap();
        let g = y.backward().unwrap().get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, [2.0, 2.0]);
    }
}
