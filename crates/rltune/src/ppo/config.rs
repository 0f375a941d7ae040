//! `PpoConfig`: TRL 0.11's `PPOConfig` names and defaults, plus rltune's options.
//!
//! It is read from the `[ppo]` table of a TOML file; unknown keys are rejected with the closest
//! valid name. [`PpoConfig::validate`] checks every field and names the fix.

use std::path::Path;

use super::math::KlPenalty;
use crate::config_file::closest;
use crate::engine::{LrSchedule, OptimArgs, ScheduleKind};
use crate::error::{ConfigError, Error, Result};
use crate::models::{ValueHeadKind, ValueHeadSpec};
use crate::optim::AdamConfig;

/// PPO hyper-parameters. Defaults are TRL 0.11.4's unless a field says otherwise.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoConfig {
    /// Adam learning rate (TRL: 1.41e-5).
    pub learning_rate: f64,
    /// Samples per `step()` call (TRL: 128).
    pub batch_size: usize,
    /// Samples per optimizer forward/backward pass (TRL: 128).
    pub mini_batch_size: usize,
    /// Minibatches whose gradients are summed before one optimizer step (TRL: 1).
    pub gradient_accumulation_steps: usize,
    /// Passes over the batch per `step()` (TRL: 4).
    pub ppo_epochs: usize,
    /// Initial KL coefficient β (TRL: 0.2).
    pub init_kl_coef: f64,
    /// Adapt β toward `target` (TRL: true).
    pub adap_kl_ctrl: bool,
    /// Target KL per sequence for the adaptive controller (TRL: 6).
    pub target: f64,
    /// Horizon of the adaptive controller, in samples (TRL: 10000).
    pub horizon: f64,
    /// Discount across tokens (TRL: 1).
    pub gamma: f64,
    /// GAE λ (TRL: 0.95).
    pub lam: f64,
    /// Policy ratio clip range (TRL: 0.2).
    pub cliprange: f64,
    /// Value clip range (TRL: 0.2).
    pub cliprange_value: f64,
    /// Value loss coefficient (TRL: 0.1).
    pub vf_coef: f64,
    /// KL penalty estimator (TRL: "kl"; rltune adds "k3").
    pub kl_penalty: KlPenalty,
    /// Whiten rewards before GAE (TRL: false). rltune keeps padding at zero (a TRL bug).
    pub whiten_rewards: bool,
    /// Clip scores to ±score_clip (TRL: none).
    pub score_clip: Option<f64>,
    /// Divide scores by their running std (TRL: false; crashes in TRL 0.11.4, works here).
    pub use_score_scaling: bool,
    /// With score scaling, also subtract the running mean (TRL: false).
    pub use_score_norm: bool,
    /// Skip a minibatch whose mean ratio exceeds this (TRL: 10). TRL zeroes the loss but still
    /// steps Adam; rltune skips the update.
    pub ratio_threshold: f64,
    /// Stop the epochs early when the policy KL exceeds 1.5·target_kl (TRL: false).
    pub early_stopping: bool,
    /// KL threshold for early stopping (TRL: 1).
    pub target_kl: f64,
    /// Clip the global gradient norm (TRL: none). TRL 0.11.4 clips only the first update of a
    /// trainer's life (its parameter iterator is consumed); rltune clips every update.
    pub max_grad_norm: Option<f64>,
    /// Seed of the minibatch shuffling (TRL: 0).
    pub seed: u64,
    /// Divide logits by this when computing training logprobs; set it to the sampling
    /// temperature ("The N implementation details of RLHF"). rltune only; default 1.
    pub temperature: f64,
    /// Subtracted from the score of a response that does not end in EOS. rltune only; default none.
    pub missing_eos_penalty: Option<f64>,
    /// PPO steps of a training run (`rltune ppo`; TRL: 20000). `step()` ignores it.
    pub steps: usize,
    /// In `rltune ppo`, reuse the rollout's logprobs and values instead of a second policy forward
    /// pass (trl-textworld's optimization; equal up to float rounding). rltune only; default true.
    pub rollout_cache: bool,
    /// The value head: `"linear"` (TRL's `Linear(C, 1)`, default) or `"mlp"` (trlx's
    /// `Linear(C, H) → ReLU → Linear(H, 1)`). With a separate critic, the critic's head. rltune only.
    pub value_head: ValueHeadKind,
    /// The MLP head's width H; default: the checkpoint's, else `2·C` (trlx). rltune only.
    pub value_head_hidden: Option<usize>,
    /// Feed the value head a detached hidden state, so the value loss trains only the head and
    /// not the LM under it (with a separate critic: not the critic's backbone). rltune only;
    /// default false (TRL: the value loss reaches the shared LM).
    pub detach_value_head: bool,
}

