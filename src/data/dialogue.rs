//! Dialogue corpora for BERT: conversations read from the Chit-Chat
//! Challenge's `dataset.json` (PyPI `chitchat-dataset==0.9.0`, MIT: 7,168
//! conversations) or the Cornell Movie-Dialogs corpus's own files
//! (`movie_lines.txt`, `movie_conversations.txt`, ` +++$+++ ` separated,
//! Latin-1), and `prepare`, which writes from them (a) a pretraining text of
//! the training conversations, one utterance a line, and (b) a labelled set
//! of reply prediction: (utterance, the next one) is a reply (1), and
//! (utterance, an utterance of another conversation of the same split) is
//! not (0), one of each per turn, split 80/10/10 **by conversation** (a hash
//! of its id), so no conversation is in two splits.

use super::labelled::{split_of, write_set, Example};
use crate::error::{Error, Result};
use crate::rng::Rng;
use std::path::{Path, PathBuf};

/// A conversation: its id and its utterances in order (a speaker's
/// consecutive messages joined into one).
pub struct Conversation {
    pub id: String,
    pub utterances: Vec<String>,
}

/// The conversations in `input`: a Chit-Chat `dataset.json`, a folder
/// holding one (the unpacked wheel: `chitchat_dataset/dataset.json`), or a
/// folder of Cornell's `movie_lines.txt` and `movie_conversations.txt`.
pub fn read(input: &Path) -> Result<Vec<Conversation>> {
    let chitchat = [
        input.to_path_buf(),
        input.join("dataset.json"),
        input.join("chitchat_dataset/dataset.json"),
    ]
    .into_iter()
    .find(|p| p.is_file() && p.extension().is_some_and(|e| e == "json"));
    if let Some(path) = chitchat {
        return read_chitchat(&path);
    }
    let cornell = |name: &str| -> Option<PathBuf> {
        [
            input.join(name),
            input.join("cornell movie-dialogs corpus").join(name),
        ]
        .into_iter()
        .find(|p| p.is_file())
    };
    if let (Some(lines), Some(convs)) = (
        cornell("movie_lines.txt"),
        cornell("movie_conversations.txt"),
    ) {
        return read_cornell(&lines, &convs);
    }
    Err(Error::Input(format!(
        "{} holds no dialogue corpus: give the unpacked `chitchat-dataset==0.9.0` wheel \
         (its chitchat_dataset/dataset.json) or a folder of Cornell's movie_lines.txt and \
         movie_conversations.txt",
        input.display()
    )))
}

fn read_chitchat(path: &Path) -> Result<Vec<Conversation>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let bad = |what: String| Error::Input(format!("{}: {what}", path.display()));
    let j: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let convs = j
        .as_object()
        .ok_or_else(|| bad("not an object of conversations by id".into()))?;
    let mut out = Vec::with_capacity(convs.len());
    for (id, conv) in convs {
        let turns = conv["messages"]
            .as_array()
            .ok_or_else(|| bad(format!("conversation {id} has no \"messages\" list")))?;
        let utterances = turns
            .iter()
            .map(|turn| {
                let texts: Option<Vec<&str>> = turn
                    .as_array()
                    .map(|ms| ms.iter().filter_map(|m| m["text"].as_str()).collect());
                texts.map(|t| t.join(" ").trim().to_string())
            })
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| {
                bad(format!(
                    "conversation {id}: a turn is not a list of messages"
                ))
            })?;
        out.push(Conversation {
            id: id.clone(),
            utterances: utterances.into_iter().filter(|u| !u.is_empty()).collect(),
        });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// Cornell's files are Latin-1: each byte is the character of that code.
fn latin1(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    Ok(bytes.iter().map(|&b| b as char).collect())
}

const SEP: &str = " +++$+++ ";

