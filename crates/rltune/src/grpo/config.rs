//! `GrpoConfig` and `RlooConfig`: TRL 1.16.0's `GRPOConfig` / `RLOOConfig` names and defaults,
//! with the transformers `TrainingArguments` fields that change the update (AdamW, clipping,
//! schedule).
//!
//! They are read from the `[grpo]` / `[rloo]` table of a TOML file. Unknown keys are rejected with
//! the closest valid name; TRL fields that rltune does not implement are accepted only at their
//! default, and a different value is an error naming the field. Generation-only fields
//! (`top_p`, `top_k`, …) are accepted and do not change a step.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config_file::closest;
use crate::engine::training_arguments::resolve_optim;
use crate::error::{ConfigError, Error, Result};

/// GRPO's loss aggregation (`loss_type`). TRL `_compute_loss`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Per-sequence mean over its tokens, then mean over sequences (length-biased).
    Grpo,
    /// Sum over tokens / (B · max_completion_length).
    DrGrpo,
    /// Sum over tokens / tokens in the generation batch (TRL's default).
    Dapo,
    /// Sum over tokens / tokens in the local batch.
    Bnpo,
    /// TRL's CISPO loss (not implemented in rltune).
    Cispo,
    /// TRL's SAPO loss (not implemented in rltune).
    Sapo,
    /// TRL's LUSPO loss (not implemented in rltune).
    Luspo,
    /// TRL's VESPO loss (not implemented in rltune).
    Vespo,
}

/// How rewards are scaled into advantages (`scale_rewards`; TRL also takes `true`/`false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// Divide by the group's standard deviation (`"group"`, `true`; TRL's default).
    Group,
    /// Divide by the whole batch's standard deviation.
    Batch,
    /// No scaling (`"none"`, `false`; Dr. GRPO).
    None,
}

impl<'de> Deserialize<'de> for ScaleRewards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bool(true) => Ok(Self::Group),
            Raw::Bool(false) => Ok(Self::None),
            Raw::Str(s) => match s.as_str() {
                "group" => Ok(Self::Group),
                "batch" => Ok(Self::Batch),
                "none" => Ok(Self::None),
                other => Err(serde::de::Error::custom(format!(
                    "scale_rewards {other:?}: expected \"group\", \"batch\", \"none\", true or false"
                ))),
            },
        }
    }
}

/// Token-level ratios (GRPO) or one length-normalized ratio per sequence (GSPO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// `exp(logp − old_logp)` per token.
    Token,
    /// `exp(mean over the sequence of (logp − old_logp))`, one per sequence (GSPO).
    Sequence,
}

/// How several reward functions are combined (`multi_objective_aggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// Weighted sum (NaN-skipping), then the `scale_rewards` normalization.
    SumThenNormalize,
    /// Each function normalized within its group, weighted sum, then batch normalization (GDPO).
    NormalizeThenSum,
}

pub use crate::engine::OptimArgs;
/// transformers' `lr_scheduler_type` (the ones rltune implements): the one schedule type.
pub use crate::engine::ScheduleKind as SchedulerType;

