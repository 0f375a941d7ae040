//! Matrix products and linear layers on the SGEMM of `ops/gemm`, with backward passes that reuse it.
//!
//! [`linear`] is `y = x·Wᵀ + b` for nn.Linear's `W (out, in)`; [`linear_in_out`] is
//! `y = x·W + b` for GPT-2's Conv1D `W (in, out)`; [`matmul`] is a 2-D `A·B`. The bias is
//! added in the GEMM's epilogue (no broadcast add, no `(rows, out)` temporary), and the
//! backward reads `dyᵀ`, `xᵀ` and `W` in place, as strided views, instead of copying them:
//!
//! | y | dx | dW | db |
//! |---|---|---|---|
//! | `x·Wᵀ + b` | `dy·W` | `dyᵀ·x` | `Σ_rows dy` |
//! | `x·W + b` | `dy·Wᵀ` | `xᵀ·dy` | `Σ_rows dy` |
//!
//! f32 runs on the SGEMM of `ops/gemm` where the CPU has AVX-512 or AVX2. f64, and f32 on other CPUs, run
//! candle's own CPU matmul on the same strided views (f64 so the tests can check gradients
//! by finite differences). Other devices use the composed candle ops.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use rayon::prelude::*;

use super::gemm::{self, MatRef};
use super::grad_sink::{GradSlot, Sinks};
use super::{contiguous, unsupported, CResult, Elem};

/// How a linear layer stores its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightLayout {
    /// nn.Linear: `(out, in)`, `y = x·Wᵀ`.
    OutIn,
    /// GPT-2's Conv1D: `(in, out)`, `y = x·W`.
    InOut,
}

/// The `(rows, cols)` of a rank-2 layout, or an error naming `op`.
fn dims2(l: &Layout, op: &'static str) -> CResult<(usize, usize)> {
    match l.dims() {
        &[r, c] => Ok((r, c)),
        d => candle_core::bail!("{op}: expected a matrix, got shape {d:?}"),
    }
}

/// `a·b (+ bias)` for rank-2 operands with any strides; `c` comes back contiguous `(m, n)`.
pub(super) fn cpu_gemm(
    (sa, la): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
    bias: Option<(&CpuStorage, &Layout)>,
    op: &'static str,
) -> CResult<(CpuStorage, Shape)> {
    let (m, k) = dims2(la, op)?;
    let (k2, n) = dims2(lb, op)?;
    if k != k2 {
        candle_core::bail!("{op}: shapes ({m}, {k}) and ({k2}, {n}) do not multiply");
    }
    if let Some((_, lbias)) = bias {
        if lbias.dims() != [n] {
            candle_core::bail!("{op}: bias of shape {:?} for {n} outputs", lbias.dims());
        }
    }
    match (sa, sb) {
        (CpuStorage::F32(a), CpuStorage::F32(b)) if gemm::fast_available() => {
            let view = |data, l: &Layout, rows, cols| {
                let s = l.stride();
                MatRef { data, off: l.start_offset(), rows, cols, rs: s[0], cs: s[1] }
            };
            let bias = bias.map(|(s, l)| contiguous::<f32>(s, l, op)).transpose()?;
            let c = gemm::sgemm_new(view(a, la, m, k), view(b, lb, k, n), bias);
            Ok((CpuStorage::F32(c), (m, n).into()))
        }
        _ => {
            let c = sa.matmul(sb, (1, m, n, k), la, lb)?;
            let c = match (c, bias) {
                (c, None) => c,
                (CpuStorage::F32(c), Some((s, l))) => CpuStorage::F32(add_rows(c, contiguous(s, l, op)?)),
                (CpuStorage::F64(c), Some((s, l))) => CpuStorage::F64(add_rows(c, contiguous(s, l, op)?)),
                (c, Some(_)) => return Err(unsupported(op, c.dtype())),
            };
            Ok((c, (m, n).into()))
        }
    }
}

/// Adds `bias` to every row of `c`.
fn add_rows<T: Elem>(mut c: Vec<T>, bias: &[T]) -> Vec<T> {
    for row in c.chunks_mut(bias.len().max(1)) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
    c
}

/// The product of two matrices, differentiable; also the backward's workhorse (applied
/// without a graph there).
struct Gemm;

impl CustomOp2 for Gemm {
    fn name(&self) -> &'static str {
        "rltune-gemm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        cpu_gemm((s1, l1), (s2, l2), None, "gemm")
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _c: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(gemm_no_bwd(g, &b.t()?)?), Some(gemm_no_bwd(&a.t()?, g)?)))
    }
}

pub(super) fn gemm_no_bwd(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    a.apply_op2_no_bwd(b, &Gemm)
}

/// The gradient `a·b` of weight `w`: written into `w`'s gradient sink when it has one (`None`
/// is then candle's share), else the product. `None` for a frozen weight (no variable behind it,
/// e.g. a LoRA base): nothing reads its gradient, so the product is not computed.
pub(super) fn weight_grad(sinks: &Sinks, w: &Tensor, a: &Tensor, b: &Tensor) -> CResult<Option<Tensor>> {
    if !w.track_op() {
        return Ok(None);
    }
    if sinks.gemm_into(w, a, b)? {
        return Ok(None);
    }
    sinks.give(w, gemm_no_bwd(a, b)?)
}

