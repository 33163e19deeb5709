//! Bad input gets an error that names the problem: never a panic.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{shard, Dataset, TokenizerKind};
use distgpt::model::files::{read_weights, write_weights};
use distgpt::model::{Gpt2, GptConfig};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = scratch(&format!("bad-{name}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The model's weights as Hugging Face GPT-2 safetensors.
fn save_weights(m: &Gpt2<Cpu>, path: &Path) -> distgpt::error::Result<String> {
    write_weights(&m.config.clone().into(), &m.params_host()?, path, false)
}

/// A safetensors file's weights into `m`.
fn load_weights(m: &mut Gpt2<Cpu>, path: &Path, sum: Option<&str>) -> distgpt::error::Result<()> {
    m.set_params(&read_weights(&m.config.clone().into(), path, sum)?)
}

fn tiny() -> Gpt2<Cpu> {
    let mut m = Gpt2::new(Cpu::new(), GptConfig::preset("tiny").unwrap()).unwrap();
    m.init_weights(0).unwrap();
    m
}

#[test]
fn missing_data_file_is_named() {
    let err = Dataset::load(
        Some(&PathBuf::from("/no/such/corpus.txt")),
        TokenizerKind::Char,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("/no/such/corpus.txt"), "{err}");
}

#[test]
fn a_data_path_that_is_no_regular_file_is_refused_not_read() {
    // /dev/zero would be read until memory ran out; /dev/null is as much a device
    let err = Dataset::load(Some(Path::new("/dev/null")), TokenizerKind::Char)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("/dev/null is not a regular file"), "{err}");
}

#[test]
fn a_text_too_short_is_named_by_its_path() {
    let path = tmp("short").join("one.txt");
    std::fs::write(&path, "a").unwrap();
    let err = Dataset::load(Some(&path), TokenizerKind::Char)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.starts_with(&format!("bad input: {} is 1 tokens long", path.display())),
        "{err}"
    );
}

#[test]
fn an_empty_prompt_is_told_the_block_size_as_its_limit() {
    let sc = distgpt::sample::SampleConfig {
        max_new_tokens: 30,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let generate = distgpt::model::gpt2::generate::generate;
    let err = generate(&tiny(), &[vec![]], &sc, None, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("has 0 tokens; it needs 1 to 64"), "{err}");
}

#[test]
fn shard_directory_with_bad_magic_is_refused() {
    let d = tmp("magic");
    shard::write_shard(&d.join("x_train_000000.bin"), &[1, 2, 3]).unwrap();
    shard::write_shard(&d.join("x_val_000000.bin"), &[1, 2, 3]).unwrap();
    let p = d.join("x_val_000000.bin");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[..4].copy_from_slice(&7i32.to_le_bytes());
    std::fs::write(&p, bytes).unwrap();
    let err = Dataset::load(Some(&d), TokenizerKind::Gpt2)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("x_val_000000.bin") && err.contains("magic number 7"),
        "{err}"
    );
}

#[test]
fn safetensors_with_missing_or_misshaped_tensor_is_refused_by_name() {
    let d = tmp("st");
    let m = tiny();
    let path = d.join("w.safetensors");
    save_weights(&m, &path).unwrap();

    let mut other = GptConfig::preset("tiny").unwrap();
    other.n_layer = 3;
    let mut deeper = Gpt2::new(Cpu::new(), other).unwrap();
    let err = load_weights(&mut deeper, &path, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing tensor 'transformer.h.2.ln_1.weight'")
            && err.contains("w.safetensors"),
        "{err}"
    );

    let mut other = GptConfig::preset("tiny").unwrap();
    other.n_embd = 64;
    let mut wider = Gpt2::new(Cpu::new(), other).unwrap();
    let err = load_weights(&mut wider, &path, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("transformer.wte.weight") && err.contains("shape [65, 32], expected [65, 64]"),
        "{err}"
    );

    std::fs::write(&path, b"not a safetensors file").unwrap();
    let err = load_weights(&mut tiny(), &path, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a valid safetensors file"), "{err}");
}

#[test]
fn impossible_shapes_and_inputs_are_refused() {
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.n_head = 5;
    let err = Gpt2::new(Cpu::new(), cfg).err().unwrap().to_string();
    assert!(
        err.contains("n_embd (32) must be divisible by n_head (5)"),
        "{err}"
    );

    let mut m = tiny();
    let t = m.config.block_size + 1;
    let err = m.forward(&vec![0; t], None, 1, t).unwrap_err().to_string();
    assert!(
        err.contains("sequence length 65") && err.contains("block size 64"),
        "{err}"
    );
    let err = m.forward(&[0, 1, 99], None, 1, 3).unwrap_err().to_string();
    assert!(err.contains("token id 99 at position 2"), "{err}");
    let err = m.forward(&[0, 1, 2], None, 2, 3).unwrap_err().to_string();
    assert!(err.contains("3 tokens for a batch of 2 x 3"), "{err}");
}
