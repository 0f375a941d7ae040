//! Entity-level F1 of BIO tag sequences, conlleval's exact-span rule.
//!
//! Tags are `O`, `B-TYPE` or `I-TYPE`. An entity is a maximal chunk `(type, start, end)`; a
//! predicted entity counts only when a gold entity has the same type, start and end (exact
//! match). Chunking follows conlleval (CoNLL-2000's `conlleval.pl`) and seqeval's default mode
//! (`seqeval.metrics.sequence_labeling.get_entities`, which copies conlleval's
//! `startOfChunk`/`endOfChunk`):
//! - `B-X` always starts a chunk;
//! - `I-X` continues the chunk before it when that chunk has type X, and otherwise **starts a
//!   new chunk** of type X: after `O`, at the start of the sequence, or after `B-Y`/`I-Y` with
//!   Y ≠ X. (seqeval's `mode="strict"` with `scheme=IOB2` instead drops such an entity; we follow
//!   the default, which is what conlleval and most NER papers report.)
//! - `O`, and a tag that is none of the three forms, end the chunk.
//!
//! Scores are micro-averaged over all entities of all sequences: precision = TP/(TP+FP),
//! recall = TP/(TP+FN), F1 = 2·TP/(2·TP+FP+FN), each 0 when its denominator is 0 (seqeval's
//! value, with a warning there). For a per-sequence reward, [`sequence_score`] gives 1 to a
//! sequence with no gold and no predicted entity (nothing to find, nothing invented).

use std::path::Path;

use crate::error::{Error, Result};

/// One entity: its type and its tokens `start..end`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct Entity {
    /// The type (the tag after `B-`/`I-`).
    pub kind: String,
    /// First token.
    pub start: usize,
    /// One past the last token.
    pub end: usize,
}

/// A tag's prefix and type: `('B', "person")`, `('O', "")`; anything else is `('O', "")`.
fn split_tag(tag: &str) -> (char, &str) {
    match tag.split_once('-') {
        Some(("B", t)) if !t.is_empty() => ('B', t),
        Some(("I", t)) if !t.is_empty() => ('I', t),
        _ => ('O', ""),
    }
}

/// The entities of a tag sequence (module docs for the rule), in order.
pub fn entities<S: AsRef<str>>(tags: &[S]) -> Vec<Entity> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize)> = None;
    for (i, tag) in tags.iter().enumerate() {
        let (prefix, kind) = split_tag(tag.as_ref());
        let continues = prefix == 'I' && open.as_ref().is_some_and(|(k, _)| k == kind);
        if continues {
            continue;
        }
        if let Some((k, start)) = open.take() {
            out.push(Entity { kind: k, start, end: i });
        }
        if prefix != 'O' {
            open = Some((kind.to_string(), i));
        }
    }
    if let Some((kind, start)) = open {
        out.push(Entity { kind, start, end: tags.len() });
    }
    out
}

/// Precision, recall and F1 with their counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Prf {
    /// Predicted entities that are gold entities.
    pub tp: usize,
    /// Predicted entities that are not.
    pub fp: usize,
    /// Gold entities not predicted.
    pub fn_: usize,
    /// TP / (TP + FP), 0 when nothing was predicted.
    pub precision: f64,
    /// TP / (TP + FN), 0 when there is no gold entity.
    pub recall: f64,
    /// 2·TP / (2·TP + FP + FN), 0 when all counts are 0.
    pub f1: f64,
}

impl Prf {
    /// The scores of the counts.
    pub fn of(tp: usize, fp: usize, fn_: usize) -> Self {
        let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        Self {
            tp,
            fp,
            fn_,
            precision: ratio(tp, tp + fp),
            recall: ratio(tp, tp + fn_),
            f1: ratio(2 * tp, 2 * tp + fp + fn_),
        }
    }
}

/// TP, FP, FN of one sequence: entities compared as sets (the sequences may differ in length;
/// a shorter prediction simply has fewer entities).
pub fn sequence_counts<S: AsRef<str>, T: AsRef<str>>(gold: &[S], pred: &[T]) -> (usize, usize, usize) {
    let g = entities(gold);
    let p = entities(pred);
    let tp = p.iter().filter(|e| g.contains(e)).count();
    (tp, p.len() - tp, g.len() - tp)
}

