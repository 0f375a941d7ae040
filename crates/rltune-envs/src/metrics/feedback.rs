//! The Feedback Prize overlap F-score (Kaggle, "Feedback Prize – Evaluating Student Writing",
//! 2021–22): discourse elements of an essay, each a class and a set of word indices.
//!
//! The competition's rule, as its reference implementation (`score_feedback_comp` of the
//! competition's "Evaluation" notebook) computes it:
//! 1. predictions and ground truths of the same essay and the same class are compared;
//! 2. a prediction is a *potential match* of a ground truth when their overlap (words in both)
//!    is at least half of the ground truth's words **and** at least half of the prediction's
//!    words;
//! 3. each ground truth with a potential match counts one true positive, matched to the
//!    prediction with the largest `max(overlap/len(gold), overlap/len(pred))` (ties: the earliest
//!    prediction; the reference's sort is unstable there); every prediction that is not the
//!    match of some ground truth is a false positive (so of several predictions matching one
//!    ground truth, one is TP and the rest FP); every ground truth without a potential match is
//!    a false negative;
//! 4. per class, over the whole data set, F1 = TP / (TP + ½(FP + FN));
//! 5. the score is the mean of the per-class F1 over the classes that occur in the ground truth
//!    (the reference groups by the ground truth's `discourse_type`: predictions of a class with
//!    no ground truth anywhere are not scored).
//!
//! [`feedback_score`] computes exactly this over a set of essays. For a **per-essay reward**
//! ([`essay_score`]) step 5 needs a rule, because most essays lack several classes:
//! - the mean runs over the classes that occur in the essay's ground truth **or** its
//!   predictions: a class with neither is left out (it says nothing about this essay; counting
//!   it as 1 would add a constant to every essay and dilute the signal);
//! - a class predicted but absent from the ground truth scores 0 (TP = 0, FP > 0): unlike step
//!   5, an invented element is penalised, otherwise a reward-maximiser could predict spurious
//!   classes for free;
//! - an essay with no ground truth and no predictions scores 1.
//!
//! Both treat a span as a set: repeated word indices count once, and a span with no words is
//! ignored (the reference has no empty prediction strings).

use std::collections::BTreeMap;

/// The seven discourse classes of the Feedback Prize, in the competition's order.
pub const CLASSES: [&str; 7] =
    ["Lead", "Position", "Claim", "Counterclaim", "Rebuttal", "Evidence", "Concluding Statement"];

/// One discourse element: its class (an index, e.g. into [`CLASSES`]) and its words (indices
/// into the essay's whitespace-split words).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Span {
    /// The class.
    pub class: usize,
    /// The word indices (any order; repeats count once).
    pub words: Vec<usize>,
}

impl Span {
    /// A span of `class` over the words `range`.
    pub fn new(class: usize, range: std::ops::Range<usize>) -> Self {
        Self { class, words: range.collect() }
    }
}

/// True positives, false positives and false negatives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counts {
    /// Ground truths matched.
    pub tp: usize,
    /// Predictions that are no ground truth's match.
    pub fp: usize,
    /// Ground truths not matched.
    pub fn_: usize,
}

impl Counts {
    /// TP / (TP + ½(FP + FN)); `None` when all three are 0 (nothing to score).
    pub fn f1(&self) -> Option<f64> {
        let denom = self.tp as f64 + 0.5 * (self.fp + self.fn_) as f64;
        (denom > 0.0).then(|| self.tp as f64 / denom)
    }

    fn add(&mut self, o: Counts) {
        self.tp += o.tp;
        self.fp += o.fp;
        self.fn_ += o.fn_;
    }
}

/// Sorted, deduplicated words of a span.
fn word_set(words: &[usize]) -> Vec<usize> {
    let mut w = words.to_vec();
    w.sort_unstable();
    w.dedup();
    w
}

