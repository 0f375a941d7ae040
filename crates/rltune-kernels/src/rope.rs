//! Rotary position embedding applied while splitting the heads, with a fused backward.
//!
//! `(B, T, H·D)` projections become `(B, H, T, D)` heads rotated as transformers'
//! `rotate_half` rotates them: with `x = [x₁ | x₂]` along `D`,
//! `out = [x₁·cos − x₂·sin | x₂·cos + x₁·sin]`. Composed (split the heads into a contiguous copy,
//! two narrows, four products, a difference, a sum and a concatenation) the graph kept the copy,
//! the four products and both halves for the backward, about four tensors of the input's size;
//! fused it keeps the input only. The products and sums are done in the composed order, so the
//! forward is the composed one's bit for bit. `cos` and `sin` `(B, 1, T, D/2)` are functions of
//! the positions: they get no gradient. On CUDA (f32) both directions run as `rope.cu`'s twin of
//! [`rotate`]'s loop.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{contiguous, CResult, Elem};

/// The op: the forward (`inverse = false`, `x (B, T, H·D)` → `(B, H, T, D)`), or its transpose,
/// the backward (`inverse = true`, `dy (B, H, T, D)` → `(B, T, H·D)`), with `heads` per position.
struct RopeHeads {
    heads: usize,
    inverse: bool,
    /// The bf16 side: the forward reads f32 and writes bf16 (each value rounded once), the
    /// backward reads the bf16 gradient and writes f32 ([`rope_heads_bf16`]).
    bf16: bool,
}

/// `(b, t, h, d)` from `x (B, T, H·D)` and `cos (B, 1, T, D/2)`, or an error.
fn dims(lx: &Layout, lc: &Layout, ls: &Layout, heads: usize, op: &'static str) -> CResult<[usize; 4]> {
    let (b, t, c) = match lx.dims() {
        &[b, t, c] => (b, t, c),
        d => candle_core::bail!("{op}: x must be (B, T, H·D), got {d:?}"),
    };
    if heads == 0 || !c.is_multiple_of(heads) || !(c / heads).is_multiple_of(2) {
        candle_core::bail!("{op}: {c} does not split into {heads} heads of an even size");
    }
    let d = c / heads;
    if lc.dims() != [b, 1, t, d / 2] || ls.dims() != lc.dims() {
        candle_core::bail!(
            "{op}: cos {:?} and sin {:?} are not ({b}, 1, {t}, {})",
            lc.dims(),
            ls.dims(),
            d / 2
        );
    }
    Ok([b, t, heads, d])
}

/// Forward (`inverse = false`) from `(B, T, H·D)` to `(B, H, T, D)`, or its transpose, the
/// backward (`inverse = true`), from `(B, H, T, D)` to `(B, T, H·D)`.
fn rotate<T: Elem>(x: &[T], cos: &[T], sin: &[T], [_, t, h, d]: [usize; 4], inverse: bool) -> Vec<T> {
    let half = d / 2;
    let mut out = vec![T::zero(); x.len()];
    // One task per sequence: its T·H·D values are contiguous in both layouts.
    out.par_chunks_mut(t * h * d).enumerate().for_each(|(bi, o)| {
        let xs = &x[bi * t * h * d..][..t * h * d];
        for ti in 0..t {
            let c = &cos[(bi * t + ti) * half..][..half];
            let s = &sin[(bi * t + ti) * half..][..half];
            for hi in 0..h {
                // Position (t, h) in the (T, H·D) layout and in the (H, T, D) one.
                let thd = (ti * h + hi) * d;
                let htd = (hi * t + ti) * d;
                let (src, dst) = if inverse { (htd, thd) } else { (thd, htd) };
                rotate_head(&mut o[dst..dst + d], &xs[src..src + d], c, s, inverse);
            }
        }
    });
    out
}

/// One head `x = [x₁ | x₂]` rotated into `out` by `c`, `s` (`D/2` each): `[x₁·c − x₂·s | x₂·c +
/// x₁·s]`, or its transpose (`inverse`, the backward), products and sums in the composed order.
#[inline(always)]
pub(crate) fn rotate_head<T: Elem>(out: &mut [T], x: &[T], c: &[T], s: &[T], inverse: bool) {
    let half = x.len() / 2;
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = out.split_at_mut(half);
    for j in 0..half {
        if inverse {
            o1[j] = x1[j] * c[j] + x2[j] * s[j];
            o2[j] = x2[j] * c[j] - x1[j] * s[j];
        } else {
            o1[j] = x1[j] * c[j] - x2[j] * s[j];
            o2[j] = x2[j] * c[j] + x1[j] * s[j];
        }
    }
}

