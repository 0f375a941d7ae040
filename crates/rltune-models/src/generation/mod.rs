//! Batched sampling with a KV cache.
//!
//! Prompts are left-padded; position ids come from the mask (`cumsum − 1`), so a padded batch
//! gives the same logprobs as each prompt run alone. Every sequence stops on its own at EOS (the
//! EOS token is kept, as TRL's `generate` keeps it). Each sampled token comes with its logprob
//! under the distribution it was drawn from, and, with a value head, the value of the state that
//! produced it — what PPO needs, so rollouts can skip a second forward pass.
//!
//! Defaults follow TRL's advice for PPO: pure sampling, no top-k, no top-p, no min-p, no
//! min-length. With top-k, top-p or min-p on, each token is drawn from the truncated
//! distribution renormalized over its support, and the sample keeps each position's support
//! ([`Sample::support`], sorted ids): the trainers renormalize the policy's and the reference's
//! distributions over the same sets (their `allowed` input, the admissible-action machinery), so
//! the first ratio is 1 and the KL compares the distributions actually sampled from (issue #57).
//! `logprob_support = "vocabulary"` keeps TRL's behaviour instead: logprobs over the whole
//! vocabulary, which biases the ratio and the KL (TRL's documented cause of negative KL), with a
//! warning. Min-length (banning EOS) is not recorded as a support: it still biases the KL.

pub mod admissible;
pub mod carried;
pub mod sampler;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

pub use sampler::SamplerConfig;

use crate::error::{ConfigError, Error, Result};
use crate::layers::causal_bias;
use crate::tokenizer::{pad, PaddingSide};
use crate::{CausalLm, ValueHead};

thread_local! {
    /// Time spent and real tokens run in prefills on this thread, since it started.
    static PREFILL: std::cell::Cell<(std::time::Duration, usize)> =
        const { std::cell::Cell::new((std::time::Duration::ZERO, 0)) };
}

/// Counts a prefill of `tokens` real tokens that took `elapsed`.
pub(crate) fn add_prefill(elapsed: std::time::Duration, tokens: usize) {
    PREFILL.with(|p| {
        let (t, n) = p.get();
        p.set((t + elapsed, n + tokens));
    });
}

/// The time spent and the real (unpadded) tokens run in the prompt prefills of this thread's
/// sampling calls ([`generate`], [`admissible::generate_admissible`] and its carried form)
/// since the thread started: a caller takes the difference over a stretch of work, e.g. a
/// rollout's prefill share.
pub fn prefill_counters() -> (std::time::Duration, usize) {
    PREFILL.with(std::cell::Cell::get)
}

