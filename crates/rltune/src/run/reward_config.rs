//! `[reward]` of the run config: the reward sources, summed with their weights by PPO and
//! rejection sampling, one reward function each for GRPO and RLOO.

use crate::error::{Error, Result};
use crate::rewards::{
    ClassifierOutput, Extract, HttpReward, JudgeConfig, LlmJudgeReward, RetryPolicy, RewardSource, ScoredText,
};

/// One reward source in `[[reward.sources]]`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RewardSourceConfig {
    /// A sequence-classification model's label logit or probability.
    Classifier {
        /// Model directory or hub id (bert / distilbert) with its tokenizer.json.
        model: String,
        /// Label name (e.g. "POSITIVE") or index.
        #[serde(default = "default_label")]
        label: String,
        /// "logit" (TRL's sentiment example) or "probability".
        #[serde(default)]
        output: ClassifierOutput,
        /// "query_and_response" (TRL's sentiment example) or "response_only".
        #[serde(default)]
        text: ScoredText,
        /// Samples per classifier forward pass.
        #[serde(default = "default_batch")]
        batch_size: usize,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
        /// The name in GRPO/RLOO metrics (`rewards/<name>/mean`); default: the kind.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// An external command speaking JSON lines on stdin/stdout.
    Command {
        /// Program and arguments.
        command: Vec<String>,
        /// Seconds to wait for a batch's answers.
        #[serde(default = "default_timeout")]
        timeout_s: f64,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
        /// The name in GRPO/RLOO metrics (`rewards/<name>/mean`); default: the kind.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// An HTTP service scoring batches ([`crate::rewards::http`] has the schema).
    Http {
        /// Where batches are POSTed.
        url: String,
        /// Samples per request at most.
        #[serde(default = "default_http_batch")]
        batch_size: usize,
        /// Seconds one attempt may take.
        #[serde(default = "default_timeout")]
        timeout_s: f64,
        /// Attempts after the first, for timeouts, connection errors, 408, 425, 429 and 5xx.
        #[serde(default = "default_retries")]
        max_retries: usize,
        /// Seconds before the first retry; doubled for each further one.
        #[serde(default = "one_f64")]
        backoff_s: f64,
        /// An environment variable holding a key, sent as `Authorization: Bearer <key>`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        api_key_env: Option<String>,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
        /// The name in GRPO/RLOO metrics (`rewards/<name>/mean`); default: the kind.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// An LLM judge behind an OpenAI-compatible API ([`crate::rewards::judge`]).
    #[serde(rename = "llm_judge")]
    LlmJudge {
        /// The API's base URL, e.g. "http://127.0.0.1:8000/v1".
        url: String,
        /// The `model` of each request.
        model: String,
        /// The user message: `{prompt}` and `{completion}` are filled in.
        prompt_template: String,
        /// An optional system message.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        system: Option<String>,
        /// Where the score is in the answer: the first match (its first group when it has one).
        #[serde(default = "default_score_regex")]
        score_regex: String,
        /// The score of an answer without one; unset, such an answer is an error.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        default: Option<f32>,
        /// The answer's max_tokens.
        #[serde(default = "default_judge_tokens")]
        max_tokens: usize,
        /// The answer's temperature (0: greedy).
        #[serde(default)]
        temperature: f64,
        /// The requests' seed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        /// Requests in flight at once.
        #[serde(default = "default_concurrency")]
        concurrency: usize,
        /// Seconds one attempt may take.
        #[serde(default = "default_timeout")]
        timeout_s: f64,
        /// Attempts after the first, for timeouts, connection errors, 408, 425, 429 and 5xx.
        #[serde(default = "default_retries")]
        max_retries: usize,
        /// Seconds before the first retry; doubled for each further one.
        #[serde(default = "one_f64")]
        backoff_s: f64,
        /// An environment variable holding a key, sent as `Authorization: Bearer <key>`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        api_key_env: Option<String>,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
        /// The name in GRPO/RLOO metrics (`rewards/<name>/mean`); default: the kind.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// 1 when the completion's answer equals the gold answer in the row's `column`, else 0;
    /// missing (NaN) when the row has no such column ([`crate::rewards::exact_match`]).
    #[serde(rename = "exact_match")]
    ExactMatch {
        /// The dataset column holding the gold answer.
        #[serde(default = "default_answer_column")]
        column: String,
        /// How the answer is read from the completion: "first_line" or "last_number".
        #[serde(default)]
        extract: Extract,
        /// Weight in the sum of sources.
        #[serde(default = "one")]
        weight: f32,
        /// The name in GRPO/RLOO metrics (`rewards/<name>/mean`); default: the kind.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
}

impl RewardSourceConfig {
    /// The name in GRPO/RLOO metrics: `name`, else the kind (`classifier`, `command`, `http`,
    /// `llm_judge`, `exact_match`).
    pub fn metric_name(&self) -> String {
        let (name, kind) = match self {
            Self::Classifier { name, .. } => (name, "classifier"),
            Self::Command { name, .. } => (name, "command"),
            Self::Http { name, .. } => (name, "http"),
            Self::LlmJudge { name, .. } => (name, "llm_judge"),
            Self::ExactMatch { name, .. } => (name, "exact_match"),
        };
        name.clone().unwrap_or_else(|| kind.to_string())
    }

    /// The weight in the sum of sources.
    pub fn weight(&self) -> f32 {
        match self {
            Self::Classifier { weight, .. }
            | Self::Command { weight, .. }
            | Self::Http { weight, .. }
            | Self::LlmJudge { weight, .. }
            | Self::ExactMatch { weight, .. } => *weight,
        }
    }
}

fn default_answer_column() -> String {
    "answer".into()
}

fn default_label() -> String {
    "POSITIVE".into()
}
fn default_batch() -> usize {
    16
}
fn one() -> f32 {
    1.0
}
fn default_timeout() -> f64 {
    60.0
}
fn one_f64() -> f64 {
    1.0
}
fn default_retries() -> usize {
    3
}
fn default_http_batch() -> usize {
    64
}
fn default_judge_tokens() -> usize {
    16
}
fn default_concurrency() -> usize {
    8
}
fn default_score_regex() -> String {
    crate::rewards::judge::DEFAULT_SCORE_REGEX.into()
}

/// `[reward]`
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// The sources, summed with their weights.
    pub sources: Vec<RewardSourceConfig>,
}

/// Builds an `http` or `llm_judge` source of `[[reward.sources]]`; errors name the source and
/// the field.
pub(crate) fn build_http(s: &RewardSourceConfig) -> Result<Box<dyn RewardSource>> {
    match s {
        RewardSourceConfig::Http {
            url, batch_size, timeout_s, max_retries, backoff_s, api_key_env, ..
        } => {
            let what = format!("[[reward.sources]] kind = \"http\" (url {url:?})");
            let policy = RetryPolicy::from_secs(*timeout_s, *max_retries, *backoff_s, &what)?;
            let mut r = HttpReward::new(url)?.with_policy(policy).with_batch_size(*batch_size)?;
            if let Some(var) = api_key_env {
                r = r.with_api_key(&api_key(var, &what)?);
            }
            Ok(Box::new(r))
        }
        RewardSourceConfig::LlmJudge {
            url,
            model,
            prompt_template,
            system,
            score_regex,
            default,
            max_tokens,
            temperature,
            seed,
            concurrency,
            timeout_s,
            max_retries,
            backoff_s,
            api_key_env,
            ..
        } => {
            let what = format!("[[reward.sources]] kind = \"llm_judge\" (url {url:?})");
            let cfg = JudgeConfig {
                system: system.clone(),
                score_regex: score_regex.clone(),
                default: *default,
                max_tokens: *max_tokens,
                temperature: *temperature,
                seed: *seed,
                concurrency: *concurrency,
                policy: RetryPolicy::from_secs(*timeout_s, *max_retries, *backoff_s, &what)?,
                api_key: api_key_env.as_deref().map(|v| api_key(v, &what)).transpose()?,
                ..JudgeConfig::new(url, model, prompt_template)
            };
            Ok(Box::new(LlmJudgeReward::new(cfg)?))
        }
        other => Err(Error::Internal(format!(
            "build_http: reward source {} is not an HTTP source",
            other.metric_name()
        ))),
    }
}

/// The key in the variable `var`, through the installed host's secrets lookup (the command
/// line's is its environment).
fn api_key(var: &str, what: &str) -> Result<String> {
    crate::runtime::host().secrets.get(var).ok_or_else(|| {
        Error::reward(
            what,
            format!(
                "api_key_env names {var}, which is not set (set it in the environment of `rltune`; a \
                 program using the library supplies its keys with runtime::Host::with_secrets)"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::run::RunConfig;

    fn load(name: &str) -> RunConfig {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs").join(name);
        let text = std::fs::read_to_string(&p).unwrap();
        RunConfig::from_toml(&text, &p, &[]).unwrap()
    }

    #[test]
    fn the_example_configs_build_their_http_sources() {
        let http = load("http-reward.toml");
        let s = &http.reward.sources[0];
        assert!(matches!(s, RewardSourceConfig::Http { max_retries: 3, batch_size: 64, .. }), "{s:?}");
        assert_eq!(build_http(s).unwrap().name(), "http(http://127.0.0.1:9000/score)");
        let judge = load("llm-judge.toml");
        let s = &judge.reward.sources[0];
        assert_eq!((s.metric_name(), s.weight()), ("llm_judge".to_string(), 1.0));
        assert_eq!(build_http(s).unwrap().name(), "llm_judge(judge)");
    }

    #[test]
    fn http_fields_are_checked_and_named() {
        let p = Path::new("run.toml");
        let base =
            "[model]\npath = \"m\"\n[data]\nsource = \"p.jsonl\"\n[[reward.sources]]\nkind = \"http\"\n";
        let err = RunConfig::from_toml(&format!("{base}url = \"http://x\"\ntimout_s = 3\n"), p, &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("timout_s") && err.contains("timeout_s"), "{err}");
        let cfg =
            RunConfig::from_toml(&format!("{base}url = \"http://x\"\nbackoff_s = -2\n"), p, &[]).unwrap();
        let err = build_http(&cfg.reward.sources[0]).err().unwrap().to_string();
        assert!(err.contains("kind = \"http\"") && err.contains("backoff_s") && err.contains("-2"), "{err}");
        let cfg = RunConfig::from_toml(
            &format!("{base}url = \"http://x\"\napi_key_env = \"RLTUNE_NO_SUCH_VAR\"\n"),
            p,
            &[],
        )
        .unwrap();
        let err = build_http(&cfg.reward.sources[0]).err().unwrap().to_string();
        assert!(err.contains("RLTUNE_NO_SUCH_VAR") && err.contains("not set"), "{err}");
    }
}
