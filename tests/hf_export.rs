//! Export to a Hugging Face folder: the committed fixture folder is exactly
//! what distgpt exports for a deterministic model, `transformers` loaded it
//! and computed logits (scripts/check_hf_export.py, run by hand), and distgpt
//! gives the same logits, also after importing the folder back.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::wordpiece::{Normalizer, WordPiece};
use distgpt::data::{Tokenizer, TokenizerSpec};
use distgpt::model::bert::{self, BertConfig, BertHead};
use distgpt::model::gpt2::hf;
use distgpt::model::{Gpt2, GptConfig};
use distgpt::store::checksum;
use safetensors::SafeTensors;
use std::path::PathBuf;

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::load_model;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_export")
}

/// A model whose every parameter is a fixed function of its index.
fn model() -> (Gpt2<Cpu>, TokenizerSpec) {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        block_size: 16,
        vocab_size: 40,
        blocks: Vec::new(),
    };
    let mut m = Gpt2::new(Cpu::new(), cfg).unwrap();
    let mut p: Vec<f32> = (0..m.core.layout.total())
        .map(|i| (((i as u64 * 2_654_435_761) % 1000) as f32 / 1000.0 - 0.5) * 0.2)
        .collect();
    let wte = m.core.layout.wte();
    let real = wte.start + 40 * 32;
    p[real..wte.end].fill(0.0);
    m.set_params(&p).unwrap();
    let chars: String = (0..40u8).map(|i| (b'0' + i) as char).collect();
    (m, TokenizerSpec::Char { chars })
}

fn tokens() -> Vec<u32> {
    (0..16).map(|i| (i * 7 % 40) as u32).collect()
}

#[test]
#[ignore = "writes the fixture; run by hand before scripts/check_hf_export.py"]
fn write_export_fixture() {
    let (m, tk) = model();
    hf::export(&m, &tk, &fixture()).unwrap();
}

