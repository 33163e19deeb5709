//! Data: tokenizers, llm.c token shards, the embedded Shakespeare corpus and
//! the deterministic loader.

pub mod dialogue;
pub mod labelled;
pub mod loader;
pub mod shard;
pub mod tokenizer;
pub mod wordpiece;

pub use loader::{Batch, DataLoader, LoaderPosition, LossTerms, Part, Split, IGNORE};
pub use tokenizer::{Tokenizer, TokenizerSpec};

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The Shakespeare corpus compiled into the binary (see data/README.md).
pub const SHAKESPEARE: &str = include_str!("../../data/shakespeare.txt");

/// Fraction of a text corpus held out for validation (its tail).
pub const VAL_FRACTION: f64 = 0.1;
/// The fewest tokens a split of a text may have: one to read, one to predict.
pub const MIN_SPLIT_TOKENS: usize = 2;

/// Which tokenizer to build for a text corpus.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    Char,
    Gpt2,
}

impl TokenizerKind {
    /// As `--tokenizer` spells it.
    pub fn key(self) -> &'static str {
        match self {
            TokenizerKind::Char => "char",
            TokenizerKind::Gpt2 => "gpt2",
        }
    }
}

pub struct Dataset {
    pub name: String,
    pub tokenizer: Tokenizer,
    pub train: Split,
    pub val: Split,
    /// [`Dataset::fingerprint`], computed once however many ranks ask.
    fingerprint: std::sync::OnceLock<String>,
}

/// A hash of a token sequence, the same for a text and for its shards.
struct TokenHash(u64);

impl TokenHash {
    fn new() -> Self {
        TokenHash(0xcbf2_9ce4_8422_2325)
    }

    fn word(&mut self, x: u64) {
        self.0 = (self.0 ^ x)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }

    fn byte(&mut self, b: u8) {
        self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }

    /// Mixes in bytes (little-endian u16 tokens), eight at a time.
    fn bytes(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in words.by_ref() {
            self.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        words.remainder().iter().for_each(|&b| self.byte(b));
    }

    /// The same as [`TokenHash::bytes`] of the tokens' little-endian bytes,
    /// without making them.
    fn tokens(&mut self, tokens: &[u16]) {
        let mut quads = tokens.chunks_exact(4);
        for q in quads.by_ref() {
            self.word(q.iter().rev().fold(0u64, |w, &t| w << 16 | t as u64));
        }
        for &t in quads.remainder() {
            t.to_le_bytes().into_iter().for_each(|b| self.byte(b));
        }
    }

    fn split(&mut self, split: &Split) {
        for part in &split.parts {
            match part {
                Part::Memory(v) => self.tokens(v),
                Part::Mapped(s) => self.bytes(s.token_bytes()),
            }
        }
        // Where one split ends is part of the data.
        self.bytes(&(split.len() as u64).to_le_bytes());
    }
}

/// How a tokenizer is named in messages.
pub fn describe(spec: &TokenizerSpec) -> String {
    match spec {
        TokenizerSpec::Char { chars } => {
            format!("a character vocabulary of {}", chars.chars().count())
        }
        TokenizerSpec::Gpt2 => "GPT-2 BPE".into(),
        TokenizerSpec::WordPiece {
            tokens, normalizer, ..
        } => match normalizer.is_uncased() {
            true => format!("a WordPiece vocabulary of {tokens}"),
            false => format!(
                "a WordPiece vocabulary of {tokens} ({})",
                normalizer.describe()
            ),
        },
    }
}

/// Two tokenizers that differ, each described so that the difference
/// shows: where [`describe`] says the same of both, what inside them
/// differs is added (a vocabulary's checksum, a character one has and the
/// other lacks), so a refusal never reads "400 vs 400".
pub fn describe_apart(a: &TokenizerSpec, b: &TokenizerSpec) -> [String; 2] {
    let (da, db) = (describe(a), describe(b));
    if da != db {
        return [da, db];
    }
    match (a, b) {
        (
            TokenizerSpec::WordPiece { checksum: ca, .. },
            TokenizerSpec::WordPiece { checksum: cb, .. },
        ) => [
            format!("{da}, checksum {ca}"),
            format!("{db}, checksum {cb}"),
        ],
        (TokenizerSpec::Char { chars: ca }, TokenizerSpec::Char { chars: cb }) => {
            let side = |d: &str, ours: &str, theirs: &str| match ours
                .chars()
                .find(|&c| !theirs.contains(c))
            {
                Some(c) => format!("{d}, {c:?} among them"),
                None => format!("{d}, in another order"),
            };
            [side(&da, ca, cb), side(&db, cb, ca)]
        }
        _ => [da, db],
    }
}

/// The largest vocabulary a dataset can hold: token ids are u16.
pub const MAX_VOCAB: usize = 1 << 16;

impl Dataset {
    /// Refuses `--tokenizer asked` where the shard folder `dir` this was
    /// read from holds another tokenizer's tokens (its tokenizer.json, or
    /// GPT-2 BPE without one, as llm.c writes them).
    pub fn refuse_other_tokenizer(&self, dir: &Path, asked: TokenizerKind) -> Result<()> {
        let theirs = self.tokenizer.spec();
        let same = matches!(
            (asked, &theirs),
            (TokenizerKind::Char, TokenizerSpec::Char { .. })
                | (TokenizerKind::Gpt2, TokenizerSpec::Gpt2)
        );
        if same {
            return Ok(());
        }
        let how = match dir.join("tokenizer.json").exists() {
            true => "its tokenizer.json",
            false => "no tokenizer.json: GPT-2 BPE tokens, as llm.c writes them",
        };
        Err(Error::Config(format!(
            "--tokenizer {}: {} holds shards of {} ({how}); shards keep the tokenizer they were prepared with: leave --tokenizer out, or prepare the text again with `data prepare --tokenizer {}`",
            asked.key(),
            dir.display(),
            describe(&theirs),
            asked.key()
        )))
    }

