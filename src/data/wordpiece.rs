//! BERT's WordPiece tokenizer, as Hugging Face's `BertTokenizer` (the
//! `tokenizers` library's `BertNormalizer`, `BertPreTokenizer` and
//! `WordPiece`) does it: clean the text (drop NUL, U+FFFD and every
//! control, format and private-use character, whitespace to spaces), space out CJK
//! ideographs, strip accents (NFD, then drop the nonspacing marks, Mn: not
//! the spacing ones, Mc, that Indic scripts write vowels with), lowercase,
//! split on whitespace and split off punctuation (ASCII's and every Unicode
//! category P*), then cut each word into the longest vocabulary pieces from
//! the left (`##` marks a piece inside a word); a word that cannot be cut,
//! or longer than 100 characters, is `[UNK]`; a special token written in
//! the text is kept whole. A folder's `tokenizer_config.json` (or, without
//! one, its `tokenizer.json`) says which of those steps a model takes
//! ([`Normalizer`]).

use super::MAX_VOCAB;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
// `tokenizers`' own category tables (older than Unicode's current ones):
// a character assigned since is a letter of its word there, and here
use unicode_categories::UnicodeCategories;
use unicode_normalization::UnicodeNormalization;

/// Which of BERT's normalizing steps a vocabulary's model was trained
/// with, as `tokenizer_config.json` names them (`do_lower_case`,
/// `strip_accents`, `tokenize_chinese_chars`): lowercase; strip accents
/// (where unset, as lowercasing does); space out CJK ideographs. The
/// default is BERT uncased's, and `transformers`' for a folder that does
/// not say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Normalizer {
    pub lowercase: bool,
    pub strip_accents: Option<bool>,
    pub chinese_chars: bool,
}

impl Default for Normalizer {
    fn default() -> Self {
        Normalizer {
            lowercase: true,
            strip_accents: None,
            chinese_chars: true,
        }
    }
}

impl Normalizer {
    /// BERT uncased's steps (what a record without a normalizer means).
    pub fn is_uncased(&self) -> bool {
        *self == Self::default()
    }

    /// As `dir`'s `tokenizer_config.json` says; where it has none, as its
    /// `tokenizer.json`'s `BertNormalizer` says (what `AutoTokenizer`
    /// reads then); the default without either.
    pub fn of_folder(dir: &Path) -> Result<Self> {
        let config = dir.join("tokenizer_config.json");
        let tokenizer = dir.join("tokenizer.json");
        if config.exists() {
            Self::of_config(&config)
        } else if tokenizer.exists() {
            Self::of_tokenizer_json(&tokenizer)
        } else {
            Ok(Self::default())
        }
    }

    /// As a `tokenizer_config.json` says (`do_lower_case`,
    /// `strip_accents`, `tokenize_chinese_chars`).
    fn of_config(path: &Path) -> Result<Self> {
        let json = read_json(path)?;
        let default = Self::default();
        Ok(Normalizer {
            lowercase: json_flag(&json, "do_lower_case", path)?.unwrap_or(default.lowercase),
            strip_accents: json_flag(&json, "strip_accents", path)?,
            chinese_chars: json_flag(&json, "tokenize_chinese_chars", path)?
                .unwrap_or(default.chinese_chars),
        })
    }

    /// As a Hugging Face `tokenizer.json`'s `normalizer` says, which must
    /// be BERT's (`BertNormalizer`: `lowercase`, `strip_accents`,
    /// `handle_chinese_chars`, and `clean_text`, which this tokenizer always
    /// does); a file without a `model` is not Hugging Face's and says
    /// nothing.
    fn of_tokenizer_json(path: &Path) -> Result<Self> {
        let json = read_json(path)?;
        if json.get("model").is_none() {
            return Ok(Self::default());
        }
        let normalizer = &json["normalizer"];
        let kind = normalizer["type"].as_str();
        let clean = json_flag(normalizer, "clean_text", path)?;
        if kind != Some("BertNormalizer") || clean == Some(false) {
            let what = match kind {
                Some("BertNormalizer") => "a BertNormalizer with clean_text false".to_string(),
                Some(other) => format!("a {other}"),
                None => format!("{normalizer}"),
            };
            return Err(Error::Input(format!(
                "{}: its normalizer is {what}; a BERT's WordPiece here normalizes as \
                 BertNormalizer (clean_text true): write a tokenizer_config.json beside it \
                 (do_lower_case, strip_accents, tokenize_chinese_chars) to say which steps it takes",
                path.display()
            )));
        }
        let default = Self::default();
        Ok(Normalizer {
            lowercase: json_flag(normalizer, "lowercase", path)?.unwrap_or(default.lowercase),
            strip_accents: json_flag(normalizer, "strip_accents", path)?,
            chinese_chars: json_flag(normalizer, "handle_chinese_chars", path)?
                .unwrap_or(default.chinese_chars),
        })
    }

    /// How messages name the steps.
    pub fn describe(&self) -> String {
        let strip = self.strip_accents.unwrap_or(self.lowercase);
        format!(
            "{}, accents {}, CJK ideographs {}",
            if self.lowercase {
                "lowercased"
            } else {
                "cased"
            },
            if strip { "stripped" } else { "kept" },
            if self.chinese_chars {
                "spaced"
            } else {
                "not spaced"
            }
        )
    }
}

