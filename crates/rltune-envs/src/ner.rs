//! Named-entity recognition as a text game: the agent tags a sentence's tokens one per turn
//! with BIO tags, and the reward is the sentence's entity-level F1 (conlleval's exact-span
//! rule, [`crate::metrics::bio`]). Built for WNUT-2016's Twitter NER data
//! (`tools/data/fetch_wnut.sh`), it reads any CoNLL-style two-column file.
//!
//! - **Data**: the sentences of `file`; a fixed split holds out every `heldout_every`-th
//!   sentence (indices `heldout_every − 1`, `2·heldout_every − 1`, …); the rest train.
//! - **Episodes**: a reset with seed `s` tags training sentence `s mod n_train`; a held-out
//!   seed ([`super::adventure::heldout_seed`]`(i)`) tags held-out sentence `i mod n_heldout`,
//!   so `n_heldout` consecutive evaluation episodes tag every held-out sentence once.
//! - **A turn** tags the next token with one of the tags seen in the file (the admissible
//!   commands, `O` first); anything else is refused (`invalid`) and tags `O`.
//! - **The observation**: the whole sentence, the last tags given, the token and the two after.
//! - **The reward**: the sentence's entity F1 on the last turn (1 when it has no entity and
//!   none was predicted); with `dense_reward`, the change of the F1 of the tagged prefix
//!   against the gold entities that end inside it (Φ₀ = 0), which telescopes to the same total.
//! - [`TextEnv::walkthrough`] gives the gold tags of the remaining tokens.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::adventure::{is_heldout, HELDOUT_START};
use super::{check_indices, sanitize_action, EnvStep, Reset, TextEnv};
use crate::error::{Error, Result};
use crate::metrics::bio::{entities, read_conll, sequence_score, Tagged};

/// `[env.ner]`: the data file and its split.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NerConfig {
    /// The CoNLL-style file (`TOKEN<TAB>TAG` lines, blank lines between sentences); relative to
    /// the env config's folder.
    pub file: String,
    /// Every this-many-th sentence is held out (default 5: 20%).
    pub heldout_every: usize,
    /// Reward every turn with the change of the prefix F1 (the return is unchanged).
    pub dense_reward: bool,
    /// The last tags shown in the observation.
    pub tags_shown: usize,
}

impl Default for NerConfig {
    fn default() -> Self {
        Self {
            file: "target/data/wnut16/ner.txt".into(),
            heldout_every: 5,
            dense_reward: false,
            tags_shown: 3,
        }
    }
}

/// The sentences of a file, split.
#[derive(Debug, Clone, PartialEq)]
pub struct NerData {
    /// Training sentences.
    pub train: Vec<Tagged>,
    /// Held-out sentences.
    pub heldout: Vec<Tagged>,
    /// Every tag in the file, `O` first, then sorted.
    pub tags: Vec<String>,
}

impl NerData {
    /// Reads `file` and splits it (every `heldout_every`-th sentence held out).
    pub fn load(file: &Path, heldout_every: usize) -> Result<Self> {
        if heldout_every < 2 {
            return Err(Error::Config(format!(
                "[env.ner] heldout_every must be at least 2, got {heldout_every}"
            )));
        }
        if !file.is_file() {
            return Err(Error::Config(format!(
                "[env.ner] file {}: not found; fetch WNUT-2016 with tools/data/fetch_wnut.sh",
                file.display()
            )));
        }
        let all = read_conll(file)?;
        if all.is_empty() {
            return Err(Error::Data { path: file.to_path_buf(), line: None, msg: "no sentences".into() });
        }
        let mut tags: Vec<String> = all.iter().flat_map(|s| s.tags.iter().cloned()).collect();
        tags.sort();
        tags.dedup();
        tags.retain(|t| t != "O");
        tags.insert(0, "O".into());
        let (mut train, mut heldout) = (Vec::new(), Vec::new());
        for (i, s) in all.into_iter().enumerate() {
            if (i + 1).is_multiple_of(heldout_every) {
                heldout.push(s);
            } else {
                train.push(s);
            }
        }
        Ok(Self { train, heldout, tags })
    }

    /// The sentence a reset with `seed` tags (module docs).
    pub fn sentence(&self, seed: u64) -> &Tagged {
        if is_heldout(seed) && !self.heldout.is_empty() {
            &self.heldout[((seed - HELDOUT_START) % self.heldout.len() as u64) as usize]
        } else {
            &self.train[(seed % self.train.len().max(1) as u64) as usize]
        }
    }
}

