//! A GPT-2 block as one graph node, with a hand-written backward.
//!
//! Built from the other ops, a block is ten nodes in candle's graph (two layer norms, four
//! linear maps, attention, GELU, two residual adds), and candle's backward gives each input of
//! each node a zero-filled gradient buffer and an add: per block about twelve activation-sized
//! zero fills and adds, on the calling thread while the matmul workers wait. In the `small` PPO
//! benchmark that was 4% of the CPU time and twice that in wall time.
//!
//! [`gpt2_block`] runs the same ops without a graph, keeps the activations the backward reads,
//! and puts one node in the graph: `x → z`. Its backward walks the block in reverse with the
//! same kernels (`dx` products before each weight's own product, as the linear op does, so an
//! optimizer fused into that product sees the right order), writes every weight's gradient
//! into its gradient sink (`grad_sink`) and hands candle `dx` only. GELU and its derivative run
//! in the epilogue of the MLP's first product (`activation::linear_in_out_gelu`), the
//! derivative's product in the backward's (`activation::gelu_bwd_of_product`): neither GELU's
//! input nor `dz·Wᵀ` makes another trip through memory.
//!
//! With [`Rows`], the block computes its attention output's projection and its MLP only for
//! the rows whose output will be read (PPO reads the response positions; the model passes the
//! rows to its last block), and keys and values for all.
//!
//! The weights' gradients can only go to sinks (a custom op returns gradients for its inputs,
//! and the weights are not inputs), so the block is used only where every weight that tracks a
//! gradient has a sink where the model's [`GradSlot`] points while the forward runs; the model
//! falls back to the composed block otherwise. Same values as the composed block (the same kernels in the
//! same order; tested, values and every gradient).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use super::activation::{gelu_bwd_of_product, linear_in_out_gelu};
use super::attention::{self_attention_bwd, self_attention_keep};
use super::grad_sink::{GradSlot, Sinks};
use super::linear::{column_sum_of, gemm_no_bwd, weight_grad};
use super::norm::layer_norm_bwd_parts;
use super::{f32_cpu, layer_norm, linear_in_out, lock, with_f32, CResult};

/// A GPT-2 block's parameters (Conv1D weights are `(in, out)`) and geometry.
#[derive(Debug, Clone)]
pub struct Gpt2BlockParams {
    /// `ln_1` weight and bias `(C)`.
    pub ln_1: (Tensor, Tensor),
    /// `attn.c_attn` `(C, 3C)`, `(3C)`.
    pub c_attn: (Tensor, Tensor),
    /// `attn.c_proj` `(C, C)`, `(C)`.
    pub c_proj: (Tensor, Tensor),
    /// `ln_2` weight and bias `(C)`.
    pub ln_2: (Tensor, Tensor),
    /// `mlp.c_fc` `(C, I)`, `(I)`.
    pub c_fc: (Tensor, Tensor),
    /// `mlp.c_proj` `(I, C)`, `(C)`.
    pub mlp_proj: (Tensor, Tensor),
    /// Layer norm epsilon.
    pub eps: f64,
    /// Attention heads.
    pub n_head: usize,
    /// Attention score scale.
    pub scale: f64,
}

impl Gpt2BlockParams {
    fn all(&self) -> [&Tensor; 12] {
        let p = self;
        [
            &p.ln_1.0,
            &p.ln_1.1,
            &p.c_attn.0,
            &p.c_attn.1,
            &p.c_proj.0,
            &p.c_proj.1,
            &p.ln_2.0,
            &p.ln_2.1,
            &p.c_fc.0,
            &p.c_fc.1,
            &p.mlp_proj.0,
            &p.mlp_proj.1,
        ]
    }
}

/// Rows of `(B·T)` whose outputs are needed: the others skip the attention output's projection
/// and the MLP (their keys and values are still computed for the rows that attend to them).
#[derive(Debug, Clone)]
pub struct Rows {
    idx: Tensor,
    list: Arc<Vec<usize>>,
}

