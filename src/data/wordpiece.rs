//! BERT's WordPiece tokenizer (uncased), as Hugging Face's `BertTokenizer`
//! does it: clean the text (drop control characters, whitespace to spaces),
//! space out CJK ideographs, split on whitespace, lowercase, strip accents
//! (NFD, combining marks dropped), split off punctuation, then cut each word
//! into the longest vocabulary pieces from the left (`##` marks a piece
//! inside a word); a word that cannot be cut, or longer than 100
//! characters, is `[UNK]`. Punctuation is ASCII's and the Unicode
//! punctuation of Latin-1, General Punctuation, CJK Symbols and the
//! fullwidth forms; other scripts' punctuation stays inside its word.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
use unicode_normalization::char::is_combining_mark;
use unicode_normalization::UnicodeNormalization;

/// A WordPiece vocabulary and its special tokens.
pub struct WordPiece {
    vocab: HashMap<String, u32>,
    /// The tokens in id order (a `vocab.txt`'s lines).
    tokens: Vec<String>,
    pub unk: u32,
    pub cls: u32,
    pub sep: u32,
    pub pad: u32,
    pub mask: u32,
    size: usize,
    /// Checksum of the tokens in id order (see [`WordPiece::spec`]).
    checksum: String,
}

const MAX_WORD: usize = 100;

impl WordPiece {
    /// From the tokens in id order (a `vocab.txt`'s lines).
    pub fn new(tokens: Vec<String>) -> Result<Self> {
        let size = tokens.len();
        let checksum = crate::store::checksum(tokens.join("\n").as_bytes());
        let vocab: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let special = |t: &str| {
            vocab
                .get(t)
                .copied()
                .ok_or_else(|| Error::Input(format!("the WordPiece vocabulary has no {t} token")))
        };
        Ok(WordPiece {
            unk: special("[UNK]")?,
            cls: special("[CLS]")?,
            sep: special("[SEP]")?,
            pad: special("[PAD]")?,
            mask: special("[MASK]")?,
            vocab,
            tokens,
            size,
            checksum,
        })
    }

    /// From a `vocab.txt` (one token per line, line i is id i).
    pub fn from_vocab_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
        Self::new(text.lines().map(str::to_string).collect())
    }

    /// The vocabulary in the one vocab.txt that `from_vocab_file` reads
    /// that `dir` holds, checked against what a run or checkpoint recorded
    /// of it (`spec`): another vocabulary is refused in words.
    pub fn recorded_in(dir: &Path, spec: &crate::data::TokenizerSpec) -> Result<Self> {
        let path = dir.join("vocab.txt");
        let wp = Self::from_vocab_file(&path)?;
        if &wp.spec() != spec {
            return Err(Error::Input(format!(
                "{} is not the WordPiece vocabulary this model was trained with ({}, \
                 checksum {}; the model's: {}, checksum {})",
                path.display(),
                crate::data::describe(&wp.spec()),
                wp.checksum,
                crate::data::describe(spec),
                match spec {
                    crate::data::TokenizerSpec::WordPiece { checksum, .. } => checksum.as_str(),
                    _ => "none",
                }
            )));
        }
        Ok(wp)
    }

    pub fn vocab_size(&self) -> usize {
        self.size
    }

    /// What `vocab.txt` holds: one token per line, in id order.
    pub fn vocab_text(&self) -> String {
        let mut text = self.tokens.join("\n");
        text.push('\n');
        text
    }

    /// The pieces of `ids` as text: a `##` piece joined to the one before
    /// it, the others spaced (an id past the vocabulary is `[UNK]`).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for &id in ids {
            let piece = self.tokens.get(id as usize).map_or("[UNK]", String::as_str);
            match piece.strip_prefix("##") {
                Some(rest) => out.push_str(rest),
                None => {
                    if !out.is_empty() {
                        out.push(' ');
                    }
                    out.push_str(piece);
                }
            }
        }
        out
    }

    /// What a checkpoint records of the vocabulary: its size and checksum.
    pub fn spec(&self) -> crate::data::TokenizerSpec {
        crate::data::TokenizerSpec::WordPiece {
            tokens: self.size,
            checksum: self.checksum.clone(),
        }
    }

    /// The ids of `text`'s pieces, without [CLS] / [SEP].
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        for word in basic_tokens(text) {
            self.word_pieces(&word, &mut ids);
        }
        ids
    }

    /// `[CLS] pieces [SEP]`, cut to `max_len` (keeping the [SEP]), as a
    /// classifier takes a sequence.
    pub fn encode_for_classifier(&self, text: &str, max_len: usize) -> Vec<u32> {
        let mut ids = vec![self.cls];
        ids.extend(
            self.encode(text)
                .into_iter()
                .take(max_len.saturating_sub(2)),
        );
        ids.push(self.sep);
        ids
    }

    fn word_pieces(&self, word: &str, out: &mut Vec<u32>) {
        let chars: Vec<char> = word.chars().collect();
        if chars.len() > MAX_WORD {
            return out.push(self.unk);
        }
        let at = out.len();
        let mut start = 0;
        let mut piece = String::new();
        while start < chars.len() {
            let mut end = chars.len();
            let mut found = None;
            while start < end {
                piece.clear();
                if start > 0 {
                    piece.push_str("##");
                }
                piece.extend(&chars[start..end]);
                if let Some(&id) = self.vocab.get(&piece) {
                    found = Some(id);
                    break;
                }
                end -= 1;
            }
            match found {
                Some(id) => out.push(id),
                None => {
                    out.truncate(at);
                    return out.push(self.unk);
                }
            }
            start = end;
        }
    }
}

