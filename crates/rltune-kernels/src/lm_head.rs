//! The LM head fused with the log-probability of the next token and the entropy.
//!
//! PPO needs, per position, `log softmax(h·Wᵀ / τ)[target]` and (as a statistic) the entropy
//! of that distribution. Composed, that is a `(N, V)` logits tensor in the graph, a log-softmax
//! pass, a gather, an entropy pass and, in the backward, a zero-filled `(N, V)` gradient buffer
//! plus an add (candle's gradient store), a softmax pass and two matrix products. At GPT-2's
//! vocabulary the `(N, V)` passes cost as much as the rest of the model.
//!
//! [`lm_head_logprobs`] is one custom op on `(h, W)`: the forward runs the product, then one pass
//! per row computes the max, `Σ e^(x−m)` (storing `e^(x−m)`), the target's logprob and the
//! entropy, and a second pass turns the row into probabilities, which the op keeps for its
//! backward. The backward turns them in place into `dlogits = g/τ · (onehot − p)` and runs
//! `dh = dlogits·W` and `dW = dlogitsᵀ·h`. Without a saved buffer (the op was applied with
//! `keep = false`, or a second backward) the probabilities are recomputed.
//!
//! Rows can be selected: only those rows go through the product and the softmax; the others read
//! 0 and get no gradient. PPO selects the response positions (a quarter fewer rows than the whole
//! sequence in the benchmark presets).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::grad_sink::{GradSlot, Sinks};
use super::linear::{cpu_gemm, gemm_no_bwd, weight_grad};
use super::simd::{self, simd_kernel, LANES};
use super::{contiguous, lock, CResult, Elem};

simd_kernel! {
    /// Per row of logits `x` (divided by `temp` unless it is 1): `logp = x_t − logsumexp(x)` and
    /// the entropy; with `keep`, `x` becomes `softmax(x)` in place, else `e^(x − max)`.
    fn head_rows<T: Elem>(
        x: &mut [T],
        logp: &mut [T],
        ent: &mut [T],
        targets: &[usize],
        n: usize,
        temp: T,
        keep: bool,
    ) {
        for (((x, lp), en), &t) in x.chunks_mut(n).zip(logp).zip(ent).zip(targets) {
            if temp != T::one() {
                for v in x.iter_mut() {
                    *v /= temp;
                }
            }
            let m = simd::max(x);
            let xt = x[t];
            let (s, sx) = exp_pass(x, m);
            let ln_s = s.ln();
            *lp = xt - (m + ln_s);
            *en = ln_s - sx / s;
            if keep {
                let inv = T::one() / s;
                for v in x.iter_mut() {
                    *v *= inv;
                }
            }
        }
    }
}

/// `x ← e^(x − m)` over a row, returning `(Σ e, Σ e·(x − m))`; a term with `e = 0` adds nothing
/// to the second sum (`x = −∞` gives `0·(−MAX) = 0`, not `0·(−∞) = NaN`). The hand-written AVX2
/// body for f32 where the CPU has it.
#[inline(always)]
fn exp_pass<T: Elem>(x: &mut [T], m: T) -> (T, T) {
    #[cfg(target_arch = "x86_64")]
    if let Some(xf) = simd::as_f32_mut(x) {
        if simd::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            let (s, sx) = unsafe { x86::exp_pass(xf, m.to_f32().unwrap_or(f32::NAN)) };
            return (T::from(s).unwrap_or_else(T::nan), T::from(sx).unwrap_or_else(T::nan));
        }
    }
    let lo = <T as num_traits::Float>::min_value();
    let mut acc = [T::zero(); LANES];
    let mut acc_x = [T::zero(); LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            let d = c[l] - m;
            let e = d.exp_fast();
            acc[l] += e;
            // Branch-free (a select here compiled to a masked store per vector).
            acc_x[l] += e * if d > lo { d } else { lo };
            c[l] = e;
        }
    }
    let (mut s, mut sx) = (simd::sum(&acc), simd::sum(&acc_x));
    for v in chunks.into_remainder() {
        let d = *v - m;
        let e = d.exp_fast();
        s += e;
        if e > T::zero() {
            sx += e * d;
        }
        *v = e;
    }
    (s, sx)
}

