//! The model worker: one thread owns the model and samples every queued request in batches.
//!
//! Request handlers send a [`Job`] (its rows: one prompt and one stream seed per choice) and
//! wait for the reply. The worker blocks for the first job, then takes every job queued behind
//! it (waiting up to `batch_wait` for more) until `max_batch` rows, groups the rows by sampling
//! settings (temperature, top-p, top-k), and samples each group as one left-padded batch
//! (`generate_with` on the host path, each row with its own seed through `row_seeds`), so a row
//! draws what it would draw alone. A group's batch samples up to its longest `max_tokens`; each
//! row is cut to its own. A failure or a panic in one batch answers its requests with a 500 and
//! the worker goes on; a client that went away only loses its answer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use rltune::generation::sampler::{log_distribution, SamplerConfig};
use rltune::generation::{generate_with, GenerationConfig, SamplingPath};
use rltune::models::layers::{causal_bias, position_ids_from_mask};
use rltune::models::CausalLm;

use super::error::ApiError;

/// How a job's rows are sampled (the worker batches rows with equal settings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Tokens per row at most.
    pub max_tokens: usize,
    /// Temperature (> 0; greedy decoding is `top_k = 1`).
    pub temperature: f64,
    /// Nucleus threshold; 1.0 is off.
    pub top_p: f64,
    /// Keep the k most likely tokens; 0 is off.
    pub top_k: usize,
    /// Drop the tokens less likely than `min_p` times the most likely one; 0 is off.
    pub min_p: f64,
}

impl Params {
    /// The batching key: rows with equal keys share a batch.
    fn key(&self) -> Key {
        (self.temperature.to_bits(), self.top_p.to_bits(), self.top_k, self.min_p.to_bits())
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

/// A request's work: one row per choice.
pub struct Job {
    /// Each row's prompt ids (validated: non-empty, within the vocabulary and the context).
    pub prompts: Vec<Vec<u32>>,
    /// Each row's stream seed.
    pub seeds: Vec<u64>,
    /// Sampling settings.
    pub params: Params,
    /// Alternatives per token to return (0: none).
    pub top_logprobs: usize,
    /// Where the answer goes, one [`RowOut`] per row.
    pub reply: Sender<Result<Vec<RowOut>, ApiError>>,
}

/// One sampled row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RowOut {
    /// The sampled ids (ending with EOS when the row stopped there).
    pub ids: Vec<u32>,
    /// Each id's logprob under the distribution it was drawn from.
    pub logprobs: Vec<f32>,
    /// With `top_logprobs`: each position's most likely (id, logprob), best first.
    pub top: Vec<Vec<(u32, f32)>>,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Stats {
    /// Jobs answered.
    pub requests: AtomicU64,
    /// Sampling batches run.
    pub batches: AtomicU64,
    /// Rows sampled.
    pub rows: AtomicU64,
    /// Tokens sampled (before cutting rows to their own `max_tokens`).
    pub tokens: AtomicU64,
    /// The most requests in one batch so far.
    pub max_batch_requests: AtomicU64,
    /// The most rows in one batch so far.
    pub max_batch_rows: AtomicU64,
    /// Requests answered with an error by the worker.
    pub failed: AtomicU64,
    /// Error responses of any kind (bad requests included).
    pub http_errors: AtomicU64,
}

impl Stats {
    /// The counters in Prometheus' text format.
    pub fn prometheus(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("rltune_requests_total", "requests sampled", g(&self.requests)),
            ("rltune_batches_total", "sampling batches run", g(&self.batches)),
            ("rltune_rows_total", "rows (choices) sampled", g(&self.rows)),
            ("rltune_tokens_total", "tokens sampled", g(&self.tokens)),
            ("rltune_batch_requests_max", "most requests in one batch", g(&self.max_batch_requests)),
            ("rltune_batch_rows_max", "most rows in one batch", g(&self.max_batch_rows)),
            ("rltune_failed_requests_total", "requests the worker failed", g(&self.failed)),
            ("rltune_http_errors_total", "error responses", g(&self.http_errors)),
        ]
        .iter()
        .map(|(name, help, v)| format!("# HELP {name} {help}\n{name} {v}\n"))
        .collect()
    }
}

/// The worker's model and batching limits.
pub struct Worker {
    /// The policy.
    pub lm: CausalLm,
    /// Where it computes.
    pub device: Device,
    /// Rows per batch at most.
    pub max_batch: usize,
    /// How long to wait for more jobs after the first.
    pub batch_wait: Duration,
    /// The model's positions (prompt + new tokens), when limited.
    pub context: Option<usize>,
    /// Counters.
    pub stats: Arc<Stats>,
}

/// A row of a job: (job index, row index).
type RowRef = (usize, usize);

/// Temperature and top-p (their bits) and top-k: what rows must share to share a batch.
type Key = (u64, u64, usize, u64);

impl Worker {
    /// Serves jobs until every sender is dropped (the server shuts down), finishing those queued.
    pub fn run(self, rx: Receiver<Job>) {
        while let Ok(first) = rx.recv() {
            let mut rows = first.prompts.len();
            let mut jobs = vec![first];
            let deadline = Instant::now() + self.batch_wait;
            while rows < self.max_batch {
                let next = match rx.try_recv() {
                    Ok(job) => Ok(job),
                    Err(_) => rx.recv_timeout(deadline.saturating_duration_since(Instant::now())),
                };
                match next {
                    Ok(job) => {
                        rows += job.prompts.len();
                        jobs.push(job);
                    }
                    Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                }
            }
            self.serve(jobs);
        }
        tracing::debug!("model worker: queue closed, stopping");
    }

