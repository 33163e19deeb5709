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
/// Its text.
const EOT_TEXT: &str = "<|endoftext|>";
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
                let mut index = HashMap::new();
                for (i, &ch) in chars.iter().enumerate() {
                    // a second id for a character: text would encode to the
                    // later, which the data's ids never were
                    if let Some(first) = index.insert(ch, i as u32) {
                        return Err(Error::Input(format!(
                            "the character vocabulary holds {ch:?} twice (ids {first} and {i}): a character has one id"
                        )));
                    }
                }
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

    /// Where a sample with no prompt starts: the end-of-text token, else a
    /// newline, else (a vocabulary without one) its first token.
    pub fn no_prompt(&self) -> Vec<u32> {
        match self.eot() {
            Some(eot) => vec![eot],
            None => self.encode("\n").unwrap_or_else(|_| vec![0]),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Char { index, .. } => text
                .chars()
                .map(|ch| index.get(&ch).copied())
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| unknown_characters(text, index)),
            // `<|endoftext|>` in the text is its token, as `transformers`
            // reads our tokenizer.json (and llm.c's prompts allow it)
            Tokenizer::Gpt2(bpe) => Ok(bpe.encode_with_special_tokens(text)),
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

    /// A text decoded token by token as the tokens come (`generate`'s
    /// stream), each piece as soon as its characters are whole.
    pub fn stream(&self) -> Stream<'_> {
        Stream {
            tk: self,
            pending: Vec::new(),
        }
    }
}

/// Tokens decoded one at a time into the text [`Tokenizer::decode`] gives
/// them all at once: a character GPT-2's BPE splits over tokens (its UTF-8
/// bytes in two tokens: "¿", most emoji) waits for its last byte, where
/// decoding each token alone would print U+FFFD for each part.
pub struct Stream<'a> {
    tk: &'a Tokenizer,
    /// Bytes of a character not yet whole.
    pending: Vec<u8>,
}

impl Stream<'_> {
    /// The text `token` completes.
    pub fn push(&mut self, token: u32) -> String {
        let Tokenizer::Gpt2(bpe) = self.tk else {
            return self.tk.decode(&[token]);
        };
        let Ok(bytes) = bpe.decode_bytes(&[token]) else {
            return self.finish() + "\u{FFFD}";
        };
        self.pending.extend(bytes);
        let mut text = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(whole) => {
                    text.push_str(whole);
                    self.pending.clear();
                    return text;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    // a character cut short waits; a byte no character
                    // has is one U+FFFD, as from_utf8_lossy makes it
                    let Some(bad) = e.error_len() else {
                        self.pending.drain(..valid);
                        return text;
                    };
                    text.push('\u{FFFD}');
                    self.pending.drain(..valid + bad);
                }
            }
        }
    }

    /// What is left at the end: a character cut short, as U+FFFD.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

