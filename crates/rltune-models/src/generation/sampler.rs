//! Exact sampling from one row of logits, with optional (off by default) top-k, top-p, min-p and
//! min-length processing.
//!
//! The returned logprob is that of the sampled token under the distribution actually sampled
//! from: `log softmax(process(logits / T))`, the truncated distribution renormalized over its
//! support ([`support`]), which a training forward renormalizes over again (issue #57). [`log_distribution`] and [`sample_at`] compute in
//! f64 and handle every option; [`sample_pure`], the path generation takes for pure sampling (the
//! PPO default), makes one vectorized f32 pass over the row instead of two f64 `exp` passes
//! (the f64 path took 5 ms per decoding step at GPT-2's vocabulary and batch 16).

use rand::Rng;

/// How logits are turned into the sampling distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// Divides the logits; 1.0 is pure sampling.
    pub temperature: f64,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1.0 disables.
    pub top_p: f64,
    /// Keep the tokens whose probability is at least `min_p` times the most likely one's; 0
    /// disables (it keeps every token).
    pub min_p: f64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0 }
    }
}

impl SamplerConfig {
    /// Whether top-k, top-p or min-p can drop a token (greedy `top_k = 1` included).
    pub fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// The log-probabilities of the processed distribution over one row of logits.
///
/// `banned` ids (EOS under min-length) get probability 0. Then, in the order transformers'
/// `generate` applies its warpers (`generation/utils.py::_get_logits_processor`, 4.46:
/// temperature → top-k → top-p → min-p, each on the previous one's output, with
/// `min_tokens_to_keep = 1`, `logits_process.py`):
/// - `TopKLogitsWarper`: drops the tokens below the k-th largest logit; ties with it are kept,
///   so the support can exceed k.
/// - `TopPLogitsWarper`: sorts ascending, drops the tokens whose cumulative probability is at
///   most `1 − p`, always keeping the most likely token. Equal probabilities are ordered by id
///   (torch's unstable sort leaves their order unspecified).
/// - `MinPLogitsWarper`: drops the tokens whose probability (over the top-p output) is below
///   `min_p` times the largest, always keeping the most likely token.
///
/// The arithmetic is f64 (transformers': the logits' dtype), so a token within rounding of a
/// cut can fall on the other side of it.
pub fn log_distribution(logits: &[f32], cfg: &SamplerConfig, banned: &[u32]) -> Vec<f64> {
    let t = if cfg.temperature > 0.0 { cfg.temperature } else { 1.0 };
    let mut x: Vec<f64> = logits.iter().map(|&l| l as f64 / t).collect();
    for &b in banned {
        if let Some(v) = x.get_mut(b as usize) {
            *v = f64::NEG_INFINITY;
        }
    }
    if cfg.top_k > 0 && cfg.top_k < x.len() {
        let mut sorted: Vec<f64> = x.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[cfg.top_k - 1];
        x.iter_mut().filter(|v| **v < kth).for_each(|v| *v = f64::NEG_INFINITY);
    }
    if cfg.top_p < 1.0 {
        let p = softmax(&x);
        let mut order: Vec<usize> = (0..x.len()).collect();
        order.sort_by(|&a, &b| p[a].total_cmp(&p[b]));
        let mut cum = 0.0;
        let last = order.len().saturating_sub(1);
        for (rank, &i) in order.iter().enumerate() {
            cum += p[i];
            if cum <= 1.0 - cfg.top_p && rank != last {
                x[i] = f64::NEG_INFINITY;
            }
        }
    }
    if cfg.min_p > 0.0 {
        let p = softmax(&x);
        let top = p.iter().copied().fold(0.0, f64::max);
        let best = x.iter().enumerate().fold(0, |b, (i, v)| if *v > x[b] { i } else { b });
        for (i, v) in x.iter_mut().enumerate() {
            if p[i] < cfg.min_p * top && i != best {
                *v = f64::NEG_INFINITY;
            }
        }
    }
    log_softmax(&x)
}

/// The support of a log-distribution from [`log_distribution`]: the ids with a finite logprob,
/// ascending (the allowed set a training forward renormalizes over).
pub fn support(logp: &[f64]) -> Vec<u32> {
    logp.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, _)| i as u32).collect()
}