impl Rows {
    /// The rows `list` (ascending, each below `B·T`) on `device`.
    pub fn new(list: Vec<usize>, device: &candle_core::Device) -> CResult<Self> {
        let idx = Tensor::from_vec(list.iter().map(|&r| r as u32).collect::<Vec<_>>(), list.len(), device)?;
        Ok(Self { idx, list: Arc::new(list) })
    }
}

/// `base` (or zeros) of `n` rows of `c` values with rows `rows` replaced by the rows of `src`.
fn scatter_rows(base: Option<&[f32]>, n: usize, c: usize, rows: &Rows, src: &[f32]) -> Vec<f32> {
    let mut out = match base {
        Some(b) => b.to_vec(),
        None => super::zeros_par(n * c),
    };
    for (k, &r) in rows.list.iter().enumerate() {
        out[r * c..(r + 1) * c].copy_from_slice(&src[k * c..(k + 1) * c]);
    }
    out
}

/// [`scatter_rows`] on tensors `(n, c)`.
fn scatter_row_tensors(
    base: Option<&Tensor>,
    n: usize,
    c: usize,
    rows: &Rows,
    src: &Tensor,
) -> CResult<Tensor> {
    let out = with_f32(src, "gpt2 block", |s| match base {
        Some(b) => with_f32(b, "gpt2 block", |b| scatter_rows(Some(b), n, c, rows, s)),
        None => Ok(scatter_rows(None, n, c, rows, s)),
    })??;
    Tensor::from_vec(out, (n, c), src.device())
}

/// The block's output from [`forward`]'s halves: `h + m` on the computed rows, `x` passed
/// through on the others (rows of `c` values).
fn output(x: &[f32], h: &Tensor, m: &Tensor, rows: Option<&Rows>, c: usize) -> CResult<Vec<f32>> {
    let z = with_f32(h, "gpt2 block", |h| with_f32(m, "gpt2 block", |m| super::add_par(h, m)))??;
    Ok(match rows {
        Some(r) => scatter_rows(Some(x), x.len() / c.max(1), c, r, &z),
        None => z,
    })
}

/// `a + b` for f32 CPU tensors of one shape, on every core (the residual adds).
fn add(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    if a.shape() != b.shape() {
        candle_core::bail!("gpt2 block: adding shapes {:?} and {:?}", a.dims(), b.dims());
    }
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let z = with_f32(&a, "gpt2 block", |a| with_f32(&b, "gpt2 block", |b| super::add_par(a, b)))??;
    Tensor::from_vec(z, a.shape(), a.device())
}

/// What the backward reads, all `(N, ·)` row-major (with [`Rows`], `y` to `g` hold the selected
/// rows only).
struct Saved {
    a1: Tensor,
    qkv: Tensor,
    probs: super::attention::Probs,
    y: Tensor,
    h: Tensor,
    a2: Tensor,
    /// `gelu'(u)` at the MLP's pre-activation `u` (the forward's epilogue computes it with
    /// `gelu(u)`; `u` itself is not kept).
    dgelu: Tensor,
    g: Tensor,
}

/// The forward without a graph: `(h, mlp_out)` (of the selected rows) and, with `keep`, what the
/// backward reads.
fn forward(
    x: &Tensor,
    bias: &Tensor,
    p: &Gpt2BlockParams,
    rows: Option<&Rows>,
    keep: bool,
) -> CResult<(Tensor, Tensor, Option<Saved>)> {
    let (b, t, c) = x.dims3()?;
    let n = b * t;
    let d = |t: &Tensor| t.detach();
    let lin = |x: &Tensor, (w, bias): &(Tensor, Tensor)| linear_in_out(x, &d(w), Some(&d(bias)));
    let x = d(x).reshape((n, c))?;
    let a1 = layer_norm(&x, &d(&p.ln_1.0), &d(&p.ln_1.1), p.eps)?;
    let qkv = lin(&a1, &p.c_attn)?.reshape((b, t, 3 * c))?;
    let (y, probs) = self_attention_keep(&qkv, &d(bias), p.n_head, p.scale)?;
    let (x, y) = match rows {
        Some(r) => (x.index_select(&r.idx, 0)?, y.reshape((n, c))?.index_select(&r.idx, 0)?),
        None => (x, y.reshape((n, c))?),
    };
    let h = add(&x, &lin(&y, &p.c_proj)?)?;
    let a2 = layer_norm(&h, &d(&p.ln_2.0), &d(&p.ln_2.1), p.eps)?;
    // With `keep`, `gelu'(u)` for the backward; else `u`, unused.
    let (dgelu, g) = linear_in_out_gelu(&a2, &d(&p.c_fc.0), &d(&p.c_fc.1), keep)?;
    let m = lin(&g, &p.mlp_proj)?;
    let saved = keep.then(|| Saved { a1, qkv, probs, y, h: h.clone(), a2, dgelu, g });
    Ok((h, m, saved))
}

