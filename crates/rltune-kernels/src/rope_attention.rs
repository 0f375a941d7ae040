//! Llama's attention core as one op: rotary embedding, grouped-query attention, merged heads.
//!
//! `q (B, T, H·D)`, `k`, `v (B, T, H_kv·D)` (the projections' outputs) → `(B, T, H·D)`: for each
//! sequence and query head `h`, `softmax(rope(q)·rope(k)ᵀ·scale + bias)·v` with the key and
//! value head `h / (H / H_kv)`, and the heads merged. Composed (the rotary op into `(B, H, T,
//! D)` heads, `repeat_kv` of keys and values, a transposed copy of the keys, two batched
//! products, the softmax and the merge) the graph kept, per layer, the rotated heads, the
//! repeated keys and values, the transposed keys, the scores, the probabilities, the output
//! heads and their merged copy: on SmolLM2-135M (9 query heads, 3 key heads) about 870 MiB of
//! a GRPO step's 4.5 GiB. This op keeps its three inputs (which the projections' graph keeps
//! anyway) and the probabilities `(B, H, T, T)`; the backward rotates `q` and `k` again.
//!
//! Each sequence packs its rotated queries, rotated keys and values into one row-major `(T,
//! H·D + 2·H_kv·D)` scratch and runs GPT-2's fused attention kernels on it
//! (`attention::fwd_seq`, `bwd_seq`, which take the grouped geometry); the backward rotates the
//! query and key gradients back (rope's transpose, `rope::rotate`'s inverse). The rotation is
//! `rope_heads`'s, product for product, so the rotated heads are the composed path's bit for
//! bit; the products sum in another order than candle's matmul, so the outputs and gradients
//! agree with [`rope_attention_composed`] to rounding (tested). `cos`, `sin` and the bias are
//! functions of the positions and the mask: they get no gradient. CPU, f32 and f64; CUDA, f32:
//! `rope.cu`'s pack kernel writes the same rows (`rope_pack`), `attention.cu` runs the grouped
//! geometry, and the backward unpacks the rows' gradient with the rotation's transpose
//! (`rope_unpack`), four launches in all. [`rope_attention_takes`] says when the fused op
//! applies, and [`rope_attention_composed`] runs elsewhere.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::attention::{bias_rows, bwd_seq, fwd_seq, padded, Dims, Probs, ROWS};
use super::rope::rotate_head;
use super::{contiguous, CResult, Elem};

/// The operands' geometry: `(b, t, h, kv, d)`, checked.
fn geometry(q: &[usize], k: &[usize], v: &[usize], heads: (usize, usize)) -> CResult<[usize; 5]> {
    let (h, kv) = heads;
    let (&[b, t, cq], &[bk, tk, ck]) = (q, k) else {
        candle_core::bail!("rope attention: q {q:?} and k {k:?} must be (B, T, heads·D)")
    };
    if h == 0 || kv == 0 || !h.is_multiple_of(kv) || !cq.is_multiple_of(h) {
        candle_core::bail!(
            "rope attention: {cq} query values in {h} heads with {kv} key heads do not split evenly"
        );
    }
    let d = cq / h;
    if [bk, tk, ck] != [b, t, kv * d] || v != [b, t, kv * d] || !d.is_multiple_of(2) {
        candle_core::bail!(
            "rope attention: q {q:?}, k {k:?}, v {v:?} do not hold {h} query heads and {kv} key and value \
             heads of one even size"
        );
    }
    Ok([b, t, h, kv, d])
}

/// The forward op; `cos`, `sin (B, 1, T, D/2)` and the bias are constants it holds. It keeps the
/// probabilities for its backward.
struct RopeAttention {
    cos: Tensor,
    sin: Tensor,
    bias: Tensor,
    heads: (usize, usize),
    scale: f64,
    probs: Mutex<Option<Probs>>,
}

