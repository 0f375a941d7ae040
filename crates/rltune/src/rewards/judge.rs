//! An LLM judge: `[[reward.sources]] kind = "llm_judge"`.
//!
//! Each sample becomes one chat request to an OpenAI-compatible endpoint (`rltune serve`, vLLM,
//! OpenAI itself): `POST {url}/chat/completions` with
//!
//! ```json
//! {"model": "<model>", "messages": [{"role": "system", "content": "<system>"},
//!                                   {"role": "user", "content": "<prompt_template, filled>"}],
//!  "max_tokens": 16, "temperature": 0, "seed": <seed, when set>}
//! ```
//!
//! (the system message only when `system` is set). `prompt_template` gets the sample's prompt
//! where it says `{prompt}` and its completion where it says `{completion}`; nothing else in it
//! is special. The score is the first match of `score_regex` in the answer's
//! `choices[0].message.content` (its first capture group when it has one) read as a number.
//! An answer without one scores `default` when it is set, and is an error quoting the answer
//! otherwise.
//!
//! The samples of a batch are sent `concurrency` at a time (a server that batches, as `rltune
//! serve` does, answers them together). Each request has the HTTP source's timeout and retries
//! ([`super::http::post_json`]); a sample's score comes from its one successful answer, so a
//! retry never counts twice.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use regex::Regex;
use serde_json::{json, Value};

use super::http::{agent, check_url, post_json, RetryPolicy};
use super::{RewardInput, RewardSource};
use crate::error::{Error, Result};

/// The default `score_regex`: the first number in the answer.
pub const DEFAULT_SCORE_REGEX: &str = r"(-?\d+(?:\.\d+)?)";

/// What the judge asks and how its answer is read.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeConfig {
    /// The API's base URL, e.g. `http://127.0.0.1:8000/v1`.
    pub url: String,
    /// The `model` of each request.
    pub model: String,
    /// The user message, with `{prompt}` and `{completion}` filled in.
    pub prompt_template: String,
    /// An optional system message.
    pub system: Option<String>,
    /// Where the score is in the answer (first match; its first group when it has one).
    pub score_regex: String,
    /// The score of an answer without one; `None` makes it an error.
    pub default: Option<f32>,
    /// The answer's `max_tokens`.
    pub max_tokens: usize,
    /// The answer's temperature (0: greedy).
    pub temperature: f64,
    /// The requests' `seed`, when set.
    pub seed: Option<u64>,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Timeouts and retries of each request.
    pub policy: RetryPolicy,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
}

impl JudgeConfig {
    /// A judge of `model` at `url` with `prompt_template`; every other setting at its default.
    pub fn new(url: &str, model: &str, prompt_template: &str) -> Self {
        Self {
            url: url.to_string(),
            model: model.to_string(),
            prompt_template: prompt_template.to_string(),
            system: None,
            score_regex: DEFAULT_SCORE_REGEX.to_string(),
            default: None,
            max_tokens: 16,
            temperature: 0.0,
            seed: None,
            concurrency: 8,
            policy: RetryPolicy::default(),
            api_key: None,
        }
    }
}

/// An LLM judge (see the module docs).
pub struct LlmJudgeReward {
    name: String,
    cfg: JudgeConfig,
    endpoint: String,
    regex: Regex,
    agent: ureq::Agent,
}

impl LlmJudgeReward {
    /// Checks `cfg` (errors name the field) and builds the judge.
    pub fn new(cfg: JudgeConfig) -> Result<Self> {
        let name = format!("llm_judge({})", cfg.model);
        let what = format!("reward {name}");
        check_url(&cfg.url, &what)?;
        let bad = |msg: String| Err(Error::reward(&what, msg));
        if !cfg.prompt_template.contains("{completion}") {
            return bad(
                "prompt_template must contain {completion}, where the sample's completion goes".into()
            );
        }
        let regex = match Regex::new(&cfg.score_regex) {
            Ok(r) => r,
            Err(e) => {
                return bad(format!("score_regex {:?} is not a regular expression: {e}", cfg.score_regex))
            }
        };
        if cfg.concurrency == 0 || cfg.max_tokens == 0 {
            return bad("concurrency and max_tokens must be at least 1".into());
        }
        if !(cfg.temperature >= 0.0 && cfg.temperature.is_finite()) {
            return bad(format!("temperature must be ≥ 0, got {}", cfg.temperature));
        }
        let endpoint = format!("{}/chat/completions", cfg.url.trim_end_matches('/'));
        Ok(Self { name, cfg, endpoint, regex, agent: agent() })
    }

