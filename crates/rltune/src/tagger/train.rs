//! Training a [`Tagger`]: imitation of the gold tags, then reinforcement on entity F1, both on
//! the supervised loop ([`crate::train::runner`]: its shuffles, Adam, clipping, schedule,
//! checkpoints and bitwise `--resume`), and decoding for evaluation.
//!
//! **Imitation** ([`train_imitation`]) minimizes `−log π(gold tags)`, the constrained
//! log-likelihood of each sentence's gold sequence (teacher-forced: word `w`'s mask follows the
//! gold tag of word `w − 1`), summed over the covered words and averaged over them.
//!
//! **Reinforcement** ([`train_rl`]) is REINFORCE with a leave-one-out baseline (RLOO, Ahmadian
//! et al. 2024; or the greedy tags' reward, [`Baseline::Greedy`]) and an exact KL penalty in the
//! loss. For each sentence of a step it draws
//! `samples_per_sentence` tag sequences from the policy, scores each with
//! [`reward`] = `TP − ½(FP + FN)` (the sentence's part of micro-F1's numerator less the
//! errors: predicting nothing on a sentence with entities costs `½·FN`, and on one without is
//! worth 0, not 1), and minimizes, per sentence,
//!
//! `(1/k) Σ_j [ −(r_j − mean_{i≠j} r_i) · log π(a_j) + β · Σ_w KL(π(·|x, a_j,<w) ‖ π_ref(·|x, a_j,<w)) ]`
//!
//! The KL to the reference (the imitation policy, frozen) is computed over the constrained tag
//! distribution at every word of every sample, not estimated from the sampled tag: with 21 tags
//! it is one sum. Sample `j` of sentence `i` at optimizer step `s` draws from the stream
//! `mix(seed, s, i, j)`, so a resumed run draws what an uninterrupted one drew.
//!
//! **Decoding** ([`predict`]): greedy (the most probable allowed tag, left to right) or sampled
//! at a temperature; sentence `i` draws from the stream `mix(seed, i)`, so a score does not
//! depend on the batch size.

use std::cell::{Cell, RefCell};

use candle_core::{Tensor, D};
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::{Bio, Encoded, Tagger};
use crate::dist::Dist;
use crate::envs::play::mix_seeds;
use crate::error::{ConfigError, Error, Result};
use crate::ops;
use crate::rewards::metrics::bio::{sequence_counts, Tagged};
use crate::train::runner::{self, BatchLoss, Objective};
use crate::train::{Checkpointing, TrainProgress, TrainSummary, TrainingArgs};

/// A sentence ready for the tagger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagExample {
    /// Its index in its split: the key of its random streams.
    pub index: usize,
    /// Its word pieces.
    pub encoded: Encoded,
    /// Its gold tags, one per word.
    pub gold: Vec<String>,
    /// The covered words' gold tags as indices, each `I-X` that may not follow its predecessor
    /// made `B-X` ([`Bio::valid_indices`]).
    pub gold_ids: Vec<u32>,
}

/// `sentences` encoded for `tagger`, indexed in order.
pub fn examples(tagger: &Tagger, sentences: &[Tagged]) -> Result<Vec<TagExample>> {
    sentences
        .iter()
        .enumerate()
        .map(|(index, s)| {
            let encoded = tagger.encode(&s.tokens)?;
            let mut gold_ids = tagger.bio().valid_indices(&s.tags).map_err(|e| {
                let words = s.tokens.iter().take(5).cloned().collect::<Vec<_>>().join(" ");
                Error::data(format!("sentence {index} ({words}…)"), e)
            })?;
            gold_ids.truncate(encoded.first.len());
            Ok(TagExample { index, encoded, gold: s.tags.clone(), gold_ids })
        })
        .collect()
}

/// A sentence's reward for predicted tags: `TP − ½(FP + FN)` over its entities (conlleval's
/// exact-span rule).
pub fn reward<S: AsRef<str>, T: AsRef<str>>(gold: &[S], pred: &[T]) -> f64 {
    let (tp, fp, fn_) = sequence_counts(gold, pred);
    tp as f64 - 0.5 * (fp + fn_) as f64
}