/// A contiguous CPU tensor's values, read through its storage's guard.
fn values<'a, T: Elem>(s: &'a candle_core::Storage, l: &Layout) -> CResult<&'a [T]> {
    match s {
        candle_core::Storage::Cpu(cs) => contiguous::<T>(cs, l, "rope attention"),
        _ => candle_core::bail!("rope attention: every operand must be on the CPU"),
    }
}

/// Sequence `bi`'s `n` values of `x`.
#[inline(always)]
fn seq<T>(x: &[T], bi: usize, n: usize) -> &[T] {
    &x[bi * n..][..n]
}

/// The values the packed rows are made from: the projections and the angles.
struct Inputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    cos: &'a [T],
    sin: &'a [T],
}

impl<T: Elem> Inputs<'_, T> {
    /// Sequence `bi`'s packed rows `(T, W)`: the rotated queries, the rotated keys, the values.
    fn packed(&self, bi: usize, dims: &Dims) -> Vec<T> {
        let (t, c, d) = (dims.t, dims.c, dims.d());
        let (w, ckv, half) = (dims.width(), dims.kv * d, d / 2);
        let (q, k, v) = (seq(self.q, bi, t * c), seq(self.k, bi, t * ckv), seq(self.v, bi, t * ckv));
        let (cos, sin) = (seq(self.cos, bi, t * half), seq(self.sin, bi, t * half));
        let mut out = vec![T::zero(); t * w];
        for ti in 0..t {
            let (cs, sn) = (&cos[ti * half..][..half], &sin[ti * half..][..half]);
            let row = &mut out[ti * w..(ti + 1) * w];
            let (rq, rest) = row.split_at_mut(c);
            let (rk, rv) = rest.split_at_mut(ckv);
            rotate_heads(rq, &q[ti * c..][..c], cs, sn, d, false);
            rotate_heads(rk, &k[ti * ckv..][..ckv], cs, sn, d, false);
            rv.copy_from_slice(&v[ti * ckv..][..ckv]);
        }
        out
    }
}

/// Each head of `x` (heads of `d` values side by side) rotated into `out` as `rope_heads` rotates
/// it ([`rotate_head`]; `inverse`: its transpose, the backward).
#[inline(always)]
fn rotate_heads<T: Elem>(out: &mut [T], x: &[T], c: &[T], s: &[T], d: usize, inverse: bool) {
    for (o, x) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        rotate_head(o, x, c, s, inverse);
    }
}

impl RopeAttention {
    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> CResult<(usize, Dims)> {
        let [b, t, h, kv, d] = geometry(q.dims(), k.dims(), v.dims(), self.heads)?;
        if self.cos.dims() != [b, 1, t, d / 2] || self.sin.dims() != self.cos.dims() {
            candle_core::bail!(
                "rope attention: cos {:?} and sin {:?} are not ({b}, 1, {t}, {})",
                self.cos.dims(),
                self.sin.dims(),
                d / 2
            );
        }
        let bias = bias_rows(self.bias.dims(), [b, h, t], "rope attention")?;
        Ok((b, Dims { t, c: h * d, h, kv, bias }))
    }