/// Draws one index from `logp` (log-probabilities) by inverting the CDF with `u ~ U[0, 1)`.
pub fn sample<R: Rng>(logp: &[f64], rng: &mut R) -> usize {
    sample_at(logp, rng.gen())
}

/// The index where the CDF of `logp` first exceeds `u` ([`sample`] with its uniform draw given).
pub fn sample_at(logp: &[f64], u: f64) -> usize {
    let mut cum = 0.0;
    let mut last_possible = 0;
    for (i, &lp) in logp.iter().enumerate() {
        if lp == f64::NEG_INFINITY {
            continue;
        }
        cum += lp.exp();
        last_possible = i;
        if u < cum {
            return i;
        }
    }
    // Rounding left the total just under 1: take the last token with non-zero probability.
    last_possible
}

/// Pure sampling (temperature only, no top-k or top-p) from one row of logits with the uniform
/// draw `u ∈ [0, 1)`: the token and its logprob under `softmax(logits / T)` with `banned`
/// removed.
///
/// One vectorized f32 pass turns the row into `e^(x/T − m)`; the draw scans the running sum (in
/// f64) to `u · Σ`, the same inversion of the CDF as [`sample_at`]. It agrees with
/// [`log_distribution`] + [`sample_at`] up to the f32 rounding of `x/T − m` and of `e^…` (a
/// relative ~1e-7 per weight, and ~1e-5 absolute in the logprob when |x/T| is near 100): a
/// draw that close to a CDF step can pick the neighbouring token. A row with no finite weight
/// (all banned) goes to the f64 path. A temperature ≤ 0 counts as 1, as there.
pub fn sample_pure(logits: &[f32], temperature: f64, banned: &[u32], u: f64) -> (usize, f64) {
    let mut row = logits.to_vec();
    for &b in banned {
        if let Some(v) = row.get_mut(b as usize) {
            *v = f32::NEG_INFINITY;
        }
    }
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    rltune_kernels::exp_row_f32(&mut row, t as f32);
    // The total in the scan's own f64 arithmetic (an f32 sum is off by ~1e-6, which would move
    // the target across a CDF step in one draw out of twenty at GPT-2's vocabulary).
    let mut lanes = [0f64; 4];
    let mut chunks = row.chunks_exact(4);
    for c in &mut chunks {
        for (acc, &e) in lanes.iter_mut().zip(c) {
            *acc += e as f64;
        }
    }
    let s = lanes.iter().sum::<f64>() + chunks.remainder().iter().map(|&e| e as f64).sum::<f64>();
    if !(s > 0.0 && s.is_finite()) {
        let cfg = SamplerConfig { temperature, ..Default::default() };
        let logp = log_distribution(logits, &cfg, banned);
        let tok = sample_at(&logp, u);
        return (tok, logp[tok]);
    }
    let target = u * s;
    let (mut cum, mut last) = (0f64, 0);
    let mut pick = None;
    for (i, &e) in row.iter().enumerate() {
        if e > 0.0 {
            last = i;
            cum += e as f64;
            if target < cum {
                pick = Some(i);
                break;
            }
        }
    }
    // Rounding left the total just under the target: take the last token with weight.
    let tok = pick.unwrap_or(last);
    (tok, (row[tok] as f64).ln() - s.ln())
}

/// Where [`sample_on_device`] gets its uniforms: on a CUDA device, the device's own seeded
/// generator (cuRAND; `Tensor::rand`), so nothing but the sampled ids and logprobs crosses to
/// the host; on the CPU (which candle cannot seed), a seeded host stream.
pub enum DeviceNoise {
    /// The device's generator, seeded once.
    Device,
    /// A host stream (the CPU).
    Host(Box<rand::rngs::StdRng>),
}

impl DeviceNoise {
    /// Seeds the noise of `device` with `seed`.
    pub fn new(device: &candle_core::Device, seed: u64) -> crate::Result<Self> {
        use rand::SeedableRng;
        if device.is_cpu() {
            return Ok(Self::Host(Box::new(rand::rngs::StdRng::seed_from_u64(seed))));
        }
        device.set_seed(seed)?;
        Ok(Self::Device)
    }

