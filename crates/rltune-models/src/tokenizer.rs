//! Tokenizers from `tokenizer.json`, with a configurable pad id and padding side.
//!
//! GPT-2 has no pad token: the pad id defaults to the model's EOS id, as in TRL's examples
//! (`tokenizer.pad_token = tokenizer.eos_token`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Which side padding goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PaddingSide {
    /// Pad before the tokens (what batched generation needs).
    #[default]
    Left,
    /// Pad after the tokens (what classifiers and TRL's training collator use).
    Right,
}

/// Words a BPE or Unigram model caches. The `tokenizers` default (10,000) kept growing for
/// ~1,800 PPO steps of the tiny quickstart models, where sampled text keeps making new words:
/// the soak benchmark's RSS rose 3.5 MB before it levelled off. A short cache costs little:
/// the words of prompts and responses are short.
pub const CACHE_WORDS: usize = 1024;

/// The tokenizer as rltune uses it: its word cache bounded ([`CACHE_WORDS`]), and its padding
/// off. rltune pads batches itself, with an attention mask ([`pad`]); a `tokenizer.json` that
/// pads to a fixed length (sentence-transformers' all-MiniLM-L6-v2 pads every text to 128)
/// would otherwise hand back `[PAD]` ids as if they were text. transformers does the same: its
/// fast tokenizers pad only when a call asks for it.
fn bounded_cache(mut inner: tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    let mut model = inner.get_model().clone();
    model.resize_cache(CACHE_WORDS);
    inner.with_model(model);
    inner.with_padding(None);
    inner
}