/// Generation settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenerationConfig {
    /// Tokens to sample per prompt at most.
    pub max_new_tokens: usize,
    /// Sampling temperature (logits are divided by it).
    pub temperature: f64,
    /// Keep only the k most likely tokens; 0 (default) disables; 1 is greedy decoding.
    pub top_k: usize,
    /// Nucleus sampling threshold; 1.0 (default) disables.
    pub top_p: f64,
    /// Keep the tokens at least `min_p` times as likely as the most likely one (applied after
    /// top-k and top-p, as transformers does); 0 (default) disables.
    pub min_p: f64,
    /// The distribution the logprobs of a truncated (top-k / top-p / min-p) sample are taken
    /// over, in sampling and in training: `"truncated"` (default, exact) or `"vocabulary"`
    /// (TRL's: the whole vocabulary).
    pub logprob_support: LogprobSupport,
    /// EOS is forbidden before this many new tokens; 0 (default) disables.
    pub min_new_tokens: usize,
    /// Seed of the sampler's random source.
    pub seed: u64,
    /// Ids that end a sequence; empty means the model config's EOS ids.
    pub eos_token_ids: Vec<u32>,
    /// Id used for padding; `None` means config.json's `pad_token_id`, else the first EOS id.
    pub pad_token_id: Option<u32>,
    /// Stop at EOS; false samples exactly `max_new_tokens` tokens (benchmarks).
    pub stop_at_eos: bool,
    /// The global index of the first prompt (not a config field). Each row draws from its own
    /// random stream, seeded by `seed` and its global index: a sample does not depend on the
    /// other rows of its batch, so the processes of a data-parallel run, each sampling its share
    /// of a batch, draw exactly what one process sampling the whole batch draws.
    #[serde(skip)]
    pub row_offset: u64,
    /// Each row's own stream seed, one per prompt (not a config field): when non-empty, row `i`
    /// draws from the stream seeded by `row_seeds[i]` instead of `row_seed(seed, row_offset + i)`,
    /// so rows with unrelated seeds (the requests a server batches together) share a batch and
    /// each still draws what it would draw alone. [`generate`] then samples on the host on every
    /// device ([`SamplingPath::Auto`]); only an explicit [`SamplingPath::Device`] ignores it.
    #[serde(skip)]
    pub row_seeds: Vec<u64>,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 20,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logprob_support: LogprobSupport::Truncated,
            min_new_tokens: 0,
            seed: 0,
            eos_token_ids: Vec::new(),
            pad_token_id: None,
            stop_at_eos: true,
            row_offset: 0,
            row_seeds: Vec::new(),
        }
    }
}

impl GenerationConfig {
    /// Checks ranges; the error names the field of the `[generation]` table.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        let bad = |field: &str, problem: String| ConfigError::new("generation", field, problem);
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(bad("temperature", format!("must be > 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        Ok(())
    }

    /// Whether top-k, top-p or min-p can drop a token.
    pub fn truncates(&self) -> bool {
        self.sampler().truncates()
    }

    /// Whether each sample keeps the supports of its tokens ([`Sample::support`]): truncated
    /// sampling with `logprob_support = "truncated"`.
    pub fn records_support(&self) -> bool {
        self.truncates() && self.logprob_support == LogprobSupport::Truncated
    }

    /// Whether any option that biases PPO's KL estimate is on: min-length, or truncation whose
    /// logprobs are taken over the whole vocabulary.
    pub fn biases_kl(&self) -> bool {
        (self.truncates() && !self.records_support()) || self.min_new_tokens > 0
    }

    /// The seed of row `i`'s random stream: `row_seeds[i]` when given, else
    /// [`row_seed`]`(seed, row_offset + i)`.
    pub fn stream_seed(&self, i: u64) -> u64 {
        match usize::try_from(i).ok().and_then(|i| self.row_seeds.get(i)) {
            Some(&s) => s,
            None => row_seed(self.seed, self.row_offset + i),
        }
    }

    fn sampler(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
        }
    }
}

/// What the logprobs of truncated sampling are taken over (`[generation] logprob_support`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogprobSupport {
    /// The truncated support each token was drawn from, renormalized: exact sampling, ratio and
    /// KL (rltune's default).
    #[default]
    Truncated,
    /// The whole vocabulary, as TRL computes them whatever the sampler truncated (its
    /// behaviour, kept on request; biased, see `docs/trl-deviations.md`).
    Vocabulary,
}

/// One generated sequence.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Sample {
    /// The prompt.
    pub query_ids: Vec<u32>,
    /// The sampled tokens (ending in EOS when the sequence stopped there).
    pub response_ids: Vec<u32>,
    /// Logprob of each response token under the distribution it was sampled from (with
    /// `logprob_support = "vocabulary"`: under the untruncated distribution).
    pub logprobs: Vec<f32>,
    /// With truncated sampling ([`GenerationConfig::records_support`]): the ids each response
    /// token was drawn from, sorted, one set per token; what a training forward renormalizes
    /// over (`StepInput::allowed`). `None` otherwise: the whole vocabulary.
    #[serde(skip)]
    pub support: Option<Vec<Vec<u32>>>,
    /// Value of the state that produced each response token (with a value head).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<f32>>,
}