/// [`exp_pass`] with FMA, on 16 lanes where the CPU has AVX-512, else on 8.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::simd::{self, avx2::exp_clamped, avx512};

    /// Values more than 80 below the maximum count as `e^(x − m) = 0`: their share of the sum is
    /// below 2·10⁻³⁵ (and −∞, a masked logit, must give 0, not [`exp_clamped`]'s `e^−80`). NaN
    /// stays NaN (an unordered compare keeps it).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_pass(x: &mut [f32], m: f32) -> (f32, f32) {
        let (mut s, mut sx) = if simd::has_avx512() { exp_pass_16(x, m) } else { exp_pass_8(x, m) };
        for v in x.chunks_exact_mut(16).into_remainder() {
            let d = *v - m;
            let e = super::super::simd::exp_f32(d);
            s += e;
            if e > 0.0 {
                sx += e * d;
            }
            *v = e;
        }
        (s, sx)
    }

    /// The loop over whole chunks of 16 values of [`exp_pass`] on 8 lanes: the sums of
    /// `e^(x − m)` and `e^(x − m)·(x − m)`, two vectors of each, added up lane by lane at the
    /// end.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_pass_8(x: &mut [f32], m: f32) -> (f32, f32) {
        let (mv, lo, floor) = (_mm256_set1_ps(m), _mm256_set1_ps(f32::MIN), _mm256_set1_ps(-80.0));
        let (mut acc, mut acc_x) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
        for c in x.chunks_exact_mut(16) {
            for (l, (a, ax)) in acc.iter_mut().zip(&mut acc_x).enumerate() {
                // SAFETY: a chunk holds 16 values.
                let p = c.as_mut_ptr().add(8 * l);
                let d = _mm256_sub_ps(_mm256_loadu_ps(p), mv);
                let e = _mm256_and_ps(exp_clamped(d), _mm256_cmp_ps::<_CMP_NLT_UQ>(d, floor));
                *a = _mm256_add_ps(*a, e);
                *ax = _mm256_fmadd_ps(e, _mm256_max_ps(d, lo), *ax);
                _mm256_storeu_ps(p, e);
            }
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc[0], acc[1]));
        let s: f32 = lanes.iter().sum();
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc_x[0], acc_x[1]));
        (s, lanes.iter().sum())
    }

    /// [`exp_pass_8`] on 16 lanes where the CPU has AVX-512: lane `l` of the sums is lane
    /// `l % 8` of the 8-lane body's `acc[l / 8]`, added in the same order, and the halves are
    /// added as those two are, so the sums have the same bits.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_pass_16(x: &mut [f32], m: f32) -> (f32, f32) {
        let (mv, lo, floor) = (_mm512_set1_ps(m), _mm512_set1_ps(f32::MIN), _mm512_set1_ps(-80.0));
        let (mut acc, mut acc_x) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for c in x.chunks_exact_mut(16) {
            // SAFETY: a chunk holds 16 values.
            let p = c.as_mut_ptr();
            let d = _mm512_sub_ps(_mm512_loadu_ps(p), mv);
            let e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(d, floor), avx512::exp_clamped(d));
            acc = _mm512_add_ps(acc, e);
            acc_x = _mm512_fmadd_ps(e, _mm512_max_ps(d, lo), acc_x);
            _mm512_storeu_ps(p, e);
        }
        let halves = |v: __m512| {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), v);
            (0..8).map(|l| lanes[l] + lanes[8 + l]).sum::<f32>()
        };
        (halves(acc), halves(acc_x))
    }
}

simd_kernel! {
    /// `p[r] ← g[r] · (onehot(t_r) − p[r])`, in place.
    fn head_bwd_rows<T: Elem>(p: &mut [T], targets: &[usize], g: &[T], n: usize) {
        for ((p, &t), &g) in p.chunks_mut(n).zip(targets).zip(g) {
            let ng = -g;
            for v in p.iter_mut() {
                *v *= ng;
            }
            p[t] += g;
        }
    }
}

/// What the forward computed for the selected rows.
struct HeadRows<T> {
    /// `(rows, V)`: probabilities with `keep`, else scratch.
    x: Vec<T>,
    logp: Vec<T>,
    entropy: Vec<T>,
}

/// Which rows of `h` the op computes, and their targets.
#[derive(Clone)]
struct Selection {
    /// Rows of `h` in all.
    n: usize,
    /// The selected rows, ascending; `None` for all of them.
    rows: Option<Arc<Vec<usize>>>,
    /// The target id of each selected row.
    targets: Arc<Vec<usize>>,
    temperature: f64,
}

impl Selection {
    fn len(&self) -> usize {
        self.targets.len()
    }

    /// The selected rows as an index tensor (for `index_select` / `index_add`).
    fn index(&self) -> CResult<Option<Tensor>> {
        let Some(rows) = &self.rows else { return Ok(None) };
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        Ok(Some(Tensor::from_vec(idx, rows.len(), &Device::Cpu)?))
    }

    /// Logits of the selected rows, then the per-row pass.
    fn run<T: Elem>(
        &self,
        (sh, lh): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        keep: bool,
    ) -> CResult<HeadRows<T>> {
        let (n, c) = lh.shape().dims2()?;
        let (v, c2) = lw.shape().dims2()?;
        if c != c2 || n != self.n {
            candle_core::bail!(
                "lm-head: hidden states ({n}, {c}) for a weight ({v}, {c2}) and {} rows",
                self.n
            );
        }
        let w_t = lw.transpose(0, 1)?;
        let logits = match &self.rows {
            None => cpu_gemm((sh, lh), (sw, &w_t), None, "lm-head")?.0,
            Some(rows) => {
                let h = contiguous::<T>(sh, lh, "lm-head")?;
                let mut sel = Vec::with_capacity(rows.len() * c);
                for &r in rows.iter() {
                    sel.extend_from_slice(&h[r * c..(r + 1) * c]);
                }
                let sel = T::to_cpu_storage_owned(sel);
                cpu_gemm((&sel, &Layout::contiguous((rows.len(), c))), (sw, &w_t), None, "lm-head")?.0
            }
        };
        let mut x = T::cpu_storage_data(logits)?;
        let ns = self.len();
        let (mut logp, mut entropy) = (vec![T::zero(); ns], vec![T::zero(); ns]);
        let per = super::rows_per_task(v);
        let temp = T::from(self.temperature).unwrap_or_else(T::one);
        x.par_chunks_mut(per * v)
            .zip(logp.par_chunks_mut(per))
            .zip(entropy.par_chunks_mut(per))
            .zip(self.targets.par_chunks(per))
            .for_each(|(((x, lp), en), t)| head_rows(x, lp, en, t, v, temp, keep));
        Ok(HeadRows { x, logp, entropy })
    }