/// The constrained log-probability of each row's tag sequence `(B)` under `logits (B, W, L)`,
/// and with `reference` (same shape) the sum over the sequence's words of `KL(π ‖ π_ref)` at
/// each word's prefix `(B)`.
fn sequence_terms(
    bio: &Bio,
    logits: &Tensor,
    reference: Option<&Tensor>,
    seqs: &[&[u32]],
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, w, l) = logits.dims3()?;
    let dev = logits.device();
    let mask = Tensor::from_vec(bio.masks(seqs, w), (b, w, l), dev)?;
    let (mut targets, mut valid) = (vec![0u32; b * w], vec![0f32; b * w]);
    for (r, s) in seqs.iter().enumerate() {
        for (i, &t) in s.iter().enumerate().take(w) {
            (targets[r * w + i], valid[r * w + i]) = (t, 1.0);
        }
    }
    let valid = Tensor::from_vec(valid, (b, w), dev)?;
    let lp = ops::log_softmax_last_dim(&(logits + &mask)?)?;
    let chosen = lp.gather(&Tensor::from_vec(targets, (b, w, 1), dev)?, D::Minus1)?.squeeze(D::Minus1)?;
    let logp = (chosen * &valid)?.sum(1)?;
    let kl = match reference {
        Some(r) => {
            let lq = ops::log_softmax_last_dim(&(r + &mask)?)?;
            Some(((lp.exp()? * (&lp - &lq)?)?.sum(D::Minus1)? * &valid)?.sum(1)?)
        }
        None => None,
    };
    Ok((logp, kl))
}

/// Imitation: the gold sequences' negative constrained log-likelihood.
struct Imitation<'a>(&'a Tagger);

impl Objective for Imitation<'_> {
    type Example = TagExample;
    const PERPLEXITY: bool = false;

    fn terms(&self, ex: &TagExample) -> usize {
        ex.gold_ids.len()
    }

    fn batch_loss(&self, batch: &[&TagExample], count_correct: bool) -> Result<BatchLoss> {
        let encoded: Vec<&Encoded> = batch.iter().map(|e| &e.encoded).collect();
        let logits = self.0.logits(&encoded)?;
        let seqs: Vec<&[u32]> = batch.iter().map(|e| e.gold_ids.as_slice()).collect();
        let (logp, _) = sequence_terms(self.0.bio(), &logits, None, &seqs)?;
        let mut correct = 0;
        if count_correct {
            // Teacher-forced: the most probable allowed tag after the gold one, against the gold.
            let (_, w, l) = logits.dims3()?;
            let flat = logits.detach().flatten_all()?.to_vec1::<f32>()?;
            for (r, e) in batch.iter().enumerate() {
                for (i, &g) in e.gold_ids.iter().enumerate() {
                    let prev = (i > 0).then(|| e.gold_ids[i - 1] as usize);
                    let row = &flat[(r * w + i) * l..][..l];
                    correct += usize::from(self.0.bio().best(row, prev) == g as usize);
                }
            }
        }
        Ok(BatchLoss { loss_sum: logp.sum_all()?.neg()?, correct })
    }
}

/// Trains `tagger` to imitate the gold tags of `examples` (`args.eval_fraction` of them held out
/// for the loss and teacher-forced tag accuracy); `progress` after every optimizer step.
pub fn train_imitation(
    tagger: &Tagger,
    examples: &[TagExample],
    args: &TrainingArgs,
    checkpoints: Option<Checkpointing>,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainSummary> {
    runner::run_with(
        &Imitation(tagger),
        tagger.store(),
        examples,
        args,
        &Dist::default(),
        progress,
        true,
        checkpoints,
    )
}

/// `[rl]`: the reinforcement stage's own settings (the optimizer's are [`TrainingArgs`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlArgs {
    /// Tag sequences drawn per sentence, k (at least 2: each one's baseline is the others' mean).
    pub samples_per_sentence: usize,
    /// β, the weight of the KL to the reference policy.
    pub kl_coef: f64,
    /// Sampling temperature of the drawn sequences.
    pub temperature: f64,
    /// Seed of the samples' streams.
    pub seed: u64,
    /// What each sample's reward is compared with.
    pub baseline: Baseline,
}

/// The baseline of a sample's reward in the policy gradient.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Baseline {
    /// The mean reward of the sentence's other samples (RLOO).
    #[default]
    LeaveOneOut,
    /// The reward of the sentence's greedy tags (self-critical training, Rennie et al. 2017): a
    /// sample is pushed up when it beats what greedy decoding would have tagged.
    Greedy,
}

impl Default for RlArgs {
    fn default() -> Self {
        Self {
            samples_per_sentence: 4,
            kl_coef: 0.05,
            temperature: 1.0,
            seed: 0,
            baseline: Baseline::LeaveOneOut,
        }
    }
}