/// Where the next token is drawn from the logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SamplingPath {
    /// [`Self::Device`] for pure sampling on a GPU, else [`Self::Host`].
    #[default]
    Auto,
    /// The logits `(B, V)` are copied to the host each token and sampled exactly (f64 CDF,
    /// [`sampler::sample_pure`] / [`sampler::log_distribution`]); every option. The CPU's path.
    Host,
    /// Sampled where the logits are, with candle ops ([`sampler::sample_on_device`]): only the
    /// ids and logprobs come back. Pure sampling (temperature, min-length) only.
    Device,
}

/// Samples continuations of `prompts` (token ids) in one batch.
///
/// With `v_head`, each sample also carries the values. Prompt ids at or above the model's
/// vocabulary size are rejected with an error naming the prompt. Sampling takes
/// [`SamplingPath::Auto`]: exact on the host on a CPU, on the device on a GPU unless the rows
/// have their own seeds (`row_seeds`).
pub fn generate(
    lm: &CausalLm,
    v_head: Option<&ValueHead>,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
    device: &Device,
) -> Result<Vec<Sample>> {
    generate_with(lm, v_head, prompts, cfg, device, SamplingPath::Auto)
}

/// [`generate`] with the sampling path chosen. [`SamplingPath::Device`] with top-k, top-p or
/// min-p is an error.
pub fn generate_with(
    lm: &CausalLm,
    v_head: Option<&ValueHead>,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
    device: &Device,
    path: SamplingPath,
) -> Result<Vec<Sample>> {
    cfg.validate()?;
    let pure = !cfg.truncates();
    let on_device = match path {
        // Rows with their own seeds are drawn on the host, where each row has its stream.
        SamplingPath::Auto => pure && !device.is_cpu() && cfg.row_seeds.is_empty(),
        SamplingPath::Host => false,
        SamplingPath::Device if pure => true,
        SamplingPath::Device => {
            return Err(Error::Input(
                "sampling on the device supports pure sampling only (temperature, min_new_tokens); \
                 set top_k = 0, top_p = 1.0 and min_p = 0, or sample on the host"
                    .into(),
            ))
        }
    };
    // Greedy decoding (top_k = 1) is for evaluation, where no KL is estimated.
    if cfg.biases_kl() && cfg.top_k != 1 {
        tracing::warn!(
            "min_new_tokens, or top_k / top_p / min_p with logprob_support = \"vocabulary\", is on: \
             sampling no longer follows the distribution the logprobs are taken over, which biases \
             the ratio and the KL estimate (it can turn negative and PPO will exploit it)"
        );
    }
    check_prompts(prompts, lm.vocab_size())?;
    // Sampling trains nothing: on the CPU in f32, LoRA adapters are folded into their weights
    // once per call (PEFT's merge), so each decoding step runs one product per layer instead of
    // three. The logprobs then differ from the unmerged forward's by rounding only (~1e-6).
    let merged = match device.is_cpu() && lm.lm_head_weight().dtype() == DType::F32 {
        true => lm.with_adapters_merged()?,
        false => None,
    };
    let lm = merged.as_ref().unwrap_or(lm);
    let _awake = device.is_cpu().then(rltune_kernels::cpu::keep_pool_awake);
    // Under bf16 products on a GPU, each weight is cast once for the whole call, not once per
    // decoding step (Qwen2-0.5B: 128 casts of its 136M-element LM head per batch of samples).
    let _casts = rltune_kernels::weight_cast_scope();
    let eos =
        if cfg.eos_token_ids.is_empty() { lm.config().eos_token_ids() } else { cfg.eos_token_ids.clone() };
    let pad_id = cfg.pad_token_id.or(lm.config().pad_token_id()).or(eos.first().copied()).unwrap_or(0);
    let b = prompts.len();
    let (ids, mut mask) = pad(prompts, pad_id, PaddingSide::Left);
    let prompt_len = ids.first().map_or(0, Vec::len);
    if let Some(max) = lm.config().max_positions() {
        if prompt_len + cfg.max_new_tokens > max {
            return Err(Error::Input(format!(
                "prompt length {prompt_len} + max_new_tokens {} exceeds the model's {max} positions",
                cfg.max_new_tokens
            )));
        }
    }
    if !cfg.row_seeds.is_empty() && cfg.row_seeds.len() != b {
        return Err(Error::Input(format!(
            "generation: {} row_seeds given for {b} prompts; give one per prompt, or none",
            cfg.row_seeds.len()
        )));
    }
    let mut rngs: Vec<rand::rngs::StdRng> =
        (0..b as u64).map(|i| rand::rngs::StdRng::seed_from_u64(cfg.stream_seed(i))).collect();
    let mut noise = if on_device { Some(sampler::DeviceNoise::new(device, cfg.seed)?) } else { None };
    let mut cache = lm.new_cache();
    cache.reserve(prompt_len + cfg.max_new_tokens);
    let mut samples: Vec<Sample> = prompts
        .iter()
        .map(|p| Sample {
            query_ids: p.clone(),
            response_ids: Vec::new(),
            logprobs: Vec::new(),
            support: cfg.records_support().then(Vec::new),
            values: v_head.map(|_| Vec::new()),
        })
        .collect();
    let mut done = vec![false; b];
    // Next position id of each row = number of real tokens so far.
    let mut next_pos: Vec<u32> = mask.iter().map(|m| m.iter().map(|&x| x as u32).sum()).collect();

    let started = std::time::Instant::now();
    // A prompt that repeats an earlier one (GRPO's and RLOO's `num_generations` samples of each
    // prompt, best-of-N's candidates) is prefilled once, and its cache and last hidden state
    // copied to the rows that repeat it. Each row's prefill is computed by itself (the batch is
    // padded to the same length, and no op mixes rows), so on the CPU the samples are the same
    // bit for bit (tested); a GPU's products may round differently for fewer rows.
    let (of_row, distinct) = distinct_rows(prompts);
    let repeats = distinct.len() < b;
    let (ids, prefill_mask) = match repeats {
        true => (pick_rows(&ids, &distinct), pick_rows(&mask, &distinct)),
        false => (ids, mask.clone()),
    };
    let input = Tensor::new(ids, device)?;
    let positions = crate::layers::position_ids_from_mask(&prefill_mask, device)?;
    let bias = causal_bias(&prefill_mask, prompt_len, DType::F32, device)?;
    let mut hidden = lm.forward(&input, &positions, &bias, Some(&mut cache))?;
    if repeats {
        let last = hidden.narrow(1, hidden.dim(1)? - 1, 1)?.contiguous()?;
        let idx = Tensor::new(of_row.iter().map(|&r| r as u32).collect::<Vec<_>>(), device)?;
        hidden = last.index_select(&idx, 0)?;
        cache.select_rows(&of_row)?;
    }
    add_prefill(started.elapsed(), distinct.iter().map(|&r| prompts[r].len()).sum());
    // Every decoding step multiplies the same weights by B rows: pack them once.
    let _packed = rltune_kernels::gemm::pack_scope(&lm.weight_matrices());
    for step in 0..cfg.max_new_tokens {
        // The last position's hidden state (B, 1, C), then its logits (B, V), read in place: each
        // row is copied once, by the task that samples it.
        let last = hidden.narrow(1, hidden.dim(1)? - 1, 1)?;
        let values = match v_head {
            Some(h) => Some(h.forward(&last)?.squeeze(1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        let banned: &[u32] = if step < cfg.min_new_tokens { &eos } else { &[] };
        let mut next = vec![pad_id; b];
        let picked: Vec<Option<Picked>> = match noise.as_mut() {
            Some(noise) => {
                // Finished rows are sampled too (their tokens are dropped): a fixed (B, V) shape.
                let logits = lm.logits(&last)?.squeeze(1)?;
                let (ids, lps) = sampler::sample_on_device(&logits, cfg.temperature, banned, noise)?;
                ids.into_iter()
                    .zip(lps)
                    .zip(&done)
                    .map(|((id, lp), &d)| (!d).then_some((id as usize, lp as f64, None)))
                    .collect()
            }
            None => sample_on_host(lm, &last, &done, &mut rngs, cfg, banned)?,
        };

        for (i, pick) in picked.into_iter().enumerate() {
            let Some((tok, lp, support)) = pick else { continue };
            let s = &mut samples[i];
            s.response_ids.push(tok as u32);
            s.logprobs.push(lp as f32);
            if let (Some(sets), Some(set)) = (s.support.as_mut(), support) {
                sets.push(set);
            }
            if let (Some(vs), Some(v)) = (s.values.as_mut(), values.as_ref()) {
                vs.push(v[i]);
            }
            next[i] = tok as u32;
            if cfg.stop_at_eos && eos.contains(&(tok as u32)) {
                done[i] = true;
            }
        }
        if done.iter().all(|&d| d) || step + 1 == cfg.max_new_tokens {
            break;
        }
        // Rows that are done feed padding that nothing attends to.
        for (i, m) in mask.iter_mut().enumerate() {
            m.push(u8::from(!done[i] || samples[i].response_ids.len() == step + 1));
        }
        let pos: Vec<u32> = next_pos.clone();
        next_pos.iter_mut().for_each(|p| *p += 1);
        let input = Tensor::from_vec(next, (b, 1), device)?;
        let positions = Tensor::from_vec(pos, (b, 1), device)?;
        let bias = causal_bias(&mask, 1, DType::F32, device)?;
        hidden = lm.forward(&input, &positions, &bias, Some(&mut cache))?;
    }
    Ok(samples)
}

/// Rows `which` of `rows`, in order.
fn pick_rows<T: Clone>(rows: &[Vec<T>], which: &[usize]) -> Vec<Vec<T>> {
    which.iter().map(|&r| rows[r].clone()).collect()
}

/// Each row's index among the distinct prompts, and the first row of each distinct prompt, in
/// order of appearance.
fn distinct_rows(prompts: &[Vec<u32>]) -> (Vec<usize>, Vec<usize>) {
    let mut seen: std::collections::HashMap<&[u32], usize> = std::collections::HashMap::new();
    let mut distinct = Vec::new();
    let of_row = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            *seen.entry(p.as_slice()).or_insert_with(|| {
                distinct.push(i);
                distinct.len() - 1
            })
        })
        .collect();
    (of_row, distinct)
}

/// A sampled token, its logprob, and (when recorded) the support it was drawn from.
type Picked = (usize, f64, Option<Vec<u32>>);

/// One token per live row (`None` for finished rows), sampled exactly on the host from the
/// last position's logits.
fn sample_on_host(
    lm: &CausalLm,
    last: &Tensor,
    done: &[bool],
    rngs: &mut [rand::rngs::StdRng],
    cfg: &GenerationConfig,
    banned: &[u32],
) -> Result<Vec<Option<Picked>>> {
    // The logits (B, V), read in place: each row is copied once, by the task that samples it.
    let logits = lm.logits(last)?.squeeze(1)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?;
    let vocab = logits.dim(1)?;
    // One uniform per live row from the row's own stream, then the rows' distributions and draws
    // in parallel: the same tokens for a seed on any thread count and in any batch.
    let draws: Vec<Option<f64>> =
        done.iter().zip(rngs.iter_mut()).map(|(&d, rng)| (!d).then(|| rng.gen::<f64>())).collect();
    let sampler_cfg = cfg.sampler();
    let pure = !cfg.truncates();
    let picked = rltune_kernels::with_f32(&logits, "generation: logits", |logits| {
        draws
            .par_iter()
            .zip(logits.par_chunks(vocab.max(1)))
            .map(|(u, row)| u.map(|u| sample_row(row, cfg, &sampler_cfg, pure, banned, u)))
            .collect()
    })?;
    Ok(picked)
}

/// One draw from one row of logits with the uniform `u`: pure sampling takes the vectorized
/// path, truncated sampling the f64 one, whose support is kept when `cfg` records it; with
/// `logprob_support = "vocabulary"` the logprob is the untruncated `log_softmax(logits / T)`'s.
fn sample_row(
    row: &[f32],
    cfg: &GenerationConfig,
    sampler_cfg: &SamplerConfig,
    pure: bool,
    banned: &[u32],
    u: f64,
) -> Picked {
    if pure {
        let (tok, lp) = sampler::sample_pure(row, cfg.temperature, banned, u);
        return (tok, lp, None);
    }
    let logp = sampler::log_distribution(row, sampler_cfg, banned);
    let tok = sampler::sample_at(&logp, u);
    match cfg.logprob_support {
        LogprobSupport::Truncated => (tok, logp[tok], Some(sampler::support(&logp))),
        LogprobSupport::Vocabulary => {
            let whole = SamplerConfig { temperature: cfg.temperature, ..Default::default() };
            (tok, sampler::log_distribution(row, &whole, &[])[tok], None)
        }
    }
}

/// The seed of row `row`'s random stream in a batch sampled with `seed` (splitmix64 twice: rows
/// and seeds close together get unrelated streams).
pub fn row_seed(seed: u64, row: u64) -> u64 {
    fn splitmix64(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    splitmix64(splitmix64(seed) ^ row)
}

/// Rejects empty prompts and ids outside the vocabulary, naming the prompt.
fn check_prompts(prompts: &[Vec<u32>], vocab_size: usize) -> Result<()> {
    if prompts.is_empty() {
        return Err(Error::Input("no prompts given".into()));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(Error::Input(format!("prompt {i} is empty")));
        }
        if let Some(&bad) = p.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::Input(format!(
                "prompt {i} has token id {bad}, which is not below the model's vocab_size {vocab_size}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::ParamStore;
    use crate::{gpt2::Gpt2Config, CausalLmConfig};

    fn tiny_lm() -> CausalLm {
        let cfg = CausalLmConfig::Gpt2(Gpt2Config::tiny(40, 16, 2, 2, 32));
        let store = ParamStore::random(3, false, DType::F32, &Device::Cpu).unwrap();
        CausalLm::load(&store.root(), &cfg).unwrap()
    }

    /// Issue #57: truncated sampling keeps each token's support; the token is in it, its logprob
    /// is the softmax renormalized over it (what a training forward computes from the same
    /// logits), and `"vocabulary"` draws the same tokens with the untruncated logprobs and no
    /// support. Pure sampling keeps none.
    #[test]
    fn truncated_samples_keep_their_supports() {
        let lm = tiny_lm();
        let prompts = vec![vec![1u32, 2, 3], vec![4]];
        let base = GenerationConfig { max_new_tokens: 6, stop_at_eos: false, seed: 5, ..Default::default() };
        let pure = generate(&lm, None, &prompts, &base, &Device::Cpu).unwrap();
        assert!(pure.iter().all(|s| s.support.is_none()));
        let cfg = GenerationConfig { temperature: 0.8, top_k: 12, top_p: 0.9, min_p: 0.05, ..base };
        let exact = generate(&lm, None, &prompts, &cfg, &Device::Cpu).unwrap();
        let whole = GenerationConfig { logprob_support: LogprobSupport::Vocabulary, ..cfg.clone() };
        let trl = generate(&lm, None, &prompts, &whole, &Device::Cpu).unwrap();
        for (s, t) in exact.iter().zip(&trl) {
            assert_eq!(s.response_ids, t.response_ids, "the draws do not depend on logprob_support");
            assert!(t.support.is_none());
            let sets = s.support.as_ref().unwrap();
            assert_eq!(sets.len(), s.response_ids.len());
            // Each position's logits, from one forward of the whole sequence.
            let ids: Vec<u32> = s.query_ids.iter().chain(&s.response_ids).copied().collect();
            let n = ids.len();
            let mask = vec![vec![1u8; n]];
            let h = lm
                .forward(
                    &Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(),
                    &crate::layers::position_ids_from_mask(&mask, &Device::Cpu).unwrap(),
                    &causal_bias(&mask, n, DType::F32, &Device::Cpu).unwrap(),
                    None,
                )
                .unwrap();
            let logits = lm.logits(&h).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
            for (j, (&tok, set)) in s.response_ids.iter().zip(sets).enumerate() {
                let row = &logits[s.query_ids.len() + j - 1];
                assert!(set.contains(&tok) && set.windows(2).all(|w| w[0] < w[1]));
                assert!(set.len() <= 12 && !set.is_empty());
                let want = admissible::allowed_logprob(row, 0.8, set, tok);
                assert!((s.logprobs[j] as f64 - want).abs() < 1e-4, "{} vs {want}", s.logprobs[j]);
                let full: Vec<u32> = (0..40).collect();
                let want = admissible::allowed_logprob(row, 0.8, &full, tok);
                assert!((t.logprobs[j] as f64 - want).abs() < 1e-4, "{} vs {want}", t.logprobs[j]);
            }
        }
        let bad = GenerationConfig { min_p: 1.5, ..Default::default() };
        assert_eq!(bad.validate().unwrap_err().to_string(), "generation.min_p must be in [0, 1], got 1.5");
    }

    /// A repeated prompt is prefilled once and its cache copied (GRPO's samples of one prompt):
    /// a row that repeats an earlier prompt samples exactly what it samples when it is the first
    /// of its prompt, with other prompts around it. GPT-2 and Llama keep their caches in place,
    /// GPT-NeoX as tensors; widths past the GEMM's 256-deep blocks.
    #[test]
    fn repeated_prompts_are_prefilled_once_and_sample_the_same() {
        use crate::{gpt_neox::GptNeoXConfig, llama::LlamaConfig};
        let configs = [
            CausalLmConfig::Gpt2(Gpt2Config::tiny(40, 288, 2, 4, 32)),
            CausalLmConfig::Llama(LlamaConfig::tiny(40, 288, 2, 9, 3)),
            CausalLmConfig::GptNeoX(GptNeoXConfig::tiny(40, 64, 2, 4)),
        ];
        let p = |x: u32| vec![x, x + 1, 3, x % 7, 5];
        // Rows 1 and 4 repeat rows 0 and 3 in the first batch, and are their prompt's first in
        // the second (all prompts of one length, so the padding is the same).
        let repeated = vec![p(10), p(10), p(10), p(20), p(20), p(20)];
        let distinct = vec![p(11), p(10), p(12), p(13), p(20), p(14)];
        for cfg in configs {
            let store = ParamStore::random(3, false, DType::F32, &Device::Cpu).unwrap();
            let lm = CausalLm::load(&store.root(), &cfg).unwrap();
            let gen =
                GenerationConfig { max_new_tokens: 6, stop_at_eos: false, seed: 9, ..Default::default() };
            let a = generate(&lm, None, &repeated, &gen, &Device::Cpu).unwrap();
            let b = generate(&lm, None, &distinct, &gen, &Device::Cpu).unwrap();
            for row in [1, 4] {
                assert_eq!(a[row].response_ids, b[row].response_ids, "{cfg:?} row {row}");
                assert_eq!(a[row].logprobs, b[row].logprobs, "{cfg:?} row {row}");
            }
            // The copies draw from their own streams.
            assert_ne!(a[0].response_ids, a[1].response_ids, "{cfg:?}");
        }
    }
}
