//! TRL 1.16.0's DPO losses as pure functions of each pair's summed logprobs (TRL
//! `DPOTrainer._compute_loss`), with their exact derivatives.
//!
//! Every loss depends on the policy only through the per-sequence sums `c` (chosen) and `r`
//! (rejected), so a step computes the loss and `∂L/∂c_i`, `∂L/∂r_i` here, in f64, and backpropagates
//! the surrogate `Σ_i ∂L/∂c_i · c_i + ∂L/∂r_i · r_i`, whose gradient in the weights is the loss's.
//! The derivatives come from forward-mode dual numbers ([`Dual`]), so each loss is written once,
//! as TRL writes it.
//!
//! Notation: `Δc = c − c_ref`, `Δr = r − r_ref` (the log-ratios); the scores `s_c = f'(Δc)`,
//! `s_r = f'(Δr)` with f-DPO's divergence (`s = Δ` for the default reverse KL); `δ = s_c − s_r`.

use super::config::{DpoLossType, FDivergence};

/// One pair's inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairLogps {
    /// Policy logprob of the chosen completion (summed over its tokens).
    pub chosen: f64,
    /// Policy logprob of the rejected completion.
    pub rejected: f64,
    /// Reference logprob of the chosen completion.
    pub ref_chosen: f64,
    /// Reference logprob of the rejected completion.
    pub ref_rejected: f64,
    /// Completion tokens of the chosen sequence (after truncation; IPO and `sigmoid_norm` divide by
    /// it, at least 1).
    pub chosen_len: f64,
    /// Completion tokens of the rejected sequence.
    pub rejected_len: f64,
    /// Chosen tokens whose logprob is in `chosen` (`sft` divides the batch's sum by their total).
    pub chosen_scored: f64,
}

/// The loss settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LossParams {
    /// Losses and weights.
    pub losses: Vec<(DpoLossType, f64)>,
    /// β.
    pub beta: f64,
    /// ε of `robust` and `exo_pair`.
    pub label_smoothing: f64,
    /// f-DPO's divergence.
    pub f_divergence: FDivergence,
    /// α of the α-divergence.
    pub f_alpha: f64,
    /// τ of DiscoPOP.
    pub discopop_tau: f64,
}

/// The loss of a batch and its gradient in each pair's logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct LossGrad {
    /// `Σ_k w_k · mean_i ℓ_k(i)`.
    pub loss: f64,
    /// `∂ loss / ∂ c_i`.
    pub d_chosen: Vec<f64>,
    /// `∂ loss / ∂ r_i`.
    pub d_rejected: Vec<f64>,
}

/// A forward-mode dual number: a value and its derivative in one input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dual {
    /// Value.
    pub v: f64,
    /// Derivative.
    pub d: f64,
}