/// A JSON file of a tokenizer's settings.
fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = crate::store::read_text(path)?;
    serde_json::from_str(&text).map_err(|e| Error::Input(format!("{}: {e}", path.display())))
}

/// `json`'s `key` of the file `path`: true, false, or unset (absent or null).
fn json_flag(json: &serde_json::Value, key: &str, path: &Path) -> Result<Option<bool>> {
    match json.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(Error::Input(format!(
            "{}: {key} is {other}; it must be true, false or null",
            path.display()
        ))),
    }
}

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
    normalizer: Normalizer,
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
            normalizer: Normalizer::default(),
        })
    }

    /// The same vocabulary, its text normalized by `normalizer`'s steps.
    pub fn with_normalizer(self, normalizer: Normalizer) -> Self {
        WordPiece { normalizer, ..self }
    }

    pub fn normalizer(&self) -> Normalizer {
        self.normalizer
    }

    /// From a `vocab.txt` (one token per line, line i is id i), BERT
    /// uncased's normalizer.
    fn from_vocab_file(path: &Path) -> Result<Self> {
        crate::store::regular_file(path)?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
        Self::new(text.lines().map(str::to_string).collect()).map_err(|e| match e {
            Error::Input(why) => Error::Input(format!("{}: {why}", path.display())),
            other => other,
        })
    }

    /// A Hugging Face folder's tokenizer: its `vocab.txt`, normalized as
    /// the folder says ([`Normalizer::of_folder`]).
    pub fn from_folder(dir: &Path) -> Result<Self> {
        let normalizer = Normalizer::of_folder(dir)?;
        Ok(Self::from_vocab_file(&dir.join("vocab.txt"))?.with_normalizer(normalizer))
    }

    /// The vocabulary in `dir`'s vocab.txt, checked against what a run or
    /// checkpoint recorded of it (`spec`), normalized as recorded: another
    /// vocabulary is refused in words.
    pub fn recorded_in(dir: &Path, spec: &crate::data::TokenizerSpec) -> Result<Self> {
        Self::recorded_at(&dir.join("vocab.txt"), spec)
    }

    /// [`WordPiece::recorded_in`] of the vocabulary file `path`.
    pub fn recorded_at(path: &Path, spec: &crate::data::TokenizerSpec) -> Result<Self> {
        let normalizer = match spec {
            crate::data::TokenizerSpec::WordPiece { normalizer, .. } => *normalizer,
            _ => Normalizer::default(),
        };
        let wp = Self::from_vocab_file(path)?.with_normalizer(normalizer);
        if &wp.spec() != spec {
            let [file, model] = crate::data::describe_apart(&wp.spec(), spec);
            return Err(Error::Input(format!(
                "{} is not the WordPiece vocabulary this model was trained with ({file}; the \
                 model's: {model})",
                path.display(),
            )));
        }
        Ok(wp)
    }

    pub fn vocab_size(&self) -> usize {
        self.size
    }

    /// The checksum of the tokens in id order, as [`WordPiece::spec`]
    /// records it.
    pub fn checksum(&self) -> &str {
        &self.checksum
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

    /// What a checkpoint records of the vocabulary: its size, checksum and
    /// normalizer.
    pub fn spec(&self) -> crate::data::TokenizerSpec {
        crate::data::TokenizerSpec::WordPiece {
            tokens: self.size,
            checksum: self.checksum.clone(),
            normalizer: self.normalizer,
        }
    }

    /// The ids of `text`'s pieces, without `[CLS]` / `[SEP]` around them.
    /// A special token written in the text ([`SPECIAL`], exactly so: case
    /// and all) is its own id, as `transformers` keeps its special tokens
    /// whole; the text on each side of one is tokenized alone.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let specials = [self.pad, self.unk, self.cls, self.sep, self.mask];
        let mut ids = Vec::new();
        let mut start = 0;
        for (at, _) in text.match_indices('[') {
            if at < start {
                continue;
            }
            let found = SPECIAL
                .iter()
                .zip(specials)
                .find(|(t, _)| text[at..].starts_with(**t));
            if let Some((token, id)) = found {
                self.encode_words(&text[start..at], &mut ids);
                ids.push(id);
                start = at + token.len();
            }
        }
        self.encode_words(&text[start..], &mut ids);
        ids
    }

    /// The pieces of the words of a text without special tokens.
    fn encode_words(&self, text: &str, ids: &mut Vec<u32>) {
        for word in basic_tokens(text, self.normalizer) {
            self.word_pieces(&word, ids);
        }
    }

    /// `[CLS] pieces [SEP]`, cut to `max_len` (keeping the `[SEP]`), as a
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

    /// A classifier's input and token types for `text`, or for the pair
    /// `text`, `pair`: `[CLS] A [SEP]` (types 0) then `B [SEP]` (types 1),
    /// cut to `max_len` as `transformers`' (fast) tokenizer cuts a pair
    /// with `truncation="longest_first"`: of the r pieces there is room
    /// for, the shorter keeps all of its own if they are at most r / 2 and
    /// the longer the rest; else the shorter keeps r / 2 and the longer the
    /// rest (A counts as the shorter when they are as long).
    pub fn encode_pair(
        &self,
        text: &str,
        pair: Option<&str>,
        max_len: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        // an empty second text is none, as transformers takes it
        let Some(pair) = pair.filter(|p| !p.is_empty()) else {
            let ids = self.encode_for_classifier(text, max_len);
            let types = vec![0; ids.len()];
            return (ids, types);
        };
        let (mut a, mut b) = (self.encode(text), self.encode(pair));
        let room = max_len.saturating_sub(3);
        if a.len() + b.len() > room {
            let swap = a.len() > b.len();
            let short = a.len().min(b.len());
            let (short, long) = match short > room / 2 {
                true => (room / 2, room - room / 2),
                false => (short, room - short),
            };
            let (na, nb) = if swap { (long, short) } else { (short, long) };
            a.truncate(na);
            b.truncate(nb);
        }
        let mut ids = Vec::with_capacity(a.len() + b.len() + 3);
        ids.push(self.cls);
        ids.extend(&a);
        ids.push(self.sep);
        let first = ids.len();
        ids.extend(&b);
        ids.push(self.sep);
        let mut types = vec![0; first];
        types.resize(ids.len(), 1);
        (ids, types)
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

/// A character the cleaning drops: NUL, U+FFFD, and the controls,
/// formats (zero-width joiners) and private use (`tokenizers`'
/// `BertNormalizer`: `is_other()`, which leaves unassigned code points in
/// the word, where the older Python tokenizer dropped them) but the tab
/// and line breaks, which are whitespace.
fn is_dropped(c: char) -> bool {
    match c {
        '\t' | '\n' | '\r' => false,
        '\u{fffd}' => true,
        _ => c.is_other(),
    }
}

/// The ideographs spaced out as words of their own: `tokenizers`'
/// `is_chinese_char` (whose Extension E starts at U+2B920; the Python
/// tokenizer's at U+2B820).
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F | 0x2B920..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

/// ASCII's punctuation and symbols, and every Unicode punctuation category.
fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation() || c.is_punctuation()
}

