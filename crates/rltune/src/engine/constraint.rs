//! Training on admissible actions (`[agent] actions = "admissible"`): the policy samples each
//! token of a command from its softmax renormalised over the tokens the command trie allows there
//! ([`crate::generation::admissible`]), so the logprobs PPO, GRPO and RLOO compare, of the policy
//! and of the reference, are those of the same renormalised distributions.
//!
//! A [`Constraint`] holds, for every position of the padded batch, the allowed tokens as a
//! gather index `(B, L−1, K)` into the vocabulary and an additive mask `(B, L−1, K)` (0 on the
//! set, −1e9 on the padding of shorter sets); `K` is the largest set. Positions outside the
//! responses get the one-token set of their target, so their logprob and entropy are 0 (the
//! losses mask them out anyway).
//!
//! The constrained head computes the `(rows, V)` logits with [`ops::linear`] (differentiable on
//! every device), gathers the `K` allowed logits and normalises over them: it never forms a
//! `(rows, V)` log-softmax, and with every token allowed it is the unconstrained head
//! (tests/integration/admissible_ppo.rs checks one PPO step against the fused head's).

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::ops;

/// The mask value of the padding of shorter allowed sets (`exp` of it is 0; finite, so that
/// `0 · mask` in the entropy stays 0).
const PAD: f32 = -1e9;

/// The allowed tokens of every position of a batch (see the module docs).
pub(crate) struct Constraint {
    /// `(B, L−1, K)` u32: the allowed token ids.
    pub(crate) idx: Tensor,
    /// `(B, L−1, K)` f32: 0 on the allowed ids, −1e9 on padding.
    pub(crate) pad: Tensor,
}

impl Constraint {
    /// Builds the constraint of the right-padded `ids (B, L)` whose row `i` has its response at
    /// columns `starts[i] + 1 ..` with `allowed[i][j]` the set of response token `j`.
    pub(crate) fn new(
        ids: &[Vec<u32>],
        starts: &[usize],
        responses: &[Vec<u32>],
        allowed: &[Vec<Vec<u32>>],
        device: &Device,
    ) -> Result<Self> {
        let b = ids.len();
        check_allowed(responses, allowed, "StepInput.allowed", "sample", "response")?;
        let w = ids.first().map_or(0, Vec::len).saturating_sub(1);
        let k = allowed.iter().flatten().map(Vec::len).max().unwrap_or(1).max(1);
        // Index and mask take 8 bytes a slot, and the forward gathers as many logits.
        let bytes = b * w * k * 8;
        if bytes > 1 << 30 {
            tracing::warn!(
                "the largest allowed set (the support of one sampled token) holds {k} ids, so this \
                 batch's constraint takes {:.1} GiB ({b} rows × {w} positions × {k}); with top_p, cap \
                 the supports with [generation] top_k (applied first) or use min_p",
                bytes as f64 / f64::from(1u32 << 30)
            );
        }
        let (mut idx, mut pad) = (vec![0u32; b * w * k], vec![PAD; b * w * k]);
        for i in 0..b {
            for c in 0..w {
                let at = (i * w + c) * k;
                let set: &[u32] = match c.checked_sub(starts[i]) {
                    Some(j) if j < allowed[i].len() => &allowed[i][j],
                    _ => std::slice::from_ref(&ids[i][c + 1]),
                };
                for (slot, &tok) in set.iter().enumerate() {
                    idx[at + slot] = tok;
                    pad[at + slot] = 0.0;
                }
                // Padding slots repeat the first id (any valid id), masked out.
                let first = set[0];
                idx[at + set.len()..at + k].iter_mut().for_each(|x| *x = first);
            }
        }
        Ok(Self {
            idx: Tensor::from_vec(idx, (b, w, k), device)?,
            pad: Tensor::from_vec(pad, (b, w, k), device)?,
        })
    }