/// `y = x·W (+ b)` with `W` read through `layout`; inputs `x (rows, in)`, `W`, `b (out)`; the
/// backward writes the weight's and bias's gradients into `sinks` where they have one.
struct LinearOp {
    layout: WeightLayout,
    sinks: Sinks,
}

impl LinearOp {
    /// `W` as the `(in, out)` right operand: a transposed view for nn.Linear.
    fn rhs_layout(&self, l: &Layout) -> CResult<Layout> {
        match self.layout {
            WeightLayout::OutIn => l.transpose(0, 1),
            WeightLayout::InOut => Ok(l.clone()),
        }
    }

    fn rhs(&self, w: &Tensor) -> CResult<Tensor> {
        match self.layout {
            WeightLayout::OutIn => w.t(),
            WeightLayout::InOut => Ok(w.clone()),
        }
    }

    /// `(dx, dW)` for upstream gradient `g (rows, out)`; `dW` is `None` when it went into the
    /// weight's gradient sink.
    fn grads(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> CResult<(Tensor, Option<Tensor>)> {
        // `dx` reads W, so it comes first: the weight-gradient product may update W in place
        // (an armed gradient sink, see `grad_sink`).
        let dx = gemm_no_bwd(g, &self.rhs(w)?.t()?)?;
        let (a, b) = match self.layout {
            WeightLayout::OutIn => (g.t()?, x.clone()),
            WeightLayout::InOut => (x.t()?, g.clone()),
        };
        Ok((dx, weight_grad(&self.sinks, w, &a, &b)?))
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "rltune-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        cpu_gemm((s1, l1), (s2, &self.rhs_layout(l2)?), None, "linear")
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.grads(x, w, g)?;
        Ok((Some(dx), dw))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "rltune-linear-bias"
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
        cpu_gemm((s1, l1), (s2, &self.rhs_layout(l2)?), Some((s3, l3)), "linear")
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.grads(x, w, g)?;
        let db = self.sinks.give(b, g.contiguous()?.apply_op1_no_bwd(&ColumnSum)?)?;
        Ok((Some(dx), dw, db))
    }
}

/// `(rows, n) -> (n)`: the sum over rows (a bias gradient).
struct ColumnSum;

/// The sum over the rows of `g (rows, n)` (no graph; CPU, f32 or f64).
pub(super) fn column_sum_of(g: &Tensor) -> CResult<Tensor> {
    g.contiguous()?.apply_op1_no_bwd(&ColumnSum)
}

fn column_sum<T: Elem>(s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
    let (_, n) = dims2(l, "column-sum")?;
    let g = contiguous::<T>(s, l, "column-sum")?;
    let n1 = n.max(1);
    let rows = g.len() / n1;
    let sum_rows = |g: &[T]| {
        let mut acc = vec![T::zero(); n];
        for row in g.chunks_exact(n1) {
            for (o, &v) in acc.iter_mut().zip(row) {
                *o += v;
            }
        }
        acc
    };
    // Chunks of rows in parallel (each streamed in order), then their partial sums added in
    // chunk order: the bias gradients ran on the calling thread while the other cores idled.
    // The chunks depend on the shape only, so the sums are the same on any number of threads.
    let out = if g.len() >= 1 << 15 {
        let per = rows.div_ceil(32).max(8);
        let partials: Vec<Vec<T>> = g.par_chunks(per * n1).map(sum_rows).collect();
        let mut out = vec![T::zero(); n];
        for p in partials {
            out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
        }
        out
    } else {
        sum_rows(g)
    };
    Ok((T::to_cpu_storage_owned(out), n.into()))
}

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "rltune-column-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, "column-sum", column_sum(s, l))
    }
}

/// `(…, in)` as `(rows, in)`, and the output shape `(…, out)`.
fn flatten_rows(x: &Tensor, d_out: usize) -> CResult<(Tensor, Vec<usize>)> {
    let mut dims = x.dims().to_vec();
    let d_in = dims.last().copied().unwrap_or(1);
    let x2 = if x.rank() == 2 { x.clone() } else { x.reshape((x.elem_count() / d_in.max(1), d_in))? };
    match dims.last_mut() {
        Some(last) => *last = d_out,
        None => candle_core::bail!("linear: input is a scalar"),
    }
    Ok((x2, dims))
}

fn apply_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    layout: WeightLayout,
    grads: &GradSlot,
) -> CResult<Tensor> {
    let d_out = match layout {
        WeightLayout::OutIn => w.dim(0)?,
        WeightLayout::InOut => w.dim(1)?,
    };
    let (x2, out_dims) = flatten_rows(x, d_out)?;
    let op = LinearOp { layout, sinks: grads.sinks() };
    let y = match bias {
        Some(b) => x2.apply_op3(w, b, op)?,
        None => x2.apply_op2(w, op)?,
    };
    y.reshape(out_dims)
}