impl RlArgs {
    /// Checks every field; the message names the field and the fix.
    pub fn validate(&self) -> Result<()> {
        let least = match self.baseline {
            Baseline::LeaveOneOut => 2,
            Baseline::Greedy => 1,
        };
        if self.samples_per_sentence < least {
            return Err(Error::Setting(ConfigError::new(
                "rl",
                "samples_per_sentence",
                format!(
                    "= {}: needs at least {least} with baseline {:?} (leave_one_out compares each \
                     sample with the mean of the others)",
                    self.samples_per_sentence, self.baseline
                ),
            )));
        }
        if !(self.kl_coef >= 0.0 && self.kl_coef.is_finite()) {
            return Err(Error::Setting(ConfigError::new(
                "rl",
                "kl_coef",
                format!("= {}: must be a finite number ≥ 0", self.kl_coef),
            )));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(Error::Setting(ConfigError::new(
                "rl",
                "temperature",
                format!("= {}: must be a finite number > 0", self.temperature),
            )));
        }
        Ok(())
    }
}

/// What the samples of one optimizer step scored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RlStats {
    /// Sequences drawn.
    pub samples: usize,
    /// Their mean reward.
    pub reward_mean: f64,
    /// Their mean summed KL to the reference.
    pub kl_mean: f64,
    /// Their micro entity F1 against the gold tags.
    pub f1: f64,
    /// Entities each sequence predicted, on average.
    pub predicted_per_sentence: f64,
}

#[derive(Default)]
struct StepTally {
    samples: usize,
    reward: f64,
    kl: f64,
    counts: (usize, usize, usize),
}

impl StepTally {
    fn stats(&self) -> RlStats {
        let n = self.samples.max(1) as f64;
        let (tp, fp, fn_) = self.counts;
        RlStats {
            samples: self.samples,
            reward_mean: self.reward / n,
            kl_mean: self.kl / n,
            f1: crate::rewards::metrics::bio::Prf::of(tp, fp, fn_).f1,
            predicted_per_sentence: (tp + fp) as f64 / n,
        }
    }
}

/// RLOO with an exact KL penalty (module docs).
struct Reinforce<'a> {
    policy: &'a Tagger,
    reference: &'a Tagger,
    args: &'a RlArgs,
    step: Cell<usize>,
    tally: RefCell<StepTally>,
}

impl Objective for Reinforce<'_> {
    type Example = TagExample;
    const PERPLEXITY: bool = false;

    fn terms(&self, _: &TagExample) -> usize {
        1
    }

    fn begin_step(&self, step: usize) {
        self.step.set(step);
        *self.tally.borrow_mut() = StepTally::default();
    }

    fn batch_loss(&self, batch: &[&TagExample], _count_correct: bool) -> Result<BatchLoss> {
        let k = self.args.samples_per_sentence;
        let bio = self.policy.bio();
        let encoded: Vec<&Encoded> = batch.iter().map(|e| &e.encoded).collect();
        // (B, W, L)
        let logits = self.policy.logits(&encoded)?;
        let reference = self.reference.logits(&encoded)?.detach();
        let (_, w, l) = logits.dims3()?;
        let flat = logits.detach().flatten_all()?.to_vec1::<f32>()?;
        let step = self.step.get() as u64;
        let (mut seqs, mut rewards) =
            (Vec::with_capacity(batch.len() * k), Vec::with_capacity(batch.len() * k));
        let mut tally = self.tally.borrow_mut();
        let mut greedy = Vec::with_capacity(batch.len());
        for (r, e) in batch.iter().enumerate() {
            let words = e.encoded.first.len();
            if self.args.baseline == Baseline::Greedy {
                let seq = bio.pick(&flat[r * w * l..], words, 0.0, &mut rand::rngs::StdRng::seed_from_u64(0));
                greedy.push(reward(&e.gold, &tag_strings(bio, &seq, e.gold.len())));
            }
            for j in 0..k {
                let seed = mix_seeds(&[self.args.seed, step, e.index as u64, j as u64]);
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let seq = bio.pick(&flat[r * w * l..], words, self.args.temperature, &mut rng);
                let pred = tag_strings(bio, &seq, e.gold.len());
                let (tp, fp, fn_) = sequence_counts(&e.gold, &pred);
                tally.counts = (tally.counts.0 + tp, tally.counts.1 + fp, tally.counts.2 + fn_);
                rewards.push(reward(&e.gold, &pred));
                seqs.push(seq);
            }
        }
        // Advantages, each sample's weight in the sentence's mean over k.
        let mut weights = Vec::with_capacity(rewards.len());
        for (i, group) in rewards.chunks(k).enumerate() {
            let sum: f64 = group.iter().sum();
            weights.extend(group.iter().map(|&x| {
                let base = match self.args.baseline {
                    Baseline::LeaveOneOut => (sum - x) / (k - 1) as f64,
                    Baseline::Greedy => greedy[i],
                };
                ((x - base) / k as f64) as f32
            }));
        }
        let rows: Vec<u32> = (0..batch.len() as u32).flat_map(|r| std::iter::repeat_n(r, k)).collect();
        let rows = Tensor::from_vec(rows, batch.len() * k, logits.device())?;
        let views: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let (logp, kl) = sequence_terms(
            bio,
            &logits.index_select(&rows, 0)?,
            Some(&reference.index_select(&rows, 0)?),
            &views,
        )?;
        let kl = kl.unwrap_or_else(|| unreachable!("a reference was given"));
        let adv = Tensor::from_vec(weights, batch.len() * k, logits.device())?;
        let pg = (logp * adv)?.sum_all()?.neg()?;
        let penalty = (kl.sum_all()? * (self.args.kl_coef / k as f64))?;
        tally.samples += seqs.len();
        tally.reward += rewards.iter().sum::<f64>();
        tally.kl += kl.detach().to_vec1::<f32>()?.iter().map(|&x| f64::from(x)).sum::<f64>();
        Ok(BatchLoss { loss_sum: (pg + penalty)?, correct: 0 })
    }
}

