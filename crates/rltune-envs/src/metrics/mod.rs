//! Task metrics as rewards: the scores a task is judged by, computed exactly, so RL can train
//! on them (issue #41, "RL on a task's own metric").
//!
//! - [`feedback`]: the overlap F-score of Kaggle's "Feedback Prize – Evaluating Student Writing"
//!   (discourse elements of essays as sets of word indices), over a data set
//!   ([`feedback::feedback_score`], the competition's rule) and per essay
//!   ([`feedback::essay_score`], the reward).
//! - [`bio`]: entity-level precision, recall and F1 of BIO tag sequences with conlleval's and
//!   seqeval's (default mode) chunking ([`bio::entities`], [`bio::entity_f1`]), and a reader
//!   for CoNLL-style two-column files ([`bio::read_conll`]).
//! - [`mean_se`]: a mean with its standard error, for reporting per-document scores.
//!
//! ```
//! use rltune_envs::metrics::bio::{entities, entity_f1};
//!
//! let gold = vec!["B-person", "I-person", "O", "B-geo-loc"];
//! let pred = vec!["B-person", "I-person", "O", "O"];
//! assert_eq!(entities(&gold).len(), 2);
//! let f = entity_f1(&[gold], &[pred]);
//! assert_eq!((f.tp, f.fp, f.fn_), (1, 0, 1));
//! assert!((f.f1 - 2.0 / 3.0).abs() < 1e-12);
//! ```

pub mod bio;
pub mod feedback;

/// The mean of `xs` and its standard error `s / √n` (`s` the sample standard deviation, n − 1
/// in the denominator); `(NaN, NaN)` for no values, `(x, 0)` for one.
pub fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, (var / n as f64).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error_by_hand() {
        // mean 2, sample variance ((1)^2 + 0 + 1^2) / 2 = 1, SE = 1/√3
        let (m, se) = mean_se(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((se - 1.0 / 3f64.sqrt()).abs() < 1e-12);
        assert_eq!(mean_se(&[5.0]), (5.0, 0.0));
        assert!(mean_se(&[]).0.is_nan());
    }
}