impl RopeHeads {
    fn label(&self) -> &'static str {
        if self.inverse {
            "rope backward"
        } else {
            "rope"
        }
    }

    /// `[b, t, h, d]` and the output's shape, from the layouts of the input, `cos` and `sin`.
    /// The geometry is read off the `(B, T, H·D)` side: the input forward, the output backward.
    fn geometry(&self, l1: &Layout, l2: &Layout, l3: &Layout) -> CResult<([usize; 4], Shape)> {
        let name = self.label();
        let flat = match (self.inverse, l1.dims()) {
            (false, _) => l1.clone(),
            (true, &[b, h, t, d]) if h == self.heads => Layout::contiguous((b, t, h * d)),
            (true, other) => candle_core::bail!("{name}: dy {other:?} is not (B, {}, T, D)", self.heads),
        };
        let g = dims(&flat, l2, l3, self.heads, name)?;
        let [b, t, h, d] = g;
        let shape: Shape = if self.inverse { (b, t, h * d).into() } else { (b, h, t, d).into() };
        Ok((g, shape))
    }
}

/// [`RopeHeads`] on the CPU, in `T`.
fn rope_cpu<T: Elem>(
    op: &RopeHeads,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let (g, shape) = op.geometry(l1, l2, l3)?;
    let name = op.label();
    let out = rotate::<T>(
        contiguous(s1, l1, name)?,
        contiguous(s2, l2, name)?,
        contiguous(s3, l3, name)?,
        g,
        op.inverse,
    );
    Ok((T::to_cpu_storage_owned(out), shape))
}

impl CustomOp3 for RopeHeads {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rltune-rope-heads-bwd"
        } else {
            "rltune-rope-heads"
        }
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
        if self.bf16 {
            return rope_cpu_bf16(self, s1, l1, s2, l2, s3, l3);
        }
        by_dtype!(s1, "rope", rope_cpu(self, s1, l1, s2, l2, s3, l3))
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
        let (g, shape) = self.geometry(l1, l2, l3)?;
        Ok((crate::cuda::rope((s1, l1), (s2, l2), (s3, l3), g, self.inverse, self.bf16)?, shape))
    }

    /// The forward's gradient (the backward op is applied without a graph).
    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let inverse = RopeHeads { heads: self.heads, inverse: true, bf16: self.bf16 };
        let dx = dy.contiguous()?.apply_op3_no_bwd(cos, sin, &inverse)?;
        Ok((Some(dx), None, None))
    }
}

/// `x (B, T, H·D)` split into `H` heads `(B, H, T, D)` and rotated by `cos`, `sin`
/// `(B, 1, T, D/2)` (transformers' `apply_rotary_pos_emb` with `rotate_half`), differentiable in
/// `x`. One fused node on the CPU (f32, f64) and on CUDA (f32: `rope.cu`);
/// [`rope_heads_composed`] elsewhere.
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> CResult<Tensor> {
    if super::fused_cpu(&[x, cos, sin]) || super::cuda_f32(&[x, cos, sin]) {
        x.contiguous()?.apply_op3(
            &cos.contiguous()?,
            &sin.contiguous()?,
            RopeHeads { heads, inverse: false, bf16: false },
        )
    } else {
        rope_heads_composed(x, cos, sin, heads)
    }
}