/// One environment's sentence in progress.
#[derive(Debug, Clone)]
struct Episode {
    seed: u64,
    sentence: Tagged,
    tags: Vec<String>,
    ended: bool,
}

impl Episode {
    /// The F1 of the tags so far against the gold entities ending inside the prefix.
    fn prefix_score(&self) -> f64 {
        let k = self.tags.len();
        if k == 0 {
            return 0.0;
        }
        if k >= self.sentence.tags.len() {
            return sequence_score(&self.sentence.tags, &self.tags);
        }
        // Gold entities ending inside the prefix: the gold tags up to k, with an entity that
        // runs past k cut off (its tags set to O).
        let mut gold: Vec<String> = self.sentence.tags[..k].to_vec();
        for e in entities(&self.sentence.tags) {
            if e.start < k && e.end > k {
                for t in &mut gold[e.start..k] {
                    *t = "O".into();
                }
            }
        }
        sequence_score(&gold, &self.tags)
    }
}

/// A batch of NER tagging environments (see the module docs).
#[derive(Debug, Clone)]
pub struct Ner {
    config: NerConfig,
    data: Arc<NerData>,
    max_steps: usize,
    episodes: Vec<Option<Episode>>,
}

impl Ner {
    /// `num_envs` environments over `data`; an episode is cut after `max_steps` tokens (the
    /// rest tagged `O` for the score).
    pub fn new(num_envs: usize, config: NerConfig, data: Arc<NerData>, max_steps: usize) -> Result<Self> {
        if max_steps == 0 {
            return Err(Error::Config("ner: max_steps must be at least 1".into()));
        }
        Ok(Self { config, data, max_steps, episodes: vec![None; num_envs] })
    }

    /// Reads `config.file` (relative to `base`) and makes the environments.
    pub fn from_config(num_envs: usize, config: &NerConfig, base: &Path, max_steps: usize) -> Result<Self> {
        let file = if Path::new(&config.file).is_absolute() {
            PathBuf::from(&config.file)
        } else {
            base.join(&config.file)
        };
        let data = NerData::load(&file, config.heldout_every)?;
        Self::new(num_envs, config.clone(), Arc::new(data), max_steps)
    }

    /// The data.
    pub fn data(&self) -> &NerData {
        &self.data
    }

    fn report(&self, ep: &Episode, reward: f64, invalid: bool) -> EnvStep {
        let n = ep.sentence.tokens.len();
        let k = ep.tags.len();
        let finished = k >= n;
        let score = if ep.ended {
            let mut tags = ep.tags.clone();
            tags.resize(n, "O".into());
            sequence_score(&ep.sentence.tags, &tags)
        } else {
            ep.prefix_score()
        };
        let observation = if ep.ended {
            format!("All {n} tokens tagged.")
        } else {
            let shown = k.saturating_sub(self.config.tags_shown);
            let recent: Vec<String> =
                (shown..k).map(|i| format!("{}/{}", ep.sentence.tokens[i], ep.tags[i])).collect();
            let next: Vec<&str> = ep.sentence.tokens.iter().skip(k + 1).take(2).map(String::as_str).collect();
            format!(
                "Sentence: {}\nToken {} of {n}. Tagged: {}\nToken: {}\nNext: {}",
                ep.sentence.tokens.join(" "),
                k + 1,
                if recent.is_empty() { "(none)".to_string() } else { recent.join(" ") },
                ep.sentence.tokens[k],
                if next.is_empty() { "(end)".to_string() } else { next.join(" ") }
            )
        };
        let mut infos = serde_json::Map::new();
        infos.insert("seed".into(), ep.seed.into());
        EnvStep {
            observation,
            reward,
            terminated: ep.ended && finished,
            truncated: ep.ended && !finished,
            won: ep.ended && score >= 1.0,
            lost: false,
            score,
            max_score: 1.0,
            moves: k,
            admissible_commands: if ep.ended { Vec::new() } else { self.data.tags.clone() },
            objective: "Tag each token: O, B-TYPE or I-TYPE.".into(),
            inventory: String::new(),
            invalid,
            infos,
        }
    }
}

impl TextEnv for Ner {
    fn num_envs(&self) -> usize {
        self.episodes.len()
    }