/// BERT's basic tokenization: words and punctuation marks, normalized by
/// `normalizer`'s steps.
fn basic_tokens(text: &str, normalizer: Normalizer) -> Vec<String> {
    let mut spaced = String::with_capacity(text.len());
    for c in text.chars() {
        if is_dropped(c) {
            continue;
        }
        if c.is_whitespace() {
            spaced.push(' ');
        } else if normalizer.chinese_chars && is_cjk(c) {
            spaced.push(' ');
            spaced.push(c);
            spaced.push(' ');
        } else {
            spaced.push(c);
        }
    }
    let strip = normalizer.strip_accents.unwrap_or(normalizer.lowercase);
    let mut out = Vec::new();
    for word in spaced.split_whitespace() {
        let mut plain = word.to_string();
        if strip {
            plain = plain.nfd().filter(|&c| !c.is_mark_nonspacing()).collect();
        }
        if normalizer.lowercase {
            // character by character, as `tokenizers` lowercases: no final sigma
            plain = plain.chars().flat_map(char::to_lowercase).collect();
        }
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

/// BERT's special tokens, first in a learned vocabulary (ids 0 to 4).
pub const SPECIAL: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// Learns a WordPiece vocabulary of `size` tokens from `text` by the
/// WordPiece training algorithm (Schuster and Nakajima, 2012): the words of
/// BERT's basic tokenization, each split into its characters (`##` before
/// every one but the first), then, until the vocabulary has `size` tokens,
/// the adjacent pair (a, b) whose merge raises the corpus's likelihood
/// under a unigram model of its pieces the most is merged into one piece
/// everywhere. That gain is count(ab) ln(count(ab) n / (count(a) count(b)))
/// for n pieces in all: Hugging Face's course drops the leading count(ab)
/// (its score, count(ab) / (count(a) count(b)), spends a vocabulary on
/// pairs seen once, and left "here" in four pieces at 8,000 tokens of
/// Shakespeare). Ties go to the more frequent pair, then the pair that
/// sorts first, so the result is the same on every run. The vocabulary is
/// the special tokens, every character of the corpus's words in both forms
/// it takes (so no word of the corpus becomes `[UNK]` but one longer than
/// `MAX_WORD`, which is not learned from), then the merges in the order
/// they were made. Fewer tokens result where nothing is left to merge (a
/// note says so); a `size` below the special tokens and the characters is
/// refused, and so is a text without a word to learn from. A `size` past
/// [`MAX_VOCAB`] (16-bit token ids) is refused before the text is read,
/// and so is a text with more characters than that holds: no vocabulary
/// of either could be used, and each merge scans every pair of pieces,
/// so learning one took minutes before it was refused.
pub fn learn(text: &str, size: usize) -> Result<WordPiece> {
    if size > MAX_VOCAB {
        return Err(Error::Config(format!(
            "--vocab-size {size}: token ids are stored as 16-bit numbers (llm.c's shard \
             format), which hold at most {MAX_VOCAB} tokens"
        )));
    }
    let words = word_counts(text)?;
    let mut names: Vec<String> = Vec::new();
    let mut index: HashMap<String, u32> = HashMap::new();
    let mut intern = |name: String, names: &mut Vec<String>| -> u32 {
        *index.entry(name.clone()).or_insert_with(|| {
            names.push(name);
            names.len() as u32 - 1
        })
    };
    // every character, as a word's first and as a continuation, sorted
    let mut alphabet: Vec<String> = words
        .iter()
        .flat_map(|(w, _)| w.chars().enumerate().map(|(i, c)| piece(i, c)))
        .collect();
    alphabet.sort();
    alphabet.dedup();
    if SPECIAL.len() + alphabet.len() > MAX_VOCAB {
        return Err(Error::Input(format!(
            "the text's {} characters (as first and as continuing pieces) and the {} special \
             tokens are more than the {MAX_VOCAB} tokens 16-bit token ids hold: no WordPiece \
             vocabulary learned from it fits; give a text with fewer distinct characters, or \
             prepare it with --tokenizer gpt2",
            alphabet.len(),
            SPECIAL.len()
        )));
    }
    if size < SPECIAL.len() + alphabet.len() {
        return Err(Error::Config(format!(
            "--vocab-size {size} cannot hold the {} special tokens and the text's {} \
             characters (as first and as continuing pieces): give at least {}",
            SPECIAL.len(),
            alphabet.len(),
            SPECIAL.len() + alphabet.len()
        )));
    }
    for a in alphabet {
        intern(a, &mut names);
    }
    let mut splits: Vec<Vec<u32>> = words
        .iter()
        .map(|(w, _)| {
            let pieces = w.chars().enumerate().map(|(i, c)| piece(i, c));
            pieces.map(|name| intern(name, &mut names)).collect()
        })
        .collect();
    let mut merges = Merges::default();
    for (i, (split, (_, n))) in splits.iter().zip(&words).enumerate() {
        merges.add(i, split, *n as i64);
    }
    while SPECIAL.len() + names.len() < size {
        let Some((a, b)) = merges.best(&names) else {
            break;
        };
        let joined = format!(
            "{}{}",
            names[a as usize],
            names[b as usize].trim_start_matches("##")
        );
        let ab = intern(joined, &mut names);
        let mut touched = merges.words.remove(&(a, b)).unwrap_or_default();
        touched.sort_unstable();
        touched.dedup();
        for w in touched {
            let n = words[w].1 as i64;
            merges.add(w, &splits[w], -n);
            let new = merged(&splits[w], a, b, ab);
            merges.add(w, &new, n);
            splits[w] = new;
        }
        // a piece two merges spell alike stays one token (`intern`)
        merges.forget(a, b);
    }
    if SPECIAL.len() + names.len() < size {
        crate::errln!(
            "note: the text's words give {} pieces: the vocabulary learned has {} tokens, fewer than the --vocab-size {size} asked",
            names.len(),
            SPECIAL.len() + names.len()
        );
    }
    let tokens = SPECIAL.iter().map(|s| s.to_string()).chain(names).collect();
    WordPiece::new(tokens)
}

/// Character `c` at place `i` of a word as a piece: a word's first as it
/// is, a continuation with `##`.
fn piece(i: usize, c: char) -> String {
    match i {
        0 => c.to_string(),
        _ => format!("##{c}"),
    }
}

/// How often each word of at most [`MAX_WORD`] characters occurs, sorted
/// (a longer word is one [UNK] however it is split: nothing to learn).
fn word_counts(text: &str) -> Result<Vec<(String, u64)>> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    for w in basic_tokens(text, Normalizer::default()) {
        if w.chars().count() <= MAX_WORD {
            *counts.entry(w).or_default() += 1;
        }
    }
    if counts.is_empty() {
        return Err(Error::Input(format!(
            "the text has no word of at most {MAX_WORD} characters (the longest WordPiece \
             encodes; a longer one is a single [UNK]): nothing to learn a vocabulary from; \
             give a text of words separated by spaces"
        )));
    }
    let mut words: Vec<(String, u64)> = counts.into_iter().collect();
    words.sort();
    Ok(words)
}

/// `split` with each adjacent (a, b), left to right, replaced by `ab`.
fn merged(split: &[u32], a: u32, b: u32, ab: u32) -> Vec<u32> {
    let mut new = Vec::with_capacity(split.len());
    let mut i = 0;
    while i < split.len() {
        if i + 1 < split.len() && (split[i], split[i + 1]) == (a, b) {
            new.push(ab);
            i += 2;
        } else {
            new.push(split[i]);
            i += 1;
        }
    }
    new
}

/// The training state: how often each piece and each adjacent pair occurs
/// over the corpus (weighted by the words' counts), the pairs by count,
/// and the words each pair occurs in (possibly more than are left: checked
/// on merging).
#[derive(Default)]
struct Merges {
    pieces: HashMap<u32, i64>,
    /// The pieces' counts together.
    total: i64,
    pairs: HashMap<(u32, u32), i64>,
    /// (count, pair) of every pair in `pairs`: [`Merges::best`] reads
    /// them from the most frequent down and stops where no pair left can
    /// gain as much as the best so far.
    by_count: std::collections::BTreeSet<(i64, (u32, u32))>,
    words: HashMap<(u32, u32), Vec<usize>>,
}

impl Merges {
    /// Counts word `w`'s pieces and pairs `n` more times (less where negative).
    fn add(&mut self, w: usize, split: &[u32], n: i64) {
        for &p in split {
            *self.pieces.entry(p).or_default() += n;
        }
        self.total += n * split.len() as i64;
        for pair in split.windows(2) {
            let pair = (pair[0], pair[1]);
            let c = self.pairs.entry(pair).or_default();
            self.by_count.remove(&(*c, pair));
            *c += n;
            if *c <= 0 {
                self.pairs.remove(&pair);
            } else {
                self.by_count.insert((*c, pair));
                if n > 0 {
                    self.words.entry(pair).or_default().push(w);
                }
            }
        }
    }

    /// Forgets the pair `a b` (merged: none is left to merge again).
    fn forget(&mut self, a: u32, b: u32) {
        let pair = (a, b);
        if let Some(c) = self.pairs.remove(&pair) {
            self.by_count.remove(&(c, pair));
        }
    }

    /// The pair to merge next: the highest likelihood gain, count(ab)
    /// ln(count(ab) n / (count(a) count(b))), then the higher count(ab),
    /// then the names that sort first. A pair seen c times gains at most
    /// c ln(n / c) (each of its pieces is seen at least c times), which
    /// falls with c below n / e: read from the most frequent down, the
    /// pairs past the first whose bound is under the best gain found
    /// cannot win, and are not scored (scoring every pair at every merge
    /// took minutes for a vocabulary of tens of thousands).
    fn best(&self, names: &[String]) -> Option<(u32, u32)> {
        let total = self.total as f64;
        let score = |(a, b): (u32, u32), n: i64| {
            let (n, fa, fb) = (n as f64, self.pieces[&a] as f64, self.pieces[&b] as f64);
            n * (n * total / (fa * fb)).ln()
        };
        let name = |p: (u32, u32)| (&names[p.0 as usize], &names[p.1 as usize]);
        let mut best: Option<((u32, u32), i64, f64)> = None;
        for &(n, pair) in self.by_count.iter().rev() {
            if let Some((_, _, top)) = best {
                let c = n as f64;
                let bound = c * (total / c).ln();
                // a margin for rounding: the bound and a score are computed apart
                if c < total / std::f64::consts::E && bound + 1e-9 * (bound.abs() + 1.0) < top {
                    break;
                }
            }
            let x = (pair, n, score(pair, n));
            let wins = best.is_none_or(|y| {
                x.2.total_cmp(&y.2)
                    .then(x.1.cmp(&y.1))
                    .then_with(|| name(y.0).cmp(&name(x.0)))
                    .is_gt()
            });
            if wins {
                best = Some(x);
            }
        }
        best.map(|(pair, ..)| pair)
    }
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

    /// Where `tokenizers` (BertTokenizerFast) parts from the Python
    /// tokenizer the fixture was checked against: an unassigned code point
    /// (U+0378) stays in its word, which this vocabulary cannot spell
    /// ([UNK]); U+2B820, before `tokenizers`' Extension E range (U+2B920),
    /// is a letter of its word, not a word of its own.
    #[test]
    fn unassigned_code_points_and_ideographs_are_read_as_tokenizers_reads_them() {
        let toks = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "ma", "##bz", "mabz",
        ]
        .into_iter()
        .chain(["kx", "##\u{2B820}", "##yq", "\u{2B820}", "yq"]);
        let wp = WordPiece::new(toks.map(String::from).collect()).unwrap();
        assert_eq!(wp.encode("ma\u{378}bz"), [1]);
        // U+FFFD (a symbol, So) and a zero-width joiner (Cf) are dropped
        assert_eq!(wp.encode("ma\u{FFFD}b\u{200D}z"), [7]);
        assert_eq!(wp.encode("kx\u{2B820}yq"), [8, 9, 10]);
        // assigned since `tokenizers`' tables were made, so letters of their
        // word there: an Arabic end-of-text mark (Po since Unicode 14), a
        // nonspacing mark (Mn) and a format character (Cf), neither split
        // off, stripped nor dropped
        for c in ['\u{61D}', '\u{898}', '\u{890}', '\u{2E4F}'] {
            assert_eq!(wp.encode(&format!("ma{c}bz")), [1], "U+{:04X}", c as u32);
        }
    }

    #[test]
    fn a_text_without_a_word_wordpiece_encodes_is_refused_before_learning() {
        let started = std::time::Instant::now();
        let err = learn(&"x".repeat(200_000), 100).err().unwrap().to_string();
        assert!(err.contains("no word of at most 100"), "{err}");
        assert!(started.elapsed().as_secs() < 5);
    }

    /// More tokens than 16-bit ids hold, asked for or needed for the
    /// text's characters, are refused at once: learning them ran merges
    /// for minutes before the shards refused the result.
    #[test]
    fn a_vocabulary_past_16_bit_ids_is_refused_before_learning() {
        let started = std::time::Instant::now();
        let err = learn(&course(), MAX_VOCAB + 1).err().unwrap().to_string();
        assert!(
            err.contains("--vocab-size 65537") && err.contains("at most 65536 tokens"),
            "{err}"
        );
        // 66,000 ideographs, each a word of its own: 66,005 tokens at least
        let text: String = (0x3400..0x4DC0)
            .chain(0x4E00..0xA000)
            .chain(0x20000..)
            .filter_map(char::from_u32)
            .take(66_000)
            .collect();
        let err = learn(&text, MAX_VOCAB).err().unwrap().to_string();
        assert!(
            err.contains("text's 66000 characters") && err.contains("more than the 65536"),
            "{err}"
        );
        assert!(started.elapsed().as_secs() < 10);
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
    fn a_pair_is_two_segments_cut_from_the_longer_first() {
        let wp = vocab();
        // hello hello ! (3) and runnings , (4): [CLS] A [SEP] B [SEP]
        let (ids, types) = wp.encode_pair("hello hello!", Some("runnings,"), 20);
        assert_eq!(ids, vec![2, 8, 8, 9, 3, 14, 15, 16, 10, 3]);
        assert_eq!(types, vec![0, 0, 0, 0, 0, 1, 1, 1, 1, 1]);
        // 8 positions leave 5: the shorter, A (3), is over 5 / 2 and keeps
        // 2, B the other 3; 7 positions leave 4: 2 each; 10 leave 7: A
        // keeps its 3, B 4 (all of both); 9 leave 6: A 3, B 3
        let (ids, types) = wp.encode_pair("hello hello!", Some("runnings,"), 8);
        assert_eq!(ids, vec![2, 8, 8, 3, 14, 15, 16, 3]);
        assert_eq!(types, vec![0, 0, 0, 0, 1, 1, 1, 1]);
        let (ids, _) = wp.encode_pair("hello hello!", Some("runnings,"), 7);
        assert_eq!(ids, vec![2, 8, 8, 3, 14, 15, 3]);
        let (ids, _) = wp.encode_pair("runnings,", Some("hello hello!"), 9);
        assert_eq!(ids, vec![2, 14, 15, 16, 3, 8, 8, 9, 3]);
        // as long as each other (3 and 3) in 5: A is the shorter, B gets the odd one
        let (ids, _) = wp.encode_pair("hello hello!", Some("runnings"), 8);
        assert_eq!(ids, vec![2, 8, 8, 3, 14, 15, 16, 3]);
        // the longer first: A (4) keeps 3 of 5, B (3) keeps 2
        let (ids, _) = wp.encode_pair("runnings,", Some("hello hello!"), 8);
        assert_eq!(ids, vec![2, 14, 15, 16, 3, 8, 8, 3]);
        // an empty A leaves B all the room
        let (ids, _) = wp.encode_pair("", Some("runnings,"), 6);
        assert_eq!(ids, vec![2, 3, 14, 15, 16, 3]);
        // one text: as encode_for_classifier, every type 0
        let (ids, types) = wp.encode_pair("hello hello hello", None, 4);
        assert_eq!((ids, types), (vec![2, 8, 8, 3], vec![0; 4]));
    }

    /// Hugging Face course's corpus: hug x10, pug x5, pun x12, bun x4, hugs x5.
    fn course() -> String {
        [
            ("hug", 10),
            ("pug", 5),
            ("pun", 12),
            ("bun", 4),
            ("hugs", 5),
        ]
        .iter()
        .flat_map(|&(w, n)| std::iter::repeat_n(w, n))
        .collect::<Vec<_>>()
        .join(" ")
    }

    #[test]
    fn learning_merges_the_pair_that_raises_the_likelihood_most() {
        let tokens =
            |wp: &WordPiece| -> Vec<String> { wp.vocab_text().lines().map(String::from).collect() };
        // the specials, the alphabet in both forms, then the merges. Of 113
        // pieces, ##u ##g (20 times; ##u 36, ##g 20) gains 20 ln(20 x 113 /
        // (36 x 20)) = 22.9, above p ##u's 19.5, ##u ##n's 18.3, h ##u's
        // 17.2 and ##g ##s's 8.7 (the course's score, 5 / (20 x 5), would
        // take ##g ##s: a pair seen 5 times)
        let wp = learn(&course(), 13).unwrap();
        assert_eq!(
            tokens(&wp),
            [
                "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "##g", "##n", "##s", "##u", "b", "h",
                "p", "##ug"
            ]
        );
        // then, of 93 pieces, ##u ##n: 16 ln(16 x 93 / (16 x 16)) = 28.2,
        // above h ##ug's 15 ln(15 x 93 / (15 x 20)) = 23.1; and so on until
        // every word is one piece and nothing is left to merge
        let wp = learn(&course(), 100).unwrap();
        assert_eq!(tokens(&wp)[13], "##un");
        for w in ["hug", "pug", "pun", "bun", "hugs"] {
            assert_eq!(wp.encode(w).len(), 1, "{w}: {:?}", wp.encode(w));
        }
        assert!(wp.vocab_size() < 100, "{}", wp.vocab_size());
        let err = learn(&course(), 11).err().unwrap().to_string();
        assert!(err.contains("give at least 12"), "{err}");
    }

    /// A corpus on which the likelihood rule, frequency alone (BPE's rule)
    /// and the course's score each merge a different pair first, worked
    /// out by hand. Words: "a" x60, "ab" x20, "xq" x10, "zk" x1; pieces
    /// a 80, ##b 20, x 10, ##q 10, z 1, ##k 1 (n = 122); pairs a ##b 20,
    /// x ##q 10, z ##k 1.
    /// - frequency: a ##b (20 times);
    /// - the course's count(ab) / (count(a) count(b)): a ##b 20 / 1,600 =
    ///   0.0125, x ##q 10 / 100 = 0.1, z ##k 1 / 1 = 1: z ##k;
    /// - the gain count(ab) ln(count(ab) n / (count(a) count(b))): a ##b
    ///   20 ln(2,440 / 1,600) = 8.44, x ##q 10 ln(1,220 / 100) = 25.0,
    ///   z ##k ln 122 = 4.80: x ##q.
    ///
    /// Then, of 112 pieces, a ##b gains 20 ln(2,240 / 1,600) = 6.73 and
    /// z ##k ln 112 = 4.72: ab; then z ##k (ln 92). Frequency would have
    /// merged ab, xq, zk; the course's score zk, xq, ab.
    #[test]
    fn the_likelihood_rule_merges_neither_the_most_frequent_nor_the_courses_pair() {
        let corpus = [("a", 60), ("ab", 20), ("xq", 10), ("zk", 1)]
            .iter()
            .flat_map(|&(w, n)| std::iter::repeat_n(w, n))
            .collect::<Vec<_>>()
            .join(" ");
        let learned = |size| -> Vec<String> {
            let wp = learn(&corpus, size).unwrap();
            wp.vocab_text()
                .lines()
                .skip(SPECIAL.len())
                .map(String::from)
                .collect()
        };
        let alphabet = ["##b", "##k", "##q", "a", "x", "z"];
        assert_eq!(learned(11), alphabet);
        assert_eq!(learned(12)[6..], ["xq"]);
        assert_eq!(learned(14)[6..], ["xq", "ab", "zk"]);
    }

    #[test]
    fn a_learned_vocabulary_covers_every_character_and_is_the_same_every_time() {
        let text = "Élan, naïve café-goers! 世界 \"Quoth\" the raven; nevermore... 42 times, 4242.";
        let corpus = text.repeat(3) + " " + &crate::data::SHAKESPEARE[..20_000];
        let wp = learn(&corpus, 400).unwrap();
        assert_eq!(wp.vocab_size(), 400);
        // every word of the corpus encodes without [UNK], in fewer pieces
        // than characters, and reads back as BERT's basic tokens
        let ids = wp.encode(&corpus);
        assert!(!ids.contains(&wp.unk));
        let letters: usize = basic_tokens(&corpus, Normalizer::default())
            .iter()
            .map(|w| w.chars().count())
            .sum();
        assert!(
            ids.len() < letters,
            "{} pieces for {letters} characters",
            ids.len()
        );
        let more = learn(&corpus, 800).unwrap();
        assert!(
            more.encode(&corpus).len() < ids.len(),
            "more merges, fewer pieces"
        );
        assert_eq!(
            wp.decode(&wp.encode(text)),
            basic_tokens(text, Normalizer::default())
                .join(" ")
                .replace(" ##", "")
        );
        assert!(wp
            .vocab_text()
            .lines()
            .any(|t| t.starts_with("##") && t.len() > 3));
        // the same on every run, whatever order the hash maps visit pairs in
        for _ in 0..3 {
            assert_eq!(learn(&corpus, 400).unwrap().vocab_text(), wp.vocab_text());
        }
    }

    /// tests/fixtures/wordpiece (scripts/make_wordpiece_fixture.py):
    /// `transformers`' ids of texts in many scripts, cased and uncased.
    #[test]
    fn every_script_gives_the_ids_transformers_gives_cased_and_uncased() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wordpiece");
        let text = std::fs::read_to_string(dir.join("ids.json")).unwrap();
        let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert!(cases.len() >= 15);
        let cased = Normalizer {
            lowercase: false,
            ..Normalizer::default()
        };
        let mut wrong = Vec::new();
        for (name, normalizer) in [("uncased", Normalizer::default()), ("cased", cased)] {
            // the fixture folder has no tokenizer_config.json: uncased
            let wp = WordPiece::from_folder(&dir)
                .unwrap()
                .with_normalizer(normalizer);
            for case in cases {
                let text = case["text"].as_str().unwrap();
                let want: Vec<u32> = case[name]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                let ours = wp.encode(text);
                let differing = ours.len().abs_diff(want.len())
                    + ours.iter().zip(&want).filter(|(a, b)| a != b).count();
                if differing > 0 {
                    wrong.push(format!(
                        "{name} {text:?}: {differing} ids differ\n ours   {ours:?}\n theirs {want:?}"
                    ));
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn a_folder_tokenizes_as_its_tokenizer_config_says() {
        let toks = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Café", "Cafe", "café", "cafe", "世界",
            "世", "界",
        ];
        let dir = crate::testdir::TestDir::new("wordpiece-config");
        let vocab: Vec<String> = toks.iter().map(|s| s.to_string()).collect();
        std::fs::write(dir.path().join("vocab.txt"), vocab.join("\n")).unwrap();
        let config = dir.path().join("tokenizer_config.json");
        let ids = |json: Option<&str>| {
            match json {
                Some(j) => std::fs::write(&config, j).unwrap(),
                None => std::fs::remove_file(&config).unwrap_or(()),
            }
            WordPiece::from_folder(dir.path())
                .map(|wp| (wp.encode("Café 世界"), wp.spec()))
                .map_err(|e| e.to_string())
        };
        let uncased = ids(None).unwrap();
        assert_eq!(uncased.0, [8, 10, 11]);
        assert_eq!(ids(Some(r#"{"do_lower_case": true}"#)).unwrap(), uncased);
        let cased = ids(Some(r#"{"do_lower_case": false}"#)).unwrap();
        assert_eq!(cased.0, [5, 10, 11]);
        let stripped = r#"{"do_lower_case": false, "strip_accents": true}"#;
        assert_eq!(ids(Some(stripped)).unwrap().0, [6, 10, 11]);
        let accents = r#"{"do_lower_case": true, "strip_accents": false}"#;
        assert_eq!(ids(Some(accents)).unwrap().0, [7, 10, 11]);
        let whole = r#"{"tokenize_chinese_chars": false}"#;
        assert_eq!(ids(Some(whole)).unwrap().0, [8, 9]);
        // the record tells a cased vocabulary from the same one uncased,
        // and reads as before where it is uncased
        assert_ne!(cased.1, uncased.1);
        let record = serde_json::to_string(&uncased.1).unwrap();
        assert!(!record.contains("normalizer"), "{record}");
        let record = serde_json::to_string(&cased.1).unwrap();
        let back: crate::data::TokenizerSpec = serde_json::from_str(&record).unwrap();
        assert_eq!(back, cased.1);
        let wp = WordPiece::recorded_in(dir.path(), &cased.1).unwrap();
        assert_eq!(wp.encode("Café"), [5]);
        let err = ids(Some(r#"{"do_lower_case": "no"}"#)).unwrap_err();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("do_lower_case"),
            "{err}"
        );
    }

    /// A folder with tokenizer.json and no tokenizer_config.json
    /// normalizes as its BertNormalizer says: what `transformers`'
    /// AutoTokenizer (5.24) made of "Hello Café 世界" from such folders,
    /// each saved by BertTokenizer with the steps named and its
    /// tokenizer_config.json removed.
    #[test]
    fn a_folder_with_only_tokenizer_json_normalizes_as_its_bert_normalizer() {
        let toks = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "Hello", "cafe", "café", "Café",
            "Cafe", "世界", "世", "界",
        ];
        let dir = crate::testdir::TestDir::new("wordpiece-tokenizer-json");
        std::fs::write(dir.path().join("vocab.txt"), toks.join("\n")).unwrap();
        let encode = |normalizer: &str| {
            let json =
                format!(r#"{{"model": {{"type": "WordPiece"}}, "normalizer": {normalizer}}}"#);
            std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
            WordPiece::from_folder(dir.path())
                .map(|wp| {
                    wp.encode("Hello Café 世界")
                        .iter()
                        .map(|&i| toks[i as usize])
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string())
        };
        let bert = |lower: &str, strip: &str, cjk: &str| {
            format!(
                r#"{{"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": {cjk}, "strip_accents": {strip}, "lowercase": {lower}}}"#
            )
        };
        assert_eq!(
            encode(&bert("false", "null", "true")).unwrap(),
            ["Hello", "Café", "世", "界"]
        );
        assert_eq!(
            encode(&bert("true", "false", "true")).unwrap(),
            ["hello", "café", "世", "界"]
        );
        assert_eq!(
            encode(&bert("false", "true", "false")).unwrap(),
            ["Hello", "Cafe", "世界"]
        );
        assert_eq!(
            encode(&bert("true", "null", "true")).unwrap(),
            ["hello", "cafe", "世", "界"]
        );
        // a tokenizer_config.json, where there is one, says
        std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
        assert_eq!(
            encode(&bert("false", "null", "true")).unwrap(),
            ["hello", "cafe", "世", "界"]
        );
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        // other normalizers are refused, by name
        let err = encode(r#"{"type": "Lowercase"}"#).unwrap_err();
        assert!(
            err.contains("tokenizer.json: its normalizer is a Lowercase"),
            "{err}"
        );
        let err = encode("null").unwrap_err();
        assert!(err.contains("its normalizer is null"), "{err}");
        // one sentence, not the source's indentation
        assert!(
            err.contains("normalizes as BertNormalizer") && !err.contains("  "),
            "{err}"
        );
        let err = encode(&bert("\"yes\"", "null", "true")).unwrap_err();
        assert!(err.contains("lowercase is \"yes\""), "{err}");
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
        // a file without a special token is named, once
        let short = wp.vocab_text().replace("[MASK]\n", "");
        std::fs::write(dir.path().join("vocab.txt"), short).unwrap();
        let err = WordPiece::from_folder(dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("vocab.txt: the WordPiece vocabulary has no [MASK]"),
            "{err}"
        );
        assert_eq!(err.matches("bad input").count(), 1, "{err}");
    }
}
