//! `DpoConfig`: TRL 1.16.0's `DPOConfig` names and defaults, with the transformers
//! `TrainingArguments` fields that change the update (AdamW, clipping, schedule, batch geometry).
//!
//! Read from the `[dpo]` table of a TOML file. Unknown keys are rejected with the closest valid
//! name; TRL fields that rltune does not implement are accepted only at their default, and a
//! different value is an error naming the field.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Error, Result};
use crate::grpo::config::{parse_table_with, OptimArgs, SchedulerType};

/// One of TRL's DPO losses (`loss_type`). TRL `DPOTrainer._compute_loss`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpoLossType {
    /// `−log σ(β·Δ)` (DPO; TRL's default).
    Sigmoid,
    /// `relu(1 − β·Δ)` (SLiC).
    Hinge,
    /// `(Δ_c/n_c − Δ_r/n_r − 1/(2β))²`, scores averaged over completion tokens (IPO).
    Ipo,
    /// EXO-pref, with `label_smoothing` as its ε.
    ExoPair,
    /// NCA.
    NcaPair,
    /// Robust DPO, with `label_smoothing` the label-flip probability.
    Robust,
    /// BCO on pairs.
    BcoPair,
    /// SPPO with hard labels.
    SppoHard,
    /// AOT (not implemented in rltune).
    Aot,
    /// AOT unpaired (not implemented in rltune).
    AotUnpaired,
    /// APO-zero.
    ApoZero,
    /// APO-down.
    ApoDown,
    /// DiscoPOP, with `discopop_tau`.
    Discopop,
    /// Negative log-likelihood of the chosen completions, per token.
    Sft,
    /// The sigmoid loss on scores averaged over completion tokens.
    SigmoidNorm,
}

/// `loss_type`: one name or a list (TRL's `__post_init__` makes a string a list of one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum LossTypes {
    /// One loss.
    One(DpoLossType),
    /// Several, combined with `loss_weights`.
    Many(Vec<DpoLossType>),
}

/// TRL's names of the losses, as `loss_type` spells them.
const LOSS_NAMES: &[(&str, DpoLossType)] = &[
    ("sigmoid", DpoLossType::Sigmoid),
    ("hinge", DpoLossType::Hinge),
    ("ipo", DpoLossType::Ipo),
    ("exo_pair", DpoLossType::ExoPair),
    ("nca_pair", DpoLossType::NcaPair),
    ("robust", DpoLossType::Robust),
    ("bco_pair", DpoLossType::BcoPair),
    ("sppo_hard", DpoLossType::SppoHard),
    ("aot", DpoLossType::Aot),
    ("aot_unpaired", DpoLossType::AotUnpaired),
    ("apo_zero", DpoLossType::ApoZero),
    ("apo_down", DpoLossType::ApoDown),
    ("discopop", DpoLossType::Discopop),
    ("sft", DpoLossType::Sft),
    ("sigmoid_norm", DpoLossType::SigmoidNorm),
];

impl<'de> Deserialize<'de> for LossTypes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        let one = |name: &str| {
            LOSS_NAMES.iter().find(|(n, _)| *n == name).map(|(_, t)| *t).ok_or_else(|| {
                let names: Vec<&str> = LOSS_NAMES.iter().map(|(n, _)| *n).collect();
                serde::de::Error::custom(format!(
                    "loss_type {name:?} is not one of TRL's losses: {}",
                    names.join(", ")
                ))
            })
        };
        match Raw::deserialize(d)
            .map_err(|_| serde::de::Error::custom("loss_type must be a loss name or a list of names"))?
        {
            Raw::One(name) => Ok(Self::One(one(&name)?)),
            Raw::Many(names) => {
                names.iter().map(|n| one(n)).collect::<std::result::Result<_, _>>().map(Self::Many)
            }
        }
    }
}

impl LossTypes {
    /// The losses, in order.
    pub fn list(&self) -> Vec<DpoLossType> {
        match self {
            Self::One(t) => vec![*t],
            Self::Many(v) => v.clone(),
        }
    }
}

