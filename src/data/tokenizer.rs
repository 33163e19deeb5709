//! Tokenizers: `char` (vocabulary taken from a corpus, saved with the model),
//! `gpt2` (tiktoken's `r50k_base`, compiled in) and BERT's WordPiece (a
//! `vocab.txt`, kept beside the model; `data::wordpiece`).

use super::wordpiece::Normalizer;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What is saved beside a model or a shard directory to rebuild the tokenizer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TokenizerSpec {
    /// Token i is the i-th character of `chars`.
    Char {
        chars: String,
    },
    Gpt2,
    /// A BERT folder's WordPiece vocabulary (`vocab.txt`, which it is read
    /// from): its size and checksum, so a checkpoint names the vocabulary
    /// it was trained with, and how text is normalized before it is cut
    /// (recorded where it is not BERT uncased's, so older records read the
    /// same).
    WordPiece {
        tokens: usize,
        checksum: String,
        #[serde(default, skip_serializing_if = "Normalizer::is_uncased")]
        normalizer: Normalizer,
    },
}

pub enum Tokenizer {
    Char {
        chars: Vec<char>,
        index: HashMap<char, u32>,
    },
    Gpt2(Box<tiktoken_rs::CoreBPE>),
    WordPiece(Box<super::wordpiece::WordPiece>),
}

/// GPT-2's `<|endoftext|>`.
pub const GPT2_EOT: u32 = 50256;
/// The GPT-2 BPE vocabulary (`r50k_base`).
pub const GPT2_VOCAB: usize = 50257;

impl Tokenizer {
    /// A character vocabulary of every distinct character in `text`, sorted.
    pub fn char_from_corpus(text: &str) -> Self {
        let chars: std::collections::BTreeSet<char> = text.chars().collect();
        Self::from_spec(&TokenizerSpec::Char {
            chars: chars.into_iter().collect(),
        })
        .expect("char spec always builds")
    }

    /// The tokenizer `spec` records; a WordPiece vocabulary is read from the
    /// `vocab.txt` in `dir` (a run, a checkpoint, a model or shard folder)
    /// and checked against the record.
    pub fn from_spec_in(spec: &TokenizerSpec, dir: &std::path::Path) -> Result<Self> {
        match spec {
            TokenizerSpec::WordPiece { .. } => Ok(Tokenizer::WordPiece(Box::new(
                super::wordpiece::WordPiece::recorded_in(dir, spec)?,
            ))),
            _ => Self::from_spec(spec),
        }
    }

    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self> {
        match spec {
            TokenizerSpec::Char { chars } => {
                let chars: Vec<char> = chars.chars().collect();
                let index = chars
                    .iter()
                    .enumerate()
                    .map(|(i, &ch)| (ch, i as u32))
                    .collect();
                Ok(Tokenizer::Char { chars, index })
            }
            TokenizerSpec::Gpt2 => tiktoken_rs::r50k_base()
                .map(|b| Tokenizer::Gpt2(Box::new(b)))
                .map_err(|e| Error::Config(format!("cannot build the GPT-2 tokenizer: {e}"))),
            TokenizerSpec::WordPiece { tokens, .. } => Err(Error::Config(format!(
                "a WordPiece vocabulary ({tokens} tokens) is read from the vocab.txt kept beside its model"
            ))),
        }
    }

    pub fn spec(&self) -> TokenizerSpec {
        match self {
            Tokenizer::Char { chars, .. } => TokenizerSpec::Char {
                chars: chars.iter().collect(),
            },
            Tokenizer::Gpt2(_) => TokenizerSpec::Gpt2,
            Tokenizer::WordPiece(wp) => wp.spec(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char { chars, .. } => chars.len(),
            Tokenizer::Gpt2(_) => GPT2_VOCAB,
            Tokenizer::WordPiece(wp) => wp.vocab_size(),
        }
    }

    /// The end-of-text token, where the vocabulary has one.
    pub fn eot(&self) -> Option<u32> {
        match self {
            Tokenizer::Char { .. } | Tokenizer::WordPiece(_) => None,
            Tokenizer::Gpt2(_) => Some(GPT2_EOT),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Char { index, .. } => text
                .chars()
                .map(|ch| {
                    index.get(&ch).copied().ok_or_else(|| {
                        Error::Input(format!(
                            "character {ch:?} is not in this model's character vocabulary"
                        ))
                    })
                })
                .collect(),
            Tokenizer::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Tokenizer::WordPiece(wp) => Ok(wp.encode(text)),
        }
    }

    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Tokenizer::Char { chars, .. } => tokens
                .iter()
                .filter_map(|&t| chars.get(t as usize))
                .collect(),
            // Ids outside the vocabulary decode to U+FFFD rather than failing.
            Tokenizer::Gpt2(bpe) => match bpe.decode_bytes(tokens) {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(_) => "\u{FFFD}".into(),
            },
            Tokenizer::WordPiece(wp) => wp.decode(tokens),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_tokenizer_matches_known_ids_and_round_trips() {
        let t = Tokenizer::from_spec(&TokenizerSpec::Gpt2).unwrap();
        assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(t.decode(&[15496, 995]), "Hello world");
    }

    #[test]
    fn char_tokenizer_round_trips_and_names_unknown_characters() {
        let t = Tokenizer::char_from_corpus("to be or not");
        assert_eq!(t.vocab_size(), 7);
        let ids = t.encode("not to be").unwrap();
        assert_eq!(t.decode(&ids), "not to be");
        let err = t.encode("nut").unwrap_err().to_string();
        assert!(err.contains("'u'"), "{err}");
    }
}