    /// Values of the selected rows placed into `n` rows (0 elsewhere).
    fn scatter<T: Elem>(&self, sel: Vec<T>) -> Vec<T> {
        match &self.rows {
            None => sel,
            Some(rows) => {
                let mut out = vec![T::zero(); self.n];
                for (&r, x) in rows.iter().zip(sel) {
                    out[r] = x;
                }
                out
            }
        }
    }
}

/// The op: `(h (N, C), W (V, C)) -> logp (N)`; the entropy comes out on the side.
struct LmHead {
    sel: Selection,
    keep: bool,
    /// The forward's probabilities `(rows, V)`, taken by the backward.
    saved: Mutex<Option<CpuStorage>>,
    /// The entropy `(N)`, taken by [`lm_head_logprobs`].
    entropy: Arc<Mutex<Option<Tensor>>>,
    /// Where the backward writes the weight's gradient.
    sinks: Sinks,
}

impl LmHead {
    fn fwd<T: Elem>(
        &self,
        h: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
    ) -> CResult<(CpuStorage, Shape)> {
        let r = self.sel.run::<T>(h, w, self.keep)?;
        if self.keep {
            *lock(&self.saved) = Some(T::to_cpu_storage_owned(r.x));
        }
        let n = self.sel.n;
        *lock(&self.entropy) = Some(Tensor::from_vec(self.sel.scatter(r.entropy), n, &Device::Cpu)?);
        Ok((T::to_cpu_storage_owned(self.sel.scatter(r.logp)), n.into()))
    }

    /// `dlogits (rows, V)` from the probabilities and the upstream gradient `g (N)`.
    fn dlogits<T: Elem>(&self, p: CpuStorage, g: &Tensor) -> CResult<Tensor> {
        let mut p = T::cpu_storage_data(p)?;
        let g = g.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>()?;
        let inv_t = T::one() / T::from(self.sel.temperature).unwrap_or_else(T::one);
        let g: Vec<T> = match &self.sel.rows {
            None => g.iter().map(|&g| g * inv_t).collect(),
            Some(rows) => rows.iter().map(|&r| g[r] * inv_t).collect(),
        };
        let ns = self.sel.len();
        let v = p.len() / ns.max(1);
        let per = super::rows_per_task(v);
        p.par_chunks_mut(per * v)
            .zip(self.sel.targets.par_chunks(per))
            .zip(g.par_chunks(per))
            .for_each(|((p, t), g)| head_bwd_rows(p, t, g, v));
        Tensor::from_vec(p, (ns, v), &Device::Cpu)
    }
}

impl CustomOp2 for LmHead {
    fn name(&self) -> &'static str {
        "rltune-lm-head-logprobs"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "lm-head", self.fwd((s1, l1), (s2, l2)))
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let w_param = w;
        let (h, w) = (h.detach(), w.detach());
        let p = match lock(&self.saved).take() {
            Some(p) => p,
            None => {
                let probs = h.apply_op2_no_bwd(&w, &Probs(self.sel.clone()))?;
                let (s, l) = probs.storage_and_layout();
                match &*s {
                    candle_core::Storage::Cpu(s) if l.is_contiguous() => s.clone(),
                    _ => candle_core::bail!("lm-head: probabilities are not a contiguous CPU tensor"),
                }
            }
        };
        let d = by_dtype!(h, "lm-head", self.dlogits(p, g))?;
        let idx = self.sel.index()?;
        let h_sel = match &idx {
            None => h.clone(),
            Some(idx) => h.index_select(idx, 0)?,
        };
        // `dh` reads W, so it comes first: the weight-gradient product may update W in place
        // (an armed gradient sink, see `grad_sink`).
        let dh_sel = gemm_no_bwd(&d, &w)?;
        let dw = weight_grad(&self.sinks, w_param, &d.t()?, &h_sel)?;
        let dh = match &self.sel.rows {
            None => dh_sel,
            Some(rows) => by_dtype!(h, "lm-head", scatter_rows(rows, &dh_sel, self.sel.n))?,
        };
        Ok((Some(dh), dw))
    }
}