/// Which end of a too-long sequence is kept (`truncation_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncationMode {
    /// Keep the first `max_length` tokens (TRL's default): the completion's end is cut.
    KeepStart,
    /// Keep the last `max_length` tokens (deprecated in TRL): the prompt's start is cut.
    KeepEnd,
}

/// The f-divergence regularizer of f-DPO (`f_divergence_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FDivergence {
    /// Standard DPO: the scores are the log-ratios.
    ReverseKl,
    /// `1 − exp(−log-ratio)`.
    ForwardKl,
    /// `log 2 + log σ(log-ratio)`.
    JsDivergence,
    /// `(exp((α − 1)·log-ratio) − 1)/(α − 1)`, α = `f_alpha_divergence_coef`.
    AlphaDivergence,
}

/// `max_length`: a number, or `"none"` for no truncation (TRL's `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MaxLength {
    /// At most this many tokens per prompt+completion sequence.
    Tokens(usize),
    /// The string `"none"`: no truncation.
    Unbounded(NoneWord),
}

/// The word `"none"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoneWord {
    /// `"none"`.
    None,
}

impl MaxLength {
    /// The limit, if any.
    pub fn get(self) -> Option<usize> {
        match self {
            Self::Tokens(n) => Some(n),
            Self::Unbounded(_) => None,
        }
    }
}

crate::engine::training_arguments::training_arguments! {
    /// DPO hyper-parameters: TRL 1.16.0 `DPOConfig` names and defaults, transformers'
    /// `TrainingArguments` fields first (`crate::engine::training_arguments`). A pass of
    /// `num_train_epochs` is one over the pairs; `gradient_accumulation_steps` micro-batches of
    /// `per_device_train_batch_size` pairs make an optimizer step, each loss divided by their number;
    /// the seed is the data shuffle's.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct DpoConfig {
        /// Preference pairs per micro-batch (8).
        pub per_device_train_batch_size: usize,
        /// Longest prompt+completion sequence (1024, or `"none"`).
        pub max_length: MaxLength,
        /// Which end a too-long sequence keeps ("keep_start").
        pub truncation_mode: TruncationMode,
        /// Accepted; TRL 1.16.0 falls back to padding too (false).
        pub padding_free: bool,
        /// Pads to a multiple of this; changes no number (unset; TRL's "auto" is unset off Neuron).
        pub pad_to_multiple_of: Option<usize>,
        /// Compute the reference's logprobs once, before training (false).
        pub precompute_ref_log_probs: bool,
        /// Batch size of that pass (default `per_device_train_batch_size`).
        pub precompute_ref_batch_size: Option<usize>,
        /// The loss, or several ("sigmoid").
        pub loss_type: LossTypes,
        /// One weight per loss (default 1 each).
        pub loss_weights: Option<Vec<f64>>,
        /// Not implemented: must stay unset (LD-DPO).
        pub ld_alpha: Option<f64>,
        /// f-DPO regularizer ("reverse_kl").
        pub f_divergence_type: FDivergence,
        /// α of `alpha_divergence` (0.5).
        pub f_alpha_divergence_coef: f64,
        /// ε of `robust` and `exo_pair` (0.0); the other losses ignore it, as TRL 1.16.0.
        pub label_smoothing: f64,
        /// Deviation from the reference: the β of every loss, τ of IPO (0.1).
        pub beta: f64,
        /// Not implemented: must stay false (WPO weighting).
        pub use_weighting: bool,
        /// τ of `discopop` (0.05).
        pub discopop_tau: f64,
        /// Not implemented: must stay false (TR-DPO).
        pub sync_ref_model: bool,
        /// TR-DPO only (0.6).
        pub ref_model_mixup_alpha: f64,
        /// TR-DPO only (512).
        pub ref_model_sync_steps: usize,
        /// rltune applies no dropout: must stay true.
        pub disable_dropout: bool,
        /// Changes nothing in rltune (unset).
        pub dataset_num_proc: Option<usize>,
        /// MoE only: must stay unset.
        pub router_aux_loss_coef: Option<f64>,
        /// Changes no number (false).
        pub activation_offloading: bool,
        /// Write a checkpoint every this many optimizer steps (transformers' `save_steps`; 0, the
        /// default: only when stopped by Ctrl-C). Where they go: `rltune dpo --checkpoint-dir`. The
        /// one setting a resumed run may change.
        pub save_steps: usize,
    }
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1e-6,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            lr_scheduler_type: SchedulerType::Linear,
            warmup_steps: 0.0,
            max_steps: -1,
            num_train_epochs: 3.0,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            seed: 42,
            max_length: MaxLength::Tokens(1024),
            truncation_mode: TruncationMode::KeepStart,
            padding_free: false,
            pad_to_multiple_of: None,
            precompute_ref_log_probs: false,
            precompute_ref_batch_size: None,
            loss_type: LossTypes::Many(vec![DpoLossType::Sigmoid]),
            loss_weights: None,
            ld_alpha: None,
            f_divergence_type: FDivergence::ReverseKl,
            f_alpha_divergence_coef: 0.5,
            label_smoothing: 0.0,
            beta: 0.1,
            use_weighting: false,
            discopop_tau: 0.05,
            sync_ref_model: false,
            ref_model_mixup_alpha: 0.6,
            ref_model_sync_steps: 512,
            disable_dropout: true,
            dataset_num_proc: None,
            router_aux_loss_coef: None,
            activation_offloading: false,
            save_steps: 0,
        }
    }
}