/// Trains `policy` by RLOO on [`reward`] with the exact KL to `reference` (module docs);
/// `progress` after every optimizer step, with what the step's samples scored. Set
/// `args.eval_fraction = 0`: the loss of held-out sentences means little here.
pub fn train_rl(
    policy: &Tagger,
    reference: &Tagger,
    examples: &[TagExample],
    args: &TrainingArgs,
    rl: &RlArgs,
    checkpoints: Option<Checkpointing>,
    progress: &mut dyn FnMut(&TrainProgress, &RlStats),
) -> Result<TrainSummary> {
    rl.validate()?;
    if policy.tags() != reference.tags() {
        return Err(Error::argument(
            "reference",
            format!(
                "the reference tags {:?} but the policy {:?}; start RL from the imitation policy",
                reference.tags(),
                policy.tags()
            ),
        ));
    }
    let obj = Reinforce { policy, reference, args: rl, step: Cell::new(0), tally: RefCell::default() };
    let mut report = |p: &TrainProgress| progress(p, &obj.tally.borrow().stats());
    runner::run_with(&obj, policy.store(), examples, args, &Dist::default(), &mut report, true, checkpoints)
}

/// How [`predict`] picks tags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decoding {
    /// The most probable allowed tag, left to right.
    Greedy,
    /// Greedy after `o_bias` is taken off every word's `O` logit: a positive bias tags more
    /// entities (the decision threshold of entity F1 is below the argmax's).
    GreedyBiased {
        /// Subtracted from the `O` logit.
        o_bias: f32,
    },
    /// Drawn at `temperature`; sentence `i` from the stream `mix(seed, i)`.
    Sampled {
        /// Seed of the streams.
        seed: u64,
        /// Sampling temperature.
        temperature: f64,
    },
}

/// The tags `tagger` gives every word of `examples` (uncovered words `O`), in batches of
/// `batch_size`.
pub fn predict(
    tagger: &Tagger,
    examples: &[TagExample],
    decoding: Decoding,
    batch_size: usize,
) -> Result<Vec<Vec<String>>> {
    let mut all = predict_each(tagger, examples, &[decoding], batch_size)?;
    Ok(all.pop().unwrap_or_default())
}

/// [`predict`] under each of `decodings` from one encoder pass per sentence: one list of
/// predictions per decoding. The sentences are batched by length (their order does not change a
/// prediction), so that little of a batch is padding.
pub fn predict_each(
    tagger: &Tagger,
    examples: &[TagExample],
    decodings: &[Decoding],
    batch_size: usize,
) -> Result<Vec<Vec<Vec<String>>>> {
    let mut out = vec![vec![Vec::new(); examples.len()]; decodings.len()];
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.sort_by_key(|&i| examples[i].encoded.ids.len());
    for chunk in order.chunks(batch_size.max(1)) {
        let encoded: Vec<&Encoded> = chunk.iter().map(|&i| &examples[i].encoded).collect();
        let logits = tagger.logits(&encoded)?.detach();
        let (_, w, l) = logits.dims3()?;
        let flat = logits.flatten_all()?.to_vec1::<f32>()?;
        for (r, &i) in chunk.iter().enumerate() {
            let e = &examples[i];
            let words = e.encoded.first.len();
            let row = &flat[r * w * l..][..words * l];
            for (d, decoding) in decodings.iter().enumerate() {
                let (seed, temperature, o_bias) = match *decoding {
                    Decoding::Greedy => (0, 0.0, 0.0),
                    Decoding::GreedyBiased { o_bias } => (0, 0.0, o_bias),
                    Decoding::Sampled { seed, temperature } => {
                        (mix_seeds(&[seed, e.index as u64]), temperature, 0.0)
                    }
                };
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let seq = match tagger.bio().index("O") {
                    Some(o) if o_bias != 0.0 => {
                        let mut biased = row.to_vec();
                        biased.iter_mut().skip(o).step_by(l).for_each(|x| *x -= o_bias);
                        tagger.bio().pick(&biased, words, temperature, &mut rng)
                    }
                    _ => tagger.bio().pick(row, words, temperature, &mut rng),
                };
                out[d][i] = tag_strings(tagger.bio(), &seq, e.encoded.words);
            }
        }
    }
    Ok(out)
}