/// GPT-2's block `z = h + mlp(ln_2(h))`, `h = x + attn(ln_1(x))` on `x (B, T, C)` with the
/// attention bias `(B|1, 1, T, T)`; `None` where it does not apply (not f32 on a CPU with the
/// fast SGEMM, a weight that tracks a gradient has no sink where `grads` points, or weights
/// that track a gradient on an `x` that does not), and the caller composes the block instead.
///
/// With `rows`, only those rows of `(B·T)` get the block's output; the others hold `x`
/// unchanged and must not be read (their gradient passes straight through).
pub fn gpt2_block(
    x: &Tensor,
    bias: &Tensor,
    p: &Gpt2BlockParams,
    rows: Option<&Rows>,
    grads: &GradSlot,
) -> CResult<Option<Tensor>> {
    let ws = p.all();
    if !super::gemm::fast_available() || !f32_cpu(x) || !f32_cpu(bias) || !ws.iter().all(|w| f32_cpu(w)) {
        return Ok(None);
    }
    let sinks = grads.sinks();
    if !ws.iter().all(|w| !w.track_op() || sinks.of(w).is_some()) {
        return Ok(None);
    }
    // The graph node hangs off `x`: with an untracked `x` (a frozen trunk's detached output)
    // it would not be in the graph and the weights' gradients would be lost silently.
    if !x.track_op() && ws.iter().any(|w| w.track_op()) {
        return Ok(None);
    }
    let grad = x.track_op() || ws.iter().any(|w| w.track_op());
    let (h, m, saved) = forward(x, bias, p, rows, grad)?;
    if !grad {
        let x = x.detach().contiguous()?;
        let z = with_f32(&x, "gpt2 block", |xs| output(xs, &h, &m, rows, x.dim(2)?))??;
        return Ok(Some(Tensor::from_vec(z, x.shape(), x.device())?));
    }
    let op = BlockOp {
        p: p.clone(),
        bias: bias.detach(),
        rows: rows.cloned(),
        out: Mutex::new(Some((h, m))),
        saved: Mutex::new(saved),
        sinks,
    };
    Ok(Some(x.contiguous()?.apply_op1_arc(Arc::new(Box::new(op)))?))
}

/// The graph node; its forward adds the two halves computed by [`forward`].
struct BlockOp {
    p: Gpt2BlockParams,
    bias: Tensor,
    rows: Option<Rows>,
    out: Mutex<Option<(Tensor, Tensor)>>,
    saved: Mutex<Option<Saved>>,
    /// Where the backward writes the weights' gradients: a sink for every tracked weight.
    sinks: Sinks,
}