/// GRPO's and RLOO's shared fields after transformers' `TrainingArguments` ones
/// ([`crate::engine::training_arguments`]). In a GRPO/RLOO step `gradient_accumulation_steps`
/// must be 1 (one step is one optimizer update over the whole batch), the seed draws nothing,
/// and without `max_steps` a pass of `num_train_epochs` is one step's batch.
macro_rules! group_arguments {
    ($(#[$m:meta])* pub struct $name:ident { $($body:tt)* }) => {
        crate::engine::training_arguments::training_arguments! {
            $(#[$m])*
            pub struct $name {
                /// Completions per optimizer step; when set, a step's batch must have exactly this many.
                pub per_device_train_batch_size: Option<usize>,
                /// Completions per prompt: consecutive rows with the same prompt form a group.
                pub num_generations: usize,
                /// Longest completion (512); `dr_grpo` divides by it.
                pub max_completion_length: usize,
                /// Logits are divided by it before every log-softmax (1.0).
                pub temperature: f64,
                /// Generation only (1.0).
                pub top_p: f64,
                /// Generation only (0).
                pub top_k: usize,
                /// Generation only.
                pub min_p: Option<f64>,
                /// Generation only (1.0).
                pub repetition_penalty: f64,
                /// Passes over one generation batch, each an optimizer step (1).
                pub num_iterations: usize,
                /// Lower clip ε (0.2).
                pub epsilon: f64,
                /// Upper clip ε (default: `epsilon`).
                pub epsilon_high: Option<f64>,
                /// One weight per reward function (default: all 1).
                pub reward_weights: Option<Vec<f64>>,
                /// rltune: the reward functions' names, in the order of `reward_weights` (TRL's
                /// `trl grpo` script argument). Default: the names in the rollouts, sorted.
                pub reward_funcs: Option<Vec<String>>,
                /// Drop completions that ended without EOS from the loss (false).
                pub mask_truncated_completions: bool,
                /// Must be 1 (one generation per optimizer step).
                pub steps_per_generation: Option<usize>,
                /// Must be unset or the batch size.
                pub generation_batch_size: Option<usize>,
                $($body)*
            }
        }
    };
}

group_arguments! {
    /// GRPO hyper-parameters: TRL 1.16.0 `GRPOConfig` names and defaults.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct GrpoConfig {
        /// KL coefficient; 0 loads no reference model (0.0).
        pub beta: f64,
        /// Two-sided clipping: cap the ratio at `delta` (INTELLECT-2; unset).
        pub delta: Option<f64>,
        /// Token or sequence (GSPO) ratios ("token").
        pub importance_sampling_level: ImportanceSamplingLevel,
        /// How several reward functions are combined ("sum_then_normalize").
        pub multi_objective_aggregation: Aggregation,
        /// Advantage scaling ("group").
        pub scale_rewards: ScaleRewards,
        /// Loss aggregation ("dapo").
        pub loss_type: LossType,
        /// Multiply the k3 KL term by the importance ratio (true).
        pub use_bias_correction_kl: bool,
        /// Not implemented: must stay 1.0.
        pub top_entropy_quantile: f64,
        /// Not implemented: must stay 0.0.
        pub entropy_coef: f64,
        /// Not implemented: must stay false.
        pub use_adaptive_entropy: bool,
        /// Not implemented: must stay unset.
        pub off_policy_mask_threshold: Option<f64>,
    }
}

group_arguments! {
    /// RLOO hyper-parameters: TRL 1.16.0 `RLOOConfig` names and defaults.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct RlooConfig {
        /// k1 KL coefficient, folded into the reward (0.05); 0 loads no reference model.
        pub beta: f64,
        /// Whiten the advantages over the batch (false).
        pub normalize_advantages: bool,
        /// Clip the rewards (after weighting) to `[lo, hi]` before the KL penalty (unset).
        pub reward_clip_range: Option<(f64, f64)>,
    }
}

/// Defaults shared by both configs (TrainingArguments as TRL overrides them).
macro_rules! shared_defaults {
    ($num_generations:expr) => {
        (
            1e-6,
            0.9,
            0.999,
            1e-8,
            0.0,
            1.0,
            SchedulerType::Linear,
            0.0,
            -1,
            3.0,
            None,
            1,
            42,
            $num_generations,
            512,
        )
    };
}

impl Default for GrpoConfig {
    fn default() -> Self {
        let (lr, b1, b2, eps, wd, gn, sched, warm, steps, epochs, bs, ga, seed, g, mcl) = shared_defaults!(8);
        Self {
            learning_rate: lr,
            adam_beta1: b1,
            adam_beta2: b2,
            adam_epsilon: eps,
            weight_decay: wd,
            max_grad_norm: gn,
            lr_scheduler_type: sched,
            warmup_steps: warm,
            max_steps: steps,
            num_train_epochs: epochs,
            per_device_train_batch_size: bs,
            gradient_accumulation_steps: ga,
            seed,
            num_generations: g,
            max_completion_length: mcl,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            num_iterations: 1,
            epsilon: 0.2,
            epsilon_high: None,
            reward_weights: None,
            reward_funcs: None,
            mask_truncated_completions: false,
            steps_per_generation: None,
            generation_batch_size: None,
            beta: 0.0,
            delta: None,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            multi_objective_aggregation: Aggregation::SumThenNormalize,
            scale_rewards: ScaleRewards::Group,
            loss_type: LossType::Dapo,
            use_bias_correction_kl: true,
            top_entropy_quantile: 1.0,
            entropy_coef: 0.0,
            use_adaptive_entropy: false,
            off_policy_mask_threshold: None,
        }
    }
}