    /// The user message for one sample: one pass over the template, so a `{completion}` inside
    /// the prompt's own text is left as it is.
    pub fn render(&self, prompt: &str, completion: &str) -> String {
        let t = &self.cfg.prompt_template;
        let mut out = String::with_capacity(t.len() + prompt.len() + completion.len());
        let mut rest = t.as_str();
        while let Some(at) = rest.find('{') {
            out.push_str(&rest[..at]);
            let tail = &rest[at..];
            if let Some(r) = tail.strip_prefix("{prompt}") {
                out.push_str(prompt);
                rest = r;
            } else if let Some(r) = tail.strip_prefix("{completion}") {
                out.push_str(completion);
                rest = r;
            } else {
                out.push('{');
                rest = &tail[1..];
            }
        }
        out.push_str(rest);
        out
    }

    /// The score in `answer`, or why there is none.
    pub fn parse(&self, answer: &str) -> std::result::Result<f32, ScoreError> {
        let Some(caps) = self.regex.captures(answer) else {
            return Err(ScoreError::NoMatch { score_regex: self.cfg.score_regex.clone() });
        };
        let text = caps.get(1).or_else(|| caps.get(0)).map_or("", |m| m.as_str());
        text.trim()
            .parse::<f64>()
            .map(|x| x as f32)
            .map_err(|_| ScoreError::NotANumber { text: text.to_string() })
    }

    /// Asks about one sample and reads the score.
    fn judge(&self, i: usize, s: &RewardInput<'_>) -> Result<f32> {
        let mut messages = Vec::new();
        if let Some(system) = &self.cfg.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": self.render(s.query, s.response)}));
        let mut body = json!({"model": self.cfg.model, "messages": messages,
                              "max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature});
        if let Some(seed) = self.cfg.seed {
            body["seed"] = seed.into();
        }
        let headers: Vec<(String, String)> =
            self.cfg.api_key.iter().map(|k| ("Authorization".to_string(), format!("Bearer {k}"))).collect();
        let what = format!("reward {}", self.name);
        let answer = post_json(&self.agent, &self.endpoint, &body, &headers, &self.cfg.policy, &what)?;
        let Some(content) = answer.pointer("/choices/0/message/content").and_then(Value::as_str) else {
            return Err(Error::reward(
                &what,
                format!(
                    "POST {} answered without choices[0].message.content: {}",
                    self.endpoint,
                    truncate(&answer.to_string(), 200)
                ),
            ));
        };
        match (self.parse(content), self.cfg.default) {
            (Ok(score), _) => Ok(score),
            (Err(_), Some(default)) => Ok(default),
            (Err(why), None) => Err(Error::reward(
                &what,
                format!(
                    "the judge's answer for sample {i} is {:?}: {why}; set `default` to score such answers",
                    truncate(content, 200)
                ),
            )),
        }
    }
}

/// Why a judge's answer holds no score.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScoreError {
    /// `score_regex` does not match the answer.
    #[error("no match of score_regex {score_regex:?}")]
    NoMatch {
        /// The configured pattern.
        score_regex: String,
    },
    /// What the pattern matched does not parse as a number.
    #[error("the match {text:?} is not a number")]
    NotANumber {
        /// The matched text.
        text: String,
    },
}

fn truncate(s: &str, n: usize) -> String {
    let mut t: String = s.chars().take(n).collect();
    if s.chars().count() > n {
        t.push('…');
    }
    t
}

impl std::fmt::Debug for LlmJudgeReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmJudgeReward")
            .field("endpoint", &self.endpoint)
            .field("model", &self.cfg.model)
            .finish()
    }
}

