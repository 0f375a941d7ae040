//! `[reward]` of the run config: the reward sources, summed with their weights by PPO and
//! rejection sampling, one reward function each for GRPO and RLOO.

use crate::rewards::{ClassifierOutput, Extract, ScoredText};

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
    /// The name in GRPO/RLOO metrics: `name`, else the kind (`classifier`, `command`,
    /// `exact_match`).
    pub fn metric_name(&self) -> String {
        let (name, kind) = match self {
            Self::Classifier { name, .. } => (name, "classifier"),
            Self::Command { name, .. } => (name, "command"),
            Self::ExactMatch { name, .. } => (name, "exact_match"),
        };
        name.clone().unwrap_or_else(|| kind.to_string())
    }

    /// The weight in the sum of sources.
    pub fn weight(&self) -> f32 {
        match self {
            Self::Classifier { weight, .. }
            | Self::Command { weight, .. }
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

/// `[reward]`
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// The sources, summed with their weights.
    pub sources: Vec<RewardSourceConfig>,
}