impl Default for RlooConfig {
    fn default() -> Self {
        let (lr, b1, b2, eps, wd, gn, sched, warm, steps, epochs, bs, ga, seed, g, mcl) = shared_defaults!(2);
        Self {
            learning_rate: lr,
            adam_beta1: b1,
            adam_beta2: b2,
            adam_epsilon: eps,
            weight_decay: wd,
            max_grad_norm: gn,
            lr_scheduler_type: sched,
            warmup_steps: warm,
            max_steps: steps,
            num_train_epochs: epochs,
            per_device_train_batch_size: bs,
            gradient_accumulation_steps: ga,
            seed,
            num_generations: g,
            max_completion_length: mcl,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            num_iterations: 1,
            epsilon: 0.2,
            epsilon_high: None,
            reward_weights: None,
            reward_funcs: None,
            mask_truncated_completions: false,
            steps_per_generation: None,
            generation_batch_size: None,
            beta: 0.05,
            normalize_advantages: false,
            reward_clip_range: None,
        }
    }
}

/// The fields both configs share, by reference (for the shared checks and the optimizer).
pub(crate) struct Common<'a> {
    pub table: &'static str,
    pub learning_rate: f64,
    pub adam: (f64, f64, f64),
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    pub lr_scheduler_type: SchedulerType,
    pub warmup_steps: f64,
    pub max_steps: i64,
    pub num_train_epochs: f64,
    pub gradient_accumulation_steps: usize,
    pub num_generations: usize,
    pub max_completion_length: usize,
    pub temperature: f64,
    pub num_iterations: usize,
    pub epsilon: f64,
    pub epsilon_high: Option<f64>,
    pub reward_weights: Option<&'a [f64]>,
    pub steps_per_generation: Option<usize>,
    pub beta: f64,
}

macro_rules! common {
    ($self:ident, $table:expr) => {
        Common {
            table: $table,
            learning_rate: $self.learning_rate,
            adam: ($self.adam_beta1, $self.adam_beta2, $self.adam_epsilon),
            weight_decay: $self.weight_decay,
            max_grad_norm: $self.max_grad_norm,
            lr_scheduler_type: $self.lr_scheduler_type,
            warmup_steps: $self.warmup_steps,
            max_steps: $self.max_steps,
            num_train_epochs: $self.num_train_epochs,
            gradient_accumulation_steps: $self.gradient_accumulation_steps,
            num_generations: $self.num_generations,
            max_completion_length: $self.max_completion_length,
            temperature: $self.temperature,
            num_iterations: $self.num_iterations,
            epsilon: $self.epsilon,
            epsilon_high: $self.epsilon_high,
            reward_weights: $self.reward_weights.as_deref(),
            steps_per_generation: $self.steps_per_generation,
            beta: $self.beta,
        }
    };
}

impl Common<'_> {
    fn validate(&self) -> std::result::Result<(), ConfigError> {
        let t = self.table;
        if self.num_generations < 2 {
            return Err(ConfigError::new(
                t,
                "num_generations",
                format!(
                    "is {}; advantages compare completions of one prompt, so at least 2 \
                 are needed (TRL refuses fewer too)",
                    self.num_generations
                ),
            ));
        }
        for (name, v) in
            [("num_iterations", self.num_iterations), ("max_completion_length", self.max_completion_length)]
        {
            if v == 0 {
                return Err(ConfigError::new(t, name, "must be at least 1"));
            }
        }
        if self.gradient_accumulation_steps != 1 {
            return Err(ConfigError::new(
                t,
                "gradient_accumulation_steps",
                format!(
                    "is {}; rltune makes one optimizer update over the whole \
                 batch of a step: set it to 1 and pass the accumulated batch instead",
                    self.gradient_accumulation_steps
                ),
            ));
        }
        if self.steps_per_generation.is_some_and(|s| s != 1) {
            return Err(ConfigError::new(
                t,
                "steps_per_generation",
                "must be 1 (one optimizer step per generation batch and iteration)",
            ));
        }
        let positive = [("learning_rate", self.learning_rate), ("temperature", self.temperature)];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::new(t, name, format!("must be a positive number, got {v}")));
            }
        }
        let nonneg = [
            ("weight_decay", self.weight_decay),
            ("max_grad_norm", self.max_grad_norm),
            ("warmup_steps", self.warmup_steps),
            ("epsilon", self.epsilon),
            ("adam_epsilon", self.adam.2),
            ("num_train_epochs", self.num_train_epochs),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::new(t, name, format!("must be a non-negative number, got {v}")));
            }
        }
        if let Some(e) = self.epsilon_high {
            if !(e.is_finite() && e >= 0.0) {
                return Err(ConfigError::new(
                    t,
                    "epsilon_high",
                    format!("must be a non-negative number, got {e}"),
                ));
            }
        }
        for (name, b) in [("adam_beta1", self.adam.0), ("adam_beta2", self.adam.1)] {
            if !(0.0..1.0).contains(&b) {
                return Err(ConfigError::new(t, name, format!("must be in [0, 1), got {b}")));
            }
        }
        if !self.beta.is_finite() || self.beta < 0.0 {
            return Err(ConfigError::new(
                t,
                "beta",
                format!("must be a non-negative number, got {}", self.beta),
            ));
        }
        if let Some(w) = self.reward_weights {
            if let Some(bad) = w.iter().find(|x| !x.is_finite()) {
                return Err(ConfigError::new(t, "reward_weights", format!(": {bad} is not a finite number")));
            }
        }
        Ok(())
    }

    fn optim_args(&self) -> OptimArgs {
        let total = if self.max_steps > 0 {
            self.max_steps as usize
        } else {
            (self.num_train_epochs * self.num_iterations as f64).ceil().max(1.0) as usize
        };
        resolve_optim(
            self.learning_rate,
            self.adam,
            self.weight_decay,
            self.max_grad_norm,
            self.lr_scheduler_type,
            self.warmup_steps,
            total,
        )
    }
}