/// The `(rows.len(), C)` rows of `sel` placed at `rows` of an `(n, C)` tensor, zeros elsewhere
/// (in parallel: a zero fill and one copy per selected row, no `index_add`).
fn scatter_rows<T: Elem>(rows: &[usize], sel: &Tensor, n: usize) -> CResult<Tensor> {
    let c = sel.dim(1)?;
    let mut from = vec![None; n];
    for (j, &r) in rows.iter().enumerate() {
        from[r] = Some(j);
    }
    let (st, l) = sel.storage_and_layout();
    let candle_core::Storage::Cpu(st) = &*st else {
        candle_core::bail!("lm-head: the gradient is not on the CPU");
    };
    let src = contiguous::<T>(st, l, "lm-head")?;
    let mut out = super::zeros_par::<T>(n * c);
    let per = super::rows_per_task(c);
    out.par_chunks_mut(per * c.max(1)).zip(from.par_chunks(per)).for_each(|(out, from)| {
        for (row, f) in out.chunks_exact_mut(c.max(1)).zip(from) {
            if let Some(j) = f {
                row.copy_from_slice(&src[j * c..(j + 1) * c]);
            }
        }
    });
    Tensor::from_vec(out, (n, c), &Device::Cpu)
}

/// The probabilities of the selected rows, `(rows, V)` (the backward's recompute).
struct Probs(Selection);

fn probs<T: Elem>(
    sel: &Selection,
    h: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let v = w.1.dims()[0];
    Ok((T::to_cpu_storage_owned(sel.run::<T>(h, w, true)?.x), (sel.len(), v).into()))
}

impl CustomOp2 for Probs {
    fn name(&self) -> &'static str {
        "rltune-lm-head-probs"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s1, "lm-head", probs(&self.0, (s1, l1), (s2, l2)))
    }
}

/// Log-probabilities of `targets` under the LM head, and the entropies, for the rows of `hidden`
/// that `select` marks: `(N, C), (V, C), (N) -> ((N), (N))`.
///
/// `logp[r] = log softmax(h[r]·Wᵀ / τ)[targets[r]]` (differentiable in `hidden` and `weight`),
/// `entropy[r]` is the entropy of `softmax(h[r]·Wᵀ / τ)` (no gradient); rows where `select` is 0
/// read 0 in both. `weight` is the `(V, C)` LM head (nn.Linear layout, or GPT-2's tied `wte`).
/// `keep` keeps the `(rows, V)` probabilities for the backward (set it when a backward follows;
/// without, the backward recomputes them). TRL: `logprobs_from_logits(logits / τ, labels)` and
/// `entropy_from_logits(logits / τ)` on the full logits.
///
/// On the CPU (f32, f64) one fused op. Elsewhere (CUDA, bf16, the composed path) composed from
/// [`super::linear()`], [`super::logprobs_of`] and [`super::entropy_from_logits`], with the same
/// results, by chunks of rows (see [`by_chunks`]): no `(N, V)` tensor is kept for the backward.
///
/// The weight's gradient goes to candle's store; [`lm_head_logprobs_with`] writes it where a
/// [`GradSlot`] points.
pub fn lm_head_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    select: Option<&Tensor>,
    temperature: f64,
    keep: bool,
) -> CResult<(Tensor, Tensor)> {
    lm_head_logprobs_with(hidden, weight, targets, select, temperature, keep, &GradSlot::new())
}

/// [`lm_head_logprobs`], whose backward writes the weight's gradient into the buffers `grads`
/// points at when its forward runs (see [`GradSlot`]); off the fused CPU op, its chunks are
/// checkpointed segments whose weight gradients go there too.
pub fn lm_head_logprobs_with(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    select: Option<&Tensor>,
    temperature: f64,
    keep: bool,
    grads: &GradSlot,
) -> CResult<(Tensor, Tensor)> {
    let (n, _) = hidden.dims2()?;
    let (v, _) = weight.dims2()?;
    if targets.elem_count() != n {
        candle_core::bail!("lm-head: {} targets for {n} rows", targets.elem_count());
    }
    let dt = hidden.dtype();
    let fused = super::cpu_kernels(hidden.device())
        && super::cpu_kernels(weight.device())
        && weight.dtype() == dt
        && matches!(dt, DType::F32 | DType::F64);
    if !fused {
        let (logp, entropy) = by_chunks(hidden, weight, targets, temperature, chunk_rows(v), grads)?;
        return match select {
            None => Ok((logp, entropy)),
            Some(s) => {
                let s = s.flatten_all()?.ne(0f64)?.to_dtype(dt)?;
                Ok(((logp * &s)?, (entropy * s)?))
            }
        };
    }
    let ids = targets.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("lm-head: target id {bad} is not below the vocabulary size {v}");
    }
    let rows = match select {
        None => None,
        Some(s) => {
            if s.elem_count() != n {
                candle_core::bail!("lm-head: a selection of {} for {n} rows", s.elem_count());
            }
            let s = s.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Some(Arc::new((0..n).filter(|&r| s[r] != 0.0).collect::<Vec<_>>()))
        }
    };
    let targets: Vec<usize> = match &rows {
        None => ids.iter().map(|&t| t as usize).collect(),
        Some(rows) => rows.iter().map(|&r| ids[r] as usize).collect(),
    };
    let entropy = Arc::new(Mutex::new(None));
    let op = LmHead {
        sel: Selection { n, rows, targets: Arc::new(targets), temperature },
        keep,
        saved: Mutex::new(None),
        entropy: entropy.clone(),
        sinks: grads.sinks(),
    };
    let logp = hidden.contiguous()?.apply_op2_arc(&weight.contiguous()?, Arc::new(Box::new(op)))?;
    let entropy = lock(&entropy).take();
    match entropy {
        Some(e) => Ok((logp, e.to_dtype(dt)?)),
        None => candle_core::bail!("lm-head: the op ran without computing the entropy"),
    }
}

