//! GiGPO's step-level credit (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
//! Training"; verl-agent's `core_gigpo.py`): trajectory GRPO plus an advantage for each turn,
//! computed among the turns that acted from the same game state.
//!
//! A group's `G` plays of one game revisit the same states (the start, a room before its door is
//! opened, …). Every turn taken from one state, in any play of the group, forms an *anchor-state
//! group*; a turn's step return is the discounted sum of its episode's rewards from that turn on,
//! `R_t = Σ_{k≥0} γ^k r_{t+k}`; and its step advantage is that return against its anchor group's
//! mean, `A^S = R_t − mean(R)` (`mean_norm`, verl-agent's default), or divided by the group's
//! unbiased std plus 1e-6 (`mean_std_norm`). A turn alone in its state gets `A^S = 0`. The turn's
//! advantage is then `A^E + ω·A^S`, `A^E` being its episode's trajectory GRPO advantage.
//!
//! Deliberate deviations from verl-agent (docs/trl-deviations.md): `A^E` is TRL's GRPO advantage
//! of the episode returns (one value per episode, scaled by `[grpo] scale_rewards`) where
//! verl-agent's later versions average over every turn row of the group; and the anchor is the
//! environment's exact state when it reports one (`infos["state"]`), else its observation,
//! inventory and admissible commands together, where verl-agent keys on the observation text.

use crate::error::ConfigError;
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// How a step advantage is scaled within its anchor-state group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepNorm {
    /// `R − mean(R)` (verl-agent's default).
    #[default]
    MeanNorm,
    /// `(R − mean(R)) / (std(R) + 1e-6)`, the unbiased std; a group of one gets 0.
    MeanStdNorm,
}

/// `[episodes.gigpo]`: step-level credit for trajectory GRPO on games. Present: GiGPO; absent:
/// trajectory GRPO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GigpoArgs {
    /// ω, the step advantage's weight (verl-agent's `step_advantage_w`, 1.0).
    pub step_advantage_w: f64,
    /// γ of the step returns (verl-agent's `gamma`, 0.95).
    pub gamma: f64,
    /// The step advantage's scaling (verl-agent's `mode`).
    pub mode: StepNorm,
}

impl Default for GigpoArgs {
    fn default() -> Self {
        Self { step_advantage_w: 1.0, gamma: 0.95, mode: StepNorm::MeanNorm }
    }
}

impl GigpoArgs {
    /// Checks the values; messages name the field.
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        if !(self.step_advantage_w.is_finite() && self.step_advantage_w >= 0.0) {
            return Err(ConfigError::new(
                "episodes.gigpo",
                "step_advantage_w",
                format!("must be a finite number ≥ 0, got {}", self.step_advantage_w),
            ));
        }
        if !(0.0..=1.0).contains(&self.gamma) {
            return Err(ConfigError::new(
                "episodes.gigpo",
                "gamma",
                format!("must be in [0, 1], got {}", self.gamma),
            ));
        }
        Ok(())
    }
}

/// What GiGPO needs of a step's turns, beside [`super::TurnBatch`]'s episodes.
#[derive(Debug, Clone, Copy)]
pub struct StepCredit<'a> {
    /// Each turn's reward (the shaped one the episode return sums).
    pub rewards: &'a [f64],
    /// Each turn's anchor state, as a key: equal keys are the same state.
    pub states: &'a [u64],
    /// The settings.
    pub args: &'a GigpoArgs,
}

/// The step advantages and how the anchor groups came out.
#[derive(Debug, Clone, PartialEq)]
pub struct StepAdvantages {
    /// One per turn, in batch order (0 for a turn of a lost episode).
    pub advantages: Vec<f64>,
    /// Each turn's discounted step return `R_t`.
    pub returns: Vec<f64>,
    /// Turns per anchor group, averaged over the turns (`gigpo/step_group_size`).
    pub mean_group_size: f64,
    /// Fraction of the turns alone in their state (`gigpo/frac_singleton_turns`).
    pub frac_singleton: f64,
}