impl GrpoConfig {
    /// Reads the `[grpo]` table of a TOML file (an absent table gives TRL's defaults).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text, path)
    }

    /// Parses the `[grpo]` table of TOML text; `path` names the source in errors.
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = parse_table(text, path, "grpo", GRPO_FIELDS)?;
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// Checks every field; the message names the field and the fix.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        common!(self, "grpo").validate()?;
        let unsupported = |what: &str| {
            Err(ConfigError::new("grpo", what, "is not implemented in rltune; leave it at TRL's default"))
        };
        if matches!(self.loss_type, LossType::Cispo | LossType::Sapo | LossType::Luspo | LossType::Vespo) {
            return Err(ConfigError::new(
                "grpo",
                "loss_type",
                format!(
                    "{:?} is not implemented in rltune; use \"dapo\" (TRL's default), \"grpo\", \
                 \"dr_grpo\" or \"bnpo\"",
                    self.loss_type
                ),
            ));
        }
        if self.top_entropy_quantile != 1.0 {
            return unsupported("top_entropy_quantile (only 1.0)");
        }
        if self.entropy_coef != 0.0 || self.use_adaptive_entropy {
            return unsupported("entropy_coef / use_adaptive_entropy (only 0 / false)");
        }
        if self.off_policy_mask_threshold.is_some() {
            return unsupported("off_policy_mask_threshold (only unset)");
        }
        if let Some(d) = self.delta {
            if !(d.is_finite() && d > 0.0) {
                return Err(ConfigError::new(
                    "grpo",
                    "delta",
                    format!("must be a positive number when set, got {d}"),
                ));
            }
        }
        Ok(())
    }

    /// The upper clip ε (`epsilon_high`, else `epsilon`).
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    /// The optimizer and schedule.
    pub fn optim_args(&self) -> OptimArgs {
        common!(self, "grpo").optim_args()
    }
}

impl RlooConfig {
    /// Reads the `[rloo]` table of a TOML file (an absent table gives TRL's defaults).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text, path)
    }

    /// Parses the `[rloo]` table of TOML text; `path` names the source in errors.
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = parse_table(text, path, "rloo", RLOO_FIELDS)?;
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// Checks every field; the message names the field and the fix.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        common!(self, "rloo").validate()?;
        if let Some((lo, hi)) = self.reward_clip_range {
            if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
                return Err(ConfigError::new(
                    "rloo",
                    "reward_clip_range",
                    format!("must be [lo, hi] with lo ≤ hi, got [{lo}, {hi}]"),
                ));
            }
        }
        Ok(())
    }

    /// The upper clip ε (`epsilon_high`, else `epsilon`).
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    /// The optimizer and schedule.
    pub fn optim_args(&self) -> OptimArgs {
        common!(self, "rloo").optim_args()
    }
}

const SHARED_FIELDS: &[&str] = &[
    "learning_rate",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "max_grad_norm",
    "lr_scheduler_type",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "reward_weights",
    "reward_funcs",
    "mask_truncated_completions",
    "steps_per_generation",
    "generation_batch_size",
    "beta",
];
const GRPO_FIELDS: &[&str] = &[
    "delta",
    "importance_sampling_level",
    "multi_objective_aggregation",
    "scale_rewards",
    "loss_type",
    "use_bias_correction_kl",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "off_policy_mask_threshold",
];
const RLOO_FIELDS: &[&str] = &["normalize_advantages", "reward_clip_range"];

fn parse_table<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
    name: &str,
    own: &[&str],
) -> Result<T> {
    let fields: Vec<&str> = SHARED_FIELDS.iter().chain(own).copied().collect();
    parse_table_with(text, path, name, &fields)
}