    /// `source` is `None` for the embedded corpus, a text file, or a
    /// directory of `<name>_train[_<n>].bin` / `<name>_val[_<n>].bin` shards (with `tokenizer.json`
    /// from `distgpt data prepare`; without it, GPT-2 tokens as llm.c writes).
    pub fn load(source: Option<&Path>, kind: TokenizerKind) -> Result<Self> {
        if let Some(dir) = source.filter(|p| p.is_dir()) {
            return Self::from_shards(dir);
        }
        let text = read_text(source)?;
        let tokenizer = match kind {
            TokenizerKind::Char => Tokenizer::char_from_corpus(&text),
            TokenizerKind::Gpt2 => Tokenizer::from_spec(&TokenizerSpec::Gpt2)?,
        };
        Self::encode(source, &text, tokenizer)
    }

    /// Like [`Dataset::load`], but text is encoded with a model's own
    /// tokenizer, and shards must have been made with it.
    pub fn load_for_model(source: Option<&Path>, tokenizer: &TokenizerSpec) -> Result<Self> {
        if let Some(dir) = source.filter(|p| p.is_dir()) {
            return Self::shards_made_with(dir, tokenizer);
        }
        let text = read_text(source)?;
        Self::encode(source, &text, Tokenizer::from_spec(tokenizer)?)
    }

    /// A text encoded with `tokenizer` (None: the embedded corpus), or
    /// shards, which must have been made with it.
    pub fn load_with(source: Option<&Path>, tokenizer: Tokenizer) -> Result<Self> {
        if let Some(dir) = source.filter(|p| p.is_dir()) {
            return Self::shards_made_with(dir, &tokenizer.spec());
        }
        let text = read_text(source)?;
        Self::encode(source, &text, tokenizer)
    }

    /// The shards in `dir`, which must have been made with `tokenizer`.
    fn shards_made_with(dir: &Path, tokenizer: &TokenizerSpec) -> Result<Self> {
        let ds = Self::from_shards(dir)?;
        let theirs = ds.tokenizer.spec();
        if &theirs != tokenizer {
            let [theirs, ours] = describe_apart(&theirs, tokenizer);
            return Err(Error::Input(format!(
                "{}: the shards were tokenized with {theirs}, the model uses {ours}: prepare the data with the model's tokenizer",
                dir.display(),
            )));
        }
        Ok(ds)
    }