/// Micro-averaged entity scores over pairs of sequences (`gold[i]` with `pred[i]`; extra
/// sequences on either side are ignored: pass equal numbers).
pub fn entity_f1<S: AsRef<str>, T: AsRef<str>>(gold: &[Vec<S>], pred: &[Vec<T>]) -> Prf {
    let (mut tp, mut fp, mut fn_) = (0, 0, 0);
    for (g, p) in gold.iter().zip(pred) {
        let (a, b, c) = sequence_counts(g, p);
        tp += a;
        fp += b;
        fn_ += c;
    }
    Prf::of(tp, fp, fn_)
}

/// The per-sequence reward: the sequence's entity F1, and 1 when it has neither gold nor
/// predicted entities.
pub fn sequence_score<S: AsRef<str>, T: AsRef<str>>(gold: &[S], pred: &[T]) -> f64 {
    let (tp, fp, fn_) = sequence_counts(gold, pred);
    if tp + fp + fn_ == 0 {
        1.0
    } else {
        Prf::of(tp, fp, fn_).f1
    }
}

/// A tagged sequence: tokens and one tag per token.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tagged {
    /// The tokens.
    pub tokens: Vec<String>,
    /// Their tags (`O`, `B-TYPE`, `I-TYPE`).
    pub tags: Vec<String>,
}

/// Whether `tag` is `O`, `B-TYPE` or `I-TYPE` with a non-empty type.
pub fn is_bio_tag(tag: &str) -> bool {
    tag == "O" || split_tag(tag).0 != 'O'
}

/// Reads a CoNLL-style file: one `TOKEN<TAB>TAG` per line (or `TOKEN TAG`, split at the last
/// space when the line has no tab), sequences separated by blank (or whitespace-only) lines.
/// A malformed line is an error naming the file, the line and the fix.
pub fn read_conll(path: &Path) -> Result<Vec<Tagged>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_conll(&text, path)
}