/// GiGPO's step advantages of a batch of turns. `episodes[i]` is turn i's episode (`g`
/// consecutive episodes are one game's group), and an episode's turns appear in the order they
/// were played; `lost[e]` marks an episode lost to a failing environment, whose turns get 0 and
/// join no group. See the module docs for the formulas.
pub fn step_advantages(episodes: &[usize], g: usize, lost: &[bool], credit: &StepCredit) -> StepAdvantages {
    let n = episodes.len();
    let gamma = credit.args.gamma;
    // Discounted returns, from each episode's last turn back.
    let mut returns = vec![0.0; n];
    let mut next: HashMap<usize, f64> = HashMap::new();
    for i in (0..n).rev() {
        let later = next.get(&episodes[i]).copied().unwrap_or(0.0);
        returns[i] = credit.rewards[i] + gamma * later;
        next.insert(episodes[i], returns[i]);
    }
    // Anchor groups: the game group and the state.
    let mut groups: HashMap<(usize, u64), Vec<usize>> = HashMap::new();
    for i in (0..n).filter(|&i| !lost[episodes[i]]) {
        groups.entry((episodes[i] / g, credit.states[i])).or_default().push(i);
    }
    let mut advantages = vec![0.0; n];
    let (mut size_sum, mut singles, mut counted) = (0.0, 0usize, 0usize);
    for members in groups.values() {
        let m = members.len();
        counted += m;
        size_sum += (m * m) as f64;
        if m == 1 {
            singles += 1;
            continue;
        }
        let vals: Vec<f64> = members.iter().map(|&i| returns[i]).collect();
        let mean = vals.iter().sum::<f64>() / m as f64;
        let scale = match credit.args.mode {
            StepNorm::MeanNorm => 1.0,
            StepNorm::MeanStdNorm => super::math::nanstd(&vals) + 1e-6,
        };
        for (&i, v) in members.iter().zip(&vals) {
            advantages[i] = (v - mean) / scale;
        }
    }
    let per_turn = |x: f64| if counted == 0 { 0.0 } else { x / counted as f64 };
    StepAdvantages {
        advantages,
        returns,
        mean_group_size: per_turn(size_sum),
        frac_singleton: per_turn(singles as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(mode: StepNorm) -> GigpoArgs {
        GigpoArgs { step_advantage_w: 1.0, gamma: 0.5, mode }
    }

    /// Two plays of one game (g = 2). Play 0: states A, B (rewards 0, 1). Play 1: states A, C, B
    /// (rewards 0, 0, 1). With γ = 0.5: play 0 returns 0.5, 1; play 1 returns 0.25, 0.5, 1.
    /// Groups: A {0.5, 0.25}, B {1, 1}, C {0.5} alone.
    #[test]
    fn step_advantages_compare_turns_from_the_same_state() {
        let episodes = [0, 0, 1, 1, 1];
        let states = [1, 2, 1, 3, 2];
        let rewards = [0.0, 1.0, 0.0, 0.0, 1.0];
        let a = args(StepNorm::MeanNorm);
        let c = StepCredit { rewards: &rewards, states: &states, args: &a };
        let got = step_advantages(&episodes, 2, &[false, false], &c);
        assert_eq!(got.returns, vec![0.5, 1.0, 0.25, 0.5, 1.0]);
        assert_eq!(got.advantages, vec![0.125, 0.0, -0.125, 0.0, 0.0]);
        // Sizes per turn: 2, 2, 2, 1, 2 → mean 9/5; one turn of five alone.
        assert!((got.mean_group_size - 1.8).abs() < 1e-12);
        assert!((got.frac_singleton - 0.2).abs() < 1e-12);

        let s = args(StepNorm::MeanStdNorm);
        let got = step_advantages(&episodes, 2, &[false, false], &StepCredit { args: &s, ..c });
        // Group A: std of {0.5, 0.25} (unbiased) = 0.1767767; ±0.125 / (0.1767767 + 1e-6).
        let want = 0.125 / (0.125f64 * 2f64.sqrt() + 1e-6);
        assert!((got.advantages[0] - want).abs() < 1e-12 && (got.advantages[2] + want).abs() < 1e-12);
    }

    /// States are grouped within a game's group only, and a lost episode's turns join none.
    #[test]
    fn groups_do_not_cross_games_or_include_lost_episodes() {
        let episodes = [0, 1, 2, 3];
        let states = [7, 7, 7, 7];
        let rewards = [1.0, 0.0, 1.0, 5.0];
        let a = args(StepNorm::MeanNorm);
        let c = StepCredit { rewards: &rewards, states: &states, args: &a };
        let got = step_advantages(&episodes, 2, &[false, false, false, true], &c);
        assert_eq!(got.advantages, vec![0.5, -0.5, 0.0, 0.0]);
    }

    #[test]
    fn bad_settings_name_the_field() {
        let bad = GigpoArgs { gamma: 1.5, ..GigpoArgs::default() };
        assert_eq!(bad.validate().unwrap_err().field, "gamma");
        let bad = GigpoArgs { step_advantage_w: -1.0, ..GigpoArgs::default() };
        let err = bad.validate().unwrap_err();
        assert_eq!((err.section.as_str(), err.field.as_str()), ("episodes.gigpo", "step_advantage_w"));
    }
}