/// [`rope_heads`] of an f32 `x`, returned in bf16: each value computed in f32 and rounded once,
/// the values of `rope_heads(x, …).to_dtype(BF16)` without the f32 heads (autocast's bf16
/// attention, [`crate::rope_attention_bf16`]). Its backward takes the bf16 gradient and gives
/// `x` an f32 one. One node on the CPU and on CUDA (`rope.cu`'s f32/bf16 kernels); elsewhere
/// that composition.
pub fn rope_heads_bf16(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> CResult<Tensor> {
    use candle_core::DType;
    let f32s = [x, cos, sin].iter().all(|t| t.dtype() == DType::F32);
    if f32s && (x.device().is_cpu() || super::cuda_kernels(x.device())) {
        x.contiguous()?.apply_op3(
            &cos.contiguous()?,
            &sin.contiguous()?,
            RopeHeads { heads, inverse: false, bf16: true },
        )
    } else {
        rope_heads(x, cos, sin, heads)?.to_dtype(DType::BF16)
    }
}

/// [`RopeHeads`]'s bf16 side on the CPU: the f32 loop between conversions.
fn rope_cpu_bf16(
    op: &RopeHeads,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    if op.inverse {
        // The bf16 gradient widened, then the f32 inverse rotation.
        let dy = contiguous::<half::bf16>(s1, l1, op.label())?.iter().map(|v| v.to_f32()).collect();
        return rope_cpu::<f32>(op, &CpuStorage::F32(dy), &Layout::contiguous(l1.shape()), s2, l2, s3, l3);
    }
    // The f32 rotation, rounded once.
    let (y, shape) = rope_cpu::<f32>(op, s1, l1, s2, l2, s3, l3)?;
    Ok((CpuStorage::BF16(y.as_slice::<f32>()?.iter().map(|&v| half::bf16::from_f32(v)).collect()), shape))
}

/// [`rope_heads`] from candle's ops.
pub fn rope_heads_composed(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> CResult<Tensor> {
    let (b, t, c) = x.dims3()?;
    let x = x.reshape((b, t, heads, c / heads))?.transpose(1, 2)?.contiguous()?;
    let half = x.dim(3)? / 2;
    let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
    let lo = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let hi = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[lo, hi], 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check, fd_check, max_diff, randn};
    use candle_core::DType;

    /// The bf16 side is `rope_heads` then a cast, bit for bit, forward and backward (from a bf16
    /// gradient), in the fused and the composed scope.
    #[test]
    fn bf16_heads_are_the_f32_ones_rounded_once() {
        use candle_core::Var;
        let (b, t, h, d) = (2, 5, 3, 8);
        let (cos, sin) = angles(b, t, d / 2, 4);
        let (cos, sin) = (cos.to_dtype(DType::F32).unwrap(), sin.to_dtype(DType::F32).unwrap());
        let x = randn(&[b, t, h * d], 1).to_dtype(DType::F32).unwrap();
        let r = randn(&[b, h, t, d], 2).to_dtype(DType::BF16).unwrap();
        for composed in [false, true] {
            let _scope = composed.then(crate::composed_scope);
            let run = |fused: bool| {
                let xv = Var::from_tensor(&x).unwrap();
                let y = if fused {
                    rope_heads_bf16(xv.as_tensor(), &cos, &sin, h).unwrap()
                } else {
                    rope_heads(xv.as_tensor(), &cos, &sin, h).unwrap().to_dtype(DType::BF16).unwrap()
                };
                assert_eq!(y.dtype(), DType::BF16);
                let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let dx = g.get(xv.as_tensor()).unwrap().clone();
                assert_eq!(dx.dtype(), DType::F32);
                (y, dx)
            };
            let ((y, dx), (want_y, want_dx)) = (run(true), run(false));
            assert_eq!(max_diff(&y, &want_y), 0.0, "composed: {composed}");
            assert_eq!(max_diff(&dx, &want_dx), 0.0, "composed: {composed}");
            assert!(max_diff(&dx, &(&dx * 0.0).unwrap()) > 0.0);
        }
    }

    fn angles(b: usize, t: usize, half: usize, seed: u64) -> (Tensor, Tensor) {
        let a = randn(&[b, 1, t, half], seed);
        (a.cos().unwrap(), a.sin().unwrap())
    }

    #[test]
    fn matches_composed_values_and_gradients() {
        let (cos, sin) = angles(2, 3, 2, 9);
        check(
            &[&[2, 3, 12]],
            |t| rope_heads(&t[0], &cos, &sin, 3).unwrap(),
            |t| rope_heads_composed(&t[0], &cos, &sin, 3).unwrap(),
        );
        fd_check(&[&[2, 3, 12]], |t| rope_heads(&t[0], &cos, &sin, 3).unwrap());
        let err = rope_heads(&randn(&[2, 3, 12], 1), &cos, &sin, 2).unwrap_err();
        assert!(err.to_string().contains("cos [2, 1, 3, 2] and sin"), "{err}");
    }

    /// In f32 the forward is the composed one bit for bit (the models' parity with
    /// transformers is measured on it).
    #[test]
    fn f32_forward_is_the_composed_one_exactly() {
        let f = |t: Tensor| t.to_dtype(DType::F32).unwrap();
        let (cos, sin) = angles(3, 7, 4, 2);
        let (cos, sin) = (f(cos), f(sin));
        let x = f(randn(&[3, 7, 40], 3));
        assert_eq!(
            max_diff(
                &rope_heads(&x, &cos, &sin, 5).unwrap(),
                &rope_heads_composed(&x, &cos, &sin, 5).unwrap()
            ),
            0.0
        );
    }
}
