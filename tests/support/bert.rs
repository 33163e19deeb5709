//! A tiny BERT classifier folder and labelled set for command-line tests
//! (shared by the tests that `#[path]` this file in).

use std::path::{Path, PathBuf};

/// A tiny BERT classifier folder (the parity fixture's 3-label weights with a
/// vocabulary of its 99 ids) and a labelled set of 2 labels, in `dir`.
pub fn tiny_bert_and_labelled_set(dir: &Path) -> (PathBuf, PathBuf) {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bert_tiny/cls");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), model.join(f)).unwrap();
    }
    let mut vocab: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .map(String::from)
        .to_vec();
    vocab.extend(('a'..='z').map(|c| c.to_string()));
    vocab.extend(('a'..='z').map(|c| format!("##{c}")));
    vocab.extend((0..99 - vocab.len()).map(|i| format!("w{i}")));
    std::fs::write(model.join("vocab.txt"), vocab.join("\n")).unwrap();
    let data = dir.join("set");
    std::fs::create_dir_all(&data).unwrap();
    let line = |i: usize| {
        let (label, text) = match i % 2 {
            0 => (0, "good day sir"),
            _ => (1, "buy cheap pills now"),
        };
        format!("{{\"label\":{label},\"text\":\"{text} {i}\"}}\n")
    };
    for (split, n) in [("train", 12), ("val", 4), ("test", 5)] {
        let lines: String = (0..n).map(line).collect();
        std::fs::write(data.join(format!("{split}.jsonl")), lines).unwrap();
    }
    std::fs::write(data.join("labels.json"), r#"["ham","spam"]"#).unwrap();
    (model, data)
}