const FIELDS: &[&str] = &[
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
    "max_length",
    "truncation_mode",
    "padding_free",
    "pad_to_multiple_of",
    "precompute_ref_log_probs",
    "precompute_ref_batch_size",
    "loss_type",
    "loss_weights",
    "ld_alpha",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "label_smoothing",
    "beta",
    "use_weighting",
    "discopop_tau",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "disable_dropout",
    "dataset_num_proc",
    "router_aux_loss_coef",
    "activation_offloading",
    "save_steps",
];

impl DpoConfig {
    /// Reads the `[dpo]` table of a TOML file (an absent table gives TRL's defaults).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text, path)
    }

    /// Parses the `[dpo]` table of TOML text; `path` names the source in errors.
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = parse_table_with(text, path, "dpo", FIELDS)?;
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// The losses and their weights, in order.
    pub fn losses(&self) -> Vec<(DpoLossType, f64)> {
        let types = self.loss_type.list();
        let weights = self.loss_weights.clone().unwrap_or_else(|| vec![1.0; types.len()]);
        types.into_iter().zip(weights).collect()
    }

    /// The sequence length limit (`max_length`), if any.
    pub fn max_len(&self) -> Option<usize> {
        self.max_length.get()
    }

    /// Checks every field; the message names the field and the fix.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        let types = self.loss_type.list();
        if types.is_empty() {
            return Err(ConfigError::new(
                "dpo",
                "loss_type",
                "is empty; give at least one loss (TRL's default: \"sigmoid\")",
            ));
        }
        if let Some(t) = types.iter().find(|t| matches!(t, DpoLossType::Aot | DpoLossType::AotUnpaired)) {
            return Err(ConfigError::new(
                "dpo",
                "loss_type",
                format!(
                    "{t:?} is not implemented in rltune (it sorts the batch); use \"sigmoid\", \
                 \"hinge\", \"ipo\", \"robust\", \"exo_pair\", \"nca_pair\", \"bco_pair\", \"sppo_hard\", \
                 \"apo_zero\", \"apo_down\", \"discopop\", \"sft\" or \"sigmoid_norm\""
                ),
            ));
        }
        if let Some(w) = &self.loss_weights {
            if w.len() != types.len() {
                return Err(ConfigError::new(
                    "dpo",
                    "loss_weights",
                    format!(
                        "has {} weights for {} loss types; give one weight per loss (TRL \
                     refuses this too)",
                        w.len(),
                        types.len()
                    ),
                ));
            }
            if let Some(bad) = w.iter().find(|x| !x.is_finite()) {
                return Err(ConfigError::new(
                    "dpo",
                    "loss_weights",
                    format!(": {bad} is not a finite number"),
                ));
            }
        }
        use DpoLossType as L;
        let f_ok = [L::Sigmoid, L::SigmoidNorm, L::Hinge, L::Ipo, L::ExoPair, L::Robust, L::Discopop, L::Sft];
        if self.f_divergence_type != FDivergence::ReverseKl && !types.iter().all(|t| f_ok.contains(t)) {
            return Err(ConfigError::new(
                "dpo",
                "f_divergence_type",
                format!(
                    "{:?} only goes with the losses built on the chosen−rejected \
                 difference (sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft); you gave \
                 {types:?} (TRL refuses this too)",
                    self.f_divergence_type
                ),
            ));
        }
        if types.contains(&L::ExoPair) && !(self.label_smoothing > 0.0 && self.label_smoothing < 1.0) {
            return Err(ConfigError::new(
                "dpo",
                "label_smoothing",
                format!(
                    "is {} but exo_pair needs it in (0, 1) (the EXO paper uses 1e-3)",
                    self.label_smoothing
                ),
            ));
        }
        if types.contains(&L::Robust) && !(0.0..0.5).contains(&self.label_smoothing) {
            return Err(ConfigError::new(
                "dpo",
                "label_smoothing",
                format!("is {} but robust needs it in [0, 0.5) (it divides by 1 − 2ε)", self.label_smoothing),
            ));
        }
        let unsupported = |what: &str| {
            Err(ConfigError::new("dpo", what, "is not implemented in rltune; leave it at TRL's default"))
        };
        if self.ld_alpha.is_some() {
            return unsupported("ld_alpha (only unset)");
        }
        if self.use_weighting {
            return unsupported("use_weighting (only false)");
        }
        if self.sync_ref_model {
            return unsupported("sync_ref_model (only false)");
        }
        if self.router_aux_loss_coef.is_some() {
            return unsupported("router_aux_loss_coef (only unset: rltune has no MoE models)");
        }
        if !self.disable_dropout {
            return Err(ConfigError::new(
                "dpo",
                "disable_dropout",
                "is false, but rltune never applies dropout; set it to true",
            ));
        }
        self.validate_numbers()
    }

    fn validate_numbers(&self) -> std::result::Result<(), ConfigError> {
        let positive =
            [("learning_rate", self.learning_rate), ("beta", self.beta), ("discopop_tau", self.discopop_tau)];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::new("dpo", name, format!("must be a positive number, got {v}")));
            }
        }
        let nonneg = [
            ("weight_decay", self.weight_decay),
            ("max_grad_norm", self.max_grad_norm),
            ("warmup_steps", self.warmup_steps),
            ("adam_epsilon", self.adam_epsilon),
            ("num_train_epochs", self.num_train_epochs),
            ("label_smoothing", self.label_smoothing),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::new("dpo", name, format!("must be a non-negative number, got {v}")));
            }
        }
        if !self.f_alpha_divergence_coef.is_finite() {
            return Err(ConfigError::new("dpo", "f_alpha_divergence_coef", "must be a finite number"));
        }
        for (name, b) in [("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(ConfigError::new("dpo", name, format!("must be in [0, 1), got {b}")));
            }
        }
        let counts = [
            ("per_device_train_batch_size", self.per_device_train_batch_size),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
            ("precompute_ref_batch_size", self.precompute_ref_batch_size.unwrap_or(1)),
            ("pad_to_multiple_of", self.pad_to_multiple_of.unwrap_or(1)),
        ];
        for (name, v) in counts {
            if v == 0 {
                return Err(ConfigError::new("dpo", name, "must be at least 1"));
            }
        }
        if self.max_len().is_some_and(|m| m < 2) {
            return Err(ConfigError::new(
                "dpo",
                "max_length",
                format!(
                    "is {:?}; a sequence needs a prompt token and a completion token: use at least 2 \
                 (or \"none\")",
                    self.max_length
                ),
            ));
        }
        if self.max_steps <= 0 && self.num_train_epochs == 0.0 {
            return Err(ConfigError::new(
                "dpo",
                "num_train_epochs",
                "is 0 and max_steps is unset: nothing to train",
            ));
        }
        Ok(())
    }

    /// Optimizer steps of a run over `n_pairs` training pairs: `max_steps` when set, else
    /// transformers' `ceil(num_train_epochs · max(1, ceil(batches / gradient_accumulation_steps)))`
    /// with `batches = ceil(n_pairs / per_device_train_batch_size)`.
    pub fn total_steps(&self, n_pairs: usize) -> usize {
        if self.max_steps > 0 {
            return self.max_steps as usize;
        }
        let batches = n_pairs.div_ceil(self.per_device_train_batch_size);
        let per_epoch = batches.div_ceil(self.gradient_accumulation_steps).max(1);
        (self.num_train_epochs * per_epoch as f64).ceil().max(1.0) as usize
    }

    /// The optimizer and schedule of a run over `n_pairs` training pairs.
    pub fn optim_args(&self, n_pairs: usize) -> OptimArgs {
        self.optim_args_for(self.total_steps(n_pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_trl_1_16s() {
        let c = DpoConfig::default();
        assert_eq!((c.learning_rate, c.beta, c.max_len(), c.label_smoothing), (1e-6, 0.1, Some(1024), 0.0));
        assert_eq!(c.losses(), vec![(DpoLossType::Sigmoid, 1.0)]);
        assert_eq!((c.per_device_train_batch_size, c.truncation_mode), (8, TruncationMode::KeepStart));
        c.validate().unwrap();
    }

    #[test]
    fn toml_reads_trl_spellings_and_names_bad_fields() {
        let p = Path::new("run.toml");
        let c =
            DpoConfig::from_toml_str("[dpo]\nloss_type = \"ipo\"\nmax_length = \"none\"\nbeta = 0.5\n", p)
                .unwrap();
        assert_eq!((c.losses(), c.max_len()), (vec![(DpoLossType::Ipo, 1.0)], None));
        let c = DpoConfig::from_toml_str(
            "[dpo]\nloss_type = [\"sigmoid\", \"bco_pair\"]\nloss_weights = [0.8, 0.2]\n",
            p,
        )
        .unwrap();
        assert_eq!(c.losses()[1], (DpoLossType::BcoPair, 0.2));
        let cases = [
            ("betta = 0.2", "did you mean \"beta\""),
            ("loss_type = \"aot\"", "not implemented"),
            (
                "loss_type = [\"sigmoid\", \"sigmod\"]",
                "\"sigmod\" is not one of TRL's losses: sigmoid, hinge",
            ),
            ("loss_type = [\"sigmoid\"]\nloss_weights = [1.0, 2.0]", "dpo.loss_weights"),
            ("loss_type = \"exo_pair\"", "dpo.label_smoothing"),
            ("use_weighting = true", "dpo.use_weighting"),
            ("f_divergence_type = \"js_divergence\"\nloss_type = \"bco_pair\"", "dpo.f_divergence_type"),
            ("max_length = 1", "dpo.max_length"),
            ("beta = 0.0", "dpo.beta"),
        ];
        for (body, want) in cases {
            let err = DpoConfig::from_toml_str(&format!("[dpo]\n{body}\n"), p).unwrap_err().to_string();
            assert!(err.contains("run.toml") && err.contains(want), "{body}: {err}");
        }
    }

    #[test]
    fn total_steps_follow_transformers() {
        let c = DpoConfig {
            per_device_train_batch_size: 2,
            gradient_accumulation_steps: 2,
            ..Default::default()
        };
        // 5 pairs: 3 batches, 2 updates per epoch, 3 epochs.
        assert_eq!(c.total_steps(5), 6);
        let c = DpoConfig { num_train_epochs: 1.5, ..c };
        assert_eq!(c.total_steps(5), 3);
        let c = DpoConfig { max_steps: 4, ..c };
        assert_eq!(c.total_steps(5), 4);
    }
}
