//! The gated MLP product of Llama, Qwen2 and Mistral, `silu(gate) · up`, with a fused backward.
//!
//! Composed, the graph keeps `gate`, `silu(gate)` and `up` for the backward, three
//! `(rows, inner)` tensors per layer; fused, it keeps `gate` and `up`. `silu(x)` is
//! `x / (1 + e^(−x))` as candle's CPU `silu` computes it, so the forward is the composed one's
//! bit for bit. The backward: with `σ = 1 / (1 + e^(−g))`,
//! `d gate = dy · up · σ(1 + g(1 − σ))` and `d up = dy · silu(g)`. On CUDA both run as
//! `swiglu.cu`'s twins of these loops, in f32 and in bf16: the bf16 kernels (autocast's bf16
//! activations, [`crate::bf16_activations`]) compute each value in f32 as the f32 ones do and
//! round it to bf16 once, so their CPU twin is this kernel in f32, rounded.

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

/// `silu(gate) · up`, differentiable: one fused node on the CPU (f32, f64) and on CUDA (f32 and
/// bf16, `swiglu.cu`), candle's `silu` and `mul` elsewhere. Two bf16 tensors give each value
/// computed in f32 and rounded to bf16 once, on every device (where there is no bf16 kernel,
/// through f32 casts): the bf16 kernel's values, and those of the f32 op whose result a bf16
/// product then reads.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    use candle_core::DType;
    let cuda = super::cuda_kernels(gate.device())
        && gate.dtype() == up.dtype()
        && matches!(gate.dtype(), DType::F32 | DType::BF16);
    if (super::fused_cpu(&[gate, up]) || cuda) && gate.rank() > 0 {
        gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
    } else if gate.dtype() == DType::BF16 && up.dtype() == DType::BF16 {
        swiglu(&gate.to_dtype(DType::F32)?, &up.to_dtype(DType::F32)?)?.to_dtype(DType::BF16)
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

    /// Two bf16 tensors: each value, and each gradient, is the f32 op's rounded to bf16 once
    /// (the CUDA bf16 kernel's definition, which `rltune selftest` checks it against). Fused
    /// and composed CPU paths alike.
    #[test]
    fn bf16_is_the_f32_op_rounded_once() {
        use candle_core::{DType, Var};
        for composed in [false, true] {
            let _scope = composed.then(crate::composed_scope);
            let bf = |seed| randn(&[9, 37], seed).affine(3.0, 0.0).unwrap().to_dtype(DType::BF16).unwrap();
            let (g, u, r) = (bf(1), bf(2), bf(3));
            let run = |dtype: DType| {
                let (gv, uv) = (
                    Var::from_tensor(&g.to_dtype(dtype).unwrap()).unwrap(),
                    Var::from_tensor(&u.to_dtype(dtype).unwrap()).unwrap(),
                );
                let y = swiglu(gv.as_tensor(), uv.as_tensor()).unwrap();
                let grads = (&y * r.to_dtype(dtype).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                let (dg, du) =
                    (grads.get(gv.as_tensor()).unwrap().clone(), grads.get(uv.as_tensor()).unwrap().clone());
                [y, dg, du].map(|t| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap())
            };
            let (want, got) = (run(DType::F32), run(DType::BF16));
            for (w, g) in want.iter().zip(&got) {
                assert_eq!(max_diff(w, g), 0.0, "composed: {composed}");
                assert!(w.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
            }
        }
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