    /// Uniforms in (0, 1), shape `(b, v)`, on `device`.
    fn uniform(
        &mut self,
        b: usize,
        v: usize,
        device: &candle_core::Device,
    ) -> crate::Result<candle_core::Tensor> {
        // Away from 0 and 1, where the Gumbel transform is infinite.
        let (lo, hi) = (1e-20f64, 1.0 - f32::EPSILON as f64);
        let u = match self {
            Self::Device => candle_core::Tensor::rand(0f32, 1f32, (b, v), device)?,
            Self::Host(rng) => {
                let u: Vec<f32> = (0..b * v).map(|_| rng.gen::<f32>()).collect();
                candle_core::Tensor::from_vec(u, (b, v), device)?
            }
        };
        Ok(u.clamp(lo, hi)?)
    }
}

/// Pure sampling (a temperature, `banned` ids excluded, no top-k / top-p) of one token per row of
/// `logits` `(B, V)`, computed on their device: `log_softmax(logits / T)`, then the Gumbel-max
/// trick, `argmax_j(logp_j − log(−log u_j))` with uniforms `u` from `noise`, which draws exactly
/// from `softmax(logits / T)`. Returns each row's token and its logprob under that distribution:
/// the only `2·B` numbers that leave the device. The exact CPU sampler ([`sample_pure`]) stays the
/// CPU's default; this is the path of a GPU, where copying `(B, V)` logits to the host each token
/// would cost more than the forward pass. Draws differ from the CPU sampler's for the same seed.
pub fn sample_on_device(
    logits: &candle_core::Tensor,
    temperature: f64,
    banned: &[u32],
    noise: &mut DeviceNoise,
) -> crate::Result<(Vec<u32>, Vec<f32>)> {
    use candle_core::{DType, Tensor, D};
    let (b, v) = logits.dims2()?;
    let device = logits.device();
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let mut x = (logits.to_dtype(DType::F32)? / t)?;
    if !banned.is_empty() {
        let mut bias = vec![0f32; v];
        for &id in banned {
            if let Some(b) = bias.get_mut(id as usize) {
                *b = f32::NEG_INFINITY;
            }
        }
        x = x.broadcast_add(&Tensor::from_vec(bias, (1, v), device)?)?;
    }
    let logp = candle_nn::ops::log_softmax(&x, D::Minus1)?;
    let gumbel = noise.uniform(b, v, device)?.log()?.neg()?.log()?.neg()?;
    let ids = (&logp + gumbel)?.argmax_keepdim(D::Minus1)?; // (B, 1) u32
    let lp = logp.gather(&ids, D::Minus1)?;
    let ids = ids.squeeze(1)?.to_vec1::<u32>()?;
    let lp = lp.squeeze(1)?.to_vec1::<f32>()?;
    Ok((ids, lp))
}