    fn reset(&mut self, envs: &[usize], resets: &[Reset]) -> Result<Vec<EnvStep>> {
        check_indices("reset", envs, self.episodes.len(), resets.len())?;
        let mut out = Vec::with_capacity(envs.len());
        for (&e, reset) in envs.iter().zip(resets) {
            let seed = reset.seed.unwrap_or(0);
            let ep =
                Episode { seed, sentence: self.data.sentence(seed).clone(), tags: Vec::new(), ended: false };
            out.push(self.report(&ep, 0.0, false));
            self.episodes[e] = Some(ep);
        }
        Ok(out)
    }

    fn step(&mut self, actions: &[(usize, String)]) -> Result<Vec<Result<EnvStep>>> {
        let envs: Vec<usize> = actions.iter().map(|(e, _)| *e).collect();
        check_indices("step", &envs, self.episodes.len(), actions.len())?;
        let mut out = Vec::with_capacity(actions.len());
        for (e, action) in actions {
            let Some(mut ep) = self.episodes[*e].take() else {
                out.push(Err(Error::not_running("ner", *e, "has no sentence")));
                continue;
            };
            if ep.ended {
                self.episodes[*e] = Some(ep);
                out.push(Err(Error::not_running("ner", *e, "has tagged its sentence")));
                continue;
            }
            let tag = sanitize_action(action, 100);
            let valid = self.data.tags.contains(&tag);
            let before = ep.prefix_score();
            ep.tags.push(if valid { tag } else { "O".into() });
            ep.ended = ep.tags.len() >= ep.sentence.tokens.len() || ep.tags.len() >= self.max_steps;
            let reward = if self.config.dense_reward {
                self.report(&ep, 0.0, false).score - before
            } else if ep.ended {
                self.report(&ep, 0.0, false).score
            } else {
                0.0
            };
            out.push(Ok(self.report(&ep, reward, !valid)));
            self.episodes[*e] = Some(ep);
        }
        Ok(out)
    }

    fn walkthrough(&self, env: usize) -> Option<Vec<String>> {
        let ep = self.episodes.get(env)?.as_ref()?;
        (!ep.ended).then(|| ep.sentence.tags[ep.tags.len()..].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> Arc<NerData> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ner.txt");
        let mut text = String::new();
        for i in 0..10 {
            text.push_str(&format!("w{i}\tO\nEmpire\tB-facility\nState\tI-facility\nis\tO\nbig\tO\n\t\n"));
        }
        std::fs::write(&p, text).unwrap();
        Arc::new(NerData::load(&p, 5).unwrap())
    }

    #[test]
    fn split_is_every_fifth_and_seeds_pick_sentences() {
        let d = data();
        assert_eq!((d.train.len(), d.heldout.len()), (8, 2));
        assert_eq!(d.heldout[0].tokens[0], "w4");
        assert_eq!(d.heldout[1].tokens[0], "w9");
        assert_eq!(d.tags, vec!["O", "B-facility", "I-facility"]);
        assert_eq!(d.sentence(super::super::adventure::heldout_seed(1)).tokens[0], "w9");
        assert_eq!(d.sentence(9).tokens[0], "w1", "training seeds wrap");
        let e = NerData::load(Path::new("/nonexistent/ner.txt"), 5).unwrap_err().to_string();
        assert!(e.contains("fetch_wnut.sh"), "{e}");
    }

    #[test]
    fn gold_tags_win_and_dense_rewards_telescope() {
        for dense in [false, true] {
            let cfg = NerConfig { dense_reward: dense, ..NerConfig::default() };
            let mut env = Ner::new(1, cfg, data(), 50).unwrap();
            env.reset(&[0], &[Reset { seed: Some(0), game: None }]).unwrap();
            let mut total = 0.0;
            let mut last = EnvStep::default();
            for t in env.walkthrough(0).unwrap() {
                last = env.step(&[(0, t)]).unwrap().remove(0).unwrap();
                total += last.reward;
            }
            assert!(last.terminated && last.won && (total - 1.0).abs() < 1e-12, "dense {dense}: {total}");
            // A wrong end of the entity: F1 0, and an invalid tag is refused as O.
            env.reset(&[0], &[Reset { seed: Some(1), game: None }]).unwrap();
            let mut total = 0.0;
            for t in ["O", "B-facility", "bogus", "O", "O"] {
                last = env.step(&[(0, t.into())]).unwrap().remove(0).unwrap();
                total += last.reward;
                assert_eq!(last.invalid, t == "bogus");
            }
            assert!(last.done() && last.score == 0.0 && total.abs() < 1e-12, "dense {dense}: {total}");
        }
    }
}
