//! Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.
//!
//! The multipliers are transformers' `optimization.py` lambdas
//! (`get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup` with `num_cycles = 0.5`,
//! `get_constant_schedule_with_warmup`), and they are applied as transformers' `Trainer` applies
//! them: optimizer step `k` (counting from 0) uses `lr · λ(k)`. With warm-up, the first update
//! therefore has learning rate 0, exactly as in transformers.

use serde::{Deserialize, Serialize};

/// The shape of the schedule after warm-up (`lr_scheduler_type` in transformers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Linear warm-up, then linear decay from the peak to 0 at the last step (transformers'
    /// default).
    #[default]
    Linear,
    /// Linear warm-up, then half a cosine from the peak to 0 at the last step.
    Cosine,
    /// Constant; the warm-up is ignored, as transformers' `constant` ignores it.
    Constant,
    /// Linear warm-up, then constant.
    ConstantWithWarmup,
}

/// A learning-rate schedule over a known number of optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Decay shape after warm-up.
    pub kind: ScheduleKind,
    /// Peak learning rate (reached at the end of warm-up).
    pub base_lr: f64,
    /// Steps of linear warm-up from 0.
    pub warmup_steps: usize,
    /// Total optimizer steps of the run.
    pub total_steps: usize,
}

impl LrSchedule {
    /// The schedule of `kind` peaking at `base_lr` over `total_steps` optimizer steps, with
    /// `warmup_steps` of warm-up (none for [`ScheduleKind::Constant`], as in transformers).
    pub fn new(kind: ScheduleKind, base_lr: f64, warmup_steps: usize, total_steps: usize) -> Self {
        let warmup_steps = if kind == ScheduleKind::Constant { 0 } else { warmup_steps };
        Self { kind, base_lr, warmup_steps, total_steps }
    }

    /// The multiplier λ(step) of the base learning rate, in `[0, 1]`.
    pub fn factor(&self, step: usize) -> f64 {
        let (step, warmup, total) = (step as f64, self.warmup_steps as f64, self.total_steps as f64);
        if step < warmup {
            // transformers: float(current_step) / float(max(1, num_warmup_steps))
            return step / warmup.max(1.0);
        }
        let decay_steps = (total - warmup).max(1.0);
        match self.kind {
            ScheduleKind::Constant | ScheduleKind::ConstantWithWarmup => 1.0,
            // transformers: max(0, (num_training_steps - current_step) / max(1, num_training_steps - num_warmup_steps))
            ScheduleKind::Linear => ((total - step) / decay_steps).max(0.0),
            // transformers: max(0, 0.5 * (1 + cos(pi * num_cycles * 2 * progress))), num_cycles = 0.5
            ScheduleKind::Cosine => {
                let progress = (step - warmup) / decay_steps;
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        }
    }

    /// The learning rate of optimizer step `step` (counting from 0).
    pub fn lr(&self, step: usize) -> f64 {
        self.base_lr * self.factor(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind) -> LrSchedule {
        LrSchedule { kind, base_lr: 1.0, warmup_steps: 2, total_steps: 10 }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    /// Values of transformers 4.46's lambdas for warm-up 2, total 10 (computed by hand from the
    /// formulas in `optimization.py`, which these functions copy).
    #[test]
    fn linear_matches_transformers() {
        let s = sched(ScheduleKind::Linear);
        let want = [0.0, 0.5, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0, 0.0];
        for (k, w) in want.iter().enumerate() {
            assert!(close(s.factor(k), *w), "step {k}: {} vs {w}", s.factor(k));
        }
    }

    #[test]
    fn cosine_matches_transformers() {
        let s = sched(ScheduleKind::Cosine);
        // progress = (k − 2) / 8; λ = 0.5 (1 + cos(π progress))
        let want = [(0, 0.0), (1, 0.5), (2, 1.0), (4, 0.853_553_390_593_273_8), (6, 0.5), (10, 0.0)];
        for (k, w) in want {
            assert!(close(s.factor(k), w), "step {k}: {} vs {w}", s.factor(k));
        }
        // Past the end the cosine rises again in transformers too, but stays in [0, 1].
        assert!((0.0..=1.0).contains(&s.factor(13)));
    }

    #[test]
    fn constant_and_no_warmup() {
        let s = sched(ScheduleKind::Constant);
        assert!(close(s.factor(1), 0.5) && close(s.factor(2), 1.0) && close(s.factor(9), 1.0));
        let s = LrSchedule { kind: ScheduleKind::Linear, base_lr: 3e-4, warmup_steps: 0, total_steps: 4 };
        assert!(close(s.lr(0), 3e-4) && close(s.lr(1), 2.25e-4) && close(s.lr(3), 0.75e-4));
    }

    #[test]
    fn kind_parses_transformers_names() {
        #[derive(Deserialize)]
        struct W {
            k: ScheduleKind,
        }
        let w: W = toml::from_str("k = \"constant_with_warmup\"").unwrap();
        assert_eq!(w.k, ScheduleKind::ConstantWithWarmup);
        let w: W = toml::from_str("k = \"constant\"").unwrap();
        assert_eq!(w.k, ScheduleKind::Constant);
        let w: W = toml::from_str("k = \"cosine\"").unwrap();
        assert_eq!(w.k, ScheduleKind::Cosine);
    }

    #[test]
    fn constant_ignores_the_warmup_and_constant_with_warmup_keeps_it() {
        let c = LrSchedule::new(ScheduleKind::Constant, 1.0, 5, 10);
        let w = LrSchedule::new(ScheduleKind::ConstantWithWarmup, 1.0, 5, 10);
        assert_eq!((c.warmup_steps, c.lr(0), c.lr(9)), (0, 1.0, 1.0));
        assert_eq!((w.warmup_steps, w.lr(0), w.lr(4), w.lr(5)), (5, 0.0, 0.8, 1.0));
        let lin = LrSchedule::new(ScheduleKind::Linear, 1.0, 5, 10);
        assert_eq!(lin.warmup_steps, 5);
    }
}