    /// The rows `rows` (a u32 index) of the batch.
    pub(crate) fn select(&self, rows: &Tensor) -> Result<Self> {
        Ok(Self { idx: self.idx.index_select(rows, 0)?, pad: self.pad.index_select(rows, 0)? })
    }

    /// Rows `start .. start + n`.
    pub(crate) fn narrow(&self, start: usize, n: usize) -> Result<Self> {
        Ok(Self { idx: self.idx.narrow(0, start, n)?, pad: self.pad.narrow(0, start, n)? })
    }
}

/// Checks that `allowed` holds, for each row of `tokens`, one set per token that contains it
/// (the tokens were sampled under these sets). Messages read `{row} i: {what}: {token} token j
/// …`, naming the caller's field and words.
pub(crate) fn check_allowed(
    tokens: &[Vec<u32>],
    allowed: &[Vec<Vec<u32>>],
    what: &str,
    row: &'static str,
    token: &str,
) -> Result<()> {
    if allowed.len() != tokens.len() {
        return Err(Error::batch(format!("{what}: {} rows for a batch of {}", allowed.len(), tokens.len())));
    }
    for (i, (a, r)) in allowed.iter().zip(tokens).enumerate() {
        if a.len() != r.len() {
            return Err(Error::row_of(
                row,
                i,
                format!("{what}: {} allowed sets for {} {token} tokens", a.len(), r.len()),
            ));
        }
        for (j, (set, tok)) in a.iter().zip(r).enumerate() {
            if !set.contains(tok) {
                return Err(Error::row_of(
                    row,
                    i,
                    format!(
                        "{what}: {token} token {j} ({tok}) is not in its allowed set {set:?}: the {token} \
                         was not sampled under these sets"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The allowed sets of `N` positions as the gather index and mask `(N, K)` of
/// [`constrained_logprobs`] (`K`: the largest set; an empty set is an error).
pub(crate) fn row_sets(sets: &[&[u32]], device: &Device) -> Result<(Tensor, Tensor)> {
    let n = sets.len();
    let k = sets.iter().map(|s| s.len()).max().unwrap_or(1).max(1);
    let (mut idx, mut pad) = (vec![0u32; n * k], vec![PAD; n * k]);
    for (r, set) in sets.iter().enumerate() {
        let first = *set
            .first()
            .ok_or_else(|| Error::row_of("position", r, "an empty allowed set (no token may follow)"))?;
        for slot in 0..k {
            idx[r * k + slot] = *set.get(slot).unwrap_or(&first);
            if slot < set.len() {
                pad[r * k + slot] = 0.0;
            }
        }
    }
    Ok((Tensor::from_vec(idx, (n, k), device)?, Tensor::from_vec(pad, (n, k), device)?))
}

/// Logprobs of `targets (N)` and entropies `(N)` under `softmax(h·Wᵀ / τ)` renormalised over
/// each row's allowed set (`idx`, `pad`: `(N, K)`); differentiable in `hidden` and `weight`
/// (the entropy carries no gradient, as the unconstrained head's); the weight's gradient goes
/// where `grads` (its store's slot) points.
pub(crate) fn constrained_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    grads: &ops::GradSlot,
    targets: &Tensor,
    idx: &Tensor,
    pad: &Tensor,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let logits = ops::linear_with(hidden, weight, None, grads)?;
    let logits = if temperature != 1.0 { (logits / temperature)? } else { logits };
    let g = (logits.gather(&idx.contiguous()?, 1)? + pad.to_dtype(logits.dtype())?)?;
    let max = g.max_keepdim(1)?.detach();
    let shifted = g.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    let target = logits.gather(&targets.to_dtype(DType::U32)?.unsqueeze(1)?.contiguous()?, 1)?;
    let logp = target.broadcast_sub(&max)?.broadcast_sub(&lse)?.squeeze(1)?;
    let logq = shifted.detach().broadcast_sub(&lse.detach())?;
    let entropy = (logq.exp()? * &logq)?.sum(1)?.neg()?;
    Ok((logp, entropy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::admissible::allowed_logprob;

    /// Issue #57: the gradient of the truncated logprobs (supports from top-k / top-p / min-p
    /// on the rows' own logits, held fixed) equals central finite differences in f64, for the
    /// hidden states and the LM head weight: the loss is `Σ w_r · log π(target_r | support_r)`.
    #[test]
    fn truncated_logprob_gradients_match_finite_differences() {
        use crate::generation::sampler::{log_distribution, support, SamplerConfig};
        let dev = Device::Cpu;
        let (n, c, v, temp) = (4usize, 6usize, 23usize, 0.8);
        // Fixed, smooth values (candle's CPU `randn` cannot be seeded).
        let h0: Vec<f64> = (0..n * c).map(|k| (1.3 * k as f64 + 0.4).sin() * 0.6).collect();
        let w0: Vec<f64> = (0..v * c).map(|k| (0.37 * (k * k % 101) as f64).cos()).collect();
        let h0 = Tensor::from_vec(h0, (n, c), &dev).unwrap();
        let w0 = Tensor::from_vec(w0, (v, c), &dev).unwrap();
        let logits = h0.matmul(&w0.t().unwrap()).unwrap().to_vec2::<f64>().unwrap();
        let cfgs = [
            SamplerConfig { temperature: temp, top_k: 5, ..Default::default() },
            SamplerConfig { temperature: temp, top_p: 0.8, ..Default::default() },
            SamplerConfig { temperature: temp, min_p: 0.1, ..Default::default() },
            SamplerConfig { temperature: temp, top_k: 12, top_p: 0.9, min_p: 0.05 },
        ];
        let sets: Vec<Vec<u32>> = logits
            .iter()
            .zip(&cfgs)
            .map(|(row, cfg)| {
                let row: Vec<f32> = row.iter().map(|&x| x as f32).collect();
                support(&log_distribution(&row, cfg, &[]))
            })
            .collect();
        assert!(sets.iter().all(|s| s.len() > 2 && s.len() < v), "{sets:?}");
        // Each row's target: its support's second id.
        let targets: Vec<u32> = sets.iter().map(|s| s[1]).collect();
        let refs: Vec<&[u32]> = sets.iter().map(Vec::as_slice).collect();
        let (idx, pad) = row_sets(&refs, &dev).unwrap();
        let tt = Tensor::new(targets.as_slice(), &dev).unwrap();
        let weights = Tensor::new(&[0.7f64, -1.1, 0.4, 1.3], &dev).unwrap();
        let loss = |h: &Tensor, w: &Tensor| {
            let (lp, _) = constrained_logprobs(h, w, &ops::GradSlot::new(), &tt, &idx, &pad, temp).unwrap();
            (lp * &weights).unwrap().sum_all().unwrap()
        };
        let (h, w) =
            (candle_core::Var::from_tensor(&h0).unwrap(), candle_core::Var::from_tensor(&w0).unwrap());
        let grads = loss(h.as_tensor(), w.as_tensor()).backward().unwrap();
        let eps = 1e-5;
        let mut worst = 0f64;
        for (var, x0, other_is_h) in [(&h, &h0, false), (&w, &w0, true)] {
            let analytic = grads.get(var).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let flat = x0.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            for (k, &g) in analytic.iter().enumerate() {
                let at = |d: f64| {
                    let mut x = flat.clone();
                    x[k] += d;
                    let x = Tensor::from_vec(x, x0.dims(), &dev).unwrap();
                    let l = if other_is_h { loss(&h0, &x) } else { loss(&x, &w0) };
                    l.to_scalar::<f64>().unwrap()
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                worst = worst.max((fd - g).abs());
            }
        }
        let sizes: Vec<usize> = sets.iter().map(Vec::len).collect();
        eprintln!("supports of {sizes:?} of {v} ids: analytic vs finite differences, max |diff| {worst:e}");
        assert!(worst < 1e-7, "analytic vs finite-difference gradient: max |diff| {worst:e}");
        // Not the untruncated gradient: renormalizing over the support changes it.
        let all: Vec<&[u32]> =
            vec![&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]; n];
        let (idx_all, pad_all) = row_sets(&all, &dev).unwrap();
        let (lp_all, _) = constrained_logprobs(
            h.as_tensor(),
            w.as_tensor(),
            &ops::GradSlot::new(),
            &tt,
            &idx_all,
            &pad_all,
            temp,
        )
        .unwrap();
        let g_all = (lp_all * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let d = (g_all.get(&h).unwrap() - grads.get(&h).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f64>().unwrap() > 1e-3, "the support changes nothing");
    }

    /// The constrained logprobs are the sampler's ([`allowed_logprob`]), and their gradients
    /// those of a log-softmax over logits with −∞ outside the set (finite differences of the
    /// dense form would say the same; the dense form is candle's own ops).
    #[test]
    fn matches_the_sampler_and_the_dense_masked_log_softmax() {
        let dev = Device::Cpu;
        let (n, c, v, temp) = (3usize, 5usize, 7usize, 0.7);
        let h = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c), &dev).unwrap()).unwrap();
        let w = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, (v, c), &dev).unwrap()).unwrap();
        let sets: [&[u32]; 3] = [&[1, 4, 6], &[2], &[0, 3]];
        let targets = [4u32, 2, 0];
        let k = 3;
        let (mut idx, mut pad) = (vec![], vec![]);
        for s in sets {
            for slot in 0..k {
                idx.push(*s.get(slot).unwrap_or(&s[0]));
                pad.push(if slot < s.len() { 0.0 } else { PAD });
            }
        }
        let idx = Tensor::from_vec(idx, (n, k), &dev).unwrap();
        let pad = Tensor::from_vec(pad, (n, k), &dev).unwrap();
        let tt = Tensor::new(&targets, &dev).unwrap();
        let (logp, entropy) =
            constrained_logprobs(h.as_tensor(), w.as_tensor(), &ops::GradSlot::new(), &tt, &idx, &pad, temp)
                .unwrap();
        let logits = h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        let got = logp.to_vec1::<f32>().unwrap();
        for r in 0..n {
            let want = allowed_logprob(&logits[r], temp, sets[r], targets[r]);
            assert!((got[r] as f64 - want).abs() < 1e-5, "row {r}: {} vs {want}", got[r]);
        }
        assert!(entropy.to_vec1::<f32>().unwrap()[1].abs() < 1e-6, "a one-token set has no entropy");

        // Gradients against the dense masked log-softmax.
        let mut dense = vec![f32::NEG_INFINITY; n * v];
        for (r, s) in sets.iter().enumerate() {
            s.iter().for_each(|&t| dense[r * v + t as usize] = 0.0);
        }
        let dense = Tensor::from_vec(dense, (n, v), &dev).unwrap();
        let weights = Tensor::new(&[0.3f32, -1.2, 0.8], &dev).unwrap();
        let loss_of = |lp: &Tensor| (lp * &weights).unwrap().sum_all().unwrap();
        let g1 = loss_of(&logp).backward().unwrap();
        let z =
            ((h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap() / temp).unwrap() + &dense).unwrap();
        let lsm = candle_nn::ops::log_softmax(&z, 1).unwrap();
        let lp2 = lsm.gather(&tt.unsqueeze(1).unwrap(), 1).unwrap().squeeze(1).unwrap();
        let g2 = loss_of(&lp2).backward().unwrap();
        for var in [&h, &w] {
            let (a, b) = (g1.get(var).unwrap(), g2.get(var).unwrap());
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-5, "gradient differs by {d}");
        }
    }
}
