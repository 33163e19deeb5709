//! Bad input gets an error that names the problem: never a panic.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::checkpoint::{read_any_meta, read_model};
use distgpt::data::labelled::LabelledSet;
use distgpt::data::{shard, Dataset, TokenizerKind, TokenizerSpec};
use distgpt::model::files::{read_weights, write_weights};
use distgpt::model::gpt2::hf;
use distgpt::model::{Gpt2, GptConfig};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::save_model;

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
    m.set_params(&read_weights(&m.config.clone().into(), path, sum, None)?)
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

/// A shard folder's character vocabulary that holds a character twice is
/// refused, naming its tokenizer.json: the data's ids are the first copy's,
/// and every text encoded later (`eval --data`, a prompt) took the second,
/// never trained (eval's loss 5.67 where the shards read 3.22).
#[test]
fn a_shard_folders_character_vocabulary_holding_a_character_twice_is_refused() {
    let d = tmp("dup-chars");
    shard::write_shard(&d.join("x_train_000000.bin"), &[1, 2, 3]).unwrap();
    shard::write_shard(&d.join("x_val_000000.bin"), &[1, 2, 3]).unwrap();
    let spec = |chars: &str| {
        let spec = TokenizerSpec::Char {
            chars: chars.into(),
        };
        std::fs::write(
            d.join("tokenizer.json"),
            serde_json::to_string(&spec).unwrap(),
        )
        .unwrap();
        Dataset::load(Some(&d), TokenizerKind::Char).map(|_| ())
    };
    spec("abcd").unwrap();
    let err = spec("abcdab").unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("holds 'a' twice (ids 0 and 4)"),
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

/// The tiny model exported as a Hugging Face GPT-2 folder, its
/// `config.json` then changed by `edit`.
fn hf_folder(name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let d = tmp(name);
    let chars: String = (0..65u8).map(|i| (b'0' + i) as char).collect();
    hf::export(&tiny(), &TokenizerSpec::Char { chars }, &d).unwrap();
    let path = d.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    d
}

/// Positions or layers that pass the parameter-count check but are far
/// more than model.safetensors holds are refused before the model is
/// allocated (a 128 GB allocation aborted the process).
#[test]
fn a_hugging_face_config_larger_than_its_weights_is_refused_before_allocating() {
    for (field, value) in [("n_positions", 1_000_000_000u64), ("n_layer", 5_000_000)] {
        let d = hf_folder(&format!("hf-huge-{field}"), |c| c[field] = value.into());
        let err = read_model(&d).err().unwrap().to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("cannot hold"),
            "{field}: {err}"
        );
    }
}

/// An activation function that is not a string is refused as one that is
/// not gelu_new is (5 ran as gelu_new; `transformers` refuses it too).
#[test]
fn a_hugging_face_activation_that_is_not_a_name_is_refused() {
    let d = hf_folder("hf-activation-type", |c| {
        c["activation_function"] = 5.into()
    });
    let err = read_model(&d).err().unwrap().to_string();
    assert!(
        err.contains("activation_function 5 is not supported"),
        "{err}"
    );
}

/// `path` made a named pipe (a FIFO): opening it to read blocks until a
/// writer comes, which none does.
fn make_fifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a mode
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {}",
        path.display()
    );
}

/// `read` run with a limit: a reader that blocks on a pipe fails the test
/// instead of hanging it.
fn within_20_s<T: Send + 'static>(read: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(read()));
    (rx.recv_timeout(std::time::Duration::from_secs(20))).expect("the read hung on a pipe")
}