/// |a ∩ b| of two sorted, deduplicated lists.
fn intersection(a: &[usize], b: &[usize]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// The counts of one essay and one class: `pred` and `gold` are the word sets of that class's
/// predicted and ground-truth spans (empty sets are ignored).
pub fn match_spans(pred: &[Vec<usize>], gold: &[Vec<usize>]) -> Counts {
    let pred: Vec<Vec<usize>> = pred.iter().map(|p| word_set(p)).filter(|p| !p.is_empty()).collect();
    let gold: Vec<Vec<usize>> = gold.iter().map(|g| word_set(g)).filter(|g| !g.is_empty()).collect();
    let mut chosen = vec![false; pred.len()];
    let mut c = Counts::default();
    for g in &gold {
        // The potential matches, and the best by max(overlap/len(g), overlap/len(p)).
        let mut best: Option<(usize, f64)> = None;
        for (k, p) in pred.iter().enumerate() {
            let inter = intersection(g, p);
            // overlap/len ≥ 0.5, exactly, in integers (the reference divides floats; the two
            // agree for any length below 2^52)
            if 2 * inter >= g.len() && 2 * inter >= p.len() {
                let score = (inter as f64 / g.len() as f64).max(inter as f64 / p.len() as f64);
                if best.is_none_or(|(_, s)| score > s) {
                    best = Some((k, score));
                }
            }
        }
        match best {
            Some((k, _)) => {
                c.tp += 1;
                chosen[k] = true;
            }
            None => c.fn_ += 1,
        }
    }
    c.fp = chosen.iter().filter(|&&x| !x).count();
    c
}

/// Per-class counts of one essay, for every class that occurs in `pred` or `gold`.
pub fn essay_counts(pred: &[Span], gold: &[Span]) -> BTreeMap<usize, Counts> {
    let mut classes: Vec<usize> = pred.iter().chain(gold).map(|s| s.class).collect();
    classes.sort_unstable();
    classes.dedup();
    classes
        .into_iter()
        .map(|class| {
            let of = |spans: &[Span]| -> Vec<Vec<usize>> {
                spans.iter().filter(|s| s.class == class).map(|s| s.words.clone()).collect()
            };
            (class, match_spans(&of(pred), &of(gold)))
        })
        .filter(|(_, c)| c.tp + c.fp + c.fn_ > 0)
        .collect()
}

/// The per-essay reward (see the module docs for the rule): the mean F1 over the classes in
/// `gold` or `pred`, a predicted class absent from `gold` scoring 0; 1 when both are empty.
pub fn essay_score(pred: &[Span], gold: &[Span]) -> f64 {
    let counts = essay_counts(pred, gold);
    if counts.is_empty() {
        return 1.0;
    }
    counts.values().map(|c| c.f1().unwrap_or(0.0)).sum::<f64>() / counts.len() as f64
}

/// The competition's score over a data set.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FeedbackScore {
    /// Per class that occurs in the ground truth: its counts over all essays and its F1.
    pub per_class: Vec<(usize, Counts, f64)>,
    /// The mean of the per-class F1 (NaN when no essay has a ground truth).
    pub macro_f1: f64,
}