impl Dual {
    /// A constant.
    pub fn c(v: f64) -> Self {
        Self { v, d: 0.0 }
    }
    fn exp(self) -> Self {
        let e = self.v.exp();
        Self { v: e, d: e * self.d }
    }
    fn sigmoid(self) -> Self {
        let s = sigmoid(self.v);
        Self { v: s, d: s * (1.0 - s) * self.d }
    }
    /// `log σ(x)`, computed as torch's `logsigmoid`: `min(x, 0) − log1p(exp(−|x|))`.
    fn logsigmoid(self) -> Self {
        let v = self.v.min(0.0) - (-self.v.abs()).exp().ln_1p();
        Self { v, d: sigmoid(-self.v) * self.d }
    }
    fn relu(self) -> Self {
        if self.v > 0.0 {
            self
        } else {
            Self::c(0.0)
        }
    }
    fn sq(self) -> Self {
        self * self
    }
    /// `min(x, hi)` (`torch.clamp(max=hi)`: no gradient above).
    fn clamp_max(self, hi: f64) -> Self {
        if self.v > hi {
            Self::c(hi)
        } else {
            self
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

impl std::ops::Add for Dual {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self { v: self.v + o.v, d: self.d + o.d }
    }
}
impl std::ops::Sub for Dual {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self { v: self.v - o.v, d: self.d - o.d }
    }
}
impl std::ops::Mul for Dual {
    type Output = Self;
    fn mul(self, o: Self) -> Self {
        Self { v: self.v * o.v, d: self.d * o.v + self.v * o.d }
    }
}
impl std::ops::Mul<Dual> for f64 {
    type Output = Dual;
    fn mul(self, o: Dual) -> Dual {
        Dual { v: self * o.v, d: self * o.d }
    }
}
impl std::ops::Neg for Dual {
    type Output = Self;
    fn neg(self) -> Self {
        Self { v: -self.v, d: -self.d }
    }
}

/// f-DPO's score of a log-ratio. TRL `_compute_loss`, the `f_divergence_type` branch.
fn score(ratio: Dual, p: &LossParams) -> Dual {
    match p.f_divergence {
        FDivergence::ReverseKl => ratio,
        FDivergence::ForwardKl => Dual::c(1.0) - (-ratio).exp(),
        FDivergence::JsDivergence => Dual::c(std::f64::consts::LN_2) + ratio.logsigmoid(),
        FDivergence::AlphaDivergence => {
            let a = p.f_alpha;
            if (a - 1.0).abs() < 1e-6 {
                return ratio;
            }
            let coef = 1.0 / (a - 1.0);
            coef * ((a - 1.0) * ratio).clamp_max(80.0).exp() - Dual::c(coef)
        }
    }
}

/// One pair's loss of type `kind` (not `sft`), from the policy logprobs `c`, `r` (duals) and the
/// rest of `x`. TRL `_compute_loss`, the `loss_type` branches.
fn pair_loss(kind: DpoLossType, c: Dual, r: Dual, x: &PairLogps, p: &LossParams) -> Dual {
    let beta = p.beta;
    let eps = p.label_smoothing;
    let (c_ratio, r_ratio) = (c - Dual::c(x.ref_chosen), r - Dual::c(x.ref_rejected));
    let (cs, rs) = (score(c_ratio, p), score(r_ratio, p));
    let delta = cs - rs;
    let per_token = || {
        let (nc, nr) = (x.chosen_len.max(1.0), x.rejected_len.max(1.0));
        (1.0 / nc) * cs - (1.0 / nr) * rs
    };
    use DpoLossType as L;
    match kind {
        L::Sigmoid => -(beta * delta).logsigmoid(),
        L::Hinge => (Dual::c(1.0) - beta * delta).relu(),
        L::Ipo => (per_token() - Dual::c(1.0 / (2.0 * beta))).sq(),
        L::ExoPair => {
            let z = beta * delta;
            let (log_pw, log_pl) = ((-eps).ln_1p(), eps.ln());
            z.sigmoid() * (z.logsigmoid() - Dual::c(log_pw))
                + (-z).sigmoid() * ((-z).logsigmoid() - Dual::c(log_pl))
        }
        L::NcaPair => {
            let (cr, rr) = (beta * c_ratio, beta * r_ratio);
            -cr.logsigmoid() - 0.5 * (-cr).logsigmoid() - 0.5 * (-rr).logsigmoid()
        }
        L::Robust => {
            let z = beta * delta;
            (1.0 / (1.0 - 2.0 * eps)) * (-(1.0 - eps) * z.logsigmoid() + eps * (-z).logsigmoid())
        }
        L::BcoPair => -(beta * c_ratio).logsigmoid() - (-(beta * r_ratio)).logsigmoid(),
        L::SppoHard => (c_ratio - Dual::c(0.5 / beta)).sq() + (r_ratio + Dual::c(0.5 / beta)).sq(),
        L::ApoZero => Dual::c(1.0) - (beta * c_ratio).sigmoid() + (beta * r_ratio).sigmoid(),
        L::ApoDown => (beta * c_ratio).sigmoid() + Dual::c(1.0) - (beta * (c_ratio - r_ratio)).sigmoid(),
        L::Discopop => {
            let z = beta * delta;
            let m = (1.0 / p.discopop_tau * z).sigmoid();
            -z.logsigmoid() * (Dual::c(1.0) - m) + (-z).exp() * m
        }
        L::SigmoidNorm => -(beta * per_token()).logsigmoid(),
        // Validated away (`DpoConfig::validate`); `sft` is handled by `batch_loss`.
        L::Sft | L::Aot | L::AotUnpaired => Dual::c(f64::NAN),
    }
}

/// The loss of a batch of pairs and its gradient in each pair's policy logprobs.
pub fn batch_loss(pairs: &[PairLogps], p: &LossParams) -> LossGrad {
    let n = pairs.len() as f64;
    let mut out =
        LossGrad { loss: 0.0, d_chosen: vec![0.0; pairs.len()], d_rejected: vec![0.0; pairs.len()] };
    for &(kind, w) in &p.losses {
        if kind == DpoLossType::Sft {
            // −mean over the chosen tokens of their logprob: −Σ c_i / Σ scored chosen tokens.
            let tokens: f64 = pairs.iter().map(|x| x.chosen_scored).sum();
            out.loss += w * -pairs.iter().map(|x| x.chosen).sum::<f64>() / tokens;
            out.d_chosen.iter_mut().for_each(|g| *g -= w / tokens);
            continue;
        }
        let mut mean = 0.0;
        for (i, x) in pairs.iter().enumerate() {
            let vc = pair_loss(kind, Dual { v: x.chosen, d: 1.0 }, Dual::c(x.rejected), x, p);
            let vr = pair_loss(kind, Dual::c(x.chosen), Dual { v: x.rejected, d: 1.0 }, x, p);
            mean += vc.v / n;
            out.d_chosen[i] += w * vc.d / n;
            out.d_rejected[i] += w * vr.d / n;
        }
        out.loss += w * mean;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(losses: Vec<(DpoLossType, f64)>, f: FDivergence) -> LossParams {
        LossParams {
            losses,
            beta: 0.3,
            label_smoothing: 0.1,
            f_divergence: f,
            f_alpha: 0.4,
            discopop_tau: 0.05,
        }
    }

    fn pairs() -> Vec<PairLogps> {
        let p = |c, r, rc, rr, nc, nr| PairLogps {
            chosen: c,
            rejected: r,
            ref_chosen: rc,
            ref_rejected: rr,
            chosen_len: nc,
            rejected_len: nr,
            chosen_scored: nc,
        };
        vec![
            p(-7.0, -9.5, -8.0, -8.5, 3.0, 5.0),
            p(-3.0, -2.0, -2.5, -2.2, 2.0, 1.0),
            p(-4.0, -4.0, -4.0, -4.0, 2.0, 2.0),
        ]
    }

    /// Every loss's derivative agrees with central finite differences of its value.
    #[test]
    fn derivatives_match_finite_differences() {
        use DpoLossType as L;
        let kinds = [
            L::Sigmoid,
            L::Hinge,
            L::Ipo,
            L::ExoPair,
            L::NcaPair,
            L::Robust,
            L::BcoPair,
            L::SppoHard,
            L::ApoZero,
            L::ApoDown,
            L::Discopop,
            L::SigmoidNorm,
            L::Sft,
        ];
        let fs = [
            FDivergence::ReverseKl,
            FDivergence::ForwardKl,
            FDivergence::JsDivergence,
            FDivergence::AlphaDivergence,
        ];
        for kind in kinds {
            for f in fs {
                let p = params(vec![(kind, 0.7)], f);
                let base = pairs();
                let g = batch_loss(&base, &p);
                let h = 1e-6;
                for i in 0..base.len() {
                    for side in 0..2 {
                        let at = |d: f64| {
                            let mut x = base.clone();
                            if side == 0 {
                                x[i].chosen += d;
                            } else {
                                x[i].rejected += d;
                            }
                            batch_loss(&x, &p).loss
                        };
                        let fd = (at(h) - at(-h)) / (2.0 * h);
                        let ad = if side == 0 { g.d_chosen[i] } else { g.d_rejected[i] };
                        // The hinge's kink is not at these points.
                        assert!((fd - ad).abs() < 1e-6, "{kind:?} {f:?} pair {i} side {side}: {fd} vs {ad}");
                    }
                }
            }
        }
    }

    /// At the reference (Δ = 0): sigmoid is log 2, hinge 1, IPO 1/(4β²); identical pairs have no
    /// gradient in any loss built on δ.
    #[test]
    fn known_values() {
        let at_ref = PairLogps {
            chosen: -3.0,
            rejected: -5.0,
            ref_chosen: -3.0,
            ref_rejected: -5.0,
            chosen_len: 2.0,
            rejected_len: 4.0,
            chosen_scored: 2.0,
        };
        let one = |k| batch_loss(&[at_ref], &params(vec![(k, 1.0)], FDivergence::ReverseKl));
        assert!((one(DpoLossType::Sigmoid).loss - std::f64::consts::LN_2).abs() < 1e-15);
        assert!((one(DpoLossType::Sigmoid).d_chosen[0] + 0.15).abs() < 1e-15, "−β/2");
        assert_eq!(one(DpoLossType::Hinge).loss, 1.0);
        assert!((one(DpoLossType::Ipo).loss - 1.0 / (4.0 * 0.09)).abs() < 1e-12);
        let g = batch_loss(&pairs()[2..], &params(vec![(DpoLossType::Sigmoid, 1.0)], FDivergence::ReverseKl));
        assert_eq!(g.d_chosen[0] + g.d_rejected[0], 0.0, "identical pair: the gradients cancel");
    }
}