/// Elements of one chunk's `(rows, V)` logits in [`by_chunks`]: 128 MiB in f32. Qwen2's
/// vocabulary of 151,936 gives chunks of 220 rows, GPT-2's 50,257 chunks of 667.
const CHUNK_ELEMENTS: usize = 1 << 25;

/// Rows per chunk of [`by_chunks`] for a vocabulary of `v`.
fn chunk_rows(v: usize) -> usize {
    (CHUNK_ELEMENTS / v.max(1)).max(1)
}

/// Bytes of the log-probabilities' gradients, in the products' dtype, that [`by_chunks`]'s
/// backward gathers from several chunks before one product adds them to the weight's gradient:
/// 256 MiB, four of Qwen2's chunks of 220 rows in bf16.
const GROUP_BYTES: usize = 1 << 28;

/// [`lm_head_logprobs`]'s composed form over chunks of `rows` rows: no `(N, V)` tensor lives
/// from the forward to the backward. Composed in one piece, the `(N, V)` f32 logits (and, scaled
/// by a temperature or cast from a bf16 product, their source) stayed alive until the end of the
/// backward: 1.2 GB per copy for a mini-batch of 8 × 256 tokens of Qwen2-0.5B.
///
/// The forward computes each chunk's logits, log-probabilities and entropies and drops the
/// logits. One node on `(hidden, W)` carries the log-probabilities into the graph; its backward
/// recomputes one chunk's logits at a time, turns them into `dlogits = g/τ · (onehot − p)`, and
/// runs `dh = dlogits·W` per chunk and `dW = dlogitsᵀ·h` once per group of chunks
/// ([`GROUP_BYTES`] of `dlogits`). The cost is the LM head's product run again in the backward.
///
/// Where the device's products run in bf16 ([`crate::set_device_matmul_precision`], autocast),
/// the weight is cast to bf16 once per call, not once per chunk and product: the casts of
/// Qwen2's 136M-element LM head were a fifth of the GPU time of a PPO iteration. `dW` comes out
/// of each group's product in bf16, as autocast's product does, and is summed in f32.
///
/// The values are those of the composed form on each chunk's rows (the same products and
/// kernels); the gradients are the composed form's up to the order of the sums over rows.
/// `grads` gets the weight's gradient where it has a sink (see [`GradSlot`]); otherwise candle's
/// store does.
fn by_chunks(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    temperature: f64,
    rows: usize,
    grads: &GradSlot,
) -> CResult<(Tensor, Tensor)> {
    let (v, _) = weight.dims2()?;
    let size = product_dtype(weight).size_in_bytes();
    let group = (GROUP_BYTES / (rows.max(1) * v.max(1) * size)).max(1);
    by_chunk_groups(hidden, weight, targets, temperature, rows, group, grads)
}

/// [`by_chunks`] with `group` chunks a weight-gradient product.
fn by_chunk_groups(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    temperature: f64,
    rows: usize,
    group: usize,
    grads: &GradSlot,
) -> CResult<(Tensor, Tensor)> {
    let n = hidden.dim(0)?;
    if n == 0 {
        let none = Tensor::zeros(0, hidden.dtype(), hidden.device())?;
        return Ok((none.clone(), none));
    }
    let head = ChunkedHead {
        w: product_weight(weight)?,
        targets: targets.flatten_all()?,
        temperature,
        rows: rows.max(1),
        group: group.max(1),
        out: Mutex::new(None),
        sinks: grads.sinks(),
    };
    let h = hidden.detach();
    let (mut logp, mut entropy) = (Vec::new(), Vec::new());
    for start in (0..n).step_by(head.rows) {
        let len = head.rows.min(n - start);
        let logits = head.logits(&h.narrow(0, start, len)?)?;
        logp.push(super::logprobs_of(&logits, &head.targets.narrow(0, start, len)?)?);
        entropy.push(super::entropy_from_logits(&logits)?);
    }
    let (logp, entropy) = (Tensor::cat(&logp, 0)?, Tensor::cat(&entropy, 0)?);
    if !hidden.track_op() && !weight.track_op() {
        return Ok((logp, entropy));
    }
    *lock(&head.out) = Some(logp);
    Ok((hidden.apply_op2(weight, head)?, entropy))
}

/// The dtype of [`by_chunks`]'s products for `weight`: bf16 where the device's products run in
/// bf16 (autocast), the weight's own otherwise.
fn product_dtype(weight: &Tensor) -> DType {
    if super::linear::autocast(weight) {
        DType::BF16
    } else {
        weight.dtype()
    }
}