/// [`read_conll`] of `text`, `path` naming it in errors.
pub fn parse_conll(text: &str, path: &Path) -> Result<Vec<Tagged>> {
    let mut out = Vec::new();
    let mut cur = Tagged { tokens: Vec::new(), tags: Vec::new() };
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            if !cur.tokens.is_empty() {
                out.push(std::mem::replace(&mut cur, Tagged { tokens: Vec::new(), tags: Vec::new() }));
            }
            continue;
        }
        let split = line.rsplit_once('\t').or_else(|| line.trim_end().rsplit_once(' '));
        let bad = |what: &str| Error::Data {
            path: path.to_path_buf(),
            line: Some(i + 1),
            msg: format!(
                "{what} in {line:?}; expected TOKEN<TAB>TAG with TAG `O`, `B-TYPE` or `I-TYPE` \
                     (fix or delete the line; sequences are separated by blank lines)"
            ),
        };
        let Some((token, tag)) = split else { return Err(bad("no tag")) };
        let (token, tag) = (token.trim(), tag.trim());
        if token.is_empty() {
            return Err(bad("no token"));
        }
        if !is_bio_tag(tag) {
            return Err(bad(&format!("tag {tag:?} is not BIO")));
        }
        cur.tokens.push(token.to_string());
        cur.tags.push(tag.to_string());
    }
    if !cur.tokens.is_empty() {
        out.push(cur);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(kind: &str, start: usize, end: usize) -> Entity {
        Entity { kind: kind.into(), start, end }
    }

    #[test]
    fn chunks_follow_conlleval() {
        assert_eq!(entities(&["B-PER", "I-PER", "O", "B-LOC"]), vec![e("PER", 0, 2), e("LOC", 3, 4)]);
        // B after B: two entities.
        assert_eq!(entities(&["B-PER", "B-PER"]), vec![e("PER", 0, 1), e("PER", 1, 2)]);
        // I- without a B-: a new chunk (conlleval, seqeval default mode).
        assert_eq!(entities(&["I-PER", "I-PER", "O"]), vec![e("PER", 0, 2)]);
        assert_eq!(entities(&["O", "I-LOC"]), vec![e("LOC", 1, 2)]);
        // I- of another type: ends the chunk and starts one.
        assert_eq!(entities(&["B-PER", "I-LOC", "I-LOC"]), vec![e("PER", 0, 1), e("LOC", 1, 3)]);
        // Not a BIO tag: treated as O.
        assert_eq!(entities(&["B-PER", "X", "I-PER"]), vec![e("PER", 0, 1), e("PER", 2, 3)]);
        assert!(entities::<&str>(&[]).is_empty());
    }

    #[test]
    fn exact_spans_only() {
        let gold = vec![vec!["B-PER", "I-PER", "O", "B-LOC", "I-LOC"]];
        // PER exact; LOC one token short: a FP and a FN.
        let pred = vec![vec!["B-PER", "I-PER", "O", "B-LOC", "O"]];
        let f = entity_f1(&gold, &pred);
        assert_eq!((f.tp, f.fp, f.fn_), (1, 1, 1));
        assert_eq!((f.precision, f.recall, f.f1), (0.5, 0.5, 0.5));
        // Right span, wrong type.
        let f = entity_f1(&[vec!["B-PER"]], &[vec!["B-LOC"]]);
        assert_eq!((f.tp, f.fp, f.fn_, f.f1), (0, 1, 1, 0.0));
    }

    #[test]
    fn micro_average_over_sequences() {
        // Sequence 1: 2 gold, 2 right. Sequence 2: 1 gold, predicted 2 wrong ones.
        let gold = vec![vec!["B-A", "O", "B-B"], vec!["B-A", "O", "O"]];
        let pred = vec![vec!["B-A", "O", "B-B"], vec!["O", "B-A", "B-B"]];
        let f = entity_f1(&gold, &pred);
        assert_eq!((f.tp, f.fp, f.fn_), (2, 2, 1));
        assert!((f.f1 - 4.0 / 7.0).abs() < 1e-12);
        assert!((f.precision - 0.5).abs() < 1e-12 && (f.recall - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn duplicates_empty_predictions_and_empty_gold() {
        // Duplicate predictions cannot happen within one sequence (entities are disjoint), but
        // the same sequence predicted twice is counted twice.
        let f = entity_f1(&[vec!["B-A"], vec!["B-A"]], &[vec!["B-A"], vec!["B-A"]]);
        assert_eq!((f.tp, f.fp, f.fn_), (2, 0, 0));
        // Empty predictions: recall 0, F1 0.
        let f = entity_f1(&[vec!["B-A", "I-A"]], &[vec!["O", "O"]]);
        assert_eq!((f.tp, f.fp, f.fn_, f.precision, f.f1), (0, 0, 1, 0.0, 0.0));
        // Empty gold: every prediction a FP.
        let f = entity_f1(&[vec!["O"]], &[vec!["B-A"]]);
        assert_eq!((f.tp, f.fp, f.fn_, f.recall, f.f1), (0, 1, 0, 0.0, 0.0));
        // Neither: seqeval's 0 for the corpus, 1 as a per-sequence reward.
        assert_eq!(entity_f1(&[vec!["O"]], &[vec!["O"]]).f1, 0.0);
        assert_eq!(sequence_score(&["O"], &["O"]), 1.0);
        assert_eq!(sequence_score(&["B-A", "O"], &["B-A", "B-A"]), 2.0 / 3.0);
    }

    #[test]
    fn conll_files_parse_and_bad_rows_name_the_line() {
        let p = Path::new("ner.txt");
        let text = "@paul\tO\nEmpire\tB-facility\nState\tI-facility\n\t\nFrom\tO\n\nSage B-other\n";
        let seqs = parse_conll(text, p).unwrap();
        assert_eq!(seqs.len(), 3);
        assert_eq!(seqs[0].tags, vec!["O", "B-facility", "I-facility"]);
        assert_eq!(seqs[2].tokens, vec!["Sage"]);
        let e = parse_conll("a\tO\nb\tB-\n", p).unwrap_err().to_string();
        assert!(e.starts_with("ner.txt:2: tag \"B-\" is not BIO"), "{e}");
        let e = parse_conll("a\tO\n\nnotag\n", p).unwrap_err().to_string();
        assert!(e.contains("ner.txt:3: no tag") && e.contains("fix or delete"), "{e}");
        let e = parse_conll("\tO\n", p).unwrap_err().to_string();
        assert!(e.contains("ner.txt:1: no token"), "{e}");
    }
}
