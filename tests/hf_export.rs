//! Export to a Hugging Face folder: the committed fixture folder is exactly
//! what distgpt exports for a deterministic model, `transformers` loaded it
//! and computed logits (scripts/check_hf_export.py, run by hand), and distgpt
//! gives the same logits, also after importing the folder back.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::checkpoint::load_model;
use distgpt::data::TokenizerSpec;
use distgpt::model::gpt2::hf;
use distgpt::model::{Gpt2, GptConfig};
use safetensors::SafeTensors;
use std::path::PathBuf;

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
    let mut p: Vec<f32> = (0..m.layout.total())
        .map(|i| (((i as u64 * 2_654_435_761) % 1000) as f32 / 1000.0 - 0.5) * 0.2)
        .collect();
    let wte = m.layout.wte();
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