/// The LM head's weight as [`by_chunks`]'s products read it, detached, in [`product_dtype`]:
/// cast once per call.
fn product_weight(weight: &Tensor) -> CResult<Tensor> {
    weight.detach().to_dtype(product_dtype(weight))
}

/// `a·b` with `a` cast to `b`'s dtype, the result in `out`.
fn product(a: &Tensor, b: &Tensor, out: DType) -> CResult<Tensor> {
    let a = a.to_dtype(b.dtype())?;
    let y = if a.device().is_cpu() { super::matmul(&a, b)? } else { a.matmul(b)? };
    y.to_dtype(out)
}

/// [`by_chunks`]'s node: the log-probabilities its forward computed, and the backward by chunks.
struct ChunkedHead {
    /// The weight as the products read it ([`product_weight`]).
    w: Tensor,
    targets: Tensor,
    temperature: f64,
    rows: usize,
    /// Chunks per weight-gradient product.
    group: usize,
    /// The log-probabilities, until the node's forward copies them out.
    out: Mutex<Option<Tensor>>,
    sinks: Sinks,
}

impl ChunkedHead {
    /// `h·Wᵀ / τ` for the rows `h`, in `h`'s dtype.
    fn logits(&self, h: &Tensor) -> CResult<Tensor> {
        let logits = product(h, &self.w.t()?, h.dtype())?;
        if self.temperature != 1.0 {
            logits / self.temperature
        } else {
            Ok(logits)
        }
    }

    fn take(&self) -> CResult<Tensor> {
        lock(&self.out)
            .take()
            .ok_or_else(|| candle_core::Error::Msg("internal: the LM head's forward ran twice".into()))
    }
}

impl CustomOp2 for ChunkedHead {
    fn name(&self) -> &'static str {
        "rltune-lm-head-chunks"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let err = "lm-head: the log-probabilities are not on the CPU, the hidden states are";
        super::checkpoint::cpu_copy(&self.take()?, err)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        let err = "lm-head: the log-probabilities are not on CUDA, the hidden states are";
        super::checkpoint::cuda_copy(&self.take()?, err)
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _logp: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (n, d) = hidden.dims2()?;
        let (want_dh, want_dw) = (hidden.track_op(), weight.track_op());
        let (h, g) = (hidden.detach(), g.detach().flatten_all()?.to_dtype(hidden.dtype())?.contiguous()?);
        let (mut dh, mut dw): (Vec<Tensor>, Option<Tensor>) = (Vec::new(), None);
        let group_rows = self.rows * self.group;
        for g0 in (0..n).step_by(group_rows) {
            let glen = group_rows.min(n - g0);
            let mut dlogits = Vec::new();
            for start in (g0..g0 + glen).step_by(self.rows) {
                let len = self.rows.min(g0 + glen - start);
                let h_c = h.narrow(0, start, len)?;
                let logits = self.logits(&h_c)?.contiguous()?;
                super::checkpoint::note_recomputation();
                let dl = super::softmax::logprobs_of_grad(
                    &logits,
                    &self.targets.narrow(0, start, len)?,
                    &g.narrow(0, start, len)?,
                )?;
                drop(logits);
                let dl = if self.temperature != 1.0 { (dl / self.temperature)? } else { dl };
                let dl = dl.to_dtype(self.w.dtype())?;
                if want_dh {
                    dh.push(product(&dl, &self.w, hidden.dtype())?);
                }
                if want_dw {
                    dlogits.push(dl);
                }
            }
            if want_dw {
                let dl = Tensor::cat(&dlogits, 0)?;
                drop(dlogits);
                let part =
                    product(&dl.t()?, &h.narrow(0, g0, glen)?.to_dtype(self.w.dtype())?, weight.dtype())?;
                dw = Some(match dw {
                    None => part,
                    Some(acc) => (acc + part)?,
                });
            }
        }
        let dh = if want_dh && !dh.is_empty() { Some(Tensor::cat(&dh, 0)?.reshape((n, d))?) } else { None };
        let dw = match dw {
            Some(dw) => self.sinks.give(weight, dw)?,
            None => None,
        };
        Ok((dh, dw))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::super::testutil::{check_tol, fd_check, max_diff, randn};
    use super::*;

    fn targets(n: usize, v: usize) -> Tensor {
        Tensor::from_vec((0..n).map(|i| ((i * 7 + 3) % v) as u32).collect::<Vec<_>>(), n, &Device::Cpu)
            .unwrap()
    }

    /// The composed reference: full logits, log-softmax, gather; entropy; then the selection mask.
    fn composed(h: &Tensor, w: &Tensor, t: &Tensor, sel: Option<&Tensor>, temp: f64) -> (Tensor, Tensor) {
        let logits = (h.matmul(&w.t().unwrap()).unwrap() / temp).unwrap();
        let lp = super::super::logprobs_of_composed(&logits, t).unwrap();
        let en = super::super::entropy_from_logits_composed(&logits).unwrap();
        match sel {
            None => (lp, en),
            Some(s) => ((lp * s).unwrap(), (en * s).unwrap()),
        }
    }