/// The competition's score over `essays`, each `(pred, gold)`: counts per class summed over the
/// essays, F1 per class, the mean over the classes present in the ground truth (step 5 of the
/// module docs: predictions of other classes are not scored).
pub fn feedback_score(essays: &[(Vec<Span>, Vec<Span>)]) -> FeedbackScore {
    let mut total: BTreeMap<usize, Counts> = BTreeMap::new();
    let mut gold_classes: Vec<usize> = Vec::new();
    for (pred, gold) in essays {
        gold_classes.extend(gold.iter().filter(|s| !s.words.is_empty()).map(|s| s.class));
        for (class, c) in essay_counts(pred, gold) {
            total.entry(class).or_default().add(c);
        }
    }
    gold_classes.sort_unstable();
    gold_classes.dedup();
    let per_class: Vec<(usize, Counts, f64)> = gold_classes
        .into_iter()
        .map(|class| {
            let c = total.get(&class).copied().unwrap_or_default();
            (class, c, c.f1().unwrap_or(0.0))
        })
        .collect();
    let macro_f1 = if per_class.is_empty() {
        f64::NAN
    } else {
        per_class.iter().map(|p| p.2).sum::<f64>() / per_class.len() as f64
    };
    FeedbackScore { per_class, macro_f1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(r: std::ops::Range<usize>) -> Vec<usize> {
        r.collect()
    }

    #[test]
    fn overlap_at_049_050_051_of_the_gold() {
        // Gold: 100 words 0..100. A prediction inside it covering k words has
        // overlap/len(pred) = 1, overlap/len(gold) = k/100.
        let gold = vec![words(0..100)];
        let c49 = match_spans(&[words(0..49)], &gold);
        assert_eq!((c49.tp, c49.fp, c49.fn_), (0, 1, 1), "0.49 of the gold is no match");
        let c50 = match_spans(&[words(0..50)], &gold);
        assert_eq!((c50.tp, c50.fp, c50.fn_), (1, 0, 0), "exactly 0.5 matches");
        let c51 = match_spans(&[words(0..51)], &gold);
        assert_eq!((c51.tp, c51.fp, c51.fn_), (1, 0, 0));
    }

    #[test]
    fn overlap_at_049_050_051_of_the_prediction() {
        // Prediction 0..100 over gold 0..k: overlap/len(gold) = 1, overlap/len(pred) = k/100.
        let pred = vec![words(0..100)];
        assert_eq!(match_spans(&pred, &[words(0..49)]).tp, 0);
        assert_eq!(match_spans(&pred, &[words(0..50)]).tp, 1);
        assert_eq!(match_spans(&pred, &[words(0..51)]).tp, 1);
        // Both sides at 0.5: gold 0..4, pred 2..6 overlap 2 of 4 each way.
        assert_eq!(match_spans(&[words(2..6)], &[words(0..4)]).tp, 1);
        // 2 of 4 and 2 of 5: the prediction side is 0.4.
        assert_eq!(match_spans(&[words(2..7)], &[words(0..4)]), Counts { tp: 0, fp: 1, fn_: 1 });
    }

    #[test]
    fn duplicate_predictions_are_one_tp_and_the_rest_fp() {
        let gold = vec![words(0..10)];
        let pred = vec![words(0..10), words(0..10), words(1..10)];
        assert_eq!(match_spans(&pred, &gold), Counts { tp: 1, fp: 2, fn_: 0 });
        // F1 = 1 / (1 + ½·2) = 0.5
        assert_eq!(
            essay_score(&[Span::new(2, 0..10), Span::new(2, 0..10)], &[Span::new(2, 0..10)]),
            1.0 / 1.5
        );
        // Repeated word indices inside one span count once.
        let rep = vec![vec![0, 0, 1, 1, 2, 3]];
        assert_eq!(match_spans(&rep, &[words(0..8)]).tp, 1, "4 distinct words of 8 is 0.5");
    }

    #[test]
    fn the_best_overlap_is_the_match_when_several_predictions_qualify() {
        // Both predictions match gold 0..10; the exact one is chosen, the other is a FP.
        let c = match_spans(&[words(0..6), words(0..10)], &[words(0..10)]);
        assert_eq!(c, Counts { tp: 1, fp: 1, fn_: 0 });
        // A prediction can be chosen by two golds only when it is exactly half of each:
        // 10/20 of the prediction and 10/10 of each gold. The reference then counts two true
        // positives and no false positive.
        let golds = vec![words(0..10), words(10..20)];
        assert_eq!(match_spans(&[words(0..20)], &golds), Counts { tp: 2, fp: 0, fn_: 0 });
    }

    #[test]
    fn empty_predictions_and_empty_gold() {
        let gold = vec![Span::new(0, 0..5), Span::new(2, 5..9)];
        // No predictions: every gold is a FN, every class present scores 0.
        assert_eq!(essay_score(&[], &gold), 0.0);
        // No gold: every prediction's class scores 0.
        assert_eq!(essay_score(&gold, &[]), 0.0);
        // Neither: nothing went wrong.
        assert_eq!(essay_score(&[], &[]), 1.0);
        // Empty word lists are ignored on both sides.
        assert_eq!(essay_score(&[Span { class: 3, words: vec![] }], &[]), 1.0);
        let ds = feedback_score(&[(vec![], vec![])]);
        assert!(ds.macro_f1.is_nan() && ds.per_class.is_empty());
    }

    #[test]
    fn per_essay_mean_runs_over_classes_in_gold_or_predictions() {
        let gold = vec![Span::new(0, 0..5), Span::new(2, 5..9)];
        // Lead right, Claim right, an invented Rebuttal: (1 + 1 + 0) / 3.
        let pred = vec![Span::new(0, 0..5), Span::new(2, 5..9), Span::new(4, 9..12)];
        assert!((essay_score(&pred, &gold) - 2.0 / 3.0).abs() < 1e-12);
        // The same essay over the data set: the Rebuttal has no gold and is not scored.
        assert_eq!(feedback_score(&[(pred, gold)]).macro_f1, 1.0);
    }

    #[test]
    fn data_set_score_sums_counts_per_class_before_f1() {
        // Essay A: Claim 1 TP. Essay B: Claim 1 FN, Evidence 1 TP + 1 FP.
        let a = (vec![Span::new(2, 0..4)], vec![Span::new(2, 0..4)]);
        let b = (
            vec![Span::new(5, 0..10), Span::new(5, 20..30)],
            vec![Span::new(2, 10..14), Span::new(5, 0..10)],
        );
        let s = feedback_score(&[a, b]);
        // Claim: TP 1, FN 1 → 1/1.5; Evidence: TP 1, FP 1 → 1/1.5.
        assert_eq!(s.per_class.len(), 2);
        assert_eq!(s.per_class[0].1, Counts { tp: 1, fp: 0, fn_: 1 });
        assert_eq!(s.per_class[1].1, Counts { tp: 1, fp: 1, fn_: 0 });
        assert!((s.macro_f1 - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn classes_never_match_across() {
        let c = essay_counts(&[Span::new(1, 0..5)], &[Span::new(2, 0..5)]);
        assert_eq!(c[&1], Counts { tp: 0, fp: 1, fn_: 0 });
        assert_eq!(c[&2], Counts { tp: 0, fp: 0, fn_: 1 });
    }
}