    /// Samples `jobs` and answers each.
    fn serve(&self, jobs: Vec<Job>) {
        let mut outs: Vec<Vec<RowOut>> =
            jobs.iter().map(|j| vec![RowOut::default(); j.prompts.len()]).collect();
        let mut errors: Vec<Option<ApiError>> = vec![None; jobs.len()];
        for batch in self.batches(&jobs) {
            let result = catch_unwind(AssertUnwindSafe(|| self.sample(&jobs, &batch)))
                .unwrap_or_else(|panic| Err(format!("the model worker panicked: {}", panic_text(&panic))));
            match result {
                Ok(rows) => {
                    for (&(j, r), out) in batch.iter().zip(rows) {
                        outs[j][r] = out;
                    }
                }
                Err(why) => {
                    tracing::error!("sampling failed: {why}");
                    for &(j, _) in &batch {
                        errors[j]
                            .get_or_insert_with(|| ApiError::internal(format!("sampling failed: {why}")));
                    }
                }
            }
        }
        for ((job, out), err) in jobs.into_iter().zip(outs).zip(errors) {
            let answer = match err {
                Some(e) => Err(e),
                None if job.top_logprobs > 0 => self.with_top(&job, out),
                None => Ok(out),
            };
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            if answer.is_err() {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
            }
            // The handler is gone when its client disconnected: the answer is dropped.
            let _ = job.reply.send(answer);
        }
    }