    fn selection(n: usize) -> Tensor {
        Tensor::from_vec(
            (0..n).map(|i| if i % 3 == 1 { 0f64 } else { 1.0 }).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )
        .unwrap()
    }

    #[test]
    fn matches_composed_values_and_gradients() {
        let (n, c, v) = (7, 5, 11);
        for temp in [1.0, 0.7] {
            for sel in [None, Some(selection(n))] {
                for keep in [true, false] {
                    let t = targets(n, v);
                    let s = sel.clone();
                    let s2 = sel.clone();
                    let t2 = t.clone();
                    check_tol(
                        &[&[n, c], &[v, c]],
                        1e-10,
                        move |x| lm_head_logprobs(&x[0], &x[1], &t, s.as_ref(), temp, keep).unwrap().0,
                        move |x| composed(&x[0], &x[1], &t2, s2.as_ref(), temp).0,
                    );
                }
                let (h, w, t) = (randn(&[n, c], 1), randn(&[v, c], 2), targets(n, v));
                let (_, en) = lm_head_logprobs(&h, &w, &t, sel.as_ref(), temp, false).unwrap();
                let (_, en_c) = composed(&h, &w, &t, sel.as_ref(), temp);
                assert!(max_diff(&en, &en_c) < 1e-10);
            }
        }
    }

    #[test]
    fn finite_differences() {
        let (n, c, v) = (4, 3, 6);
        let t = targets(n, v);
        let s = selection(n);
        fd_check(&[&[n, c], &[v, c]], move |x| {
            lm_head_logprobs(&x[0], &x[1], &t, Some(&s), 0.9, true).unwrap().0
        });
    }

    #[test]
    fn f32_matches_f64() {
        // Wide enough for the SGEMM and the vectorized row pass (V not a multiple of 16).
        let (n, c, v) = (37, 64, 1001);
        let (h, w, t) = (randn(&[n, c], 3), randn(&[v, c], 4), targets(n, v));
        let h = (h * 0.2).unwrap();
        let sel = selection(n);
        let (lp64, en64) = lm_head_logprobs(&h, &w, &t, Some(&sel), 1.0, true).unwrap();
        let h32 = h.to_dtype(DType::F32).unwrap();
        let w32 = w.to_dtype(DType::F32).unwrap();
        let (lp32, en32) = lm_head_logprobs(&h32, &w32, &t, Some(&sel), 1.0, true).unwrap();
        assert!(max_diff(&lp32, &lp64) < 1e-4, "logp {}", max_diff(&lp32, &lp64));
        assert!(max_diff(&en32, &en64) < 1e-4, "entropy {}", max_diff(&en32, &en64));
    }

    /// The row pass on 8-lane vectors: masked logits (−∞) and logits far below the maximum
    /// add nothing, NaN stays NaN; against the sums in f64.
    #[test]
    fn exp_pass_sums_match_f64_with_masked_and_far_logits() {
        let m = 3.0f32;
        let mut row: Vec<f32> = (0..77).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        row[5] = f32::NEG_INFINITY;
        row[17] = m;
        row[20] = -79.0;
        row[33] = -200.0;
        let (mut s64, mut sx64) = (0f64, 0f64);
        for &x in &row {
            let d = x as f64 - m as f64;
            let e = d.exp();
            s64 += e;
            if e > 0.0 {
                sx64 += e * d;
            }
        }
        let mut x = row.clone();
        let (s, sx) = exp_pass(&mut x, m);
        assert!(((s as f64) - s64).abs() < 1e-5 * s64, "{s} vs {s64}");
        assert!(((sx as f64) - sx64).abs() < 1e-5 * (1.0 + sx64.abs()), "{sx} vs {sx64}");
        assert_eq!((x[5], x[33]), (0.0, 0.0));
        assert_eq!(x[17], 1.0);
        row[9] = f32::NAN;
        let (s, sx) = exp_pass(&mut row, m);
        assert!(s.is_nan() && sx.is_nan());
    }