/// Where a text leaves a character vocabulary: the first character it
/// lacks, by line and column, and how many others.
fn unknown_characters(text: &str, index: &HashMap<char, u32>) -> Error {
    let mut unknown: Vec<char> = text.chars().filter(|c| !index.contains_key(c)).collect();
    let first = unknown[0];
    let (mut line, mut column) = (1, 1);
    for c in text.chars().take_while(|&c| c != first) {
        (line, column) = if c == '\n' {
            (line + 1, 1)
        } else {
            (line, column + 1)
        };
    }
    unknown.sort_unstable();
    unknown.dedup();
    let others = match unknown.len() - 1 {
        0 => String::new(),
        n => format!(
            " (and {n} other character{} it lacks: {})",
            if n == 1 { "" } else { "s" },
            (unknown.iter().filter(|&&c| c != first).take(10))
                .map(|c| format!("{c:?}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    };
    Error::Input(format!(
        "character {first:?} at line {line}, column {column} is not in this model's character vocabulary{others}: a character model reads only the characters it was trained on"
    ))
}

/// GPT-2's byte-to-character map (`bytes_to_unicode`): printable bytes stand
/// for themselves, the rest for U+0100 onward in byte order, so every token
/// of its `vocab.json` and `merges.txt` is printable and has no space.
fn gpt2_byte_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256;
    for (b, slot) in map.iter_mut().enumerate() {
        *slot = match b {
            0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => char::from(b as u8),
            _ => {
                next += 1;
                char::from_u32(next - 1).expect("U+0100..U+0143 are characters")
            }
        };
    }
    map
}

/// `r50k_base` as `transformers` spells GPT-2's BPE: each token's bytes
/// (rank order) and, for every token past the 256 bytes, the merge that
/// makes it. A token's merge is found by running the merges of lower rank
/// over its bytes, which leaves exactly two parts.
fn gpt2_tokens_and_merges(bpe: &tiktoken_rs::CoreBPE) -> (Vec<Vec<u8>>, Vec<(usize, usize)>) {
    let tokens: Vec<Vec<u8>> = (0..GPT2_EOT)
        .map(|r| {
            bpe.decode_bytes(&[r])
                .expect("every rank below 50256 is a token")
        })
        .collect();
    let rank: HashMap<&[u8], usize> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let merges = (256..tokens.len())
        .map(|r| {
            let bytes = &tokens[r];
            // the parts as the ends of their ranges of `bytes`
            let mut ends: Vec<usize> = (1..=bytes.len()).collect();
            while ends.len() > 2 {
                let (mut best, mut at) = (r, 0);
                for i in 0..ends.len() - 1 {
                    let start = if i == 0 { 0 } else { ends[i - 1] };
                    match rank.get(&bytes[start..ends[i + 1]]) {
                        Some(&k) if k < best => (best, at) = (k, i),
                        _ => {}
                    }
                }
                assert!(best < r, "token {r} is not made by lower merges");
                ends.remove(at);
            }
            (ends[0], r)
        })
        .collect();
    (tokens, merges)
}

impl Tokenizer {
    /// The files `transformers`' `AutoTokenizer.from_pretrained` reads to
    /// give this tokenizer's ids: GPT-2's `vocab.json`, `merges.txt` and
    /// `tokenizer.json` (byte-level BPE, `<|endoftext|>` its special token);
    /// a character vocabulary as a `tokenizer.json` whose BPE has no merges,
    /// so each character is its own token. `max_len` is the model's
    /// context. A WordPiece vocabulary has none here: BERT's folder writes
    /// its own `vocab.txt`.
    pub fn hf_files(&self, max_len: usize) -> Vec<(&'static str, String)> {
        let json = |v: serde_json::Value| serde_json::to_string_pretty(&v).expect("JSON");
        // the model, tokenizer_config.json, the files only GPT-2 has, and
        // its byte-level pre-tokenizer and decoder
        let (model, config, extra, byte_level) = match self {
            Tokenizer::WordPiece(_) => return Vec::new(),
            Tokenizer::Char { chars, .. } => {
                let vocab: serde_json::Map<_, _> = chars
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.to_string(), i.into()))
                    .collect();
                let model = serde_json::json!({
                    "type": "BPE", "dropout": null, "unk_token": null,
                    "continuing_subword_prefix": null, "end_of_word_suffix": null,
                    "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                    "vocab": vocab, "merges": [],
                });
                let config = serde_json::json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": max_len,
                    "clean_up_tokenization_spaces": false,
                });
                (model, config, Vec::new(), None)
            }
            Tokenizer::Gpt2(bpe) => {
                let map = gpt2_byte_chars();
                let spell = |b: &[u8]| b.iter().map(|&x| map[x as usize]).collect::<String>();
                let (tokens, merges) = gpt2_tokens_and_merges(bpe);
                let mut vocab: serde_json::Map<_, _> = tokens
                    .iter()
                    .enumerate()
                    .map(|(r, t)| (spell(t), r.into()))
                    .collect();
                vocab.insert(EOT_TEXT.into(), GPT2_EOT.into());
                let merges: Vec<String> = merges
                    .iter()
                    .map(|&(cut, r)| {
                        let t = &tokens[r];
                        format!("{} {}", spell(&t[..cut]), spell(&t[cut..]))
                    })
                    .collect();
                let byte_level = serde_json::json!({
                    "type": "ByteLevel", "add_prefix_space": false,
                    "trim_offsets": true, "use_regex": true,
                });
                let model = serde_json::json!({
                    "type": "BPE", "dropout": null, "unk_token": null,
                    "continuing_subword_prefix": "", "end_of_word_suffix": "",
                    "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                    "vocab": vocab, "merges": merges,
                });
                let config = serde_json::json!({
                    "tokenizer_class": "GPT2Tokenizer",
                    "model_max_length": max_len,
                    "add_prefix_space": false,
                    "clean_up_tokenization_spaces": false,
                    "bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT,
                });
                let extra = vec![
                    ("vocab.json", json(model["vocab"].clone())),
                    (
                        "merges.txt",
                        format!("#version: 0.2\n{}\n", merges.join("\n")),
                    ),
                    (
                        "special_tokens_map.json",
                        json(serde_json::json!({
                            "bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT,
                        })),
                    ),
                ];
                (model, config, extra, Some(byte_level))
            }
        };
        let added = match self {
            Tokenizer::Gpt2(_) => serde_json::json!([{
                "id": GPT2_EOT, "content": EOT_TEXT, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": true, "special": true,
            }]),
            _ => serde_json::json!([]),
        };
        let (pre, decoder) = match byte_level {
            Some(b) => (b.clone(), b),
            None => (serde_json::Value::Null, serde_json::json!({"type": "Fuse"})),
        };
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null, "pre_tokenizer": pre,
            "post_processor": null, "decoder": decoder, "model": model,
        });
        let mut files = vec![
            ("tokenizer.json", json(tokenizer)),
            ("tokenizer_config.json", json(config)),
        ];
        files.extend(extra);
        files
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample with no prompt starts at the end of text, else a newline,
    /// else the vocabulary's first token.
    #[test]
    fn a_sample_with_no_prompt_starts_where_the_vocabulary_can() {
        let of = |chars: &str| {
            Tokenizer::from_spec(&TokenizerSpec::Char {
                chars: chars.into(),
            })
        };
        assert_eq!(of("ab\n").unwrap().no_prompt(), [2]);
        assert_eq!(of("ab").unwrap().no_prompt(), [0]);
        let gpt2 = Tokenizer::from_spec(&TokenizerSpec::Gpt2).unwrap();
        assert_eq!(gpt2.no_prompt(), [GPT2_EOT]);
    }

    #[test]
    fn gpt2_tokenizer_matches_known_ids_and_round_trips() {
        let t = Tokenizer::from_spec(&TokenizerSpec::Gpt2).unwrap();
        assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(t.decode(&[15496, 995]), "Hello world");
        // the end-of-text token, written in a text, is that token (as
        // `transformers` reads the tokenizer.json we export), not the seven
        // pieces of its spelling
        assert_eq!(t.encode("a<|endoftext|>b").unwrap(), [64, GPT2_EOT, 65]);
        assert_eq!(t.decode(&[64, GPT2_EOT, 65]), "a<|endoftext|>b");
    }

    /// Streamed a token at a time, a text prints as itself: the texts'
    /// characters GPT-2's BPE splits over tokens ("¿" as " Â" then a
    /// byte, an emoji in three) wait for their last byte; bytes no
    /// character has print as whole-text decoding prints them.
    #[test]
    fn a_stream_of_gpt2_tokens_prints_the_text_itself() {
        let t = Tokenizer::from_spec(&TokenizerSpec::Gpt2).unwrap();
        let streamed = |ids: &[u32]| {
            let mut s = t.stream();
            let mut text: String = ids.iter().map(|&id| s.push(id)).collect();
            text.push_str(&s.finish());
            text
        };
        for text in [
            "Élan naïve — «quoted» ¿Qué? Straße",
            "日本語 Привет",
            "🦀👍🏽 👨\u{200d}👩 a\u{200b}b",
        ] {
            let ids = t.encode(text).unwrap();
            assert!(ids.len() < text.len(), "{text:?}: a token a byte");
            assert_eq!(streamed(&ids), text);
        }
        // "é" (C3 A9) as its two bytes' tokens, then out of order, then cut
        // short at the end: as UTF-8 reads those bytes
        let Tokenizer::Gpt2(bpe) = &t else {
            panic!("not GPT-2's")
        };
        let of =
            |b: u8| (0..GPT2_VOCAB as u32).find(|&i| bpe.decode_bytes(&[i]).ok() == Some(vec![b]));
        let (c3, a9) = (of(0xC3).unwrap(), of(0xA9).unwrap());
        for (ids, want) in [
            (vec![c3, a9], "é"),
            (vec![a9, c3], "\u{FFFD}\u{FFFD}"),
            (vec![c3, a9, c3], "é\u{FFFD}"),
        ] {
            assert_eq!(streamed(&ids), want, "{ids:?}");
        }
    }

    #[test]
    fn char_tokenizer_round_trips_and_names_unknown_characters() {
        let t = Tokenizer::char_from_corpus("to be or not");
        assert_eq!(t.vocab_size(), 7);
        let ids = t.encode("not to be").unwrap();
        assert_eq!(t.decode(&ids), "not to be");
        let err = t.encode("nut").unwrap_err().to_string();
        assert!(err.contains("'u' at line 1, column 2"), "{err}");
        let t = Tokenizer::char_from_corpus("to be\nor not");
        let err = t.encode("to be\nor zot, yea").unwrap_err().to_string();
        assert!(
            err.contains("'z' at line 2, column 4")
                && err.contains("(and 3 other characters it lacks: ',' 'a' 'y')"),
            "{err}"
        );
    }
}