fn read_cornell(lines: &Path, convs: &Path) -> Result<Vec<Conversation>> {
    let mut by_id = std::collections::HashMap::new();
    for (i, l) in latin1(lines)?.lines().enumerate() {
        let f: Vec<&str> = l.split(SEP).collect();
        if f.len() != 5 {
            return Err(Error::Input(format!(
                "{} line {}: {} fields, not Cornell's 5 (line id, speaker, movie, name, text)",
                lines.display(),
                i + 1,
                f.len()
            )));
        }
        by_id.insert(f[0].trim().to_string(), f[4].trim().to_string());
    }
    let mut out = Vec::new();
    for (i, l) in latin1(convs)?.lines().enumerate() {
        let f: Vec<&str> = l.split(SEP).collect();
        let bad = |what: &str| Error::Input(format!("{} line {}: {what}", convs.display(), i + 1));
        let list = f
            .get(3)
            .ok_or_else(|| bad("fewer than Cornell's 4 fields"))?;
        let ids: Vec<String> = list
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split(',')
            .map(|s| s.trim().trim_matches('\'').to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let utterances = ids
            .iter()
            .map(|id| {
                by_id
                    .get(id)
                    .cloned()
                    .ok_or_else(|| bad(&format!("line {id} is not in {}", lines.display())))
            })
            .collect::<Result<Vec<String>>>()?;
        out.push(Conversation {
            id: ids.first().cloned().unwrap_or_default(),
            utterances: utterances.into_iter().filter(|u| !u.is_empty()).collect(),
        });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// What `prepare` wrote: conversations and examples per split, and the
/// pretraining text's utterances.
pub struct Prepared {
    pub conversations: [usize; 3],
    pub examples: [usize; 3],
    pub text_lines: usize,
}

/// Writes into `out`: `text.txt` (the training conversations' utterances,
/// one a line, a blank line between conversations), and the reply set:
/// `train.jsonl`, `val.jsonl`, `test.jsonl` (`{"label", "text",
/// "text_pair"}`) and `labels.json` (`other`, `reply`). Negatives are drawn
/// with `seed` from the other conversations of the same split.
pub fn prepare(convs: &[Conversation], out: &Path, seed: u64) -> Result<Prepared> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut splits: [Vec<&Conversation>; 3] = Default::default();
    for c in convs.iter().filter(|c| c.utterances.len() >= 2) {
        splits[split_of(&c.id)].push(c);
    }
    // a non-reply comes from another conversation of the split: two at least
    if splits.iter().any(|s| s.len() < 2) {
        let [a, b, c] = splits.each_ref().map(Vec::len);
        return Err(Error::Input(format!(
            "{a} / {b} / {c} conversations of two utterances or more fall in train / val / \
             test: too few to split by conversation (each split needs two, so a non-reply \
             comes from another conversation)"
        )));
    }
    let mut prepared = Prepared {
        conversations: splits.each_ref().map(Vec::len),
        examples: [0; 3],
        text_lines: 0,
    };
    let mut text = String::new();
    for c in &splits[0] {
        for u in &c.utterances {
            text.push_str(&u.replace('\n', " "));
            text.push('\n');
            prepared.text_lines += 1;
        }
        text.push('\n');
    }
    let path = out.join("text.txt");
    crate::store::write_atomic(&path, text.as_bytes())?;
    let mut rng = Rng::new(seed);
    let mut sets: [Vec<Example>; 3] = Default::default();
    for (split, examples) in splits.iter().zip(&mut sets) {
        for (ci, c) in split.iter().enumerate() {
            for w in c.utterances.windows(2) {
                examples.push(Example {
                    label: 1,
                    text: w[0].clone(),
                    text_pair: Some(w[1].clone()),
                });
                // an utterance of another conversation of this split
                let other = (ci + 1 + rng.below(split.len() - 1)) % split.len();
                let o = &split[other].utterances;
                examples.push(Example {
                    label: 0,
                    text: w[0].clone(),
                    text_pair: Some(o[rng.below(o.len())].clone()),
                });
            }
        }
    }
    prepared.examples = sets.each_ref().map(Vec::len);
    write_set(out, &sets, &["other", "reply"])?;
    Ok(prepared)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Cornell-format sample of `n` conversations of 3 lines each, with
    /// a Latin-1 byte in one line.
    fn cornell(dir: &Path, n: usize) {
        let mut lines = Vec::new();
        let mut convs = Vec::new();
        for c in 0..n {
            let ids: Vec<String> = (0..3).map(|k| format!("L{}", c * 10 + k)).collect();
            for (k, id) in ids.iter().enumerate() {
                let text = format!("conversation {c} line {k}");
                lines.push(format!("{id}{SEP}u{k}{SEP}m{c}{SEP}NAME{SEP}{text}").into_bytes());
            }
            let list: Vec<String> = ids.iter().map(|i| format!("'{i}'")).collect();
            convs.push(format!("u0{SEP}u1{SEP}m{c}{SEP}[{}]", list.join(", ")).into_bytes());
        }
        // "café" in Latin-1
        lines[0] = [
            format!("L0{SEP}u0{SEP}m0{SEP}NAME{SEP}caf").into_bytes(),
            vec![0xE9],
        ]
        .concat();
        let join = |v: Vec<Vec<u8>>| v.join(&b"\n"[..]);
        std::fs::write(dir.join("movie_lines.txt"), join(lines)).unwrap();
        std::fs::write(dir.join("movie_conversations.txt"), join(convs)).unwrap();
    }

    #[test]
    fn cornell_reply_pairs_are_balanced_and_split_by_conversation() {
        let dir = crate::testdir::TestDir::new("cornell");
        cornell(dir.path(), 60);
        let convs = read(dir.path()).unwrap();
        assert_eq!(convs.len(), 60);
        let first = convs.iter().find(|c| c.id == "L0").unwrap();
        assert_eq!(first.utterances[0], "caf\u{e9}");
        let out = dir.path().join("set");
        let p = prepare(&convs, &out, 1).unwrap();
        assert_eq!(p.conversations.iter().sum::<usize>(), 60);
        let set = crate::data::labelled::LabelledSet::load(&out).unwrap();
        assert_eq!(set.labels, ["other", "reply"]);
        // the conversation an utterance comes from
        let conv_of = |u: &str| -> String {
            match u.strip_prefix("conversation ") {
                Some(rest) => rest.split(' ').next().unwrap().to_string(),
                None => "0".into(),
            }
        };
        let mut seen: [std::collections::HashSet<String>; 3] = Default::default();
        for (s, split) in [&set.train, &set.val, &set.test].iter().enumerate() {
            let ex = &split.examples;
            assert_eq!(ex.len(), p.examples[s]);
            // two turns a conversation, a reply and a non-reply each
            let replies = ex.iter().filter(|e| e.label == 1).count();
            assert_eq!(replies * 2, ex.len());
            for e in ex.iter() {
                let (a, b) = (conv_of(&e.text), conv_of(e.text_pair.as_deref().unwrap()));
                assert_eq!(e.label == 1, a == b, "{e:?}");
                seen[s].insert(a);
                seen[s].insert(b);
            }
        }
        for (i, j) in [(0, 1), (0, 2), (1, 2)] {
            assert!(
                seen[i].is_disjoint(&seen[j]),
                "a conversation in two splits"
            );
        }
        // the pretraining text is the training conversations alone
        let text = std::fs::read_to_string(out.join("text.txt")).unwrap();
        assert_eq!(text.lines().filter(|l| !l.is_empty()).count(), p.text_lines);
        assert!(text
            .lines()
            .filter(|l| !l.is_empty())
            .all(|l| seen[0].contains(&conv_of(l))));
        // the same corpus gives the same files
        let again = dir.path().join("again");
        prepare(&read(dir.path()).unwrap(), &again, 1).unwrap();
        for f in ["text.txt", "train.jsonl", "val.jsonl", "test.jsonl"] {
            assert_eq!(
                std::fs::read(out.join(f)).unwrap(),
                std::fs::read(again.join(f)).unwrap(),
                "{f}"
            );
        }
    }

    #[test]
    fn a_chitchat_conversation_joins_a_speakers_messages_into_one_utterance() {
        let dir = crate::testdir::TestDir::new("chitchat");
        let json = r#"{"b": {"messages": [[{"sender": "x", "text": "Hello"}, {"sender": "x", "text": "How are you?"}],
                                          [{"sender": "y", "text": "fine"}]]},
                       "a": {"messages": [[{"sender": "z", "text": "hi"}]]}}"#;
        std::fs::create_dir_all(dir.path().join("chitchat_dataset")).unwrap();
        std::fs::write(dir.path().join("chitchat_dataset/dataset.json"), json).unwrap();
        let convs = read(dir.path()).unwrap();
        assert_eq!(convs[0].id, "a");
        assert_eq!(convs[1].utterances, ["Hello How are you?", "fine"]);
        let err = read(&dir.path().join("nothing")).err().unwrap().to_string();
        assert!(err.contains("holds no dialogue corpus"), "{err}");
        // a split of one conversation has no other to draw a non-reply from
        let few = dir.path().join("few");
        std::fs::create_dir_all(&few).unwrap();
        cornell(&few, 12);
        let err = prepare(&read(&few).unwrap(), &few.join("set"), 1)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("each split needs two"), "{err}");
    }
}