    /// `text`, read from `source` (None: the embedded corpus), as tokens.
    fn encode(source: Option<&Path>, text: &str, tokenizer: Tokenizer) -> Result<Self> {
        // shards are named by the file's stem; a refusal names its path
        let name = source.map_or("shakespeare".into(), |p| {
            p.file_stem()
                .map_or("text".into(), |s| s.to_string_lossy().into_owned())
        });
        let shown = source.map_or(name.clone(), |p| p.display().to_string());
        // tokens are held (and written to shards) as u16, as llm.c's format has them
        let vocab = tokenizer.vocab_size();
        if vocab > MAX_VOCAB {
            let instead = match &tokenizer {
                Tokenizer::WordPiece(_) => "a WordPiece vocabulary of at most that many (`data prepare --tokenizer wordpiece --vocab-size`)",
                _ => "--tokenizer gpt2 or a text with fewer distinct characters",
            };
            return Err(Error::Input(format!(
                "{shown} read with a vocabulary of {vocab} tokens; token ids are stored as 16-bit numbers (llm.c's shard format), which hold at most {MAX_VOCAB}: use {instead}"
            )));
        }
        let ids = tokenizer.encode(text)?;
        let tokens: Vec<u16> = ids.iter().map(|&t| t as u16).collect();
        let n_val = (tokens.len() as f64 * VAL_FRACTION) as usize;
        if n_val < MIN_SPLIT_TOKENS {
            return Err(Error::Input(format!(
                "{shown} is {} tokens long: too short to hold out a validation part ({}% of the text, and each part needs at least {MIN_SPLIT_TOKENS} tokens); give a text of at least {} tokens",
                tokens.len(),
                VAL_FRACTION * 100.0,
                (MIN_SPLIT_TOKENS as f64 / VAL_FRACTION).ceil() as usize
            )));
        }
        let (train, val) = tokens.split_at(tokens.len() - n_val);
        Ok(Dataset {
            name,
            tokenizer,
            train: Split {
                parts: vec![Part::Memory(train.to_vec())],
            },
            val: Split {
                parts: vec![Part::Memory(val.to_vec())],
            },
            fingerprint: Default::default(),
        })
    }