/// A `tokenizer.json` tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("path", &self.path).finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self { inner: bounded_cache(inner), path: path.to_path_buf() })
    }

    /// Wraps an in-memory tokenizer (e.g. one just trained).
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self { inner: bounded_cache(inner), path: PathBuf::from("<in memory>") }
    }

    /// A word-level tokenizer of `words` that splits on whitespace and punctuation (the
    /// `tokenizers` `Whitespace` pre-tokenizer), for tests and smoke runs with a model built
    /// in-process. With `bert`, ids 0–3 are `[PAD] [UNK] [CLS] [SEP]` and a single text becomes
    /// `[CLS] … [SEP]`; otherwise the words come first, then `<unk>` and `<eos>` (the last id,
    /// as `Gpt2Config::tiny` expects). Give each word once: a word listed twice keeps its last
    /// id. Words in `[…]` or `<…>` are special tokens.
    pub fn word_level(words: &[&str], bert: bool) -> Result<Self> {
        let specials: Vec<&str> = if bert { vec!["[PAD]", "[UNK]", "[CLS]", "[SEP]"] } else { vec![] };
        let tail: Vec<&str> = if bert { vec![] } else { vec!["<unk>", "<eos>"] };
        let all: Vec<&str> = specials.iter().chain(words).chain(&tail).copied().collect();
        let vocab: serde_json::Map<String, serde_json::Value> =
            all.iter().enumerate().map(|(i, w)| (w.to_string(), i.into())).collect();
        let added: Vec<serde_json::Value> = all
            .iter()
            .enumerate()
            .filter(|(_, w)| w.starts_with('[') || w.starts_with('<'))
            .map(|(i, w)| {
                serde_json::json!({"id": i, "content": w, "single_word": false, "lstrip": false,
                                   "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let tok = |id: &str| serde_json::json!({"SpecialToken": {"id": id, "type_id": 0}});
        let seq = |id: &str, t: u32| serde_json::json!({"Sequence": {"id": id, "type_id": t}});
        let post = bert.then(|| {
            serde_json::json!({
                "type": "TemplateProcessing",
                "single": [tok("[CLS]"), seq("A", 0), tok("[SEP]")],
                "pair": [tok("[CLS]"), seq("A", 0), tok("[SEP]"), seq("B", 1), tok("[SEP]")],
                "special_tokens": {
                    "[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                    "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}
                }
            })
        });
        let unk = if bert { "[UNK]" } else { "<unk>" };
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": post,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": unk}
        });
        let inner: tokenizers::Tokenizer =
            json.to_string().parse().map_err(|e| Error::Tokenizer(format!("a word-level tokenizer: {e}")))?;
        Ok(Self::from_inner(inner))
    }

    /// Writes the tokenizer to `path` as `tokenizer.json`, atomically (a temporary file, then a
    /// rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::io::write_atomic(path, |tmp| {
            self.inner.save(tmp, true).map_err(|e| Error::Tokenizer(format!("{}: {e}", tmp.display())))
        })
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Number of ids the tokenizer can produce (vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Fails unless every id the tokenizer can produce is below the model's `vocab_size`.
    pub fn check_fits(&self, model_vocab_size: usize) -> Result<()> {
        let max_id = self.inner.get_vocab(true).values().copied().max().unwrap_or(0) as usize;
        if max_id >= model_vocab_size {
            return Err(Error::Tokenizer(format!(
                "{}: produces ids up to {max_id} but the model's vocab_size is {model_vocab_size}; \
                 the tokenizer belongs to a different model: use the tokenizer.json saved with this \
                 model",
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Token ids of `text`, without special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    /// Token ids of `text`, with the post-processor's special tokens (`[CLS] … [SEP]`) when asked.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("{}: cannot encode {text:?}: {e}", self.path.display())))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(format!("{}: cannot decode: {e}", self.path.display())))
    }

    /// The id of a token string (e.g. `"<|endoftext|>"`), if in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Pads rows of ids to one length: returns the padded ids and the mask (1 real, 0 pad).
pub fn pad(rows: &[Vec<u32>], pad_id: u32, side: PaddingSide) -> (Vec<Vec<u32>>, Vec<Vec<u8>>) {
    let len = rows.iter().map(Vec::len).max().unwrap_or(0);
    rows.iter()
        .map(|r| {
            let n = len - r.len();
            let (mut ids, mut mask) = (Vec::with_capacity(len), Vec::with_capacity(len));
            if side == PaddingSide::Left {
                ids.extend(std::iter::repeat_n(pad_id, n));
                mask.extend(std::iter::repeat_n(0u8, n));
            }
            ids.extend_from_slice(r);
            mask.extend(std::iter::repeat_n(1u8, r.len()));
            if side == PaddingSide::Right {
                ids.extend(std::iter::repeat_n(pad_id, n));
                mask.extend(std::iter::repeat_n(0u8, n));
            }
            (ids, mask)
        })
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pad_both_sides() {
        let rows = vec![vec![1, 2, 3], vec![4]];
        let (ids, mask) = pad(&rows, 0, PaddingSide::Left);
        assert_eq!(ids, vec![vec![1, 2, 3], vec![0, 0, 4]]);
        assert_eq!(mask, vec![vec![1, 1, 1], vec![0, 0, 1]]);
        let (ids, mask) = pad(&rows, 9, PaddingSide::Right);
        assert_eq!(ids, vec![vec![1, 2, 3], vec![4, 9, 9]]);
        assert_eq!(mask[1], vec![1, 0, 0]);
    }

    /// A `tokenizer.json` that pads to a fixed length (as all-MiniLM-L6-v2's does) encodes
    /// without padding.
    #[test]
    fn fixed_padding_in_tokenizer_json_is_ignored() {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "added_tokens": [],
            "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": {"[PAD]": 0, "a": 1, "b": 2}, "unk_token": "[PAD]"}
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let raw = tokenizers::Tokenizer::from_file(&path).unwrap();
        assert_eq!(raw.encode("a b", false).unwrap().get_ids().len(), 8, "the file pads");
        let tok = Tokenizer::from_file(&path).unwrap();
        assert_eq!(tok.encode("a b").unwrap(), [1, 2]);
        assert_eq!(Tokenizer::from_inner(raw).encode("b").unwrap(), [2]);
    }
}