impl RewardSource for LlmJudgeReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &[RewardInput<'_>]) -> Result<Vec<f32>> {
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<Option<Result<f32>>>> = Mutex::new((0..batch.len()).map(|_| None).collect());
        let this = &*self;
        std::thread::scope(|scope| {
            for _ in 0..this.cfg.concurrency.min(batch.len()) {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(s) = batch.get(i) else { break };
                    let r = this.judge(i, s);
                    let failed = r.is_err();
                    if let Ok(mut all) = results.lock() {
                        all[i] = Some(r);
                    }
                    if failed {
                        // Stop taking samples: the batch fails anyway.
                        next.store(batch.len(), Ordering::SeqCst);
                    }
                });
            }
        });
        let results = results
            .into_inner()
            .map_err(|_| Error::Internal(format!("reward {}: a request thread panicked", self.name)))?;
        let mut out = Vec::with_capacity(batch.len());
        let mut first_error = None;
        for r in results {
            match r {
                Some(Ok(s)) => out.push(s),
                Some(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                None => {}
            }
        }
        match first_error {
            Some(e) => Err(e),
            None if out.len() == batch.len() => Ok(out),
            None => Err(Error::Internal(format!("reward {}: some samples were not judged", self.name))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::rewards::test_server::{Reply, TestServer};

    fn judge(url: &str, f: impl FnOnce(&mut JudgeConfig)) -> LlmJudgeReward {
        let mut cfg = JudgeConfig::new(url, "judge-model", "Q: {prompt}\nA: {completion}\nScore 0-10:");
        cfg.policy = RetryPolicy {
            timeout: Duration::from_secs(2),
            max_retries: 1,
            backoff: Duration::from_millis(10),
        };
        f(&mut cfg);
        LlmJudgeReward::new(cfg).unwrap()
    }

    /// Answers "Score: <length of the completion in the user message>/10".
    fn chat_answer(n: usize, body: &Value) -> Reply {
        let user = body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["content"].as_str())
            .unwrap_or("");
        let completion = user.split("A: ").nth(1).and_then(|r| r.split('\n').next()).unwrap_or("");
        if n == 0 {
            return Reply::json(502, json!("bad gateway"));
        }
        let content = if completion == "nonsense" {
            "I refuse".to_string()
        } else {
            format!("Score: {}/10", completion.len())
        };
        Reply::json(
            200,
            json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}),
        )
    }

    #[test]
    fn judges_each_sample_through_chat_completions_with_retries() {
        let server = TestServer::start(chat_answer);
        let mut r = judge(&format!("{}/v1/", server.url), |c| {
            c.system = Some("You grade answers.".into());
            c.seed = Some(7);
            c.concurrency = 3;
        });
        let batch: Vec<RewardInput> =
            ["a", "bbb", "cc", "dddd"].iter().map(|c| RewardInput::text("{completion}?", c)).collect();
        assert_eq!(r.score(&batch).unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
        let seen = server.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 5, "four samples, one retried after a 502");
        let (path, _, body) = &seen[1];
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(
            (body["model"].as_str(), body["seed"].as_u64(), body["temperature"].as_f64()),
            (Some("judge-model"), Some(7), Some(0.0))
        );
        assert_eq!(body["messages"][0], json!({"role": "system", "content": "You grade answers."}));
        let users: Vec<&str> =
            seen.iter().filter_map(|(_, _, b)| b["messages"][1]["content"].as_str()).collect();
        assert!(
            users.contains(&"Q: {completion}?\nA: bbb\nScore 0-10:"),
            "placeholders in the prompt stay: {users:?}"
        );
    }

    #[test]
    fn an_unparsable_answer_is_an_error_or_the_default() {
        let server = TestServer::start(|n, b| chat_answer(n + 1, b));
        let batch = [RewardInput::text("q", "ok"), RewardInput::text("q", "nonsense")];
        let err = judge(&server.url, |_| {}).score(&batch).unwrap_err().to_string();
        assert!(
            err.contains("sample 1") && err.contains("\"I refuse\"") && err.contains("set `default`"),
            "{err}"
        );
        let mut r = judge(&server.url, |c| c.default = Some(-1.0));
        assert_eq!(r.score(&batch).unwrap(), vec![2.0, -1.0]);
    }

    #[test]
    fn parse_render_and_config_errors() {
        let r = judge("http://127.0.0.1:9", |c| c.score_regex = r"(?i)grade:\s*([A-F])|(\d+)".into());
        assert_eq!(r.parse("grade: B").unwrap_err(), ScoreError::NotANumber { text: "B".into() });
        let r = judge("http://127.0.0.1:9", |_| {});
        assert_eq!(r.parse("I'd say 7.5 out of 10").unwrap(), 7.5);
        assert_eq!(r.parse("-3").unwrap(), -3.0);
        assert_eq!(r.render("{x} p", "c"), "Q: {x} p\nA: c\nScore 0-10:");
        for (f, want) in [
            (
                Box::new(|c: &mut JudgeConfig| c.prompt_template = "{prompt}".into())
                    as Box<dyn Fn(&mut JudgeConfig)>,
                "{completion}",
            ),
            (Box::new(|c: &mut JudgeConfig| c.score_regex = "(".into()), "score_regex"),
            (Box::new(|c: &mut JudgeConfig| c.url = "127.0.0.1:8000".into()), "http://"),
            (Box::new(|c: &mut JudgeConfig| c.concurrency = 0), "concurrency"),
        ] {
            let mut cfg = JudgeConfig::new("http://x/v1", "m", "{completion}");
            f(&mut cfg);
            let err = LlmJudgeReward::new(cfg).unwrap_err().to_string();
            assert!(err.contains("llm_judge(m)") && err.contains(want), "{err}");
        }
    }
}