    fn from_shards(dir: &Path) -> Result<Self> {
        if dir.join(UNFINISHED).exists() {
            return Err(Error::Input(format!(
                "{}: an unfinished `distgpt data prepare` ({} is there: it was stopped, or ran out of disk, before its tokenizer.json was written); prepare it again with --overwrite",
                dir.display(),
                UNFINISHED
            )));
        }
        let (mut train_files, mut val_files) = (Vec::new(), Vec::new());
        for p in shard_files(dir)? {
            match shard_split(&p) {
                Some("train") => train_files.push(p),
                Some("val") => val_files.push(p),
                _ => {
                    return Err(Error::Input(format!(
                        "{}: a shard's name must say its split as `data prepare` and llm.c \
                         write them, `<name>_train.bin` or `<name>_val.bin`, each optionally \
                         followed by `_<number>`: rename the file or move it out of the folder",
                        p.display()
                    )))
                }
            }
        }
        let named = |key: &str, files: &[PathBuf]| -> Result<Split> {
            let parts = files
                .iter()
                .map(|p| shard::Shard::open(p).map(Part::Mapped))
                .collect::<Result<Vec<_>>>()?;
            if parts.is_empty() && dir.join("labels.json").exists() {
                return Err(Error::Input(format!(
                    "{} is a labelled set (labels.json, train/val/test.jsonl), which a \
                     classifier reads: a language model reads a text file or a directory of \
                     *_train_*.bin / *_val_*.bin token shards",
                    dir.display()
                )));
            }
            if parts.is_empty() {
                return Err(Error::Input(format!(
                    "{}: no <name>_{key}[_<number>].bin shard in this directory",
                    dir.display()
                )));
            }
            Ok(Split { parts })
        };
        // the shards first: a folder of none is said to be so before any note
        let (train, val) = (named("train", &train_files)?, named("val", &val_files)?);
        let spec_path = dir.join("tokenizer.json");
        let spec = if spec_path.exists() {
            let text = crate::store::read_text(&spec_path)?;
            serde_json::from_str(&text).map_err(|e| {
                // a Hugging Face tokenizer.json has a "model"; ours a "kind"
                let hf = serde_json::from_str::<serde_json::Value>(&text)
                    .is_ok_and(|v| v.get("model").is_some());
                Error::Input(match hf {
                    true => format!(
                        "{}: a Hugging Face tokenizer, not the tokenizer.json `distgpt data prepare` writes beside its shards; llm.c's GPT-2 shards need none (move it away)",
                        spec_path.display()
                    ),
                    false => format!("{}: {e}", spec_path.display()),
                })
            })?
        } else {
            // llm.c's shards carry none; `data prepare` always writes one
            crate::errln!(
                "note: {} has no tokenizer.json: its shards are read as GPT-2 BPE ids (llm.c's); \
                 a folder of `data prepare` that lost it needs it back",
                dir.display()
            );
            TokenizerSpec::Gpt2
        };
        let tokenizer = Tokenizer::from_spec_in(&spec, dir).map_err(|e| match (e, &spec) {
            (Error::Input(m), TokenizerSpec::Char { .. }) => {
                Error::Input(format!("{}: {m}", spec_path.display()))
            }
            (e, _) => e,
        })?;
        let vocab = tokenizer.vocab_size() as u32;
        for split in [&train, &val] {
            for part in &split.parts {
                if let Part::Mapped(s) = part {
                    if let Some((i, t)) = s.first_outside(vocab) {
                        return Err(Error::Shard {
                            path: s.path.clone(),
                            reason: format!(
                                "token {t} at position {i} is outside the tokenizer's vocabulary of {vocab} ({})",
                                describe(&tokenizer.spec())
                            ),
                        });
                    }
                }
            }
        }
        let name = dir
            .file_name()
            .map_or("shards".into(), |s| s.to_string_lossy().into_owned());
        Ok(Dataset {
            name,
            tokenizer,
            train,
            val,
            fingerprint: Default::default(),
        })
    }
}

impl Dataset {
    /// A fingerprint of the tokens and the tokenizer, recorded in
    /// checkpoints so a resumed run can tell that its data changed.
    pub fn fingerprint(&self) -> &str {
        self.fingerprint.get_or_init(|| {
            let mut h = TokenHash::new();
            h.bytes(
                serde_json::to_string(&self.tokenizer.spec())
                    .expect("json")
                    .as_bytes(),
            );
            h.split(&self.train);
            h.split(&self.val);
            format!("{:016x}", h.0)
        })
    }
}

/// The text of the embedded corpus or a text file.
fn read_text(source: Option<&Path>) -> Result<std::borrow::Cow<'static, str>> {
    match source {
        None => Ok(SHAKESPEARE.into()),
        Some(p) => {
            // a device or a pipe (/dev/zero) would be read without end
            let text = crate::store::read_text(p)?;
            if text.trim().is_empty() {
                return Err(Error::Input(format!(
                    "{}: the file is empty (or only whitespace): there is nothing to tokenize",
                    p.display()
                )));
            }
            Ok(text.into())
        }
    }
}

/// The split named in a shard's file name, `<name>_<split>.bin` or
/// `<name>_<split>_<number>.bin` as `data prepare` and llm.c write them:
/// the word in that place, never a word that merely contains it (a corpus
/// named `train` or `interval` names no split).
fn shard_split(path: &Path) -> Option<&str> {
    let stem = path.file_stem()?.to_str()?;
    let mut words = stem.rsplit('_');
    let last = words.next()?;
    match !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()) {
        true => words.next(),
        false => Some(last),
    }
}

/// The token shards (`*.bin`) in `dir`, sorted.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    files.sort();
    Ok(files)
}

/// Tokenizes a text (None: the embedded corpus) with `kind` into shards in
/// `out` ([`write_shards`]); returns (train tokens, val tokens).
pub fn prepare(source: Option<&Path>, kind: TokenizerKind, out: &Path) -> Result<(usize, usize)> {
    write_shards(&Dataset::load(source, kind)?, out)
}

/// A WordPiece vocabulary of `size` tokens learned from a text (None: the
/// embedded corpus; [`wordpiece::learn`]).
pub fn learn_wordpiece(source: Option<&Path>, size: usize) -> Result<wordpiece::WordPiece> {
    let text = read_text(source)?;
    wordpiece::learn(&text, size)
}