    fn fwd<T: Elem>(
        &self,
        q: (&CpuStorage, &Layout),
        k: (&CpuStorage, &Layout),
        v: (&CpuStorage, &Layout),
    ) -> CResult<(CpuStorage, Shape)> {
        let (b, dims) = self.dims(q.1, k.1, v.1)?;
        let what = "rope attention";
        let (q, k, v) = (
            contiguous::<T>(q.0, q.1, what)?,
            contiguous::<T>(k.0, k.1, what)?,
            contiguous::<T>(v.0, v.1, what)?,
        );
        let (t, c, h) = (dims.t, dims.c, dims.h);
        let scale = T::from(self.scale).unwrap_or_else(T::one);
        let mut out = super::zeros_par(b * t * c);
        let mut p = super::zeros_par(b * h * t * t);
        let ((cos, lc), (sin, ls), (bias, lb)) =
            (self.cos.storage_and_layout(), self.sin.storage_and_layout(), self.bias.storage_and_layout());
        let (cos, sin, bias) = (values::<T>(&cos, lc)?, values::<T>(&sin, ls)?, values::<T>(&bias, lb)?);
        let inputs = Inputs { q, k, v, cos, sin };
        let tp = padded(t);
        if t > 0 && c > 0 {
            out.par_chunks_mut(t * c).zip(p.par_chunks_mut(h * t * t)).enumerate().for_each(
                |(bi, (o, p))| {
                    let rows = inputs.packed(bi, &dims);
                    let (kt, srows) = (&mut vec![T::zero(); dims.d() * tp], &mut vec![T::zero(); ROWS * tp]);
                    fwd_seq(o, p, kt, srows, &rows, bias, bi, &dims, scale);
                },
            );
        }
        *super::lock(&self.probs) = Some(Probs::Cpu(T::to_cpu_storage_owned(p)));
        Ok((T::to_cpu_storage_owned(out), (b, t, c).into()))
    }

    /// `(dq, dk, dv)` for the upstream gradient `g (B, T, H·D)` from the kept probabilities.
    fn bwd_cpu<T: Elem>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        probs: &CpuStorage,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let (b, dims) = self.dims(q.layout(), k.layout(), v.layout())?;
        let (t, c, h, d) = (dims.t, dims.c, dims.h, dims.d());
        let (ckv, w, half) = (dims.kv * d, dims.width(), d / 2);
        let scale = T::from(self.scale).unwrap_or_else(T::one);
        let p = probs.as_slice::<T>()?;
        let g = g.contiguous()?;
        let (mut dq, mut dk, mut dv) =
            (super::zeros_par(b * t * c), super::zeros_par(b * t * ckv), super::zeros_par(b * t * ckv));
        let guards = [q, k, v, &g, &self.cos, &self.sin].map(|x| x.storage_and_layout());
        let [qs, ks, vs, gs, cos, sin] = guards.each_ref().map(|(s, l)| values::<T>(s, l));
        let (qs, ks, vs, gs, cos, sin) = (qs?, ks?, vs?, gs?, cos?, sin?);
        let inputs = Inputs { q: qs, k: ks, v: vs, cos, sin };
        let tp = padded(t);
        if t > 0 && c > 0 {
            dq.par_chunks_mut(t * c)
                .zip(dk.par_chunks_mut(t * ckv))
                .zip(dv.par_chunks_mut(t * ckv))
                .enumerate()
                .for_each(|(bi, ((dq, dk), dv))| {
                    let (cs, sn) = (seq(cos, bi, t * half), seq(sin, bi, t * half));
                    let rows = inputs.packed(bi, &dims);
                    let mut drows = vec![T::zero(); t * w];
                    let (vt, dsp) = (&mut vec![T::zero(); d * tp], &mut vec![T::zero(); ROWS * tp]);
                    let (dsm, col) = (&mut vec![T::zero(); t * t], &mut vec![T::zero(); 2 * ROWS * t]);
                    let kv = &mut vec![T::zero(); 2 * ROWS * d];
                    let p = &p[bi * h * t * t..][..h * t * t];
                    bwd_seq(&mut drows, vt, dsp, dsm, col, kv, seq(gs, bi, t * c), p, &rows, &dims, scale);
                    // Back through the rotation (rope's transpose); the values were not rotated.
                    for ti in 0..t {
                        let row = &drows[ti * w..(ti + 1) * w];
                        let (c_, s_) = (&cs[ti * half..][..half], &sn[ti * half..][..half]);
                        rotate_heads(&mut dq[ti * c..][..c], &row[..c], c_, s_, d, true);
                        rotate_heads(&mut dk[ti * ckv..][..ckv], &row[c..c + ckv], c_, s_, d, true);
                        dv[ti * ckv..][..ckv].copy_from_slice(&row[c + ckv..]);
                    }
                });
        }
        let dev = q.device();
        Ok((
            Tensor::from_vec(dq, q.shape(), dev)?,
            Tensor::from_vec(dk, k.shape(), dev)?,
            Tensor::from_vec(dv, v.shape(), dev)?,
        ))
    }
}

