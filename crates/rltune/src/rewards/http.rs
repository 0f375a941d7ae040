//! Rewards from an HTTP service: `[[reward.sources]] kind = "http"`.
//!
//! For each batch (split into requests of at most `batch_size` samples) rltune POSTs
//!
//! ```json
//! {"request_id": "rltune-4121-1732808400-7",
//!  "samples": [{"index": 0, "prompt": "…", "completion": "…", "meta": {…}}, …]}
//! ```
//!
//! with `Content-Type: application/json` and `Idempotency-Key: <request_id>`, and reads one score
//! per sample back, in either form:
//!
//! - `{"scores": [0.5, -1, null, …]}`: the i-th score is sample `index` i's;
//! - `{"scores": [{"index": 2, "score": 0.5}, …]}`: any order, each index exactly once.
//!
//! A score may be `null` (missing: NaN, as `exact_match` scores a row without an answer; the PPO
//! loop skips a batch with a non-finite score, GRPO ignores it). `meta` is the prompt row.
//!
//! **Retries.** A request that times out (`timeout_s`), cannot connect, or is answered 408, 425,
//! 429 or 5xx is sent again, whole and with the same `request_id`, up to `max_retries` times,
//! after `backoff_s`, then twice that, and so on (at most 60 s; a longer `Retry-After` is
//! honoured up to 60 s). Scores are taken only from the one answer that succeeds, matched by
//! index, so a retry never counts a sample twice; a service that keeps state per request can
//! deduplicate on `request_id`. Any other status, or a body that is not the schema above, fails
//! at once. Failures name the URL, the status and the first line of the body.
//!
//! [`post_json`] is the transport, shared with the LLM judge ([`super::judge`]).

use std::time::Duration;

use serde_json::{json, Value};

use super::{RewardInput, RewardSource};
use crate::error::{Error, Result};

/// Longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Timeouts and retries of an HTTP reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// One attempt's limit, from connecting to the last byte of the answer.
    pub timeout: Duration,
    /// Attempts after the first.
    pub max_retries: usize,
    /// The wait before the first retry; it doubles for each further one.
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { timeout: Duration::from_secs(60), max_retries: 3, backoff: Duration::from_secs(1) }
    }
}

impl RetryPolicy {
    /// A policy from a config's seconds, checked: `what` names the source in errors.
    pub fn from_secs(timeout_s: f64, max_retries: usize, backoff_s: f64, what: &str) -> Result<Self> {
        let secs = |v: f64, field: &str, zero_ok: bool| {
            let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0)) && v < 1e9;
            if !ok {
                return Err(Error::reward(
                    what,
                    format!(
                        "{field} must be a {} number of seconds, got {v}",
                        if zero_ok { "non-negative" } else { "positive" }
                    ),
                ));
            }
            Ok(Duration::from_secs_f64(v))
        };
        Ok(Self {
            timeout: secs(timeout_s, "timeout_s", false)?,
            max_retries,
            backoff: secs(backoff_s, "backoff_s", true)?,
        })
    }

    /// The wait before retry `n` (0-based): `backoff · 2ⁿ`, at most `MAX_BACKOFF`.
    pub fn delay(&self, n: usize) -> Duration {
        let factor = 2f64.powi(n.min(30) as i32);
        Duration::from_secs_f64((self.backoff.as_secs_f64() * factor).min(MAX_BACKOFF.as_secs_f64()))
    }
}

/// A blocking HTTP client for rewards: no proxy from the environment, no idle pool limits.
pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().try_proxy_from_env(false).build()
}

/// Checks that `url` is an http(s) URL; `what` names the source.
pub fn check_url(url: &str, what: &str) -> Result<()> {
    if url.starts_with("http://") || url.starts_with("https://") {
        return Ok(());
    }
    Err(Error::reward(what, format!("url must start with http:// or https://, got {url:?}")))
}

/// Whether an answer with this status is worth another attempt.
fn retryable(status: u16) -> bool {
    matches!(status, 408 | 425 | 429) || (500..600).contains(&status)
}

/// The first line of a body, trimmed to 200 characters, for errors.
fn first_line(body: &str) -> String {
    let line = body.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    let mut s: String = line.chars().take(200).collect();
    if line.chars().count() > 200 {
        s.push('…');
    }
    if s.is_empty() {
        "(empty body)".into()
    } else {
        s
    }
}