/// A pipe (or a device) where a model's, a shard folder's or a labelled
/// set's file belongs is refused by name, not read: opening one blocks for
/// ever (model.json, a Hugging Face config.json, a BERT's weights, a shard,
/// a shard folder's tokenizer.json, a labelled split all hung).
#[test]
fn a_pipe_where_a_file_belongs_is_refused_not_read() {
    let model = tmp("fifo-model");
    save_model(
        &tiny(),
        TokenizerSpec::Char {
            chars: (0..65u8).map(|i| (b'0' + i) as char).collect(),
        },
        &model,
    )
    .unwrap();
    make_fifo(&model.join("model.json"));
    let hf = hf_folder("fifo-hf", |_| {});
    make_fifo(&hf.join("config.json"));
    let shard = tmp("fifo-shard").join("x_train_000001.bin");
    make_fifo(&shard);
    for (file, dir) in [
        (model.join("model.json"), model.clone()),
        (hf.join("config.json"), hf.clone()),
    ] {
        let err = within_20_s(move || read_any_meta(&dir).err().unwrap().to_string());
        let named = format!("{} is not a regular file", file.display());
        assert!(err.contains(&named), "{err}");
    }
    let path = shard.clone();
    let err = within_20_s(move || shard::Shard::open(&path).err().unwrap().to_string());
    assert!(err.contains("is not a regular file"), "{err}");
    let set = tmp("fifo-labelled");
    std::fs::write(set.join("labels.json"), r#"["a","b"]"#).unwrap();
    for split in ["train", "test"] {
        let line = "{\"label\":0,\"text\":\"x\"}\n";
        std::fs::write(set.join(format!("{split}.jsonl")), line).unwrap();
    }
    make_fifo(&set.join("val.jsonl"));
    let err = within_20_s(move || LabelledSet::load(&set).err().unwrap().to_string());
    assert!(err.contains("val.jsonl is not a regular file"), "{err}");
}

/// A header the safetensors crate refuses is told in words naming the file
/// and, where the crate knows it, the tensor: never the crate's variant
/// names (`TensorInvalidInfo`, `InvalidOffset("..")`, `HeaderTooLarge`).
#[test]
fn a_damaged_safetensors_header_is_told_in_words() {
    let d = tmp("st-header");
    let path = d.join("w.safetensors");
    save_weights(&tiny(), &path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let head = std::str::from_utf8(&good[8..8 + n]).unwrap().to_string();
    // the header with `from` changed to `to` (of the same length)
    let edited = |from: &str, to: &str| {
        assert!(head.contains(from) && from.len() == to.len(), "{from}");
        let mut b = good.clone();
        b[8..8 + n].copy_from_slice(head.replacen(from, to, 1).as_bytes());
        b
    };
    let wpe = "\"transformer.wpe.weight\":{\"dtype\":\"F32\",\"shape\":[64,32]";
    let mut too_long = good.clone();
    too_long[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let cases = [
        (
            edited(wpe, &wpe.replace("F32", "F16")),
            "transformer.wpe.weight",
        ),
        (
            edited(wpe, &wpe.replace("[64,32]", "[64,31]")),
            "transformer.wpe.weight",
        ),
        (
            edited("\"data_offsets\":[0,", "\"data_offsets\":[1,"),
            "data_offsets",
        ),
        (edited("\"dtype\":", "\"dtype\";"), "header"),
        (too_long, "header"),
        (good[..good.len() - 4].to_vec(), "truncated"),
        (good[..4].to_vec(), "8 bytes"),
    ];
    for (i, (bytes, says)) in cases.into_iter().enumerate() {
        std::fs::write(&path, bytes).unwrap();
        let err = load_weights(&mut tiny(), &path, None)
            .unwrap_err()
            .to_string();
        let raw = ["Invalid", "Header", "Overflow", "Buffer", "Info"];
        assert!(
            err.contains("w.safetensors")
                && err.contains(says)
                && !raw.iter().any(|r| err.contains(r)),
            "case {i}: {err}"
        );
    }
}

/// A folder with neither model files, a Hugging Face config nor a
/// checkpoint is said to hold no model, by name (not as the OS's error
/// about model.json).
#[test]
fn a_folder_that_holds_no_model_is_told_so() {
    let d = tmp("no-model");
    for err in [read_model(&d).err(), read_any_meta(&d).err()] {
        let err = err.unwrap().to_string();
        assert!(
            err.contains(&d.display().to_string())
                && err.contains("holds no model")
                && !err.contains("os error"),
            "{err}"
        );
    }
}

/// Model files with one of the pair missing are a damaged model, refused
/// by the missing file's name (not read past to a checkpoint).
#[test]
fn model_files_missing_one_of_the_pair_are_refused_by_its_name() {
    let chars: String = (0..65u8).map(|i| (b'0' + i) as char).collect();
    for (gone, kept) in [
        ("model.json", "model.safetensors"),
        ("model.safetensors", "model.json"),
    ] {
        let d = tmp(&format!("half-{gone}"));
        save_model(
            &tiny(),
            TokenizerSpec::Char {
                chars: chars.clone(),
            },
            &d,
        )
        .unwrap();
        std::fs::remove_file(d.join(gone)).unwrap();
        let err = read_model(&d).err().unwrap().to_string();
        assert!(
            err.contains(&format!("{kept} but no {gone}")) && !err.contains("os error"),
            "{err}"
        );
    }
}

/// GPT2Config fields whose other values make `transformers` compute
/// another model than distgpt would are refused, by the field and the
/// value distgpt needs; what `transformers` writes by default is read.
#[test]
fn hugging_face_config_fields_distgpt_cannot_honour_are_refused_by_name() {
    let refused = [
        ("layer_norm_epsilon", json!(-1), "1e-5"),
        ("n_inner", json!(64), "128"),
        ("tie_word_embeddings", json!(false), "true"),
        ("scale_attn_by_inverse_layer_idx", json!(true), "false"),
        ("scale_attn_weights", json!(false), "true"),
    ];
    for (field, value, needs) in refused {
        let d = hf_folder(&format!("hf-{field}"), |c| c[field] = value.clone());
        let err = read_model(&d).err().unwrap().to_string();
        assert!(
            err.contains("config.json")
                && err.contains(field)
                && err.contains(&value.to_string())
                && err.contains(needs),
            "{err}"
        );
    }
    let accepted = [
        ("n_inner", json!(128)),
        ("layer_norm_epsilon", json!(1e-5)),
        ("tie_word_embeddings", json!(true)),
        ("scale_attn_weights", json!(true)),
        ("scale_attn_by_inverse_layer_idx", json!(false)),
    ];
    for (field, value) in accepted {
        let d = hf_folder(&format!("hf-ok-{field}"), |c| c[field] = value);
        read_model(&d).unwrap();
    }
    let d = hf_folder("hf-absent", |c| {
        for field in ["n_inner", "layer_norm_epsilon", "tie_word_embeddings"] {
            c.as_object_mut().unwrap().remove(field);
        }
    });
    read_model(&d).unwrap();
}