#[test]
fn exported_folder_matches_transformers_logits() {
    let (mut m, tk) = model();
    let tmp = scratch("hf-export");
    hf::export(&m, &tk, &tmp).unwrap();
    for f in ["config.json", "model.safetensors"] {
        let (a, b) = (
            std::fs::read(tmp.join(f)).unwrap(),
            std::fs::read(fixture().join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs from the committed export");
    }
    let bytes = std::fs::read(fixture().join("transformers_logits.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let toks = tokens();
    let (mut imported, meta) = load_model(Cpu::new(), &fixture()).unwrap();
    assert_eq!(meta.tokenizer, tk);
    for model in [&mut m, &mut imported] {
        model.forward(&toks, None, 1, toks.len()).unwrap();
        let got: Vec<f32> = (0..toks.len())
            .flat_map(|t| model.logits(0, t).unwrap())
            .collect();
        let err = got
            .iter()
            .zip(&want)
            .fold(0.0f32, |e, (a, b)| e.max((a - b).abs()));
        assert_eq!(got.len(), want.len());
        assert!(err <= 1e-4, "logits differ from transformers' by {err}");
    }
}

/// Texts a tokenizer export is checked on: verse, whitespace of every kind,
/// contractions and numbers (GPT-2's pre-tokenizer splits them), accents,
/// other scripts, emoji with joiners.
const TEXTS: [&str; 6] = [
    "ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "  leading spaces,\ttabs\tand\n\n\nblank lines;   runs   of spaces  \n",
    "don't we'll I'm they're You'VE 1234567 3.14 $5.00 #hash @user (a) [b] {c}",
    "Élan naïve café-goers — «quoted» ¿Qué? Straße",
    "日本語のテキスト Привет, мир! مرحبا नमस्ते",
    "emoji 🦀👍🏽 👨\u{200d}👩\u{200d}👧 and\u{a0}nbsp\u{200b}zero width",
];

/// The tokenizers each kind of GPT-2 export carries: GPT-2's BPE, and a
/// character vocabulary of every character of the texts.
fn tokenizer_kinds() -> [(&'static str, TokenizerSpec); 2] {
    let chars: std::collections::BTreeSet<char> = TEXTS.concat().chars().collect();
    [
        ("gpt2", TokenizerSpec::Gpt2),
        (
            "char",
            TokenizerSpec::Char {
                chars: chars.into_iter().collect(),
            },
        ),
    ]
}

/// The committed WordPiece fixture's vocabulary (528 tokens of many
/// scripts), normalized as BERT uncased or cased.
fn wordpieces() -> [(&'static str, WordPiece); 2] {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wordpiece/vocab.txt");
    let tokens = std::fs::read_to_string(path).unwrap();
    let wp = || WordPiece::new(tokens.lines().map(String::from).collect()).unwrap();
    let cased = Normalizer {
        lowercase: false,
        ..Normalizer::default()
    };
    [("bert", wp()), ("bert-cased", wp().with_normalizer(cased))]
}

/// An export of each kind into `dir/KIND`, through the exporters: a GPT-2
/// of each tokenizer, and a BERT masked LM of each normalizer.
fn export_tokenizers(dir: &std::path::Path) {
    for (kind, wp) in wordpieces() {
        let cfg = BertConfig {
            vocab_size: wp.vocab_size(),
            head: BertHead::Mlm,
            ..BertConfig::preset("bert-tiny").unwrap()
        };
        let params = bert::init_full(&cfg, 1);
        bert::hf::write_folder(&cfg, &params, Some(&wp), &[], &dir.join(kind)).unwrap();
    }
    for (kind, spec) in tokenizer_kinds() {
        let vocab_size = Tokenizer::from_spec(&spec).unwrap().vocab_size();
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 1,
            n_embd: 4,
            block_size: 8,
            vocab_size,
            blocks: Vec::new(),
        };
        let m = Gpt2::new(Cpu::new(), cfg).unwrap();
        hf::export(&m, &spec, &dir.join(kind)).unwrap();
    }
}

#[test]
#[ignore = "writes target/tmp/tokenizer-exports; run by hand before scripts/make_tokenizer_fixture.py"]
fn write_tokenizer_exports() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tokenizer-exports");
    export_tokenizers(&dir);
    std::fs::write(
        dir.join("texts.json"),
        serde_json::to_string(&TEXTS).unwrap(),
    )
    .unwrap();
}

/// `AutoTokenizer.from_pretrained` on an export gives distgpt's own ids:
/// the files exported now are the ones `transformers` loaded to make the
/// fixture (their sums), and its ids over the texts are distgpt's.
#[test]
fn exported_tokenizers_give_transformers_the_same_ids() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_tokenizer/ids.json"),
    )
    .unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        fixture["texts"],
        serde_json::json!(TEXTS),
        "re-make the fixture"
    );
    let tmp = scratch("hf-tokenizers");
    export_tokenizers(&tmp);
    for (kind, spec) in tokenizer_kinds() {
        let want = &fixture["exports"][kind];
        let sums = want["fnv1a"].as_object().unwrap();
        assert!(sums.contains_key("tokenizer.json"), "{kind}: {sums:?}");
        for (name, sum) in sums {
            let bytes = std::fs::read(tmp.join(kind).join(name)).unwrap();
            assert_eq!(
                checksum(&bytes),
                sum.as_str().unwrap(),
                "{kind}/{name} is not the file transformers loaded"
            );
        }
        let tk = Tokenizer::from_spec(&spec).unwrap();
        for (t, ids) in TEXTS.iter().zip(want["ids"].as_array().unwrap()) {
            let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            assert_eq!(tk.encode(t).unwrap(), ids, "{kind}: {t:?}");
        }
    }
    for (kind, wp) in wordpieces() {
        let want = &fixture["exports"][kind];
        for (name, sum) in want["fnv1a"].as_object().unwrap() {
            let bytes = std::fs::read(tmp.join(kind).join(name)).unwrap();
            assert_eq!(checksum(&bytes), sum.as_str().unwrap(), "{kind}/{name}");
        }
        for (t, ids) in TEXTS.iter().zip(want["ids"].as_array().unwrap()) {
            let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            assert_eq!(wp.encode(t), ids, "{kind}: {t:?}");
        }
    }
    // a character vocabulary has no end of text: generate() must not stop
    // at its id 0
    let config = std::fs::read_to_string(tmp.join("char/config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert!(config["eos_token_id"].is_null(), "{config}");
}