/// nn.Linear: `(…, in) -> (…, out)`, `y = x·Wᵀ + b` for `W (out, in)` and `b (out)`; the
/// weights' gradients go to candle's store ([`linear_with`] writes them where a slot says).
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> CResult<Tensor> {
    linear_with(x, w, bias, &GradSlot::new())
}

/// [`linear`], whose backward writes the gradients of `w` and `bias` into the buffers `grads`
/// points at when its forward runs (see [`GradSlot`]).
pub fn linear_with(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, grads: &GradSlot) -> CResult<Tensor> {
    let mut ts = vec![x, w];
    ts.extend(bias);
    if super::fused_cpu(&ts) {
        apply_linear(x, w, bias, WeightLayout::OutIn, grads)
    } else {
        linear_composed(x, w, bias)
    }
}

/// GPT-2's Conv1D: `(…, in) -> (…, out)`, `y = x·W + b` for `W (in, out)` and `b (out)`.
pub fn linear_in_out(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> CResult<Tensor> {
    linear_in_out_with(x, w, bias, &GradSlot::new())
}

/// [`linear_in_out`] with the weights' gradients written where `grads` points ([`linear_with`]).
pub fn linear_in_out_with(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    grads: &GradSlot,
) -> CResult<Tensor> {
    let mut ts = vec![x, w];
    ts.extend(bias);
    if super::fused_cpu(&ts) {
        apply_linear(x, w, bias, WeightLayout::InOut, grads)
    } else {
        linear_in_out_composed(x, w, bias)
    }
}

/// A LoRA linear layer as one graph node: `y = x·W (+ b) + s·(x·Aᵀ)·Bᵀ`, with `W` read through
/// the layout, `A (r, in)`, `B (out, r)` and the bias packed into one vector (the third input,
/// a concatenation whose backward hands each part its gradient).
///
/// Composed, the adapter kept three more `(rows, out)` tensors alive per layer for the backward
/// (`x·Aᵀ·Bᵀ`, its scaled copy and the base output under the sum); here only `x` and the output
/// are, and `x·Aᵀ` (`(rows, r)`) is recomputed in the backward. A frozen `W` gets no product.
struct LoraLinearOp {
    layout: WeightLayout,
    r: usize,
    d_in: usize,
    d_out: usize,
    bias: bool,
    scaling: f64,
}

impl LoraLinearOp {
    /// The base layer's op. Its weight is frozen under an adapter (no product is computed for
    /// it); were it tracked, its gradient would go to candle's store.
    fn base(&self) -> LinearOp {
        LinearOp { layout: self.layout, sinks: Sinks::default() }
    }

    fn pack_len(&self) -> usize {
        self.r * self.d_in + self.d_out * self.r + if self.bias { self.d_out } else { 0 }
    }

    /// `(A, B, bias)` as tensors viewing `pack`.
    fn split(&self, pack: &Tensor) -> CResult<(Tensor, Tensor, Option<Tensor>)> {
        let (r, i, o) = (self.r, self.d_in, self.d_out);
        let a = pack.narrow(0, 0, r * i)?.reshape((r, i))?;
        let b = pack.narrow(0, r * i, o * r)?.reshape((o, r))?;
        let bias = self.bias.then(|| pack.narrow(0, r * i + o * r, o)).transpose()?;
        Ok((a, b, bias))
    }
}

/// `y += s·d`, elementwise.
fn add_scaled(y: CpuStorage, d: CpuStorage, s: f64, op: &'static str) -> CResult<CpuStorage> {
    Ok(match (y, d) {
        (CpuStorage::F32(mut y), CpuStorage::F32(d)) => {
            let s = s as f32;
            y.par_chunks_mut(4096).zip(d.par_chunks(4096)).for_each(|(y, d)| {
                y.iter_mut().zip(d).for_each(|(y, d)| *y += s * d);
            });
            CpuStorage::F32(y)
        }
        (CpuStorage::F64(mut y), CpuStorage::F64(d)) => {
            y.iter_mut().zip(&d).for_each(|(y, d)| *y += s * d);
            CpuStorage::F64(y)
        }
        (y, _) => return Err(unsupported(op, y.dtype())),
    })
}

impl CustomOp3 for LoraLinearOp {
    fn name(&self) -> &'static str {
        "rltune-lora-linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sp: &CpuStorage,
        lp: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        const OP: &str = "lora linear";
        let (r, i, o) = (self.r, self.d_in, self.d_out);
        if lp.dims() != [self.pack_len()] || !lp.is_contiguous() {
            candle_core::bail!("{OP}: adapter pack {:?} is not ({},) contiguous", lp.dims(), self.pack_len());
        }
        let at = lp.start_offset();
        // Aᵀ (in, r) and Bᵀ (r, out) as strided views of A (r, in) and B (out, r).
        let a_t = Layout::new((i, r).into(), vec![1, i], at);
        let b_t = Layout::new((r, o).into(), vec![1, r], at + r * i);
        let bias = Layout::contiguous_with_offset(o, at + r * i + o * r);
        let w = self.base().rhs_layout(lw)?;
        let (h, _) = cpu_gemm((sx, lx), (sp, &a_t), None, OP)?;
        let (y, shape) = cpu_gemm((sx, lx), (sw, &w), self.bias.then_some((sp, &bias)), OP)?;
        let h_layout = Layout::contiguous(shape_of(lx, r)?);
        let (d, _) = cpu_gemm((&h, &h_layout), (sp, &b_t), None, OP)?;
        Ok((add_scaled(y, d, self.scaling, OP)?, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        pack: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (a, b, bias) = self.split(pack)?;
        let s = self.scaling;
        // Through the adapter: h = x·Aᵀ (recomputed), dh = s·g·B, dA = dhᵀ·x, dB = s·gᵀ·h.
        let h = gemm_no_bwd(x, &a.t()?)?;
        let dh = (gemm_no_bwd(g, &b)? * s)?;
        let (dx, dw) = self.base().grads(x, w, g)?;
        let dx = (dx + gemm_no_bwd(&dh, &a)?)?;
        if !pack.track_op() {
            return Ok((Some(dx), dw, None));
        }
        let da = gemm_no_bwd(&dh.t()?, x)?;
        let db = (gemm_no_bwd(&g.t()?, &h)? * s)?;
        let mut parts = vec![da.flatten_all()?, db.flatten_all()?];
        if bias.is_some() {
            parts.push(column_sum_of(g)?);
        }
        Ok((Some(dx), dw, Some(Tensor::cat(&parts, 0)?)))
    }
}

/// The `(rows, cols)` shape for the rows of a `(rows, in)` layout.
fn shape_of(l: &Layout, cols: usize) -> CResult<Shape> {
    let (rows, _) = dims2(l, "lora linear")?;
    Ok((rows, cols).into())
}

/// nn.Linear with a LoRA adapter: `(…, in) -> (…, out)`,
/// `y = x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ` for `W (out, in)`, `A (r, in)`, `B (out, r)`. On the CPU
/// one fused node (see `LoraLinearOp`: no `(rows, out)` intermediates kept for the backward,
/// no product for a frozen `W`); elsewhere the composed ops.
pub fn linear_lora(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
) -> CResult<Tensor> {
    apply_lora(x, w, bias, a, b, scaling, WeightLayout::OutIn)
}

/// [`linear_lora`] for GPT-2's Conv1D, `W (in, out)`: `y = x·W + b + scaling·(x·Aᵀ)·Bᵀ`.
pub fn linear_in_out_lora(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
) -> CResult<Tensor> {
    apply_lora(x, w, bias, a, b, scaling, WeightLayout::InOut)
}

fn apply_lora(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    layout: WeightLayout,
) -> CResult<Tensor> {
    let (r, d_in) = a.dims2()?;
    let (d_out, r2) = b.dims2()?;
    let mut ts = vec![x, w, a, b];
    ts.extend(bias);
    if !super::fused_cpu(&ts) || r != r2 {
        let y = match layout {
            WeightLayout::OutIn => linear(x, w, bias)?,
            WeightLayout::InOut => linear_in_out(x, w, bias)?,
        };
        let delta = (linear(&linear(x, a, None)?, b, None)? * scaling)?;
        return y + delta;
    }
    let mut parts = vec![a.flatten_all()?, b.flatten_all()?];
    parts.extend(bias.cloned());
    let pack = Tensor::cat(&parts, 0)?;
    let (x2, out_dims) = flatten_rows(x, d_out)?;
    let op = LoraLinearOp { layout, r, d_in, d_out, bias: bias.is_some(), scaling };
    x2.apply_op3(w, &pack, op)?.reshape(out_dims)
}

/// `a (…, m, k) · b (…, k, n)`, differentiable; either operand may be a strided view (`.t()`).
/// Two f32 matrices on the CPU take the fused SGEMM; everything else candle's matmul, in bf16
/// off the CPU where [`crate::set_device_matmul_precision`] asks for it (autocast: the result
/// comes back as f32).
pub fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    if super::fused_cpu(&[a, b]) && a.rank() == 2 && b.rank() == 2 {
        a.apply_op2(b, Gemm)
    } else {
        candle_matmul(a, b)
    }
}

/// `a · wᵀ` for a weight `w (out, in)`: [`matmul`]`(a, wᵀ)`, except that off the CPU, inside a
/// [`weight_cast_scope`], the bf16 copy of `w` that autocast reads is made once per scope.
pub fn matmul_weight_t(a: &Tensor, w: &Tensor) -> CResult<Tensor> {
    matmul(a, &autocast_weight(w)?.t()?)
}

/// Whether products on `t`'s device run in bf16 for f32 operands (autocast): off the CPU under
/// [`MatmulPrecision::Bf16`](crate::MatmulPrecision), or anywhere in an
/// [`autocast_composed_scope`].
pub(crate) fn autocast(t: &Tensor) -> bool {
    t.dtype() == DType::F32
        && ((!t.device().is_cpu() && super::gemm::device_matmul_precision() == super::MatmulPrecision::Bf16)
            || AUTOCAST_ON_CPU.with(|c| c.get()))
}

/// Whether bf16 activations are on (process-wide; see [`set_bf16_activations`]).
static BF16_ACTIVATIONS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Process-wide: under autocast, whether a product whose result goes straight into another
/// product through an op with a bf16 twin hands that result on in bf16 instead of casting it to
/// f32 and back (on by default; `[runtime] activations = "f32"` turns it off, to measure it).
/// Today that is Llama's MLP: `down(swiglu(gate(x), up(x)))` keeps `gate`, `up` and the SwiGLU in
/// bf16, as `torch.autocast` does, and computes the same values as with it off (each SwiGLU
/// value is computed in f32 and rounded once, where the f32 path rounded it in the down
/// product's cast), while keeping a third of the bytes for the backward and four fewer casts.
/// Returns the setting it replaces.
pub fn set_bf16_activations(on: bool) -> bool {
    BF16_ACTIVATIONS.swap(on, std::sync::atomic::Ordering::Relaxed)
}

/// Whether products of `x` under autocast hand on bf16 activations ([`set_bf16_activations`]):
/// autocast applies to `x` and the switch is on.
pub fn bf16_activations(x: &Tensor) -> bool {
    autocast(x) && BF16_ACTIVATIONS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether attention's products run in bf16 under autocast (process-wide; see
/// [`set_bf16_attention`]).
static BF16_ATTENTION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Process-wide: under autocast, whether attention's two products run as autocast runs every
/// product, in bf16 on the tensor cores (candle's batched products: cuBLAS), with the masked
/// softmax's bf16 kernel between them ([`crate::rope_attention_bf16`]), instead of rltune's fused
/// attention kernels, whose products are f32. Off by default (`[runtime] attention = "bf16"`
/// turns it on) until a GPU has timed it. Unlike [`set_bf16_activations`] it changes values, at
/// bf16's precision, as `torch.autocast` does. Returns the setting it replaces.
pub fn set_bf16_attention(on: bool) -> bool {
    BF16_ATTENTION.swap(on, std::sync::atomic::Ordering::Relaxed)
}

/// Whether attention over `q` runs its products in bf16 ([`set_bf16_attention`]): autocast
/// applies to `q` and the switch is on.
pub fn bf16_attention(q: &Tensor) -> bool {
    autocast(q) && BF16_ATTENTION.load(std::sync::atomic::Ordering::Relaxed)
}

std::thread_local! {
    /// Set by an [`AutocastComposedScope`]: the CPU takes autocast's bf16 products.
    static AUTOCAST_ON_CPU: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, this thread runs the GPU's bf16 autocast path on the CPU: every op takes its
/// composed candle form (as in a [`crate::composed_scope`]) and f32 products run in bf16 as under
/// [`MatmulPrecision::Bf16`](crate::MatmulPrecision) on a GPU. For tests of what autocast feeds
/// where, on a machine without a GPU.
#[doc(hidden)]
pub struct AutocastComposedScope {
    _composed: super::ComposedScope,
    was: bool,
}

impl Drop for AutocastComposedScope {
    fn drop(&mut self) {
        AUTOCAST_ON_CPU.with(|c| c.set(self.was));
    }
}

/// Starts an [`AutocastComposedScope`] on this thread.
#[doc(hidden)]
pub fn autocast_composed_scope() -> AutocastComposedScope {
    let composed = super::composed_scope();
    AutocastComposedScope { _composed: composed, was: AUTOCAST_ON_CPU.with(|c| c.replace(true)) }
}

/// candle's matmul, with bf16 inputs under autocast ([`autocast`]; see
/// [`crate::set_device_matmul_precision`]): an f32 left operand is cast and the result cast back
/// to f32; a bf16 left operand (a bf16 activation, [`bf16_activations`]) keeps its bf16 result.
/// The casts are differentiable ops, so the gradients come back to the f32 operands as f32. A
/// right operand already in bf16 (a weight cast once by [`autocast_weight`]) is taken as it is;
/// an f32 one beside a bf16 left operand is cast.
fn candle_matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    if autocast(a) && matches!(b.dtype(), DType::F32 | DType::BF16) {
        a.to_dtype(DType::BF16)?.matmul(&b.to_dtype(DType::BF16)?)?.to_dtype(DType::F32)
    } else if a.dtype() == DType::BF16 && b.dtype() == DType::F32 {
        rows_contiguous(a)?.matmul(&b.to_dtype(DType::BF16)?)
    } else {
        rows_contiguous(a)?.matmul(b)
    }
}

std::thread_local! {
    /// The bf16 copies of weights made in this thread's [`weight_cast_scope`], by weight; `None`
    /// outside a scope.
    static WEIGHT_CASTS: std::cell::RefCell<Option<std::collections::HashMap<candle_core::TensorId, Tensor>>> =
        const { std::cell::RefCell::new(None) };
}

/// While alive, each weight that a product reads under autocast off the CPU is cast to bf16 once
/// and the copy reused, as torch's autocast caches the casts of leaf tensors in an autocast
/// region. The copies are detached: a product in the scope gives its weights no gradient. Hold
/// it only where the weights neither change nor train: rltune holds it for one call of sampling
/// (`generation::generate`). Scopes nest; the copies are dropped when the outermost one is.
pub struct WeightCastScope {
    outermost: bool,
}

/// Whether a [`WeightCastScope`] is open in this thread: nothing trains here (sampling).
pub(crate) fn in_weight_cast_scope() -> bool {
    WEIGHT_CASTS.with(|c| c.borrow().is_some())
}

/// Opens a [`WeightCastScope`] in this thread.
pub fn weight_cast_scope() -> WeightCastScope {
    let outermost = WEIGHT_CASTS.with(|c| {
        let mut c = c.borrow_mut();
        let fresh = c.is_none();
        if fresh {
            *c = Some(Default::default());
        }
        fresh
    });
    WeightCastScope { outermost }
}

impl Drop for WeightCastScope {
    fn drop(&mut self) {
        if self.outermost {
            WEIGHT_CASTS.with(|c| *c.borrow_mut() = None);
        }
    }
}

/// The weight `w` as a product reads it: inside a [`weight_cast_scope`] and under autocast, its
/// bf16 copy (made on first use); otherwise `w` itself (the product casts it, differentiably).
fn autocast_weight(w: &Tensor) -> CResult<Tensor> {
    if !autocast(w) {
        return Ok(w.clone());
    }
    cached_bf16(w)
}

/// `w` in bf16 from this thread's scope's copies (made on a miss); `w` itself outside a scope.
fn cached_bf16(w: &Tensor) -> CResult<Tensor> {
    WEIGHT_CASTS.with(|c| {
        let mut c = c.borrow_mut();
        let Some(casts) = c.as_mut() else { return Ok(w.clone()) };
        if let Some(hit) = casts.get(&w.id()) {
            return Ok(hit.clone());
        }
        let cast = w.detach().to_dtype(DType::BF16)?;
        casts.insert(w.id(), cast.clone());
        Ok(cast)
    })
}

/// `x`, copied to a contiguous layout off the CPU: candle's CUDA matmul takes no left operand
/// whose rows are further apart than their length (e.g. the first position of every sequence,
/// `hidden.i((.., 0))`, which BERT's pooler multiplies). On the CPU, `x` as it is.
fn rows_contiguous(x: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// [`linear`] from candle's matmul and broadcast add.
pub fn linear_composed(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> CResult<Tensor> {
    in_out_composed(x, &autocast_weight(w)?.t()?, bias)
}

/// [`linear_in_out`] from candle's matmul and broadcast add.
pub fn linear_in_out_composed(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> CResult<Tensor> {
    in_out_composed(x, &autocast_weight(w)?, bias)
}

/// `x·W (+ b)` from candle's matmul and broadcast add, `W` as the product reads it.
fn in_out_composed(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> CResult<Tensor> {
    let (x2, out_dims) = flatten_rows(x, w.dim(1)?)?;
    let y = candle_matmul(&x2, w)?;
    let y = match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
        None => y,
    };
    y.reshape(out_dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check, fd_check, max_diff, randn};
    use candle_core::Device;

    #[test]
    fn column_sum_in_parallel_row_chunks_matches_the_f64_sum() {
        // 300 × 130 (39 000 values) takes the parallel path, with a partial last chunk.
        for (rows, cols) in [(300, 130), (3, 5)] {
            let g = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)
                .unwrap()
                .affine(0.37, -11.0)
                .unwrap()
                .sin()
                .unwrap()
                .reshape((rows, cols))
                .unwrap();
            let v = g.to_vec2::<f32>().unwrap();
            let want: Vec<f64> = (0..cols).map(|j| v.iter().map(|r| r[j] as f64).sum()).collect();
            let got = column_sum_of(&g).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got.len(), cols);
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-4, "{g} against {w}");
            }
            // The same bits on any number of threads (runs stay reproducible across machines).
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let on = pool.install(|| column_sum_of(&g).unwrap().to_vec1::<f32>().unwrap());
                assert_eq!(on, got, "{threads} threads");
            }
        }
    }

    /// Autocast's products (the GPU's bf16 path, run on the CPU): an f32 activation comes back
    /// f32, a bf16 one stays bf16; either way the f32 weight's gradient is f32, and a bf16
    /// activation's is bf16. Both round the same products the same way.
    #[test]
    fn autocast_products_keep_a_bf16_activation_in_bf16() {
        let (x, w, b) = (randn(&[2, 3, 8], 1), randn(&[5, 8], 2), randn(&[5], 3));
        let (x, w, b) = (
            x.to_dtype(DType::F32).unwrap(),
            w.to_dtype(DType::F32).unwrap(),
            b.to_dtype(DType::F32).unwrap(),
        );
        let _autocast = autocast_composed_scope();
        let run = |x: &Tensor| {
            let (xv, wv) =
                (candle_core::Var::from_tensor(x).unwrap(), candle_core::Var::from_tensor(&w).unwrap());
            let y = linear(xv.as_tensor(), wv.as_tensor(), Some(&b)).unwrap();
            let grads = y.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let (dx, dw) =
                (grads.get(xv.as_tensor()).unwrap().clone(), grads.get(wv.as_tensor()).unwrap().clone());
            (y, dx, dw)
        };
        let (y32, dx32, dw32) = run(&x);
        let (y16, dx16, dw16) = run(&x.to_dtype(DType::BF16).unwrap());
        assert_eq!((y32.dtype(), dx32.dtype(), dw32.dtype()), (DType::F32, DType::F32, DType::F32));
        assert_eq!((y16.dtype(), dx16.dtype(), dw16.dtype()), (DType::BF16, DType::BF16, DType::F32));
        assert_eq!(y32.dims(), [2, 3, 5]);
        // The bias is added after the product: in f32 on the f32 path, in bf16 on the other.
        assert!(max_diff(&y16.to_dtype(DType::F32).unwrap(), &y32) < 0.1);
        let scale =
            dw32.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() as f64;
        assert!(max_diff(&dw16, &dw32) < 0.05 * scale, "{} against {scale}", max_diff(&dw16, &dw32));
    }

    #[test]
    fn linear_matches_composed() {
        let with_bias = |t: &[Tensor]| linear(&t[0], &t[1], Some(&t[2])).unwrap();
        let composed = |t: &[Tensor]| linear_composed(&t[0], &t[1], Some(&t[2])).unwrap();
        check(&[&[2, 3, 5], &[7, 5], &[7]], with_bias, composed);
        check(
            &[&[4, 5], &[7, 5]],
            |t| linear(&t[0], &t[1], None).unwrap(),
            |t| linear_composed(&t[0], &t[1], None).unwrap(),
        );
        fd_check(&[&[2, 3, 4], &[3, 4], &[3]], with_bias);
    }

    #[test]
    fn linear_in_out_matches_composed() {
        let with_bias = |t: &[Tensor]| linear_in_out(&t[0], &t[1], Some(&t[2])).unwrap();
        let composed = |t: &[Tensor]| linear_in_out_composed(&t[0], &t[1], Some(&t[2])).unwrap();
        check(&[&[2, 3, 5], &[5, 7], &[7]], with_bias, composed);
        fd_check(&[&[3, 4], &[4, 3], &[3]], with_bias);
        fd_check(&[&[2, 4], &[4, 3]], |t| linear_in_out(&t[0], &t[1], None).unwrap());
    }

    /// The fused LoRA layer against `linear(x, W, b) + s·linear(linear(x, A), B)`: values and the
    /// gradients of x, W, A, B and the bias, for both weight layouts, with and without a bias;
    /// finite differences too. A frozen W gets no gradient and the rest still do.
    #[test]
    fn lora_linear_matches_composed() {
        let composed = |t: &[Tensor], layout: WeightLayout| {
            let y = match layout {
                WeightLayout::OutIn => linear(&t[0], &t[1], t.get(4)).unwrap(),
                WeightLayout::InOut => linear_in_out(&t[0], &t[1], t.get(4)).unwrap(),
            };
            (y + (linear(&linear(&t[0], &t[2], None).unwrap(), &t[3], None).unwrap() * 0.7).unwrap()).unwrap()
        };
        let fused = |t: &[Tensor], layout: WeightLayout| {
            apply_lora(&t[0], &t[1], t.get(4), &t[2], &t[3], 0.7, layout).unwrap()
        };
        check(
            &[&[2, 3, 5], &[4, 5], &[2, 5], &[4, 2], &[4]],
            |t| fused(t, WeightLayout::OutIn),
            |t| composed(t, WeightLayout::OutIn),
        );
        check(
            &[&[3, 5], &[5, 4], &[3, 5], &[4, 3]],
            |t| fused(t, WeightLayout::InOut),
            |t| composed(t, WeightLayout::InOut),
        );
        check(
            &[&[3, 5], &[5, 4], &[3, 5], &[4, 3], &[4]],
            |t| fused(t, WeightLayout::InOut),
            |t| composed(t, WeightLayout::InOut),
        );
        fd_check(&[&[3, 4], &[3, 4], &[2, 4], &[3, 2], &[3]], |t| fused(t, WeightLayout::OutIn));
        // A frozen base weight: no gradient for it, the adapter's and the input's as composed.
        let x = candle_core::Var::from_tensor(&randn(&[3, 4], 1)).unwrap();
        let w = randn(&[5, 4], 2);
        let a = candle_core::Var::from_tensor(&randn(&[2, 4], 3)).unwrap();
        let b = candle_core::Var::from_tensor(&randn(&[5, 2], 4)).unwrap();
        let proj = randn(&[3, 5], 5);
        let grads = |y: Tensor| (y * &proj).unwrap().sum_all().unwrap().backward().unwrap();
        let got = grads(linear_lora(x.as_tensor(), &w, None, a.as_tensor(), b.as_tensor(), 0.7).unwrap());
        let want = grads(composed(
            &[x.as_tensor().clone(), w.clone(), a.as_tensor().clone(), b.as_tensor().clone()],
            WeightLayout::OutIn,
        ));
        assert!(got.get(&w).is_none());
        for v in [&x, &a, &b] {
            let d = max_diff(got.get(v).unwrap(), want.get(v).unwrap());
            assert!(d < 1e-10, "{d}");
        }
    }

    #[test]
    fn matmul_of_views_matches_candle() {
        // Transposed operands reach the kernel as strided views.
        let tt = |t: &[Tensor]| matmul(&t[0].t().unwrap(), &t[1].t().unwrap()).unwrap();
        let tt_c = |t: &[Tensor]| t[0].t().unwrap().matmul(&t[1].t().unwrap()).unwrap();
        check(&[&[6, 4], &[5, 6]], tt, tt_c);
        fd_check(&[&[3, 2], &[4, 3]], tt);
    }

    /// f32 through the AVX-512 kernel (where the CPU has it): values and gradients within
    /// 1e-5 relative of candle's matmul, on shapes that exercise every edge of the tiling.
    #[test]
    fn f32_matches_candle() {
        let f32s = |shape: &[usize], seed| randn(shape, seed).to_dtype(DType::F32).unwrap();
        for &(rows, d_in, d_out) in &[(1, 1, 1), (17, 33, 65), (64, 300, 40), (29, 257, 513)] {
            let x = candle_core::Var::from_tensor(&f32s(&[rows, d_in], 1)).unwrap();
            let w = candle_core::Var::from_tensor(&f32s(&[d_out, d_in], 2)).unwrap();
            let b = candle_core::Var::from_tensor(&f32s(&[d_out], 3)).unwrap();
            let proj = f32s(&[rows, d_out], 4);
            let run = |f: fn(&Tensor, &Tensor, Option<&Tensor>) -> CResult<Tensor>| {
                let y = f(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())).unwrap();
                let g = (&y * &proj).unwrap().sum_all().unwrap().backward().unwrap();
                let grads: Vec<Tensor> = [&x, &w, &b].iter().map(|v| g.get(v).unwrap().clone()).collect();
                (y, grads)
            };
            let (y, g) = run(linear);
            let (yc, gc) = run(linear_composed);
            let rel = |a: &Tensor, b: &Tensor| {
                let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
                let scale = scale.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap().max(1.0);
                max_diff(a, b) / scale
            };
            assert!(rel(&y, &yc) < 1e-5, "{rows}×{d_in}×{d_out}: forward {}", rel(&y, &yc));
            for (i, (a, b)) in g.iter().zip(&gc).enumerate() {
                assert!(rel(a, b) < 1e-5, "{rows}×{d_in}×{d_out}: grad {i} {}", rel(a, b));
            }
        }
    }

    #[test]
    fn strided_f32_operands() {
        let x = randn(&[40, 30], 5).to_dtype(DType::F32).unwrap();
        let w = randn(&[30, 50], 6).to_dtype(DType::F32).unwrap();
        // A column slice of x (row stride 30, 20 columns) and a transposed view of w.
        let xs = x.narrow(1, 5, 20).unwrap();
        let ws = w.narrow(0, 3, 20).unwrap().t().unwrap().t().unwrap();
        let d = max_diff(&matmul(&xs, &ws).unwrap(), &xs.matmul(&ws).unwrap());
        assert!(d < 1e-4, "max diff {d}");
        let wt = w.t().unwrap().contiguous().unwrap();
        let d = max_diff(&matmul(&x, &wt.t().unwrap()).unwrap(), &x.matmul(&w).unwrap());
        assert!(d < 1e-4, "max diff {d}");
    }

    /// A scope's copy of a weight is made once and reused, dropped with the outermost scope;
    /// outside a scope the weight itself is read.
    #[test]
    fn weight_casts_are_made_once_per_scope() {
        let w = randn(&[4, 3], 1).to_dtype(DType::F32).unwrap();
        assert_eq!(cached_bf16(&w).unwrap().id(), w.id());
        {
            let _outer = weight_cast_scope();
            let first = cached_bf16(&w).unwrap();
            assert_eq!(first.dtype(), DType::BF16);
            assert_ne!(first.id(), w.id());
            {
                let _inner = weight_cast_scope();
                assert_eq!(cached_bf16(&w).unwrap().id(), first.id());
            }
            assert_eq!(cached_bf16(&w).unwrap().id(), first.id(), "the inner scope kept the copies");
            let w2 = (&w + 1.0).unwrap();
            assert_ne!(cached_bf16(&w2).unwrap().id(), first.id());
        }
        assert_eq!(cached_bf16(&w).unwrap().id(), w.id(), "dropped with the outermost scope");
        // On the CPU nothing is cast: the products read the weight itself.
        let _scope = weight_cast_scope();
        assert_eq!(autocast_weight(&w).unwrap().id(), w.id());
    }

    #[test]
    fn falls_back_off_cpu_dtypes() {
        let x = Tensor::ones((2, 3), DType::BF16, &Device::Cpu).unwrap();
        let w = Tensor::ones((4, 3), DType::BF16, &Device::Cpu).unwrap();
        let y = linear(&x, &w, None).unwrap();
        assert_eq!(y.dims(), &[2, 4]);
    }
}