/// The file a folder of shards holds while `data prepare` writes it.
pub const UNFINISHED: &str = "prepare.unfinished";

/// The most tokens a shard of `data prepare` holds: llm.c's `fineweb.py`
/// writes shards of 10^8 (the format's count is an i32).
pub const SHARD_TOKENS: usize = 100_000_000;

/// Writes `<name>_train_000000.bin` (and `_000001.bin` on, a shard each
/// [`SHARD_TOKENS`]), `<name>_val_000000.bin`, `tokenizer.json` and, for a
/// WordPiece vocabulary, its `vocab.txt` into `out`, each atomically and
/// [`UNFINISHED`] until all are; returns (train tokens, val tokens).
pub fn write_shards(ds: &Dataset, out: &Path) -> Result<(usize, usize)> {
    write_shards_of(ds, out, SHARD_TOKENS)
}

fn write_shards_of(ds: &Dataset, out: &Path, per_shard: usize) -> Result<(usize, usize)> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    // Shards without a tokenizer.json are llm.c's GPT-2 BPE: until the
    // folder is whole, this file says it is not.
    let unfinished = out.join(UNFINISHED);
    let why = "distgpt data prepare is writing this folder\n";
    std::fs::write(&unfinished, why).map_err(|e| Error::io(&unfinished, e))?;
    let mut counts = [0usize; 2];
    for (count, (split, tag)) in counts
        .iter_mut()
        .zip([(&ds.train, "train"), (&ds.val, "val")])
    {
        let mut tokens = split.tokens();
        for k in 0.. {
            let shard: Vec<u32> = tokens.by_ref().take(per_shard).collect();
            if shard.is_empty() && k > 0 {
                break;
            }
            let path = out.join(format!("{}_{tag}_{k:06}.bin", ds.name));
            shard::write_shard(&path, &shard)?;
            *count += shard.len();
        }
    }
    if let Tokenizer::WordPiece(wp) = &ds.tokenizer {
        crate::store::write_atomic(&out.join("vocab.txt"), wp.vocab_text().as_bytes())?;
    }
    crate::store::write_json(&out.join("tokenizer.json"), &ds.tokenizer.spec())?;
    std::fs::remove_file(&unfinished).map_err(|e| Error::io(&unfinished, e))?;
    Ok((counts[0], counts[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_too_short_to_hold_out_validation_tokens_is_refused() {
        let dir = crate::testdir::TestDir::new("short");
        let path = dir.path().join("short.txt");
        for (text, refused) in [
            ("a", true),
            ("abcdefghijklmnopqrs", true),
            ("abcdefghijklmnopqrst", false),
        ] {
            std::fs::write(&path, text).unwrap();
            let ds = Dataset::load(Some(&path), TokenizerKind::Char);
            match ds {
                Err(e) => {
                    assert!(refused, "{text:?}: {e}");
                    assert!(e.to_string().contains("at least 20 tokens"), "{e}");
                }
                Ok(ds) => {
                    assert!(!refused, "{text:?} is refused");
                    assert_eq!(ds.val.len(), 2);
                }
            }
        }
    }

    #[test]
    fn a_vocabulary_past_16_bit_ids_is_refused_not_wrapped() {
        // 70,000 distinct characters: ids up to 69,999 would wrap in u16
        let text: String = (0..70_000u32)
            .filter_map(|i| char::from_u32(0x4E00 + i))
            .collect();
        let dir = crate::testdir::TestDir::new("wide");
        let path = dir.path().join("wide.txt");
        std::fs::write(&path, &text).unwrap();
        let err = Dataset::load(Some(&path), TokenizerKind::Char)
            .err()
            .expect("a vocabulary past u16 is refused");
        assert!(err.to_string().contains("at most 65536"), "{err}");
        assert!(
            err.to_string().contains("fewer distinct characters"),
            "{err}"
        );
        // a WordPiece vocabulary that large (multilingual BERT's 119,547)
        // is told of WordPiece, not of characters
        let words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].map(String::from);
        let tokens = words
            .into_iter()
            .chain((0..65_532).map(|i| format!("w{i}")))
            .collect();
        let wp = wordpiece::WordPiece::new(tokens).unwrap();
        let err = Dataset::load_with(Some(&path), Tokenizer::WordPiece(Box::new(wp)))
            .err()
            .expect("a vocabulary past u16 is refused")
            .to_string();
        assert!(
            err.contains("65537 tokens") && err.contains("a WordPiece vocabulary of at most"),
            "{err}"
        );
    }

    #[test]
    fn a_corpus_splits_the_same_whatever_its_file_is_named() {
        // a name that holds "train" or "val" once put every shard in one split
        let dir = crate::testdir::TestDir::new("split-names");
        let mut counts = Vec::new();
        for name in ["corpus", "train", "interval", "val"] {
            let input = dir.path().join(format!("{name}.txt"));
            std::fs::write(&input, &SHAKESPEARE[..2_000]).unwrap();
            let out = dir.path().join(name);
            let written = prepare(Some(&input), TokenizerKind::Char, &out).unwrap();
            let back = Dataset::load(Some(&out), TokenizerKind::Char).unwrap();
            assert_eq!((back.train.len(), back.val.len()), written, "{name}.txt");
            counts.push(written);
        }
        assert!(counts.iter().all(|&c| c == counts[0]), "{counts:?}");
    }

    #[test]
    fn a_refusal_names_what_differs_between_tokenizers_described_alike() {
        // shards of one WordPiece vocabulary read for a model of another of
        // the same size (two tokens swapped): once "400 ... 400"
        let dir = crate::testdir::TestDir::new("apart");
        let text = dir.path().join("text.txt");
        std::fs::write(&text, &SHAKESPEARE[..5_000]).unwrap();
        let ours = learn_wordpiece(Some(&text), 150).unwrap();
        let mut tokens: Vec<String> = ours.vocab_text().lines().map(String::from).collect();
        tokens.swap(20, 21);
        let theirs = wordpiece::WordPiece::new(tokens).unwrap();
        let sums = [ours.checksum().to_string(), theirs.checksum().to_string()];
        assert_eq!(describe(&ours.spec()), describe(&theirs.spec()));
        let ds = Dataset::load_with(Some(&text), Tokenizer::WordPiece(Box::new(ours))).unwrap();
        let shards = dir.path().join("shards");
        write_shards(&ds, &shards).unwrap();
        let err = Dataset::load_with(Some(&shards), Tokenizer::WordPiece(Box::new(theirs)))
            .err()
            .expect("another vocabulary is refused")
            .to_string();
        assert!(
            err.contains(&sums[0]) && err.contains(&sums[1]),
            "{err} does not name {sums:?}"
        );
        // character vocabularies of as many characters: one each lacks
        let spec = |chars: &str| TokenizerSpec::Char {
            chars: chars.into(),
        };
        let [a, b] = describe_apart(&spec("abc"), &spec("abd"));
        assert!(a.contains("'c'") && b.contains("'d'"), "{a} / {b}");
        let [a, b] = describe_apart(&spec("ab"), &TokenizerSpec::Gpt2);
        assert_eq!((a, b), (describe(&spec("ab")), "GPT-2 BPE".to_string()));
    }

    /// A split longer than a shard holds goes into numbered shards, read
    /// back as the same tokens in the same order (the format's count is an
    /// i32: one shard of a large text was refused after tokenizing it all).
    #[test]
    fn a_split_past_a_shards_size_is_written_in_numbered_shards() {
        let dir = crate::testdir::TestDir::new("many-shards");
        let text = dir.path().join("text.txt");
        std::fs::write(&text, &SHAKESPEARE[..3_000]).unwrap();
        let ds = Dataset::load(Some(&text), TokenizerKind::Char).unwrap();
        let (train, val): (Vec<u32>, Vec<u32>) =
            (ds.train.tokens().collect(), ds.val.tokens().collect());
        let out = dir.path().join("shards");
        // 2,700 train tokens: shards of 1,000, 1,000 and 700; 300 val in one
        assert_eq!(write_shards_of(&ds, &out, 1_000).unwrap(), (2_700, 300));
        let names: Vec<String> = shard_files(&out)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "text_train_000000.bin",
                "text_train_000001.bin",
                "text_train_000002.bin",
                "text_val_000000.bin"
            ]
        );
        let back = Dataset::load(Some(&out), TokenizerKind::Char).unwrap();
        assert_eq!(back.train.tokens().collect::<Vec<_>>(), train);
        assert_eq!(back.val.tokens().collect::<Vec<_>>(), val);
        // a split of exactly a shard's tokens writes no empty shard after it
        let exact = dir.path().join("exact");
        write_shards_of(&ds, &exact, 300).unwrap();
        assert_eq!(shard_files(&exact).unwrap().len(), 9 + 1);
    }

    /// A Hugging Face tokenizer.json beside shards is named as what it is.
    #[test]
    fn a_hugging_face_tokenizer_beside_shards_is_named() {
        let dir = crate::testdir::TestDir::new("hf-tok");
        shard::write_shard(&dir.path().join("x_train_000000.bin"), &[1, 2, 3]).unwrap();
        shard::write_shard(&dir.path().join("x_val_000000.bin"), &[1, 2, 3]).unwrap();
        let tok = dir.path().join("tokenizer.json");
        std::fs::write(&tok, r#"{"version": "1.0", "model": {"type": "BPE"}}"#).unwrap();
        let err = Dataset::load(Some(dir.path()), TokenizerKind::Char)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("a Hugging Face tokenizer"), "{err}");
        std::fs::write(&tok, r#"{"kind": "bpe"}"#).unwrap();
        let err = Dataset::load(Some(dir.path()), TokenizerKind::Char)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("unknown variant") && !err.contains("Hugging Face"),
            "{err}"
        );
    }

    #[test]
    fn a_shard_split_is_the_word_in_its_place_in_the_name() {
        for (name, split) in [
            ("fineweb_train_000001.bin", Some("train")),
            ("fineweb_val_000000.bin", Some("val")),
            ("tiny_shakespeare_val.bin", Some("val")),
            ("TinyStories_train.bin", Some("train")),
            ("val_train_000000.bin", Some("train")),
            ("train_val_000000.bin", Some("val")),
            ("interval_train_000000.bin", Some("train")),
            ("trainval_000000.bin", Some("trainval")),
            ("weights.bin", Some("weights")),
        ] {
            assert_eq!(shard_split(Path::new(name)), split, "{name}");
        }
        let dir = crate::testdir::TestDir::new("split-unnamed");
        shard::write_shard(&dir.path().join("x_train_000000.bin"), &[1, 2, 3]).unwrap();
        shard::write_shard(&dir.path().join("x_val_000000.bin"), &[1, 2, 3]).unwrap();
        shard::write_shard(&dir.path().join("x_valid_000000.bin"), &[1, 2, 3]).unwrap();
        let err = Dataset::load(Some(dir.path()), TokenizerKind::Gpt2)
            .err()
            .expect("a shard that names no split is refused")
            .to_string();
        assert!(err.contains("x_valid_000000.bin"), "{err}");
    }

    #[test]
    fn token_hash_of_tokens_equals_hash_of_their_bytes() {
        let tokens: Vec<u16> = (0..11u16).map(|t| t.wrapping_mul(40_503)).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let (mut a, mut b) = (TokenHash::new(), TokenHash::new());
        a.tokens(&tokens);
        b.bytes(&bytes);
        assert_eq!(a.0, b.0);
        let mut c = TokenHash::new();
        c.tokens(&tokens[1..]);
        assert_ne!(a.0, c.0);
    }

    #[test]
    fn token_hashes_tell_apart_sequences_one_token_apart() {
        // 14 tokens: three whole words of four and two tokens of remainder;
        // every position changed to every one of 40 values gives a hash of
        // its own (a hash that drops bits, or a step, collides at once)
        let base: Vec<u16> = (0..14u16).map(|t| t.wrapping_mul(9_973)).collect();
        let mut seen = std::collections::HashSet::new();
        let mut count = 0;
        for at in 0..base.len() {
            for v in 0..40u16 {
                let mut t = base.clone();
                t[at] = v.wrapping_mul(1_601).wrapping_add(7);
                if t == base && at > 0 {
                    continue;
                }
                let mut h = TokenHash::new();
                h.tokens(&t);
                count += 1;
                seen.insert(h.0);
            }
        }
        assert_eq!(seen.len(), count, "collisions among {count} sequences");
    }
}