fn softmax(x: &[f64]) -> Vec<f64> {
    log_softmax(x).into_iter().map(f64::exp).collect()
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + x.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn empirical_distribution_matches_softmax_over_temperature() {
        let logits = [1.0f32, 0.0, -1.0, 2.0, 0.5];
        let cfg = SamplerConfig { temperature: 0.7, ..Default::default() };
        let logp = log_distribution(&logits, &cfg, &[]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let n = 200_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[sample(&logp, &mut rng)] += 1;
        }
        for (i, c) in counts.iter().enumerate() {
            let p = logp[i].exp();
            let freq = *c as f64 / n as f64;
            // 5 standard errors of a binomial proportion.
            let se = (p * (1.0 - p) / n as f64).sqrt();
            assert!((freq - p).abs() < 5.0 * se, "token {i}: freq {freq} vs p {p}");
        }
    }

    #[test]
    fn top_k_and_top_p_keep_the_right_tokens() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let lp = log_distribution(&logits, &SamplerConfig { top_k: 2, ..Default::default() }, &[]);
        assert!(lp[0].is_finite() && lp[1].is_finite() && lp[2] == f64::NEG_INFINITY);
        let total: f64 = lp.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        // p ≈ [0.64, 0.24, 0.09, 0.03]; top_p 0.8 keeps the first two.
        let lp = log_distribution(&logits, &SamplerConfig { top_p: 0.8, ..Default::default() }, &[]);
        assert!(lp[1].is_finite() && lp[2] == f64::NEG_INFINITY);
        // A tiny top_p still keeps the best token.
        let lp = log_distribution(&logits, &SamplerConfig { top_p: 1e-6, ..Default::default() }, &[]);
        assert_eq!(lp[0], 0.0);
    }

    /// Issue #30: the device sampler (here on the CPU, through the same candle ops a GPU runs)
    /// draws from softmax(logits / T), never a banned id, returns each token's logprob under that
    /// distribution, and repeats itself for a seed.
    #[test]
    fn device_sampling_draws_from_the_tempered_softmax() {
        use candle_core::{Device, Tensor};
        let row = [1.0f32, 0.0, -1.0, 2.0, 0.5, 1.5];
        let (t, banned) = (0.7, [5u32]);
        let logp = log_distribution(&row, &SamplerConfig { temperature: t, ..Default::default() }, &banned);
        let b = 4000;
        let logits = Tensor::from_vec(row.repeat(b), (b, row.len()), &Device::Cpu).unwrap();
        let mut noise = DeviceNoise::new(&Device::Cpu, 7).unwrap();
        let mut counts = [0usize; 6];
        let rounds = 25;
        for _ in 0..rounds {
            let (ids, lps) = sample_on_device(&logits, t, &banned, &mut noise).unwrap();
            assert_eq!((ids.len(), lps.len()), (b, b));
            for (&id, &lp) in ids.iter().zip(&lps) {
                assert!(!banned.contains(&id), "sampled a banned id");
                assert!(
                    (lp as f64 - logp[id as usize]).abs() < 1e-5,
                    "logprob {lp} vs {}",
                    logp[id as usize]
                );
                counts[id as usize] += 1;
            }
        }
        let n = (b * rounds) as f64;
        for (i, c) in counts.iter().enumerate() {
            let p = logp[i].exp();
            let freq = *c as f64 / n;
            let se = (p * (1.0 - p) / n).sqrt();
            assert!((freq - p).abs() <= 5.0 * se, "token {i}: freq {freq} vs p {p}");
        }
        let draw = |seed| {
            let mut noise = DeviceNoise::new(&Device::Cpu, seed).unwrap();
            sample_on_device(&logits.narrow(0, 0, 64).unwrap(), 1.0, &[], &mut noise).unwrap().0
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn pure_sampling_agrees_with_the_f64_path() {
        // A GPT-2-sized row: same token for every draw away from a CDF step, logprobs to 1e-5.
        let logits: Vec<f32> = (0..50257).map(|i| (i as f32 * 0.618).sin() * 4.0).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (t, banned) in [(1.0, vec![]), (0.7, vec![50256u32, 0])] {
            let logp =
                log_distribution(&logits, &SamplerConfig { temperature: t, ..Default::default() }, &banned);
            let mut same = 0;
            for _ in 0..200 {
                let u: f64 = rng.gen();
                let want = sample_at(&logp, u);
                let (tok, lp) = sample_pure(&logits, t, &banned, u);
                assert!(!banned.contains(&(tok as u32)));
                assert!((lp - logp[tok]).abs() < 1e-5, "logprob {lp} vs {}", logp[tok]);
                same += usize::from(tok == want);
            }
            assert!(same >= 199, "{same} of 200 draws agree");
        }
        // Everything banned: the f64 path decides.
        let (tok, lp) = sample_pure(&[1.0, 2.0], 1.0, &[0, 1], 0.5);
        let logp = log_distribution(&[1.0, 2.0], &SamplerConfig::default(), &[0, 1]);
        assert_eq!(tok, sample_at(&logp, 0.5));
        assert!(lp.is_nan() == logp[tok].is_nan());
    }

    /// The survival function `P(X > x)` of chi-square with `df` degrees of freedom: the
    /// regularized upper incomplete gamma `Q(df/2, x/2)`, by its series below `a + 1` and its
    /// continued fraction above (Numerical Recipes, §6.2), with Lanczos' log-gamma (§6.1).
    fn chi2_sf(x: f64, df: usize) -> f64 {
        let (a, x) = (df as f64 / 2.0, x / 2.0);
        let ln_gamma = |z: f64| {
            let c = [
                76.180_091_729_471_46,
                -86.505_320_329_416_77,
                24.014_098_240_830_91,
                -1.231_739_572_450_155,
                0.001_208_650_973_866_179,
                -0.000_005_395_239_384_953,
            ];
            let t = z + 5.5 - (z + 0.5) * (z + 5.5).ln();
            let s =
                c.iter().enumerate().fold(1.000_000_000_190_015, |s, (j, c)| s + c / (z + 1.0 + j as f64));
            -t + (2.506_628_274_631_000_5 * s / z).ln()
        };
        let front = (-x + a * x.ln() - ln_gamma(a)).exp();
        if x < a + 1.0 {
            let (mut term, mut sum, mut ap) = (1.0 / a, 1.0 / a, a);
            while term.abs() > sum.abs() * 1e-15 {
                ap += 1.0;
                term *= x / ap;
                sum += term;
            }
            1.0 - sum * front
        } else {
            let tiny = 1e-300;
            let (mut b, mut c, mut d) = (x + 1.0 - a, 1.0 / tiny, 1.0 / (x + 1.0 - a));
            let mut h = d;
            for i in 1..10_000 {
                let an = -(i as f64) * (i as f64 - a);
                b += 2.0;
                d = an * d + b;
                d = if d.abs() < tiny { 1.0 / tiny } else { 1.0 / d };
                c = b + an / c;
                c = if c.abs() < tiny { tiny } else { c };
                let del = d * c;
                h *= del;
                if (del - 1.0).abs() < 1e-15 {
                    break;
                }
            }
            front * h
        }
    }

    /// The significance level of the chi-square tests.
    const ALPHA: f64 = 0.001;

    /// Pearson's chi-square of `counts` against the probabilities `exp(logp)`, over the cells
    /// with a non-zero probability, and its degrees of freedom; a count in a zero-probability
    /// cell is an infinite statistic.
    fn pearson(counts: &[usize], logp: &[f64]) -> (f64, usize) {
        let n: usize = counts.iter().sum();
        let (mut chi2, mut cells) = (0.0, 0usize);
        for (&c, &l) in counts.iter().zip(logp) {
            let e = l.exp() * n as f64;
            if e > 0.0 {
                chi2 += (c as f64 - e).powi(2) / e;
                cells += 1;
            } else if c > 0 {
                return (f64::INFINITY, cells);
            }
        }
        (chi2, cells.saturating_sub(1))
    }

    #[test]
    fn the_chi_square_tail_matches_the_tables() {
        // The 0.999 quantiles for 1, 4, 10 and 30 degrees of freedom (any chi-square table).
        for (df, q) in [(1, 10.828), (4, 18.467), (10, 29.588), (30, 59.703)] {
            let p = chi2_sf(q, df);
            assert!((p - 0.001).abs() < 1e-5, "df {df}: P(X > {q}) = {p}");
        }
    }

    /// Issue #57: the sampled frequencies under top-k, top-p, min-p and all three at a
    /// temperature match the truncated, renormalized distribution (Pearson's chi-square below
    /// its 0.999 quantile: significance 0.001, 100 000 draws from a fixed seed), and the same counts reject the
    /// untruncated softmax: the test can fail.
    #[test]
    fn truncated_sampling_matches_the_renormalized_distribution() {
        let logits: Vec<f32> = (0..16).map(|i| ((i * 7 % 16) as f32 * 0.37).sin() * 2.5).collect();
        let cases = [
            ("top_k = 5", SamplerConfig { top_k: 5, ..Default::default() }),
            ("top_p = 0.7", SamplerConfig { top_p: 0.7, ..Default::default() }),
            ("min_p = 0.2", SamplerConfig { min_p: 0.2, ..Default::default() }),
            (
                "T 1.3, k 9, p 0.9, min_p 0.1",
                SamplerConfig { temperature: 1.3, top_k: 9, top_p: 0.9, min_p: 0.1 },
            ),
        ];
        let n = 100_000;
        for (name, cfg) in cases {
            let logp = log_distribution(&logits, &cfg, &[]);
            let kept = support(&logp);
            assert!(kept.len() > 1 && kept.len() < logits.len(), "{name}: support {kept:?}");
            let total: f64 = logp.iter().map(|l| l.exp()).sum();
            assert!((total - 1.0).abs() < 1e-12, "{name}: sums to {total}");
            let mut rng = rand::rngs::StdRng::seed_from_u64(57);
            let mut counts = vec![0usize; logits.len()];
            for _ in 0..n {
                counts[sample(&logp, &mut rng)] += 1;
            }
            let (chi2, df) = pearson(&counts, &logp);
            let p = chi2_sf(chi2, df);
            assert!(p > ALPHA, "{name}: chi-square {chi2:.1} ({df} df), p = {p:.2e}, counts {counts:?}");
            // Against the untruncated softmax (at the same temperature) the test rejects.
            let whole = SamplerConfig { temperature: cfg.temperature, ..Default::default() };
            let untruncated = log_distribution(&logits, &whole, &[]);
            let mut chi2_whole = 0.0;
            for (&c, &l) in counts.iter().zip(&untruncated) {
                let e = l.exp() * n as f64;
                chi2_whole += (c as f64 - e).powi(2) / e;
            }
            let p_whole = chi2_sf(chi2_whole, logits.len() - 1);
            assert!(p_whole < ALPHA, "{name}: the untruncated softmax is not rejected (p = {p_whole})");
        }
    }

    /// transformers' rules: top-k keeps ties with the k-th logit; top-p keeps the most likely
    /// token however small p is and works on the top-k output; min-p compares with the most
    /// likely token of the top-p output and is applied last.
    #[test]
    fn truncation_follows_transformers_rules() {
        let kept = |logits: &[f32], cfg: SamplerConfig| support(&log_distribution(logits, &cfg, &[]));
        let logits = [2.0f32, 1.0, 1.0, 0.0, -1.0];
        assert_eq!(kept(&logits, SamplerConfig { top_k: 2, ..Default::default() }), vec![0, 1, 2]);
        assert_eq!(kept(&logits, SamplerConfig { top_k: 1, ..Default::default() }), vec![0]);
        assert_eq!(kept(&logits, SamplerConfig { top_p: 1e-9, ..Default::default() }), vec![0]);
        // p ∝ e^[2, 1, 1, 0, −1] = [0.521, 0.192, 0.192, 0.070, 0.026], 0.368 and 0.135 of the
        // best for ids 1-2 and 3: min_p 0.3 keeps 0, 1, 2; min_p 0.4 only 0.
        assert_eq!(kept(&logits, SamplerConfig { min_p: 0.3, ..Default::default() }), vec![0, 1, 2]);
        assert_eq!(kept(&logits, SamplerConfig { min_p: 0.4, ..Default::default() }), vec![0]);
        // Top-p after top-k: over the top-2 (three tokens with the tie), p ≈ [0.576, 0.212,
        // 0.212]; top_p 0.7 drops the cumulative ≤ 0.3 from the bottom: one of the tied pair,
        // id 1, which comes first in the ascending order (ties are ordered by id).
        let both = SamplerConfig { top_k: 2, top_p: 0.7, ..Default::default() };
        assert_eq!(kept(&logits, both.clone()), vec![0, 2]);
        // Min-p after top-p: relative to the best token, so unchanged by renormalization.
        let all = SamplerConfig { min_p: 0.5, ..both };
        assert_eq!(kept(&logits, all), vec![0]);
        // Temperature first: at T = 4 the ratios to the best are [1, 0.78, 0.78, 0.61, 0.47],
        // so min_p 0.6 keeps four tokens (at T = 1 it keeps one).
        let warm = SamplerConfig { temperature: 4.0, min_p: 0.6, ..Default::default() };
        assert_eq!(kept(&logits, warm), vec![0, 1, 2, 3]);
        assert_eq!(kept(&logits, SamplerConfig { min_p: 0.6, ..Default::default() }), vec![0]);
    }

    #[test]
    fn banned_tokens_are_never_sampled() {
        let lp = log_distribution(&[5.0, 0.0], &SamplerConfig::default(), &[0]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert!((0..100).all(|_| sample(&lp, &mut rng) == 1));
    }
}