/// TRL 0.11.4's PPO optimizer as [`crate::engine::Optimizer`] arguments: torch's Adam at a
/// constant `learning_rate` (its defaults β = (0.9, 0.999), ε = 1e-8; no weight decay), the
/// gradients clipped to `max_grad_norm` when set. The separate critic's too, at its own rate.
pub(super) fn optim_args(learning_rate: f64, max_grad_norm: Option<f64>) -> OptimArgs {
    let adam = AdamConfig::default();
    OptimArgs {
        learning_rate,
        betas: (adam.beta1, adam.beta2),
        eps: adam.eps,
        weight_decay: 0.0,
        max_grad_norm: max_grad_norm.unwrap_or(0.0),
        schedule: LrSchedule {
            kind: ScheduleKind::Constant,
            base_lr: learning_rate,
            warmup_steps: 0,
            total_steps: usize::MAX,
        },
    }
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1.41e-5,
            batch_size: 128,
            mini_batch_size: 128,
            gradient_accumulation_steps: 1,
            ppo_epochs: 4,
            init_kl_coef: 0.2,
            adap_kl_ctrl: true,
            target: 6.0,
            horizon: 10000.0,
            gamma: 1.0,
            lam: 0.95,
            cliprange: 0.2,
            cliprange_value: 0.2,
            vf_coef: 0.1,
            kl_penalty: KlPenalty::Kl,
            whiten_rewards: false,
            score_clip: None,
            use_score_scaling: false,
            use_score_norm: false,
            ratio_threshold: 10.0,
            early_stopping: false,
            target_kl: 1.0,
            max_grad_norm: None,
            seed: 0,
            temperature: 1.0,
            missing_eos_penalty: None,
            steps: 20000,
            rollout_cache: true,
            value_head: ValueHeadKind::Linear,
            value_head_hidden: None,
            detach_value_head: false,
        }
    }
}

/// Field names, for "did you mean" suggestions.
const FIELDS: &[&str] = &[
    "learning_rate",
    "batch_size",
    "mini_batch_size",
    "gradient_accumulation_steps",
    "ppo_epochs",
    "init_kl_coef",
    "adap_kl_ctrl",
    "target",
    "horizon",
    "gamma",
    "lam",
    "cliprange",
    "cliprange_value",
    "vf_coef",
    "kl_penalty",
    "whiten_rewards",
    "score_clip",
    "use_score_scaling",
    "use_score_norm",
    "ratio_threshold",
    "early_stopping",
    "target_kl",
    "max_grad_norm",
    "seed",
    "temperature",
    "missing_eos_penalty",
    "steps",
    "rollout_cache",
    "value_head",
    "value_head_hidden",
    "detach_value_head",
];

impl PpoConfig {
    /// Samples per optimizer step: `mini_batch_size · gradient_accumulation_steps`.
    pub fn backward_batch_size(&self) -> usize {
        self.mini_batch_size * self.gradient_accumulation_steps
    }

    /// The value head `value_head` and `value_head_hidden` ask for.
    pub fn value_head_spec(&self) -> ValueHeadSpec {
        ValueHeadSpec { kind: self.value_head, hidden: self.value_head_hidden }
    }

