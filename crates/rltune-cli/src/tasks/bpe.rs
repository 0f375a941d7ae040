//! Training a byte-level BPE tokenizer (GPT-2's scheme) in-process with the `tokenizers` crate.

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use rltune::error::{Error, Result};
use rltune::tokenizer::Tokenizer;

/// The end-of-text token, id 0 of every tokenizer trained here (GPT-2's name for it).
pub const EOS_TOKEN: &str = "<|endoftext|>";

/// Trains a byte-level BPE with `vocab_size` entries on `texts`: EOS is id 0 and `specials`
/// follow it (ids 1, 2, …), never split and never produced by merges.
pub fn train_bpe<S: AsRef<str> + Send>(
    texts: impl Iterator<Item = S> + Send,
    vocab_size: usize,
    specials: &[&str],
) -> Result<Tokenizer> {
    let mut tok = tokenizers::Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            std::iter::once(EOS_TOKEN)
                .chain(specials.iter().copied())
                .map(|t| AddedToken::from(t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tok.train(&mut trainer, texts).map_err(|e| Error::Tokenizer(format!("BPE training failed: {e}")))?;
    Ok(Tokenizer::from_inner(tok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_bpe_round_trips_text_and_has_eos_zero() {
        let texts: Vec<String> =
            super::super::corpus::generate_corpus(300, 3).into_iter().map(|r| r.text).collect();
        let tok = train_bpe(texts.iter(), 400, &["[CLS]"]).unwrap();
        assert_eq!(tok.token_to_id("[CLS]"), Some(1));
        assert_eq!(tok.token_to_id(EOS_TOKEN), Some(0));
        assert!(tok.vocab_size() <= 400);
        let s = "The acting was truly wonderful. Ten out of ten.";
        let ids = tok.encode(s).unwrap();
        assert!(ids.len() < s.len() / 2, "BPE should merge common words: {} ids", ids.len());
        assert_eq!(tok.decode(&ids).unwrap(), s);
    }
}