impl CustomOp1 for BlockOp {
    fn name(&self) -> &'static str {
        "rltune-gpt2-block"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let Some((h, m)) = lock(&self.out).take() else {
            candle_core::bail!("gpt2 block: the op ran twice");
        };
        let x = super::contiguous::<f32>(s, l, "gpt2 block")?;
        let z = output(x, &h, &m, self.rows.as_ref(), l.dims().last().copied().unwrap_or(1))?;
        if z.len() != l.shape().elem_count() {
            candle_core::bail!("gpt2 block: {} outputs for an input of shape {:?}", z.len(), l.dims());
        }
        Ok((CpuStorage::F32(z), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _z: &Tensor, dz: &Tensor) -> CResult<Option<Tensor>> {
        let p = &self.p;
        let saved = lock(&self.saved).take();
        let s = match saved {
            Some(s) => s,
            // A second backward through the same graph: recompute the activations.
            None => match forward(x, &self.bias, p, self.rows.as_ref(), true)?.2 {
                Some(s) => s,
                None => candle_core::bail!("gpt2 block: no activations"),
            },
        };
        let (b, t, c) = x.dims3()?;
        let n = b * t;
        let d = |t: &Tensor| t.detach();
        let dz = dz.reshape((n, c))?.contiguous()?;
        let dz_rows = match &self.rows {
            Some(r) => dz.index_select(&r.idx, 0)?,
            None => dz.clone(),
        };
        // `dx` of a linear map, then its weight's and bias's gradients (the weight's product may
        // update it in place, so it comes after every read of the weight).
        let param_grads = |x: &Tensor, (w, bias): &(Tensor, Tensor), g: &Tensor| -> CResult<()> {
            if w.track_op() {
                sunk(weight_grad(&self.sinks, w, &x.t()?, g)?, w)?;
            }
            if bias.track_op() {
                sunk(self.sinks.give(bias, column_sum_of(g)?)?, bias)?;
            }
            Ok(())
        };
        let linear_bwd = |x: &Tensor, w_b: &(Tensor, Tensor), g: &Tensor| -> CResult<Tensor> {
            let dx = gemm_no_bwd(g, &d(&w_b.0).t()?)?;
            param_grads(x, w_b, g)?;
            Ok(dx)
        };
        let norm_bwd = |x: &Tensor, (w, bias): &(Tensor, Tensor), g: &Tensor| -> CResult<Tensor> {
            let (dx, dw, db) = layer_norm_bwd_parts(x, &d(w), g, p.eps)?;
            if w.track_op() {
                sunk(self.sinks.give(w, dw)?, w)?;
            }
            if bias.track_op() {
                sunk(self.sinks.give(bias, db)?, bias)?;
            }
            Ok(dx)
        };
        // `du = gelu'(u) ⊙ dz·Wᵀ` in one product (scaled in its epilogue), before the
        // MLP projection's own weight gradient.
        let du = gelu_bwd_of_product(&dz_rows, &d(&p.mlp_proj.0).t()?, &s.dgelu)?;
        param_grads(&s.g, &p.mlp_proj, &dz_rows)?;
        let da2 = linear_bwd(&s.a2, &p.c_fc, &du)?;
        let dh = add(&dz_rows, &norm_bwd(&s.h, &p.ln_2, &da2)?)?;
        let dy = linear_bwd(&s.y, &p.c_proj, &dh)?;
        // Unselected rows: no attention output was used, and their gradient passes straight on.
        let (dy, dh) = match &self.rows {
            Some(r) => {
                (scatter_row_tensors(None, n, c, r, &dy)?, scatter_row_tensors(Some(&dz), n, c, r, &dh)?)
            }
            None => (dy, dh),
        };
        let dy = dy.reshape((b, t, c))?;
        let dqkv =
            self_attention_bwd(&s.qkv, &self.bias, &dy, p.n_head, p.scale, s.probs)?.reshape((n, 3 * c))?;
        let da1 = linear_bwd(&s.a1, &p.c_attn, &dqkv)?;
        let dx = add(&dh, &norm_bwd(&d(x).reshape((n, c))?, &p.ln_1, &da1)?)?;
        Ok(Some(dx.reshape((b, t, c))?))
    }
}

/// An error if a weight's gradient did not go into its sink (the forward found one for every
/// tracked weight, so this is a broken invariant).
fn sunk(left: Option<Tensor>, w: &Tensor) -> CResult<()> {
    match left {
        None => Ok(()),
        Some(_) => candle_core::bail!(
            "internal: gpt2 block: no gradient sink for a weight of shape {:?} in the backward",
            w.dims()
        ),
    }
}