    /// Splits the jobs' rows into batches: equal sampling settings, at most `max_batch` rows,
    /// and the longest prompt plus the most new tokens within the context.
    fn batches(&self, jobs: &[Job]) -> Vec<Vec<RowRef>> {
        let mut groups: Vec<(Key, Vec<Vec<RowRef>>)> = Vec::new();
        for (j, job) in jobs.iter().enumerate() {
            let key = job.params.key();
            let gi = match groups.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    groups.push((key, vec![Vec::new()]));
                    groups.len() - 1
                }
            };
            let chunks = &mut groups[gi].1;
            for r in 0..job.prompts.len() {
                let current = chunks.last_mut().filter(|c| self.fits(jobs, c, (j, r)));
                match current {
                    Some(c) => c.push((j, r)),
                    None => chunks.push(vec![(j, r)]),
                }
            }
        }
        groups.into_iter().flat_map(|(_, c)| c).filter(|c| !c.is_empty()).collect()
    }

    /// Whether `row` can join `chunk`.
    fn fits(&self, jobs: &[Job], chunk: &[RowRef], row: RowRef) -> bool {
        if chunk.is_empty() {
            return true;
        }
        if chunk.len() >= self.max_batch {
            return false;
        }
        let Some(ctx) = self.context else { return true };
        let all = chunk.iter().chain(std::iter::once(&row));
        let prompt = all.clone().map(|&(j, r)| jobs[j].prompts[r].len()).max().unwrap_or(0);
        let new = all.map(|&(j, _)| jobs[j].params.max_tokens).max().unwrap_or(0);
        prompt + new <= ctx
    }

    /// Samples one batch of rows (equal settings), each cut to its own `max_tokens`.
    fn sample(&self, jobs: &[Job], batch: &[RowRef]) -> Result<Vec<RowOut>, String> {
        let params = jobs[batch[0].0].params;
        let prompts: Vec<Vec<u32>> = batch.iter().map(|&(j, r)| jobs[j].prompts[r].clone()).collect();
        let cfg = GenerationConfig {
            max_new_tokens: batch.iter().map(|&(j, _)| jobs[j].params.max_tokens).max().unwrap_or(1),
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            row_seeds: batch.iter().map(|&(j, r)| jobs[j].seeds[r]).collect(),
            ..Default::default()
        };
        let started = Instant::now();
        let samples = generate_with(&self.lm, None, &prompts, &cfg, &self.device, SamplingPath::Host)
            .map_err(|e| e.to_string())?;
        let mut requests: Vec<usize> = batch.iter().map(|&(j, _)| j).collect();
        requests.dedup();
        let tokens: usize = samples.iter().map(|s| s.response_ids.len()).sum();
        tracing::debug!(
            "batch: {} requests, {} rows, {tokens} tokens in {:.0?}",
            requests.len(),
            batch.len(),
            started.elapsed()
        );
        let s = &self.stats;
        s.batches.fetch_add(1, Ordering::Relaxed);
        s.rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
        s.tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        s.max_batch_requests.fetch_max(requests.len() as u64, Ordering::Relaxed);
        s.max_batch_rows.fetch_max(batch.len() as u64, Ordering::Relaxed);
        Ok(samples
            .into_iter()
            .zip(batch)
            .map(|(mut sample, &(j, _))| {
                let keep = jobs[j].params.max_tokens.min(sample.response_ids.len());
                sample.response_ids.truncate(keep);
                sample.logprobs.truncate(keep);
                RowOut { ids: sample.response_ids, logprobs: sample.logprobs, top: Vec::new() }
            })
            .collect())
    }

    /// `out` with each row's top alternatives, from one forward pass over prompt + response.
    fn with_top(&self, job: &Job, mut out: Vec<RowOut>) -> Result<Vec<RowOut>, ApiError> {
        for (row, prompt) in out.iter_mut().zip(&job.prompts) {
            let top = catch_unwind(AssertUnwindSafe(|| self.top_logprobs(prompt, &row.ids, job)))
                .unwrap_or_else(|panic| Err(format!("panicked: {}", panic_text(&panic))))
                .map_err(|why| ApiError::internal(format!("computing top_logprobs failed: {why}")))?;
            row.top = top;
        }
        Ok(out)
    }

    /// Each response position's `job.top_logprobs` most likely tokens under the distribution
    /// sampled from (temperature, top-k and top-p applied).
    fn top_logprobs(&self, prompt: &[u32], ids: &[u32], job: &Job) -> Result<Vec<Vec<(u32, f32)>>, String> {
        let Some((_, inputs)) = ids.split_last() else { return Ok(Vec::new()) };
        let run = || -> rltune::Result<Vec<Vec<f32>>> {
            let seq: Vec<u32> = prompt.iter().chain(inputs).copied().collect();
            let t = seq.len();
            let input = Tensor::new(seq.as_slice(), &self.device)?.unsqueeze(0)?; // (1, T)
            let mask = vec![vec![1u8; t]];
            let positions = position_ids_from_mask(&mask, &self.device)?;
            let bias = causal_bias(&mask, t, DType::F32, &self.device)?;
            let hidden = self.lm.forward(&input, &positions, &bias, None)?; // (1, T, C)
            let last = hidden.narrow(1, prompt.len() - 1, ids.len())?; // (1, L, C)
            let logits = self.lm.logits(&last)?.squeeze(0)?; // (L, V)
            Ok(logits.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
        };
        let rows = run().map_err(|e| e.to_string())?;
        let cfg = job.params.sampler();
        Ok(rows.iter().map(|row| top_k(&log_distribution(row, &cfg, &[]), job.top_logprobs)).collect())
    }
}

/// The `k` largest finite entries of `logp` as (index, value), largest first (ties: lower id).
fn top_k(logp: &[f64], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<usize> = (0..logp.len()).filter(|&i| logp[i].is_finite()).collect();
    let k = k.min(idx.len());
    let by = |a: &usize, b: &usize| logp[*b].total_cmp(&logp[*a]).then(a.cmp(b));
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, by);
    }
    idx.truncate(k);
    idx.sort_by(by);
    idx.into_iter().map(|i| (i as u32, logp[i] as f32)).collect()
}

/// A panic's message.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_takes_the_largest_finite_entries_best_first() {
        let logp = [-1.0, f64::NEG_INFINITY, -0.5, -3.0, -0.5];
        assert_eq!(top_k(&logp, 2), vec![(2, -0.5), (4, -0.5)]);
        assert_eq!(top_k(&logp, 10), vec![(2, -0.5), (4, -0.5), (0, -1.0), (3, -3.0)]);
        assert!(top_k(&logp, 0).is_empty());
    }

    #[test]
    fn metrics_are_prometheus_text() {
        let s = Stats::default();
        s.batches.fetch_add(3, Ordering::Relaxed);
        let text = s.prometheus();
        assert!(text.contains("\nrltune_batches_total 3\n"), "{text}");
        assert!(text.contains("# HELP rltune_batch_requests_max"), "{text}");
    }
}