/// Reads table `[name]` of TOML text into `T` (an absent table gives `T`'s defaults); an unknown
/// key is reported with the closest of `fields`.
pub(crate) fn parse_table_with<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
    name: &str,
    fields: &[&str],
) -> Result<T> {
    let doc: toml::Table = toml::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
    let table = match doc.get(name) {
        Some(toml::Value::Table(t)) => t.clone(),
        Some(_) => return Err(Error::config(path, format!("[{name}] must be a table"))),
        None => toml::Table::new(),
    };
    toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| {
        let msg = e.to_string();
        let hint = msg.split("unknown field `").nth(1).and_then(|rest| rest.split('`').next()).map(|bad| {
            match closest(bad, fields) {
                Some(best) => format!("unknown key {bad:?}; did you mean {best:?}?"),
                None => format!(
                    "unknown key {bad:?}; rltune reads these TRL fields: {} (others change nothing in one \
                     step, such as logging or saving options: remove them)",
                    fields.join(", ")
                ),
            }
        });
        Error::config(path, format!("[{name}]: {}", hint.unwrap_or(msg)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_trl_1_16s() {
        let g = GrpoConfig::default();
        assert_eq!(
            (g.learning_rate, g.num_generations, g.max_completion_length, g.beta),
            (1e-6, 8, 512, 0.0)
        );
        assert_eq!(
            (g.loss_type, g.scale_rewards, g.epsilon, g.epsilon_high()),
            (LossType::Dapo, ScaleRewards::Group, 0.2, 0.2)
        );
        assert!(g.use_bias_correction_kl && !g.mask_truncated_completions);
        assert_eq!((g.max_grad_norm, g.weight_decay, g.lr_scheduler_type), (1.0, 0.0, SchedulerType::Linear));
        let r = RlooConfig::default();
        assert_eq!((r.beta, r.num_generations, r.normalize_advantages), (0.05, 2, false));
        g.validate().unwrap();
        r.validate().unwrap();
    }

    #[test]
    fn toml_tables_load_and_typos_get_suggestions() {
        let p = Path::new("run.toml");
        let c = GrpoConfig::from_toml_str(
            "[grpo]\nnum_generations = 4\nscale_rewards = false\nloss_type = \"bnpo\"\nepsilon_high = 0.28\n",
            p,
        )
        .unwrap();
        assert_eq!(
            (c.num_generations, c.scale_rewards, c.loss_type),
            (4, ScaleRewards::None, LossType::Bnpo)
        );
        assert_eq!(c.epsilon_high(), 0.28);
        let c = GrpoConfig::from_toml_str("[grpo]\nscale_rewards = \"batch\"\n", p).unwrap();
        assert_eq!(c.scale_rewards, ScaleRewards::Batch);
        let err = GrpoConfig::from_toml_str("[grpo]\nepsilon_hgh = 0.3\n", p).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains("did you mean \"epsilon_high\""), "{err}");
        let err = GrpoConfig::from_toml_str("[grpo]\nloss_type = \"sapo\"\n", p).unwrap_err().to_string();
        assert!(err.contains("not implemented"), "{err}");
        let err = GrpoConfig::from_toml_str("[grpo]\nnum_generations = 1\n", p).unwrap_err().to_string();
        assert!(err.contains("grpo.num_generations"), "{err}");
        let r =
            RlooConfig::from_toml_str("[rloo]\nreward_clip_range = [-1.0, 2.0]\nbeta = 0.0\n", p).unwrap();
        assert_eq!(r.reward_clip_range, Some((-1.0, 2.0)));
        let err = RlooConfig::from_toml_str("[rloo]\nloss_type = \"grpo\"\n", p).unwrap_err().to_string();
        assert!(err.contains("unknown key \"loss_type\""), "{err}");
    }

    #[test]
    fn schedule_resolves_as_transformers() {
        let c = GrpoConfig { max_steps: 10, warmup_steps: 0.25, ..Default::default() };
        let s = c.optim_args().schedule;
        assert_eq!((s.total_steps, s.warmup_steps), (10, 3));
        // No max_steps: num_train_epochs passes over one batch of num_iterations steps.
        let c = GrpoConfig { num_iterations: 2, ..Default::default() };
        assert_eq!(c.optim_args().schedule.total_steps, 6);
        let c = GrpoConfig {
            lr_scheduler_type: SchedulerType::Constant,
            warmup_steps: 5.0,
            ..Default::default()
        };
        assert_eq!(c.optim_args().schedule.warmup_steps, 0);
        assert_eq!(c.optim_args().schedule.lr(0), 1e-6);
    }
}