impl CustomOp3 for RopeAttention {
    fn name(&self) -> &'static str {
        "rltune-rope-attention"
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
        if s1.dtype() != s2.dtype() || s1.dtype() != s3.dtype() || s1.dtype() != self.bias.dtype() {
            candle_core::bail!("rope attention: q, k, v, cos, sin and the bias must have one dtype");
        }
        by_dtype!(s1, "rope attention", self.fwd((s1, l1), (s2, l2), (s3, l3)))
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
        let (b, dims) = self.dims(l1, l2, l3)?;
        let geometry = [b, dims.t, dims.h, dims.kv, dims.d()];
        let held = [&self.cos, &self.sin, &self.bias].map(|x| x.storage_and_layout());
        let [cos, sin, bias] = held.each_ref().map(|(s, l)| cuda_storage(s).map(|s| (s, *l)));
        let (cos, sin, bias) = (cos?, sin?, bias?);
        let rows = crate::cuda::rope_pack([(s1, l1), (s2, l2), (s3, l3)], [cos, sin], geometry)?;
        let packed = Layout::contiguous((b, dims.t, dims.width()));
        let at = [b, dims.t, dims.c, dims.h, dims.kv];
        let (y, p) = crate::cuda::attention_fwd((&rows, &packed), bias, at, dims.bias, self.scale as f32)?;
        *super::lock(&self.probs) = Some(Probs::Cuda(p));
        Ok((y, (b, dims.t, dims.c).into()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let probs = match super::lock(&self.probs).take() {
            Some(p) => p,
            // A second backward through the same graph: compute them again.
            None => {
                let again = self.clone_constants();
                q.apply_op3_no_bwd(k, v, &again)?;
                let p = super::lock(&again.probs).take();
                p.ok_or_else(|| candle_core::Error::Msg("rope attention: no probabilities".into()))?
            }
        };
        #[cfg(feature = "cuda")]
        if let Probs::Cuda(p) = probs {
            let (dq, dk, dv) = self.bwd_cuda(q, k, v, g, p)?;
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let probs = probs.cpu()?;
        let (dq, dk, dv) = match q.dtype() {
            candle_core::DType::F32 => self.bwd_cpu::<f32>(q, k, v, g, probs)?,
            candle_core::DType::F64 => self.bwd_cpu::<f64>(q, k, v, g, probs)?,
            dt => return Err(super::unsupported("rope attention", dt)),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl RopeAttention {
    /// The op's constants, with no probabilities.
    fn clone_constants(&self) -> Self {
        RopeAttention {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            bias: self.bias.clone(),
            heads: self.heads,
            scale: self.scale,
            probs: Mutex::new(None),
        }
    }
}

/// The CUDA storage of a tensor the op holds, or an error: every operand must be on one GPU.
#[cfg(feature = "cuda")]
fn cuda_storage(s: &candle_core::Storage) -> CResult<&candle_core::CudaStorage> {
    match s {
        candle_core::Storage::Cuda(cs) => Ok(cs),
        _ => candle_core::bail!("rope attention: cos, sin and the bias must be on the GPU with q, k and v"),
    }
}

/// The backward on CUDA: `(q, k, v) → [dq | dk | dv]` as one flat buffer, for the upstream
/// gradient and the probabilities it holds. It packs the rows again (the rotation is cheap),
/// runs the attention backward on them, and unpacks with the rotation's transpose.
#[cfg(feature = "cuda")]
struct RopeAttentionBwd<'a> {
    op: &'a RopeAttention,
    g: Tensor,
    probs: candle_core::CudaStorage,
}

#[cfg(feature = "cuda")]
impl CustomOp3 for RopeAttentionBwd<'_> {
    fn name(&self) -> &'static str {
        "rltune-rope-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        candle_core::bail!("rope attention backward: the probabilities are on the GPU, the operands are not")
    }

    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        let (b, dims) = self.op.dims(l1, l2, l3)?;
        let geometry = [b, dims.t, dims.h, dims.kv, dims.d()];
        let held = [&self.op.cos, &self.op.sin, &self.g].map(|x| x.storage_and_layout());
        let [cos, sin, g] = held.each_ref().map(|(s, l)| cuda_storage(s).map(|s| (s, *l)));
        let (cos, sin, g) = (cos?, sin?, g?);
        let rows = crate::cuda::rope_pack([(s1, l1), (s2, l2), (s3, l3)], [cos, sin], geometry)?;
        let packed = Layout::contiguous((b, dims.t, dims.width()));
        let at = [b, dims.t, dims.c, dims.h, dims.kv];
        let drows = crate::cuda::attention_bwd((&rows, &packed), g, &self.probs, at, self.op.scale as f32)?;
        let grads = crate::cuda::rope_unpack((&drows, &packed), [cos, sin], geometry)?;
        Ok((grads, (b * dims.t * dims.width(),).into()))
    }
}

#[cfg(feature = "cuda")]
impl RopeAttention {
    /// `(dq, dk, dv)` on CUDA from the kept probabilities: one flat buffer, cut into the three
    /// (views, no copies).
    fn bwd_cuda(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        probs: candle_core::CudaStorage,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let bwd = RopeAttentionBwd { op: self, g: g.contiguous()?, probs };
        let flat = q.apply_op3_no_bwd(k, v, &bwd)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        Ok((
            flat.narrow(0, 0, nq)?.reshape(q.shape())?,
            flat.narrow(0, nq, nk)?.reshape(k.shape())?,
            flat.narrow(0, nq + nk, nk)?.reshape(v.shape())?,
        ))
    }
}

/// Whether [`rope_attention`] runs as one fused op for these operands: f32 or f64 on the CPU,
/// or f32 on CUDA with `D + T` within the attention kernel's shared memory; one dtype; keys as
/// long as the queries (no KV cache).
pub fn rope_attention_takes(q: &Tensor, k: &Tensor, cos: &Tensor, bias: &Tensor) -> bool {
    let one_dtype = [k, cos, bias].iter().all(|t| t.dtype() == q.dtype());
    let same_length =
        q.dims().get(1).is_some_and(|&t| bias.dims().last() == Some(&t) && k.dims().get(1) == Some(&t));
    (super::fused_cpu(&[q, k, cos, bias]) || cuda_fits(q, k, cos, bias)) && one_dtype && same_length
}

/// Whether the CUDA kernels take these operands: f32 on a GPU, a head and a row of keys that
/// fit the attention kernel's shared memory.
#[cfg(feature = "cuda")]
fn cuda_fits(q: &Tensor, k: &Tensor, cos: &Tensor, bias: &Tensor) -> bool {
    let (t, d) = (q.dims().get(1).copied().unwrap_or(0), cos.dims().last().copied().unwrap_or(0) * 2);
    super::cuda_f32(&[q, k, cos, bias]) && d + t <= crate::cuda::ATTENTION_MAX_ROW
}

#[cfg(not(feature = "cuda"))]
fn cuda_fits(_: &Tensor, _: &Tensor, _: &Tensor, _: &Tensor) -> bool {
    false
}

/// Attention as Llama computes it: `q (B, T, H·D)`, `k`, `v (B, T, H_kv·D)` from the projections;
/// `q` and `k` rotated by `cos`, `sin (B, 1, T, D/2)` (transformers' `apply_rotary_pos_emb` with
/// `rotate_half`), each query head attending with key and value head `h / (H / H_kv)`
/// (`repeat_kv`), `softmax(q·kᵀ·scale + bias)·v` with `bias (B|1, 1|H, T|1, T)` from
/// [`crate::causal_bias`]; returns the heads merged, `(B, T, H·D)`. Differentiable in `q`, `k`
/// and `v`. One fused node where [`rope_attention_takes`] says so (see the module docs),
/// [`rope_attention_composed`] elsewhere.
#[allow(clippy::too_many_arguments)]
pub fn rope_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    bias: &Tensor,
    heads: (usize, usize),
    scale: f64,
) -> CResult<Tensor> {
    if !(rope_attention_takes(q, k, cos, bias) && v.dtype() == q.dtype() && sin.dtype() == q.dtype()) {
        return rope_attention_composed(q, k, v, cos, sin, bias, heads, scale);
    }
    let op = RopeAttention {
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        bias: bias.contiguous()?,
        heads,
        scale,
        probs: Mutex::new(None),
    };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// [`rope_attention`] from the other ops, as the model composed it: the rotary op, `repeat_kv`,
/// two products and the masked softmax.
#[allow(clippy::too_many_arguments)]
pub fn rope_attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    bias: &Tensor,
    (h, kv): (usize, usize),
    scale: f64,
) -> CResult<Tensor> {
    let [b, t, h, kv, d] = geometry(q.dims(), k.dims(), v.dims(), (h, kv))?;
    let q = super::rope_heads(q, cos, sin, h)?; // (B, H, T, D)
    let repeat = |x: Tensor| -> CResult<Tensor> {
        let rep = h / kv;
        if rep == 1 {
            return Ok(x);
        }
        x.unsqueeze(2)?.broadcast_as((b, kv, rep, t, d))?.reshape((b, h, t, d))
    };
    let k = repeat(super::rope_heads(k, cos, sin, kv)?)?;
    let v = repeat(v.reshape((b, t, kv, d))?.transpose(1, 2)?.contiguous()?)?;
    let scores = super::matmul(&q.contiguous()?, &k.t()?.contiguous()?)?;
    let probs = super::scaled_masked_softmax(&scores, bias, scale)?;
    let y = super::matmul(&probs, &v.contiguous()?)?; // (B, H, T, D)
    y.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))
}

