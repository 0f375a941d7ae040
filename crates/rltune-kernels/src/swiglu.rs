//! The gated MLP product of Llama, Qwen2 and Mistral, `silu(gate) · up`, with a fused backward.
//!
//! Composed, the graph keeps `gate`, `silu(gate)` and `up` for the backward, three
//! `(rows, inner)` tensors per layer; fused, it keeps `gate` and `up`. `silu(x)` is
//! `x / (1 + e^(−x))` as candle's CPU `silu` computes it, so the forward is the composed one's
//! bit for bit. The backward: with `σ = 1 / (1 + e^(−g))`,
//! `d gate = dy · up · σ(1 + g(1 − σ))` and `d up = dy · silu(g)`. On CUDA (f32) both run as
//! `swiglu.cu`'s twins of these loops.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{contiguous, par_rows, zeros_par, CResult, Elem};

/// Values per rayon task of the backward.
const CHUNK: usize = 1 << 14;

struct SwiGlu;

/// `(gate, up, dy) → [d gate; d up]`, stacked along the first dimension.
struct SwiGluBwd;

#[inline(always)]
fn silu<T: Elem>(x: T) -> T {
    x / (T::one() + (-x).exp())
}

fn check_same(l1: &Layout, l2: &Layout, op: &'static str) -> CResult<()> {
    if l1.dims() != l2.dims() {
        candle_core::bail!("{op}: gate {:?} and up {:?} differ in shape", l1.dims(), l2.dims());
    }
    Ok(())
}

fn swiglu_fwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    const OP: &str = "swiglu";
    check_same(l1, l2, OP)?;
    let (g, u) = (contiguous::<T>(s1, l1, OP)?, contiguous::<T>(s2, l2, OP)?);
    let mut out = zeros_par(g.len());
    par_rows(&mut out, 1, &[g, u], |_, o, r| {
        for ((o, &g), &u) in o.iter_mut().zip(r[0]).zip(r[1]) {
            *o = silu(g) * u;
        }
    });
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

/// `[d gate; d up]` in one pass (one `exp` per element for both halves).
fn swiglu_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    const OP: &str = "swiglu backward";
    check_same(l1, l2, OP)?;
    check_same(l1, l3, OP)?;
    let (g, u, dy) =
        (contiguous::<T>(s1, l1, OP)?, contiguous::<T>(s2, l2, OP)?, contiguous::<T>(s3, l3, OP)?);
    let n = g.len();
    let mut out = zeros_par(2 * n);
    let (dg, du) = out.split_at_mut(n);
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)).zip(dy.par_chunks(CHUNK)))
        .for_each(|((dg, du), ((g, u), dy))| {
            for ((((dg, du), &g), &u), &dy) in dg.iter_mut().zip(du).zip(g).zip(u).zip(dy) {
                let s = T::one() / (T::one() + (-g).exp());
                *dg = dy * u * s * (T::one() + g * (T::one() - s));
                *du = dy * g * s;
            }
        });
    let mut dims = l1.dims().to_vec();
    if let Some(first) = dims.first_mut() {
        *first *= 2;
    }
    Ok((T::to_cpu_storage_owned(out), dims.into()))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "rltune-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "swiglu", swiglu_fwd(s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        check_same(l1, l2, "swiglu")?;
        crate::cuda::swiglu_fwd((s1, l1), (s2, l2))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let both = g.apply_op3_no_bwd(u, &dy.contiguous()?, &SwiGluBwd)?;
        let n = g.dims().first().copied().unwrap_or(1);
        Ok((Some(both.narrow(0, 0, n)?), Some(both.narrow(0, n, n)?)))
    }
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "rltune-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "swiglu backward", swiglu_bwd(s1, l1, s2, l2, s3, l3))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        check_same(l1, l2, "swiglu backward")?;
        check_same(l1, l3, "swiglu backward")?;
        crate::cuda::swiglu_bwd((s1, l1), (s2, l2), (s3, l3))
    }
}

/// `silu(gate) · up`, differentiable: one fused node on the CPU (f32, f64) and on CUDA (f32,
/// `swiglu.cu`), candle's `silu` and `mul` elsewhere.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    if (super::fused_cpu(&[gate, up]) || super::cuda_f32(&[gate, up])) && gate.rank() > 0 {
        gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
    } else {
        swiglu_composed(gate, up)
    }
}

/// [`swiglu`] from candle's ops.
pub fn swiglu_composed(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.silu()? * up
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check, fd_check, max_diff, randn};

    #[test]
    fn matches_composed_values_and_gradients() {
        check(
            &[&[3, 4, 5], &[3, 4, 5]],
            |t| swiglu(&t[0], &t[1]).unwrap(),
            |t| swiglu_composed(&t[0], &t[1]).unwrap(),
        );
        fd_check(&[&[2, 7], &[2, 7]], |t| swiglu(&t[0], &t[1]).unwrap());
    }

    /// In f32 the forward is candle's `silu(gate) * up` bit for bit (the models' parity with
    /// transformers is measured on it).
    #[test]
    fn f32_forward_is_the_composed_one_exactly() {
        let g = randn(&[64, 300], 1).to_dtype(candle_core::DType::F32).unwrap();
        let u = randn(&[64, 300], 2).to_dtype(candle_core::DType::F32).unwrap();
        assert_eq!(max_diff(&swiglu(&g, &u).unwrap(), &swiglu_composed(&g, &u).unwrap()), 0.0);
    }
}
