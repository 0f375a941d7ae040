//! The BIO constraint as admissible actions: which tag may follow which, as an additive mask on
//! a tagger's logits, and sampling or greedy picks under it.
//!
//! `O` and every `B-X` may follow anything; `I-X` only `B-X` or `I-X`. A policy that picks tag
//! `a_w` for word `w` from `softmax(logits_w + mask(a_{w−1}))` puts probability exactly 0 on the
//! tags the constraint forbids (the mask is [`FORBIDDEN`], whose exponential is 0 in f32), so its
//! log-probabilities are those of the constrained distribution, not of a renormalized guess.

use rand::Rng;

use crate::error::{Error, Result};

/// The additive mask of a forbidden tag: `exp(FORBIDDEN + logit)` is exactly 0 in f32 for any
/// logit below 1e4, and `FORBIDDEN − logsumexp` stays finite (so `p · log p` is `0 · x = 0`).
pub const FORBIDDEN: f32 = -1.0e4;

/// A tag set under the BIO constraint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bio {
    tags: Vec<String>,
    /// `follows[prev + 1][tag]`: whether `tag` may follow `prev` (row 0: the first word).
    follows: Vec<Vec<bool>>,
}

impl Bio {
    /// The constraint over `tags`: each `O`, `B-X` or `I-X`, with `O` among them and a `B-X` for
    /// every `I-X`.
    pub fn new(tags: &[String]) -> Result<Self> {
        let bad = |msg: String| Error::argument("tags", format!("tag set {tags:?}: {msg}"));
        if !tags.iter().any(|t| t == "O") {
            return Err(bad("has no \"O\"; a BIO tag set needs it for words outside every entity".into()));
        }
        for t in tags {
            match t.split_once('-') {
                Some(("B", k)) | Some(("I", k)) if !k.is_empty() => {
                    if t.starts_with("I-") && !tags.iter().any(|b| b == &format!("B-{k}")) {
                        return Err(bad(format!("{t:?} has no \"B-{k}\" to begin its entities")));
                    }
                }
                _ if t == "O" => {}
                _ => return Err(bad(format!("{t:?} is not O, B-TYPE or I-TYPE"))),
            }
        }
        let kind = |t: &str| t.split_once('-').map(|(_, k)| k.to_string());
        let follows = std::iter::once(None)
            .chain(tags.iter().map(Some))
            .map(|prev| {
                tags.iter()
                    .map(|t| match t.strip_prefix("I-") {
                        None => true,
                        Some(k) => prev.is_some_and(|p| p != "O" && kind(p).as_deref() == Some(k)),
                    })
                    .collect()
            })
            .collect();
        Ok(Self { tags: tags.to_vec(), follows })
    }

    /// The tags by index.
    pub fn tags(&self) -> &[String] {
        &self.tags
    }

    /// The index of `tag`.
    pub fn index(&self, tag: &str) -> Option<usize> {
        self.tags.iter().position(|t| t == tag)
    }

    /// Whether `tag` may follow `prev` (`None`: the first word).
    pub fn allowed(&self, prev: Option<usize>, tag: usize) -> bool {
        self.follows[prev.map_or(0, |p| p + 1)][tag]
    }

    /// `tags` as indices, each `I-X` that may not follow its predecessor turned into `B-X`: the
    /// same entities under conlleval's rule (an `I-X` after `O` begins an entity).
    pub fn valid_indices<S: AsRef<str>>(&self, tags: &[S]) -> Result<Vec<u32>> {
        let mut out: Vec<u32> = Vec::with_capacity(tags.len());
        for t in tags {
            let t = t.as_ref();
            let i = self.index(t).ok_or_else(|| {
                Error::argument("tags", format!("tag {t:?} is not in the tagger's tag set {:?}", self.tags))
            })?;
            let prev = out.last().map(|&p| p as usize);
            let i = if self.allowed(prev, i) {
                i
            } else {
                let begin = format!("B-{}", &t[2..]);
                self.index(&begin).unwrap_or_else(|| unreachable!("Bio::new checked {begin}"))
            };
            out.push(i as u32);
        }
        Ok(out)
    }

    /// The additive masks `(B, W, L)` flattened: row `b`, word `w < seqs[b].len()` masks the tags
    /// that may not follow `seqs[b][w − 1]`; words past a row's end are left unmasked.
    pub fn masks(&self, seqs: &[&[u32]], width: usize) -> Vec<f32> {
        let l = self.tags.len();
        let mut out = vec![0f32; seqs.len() * width * l];
        for (b, seq) in seqs.iter().enumerate() {
            for w in 0..seq.len().min(width) {
                let prev = (w > 0).then(|| seq[w - 1] as usize);
                let row = &mut out[(b * width + w) * l..][..l];
                for (t, m) in row.iter_mut().enumerate() {
                    if !self.allowed(prev, t) {
                        *m = FORBIDDEN;
                    }
                }
            }
        }
        out
    }