fn is_control(c: char) -> bool {
    !matches!(c, '\t' | '\n' | '\r') && c.is_control()
}

fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F | 0x2B820..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

fn is_punctuation(c: char) -> bool {
    if c.is_ascii_punctuation() {
        return true;
    }
    matches!(c as u32,
        0xA1 | 0xA7 | 0xAB | 0xB6 | 0xB7 | 0xBB | 0xBF
        | 0x2010..=0x2027 | 0x2030..=0x2043 | 0x2045..=0x2051 | 0x2053..=0x205E
        | 0x3001..=0x3003 | 0x3008..=0x3011 | 0x3014..=0x301F | 0x3030 | 0x303D
        | 0xFF01..=0xFF03 | 0xFF05..=0xFF0A | 0xFF0C..=0xFF0F | 0xFF1A | 0xFF1B
        | 0xFF1F | 0xFF20 | 0xFF3B..=0xFF3D | 0xFF3F | 0xFF5B | 0xFF5D | 0xFF5F..=0xFF65)
}

/// BERT's basic tokenization: words and punctuation marks, lowercased and
/// without accents.
fn basic_tokens(text: &str) -> Vec<String> {
    let mut spaced = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '\0' || c == '\u{fffd}' || is_control(c) {
            continue;
        }
        if c.is_whitespace() {
            spaced.push(' ');
        } else if is_cjk(c) {
            spaced.push(' ');
            spaced.push(c);
            spaced.push(' ');
        } else {
            spaced.push(c);
        }
    }
    let mut out = Vec::new();
    for word in spaced.split_whitespace() {
        let plain: String = word
            .to_lowercase()
            .nfd()
            .filter(|&c| !is_combining_mark(c))
            .collect();
        let mut cur = String::new();
        for c in plain.chars() {
            if is_punctuation(c) {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                out.push(c.to_string());
            } else {
                cur.push(c);
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> WordPiece {
        let toks = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "hello", "!",
            ",", "cafe", "世", "界", "run", "##ning", "##s",
        ];
        WordPiece::new(toks.iter().map(|s| s.to_string()).collect()).unwrap()
    }

    #[test]
    fn splits_words_into_longest_pieces_lowercased_without_accents() {
        let wp = vocab();
        // un ##aff ##able | hello | ! | , | cafe (é -> e) | 世 | 界 | [UNK] (no piece fits) | run ##ning ##s
        assert_eq!(
            wp.encode("UNaffable Hello!, Café世界 xyz runnings"),
            vec![5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 14, 15, 16]
        );
        assert_eq!(
            wp.encode_for_classifier("hello hello hello", 4),
            vec![2, 8, 8, 3]
        );
        assert_eq!(wp.encode(&"a".repeat(101)), vec![1]);
        assert_eq!(wp.encode("\u{0}\u{7}  \t"), Vec::<u32>::new());
        assert_eq!(
            wp.decode(&[5, 6, 7, 8, 14, 15, 99]),
            "unaffable hello running [UNK]"
        );
    }

    #[test]
    fn a_vocabulary_is_written_as_read_and_checked_against_its_record() {
        let wp = vocab();
        let dir = crate::testdir::TestDir::new("wordpiece");
        std::fs::write(dir.path().join("vocab.txt"), wp.vocab_text()).unwrap();
        let back = WordPiece::recorded_in(dir.path(), &wp.spec()).unwrap();
        assert_eq!(back.vocab_text(), wp.vocab_text());
        assert_eq!(back.encode("unaffable"), vec![5, 6, 7]);
        // another vocabulary of the same size is refused, naming both
        let other = wp.vocab_text().replace("hello", "howdy");
        std::fs::write(dir.path().join("vocab.txt"), other).unwrap();
        let err = WordPiece::recorded_in(dir.path(), &wp.spec())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("vocab.txt is not the WordPiece vocabulary"),
            "{err}"
        );
    }
}