/// POSTs `body` to `url` with retries (see the module docs) and returns the answer's JSON.
///
/// `what` names the source in errors and logs; `headers` are sent with every attempt.
pub fn post_json(
    agent: &ureq::Agent,
    url: &str,
    body: &Value,
    headers: &[(String, String)],
    policy: &RetryPolicy,
    what: &str,
) -> Result<Value> {
    let attempts = policy.max_retries + 1;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut request = agent.post(url).timeout(policy.timeout);
        for (k, v) in headers {
            request = request.set(k, v);
        }
        let (failure, retry_after) = match request.send_json(body) {
            Ok(response) => {
                let status = response.status();
                match response.into_string() {
                    Ok(text) => {
                        return serde_json::from_str(&text).map_err(|e| {
                            Error::reward(
                                what,
                                format!(
                                    "POST {url} answered {status} with a body that is not JSON ({e}): {}",
                                    first_line(&text)
                                ),
                            )
                        })
                    }
                    // The connection broke in the middle of the answer: as a transport error.
                    Err(e) => (format!("the answer ({status}) broke off: {e}"), None),
                }
            }
            Err(ureq::Error::Status(status, response)) => {
                let retry_after = response
                    .header("Retry-After")
                    .and_then(|s| s.trim().parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(|s| Duration::from_secs_f64(s.min(MAX_BACKOFF.as_secs_f64())));
                let text = response.into_string().unwrap_or_default();
                let failure = format!("HTTP {status}: {}", first_line(&text));
                if !retryable(status) {
                    return Err(Error::reward(
                        what,
                        format!(
                            "POST {url} failed with {failure} (not retried: a {status} is the \
                             request's fault)"
                        ),
                    ));
                }
                (failure, retry_after)
            }
            Err(ureq::Error::Transport(t)) => (format!("{t}"), None),
        };
        if attempt >= attempts {
            return Err(Error::reward(
                what,
                format!(
                    "POST {url} failed after {attempts} attempt{} (max_retries = {}): {failure}",
                    if attempts == 1 { "" } else { "s" },
                    policy.max_retries
                ),
            ));
        }
        let wait = policy.delay(attempt - 1).max(retry_after.unwrap_or_default());
        tracing::warn!(
            "{what}: POST {url}: attempt {attempt} of {attempts} failed ({failure}); retrying in {wait:.1?}"
        );
        std::thread::sleep(wait);
    }
}

/// A reward from an HTTP scoring service (see the module docs).
pub struct HttpReward {
    name: String,
    url: String,
    agent: ureq::Agent,
    policy: RetryPolicy,
    batch_size: usize,
    headers: Vec<(String, String)>,
    /// `request_id`s are `<prefix>-<n>`: the prefix is unique to this process and moment.
    id_prefix: String,
    requests: u64,
}

impl HttpReward {
    /// A source POSTing to `url` with the default retries and 64 samples per request.
    pub fn new(url: &str) -> Result<Self> {
        let name = format!("http({url})");
        check_url(url, &format!("reward {name}"))?;
        let started =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        Ok(Self {
            name,
            url: url.to_string(),
            agent: agent(),
            policy: RetryPolicy::default(),
            batch_size: 64,
            headers: Vec::new(),
            id_prefix: format!("rltune-{}-{started}", std::process::id()),
            requests: 0,
        })
    }

    /// Sets the timeouts and retries.
    pub fn with_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the samples per request (at least 1).
    pub fn with_batch_size(mut self, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::reward(format!("reward {}", self.name), "batch_size must be at least 1"));
        }
        self.batch_size = n;
        Ok(self)
    }

    /// Sends `Authorization: Bearer <key>` with every request.
    pub fn with_api_key(mut self, key: &str) -> Self {
        self.headers.push(("Authorization".into(), format!("Bearer {key}")));
        self
    }

    /// Scores one request's samples.
    fn score_request(&mut self, samples: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        self.requests += 1;
        let id = format!("{}-{}", self.id_prefix, self.requests);
        let items: Vec<Value> = samples
            .iter()
            .enumerate()
            .map(|(i, s)| json!({"index": i, "prompt": s.query, "completion": s.response, "meta": s.meta}))
            .collect();
        let body = json!({"request_id": id, "samples": items});
        let mut headers = self.headers.clone();
        headers.push(("Idempotency-Key".into(), id.clone()));
        let what = format!("reward {}", self.name);
        let answer = post_json(&self.agent, &self.url, &body, &headers, &self.policy, &what)?;
        parse_scores(&answer, samples.len()).map_err(|why| {
            Error::reward(
                &what,
                format!(
                    "POST {} (request_id {id}) answered {}: {why}; answer {{\"scores\": [one number per \
                 sample, in order]}} or {{\"scores\": [{{\"index\": i, \"score\": x}}, …]}}",
                    self.url,
                    first_line(&answer.to_string())
                ),
            )
        })
    }
}

/// The scores of an answer for `n` samples, matched by index (see the module docs).
fn parse_scores(answer: &Value, n: usize) -> std::result::Result<Vec<f32>, String> {
    let Some(list) = answer.get("scores").and_then(Value::as_array) else {
        return Err("no \"scores\" list".into());
    };
    if list.len() != n {
        return Err(format!("{} scores for {n} samples", list.len()));
    }
    let score = |v: &Value, at: usize| match v {
        Value::Null => Ok(f32::NAN),
        Value::Number(x) => x.as_f64().map(|x| x as f32).ok_or_else(|| format!("score {at} is {x}")),
        other => Err(format!("score {at} is {other}, not a number or null")),
    };
    if list.iter().all(Value::is_object) {
        let mut out = vec![None; n];
        for (k, item) in list.iter().enumerate() {
            let i = item.get("index").and_then(Value::as_u64).map(|i| i as usize);
            let Some(i) = i.filter(|&i| i < n) else {
                return Err(format!("entry {k} has no \"index\" below {n}"));
            };
            if out[i].is_some() {
                return Err(format!("index {i} is scored twice"));
            }
            out[i] = Some(score(item.get("score").unwrap_or(&Value::Null), i)?);
        }
        // n entries, each index at most once: every index is there.
        return Ok(out.into_iter().map(|s| s.unwrap_or(f32::NAN)).collect());
    }
    list.iter().enumerate().map(|(i, v)| score(v, i)).collect()
}

impl std::fmt::Debug for HttpReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpReward")
            .field("url", &self.url)
            .field("policy", &self.policy)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}

impl RewardSource for HttpReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(self.batch_size) {
            out.extend(self.score_request(chunk)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