    /// Reads the `[ppo]` table of a TOML file (all fields optional), then validates it.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text, path)
    }

    /// Parses the `[ppo]` table of TOML text; `path` names the source in errors.
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self> {
        let doc: toml::Table = toml::from_str(text).map_err(|e| Error::config(path, e.to_string()))?;
        let table = match doc.get("ppo") {
            Some(toml::Value::Table(t)) => t.clone(),
            Some(_) => return Err(Error::config(path, "[ppo] must be a table")),
            None => toml::Table::new(),
        };
        let cfg: Self = toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| {
            Error::config(path, format!("[ppo]: {}", with_suggestion(&e.to_string())))
        })?;
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// Checks every field; the message names the field and the fix.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        let pos = |name: &str, v: usize| {
            if v == 0 {
                Err(ConfigError::new("ppo", name, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        pos("batch_size", self.batch_size)?;
        pos("mini_batch_size", self.mini_batch_size)?;
        pos("gradient_accumulation_steps", self.gradient_accumulation_steps)?;
        pos("ppo_epochs", self.ppo_epochs)?;
        pos("steps", self.steps)?;
        if !self.batch_size.is_multiple_of(self.backward_batch_size()) {
            return Err(ConfigError::new(
                "ppo",
                "batch_size",
                format!(
                    "({}) must be a multiple of mini_batch_size × gradient_accumulation_steps \
                 ({} × {} = {}); change one of them",
                    self.batch_size,
                    self.mini_batch_size,
                    self.gradient_accumulation_steps,
                    self.backward_batch_size()
                ),
            ));
        }
        let finite_pos = [
            ("learning_rate", self.learning_rate),
            ("target", self.target),
            ("horizon", self.horizon),
            ("temperature", self.temperature),
            ("ratio_threshold", self.ratio_threshold),
            ("target_kl", self.target_kl),
        ];
        for (name, v) in finite_pos {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::new("ppo", name, format!("must be a positive number, got {v}")));
            }
        }
        let unit = [("gamma", self.gamma), ("lam", self.lam)];
        for (name, v) in unit {
            if !(0.0..=1.0).contains(&v) {
                return Err(ConfigError::new("ppo", name, format!("must be in [0, 1], got {v}")));
            }
        }
        let nonneg = [
            ("init_kl_coef", self.init_kl_coef),
            ("cliprange", self.cliprange),
            ("cliprange_value", self.cliprange_value),
            ("vf_coef", self.vf_coef),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::new("ppo", name, format!("must be a non-negative number, got {v}")));
            }
        }
        for (name, v) in [("score_clip", self.score_clip), ("max_grad_norm", self.max_grad_norm)] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(ConfigError::new("ppo", name, format!("must be positive when set, got {v}")));
                }
            }
        }
        match (self.value_head, self.value_head_hidden) {
            (_, Some(0)) => {
                return Err(ConfigError::new("ppo", "value_head_hidden", "must be at least 1 when set"))
            }
            (ValueHeadKind::Linear, Some(_)) => {
                return Err(ConfigError::new(
                    "ppo",
                    "value_head_hidden",
                    "is the width of the MLP head; set value_head = \"mlp\" \
                            or leave value_head_hidden out",
                ))
            }
            _ => {}
        }
        if self.use_score_norm && !self.use_score_scaling {
            return Err(ConfigError::new("ppo", "use_score_norm", "needs use_score_scaling = true"));
        }
        Ok(())
    }
}

/// Adds "did you mean" to serde's unknown-field message.
fn with_suggestion(msg: &str) -> String {
    let Some(rest) = msg.split("unknown field `").nth(1) else { return msg.to_string() };
    let Some(name) = rest.split('`').next() else { return msg.to_string() };
    match closest(name, FIELDS) {
        Some(best) => format!("unknown key {name:?}; did you mean {best:?}?"),
        None => format!("unknown key {name:?}; valid keys: {}", FIELDS.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_trls() {
        let c = PpoConfig::default();
        assert_eq!(
            (c.learning_rate, c.ppo_epochs, c.init_kl_coef, c.target, c.horizon),
            (1.41e-5, 4, 0.2, 6.0, 10000.0)
        );
        assert_eq!((c.gamma, c.lam, c.cliprange, c.cliprange_value, c.vf_coef), (1.0, 0.95, 0.2, 0.2, 0.1));
        assert_eq!(c.kl_penalty, KlPenalty::Kl);
        assert_eq!(c.ratio_threshold, 10.0);
    }

    #[test]
    fn toml_table_loads_and_typos_get_suggestions() {
        let p = Path::new("run.toml");
        let c =
            PpoConfig::from_toml_str("[ppo]\nbatch_size = 8\nmini_batch_size = 4\nkl_penalty = \"k3\"\n", p)
                .unwrap();
        assert_eq!((c.batch_size, c.mini_batch_size, c.kl_penalty), (8, 4, KlPenalty::K3));
        let err = PpoConfig::from_toml_str("[ppo]\nlearning_rat = 1e-5\n", p).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains("\"learning_rate\""), "{err}");
    }

    #[test]
    fn batch_must_divide_into_minibatches() {
        let c = PpoConfig { batch_size: 10, mini_batch_size: 4, ..Default::default() };
        let err = c.validate().unwrap_err();
        assert_eq!((err.section.as_str(), err.field.as_str()), ("ppo", "batch_size"));
        assert_eq!(err.fix.as_deref(), Some("change one of them"));
        let shown = err.to_string();
        assert!(shown.starts_with("ppo.batch_size (10) must be a multiple of mini_batch_size"), "{shown}");
        assert!(shown.ends_with("(4 × 1 = 4); change one of them"), "{shown}");
        let c = PpoConfig { lam: 1.5, ..Default::default() };
        assert_eq!(c.validate().unwrap_err().to_string(), "ppo.lam must be in [0, 1], got 1.5");
    }
}