    /// The 16-lane row pass gives the 8-lane one's bits: the exponentials and both sums, also
    /// with masked, far and NaN logits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_pass_on_16_lanes_has_the_bits_of_8() {
        if !simd::has_avx512() || !simd::avx2::available() {
            return;
        }
        let mut row: Vec<f32> = (0..8192).map(|i| (i as f32 * 0.37).sin() * 30.0 - 10.0).collect();
        row[5] = f32::NEG_INFINITY;
        row[20] = -79.0;
        row[33] = -200.0;
        for nan in [false, true] {
            if nan {
                row[901] = f32::NAN;
            }
            let (mut a, mut b) = (row.clone(), row.clone());
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked above).
            let (s8, s16) = unsafe { (x86::exp_pass_8(&mut a, 15.0), x86::exp_pass_16(&mut b, 15.0)) };
            let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
            assert!(same(s8.0, s16.0) && same(s8.1, s16.1), "{s8:?} vs {s16:?}");
            assert!(a.iter().zip(&b).all(|(&x, &y)| same(x, y)));
        }
    }

    /// Values and gradients of `Σ c_r · logp_r` (plus the entropies) from [`by_chunk_groups`]
    /// (`group` chunks a weight-gradient product), in f64: collected by a bound
    /// [`crate::Grads`] when `bound`, else by a plain backward.
    fn chunked(
        h: &Tensor,
        w: &Tensor,
        t: &Tensor,
        temp: f64,
        rows: usize,
        group: usize,
        bound: bool,
    ) -> [Tensor; 4] {
        let (hv, wv) = (candle_core::Var::from_tensor(h).unwrap(), candle_core::Var::from_tensor(w).unwrap());
        let mut g = crate::Grads::new(&[hv.clone(), wv.clone()]);
        let slot = GradSlot::new();
        if bound {
            g.bind(&slot);
        }
        let (lp, en) = by_chunk_groups(hv.as_tensor(), wv.as_tensor(), t, temp, rows, group, &slot).unwrap();
        let n = h.dim(0).unwrap();
        let c = Tensor::from_vec((0..n).map(|i| 0.3 + 0.1 * i as f64).collect::<Vec<_>>(), n, &Device::Cpu)
            .unwrap();
        let loss = (&lp * &c).unwrap().sum_all().unwrap();
        if bound {
            g.backward(&loss).unwrap();
            return [lp, en, g.get(0).unwrap().unwrap(), g.get(1).unwrap().unwrap()];
        }
        let store = loss.backward().unwrap();
        let get = |v: &candle_core::Var| store.get(v.as_tensor()).unwrap().clone();
        [lp.clone(), en, get(&hv), get(&wv)]
    }

    /// The chunked composed form (what CUDA and bf16 take) against the one-piece composed form:
    /// one chunk, several, a ragged last one, one row each; with and without a temperature; the
    /// weight's gradient from one product per chunk, per two or three chunks, or per call; in a
    /// bound `Grads` and in a plain backward. Each chunk is recomputed in the backward, so
    /// nothing of its logits is kept.
    #[test]
    fn by_chunks_matches_the_composed_form_and_recomputes_each_chunk() {
        let (n, c, v) = (7, 5, 11);
        let (h, w, t) = (randn(&[n, c], 5), randn(&[v, c], 6), targets(n, v));
        for temp in [1.0, 0.7] {
            let (hv, wv) =
                (candle_core::Var::from_tensor(&h).unwrap(), candle_core::Var::from_tensor(&w).unwrap());
            let (lp, en) = composed(hv.as_tensor(), wv.as_tensor(), &t, None, temp);
            let coef =
                Tensor::from_vec((0..n).map(|i| 0.3 + 0.1 * i as f64).collect::<Vec<_>>(), n, &Device::Cpu);
            let store = (&lp * coef.unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let want = [
                lp,
                en,
                store.get(hv.as_tensor()).unwrap().clone(),
                store.get(wv.as_tensor()).unwrap().clone(),
            ];
            for (rows, group, bound) in [
                (n, 1, true),
                (100, 1, true),
                (3, 1, true),
                (3, 2, true),
                (2, 3, false),
                (1, 1, true),
                (1, 4, false),
            ] {
                let before = crate::checkpoint_recomputations();
                let got = chunked(&h, &w, &t, temp, rows, group, bound);
                let recomputed = crate::checkpoint_recomputations() - before;
                let case = format!("temperature {temp}, {rows} rows a chunk, {group} a group, bound {bound}");
                assert_eq!(recomputed, n.div_ceil(rows.min(n)), "{case}");
                for (what, (a, b)) in ["logp", "entropy", "dh", "dW"].iter().zip(got.iter().zip(&want)) {
                    let d = max_diff(a, b);
                    assert!(d < 1e-12, "{what}, {case}: off by {d}");
                }
            }
        }
    }

    /// Off the fused CPU op (the composed path, as on CUDA) the public function chunks too, and
    /// matches the fused op with a selection.
    #[test]
    fn the_composed_path_matches_the_fused_op() {
        let (n, c, v) = (9, 4, 13);
        let (h, w, t, sel) = (randn(&[n, c], 7), randn(&[v, c], 8), targets(n, v), selection(n));
        let fused = lm_head_logprobs(&h, &w, &t, Some(&sel), 0.8, true).unwrap();
        let _composed = crate::composed_scope();
        let (lp, en) = lm_head_logprobs(&h, &w, &t, Some(&sel), 0.8, true).unwrap();
        assert!(max_diff(&lp, &fused.0) < 1e-12 && max_diff(&en, &fused.1) < 1e-12);
    }

    #[test]
    fn bad_targets_and_shapes_are_errors() {
        let (h, w) = (randn(&[3, 2], 1), randn(&[4, 2], 2));
        let err = lm_head_logprobs(&h, &w, &targets(3, 9), None, 1.0, false).unwrap_err().to_string();
        assert!(err.contains("not below the vocabulary size 4"), "{err}");
        let err = lm_head_logprobs(&h, &w, &targets(2, 4), None, 1.0, false).unwrap_err().to_string();
        assert!(err.contains("2 targets for 3 rows"), "{err}");
    }
}
