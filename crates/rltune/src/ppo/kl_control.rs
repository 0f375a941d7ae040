//! KL coefficient controllers.
//!
//! TRL `trainer/utils.py::AdaptiveKLController` and `FixedKLController`, from Ziegler et al.
//! (2019), "Fine-Tuning Language Models from Human Preferences", section 2.2.

/// Chooses the KL coefficient β of the reward `score − β·KL`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum KlController {
    /// β never changes.
    Fixed {
        /// β
        value: f64,
    },
    /// β moves so the observed KL approaches `target` over `horizon` samples.
    Adaptive {
        /// β
        value: f64,
        /// Target KL per sequence.
        target: f64,
        /// Samples over which the error is corrected.
        horizon: f64,
    },
}

impl KlController {
    /// The current coefficient β.
    pub fn value(&self) -> f64 {
        match self {
            Self::Fixed { value } | Self::Adaptive { value, .. } => *value,
        }
    }

    /// Updates β after a batch with mean KL `current` over `n_steps` samples.
    ///
    /// Adaptive: `e = clip(current/target − 1, −0.2, 0.2)`, `β ← β·(1 + e·n_steps/horizon)`.
    pub fn update(&mut self, current: f64, n_steps: usize) {
        if let Self::Adaptive { value, target, horizon } = self {
            let err = (current / *target - 1.0).clamp(-0.2, 0.2);
            *value *= 1.0 + err * n_steps as f64 / *horizon;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_moves_toward_target_and_fixed_stays() {
        let mut c = KlController::Adaptive { value: 0.2, target: 6.0, horizon: 10000.0 };
        c.update(0.0, 4);
        // TRL fixture: 0.2 → 0.19998399913311005 (TRL stores it in f32).
        assert!((c.value() - 0.199984).abs() < 1e-12);
        c.update(100.0, 10000);
        assert!((c.value() - 0.199984 * 1.2).abs() < 1e-12);
        let mut f = KlController::Fixed { value: 0.3 };
        f.update(100.0, 64);
        assert_eq!(f.value(), 0.3);
    }
}
