//! What the RL runs of `rltune ppo` report to the one run loop ([`crate::engine::run_loop`]):
//! PPO and rejection sampling ([`super::PpoRun`]) and GRPO and RLOO ([`super::GroupRun`]) are
//! its [`Algorithm`]s, and each step reports a [`StepReport`].

pub use crate::engine::run_loop::{Algorithm, Plan};

/// What the loop reports after each step (for progress bars).
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Steps done (1-based).
    pub step: usize,
    /// Steps in the run.
    pub total: usize,
    /// `env/reward_mean`, or NaN for a skipped batch.
    pub reward_mean: f64,
    /// `objective/kl`, or NaN for a skipped batch.
    pub kl: f64,
    /// Whether the batch was skipped (a non-finite reward).
    pub skipped: bool,
    /// Runs on text games: the fraction of the step's episodes won (`env/win_rate`).
    pub win_rate: Option<f64>,
}

impl StepReport {
    /// `"  kl X"` with `digits` decimals for a progress line, or nothing when the step has no
    /// KL (GRPO and RLOO with `beta = 0`).
    pub fn kl_text(&self, digits: usize) -> String {
        if self.kl.is_nan() {
            String::new()
        } else {
            format!("  kl {:.digits$}", self.kl)
        }
    }

    /// The report of step `step` (0-based, as the loop counts; `step + 1` steps are then done)
    /// of `total` from its logged metrics: the mean reward and the KL under the trainer's keys
    /// (NaN when absent), and `env/win_rate` when the step played games.
    pub(crate) fn of(
        step: usize,
        total: usize,
        stats: &crate::engine::Stats,
        reward: &str,
        kl: &str,
    ) -> Self {
        let get = |k: &str| stats.get(k).and_then(crate::engine::Stat::as_f64);
        Self {
            step: step + 1,
            total,
            reward_mean: get(reward).unwrap_or(f64::NAN),
            kl: get(kl).unwrap_or(f64::NAN),
            skipped: false,
            win_rate: get("env/win_rate"),
        }
    }
}