/// A tag sequence as strings, padded with `O` to `words`.
fn tag_strings(bio: &Bio, seq: &[u32], words: usize) -> Vec<String> {
    let mut out: Vec<String> = seq.iter().map(|&t| bio.tags()[t as usize].clone()).collect();
    out.resize(words.max(seq.len()), "O".into());
    out
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The log-probability and KL of a sequence against a direct computation over each word's
    /// allowed tags.
    #[test]
    fn sequence_terms_are_the_constrained_distributions() {
        let tags: Vec<String> = ["O", "B-a", "I-a", "B-b", "I-b"].map(String::from).to_vec();
        let bio = Bio::new(&tags).unwrap();
        let (w, l) = (4, 5);
        let p: Vec<f32> = (0..w * l).map(|i| ((i * 7919) % 13) as f32 / 4.0 - 1.5).collect();
        let q: Vec<f32> = (0..w * l).map(|i| ((i * 104_729) % 11) as f32 / 3.0 - 1.0).collect();
        let seq = [1u32, 2, 0, 3];
        let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), (1, w, l), &Device::Cpu).unwrap();
        let (logp, kl) = sequence_terms(&bio, &t(&p), Some(&t(&q)), &[&seq[..3]]).unwrap();
        let (mut want_lp, mut want_kl) = (0f64, 0f64);
        for i in 0..3 {
            let prev = (i > 0).then(|| seq[i - 1] as usize);
            let ok: Vec<usize> = (0..l).filter(|&k| bio.allowed(prev, k)).collect();
            let lse = |v: &[f32]| ok.iter().map(|&k| f64::from(v[i * l + k]).exp()).sum::<f64>().ln();
            let (zp, zq) = (lse(&p), lse(&q));
            want_lp += f64::from(p[i * l + seq[i] as usize]) - zp;
            for &k in &ok {
                let (a, b) = (f64::from(p[i * l + k]) - zp, f64::from(q[i * l + k]) - zq);
                want_kl += a.exp() * (a - b);
            }
        }
        let got_lp = f64::from(logp.to_vec1::<f32>().unwrap()[0]);
        let got_kl = f64::from(kl.unwrap().to_vec1::<f32>().unwrap()[0]);
        assert!((got_lp - want_lp).abs() < 1e-5, "{got_lp} vs {want_lp}");
        assert!((got_kl - want_kl).abs() < 1e-5 && want_kl > 0.01, "{got_kl} vs {want_kl}");
    }

    #[test]
    fn the_reward_pays_entities_not_silence() {
        let gold = ["B-a", "I-a", "O", "B-b"];
        assert_eq!(reward(&gold, &gold), 2.0);
        assert_eq!(reward(&gold, &["O"; 4]), -1.0);
        assert_eq!(reward(&gold, &["B-a", "O", "O", "B-b"]), 1.0 - 1.0);
        assert_eq!(reward(&["O", "O"], &["O", "O"]), 0.0);
        assert_eq!(reward(&["O", "O"], &["B-a", "O"]), -0.5);
    }

    /// A bad `[rl]` value is a setting error naming its key, and prints as it did as `Input`.
    #[test]
    fn rl_args_errors_name_the_rl_key() {
        let err = RlArgs { kl_coef: -1.0, ..RlArgs::default() }.validate().unwrap_err();
        assert!(
            matches!(&err, Error::Setting(ConfigError { section, field, .. }) if section == "rl" && field == "kl_coef"),
            "{err:?}"
        );
        assert_eq!(err.to_string(), "rl.kl_coef = -1: must be a finite number ≥ 0");
        let err = RlArgs { samples_per_sentence: 1, ..RlArgs::default() }.validate().unwrap_err();
        assert!(err.to_string().starts_with("rl.samples_per_sentence = 1: needs at least 2"), "{err}");
    }
}