/// [`rope_attention`] as `torch.autocast` computes it, for [`crate::bf16_attention`]: the two
/// products in bf16 (f32 sums; on CUDA candle's batched cuBLAS products, on the tensor cores),
/// the masked softmax between them reading and writing bf16 (each probability computed in f32,
/// rounded once). Returns bf16 `(B, T, H·D)`. The rotation is rltune's, writing bf16 heads
/// ([`crate::rope_heads_bf16`]); grouped-query heads are not repeated: the `H / H_kv` query heads of a key head are
/// `H / H_kv · T` rows against its keys, one batch of the product. What the backward keeps:
/// the bf16 operands, and the scores and probabilities in bf16 (4 bytes a score, as the fused
/// kernel's f32 probabilities).
#[allow(clippy::too_many_arguments)]
pub fn rope_attention_bf16(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    bias: &Tensor,
    (h, kv): (usize, usize),
    scale: f64,
) -> CResult<Tensor> {
    use candle_core::DType;
    let [b, t, h, kv, d] = geometry(q.dims(), k.dims(), v.dims(), (h, kv))?;
    let rep = h / kv;
    // (B, H, T, D) with head g·rep + r → (B, H_kv, rep·T, D): key head g's query rows.
    let q = super::rope_heads_bf16(q, cos, sin, h)?.reshape((b, kv, rep * t, d))?;
    let k = super::rope_heads_bf16(k, cos, sin, kv)?; // (B, H_kv, T, D)
    let v = v.reshape((b, t, kv, d))?.transpose(1, 2)?.to_dtype(DType::BF16)?; // (B, H_kv, T, D), contiguous
    let scores = q.matmul(&k.t()?)?.reshape((b, h, t, t))?;
    let probs = super::scaled_masked_softmax(&scores, &bias.to_dtype(DType::F32)?, scale)?;
    let y = probs.reshape((b, kv, rep * t, t))?.matmul(&v)?; // (B, H_kv, rep·T, D)
    y.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Angles as Llama's rotary embedding makes them, for positions `0..t` shifted per row.
    fn angles(b: usize, t: usize, half: usize) -> (Tensor, Tensor) {
        let mut a = Vec::with_capacity(b * t * half);
        for bi in 0..b {
            for ti in 0..t {
                for j in 0..half {
                    let pos = (ti + bi) as f64;
                    a.push((pos / 10000f64.powf(j as f64 / half as f64)) as f32);
                }
            }
        }
        let a = Tensor::from_vec(a, (b, 1, t, half), &Device::Cpu).unwrap();
        (a.cos().unwrap(), a.sin().unwrap())
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// autocast's bf16 attention against the f32 one: outputs and the gradients of q, k and v
    /// within bf16's precision (relative to each tensor's largest value), on grouped and plain
    /// heads and a left-padded row.
    #[test]
    fn bf16_attention_matches_the_f32_one_to_bf16_precision() {
        for (b, t, h, kv, d) in [(2, 9, 6, 2, 8), (1, 5, 2, 2, 4)] {
            let (cos, sin) = angles(b, t, d / 2);
            let mut mask = vec![vec![1u8; t]; b];
            mask[b - 1][0] = 0;
            let bias = crate::causal_bias(&mask, t, DType::F32, &Device::Cpu).unwrap();
            let (q, k, v) = (randn(&[b, t, h * d], 1), randn(&[b, t, kv * d], 2), randn(&[b, t, kv * d], 3));
            let r = randn(&[b, t, h * d], 4);
            let run = |bf16: bool| {
                let vars = [&q, &k, &v].map(|x| Var::from_tensor(&(x * 2.0).unwrap()).unwrap());
                let [qv, kv_, vv] = &vars;
                let (qt, kt, vt) = (qv.as_tensor(), kv_.as_tensor(), vv.as_tensor());
                let y = if bf16 {
                    rope_attention_bf16(qt, kt, vt, &cos, &sin, &bias, (h, kv), 0.35).unwrap()
                } else {
                    rope_attention_composed(qt, kt, vt, &cos, &sin, &bias, (h, kv), 0.35).unwrap()
                };
                assert_eq!(y.dtype(), if bf16 { DType::BF16 } else { DType::F32 });
                let y = y.to_dtype(DType::F32).unwrap();
                let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let mut out = vec![y];
                for x in &vars {
                    let g = grads.get(x.as_tensor()).unwrap();
                    assert_eq!(g.dtype(), DType::F32);
                    out.push(g.clone());
                }
                out
            };
            let (f32s, bf16s) = (run(false), {
                let _autocast = crate::autocast_composed_scope();
                run(true)
            });
            for (i, (a, e)) in bf16s.iter().zip(&f32s).enumerate() {
                let scale =
                    e.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                let rel = max_diff(a, e) / scale;
                assert!(rel > 0.0 && rel < 2e-2, "tensor {i} ({b}, {t}, {h}, {kv}, {d}): relative {rel}");
            }
        }
    }

    /// Outputs and the gradients of q, k and v equal the composed path's to rounding: grouped
    /// (3 query heads per key head, as SmolLM2), multi-head, a left-padded row (a fully masked
    /// query row takes the uniform distribution in both), odd lengths.
    #[test]
    fn matches_the_composed_attention_and_its_gradients() {
        for (b, t, h, kv, d, pad) in
            [(2, 7, 6, 2, 8, 2), (1, 5, 4, 4, 6, 0), (3, 11, 3, 1, 4, 3), (2, 1, 2, 1, 4, 0)]
        {
            let seed = (b * 100 + t * 10 + h) as u64;
            let q = Var::from_tensor(&randn(&[b, t, h * d], seed)).unwrap();
            let k = Var::from_tensor(&randn(&[b, t, kv * d], seed + 1)).unwrap();
            let v = Var::from_tensor(&randn(&[b, t, kv * d], seed + 2)).unwrap();
            let (cos, sin) = angles(b, t, d / 2);
            // The first row is left-padded.
            let mask: Vec<Vec<u8>> =
                (0..b).map(|r| (0..t).map(|j| u8::from(r > 0 || j >= pad)).collect()).collect();
            let bias = crate::causal_bias(&mask, t, DType::F32, &Device::Cpu).unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let g = randn(&[b, t, h * d], seed + 3);
            let run = |fused: bool| {
                let f = if fused { rope_attention } else { rope_attention_composed };
                let y = f(&q, &k, &v, &cos, &sin, &bias, (h, kv), scale).unwrap();
                let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let grad = |x: &Var| grads.get(x.as_tensor()).unwrap().clone();
                (y, grad(&q), grad(&k), grad(&v))
            };
            let (fused, composed) = (run(true), run(false));
            assert!(rope_attention_takes(&q, &k, &cos, &bias));
            for (name, a, b) in [
                ("y", &fused.0, &composed.0),
                ("dq", &fused.1, &composed.1),
                ("dk", &fused.2, &composed.2),
                ("dv", &fused.3, &composed.3),
            ] {
                let diff = max_diff(a, b);
                assert!(diff < 2e-6, "{name} (b {b}, t {t}, h {h}, kv {kv}): max diff {diff}");
            }
        }
    }

    /// In f64 the fused op is the composed one to 1e-10, values and every gradient, and its
    /// gradients are the finite differences' (grouped heads, a padded row).
    #[test]
    fn f64_gradients_match_the_composed_op_and_finite_differences() {
        use crate::testutil::{check, fd_check};
        let (b, t, h, kv, d) = (2, 5, 4, 2, 4);
        let (cos, sin) = angles(b, t, d / 2);
        let (cos, sin) = (cos.to_dtype(DType::F64).unwrap(), sin.to_dtype(DType::F64).unwrap());
        let shapes: [&[usize]; 3] = [&[b, t, h * d], &[b, t, kv * d], &[b, t, kv * d]];
        type Attention =
            fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Tensor, (usize, usize), f64) -> CResult<Tensor>;
        let with = |f: Attention, mask: &[Vec<u8>]| {
            let bias = crate::causal_bias(mask, t, DType::F64, &Device::Cpu).unwrap();
            let (cos, sin) = (cos.clone(), sin.clone());
            move |x: &[Tensor]| f(&x[0], &x[1], &x[2], &cos, &sin, &bias, (h, kv), 0.5).unwrap()
        };
        let padded = [vec![0, 1, 1, 1, 1], vec![1; 5]];
        check(&shapes, with(rope_attention, &padded), with(rope_attention_composed, &padded));
        // Without padding: a fully masked query row's scores sit at −10⁹, where a step of 10⁻⁵
        // is below f64's resolution and finite differences lose their digits.
        fd_check(&shapes, with(rope_attention, &[vec![1; 5], vec![1; 5]]));
    }

    /// Shapes that do not fit are refused, naming them.
    #[test]
    fn refuses_heads_that_do_not_split() {
        let (cos, sin) = angles(1, 3, 2);
        let bias = crate::causal_bias(&[vec![1; 3]], 3, DType::F32, &Device::Cpu).unwrap();
        let (q, k) = (randn(&[1, 3, 12], 1), randn(&[1, 3, 8], 2));
        let err = rope_attention(&q, &k, &k, &cos, &sin, &bias, (3, 2), 0.5).unwrap_err().to_string();
        assert!(err.contains("do not split evenly"), "{err}");
    }
}