    /// The allowed tag after `prev` with the largest of `row`'s logits (`L` of them), the first
    /// of equals.
    pub fn best(&self, row: &[f32], prev: Option<usize>) -> usize {
        (0..self.tags.len())
            .filter(|&t| self.allowed(prev, t))
            .fold(None::<usize>, |b, t| match b {
                Some(b) if row[b] >= row[t] => Some(b),
                _ => Some(t),
            })
            .unwrap_or_else(|| unreachable!("O is always allowed"))
    }

    /// Picks word tags left to right from `logits` (`words` rows of `L`): the most probable
    /// allowed tag when `temperature` is 0, else a draw from the allowed tags' softmax of
    /// `logits / temperature` with `rng`.
    pub fn pick(&self, logits: &[f32], words: usize, temperature: f64, rng: &mut impl Rng) -> Vec<u32> {
        let l = self.tags.len();
        let mut seq: Vec<u32> = Vec::with_capacity(words);
        let mut weights = vec![0f64; l];
        for w in 0..words {
            let row = &logits[w * l..][..l];
            let prev = seq.last().map(|&p| p as usize);
            let allowed = |t: usize| self.allowed(prev, t);
            let best = self.best(row, prev);
            let tag = if temperature <= 0.0 {
                best
            } else {
                let max = f64::from(row[best]);
                for (t, x) in weights.iter_mut().enumerate() {
                    *x = if allowed(t) { ((f64::from(row[t]) - max) / temperature).exp() } else { 0.0 };
                }
                let mut u = rng.gen::<f64>() * weights.iter().sum::<f64>();
                let mut pick = best;
                for (t, &x) in weights.iter().enumerate() {
                    if x > 0.0 {
                        pick = t;
                        if u < x {
                            break;
                        }
                        u -= x;
                    }
                }
                pick
            };
            seq.push(tag as u32);
        }
        seq
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn tags() -> Vec<String> {
        ["O", "B-loc", "B-person", "I-loc", "I-person"].map(String::from).to_vec()
    }

    #[test]
    fn inside_tags_follow_only_their_own_entity() {
        let bio = Bio::new(&tags()).unwrap();
        let (o, bl, bp, il, ip) = (0, 1, 2, 3, 4);
        for t in [o, bl, bp] {
            assert!(bio.allowed(None, t) && bio.allowed(Some(ip), t));
        }
        assert!(!bio.allowed(None, il) && !bio.allowed(Some(o), il) && !bio.allowed(Some(bp), il));
        assert!(bio.allowed(Some(bl), il) && bio.allowed(Some(il), il) && bio.allowed(Some(ip), ip));
        assert_eq!(
            bio.valid_indices(&["I-loc", "I-loc", "O", "I-person"]).unwrap(),
            [bl, il, o, bp].map(|x| x as u32)
        );
        assert!(Bio::new(&["O".into(), "I-x".into()]).unwrap_err().to_string().contains("B-x"));
        assert!(Bio::new(&["B-x".into()]).unwrap_err().to_string().contains("\"O\""));
        assert!(bio.valid_indices(&["B-org"]).unwrap_err().to_string().contains("B-org"));
    }

    #[test]
    fn picks_never_break_the_constraint_and_follow_the_softmax() {
        let bio = Bio::new(&tags()).unwrap();
        // Every word prefers I-person; the first may not have it.
        let logits: Vec<f32> = (0..3).flat_map(|_| [0.0, 0.0, 0.0, 0.0, 5.0]).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        assert_eq!(bio.pick(&logits, 3, 0.0, &mut rng), [0, 0, 0], "greedy: ties go to the first tag");
        let (mut first, n) = ([0usize; 5], 4000);
        for _ in 0..n {
            let s = bio.pick(&logits, 3, 1.0, &mut rng);
            for w in 1..3 {
                assert!(bio.allowed(Some(s[w - 1] as usize), s[w] as usize), "{s:?}");
            }
            first[s[0] as usize] += 1;
        }
        // The first word: O, B-loc, B-person equally likely, inside tags never.
        assert_eq!((first[3], first[4]), (0, 0));
        for c in &first[..3] {
            assert!((*c as f64 / n as f64 - 1.0 / 3.0).abs() < 0.03, "{first:?}");
        }
        // The best allowed tag, whatever the tag order: a forbidden tag first with the largest
        // logit is passed over.
        let odd = Bio::new(&["I-loc", "O", "B-loc"].map(String::from)).unwrap();
        assert_eq!(odd.best(&[5.0, 0.0, 1.0], None), 2);
        assert_eq!(odd.best(&[5.0, 0.0, 1.0], Some(2)), 0);
        assert_eq!(odd.best(&[0.0, 1.0, 1.0], None), 1, "ties: the first");
        let masks = bio.masks(&[&[2, 4]], 3);
        assert_eq!(&masks[..5], &[0.0, 0.0, 0.0, FORBIDDEN, FORBIDDEN]);
        assert_eq!(&masks[5..10], &[0.0, 0.0, 0.0, FORBIDDEN, 0.0]);
        assert_eq!(&masks[10..], &[0.0; 5]);
    }
}
